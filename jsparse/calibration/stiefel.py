"""Stiefel refinement of a JSSA basis on the exact selection objective (MATH.md §2.3).

``L_sel(M) = tr((I - MᵀM) G̃_Q (I - MᵀM) G̃_K)`` is minimised by Euclidean gradient steps
followed by a QR retraction onto the row-orthonormal Stiefel manifold, ``M ← qf(Mᵀ)ᵀ``
with the signs of ``diag(R)`` made positive. Every (layer, KV head) basis is an
independent problem; all of them run in parallel as one batched program.

The paper uses a fixed step. Here a step that would raise a basis' objective is rejected
and that basis' step size halved, so the objective history is non-increasing by
construction (with a step small enough to never be rejected this is the paper's method).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jsparse import _checks

__all__ = [
    "RefineResult",
    "qr_retraction",
    "refine_basis",
    "selection_objective",
    "subspace_overlap",
]

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def selection_objective(
    basis: Float[Array, "*L R D"], gram_q: Float[Array, "*L D D"], gram_k: Float[Array, "*L D D"]
) -> Float[Array, "*L"]:
    """``tr((I-P) G_Q (I-P) G_K)`` with ``P = MᵀM``: the mean squared score error
    ``E[(q̄ᵀ(I-P)k)²]`` over the product of the query and key distributions."""
    d = basis.shape[-1]
    resid = jnp.eye(d, dtype=jnp.float32) - _mm(jnp.swapaxes(basis, -1, -2), basis)
    a = _mm(_mm(resid, gram_q), resid)
    return jnp.sum(a * jnp.swapaxes(gram_k, -1, -2), axis=(-2, -1))


def qr_retraction(x: Float[Array, "*L R D"]) -> Float[Array, "*L R D"]:
    """Row-orthonormal factor of ``x``: ``qf(xᵀ)ᵀ`` with ``diag(R) > 0``."""
    q, r = jnp.linalg.qr(jnp.swapaxes(x, -1, -2))  # q: [*L, D, R], r: [*L, R, R]
    sign = jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))
    q = q * jnp.where(sign == 0, 1.0, sign)[..., None, :]
    return jnp.swapaxes(q, -1, -2)


def subspace_overlap(a: Float[Array, "*L R D"], b: Float[Array, "*L R D"]) -> Float[Array, "*L"]:
    """``‖M_a M_bᵀ‖_F² / R``: mean squared cosine of the principal angles (1 = same span)."""
    m = _mm(a, jnp.swapaxes(b, -1, -2))
    return jnp.sum(m * m, axis=(-2, -1)) / a.shape[-2]


class RefineResult(NamedTuple):
    basis: Float[Array, "*L R D"]  # refined, row-orthonormal
    history: Float[Array, " steps_plus_one *L"]  # objective before the first step, then after each
    lr: Float[Array, "*L"]  # final per-basis step size (smaller than ``lr`` if steps were rejected)


@functools.partial(jax.jit, static_argnames=("steps", "monotone"))
def _refine(basis, gram_q, gram_k, lr, steps: int, monotone: bool) -> RefineResult:
    objective = functools.partial(selection_objective, gram_q=gram_q, gram_k=gram_k)
    # The bases are independent, so the gradient of the sum is each basis' own gradient.
    grad = jax.grad(lambda m: jnp.sum(objective(m)))

    def step(carry, _):
        m, value, eta = carry
        cand = qr_retraction(m - eta[..., None, None] * grad(m))
        cand_value = objective(cand)
        if monotone:
            accept = cand_value <= value
            m = jnp.where(accept[..., None, None], cand, m)
            value = jnp.where(accept, cand_value, value)
            eta = jnp.where(accept, eta, 0.5 * eta)
        else:
            m, value = cand, cand_value
        return (m, value, eta), value

    m0 = qr_retraction(basis.astype(jnp.float32))
    v0 = objective(m0)
    eta0 = jnp.broadcast_to(jnp.asarray(lr, jnp.float32), v0.shape)
    (m, _, eta), values = jax.lax.scan(step, (m0, v0, eta0), None, length=steps)
    return RefineResult(m, jnp.concatenate([v0[None], values], axis=0), eta)


def refine_basis(
    basis: Float[Array, "*L R D"],
    gram_q: Float[Array, "*L D D"],
    gram_k: Float[Array, "*L D D"],
    *,
    steps: int = 1600,
    lr: float = 0.05,
    monotone: bool = True,
) -> RefineResult:
    """Gradient descent with QR retraction on ``L_sel`` from ``basis``, all bases at once.

    Pass the unit-trace matrices ``G̃_Q, G̃_K`` (as the paper does; any positive rescaling
    of either leaves the minimisers unchanged). ``monotone=False`` is the paper's plain
    fixed-step iteration, which may raise the objective when ``lr`` is too large.
    """
    if basis.ndim < 2 or gram_q.shape[-2:] != (basis.shape[-1],) * 2:
        raise ValueError(
            f"refine_basis: basis {tuple(basis.shape)} must be [*L, R, D] and gram_q "
            f"{tuple(gram_q.shape)} [*L, D, D] with the same D"
        )
    if basis.shape[-2] > basis.shape[-1]:
        raise ValueError(
            f"refine_basis: basis {tuple(basis.shape)} has rank R = {basis.shape[-2]} > "
            f"D = {basis.shape[-1]}; expected at most D orthonormal rows"
        )
    if gram_q.shape != gram_k.shape or gram_q.shape[:-2] != basis.shape[:-2]:
        raise ValueError(
            f"refine_basis: leading shapes differ: basis {tuple(basis.shape)}, "
            f"gram_q {tuple(gram_q.shape)}, gram_k {tuple(gram_k.shape)}"
        )
    steps = _checks.check_int("steps", steps, 0)
    try:
        lr_value = float(lr)
    except (TypeError, ValueError):
        lr_value = math.nan
    if isinstance(lr, bool | str | bytes) or not (math.isfinite(lr_value) and lr_value > 0):
        raise ValueError(f"refine_basis: need a finite lr > 0, got {lr=}")
    return _refine(
        basis, gram_q.astype(jnp.float32), gram_k.astype(jnp.float32), lr, steps, monotone
    )
