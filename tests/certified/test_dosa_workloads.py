"""The named workloads: shapes, dtypes, ranges, and the properties they claim."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.certified import workloads
from jsparse.ops.indexer.prepare import FP8_MAX

T, S, H, D = 8, 256, 8, 32


@pytest.mark.parametrize("name", sorted(workloads.WORKLOADS))
def test_workload_shapes_and_ranges(name):
    wl = workloads.make(name, T, S, heads=H, dim=D, seed=1)
    assert wl.shape == (T, S, H, D)
    assert wl.k.dtype == jnp.float8_e4m3fn and wl.k_scale.shape == (S,)
    assert wl.weights.shape == (T, H) and wl.weights.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(wl.q, np.float32)))
    assert np.all(np.asarray(wl.k_scale) > 0)
    # A prefill chunk ending the context: query t at position S - T + t sees 0 .. itself.
    np.testing.assert_array_equal(np.asarray(wl.kv_end), S - T + np.arange(T) + 1)
    np.testing.assert_array_equal(np.asarray(wl.kv_start), 0)


def test_deepseek_like_signed_weights_and_keys():
    wl = workloads.deepseek_like(T, S, heads=H, dim=D, seed=2, fp8_queries=True)
    w = np.asarray(wl.weights)
    assert (w > 0).any() and (w < 0).any()  # a linear map of x: signed
    assert wl.q.dtype == jnp.float8_e4m3fn
    # FP8 payloads use the e4m3 range: the largest magnitude per key is ~448.
    amax = np.abs(np.asarray(wl.k, np.float32)).max(axis=1)
    assert np.all(amax > 200) and np.all(amax <= FP8_MAX)


def test_from_arrays_quantizes_like_the_key_cache():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((S, D)).astype(np.float32)
    wl = workloads.from_arrays(
        rng.standard_normal((T, H, D)).astype(np.float32),
        rng.standard_normal((T, H)).astype(np.float32),
        k,
        quantize_keys=True,
    )
    back = np.asarray(wl.k, np.float32) * np.asarray(wl.k_scale)[:, None]
    assert np.abs(back - k).max() <= 0.07 * np.abs(k).max()
    assert wl.shape == (T, S, H, D)


def test_make_decode_lengths_and_steps():
    wl = workloads.make_decode("iid", 3, 128, 2, heads=H, dim=D, seed=0)
    assert wl.k_cache.shape == (3, 130, D) and wl.q.shape == (2, 3, H, D)
    q, w, lengths = wl.step(1)
    np.testing.assert_array_equal(np.asarray(lengths), np.asarray(wl.lengths) + 2)
    assert q.shape == (3, H, D) and w.shape == (3, H)


def test_page_cache_holds_the_dense_cache_in_shuffled_pages():
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((3, 50, 8)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (3, 50)), jnp.float32)
    pool, pool_scale, table = workloads.page_cache(k, scale, 16, spare_pages=2)
    assert pool.shape == (3 * 4 + 2, 16, 8) and table.shape == (3, 4)
    assert len(set(np.asarray(table).ravel().tolist())) == 12  # distinct pages
    dense = np.asarray(pool)[np.asarray(table)].reshape(3, 64, 8)[:, :50]
    np.testing.assert_array_equal(dense, np.asarray(k))
    dense_scale = np.asarray(pool_scale)[np.asarray(table)].reshape(3, 64)[:, :50]
    np.testing.assert_array_equal(dense_scale, np.asarray(scale))
    assert not np.array_equal(np.asarray(table).ravel(), np.arange(12))  # shuffled
