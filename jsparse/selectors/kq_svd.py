"""KQ-SVD: the asymmetric rank-r factorisation ``q·k ≈ (A q)·(B k)`` (MATH.md §2.7)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jsparse.calibration.eigenbasis import eigh_or_nan
from jsparse.calibration.moments import Moments
from jsparse.selectors.base import ProjectedSelector, register

__all__ = ["KQSVDSelector", "psd_sqrt"]

_HIGHEST = jax.lax.Precision.HIGHEST


def check_rcond(rcond) -> None:
    """rcond in [0, 1): NaN or ≥ 1 would zero every eigenvalue and the maps with them
    (selection by position)."""
    if isinstance(rcond, bool) or not isinstance(rcond, int | float) or not 0 <= rcond < 1:
        raise ValueError(f"rcond: got {rcond!r}; expected a number in [0, 1)")


def psd_sqrt(gram: jnp.ndarray, rcond: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(G^{1/2}, G^{-1/2})`` of symmetric PSD matrices; eigenvalues below
    ``rcond · λ_max`` count as zero (pseudo-inverse)."""
    values, vectors = eigh_or_nan(0.5 * (gram + jnp.swapaxes(gram, -1, -2)))
    keep = values > rcond * values[..., -1:]
    root = jnp.where(keep, jnp.sqrt(jnp.where(keep, values, 1.0)), 0.0)
    inv_root = jnp.where(keep, 1.0 / jnp.where(keep, root, 1.0), 0.0)

    def rebuild(diag):
        return jnp.matmul(
            vectors * diag[..., None, :], jnp.swapaxes(vectors, -1, -2), precision=_HIGHEST
        )

    return rebuild(root), rebuild(inv_root)  # NaN for a non-finite gram (eigh_or_nan)


@register
@dataclasses.dataclass(frozen=True)
class KQSVDSelector(ProjectedSelector):
    """``A = Σ_r^{1/2} U_rᵀ G_Q^{-1/2}``, ``B = Σ_r^{1/2} V_rᵀ G_K^{-1/2}`` from the SVD
    ``G_Q^{1/2} G_K^{1/2} = U Σ Vᵀ`` (group-mean queries, per KV head).

    ``AᵀB`` is the best rank-r approximation of the identity in the calibrated metric, i.e.
    the exact minimiser of ``E[(q̄ᵀ(I - AᵀB)k)²]`` over all rank-r bilinear scores (Eckart-
    Young), the objective JSSA only bounds for a shared subspace; with ``rcond`` cutting
    small eigenvalues of the moments, within the ranges it keeps. At full rank with
    invertible moments ``AᵀB = I`` and the scores are exact. Only ``B k`` is cached.
    Params: ``{"query_map": A [Hkv, R, D], "key_map": B [Hkv, R, D]}``.
    """

    rcond: float = 1e-6

    name: ClassVar[str] = "kq_svd"

    def __post_init__(self):
        super().__post_init__()
        check_rcond(self.rcond)

    def calibrate_from_moments(self, moments: Moments):
        d = moments.gram_q.shape[-1]
        if self.rank > d:
            raise ValueError(f"kq_svd: rank {self.rank} exceeds head_dim {d}")
        return _fit(moments.gram_q, moments.gram_k, self.rank, self.rcond)

    def maps(self, params):
        return params["query_map"], params["key_map"]


@jax.jit
def _fit_full(gram_q, gram_k, rcond):
    q_root, q_inv = psd_sqrt(gram_q.astype(jnp.float32), rcond)
    k_root, k_inv = psd_sqrt(gram_k.astype(jnp.float32), rcond)
    u, s, vt = jnp.linalg.svd(jnp.matmul(q_root, k_root, precision=_HIGHEST))
    return u, s, vt, q_inv, k_inv


def _fit(gram_q, gram_k, rank, rcond):
    u, s, vt, q_inv, k_inv = _fit_full(gram_q, gram_k, rcond)
    half = jnp.sqrt(s[..., :rank])[..., :, None]  # [Hkv, R, 1]
    a = half * jnp.matmul(jnp.swapaxes(u[..., :, :rank], -1, -2), q_inv, precision=_HIGHEST)
    b = half * jnp.matmul(vt[..., :rank, :], k_inv, precision=_HIGHEST)
    return {"query_map": a, "key_map": b}
