"""DoSA on the Pallas Triton backend: the screening kernel and the certified pipeline.

Pipeline of :func:`certified_topk_triton` (MATH.md §1.8), every scoring step through the
one scorer kernel of :mod:`jsparse.ops.indexer.triton` with one tile config per call:

0. probe (policy "auto", T > 128, default seeds): steps 1-2 on 64 strided queries; unless
   a cost model (:func:`screening_pays`) says steps 1-5 beat ``base`` on them, every
   query is answered by ``base`` instead.
1. seeds: one seed list per scorer block of BT queries (as ``full``), scored by the
   scorer's key-list mode; τ_t = the K-th seed score visible to query t.
2. plan (:mod:`jsparse.certified.planner`, XLA): rows, folded weights, guard, width.
3. screen (this module's kernel): U^num for every visible key of the screened queries;
   a key survives for query t iff U^num ≥ τ_t (as score codes) or its norm is not
   finite. The kernel stores, per scorer block, one byte a key (the union of its
   queries' survivors); :func:`expand_keep` turns the bytes into ascending id lists
   and counts.
4. refine: the scorer's key-list mode over each block's survivor list, plain scores by
   list position; each query counts its scores with code ≥ τ_t (``dosa``) or its
   visible listed keys (``dense``). A key in the list because another query of the
   block kept it is scored for t too: exact, since t's bound already proved it below
   τ_t, so it cannot enter t's Top-K. This is the paper's shared refinement stream
   (§1.9) at the granularity of the scorer's query block.
5. select: ``base``'s selection over each query's listed columns, mapped to ids through
   the list (unscreened queries: ``full``'s records, selected separately and merged as
   [T, K] answers).

No candidate is ever lost: a query that is not screened (plan.prune False) or whose
block's survivor list overflows is scored in full (``full``: records ≥ τ over its whole
range); a query whose record buffer overflows is answered by ``base``. Both are
reported per query.

Screening tile (one program, queries of one width class W):

    keys     [BS, D]          one key tile, BS = 64 (bf16; fp8 keys widen exactly)
    rows     [W·BQ, D]        W rows per query (hi, lo, retained heads, zeros), by slot
    logits   [BS, W·BQ]       one tensor-core dot, f32 accumulation
    bound    [BS, BQ]         Σ ω relu − relu(hi + lo) + e·‖k‖ + c_abs, times α
    keep     [N_blocks, S']   one byte a key (S' = S in whole 4-byte words): the union
                              over each scorer block

BQ·W = 128 by default (BQ = 16 queries at W = 8), so a key tile is loaded once per 16
queries, against once per BT = 2 queries for the full scorer. Queries are grouped into
tiles by width class (§1.9: "queries with similar retained-head budgets"); scorer
blocks stay whole so each block's survivor union is built by one program.
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
from jsparse.certified import planner
from jsparse.certified.reference import CertifiedInfo
from jsparse.ops import f32_dots
from jsparse.ops.indexer import methods
from jsparse.ops.indexer import triton as scorer
from jsparse.ops.indexer.result import IndexerTopK
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code


@dataclasses.dataclass(frozen=True)
class ScreenConfig:
    """Tiles of the screening kernel."""

    # Whole 8192 × 128K pipeline on the H200 (WORKSPACE.md, runs 12 and 14): 64 keys per
    # tile 39.7-39.8 ms against 42.1 ms at 128 (the per-tile epilogue is lighter per
    # program); 3 stages 39.0 ms against 2 stages 39.7 ms in the same run.
    block_s: int = 64  # keys per tile (M of the dot)
    tile_rows: int = 128  # screening rows per program (N of the dot): BQ·W
    num_warps: int = 4
    num_stages: int = 3
    # Contraction width of each dot (0: all of D), as ScorerConfig.dim_chunk: IEEE f32
    # (FMA) dots hold their operands whole along the contraction in registers.
    dim_chunk: int = 0

    def __post_init__(self):
        f32_dots.check_dim_chunk("ScreenConfig", self.dim_chunk)
        for name in ("block_s", "tile_rows", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ScreenConfig.{name} must be a power of two, got {value}")
        if self.block_s < 16 or self.tile_rows < 16:
            raise ValueError(f"ScreenConfig: block_s and tile_rows must be ≥ 16, got {self}")


# IEEE f32 screening rows (jax.default_matmul_precision "highest"): FMA dots on the
# contraction in slices, as the scorer's IEEE_F32_CONFIG. H100, 1024 × 32K causal f32,
# top-2048, the whole dosa call (run 255): 164-173 ms with the default tiles (whole D),
# 17.0-17.2 here, the best of eight (slices of 32: 105).
IEEE_F32_SCREEN_CONFIG = ScreenConfig(
    block_s=64, tile_rows=64, num_warps=4, num_stages=2, dim_chunk=16
)


def screen_f32_tensor_core_bytes(cfg: ScreenConfig, dim: int, block_t: int, width: int):
    """Shared memory of a screening program whose f32 dots run on the tensor cores: the
    pipelined key tiles [BS, D] and the screening rows' TF32 hi and lo parts [W·BQ, D]
    (the dot's B operand), 4 bytes a value: the scorer's model (see
    :func:`jsparse.ops.indexer.triton.f32_tensor_core_bytes`) for this kernel's dot."""
    rows = width * max(block_t, cfg.tile_rows // width)
    return 4 * dim * (cfg.num_stages * cfg.block_s + 2 * rows)


def _fit_screen_f32(cfg: ScreenConfig, dim: int, block_t: int, width: int) -> ScreenConfig:
    """``cfg`` shrunk until its f32 tensor-core tiles fit: fewer stages, then fewer rows,
    then fewer keys a tile (the scorer's order)."""

    def halvable(c):
        if c.tile_rows > 16 and c.tile_rows // width > block_t:
            return "tile_rows"
        return "block_s" if c.block_s > 16 else None

    return f32_dots.shrink_to_fit(
        cfg,
        lambda c: screen_f32_tensor_core_bytes(c, dim, block_t, width),
        halvable,
        "dosa screening",
        f"D {dim}, width {width}, block {block_t}",
    )


@dataclasses.dataclass(frozen=True)
class _Static:
    t: int
    s: int
    dim: int  # padded to a power of two
    width: int  # W of this launch
    block_t: int  # BT of the scorer
    block_q: int  # BQ: queries per screening program (multiple of BT)
    n_blocks: int  # scorer blocks ceil(T / BT)
    stride: int  # keep bytes a scorer block: S rounded up to whole 4-byte words
    splits: int
    cfg: ScreenConfig


def _screen_kernel(
    tile_ref, rows_ref, omega_ref, ecoef_ref, cabs_ref, tau_ref, prune_ref, start_ref,
    end_ref, k_ref, knorm_ref, scale_ref, *refs, p: _Static,
):  # fmt: skip
    # Outputs: the keep bytes [n_blocks, S] and per-(query, split) survivor counts. The
    # first launch creates the bytes; later width classes write theirs into the same.
    keep_ref, surv_ref = refs[-2:]
    bq, bt, w, bs = p.block_q, p.block_t, p.width, p.cfg.block_s
    nsub = bq // bt
    i = pl.program_id(0)
    split = pl.program_id(1)
    lane = jnp.arange(bq, dtype=jnp.int32)
    blk_of_q = plt.load(tile_ref.at[i, lane // bt])  # [BQ] scorer block of each query
    qid = blk_of_q * bt + lane % bt
    q_in = (blk_of_q >= 0) & (qid < p.t)
    q_safe = jnp.where(q_in, qid, 0)
    pruned = plt.load(prune_ref.at[q_safe], mask=q_in, other=0) != 0
    q_ok = q_in & pruned
    # Queries not screened see nothing here: start = S, end = 0.
    start = jnp.where(q_ok, plt.load(start_ref.at[q_safe], mask=q_in, other=0), p.s)
    end = jnp.where(q_ok, plt.load(end_ref.at[q_safe], mask=q_in, other=0), 0)
    tau = plt.load(tau_ref.at[q_safe], mask=q_in, other=0)
    ecoef = plt.load(ecoef_ref.at[q_safe], mask=q_in, other=0.0)
    cabs = plt.load(cabs_ref.at[q_safe], mask=q_in, other=0.0)
    wi = jnp.arange(w, dtype=jnp.int32)
    slices = f32_dots.contraction_slices(p.dim, p.cfg.dim_chunk)
    slice_dims = [jnp.arange(c, c + width, dtype=jnp.int32) for c, width in slices]
    # Rows row-major by width slot: column w·BQ + q of the logits. In the MMA's
    # accumulator layout a query's W columns (BQ apart) then sit in one thread, so the
    # sums over W are register adds; query-major columns (q·W + w) spread each query
    # over a quad of lanes, two shuffle rounds a sum (WORKSPACE.md, run 199: the kernel
    # 11.7 → 6.3 ms at 8192 × 128K).
    rows2 = [
        plt.load(
            rows_ref.at[q_safe[None, :, None], wi[:, None, None], dims[None, None, :]],
            mask=q_ok[None, :, None],
            other=0,
        ).reshape(w * bq, len(dims))
        for dims in slice_dims
    ]  # [W·BQ, D] in slices along D
    omega = plt.load(omega_ref.at[q_safe[None, :], wi[:, None]], mask=q_ok[None, :], other=0.0)
    # A cast, not where(p, 1.0, 0.0): Pallas Triton lowers a select between two Python
    # literals as an i1 select (see the path flags in jsparse/ops/topk/triton.py).
    aux_mask = (wi < planner.AUX_ROWS).astype(jnp.float32)  # rows hi, lo
    sub = jnp.arange(nsub, dtype=jnp.int32)
    blk = plt.load(tile_ref.at[i, sub])  # [nsub] scorer blocks of this program
    blk_ok = blk >= 0

    lo = jnp.min(jnp.where(q_ok, start, p.s))
    hi = jnp.max(jnp.where(q_ok & (end > start), end, 0))
    first, last = scorer.tile_span(lo, hi, bs)
    begin, stop = scorer.split_span(first, last, p.splits, split)

    def body(j, kept_count):
        ids = j * bs + jnp.arange(bs, dtype=jnp.int32)
        ok = ids < p.s
        safe = jnp.where(ok, ids, 0)
        # Unmasked gather at safe ids (a masked fp8 load with a fill value does not lower);
        # lanes past S are dropped by `visible` below.
        k_tiles = [plt.load(k_ref.at[safe[:, None], dims[None, :]]) for dims in slice_dims]
        knorm = plt.load(knorm_ref.at[safe], mask=ok, other=0.0)
        scale = plt.load(scale_ref.at[safe], mask=ok, other=1.0)
        logits = f32_dots.sliced_dot([tile.astype(rows2[0].dtype) for tile in k_tiles], rows2)
        l3 = logits.reshape(bs, w, bq)
        kept = jnp.sum(jnp.where(l3 < 0, 0.0, l3) * omega[None, :, :], axis=1)  # [BS, BQ]
        aux = jnp.sum(l3 * aux_mask[None, :, None], axis=1)
        bound = kept - jnp.where(aux < 0, 0.0, aux)
        bound = (bound + ecoef[None, :] * knorm[:, None] + cabs[None, :]) * scale[:, None]
        reject = (score_code(bound) < tau[None, :]) & (knorm[:, None] < jnp.inf)
        visible = ok[:, None] & (ids[:, None] >= start[None, :]) & (ids[:, None] < end[None, :])
        keep = (visible & ~reject).astype(jnp.int32)  # [BS, BQ]
        # One byte a key and scorer block, stored where it lies: no per-tile prefix sum,
        # no scattered list store, no count reduced across warps (run 198: those cost
        # 5.4 and ~1.4 of the kernel's 18.3 ms). `expand_keep` lists them afterwards.
        union = jnp.sum(keep.reshape(bs, nsub, bt), axis=2) > 0  # [BS, nsub]
        live = blk_ok[None, :] & ok[:, None]
        # Dead lanes aim one past the end (never a live index): interpreted, a masked
        # lane writes back the old value, which must not land on a live one.
        dst = jnp.where(live, blk[None, :] * p.stride + safe[:, None], p.n_blocks * p.stride)
        plt.store(keep_ref.at[dst], union.astype(jnp.int8), mask=live)
        return kept_count + keep

    kept_count = jax.lax.fori_loop(begin, stop, body, jnp.zeros((bs, bq), jnp.int32))
    dst = jnp.where(q_in, qid * p.splits + split, p.t * p.splits)
    plt.store(surv_ref.at[dst], jnp.sum(kept_count, axis=0), mask=q_in)


def _screen_launch(tiles, plan, start, end, k, knorm, scale, keep, surv, p: _Static):
    """One width class's screening launch. ``keep`` None: this launch creates the keep
    bytes (their unwritten bytes are never read); else it writes into them."""
    prune = plan.prune.astype(jnp.int32)
    inputs = (
        tiles, plan.rows, plan.row_weights, plan.e_coef, plan.c_abs, plan.tau_code, prune,
        start, end, k, knorm, scale,
    )  # fmt: skip
    n_in = len(inputs)
    aliased = (surv,) if keep is None else (keep, surv)
    aliases = {n_in: 1} if keep is None else {n_in: 0, n_in + 1: 1}  # → (keep, surv)
    keep_shape = jax.ShapeDtypeStruct((p.n_blocks * p.stride,), jnp.int8)
    return pallas_call(
        functools.partial(_screen_kernel, p=p),
        grid=(tiles.shape[0], p.splits),
        out_shape=(keep_shape, jax.ShapeDtypeStruct(surv.shape, jnp.int32)),
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=p.cfg.num_warps, num_stages=p.cfg.num_stages),
        interpret=backend.is_interpret(),
        name=f"jsparse_dosa_screen_w{p.width}",
    )(*inputs, *aliased)


EXPAND_CHUNK = 2048  # keep bytes a block's expansion reads a step
EXPAND_NUM_WARPS = 4  # 8 were slower at every chunk (WORKSPACE.md, run 201)


def _expand_kernel(lo_ref, hi_ref, words_ref, _lists_in, lists_ref, count_ref, *, stride, cap):
    # Keep bytes read as 4-byte words, a word a lane: the chunk's prefix sum runs over
    # EXPAND_CHUNK / 4 word counts instead of a byte a lane (the byte scan ran at 0.45
    # TB/s: WORKSPACE.md, run 201). Byte j of word w is key 4w + j of the block.
    b = pl.program_id(0)
    n_blocks = pl.num_programs(0)
    lo, hi = plt.load(lo_ref.at[b]), plt.load(hi_ref.at[b])
    first, last = scorer.tile_span(lo, hi, EXPAND_CHUNK)
    n_words = EXPAND_CHUNK // 4

    def body(c, filled):
        key0 = (c * n_words + jnp.arange(n_words, dtype=jnp.int32)) * 4
        touches = (key0 + 3 >= lo) & (key0 < hi)  # words holding a byte the screening wrote
        word = plt.load(
            words_ref.at[(b * stride + jnp.where(touches, key0, 0)) // 4],
            mask=touches,
            other=jnp.zeros((), jnp.int32),
        )
        # Bytes outside [lo, hi) are garbage: each byte is masked by its own key id.
        kept = [
            (((word >> (8 * j)) & 0xFF) != 0) & (key0 + j >= lo) & (key0 + j < hi) for j in range(4)
        ]
        per_word = sum(x.astype(jnp.int32) for x in kept)
        pos = filled + jnp.cumsum(per_word) - per_word  # the word's first slot
        for j in range(4):
            store = kept[j] & (pos < cap)
            dst = jnp.where(store, b * cap + pos, n_blocks * cap)
            plt.store(lists_ref.at[dst], key0 + j, mask=store)
            pos = pos + kept[j].astype(jnp.int32)
        return filled + jnp.sum(per_word)

    plt.store(count_ref.at[b], jax.lax.fori_loop(first, last, body, jnp.int32(0)))


def expand_keep(keep, lo, hi, cap):
    """Survivor lists from keep bytes [n_blocks · stride] (block-major, ``stride`` a
    multiple of 4, byte i of a block for key i): block b's kept ids in [lo[b], hi[b]),
    ascending, in ``cap`` slots (-1 after them), and its count (> cap: overflow; the ids
    past cap are not listed). Returns lists [n_blocks, cap], counts."""
    n_blocks = lo.shape[0]
    stride = keep.shape[0] // n_blocks
    if stride % 4 or keep.shape[0] != n_blocks * stride:
        raise ValueError(
            f"keep: {keep.shape[0]} bytes for {n_blocks} blocks; expected whole blocks of a "
            "multiple of 4 bytes"
        )
    words = jax.lax.bitcast_convert_type(keep.reshape(-1, 4), jnp.int32)
    lists = jnp.full((n_blocks * cap,), -1, jnp.int32)
    lists, counts = pallas_call(
        functools.partial(_expand_kernel, stride=stride, cap=cap),
        grid=(n_blocks,),
        out_shape=(
            jax.ShapeDtypeStruct(lists.shape, jnp.int32),
            jax.ShapeDtypeStruct((n_blocks,), jnp.int32),
        ),
        input_output_aliases={3: 0},
        compiler_params=plt.CompilerParams(num_warps=EXPAND_NUM_WARPS, num_stages=2),
        interpret=backend.is_interpret(),
        name="jsparse_dosa_expand",
    )(lo, hi, words, lists)
    return lists.reshape(n_blocks, cap), counts


PROBE_QUERIES = 64  # queries planned first to decide whether screening can pay (policy auto)

# The probe's cost model, in units of ``base``'s time per visible (query, key) pair.
# Fitted to the H200's GPU busy times at H = 64, D = 128, K = 2048, FP8 keys
# (WORKSPACE.md, run 208; 8192 × ~127K pairs that ``base`` scores and selects in 40.8
# ms, 39 ps a pair): seeds 2.6 ms + their τ selection ~0.85 (6689 seeds a query), plan,
# selection and glue ~6.5, screening 6.2 + expansion 1.1 at W = 8, refinement 1.17 at
# 2.44% survival; every query left to ``full`` (iid): 105 ms.
_SEED_UNITS = 1.6  # per seed key of a query: scored, then τ selected from them
_QUERY_UNITS_PER_K = 10.0  # per query, times K: plan, selection, glue
_SCREEN_UNITS_PER_ROW = 0.023  # per visible pair and screening row (W = 8: 0.18)
# Per visible pair, times the estimated survival: refinement measured 1.18 per survivor
# (gathered keys, the block's union), plus a margin: the estimate counts the seeds'
# recent window as kept and samples the rest (planner.plan_from_threshold), which
# brackets the measured 2.44% at 8192 × 128K between 0.7% (sample) and 3.4%.
_REFINE_UNITS = 1.3
_FULL_UNITS = 2.4  # per visible pair of a query left to ``full`` (records ≥ τ)
PROBE_GAIN = 0.9  # screen only when the estimate is at most this share of ``base``


def probe_width(plan, start, end):
    """The screening width most of the probe's visible keys would be screened at."""
    visible = (end - start).astype(jnp.float32) * plan.prune
    widths = jnp.asarray(plan.widths, jnp.int32)
    votes = jnp.sum(jnp.where(plan.width[None, :] == widths[:, None], visible[None, :], 0), axis=1)
    return widths[jnp.argmax(votes)]


def screening_pays(plan, start, end, n_seeds: int, top_k: int):
    """Whether the certified pipeline is estimated to beat ``base`` on these queries.

    Seeds and the plan are paid for every query before any key is screened: on short
    visible ranges (the early queries of a causal prefill) that alone exceeds ``base``,
    whatever the bound prunes.
    """
    visible = (end - start).astype(jnp.float32)
    fixed = _SEED_UNITS * jnp.minimum(visible, n_seeds) + _QUERY_UNITS_PER_K * top_k
    screened = visible * (_SCREEN_UNITS_PER_ROW * plan.width + _REFINE_UNITS * plan.est_survival)
    per_query = fixed + jnp.where(plan.prune, screened, _FULL_UNITS * visible)
    return jnp.sum(per_query) <= PROBE_GAIN * jnp.sum(visible)


def _class_tiles(block_class, c, nsub):
    """Scorer blocks of width class c packed into tiles of nsub blocks: [n_tiles, nsub]."""
    n = block_class.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    order = jnp.argsort(jnp.where(block_class == c, idx, n + idx)).astype(jnp.int32)
    count = jnp.sum(block_class == c)
    n_tiles = -(-n // nsub)
    order = jnp.pad(order, (0, n_tiles * nsub - n))
    live = jnp.arange(n_tiles * nsub) < count
    return jnp.where(live, order, -1).reshape(n_tiles, nsub)


# FP8 keys reach the screening kernel widened once, in memory, to the rows' dtype
# (exact; each tile is cast to it in the kernel anyway), by the scorer's rule
# (``WIDEN_FP8_IN_MEMORY_FROM``): a tile converted in registers cannot stream to shared
# memory asynchronously. Measured (WORKSPACE.md, run 50): screening 20.2 → 18.3 ms at
# 8192 × 128K low_survival, same answers.
SCREEN_WIDENS_FP8_IN_MEMORY = True


def _screen_widens_in_memory(num_queries: int) -> bool:
    return SCREEN_WIDENS_FP8_IN_MEMORY and scorer.widens_fp8_in_memory(num_queries)


def screen(plan, start, end, k, k_scale, knorm, *, block_t, cap, cfg=None, splits=None):
    """Survivor lists per scorer block (union over its queries) and counts.

    Two steps: the screening launches (one per width class) store one keep byte per key
    and scorer block, then :func:`expand_keep` lists each block's kept ids. Returns
    (lists [n_blocks, cap] int32 in ascending id order, split key ranges included, -1
    in unused slots; counts [n_blocks] (may exceed cap: overflow); survivors [T] (keys
    each query's own bound kept)).
    """
    if cfg is None:
        ieee_f32 = plan.rows.dtype == jnp.float32 and not f32_dots.tensor_cores(jnp.float32)
        cfg = IEEE_F32_SCREEN_CONFIG if ieee_f32 else ScreenConfig()
    t, _, d = plan.rows.shape
    s = k.shape[0]
    if k.dtype == jnp.float8_e4m3fn and _screen_widens_in_memory(t):
        k = k.astype(plan.rows.dtype)
    dp = max(16, 1 << (d - 1).bit_length())
    rows = plan.rows
    if dp != d:
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, dp - d)))
        k = jnp.pad(k, ((0, 0), (0, dp - d)))
    plan = plan.replace(rows=rows)
    if f32_dots.tensor_cores(rows.dtype):
        cfg = _fit_screen_f32(cfg, dp, block_t, max(plan.widths))
    n_blocks = -(-t // block_t)
    # Width class of each scorer block: the widest of its screened queries (-1: none).
    pad = n_blocks * block_t - t
    width_idx = jnp.searchsorted(jnp.asarray(plan.widths, jnp.int32), plan.width)
    cls = jnp.where(plan.prune, width_idx, -1)
    block_class = jnp.max(jnp.pad(cls, (0, pad), constant_values=-1).reshape(-1, block_t), axis=1)
    if splits is None:
        # Decode-sized batches split the key range over programs; prefill does not.
        splits = int(max(1, min(-(-s // cfg.block_s), -(-4 * backend.sm_count() // n_blocks))))
    # The queries' own chunking (jsparse._chunking) keeps T·S, hence the keep bytes,
    # under 2^31 elements; refuse rather than wrap if a caller does not.
    stride = -(-s // 4) * 4  # whole words a block: the expansion reads 4 bytes a lane
    backend.check_triton_offsets(
        "dosa screening", keep=jax.ShapeDtypeStruct((n_blocks * stride + 1,), jnp.int8)
    )
    scale = jnp.ones((s,), jnp.float32) if k_scale is None else k_scale
    keep = None
    surv = jnp.zeros((t * splits,), jnp.int32)
    for c, width in enumerate(plan.widths):
        block_q = max(block_t, cfg.tile_rows // width)
        p = _Static(
            t=t, s=s, dim=dp, width=width, block_t=block_t, block_q=block_q,
            n_blocks=n_blocks, stride=stride, splits=splits, cfg=cfg,
        )  # fmt: skip
        tiles = _class_tiles(block_class, c, block_q // block_t)
        keep, surv = _screen_launch(tiles, plan, start, end, k, knorm, scale, keep, surv, p)
    # Each block's survivors lie in the span of its screened queries' ranges, inside the
    # key tiles its programs scanned (and wrote bytes for).
    lo, hi = methods.block_ranges(start, jnp.where(plan.prune, end, start), block_t, s)
    lists, counts = expand_keep(keep, lo.astype(jnp.int32), hi.astype(jnp.int32), cap)
    return lists, counts, surv.reshape(t, splits).sum(axis=1)


def default_list_capacity(top_k: int, num_keys: int) -> int:
    """Survivor slots per scorer block: S/4, at least 4·K, at most S (rounded to 256).

    The planner screens a query only when its estimated block list fits in half of this
    (about 8% survival), so overflows stay rare; 8192 × 128K keys: 512 MB of lists.
    """
    s_r = methods._round_up(num_keys, 256)
    return min(s_r, max(methods._round_up(4 * top_k, 256), methods._round_up(num_keys // 4, 256)))


@backend.jit_per_mode(
    static_argnames=(
        "top_k", "method", "widths", "policy", "n_seeds", "list_capacity",
        "record_capacity", "cfg", "screen_cfg", "splits", "sort",
    ),
)  # fmt: skip
def _pipeline(
    q, weights, k, top_k, k_scale, start, end, seed_ids, r_arr, flags, *,
    method, widths, policy, n_seeds, list_capacity, record_capacity, cfg,
    screen_cfg, splits, sort,
):  # fmt: skip
    t = q.shape[0]
    norms = planner.key_norms(k, k_scale)

    def certified(r_given):
        return _certified(
            q, weights, k, top_k, k_scale, start, end, seed_ids, r_given, flags, norms,
            method=method, widths=widths, policy=policy, n_seeds=n_seeds,
            list_capacity=list_capacity, record_capacity=record_capacity, cfg=cfg,
            screen_cfg=screen_cfg, splits=splits, sort=sort,
        )  # fmt: skip

    if not (policy == "auto" and seed_ids is None and t > 2 * PROBE_QUERIES):
        return certified(r_arr)
    # A useless bound (i.i.d.-like scores: τ from seeds admits a large share of keys),
    # or visible ranges too short to repay seeds + plan, cost more than ``base``. Plan a
    # strided sample of the queries first, and score everything with ``base`` unless the
    # cost model says the certified pipeline is faster on the sample.
    probe = np.linspace(0, t - 1, PROBE_QUERIES).astype(np.int32)
    _, probe_plan = _seeds_and_plan(
        q[probe], weights[probe], k, k_scale, start[probe], end[probe], None,
        None if r_arr is None else r_arr[probe], flags, norms, top_k=top_k, widths=widths,
        policy=policy, n_seeds=n_seeds, list_capacity=list_capacity, cfg=cfg,
    )  # fmt: skip
    n_seeds_used = _seeds_per_block(n_seeds, top_k, k.shape[0])
    worth = screening_pays(probe_plan, start[probe], end[probe], n_seeds_used, top_k)
    if r_arr is None:
        # r="auto": every query gets the width the probe's screened queries chose most
        # (weighted by visible keys), so the plan computes one certificate per query
        # instead of one per width (the plan is memory-bound: 4.8 of dosa's 40 ms).
        width = probe_width(probe_plan, start[probe], end[probe])
        r_arr = jnp.full((t,), jnp.minimum(width - planner.AUX_ROWS, q.shape[1]), jnp.int32)

    def everything(_):
        base = methods.topk_base(q, weights, k, top_k, k_scale, start, end, cfg=cfg, sort=sort)
        visible = (end - start).astype(jnp.int32)
        none = jnp.zeros((t,), bool)
        # The full plan has the probe plan's layout with T rows; nothing was planned.
        plan = jax.tree.map(lambda x: jnp.zeros((t, *x.shape[1:]), x.dtype), probe_plan)
        plan = plan.replace(
            tau_code=jnp.full((t,), EMPTY_CODE, jnp.int32),
            reason=jnp.full((t,), planner.REASON_USELESS, jnp.int32),
            est_survival=jnp.ones((t,), jnp.float32),
        )
        result = base.replace(
            candidates=visible, survivors=visible, threshold=code_to_score(plan.tau_code),
            fallback=jnp.ones((t,), bool),
        )  # fmt: skip
        return result, CertifiedInfo(plan, none, none, none, visible)

    return jax.lax.cond(worth, certified, everything, r_arr)


def _seeds_per_block(n_seeds, top_k, num_keys):
    """Length of the default seed lists: ``n_seeds`` or √(K·S/6) (``full``'s rule), ≤ S."""
    return min(n_seeds or methods.default_seed_count(top_k, num_keys), num_keys)


def _seeds_and_plan(
    q, weights, k, k_scale, start, end, seed_ids, r_arr, flags, norms, *, top_k, widths,
    policy, n_seeds, list_capacity, cfg,
):  # fmt: skip
    """Seeds per scorer block, τ per query (their K-th score) and the screening plan.

    ``norms``: :func:`planner.key_norms` of the keys (computed once per call)."""
    d = q.shape[2]
    s = k.shape[0]
    bt = cfg.block_t
    if seed_ids is None:
        n = _seeds_per_block(n_seeds, top_k, s)
        seeds = methods.block_seed_ids(start, end, bt, n, s)
        skip = n // 2  # the recent half of the default seed lists
    else:
        seeds = methods.block_union_ids(seed_ids, bt)
        skip = 0
    tau = methods.seed_threshold(q, weights, k, k_scale, start, end, seeds, top_k, cfg=cfg)

    knorm, kmax, smax = norms
    cols = planner.sample_seed_columns(seeds.shape[1], skip)
    numerics = planner.numerics_for("triton", q.dtype, k.dtype, d, cfg.fp8_dot)
    plan = planner.plan_from_threshold(
        q, weights, k, k_scale, start, end, tau, seeds[:, cols], r_arr, knorm, kmax, smax,
        flags, top_k=top_k, group=bt, widths=widths, numerics=numerics, policy=policy,
        list_capacity=list_capacity, recent_keys=skip,
    )  # fmt: skip

    return tau, plan


def _certified(
    q, weights, k, top_k, k_scale, start, end, seed_ids, r_arr, flags, norms, *,
    method, widths, policy, n_seeds, list_capacity, record_capacity, cfg,
    screen_cfg, splits, sort,
):  # fmt: skip
    t = q.shape[0]
    bt = cfg.block_t
    keep_all = jnp.full((t,), EMPTY_CODE, jnp.int32)
    tau, plan = _seeds_and_plan(
        q, weights, k, k_scale, start, end, seed_ids, r_arr, flags, norms, top_k=top_k,
        widths=widths, policy=policy, n_seeds=n_seeds, list_capacity=list_capacity, cfg=cfg,
    )  # fmt: skip
    knorm = norms[0]
    lists, list_counts, n_surv = screen(
        plan, start, end, k, k_scale, knorm, block_t=bt, cap=list_capacity, cfg=screen_cfg,
        splits=splits,
    )  # fmt: skip
    block_overflow = list_counts > list_capacity
    q_block = jnp.arange(t) // bt
    list_overflow = plan.prune & block_overflow[q_block]
    screened = plan.prune & ~list_overflow

    # Refinement over the survivor lists (screened queries only; others see nothing):
    # each query's scores by list position, then base's selection over the first
    # list-count columns. The lists are in id order, so column order is the tie-break.
    # Nothing can overflow: a screened query's block list fits its capacity.
    tau_write = keep_all if method == "dense" else tau
    refine_end = jnp.where(screened, end, start)
    counts_in = jnp.where(block_overflow, 0, jnp.minimum(list_counts, list_capacity))
    listed, counts = scorer.score_list_triton(
        q, weights, k, k_scale, start, refine_end, lists, key_counts=counts_in,
        tau_codes=tau_write, cfg=cfg,
    )  # fmt: skip
    indices, values = methods.select_listed(
        listed, lists, q_block, jnp.where(screened, counts_in[q_block], 0), top_k, sort
    )

    # Queries not screened: ``full`` (records ≥ τ over the whole visible range), selected
    # on their own. Only [T, K] answers pass through the cond: record buffers returned
    # unchanged by a cond branch are copied (8192 × 128K: 5.4 GB, 4.2 ms, run 198).
    full_q = ~screened

    def with_full(args):
        i0, v0, n0 = args
        c1, r1, n1, ordered = scorer.score_records_triton(
            q, weights, k, k_scale, start, jnp.where(full_q, end, start), tau,
            record_capacity, cfg=cfg,
        )  # fmt: skip
        i1, v1 = methods.select_records(
            c1, r1, jnp.minimum(n1, record_capacity), top_k, id_ordered=ordered, sort=sort
        )
        return (
            jnp.where(full_q[:, None], i1, i0),
            jnp.where(full_q[:, None], v1, v0),
            jnp.where(full_q, n1, n0),
        )

    indices, values, counts = jax.lax.cond(
        jnp.any(full_q), with_full, lambda a: a, (indices, values, counts)
    )
    rec_overflow = full_q & (counts > record_capacity)

    def recover(iv):
        # Records were dropped for these queries: only scoring everything is exact there.
        fb_end = jnp.where(rec_overflow, end, start)
        base = methods.topk_base(q, weights, k, top_k, k_scale, start, fb_end, cfg=cfg, sort=sort)
        return (
            jnp.where(rec_overflow[:, None], base.indices, iv[0]),
            jnp.where(rec_overflow[:, None], base.scores, iv[1]),
        )

    indices, values = jax.lax.cond(jnp.any(rec_overflow), recover, lambda iv: iv, (indices, values))
    visible = (end - start).astype(jnp.int32)
    q_list = jnp.where(screened, list_counts[q_block], visible)
    result = IndexerTopK(
        indices=indices,
        scores=values,
        visible=visible,
        candidates=counts.astype(jnp.int32),
        survivors=jnp.where(screened, n_surv, visible),
        threshold=code_to_score(tau),
        fallback=~screened | rec_overflow,
    )
    info = CertifiedInfo(
        plan=plan,
        screened=screened,
        survivor_overflow=list_overflow,
        record_overflow=rec_overflow,
        list_length=q_list.astype(jnp.int32),
    )
    return result, info


def certified_topk_triton(
    q, weights, k, top_k, k_scale, start, end, seeds, *,
    method="dosa", variant="dosa", r="auto", policy="auto", list_capacity=None,
    record_capacity=None, refine_block=None, screen_cfg=None, splits=None, sort=True,
):  # fmt: skip
    """``dense`` / ``dosa`` on the Triton kernels. Returns (IndexerTopK, CertifiedInfo).

    Options: ``list_capacity`` survivor slots per scorer block (default
    :func:`default_list_capacity`); ``record_capacity`` records per query (default as
    ``full``); ``refine_block`` queries per scorer block for every scoring launch of the
    call (default the scorer's heuristic, the one ``base`` uses: answers are identical
    to ``base`` run with the same block); ``screen_cfg`` :class:`ScreenConfig` (None:
    the default, :data:`IEEE_F32_SCREEN_CONFIG` for IEEE f32 rows);
    ``splits`` programs per screening tile along the keys; ``sort`` False returns each
    row's exact Top-K set without the final ordering (as ``base``).
    """
    t, h, _ = q.shape
    s = k.shape[0]
    widths, r_arr = planner.resolve_r(r, t, h)
    cfg = scorer.config_for(q, k)
    if refine_block is not None:
        cfg = dataclasses.replace(cfg, block_t=refine_block)
    explicit = seeds is not None and not isinstance(seeds, int)
    n_seeds = seeds if isinstance(seeds, int) else None
    n_used = seeds.shape[1] if explicit else min(n_seeds or methods.default_seed_count(top_k, s), s)
    result, info = _pipeline(
        q, weights, k, top_k, k_scale, start, end, seeds if explicit else None, r_arr,
        planner.variant_flags(variant), method=method, widths=widths, policy=policy,
        n_seeds=n_seeds,
        list_capacity=list_capacity or default_list_capacity(top_k, s),
        record_capacity=record_capacity or methods.default_record_capacity(top_k, s, n_used),
        cfg=cfg, screen_cfg=screen_cfg, splits=splits, sort=sort,
    )  # fmt: skip
    return result, info.replace(plan=info.plan.replace(variant=variant))
