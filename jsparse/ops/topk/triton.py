"""Exact Top-K selection as Pallas Triton kernels, one program per row.

Triton on this backend has no sort, no histogram and unreliable vector int atomics,
so selection is built from what is fast: streaming compares, sums and forward
``cumsum`` (for order-preserving compaction). Comparisons are on int32 score codes
(:mod:`jsparse.ops.topk.codes`), so equality is exact and ties are explicit; the one
exception is the dense compaction's test against a sampled θ, which compares the
scores as floats where that is the same test (:func:`_at_least`).

Two kernels:

* :func:`compact_rows` / :func:`compact_records` (a long row → a short candidate
  buffer). A row is either a dense score row (ids are positions in ``[start, end)``) or
  a list of records (code, id). A sample of the row (the whole row when short, else 512
  evenly spaced runs of 8) gives a threshold θ whose count of entries ≥ θ is above K
  with ~3.5 spreads to spare (:func:`sample_rank`); every entry ≥ θ is compacted, in row
  order, into ``cap`` slots: for whole dense rows through a bit an entry and an
  expansion of the words (``KEEP_BITS``), else in one streaming pass. A dense row stores
  only ids (the select gathers their scores back): the second scattered store and the
  code of every entry cost more than the gather (WORKSPACE.md run 26). If the count
  lands outside [K, cap] (an unlucky sample, or massive ties), a separate kernel runs
  the row's slow path: one retry at a rescaled rank; if that overshoots the other way,
  one pass counting a ladder of 16 thresholds between the two; failing both, a radix-16
  search over the whole row (8 passes) for the K-th code θ*, and one pass stores the
  entries above θ* plus the ties with the smallest ids: exactly K. Either way the buffer
  holds every entry of the exact Top-K.
* :func:`select_candidates` / :func:`select_rows` (candidate buffer → Top-K set). A
  search by false position on the scores, handing over to interpolation over codes
  safeguarded by bisection (:func:`_search_kth`), finds the K-th largest code θ in ~8
  block-wide counts instead of bisection's 32; every entry above θ enters; ties at θ
  enter by ascending id (a bisection over ids finds the cut when ties straddle the
  boundary). Output keeps the input order. A row's candidates sit in registers (a
  4096-lane tile), so an SM holds two rows at a time (ncu, run 35): its latency, not its
  arithmetic, is the select's cost.

Few rows (decode) take :func:`rank_select` instead of the select and the order: every
candidate is ranked against its row in one launch and written at its rank.

The final order (score descending, id ascending, :func:`order_topk`): for a few rows
(T·K² ≤ 2^26) one kernel ranks each entry against its whole row (2.3 µs at T = 1
against XLA's 23 µs sort, run 35); for more rows of K ≤ 2048, a bitonic network in
registers, one program per row (:func:`bitonic_order`); for longer rows, an XLA sort
of K entries per row, with one stable key when the entries are already in id order,
else two.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import pallas_call
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code

_INT_MIN = np.int32(np.iinfo(np.int32).min)
_INT_MAX = np.int32(np.iinfo(np.int32).max)
# The θ sample: 4096 entries in 512 evenly spaced runs of 8 (one 32-byte sector each).
# Runs of 128 saved nothing in bytes and made θ depend on where the high scores cluster:
# on structured rows (recency, topics) half of the rows missed [K, cap] and took the
# slow path (WORKSPACE.md, 2026-11-29).
SAMPLE_BLOCKS = 512
SAMPLE_BLOCK = 8
MAX_RESIDENT = 8192  # candidate rows up to this many entries are held in registers
SMALL_RESIDENT = 4096  # ... in a block of this many when they fit (run 26: −8% select)
RADIX = 16  # trial thresholds per streaming pass of the exact path
# compact_rows' per-row report of the path taken. Typed on purpose: in a Pallas Triton
# kernel, jnp.where(p, 1, 2) with two Python-int branches lowers to an i1 select of
# `true`/`false` and stores 1 or 0 (run 25's anomaly, confirmed in the lowered IR);
# np.int32 branches, or arithmetic on p.astype(int32), lower correctly.
FAST, RETRIED, SEARCHED = np.int32(0), np.int32(1), np.int32(2)


@dataclasses.dataclass(frozen=True)
class SelectConfig:
    """Measured on an H200 (WORKSPACE.md run 3): small blocks and 4 warps stream best.
    The select at 8192 rows × 4096 resident candidates also runs best at 4 warps: 579
    µs, against 1046 at 8 and 820 at 16 (run 94)."""

    block: int = 1024  # entries per step of a streaming pass
    num_warps: int = 4
    num_stages: int = 1
    # Rows split over several programs (decode): each program's θ search is a chain of
    # sample counts, and 8 warps halve each count's work per thread (run 63: −2.6 to
    # −2.7 µs of a 13-16 µs compaction at 1 and 8 rows; 16 warps gave back half of it).
    split_num_warps: int = 8


# The K-th code search's first trials are in score space (see _search_kth). It steps in
# code space for good (where a bisection safeguard bounds it to ~64 more counts) after
# SCORE_STEPS of them, or after SCORE_STALLS in a row that did not halve the count gap.
SCORE_STEPS = 16
SCORE_STALLS = 3
# The sampled θ accepts a code whose sample count is up to rank / SAMPLE_SLACK_DIVISOR
# above its rank (≤ 5% more candidates): the compaction only needs a count in [K, cap],
# and an exact search's last counts only pin one code among a handful.
SAMPLE_SLACK_DIVISOR = 20
# Whether the select kernel's K-th search starts from the normal guess too. Its rows
# live in registers (up to 8192 candidates), and the guess's two reductions cost more
# than the counts they save there (run 76, 8192 rows: 3-8 µs slower with it).
SELECT_GUESS = False
# The count of row entries ≥ the sample's rank-th code is about rank · L/n, give or
# take a relative ~1/√rank (a binomial draw; measured a little wider, run 75's rows):
# the rank puts K SAMPLE_MARGIN such spreads below, and the capacity sits
# CAPACITY_MARGIN above.
SAMPLE_MARGIN = 3.5
CAPACITY_MARGIN = 4.5


def sample_rank(top_k, length):
    """The θ sample's rank in a row of ``length`` > 4096 entries: the r with
    r − SAMPLE_MARGIN·√r = K·n/L, so a count below K is ~3.5 spreads away. At 64 × 128K
    the former rank ⌈1.3·K·n/L⌉ + 8 = 92 gave counts down to 2005 < K on the bench's
    rows (a CPU replay of run 75's inputs, WORKSPACE.md); this one gives 99,
    counts 2204-4568. Works on Python ints (host) and traced int32."""
    xp = np if isinstance(length, (int, np.integer)) else jnp  # numpy: no tracing on host
    n_sample = SAMPLE_BLOCKS * SAMPLE_BLOCK
    expected = top_k * n_sample / xp.maximum(length, 1).astype(xp.float32)
    root = (SAMPLE_MARGIN + xp.sqrt(SAMPLE_MARGIN**2 + 4.0 * expected)) / 2.0
    return xp.clip(xp.ceil(root * root), 1, n_sample).astype(xp.int32)


def sample_capacity_floor(top_k, length):
    """The candidate count CAPACITY_MARGIN spreads above θ's rank (plus its slack), for
    :func:`jsparse.ops.indexer.methods.candidate_capacity`."""
    rank = int(sample_rank(top_k, length))
    high = rank + CAPACITY_MARGIN * math.sqrt(rank) + rank // SAMPLE_SLACK_DIVISOR
    return math.ceil(high * length / (SAMPLE_BLOCKS * SAMPLE_BLOCK))


def _upper_normal_quantile(p):
    """z with P(N(0,1) > z) = p, 0 < p < 1: Abramowitz & Stegun 26.2.23 (|error| <
    4.5e-4), enough for a first guess."""
    tail = jnp.minimum(p, 1.0 - p)
    t = jnp.sqrt(-2.0 * jnp.log(jnp.maximum(tail, 1e-30)))
    z = t - (2.515517 + t * (0.802853 + t * 0.010328)) / (
        1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308))
    )
    return jnp.where(p <= 0.5, z, -z)


def _search_kth(count_ge, smallest_ge, lo, hi, c_lo, rank, *, guess=None, slack=None):
    """The largest code θ with count_ge(θ) ≥ rank, exactly, given count_ge(lo) = c_lo ≥
    rank and count_ge(hi) = 0 (lo < hi); ``smallest_ge(θ)`` is the smallest code ≥ θ.
    Returns (θ, counts taken).

    A search keeping lo (count ≥ rank) and hi (count < rank). The first trial is the
    score ``guess`` when given (the caller's estimate of the rank-th largest score);
    then false position on the scores with the Illinois rule (the end kept twice in a
    row has its count gap halved, so one end cannot stall). Score steps follow the
    distribution where code steps follow its exponent: on the θ sample of normal-like
    rows the search took ~13 counts in code space, ~3 with the guess and score steps
    (WORKSPACE.md, thirteenth session). They end for good after SCORE_STEPS, after
    SCORE_STALLS in a row that did not halve the count gap (a point mass or a gap in
    the scores, whose edge code steps find in ~30 counts and score steps may never),
    or at a trial that is not a finite score (an end at ±inf or NaN, an overflowing
    guess). Then it steps in code space: interpolation of the counts, or bisection when
    the previous step did not halve [lo, hi) or the interval spans more than 2^30 codes
    (there hi - lo may not fit int32, and bisection is as good a guess), so the search
    ends. It stops early when count(≥ lo) is exactly rank: θ is then the smallest code
    ≥ lo. With ``slack`` (≥ 0, maybe traced; an estimate suffices) it stops as soon as
    count(≥ lo) ≤ rank + slack and returns lo, a code whose count is in [rank, rank +
    slack] (or the exact θ, when ties make that window empty).
    """
    f32 = jnp.float32

    def half_span(lo, hi):  # ⌊hi/2⌋ - ⌊lo/2⌋: within 1 of (hi - lo)/2, never overflows
        return (hi >> 1) - (lo >> 1)

    def searching(state):
        lo, hi, c_lo = state[:3]
        return (lo + 1 < hi) & (c_lo > rank + (0 if slack is None else slack))

    def step(state):
        lo, hi, c_lo, c_hi, scoring, stalls, bisect, w_lo, w_hi, side, n = state
        half, gap = half_span(lo, hi), c_lo - c_hi
        gap_lo, gap_hi = w_lo * (c_lo - rank).astype(f32), w_hi * (rank - c_hi).astype(f32)
        frac = gap_lo / (gap_lo + gap_hi)  # c_hi < rank ≤ c_lo: the sum is > 0
        # score space: between the scores of the two ends
        s_lo, s_hi = code_to_score(lo), code_to_score(hi - 1)
        s_trial = s_lo + (s_hi - s_lo) * frac
        if guess is not None:
            s_trial = jnp.where(n == 0, guess, s_trial)
        finite = jnp.abs(s_trial) < jnp.inf
        by_score = (scoring == 1) & (stalls < SCORE_STALLS) & (n < SCORE_STEPS) & finite
        # code space: hi - lo is exact (no wrap) unless the span is huge, where bisection
        # is used; the offset is in integers, so it stays exact where f32 codes would not
        offset = jnp.clip((hi - lo).astype(f32) * frac, 1.0, 2.0**30).astype(jnp.int32)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # ⌊(lo + hi) / 2⌋ without overflow
        interpolate = (bisect == 0) & (half < 2**29)
        by_code = jnp.where(interpolate, lo + offset, mid)
        trial = jnp.where(by_score, score_code(jnp.where(by_score, s_trial, 0.0)), by_code)
        trial = jnp.clip(trial, lo + 1, hi - 1)
        c_trial = count_ge(trial)
        up = c_trial >= rank
        new_lo, c_lo = jnp.where(up, trial, lo), jnp.where(up, c_trial, c_lo)
        new_hi, c_hi = jnp.where(up, hi, trial), jnp.where(up, c_hi, c_trial)
        # Illinois: the end not moved has its weight halved when it stayed last time too
        w_lo = jnp.where(up, 1.0, jnp.where(side < 0, w_lo * 0.5, 1.0))
        w_hi = jnp.where(up, jnp.where(side > 0, w_hi * 0.5, 1.0), 1.0)
        side = jnp.where(up, np.int32(1), np.int32(-1))
        stalls = jnp.where(2 * (c_lo - c_hi) <= gap, 0, stalls + 1)
        # a code step that did not halve [lo, hi) makes the next one a bisection
        halved = (2 * half_span(new_lo, new_hi) <= half).astype(jnp.int32)
        bisect = jnp.where(by_score, bisect, 1 - halved)
        scoring = by_score.astype(jnp.int32)  # the first code step ends score steps
        return new_lo, new_hi, c_lo, c_hi, scoring, stalls, bisect, w_lo, w_hi, side, n + 1

    zero = c_lo * 0
    one = zero.astype(f32) + 1.0
    state = (lo, hi, c_lo, zero, zero + 1, zero, zero, one, one, zero, zero)
    lo, _, c_lo, *_, n = jax.lax.while_loop(searching, step, state)
    if slack is not None:
        return lo, n
    return jnp.where(c_lo == rank, smallest_ge(lo), lo), n


def _kth_code(codes, rank, slack=None, guess=True):
    """The rank-th largest of the live codes (1 ≤ rank ≤ their count), held in
    registers: :func:`_search_kth` between the smallest and the largest code, first
    guessing (``guess``) the score at that rank from the live scores' mean and
    deviation as if they were normal. ``slack``: a code whose count is in [rank, rank
    + slack] will do (see :func:`_search_kth`).

    EMPTY_CODE marks a dead entry. Every trial lies above the smallest live code, so
    the counts need no mask (run 63: a mask there was 1.7-2.5 µs of a decode
    compaction's θ search).
    """
    return _kth_code_counted(codes, rank, slack, guess)[0]


def _kth_code_counted(codes, rank, slack=None, guess=True):
    """:func:`_kth_code` and the number of counts its search took. ``guess=False``: no
    first guess (it costs two more reductions over the codes)."""
    f32 = jnp.float32
    ok = codes != EMPTY_CODE
    n_live = jnp.sum(ok.astype(jnp.int32))

    def count_ge(th):
        return jnp.sum((codes >= th).astype(jnp.int32))

    def smallest_ge(th):
        return jnp.min(jnp.where(codes >= th, codes, _INT_MAX))

    first = None
    if guess:
        x = jnp.where(ok, code_to_score(codes), 0.0)
        n_f = jnp.maximum(n_live, 1).astype(f32)
        mean = jnp.sum(x) / n_f
        deviation = jnp.sqrt(jnp.maximum(jnp.sum(x * x) / n_f - mean * mean, 0.0))
        p = (rank - 0.5) / n_f  # the rank-th of n sits at upper quantile ~(r - ½)/n
        first = mean + _upper_normal_quantile(p) * deviation  # non-finite: ignored
    lo = jnp.min(jnp.where(ok, codes, _INT_MAX))
    hi = jnp.max(jnp.where(ok, codes, _INT_MIN)) + 1  # codes stop below NaN's: no overflow
    return _search_kth(count_ge, smallest_ge, lo, hi, n_live, rank, guess=first, slack=slack)


def _id_cut(count_ties, need):
    """The need-th smallest id among tied entries (INT_MAX when all ties fit).

    ``count_ties(pred)`` counts the ties whose id satisfies ``pred``. Bisection over the
    31 bits of a non-negative id; it runs only when the ties straddle the boundary.
    """

    def bisect():
        def step(b, prefix):
            trial = prefix | jnp.left_shift(jnp.int32(1), 30 - b)
            below = count_ties(lambda i: i < trial)
            return jnp.where(below < need, trial, prefix)

        return jax.lax.fori_loop(0, 31, step, need * 0)

    n_ties = count_ties(lambda i: i >= 0)
    return jax.lax.cond(n_ties > need, bisect, lambda: need * 0 + _INT_MAX)


def _largest_true(holds):
    """Largest unsigned 32-bit u (as an int32 bit pattern) with holds(u), where holds is
    true from u = 0 up to some value and false beyond it.

    Four bits per round: ``holds`` tests 16 trial values at once, so a search that reads
    a whole row per test costs 8 passes instead of bisection's 32 (the exact path of a
    row runs in one program, so its passes are its latency).
    """
    digits = jnp.arange(RADIX, dtype=jnp.int32)

    def step(r, prefix):
        shift = 28 - 4 * r
        ok = holds(prefix | jnp.left_shift(digits, shift))  # ok[0]: prefix itself holds
        return prefix | jnp.left_shift(jnp.sum(ok.astype(jnp.int32)) - 1, shift)

    return jax.lax.fori_loop(0, 8, step, jnp.int32(0))


def _dense_range(start_ref, end_ref, row, shape):
    """Row ``row``'s visible range [lo, hi) of a dense [T, S] ``shape``. A range array of
    n entries serves the rows in groups of T / n (a start of one entry: every row's
    start; ends of B entries: B sequences of T / B heads each, a decode step's lengths),
    clamped as :func:`jsparse._checks.clamp_ranges` (lo to [0, S], hi to [lo, S]):
    sequence lengths and traced ranges are not checked against S, and a caller's
    ranges then need no launch of their own (two a decode step: −1.6 µs at one GQA
    sequence, within noise elsewhere, run 184; one for a traced range's clamp, run 218c)."""
    t, width = shape
    lo = jnp.clip(plt.load(start_ref.at[row // (t // start_ref.shape[0])]), 0, width)
    hi = plt.load(end_ref.at[row // (t // end_ref.shape[0])])
    return lo, jnp.clip(hi, lo, width)


def _row_source(refs, dense, row, blk):
    """(entries, block, lo, hi) of a dense score row or a record row.

    The row's entries sit at positions [lo, hi) of its storage row. ``entries(pos)``
    gathers (codes, ids, ok) at offsets ``pos`` from lo (any shape; EMPTY past the row),
    for the θ sample. ``block(a, masked, raw)`` loads the ``blk`` entries at storage
    positions a .. a+blk-1, a a multiple of blk: (codes, ids, ok), or with ``raw`` (dense
    rows) the scores themselves in place of codes. ``masked=False`` is for blocks inside
    [lo, hi) (every block but a row's first and last): no mask, and ok is None.
    Streaming passes walk aligned blocks so each thread can load 16 contiguous bytes,
    which Triton only emits when the offset is provably aligned; rows whose storage
    length is not a multiple of blk use a gathered load instead.
    """
    lanes = jnp.arange(blk, dtype=jnp.int32)
    if dense:
        scores_ref, start_ref, end_ref = refs
        width = scores_ref.shape[1]
        lo, hi = _dense_range(start_ref, end_ref, row, scores_ref.shape)
        refs_other = ((scores_ref, 0.0),)
    else:
        codes_ref, ids_ref, count_ref = refs
        width = codes_ref.shape[1]
        lo, hi = row * 0, jnp.minimum(plt.load(count_ref.at[row]), width)
        refs_other = ((codes_ref, EMPTY_CODE), (ids_ref, -1))

    def to_entries(loaded, pos, ok, raw):
        if dense:
            (x,) = loaded
            c, i = (x if raw else score_code(x)), pos
        else:
            c, i = loaded
        if ok is not None and not raw:
            c = jnp.where(ok, c, EMPTY_CODE)
        return c, i, ok

    def load(ref, pos, ok, other):  # gathered: any positions
        if ok is None:
            return plt.load(ref.at[row, pos])
        return plt.load(ref.at[row, jnp.where(ok, pos, 0)], mask=ok, other=other)

    def entries(pos):
        ok = pos < hi - lo
        loaded = [load(ref, lo + pos, ok, other) for ref, other in refs_other]
        return to_entries(loaded, lo + pos, ok, raw=False)

    aligned = width % blk == 0

    def block(a, masked=True, raw=False):
        pos = a + lanes
        ok = ((pos >= lo) & (pos < hi)) if masked else None
        if aligned:
            span = pl.ds(pl.multiple_of(a, blk), blk)
            if masked:
                loaded = [plt.load(r.at[row, span], mask=ok, other=o) for r, o in refs_other]
            else:
                loaded = [plt.load(r.at[row, span]) for r, _ in refs_other]
        else:
            loaded = [load(ref, pos, ok, other) for ref, other in refs_other]
        return to_entries(loaded, pos, ok, raw)

    return entries, block, lo, hi


def _aligned_blocks(lo, hi, blk):
    """(first, n): the blk-aligned blocks first, first + blk, ... that touch [lo, hi)."""
    first = lo // blk * blk
    return first, (hi - first + blk - 1) // blk


def _peeled(body, first, n_blocks, blk, carry):
    """``body(a, carry, masked)`` over the aligned blocks first, first + blk, ... (n_blocks
    of them), masking only the first and last: interior blocks lie inside the row and
    load unmasked (run 26: −0.25 ms of 1.85 at 8192 × 64K). n_blocks = 0 (an empty range
    or chunk) reads nothing: the first block is all masked off then and the other two
    parts do not run."""
    carry = body(first, carry, True)
    carry = jax.lax.fori_loop(1, n_blocks - 1, lambda j, c: body(first + j * blk, c, False), carry)
    last = lambda c: body(first + (n_blocks - 1) * blk, c, True)  # noqa: E731
    return jax.lax.cond(n_blocks >= 2, last, lambda c: c, carry)


def _streaming(block, first, n_blocks, blk):
    """count(pred), count_many(preds) and compact(keep, out, base, cap) over the aligned blocks
    first, first + blk, ... (n_blocks of them)."""

    def count(pred):
        def body(j, acc):
            c, i, ok = block(first + j * blk)
            return acc + jnp.sum((ok & pred(c, i)).astype(jnp.int32))

        return jax.lax.fori_loop(0, n_blocks, body, n_blocks * 0)

    def count_many(pred_many):
        """Counts for RADIX predicates in one pass: pred_many(c, i) gives [RADIX, blk]."""

        def body(j, acc):
            c, i, ok = block(first + j * blk)
            return acc + jnp.sum((ok[None, :] & pred_many(c, i)).astype(jnp.int32), axis=1)

        return jax.lax.fori_loop(0, n_blocks, body, jnp.zeros((RADIX,), jnp.int32))

    def compact(keep_fn, out_codes, out_ids, base, cap, trash, raw=False, peel=True):
        """Stores the ids (and codes, unless out_codes is None) of the entries that
        keep_fn(value, id) selects, in row order, at out[base + n] for n < cap; returns
        how many it selected (which may exceed cap). ``raw``: values are dense scores.

        With ``peel``, only the first and last block are masked (:func:`_peeled`), for
        three copies of the loop body; the rare-path kernel does without (its code was
        2.4× the size otherwise).
        """

        def body(a, stored, masked):
            c, i, ok = block(a, masked=masked, raw=raw)
            keep = keep_fn(c, i) if ok is None else keep_fn(c, i) & ok
            keep_i = keep.astype(jnp.int32)
            pos = stored + jnp.cumsum(keep_i) - 1
            store = keep & (pos < cap)
            dst = jnp.where(store, base + pos, trash)
            if out_codes is not None:  # raw scores become codes only here
                plt.store(out_codes.at[dst], score_code(c) if raw else c, mask=store)
            plt.store(out_ids.at[dst], i, mask=store)
            return stored + jnp.sum(keep_i)

        if not peel:
            return jax.lax.fori_loop(
                0, n_blocks, lambda j, s: body(first + j * blk, s, True), n_blocks * 0
            )
        return _peeled(body, first, n_blocks, blk, n_blocks * 0)

    return count, count_many, compact


def _sample_threshold(entries, length, top_k, cap, missed=None):
    """θ ≤ (probably a little below) the K-th code; EMPTY_CODE when the row fits in cap.

    The sample is the whole row when short (θ is then about the K-th code), else 512
    evenly spaced runs of 8 (the last ending at the row's end), ranked by
    :func:`sample_rank`; the search accepts a count up to 1/SAMPLE_SLACK_DIVISOR above
    the rank.
    ``missed``: the row count that this rank gave, outside [K, cap]; then returns (θ,
    θ at the rank rescaled so the expected count lands mid-way between K and cap)
    from the one sample (counts grow about linearly with the sample rank).
    """
    # past a short row's end the sample holds EMPTY, which _kth_code skips
    k = jnp.arange(SAMPLE_BLOCKS * SAMPLE_BLOCK, dtype=jnp.int32)
    sample, _, _ = entries(sample_positions(k, length)[0])
    return sample_threshold_of(sample, length, top_k, cap, missed)


def sample_positions(k, length):
    """(offsets, exists) of θ sample entries ``k`` in a row of ``length`` entries: the
    whole row when it has ≤ 4096 entries, else 512 evenly spaced runs of 8, the last
    ending at the row's end."""
    n_sample = SAMPLE_BLOCKS * SAMPLE_BLOCK
    whole = length <= n_sample
    spread = (k // SAMPLE_BLOCK) * jnp.maximum(length - SAMPLE_BLOCK, 0) // (SAMPLE_BLOCKS - 1)
    pos = jnp.where(whole, k, spread + k % SAMPLE_BLOCK)
    return pos, pos < length


def sample_threshold_of(sample, length, top_k, cap, missed=None):
    """:func:`_sample_threshold` from the sample's codes (EMPTY where an entry does not
    exist), wherever they were scored."""
    n_sample = SAMPLE_BLOCKS * SAMPLE_BLOCK
    whole = length <= n_sample
    f32 = jnp.float32
    ranks = [jnp.where(whole, top_k, sample_rank(top_k, length))]
    if missed is not None:
        missed = jnp.maximum(missed, 1)
        if n_sample * (top_k + cap) < 2**31:
            rescaled = ranks[0] * (top_k + cap) // (2 * missed)
        else:
            rescaled = ranks[0].astype(f32) * ((top_k + cap) / 2) / missed.astype(f32)
            rescaled = jnp.minimum(rescaled, n_sample).astype(jnp.int32)
        ranks.append(jnp.clip(rescaled, 1, n_sample))

    def search(rank):
        return _kth_code(sample, rank, rank // SAMPLE_SLACK_DIVISOR)

    def searches():
        if len(ranks) == 1:
            return (search(ranks[0]),)

        # Both ranks through one loop body: one copy of the search in the kernel (the
        # slow path's), which halves its compile in interpret mode; on the GPU the two
        # searches ran one after the other anyway.
        def body(j, found):
            theta = search(jnp.where(j == 0, ranks[0], ranks[1]))
            return tuple(jnp.where(j == n, theta, old) for n, old in enumerate(found))

        return jax.lax.fori_loop(0, 2, body, (length * 0, length * 0))

    empty = tuple(length * 0 + EMPTY_CODE for _ in ranks)
    thetas = jax.lax.cond(length > cap, searches, lambda: empty)  # fits: keep all
    return thetas if missed is not None else thetas[0]


def _exact_cut(count, count_many, top_k):
    """(θ*, cut): the exact K best entries are those with code > θ*, and those equal to
    θ* with id ≤ cut (ties by smallest id).

    The K-th code θ* is the largest code with at least K entries ≥ it; the tie cut is the
    need-th smallest id among entries equal to θ*. Both are radix-16 searches in the
    unsigned order (x ^ INT_MIN), 8 passes over the row each; the id search runs only
    when the ties straddle the boundary.
    """
    kth = _largest_true(
        lambda u: count_many(lambda c, i: c[None, :] >= (u ^ _INT_MIN)[:, None]) >= top_k
    )
    kth = kth ^ _INT_MIN
    need = top_k - count(lambda c, i: c > kth)

    def id_cut():
        below = lambda u: count_many(  # noqa: E731  ties with id below each trial
            lambda c, i: (c == kth)[None, :] & (i[None, :] < (u ^ _INT_MIN)[:, None])
        )
        return _largest_true(lambda u: below(u) < need) ^ _INT_MIN

    n_ties = count(lambda c, i: c == kth)
    cut = jax.lax.cond(n_ties > need, id_cut, lambda: need * 0 + _INT_MAX)
    return kth, cut


def _at_least(theta, dense):
    """keep(value, id): value ≥ θ. On raw dense scores this compares floats (NaN kept:
    its code ranks above every θ), which the codes' order makes the same test; it spares
    the code conversion of every entry (run 26)."""
    if dense:
        theta_f = code_to_score(theta)
        return lambda x, i: (x >= theta_f) | (x != x)
    return lambda c, i: c >= theta


def _buffer_refs(refs, codes, n_flags):
    """(codes or None, ids, count, flags): the candidate buffer refs that end ``refs``
    (slots, then a count per row or segment, then ``n_flags`` per-row flag refs).
    ``codes``: the buffers hold codes beside the ids (always for records; for dense
    rows when asked, see :func:`compact_rows`)."""
    n_slots = 2 if codes else 1
    bufs = refs[len(refs) - (n_slots + 1 + n_flags) :]
    return bufs[0] if codes else None, bufs[n_slots - 1], bufs[n_slots], bufs[n_slots + 1 :]


def _fits(n, top_k, length, cap):
    """A count of candidates holds the row's Top-K and fits the buffer: in [min(K, L), cap]."""
    return (n >= jnp.minimum(top_k, length)) & (n <= cap)


def _theta_kernel(*refs, dense, top_k, cap, cfg):
    """Program (row): the row's sampled θ (see :func:`_sample_threshold`)."""
    source, theta_ref = refs[:3], refs[3]
    row = pl.program_id(0)
    entries, _, lo, hi = _row_source(source, dense, row, cfg.block)
    plt.store(theta_ref.at[row], _sample_threshold(entries, hi - lo, top_k, cap))


def _chunk_kernel(*refs, dense, codes, top_k, cap, chunks, cfg, theta_given):
    """Program (row, chunk): compacts entries ≥ θ of its chunk of the row.

    With one chunk it writes the final buffer and flags the row for the exact kernel when
    the count missed [min(K, length), cap]; with several it writes segment (row, chunk)
    and the merge kernel finishes the row. The retry and the exact search live in their
    own kernel, so this one is the streaming loop alone. ``theta_given``: θ comes from
    :func:`_theta_kernel` (the 4th input) instead of this program's own sample.
    """
    source = refs[:3]
    codes_ref, ids_ref, count_ref, flags = _buffer_refs(refs, codes, 1 if chunks == 1 else 0)
    row, chunk = pl.program_id(0), pl.program_id(1)
    blk = cfg.block
    entries, block, lo, hi = _row_source(source, dense, row, blk)
    length = hi - lo
    first, total = _aligned_blocks(lo, hi, blk)
    per_chunk = (total + chunks - 1) // chunks
    own = jnp.clip(total - chunk * per_chunk, 0, per_chunk)
    _, _, compact = _streaming(block, first + chunk * per_chunk * blk, own, blk)
    if theta_given:
        theta = plt.load(refs[3].at[row])  # the 4th input, after the row source
    else:
        theta = _sample_threshold(entries, length, top_k, cap)
    segment = row * chunks + chunk
    trash = count_ref.shape[0] * cap  # one past the last slot: never a live index
    keep = _at_least(theta, dense)
    stored = compact(keep, codes_ref, ids_ref, segment * cap, cap, trash, raw=dense)
    if chunks > 1:
        plt.store(count_ref.at[segment], stored)
        return
    fast_ok = _fits(stored, top_k, length, cap)
    plt.store(count_ref.at[row], stored)  # unclipped: a missed count steers the retry
    plt.store(flags[0].at[row], jnp.where(fast_ok, FAST, RETRIED))  # flagged: exact kernel


def _merge_kernel(*refs, dense, codes, seg_codes, top_k, cap, chunks, cfg):
    """Program (row, chunk): copies segment (row, chunk) to its place in the row's buffer,
    after the segments before it; when the row's total missed [min(K, length), cap], no
    program copies and chunk 0 runs the row's slow path (:func:`_exact_row`) itself.
    ``codes`` without ``seg_codes`` (dense rows): the segments hold ids only, and each
    copied id's code comes from its score in the row (see ``MERGE_WRITES_CODES``).

    One program per segment: a program per row copied the segments one after another,
    a chain of dependent loads and stores (run 33: 6.5-11.6 µs of a decode step). The
    slow path here, not in a kernel of its own: that launch cost ~1 µs of every decode
    step for rows that almost never take it (run 66)."""
    source = refs[:3]
    n_segment_refs = (2 if seg_codes else 1) + 1  # (codes,) ids, counts: after the source
    seg_codes_ref, seg_ids_ref, seg_count_ref, _ = _buffer_refs(
        refs[: 3 + n_segment_refs], seg_codes, 0
    )
    codes_ref, ids_ref, count_ref, (slow_ref,) = _buffer_refs(refs, codes, 1)
    row, chunk = pl.program_id(0), pl.program_id(1)
    blk = cfg.block
    _, _, lo, hi = _row_source(source, dense, row, blk)
    length = hi - lo
    c_pad = 1 << (chunks - 1).bit_length()
    lane = jnp.arange(c_pad, dtype=jnp.int32)
    seg_counts = plt.load(
        seg_count_ref.at[row * chunks + jnp.where(lane < chunks, lane, 0)],
        mask=lane < chunks, other=0,
    )  # fmt: skip
    total = jnp.sum(seg_counts)
    fast_ok = _fits(total, top_k, length, cap)
    trash = count_ref.shape[0] * cap
    lanes = jnp.arange(blk, dtype=jnp.int32)
    n = jnp.sum(jnp.where(lane == chunk, seg_counts, 0))
    offset = jnp.sum(jnp.where(lane < chunk, seg_counts, 0))
    src = (row * chunks + chunk) * cap

    def copy(j, carry):
        pos = j * blk + lanes
        ok = pos < n
        safe = src + jnp.where(ok, pos, 0)
        dst = jnp.where(ok, row * cap + offset + pos, trash)
        vi = plt.load(seg_ids_ref.at[safe], mask=ok, other=-1)
        plt.store(ids_ref.at[dst], vi, mask=ok)
        if seg_codes_ref is not None:
            vc = plt.load(seg_codes_ref.at[safe], mask=ok, other=EMPTY_CODE)
            plt.store(codes_ref.at[dst], vc, mask=ok)
        elif codes_ref is not None:  # a dense row's id is its column
            x = plt.load(source[0].at[row, jnp.where(ok, vi, 0)], mask=ok, other=0.0)
            plt.store(codes_ref.at[dst], score_code(x), mask=ok)
        return carry

    # A missed total copies nothing: chunk 0 writes the whole row, and the total steers
    # its retry.
    n_copies = jnp.where(fast_ok, (n + blk - 1) // blk, 0)
    jax.lax.fori_loop(0, n_copies, copy, 0)

    @pl.when((chunk == 0) & fast_ok)
    def _():
        plt.store(count_ref.at[row], total)
        plt.store(slow_ref.at[row], FAST)

    @pl.when((chunk == 0) & ~fast_ok)
    def _():
        outs = (codes_ref, ids_ref, count_ref, slow_ref)
        _exact_row(source, dense, row, total, outs, top_k=top_k, cap=cap, cfg=cfg)


def _ladder(lo, hi):
    """RADIX codes evenly spaced strictly inside (lo, hi), ascending (lo < hi)."""
    f32 = jnp.float32
    steps = (jnp.arange(RADIX, dtype=jnp.int32) + 1).astype(f32) / (RADIX + 1)
    at = lo.astype(f32) + (hi.astype(f32) - lo.astype(f32)) * steps  # f32: no int overflow
    return jnp.clip(jnp.clip(at, -(2.0**31) + 256, 2.0**31 - 256).astype(jnp.int32), lo, hi)


def _exact_row(source, dense, row, missed, outs, *, top_k, cap, cfg):
    """The slow path of a row whose first count ``missed`` [min(K, length), cap]; writes
    the row's buffer, count and path flag (``outs``: codes or None, ids, count, flag refs).

    First one retry: θ from the same sample at a rank rescaled by the count the first θ
    gave, one compaction pass (run 24: 3 of 8192 i.i.d. rows at 128K miss [K, cap], and
    the exact search costs ~19 passes in one program). When the two counts bracket the
    window (one below K, one above cap: the rank-to-count relation was not linear, as on
    rows with clusters of high scores, run 27), one pass counts 16 thresholds evenly
    spaced between the two θ and compaction takes the highest that lands in [K, cap].
    Otherwise (massive ties), the exact radix search.
    """
    codes_ref, ids_ref, count_ref, slow_ref = outs
    blk = cfg.block
    entries, block, lo, hi = _row_source(source, dense, row, blk)
    count, count_many, compact = _streaming(block, *_aligned_blocks(lo, hi, blk), blk)
    trash = count_ref.shape[0] * cap
    length = hi - lo

    def into_row(theta):  # compacts the entries ≥ θ; returns their count
        keep = _at_least(theta, dense)
        return compact(keep, codes_ref, ids_ref, row * cap, cap, trash, raw=dense, peel=False)

    first, theta = _sample_threshold(entries, length, top_k, cap, missed=missed)
    stored = into_row(theta)

    def search():
        kth, cut = _exact_cut(count, count_many, top_k)
        return kth, cut, stored * 0 + SEARCHED

    def ladder():
        trial = _ladder(jnp.minimum(theta, first), jnp.maximum(theta, first))
        counts = count_many(lambda c, i: c[None, :] >= trial[:, None])
        good = _fits(counts, top_k, length, cap)
        best = jnp.max(jnp.where(good, trial, _INT_MIN))  # the fewest candidates
        found = jnp.sum(good.astype(jnp.int32)) > 0
        ladder_cut = lambda: (best, best * 0 + _INT_MAX, best * 0 + RETRIED)  # noqa: E731
        return jax.lax.cond(found, ladder_cut, search)

    def recompact():
        # Ladder or search: one compaction on codes, as they counted (a ladder code
        # need not be a score's code: it can fall among subnormals, which a float
        # compare may flush to zero). One call site keeps the kernel's code small.
        bracketed = (stored > cap) != (missed > cap)
        kth, cut, path = jax.lax.cond(bracketed, ladder, search)
        keep = lambda c, i: (c > kth) | ((c == kth) & (i <= cut))  # noqa: E731
        return compact(keep, codes_ref, ids_ref, row * cap, cap, trash, peel=False), path

    final, path = jax.lax.cond(
        _fits(stored, top_k, length, cap), lambda: (stored, stored * 0 + RETRIED), recompact
    )
    plt.store(slow_ref.at[row], path)
    plt.store(count_ref.at[row], jnp.minimum(final, cap))


def _exact_kernel(*refs, dense, codes, top_k, cap, cfg):
    """Program (row): the slow path (:func:`_exact_row`) of a row flagged by the
    compaction kernel of whole rows; other rows return at once and keep their buffers
    (aliased in and out). Rows split over chunks take it inside the merge kernel."""
    source = refs[:3]
    codes_ref, ids_ref, count_ref, (slow_ref,) = _buffer_refs(refs, codes, 1)  # aliased in/out
    row = pl.program_id(0)

    @pl.when(plt.load(slow_ref.at[row]) != 0)
    def _():
        missed = plt.load(count_ref.at[row])
        _exact_row(source, dense, row, missed, (codes_ref, ids_ref, count_ref, slow_ref),
                   top_k=top_k, cap=cap, cfg=cfg)  # fmt: skip


# Whole dense rows (one program a row, the 8192-row selection) compact in two launches:
# a streaming pass stores one bit an entry (32-entry words, contiguous stores); a
# second launch counts each row's bits and expands the words of fast rows into ids
# (flagged rows go to the exact kernel, as before). The one-pass
# compaction stores through a per-entry scattered store whose instructions, issued for
# every entry though ~4% are kept, cost ~75% on top of the loads (run 40: 491 → 877 µs
# at 8192 × 64K); the expansion stores one lane a word per round instead, as many rounds
# as the row's fullest word has bits (~7 at 4% kept). 8192 × 64K: 967 → 693 µs, the
# sorted selection 2.22 → 1.95 ms (run 97). Writing codes in the expansion (gathered by
# id, a gather a round) for select_candidates cost 700 µs more there than the select
# saved (run 98).
# The expansion, not the streaming pass, counts each row's bits (popcounts of words it
# loads anyway): summing every block across the streaming pass's warps (a barrier a
# block) cost keep bits 579 against 560 µs, the expansion 114 against 120, at 8192 ×
# 64K (run 98).
KEEP_BITS = True
EXPAND_WORDS = 2048  # words per step of the expansion (16 a thread at 4 warps)
# Rows split over chunks (decode), from this many rows and entries in all, write keep
# bits too, each chunk program its part of the row's words, and the whole-row
# expansion follows: the split compaction's per-entry stores are the same ~75% over
# its loads as above. Run 177, 256 rows × 128K: compaction + merge 83.3 µs → keep bits
# 37.8 + expansion 10.1 + an idle exact launch; the 32 × 128K GQA decode step 511 →
# 478 µs. 64 rows: −2 to −3 µs at 64K and 128K (8 × 128K step 162 → 159; `topk`
# 64 × 64K / 128K −1.9 / −2.2), but +3.4 at 32K (run 178: 8 × 32K step 87.0 → 90.4, the
# expansion's latency over a short compaction); 256 × 32K −15 (233 → 218). None: never.
SPLIT_KEEP_BITS_MIN_ROWS: int | None = 64
SPLIT_KEEP_BITS_MIN_ENTRIES = 1 << 22


def _keep_bits_kernel(scores_ref, start_ref, end_ref, theta_ref, words_ref, *, cfg, chunks):
    """Program (row, chunk): bit j of word w is whether entry 32·w + j of the row is ≥ θ
    and visible; the words of the chunk's share of the aligned blocks that touch the
    row's range are written (others are never read). The expansion counts them."""
    row, chunk = pl.program_id(0), pl.program_id(1)
    blk = cfg.block
    n_words = blk // 32
    _, block, lo, hi = _row_source((scores_ref, start_ref, end_ref), True, row, blk)
    keep = _at_least(plt.load(theta_ref.at[row]), True)
    shifts = jnp.arange(32, dtype=jnp.int32)[None, :]

    def body(a, carry, masked):
        x, i, ok = block(a, masked=masked, raw=True)
        kept = keep(x, i) if ok is None else keep(x, i) & ok
        # the [32, 32] view is free (run 97: the same time as loading it 2D); distinct
        # bits: the sum is their OR (bit 31 included, no carry)
        kept_i = kept.astype(jnp.int32).reshape(n_words, 32)
        words = jnp.sum(jnp.left_shift(kept_i, shifts), axis=1)
        at = words_ref.at[row, pl.ds(pl.multiple_of(a // 32, n_words), n_words)]
        if masked:
            # _peeled runs the first block even when there are none: an empty row at
            # the end of a block-aligned width (or an empty chunk) would store past its
            # words, into the next row's. Interior blocks lie inside the row.
            plt.store(at, words, mask=jnp.broadcast_to(a < hi, (n_words,)))
        else:
            plt.store(at, words)
        return carry

    first, total = _aligned_blocks(lo, hi, blk)
    per_chunk = (total + chunks - 1) // chunks
    own = jnp.clip(total - chunk * per_chunk, 0, per_chunk)
    _peeled(body, first + chunk * per_chunk * blk, own, blk, own * 0)


def _expand_bits_kernel(*refs, top_k, cap, cfg, codes, width):
    """Program (row): the row's count (popcounts of its words) and fast-path flag; a fast
    row's words become its candidate ids, in id order: round r stores each word's r-th
    lowest set bit at the word's offset + r. Flagged rows are left to the exact kernel.
    ``codes``: the code of each id's score is stored too."""
    if codes:
        words_ref, start_ref, end_ref, scores_ref, codes_ref, ids_ref, count_ref, flag_ref = refs
    else:
        words_ref, start_ref, end_ref, ids_ref, count_ref, flag_ref = refs
        scores_ref = codes_ref = None
    row = pl.program_id(0)
    blk = cfg.block
    lo, hi = _dense_range(start_ref, end_ref, row, (words_ref.shape[0], width))
    first, n_blocks = _aligned_blocks(lo, hi, blk)
    w0, n_w = first // 32, n_blocks * (blk // 32)
    lanes = jnp.arange(EXPAND_WORDS, dtype=jnp.int32)
    trash = ids_ref.shape[0]  # one past the last slot: never a live index
    n_steps = (n_w + EXPAND_WORDS - 1) // EXPAND_WORDS

    def words(j):
        at = j * EXPAND_WORDS + lanes
        ok = at < n_w
        return at, plt.load(words_ref.at[row, w0 + jnp.where(ok, at, 0)], mask=ok, other=0)

    def step(j, stored):
        at, w = words(j)
        bits = jax.lax.population_count(w)
        offset = stored + jnp.cumsum(bits) - bits

        def one_round(r, w):
            lowest = w & -w
            pos = offset + r
            live = (w != 0) & (pos < cap)
            key = (w0 + at) * 32 + (31 - jax.lax.clz(lowest))
            dst = jnp.where(live, row * cap + pos, trash)
            plt.store(ids_ref.at[dst], key, mask=live)
            if codes_ref is not None:
                x = plt.load(scores_ref.at[row, jnp.where(live, key, 0)], mask=live, other=0.0)
                plt.store(codes_ref.at[dst], score_code(x), mask=live)
            return w & (w - 1)

        jax.lax.fori_loop(0, jnp.max(bits), one_round, w)
        return stored + jnp.sum(bits)

    count = jax.lax.fori_loop(
        0, n_steps, lambda j, c: c + jnp.sum(jax.lax.population_count(words(j)[1])), n_w * 0
    )
    fast = _fits(count, top_k, hi - lo, cap)
    plt.store(count_ref.at[row], count)
    plt.store(flag_ref.at[row], jnp.where(fast, FAST, RETRIED))

    @pl.when(fast)
    def _():
        jax.lax.fori_loop(0, n_steps, step, n_w * 0)


# Dense rows split over chunks, with codes asked for (decode): the merge kernel writes
# the codes, from each copied id's score, instead of the chunk programs as they keep
# entries: −0.4 to −1.9 µs a decode step at 1 and 8 rows (run 71; written as kept, they
# cost the chunk kernel 0.8-1.1 µs, and the merge's gathers next to nothing).
MERGE_WRITES_CODES = True


# Entries a chunk program streams at least (decode: 16 chunks of a 64K row at 8 rows).
# Each chunk program also runs the row's θ search, so more chunks means more searches:
# one row gains from chunks of 1024 (64 chunks of a 64K row: −1.3 to −2.0 µs a step,
# run 76), eight rows lose (+4 to +5 µs with 64 chunks a row, 512 programs).
MIN_CHUNK_ENTRIES = 4096
# Split rows from this many: θ found once a row by a kernel of its own, which the chunk
# programs read, instead of each chunk program repeating the row's search (9-16 times a
# row, on SMs the streaming needs too). Selection alone, L2-hot rows (WORKSPACE.md, run
# 128): 64 × 64K 51.0 → 46.3 µs, 64 × 128K 67.6 → 60.0; 1 and 8 rows lose 0.8 (one more
# launch, and their searches ran on idle SMs). None: never.
SHARED_THETA_MIN_ROWS: int | None = 64
ONE_ROW_CHUNK_ENTRIES = 1024
MAX_CHUNKS = 64
# Chunk programs per SM the split is sized for. At 256 rows × 128K (a 32-sequence GQA
# decode step) 4 gives 3 chunks a row and the compaction reads at ~1.3 TB/s (run 162).
CHUNK_PROGRAMS_PER_SM = 4
# At least this many chunks a row while rows × chunks stay within 16 programs an SM (1:
# no floor). Run 172, 256 rows × 128K: 9 chunks a row (16 an SM) read in 81.5 µs against
# 103 at 3; at 64 rows, 33 chunks lost to 9 (the merge grows). Run 174 with this floor:
# 256 rows × 128K 104.3 → 78.1 µs, the GQA decode step 554 → 533; 64 rows unchanged.
MIN_ROW_CHUNKS = 8


def default_chunks(rows: int, length: int) -> int:
    """Programs per row: enough rows × chunks to fill the GPU (CHUNK_PROGRAMS_PER_SM per
    SM) and at least ``MIN_ROW_CHUNKS`` while that stays within 16 programs an SM, each
    chunk at least ``MIN_CHUNK_ENTRIES`` long (``ONE_ROW_CHUNK_ENTRIES`` for a single
    row), at most ``MAX_CHUNKS`` of them."""
    entries = ONE_ROW_CHUNK_ENTRIES if rows == 1 else MIN_CHUNK_ENTRIES
    sms = backend.sm_count()
    fill = -(-CHUNK_PROGRAMS_PER_SM * sms // rows)
    fill = max(fill, min(MIN_ROW_CHUNKS, 16 * sms // rows))
    return int(max(1, min(fill, length // entries, MAX_CHUNKS)))


def _compact_call(inputs, t, top_k, cap, dense, cfg, chunks, codes):
    compiler = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    interpret = backend.is_interpret()
    i32 = jnp.int32

    def buffers(n, with_codes=codes):
        # (codes,) ids, count. No init: nothing reads a slot past its count.
        slots = jax.ShapeDtypeStruct((n * cap,), i32)
        return (slots,) * (2 if with_codes else 1) + (jax.ShapeDtypeStruct((n,), i32),)

    statics = dict(dense=dense, codes=codes, top_k=top_k, cap=cap, chunks=chunks, cfg=cfg)
    flag = jax.ShapeDtypeStruct((t,), i32)

    def theta_call(num_warps):  # each row's sampled θ, one program a row
        return pallas_call(
            functools.partial(_theta_kernel, dense=dense, top_k=top_k, cap=cap, cfg=cfg),
            grid=(t,),
            out_shape=flag,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=cfg.num_stages),
            interpret=interpret,
            name="jsparse_topk_theta",
        )(*inputs)

    split_bits = (
        dense and KEEP_BITS and chunks > 1
        and SPLIT_KEEP_BITS_MIN_ROWS is not None and t >= SPLIT_KEEP_BITS_MIN_ROWS
        and t * inputs[0].shape[1] >= SPLIT_KEEP_BITS_MIN_ENTRIES
    )  # fmt: skip
    if chunks == 1 or split_bits:
        # θ in a kernel of its own: its sample (4096 entries held in registers) would
        # set the streaming kernel's register count and so its rows per SM, and its
        # reductions would delay every row's first load (run 33: streaming with θ given
        # 1.21-1.28 ms against 1.76-1.87 with θ sampled inside; θ's kernel 0.24 ms at
        # 8192 × 64K, run 40). Rows split over chunks (decode) sample in each chunk
        # program below SHARED_THETA_MIN_ROWS rows (run 61: the θ kernel saved nothing
        # at 1 and 8 rows).
        theta = theta_call(cfg.split_num_warps if split_bits else cfg.num_warps)
        if dense and KEEP_BITS:
            bufs, slow = _keep_bits_compaction(inputs, theta, t, top_k, cap, cfg, codes, chunks)
        else:
            *bufs, slow = pallas_call(
                functools.partial(_chunk_kernel, **statics, theta_given=True),
                grid=(t, 1),
                out_shape=(*buffers(t), flag),
                compiler_params=compiler,
                interpret=interpret,
                name="jsparse_topk_compact",
            )(*inputs, theta)
        n_out = len(bufs) + 1  # flagged rows: the slow path, in place
        *bufs, slow = pallas_call(
            functools.partial(
                _exact_kernel, dense=dense, codes=codes, top_k=top_k, cap=cap, cfg=cfg
            ),
            grid=(t,),
            out_shape=(*buffers(t), flag),
            input_output_aliases={3 + k: k for k in range(n_out)},
            compiler_params=compiler,
            interpret=interpret,
            name="jsparse_topk_exact",
        )(*inputs, *bufs, slow)
    else:  # the merge kernel takes flagged rows' slow path itself
        n_seg = t * chunks
        seg_codes = codes and not (dense and MERGE_WRITES_CODES)
        shared_theta = SHARED_THETA_MIN_ROWS is not None and t >= SHARED_THETA_MIN_ROWS
        theta = (theta_call(cfg.split_num_warps),) if shared_theta else ()
        segments = pallas_call(
            functools.partial(
                _chunk_kernel, **statics | dict(codes=seg_codes), theta_given=shared_theta
            ),
            grid=(t, chunks),
            out_shape=buffers(n_seg, seg_codes),
            compiler_params=plt.CompilerParams(
                num_warps=cfg.split_num_warps, num_stages=cfg.num_stages
            ),
            interpret=interpret,
            name="jsparse_topk_compact_chunks",
        )(*inputs, *theta)
        *bufs, slow = pallas_call(
            functools.partial(_merge_kernel, **statics, seg_codes=seg_codes),
            grid=(t, chunks),
            out_shape=(*buffers(t), flag),
            compiler_params=compiler,
            interpret=interpret,
            name="jsparse_topk_merge",
        )(*inputs, *segments)
    *slots, count = bufs
    return (*(x.reshape(t, cap) for x in slots), count, slow)


def _keep_bits_compaction(inputs, theta, t, top_k, cap, cfg, codes, chunks=1):
    """(buffers, flag) of whole dense rows through keep bits (see ``KEEP_BITS``): the
    same (codes,) ids, count and flag as the one-pass compaction; flagged rows' slots
    are left for the exact kernel. ``chunks`` programs write each row's words."""
    scores, start, end = inputs
    blk, i32 = cfg.block, jnp.int32
    compiler = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    interpret = backend.is_interpret()
    n_words = -(-scores.shape[1] // blk) * (blk // 32)  # every aligned block has its words
    words = pallas_call(
        functools.partial(_keep_bits_kernel, cfg=cfg, chunks=chunks),
        grid=(t, chunks),
        # no init: words outside a row's blocks are never read
        out_shape=jax.ShapeDtypeStruct((t, n_words), i32),
        compiler_params=compiler,
        interpret=interpret,
        name="jsparse_topk_keep_bits",
    )(scores, start, end, theta)
    slots = jax.ShapeDtypeStruct((t * cap,), i32)  # no init: nothing reads past a count
    per_row = jax.ShapeDtypeStruct((t,), i32)
    *bufs, flag = pallas_call(
        functools.partial(
            _expand_bits_kernel, top_k=top_k, cap=cap, cfg=cfg, codes=codes, width=scores.shape[1]
        ),
        grid=(t,),
        out_shape=(slots,) * (2 if codes else 1) + (per_row, per_row),
        compiler_params=compiler,
        interpret=interpret,
        name="jsparse_topk_expand",
    )(words, start, end, *((scores,) if codes else ()))
    return bufs, flag


def compact_rows(scores, start, end, top_k, cap, cfg=SelectConfig(), chunks=None, *,
                 with_codes=False):  # fmt: skip
    """Candidate ids [T, cap] (id order) holding each row's exact Top-K; no codes: the
    select gathers their scores back (:func:`select_rows`). Slots past a row's count
    are undefined.

    ``scores`` [T, S] is read only inside ``[start[t], end[t])``; ``start`` and ``end``
    may also hold one entry per group of rows (n entries, n dividing T: row t reads
    entry t // (T / n)), clamped as :func:`_dense_range` reads them. Returns (ids, count
    [T], slow [T] int32: the path each row took, FAST (0) for the sampled θ, RETRIED (1)
    for one retry at a rescaled rank, SEARCHED (2) for the exact radix search).
    ``cap ≥ top_k``. A row that a ladder of thresholds rescued also reports RETRIED.
    ``chunks`` programs share a row (default: :func:`default_chunks`),
    for few rows. ``with_codes``: returns (codes, ids, count, slow), the codes of the
    candidates' scores, written by the compaction (as kept, or by the merge of split
    rows: ``MERGE_WRITES_CODES``) for decode rows, where gathering them back was its
    own launch (~1.5 µs a step, run 67). Not by default: many rows would pay one more
    store per kept entry (run 41).
    """
    t, s = scores.shape
    for name, r in (("start", start), ("end", end)):
        if r.ndim != 1 or r.shape[0] == 0 or t % r.shape[0]:
            raise ValueError(
                f"{name}: shape {tuple(r.shape)}; expected [n] with n dividing T = {t}"
            )
    chunks = chunks or default_chunks(t, s)
    inputs = (scores, start, end)
    return _compact_call(inputs, t, top_k, cap, True, cfg, chunks, codes=with_codes)


def compact_records(codes, ids, counts, top_k, cap, cfg=SelectConfig(), chunks=None):
    """:func:`compact_rows` for record rows (codes, ids [T, C], valid counts [T]); returns
    (codes, ids, count, slow)."""
    t, n = codes.shape
    chunks = chunks or default_chunks(t, n)
    return _compact_call((codes, ids, counts), t, top_k, cap, False, cfg, chunks, codes=True)


def _select_kernel(src_ref, ids_ref, count_ref, out_codes_ref, out_ids_ref, kth_ref,
                   *, top_k, cap, gather, cfg, scores_out):  # fmt: skip
    """Program (row). ``src_ref``: the candidates' codes [T·cap], or with ``gather`` the
    dense score rows [T, S] that the candidate ids index. ``scores_out``: the set is
    written as scores (-inf / -1 padding), the final unsorted output, instead of codes."""
    row = pl.program_id(0)
    n = jnp.minimum(plt.load(count_ref.at[row]), cap)
    trash = count_ref.shape[0] * top_k  # one past the last slot: never a live index

    def load(j, blk):
        idx = j * blk + jnp.arange(blk, dtype=jnp.int32)
        ok = idx < n
        src = row * cap + jnp.where(ok, idx, 0)
        i = plt.load(ids_ref.at[src], mask=ok, other=-1)
        if gather:
            x = plt.load(src_ref.at[row, jnp.where(ok, i, 0)], mask=ok, other=0.0)
            c = score_code(x)
        else:
            c = plt.load(src_ref.at[src], mask=ok, other=EMPTY_CODE)
        return jnp.where(ok, c, EMPTY_CODE), i, ok

    def write(c, i, ok, kth, cut, stored):  # ok None: empty lanes are EMPTY / INT_MAX
        keep = (c > kth) | ((c == kth) & (i <= cut))
        keep = keep if ok is None else ok & keep
        keep_i = keep.astype(jnp.int32)
        pos = stored + jnp.cumsum(keep_i) - 1
        store = keep & (pos < top_k)
        dst = jnp.where(store, row * top_k + pos, trash)
        plt.store(out_codes_ref.at[dst], code_to_score(c) if scores_out else c, mask=store)
        plt.store(out_ids_ref.at[dst], i, mask=store)
        return stored + jnp.sum(keep_i)

    def tie_cut(count, kth):
        need = top_k - count(lambda c, i: c > kth)
        return _id_cut(lambda pred: count(lambda c, i: (c == kth) & pred(i)), need)

    # Fewer than K candidates: every live one enters. The cut sits below INT_MAX, the id
    # the resident path gives empty lanes. (Branch results derive from a traced value:
    # Triton's scf.if cannot yield constants.)
    all_live = lambda: (n * 0 + EMPTY_CODE, n * 0 + _INT_MAX - 1)  # noqa: E731

    def resident(blk):  # one load; every pass runs on registers
        # No lane mask held (run 37: −10-16% time): an empty lane has EMPTY_CODE, below
        # every score's code, and id INT_MAX, above every cut, so nothing below keeps it.
        c, i, ok = load(0, blk)
        i = jnp.where(ok, i, _INT_MAX)

        def count(pred):
            return jnp.sum(((c != EMPTY_CODE) & pred(c, i)).astype(jnp.int32))

        def threshold():
            kth = _kth_code(c, top_k, guess=SELECT_GUESS)
            return kth, tie_cut(count, kth)

        kth, cut = jax.lax.cond(n >= top_k, threshold, all_live)
        return kth, write(c, i, None, kth, cut, n * 0)

    def streamed(blk):  # buffers too long for registers: passes over blocks
        n_blocks = (n + blk - 1) // blk

        def count(pred):
            def body(j, acc):
                c, i, ok = load(j, blk)
                return acc + jnp.sum((ok & pred(c, i)).astype(jnp.int32))

            return jax.lax.fori_loop(0, n_blocks, body, n * 0)

        def threshold():
            def step(b, prefix):  # bisection over the bits, in the unsigned order
                trial = prefix | jnp.left_shift(jnp.int32(1), 31 - b)
                ok = count(lambda c, i: c >= (trial ^ _INT_MIN)) >= top_k
                return jnp.where(ok, trial, prefix)

            kth = jax.lax.fori_loop(0, 32, step, n * 0) ^ _INT_MIN
            return kth, tie_cut(count, kth)

        kth, cut = jax.lax.cond(n >= top_k, threshold, all_live)
        stored = jax.lax.fori_loop(
            0, n_blocks, lambda j, s: write(*load(j, blk), kth, cut, s), n * 0
        )
        return kth, stored

    def pad(stored):  # slots past a short row's entries: EMPTY / -1 (no init pass)
        blk = cfg.block
        lanes = jnp.arange(blk, dtype=jnp.int32)

        def body(j, carry):
            slot = j * blk + lanes
            empty = (slot >= stored) & (slot < top_k)
            dst = jnp.where(empty, row * top_k + slot, trash)
            empty_value = jnp.full((blk,), -jnp.inf if scores_out else EMPTY_CODE)
            plt.store(out_codes_ref.at[dst], empty_value, mask=empty)
            plt.store(out_ids_ref.at[dst], jnp.full((blk,), -1, jnp.int32), mask=empty)
            return carry

        jax.lax.fori_loop(stored // blk, (top_k + blk - 1) // blk, body, 0)

    full = 1 << (cap - 1).bit_length()
    if cap > MAX_RESIDENT:
        kth, stored = streamed(cfg.block)
    elif full > SMALL_RESIDENT:  # most rows hold far fewer than cap: a half-size block
        kth, stored = jax.lax.cond(
            n <= SMALL_RESIDENT, lambda: resident(SMALL_RESIDENT), lambda: resident(full)
        )
    else:
        kth, stored = resident(full)
    pad(stored)
    plt.store(kth_ref.at[row], kth)


# Fewer rows than SMs (a decode step's 64): each row's program runs alone on its SM,
# and the kernel lasts as long as one program, so warps that shorten a program's chain
# pay where they lose throughput over thousands of rows. 64 rows × 64K / 128K (run 126,
# µs): select_rows 25.3 → 14.1 at 8 warps (against 4), the bitonic order 14.8 → 12.7 at
# 16 (against 8). 16 warps for the select were not measured.
FEW_ROWS_SELECT_WARPS = 8
FEW_ROWS_BITONIC_WARPS = 16


def _few_rows(rows: int) -> bool:
    """Fewer rows than SMs: one program a row leaves each alone on its SM (see above)."""
    return rows < backend.sm_count()


def _select_call(src, ids, counts, top_k, gather, cfg, scores_out=False):
    t, cap = ids.shape
    if cfg is None:
        cfg = SelectConfig(num_warps=FEW_ROWS_SELECT_WARPS) if _few_rows(t) else SelectConfig()
    kernel = functools.partial(
        _select_kernel, top_k=top_k, cap=cap, gather=gather, cfg=cfg, scores_out=scores_out
    )
    out_codes, out_ids, kth = pallas_call(
        kernel,
        grid=(t,),
        out_shape=(
            jax.ShapeDtypeStruct((t * top_k,), jnp.float32 if scores_out else jnp.int32),
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32),
        ),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=backend.is_interpret(),
        name="jsparse_topk_select_rows" if gather else "jsparse_topk_select",
    )(src, ids.reshape(-1), counts)
    return out_codes.reshape(t, top_k), out_ids.reshape(t, top_k), kth


def select_candidates(codes, ids, counts, top_k, cfg=None, *, scores_out=False):
    """Exact Top-K set of each row's candidates, in input order.

    codes, ids: [T, cap]; counts: [T] (values beyond cap are clipped: callers handle
    overflow before this). Returns (codes [T, K], ids [T, K] with EMPTY/-1 padding,
    kth [T]: the K-th largest code, EMPTY_CODE when a row has fewer than K candidates).
    ``scores_out``: scores [T, K] (padding -inf) in place of the codes: the final
    unsorted output, without a conversion pass over it (63 µs at 8192 rows, run 90).
    ``cfg`` None: the default, at FEW_ROWS_SELECT_WARPS for fewer rows than SMs.
    """
    return _select_call(codes.reshape(-1), ids, counts, top_k, False, cfg, scores_out)


def select_rows(scores, ids, counts, top_k, cfg=None, *, scores_out=False):
    """:func:`select_candidates` for the candidate ids of dense score rows [T, S] (from
    :func:`compact_rows`): each candidate's score is gathered from its row by id."""
    return _select_call(scores, ids, counts, top_k, True, cfg, scores_out)


RANK_ORDER_PAIRS = 1 << 26  # T·K² up to this: order by ranks (one kernel), else XLA's sort


def _rank_order_kernel(codes_ref, ids_ref, out_ids_ref, out_scores_ref, *, k, bi, bj, id_ordered):
    """Program (row, part): the final position of each of the part's ``bi`` entries is
    the number of the row's entries that precede it (score descending, then id
    ascending), counted against all ``k`` in blocks of ``bj``; the row is written as a
    permutation, every slot once. Keys are unique: ids are, and empty slots (whose
    ids mean nothing) rank last, among themselves by slot."""
    row, part = pl.program_id(0), pl.program_id(1)

    def entries(first, n):
        slot = first + jnp.arange(n, dtype=jnp.int32)
        ok = slot < k
        at = jnp.where(ok, slot, 0)
        c = plt.load(codes_ref.at[row, at], mask=ok, other=EMPTY_CODE)
        i = plt.load(ids_ref.at[row, at], mask=ok, other=0)
        # id order is slot order when the row is id-ordered; empties order by slot
        key = slot if id_ordered else jnp.where(c == EMPTY_CODE, slot, i)
        return c, i, key, ok

    ci, ii, key_i, ok_i = entries(part * bi, bi)

    def body(j, rank):
        cj, _, key_j, ok_j = entries(j * bj, bj)
        ahead = (cj[None, :] > ci[:, None]) | (
            (cj[None, :] == ci[:, None]) & (key_j[None, :] < key_i[:, None])
        )
        return rank + jnp.sum((ok_j[None, :] & ahead).astype(jnp.int32), axis=1)

    rank = jax.lax.fori_loop(0, -(-k // bj), body, jnp.zeros((bi,), jnp.int32))
    # lanes past k own the padding slots k.. (their own slot): every slot written
    # once, no masked scatter (interpret mode resolves a masked duplicate arbitrarily)
    at = jnp.where(ok_i, rank, part * bi + jnp.arange(bi, dtype=jnp.int32))
    plt.store(out_ids_ref.at[row, at], jnp.where(ci == EMPTY_CODE, -1, ii))
    plt.store(out_scores_ref.at[row, at], code_to_score(ci))


def rank_order(codes, ids, *, id_ordered=False, tile=16384):
    """:func:`order_topk` in one kernel for few rows (T·K² ≤ ``RANK_ORDER_PAIRS``): each
    entry's position is its rank, counted against the whole row. XLA's sort of a
    [1-64, 2048] set costs ~21 µs on an H200 whatever the row count (run 33), a fifth
    of a one-query decode step."""
    t, k = codes.shape
    # the whole row (up to 2048) against a few entries per program, in one step: the
    # per-step load latency, not the compares, bounded a looped form (run 34: 13 µs at
    # T = 1, 30 at T = 8 with 32 × 128 steps)
    bj = min(1 << (k - 1).bit_length(), 2048)
    bi = max(1, min(tile // bj, 1 << (k - 1).bit_length()))
    parts = -(-k // bi)
    kernel = functools.partial(_rank_order_kernel, k=k, bi=bi, bj=bj, id_ordered=id_ordered)
    ids, scores = pallas_call(
        kernel,
        grid=(t, parts),
        out_shape=(
            jax.ShapeDtypeStruct((t, parts * bi), jnp.int32),
            jax.ShapeDtypeStruct((t, parts * bi), jnp.float32),
        ),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=backend.is_interpret(),
        name="jsparse_topk_rank_order",
    )(codes, ids)
    return ids[:, :k], scores[:, :k]


# Rows × candidates² up to this: few rows (decode) select by ranks (:func:`rank_select`)
# instead of searching the K-th code and then ordering the K entries.
RANK_SELECT_PAIRS = 1 << 28


def _row_part(count_ref, cap, bi):
    """(row, first slot, live count) of a rank kernel's program (row, part of ``bi``
    slots) over a [T·cap] candidate buffer."""
    row = pl.program_id(0)
    return row, pl.program_id(1) * bi, jnp.minimum(plt.load(count_ref.at[row]), cap)


def _slot_codes(codes_ref, row, cap, slots, n):
    """Codes at ``slots`` of a [T·cap] buffer row with ``n`` live entries; a dead slot
    loads EMPTY, ahead of nothing (live codes are above)."""
    live = slots < n
    return plt.load(
        codes_ref.at[row * cap + jnp.where(live, slots, 0)], mask=live, other=EMPTY_CODE
    )


def _ranked_slots(codes_ref, ids_ref, row, first, n, cap, bi):
    """(slots, live, storage index, codes, ids) of the ``bi`` slots from ``first`` of a
    [T·cap] candidate buffer row with ``n`` live entries (dead: EMPTY / -1)."""
    slot_i = first + jnp.arange(bi, dtype=jnp.int32)
    live_i = slot_i < n
    at_i = row * cap + jnp.where(live_i, slot_i, 0)
    c_i = _slot_codes(codes_ref, row, cap, slot_i, n)
    id_i = plt.load(ids_ref.at[at_i], mask=live_i, other=-1)
    return slot_i, live_i, at_i, c_i, id_i


def _own_block_ahead(codes_ref, row, cap, n, first, slot_i, c_i, bj):
    """[bi, bj]: whether each slot of the ranked slots' own block of ``bj`` is ahead of
    each ranked slot (slots ``first`` on; bi divides bj, so they share one block): a
    higher code, or an equal one in an earlier slot. The candidates are in id order, so
    that is the tie rule by id. c_i > EMPTY: the offset cannot wrap."""
    slot_j = first // bj * bj + jnp.arange(bj, dtype=jnp.int32)
    c_j = _slot_codes(codes_ref, row, cap, slot_j, n)
    earlier = (slot_j[None, :] < slot_i[:, None]).astype(jnp.int32)
    return (c_j[None, :] > c_i[:, None] - earlier).astype(jnp.int32)


def _write_at_rank(outs, row, rank, slot_i, live_i, c_i, id_i, top_k, rows):
    """Writes each live slot whose rank is below K at that rank of its output row, and
    the padding (-1 / -inf) of a dead slot below K at the slot itself. Live ranks are a
    permutation of [0, n) and padding slots lie in [n, K): every output slot is written
    once."""
    out_ids_ref, out_scores_ref = outs
    write = jnp.where(live_i, rank < top_k, slot_i < top_k)
    trash = rows * top_k  # one past the last slot: never a live index
    dst = jnp.where(write, row * top_k + jnp.where(live_i, rank, slot_i), trash)
    plt.store(out_ids_ref.at[dst], jnp.where(live_i, id_i, -1), mask=write)
    score = jnp.where(live_i, code_to_score(c_i), -jnp.inf)
    plt.store(out_scores_ref.at[dst], score, mask=write)


def _rank_select_kernel(codes_ref, ids_ref, count_ref, out_ids_ref, out_scores_ref,
                        *, top_k, cap, bi, bj):  # fmt: skip
    """Program (row, part): :func:`rank_block` of the part's ``bi`` candidate slots."""
    row, first, n = _row_part(count_ref, cap, bi)
    outs = (out_ids_ref, out_scores_ref)
    rank_block(codes_ref, ids_ref, outs, row, first, n, top_k=top_k, cap=cap, bi=bi, bj=bj,
               rows=count_ref.shape[0])  # fmt: skip


def rank_block(codes_ref, ids_ref, outs, row, first, n, *, top_k, cap, bi, bj, rows):
    """Ranks candidate slots first .. first + bi - 1 of row ``row`` of a [rows·cap]
    buffer with ``n`` live entries against all of them; an entry whose rank is below K
    is written at its rank of the row's output (``outs``: ids, scores), so the row comes
    out selected and ordered at once. Slots between the live count and K are the padding
    (-1 / -inf). The candidates are in id order (slot order), so an entry ranks behind
    an equal code exactly when that code sits in an earlier slot. ``bi`` divides ``bj``."""

    @pl.when(first < jnp.maximum(n, top_k))  # parts past both write nothing
    def _():
        slot_i, live_i, _, c_i, id_i = _ranked_slots(codes_ref, ids_ref, row, first, n, cap, bi)

        def count_above(bar):  # adds, per (i, lane), the block's c_j > bar_i
            def body(j, ahead):
                slots = j * bj + jnp.arange(bj, dtype=jnp.int32)
                c_j = _slot_codes(codes_ref, row, cap, slots, n)
                return ahead + (c_j[None, :] > bar[:, None]).astype(jnp.int32)

            return body

        # j precedes i iff c_j > c_i, or c_j == c_i in an earlier slot: c_j > c_i - 1 for
        # the blocks wholly before i's slots, c_j > c_i after them (one compare a pair;
        # c_i > EMPTY: no wrap), and both tests only in the block that holds them. The
        # counts stay per lane until the end: one cross-thread sum, not one a block.
        n_blocks = (n + bj - 1) // bj
        own = first // bj  # bi divides bj: i's slots lie in one block
        ahead = _own_block_ahead(codes_ref, row, cap, n, first, slot_i, c_i, bj)
        ahead = jax.lax.fori_loop(0, own, count_above(c_i - 1), ahead)
        ahead = jax.lax.fori_loop(own + 1, n_blocks, count_above(c_i), ahead)
        _write_at_rank(outs, row, jnp.sum(ahead, axis=1), slot_i, live_i, c_i, id_i, top_k, rows)


def rank_select(codes, ids, counts, top_k, *, bi=None, bj=512, num_warps=4, num_stages=1):
    """Exact Top-K of few candidate rows, ordered (score descending, then id ascending),
    in one kernel: every candidate's rank against its row decides whether and where it
    is written. Replaces the K-th code search (a chain of ~10 block-wide counts in one
    program per row) and the ordering of the K entries for decode-sized calls.

    codes, ids: [T, cap] in ascending id order (as the compaction writes them), counts
    [T] (clipped to cap). Returns (ids [T, K], scores [T, K]) with -1 / -inf padding.
    Costs T·cap² compares: few rows only (``RANK_SELECT_PAIRS``). ``bi`` slots ranked
    per program (default: 8 below four rows, else 16) against blocks of ``bj``: the
    fastest tiles of run 58 (4.3 µs at one row, 17.8-18.8 at eight).
    """
    t, cap = ids.shape
    bi = bi or (8 if t < 4 else 16)
    if bj % bi:
        raise ValueError(f"rank_select: bj={bj} must be a multiple of bi={bi}")
    kernel = functools.partial(_rank_select_kernel, top_k=top_k, cap=cap, bi=bi, bj=bj)
    parts = -(-max(cap, top_k) // bi)
    out_ids, out_scores = pallas_call(
        kernel,
        grid=(t, parts),
        out_shape=(
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t * top_k,), jnp.float32),
        ),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=backend.is_interpret(),
        name="jsparse_topk_rank_select",
    )(codes.reshape(-1), ids.reshape(-1), counts)
    return out_ids.reshape(t, top_k), out_scores.reshape(t, top_k)


# From this many rows, rank_select's T·cap² compares become two launches of ~T·cap·bj
# compares and T·cap·(cap / bj) binary-search probes (:func:`block_rank_select`): at
# 4 / 8 / 16 rows × 64K 8.5 / 13.8 / 24.2 µs against 10.0 / 17.5 / 33.9; at one row
# 5.7 against 4.4, two launches of latency (WORKSPACE.md, run 65). None: off.
BLOCK_RANK_MIN_ROWS: int | None = 4


def _within_block_rank_kernel(codes_ref, count_ref, sorted_ref, own_rank_ref, *, cap, bi, bj):
    """Program (row, part): each live slot's rank inside its own block of ``bj`` slots
    (ahead: a higher code, or an equal one in an earlier slot); its code is written at
    that rank in the block's sorted copy (descending), the rank beside its slot."""
    row, first, n = _row_part(count_ref, cap, bi)

    @pl.when(first < n)  # parts of dead slots write nothing
    def _():
        slot_i = first + jnp.arange(bi, dtype=jnp.int32)
        live_i = slot_i < n
        c_i = _slot_codes(codes_ref, row, cap, slot_i, n)
        own = first // bj  # bi divides bj: the part's slots lie in one block
        rank = jnp.sum(_own_block_ahead(codes_ref, row, cap, n, first, slot_i, c_i, bj), axis=1)
        trash = count_ref.shape[0] * cap  # one past the last slot: never a live index
        plt.store(
            sorted_ref.at[jnp.where(live_i, row * cap + own * bj + rank, trash)], c_i, mask=live_i
        )
        plt.store(own_rank_ref.at[jnp.where(live_i, row * cap + slot_i, trash)], rank, mask=live_i)


def _merged_rank_kernel(codes_ref, ids_ref, count_ref, sorted_ref, own_rank_ref, out_ids_ref,
                        out_scores_ref, *, top_k, cap, bi, bj):  # fmt: skip
    """Program (row, part): each live slot's rank in its row is its rank in its own block
    plus, for every other block, how many of the block's sorted codes are ahead of it
    (a code ≥ its own in earlier blocks, > in later ones), found by binary search; then
    written at that rank when below K, as :func:`rank_select` does."""
    row, first, n = _row_part(count_ref, cap, bi)

    @pl.when(first < jnp.maximum(n, top_k))  # parts past both write nothing
    def _():
        slot_i, live_i, at_i, c_i, id_i = _ranked_slots(codes_ref, ids_ref, row, first, n, cap, bi)
        rank = plt.load(own_rank_ref.at[at_i], mask=live_i, other=0)
        n_blocks = -(-cap // bj)
        width = 1 << (n_blocks - 1).bit_length()  # Triton tiles are powers of two
        block = jnp.arange(width, dtype=jnp.int32)
        own = first // bj
        length = jnp.clip(n - block * bj, 0, bj)  # live codes in each block
        length = jnp.where(block == own, 0, length)[None, :]  # own block: counted above
        bar = c_i[:, None] - (block[None, :] < own).astype(jnp.int32)  # c_i > EMPTY: no wrap
        base = row * cap + block[None, :] * bj

        def probe(_, bounds):  # count of a block's descending codes above bar: lo == hi
            lo, hi = bounds
            active = lo < hi
            mid = (lo + hi) // 2
            at = jnp.where(active, base + mid, 0)
            ahead = plt.load(sorted_ref.at[at], mask=active, other=EMPTY_CODE) > bar
            return jnp.where(active & ahead, mid + 1, lo), jnp.where(active & ~ahead, mid, hi)

        zero = jnp.zeros((bi, width), jnp.int32)
        steps = bj.bit_length()  # ⌈log2(bj + 1)⌉ halvings close any [0, ≤ bj]
        lo, _ = jax.lax.fori_loop(0, steps, probe, (zero, zero + length))
        rank = rank + jnp.sum(lo, axis=1)
        outs = (out_ids_ref, out_scores_ref)
        _write_at_rank(outs, row, rank, slot_i, live_i, c_i, id_i, top_k, count_ref.shape[0])


def block_rank_select(codes, ids, counts, top_k, *, bi=16, bj=512, num_warps=4):
    """:func:`rank_select` in two launches with fewer compares: each candidate is ranked
    inside its block of ``bj`` slots (T·cap·bj compares) and its code written at that
    rank into a sorted copy of the block; then its rank in the row is that plus a
    binary search in each other sorted block (T·cap·(cap / bj) probes of log2(bj)
    steps). Same inputs, outputs and tie rule as :func:`rank_select`."""
    t, cap = ids.shape
    if bj % bi:
        raise ValueError(f"block_rank_select: bj={bj} must be a multiple of bi={bi}")
    flat, interpret = codes.reshape(-1), backend.is_interpret()
    compiler = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    slots = jax.ShapeDtypeStruct((t * cap,), jnp.int32)
    sorted_codes, own_rank = pallas_call(
        functools.partial(_within_block_rank_kernel, cap=cap, bi=bi, bj=bj),
        grid=(t, -(-cap // bi)),
        out_shape=(slots, slots),  # no init: a slot past the count is never read
        compiler_params=compiler,
        interpret=interpret,
        name="jsparse_topk_block_rank",
    )(flat, counts)
    out_ids, out_scores = pallas_call(
        functools.partial(_merged_rank_kernel, top_k=top_k, cap=cap, bi=bi, bj=bj),
        grid=(t, -(-max(cap, top_k) // bi)),
        out_shape=(
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t * top_k,), jnp.float32),
        ),
        compiler_params=compiler,
        interpret=interpret,
        name="jsparse_topk_merged_rank",
    )(flat, ids.reshape(-1), counts, sorted_codes, own_rank)
    return out_ids.reshape(t, top_k), out_scores.reshape(t, top_k)


def select_by_rank(codes, ids, counts, top_k):
    """:func:`rank_select`, or :func:`block_rank_select` from ``BLOCK_RANK_MIN_ROWS`` rows."""
    rows = ids.shape[0]
    if BLOCK_RANK_MIN_ROWS is not None and rows >= BLOCK_RANK_MIN_ROWS:
        return block_rank_select(codes, ids, counts, top_k)
    return rank_select(codes, ids, counts, top_k)


def rank_selects(rows: int, cap: int) -> bool:
    """Whether :func:`rank_select` takes rows of ``cap`` candidates (compiled only:
    interpreted, a grid runs program by program, and the search path gives the same
    answer; :func:`rank_select`'s own tests run it interpreted)."""
    return not backend.is_interpret() and rows * cap * cap <= RANK_SELECT_PAIRS


# From this many rows of at most BITONIC_MAX_K entries, a sorting network in
# registers (:func:`bitonic_order`, one program per row) orders them instead of XLA's
# sort (fewer rows take :func:`rank_order` first, by ``RANK_ORDER_PAIRS``). GPU busy at
# K = 2048 (WORKSPACE.md, run 90), network vs sort: 16 rows 11.9 vs 23.3 µs, 64 rows
# 12.1 vs 24.6, 128 rows 12.4 vs 26.4, 256 rows 21.0 vs 45.2; 8192 rows 490 vs 1353
# (runs 53, 87). Measured at 2048 only.
BITONIC_MIN_ROWS = 16
BITONIC_MAX_K = 2048


def _bitonic_layer(keys, ids, axis, descending_axis):
    """One compare-exchange layer over a row of (key, id) pairs held as (2,)*m, one
    axis per bit of an element's position (axis 0 the highest). Elements that differ
    only along ``axis`` pair up; the smaller pair goes first, except where the
    position's bit along ``descending_axis`` is set (the descending runs of a merge).

    Registers have no indexed access, so each element finds its partner by subtracting
    itself from the pair's sum along the axis (exact: int32 addition wraps). The row
    keeps its shape from the first layer to the last, and both masks are 2-wide iotas
    along one axis: viewing it as [n / 2d, 2, d] and back at every layer, with masks
    from an iota of group offsets, cost 1.5× the time (WORKSPACE.md, runs 85-87)."""
    m = keys.ndim

    def along(a):  # [0, 1] along axis a, broadcastable against the row
        return jnp.arange(2, dtype=jnp.int32).reshape((1,) * a + (2,) + (1,) * (m - 1 - a))

    partner_k = jnp.sum(keys, axis=axis, keepdims=True) - keys
    partner_i = jnp.sum(ids, axis=axis, keepdims=True) - ids
    self_after = (keys > partner_k) | ((keys == partner_k) & (ids > partner_i))
    take_partner = self_after == (along(axis) == 0)
    if descending_axis is not None:
        take_partner = take_partner != (along(descending_axis) == 1)
    return jnp.where(take_partner, partner_k, keys), jnp.where(take_partner, partner_i, ids)


def bitonic_sort(keys, ids):
    """Sorts a power-of-two row of (key, id) pairs ascending, lexicographically, with
    the layers of a bitonic network (plain jnp: the kernel's body, and testable as is)."""
    n = keys.shape[0]
    m = n.bit_length() - 1
    if m == 0:
        return keys, ids
    keys, ids = keys.reshape((2,) * m), ids.reshape((2,) * m)
    for s in range(1, m + 1):  # sorted runs of 2^(s-1) merge into runs of 2^s
        descending_axis = m - 1 - s if s < m else None  # the run size's bit
        for j in range(s - 1, -1, -1):  # pairs at distance 2^j: bit j, axis m-1-j
            keys, ids = _bitonic_layer(keys, ids, m - 1 - j, descending_axis)
    return keys.reshape(n), ids.reshape(n)


def _bitonic_order_kernel(codes_ref, ids_ref, out_ids_ref, out_scores_ref, *, k, n):
    """Program per row: the whole row in registers, sorted ascending by (~code, id),
    which is score descending, then id ascending, empty slots (id -1) last."""
    row = pl.program_id(0)
    slot = jnp.arange(n, dtype=jnp.int32)
    ok = slot < k
    at = jnp.where(ok, slot, 0)
    codes = plt.load(codes_ref.at[row, at], mask=ok, other=EMPTY_CODE)
    ids = plt.load(ids_ref.at[row, at], mask=ok, other=-1)
    keys, ids = bitonic_sort(~codes, jnp.where(codes == EMPTY_CODE, -1, ids))
    # every lane owns its slot of the n-wide output (the padding sorts last): no masked
    # duplicates, which interpret mode resolves arbitrarily. The store's positions are
    # the iota itself: a computed one, even equal, changed the layout Triton picks for
    # the whole network and cost 27% (run 86).
    plt.store(out_ids_ref.at[row, slot], ids)
    plt.store(out_scores_ref.at[row, slot], code_to_score(~keys))


def bitonic_order(codes, ids, *, num_warps=None):
    """:func:`order_topk` for many rows: one program per row sorts it in registers with
    a bitonic network (no shared memory or gathers in this backend: sums along the
    row's axes exchange the partners). Any row order of the entries: ties break by id.
    8 warps: 490 µs at 8192 × 2048 against 541 at 4 and 548 at 16 (runs 85, 87); None:
    8, or FEW_ROWS_BITONIC_WARPS for fewer rows than SMs."""
    t, k = codes.shape
    if num_warps is None:
        num_warps = FEW_ROWS_BITONIC_WARPS if _few_rows(t) else 8
    n = 1 << (k - 1).bit_length()
    out_ids, out_scores = pallas_call(
        functools.partial(_bitonic_order_kernel, k=k, n=n),
        grid=(t,),
        out_shape=(
            jax.ShapeDtypeStruct((t, n), jnp.int32),
            jax.ShapeDtypeStruct((t, n), jnp.float32),
        ),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=backend.is_interpret(),
        name="jsparse_topk_bitonic_order",
    )(codes, ids)
    return out_ids[:, :k], out_scores[:, :k]


def order_topk(codes, ids, *, id_ordered=False):
    """Sorts a Top-K set by score descending, then id ascending; -1 / -inf for empty.

    ``id_ordered``: the entries of each row are already in ascending id order, so one
    stable sort key (the code) suffices. Few rows: :func:`rank_order`; many rows of at
    most ``BITONIC_MAX_K``: :func:`bitonic_order`; between, or longer rows: XLA's sort.
    """
    t, k = codes.shape
    # Interpret mode runs a grid program by program (the rank kernel became the slowest
    # step of every CPU pipeline test), and XLA's CPU compile of the network grows
    # exponentially with its width (its fusion duplicates each layer's two uses: 138 s
    # at 32 wide); there the sort gives the same answer. Both kernels' own tests
    # compare them with the sort, interpreted at small K and compiled on the GPU.
    if backend.is_interpret():
        return sort_order(codes, ids, id_ordered=id_ordered)
    if t * k * k <= RANK_ORDER_PAIRS:
        return rank_order(codes, ids, id_ordered=id_ordered)
    if t >= BITONIC_MIN_ROWS and k <= BITONIC_MAX_K:
        return bitonic_order(codes, ids)
    return sort_order(codes, ids, id_ordered=id_ordered)


def sort_order(codes, ids, *, id_ordered=False):
    """:func:`order_topk` by XLA's sort (many rows)."""
    ids = jnp.where(codes == EMPTY_CODE, _INT_MAX, ids)
    if id_ordered:
        neg, ids = jax.lax.sort((~codes, ids), dimension=1, num_keys=1, is_stable=True)
    else:
        neg, ids = jax.lax.sort((~codes, ids), dimension=1, num_keys=2)
    codes = ~neg
    empty = codes == EMPTY_CODE
    return jnp.where(empty, -1, ids), jnp.where(empty, -jnp.inf, code_to_score(codes))
