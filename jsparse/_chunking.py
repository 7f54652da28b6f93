"""Query chunking for large calls.

The Pallas kernels address their [T, row] buffers (dense scores, record rows) with int32
offsets, so one launch must keep ``T · row`` below 2^31: a full causal prefill of 64K
queries over 64K keys does not. Queries are independent, so a large call runs as several
calls over consecutive query chunks and concatenates the per-query results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INDEX_LIMIT = 2**31 - 1  # largest int32 offset
ALIGN = 256  # chunk sizes stay multiples of every kernel's query block


def queries_per_chunk(num_queries: int, row: int) -> int:
    """Queries per call so that ``chunk · row ≤ INDEX_LIMIT`` (all of them if they fit)."""
    if num_queries * row <= INDEX_LIMIT:
        return num_queries
    return max(ALIGN, INDEX_LIMIT // row // ALIGN * ALIGN)


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
