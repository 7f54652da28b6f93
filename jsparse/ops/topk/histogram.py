"""Exact Top-K of a few dense rows from a histogram of their score codes.

The scorer that writes a row's scores also counts them into a histogram of the top 16
bits of their codes (:func:`count_bins`, 65,536 bins, plus 4,096 groups of 16 bins),
so the selection needs no threshold search and no sample:

1. :func:`_bucket_kernel`, one program per chunk of a row: the groups, summed from the
   top, give the group holding the K-th code, its 16 bins the bin b*. Every entry in a
   bin ≥ b* is a candidate; it is stored in its bin's bucket of a buffer ordered by bin
   (bins descending), its slot within the bucket from a fetch-and-add on the bin's
   cursor. Above b* there are fewer than K entries; b*'s bucket completes them.
2. :func:`_bucket_rank_kernel`: each candidate is ranked inside its own bucket (a
   higher code, or an equal one with a smaller id, is ahead); its bucket's start plus
   that rank is its rank in the row, and it is written there when below K. The row
   comes out selected and ordered.

Only buckets are compared, so the work is the sum of the candidates' bucket sizes,
usually a few hundred entries each. A boundary bucket of more than ``BUCKET_LIMIT``
entries (massive ties, or scores packed closer than a bin's width, 2^-7 relative) is
too many pairs; the rank kernel's first program then takes the row's exact path
instead: a radix search for the K-th code and the tie cut over the whole row
(:func:`jsparse.ops.topk.triton._exact_cut`), a compaction of the K entries and their
ranks among themselves.

Counts are float32, exact up to 2^24 entries a row (vector int32 atomics do nothing on
this backend; float32 ones work). The histogram sits in one zeroed buffer per row:
[bins | groups | cursors | one trash slot].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse.ops.topk import triton as topk_triton
from jsparse.ops.topk.codes import EMPTY_CODE

BIN_SHIFT = 16  # a bin: the top 16 bits of a code
BINS = 1 << (32 - BIN_SHIFT)
GROUP_BITS = 4  # 16 bins a group
GROUPS = BINS >> GROUP_BITS
GROUPS_AT = BINS  # offsets inside a row's histogram


def _layout():
    """(cursors at, trash at, row stride) for the current GROUP_COPIES."""
    cursors = BINS + GROUPS * GROUP_COPIES
    return cursors, cursors + BINS, cursors + BINS + 1


MAX_ENTRIES = 1 << 24  # float32 counts are exact up to here

# A boundary bucket above this many entries sends the row to the exact path (see the
# module docstring): ranking inside it costs its size squared in compares.
BUCKET_LIMIT = 4096
# Rows selected this way: the zeroed histogram is ~540 KB a row. None: off.
MAX_ROWS: int | None = None  # off: slower than the previous path (WORKSPACE.md runs 122-123)
CHUNK_ENTRIES = 1024  # entries a bucket program stores
BUCKET_BLOCK = 256  # ... per step (a step gathers 16 bins a candidate lane)
RANK_SLOTS = 64  # candidate slots a rank program ranks
RANK_BLOCK = 128  # bucket entries compared per step
# Experiment switches (run 123): what the scorer counts ("both", "bins", "groups",
# "none": the last three only for timing the scorer), group counters replicated over
# GROUP_COPIES copies by the scorer's split (atomics on one address serialise), and the
# exact path compiled into the rank kernel (False only for timing).
SCORER_COUNTS = "both"
GROUP_COPIES = 1
EXACT_IN_RANK = True


def selects(rows: int, width: int, top_k: int) -> bool:
    """Whether rows of ``width`` scores take this selection (``MAX_ROWS``, exact counts)."""
    return MAX_ROWS is not None and rows <= MAX_ROWS and width <= MAX_ENTRIES and top_k >= 1


def zeroed(rows: int) -> jax.Array:
    """The histograms a scorer launch counts into: one zeroed row each."""
    return jnp.zeros((rows * _layout()[2],), jnp.float32)


def code_bin(codes):
    """Bin of each int32 code: its top 16 bits, offset to [0, BINS) (signed order kept)."""
    return jnp.right_shift(codes, BIN_SHIFT) + (BINS // 2)


def _same_earlier(idx, ok):
    """(lanes of the same index before each lane, lanes of the same index) among ok lanes."""
    lane = jnp.arange(idx.shape[0], dtype=jnp.int32)
    same = (idx[:, None] == idx[None, :]) & ok[:, None] & ok[None, :]
    before = jnp.sum((same & (lane[None, :] < lane[:, None])).astype(jnp.int32), axis=1)
    return same, before, jnp.sum(same.astype(jnp.int32), axis=1)


def _add(ref, idx, ok, trash, *, aggregate, interpret):
    """Adds one to ref[idx] for each ok lane; returns each ok lane's fetch-and-add answer
    (the count before it, lanes of one index counted in lane order).

    Compiled, each lane is an atomic of its own unless ``aggregate``: then the first lane
    of each index adds the lanes sharing it, one atomic an index (a tile's scores share a
    few groups, and atomics on one address serialise). Interpreted, atomics apply a
    vector as one scatter, so lanes sharing an index would collapse: always aggregated,
    and without masks (which interpret mode rejects): masked lanes go to ``trash``.
    """
    if not (aggregate or interpret):
        ones = jnp.ones(idx.shape, jnp.float32)
        return plt.atomic_add(ref, (jnp.where(ok, idx, trash),), ones, mask=ok).astype(jnp.int32)
    same, before, group = _same_earlier(idx, ok)
    leader = ok & (before == 0)
    add = jnp.where(leader, group, 0).astype(jnp.float32)
    if interpret:
        old = plt.atomic_add(ref, (jnp.where(leader, idx, trash),), add)
    else:
        old = plt.atomic_add(ref, (jnp.where(leader, idx, trash),), add, mask=leader)
    old = jnp.where(leader, old.astype(jnp.int32), 0)
    # each lane's group leader's answer, then its place after the lanes before it
    lead_old = jnp.sum(jnp.where(same & leader[None, :], old[None, :], 0), axis=1)
    return lead_old + before


def count_bins(hist_ref, row, codes, ok, *, interpret, copy=0):
    """Counts a tile's codes [n] (``ok`` lanes) into row ``row``'s bins and groups (the
    groups' copy ``copy`` % GROUP_COPIES); the scorer's share of this selection."""
    _, trash_at, stride = _layout()
    base = row * stride
    trash = base + trash_at
    b = code_bin(codes)
    if SCORER_COUNTS in ("both", "bins"):
        _add(hist_ref, base + b, ok, trash, aggregate=False, interpret=interpret)
    if SCORER_COUNTS in ("both", "groups"):
        at = base + GROUPS_AT + (copy % GROUP_COPIES) * GROUPS
        _add(hist_ref, at + jnp.right_shift(b, GROUP_BITS), ok, trash, aggregate=True,
             interpret=interpret)  # fmt: skip


def _boundary(hist_ref, row, need):
    """(b*, entries in bins above b*, entries in bins ≥ b*, each group's entries above
    it [GROUPS]) of a row, b* the bin holding its ``need``-th largest code."""
    base = row * _layout()[2]
    g = jnp.arange(GROUPS, dtype=jnp.int32)
    # groups from the top (no reverse cumsum on this backend): j-th is GROUPS - 1 - j
    rev = jnp.zeros((GROUPS,), jnp.int32)
    for copy in range(GROUP_COPIES):
        at = base + GROUPS_AT + copy * GROUPS + GROUPS - 1 - g
        rev = rev + plt.load(hist_ref.at[at]).astype(jnp.int32)
    cum = jnp.cumsum(rev)
    j_star = jnp.min(jnp.where(cum >= need, g, GROUPS - 1))  # cum[-1] = entries ≥ need
    group_star = GROUPS - 1 - j_star
    above_group = jnp.sum(jnp.where(g == j_star, cum - rev, 0))
    f = jnp.arange(1 << GROUP_BITS, dtype=jnp.int32)
    top_bin = (group_star << GROUP_BITS) + (1 << GROUP_BITS) - 1
    fine_rev = plt.load(hist_ref.at[base + top_bin - f]).astype(jnp.int32)
    cum_f = above_group + jnp.cumsum(fine_rev)
    jf = jnp.min(jnp.where(cum_f >= need, f, (1 << GROUP_BITS) - 1))
    n_cand = jnp.sum(jnp.where(f == jf, cum_f, 0))
    n_above = n_cand - jnp.sum(jnp.where(f == jf, fine_rev, 0))
    return top_bin - jf, n_above, n_cand, (g, cum - rev)


def _bucket_kernel(
    scores_ref, start_ref, end_ref, hist_in_ref, hist_ref, codes_ref, ids_ref,
    lo_ref, hi_ref, info_ref, above_ref, *, top_k, chunks, blk, interpret,
):  # fmt: skip
    """Program (row, chunk): the row's boundary bin from its histogram, then the
    candidates of its chunk of the row stored in their buckets (see the module
    docstring). Chunk 0 writes the row's (candidates, entries above b*)."""
    del hist_in_ref  # aliased: the same buffer as hist_ref
    row, chunk = pl.program_id(0), pl.program_id(1)
    source = (scores_ref, start_ref, end_ref)
    _, block, lo, hi = topk_triton._row_source(source, True, row, blk)
    need = jnp.minimum(top_k, hi - lo)
    b_star, n_above, n_cand, (g, group_above) = _boundary(hist_ref, row, need)
    # each group's entries above it, in this program's scratch (read back by gathers)
    scratch = (row * chunks + chunk) * GROUPS
    plt.store(above_ref.at[scratch + GROUPS - 1 - g], group_above)

    @pl.when(chunk == 0)
    def _():
        plt.store(info_ref.at[2 * row], n_cand)
        plt.store(info_ref.at[2 * row + 1], n_above)

    if not interpret:
        plt.debug_barrier()  # the scratch is written and read by different threads
    cap = scores_ref.shape[1]
    cursors_at, trash_at, stride = _layout()
    base = row * stride
    trash_slot = codes_ref.shape[0]
    f = jnp.arange(1 << GROUP_BITS, dtype=jnp.int32)
    first, total = topk_triton._aligned_blocks(lo, hi, blk)
    per_chunk = (total + chunks - 1) // chunks
    own = jnp.clip(total - chunk * per_chunk, 0, per_chunk)

    def store_candidates(c, i, cand):
        b = code_bin(c)
        group = jnp.right_shift(b, GROUP_BITS)
        start = plt.load(above_ref.at[scratch + jnp.where(cand, group, 0)], mask=cand, other=0)
        later = cand[:, None] & (f[None, :] > (b & ((1 << GROUP_BITS) - 1))[:, None])
        in_group = plt.load(
            hist_ref.at[base + (group << GROUP_BITS)[:, None] + f[None, :]], mask=later, other=0.0
        )  # fmt: skip
        start = start + jnp.sum(in_group, axis=1).astype(jnp.int32)
        size = plt.load(hist_ref.at[base + jnp.where(cand, b, 0)], mask=cand, other=0.0)
        cursor = base + cursors_at + b
        slot = start + _add(hist_ref, cursor, cand, base + trash_at, aggregate=False,
                            interpret=interpret)  # fmt: skip
        dst = jnp.where(cand, row * cap + slot, trash_slot)
        plt.store(codes_ref.at[dst], c, mask=cand)
        plt.store(ids_ref.at[dst], i, mask=cand)
        plt.store(lo_ref.at[dst], start, mask=cand)
        plt.store(hi_ref.at[dst], start + size.astype(jnp.int32), mask=cand)

    def body(j, carry):
        c, i, ok = block(first + (chunk * per_chunk + j) * blk)
        cand = ok & (code_bin(c) >= b_star)
        jax.lax.cond(jnp.sum(cand.astype(jnp.int32)) > 0, store_candidates,
                     lambda *_: None, c, i, cand)  # fmt: skip
        return carry

    jax.lax.fori_loop(0, own, body, 0)


def _bucket_rank_kernel(codes_ref, ids_ref, lo_ref, hi_ref, info_ref, scores_ref, start_ref,
                        end_ref, out_ids_ref, out_scores_ref, k_codes_ref, k_ids_ref, *,
                        top_k, cap, bc, bj, limit, blk, interpret):  # fmt: skip
    """Program (row, part): ranks its ``bc`` candidate slots inside their buckets and
    writes those below K at their rank (and the padding of slots in [candidates, K));
    when the boundary bucket holds more than ``limit``, part 0 takes the row's exact path
    and the others do nothing."""
    row, part = pl.program_id(0), pl.program_id(1)
    rows = info_ref.shape[0] // 2
    n_cand = plt.load(info_ref.at[2 * row])
    n_above = plt.load(info_ref.at[2 * row + 1])
    visible = plt.load(end_ref.at[row]) - plt.load(start_ref.at[row])
    exact = (n_cand - n_above > limit) & (visible > top_k)
    first = part * bc
    outs = (out_ids_ref, out_scores_ref)

    @pl.when(~exact & (first < jnp.maximum(n_cand, top_k)))
    def _():
        slot_i, live_i, at_i, c_i, id_i = topk_triton._ranked_slots(
            codes_ref, ids_ref, row, first, n_cand, cap, bc
        )
        lo_i = plt.load(lo_ref.at[at_i], mask=live_i, other=0)
        hi_i = plt.load(hi_ref.at[at_i], mask=live_i, other=0)
        span_lo = jnp.min(jnp.where(live_i, lo_i, n_cand))
        span_hi = jnp.max(jnp.where(live_i, hi_i, 0))
        lanes = jnp.arange(bj, dtype=jnp.int32)

        def body(j, ahead):
            u = span_lo + j * bj + lanes
            ok = u < span_hi
            at_u = row * cap + jnp.where(ok, u, 0)
            c_u = plt.load(codes_ref.at[at_u], mask=ok, other=EMPTY_CODE)
            id_u = plt.load(ids_ref.at[at_u], mask=ok, other=-1)
            inside = (u[None, :] >= lo_i[:, None]) & (u[None, :] < hi_i[:, None])
            tie = (c_u[None, :] == c_i[:, None]) & (id_u[None, :] < id_i[:, None])
            return ahead + (inside & ((c_u[None, :] > c_i[:, None]) | tie)).astype(jnp.int32)

        steps = jnp.maximum(span_hi - span_lo + bj - 1, 0) // bj
        ahead = jax.lax.fori_loop(0, steps, body, jnp.zeros((bc, bj), jnp.int32))
        rank = lo_i + jnp.sum(ahead, axis=1)
        topk_triton._write_at_rank(outs, row, rank, slot_i, live_i, c_i, id_i, top_k, rows)

    if not EXACT_IN_RANK:
        return

    @pl.when(exact & (part == 0))
    def _():
        refs = (scores_ref, start_ref, end_ref, k_codes_ref, k_ids_ref, outs)
        _exact_row_ranked(*refs, row, rows=rows, top_k=top_k, bc=bc, bj=bj, blk=blk,
                          interpret=interpret)  # fmt: skip


def _exact_row_ranked(scores_ref, start_ref, end_ref, k_codes_ref, k_ids_ref, outs, row, *,
                      rows, top_k, bc, bj, blk, interpret):  # fmt: skip
    """A row's exact Top-K in one program (more than K visible entries): the K-th code
    and tie cut by radix search, the K entries compacted in id order, each ranked
    against the other K - 1 and written at its rank."""
    source = (scores_ref, start_ref, end_ref)
    _, block, lo, hi = topk_triton._row_source(source, True, row, blk)
    count, count_many, compact = topk_triton._streaming(
        block, *topk_triton._aligned_blocks(lo, hi, blk), blk
    )
    kth, cut = topk_triton._exact_cut(count, count_many, top_k)
    keep = lambda c, i: (c > kth) | ((c == kth) & (i <= cut))  # noqa: E731
    trash = k_codes_ref.shape[0]
    compact(keep, k_codes_ref, k_ids_ref, row * top_k, top_k, trash, peel=False)
    if not interpret:
        plt.debug_barrier()  # the K entries are read back by other threads

    def part(p, carry):
        # in id order, so an equal code ranks ahead exactly when it sits in an earlier slot
        slot_i, live_i, _, c_i, id_i = topk_triton._ranked_slots(
            k_codes_ref, k_ids_ref, row, p * bc, top_k, top_k, bc
        )

        def body(j, ahead):
            slot_j = j * bj + jnp.arange(bj, dtype=jnp.int32)
            c_j = topk_triton._slot_codes(k_codes_ref, row, top_k, slot_j, top_k)
            earlier = (slot_j[None, :] < slot_i[:, None]).astype(jnp.int32)
            return ahead + (c_j[None, :] > c_i[:, None] - earlier).astype(jnp.int32)

        n_blocks = (top_k + bj - 1) // bj
        ahead = jax.lax.fori_loop(0, n_blocks, body, jnp.zeros((bc, bj), jnp.int32))
        rank = jnp.sum(ahead, axis=1)
        topk_triton._write_at_rank(outs, row, rank, slot_i, live_i, c_i, id_i, top_k, rows)
        return carry

    jax.lax.fori_loop(0, (top_k + bc - 1) // bc, part, 0)


@functools.partial(jax.jit, static_argnames=("top_k",))
def select(scores, hist, start, end, top_k):
    """Exact Top-K of dense rows ``scores`` [T, S] over [start, end), ordered (score
    descending, then id ascending; -1 / -inf padding), from the histograms ``hist`` that
    the scorer counted them into (:func:`count_bins`). Returns (ids, scores) [T, K]."""
    t, width = scores.shape
    interpret = backend.is_interpret()
    chunks = max(1, -(-width // CHUNK_ENTRIES))
    params = plt.CompilerParams(num_warps=4, num_stages=1)
    ints = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
    hist, codes, ids, lo, hi, info, _ = pl.pallas_call(
        functools.partial(
            _bucket_kernel, top_k=top_k, chunks=chunks, blk=BUCKET_BLOCK, interpret=interpret
        ),
        grid=(t, chunks),
        out_shape=(
            jax.ShapeDtypeStruct(hist.shape, jnp.float32),
            *(ints(t * width),) * 4,
            ints(2 * t),
            ints(t * chunks * GROUPS),
        ),
        input_output_aliases={3: 0},
        compiler_params=params,
        interpret=interpret,
        name="jsparse_topk_buckets",
    )(scores, start, end, hist)
    del hist
    limit = min(BUCKET_LIMIT, width)
    parts = -(-(limit + top_k) // RANK_SLOTS)
    out_ids, out_scores, _, _ = pl.pallas_call(
        functools.partial(
            _bucket_rank_kernel,
            top_k=top_k,
            cap=width,
            bc=RANK_SLOTS,
            bj=RANK_BLOCK,
            limit=limit,
            blk=topk_triton.SelectConfig().block,
            interpret=interpret,
        ),
        grid=(t, parts),
        out_shape=(
            ints(t * top_k),
            jax.ShapeDtypeStruct((t * top_k,), jnp.float32),
            ints(t * top_k),
            ints(t * top_k),
        ),
        compiler_params=params,
        interpret=interpret,
        name="jsparse_topk_bucket_rank",
    )(codes, ids, lo, hi, info, scores, start, end)
    return out_ids.reshape(t, top_k), out_scores.reshape(t, top_k)
