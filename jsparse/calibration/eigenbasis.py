"""The closed-form JSSA basis ``M* = TopEig_r(G̃_Q + G̃_K)`` (MATH.md §2.2).

Bases are row-orthonormal ``M ∈ R^{R×D}`` (``M Mᵀ = I_R``), batched over any leading axes
(layers, KV heads). Eigenvectors are returned in descending eigenvalue order with a fixed
sign (the entry of largest magnitude is positive), so the same moments always give the
same basis, bit for bit, on one backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jsparse import _checks
from jsparse.calibration.moments import Moments, normalize_trace

__all__ = ["eigh_or_nan", "jssa_basis", "top_eigenvectors"]


def eigh_or_nan(sym: Float[Array, "*L D D"]) -> tuple[Float[Array, "*L D"], Float[Array, "*L D D"]]:
    """``jnp.linalg.eigh`` (ascending values, vectors as columns), with NaN values and
    vectors for a matrix holding a NaN or inf: eigh may return finite vectors for one
    (a NaN on the diagonal), a basis that would look fine."""
    values, vectors = jnp.linalg.eigh(sym)
    finite = jnp.isfinite(sym).all(axis=(-2, -1))
    return (
        jnp.where(finite[..., None], values, jnp.nan),
        jnp.where(finite[..., None, None], vectors, jnp.nan),
    )


def _fix_signs(rows: Float[Array, "*L R D"]) -> Float[Array, "*L R D"]:
    pivot = jnp.argmax(jnp.abs(rows), axis=-1, keepdims=True)
    sign = jnp.sign(jnp.take_along_axis(rows, pivot, axis=-1))
    return rows * jnp.where(sign == 0, 1.0, sign)


@functools.partial(jax.jit, static_argnames=("rank",))
def top_eigenvectors(
    sym: Float[Array, "*L D D"], rank: int
) -> tuple[Float[Array, "*L R D"], Float[Array, "*L R"]]:
    """Top-``rank`` eigenvectors (as rows) and eigenvalues of symmetric matrices.

    Descending eigenvalue order; signs fixed (largest-magnitude entry of each row > 0).
    A matrix with a NaN or inf entry gives NaN vectors and values.
    """
    d = sym.shape[-1]
    if sym.ndim < 2 or sym.shape[-2] != d:
        raise ValueError(f"top_eigenvectors: sym has shape {tuple(sym.shape)}; expected [*L, D, D]")
    if not _checks.is_int(rank) or not 1 <= rank <= d:
        raise ValueError(f"top_eigenvectors: rank must be in [1, {d}], got {rank}")
    sym = sym.astype(jnp.float32)  # halves before the sum: near f32's largest, no overflow
    sym = 0.5 * sym + 0.5 * jnp.swapaxes(sym, -1, -2)
    values, vectors = eigh_or_nan(sym)  # ascending; vectors are columns
    values = values[..., ::-1][..., :rank]
    rows = jnp.swapaxes(vectors[..., :, ::-1][..., :, :rank], -1, -2)
    return _fix_signs(rows), values


def jssa_basis(
    moments: Moments, rank: int, *, normalize: bool = True
) -> Float[Array, "*L Hkv R D"]:
    """``M* = TopEig_r(G̃_Q + G̃_K)`` per (layer, KV head).

    ``normalize=False`` uses the raw ``G_Q + G_K`` (the ablation of the paper's App. B.2:
    without unit-trace normalisation the larger key moment dominates the sum).
    """
    gq, gk = moments.gram_q, moments.gram_k
    if normalize:
        gq, gk = normalize_trace(gq), normalize_trace(gk)
    basis, _ = top_eigenvectors(gq + gk, rank)
    return basis
