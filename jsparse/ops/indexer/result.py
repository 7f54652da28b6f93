"""The result type of the indexer Top-K methods."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int


@struct.dataclass
class IndexerTopK:
    """Exact Top-K of an indexer, with what the method did to get it.

    Attributes:
      indices: Int32[T, K] key ids, best first (score descending, then id ascending);
        -1 for empty slots.
      scores: Float32[T, K] their scores; -inf for empty slots.
      visible: Int32[T] keys each query could see.
      candidates: Int32[T] scores or records the final selection read per query
        (``dense``/``dosa``: the scored survivors at or above τ, what ``full`` records).
      survivors: Int32[T] keys the main pass scored with every head (all visible keys
        for xla/base/full; the screening survivors for dense/dosa).
      threshold: Float32[T] the seed threshold τ (-inf where none was used).
      fallback: Bool[T] the query was answered by full scoring because the fast path
        could not guarantee exactness (record buffer overflow, non-finite bound).
    """

    indices: Int[Array, "T K"]
    scores: Float[Array, "T K"]
    visible: Int[Array, " T"]
    candidates: Int[Array, " T"]
    survivors: Int[Array, " T"]
    threshold: Float[Array, " T"]
    fallback: Bool[Array, " T"]


def exhaustive_result(indices, scores, visible) -> IndexerTopK:
    """The result of a method that scored every visible key: no threshold, no fallback."""
    t = visible.shape[0]
    return IndexerTopK(
        indices=indices,
        scores=scores,
        visible=visible,
        candidates=visible,
        survivors=visible,
        threshold=jnp.full((t,), -jnp.inf, jnp.float32),
        fallback=jnp.zeros((t,), bool),
    )
