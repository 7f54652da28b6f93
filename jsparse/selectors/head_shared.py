"""head_shared: TokenSelect-style soft voting, one token set per layer (MATH.md §2.7)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jsparse.selectors.base import HIGHEST, ProjectedSelector, register, top_budget
from jsparse.selectors.jssa import JSSASelector

__all__ = ["HeadSharedSelector"]


@register
@dataclasses.dataclass(frozen=True)
class HeadSharedSelector(ProjectedSelector):
    """Every query head votes with the softmax of its own scores; votes are summed over
    all heads of the layer and the top-``budget`` tokens serve every KV head.

    This is the paper's App. E.3 ablation of selection granularity: the same JSSA
    projected scores (``basis="jssa"``, each query head projected by its KV head's basis)
    but one shared set instead of one set per KV head. ``basis="full"`` votes with the
    full-dimensional scores instead (no calibration, no extra cache). The softmax uses the
    model's scale ``1/sqrt(D)``. Output keeps the ``[B, Hkv, budget]`` shape, the same
    row for every KV head.
    """

    basis: str = "jssa"
    normalize: bool = True

    name: ClassVar[str] = "head_shared"

    def __post_init__(self):
        super().__post_init__()
        if self.basis not in ("jssa", "full"):
            raise ValueError(f"head_shared: basis must be 'jssa' or 'full', got {self.basis!r}")

    def _jssa(self) -> JSSASelector:
        return JSSASelector(rank=self.rank, cache_dtype=self.cache_dtype, normalize=self.normalize)

    def calibrate_from_moments(self, moments):
        if self.basis == "full":
            return {}
        return self._jssa().calibrate_from_moments(moments)

    def maps(self, params):
        return params["basis"], params["basis"]

    def _head_dim(self, params):
        return None if self.basis == "full" else super()._head_dim(params)

    def bytes_per_token(self, head_dim: int) -> float:
        return 0.0 if self.basis == "full" else super().bytes_per_token(head_dim)

    @property
    def keeps_projection(self) -> bool:
        return self.basis != "full"  # "full" votes with the keys themselves

    def scores(self, params, q, k, lengths):
        b, _, hkv, d = k.shape
        qh = q.astype(jnp.float32).reshape(b, hkv, -1, d)  # [B, Hkv, G, D]
        if self.basis == "full":
            logits = jnp.einsum("bhgd,bshd->bhgs", qh, k.astype(jnp.float32), precision=HIGHEST)
            return _votes(logits, lengths, d)
        return self._projected_votes(params, q, self.project_keys(params, k), lengths)

    def _projected_votes(self, params, q, cache, lengths):
        b, _, hkv, _ = cache.values.shape
        d = q.shape[-1]
        qh = q.astype(jnp.float32).reshape(b, hkv, -1, d)  # [B, Hkv, G, D]
        qp = jnp.einsum("bhgd,hrd->bhgr", qh, params["basis"], precision=HIGHEST)
        logits = jnp.einsum(
            "bhgr,bshr->bhgs", qp, cache.values.astype(jnp.float32), precision=HIGHEST
        )
        return _votes(logits * cache.scale[:, :, None, None], lengths, d)

    def select_projected(self, params, q, cache, lengths, budget, *, ordered=True):
        """The shared vote from a projected cache (``basis="jssa"`` only: ``"full"``
        votes with the keys themselves and keeps no cache)."""
        if self.basis == "full":
            raise NotImplementedError(
                "head_shared(basis='full') keeps no projected cache; use select(params, q, k, "
                "lengths, budget)"
            )
        self.check_step_inputs(params, q, cache, lengths, budget)
        votes = self._projected_votes(params, q, cache, lengths)
        return top_budget(votes, lengths, budget, ordered=ordered)


def _votes(logits, lengths, d):
    """Softmax votes of every query head summed per token, the same row for each KV head."""
    b, hkv, _, s = logits.shape
    visible = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    logits = jnp.where(visible[:, None, None, :], logits / math.sqrt(d), -jnp.inf)
    votes = jax.nn.softmax(logits, axis=-1).sum(axis=(1, 2))  # [B, S]
    return jnp.broadcast_to(votes[:, None, :], (b, hkv, s))
