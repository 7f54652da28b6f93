"""Streaming second moments of group-mean queries and keys (MATH.md §2.2).

JSSA, Loki, FASA and KQ-SVD all calibrate from the same four statistics per
(layer, KV head): the uncentred second moments ``G_Q = E[q̄ q̄ᵀ]`` and ``G_K = E[k kᵀ]``
and the means ``E[q̄]``, ``E[k]``. They are sums over tokens, so calibration streams: the
state below is a pytree of running sums that :func:`update_moments` grows one chunk at a
time (jit-compiled, fixed shapes, optional mask for padded chunks) and
:func:`finalize_moments` turns into expectations. Nothing of the activations is kept.

Leading axes are free: a state built with ``batch_shape=(L,)`` accumulates all layers of a
model at once from ``q [L, N, H, D]``, ``k [L, N, Hkv, D]``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jsparse import _checks

__all__ = [
    "MomentState",
    "Moments",
    "compute_moments",
    "finalize_moments",
    "group_mean_queries",
    "init_moments",
    "normalize_trace",
    "update_moments",
]

_HIGHEST = jax.lax.Precision.HIGHEST


class MomentState(NamedTuple):
    """Running sums over calibration tokens (a jit-able pytree).

    ``*L`` is any leading batch shape (for example one axis for layers).
    """

    gram_q: Float[Array, "*L Hkv D D"]  # Σ q̄ q̄ᵀ
    gram_k: Float[Array, "*L Hkv D D"]  # Σ k kᵀ
    sum_q: Float[Array, "*L Hkv D"]  # Σ q̄
    sum_k: Float[Array, "*L Hkv D"]  # Σ k
    count: Float[Array, "*L"]  # tokens seen (f32 is exact up to 2**24 tokens per update)


class Moments(NamedTuple):
    """Finalized calibration statistics of one or more layers."""

    gram_q: Float[Array, "*L Hkv D D"]  # G_Q = E[q̄ q̄ᵀ], uncentred
    gram_k: Float[Array, "*L Hkv D D"]  # G_K = E[k kᵀ], uncentred
    mean_q: Float[Array, "*L Hkv D"]  # E[q̄]
    mean_k: Float[Array, "*L Hkv D"]  # E[k]
    n_tokens: Float[Array, "*L"]

    @property
    def cov_k(self) -> Float[Array, "*L Hkv D D"]:
        """Centred key covariance ``G_K - E[k] E[k]ᵀ`` (what key PCA diagonalises)."""
        return self.gram_k - self.mean_k[..., :, None] * self.mean_k[..., None, :]

    @property
    def cov_q(self) -> Float[Array, "*L Hkv D D"]:
        """Centred group-mean query covariance."""
        return self.gram_q - self.mean_q[..., :, None] * self.mean_q[..., None, :]

    def layer(self, index: int) -> Moments:
        """The statistics of one entry of the leading axis (for example one layer)."""
        return Moments(*(x[index] for x in self))


def init_moments(n_kv_heads: int, head_dim: int, batch_shape: tuple[int, ...] = ()) -> MomentState:
    """An empty accumulator for ``n_kv_heads`` KV heads of dimension ``head_dim``."""
    n_kv_heads = _checks.check_int("n_kv_heads", n_kv_heads, 1)
    head_dim = _checks.check_int("head_dim", head_dim, 1)
    batch_shape = tuple(_checks.check_int("batch_shape", n, 0) for n in batch_shape)
    shape = (*batch_shape, n_kv_heads)
    f32 = jnp.float32
    return MomentState(
        gram_q=jnp.zeros((*shape, head_dim, head_dim), f32),
        gram_k=jnp.zeros((*shape, head_dim, head_dim), f32),
        sum_q=jnp.zeros((*shape, head_dim), f32),
        sum_k=jnp.zeros((*shape, head_dim), f32),
        count=jnp.zeros(batch_shape, f32),
    )


def group_mean_queries(q: Float[Array, "*N H D"], n_kv_heads: int) -> Float[Array, "*N Hkv D"]:
    """``q̄ = (1/G) Σ_g q_g`` over the G query heads that share each KV head.

    Query head ``h`` reads KV head ``h // G`` (the usual grouped-query layout, where the
    KV heads are repeated ``G`` times consecutively).
    """
    n_kv_heads = _checks.check_int("n_kv_heads", n_kv_heads, 1)
    n_heads = q.shape[-2]
    if n_heads % n_kv_heads:
        raise ValueError(
            f"group_mean_queries: {n_heads} query heads (q.shape={tuple(q.shape)}) are not a "
            f"multiple of {n_kv_heads} KV heads"
        )
    g = n_heads // n_kv_heads
    q = q.astype(jnp.float32)
    return q.reshape(*q.shape[:-2], n_kv_heads, g, q.shape[-1]).mean(axis=-2)


def normalize_trace(gram: Float[Array, "*L D D"]) -> Float[Array, "*L D D"]:
    """``G̃ = G / tr(G)`` (unit trace; a zero matrix stays zero)."""
    # XLA divides by multiplying with the reciprocal, which flushes to 0 past a trace of
    # ~8.5e37 (every entry came out 0), and a trace can overflow to inf: a Gram matrix
    # with a diagonal entry past 2^90 is first scaled by 2^-64, exactly.
    gram = jnp.asarray(gram)  # (a NumPy f64 input: its dtype is jax's, not NumPy's)
    diagonal = jnp.diagonal(gram, axis1=-2, axis2=-1)[..., None]
    shrink = jnp.where(jnp.max(diagonal, axis=-2, keepdims=True) > 2.0**90, 2.0**-64, 1.0)
    gram = gram * shrink.astype(gram.dtype)
    tr = jnp.trace(gram, axis1=-2, axis2=-1)[..., None, None]
    return jnp.where(tr > 0, gram / jnp.where(tr > 0, tr, 1.0), 0.0)


def _check_update_inputs(state: MomentState, q, k, mask) -> None:
    n_kv, d = state.sum_k.shape[-2:]
    lead = state.count.shape
    _checks.check_rank("q", q, len(lead) + 3, f"[*L={lead}, N, H, D]")
    _checks.check_rank("k", k, len(lead) + 3, f"[*L={lead}, N, Hkv, D]")
    _checks.check_floating("q", q)
    _checks.check_floating("k", k)
    if tuple(q.shape[: len(lead)]) != lead or tuple(k.shape[: len(lead)]) != lead:
        raise ValueError(
            f"update_moments: leading axes of q {tuple(q.shape)} / k {tuple(k.shape)} must be "
            f"the state's batch shape {lead}"
        )
    _checks.check_dim("k", k, -2, n_kv, "KV heads of the state")
    _checks.check_dim("k", k, -1, d, "head_dim of the state")
    _checks.check_dim("q", q, -1, d, "head_dim of the state")
    _checks.check_dim("q", q, -3, k.shape[-3], "tokens N, as in k")
    if q.shape[-2] % n_kv:
        raise ValueError(f"q: {q.shape[-2]} query heads are not a multiple of {n_kv} KV heads")
    if mask is not None and tuple(mask.shape) != tuple(k.shape[:-2]):
        raise ValueError(f"mask: expected shape {tuple(k.shape[:-2])}, got {tuple(mask.shape)}")
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask: dtype {mask.dtype}; expected bool (True: a valid token)")


@functools.partial(jax.jit, donate_argnums=(0,))
def _update(state: MomentState, q, k, mask) -> MomentState:
    n_kv = state.sum_k.shape[-2]
    qm = group_mean_queries(q, n_kv)
    k = k.astype(jnp.float32)
    if mask is None:
        count = jnp.full(k.shape[:-3], k.shape[-3], jnp.float32)
    else:  # selected, not multiplied: a masked-out NaN or inf adds nothing
        qm = jnp.where(mask[..., None, None], qm, 0.0)
        k = jnp.where(mask[..., None, None], k, 0.0)
        count = mask.sum(axis=-1, dtype=jnp.float32)
    # Sum over tokens inside one matmul per chunk; f32 with HIGHEST precision (no TF32 on GPU).
    return MomentState(
        gram_q=state.gram_q + jnp.einsum("...nhd,...nhe->...hde", qm, qm, precision=_HIGHEST),
        gram_k=state.gram_k + jnp.einsum("...nhd,...nhe->...hde", k, k, precision=_HIGHEST),
        sum_q=state.sum_q + qm.sum(axis=-3),
        sum_k=state.sum_k + k.sum(axis=-3),
        count=state.count + count,
    )


def update_moments(
    state: MomentState,
    q: Float[Array, "*L N H D"],
    k: Float[Array, "*L N Hkv D"],
    mask: Bool[Array, "*L N"] | None = None,
) -> MomentState:
    """Adds one chunk of post-RoPE queries and keys to the running sums.

    ``mask`` (optional) marks the valid tokens of a padded chunk, so a fixed chunk shape
    compiles once. The input state's buffers are donated: use the returned state.
    """
    mask = None if mask is None else jnp.asarray(mask)
    _check_update_inputs(state, q, k, mask)
    return _update(state, q, k, mask)


def finalize_moments(state: MomentState) -> Moments:
    """Turns running sums into expectations. Raises if no token was accumulated."""
    count = _checks.concrete(state.count)
    if count is not None and (count <= 0).any():
        raise ValueError("finalize_moments: no calibration token was accumulated (count is 0)")
    _check_finite_sums("queries", state.gram_q, state.sum_q)
    _check_finite_sums("keys", state.gram_k, state.sum_k)
    n = state.count
    return Moments(
        gram_q=state.gram_q / n[..., None, None, None],
        gram_k=state.gram_k / n[..., None, None, None],
        mean_q=state.sum_q / n[..., None, None],
        mean_k=state.sum_k / n[..., None, None],
        n_tokens=n,
    )


def _check_finite_sums(who: str, gram, total) -> None:
    """A non-finite moment would give a basis of NaN, or of arbitrary finite numbers
    (``eigh`` of a NaN matrix): refused when the sums are concrete."""
    gram, total = _checks.concrete(gram), _checks.concrete(total)
    if gram is None or total is None:
        return
    bad = ~(np.isfinite(gram).all(axis=(-2, -1)) & np.isfinite(total).all(axis=-1))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"finalize_moments: the {who}' moments at [*layers, KV head] = {list(at)} are "
            "not finite: a NaN or inf in the calibration "
            f"{who}, or values beyond ~1.8e19 whose squares overflow float32"
        )


def compute_moments(q: Float[Array, "*L N H D"], k: Float[Array, "*L N Hkv D"]) -> Moments:
    """One-shot moments of a single chunk (the non-streaming path)."""
    if k.ndim < 3:
        raise ValueError(f"k: expected [*L, N, Hkv, D], got shape {tuple(k.shape)}")
    state = init_moments(k.shape[-2], k.shape[-1], tuple(k.shape[:-3]))
    return finalize_moments(update_moments(state, q, k))
