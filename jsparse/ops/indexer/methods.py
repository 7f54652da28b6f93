"""``base`` and ``full`` composed from the Triton scorer and selection kernels.

base:  scorer → dense [T, S] scores → compact_rows (ids) → select_rows → order
full:  scorer on seed keys → τ (K-th seed score) → scorer writes records ≥ τ
       → select_candidates → order; a query whose records overflow the buffer is
       answered by ``base`` instead (reported in ``fallback``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jsparse import backend
from jsparse.ops.indexer import triton as scorer
from jsparse.ops.indexer.report import exhaustive_report
from jsparse.ops.indexer.result import IndexerTopK
from jsparse.ops.topk import triton as select
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def candidate_capacity(top_k: int, num_keys: int) -> int:
    """Slots per row for compact_rows: 2·K plus room for the sample's granularity, or
    more where the θ sample's rank can overshoot that (rows past 128K at K = 2048:
    :func:`jsparse.ops.topk.triton.sample_capacity_floor`).

    Not a power of two on purpose: at 8192 × 128K i.i.d. scores the largest row count was
    4076 for K = 2048 (WORKSPACE.md run 22), so a 4096-slot buffer sent 5 rows off the
    fast path (then ~40 passes over the row in one program; now usually one retry pass,
    still a second pass over the row).
    """
    spacing = -(-num_keys // (select.SAMPLE_BLOCKS * select.SAMPLE_BLOCK))
    floor = select.sample_capacity_floor(top_k, num_keys) if spacing > 1 else 0
    return _round_up(max(2 * top_k + 16 * spacing, floor), 256)


def default_seed_count(top_k: int, num_keys: int) -> int:
    """Seeds per query block for ``full``: √(K·S/6), between 2·K and S.

    τ is the K-th seed score, so on unstructured data about S·K/n keys score above it.
    Scoring a key costs ~6× writing and selecting its record (H=64, D=128 on an H200),
    so n = √(K·S/6) balances the two; structured data (recency) does better.
    """
    n = int(math.sqrt(top_k * num_keys / 6))
    return min(num_keys, _round_up(max(2 * top_k, n), 256))


def default_record_capacity(top_k: int, num_keys: int, n_seeds: int) -> int:
    """Records per query for ``full``: twice the count expected on unstructured data.

    With τ the K-th of n seed scores, about S·K/n keys score ≥ τ when scores carry no
    structure; a query that writes more falls back to ``base`` (reported).
    """
    return min(_round_up(num_keys, 256), _round_up(2 * top_k * num_keys // n_seeds + top_k, 256))


def block_seed_ids(start, end, block_t, n_seeds, num_keys):
    """One seed list per query block, from the block's combined range.

    Half the seeds are the most recent keys, half a strided sample of the rest (recent
    keys score high on causal text). The kernel masks each seed by its query's own
    range, so every seed a query uses is visible to it, and the list is distinct.
    """
    lo, hi = block_ranges(start, end, block_t, num_keys)
    return recent_and_strided_ids(jnp.minimum(lo, hi), hi, n_seeds)


def block_ranges(start, end, block_t, num_keys):
    """Per query block of ``block_t`` queries, the range [lo, hi) spanning its queries'
    non-empty ranges; a block with none gets lo = ``num_keys``, hi = 0."""
    t = start.shape[0]
    pad = (-t) % block_t
    s_blk = jnp.pad(start, (0, pad), constant_values=num_keys).reshape(-1, block_t)
    e_blk = jnp.pad(end, (0, pad), constant_values=0).reshape(-1, block_t)
    lo = jnp.min(jnp.where(e_blk > s_blk, s_blk, num_keys), axis=1)
    hi = jnp.max(jnp.where(e_blk > s_blk, e_blk, 0), axis=1)
    return lo, hi


def recent_and_strided_ids(lo, hi, n: int):
    """Per row, n distinct ids in [lo, hi): the most recent half, a strided sample of the rest.

    Recent keys score high on causal text (locality); the strided sample covers the rest
    of the range. A range shorter than n gives every id in it, then -1 padding.
    """
    recent = n // 2
    j = jnp.arange(n, dtype=jnp.int32)[None, :]
    lo, hi = lo[:, None], hi[:, None]
    length = hi - lo
    rest = jnp.maximum(length - recent, 0)
    # recent part: hi-1, hi-2, ...; sampled part: evenly spread over [lo, hi - recent)
    sampled = lo + (jnp.maximum(j - recent, 0) * rest) // max(n - recent, 1)
    ids = jnp.where(j < recent, hi - 1 - j, sampled)
    ids = jnp.where(length <= n, lo + j, ids)  # short ranges: every id
    return jnp.where(j < jnp.minimum(length, n), ids, -1).astype(jnp.int32)


def usable_seed_ids(seed_ids, start, end):
    """``seed_ids`` [T, N] with each id outside its query's [start, end), and each repeat
    of an id earlier in its row, set to -1. Explicit seeds are checked only when concrete;
    under ``jit`` a repeated or invisible seed would lift τ above the K-th score."""
    ids = jnp.where((seed_ids >= start[:, None]) & (seed_ids < end[:, None]), seed_ids, -1)
    order = jnp.argsort(ids, axis=1)  # stable: the first of equal ids stays first
    ranked = jnp.take_along_axis(ids, order, axis=1)
    repeat = (ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)
    repeat = jnp.concatenate([jnp.zeros_like(repeat[:, :1]), repeat], axis=1)
    repeat = jnp.take_along_axis(repeat, jnp.argsort(order, axis=1), axis=1)
    return jnp.where(repeat, -1, ids)


def block_union_ids(seed_ids, block_t):
    """Per query block, the distinct ids of its queries' explicit seed lists."""
    t, n = seed_ids.shape
    pad = (-t) % block_t
    ids = jnp.pad(seed_ids, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, block_t * n)
    ids = jnp.sort(jnp.where(ids < 0, jnp.iinfo(jnp.int32).max, ids), axis=1)
    dup = jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] == ids[:, :-1]], axis=1)
    return jnp.where(dup | (ids == jnp.iinfo(jnp.int32).max), -1, ids)


def _result(indices, values, start, end, candidates, tau_codes, fallback):
    visible = (end - start).astype(jnp.int32)
    return IndexerTopK(
        indices=indices,
        scores=values,
        visible=visible,
        candidates=candidates.astype(jnp.int32),
        survivors=visible,
        threshold=code_to_score(tau_codes),
        fallback=fallback,
    )


def select_dense(scores, start, end, top_k, sort):
    """Exact Top-K of dense [T, S] score rows over [start, end): ``base``'s selection,
    and :func:`jsparse.topk`'s Triton implementation."""
    cap = candidate_capacity(top_k, scores.shape[1])
    if select.rank_selects(scores.shape[0], cap):  # decode: selected and ordered at once
        codes, ids, count, _ = select.compact_rows(scores, start, end, top_k, cap, with_codes=True)
        return select.select_by_rank(codes, ids, count, top_k)
    ids, count, _ = select.compact_rows(scores, start, end, top_k, cap)
    if not sort:  # the select writes the final scores itself
        sel_scores, sel_ids, _ = select.select_rows(scores, ids, count, top_k, scores_out=True)
        return sel_ids, sel_scores
    sel_codes, sel_ids, _ = select.select_rows(scores, ids, count, top_k)
    return select.order_topk(sel_codes, sel_ids, id_ordered=True)


def select_records(codes, ids, counts, top_k, *, id_ordered, sort=True):
    """Exact Top-K of record rows (no overflow: counts ≤ capacity)."""
    cap = candidate_capacity(top_k, codes.shape[1])
    if codes.shape[1] > cap:  # long record rows: shrink to a sampled-threshold buffer first
        codes, ids, counts, _ = select.compact_records(codes, ids, counts, top_k, cap)
    if not sort:
        scores, sel_ids, _ = select.select_candidates(codes, ids, counts, top_k, scores_out=True)
        return sel_ids, scores
    sel_codes, sel_ids, _ = select.select_candidates(codes, ids, counts, top_k)
    return select.order_topk(sel_codes, sel_ids, id_ordered=id_ordered)


def seed_threshold(q, weights, k, k_scale, start, end, seeds, top_k, *, cfg):
    """τ per query: the code of the K-th largest score among the seed keys it sees
    (EMPTY_CODE, keeping everything, when it sees fewer than K). ``seeds`` [ceil(T/BT),
    N] one list per query block (-1 = none). Scored by list position, not as records:
    the same scores without records' per-tile compaction (see score_list_triton)."""
    t = q.shape[0]
    scores, seen = scorer.score_list_triton(q, weights, k, k_scale, start, end, seeds, cfg=cfg)
    # Unseen seeds hold -inf, at or below every seen score: the K-th of the row is the
    # K-th seen one whenever at least K are seen.
    n = scores.shape[1]
    zeros = jnp.zeros((t,), jnp.int32)
    ids, count, _ = select.compact_rows(
        scores, zeros, jnp.full((t,), n, jnp.int32), top_k, candidate_capacity(top_k, n)
    )
    kth = select.select_rows(scores, ids, count, top_k)[2]
    return jnp.where(seen >= top_k, kth, EMPTY_CODE)


def select_listed(scores, lists, block_of, counts, top_k, sort):
    """Exact Top-K of rows scored by list position (:func:`scorer.score_list_triton`):
    row t's first ``counts[t]`` columns are the keys ``lists[block_of[t]]``, which must
    be in ascending id order (then column order is id order, the tie-break). Returns
    (key ids [T, K], scores [T, K]) with -1 / -inf padding."""
    t = scores.shape[0]
    pos, values = select_dense(scores, jnp.zeros((t,), jnp.int32), counts, top_k, sort)
    flat = block_of[:, None] * lists.shape[1] + jnp.maximum(pos, 0)
    return jnp.where(pos >= 0, lists.reshape(-1)[flat], -1), values


# The scorer launch writes base's report (one program per query block) instead of a
# launch of its own: −0.9 to −1.6 µs a decode step at 1 and 8 queries (run 69).
SCORER_WRITES_REPORT = True


@backend.jit_per_mode(static_argnames=("top_k", "cfg", "sort"))
def topk_base(q, weights, k, top_k, k_scale, start, end, *, cfg=None, sort=True):
    """Every visible score written, then exact selection."""
    scores, *report = scorer._launch(
        q, weights, k, k_scale, start, end, cfg=cfg, report=SCORER_WRITES_REPORT
    )  # report: the five rows, or none
    return topk_from_scores(scores, start, end, top_k, sort=sort, report=report)


def topk_from_scores(scores, start, end, top_k, *, sort=True, report=None):
    """``base``'s second half: exact selection over dense [T, S] scores, and its report
    (``report``: the five rows already written; when empty, :func:`exhaustive_report`)."""
    indices, values = select_dense(scores, start, end, top_k, sort)
    visible, candidates, survivors, threshold, fallback = report or exhaustive_report(start, end)
    return IndexerTopK(indices, values, visible, candidates, survivors, threshold, fallback)


@backend.jit_per_mode(static_argnames=("top_k", "n_seeds", "capacity", "cfg", "sort"))
def topk_full(
    q, weights, k, top_k, k_scale, start, end, seed_ids=None, *,
    n_seeds=None, capacity=None, cfg=None, sort=True,
):  # fmt: skip
    """Seed threshold τ, records ≥ τ only, exact selection over the records."""
    s = k.shape[0]
    cfg = cfg or scorer.config_for(q, k)
    if seed_ids is None:
        n = min(n_seeds or default_seed_count(top_k, s), s)
        seeds = block_seed_ids(start, end, cfg.block_t, n, s)
    else:
        n = seed_ids.shape[1]
        seeds = block_union_ids(seed_ids, cfg.block_t)
    tau = seed_threshold(q, weights, k, k_scale, start, end, seeds, top_k, cfg=cfg)
    cap = capacity or default_record_capacity(top_k, s, max(n, 1))
    codes, ids, counts, id_ordered = scorer.score_records_triton(
        q, weights, k, k_scale, start, end, tau, cap, cfg=cfg
    )
    overflow = counts > cap
    indices, values = select_records(
        codes, ids, jnp.minimum(counts, cap), top_k, id_ordered=id_ordered, sort=sort
    )

    def recover(iv):
        # Records were dropped for these queries: only full scoring is exact there.
        base = topk_base(q, weights, k, top_k, k_scale, start, end, cfg=cfg, sort=sort)
        return (
            jnp.where(overflow[:, None], base.indices, iv[0]),
            jnp.where(overflow[:, None], base.scores, iv[1]),
        )

    indices, values = jax.lax.cond(jnp.any(overflow), recover, lambda iv: iv, (indices, values))
    return _result(indices, values, start, end, counts, tau, overflow)
