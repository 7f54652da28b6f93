"""Loki: scores in the top-r PCA subspace of the keys (MATH.md §2.7)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jsparse.calibration.eigenbasis import top_eigenvectors
from jsparse.calibration.moments import Moments
from jsparse.selectors.base import ProjectedSelector, register

__all__ = ["LokiSelector"]


@register
@dataclasses.dataclass(frozen=True)
class LokiSelector(ProjectedSelector):
    """``M = TopEig_r(Cov_K)``, the key principal components, applied to q̄ and k alike.

    Loki fits PCA (centred) on calibration keys; ``centered=False`` uses the uncentred
    ``G_K`` instead. Scores are ``(M q̄)·(M k)`` without subtracting the mean: that shifts
    every score of a query by the same amount, so the ranking is the same either way.
    Params: ``{"basis": [Hkv, R, D]}``.
    """

    centered: bool = True

    name: ClassVar[str] = "loki"

    def calibrate_from_moments(self, moments: Moments):
        cov = moments.cov_k if self.centered else moments.gram_k
        basis, _ = top_eigenvectors(cov, self.rank)
        return {"basis": basis}

    def maps(self, params):
        return params["basis"], params["basis"]
