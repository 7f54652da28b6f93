"""Decoding with witness thresholds: identical to ``base`` over a multi-step decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.certified import indexer_topk_decode
from jsparse.ops.topk.codes import EMPTY_CODE
from tests.paging import shuffled_pages

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
    # base over the same batch: the decode's scorer tiles, so equal id for id
    res = jsparse.indexer_topk_batch(
        q, w, k_cache, K, k_scale=scale, lengths=lengths, implementation=impl
    )
    return res.indices, res.scores


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
    for bad, message in ((0, "top_k ≥ 1, got 0"), (2.0, "a positive Python int, got 2.0")):
        with pytest.raises(ValueError, match=f"top_k: expected {message}"):
            indexer_topk_decode(qs[0], ws[0], k_cache, bad, lengths=jnp.asarray(lengths0))
    res, _ = indexer_topk_decode(qs[0], ws[0], k_cache, np.int32(K), lengths=jnp.asarray(lengths0))
    assert res.indices.shape == (B, K)  # a numpy integer is an int, as everywhere else
    for bad, message in ((5.5, "a Python int or None, got 5.5"), (0, f"0 < top_k = {K}")):
        with pytest.raises(ValueError, match=f"witness_capacity: (expected )?{message}"):
            indexer_topk_decode(
                qs[0], ws[0], k_cache, K, lengths=jnp.asarray(lengths0), witness_capacity=bad
            )


P = 16  # page size of the paged tests (S_MAX = 10 pages)
# Page sizes against the 64-key decode tile: a quarter of it (the tile's four entries
# as scalars), one that does not divide it (an entry a key) and a whole tile (an entry a
# tile). The seed launch over key lists always reads an entry a key.
PAGE_SIZES = [P, 20, 64]
PAGE_IDS = [f"P{page}" for page in PAGE_SIZES]


def _paged(k_cache, scale, lengths, seed=0, page=P):
    return shuffled_pages(k_cache, scale, lengths, page, spare_pages=5, seed=seed)


@pytest.mark.parametrize("page", PAGE_SIZES, ids=PAGE_IDS)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_paged_decode_equals_dense_decode(impl, page, request):
    # The same keys in a shuffled page pool: every step's ids, scores, records and
    # witnesses equal the dense cache's (the scorer reads each key in its page).
    if impl == "triton":
        request.getfixturevalue("interpret")
    _check_paged_equals_dense(impl, page)


@pytest.mark.gpu
@pytest.mark.parametrize("page", PAGE_SIZES, ids=PAGE_IDS)
def test_gpu_paged_decode_equals_dense_decode(page):
    _check_paged_equals_dense("triton", page)  # compiled


def _check_paged_equals_dense(impl, page):
    k_cache, scale, qs, ws, lengths0 = _sequence(seed=1)
    steps_lengths = [lengths0 + n for n in range(len(qs))]
    pool, pool_scale, table = _paged(k_cache, scale, steps_lengths[-1], page=page)
    dense_wit = paged_wit = jnp.full((B, 2 * K), -1, jnp.int32)
    for q, w, lengths in zip(qs, ws, steps_lengths, strict=True):
        lengths = jnp.asarray(lengths, jnp.int32)
        dense, dense_wit = indexer_topk_decode(
            q, w, k_cache, K, k_scale=scale, lengths=lengths, witnesses=dense_wit,
            implementation=impl,
        )  # fmt: skip
        paged, paged_wit = indexer_topk_decode(
            q, w, pool, K, k_scale=pool_scale, lengths=lengths, witnesses=paged_wit,
            page_table=table, implementation=impl,
        )  # fmt: skip
        for name in ("indices", "scores", "candidates", "threshold", "fallback"):
            np.testing.assert_array_equal(
                np.asarray(getattr(paged, name)), np.asarray(getattr(dense, name)), err_msg=name
            )
        # The Top-K comes first, in its order; the carried seeds after it follow the
        # order their records were written, which split launches do not fix.
        np.testing.assert_array_equal(np.asarray(paged_wit[:, :K]), np.asarray(dense_wit[:, :K]))
        np.testing.assert_array_equal(
            np.sort(np.asarray(paged_wit[:, K:]), axis=1),
            np.sort(np.asarray(dense_wit[:, K:]), axis=1),
        )
        ids, _ = _base(q, w, k_cache, scale, lengths, impl)
        np.testing.assert_array_equal(np.asarray(paged.indices), np.asarray(ids))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_traced_pages_outside_the_pool_are_never_read(impl, request):
    """Under jit: an entry outside [-1, n_pages) is no page; keys on no page are never
    read, and the decode still equals ``base`` over the same table, positions on no page
    below the length included (listed at -inf after every real score)."""
    if impl == "triton":
        request.getfixturevalue("interpret")
    _check_traced_pages(impl)


@pytest.mark.gpu
def test_gpu_traced_pages_outside_the_pool_are_never_read():
    _check_traced_pages("triton")  # compiled: the decode's fallback to base's tiles


def _check_traced_pages(impl):
    k_cache, scale, qs, ws, lengths0 = _sequence(steps=1)
    lengths = jnp.asarray(lengths0, jnp.int32)
    pool, pool_scale, table = shuffled_pages(k_cache, scale, lengths0, 16, spare_pages=2)
    bad = table.at[0, 1].set(pool.shape[0] + 3).at[2, 0].set(-6)
    # Sequence 1 (37 keys) keeps 5 on pages: fewer than K, so 3 positions on no page fill
    # its Top-K, and the records (which cannot hold them) fall back to base's dense scores.
    bad = bad.at[1, 0].set(-1).at[1, 1].set(-1)

    @jax.jit
    def both(t):
        args = dict(k_scale=pool_scale, lengths=lengths, page_table=t, implementation=impl)
        res, _ = indexer_topk_decode(qs[0], ws[0], pool, K, **args)
        return res, jsparse.indexer_topk_batch(qs[0], ws[0], pool, K, **args)

    got, want = both(bad)
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
    np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))
    np.testing.assert_array_equal(np.asarray(got.indices[1, 5:]), [0, 1, 2])
    assert np.isneginf(np.asarray(got.scores[1, 5:])).all()
    np.testing.assert_array_equal(np.asarray(got.fallback), [False, True, False])


def test_paged_decode_validates_the_page_table():
    k_cache, scale, qs, ws, lengths0 = _sequence(steps=1)
    pool, pool_scale, table = _paged(k_cache, scale, lengths0)
    lengths = jnp.asarray(lengths0)
    with pytest.raises(ValueError, match="page_table: sequence 1 has length 37"):
        holed = table.at[1, 1].set(-1)  # position 16..31 of sequence 1 has no page
        indexer_topk_decode(qs[0], ws[0], pool, K, lengths=lengths, page_table=holed)
    with pytest.raises(ValueError, match=r"page_table: entries must lie in \[-1, n_pages"):
        indexer_topk_decode(
            qs[0], ws[0], pool, K, lengths=lengths, page_table=table.at[0, 0].set(pool.shape[0])
        )
    with pytest.raises(ValueError, match="page_table: shape"):
        indexer_topk_decode(qs[0], ws[0], pool, K, lengths=lengths, page_table=table[:2])
    with pytest.raises(ValueError, match="k_scale: shape"):
        indexer_topk_decode(
            qs[0], ws[0], pool, K, lengths=lengths, page_table=table, k_scale=pool_scale[:, :3]
        )
    with pytest.raises(ValueError, match="lengths"):
        indexer_topk_decode(
            qs[0], ws[0], pool, K, page_table=table,
            lengths=jnp.asarray([1, 2, S_MAX + 1], jnp.int32),
        )  # fmt: skip


def test_fp8_decode_never_widens_the_cache_and_still_equals_base(interpret, fp8_widening):
    # Each sequence's keys are its query's alone: widening them in memory would copy the
    # whole cache on every step. The threshold is lowered so that the batch of 3 would
    # widen if the decode let it. The flattened cache through indexer_topk (queries
    # assumed to share keys) does widen, and all three agree id for id.
    k_cache, scale, qs, ws, lengths0 = _sequence(seed=2, steps=1)
    k_cache = k_cache.astype(jnp.float8_e4m3fn)
    q = qs[0].astype(jnp.float8_e4m3fn)
    lengths = jnp.asarray(lengths0, jnp.int32)
    fp8_widening.set_threshold(1)
    res, _ = indexer_topk_decode(
        q, ws[0], k_cache, K, k_scale=scale, lengths=lengths,
        witnesses=jnp.full((B, 2 * K), -1, jnp.int32), implementation="triton",
    )  # fmt: skip
    ids, scores = _base(q, ws[0], k_cache, scale, lengths, "triton")
    assert fp8_widening.decisions and not any(fp8_widening.decisions)
    fp8_widening.decisions.clear()
    start = jnp.arange(B, dtype=jnp.int32) * S_MAX
    flat = jsparse.indexer_topk(
        q, ws[0], k_cache.reshape(B * S_MAX, D), K, k_scale=scale.reshape(-1), kv_start=start,
        kv_end=start + lengths, implementation="triton",
    )  # fmt: skip
    assert fp8_widening.decisions and all(fp8_widening.decisions)
    np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(res.scores), np.asarray(scores))
    flat_ids = jnp.where(flat.indices >= 0, flat.indices - start[:, None], -1)
    np.testing.assert_array_equal(np.asarray(flat_ids), np.asarray(ids))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_repeated_witnesses_fall_back_exactly(impl, request):
    # Witnesses must be distinct (refused when concrete; under jit they cannot be
    # checked); a list that repeats one key K times makes the seed threshold that key's
    # score, which K - 1 other keys' scores lie above. The step must notice that the
    # records fall short of K and score every key, not return fewer than K ids.
    if impl == "triton":
        request.getfixturevalue("interpret")
    k_cache, scale, qs, ws, lengths0 = _sequence(steps=1)
    lengths = jnp.asarray(lengths0, jnp.int32)
    ids, scores = _base(qs[0], ws[0], k_cache, scale, lengths, impl)
    witnesses = jnp.full((B, 2 * K), -1, jnp.int32).at[0, :K].set(ids[0, K // 2])

    def step(witnesses):
        return indexer_topk_decode(
            qs[0], ws[0], k_cache, K, k_scale=scale, lengths=lengths, witnesses=witnesses,
            implementation=impl,
        )  # fmt: skip

    with pytest.raises(ValueError, match="witnesses: row 0 lists a key more than once"):
        step(witnesses)
    res, _ = jax.jit(step)(witnesses)
    np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(res.scores), np.asarray(scores))
    np.testing.assert_array_equal(np.asarray(res.fallback), [True, False, False])


def test_a_witness_past_the_length_is_ignored_even_when_repeated():
    # The docs say ids ≥ lengths[b] are ignored; the distinctness check once counted them.
    k_cache, scale, qs, ws, lengths0 = _sequence(steps=1)
    lengths = jnp.asarray(lengths0, jnp.int32)
    ids, scores = _base(qs[0], ws[0], k_cache, scale, lengths, "reference")
    past = int(lengths0[0]) + 7
    witnesses = jnp.full((B, 2 * K), -1, jnp.int32).at[0, :3].set(jnp.array([past, past, 0]))
    res, _ = indexer_topk_decode(
        qs[0], ws[0], k_cache, K, k_scale=scale, lengths=lengths, witnesses=witnesses,
        implementation="reference",
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(res.scores), np.asarray(scores))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_carried_witnesses_are_the_top_k_then_the_best_fresh_seeds(impl, request):
    from jsparse.certified import decode
    from jsparse.ops.topk import triton as select

    if impl == "triton":
        request.getfixturevalue("interpret")
        best = lambda c, i, n, m: select.select_candidates(c, i, n, m)[1]  # noqa: E731
    else:
        best = decode._best_seeds_reference
    # Two sequences of 20 slots; global ids. Row 1's Top-K is short (two visible keys).
    offset = jnp.asarray([0, 20], jnp.int32)
    top = jnp.asarray([[5, 3, 9], [21, 26, -1]], jnp.int32)
    seeds = jnp.asarray([[3, 7, 1, 9, 4, 12], [26, 21, -1, -1, -1, -1]], jnp.int32)
    codes = jnp.asarray([[50, 10, 30, 40, 20, 25], [9, 8, 0, 0, 0, 0]], jnp.int32)
    codes = jnp.where(seeds >= 0, codes, EMPTY_CODE)
    out = decode._carry_witnesses(top, seeds, codes, 6, offset, 20, best)
    out = np.asarray(out)
    # Row 0: the Top-K, then the best three of the fresh seeds 7 (10), 1 (30), 4 (20),
    # 12 (25): 1, 12, 4 in any order. Row 1: both seeds are in the Top-K.
    np.testing.assert_array_equal(out[0, :3], [5, 3, 9])
    assert sorted(out[0, 3:].tolist()) == [1, 4, 12]
    np.testing.assert_array_equal(out[1], [1, 6, -1, -1, -1, -1])
