"""Query chunking for large calls.

The Pallas kernels address their [T, row] buffers (dense scores, record rows) with int32
offsets, so one launch must keep ``T · row`` below 2^31: a full causal prefill of 64K
queries over 64K keys does not. Queries are independent, so a large call runs as several
calls over consecutive query chunks and concatenates the per-query results.

A call that has to be split is split into launches of at most 2^30 elements, not at the
int32 limit: the dense scorer compiled for a 32,512 × 65,792 launch took 139 registers a
thread (one 8-warp block per SM) where the same kernel for 16,128 queries took 128 (two
blocks per SM), and the 64K causal prefill ran in 91.2 ms instead of 139.5, same ids
(WORKSPACE.md run 55). A call under the int32 limit stays one launch: at 1.08·2^30
elements (8192 × 128K, 32K causal) the kernel compiles at 128 registers (run 54).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INDEX_LIMIT = 2**31 - 1  # largest int32 offset
SPLIT_LIMIT = 2**30  # elements per launch once a call is split
ALIGN = 256  # chunk sizes stay multiples of every kernel's query block


def queries_per_chunk(num_queries: int, row: int) -> int:
    """Queries per call: all of them if ``num_queries · row ≤ INDEX_LIMIT``, else chunks
    with ``chunk · row ≤ min(SPLIT_LIMIT, INDEX_LIMIT)``."""
    if num_queries * row <= INDEX_LIMIT:
        return num_queries
    return max(ALIGN, min(SPLIT_LIMIT, INDEX_LIMIT) // row // ALIGN * ALIGN)


def over_query_chunks(fn, chunk: int, *per_query):
    """``fn(*per_query)``, run on consecutive chunks of the leading (query) axis.

    Arguments without a leading axis (``None``, scalars, strings) pass through
    unchanged; every output leaf must have the query axis first (it is concatenated
    along it).
    """

    def sliced(a):
        return a is not None and np.ndim(a) > 0

    num = next(np.shape(a)[0] for a in per_query if sliced(a))
    if chunk >= num:
        return fn(*per_query)

    def part(a, i):
        return a[i : i + chunk] if sliced(a) else a

    outs = [fn(*(part(a, i) for a in per_query)) for i in range(0, num, chunk)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)


def key_row(num_keys: int) -> int:
    """Widest per-query buffer row of the indexer kernels for ``num_keys`` keys."""
    return -(-num_keys // ALIGN) * ALIGN + ALIGN


def queries_per_call(num_queries: int, num_keys: int) -> int:
    """Queries per indexer call over ``num_keys`` keys (:func:`queries_per_chunk`)."""
    return queries_per_chunk(num_queries, key_row(num_keys))
