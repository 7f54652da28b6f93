"""A dense test cache scattered into a shuffled page pool, the way the paged tests need it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def shuffled_pages(k_cache, scale, lengths, page_size, *, spare_pages, seed=0):
    """(pool [N, P, D], pool scales [N, P], page table [B, S_max / P]) of a dense cache
    [B, S_max, D]: pages in a shuffled pool with ``spare_pages`` pages of noise (scale 1),
    and the pages at or past each sequence's length left unallocated (-1) in the table.
    The last page's tail past S_max is zeros (past every length)."""
    rng = np.random.default_rng(seed)
    b, s_max, d = k_cache.shape
    m = -(-s_max // page_size)
    n_pages = b * m + spare_pages
    slots = rng.permutation(n_pages)[: b * m].reshape(b, m)
    pool = rng.standard_normal((n_pages, page_size, d)).astype(np.float32)
    pool_scale = np.ones((n_pages, page_size), np.float32)
    pad = m * page_size - s_max
    dense = np.pad(np.asarray(k_cache.astype(jnp.float32)), ((0, 0), (0, pad), (0, 0)))
    dense = dense.reshape(b, m, page_size, d)
    dense_scale = np.pad(np.asarray(scale), ((0, 0), (0, pad)), constant_values=1.0)
    dense_scale = dense_scale.reshape(b, m, page_size)
    table = np.full((b, m), -1, np.int32)
    for row in range(b):
        for i in range(m):
            pool[slots[row, i]], pool_scale[slots[row, i]] = dense[row, i], dense_scale[row, i]
            if i * page_size < lengths[row]:
                table[row, i] = slots[row, i]
    return jnp.asarray(pool, k_cache.dtype), jnp.asarray(pool_scale), jnp.asarray(table)
