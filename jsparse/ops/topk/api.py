"""Public exact Top-K of dense score rows: :func:`topk`.

The selection half of the indexer's ``base``, for scores computed anywhere: the K best
keys of each row under the library's total order (score descending, then key id
ascending; NaN above +inf, -0 equal to +0), each row restricted to its visible range.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse import _autodiff, _checks, backend
from jsparse.ops.topk.reference import select_topk_reference, visible_key_ids


def topk(
    scores: Float[Array, "T S"],
    top_k: int,
    *,
    kv_start: Int[Array, " T"] | None = None,
    kv_end: Int[Array, " T"] | None = None,
    sorted: bool = True,
    implementation: str | Sequence[str] | None = None,
) -> tuple[Int[Array, "T K"], Float[Array, "T K"]]:
    """Exact Top-K of every row of ``scores``.

    Args:
      scores: [T, S] float32.
      top_k: K ≥ 1.
      kv_start, kv_end: optional [T] int32; row t selects among keys kv_start[t] ≤ i <
        kv_end[t] (default: all S). Checked when concrete; under ``jit`` kv_start is
        clamped to [0, S] and kv_end to [kv_start, S].
      sorted: order each row by score descending, then id ascending (default); False
        returns the same exact set in the implementation's order (the Triton kernels:
        ascending id, except few rows, which come out ordered anyway), saving a sort of
        K entries per row.
      implementation: see :mod:`jsparse.backend` (``"triton"`` or ``"reference"``).

    Returns:
      (indices [T, K] int32, values [T, K] float32); rows with fewer than K visible keys
      are padded with -1 / -inf.
    """
    t, s = _checked_scores(scores)
    # an absent range is one constant entry for every row, not a [T] array that a jit
    # caller would fill with a launch of its own (the kernels read entry t // (T / n))
    start, end = _constant_range(0), _constant_range(s)
    if kv_start is not None or kv_end is not None:
        rows = f"scores {tuple(scores.shape)}"
        given = _checks.check_ranges(kv_start, kv_end, t, s, rows)
        start = start if kv_start is None else given[0]
        end = end if kv_end is None else given[1]
    return _select(scores, start, end, top_k, sorted, implementation)


def topk_prefix(
    scores: Float[Array, "T S"],
    lengths: Int[Array, " B"],
    top_k: int,
    *,
    sorted: bool = True,
    implementation: str | Sequence[str] | None = None,
) -> tuple[Int[Array, "T K"], Float[Array, "T K"]]:
    """:func:`topk` of rows that see a prefix of their keys: B sequences of T / B rows
    each (a decode step's heads), row t selecting among keys ``0 ≤ i < lengths[t // (T /
    B)]``, each length clipped to [0, S]. The same answer as ``topk(scores, top_k,
    kv_end=jnp.repeat(jnp.clip(lengths, 0, S), T // B))``, without the launch that
    builds those ends.
    """
    t, _ = _checked_scores(scores)
    _checks.check_rank("lengths", lengths, 1, "[B]")
    _checks.check_dtype("lengths", lengths, (jnp.int32,))
    b = lengths.shape[0]
    if b == 0 or t % b:
        raise ValueError(
            f"lengths: shape {tuple(lengths.shape)} against scores {tuple(scores.shape)}; "
            "expected B ≥ 1 sequences of T / B rows each (B dividing T ≥ 1)"
        )
    return _select(scores, _constant_range(0), lengths, top_k, sorted, implementation)


def _checked_scores(scores) -> tuple[int, int]:
    """(T, S) of f32 [T, S] score rows with T ≥ 1, else a ValueError naming ``scores``."""
    _checks.check_rank("scores", scores, 2, "[T, S]")
    _checks.check_dtype("scores", scores, (jnp.float32,))
    t, s = scores.shape
    if t == 0:
        raise ValueError(f"scores: shape {tuple(scores.shape)} has no rows; expected T ≥ 1")
    return t, s


def _constant_range(value: int):
    return np.full((1,), value, np.int32)


def _select(scores, start, end, top_k, sort, implementation):
    """Dispatch over validated rows; ``start`` and ``end`` hold one entry per group of
    rows (a [T] range: groups of one)."""
    t, s = scores.shape
    top_k = _checks.check_top_k(top_k)
    _checks.check_bool("sorted", sort)
    if s == 0:  # nothing to select: every slot is padding
        return jnp.full((t, top_k), -1, jnp.int32), jnp.full((t, top_k), -jnp.inf, jnp.float32)

    def select(scores, start, end):
        return backend.dispatch(
            "topk", _implementations(), implementation, scores, start, end, top_k, bool(sort)
        )

    return _autodiff.selection(select, _values_of_ids, lambda out: out, (scores, start, end))


def _values_of_ids(ids, scores, *_):
    """The selected values (-1: -inf): the derivative of a selection (:mod:`jsparse._autodiff`)."""
    return jnp.where(ids >= 0, jnp.take_along_axis(scores, jnp.maximum(ids, 0), axis=1), -jnp.inf)


@functools.cache  # built once: a fresh jax.jit wrapper per call costs ~1 ms of host time
def _implementations():
    from jsparse.ops.indexer import methods  # Pallas imports only when used

    return {
        "triton": backend.jit_per_mode(methods.select_dense, static_argnums=(3, 4)),
        "reference": jax.jit(_reference, static_argnums=(3, 4)),
    }


def _reference(scores, start, end, top_k, sort):
    del sort  # the reference always sorts
    t, s = scores.shape
    start, end = (jnp.repeat(r, t // r.shape[0]) for r in (start, end))  # one per row
    start, end = _checks.clamp_ranges(start, end, s)  # as the kernels read them
    return select_topk_reference(scores, visible_key_ids(start, end, s), top_k)
