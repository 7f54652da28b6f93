"""One query's exact Top-K in a single launch: score, θ, compaction and ranking.

Not dispatched by any method: measured slower than ``base`` (below). At one decode
query the four launches of ``base`` (scorer, chunk compaction, merge, rank select)
each pay a launch's ramp and a dependent chain of loads, ~11 µs of a 19 µs step at 64K
keys (WORKSPACE.md, run 112). Here one launch of ``G`` programs (at most one per SM, so
all of them are resident at once) does all of it, its phases meeting at barriers in
global memory:

1. *Sample and score.* Programs ``0 .. Q-1`` score the θ sample's keys (the positions
   of :func:`jsparse.ops.topk.triton.sample_positions`) and store their codes; the
   other programs score their contiguous share of the key tiles and store the dense
   score row.
2. *θ.* Program 0 waits for the sample and searches its θ as the chunk compaction
   does (:func:`jsparse.ops.topk.triton.sample_threshold_of`) and publishes it, while
   the scoring programs are still streaming keys.
3. *Compaction.* Each scoring program reloads its own scores, counts those ≥ θ and
   publishes the count.
4. *Placement.* Once every count is in, each program stores its (code, id) records at
   the sum of the counts before its own: program order is id order, so the buffer is
   in id order, as ``base``'s merge leaves it. With ``BUCKETS`` > 1 the counts are per
   code bucket and the buffer holds the buckets highest first, each in id order.
5. *Ranking.* Every program reads the total. If it misses [min(K, L), cap] (an
   unlucky sample, massive ties), program 0 runs the row's exact slow path
   (:func:`jsparse.ops.topk.triton._exact_row`) over the dense scores while the others
   wait. Then each program ranks its share of the candidates against all of them (or
   their buckets' slots) (:func:`jsparse.ops.topk.triton.rank_block`, ``base``'s rank
   select: one compare a pair, ties broken by slot) and writes each one whose rank is
   below K at that rank, and the padding.

The arithmetic is ``base``'s (one scorer tile, :func:`triton._score_tile`, and the
same codes), so results equal ``base`` id for id and score for score.

Barriers: an arrival is a CTA barrier (every thread's stores are done) followed by a
fetch-and-add, which this backend emits with acquire-release semantics at GPU scope.
A wait polls with fetch-and-adds of 0 (one thread issues each and the program shares
the answer, so a warp leaves the loop together: the aligned CTA barrier after it hung
on divergent warps, run 136). Waits only wait on earlier phases and all programs are
resident (``G`` ≤ SMs, one program fits an SM), so they cannot deadlock; a wait gives
up after ``SPIN_LIMIT`` polls (seconds) and counts itself in the sync words rather
than hang. In interpret mode (CPU) programs run one after another, so the five phases
are five launches of the same body and the barriers are the launch boundaries.

Measured (H200, GPU busy µs, keys cold, runs 142-146; WORKSPACE.md): at 1 × 64K the
step takes 20.7 bf16 / 19.9 fp8 against ``base``'s 18.8 / 17.3, always equal to it id
for id. By phase (bf16): scoring alone 8.2, + θ 10.5 (θ's path, sample then search in
program 0, ends ~2.3 after the streaming), + compaction and placement 13.6, +
ranking ~7. The ranking is the n² compares of ~3200 candidates: ~5 µs even as
``base``'s own launch of ~400 programs, ~7.5 at one program an SM, whatever the tile
or warps (runs 143-144). Buckets (``BUCKETS``) cut it to 0.9 µs at 16, but cost more
to count and place than they save (run 146).
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
from jsparse._pallas import pallas_call
from jsparse.ops.indexer import triton as scorer
from jsparse.ops.topk import triton as select
from jsparse.ops.topk.codes import EMPTY_CODE, score_code

_NEG_INF = float("-inf")
PHASES = ("score", "theta", "compact", "place", "rank")
SAMPLE_PROGRAMS = 16  # programs that score the θ sample (4096 keys: 256 each; 8: +1.9 µs, run 139)
# Ranking tile: BI candidates against blocks of BJ, counts per lane (or summed a
# block). 8 × 512 per lane was the fastest of six (runs 143, 146), by ~1 µs.
RANK_BLOCK, RANK_CHUNK, RANK_PER_LANE = 8, 512, True
# Candidates may be placed grouped by code into this many buckets (linear in code
# space between θ and the sample's largest code), each ranked only within its own:
# ~n²/B pairs. At 1 × 64K bf16 (run 146) the ranking fell from 7.1 µs to 0.9 at 16
# buckets, but counting and placing a bucket at a time cost ~0.6 µs a bucket, so the
# step was slower at every B > 1 (1: 20.7 µs, 4: 22.1, 8: 22.5, 16: 24.8).
BUCKETS = 1
SPIN_LIMIT = 1 << 22  # polls of one wait before it gives up (~1-2 s)
# Sync words: sample arrivals, θ published, placements, compaction arrivals,
# slow path done, aborted waits.
_SAMPLED, _THETA, _PLACED, _COMPACTED, _SLOW_DONE, _ABORTED = range(6)
_SYNC_WORDS = 8


@dataclasses.dataclass(frozen=True)
class _Plan:
    s: int  # keys
    heads: int
    dim: int
    compute: np.dtype
    top_k: int
    cap: int
    programs: int  # G
    block_s: int  # keys per scorer tile
    rank_block: int  # candidates a program ranks at a time (BI)
    rank_chunk: int  # candidates compared against at a time (BJ, a multiple of BI)
    rank_per_lane: bool  # counts kept per (candidate, lane) until the end
    counts_width: int  # a power of two ≥ the scoring programs
    buckets: int  # code buckets of the candidate buffer (1: ungrouped)
    compact_block: int  # scores a compaction step reloads
    compact_single: bool  # one block holds any program's scores
    has_scale: bool
    fused: bool  # one launch with barriers; else one launch per phase (interpret)


def _wait(sync_ref, word, target, fused):
    """Waits until sync word ``word`` ≥ target (see the module docstring); returns
    whether it got there. Outside a fused launch the phases are launches, and the
    word is already final."""
    if not fused:
        return plt.load(sync_ref.at[jnp.int32(word)]) >= target

    # Each poll is a fetch-and-add of 0: one thread issues it and the program shares
    # its answer, so every thread leaves the loop together. (Volatile loads, one a
    # thread, let threads of a warp leave at different polls, and the aligned barrier
    # after the loop then hung the GPU: run 136.)
    def polling(state):
        value, polls = state
        return (value < target) & (polls < SPIN_LIMIT)

    def poll(state):
        return plt.atomic_add(sync_ref, (jnp.int32(word),), jnp.int32(0)), state[1] + 1

    value, _ = jax.lax.while_loop(polling, poll, poll((jnp.int32(0), 0)))
    plt.debug_barrier()
    ok = value >= target

    @pl.when(~ok)
    def _():
        _arrive(sync_ref, _ABORTED, True)

    return ok


def _arrive(sync_ref, word, fused, n=1):
    """Adds ``n`` to sync word ``word`` once every thread's stores are done; returns the
    old value."""
    if fused:
        plt.debug_barrier()
    return plt.atomic_add(sync_ref, (jnp.int32(word),), jnp.int32(n))


def _kernel(q_ref, w_ref, k_ref, start_ref, end_ref, *refs, p: _Plan, phases):
    scale_ref = refs[0] if p.has_scale else None
    outs = refs[len(refs) - 11 :]  # after any aliased inputs
    (scores_ref, sample_ref, theta_ref, cand_codes_ref, cand_ids_ref, count_ref,
     path_ref, sync_ref, out_ids_ref, out_scores_ref, counts_ref) = outs  # fmt: skip
    g = pl.program_id(0)
    q2 = plt.load(q_ref.at[pl.ds(0, 1), :, :]).astype(p.compute).reshape(p.heads, p.dim)
    w = plt.load(w_ref.at[pl.ds(0, 1), :])
    q_sample, n_scorers = SAMPLE_PROGRAMS, p.programs - SAMPLE_PROGRAMS
    zero = jnp.int32(0)
    lo = jnp.clip(plt.load(start_ref.at[zero]), 0, p.s)  # as _checks.clamp_ranges
    hi = jnp.clip(plt.load(end_ref.at[zero]), lo, p.s)
    length = hi - lo
    bs = p.block_s
    dims = jnp.arange(p.dim, dtype=jnp.int32)
    # the scorer's tile ranges, as base's split scorer assigns them
    first_tile, last_tile = scorer.tile_span(lo, hi, bs)
    own = g - q_sample  # index among the scoring programs
    begin, stop = scorer.split_span(first_tile, last_tile, n_scorers, own)

    def tile_scores(ids, ok):
        """Scores [BS] of keys ``ids`` where ``ok`` (elsewhere: what masked loads give)."""
        safe = jnp.where(ok, ids, 0)
        k_tile = plt.load(
            k_ref.at[safe[:, None], dims[None, :]], mask=ok[:, None],
            other=jnp.zeros((), k_ref.dtype),
        )  # fmt: skip
        scale = plt.load(scale_ref.at[safe], mask=ok, other=0.0) if p.has_scale else None
        k_tile = k_tile.astype(p.compute)
        return scorer._score_tile([q2], w, [k_tile], scale, block_t=1, heads=p.heads)[0]

    if "score" in phases:

        @pl.when(g < q_sample)
        def _():
            n_sample = select.SAMPLE_BLOCKS * select.SAMPLE_BLOCK
            per_program = n_sample // q_sample

            def body(j, carry):
                k = g * per_program + j * bs + jnp.arange(bs, dtype=jnp.int32)
                pos, ok = select.sample_positions(k, length)
                s = tile_scores(lo + pos, ok)
                plt.store(sample_ref.at[k], jnp.where(ok, score_code(s), EMPTY_CODE))
                return carry

            jax.lax.fori_loop(0, per_program // bs, body, 0)
            _arrive(sync_ref, _SAMPLED, p.fused)

        @pl.when(g >= q_sample)
        def _():
            def body(j, carry):
                ids = j * bs + jnp.arange(bs, dtype=jnp.int32)
                in_bounds = ids < p.s
                s = tile_scores(ids, in_bounds)
                visible = (ids >= lo) & (ids < hi)
                plt.store(
                    scores_ref.at[zero, jnp.where(in_bounds, ids, p.s)],
                    jnp.where(visible, s, _NEG_INF), mask=in_bounds,
                )  # fmt: skip
                return carry

            jax.lax.fori_loop(begin, stop, body, 0)

    if "theta" in phases:

        @pl.when(g == 0)
        def _():
            _wait(sync_ref, _SAMPLED, q_sample, p.fused)
            n_sample = select.SAMPLE_BLOCKS * select.SAMPLE_BLOCK
            sample = plt.load(sample_ref.at[pl.ds(0, n_sample)])
            theta = select.sample_threshold_of(sample, length, p.top_k, p.cap)
            plt.store(theta_ref.at[zero], theta)
            plt.store(theta_ref.at[jnp.int32(1)], jnp.max(sample))
            _arrive(sync_ref, _THETA, p.fused)

    buckets = jnp.arange(p.buckets, dtype=jnp.int32)

    def bucket_counts():
        """(this program's first slot in each bucket, each bucket's first slot, each
        bucket's size): from the scoring programs' published [bucket, program] counts. Buckets
        are placed highest codes first, each in program order, which is id order."""
        lanes = jnp.arange(p.counts_width, dtype=jnp.int32)
        scoring = lanes < n_scorers
        at = buckets[:, None] * p.counts_width + jnp.where(scoring, lanes, 0)[None, :]
        table = plt.load(counts_ref.at[at], mask=scoring[None, :], other=0)
        totals = jnp.sum(table, axis=1)
        starts = jnp.cumsum(totals) - totals
        below = jnp.sum(jnp.where(lanes[None, :] < own, table, 0), axis=1)
        return starts + below, starts, totals

    def bucket_of(codes, theta, top):
        """Bucket of each code ≥ θ, 0 holding the highest. Monotone in the code (float
        conversion, subtraction, a positive scale and truncation all are), so equal
        codes share a bucket and a higher code is never in a later one."""
        f32 = jnp.float32
        top = jnp.maximum(top, theta).astype(f32)
        width = (top - theta.astype(f32) + 1.0) / p.buckets
        b = ((codes.astype(f32) - theta.astype(f32)) / width).astype(jnp.int32)
        return (p.buckets - 1) - jnp.clip(b, 0, p.buckets - 1)

    def by_bucket(block, theta, top, base=None):
        """([buckets] the block's kept records in each bucket, and, from ``base`` (each
        bucket's next slot), each record's slot: its bucket's next, in id order). One
        bucket at a time on [block] vectors: a [block, buckets] one-hot spilled
        registers (run 145: +9 µs at 16 buckets)."""
        x, _, keep = block
        b = bucket_of(score_code(x), theta, top)
        sizes, pos = buckets * 0, jnp.zeros_like(b)
        for j in range(p.buckets):
            in_j = (keep & (b == j)).astype(jnp.int32)
            sizes = jnp.where(buckets == j, jnp.sum(in_j), sizes)
            if base is not None:
                first = jnp.sum(jnp.where(buckets == j, base, 0))
                pos = jnp.where(in_j > 0, first + jnp.cumsum(in_j) - 1, pos)
        return sizes, pos

    if "compact" in phases or "place" in phases:

        @pl.when(g >= q_sample)
        def _():
            cb = p.compact_block
            a0, a1 = jnp.maximum(begin * bs, lo), jnp.minimum(stop * bs, hi)
            n_blocks = jnp.maximum(a1 - a0 + cb - 1, 0) // cb
            lanes = jnp.arange(cb, dtype=jnp.int32)
            theta = top = None

            def kept(j):
                ids = a0 + j * cb + lanes
                ok = ids < a1
                x = plt.load(scores_ref.at[zero, jnp.where(ok, ids, 0)], mask=ok, other=0.0)
                return x, ids, ok & select._at_least(theta, True)(x, ids)

            held = None

            def count(block):
                return by_bucket(block, theta, top)[0]

            if "compact" in phases:  # count the scores ≥ θ by bucket, publish the counts
                _wait(sync_ref, _THETA, 1, p.fused)
                theta, top = plt.load(theta_ref.at[zero]), plt.load(theta_ref.at[jnp.int32(1)])
                if p.compact_single:  # one block holds them: loaded once, kept in registers
                    held = kept(0)
                    n_kept = count(held)
                else:
                    n_kept = jax.lax.fori_loop(
                        0, n_blocks, lambda j, n: n + count(kept(j)), buckets * 0
                    )
                plt.store(counts_ref.at[buckets * p.counts_width + own], n_kept)
                _arrive(sync_ref, _COMPACTED, p.fused)

            if "place" in phases:
                # Every count is in: the records go to the buffer in program order, which
                # is id order, so the ranking breaks ties by slot (one compare a pair).
                _wait(sync_ref, _COMPACTED, n_scorers, p.fused)
                if theta is None:  # a launch of its own (interpret mode)
                    theta, top = plt.load(theta_ref.at[zero]), plt.load(theta_ref.at[jnp.int32(1)])
                offset, _, totals = bucket_counts()
                total = jnp.sum(totals)

                def place(block, base):  # base: [buckets] the next slot of each
                    x, ids, keep_j = block
                    sizes, pos = by_bucket(block, theta, top, base)
                    ok = keep_j & (pos < p.cap)
                    dst = jnp.where(ok, pos, p.cap)  # slot cap: the trash
                    plt.store(cand_codes_ref.at[dst], score_code(x), mask=ok)
                    plt.store(cand_ids_ref.at[dst], ids, mask=ok)
                    return base + sizes

                @pl.when(select._fits(total, p.top_k, length, p.cap))  # else: the slow path
                def _():
                    if held is not None:
                        place(held, offset)
                    else:
                        jax.lax.fori_loop(0, n_blocks, lambda j, b: place(kept(j), b), offset)

                _arrive(sync_ref, _PLACED, p.fused)

    if "rank" in phases:
        _wait(sync_ref, _PLACED, n_scorers, p.fused)
        _, starts, sizes = bucket_counts()
        total = jnp.sum(sizes)
        fast = select._fits(total, p.top_k, length, p.cap)

        @pl.when(~fast & (g == 0))
        def _():
            source = (scores_ref, start_ref, end_ref)
            bufs = (cand_codes_ref, cand_ids_ref, count_ref, path_ref)
            cfg = select.SelectConfig()
            select._exact_row(source, True, zero, total, bufs, top_k=p.top_k, cap=p.cap, cfg=cfg)
            _arrive(sync_ref, _SLOW_DONE, p.fused)

        @pl.when(fast & (g == 0))
        def _():
            plt.store(count_ref.at[zero], total)
            plt.store(path_ref.at[zero], select.FAST)

        @pl.when(~fast)
        def _():
            _wait(sync_ref, _SLOW_DONE, 1, p.fused)

        n = jnp.where(fast, total, plt.load(count_ref.at[zero]))
        # the slow path's buffer is one group in id order
        starts = jnp.where(fast, starts, 0)
        ends = jnp.where(fast, starts + sizes, n)
        bi = p.rank_block
        n_rounds = (jnp.maximum(n, p.top_k) + p.programs * bi - 1) // (p.programs * bi)

        def one_round(r, carry):
            first = (r * p.programs + g) * bi
            last = jnp.minimum(first + bi, n) - 1
            # the buckets of the block's first and last live slots bound what it ranks against
            lo = jnp.max(jnp.where(starts <= first, starts, 0))
            hi = jnp.min(jnp.where(ends > last, ends, n))
            select.rank_block(cand_codes_ref, cand_ids_ref, (out_ids_ref, out_scores_ref), zero,
                              first, n, top_k=p.top_k, cap=p.cap, bi=bi, bj=p.rank_chunk,
                              rows=1, per_lane=p.rank_per_lane, span=(lo, hi))  # fmt: skip
            return carry

        jax.lax.fori_loop(0, n_rounds, one_round, 0)


def plan_for(q, k, top_k, k_scale, *, programs=None):
    """(plan, scorer config) of a launch over padded q [1, H, D] and k [S, D]: the
    scorer's one-query decode tiles, ``base``'s candidate capacity, ``programs`` (default:
    one an SM; more would not all be resident, and the waits could not end)."""
    from jsparse.ops.indexer import methods

    s = k.shape[0]
    cfg = scorer.default_config(1, q.shape[1], k.dtype == jnp.float8_e4m3fn)
    programs = programs or backend.sm_count()
    if not SAMPLE_PROGRAMS < programs <= backend.sm_count():
        raise ValueError(
            f"one-launch Top-K: programs must exceed the {SAMPLE_PROGRAMS} that score the "
            f"θ sample and be at most the {backend.sm_count()} SMs, got {programs}"
        )
    n_tiles = -(-s // cfg.block_s)
    per_max = -(-n_tiles // (programs - SAMPLE_PROGRAMS)) * cfg.block_s
    return _Plan(
        s=s, heads=q.shape[1], dim=q.shape[2],
        compute=scorer.compute_dtype(q.dtype, k.dtype, False), top_k=top_k,
        cap=methods.candidate_capacity(top_k, s), programs=programs, block_s=cfg.block_s,
        rank_block=RANK_BLOCK, rank_chunk=RANK_CHUNK, rank_per_lane=RANK_PER_LANE,
        counts_width=scorer.next_pow2(programs), buckets=BUCKETS,
        compact_block=min(4096, scorer.next_pow2(per_max)),
        compact_single=per_max <= 4096,
        has_scale=k_scale is not None, fused=not backend.is_interpret(),
    ), cfg  # fmt: skip


@backend.jit_per_mode(static_argnames=("top_k", "programs"))
def topk_one_launch(q, weights, k, top_k, k_scale, start, end, *, programs=None):
    """(ids [1, K], scores [1, K], count [1], path [1], sync words) of one query over keys
    [start, end) (see the module docstring)."""
    q, weights, k = scorer._pad_heads_dims(q, weights, k, 1)
    p, cfg = plan_for(q, k, top_k, k_scale, programs=programs)
    i32, f32 = jnp.int32, jnp.float32
    n_sample = select.SAMPLE_BLOCKS * select.SAMPLE_BLOCK
    # Interpreted, a masked-off lane of a scatter still writes (its old value), so the
    # outputs carry a trash slot there; on the GPU it accesses nothing, and a [K + 1]
    # output would cost two copies to slice (run 137: 1.8 µs).
    trash = 0 if p.fused else 1
    state = (
        jax.ShapeDtypeStruct((1, p.s), f32),  # scores
        jax.ShapeDtypeStruct((n_sample,), i32),  # sample codes
        jax.ShapeDtypeStruct((2,), i32),  # θ, the sample's largest code
        jax.ShapeDtypeStruct((p.cap + 1,), i32),  # candidate codes (+ a trash slot)
        jax.ShapeDtypeStruct((p.cap + 1,), i32),  # candidate ids
        jax.ShapeDtypeStruct((1,), i32),  # count
        jax.ShapeDtypeStruct((1,), i32),  # path
        jax.ShapeDtypeStruct((_SYNC_WORDS,), i32),  # sync words
        jax.ShapeDtypeStruct((top_k + trash,), i32),  # ids
        jax.ShapeDtypeStruct((top_k + trash,), f32),  # scores
        jax.ShapeDtypeStruct((p.buckets * p.counts_width,), i32),  # [bucket, program] counts
    )
    inputs = (q, weights, k, start, end) + ((k_scale,) if p.has_scale else ())
    compiler = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    sync_index = 7

    def launch(phases, carried):
        # carried: the whole state, or the sync words alone (which must start at 0)
        to = range(len(state)) if len(carried) == len(state) else (sync_index,)
        return pallas_call(
            functools.partial(_kernel, p=p, phases=phases),
            grid=(p.programs,),
            out_shape=state,
            input_output_aliases={len(inputs) + j: o for j, o in enumerate(to)},
            compiler_params=compiler,
            interpret=backend.is_interpret(),
            name="jsparse_indexer_one_launch",
        )(*inputs, *carried)

    zeros_sync = jnp.zeros((_SYNC_WORDS,), i32)
    if p.fused:
        outs = launch(PHASES, (zeros_sync,))
    else:
        outs = tuple(
            zeros_sync if j == sync_index else jnp.zeros(x.shape, x.dtype)
            for j, x in enumerate(state)
        )
        for phase in PHASES:
            outs = launch((phase,), outs)
    *_, count, path, sync, out_ids, out_scores, _ = outs
    if trash:
        out_ids, out_scores = out_ids[:top_k], out_scores[:top_k]
    return out_ids[None], out_scores[None], count, path, sync
