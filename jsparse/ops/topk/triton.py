"""Exact Top-K selection as Pallas Triton kernels, one program per row.

Triton on this backend has no sort, no histogram and unreliable vector int atomics,
so selection is built from what is fast: streaming compares, sums and forward
``cumsum`` (for order-preserving compaction). Every comparison is on int32 score codes
(:mod:`jsparse.ops.topk.codes`), so equality is exact and ties are explicit.

Two kernels:

* :func:`compact_rows` (dense rows → candidate buffer). A strided sample of the row
  (32 blocks of 128) gives a threshold θ whose expected count of keys ≥ θ is a little
  above K; one pass then compacts every key with code ≥ θ into a buffer of ``cap``
  slots. If the count lands outside [K, cap] (sample unlucky, or massive ties), the row
  takes the exact slow path: 32 bisection passes over the row find the K-th code θ*,
  and one pass stores the keys above θ* plus the first ties in id order: exactly K.
  Either way the buffer holds every key of the exact Top-K.
* :func:`select_candidates` (candidate buffer or records → Top-K set). Bisection over
  the bits of the code finds the K-th largest code θ; the keys above θ all enter; ties
  at θ enter by ascending id (a second bisection over ids finds the cut when the ties
  straddle the boundary). Output is the exact Top-K set, unordered.

The final order (score descending, id ascending) is one XLA sort of K elements per
row (:func:`order_topk`).
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
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score

_INT_MIN = np.int32(np.iinfo(np.int32).min)
_INT_MAX = np.int32(np.iinfo(np.int32).max)
SAMPLE_BLOCKS = 32


@dataclasses.dataclass(frozen=True)
class SelectConfig:
    block: int = 1024  # elements per step of a streaming pass
    sample_block: int = 128  # contiguous elements per sample block
    num_warps: int = 8


def _count_ge(codes, theta):
    return jnp.sum((codes >= theta).astype(jnp.int32))


def _bisect_code(count_ge, rank):
    """Largest code θ with count_ge(θ) ≥ rank (rank ≥ 1), bit by bit from the top.

    Works in the unsigned order (code ^ INT_MIN), where setting bits only increases θ.
    """

    def step(b, prefix):
        bit = jnp.left_shift(jnp.int32(1), 31 - b)
        trial = prefix | bit
        return jnp.where(count_ge(trial ^ _INT_MIN) >= rank, trial, prefix)

    return jax.lax.fori_loop(0, 32, step, jnp.int32(0)) ^ _INT_MIN


def _compact_kernel(scores_ref, start_ref, end_ref, codes_ref, ids_ref, count_ref, slow_ref, *,
                    s, top_k, cap, cfg):  # fmt: skip
    from jsparse.ops.topk.codes import score_code

    row = pl.program_id(0)
    start = plt.load(start_ref.at[row])
    end = plt.load(end_ref.at[row])
    length = end - start
    blk = cfg.block
    lanes = jnp.arange(blk, dtype=jnp.int32)

    def load_codes(j):
        """Codes of block j of the row; lanes past the row are EMPTY with id ≥ end."""
        ids = start + j * blk + lanes
        ok = ids < end
        x = plt.load(scores_ref.at[row, jnp.where(ok, ids, 0)], mask=ok, other=0.0)
        return jnp.where(ok, score_code(x), EMPTY_CODE), ids

    n_blocks = (length + blk - 1) // blk

    def count_row(theta):
        def body(j, acc):
            c, ids = load_codes(j)
            return acc + jnp.sum(((c >= theta) & (ids < end)).astype(jnp.int32))

        return jax.lax.fori_loop(0, n_blocks, body, jnp.int32(0))

    def compact(keep_fn):
        """Stores every key with keep_fn(code, ids, n_before) in id order; returns the count."""

        def body(j, carry):
            stored, ties = carry
            c, ids = load_codes(j)
            keep, is_tie = keep_fn(c, ties)
            keep = keep & (ids < end)
            is_tie = is_tie & (ids < end)
            keep_i = keep.astype(jnp.int32)
            pos = stored + jnp.cumsum(keep_i) - 1
            ok = keep & (pos < cap)
            dst = jnp.where(ok, row * cap + pos, s_total)
            plt.store(codes_ref.at[dst], c, mask=ok)
            plt.store(ids_ref.at[dst], ids, mask=ok)
            return stored + jnp.sum(keep_i), ties + jnp.sum(is_tie.astype(jnp.int32))

        return jax.lax.fori_loop(0, n_blocks, body, (jnp.int32(0), jnp.int32(0)))[0]

    s_total = count_ref.shape[0] * cap  # one past the last slot: never a live index

    def count_gt_row(theta):
        def body(j, acc):
            c, ids = load_codes(j)
            return acc + jnp.sum(((c > theta) & (ids < end)).astype(jnp.int32))

        return jax.lax.fori_loop(0, n_blocks, body, jnp.int32(0))

    # Threshold θ from a sample of the row: the whole row when it is short, else a
    # stratified sample of 32 evenly spaced blocks (the last one ending at `end`).
    sb = cfg.sample_block
    n_sample = SAMPLE_BLOCKS * sb
    whole = length <= n_sample
    sample_idx = jnp.arange(n_sample, dtype=jnp.int32)
    spread = start + (sample_idx // sb) * jnp.maximum(length - sb, 0) // (SAMPLE_BLOCKS - 1)
    pos = jnp.where(whole, start + sample_idx, spread + sample_idx % sb)
    in_row = pos < end
    sample = plt.load(scores_ref.at[row, jnp.where(in_row, pos, 0)], mask=in_row, other=0.0)
    sample_codes = jnp.where(in_row, score_code(sample), EMPTY_CODE)
    # A whole row gives the exact K-th code. A sample takes the rank whose expected
    # count over the row is about 1.3·K (plus a few sample spacings of margin).
    spaced = (top_k * n_sample * 13 + 10 * length - 1) // (10 * length) + 8
    rank = jnp.where(whole, top_k, jnp.minimum(spaced, n_sample))
    theta = jax.lax.cond(
        length > cap,
        lambda: _bisect_code(lambda th: _count_ge(sample_codes, th), rank),
        lambda: length * 0 + EMPTY_CODE,  # the whole row fits: keep every visible key
    )
    no_tie = jnp.zeros((blk,), bool)
    stored = compact(lambda c, ties: (c >= theta, no_tie))
    fast_ok = (stored >= jnp.minimum(top_k, length)) & (stored <= cap)

    def exact_path():
        kth = _bisect_code(count_row, top_k)
        need = top_k - count_gt_row(kth)

        def keep(c, ties_before):
            tie = c == kth
            tie_rank = ties_before + jnp.cumsum(tie.astype(jnp.int32)) - 1
            return (c > kth) | (tie & (tie_rank < need)), tie

        return compact(keep)

    final = jax.lax.cond(fast_ok, lambda: stored, exact_path)
    plt.store(count_ref.at[row], jnp.minimum(final, cap))
    plt.store(slow_ref.at[row], jnp.where(fast_ok, 0, 1).astype(jnp.int32))


def compact_rows(scores, start, end, top_k, cap, cfg=SelectConfig()):
    """Candidate buffers [T, cap] (codes, ids; id order) holding each row's exact Top-K.

    Returns (codes, ids, count [T], slow [T] int32: 1 where the exact slow path ran).
    ``cap`` must be ≥ ``top_k``.
    """
    t, s = scores.shape
    kernel = functools.partial(_compact_kernel, s=s, top_k=top_k, cap=cap, cfg=cfg)
    init = (
        jnp.full((t * cap,), EMPTY_CODE, jnp.int32),
        jnp.full((t * cap,), -1, jnp.int32),
    )
    codes, ids, count, slow = pl.pallas_call(
        lambda *refs: kernel(*refs[:3], *refs[5:]),
        grid=(t,),
        out_shape=(
            jax.ShapeDtypeStruct((t * cap,), jnp.int32),
            jax.ShapeDtypeStruct((t * cap,), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32),
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=backend.is_interpret(),
        name="jsparse_topk_compact",
    )(scores, start, end, *init)
    return codes.reshape(t, cap), ids.reshape(t, cap), count, slow


def _select_kernel(codes_ref, ids_ref, count_ref, out_codes_ref, out_ids_ref, kth_ref, *,
                   top_k, cap, cfg):  # fmt: skip
    row = pl.program_id(0)
    n = jnp.minimum(plt.load(count_ref.at[row]), cap)
    blk = cfg.block
    lanes = jnp.arange(blk, dtype=jnp.int32)
    n_blocks = (n + blk - 1) // blk

    def load(j):
        idx = j * blk + lanes
        ok = idx < n
        src = row * cap + jnp.where(ok, idx, 0)
        c = plt.load(codes_ref.at[src], mask=ok, other=EMPTY_CODE)
        i = plt.load(ids_ref.at[src], mask=ok, other=-1)
        return jnp.where(ok, c, EMPTY_CODE), i, ok

    def reduce_rows(fn):
        def body(j, acc):
            c, i, ok = load(j)
            return acc + jnp.sum(fn(c, i, ok).astype(jnp.int32))

        return jax.lax.fori_loop(0, n_blocks, body, jnp.int32(0))

    def threshold():
        kth = _bisect_code(lambda th: reduce_rows(lambda c, i, ok: ok & (c >= th)), top_k)
        n_gt = reduce_rows(lambda c, i, ok: ok & (c > kth))
        n_eq = reduce_rows(lambda c, i, ok: ok & (c == kth))
        need = top_k - n_gt

        def id_cut():
            # Smallest id c with count(tie & id ≤ c) ≥ need: bisection over 31 id bits.
            def step(b, prefix):
                bit = jnp.left_shift(jnp.int32(1), 30 - b)
                trial = prefix | bit
                below = reduce_rows(lambda c, i, ok: ok & (c == kth) & (i < trial))
                return jnp.where(below < need, trial, prefix)

            return jax.lax.fori_loop(0, 31, step, jnp.int32(0))

        cut = jax.lax.cond(n_eq > need, id_cut, lambda: need * 0 + _INT_MAX)
        return kth, cut

    # (Branch results are derived from a traced value: Triton's scf.if cannot yield constants.)
    kth, cut = jax.lax.cond(n >= top_k, threshold, lambda: (n * 0 + EMPTY_CODE, n * 0 + _INT_MAX))
    trash = count_ref.shape[0] * top_k  # one past the last slot: never a live index

    def write(j, stored):
        c, i, ok = load(j)
        keep = ok & ((c > kth) | ((c == kth) & (i <= cut)))
        keep_i = keep.astype(jnp.int32)
        pos = stored + jnp.cumsum(keep_i) - 1
        store = keep & (pos < top_k)
        dst = jnp.where(store, row * top_k + pos, trash)
        plt.store(out_codes_ref.at[dst], c, mask=store)
        plt.store(out_ids_ref.at[dst], i, mask=store)
        return stored + jnp.sum(keep_i)

    jax.lax.fori_loop(0, n_blocks, write, jnp.int32(0))
    plt.store(kth_ref.at[row], kth)


def select_candidates(codes, ids, counts, top_k, cfg=SelectConfig()):
    """Exact Top-K set of each row's candidates (any order in, unordered out).

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
        lambda *refs: kernel(*refs[:3], *refs[5:]),
        grid=(t,),
        out_shape=(
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t * top_k,), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32),
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=backend.is_interpret(),
        name="jsparse_topk_select",
    )(codes.reshape(-1), ids.reshape(-1), counts, *init)
    return out_codes.reshape(t, top_k), out_ids.reshape(t, top_k), kth


def order_topk(codes, ids):
    """Sorts a Top-K set by score descending, then id ascending; -1 / -inf for empty."""
    ids = jnp.where(codes == EMPTY_CODE, _INT_MAX, ids)
    neg, ids = jax.lax.sort((~codes, ids), dimension=1, num_keys=2)
    codes = ~neg
    empty = codes == EMPTY_CODE
    return jnp.where(empty, -1, ids), jnp.where(empty, -jnp.inf, code_to_score(codes))
