"""A dense test cache scattered into a shuffled page pool, the way the paged tests need it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def shuffled_pages(k_cache, scale, lengths, page_size, *, spare_pages, seed=0):
    """(pool [N, P, D], pool scales [N, P], page table [B, S_max / P]) of a dense cache
    [B, S_max, D]: pages in a shuffled pool with ``spare_pages`` pages of noise (scale 1),
    and the pages at or past each sequence's length left unallocated (-1) in the table."""
    rng = np.random.default_rng(seed)
    b, s_max, d = k_cache.shape
    m = s_max // page_size
    n_pages = b * m + spare_pages
    slots = rng.permutation(n_pages)[: b * m].reshape(b, m)
    pool = rng.standard_normal((n_pages, page_size, d)).astype(np.float32)
    pool_scale = np.ones((n_pages, page_size), np.float32)
    dense = np.asarray(k_cache.astype(jnp.float32)).reshape(b, m, page_size, d)
    dense_scale = np.asarray(scale).reshape(b, m, page_size)
    table = np.full((b, m), -1, np.int32)
    for row in range(b):
        for i in range(m):
            pool[slots[row, i]], pool_scale[slots[row, i]] = dense[row, i], dense_scale[row, i]
            if i * page_size < lengths[row]:
                table[row, i] = slots[row, i]
    return jnp.asarray(pool, k_cache.dtype), jnp.asarray(pool_scale), jnp.asarray(table)
