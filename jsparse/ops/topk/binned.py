"""One decode row's candidates selected and ordered in one launch, by bins of codes.

After the chunk compaction (:func:`jsparse.ops.topk.triton.chunk_segments`), program
(row, b) of :func:`bin_rank_select` owns bin b of the row's candidate codes: bins are
uniform in code space between the row's smallest and largest candidate code, and every
program of the row finds the same edges from the segments themselves. A program counts
the candidates above its bin (its first rank), gathers its members from the segments
into the row's scratch at that offset, ranks them against each other only (code, then
id) and writes each whose rank is below K. Bins partition the candidates, so the ranks
are a permutation and every output slot is written once. This replaces the merge
kernel and the rank select (all candidates against all) of the split-row path.

A row whose count missed [min(K, length), cap] is left to its bin 0 program: it runs
the row's slow path (:func:`jsparse.ops.topk.triton._exact_row`) into the scratch and
ranks those entries itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import pallas_call
from jsparse.ops.topk import triton as select
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score

# Programs (bins) a row. Each reads all of its row's segments; more bins mean fewer
# pairs a bin (the largest bin is the launch's critical path) and more reads.
BINS = 128
# Rows up to this many take this selection in `base` (rows the rank select takes,
# compiled); None: never.
MAX_ROWS: int | None = None
SEGMENT_COLS = 128  # segment slots a program reads per chunk in one load
RANK_BLOCK = 128  # members ranked at once
PAIR_BLOCK = 32  # members compared against them per step


def takes(rows: int) -> bool:
    """Whether ``rows`` decode rows select through :func:`bin_rank_select`."""
    return MAX_ROWS is not None and rows <= MAX_ROWS


def _segments(seg_codes_ref, seg_ids_ref, seg_count_ref, row, chunks):
    """(load(col_block) -> (codes, ids, live) [C, SEGMENT_COLS], col_blocks): the row's
    ``chunks`` segments (C = chunks padded to a power of two) one column block at a time."""
    c_pad = 1 << (chunks - 1).bit_length()
    seg = jnp.arange(c_pad, dtype=jnp.int32)
    seg_ok = seg < chunks
    seg_row = row * chunks + jnp.where(seg_ok, seg, 0)
    counts = plt.load(seg_count_ref.at[seg_row], mask=seg_ok, other=0)
    cols = jnp.arange(SEGMENT_COLS, dtype=jnp.int32)

    def load(col_block):
        pos = col_block * SEGMENT_COLS + cols[None, :]
        live = pos < counts[:, None]
        at = jnp.where(live, pos, 0)
        c = plt.load(seg_codes_ref.at[seg_row[:, None], at], mask=live, other=EMPTY_CODE)
        i = plt.load(seg_ids_ref.at[seg_row[:, None], at], mask=live, other=-1)
        return c, i, live

    return load, jnp.sum(counts), (jnp.max(counts) + SEGMENT_COLS - 1) // SEGMENT_COLS


def _over_blocks(load, n_blocks, first, fn, carry):
    """fn((codes, ids, live), carry) over column blocks 0 .. n_blocks - 1; block 0 is
    ``first``, loaded once and kept for every pass (the common case is one block)."""
    carry = fn(first, carry)
    return jax.lax.fori_loop(1, n_blocks, lambda j, c: fn(load(j), c), carry)


def _bin_edges(load, n_blocks, first, b, bins):
    """(lo, hi, top): bin b's codes [lo, hi), b = 0 the highest bin (no upper edge).
    Edges are uniform in code space over the row's live codes, computed in f32 (no
    integer overflow across the code range) the same way by every program, so they
    are monotone and the bins partition the codes whatever the rounding."""

    def extremes(blk, mm):
        c, _, live = blk
        return (
            jnp.minimum(mm[0], jnp.min(jnp.where(live, c, select._INT_MAX))),
            jnp.maximum(mm[1], jnp.max(jnp.where(live, c, select._INT_MIN))),
        )

    start = (jnp.int32(select._INT_MAX), jnp.int32(select._INT_MIN))
    cmin, cmax = _over_blocks(load, n_blocks, first, extremes, start)
    f32 = jnp.float32
    width = jnp.maximum(cmax.astype(f32) - cmin.astype(f32) + 1.0, 1.0) / bins

    def edge(j):  # codes ≥ edge(j) lie in bins ≥ j (ascending)
        at = cmin.astype(f32) + width * j.astype(f32)
        return jnp.clip(at, -(2.0**31) + 256, 2.0**31 - 256).astype(jnp.int32)

    j = bins - 1 - b  # ascending index of program b's bin
    lo = jnp.where(j == 0, EMPTY_CODE, edge(j))
    return lo, edge(j + 1), b == 0


def _rank_members(scr_codes_ref, scr_ids_ref, outs, row, base, n, offset, *, cap, top_k, rows):
    """Ranks the ``n`` entries at scratch slots base .. base + n - 1 of row ``row``
    against each other (a higher code, or an equal code with a lower id, is ahead) and
    writes each at offset + rank of the row's output when that is below K."""
    out_ids_ref, out_scores_ref = outs
    lanes = jnp.arange(RANK_BLOCK, dtype=jnp.int32)
    pair = jnp.arange(PAIR_BLOCK, dtype=jnp.int32)
    first = row * cap + base

    def rank_block(ib, carry):
        slot_i = ib * RANK_BLOCK + lanes
        live_i = slot_i < n
        at_i = first + jnp.where(live_i, slot_i, 0)
        c_i = plt.load(scr_codes_ref.at[at_i], mask=live_i, other=EMPTY_CODE)
        id_i = plt.load(scr_ids_ref.at[at_i], mask=live_i, other=-1)

        def body(jb, ahead):
            slot_j = jb * PAIR_BLOCK + pair
            live_j = slot_j < n
            at_j = first + jnp.where(live_j, slot_j, 0)
            c_j = plt.load(scr_codes_ref.at[at_j], mask=live_j, other=EMPTY_CODE)
            id_j = plt.load(scr_ids_ref.at[at_j], mask=live_j, other=-1)
            tie = (c_j[None, :] == c_i[:, None]) & (id_j[None, :] < id_i[:, None])
            before = (c_j[None, :] > c_i[:, None]) | (tie & live_j[None, :])
            return ahead + before.astype(jnp.int32)

        n_j = (n + PAIR_BLOCK - 1) // PAIR_BLOCK
        ahead = jax.lax.fori_loop(0, n_j, body, jnp.zeros((RANK_BLOCK, PAIR_BLOCK), jnp.int32))
        rank = offset + jnp.sum(ahead, axis=1)
        write = live_i & (rank < top_k)
        dst = jnp.where(write, row * top_k + rank, rows * top_k)  # trash: never live
        plt.store(out_ids_ref.at[dst], id_i, mask=write)
        plt.store(out_scores_ref.at[dst], code_to_score(c_i), mask=write)
        return carry

    jax.lax.fori_loop(0, (n + RANK_BLOCK - 1) // RANK_BLOCK, rank_block, 0)


def _pad(outs, row, n, *, top_k):
    """Output slots n .. K - 1 of the row: -1 / -inf (fewer candidates than K)."""
    out_ids_ref, out_scores_ref = outs
    lanes = jnp.arange(RANK_BLOCK, dtype=jnp.int32)

    def body(j, carry):
        slot = j * RANK_BLOCK + lanes
        pad = (slot >= n) & (slot < top_k)
        dst = row * top_k + jnp.where(pad, slot, 0)
        plt.store(out_ids_ref.at[dst], jnp.full((RANK_BLOCK,), -1, jnp.int32), mask=pad)
        plt.store(out_scores_ref.at[dst], jnp.full((RANK_BLOCK,), -jnp.inf, jnp.float32), mask=pad)
        return carry

    jax.lax.fori_loop(n // RANK_BLOCK, (top_k + RANK_BLOCK - 1) // RANK_BLOCK, body, 0)


def _barrier():
    """Scratch stores, then loads by other threads of the program: a CTA barrier on
    the GPU (interpret mode runs a program's operations in order)."""
    if not backend.is_interpret():
        plt.debug_barrier()


def _bin_rank_kernel(scores_ref, start_ref, end_ref, seg_codes_ref, seg_ids_ref, seg_count_ref,
                     out_ids_ref, out_scores_ref, scr_codes_ref, scr_ids_ref, count_ref,
                     slow_ref, *, top_k, cap, chunks, bins, cfg):  # fmt: skip
    row, b = pl.program_id(0), pl.program_id(1)
    rows = count_ref.shape[0]
    source = (scores_ref, start_ref, end_ref)
    lo_key, hi_key = select._dense_range(start_ref, end_ref, row, scores_ref.shape)
    load, total, n_blocks = _segments(seg_codes_ref, seg_ids_ref, seg_count_ref, row, chunks)
    fast = select._fits(total, top_k, hi_key - lo_key, cap)
    outs = (out_ids_ref, out_scores_ref)
    ranks = functools.partial(
        _rank_members, scr_codes_ref, scr_ids_ref, outs, row, cap=cap, top_k=top_k, rows=rows
    )

    @pl.when(fast)
    def _():
        first = load(0)
        lo, hi, top = _bin_edges(load, n_blocks, first, b, bins)

        def counts(blk, acc):  # (candidates above the bin, the bin's members)
            c, _, live = blk
            above = live & ~top & (c >= hi)
            member = live & (c >= lo) & (top | (c < hi))
            return acc[0] + jnp.sum(above.astype(jnp.int32)), acc[1] + jnp.sum(
                member.astype(jnp.int32)
            )

        offset, n_bin = _over_blocks(load, n_blocks, first, counts, (total * 0, total * 0))

        @pl.when((offset < top_k) & (n_bin > 0))
        def _():
            def gather(blk, written):  # the bin's members to scratch [offset, offset + n)
                c, i, live = blk
                m = (live & (c >= lo) & (top | (c < hi))).astype(jnp.int32)
                per_seg = jnp.sum(m, axis=1)
                pos = written + (jnp.cumsum(per_seg) - per_seg)[:, None] + jnp.cumsum(m, axis=1) - 1
                keep = m > 0
                dst = jnp.where(keep, row * cap + offset + pos, rows * cap)  # trash: never live
                plt.store(scr_codes_ref.at[dst], c, mask=keep)
                plt.store(scr_ids_ref.at[dst], i, mask=keep)
                return written + jnp.sum(per_seg)

            _over_blocks(load, n_blocks, first, gather, total * 0)
            _barrier()
            ranks(offset, n_bin, offset)

        @pl.when(b == 0)
        def _():
            _pad(outs, row, total, top_k=top_k)
            plt.store(slow_ref.at[row], select.FAST)
            plt.store(count_ref.at[row], total)

    @pl.when(~fast & (b == 0))
    def _():
        flags = (scr_codes_ref, scr_ids_ref, count_ref, slow_ref)
        select._exact_row(source, True, row, total, flags, top_k=top_k, cap=cap, cfg=cfg)
        _barrier()
        n = plt.load(count_ref.at[row])
        ranks(0, n, 0)
        _pad(outs, row, n, top_k=top_k)


def bin_rank_select(scores, start, end, top_k, cap, *, chunks=None, bins=None, cfg=None):
    """Exact Top-K of few dense score rows [T, S] over [start, end), ordered (score
    descending, then id ascending), padded with -1 / -inf: the chunk compaction, then
    one launch of ``bins`` programs a row (see the module's docstring). ``start`` and
    ``end`` as :func:`jsparse.ops.topk.triton.compact_rows` reads them. Returns (ids
    [T, K], scores [T, K], slow [T]: FAST, RETRIED or SEARCHED a row)."""
    t, s = scores.shape
    chunks = chunks or select.default_chunks(t, s)
    bins = bins or BINS
    cfg = cfg or select.SelectConfig()
    inputs = (scores, start, end)
    seg_codes, seg_ids, seg_counts = select.chunk_segments(
        inputs, t, top_k, cap, True, cfg, chunks, seg_codes=True
    )
    i32 = jnp.int32
    kernel = functools.partial(
        _bin_rank_kernel, top_k=top_k, cap=cap, chunks=chunks, bins=bins, cfg=cfg
    )
    out_ids, out_scores, _, _, _, slow = pallas_call(
        kernel,
        grid=(t, bins),
        out_shape=(
            jax.ShapeDtypeStruct((t * top_k,), i32),
            jax.ShapeDtypeStruct((t * top_k,), jnp.float32),
            jax.ShapeDtypeStruct((t * cap,), i32),  # scratch: the row's candidates by bin
            jax.ShapeDtypeStruct((t * cap,), i32),
            jax.ShapeDtypeStruct((t,), i32),  # the row's candidate count
            jax.ShapeDtypeStruct((t,), i32),
        ),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=backend.is_interpret(),
        name="jsparse_topk_bin_rank",
    )(*inputs, seg_codes.reshape(t * chunks, cap), seg_ids.reshape(t * chunks, cap), seg_counts)
    return out_ids.reshape(t, top_k), out_scores.reshape(t, top_k), slow
