"""Decoding with witness thresholds: identical to ``base`` over a multi-step decode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.certified import indexer_topk_decode

B, S_MAX, H, D, K = 3, 160, 8, 16, 8


def _sequence(seed=0, steps=3):
    rng = np.random.default_rng(seed)
    k_cache = rng.standard_normal((B, S_MAX, D)) + 0.5 * rng.standard_normal(D)
    q0 = rng.standard_normal((B, H, D))
    w0 = rng.standard_normal((B, H)) / np.sqrt(H * D)
    # Temporally coherent queries: each step moves a little.
    qs = [q0 + 0.1 * n * rng.standard_normal((B, H, D)) for n in range(steps)]
    ws = [w0 + 0.01 * n * rng.standard_normal((B, H)) / np.sqrt(H * D) for n in range(steps)]
    lengths0 = np.array([100, 37, 140], np.int32)
    scale = np.exp(rng.uniform(-1, 1, (B, S_MAX)))
    return (
        jnp.asarray(k_cache, jnp.bfloat16),
        jnp.asarray(scale, jnp.float32),
        [jnp.asarray(q, jnp.bfloat16) for q in qs],
        [jnp.asarray(w, jnp.float32) for w in ws],
        lengths0,
    )


def _base(q, w, k_cache, scale, lengths, impl):
    flat = k_cache.reshape(B * S_MAX, D)
    start = jnp.arange(B, dtype=jnp.int32) * S_MAX
    end = start + lengths
    res = jsparse.indexer_topk(
        q, w, flat, K, k_scale=scale.reshape(-1), kv_start=start, kv_end=end,
        implementation=impl,
    )  # fmt: skip
    ids = jnp.where(res.indices >= 0, res.indices - start[:, None], -1)
    return ids, res.scores


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_decode_equals_base_over_steps(impl, request):
    if impl == "triton":
        request.getfixturevalue("interpret")
    k_cache, scale, qs, ws, lengths0 = _sequence()
    witnesses = jnp.full((B, 2 * K), -1, jnp.int32)
    for n, (q, w) in enumerate(zip(qs, ws, strict=True)):
        lengths = jnp.asarray(lengths0 + n, jnp.int32)
        res, witnesses = indexer_topk_decode(
            q, w, k_cache, K, k_scale=scale, lengths=lengths, witnesses=witnesses,
            implementation=impl,
        )  # fmt: skip
        ids, scores = _base(q, w, k_cache, scale, lengths, impl)
        np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(ids))
        np.testing.assert_array_equal(np.asarray(res.scores), np.asarray(scores))
        # New witnesses: distinct visible ids, the Top-K among them, 2K slots.
        wit = np.asarray(witnesses)
        assert wit.shape == (B, 2 * K)
        for row in range(B):
            live = wit[row][wit[row] >= 0]
            assert len(set(live.tolist())) == len(live)
            assert np.all(live < int(lengths[row]))
            top = np.asarray(res.indices)[row]
            assert set(top[top >= 0].tolist()) <= set(live.tolist())
        assert not np.asarray(res.fallback).any()
        if n > 0:
            # Witness thresholds: far fewer records than visible keys.
            assert np.all(np.asarray(res.candidates) < np.asarray(lengths))
            assert np.all(np.isfinite(np.asarray(res.threshold)))


def test_decode_validates_inputs():
    k_cache, _, qs, ws, lengths0 = _sequence(steps=1)
    with pytest.raises(ValueError, match="lengths"):
        indexer_topk_decode(
            qs[0], ws[0], k_cache, K, lengths=jnp.asarray([1, 2, S_MAX + 1], jnp.int32)
        )
    with pytest.raises(ValueError, match="k_cache"):
        indexer_topk_decode(qs[0], ws[0], k_cache[:2], K, lengths=jnp.asarray(lengths0))
