"""Exact selection kernels against the jnp reference, on adversarial candidate sets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jsparse
from jsparse import backend
from jsparse.ops.indexer.methods import candidate_capacity
from jsparse.ops.topk import codes as codes_lib
from jsparse.ops.topk import triton as select
from jsparse.ops.topk.reference import (
    select_codes_reference,
    select_topk_reference,
    visible_key_ids,
)


def test_codes_order_and_round_trip():
    # Subnormals (±2^-149, ±2^-130) keep their order: XLA's CPU reads them as zero in
    # float tests, so the codes use integer operations only.
    tiny, sub = 2.0**-149, 2.0**-130
    x = np.array(
        [-np.inf, -3.0, -1e-30, -sub, -tiny, -0.0, 0.0, tiny, sub, 1e-30, 2.0, np.inf, np.nan],
        np.float32,
    )
    c = np.asarray(codes_lib.score_code(jnp.asarray(x))).astype(np.int64)
    assert c[5] == c[6]  # -0 == +0
    assert np.all(np.diff(np.delete(c, 5)) > 0)
    assert c[0] > int(codes_lib.EMPTY_CODE)
    back = np.asarray(codes_lib.code_to_score(jnp.asarray(c, jnp.int32)))
    np.testing.assert_array_equal(back[:12], np.where(x[:12] == 0, np.float32(0.0), x[:12]))
    assert np.isnan(back[12])
    nan_bits = np.array([0x7FC00001, 0xFF800001, 0x7F800001], np.uint32).view(np.float32)
    assert np.all(np.asarray(codes_lib.score_code(jnp.asarray(nan_bits))) == c[12])


def _records(rng, t, n, kind):
    if kind == "heavy-ties":
        codes = rng.integers(-50, 50, size=(t, n))
    elif kind == "full-range":  # every score from -inf to NaN: the search's int32 range
        lo, hi = (int(c) for c in codes_lib.score_code(jnp.array([-jnp.inf, jnp.nan])))
        codes = rng.integers(lo, hi + 1, size=(t, n))
        codes[:, :4] = [lo, hi, lo, hi]
    else:
        codes = np.zeros((t, n))
    codes = np.asarray(codes, np.int32)
    ids = np.stack([rng.permutation(10 * n)[:n] for _ in range(t)]).astype(np.int32)
    return codes, ids


def _adversarial_rows(kind, t, s, start_end, rng):
    """[t, s] f32 score rows: Gaussian, all equal, a few values, or IEEE specials."""
    scores = rng.standard_normal((t, s)).astype(np.float32)
    if kind == "all-equal":
        scores[:] = 1.5  # every entry ties: the slow path must take the smallest ids
    elif kind == "few-values":
        scores = np.round(scores * 2) / 2
    elif kind == "specials":  # the compaction's float compare must keep what codes keep
        scores = np.minimum(scores, 0.0)  # ~half the row ties at 0.0 ...
        scores[:, 1::4] = -0.0  # ... or at -0.0, which is the same score
        scores[:, ::3] = -np.inf
        for r, (a, b) in enumerate(start_end):
            pick = rng.choice(np.arange(a, b), min(20, b - a), replace=False)
            scores[r, pick[:10]] = np.nan  # above +inf
            scores[r, pick[10:]] = np.inf  # the boundary then falls among the zeros
    return scores


def _assert_top_k_of_live(got, codes, ids, counts, top_k):
    """(ids, scores) equal the reference Top-K of each row's first counts[r] entries."""
    live = np.arange(codes.shape[1])[None, :] < counts[:, None]
    want = select_codes_reference(
        jnp.asarray(np.where(live, codes, codes_lib.EMPTY_CODE)),
        jnp.asarray(np.where(live, ids, -1)),
        top_k,
    )
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("kind", ["heavy-ties", "all-tied", "full-range"])
@pytest.mark.parametrize("n, counts", [(300, [300, 17, 0, 123]), (5000, [5000, 40, 4999, 2])])
def test_select_candidates_unordered_records(kind, n, counts, kernel_impl):
    rng = np.random.default_rng(n)
    codes, ids = _records(rng, 4, n, kind)
    counts = np.asarray(counts, np.int32)
    top_k = 25
    got_c, got_i, kth = select.select_candidates(
        jnp.asarray(codes), jnp.asarray(ids), jnp.asarray(counts), top_k
    )
    # every slot is written (no init pass): a short row's tail is EMPTY / -1
    live = np.asarray(got_c) != codes_lib.EMPTY_CODE
    np.testing.assert_array_equal(live.sum(axis=1), np.minimum(counts, top_k))
    np.testing.assert_array_equal(np.asarray(got_i)[~live], -1)
    _assert_top_k_of_live(select.order_topk(got_c, got_i), codes, ids, counts, top_k)
    kth_code = [np.sort(codes[r, : counts[r]])[::-1][top_k - 1] if counts[r] >= top_k else -1
                for r in range(len(counts))]  # fmt: skip
    want_kth = np.asarray(kth_code)
    got_kth = np.where(counts >= top_k, np.asarray(kth), -1)
    np.testing.assert_array_equal(got_kth, want_kth)


# width 8192: a multiple of the 1024-entry block, so streaming takes the aligned
# block loads (with ranges that start and end mid-block); 9000: the gathered loads.
@pytest.mark.parametrize("s", [9000, 8192])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("kind", ["gauss", "all-equal", "few-values", "specials"])
def test_compact_rows_keeps_the_exact_top_k(kind, chunks, s, kernel_impl):
    rng = np.random.default_rng(1)
    t, top_k = 3, 40
    start_end = [(0, s), (100, 7000), (s - 10, s)]
    scores = _adversarial_rows(kind, t, s, start_end, rng)
    start, end = (np.array(x, np.int32) for x in zip(*start_end, strict=True))
    cap = 512
    ci, cn, slow = select.compact_rows(
        jnp.asarray(scores), jnp.asarray(start), jnp.asarray(end), top_k, cap, chunks=chunks
    )
    sc, si, _ = select.select_rows(jnp.asarray(scores), ci, cn, top_k)
    got = select.order_topk(sc, si, id_ordered=True)
    vis = visible_key_ids(jnp.asarray(start), jnp.asarray(end), s)
    want = select_topk_reference(jnp.asarray(scores), vis, top_k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    if kind == "all-equal":  # ties defeat any threshold: the exact search must run
        np.testing.assert_array_equal(np.asarray(slow)[:2], select.SEARCHED)


# (KEEP_BITS, chunks, split keep bits): the one-pass compaction, keep bits and their
# expansion, rows split over programs with a merge, and split keep bits.
RANGE_PATHS = [(False, 1, False), (True, 1, False), (False, 3, False), (True, 3, True)]


@pytest.mark.parametrize("keep_bits, chunks, split_bits", RANGE_PATHS)
@pytest.mark.parametrize("kind", ["gauss", "all-equal"])
def test_ranges_shared_by_groups_of_rows(kind, keep_bits, chunks, split_bits, kernel_impl,
                                         monkeypatch):  # fmt: skip
    # A decode step's heads share their sequence's length and every row starts at 0: a
    # start of one entry and ends of one entry per sequence, read by every kernel of
    # the compaction as entry t // (T / n), each end clipped to [start, S].
    monkeypatch.setattr(select, "KEEP_BITS", keep_bits)
    if split_bits:
        monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ROWS", 1)
        monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ENTRIES", 1)
    s, g, top_k = 9000, 2, 40
    lengths = np.array([s + 50, 4000, -3, 30], np.int32)  # past S, inside, negative, < K
    ends = np.repeat(np.clip(lengths, 0, s), g)
    t = len(ends)
    scores = _adversarial_rows(kind, t, s, [(0, e) for e in ends], np.random.default_rng(2))
    # row 0's end is past S: unclipped, it would read keys S .. S + 49, which are the
    # next row's first entries on the GPU and its own last one, clamped, interpreted
    scores[:, -1] = scores[1:, :50] = np.inf
    start = jnp.zeros((1,), jnp.int32)
    codes, ci, cn, _ = select.compact_rows(
        jnp.asarray(scores), start, jnp.asarray(lengths), top_k, 512, chunks=chunks,
        with_codes=True,
    )  # fmt: skip
    got = select.select_by_rank(codes, ci, cn, top_k)
    vis = visible_key_ids(jnp.zeros((t,), jnp.int32), jnp.asarray(ends), s)
    want = select_topk_reference(jnp.asarray(scores), vis, top_k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(np.asarray(cn)[-4:], [0, 0, 30, 30])


def test_group_ranges_must_divide_the_rows():
    x = jnp.zeros((6, 64), jnp.float32)
    message = r"end: shape \(4,\); expected \[n\] with n dividing T = 6"
    with pytest.raises(ValueError, match=message):
        select.compact_rows(x, jnp.zeros((1,), jnp.int32), jnp.zeros((4,), jnp.int32), 4, 64)


@pytest.mark.parametrize("kind", ["gauss", "all-equal"])
def test_split_rows_with_a_shared_theta_keep_the_same_candidates(kind, kernel_impl, monkeypatch):
    """θ searched once a row (a kernel of its own) or by every chunk program: the same
    sample and search, so the same candidates, counts and paths (all-equal: the slow
    path, from the merge)."""
    rng = np.random.default_rng(2)
    s, top_k, cap = 9000, 40, 512
    start_end = [(0, s), (100, 7000), (s - 10, s)]
    scores = _adversarial_rows(kind, 3, s, start_end, rng)
    start, end = (jnp.asarray(np.array(x, np.int32)) for x in zip(*start_end, strict=True))
    runs = []
    for shared in (None, 1):
        monkeypatch.setattr(select, "SHARED_THETA_MIN_ROWS", shared)
        ids, count, slow = select.compact_rows(
            jnp.asarray(scores), start, end, top_k, cap, chunks=3
        )
        runs.append((np.asarray(ids), np.asarray(count), np.asarray(slow)))
    (ids0, n0, slow0), (ids1, n1, slow1) = runs
    np.testing.assert_array_equal(n0, n1)
    np.testing.assert_array_equal(slow0, slow1)
    for r in range(3):
        np.testing.assert_array_equal(ids0[r, : n0[r]], ids1[r, : n1[r]])


def _check_keep_bits(monkeypatch, scores, start_end, top_k, cap, *, with_codes, chunks=1):
    """The keep bits (written by ``chunks`` programs a row) and their expansion give the
    one-pass compaction's ids, codes, counts and flags, with the same θ (the same
    kernel, at the same warps: the search may stop at another code with other
    reductions); returns (count, flag)."""
    start, end = (jnp.asarray(np.array(x, np.int32)) for x in zip(*start_end, strict=True))
    args = (jnp.asarray(scores), start, end, top_k, cap)
    monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ROWS", 1)
    monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ENTRIES", 1)
    monkeypatch.setattr(select, "SHARED_THETA_MIN_ROWS", 1)

    def compaction(keep_bits):
        monkeypatch.setattr(select, "KEEP_BITS", keep_bits)
        out = select.compact_rows(*args, chunks=chunks, with_codes=with_codes)
        return [np.asarray(x) for x in out]

    *want_slots, want_count, want_slow = compaction(False)
    *slots, count, slow = compaction(True)
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_array_equal(slow, want_slow)
    live = np.arange(cap)[None, :] < np.minimum(count, cap)[:, None]
    for got, want in zip(slots, want_slots, strict=True):
        np.testing.assert_array_equal(got[live], want[live])
    return count, slow


@pytest.mark.parametrize(
    ("kind", "with_codes", "s", "chunks"),
    [
        ("gauss", False, 9000, 1),  # gathered block loads (width not a block multiple)
        ("gauss", False, 8192, 1),  # aligned block loads
        ("specials", True, 8192, 1),  # -0 / NaN / ±inf, codes beside the ids
        ("all-equal", False, 9000, 1),  # off the fast path: the exact kernel
        ("gauss", True, 8192, 3),  # rows split over programs (decode), codes
        ("gauss", False, 9000, 5),  # split, gathered loads, chunks past short rows' ends
        ("all-equal", False, 8192, 4),  # split, then the exact kernel
    ],
)  # fmt: skip
def test_keep_bits_compaction_equals_the_one_pass_one(kind, with_codes, s, chunks, kernel_impl,
                                                      monkeypatch):  # fmt: skip
    # Rows: a full one, one inside blocks at both ends, one that fits the buffer whole
    # (θ keeps all: every word full, bit 31 set, 32 rounds), two empty, one of them at
    # the row's end (its first block starts past the row: nothing may be stored there);
    # all-equal rows leave the fast path and take the exact kernel.
    rng = np.random.default_rng(11)
    start_end = [(0, s), (100, 7000), (3000, 3500), (5, 5), (s, s), (0, s)]
    scores = _adversarial_rows(kind, len(start_end), s, start_end, rng)
    count, slow = _check_keep_bits(
        monkeypatch, scores, start_end, 40, 512, with_codes=with_codes, chunks=chunks
    )
    assert count[2] == 500 and slow[2] == select.FAST
    assert count[3] == count[4] == 0


@pytest.mark.parametrize("chunks", [1, 3, 5])
def test_keep_bits_store_only_their_rows_blocks(chunks, kernel_impl):
    """Every program stores the words of its own blocks of its row's range and nothing
    else (a range with no blocks still runs its first one): over a buffer of sentinels,
    the words of blocks outside each row's range stay as they were. An empty row at a
    block-aligned end once stored one block past its words, into the next row's."""
    cfg = select.SelectConfig()
    blk, n_w = cfg.block, cfg.block // 32
    s = 8 * blk
    start_end = [(0, s), (s, s), (100, 5000), (3 * blk, 3 * blk), (5, 5), (s - 10, s)]
    t = len(start_end)
    start, end = (jnp.asarray(np.array(x, np.int32)) for x in zip(*start_end, strict=True))
    scores = jnp.asarray(np.random.default_rng(5).standard_normal((t, s)), jnp.float32)
    theta = jnp.full((t,), codes_lib.score_code(jnp.float32(0.0)), jnp.int32)
    sentinel = jnp.full((t, s // 32), 0x5A5A5A5A, jnp.int32)

    def kernel(scores_ref, start_ref, end_ref, theta_ref, _, words_ref):
        select._keep_bits_kernel(scores_ref, start_ref, end_ref, theta_ref, words_ref,
                                 cfg=cfg, chunks=chunks)  # fmt: skip

    words = np.asarray(
        pl.pallas_call(
            kernel, grid=(t, chunks), out_shape=jax.ShapeDtypeStruct(sentinel.shape, jnp.int32),
            input_output_aliases={4: 0}, interpret=backend.is_interpret(),
        )(scores, start, end, theta, sentinel)
    )  # fmt: skip
    x = np.asarray(scores)
    for r, (lo, hi) in enumerate(start_end):
        first, last = lo // blk, -(-hi // blk)  # the aligned blocks touching [lo, hi)
        for b in range(s // blk):
            got = words[r, b * n_w : (b + 1) * n_w]
            if not first <= b < last:
                assert np.all(got == 0x5A5A5A5A), (r, b)  # never written
                continue
            ids = b * blk + np.arange(blk)
            kept = (x[r, ids] >= 0) & (ids >= lo) & (ids < hi)
            bits = (kept.reshape(n_w, 32) << np.arange(32)).sum(axis=1, dtype=np.int64)
            np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [1, 7])
@pytest.mark.parametrize("with_codes", [False, True], ids=["ids", "codes"])
def test_gpu_keep_bits_compaction_compiled(with_codes, chunks, monkeypatch):
    # The bench's shape class compiled: 64K rows, K = 2048, causal ends, rounded scores
    # (ties at the threshold) and a row short enough to keep whole. Empty rows at the
    # end of the block-aligned width (and 7 chunks of 64 blocks, the last one empty)
    # start a block past their words, into the next row's: their stores are masked off.
    rng = np.random.default_rng(12)
    t, s, top_k = 64, 65536, 2048
    cap = candidate_capacity(top_k, s)
    scores = rng.standard_normal((t, s)).astype(np.float32)
    scores[t // 2 :] = np.round(scores[t // 2 :] * 4) / 4
    start_end = [(0, s - t + 1 + r) for r in range(t - 1)] + [(s - 3000, s)]
    empty = list(range(0, t // 2, 4))
    for r in empty:
        start_end[r] = (s, s)
    count, slow = _check_keep_bits(
        monkeypatch, scores, start_end, top_k, cap, with_codes=with_codes, chunks=chunks
    )
    live = np.setdiff1d(np.arange(t), empty)
    assert count[-1] == 3000 and np.all(count[live] >= top_k) and np.all(count[empty] == 0)
    assert np.sum(slow == select.FAST) >= t // 2  # most rows took the keep bits


def _codes_of(scores, ids, counts):
    """Codes [T, cap] of the candidate ids' scores in their dense rows (slots past a
    row's count: whatever; their ids are clipped into the row)."""
    live = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :] < counts[:, None]
    at = jnp.where(live, jnp.clip(ids, 0, scores.shape[1] - 1), 0)
    return codes_lib.score_code(jnp.take_along_axis(scores, at, axis=1))


def _assert_codes_of_live_slots(codes, want, counts):
    live = np.arange(codes.shape[1])[None, :] < np.asarray(counts)[:, None]
    np.testing.assert_array_equal(np.asarray(codes)[live], np.asarray(want)[live])


@pytest.mark.parametrize(
    ("chunks", "merge_writes"), [(1, False), (3, False), (3, True)],
    ids=["whole-rows", "chunks", "chunks-merge-writes"],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["all-equal", "specials"])
def test_compact_rows_writes_the_codes_it_keeps(kind, chunks, merge_writes, kernel_impl,
                                                monkeypatch):  # fmt: skip
    # the codes beside the ids, on the fast path, the slow one (all-equal: the exact
    # search rewrites the row) and on -0 / NaN / ±inf; written as kept, or by the merge
    # from the copied ids' scores
    monkeypatch.setattr(select, "MERGE_WRITES_CODES", merge_writes)
    rng = np.random.default_rng(5)
    s, top_k, cap = 9000, 40, 512
    start_end = [(0, s), (100, 7000), (s - 10, s)]
    scores = jnp.asarray(_adversarial_rows(kind, 3, s, start_end, rng))
    start, end = (jnp.asarray(np.array(x, np.int32)) for x in zip(*start_end, strict=True))
    args = (scores, start, end, top_k, cap)
    codes, ids, count, slow = select.compact_rows(*args, chunks=chunks, with_codes=True)
    want_ids, want_count, want_slow = select.compact_rows(*args, chunks=chunks)
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_array_equal(slow, want_slow)
    live = np.arange(cap)[None, :] < np.asarray(count)[:, None]
    np.testing.assert_array_equal(np.asarray(ids)[live], np.asarray(want_ids)[live])
    _assert_codes_of_live_slots(codes, _codes_of(scores, ids, count), count)


@pytest.mark.parametrize("width", [6000, 6144])
@pytest.mark.parametrize("chunks", [1, 4])
def test_compact_records_then_select(chunks, width, kernel_impl):
    rng = np.random.default_rng(2)
    codes, ids = _records(rng, 2, width, "heavy-ties")
    counts = np.array([width, 5000], np.int32)
    cc, ci, cn, _ = select.compact_records(
        jnp.asarray(codes), jnp.asarray(ids), jnp.asarray(counts), 30, 512, chunks=chunks
    )
    sc, si, _ = select.select_candidates(cc, ci, cn, 30)
    got = select.order_topk(sc, si)
    valid = np.arange(width)[None, :] < counts[:, None]
    want = select_codes_reference(
        jnp.asarray(np.where(valid, codes, codes_lib.EMPTY_CODE)),
        jnp.asarray(np.where(valid, ids, -1)),
        30,
    )
    np.testing.assert_array_equal(got[0], want[0])


def _select_whole_rows(scores, top_k, cap, chunks):
    """compact_rows + select_rows over whole rows, checked against the reference; returns
    the per-row path flags."""
    t, s = scores.shape
    start, end = np.zeros(t, np.int32), np.full(t, s, np.int32)
    ci, cn, slow = select.compact_rows(
        jnp.asarray(scores), jnp.asarray(start), jnp.asarray(end), top_k, cap, chunks=chunks
    )
    sc, si, _ = select.select_rows(jnp.asarray(scores), ci, cn, top_k)
    got = select.order_topk(sc, si, id_ordered=True)
    ids = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (t, s))
    want = select_topk_reference(jnp.asarray(scores), ids, top_k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    return np.asarray(slow)


def _sampled_positions(s):
    """The positions the θ sample reads in a row of s > 4096 entries."""
    k = np.arange(select.SAMPLE_BLOCKS * select.SAMPLE_BLOCK)
    run = (k // select.SAMPLE_BLOCK) * (s - select.SAMPLE_BLOCK) // (select.SAMPLE_BLOCKS - 1)
    return run + k % select.SAMPLE_BLOCK


def test_sample_threshold_is_robust_to_clustered_scores(kernel_impl):
    # Structured rows put their high scores in clusters (recency, topics). The θ sample
    # must see every cluster: with 32 runs of 128 (one run per ~1000 keys) a cluster
    # narrower than the spacing falls between runs in about a third of the rows, θ comes
    # from the background, the count overflows cap and the row takes the exact slow path
    # (a bisection over the whole row). 512 runs of 8 see it. Exactness does not depend
    # on this; speed does.
    rng = np.random.default_rng(7)
    t, s, top_k, cap = 16, 32768, 128, 512
    scores = rng.standard_normal((t, s)).astype(np.float32)
    for r in range(t):
        lo = rng.integers(0, s - 600)
        scores[r, lo : lo + 600] += 4.0  # the Top-K lives in these 600 keys
    slow = _select_whole_rows(scores, top_k, cap, chunks=1)
    assert int(slow.sum()) <= 1, slow


def _check_missed_sample(chunks):
    # Row 0: the sampled positions hold the highest scores, so θ from the sample admits
    # fewer than K entries; the retry at a rescaled rank must land in [K, cap] in one
    # pass. Row 1: all scores tie, no threshold can: the exact search runs.
    s, top_k, cap = 9000, 100, 512
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, s)).astype(np.float32)
    sampled = _sampled_positions(s)
    # log-uniform over 10 octaves, far above the rest of the row
    scores[0, sampled] = 10.0 * 2.0 ** (10 * rng.random(sampled.size)).astype(np.float32)
    scores[1] = 2.0
    slow = _select_whole_rows(scores, top_k, cap, chunks)
    np.testing.assert_array_equal(slow, [select.RETRIED, select.SEARCHED])


def _check_ladder(chunks):
    # A row whose count is not linear in the sample rank: the sampled θ admits a few
    # entries too few, the rescaled retry lands in a cluster of unsampled scores and
    # admits far too many. The ladder between the two θ must find one in [K, cap] in a
    # single counting pass instead of the exact search.
    s, top_k, cap = 9000, 100, 512
    rng = np.random.default_rng(5)
    sampled = _sampled_positions(s)
    n = sampled.size
    rank = int(select.sample_rank(top_k, s))  # the kernel's first sample rank
    row = np.zeros(s, np.float32)
    row[sampled] = 1.0 + rng.random(n).astype(np.float32)  # one binade: codes linear
    values = np.sort(row[sampled])[::-1]
    free = np.setdiff1d(np.arange(s), sampled)
    row[free[:20]] = 2.5  # above every sampled value
    first_count = int((row >= values[rank - 1]).sum())
    retry_rank = rank * (top_k + cap) // (2 * first_count)
    lo, hi = values[retry_rank - 1], values[rank - 1]
    row[free[20:620]] = lo + (hi - lo) * rng.random(600).astype(np.float32) * 0.999
    # the construction: the first θ misses low, the retry misses high
    assert first_count < top_k and int((row >= lo).sum()) > cap
    slow = _select_whole_rows(np.stack([row, row[::-1]]), top_k, cap, chunks)
    assert slow[0] == select.RETRIED, slow


_SLOW_PATHS = [_check_missed_sample, _check_ladder]


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("check", _SLOW_PATHS, ids=["retry-then-search", "ladder"])
def test_slow_paths(check, chunks, kernel_impl, monkeypatch):
    # θ exactly at the sample rank (no slack): the constructions place it there
    monkeypatch.setattr(select, "SAMPLE_SLACK_DIVISOR", 1 << 30)
    check(chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("check", _SLOW_PATHS, ids=["retry-then-search", "ladder"])
def test_gpu_slow_path_flags_compiled(check, monkeypatch):
    # The path flags come from scalar selects, which Pallas Triton once lowered wrongly
    # for Python-int branches (2 stored as 0); interpret mode cannot see that.
    monkeypatch.setattr(select, "SAMPLE_SLACK_DIVISOR", 1 << 30)
    check(1)


_RANK_SELECTS = pytest.mark.parametrize(
    "rank_select", [select.rank_select, select.block_rank_select], ids=["pairs", "blocks"]
)


@_RANK_SELECTS
@pytest.mark.parametrize("bi, bj", [(8, 1024), (8, 16)])
@pytest.mark.parametrize("kind", ["gauss", "all-equal", "few-values", "specials"])
def test_rank_select_after_compaction(kind, bi, bj, rank_select, kernel_impl):
    """Decode's selection: the compaction's candidates, each ranked against its row and
    written at its rank, equal the reference id for id and in order, on ties, -0 / NaN /
    ±inf, a row with fewer visible keys than K, and an empty row. bj = 16 makes the
    rank loops take several blocks: before, holding and after the ranked slots."""
    rng = np.random.default_rng(3)
    s, top_k, cap = 9000, 40, 512
    start_end = [(0, s), (100, 7000), (s - 10, s), (500, 500)]
    scores = _adversarial_rows(kind, len(start_end), s, start_end, rng)
    start, end = (jnp.asarray(np.array(x, np.int32)) for x in zip(*start_end, strict=True))
    scores = jnp.asarray(scores)
    codes, ids, count, _ = select.compact_rows(
        scores, start, end, top_k, cap, chunks=3, with_codes=True
    )
    _assert_codes_of_live_slots(codes, _codes_of(scores, ids, count), count)
    got = rank_select(codes, ids, count, top_k, bi=bi, bj=bj)
    vis = visible_key_ids(start, end, s)
    want = select_topk_reference(scores, vis, top_k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@_RANK_SELECTS
@pytest.mark.parametrize("cap", [96, 90], ids=["aligned-rows", "unaligned-rows"])
def test_rank_select_on_tied_records_of_every_count(cap, rank_select, kernel_impl):
    # counts 0, below K, K exactly, above K and the full buffer; codes tie heavily and
    # include the extremes (NaN's code, -inf's); ids ascend along each row. Slots past
    # a count hold the highest code, so reading one would move every rank.
    rng = np.random.default_rng(9)
    t, top_k = 5, 30
    lo, hi = (int(c) for c in codes_lib.score_code(jnp.array([-jnp.inf, jnp.nan])))
    codes = rng.integers(-3, 3, size=(t, cap)).astype(np.int32)
    codes[:, ::11] = hi
    codes[:, 5::13] = lo
    ids = np.stack([np.sort(rng.permutation(50 * cap)[:cap]) for _ in range(t)]).astype(np.int32)
    counts = np.array([0, 7, top_k, 61, cap], np.int32)
    codes[np.arange(cap)[None, :] >= counts[:, None]] = hi
    got = rank_select(jnp.asarray(codes), jnp.asarray(ids), jnp.asarray(counts), top_k, bj=32)
    _assert_top_k_of_live(got, codes, ids, counts, top_k)


def test_select_by_rank_takes_the_block_form_from_its_row_count(monkeypatch):
    # one row: one launch of pairs (lower latency); from BLOCK_RANK_MIN_ROWS: the blocks
    taken = []
    monkeypatch.setattr(select, "rank_select", lambda *a: taken.append("pairs"))
    monkeypatch.setattr(select, "block_rank_select", lambda *a: taken.append("blocks"))
    for rows in (1, select.BLOCK_RANK_MIN_ROWS - 1, select.BLOCK_RANK_MIN_ROWS, 16):
        select.select_by_rank(None, jnp.zeros((rows, 8), jnp.int32), None, 4)
    assert taken == ["pairs", "pairs", "blocks", "blocks"]


@pytest.mark.gpu
@pytest.mark.parametrize("by_blocks", [False, True], ids=["pairs", "blocks"])
@pytest.mark.parametrize("t, s", [(1, 65536), (8, 131072)])
def test_gpu_decode_rows_select_by_rank(t, s, by_blocks, monkeypatch):
    # decode-sized rows take rank_select (or its block form) when compiled; rounded
    # scores tie at the boundary, one row sees fewer keys than K. (The module constant
    # is read at trace time; the monkeypatch fixture clears traces around the test.)
    monkeypatch.setattr(select, "BLOCK_RANK_MIN_ROWS", 1 if by_blocks else None)
    rng = np.random.default_rng(t)
    cap = candidate_capacity(2048, s)
    assert select.rank_selects(t, cap)
    x = jnp.asarray(np.round(rng.standard_normal((t, s)) * 16).astype(np.float32))
    start = jnp.zeros((t,), jnp.int32)
    end = jnp.full((t,), s, jnp.int32).at[-1].set(1500 if t > 1 else s)
    got = jax.jit(functools.partial(jsparse.topk, top_k=2048))(x, kv_start=start, kv_end=end)
    want = select_topk_reference(x, visible_key_ids(start, end, s), 2048)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize(
    "s, top_k, cap",
    [(30000, 4100, 8704), (200000, 41000, 83968)],
    ids=["streamed-select", "large-k-ranks-in-f32"],
)
def test_long_candidate_rows(s, top_k, cap, kernel_impl):
    # cap > 8192: the select streams its buffer (ids gathered back to scores) instead of
    # holding it in registers; K > 40K: the sample's rank arithmetic would overflow int32.
    rng = np.random.default_rng(11)
    scores = rng.standard_normal((1, s)).astype(np.float32)
    scores[0, ::7] = np.round(scores[0, ::7])  # ties near the boundary too
    slow = _select_whole_rows(scores, top_k, cap, chunks=1)
    assert slow[0] == select.FAST  # the sample's θ fit: no slow path


def _assert_order_is_sort(codes, ids, id_ordered, order="rank"):
    if order == "rank":
        got = select.rank_order(codes, ids, id_ordered=id_ordered)
    else:  # the network ignores id_ordered: it always breaks ties by id
        got = select.bitonic_order(codes, ids)
    want = select.sort_order(codes, ids, id_ordered=id_ordered)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize(
    ("order", "k"),
    [("rank", 1), ("rank", 37), ("rank", 300), ("bitonic", 1), ("bitonic", 5), ("bitonic", 13)],
)
@pytest.mark.parametrize("id_ordered", [False, True])
def test_order_kernels_match_sort(order, k, id_ordered, kernel_impl):
    """The order kernels (rank: few rows; bitonic network: many) against XLA's sort:
    heavy ties, NaN / ±inf codes, and empty slots (at the tail of an id-ordered row,
    anywhere otherwise). The network kernel runs interpreted only at K ≤ 16 (XLA's CPU
    compile of it grows exponentially with the width); its layers are checked wide
    below, eagerly, and the GPU test compiles it at 2048."""
    rng = np.random.default_rng(k)
    t = 3
    lo, hi = (int(c) for c in codes_lib.score_code(jnp.array([-jnp.inf, jnp.nan])))
    codes = rng.integers(-4, 4, size=(t, k)).astype(np.int32)
    codes[0, : min(k, 3)] = [hi, lo, hi][: min(k, 3)]
    n_valid = [k, max(k - 5, 0), k // 2]
    if id_ordered:
        ids = np.stack([np.sort(rng.permutation(10 * k)[:k]) for _ in range(t)])
        for r, n in enumerate(n_valid):
            codes[r, n:] = codes_lib.EMPTY_CODE
    else:
        ids = np.stack([rng.permutation(10 * k)[:k] for _ in range(t)])
        for r, n in enumerate(n_valid):
            codes[r, rng.permutation(k)[n:]] = codes_lib.EMPTY_CODE
    ids = np.where(codes == codes_lib.EMPTY_CODE, -1, ids).astype(np.int32)
    _assert_order_is_sort(jnp.asarray(codes), jnp.asarray(ids), id_ordered, order)


@pytest.mark.parametrize("n", [1, 2, 64, 512])
def test_bitonic_network_sorts_pairs(n):
    """The network's layers, run op by op: ascending (key, id) on rows with heavy ties,
    the int32 extremes (the partner trick's sums wrap) and repeated empty pairs."""
    rng = np.random.default_rng(n)
    info = np.iinfo(np.int32)
    keys = rng.integers(-3, 3, size=n).astype(np.int32)
    keys[: min(n, 4)] = [info.max, info.min, info.max, 0][: min(n, 4)]
    ids = rng.permutation(4 * n)[:n].astype(np.int32)
    ids[rng.random(n) < 0.2] = -1  # empties: (INT_MAX, -1) after the kernel's mapping
    keys[ids == -1] = info.max
    got_k, got_i = select.bitonic_sort(jnp.asarray(keys), jnp.asarray(ids))
    order = np.lexsort((ids, keys))
    np.testing.assert_array_equal(got_k, keys[order])
    np.testing.assert_array_equal(got_i, ids[order])


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16])
def test_gpu_rank_order_compiled(t):
    # the full-size set (K = 2048, one 2048-lane compare per program) compiled; rounded
    # scores give ties that only the id order separates
    rng = np.random.default_rng(t)
    x = np.round(rng.standard_normal((t, 2048)) * 8).astype(np.float32)
    codes = codes_lib.score_code(jnp.asarray(x))
    ids = jnp.asarray(np.sort(rng.permutation(1 << 17)[:2048])[None].repeat(t, 0), jnp.int32)
    codes = codes.at[:, -100:].set(codes_lib.EMPTY_CODE)
    for id_ordered in (True, False):
        _assert_order_is_sort(codes, ids, id_ordered)


@pytest.mark.gpu
def test_gpu_bitonic_order_compiled():
    # many rows of the full-size set: order_topk takes the network, which must equal the
    # sort id for id; rounded scores tie, ids unordered, empty slots scattered
    rng = np.random.default_rng(5)
    t, k = 4096, 2048
    assert (
        t * k * k > select.RANK_ORDER_PAIRS
        and t >= select.BITONIC_MIN_ROWS
        and k <= select.BITONIC_MAX_K
    )
    x = np.round(rng.standard_normal((t, k)) * 8).astype(np.float32)
    x[:, ::97] = np.nan
    codes = np.array(codes_lib.score_code(jnp.asarray(x)))  # a writable copy
    codes[rng.random((t, k)) < 0.03] = codes_lib.EMPTY_CODE
    ids = np.stack([rng.permutation(1 << 17)[:k] for _ in range(16)]).repeat(t // 16, 0)
    codes, ids = jnp.asarray(codes), jnp.asarray(ids, jnp.int32)
    want = select.sort_order(codes, ids)
    outputs = [jax.jit(select.order_topk)(codes, ids)]
    outputs += [select.bitonic_order(codes, ids, num_warps=w) for w in (4, 16)]
    for got in outputs:
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_default_chunks_fill_the_device_and_follow_the_chunk_length(monkeypatch):
    assert select.default_chunks(1, 65536) == 64  # one row: 1024 entries a chunk
    assert select.default_chunks(1, 16384) == 16
    assert select.default_chunks(8, 65536) == 16  # 4096 entries a chunk
    assert select.default_chunks(64, 65536) == 9  # four programs an SM: ⌈528 / 64⌉
    assert select.default_chunks(8192, 65536) == 1
    assert select.default_chunks(1, 1000) == 1
    # MIN_ROW_CHUNKS = 8: a floor while rows × chunks stay within 16 programs an SM
    assert select.default_chunks(256, 131072) == 8
    assert select.default_chunks(64, 131072) == 9  # the fill is above the floor
    assert select.default_chunks(1024, 131072) == 2  # ⌊2112 / 1024⌋
    monkeypatch.setattr(select, "MIN_ROW_CHUNKS", 1)  # no floor: four programs an SM
    assert select.default_chunks(256, 131072) == 3
    assert select.default_chunks(1024, 131072) == 1
    monkeypatch.setattr(select, "MIN_CHUNK_ENTRIES", 1024)
    assert select.default_chunks(8, 65536) == 64
    assert select.default_chunks(1, 1 << 20) == 64  # MAX_CHUNKS


@pytest.mark.parametrize("length", [65536, 131072])
def test_sampled_theta_count_lands_in_the_window_on_iid_rows(length):
    """The θ sample's rank (``sample_rank``) and slack put every row's count of entries
    ≥ θ inside [K, cap] on 256 i.i.d. rows, as the kernels compute θ (the sampled
    positions, then ``_kth_code`` with the slack): a row outside takes the slow path,
    one program streaming the whole row (~160 µs at 128K, run 75)."""
    rows, k = 256, 2048
    cap = candidate_capacity(k, length)
    codes = codes_lib.score_code(jax.random.normal(jax.random.key(0), (rows, length)))
    sample = codes[:, _sampled_positions(length)]
    rank = select.sample_rank(k, jnp.int32(length))
    slack = rank // select.SAMPLE_SLACK_DIVISOR
    theta = jax.jit(jax.vmap(lambda c: select._kth_code(c, rank, slack)))(sample)
    counts = np.asarray(jnp.sum(codes >= theta[:, None], axis=1))
    assert counts.min() >= k and counts.max() <= cap, (counts.min(), counts.max(), cap)
