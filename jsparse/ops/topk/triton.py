"""Exact Top-K selection as Pallas Triton kernels, one program per row.

Triton on this backend has no sort, no histogram and unreliable vector int atomics,
so selection is built from what is fast: streaming compares, sums and forward
``cumsum`` (for order-preserving compaction). Every comparison is on int32 score codes
(:mod:`jsparse.ops.topk.codes`), so equality is exact and ties are explicit.

Two kernels:

* :func:`compact_rows` (a long row → a short candidate buffer). A row is either a
  dense score row (ids are positions in ``[start, end)``) or a list of records
  (code, id). A sample of the row (the whole row when short, else 512 evenly spaced
  runs of 8) gives a threshold θ whose expected count of entries ≥ θ is a little
  above K; one streaming pass compacts every entry with code ≥ θ, in row order, into
  ``cap`` slots. If the count lands outside [K, cap] (an unlucky sample, or massive
  ties), a separate kernel runs the row's exact slow path: a radix-16 search over the
  whole row (8 passes) finds the K-th code θ*, and one pass stores the entries above θ*
  plus the ties with the smallest ids: exactly K. Either way the buffer holds every
  entry of the exact Top-K.
* :func:`select_candidates` (candidate buffer → Top-K set). Bisection over the bits of
  the code finds the K-th largest code θ; every entry above θ enters; ties at θ enter
  by ascending id (a bisection over ids finds the cut when ties straddle the
  boundary). Output keeps the input order.

The final order (score descending, id ascending) is an XLA sort of K entries per row
(:func:`order_topk`): one stable key when the entries are already in id order, else
two keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code

_INT_MIN = np.int32(np.iinfo(np.int32).min)
_INT_MAX = np.int32(np.iinfo(np.int32).max)
# The θ sample: 4096 entries in 512 evenly spaced runs of 8 (one 32-byte sector each).
# Runs of 128 saved nothing in bytes and made θ depend on where the high scores cluster:
# on structured rows (recency, topics) half of the rows missed [K, cap] and took the
# slow path (WORKSPACE.md, 2026-11-29).
SAMPLE_BLOCKS = 512
SAMPLE_BLOCK = 8
SAMPLE_BITS = 16  # the sample threshold needs only a lower bound: 16 bits of the code suffice
MAX_RESIDENT = 8192  # candidate rows up to this many entries are held in registers
RADIX = 16  # trial thresholds per streaming pass of the exact path
# compact_rows' per-row report of the path taken. Typed on purpose: in a Pallas Triton
# kernel, jnp.where(p, 1, 2) with two Python-int branches lowers to an i1 select of
# `true`/`false` and stores 1 or 0 (run 25's anomaly, confirmed in the lowered IR);
# np.int32 branches, or arithmetic on p.astype(int32), lower correctly.
FAST, RETRIED, SEARCHED = np.int32(0), np.int32(1), np.int32(2)


@dataclasses.dataclass(frozen=True)
class SelectConfig:
    """Measured on an H200 (WORKSPACE.md run 3): small blocks and 4 warps stream best."""

    block: int = 1024  # entries per step of a streaming pass
    num_warps: int = 4
    num_stages: int = 1


def _bisect_code(count_ge, rank, bits=32):
    """Largest code θ (to ``bits`` bits) with count_ge(θ) ≥ rank, rank ≥ 1.

    Works in the unsigned order (code ^ INT_MIN), where setting bits only increases θ;
    with fewer than 32 bits the result is rounded down: still a valid lower bound.
    """

    def step(b, prefix):
        trial = prefix | jnp.left_shift(jnp.int32(1), 31 - b)
        return jnp.where(count_ge(trial ^ _INT_MIN) >= rank, trial, prefix)

    return jax.lax.fori_loop(0, bits, step, rank * 0) ^ _INT_MIN


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


def _row_source(refs, dense, row, blk):
    """(entries, block, lo, hi) of a dense score row or a record row.

    The row's entries sit at positions [lo, hi) of its storage row. ``entries(pos)``
    gathers (codes, ids, ok) at offsets ``pos`` from lo (any shape; EMPTY past the row),
    for the θ sample. ``block(a)`` loads the ``blk`` entries at storage positions
    a .. a+blk-1, a a multiple of blk, masked to [lo, hi): streaming passes walk aligned
    blocks so each thread can load 16 contiguous bytes, which Triton only emits when the
    offset is provably aligned. (A lone streaming kernel gained 0.5-0.9 ms from this at
    8192 × 64K, WORKSPACE.md run 21; whole compaction measured the same either way,
    runs 23-25: its scattered stores dominate.) Rows whose storage length is not a
    multiple of blk use a gathered load instead.
    """
    lanes = jnp.arange(blk, dtype=jnp.int32)
    if dense:
        scores_ref, start_ref, end_ref = refs
        lo, hi = plt.load(start_ref.at[row]), plt.load(end_ref.at[row])
        width = scores_ref.shape[1]

        def to_entries(x, pos, ok):
            return jnp.where(ok, score_code(x), EMPTY_CODE), pos, ok

        refs_other = ((scores_ref, 0.0),)
    else:
        codes_ref, ids_ref, count_ref = refs
        width = codes_ref.shape[1]
        lo, hi = row * 0, jnp.minimum(plt.load(count_ref.at[row]), width)

        def to_entries(c, i, pos, ok):
            return jnp.where(ok, c, EMPTY_CODE), i, ok

        refs_other = ((codes_ref, EMPTY_CODE), (ids_ref, -1))

    def load(ref, pos, ok, other):  # gathered: any positions
        return plt.load(ref.at[row, jnp.where(ok, pos, 0)], mask=ok, other=other)

    def entries(pos):
        ok = pos < hi - lo
        loaded = [load(ref, lo + pos, ok, other) for ref, other in refs_other]
        return to_entries(*loaded, lo + pos, ok)

    aligned = width % blk == 0

    def block(a):
        pos = a + lanes
        ok = (pos >= lo) & (pos < hi)
        if aligned:
            a = pl.multiple_of(a, blk)
            loaded = [
                plt.load(ref.at[row, pl.ds(a, blk)], mask=ok, other=other)
                for ref, other in refs_other
            ]
        else:
            loaded = [load(ref, pos, ok, other) for ref, other in refs_other]
        return to_entries(*loaded, pos, ok)

    return entries, block, lo, hi


def _aligned_blocks(lo, hi, blk):
    """(first, n): the blk-aligned blocks first, first + blk, ... that touch [lo, hi)."""
    first = lo // blk * blk
    return first, (hi - first + blk - 1) // blk


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

    def compact(keep_fn, out_codes, out_ids, base, cap, trash):
        """Stores entries keep_fn(code, id) selects, in row order, at out[base + n] for
        n < cap; returns how many it selected (which may exceed cap)."""

        def body(j, stored):
            c, i, ok = block(first + j * blk)
            keep = keep_fn(c, i) & ok
            keep_i = keep.astype(jnp.int32)
            pos = stored + jnp.cumsum(keep_i) - 1
            store = keep & (pos < cap)
            dst = jnp.where(store, base + pos, trash)
            plt.store(out_codes.at[dst], c, mask=store)
            plt.store(out_ids.at[dst], i, mask=store)
            return stored + jnp.sum(keep_i)

        return jax.lax.fori_loop(0, n_blocks, body, n_blocks * 0)

    return count, count_many, compact


def _sample_threshold(entries, length, top_k, cap, missed=None):
    """θ ≤ (probably a little below) the K-th code; EMPTY_CODE when the row fits in cap.

    The sample is the whole row when short (θ is then exactly the K-th code), else 512
    evenly spaced runs of 8 (the last ending at the row's end), ranked so that the
    expected count of entries ≥ θ over the row is about 1.3·K plus a few spacings.
    ``missed``: the row count that this rank gave, outside [K, cap]; the rank is then
    rescaled so the expected count lands mid-way between K and cap (counts grow about
    linearly with the sample rank).
    """
    n_sample = SAMPLE_BLOCKS * SAMPLE_BLOCK
    whole = length <= n_sample
    k = jnp.arange(n_sample, dtype=jnp.int32)
    spread = (k // SAMPLE_BLOCK) * jnp.maximum(length - SAMPLE_BLOCK, 0) // (SAMPLE_BLOCKS - 1)
    sample, _, _ = entries(jnp.where(whole, k, spread + k % SAMPLE_BLOCK))
    spaced = (top_k * n_sample * 13 + 10 * length - 1) // (10 * jnp.maximum(length, 1)) + 8
    rank = jnp.where(whole, top_k, jnp.minimum(spaced, n_sample))
    if missed is not None:
        rank = jnp.clip(rank * (top_k + cap) // (2 * jnp.maximum(missed, 1)), 1, n_sample)
    return jax.lax.cond(
        length > cap,
        lambda: _bisect_code(
            lambda th: jnp.sum((sample >= th).astype(jnp.int32)), rank, SAMPLE_BITS
        ),
        lambda: length * 0 + EMPTY_CODE,  # the whole row fits: keep every entry
    )


def _exact_compact(count, count_many, compact, top_k):
    """The slow path: exactly the K best entries (ties by smallest id).

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
    return compact(lambda c, i: (c > kth) | ((c == kth) & (i <= cut)))


def _chunk_kernel(*refs, dense, top_k, cap, chunks, cfg):
    """Program (row, chunk): compacts entries ≥ θ of its chunk of the row.

    With one chunk it writes the final buffer and flags the row for the exact kernel when
    the count missed [min(K, length), cap]; with several it writes segment (row, chunk)
    and the merge kernel finishes the row. The retry and the exact search live in their
    own kernel, so this one is the streaming loop alone (moving them out did not change
    its speed, run 24; it keeps the rare paths in one place for both kernels).
    """
    source = refs[:3]
    codes_ref, ids_ref, count_ref = refs[-3:] if chunks > 1 else refs[-4:-1]
    row, chunk = pl.program_id(0), pl.program_id(1)
    blk = cfg.block
    entries, block, lo, hi = _row_source(source, dense, row, blk)
    length = hi - lo
    first, total = _aligned_blocks(lo, hi, blk)
    per_chunk = (total + chunks - 1) // chunks
    own = jnp.clip(total - chunk * per_chunk, 0, per_chunk)
    _, _, compact = _streaming(block, first + chunk * per_chunk * blk, own, blk)
    theta = _sample_threshold(entries, length, top_k, cap)
    segment = row * chunks + chunk
    trash = count_ref.shape[0] * cap  # one past the last slot: never a live index
    stored = compact(lambda c, i: c >= theta, codes_ref, ids_ref, segment * cap, cap, trash)
    if chunks > 1:
        plt.store(count_ref.at[segment], stored)
        return
    fast_ok = (stored >= jnp.minimum(top_k, length)) & (stored <= cap)
    plt.store(count_ref.at[row], stored)  # unclipped: a missed count steers the retry
    plt.store(refs[-1].at[row], jnp.where(fast_ok, FAST, RETRIED))  # flagged: exact kernel


def _merge_kernel(*refs, dense, top_k, cap, chunks, cfg):
    """Program (row): concatenates the row's segments, or flags it for the exact kernel."""
    source = refs[:3]
    seg_codes_ref, seg_ids_ref, seg_count_ref = refs[3:6]
    codes_ref, ids_ref, count_ref, slow_ref = refs[-4:]
    row = pl.program_id(0)
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
    fast_ok = (total >= jnp.minimum(top_k, length)) & (total <= cap)
    trash = count_ref.shape[0] * cap
    lanes = jnp.arange(blk, dtype=jnp.int32)

    def merge():
        def one_segment(c, offset):
            n = jnp.sum(jnp.where(lane == c, seg_counts, 0))
            src = (row * chunks + c) * cap

            def copy(j, carry):
                pos = j * blk + lanes
                ok = pos < n
                safe = src + jnp.where(ok, pos, 0)
                vc = plt.load(seg_codes_ref.at[safe], mask=ok, other=EMPTY_CODE)
                vi = plt.load(seg_ids_ref.at[safe], mask=ok, other=-1)
                dst = jnp.where(ok, row * cap + offset + pos, trash)
                plt.store(codes_ref.at[dst], vc, mask=ok)
                plt.store(ids_ref.at[dst], vi, mask=ok)
                return carry

            jax.lax.fori_loop(0, (n + blk - 1) // blk, copy, 0)
            return offset + n

        return jax.lax.fori_loop(0, chunks, one_segment, row * 0)

    final = jax.lax.cond(fast_ok, merge, lambda: total)  # a missed total steers the retry
    plt.store(count_ref.at[row], final)
    plt.store(slow_ref.at[row], jnp.where(fast_ok, FAST, RETRIED))  # flagged: exact kernel


def _exact_kernel(*refs, dense, top_k, cap, cfg):
    """Program (row): the slow path of a row flagged by the compaction kernels; other rows
    return at once and keep their buffers (aliased in and out).

    First one retry: θ from the same sample at a rank rescaled by the count the first θ
    gave, one compaction pass (run 24: 3 of 8192 i.i.d. rows at 128K miss [K, cap], and
    the exact search costs ~19 passes in one program). If the retry misses too (massive
    ties), the exact radix search.
    """
    source = refs[:3]
    codes_ref, ids_ref, count_ref, slow_ref = refs[-4:]
    row = pl.program_id(0)
    blk = cfg.block

    @pl.when(plt.load(slow_ref.at[row]) != 0)
    def _():
        entries, block, lo, hi = _row_source(source, dense, row, blk)
        count, count_many, compact = _streaming(block, *_aligned_blocks(lo, hi, blk), blk)
        trash = count_ref.shape[0] * cap
        into_row = lambda keep: compact(keep, codes_ref, ids_ref, row * cap, cap, trash)  # noqa: E731
        length = hi - lo
        theta = _sample_threshold(entries, length, top_k, cap, missed=plt.load(count_ref.at[row]))
        stored = into_row(lambda c, i: c >= theta)
        retry_ok = (stored >= jnp.minimum(top_k, length)) & (stored <= cap)
        plt.store(slow_ref.at[row], jnp.where(retry_ok, RETRIED, SEARCHED))
        final = jax.lax.cond(
            retry_ok,
            lambda: stored,
            lambda: _exact_compact(count, count_many, into_row, top_k),
        )
        plt.store(count_ref.at[row], jnp.minimum(final, cap))


def default_chunks(rows: int, length: int) -> int:
    """Programs per row: enough rows × chunks to fill an H200, chunks ≥ 4096 entries."""
    return int(max(1, min(-(-4 * 132 // rows), length // 4096, 64)))


def _compact_call(inputs, t, top_k, cap, dense, cfg, chunks):
    compiler = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    interpret = backend.is_interpret()
    i32 = jnp.int32
    empty = lambda n: (jnp.full((n,), EMPTY_CODE, i32), jnp.full((n,), -1, i32))  # noqa: E731
    buffers = lambda n: (  # noqa: E731
        jax.ShapeDtypeStruct((n * cap,), i32),
        jax.ShapeDtypeStruct((n * cap,), i32),
        jax.ShapeDtypeStruct((n,), i32),
    )
    statics = dict(dense=dense, top_k=top_k, cap=cap, chunks=chunks, cfg=cfg)
    flag = jax.ShapeDtypeStruct((t,), i32)
    if chunks == 1:
        codes, ids, count, slow = pl.pallas_call(
            functools.partial(_chunk_kernel, **statics),
            grid=(t, 1),
            out_shape=(*buffers(t), flag),
            input_output_aliases={3: 0, 4: 1},
            compiler_params=compiler,
            interpret=interpret,
            name="jsparse_topk_compact",
        )(*inputs, *empty(t * cap))
    else:
        n_seg = t * chunks
        seg_codes, seg_ids, seg_count = pl.pallas_call(
            functools.partial(_chunk_kernel, **statics),
            grid=(t, chunks),
            out_shape=buffers(n_seg),
            input_output_aliases={3: 0, 4: 1},
            compiler_params=compiler,
            interpret=interpret,
            name="jsparse_topk_compact_chunks",
        )(*inputs, *empty(n_seg * cap))
        codes, ids, count, slow = pl.pallas_call(
            functools.partial(_merge_kernel, **statics),
            grid=(t,),
            out_shape=(*buffers(t), flag),
            input_output_aliases={6: 0, 7: 1},
            compiler_params=compiler,
            interpret=interpret,
            name="jsparse_topk_merge",
        )(*inputs, seg_codes, seg_ids, seg_count, *empty(t * cap))
    codes, ids, count, slow = pl.pallas_call(
        functools.partial(_exact_kernel, dense=dense, top_k=top_k, cap=cap, cfg=cfg),
        grid=(t,),
        out_shape=(*buffers(t), flag),
        input_output_aliases={3: 0, 4: 1, 5: 2, 6: 3},
        compiler_params=compiler,
        interpret=interpret,
        name="jsparse_topk_exact",
    )(*inputs, codes, ids, count, slow)
    return codes.reshape(t, cap), ids.reshape(t, cap), count, slow


def compact_rows(scores, start, end, top_k, cap, cfg=SelectConfig(), chunks=None):
    """Candidate buffers [T, cap] (codes, ids; id order) holding each row's exact Top-K.

    ``scores`` [T, S] is read only inside ``[start[t], end[t])``. Returns (codes, ids,
    count [T], slow [T] int32: the path each row took, FAST (0) for the sampled θ,
    RETRIED (1) for one retry at a rescaled rank, SEARCHED (2) for the exact radix
    search). ``cap ≥ top_k``.
    ``chunks`` programs share a row (default: :func:`default_chunks`), for few rows.
    """
    t, s = scores.shape
    chunks = chunks or default_chunks(t, s)
    return _compact_call((scores, start, end), t, top_k, cap, True, cfg, chunks)


def compact_records(codes, ids, counts, top_k, cap, cfg=SelectConfig(), chunks=None):
    """:func:`compact_rows` for record rows (codes, ids [T, C], valid counts [T])."""
    t, n = codes.shape
    chunks = chunks or default_chunks(t, n)
    return _compact_call((codes, ids, counts), t, top_k, cap, False, cfg, chunks)


def _select_kernel(codes_ref, ids_ref, count_ref, _c0, _i0, out_codes_ref, out_ids_ref, kth_ref,
                   *, top_k, cap, cfg):  # fmt: skip
    row = pl.program_id(0)
    n = jnp.minimum(plt.load(count_ref.at[row]), cap)
    resident = cap <= MAX_RESIDENT
    blk = 1 << (cap - 1).bit_length() if resident else cfg.block
    lanes = jnp.arange(blk, dtype=jnp.int32)
    n_blocks = (n + blk - 1) // blk
    trash = count_ref.shape[0] * top_k  # one past the last slot: never a live index

    def load(j):
        idx = j * blk + lanes
        ok = idx < n
        src = row * cap + jnp.where(ok, idx, 0)
        c = plt.load(codes_ref.at[src], mask=ok, other=EMPTY_CODE)
        i = plt.load(ids_ref.at[src], mask=ok, other=-1)
        return jnp.where(ok, c, EMPTY_CODE), i, ok

    if resident:  # one load; every pass below runs on registers
        held = load(0)

    def count(pred):
        if resident:
            return jnp.sum((held[2] & pred(*held[:2])).astype(jnp.int32))

        def body(j, acc):
            c, i, ok = load(j)
            return acc + jnp.sum((ok & pred(c, i)).astype(jnp.int32))

        return jax.lax.fori_loop(0, n_blocks, body, n * 0)

    def threshold():
        kth = _bisect_code(lambda th: count(lambda c, i: c >= th), top_k)
        need = top_k - count(lambda c, i: c > kth)
        cut = _id_cut(lambda pred: count(lambda c, i: (c == kth) & pred(i)), need)
        return kth, cut

    # (Branch results derive from a traced value: Triton's scf.if cannot yield constants.)
    kth, cut = jax.lax.cond(n >= top_k, threshold, lambda: (n * 0 + EMPTY_CODE, n * 0 + _INT_MAX))

    def write(c, i, ok, stored):
        keep = ok & ((c > kth) | ((c == kth) & (i <= cut)))
        keep_i = keep.astype(jnp.int32)
        pos = stored + jnp.cumsum(keep_i) - 1
        store = keep & (pos < top_k)
        dst = jnp.where(store, row * top_k + pos, trash)
        plt.store(out_codes_ref.at[dst], c, mask=store)
        plt.store(out_ids_ref.at[dst], i, mask=store)
        return stored + jnp.sum(keep_i)

    if resident:
        write(*held, n * 0)
    else:
        jax.lax.fori_loop(0, n_blocks, lambda j, s: write(*load(j), s), n * 0)
    plt.store(kth_ref.at[row], kth)


def select_candidates(codes, ids, counts, top_k, cfg=SelectConfig()):
    """Exact Top-K set of each row's candidates, in input order.

    codes, ids: [T, cap]; counts: [T] (values beyond cap are clipped: callers handle
    overflow before this). Returns (codes [T, K], ids [T, K] with EMPTY/-1 padding,
    kth [T]: the K-th largest code, EMPTY_CODE when a row has fewer than K candidates).
    """
    t, cap = codes.shape
    kernel = functools.partial(_select_kernel, top_k=top_k, cap=cap, cfg=cfg)
    init = (
        jnp.full((t * top_k,), EMPTY_CODE, jnp.int32),
        jnp.full((t * top_k,), -1, jnp.int32),
    )
    out_codes, out_ids, kth = pl.pallas_call(
        kernel,
        grid=(t,),
        out_shape=(
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32),
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=backend.is_interpret(),
        name="jsparse_topk_select",
    )(codes.reshape(-1), ids.reshape(-1), counts, *init)
    return out_codes.reshape(t, top_k), out_ids.reshape(t, top_k), kth


def order_topk(codes, ids, *, id_ordered=False):
    """Sorts a Top-K set by score descending, then id ascending; -1 / -inf for empty.

    ``id_ordered``: the entries of each row are already in ascending id order, so one
    stable sort key (the code) suffices.
    """
    ids = jnp.where(codes == EMPTY_CODE, _INT_MAX, ids)
    if id_ordered:
        neg, ids = jax.lax.sort((~codes, ids), dimension=1, num_keys=1, is_stable=True)
    else:
        neg, ids = jax.lax.sort((~codes, ids), dimension=1, num_keys=2)
    codes = ~neg
    empty = codes == EMPTY_CODE
    return jnp.where(empty, -1, ids), jnp.where(empty, -jnp.inf, code_to_score(codes))
