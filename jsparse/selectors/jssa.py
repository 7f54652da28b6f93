"""JSSA: a shared calibrated query-key subspace per KV head (MATH.md §2.1-2.3)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jsparse import _checks
from jsparse.calibration.eigenbasis import jssa_basis
from jsparse.calibration.moments import Moments, normalize_trace
from jsparse.calibration.stiefel import refine_basis
from jsparse.selectors.base import ProjectedSelector, register

__all__ = ["JSSASelector"]


@register
@dataclasses.dataclass(frozen=True)
class JSSASelector(ProjectedSelector):
    """Scores ``(M q̄)·(M k)`` with ``M = TopEig_r(G̃_Q + G̃_K)`` per KV head.

    Options: ``rank`` (R), ``cache_dtype``, ``normalize`` (unit-trace normalisation of the
    two moments before summing; the paper's default, App. B.2), ``refine_steps`` /
    ``refine_lr`` (Stiefel refinement on the exact objective from ``M*``, App. B.4; 0 =
    the closed form, as the paper ships). Params: ``{"basis": [Hkv, R, D]}``.
    """

    normalize: bool = True
    refine_steps: int = 0
    refine_lr: float = 0.05

    def __post_init__(self):
        super().__post_init__()
        _checks.check_bool("normalize", self.normalize)
        object.__setattr__(
            self, "refine_steps", _checks.check_int("refine_steps", self.refine_steps, 0)
        )
        lr = self.refine_lr
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < float("inf"):
            raise ValueError(f"refine_lr: expected a positive number, got {lr!r}")

    name: ClassVar[str] = "jssa"

    def calibrate_from_moments(self, moments: Moments):
        basis = jssa_basis(moments, self.rank, normalize=self.normalize)
        if self.refine_steps:
            basis = refine_basis(
                basis,
                normalize_trace(moments.gram_q),
                normalize_trace(moments.gram_k),
                steps=self.refine_steps,
                lr=self.refine_lr,
            ).basis
        return {"basis": basis}

    def maps(self, params):
        return params["basis"], params["basis"]
