"""Exact Top-K under the library's total order, in plain jnp (the selection reference).

Order: score descending (compared through :func:`score_code`, so NaN first and
-0 == +0), then key id ascending. Empty slots (id ``-1``) come last and are returned
as ``-1`` / ``-inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code


def visible_key_ids(
    kv_start: Int[Array, " T"], kv_end: Int[Array, " T"], num_keys: int
) -> Int[Array, "T S"]:
    """Key ids ``0..S-1`` per query, ``-1`` outside ``[kv_start, kv_end)``."""
    ids = jnp.arange(num_keys, dtype=jnp.int32)[None, :]
    visible = (ids >= kv_start[:, None]) & (ids < kv_end[:, None])
    return jnp.where(visible, ids, -1)


def select_topk_reference(
    scores: Float[Array, "T N"], ids: Int[Array, "T N"], top_k: int
) -> tuple[Int[Array, "T K"], Float[Array, "T K"]]:
    """Top ``top_k`` of each row's candidates (``ids == -1`` marks an empty slot).

    Candidate ids must be distinct within a row. Rows with fewer than ``top_k``
    candidates are padded with ``-1`` / ``-inf``.
    """
    codes = jnp.where(ids >= 0, score_code(scores), EMPTY_CODE)
    return select_codes_reference(codes, ids, top_k)


def select_codes_reference(
    codes: Int[Array, "T N"], ids: Int[Array, "T N"], top_k: int
) -> tuple[Int[Array, "T K"], Float[Array, "T K"]]:
    """:func:`select_topk_reference` on precomputed codes (``EMPTY_CODE`` = empty)."""
    n = codes.shape[1]
    if n < top_k:
        pad = ((0, 0), (0, top_k - n))
        codes = jnp.pad(codes, pad, constant_values=EMPTY_CODE)
        ids = jnp.pad(ids, pad, constant_values=-1)
    ids = jnp.where(codes == EMPTY_CODE, jnp.iinfo(jnp.int32).max, ids)
    # ~code reverses the int32 order without overflow; ids break ties ascending.
    neg_codes, sorted_ids = jax.lax.sort((~codes, ids), dimension=1, num_keys=2)
    codes = ~neg_codes[:, :top_k]
    sorted_ids = sorted_ids[:, :top_k]
    empty = codes == EMPTY_CODE
    return jnp.where(empty, -1, sorted_ids), jnp.where(empty, -jnp.inf, code_to_score(codes))
