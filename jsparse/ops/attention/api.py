"""Public indexed decode attention: :func:`indexed_attention`."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse import _checks, backend
from jsparse.ops.attention.reference import indexed_attention_reference

QUERY_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
CACHE_FLOATS = (*QUERY_FLOATS, jnp.float8_e4m3fn)


def indexed_attention(
    q: Float[Array, "B H D"],
    k: Float[Array, "B S Hkv D"],
    v: Float[Array, "B S Hkv Dv"],
    indices: Int[Array, "B Hkv N"],
    *,
    scale: float | None = None,
    k_scale: Float[Array, "B Hkv"] | None = None,
    v_scale: Float[Array, "B Hkv"] | None = None,
    page_table: Int[Array, "B M"] | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
):
    """Decode attention over the K/V rows that each KV head's index list names.

    Query head ``h`` of sequence ``b`` attends rows ``indices[b, h // G]`` of its KV head
    (``G = H / Hkv``), softmax over ``scale · q·k``; the kernel reads those rows where
    they lie in the cache, one pass per KV head for all its G query heads.

    Args:
      q: [B, H, D] float32, bfloat16 or float16: one decode query per sequence.
      k, v: [B, S, Hkv, D] and [B, S, Hkv, Dv], the cache (the model's layout). The same
        dtype as ``q``, or both narrower, widened to ``q``'s dtype on load:
        float8_e4m3fn, or bfloat16 / float16 under an f32 ``q``.
      indices: [B, Hkv, N] int32, entries in [0, S) or -1 (an empty slot), e.g. a
        selector's ``select`` output. An entry listed twice counts twice.
      scale: logit scale (default ``1/sqrt(D)``).
      k_scale, v_scale: optional [B, Hkv] float32 > 0 dequantisation scales of an FP8
        cache (one per sequence and KV head); a cache of another dtype is multiplied by
        them alike.
      page_table: optional [B, M] int32: ``k`` and ``v`` are page pools
        [n_pages, P, Hkv, D] and sequence b's token i is slot ``i % P`` of page
        ``page_table[b, i // P]`` (-1: no page; S = M·P). A listed token on a missing
        page is an error when concrete, and never read when traced.
      return_lse: also return the log-sum-exp of the scaled logits, [B, H] float32.
      implementation: see :mod:`jsparse.backend` (``"triton"`` or ``"reference"``).

    Returns:
      out [B, H, Dv] in ``q``'s dtype (zeros for a query whose list is empty), and with
      ``return_lse`` also lse [B, H] float32 (-inf for an empty list).

    Index and scale values are checked when they are concrete; under ``jit`` an entry
    outside [0, S) is treated as empty (never read), and a scale that is not finite and
    positive goes through as the arithmetic takes it. Only listed rows are read, so a non-finite
    row that no list names changes nothing. A NaN logit (a NaN in q or in a listed key)
    makes its head's output and lse NaN; an inf in a listed value row makes the output
    non-finite, as the arithmetic does.
    """
    _checks.check_rank("q", q, 3, "[B, H, D]")
    _checks.check_rank("k", k, 4, "[B, S, Hkv, D]")
    _checks.check_rank("v", v, 4, "[B, S, Hkv, Dv]")
    _checks.check_rank("indices", indices, 3, "[B, Hkv, N]")
    _checks.check_dtype("q", q, QUERY_FLOATS)
    _checks.check_dtype("k", k, CACHE_FLOATS)
    _checks.check_dtype("v", v, CACHE_FLOATS)
    _checks.check_dtype("indices", indices, (jnp.int32,))
    b, h, d = q.shape
    if d == 0:  # the logits' default scale is 1/sqrt(D)
        raise ValueError(f"q: shape {tuple(q.shape)}; expected a head dimension D >= 1")
    if v.shape[3] == 0:
        raise ValueError(f"v: shape {tuple(v.shape)}; expected a value dimension Dv >= 1")
    hkv = k.shape[2]
    paged = page_table is not None
    if jnp.dtype(k.dtype) != jnp.dtype(v.dtype):
        raise ValueError(
            f"k, v: dtypes {_checks.dtype_name(k.dtype)} and {_checks.dtype_name(v.dtype)}; "
            "expected one cache dtype"
        )
    check_cache_dtype("k", k, q)
    if not paged:
        _checks.check_dim("k", k, 0, b, f"B of q {tuple(q.shape)}")
    _checks.check_dim("k", k, 3, d, f"D of q {tuple(q.shape)}")
    _checks.check_dim("v", v, 0, k.shape[0], f"axis 0 of k {tuple(k.shape)}")
    _checks.check_dim("v", v, 1, k.shape[1], f"axis 1 of k {tuple(k.shape)}")
    s, table = k.shape[1], None
    if paged:
        s, table = check_page_table(page_table, b, k.shape[0], k.shape[1], q.shape)
    _checks.check_dim("v", v, 2, hkv, f"Hkv of k {tuple(k.shape)}")
    _checks.check_dim("indices", indices, 0, b, f"B of q {tuple(q.shape)}")
    _checks.check_dim("indices", indices, 1, hkv, f"Hkv of k {tuple(k.shape)}")
    if hkv == 0 or h % hkv:
        raise ValueError(
            f"q: {h} heads with {hkv} KV heads (k {tuple(k.shape)}); expected H a multiple of Hkv"
        )
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            continue
        _checks.check_rank(name, x, 2, "[B, Hkv]")
        _checks.check_dtype(name, x, (jnp.float32,))
        if x.shape != (b, hkv):
            raise ValueError(f"{name}: shape {tuple(x.shape)}; expected [B, Hkv] = {(b, hkv)}")
        _checks.check_positive_finite(name, x)
    scale = _checks.check_logit_scale(1.0 / math.sqrt(d) if scale is None else scale)
    check_listed(indices, s, table, k.shape[1])
    if 0 in (b, h, s, indices.shape[2], k.shape[0]):  # nothing to attend (no page or row)
        out = jnp.zeros((b, h, v.shape[3]), q.dtype)
        lse = jnp.full((b, h), -jnp.inf, jnp.float32)
    else:
        out, lse = backend.dispatch(
            "indexed_attention", _implementations(), implementation,
            q, k, v, indices, k_scale, v_scale, page_table, scale, differentiable=True,
        )  # fmt: skip
        out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


@functools.cache  # one jit wrapper: a fresh one per call costs host time
def _implementations():
    from jsparse.ops.attention import triton  # Pallas imports only when used

    def run_triton(q, k, v, indices, k_scale, v_scale, page_table, scale):
        return triton.indexed_attention_triton(
            q, k, v, indices, k_scale, v_scale, scale=scale, page_table=page_table
        )

    reference = jax.jit(indexed_attention_reference, static_argnames="scale")

    def run_reference(q, k, v, indices, k_scale, v_scale, page_table, scale):
        return reference(q, k, v, indices, scale=scale, k_scale=k_scale, v_scale=v_scale,
                         page_table=page_table)  # fmt: skip

    return {"triton": run_triton, "reference": run_reference}


def check_cache_dtype(name: str, cache, q) -> None:
    """A decode cache holds ``q``'s dtype or a narrower one that is widened to it on
    load: FP8 under any q, bf16 or f16 under an f32 q."""
    if not widens_to(cache.dtype, q.dtype):
        raise ValueError(
            f"{name}: dtype {_checks.dtype_name(cache.dtype)} with q "
            f"{_checks.dtype_name(q.dtype)}; expected q's dtype, float8_e4m3fn, or "
            "bfloat16 / float16 under an f32 q"
        )


def widens_to(cache_dtype, q_dtype) -> bool:
    """Whether a cache of ``cache_dtype`` is read against a ``q_dtype`` query, widened
    exactly (or is that dtype already)."""
    cache_dtype, q_dtype = jnp.dtype(cache_dtype), jnp.dtype(q_dtype)
    narrow = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return cache_dtype in (q_dtype, jnp.dtype(jnp.float8_e4m3fn)) or (
        q_dtype == jnp.dtype(jnp.float32) and cache_dtype in narrow
    )


def check_page_table(page_table, batch: int, n_pages: int, page_size: int, q_shape):
    """(virtual S = M·P, even for a pool of no pages, whose tables hold only -1; the
    table's values when concrete) after checking a ``[B, M]`` int32 page table whose
    entries are -1 or pages of the pool."""
    _checks.check_rank("page_table", page_table, 2, "[B, max_pages]")
    _checks.check_dtype("page_table", page_table, (jnp.int32,))
    _checks.check_dim("page_table", page_table, 0, batch, f"B of q {tuple(q_shape)}")
    table = _checks.concrete(page_table)
    if table is not None and ((table < -1) | (table >= n_pages)).any():
        at = tuple(int(i) for i in np.argwhere((table < -1) | (table >= n_pages))[0])
        raise ValueError(
            f"page_table: page_table{list(at)} = {table[at]}; expected -1 or a page of "
            f"the pool [0, n_pages = {n_pages})"
        )
    return page_table.shape[1] * page_size, table


def check_listed(indices, s: int, table, page_size: int) -> None:
    """Index lists ``[B, ...]`` (checked when concrete): every entry -1 or in [0, S),
    and, with a page ``table`` (concrete values), none on a page it leaves at -1."""
    ids = _checks.concrete(indices)
    if ids is None:
        return
    bad = (ids < -1) | (ids >= s)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"indices: indices{list(at)} = {ids[at]} is outside [0, S) = [0, {s}) "
            "and not -1 (an empty slot)"
        )
    if table is None or not (ids >= 0).any():  # (an empty table cannot be looked up)
        return
    pages = table[np.arange(ids.shape[0]).reshape(-1, *[1] * (ids.ndim - 1)),
                  np.maximum(ids, 0) // page_size]  # fmt: skip
    missing = (ids >= 0) & (pages < 0)
    if missing.any():
        at = tuple(int(i) for i in np.argwhere(missing)[0])
        raise ValueError(
            f"indices: indices{list(at)} = {ids[at]} lies on page {ids[at] // page_size} "
            f"of sequence {at[0]}, which page_table leaves unallocated (-1)"
        )
