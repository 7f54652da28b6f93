"""Decoding with witness thresholds (MATH.md §1.10).

One query per sequence and step. Keys selected in recent steps (the witnesses) are still
visible and usually still score high, so their current scores give a seed threshold τ_b
(the K-th largest, when at least K witnesses are visible): every key with score < τ_b is
out of the Top-K. The full scorer then writes only records ≥ τ_b, and an exact selection
over the records gives the Top-K.

The witness buffer holds W ≥ K distinct ids (default W = 2K): after each step, the new
Top-K plus the previous witnesses that score best under the current query. With exactly
K witnesses τ would be the *smallest* current score among them, and one witness that
dropped far is enough to make τ useless; with 2K of them τ is their K-th best, robust to
half the set moving away (measured: about 5× fewer records at 32K keys on
``deepseek_like``). After a step that had witnesses, every witness is a key selected in
some recent step (MATH.md §1.10's "distinct keys selected in recent steps"); after a
first step the buffer also carries the best-scoring default seeds. Exactness needs only
that they are distinct visible keys.

Sequences with fewer than K valid witnesses (the first step) use the default seed set
(recent keys plus a strided sample) instead. A record buffer overflow, or fewer
records than min(K, visible) (only witnesses that were not distinct can do that), falls
back to scoring every key of that sequence and reports it; nothing is ever dropped.

The key cache is dense, [B, S_max, D], with ``lengths[b]`` valid keys per sequence, or
paged: a pool [n_pages, P, D] and a page table [B, max_pages] (position i of sequence b
lives in page ``page_table[b, i // P]`` at row i % P), read in place by the scorer. Ids in
and out are positions within the sequence either way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse import _autodiff, _checks, backend
from jsparse.ops.indexer import batch
from jsparse.ops.indexer import reference as scorer
from jsparse.ops.indexer.result import IndexerTopK
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code
from jsparse.ops.topk.reference import select_topk_reference


def _validate(q, weights, k_cache, k_scale, lengths, witnesses, top_k, page_table) -> int:
    """Checks every argument; returns ``top_k`` as an int."""
    batch.validate_cache(q, weights, k_cache, k_scale, lengths, page_table)
    b = q.shape[0]
    if witnesses is not None:
        _checks.check_rank("witnesses", witnesses, 2, "[B, W]")
        _checks.check_dtype("witnesses", witnesses, (jnp.int32,))
        if witnesses.shape[0] != b:
            raise ValueError(f"witnesses: shape {tuple(witnesses.shape)}; expected [B, W]")
        ids, n = _checks.concrete(witnesses), _checks.concrete(lengths)
        if ids is not None and n is not None:  # ids ≥ lengths are ignored, repeats too
            row = _checks.first_repeating_row(np.where(ids < n[:, None], ids, -1))
            if row is not None:
                raise ValueError(f"witnesses: row {row} lists a key more than once")
    return _checks.check_top_k(top_k)


def _capacity(witness_capacity, top_k: int, n_witnesses: int) -> int:
    """W of the returned witness buffer: ``witness_capacity``, a Python int ≥ K, or
    by default max(2·K, the W given)."""
    if witness_capacity is None:
        return max(2 * top_k, n_witnesses)
    if not _checks.is_int(witness_capacity):
        raise ValueError(
            f"witness_capacity: expected a Python int or None, got {witness_capacity!r}"
        )
    if witness_capacity < top_k:
        raise ValueError(
            f"witness_capacity: {witness_capacity} < top_k = {top_k}; expected ≥ top_k"
        )
    return int(witness_capacity)


def indexer_topk_decode(
    q: Float[Array, "B H D"],
    weights: Float[Array, "B H"],
    k_cache: Float[Array, "B S D"] | Float[Array, "N P D"],
    top_k: int,
    *,
    k_scale: Float[Array, "B S"] | Float[Array, "N P"] | None = None,
    lengths: Int[Array, " B"],
    witnesses: Int[Array, "B W"] | None = None,
    witness_capacity: int | None = None,
    page_table: Int[Array, "B M"] | None = None,
    implementation: str | Sequence[str] | None = None,
) -> tuple[IndexerTopK, Int[Array, "B W"]]:
    """Exact Top-K of one decode step per sequence, thresholded by witnesses.

    Equal id for id to :func:`jsparse.indexer_topk_batch` (``base``, the same scorer
    tiles), which was faster at every batch size measured (WORKSPACE.md, run 118).

    Args:
      q: [B, H, D] the step's query of each sequence.
      weights: [B, H] float32 head weights.
      k_cache: [B, S_max, D] keys; sequence b has ``lengths[b]`` valid keys (the query
        sees keys 0 .. lengths[b]-1, the new token's key included if the caller wrote it).
        With ``page_table``: a page pool [n_pages, P, D].
      top_k: K.
      k_scale: optional float32 > 0 per-key scales, shaped like ``k_cache`` without D.
      lengths: [B] int32 valid keys per sequence.
      witnesses: optional [B, W] int32 key ids (-1 = empty): the witnesses this
        function returned at the previous step (or any distinct ids, e.g. a previous
        Top-K); ids ≥ lengths[b] are ignored. Distinct per row.
      witness_capacity: W of the returned buffer (default max(2·K, W of ``witnesses``)).
      page_table: optional [B, max_pages] int32: position i of sequence b is row i % P of
        page ``page_table[b, i // P]`` (-1: no page; every page below ``lengths[b]``
        must be allocated, checked when concrete; under jit, as in
        :func:`jsparse.indexer_topk_batch`, and such a sequence falls back and says so).
        S_max = max_pages·P.
      implementation: see :mod:`jsparse.backend`.

    Returns:
      (IndexerTopK with ids relative to each sequence, the new witnesses [B, W]: this
      step's Top-K first, then the previous witnesses scoring best now, in no fixed
      order (the GPU writes records in arbitrary order), -1 padded).
    """
    top_k = _validate(q, weights, k_cache, k_scale, lengths, witnesses, top_k, page_table)
    page_table = _checks.usable_pages(page_table, k_cache.shape[0])
    # Traced lengths cannot be checked: clamped, no sequence reads another's keys.
    lengths = jnp.clip(lengths, 0, batch.s_max_of(k_cache, page_table))
    b = q.shape[0]
    if witnesses is None:
        witnesses = jnp.full((b, 1), -1, jnp.int32)
    capacity = _capacity(witness_capacity, top_k, witnesses.shape[1])
    if batch.holds_no_keys(k_cache, page_table):
        return batch.nothing_visible(b, top_k), jnp.full((b, capacity), -1, jnp.int32)

    def select(q, weights, k_cache, k_scale, page_table, lengths, witnesses):
        return backend.dispatch(
            "indexer_topk_decode",
            {"triton": _decode_triton, "reference": _decode_reference},
            implementation,
            q, weights, k_cache, top_k, k_scale, lengths, witnesses, capacity, page_table,
        )  # fmt: skip

    return _autodiff.selection(
        select, batch.scores_of_ids, lambda out: (out[0].indices, out[0].scores),
        (q, weights, k_cache, k_scale, page_table, lengths, witnesses),
    )  # fmt: skip


def _flat(k_cache, k_scale, lengths, witnesses, s_max):
    """Keys as rows [N, D] (the dense cache or the page pool), each sequence's range of
    B·S_max virtual ids, and witness ids made global."""
    k, scale, start, end = batch.flat_keys(k_cache, k_scale, lengths, s_max)
    ok = (witnesses >= 0) & (witnesses < lengths[:, None])
    wit = jnp.where(ok, witnesses + start[:, None], -1)
    return k, scale, start, end, wit


def _seeds(wit, start, end, top_k, num_keys):
    """Witnesses where a sequence has ≥ K of them, else the default seed set."""
    from jsparse.ops.indexer.api import default_seed_ids

    enough = jnp.sum(wit >= 0, axis=1) >= top_k
    default = default_seed_ids(start, end, top_k, n_seeds=2 * top_k, num_keys=num_keys)
    width = max(wit.shape[1], default.shape[1])
    wit = jnp.pad(wit, ((0, 0), (0, width - wit.shape[1])), constant_values=-1)
    default = jnp.pad(default, ((0, 0), (0, width - default.shape[1])), constant_values=-1)
    return jnp.where(enough[:, None], wit, default)


def _block_lists(seeds, block_t):
    """Per query block, its queries' seed lists one after another with the live ids
    first, and their count. Sequences' ids are disjoint (each has its own range of the
    flat cache) and each list is distinct (default seeds by construction, witnesses by
    contract), so the concatenation is the union, without the sort that
    :func:`jsparse.ops.indexer.methods.block_union_ids` needs for shared keys. (Were a
    list not distinct, τ could only rise: the missed count then falls back, exactly.)"""
    t, n = seeds.shape
    pad = (-t) % block_t
    ids = jnp.pad(seeds, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, block_t * n)
    live = ids >= 0
    return _to_front(ids, live, -1), jnp.sum(live, axis=1).astype(jnp.int32)


def _to_front(values, keep, fill):
    """Each row's kept values moved to its front, in order; ``fill`` after them."""
    rows = jnp.arange(values.shape[0])[:, None]
    slot = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, values.shape[1])  # past the end: dropped
    return jnp.full_like(values, fill).at[rows, slot].set(values, mode="drop")


def _best_seeds_reference(codes, ids, count, n):
    """The ``n`` best-scoring of each row's first ``count`` (codes, ids), -1 padded."""
    del count  # past it the codes are EMPTY
    best, pos = jax.lax.top_k(codes, n)
    return jnp.where(best == EMPTY_CODE, -1, jnp.take_along_axis(ids, pos, axis=1))


def _carry_witnesses(top_ids, seed_ids, seed_codes, capacity, offset, s_max, best_seeds):
    """Next witnesses: this step's Top-K, then the best-scoring previous seeds (distinct).

    top_ids [B, K] and seed_ids [B, N] are global ids (-1 empty) of each sequence's
    range [offset, offset + s_max); seed_codes [B, N] the seeds' current score codes.
    ``best_seeds(codes, ids, count, n)``: the n best of each row's first ``count``
    entries (-1 padded). A seed already in the Top-K is found through a per-sequence
    bitmap of the Top-K's ids (a scatter and a gather; no sort). Returns relative ids
    [B, capacity], -1 padded.
    """
    b, k = top_ids.shape
    rows = jnp.arange(b)[:, None]
    top_rel = jnp.where(top_ids >= 0, top_ids - offset[:, None], s_max)  # s_max: dropped
    in_top = jnp.zeros((b, s_max), bool).at[rows, top_rel].set(True, mode="drop")
    seed_rel = jnp.clip(seed_ids - offset[:, None], 0, s_max - 1)
    fresh = (seed_ids >= 0) & ~jnp.take_along_axis(in_top, seed_rel, axis=1)
    chosen = top_ids
    if capacity > k:
        codes = _to_front(seed_codes, fresh, EMPTY_CODE)
        ids = _to_front(seed_ids, fresh, -1)
        n = capacity - k
        if ids.shape[1] < n:  # fewer seed slots than places: pad with empties
            extra = ((0, 0), (0, n - ids.shape[1]))
            codes = jnp.pad(codes, extra, constant_values=EMPTY_CODE)
            ids = jnp.pad(ids, extra, constant_values=-1)
        count = jnp.sum(fresh, axis=1).astype(jnp.int32)
        chosen = jnp.concatenate([top_ids, best_seeds(codes, ids, count, n)], axis=1)
    return batch.relative_ids(chosen[:, :capacity], offset)


@functools.partial(jax.jit, static_argnames=("top_k", "capacity"))
def _decode_reference(
    q, weights, k_cache, top_k, k_scale, lengths, witnesses, capacity, page_table
):
    from jsparse.ops.indexer.api import seed_threshold_code

    k_cache, k_scale, on_page = batch.dense_view(k_cache, k_scale, page_table)
    k, scale, start, end, wit = _flat(k_cache, k_scale, lengths, witnesses, k_cache.shape[1])
    seeds = _seeds(wit, start, end, top_k, k.shape[0])
    # A position on no page (a traced page table; refused when concrete) holds no key:
    # the kernels never read it, so it is neither a seed nor a record.
    listed = jnp.ones(k.shape[0], bool) if on_page is None else on_page.reshape(-1)
    seeds = jnp.where(listed[jnp.maximum(seeds, 0)], seeds, -1)
    seed_scores = scorer.score_keys_reference(q, weights, k, seeds, scale)
    tau = seed_threshold_code(seed_scores, seeds, top_k)
    # Only the sequence's own keys: ids relative to its block of the flat cache.
    s_max = k_cache.shape[1]
    rel = jnp.arange(s_max, dtype=jnp.int32)[None, :]
    ids = jnp.where(rel < lengths[:, None], rel + start[:, None], -1)
    scores = batch.off_page_unread(scorer.score_keys_reference(q, weights, k, ids, scale), on_page)
    keep = (ids >= 0) & listed.reshape(ids.shape) & (score_code(scores) >= tau[:, None])
    candidates = jnp.sum(keep, axis=1).astype(jnp.int32)
    # Fewer candidates than min(K, visible): τ lies above the K-th score (seeds that
    # were not distinct), or positions on no page; so the sequence keeps every position
    # below its length, as the kernels' fallback (base's dense scores) does.
    short = candidates < jnp.minimum(top_k, lengths)
    keep = jnp.where(short[:, None], ids >= 0, keep)
    indices, values = select_topk_reference(scores, jnp.where(keep, ids, -1), top_k)
    result = IndexerTopK(
        indices=indices,
        scores=values,
        visible=lengths,
        candidates=candidates,
        survivors=lengths,
        threshold=code_to_score(tau),
        fallback=short,
    )
    seed_codes = jnp.where(seeds >= 0, score_code(seed_scores), EMPTY_CODE)
    new_witnesses = _carry_witnesses(
        indices, seeds, seed_codes, capacity, start, s_max, _best_seeds_reference
    )
    return result.replace(indices=batch.relative_ids(result.indices, start)), new_witnesses


@backend.jit_per_mode(static_argnames=("top_k", "capacity", "witness_capacity"))
def _decode_triton_jit(
    q, weights, k_cache, top_k, k_scale, lengths, witnesses, page_table, *, capacity,
    witness_capacity,
):  # fmt: skip
    from jsparse.ops.indexer import methods
    from jsparse.ops.indexer import triton as scorer_triton
    from jsparse.ops.topk import triton as select

    s_max = batch.s_max_of(k_cache, page_table)
    k, scale, start, end, wit = _flat(k_cache, k_scale, lengths, witnesses, s_max)
    b = q.shape[0]
    # The tiles of indexer_topk_batch's base: one query a block, keys never widened in
    # memory (each sequence's keys are its query's alone), so the answers agree id for id.
    cfg = scorer_triton.batch_config_for(q, k)
    key_layout = batch.key_layout(k_cache, page_table)
    seeds = _seeds(wit, start, end, top_k, b * s_max)
    lists, listed = _block_lists(seeds, cfg.block_t)
    keep_all = jnp.full((b,), EMPTY_CODE, jnp.int32)
    # A query records only the seeds of its own list: the block's other lists hold other
    # sequences' ids, which it cannot see. So its own list's width bounds its records,
    # and a buffer that narrow keeps the τ and carried-seed selects in registers (the
    # block's width, 4 × 4096 at 8 sequences, sent them to the streamed path; run 95).
    seed_cap = methods._round_up(seeds.shape[1], 128)
    seed_codes, seed_ids, seed_counts, _ = scorer_triton.score_records_triton(
        q, weights, k, scale, start, end, keep_all, seed_cap, key_ids=lists, key_counts=listed,
        cfg=cfg, **key_layout,
    )  # fmt: skip
    _, _, tau = select.select_candidates(seed_codes, seed_ids, seed_counts, top_k)
    codes, ids, counts, ordered = scorer_triton.score_records_triton(
        q, weights, k, scale, start, end, tau, capacity, cfg=cfg,
        splits=scorer_triton.batch_splits(b, s_max, cfg), **key_layout,
    )  # fmt: skip
    # Fewer records than min(K, visible) would mean τ above the K-th score (seeds that
    # were not distinct); more than the buffer, lost records. Either way: every key.
    missed = (counts > capacity) | (counts < jnp.minimum(top_k, lengths))
    indices, values = methods.select_records(
        codes, ids, jnp.minimum(counts, capacity), top_k, id_ordered=ordered
    )

    def recover(iv):
        # Missed sequences only (the others get empty ranges): indexer_topk_batch's
        # base, every visible score written in place by the same tiles, then exact
        # selection. Not records: under jit a page table may leave a position below the
        # length on no page (refused when concrete), and a record cannot list it where
        # every other path does, at -inf after every real score (batch.off_page_unread).
        fb_end = jnp.where(missed, end, start)
        scores = scorer_triton._launch(
            q, weights, k, scale, start, fb_end, cfg=cfg, row_cols=s_max,
            splits=scorer_triton.batch_splits(b, s_max, cfg, k.dtype == jnp.float8_e4m3fn),
            **key_layout,
        )[0]  # fmt: skip
        fb = methods.topk_from_scores(scores, jnp.zeros_like(start), fb_end - start, top_k)
        fb_idx = jnp.where(fb.indices >= 0, fb.indices + start[:, None], -1)
        return (
            jnp.where(missed[:, None], fb_idx, iv[0]),
            jnp.where(missed[:, None], fb.scores, iv[1]),
        )

    indices, values = jax.lax.cond(jnp.any(missed), recover, lambda iv: iv, (indices, values))
    result = IndexerTopK(
        indices=indices,
        scores=values,
        visible=lengths,
        candidates=counts.astype(jnp.int32),
        survivors=lengths,
        threshold=code_to_score(tau),
        fallback=missed,
    )

    def best_seeds(codes, ids, count, n):
        return select.select_candidates(codes, ids, count, n)[1]

    new_witnesses = _carry_witnesses(
        indices, seed_ids, seed_codes, witness_capacity, start, s_max, best_seeds
    )
    return result.replace(indices=batch.relative_ids(result.indices, start)), new_witnesses


def _decode_triton(
    q, weights, k_cache, top_k, k_scale, lengths, witnesses, witness_capacity, page_table
):
    from jsparse.ops.indexer import methods

    n_seeds = max(witnesses.shape[1], 2 * top_k)  # the width of the seed lists (_seeds)
    cap = methods.default_record_capacity(top_k, batch.s_max_of(k_cache, page_table), n_seeds)
    return _decode_triton_jit(
        q, weights, k_cache, top_k, k_scale, lengths, witnesses, page_table, capacity=cap,
        witness_capacity=witness_capacity,
    )  # fmt: skip
