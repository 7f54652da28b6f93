"""Exact indexer Top-K for a batch of sequences: one query each, over its own keys.

This is decode in a serving batch. Sequence b's query sees keys 0 .. lengths[b]-1 of its
own cache: a dense [B, S_max, D] array, or a paged pool [n_pages, P, D] with a page table
[B, max_pages] (position i of sequence b is row i % P of page ``page_table[b, i // P]``),
read in place. Ids in and out are positions within the sequence.

:func:`jsparse.indexer_topk` can express the same with a flattened cache and ranges, but
it has to assume that queries share keys. It then widens an FP8 cache in memory (a copy
of the whole cache every step), scores blocks of several queries (each key tile belongs
to one sequence, so most of each dot is masked away) and writes a [B, B·S_max] score
matrix. Here every query is a block of its own, FP8 keys stay FP8 in memory and the
scores are [B, S_max].

Methods: ``xla`` (einsum over each sequence's keys, then ``lax.top_k``) and ``base``
(the fused scorer writes every visible score, then exact selection). The
witness-thresholded decode (:func:`jsparse.indexer_topk_decode`) uses the same scorer
tiles, so its answers equal ``base``'s id for id.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse import _autodiff, _checks, _chunking, backend
from jsparse.ops.attention.reference import listed_locations
from jsparse.ops.indexer import reference
from jsparse.ops.indexer.result import IndexerTopK, exhaustive_result
from jsparse.ops.topk.reference import select_topk_reference

METHODS = ("xla", "base")


def validate_cache(q, weights, k_cache, k_scale, lengths, page_table, *, chunked=False) -> int:
    """Checks a batch's queries and key cache (dense or paged); returns S_max. ``chunked``:
    the caller runs a dense cache in chunks of sequences, so its rows may pass 2^31."""
    paged = page_table is not None
    cache_layout = "[n_pages, P, D]" if paged else "[B, S_max, D]"
    _checks.check_rank("q", q, 3, "[B, H, D]")
    _checks.check_rank("weights", weights, 2, "[B, H]")
    _checks.check_rank("k_cache", k_cache, 3, cache_layout)
    _checks.check_dtype("q", q, _checks.INPUT_FLOATS)
    _checks.check_dtype("k_cache", k_cache, _checks.INPUT_FLOATS)
    _checks.check_dtype("weights", weights, (jnp.float32,))
    b, h, d = q.shape
    if b == 0 or h == 0 or d == 0:
        raise ValueError(f"q: shape {tuple(q.shape)} has an empty axis; expected B, H, D ≥ 1")
    if weights.shape != (b, h):
        raise ValueError(f"weights: shape {tuple(weights.shape)}; expected [B, H] = ({b}, {h})")
    if (not paged and k_cache.shape[0] != b) or k_cache.shape[2] != d:
        raise ValueError(
            f"k_cache: shape {tuple(k_cache.shape)}; expected {cache_layout} with "
            + ("" if paged else f"B = {b}, ")
            + f"D = {d}"
        )
    if paged:
        _checks.check_rank("page_table", page_table, 2, "[B, max_pages]")
        _checks.check_dtype("page_table", page_table, (jnp.int32,))
        if page_table.shape[0] != b:
            raise ValueError(
                f"page_table: shape {tuple(page_table.shape)}; expected [B, max_pages] with B = {b}"
            )
        n_pages, page_size = k_cache.shape[:2]
        s_max = page_table.shape[1] * page_size
    else:
        s_max = k_cache.shape[1]
    if k_scale is not None:
        _checks.check_rank("k_scale", k_scale, 2, cache_layout[:-4] + "]")
        _checks.check_dtype("k_scale", k_scale, (jnp.float32,))
        want = k_cache.shape[:2]
        if k_scale.shape != want:
            raise ValueError(
                f"k_scale: shape {tuple(k_scale.shape)}; expected {cache_layout[:-4]}] = {want}"
            )
        scales = _checks.concrete(k_scale)
        if scales is not None and scales.size:
            bad = ~(np.isfinite(scales) & (scales > 0))
            if bad.any():
                at = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(
                    f"k_scale: every scale must be finite and > 0; k_scale[{at}] = "
                    f"{scales[at]} ({int(bad.sum())} bad of {scales.size})"
                )
    _checks.check_rank("lengths", lengths, 1, "[B]")
    _checks.check_dtype("lengths", lengths, (jnp.int32,))
    if lengths.shape[0] != b:
        raise ValueError(f"lengths: shape {tuple(lengths.shape)}; expected [B] = ({b},)")
    values = _checks.concrete(lengths)
    if values is not None and ((values < 0) | (values > s_max)).any():
        raise ValueError(f"lengths: every length must lie in [0, S_max = {s_max}], got {values}")
    table = _checks.concrete(page_table) if paged else None
    if table is not None:
        if ((table < -1) | (table >= n_pages)).any():
            raise ValueError(
                f"page_table: entries must lie in [-1, n_pages = {n_pages}), got min "
                f"{table.min()} max {table.max()}"
            )
        if values is not None:
            used = np.arange(table.shape[1])[None, :] * page_size < values[:, None]
            missing = np.argwhere(used & (table < 0))
            if missing.size:
                seq, page = missing[0]
                raise ValueError(
                    f"page_table: sequence {seq} has length {values[seq]} but no page at "
                    f"slot {page} (-1); every page below its length must be allocated"
                )
    if (paged or not chunked) and k_cache.shape[0] * k_cache.shape[1] > _chunking.INDEX_LIMIT:
        raise NotImplementedError(
            f"k_cache: {k_cache.shape[0]}·{k_cache.shape[1]} key rows; the kernels address "
            "at most 2^31 - 1" + ("" if paged else " (split the batch)")
        )
    return s_max


def s_max_of(k_cache, page_table) -> int:
    return k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])


def flat_keys(k_cache, k_scale, lengths, s_max):
    """Keys as rows [N, D] (the dense cache or the page pool) and each sequence's range
    [b·S_max, b·S_max + lengths[b]) of the B·S_max virtual key ids."""
    rows = k_cache.shape[0] * k_cache.shape[1]
    offset = jnp.arange(lengths.shape[0], dtype=jnp.int32) * s_max
    scale = None if k_scale is None else k_scale.reshape(rows)
    return k_cache.reshape(rows, k_cache.shape[2]), scale, offset, offset + lengths


def relative_ids(ids, start):
    """Flat key ids [B, N] as positions within each sequence (-1 stays -1)."""
    return jnp.where(ids >= 0, ids - start[:, None], -1).astype(jnp.int32)


def key_layout(k_cache, page_table) -> dict:
    """The scorer's key layout arguments: each sequence's keys are its own (never widened
    in memory), read through the flattened page table when paged."""
    layout = dict(shared_keys=False)
    if page_table is not None:
        layout.update(page_table=page_table.reshape(-1), page_size=k_cache.shape[1])
    return layout


def dense_view(k_cache, k_scale, page_table):
    """(keys [B, S_max, D], their scales, on_page [B, S_max] or None): the paged cache
    gathered into a dense one (the reference's clarity over speed); ``on_page`` is False
    for positions on no page (-1), which the kernels never read (see
    :func:`off_page_unread`)."""
    if page_table is None:
        return k_cache, k_scale, None
    b, m = page_table.shape
    n, p, d = k_cache.shape
    pages = jnp.clip(page_table, 0, n - 1)  # a missing page reads page 0, masked by on_page
    dense = k_cache[pages].reshape(b, m * p, d)
    scale = None if k_scale is None else k_scale[pages].reshape(b, m * p)
    return dense, scale, jnp.repeat(page_table >= 0, p, axis=1)


def holds_no_keys(k_cache, page_table) -> bool:
    """No key can be visible: S_max = 0, or an empty page pool (the kernels need a key
    tile to read)."""
    return s_max_of(k_cache, page_table) == 0 or k_cache.shape[0] * k_cache.shape[1] == 0


def nothing_visible(b: int, top_k: int) -> IndexerTopK:
    """The result for B queries that see no key: rows of -1 / -inf."""
    return exhaustive_result(
        jnp.full((b, top_k), -1, jnp.int32),
        jnp.full((b, top_k), -jnp.inf, jnp.float32),
        jnp.zeros((b,), jnp.int32),
    )


def off_page_unread(scores, on_page):
    """``scores`` [B, S_max] with -inf at positions on no page: what the kernels give a
    key they never read (still in its sequence's range, so selected only after every
    real score)."""
    return scores if on_page is None else jnp.where(on_page, scores, -jnp.inf)


def indexer_topk_batch(
    q: Float[Array, "B H D"],
    weights: Float[Array, "B H"],
    k_cache: Float[Array, "B S D"] | Float[Array, "N P D"],
    top_k: int,
    *,
    lengths: Int[Array, " B"],
    k_scale: Float[Array, "B S"] | Float[Array, "N P"] | None = None,
    page_table: Int[Array, "B M"] | None = None,
    method: str = "base",
    sorted: bool = True,
    implementation: str | Sequence[str] | None = None,
) -> IndexerTopK:
    """Exact Top-K keys of the indexer score, one query per sequence over its own keys.

    Args:
      q: [B, H, D] each sequence's query (float32, bfloat16 or float8_e4m3fn).
      weights: [B, H] float32 signed head weights.
      k_cache: [B, S_max, D] keys, sequence b's first ``lengths[b]`` valid; with
        ``page_table``, a page pool [n_pages, P, D].
      top_k: K.
      lengths: [B] int32 visible keys per sequence (0 ≤ lengths[b] ≤ S_max; checked when
        concrete, clamped to that range when traced, so no sequence reads another's keys).
      k_scale: optional float32 > 0 per-key scales, shaped like ``k_cache`` without D.
      page_table: optional [B, max_pages] int32 (-1: no page; every page below a
        sequence's length must be allocated, checked when concrete; under jit a
        position on no page below the length is listed at -inf after every real score,
        on every path). S_max = max_pages·P.
      method: ``"xla"`` or ``"base"`` (module doc).
      sorted: as in :func:`jsparse.indexer_topk`.
      implementation: see :mod:`jsparse.backend`; ignored by ``xla`` (but checked). ``"mosaic"``
        (opt-in): the Mosaic GPU scorer, for dense caches whose S_max is a multiple of
        128 and page pools whose P is a multiple of 64, q and keys both bfloat16 or both
        float8_e4m3fn.

    Returns:
      :class:`IndexerTopK` with ids relative to each sequence, ordered by score
      descending then id ascending, -1 / -inf padded past ``lengths[b]``.
    """
    s_max = validate_cache(q, weights, k_cache, k_scale, lengths, page_table, chunked=True)
    page_table = _checks.usable_pages(page_table, k_cache.shape[0])
    top_k = _checks.check_top_k(top_k)
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}; expected one of {METHODS}")
    _checks.check_bool("sorted", sorted)
    backend.check_implementation(implementation)  # xla ignores it: a typo still raises
    if holds_no_keys(k_cache, page_table):
        return nothing_visible(q.shape[0], top_k)

    def call(q, weights, lengths, page_table, k_cache, k_scale):
        lengths = jnp.clip(lengths, 0, s_max)
        if method == "xla":
            return _topk_xla(q, weights, k_cache, top_k, k_scale, lengths, page_table)
        return backend.dispatch(
            "indexer_topk_batch[base]", _BASE_IMPLEMENTATIONS, implementation,
            q, weights, k_cache, top_k, k_scale, lengths, page_table, sorted,
        )  # fmt: skip

    def select(q, weights, k_cache, k_scale, page_table, lengths):
        # Virtual key ids and score rows are int32 offsets: B·S_max per launch must fit.
        chunk = _chunking.queries_per_chunk(q.shape[0], s_max)
        if page_table is None:
            return _chunking.over_query_chunks(
                lambda q, w, n, kc, ks: call(q, w, n, None, kc, ks), chunk, q, weights,
                lengths, k_cache, k_scale,
            )  # fmt: skip
        # A page pool is shared by every chunk of sequences; their page tables are not.
        return _chunking.over_query_chunks(
            lambda q, w, n, t: call(q, w, n, t, k_cache, k_scale), chunk, q, weights,
            lengths, page_table,
        )  # fmt: skip

    return _autodiff.selection(
        select, scores_of_ids, lambda r: (r.indices, r.scores),
        (q, weights, k_cache, k_scale, page_table, lengths),
    )  # fmt: skip


def scores_of_ids(ids, q, weights, k_cache, k_scale, page_table, *_):
    """[B, N] scores of each sequence's key positions ``ids`` (-1, or a position on no
    page: -inf), gathered from the cache as the kernels address it: the derivative of a
    Top-K's scores (:mod:`jsparse._autodiff`)."""
    n, p, d = k_cache.shape  # [B, S_max, D] dense, or the page pool [n_pages, P, D]
    valid, i0, i1 = listed_locations(ids, k_cache, page_table)
    rows = jnp.where(valid, i0 * p + i1, -1)
    scale = None if k_scale is None else k_scale.reshape(n * p)
    return reference.score_keys_reference(q, weights, k_cache.reshape(n * p, d), rows, scale)


@functools.partial(jax.jit, static_argnames=("top_k", "sort"))
def _base_reference(q, weights, k_cache, top_k, k_scale, lengths, page_table, sort=True):
    del sort  # the reference always sorts
    k_cache, k_scale, on_page = dense_view(k_cache, k_scale, page_table)
    s_max = k_cache.shape[1]
    k, scale, start, _ = flat_keys(k_cache, k_scale, lengths, s_max)
    rel = jnp.arange(s_max, dtype=jnp.int32)[None, :]
    ids = jnp.where(rel < lengths[:, None], rel + start[:, None], -1)
    scores = off_page_unread(reference.score_keys_reference(q, weights, k, ids, scale), on_page)
    indices, values = select_topk_reference(scores, ids, top_k)
    return exhaustive_result(relative_ids(indices, start), values, lengths)


@backend.jit_per_mode(static_argnames=("top_k", "sort"))
def _base_triton(q, weights, k_cache, top_k, k_scale, lengths, page_table, sort=True):
    from jsparse.ops.indexer import methods
    from jsparse.ops.indexer import triton as scorer

    s_max = s_max_of(k_cache, page_table)
    k, scale, start, end = flat_keys(k_cache, k_scale, lengths, s_max)
    cfg = scorer.batch_config_for(q, k)
    fp8_keys = k.dtype == jnp.float8_e4m3fn
    scores, *report = scorer._launch(
        q, weights, k, scale, start, end, cfg=cfg, report=methods.SCORER_WRITES_REPORT,
        row_cols=s_max, splits=scorer.batch_splits(q.shape[0], s_max, cfg, fp8_keys),
        **key_layout(k_cache, page_table),
    )  # fmt: skip
    # scores [B, S_max]: sequence b's key i at column i, so the rows' ranges are [0, length).
    zero = jnp.zeros_like(lengths)
    return methods.topk_from_scores(scores, zero, lengths, top_k, sort=sort, report=report)


@backend.jit_per_mode(static_argnames=("top_k", "sort"))
def _base_mosaic(q, weights, k_cache, top_k, k_scale, lengths, page_table, sort=True):
    """``base`` with the Mosaic GPU scorer (opt-in): FP8 × FP8 on the FP8 tensor cores,
    so FP8 scores round differently from the Triton scorer's."""
    from jsparse.ops.indexer import methods, mosaic

    scores, report = mosaic.batch_scores_mosaic(
        q, weights, k_cache, k_scale, lengths, page_table, with_report=True
    )
    zero = jnp.zeros_like(lengths)
    return methods.topk_from_scores(scores, zero, lengths, top_k, sort=sort, report=report)


# Preferred order; "mosaic" is opt-in (jsparse.backend.OPT_IN_IMPLEMENTATIONS).
_BASE_IMPLEMENTATIONS = {
    "triton": _base_triton,
    "mosaic": _base_mosaic,
    "reference": _base_reference,
}


# Sequences per einsum of the ``xla`` method: bounds its [chunk, H, S_max] f32 logits.
XLA_SEQUENCES_PER_STEP = 8


@functools.partial(jax.jit, static_argnames=("top_k",))
def _topk_xla(q, weights, k_cache, top_k, k_scale, lengths, page_table):
    """The naive XLA formulation per sequence: einsum → relu → einsum, ``lax.top_k``."""
    k_cache, k_scale, on_page = dense_view(k_cache, k_scale, page_table)
    b, h, d = q.shape
    s_max = k_cache.shape[1]
    compute = reference.einsum_dtype(q.dtype, k_cache.dtype)
    # The largest chunk that divides B: padding B would copy the whole cache.
    chunk = max(c for c in range(1, XLA_SEQUENCES_PER_STEP + 1) if b % c == 0)

    def one_chunk(args):
        qc, wc, kc = args
        logits = jnp.einsum(
            "bhd,bsd->bhs", qc.astype(compute), kc.astype(compute),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return jnp.einsum("bh,bhs->bs", wc, reference.relu_keep_nan(logits))

    n = b // chunk
    scores = jax.lax.map(
        one_chunk,
        (q.reshape(n, chunk, h, d), weights.reshape(n, chunk, h),
         k_cache.reshape(n, chunk, s_max, d)),
    ).reshape(b, s_max)  # fmt: skip
    if k_scale is not None:
        scores = scores * k_scale
    visible = jnp.arange(s_max)[None, :] < lengths[:, None]
    scores = jnp.where(visible, off_page_unread(scores, on_page), -jnp.inf)
    return exhaustive_result(*reference.lax_topk(scores, lengths, top_k), lengths)
