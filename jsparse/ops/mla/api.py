"""Public indexed MLA decode attention: :func:`indexed_mla_attention`."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse import _checks, backend
from jsparse.ops.attention.api import (
    CACHE_FLOATS,
    QUERY_FLOATS,
    check_cache_dtype,
    check_listed,
    check_page_table,
)
from jsparse.ops.mla.reference import indexed_mla_attention_reference


def indexed_mla_attention(
    q: Float[Array, "B H D"],
    cache: Float[Array, "B S D"],
    indices: Int[Array, "B N"],
    *,
    scale: float,
    latent_dim: int = 512,
    cache_scale: Float[Array, " B"] | None = None,
    page_table: Int[Array, "B M"] | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
):
    """Multi-head latent attention (MLA) decoding over the cache rows one list names.

    Every head of sequence ``b`` attends the rows ``indices[b]`` (MLA shares one index
    set per token across heads), softmax over ``scale · q·[c ; k_r]``, and averages the
    latents ``c``; the kernel reads each listed row once for a block of heads, where it
    lies in the cache, and uses its latent part as both key and value.

    Args:
      q: [B, H, D] float32, bfloat16 or float16: the absorbed decode queries
        ``[W_UKᵀ q_nope ; q_rope]``, D = latent_dim + the RoPE dim.
      cache: [B, S, D], each token's latent ``c`` (first ``latent_dim`` values) and
        RoPE key ``k_r``; ``q``'s dtype, or float8_e4m3fn, or bfloat16 / float16 under an
        f32 ``q`` (widened on load). With
        ``page_table``, a page pool [n_pages, P, D].
      indices: [B, N] int32, entries in [0, S) or -1 (an empty slot), e.g. the
        ``[B, 1, budget]`` output of ``make_selector("jssa_mla").select`` reshaped.
      scale: logit scale. No default: with absorbed queries the usual one is
        ``1/sqrt(nope + rope dims of a head)`` (DeepSeek-V3: 1/sqrt(192)), which the
        op cannot infer from D.
      latent_dim: Dc, the latent width (DeepSeek-V2/V3: 512); 1 ≤ Dc ≤ D.
      cache_scale: optional [B] float32 > 0 dequantisation scale of an FP8 cache.
      page_table: optional [B, M] int32: sequence b's token i is row ``i % P`` of page
        ``page_table[b, i // P]`` (-1: no page; S = M·P). A listed token on a missing
        page is an error when concrete, and never read when traced.
      return_lse: also return the log-sum-exp of the scaled logits, [B, H] float32.
      implementation: see :mod:`jsparse.backend` (``"triton"`` or ``"reference"``).

    Returns:
      out [B, H, Dc] in ``q``'s dtype (zeros where the list is empty; ``W_UV`` is
      applied by the caller), and with ``return_lse`` also lse [B, H] float32.

    Index and scale values are checked when concrete; under ``jit`` an entry outside
    [0, S) is treated as empty (never read), and a scale that is not finite and positive
    goes through as the arithmetic takes it. Only listed rows are read; a NaN logit (a NaN in q
    or in a listed row) makes its head's output and lse NaN.
    """
    _checks.check_rank("q", q, 3, "[B, H, D]")
    _checks.check_rank("cache", cache, 3, "[B, S, D]")
    _checks.check_rank("indices", indices, 2, "[B, N]")
    _checks.check_dtype("q", q, QUERY_FLOATS)
    _checks.check_dtype("cache", cache, CACHE_FLOATS)
    _checks.check_dtype("indices", indices, (jnp.int32,))
    b, h, d = q.shape
    paged = page_table is not None
    check_cache_dtype("cache", cache, q)
    if not paged:
        _checks.check_dim("cache", cache, 0, b, f"B of q {tuple(q.shape)}")
    _checks.check_dim("cache", cache, 2, d, f"D of q {tuple(q.shape)}")
    s, table = cache.shape[1], None
    if paged:
        s, table = check_page_table(page_table, b, cache.shape[0], cache.shape[1], q.shape)
    _checks.check_dim("indices", indices, 0, b, f"B of q {tuple(q.shape)}")
    if (
        isinstance(latent_dim, bool)
        or not isinstance(latent_dim, (int, np.integer))
        or not (1 <= latent_dim <= d)
    ):
        raise ValueError(f"latent_dim: got {latent_dim!r}; expected an int in [1, D = {d}]")
    if cache_scale is not None:
        _checks.check_rank("cache_scale", cache_scale, 1, "[B]")
        _checks.check_dtype("cache_scale", cache_scale, (jnp.float32,))
        _checks.check_dim("cache_scale", cache_scale, 0, b, f"B of q {tuple(q.shape)}")
        _checks.check_positive_finite("cache_scale", cache_scale)
    scale = _checks.check_logit_scale(scale)
    check_listed(indices, s, table, cache.shape[1])
    if 0 in (b, h, s, indices.shape[1], cache.shape[0]):  # nothing to attend (no page or row)
        out = jnp.zeros((b, h, int(latent_dim)), q.dtype)
        lse = jnp.full((b, h), -jnp.inf, jnp.float32)
    else:
        out, lse = backend.dispatch(
            "indexed_mla_attention", _implementations(), implementation,
            q, cache, indices, cache_scale, page_table, int(latent_dim), scale,
            differentiable=True,
        )  # fmt: skip
        out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


@functools.cache  # one jit wrapper: a fresh one per call costs host time
def _implementations():
    from jsparse.ops.mla import triton  # Pallas imports only when used

    def run_triton(q, cache, indices, cache_scale, page_table, latent_dim, scale):
        return triton.indexed_mla_attention_triton(
            q, cache, indices, cache_scale, latent_dim=latent_dim, scale=scale,
            page_table=page_table,
        )  # fmt: skip

    reference = jax.jit(indexed_mla_attention_reference, static_argnames=("latent_dim", "scale"))

    def run_reference(q, cache, indices, cache_scale, page_table, latent_dim, scale):
        return reference(q, cache, indices, latent_dim=latent_dim, scale=scale,
                         cache_scale=cache_scale, page_table=page_table)  # fmt: skip

    return {"triton": run_triton, "reference": run_reference}
