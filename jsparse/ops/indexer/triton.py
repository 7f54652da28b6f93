"""The indexer scorer as a Pallas Triton kernel, and the Top-K methods built on it.

One kernel body scores every (query, key) pair the library ever scores on this
backend: all visible keys (``base``), seed keys and thresholded records (``full``),
screening survivors (``dense``/``dosa``). It is specialised statically by

* where its keys come from: a range (every key a query block can see) or a list of
  key ids per query block (seeds, survivors), and
* where its scores go: a dense [T, S] matrix, compacted records (score code, key id)
  of the scores ≥ a per-query threshold τ, or (key lists) a dense [T, N] matrix by
  list position, with each query's count of scores ≥ τ.

The arithmetic between loading a key tile and producing its scores is the same code
with the same tile config in every case (:func:`_score_tile`), which is what makes the
methods agree id for id (MATH.md §1.8, "the same scorer").

Tile of one program step (BT queries share each key tile, MATH.md §1.1):

    keys    [BS, D]      gathered by id (contiguous ids for a range)
    queries [BT·H, D]    the BT queries' heads, stacked
    logits  [BS, BT·H]   one tensor-core dot, f32 accumulation
    scores  [BT, BS]     relu, times weights, summed over H, times k_scale
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
from jsparse.ops import f32_dots
from jsparse.ops.indexer.report import report_shapes, store_report
from jsparse.ops.topk import codes as codes_lib

_NEG_INF = float("-inf")
# FP8 inputs of a launch with at least this many queries are widened to the compute
# dtype once, in memory, before the kernel (exact: every e4m3 value is an f16), instead
# of tile by tile in registers: a load that feeds a conversion cannot stream global →
# shared memory asynchronously, and the in-register fp8 scorer runs ~30% below the bf16
# one. Widened, it runs at the bf16 tiles' rate (WORKSPACE.md, run 45: 8192 × 128K
# causal, 270 → 462 TFLOP/s). The dot's operands, and so the scores, are the same either
# way. Few queries read each key once or twice, where fp8's halved bytes pay more than
# the copy. None: always in registers.
WIDEN_FP8_IN_MEMORY_FROM: int | None = 16


@dataclasses.dataclass(frozen=True)
class ScorerConfig:
    """Tiles of the scorer kernel. Every launch of one indexer call uses one config: the
    dot's decomposition, and so the f32 rounding of a score, can change with the tiles
    (64-key tiles at 8 warps give other scores than at 4, run 113)."""

    block_t: int = 2  # queries per program; they share every key tile
    block_s: int = 128  # keys per tile (M of the dot)
    num_warps: int = 8
    num_stages: int = 2
    # FP8 × FP8 on the FP8 tensor cores; off by default: widening both to f16 in
    # registers is exact (every e4m3 value is an f16), keeps true f32 accumulation
    # (Hopper's FP8 MMA accumulates with fewer bits) and measured faster in this kernel
    # (WORKSPACE.md, 2026-11-29). f16, not bf16: e4m3 → f16 is one instruction on sm_90.
    fp8_dot: bool = False
    # Contraction width of each dot (0: all of D in one dot). The key tile is loaded and
    # multiplied in D / dim_chunk slices into one accumulator, in order, so the scores
    # are those of one dot; what changes is what a dot holds. Triton's IEEE f32 (FMA)
    # dot keeps each thread's operand rows whole along the contraction in registers.
    dim_chunk: int = 0

    def __post_init__(self):
        for name in ("block_t", "block_s", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ScorerConfig.{name} must be a power of two, got {value}")
        if self.block_s < 16:
            raise ValueError(f"ScorerConfig.block_s must be ≥ 16, got {self.block_s}")
        if self.num_stages < 1:
            raise ValueError(f"ScorerConfig.num_stages must be ≥ 1, got {self.num_stages}")
        f32_dots.check_dim_chunk("ScorerConfig", self.dim_chunk)


def default_config(num_queries: int, heads: int, fp8_keys: bool = False) -> ScorerConfig:
    """Tiles measured best on an H200 (WORKSPACE.md, runs 1-3, 45, 66 and 72, H=64, D=128).

    Queries share each key tile (N = block_t·H of the dot). From 16 queries: two for
    bf16 keys and for fp8 keys widened in memory, four for fp8 keys widened in registers
    (where more reuse per widened tile pays). Decode (fewer than 16): one small-tile
    config for both dtypes, below. The tiles follow the query count alone, not whether
    a launch actually widens (see :func:`_widen_in_memory`), so that every launch over
    the same queries, whatever its keys, runs one config: one config is what keeps
    methods identical id for id. f32 inputs take tiles of their own: :func:`config_for`.
    """
    if heads >= 128:
        return ScorerConfig(block_t=1)
    in_registers = fp8_keys and not widens_fp8_in_memory(num_queries)
    if num_queries < 16 and (in_registers or not fp8_keys):
        # Decode: 64-key tiles, 4 warps, 3 stages, with keys streamed from HBM (run 72,
        # inputs rotated; µs, 64K / 128K): 8 queries bf16 (bt 2) 23.0 / 43.0 → 21.0 /
        # 37.6, fp8 (bt 4, 128-key tiles) 22.3 / 43.5 → 21.8 / 39.4. One query runs a
        # block of one (runs 104-105: bf16 8.3 / 12.7 at a block of two with one masked
        # → 7.6 / 11.8, fp8 7.0 / 11.8 → 5.5 / 9.5, the same scores); 2-3 a block of two.
        block_t = 1 if num_queries == 1 else 2 if num_queries < 4 else 4
        return ScorerConfig(block_t=block_t, block_s=64, num_warps=4, num_stages=3)
    if in_registers:
        return ScorerConfig(block_t=4)
    return ScorerConfig(block_t=2)


# f32 operands multiplied as IEEE f32 (jax.default_matmul_precision "highest"): Triton's
# FMA dot holds each thread's operands whole along the contraction in registers, so it
# slows far more than in proportion to the tile unless the contraction is split
# (dim_chunk). H100, H 64, D 128, ms (runs 248, 253; XLA's IEEE einsum 0.70 / 27.0):
# 8 × 64K 15.2 at the decode tiles (4, 64, 4 warps, 3 stages), 1.49 at one query × 16
# keys, 0.86 here; 1024 × 32K causal 790 at the prefill tiles, 78.3 at one query × 16
# keys, 41.5 here (13 TFLOP/s). Within 3% of the best of 13 / 10 chunked tiles at each.
IEEE_F32_CONFIG = ScorerConfig(block_t=2, block_s=128, num_warps=8, num_stages=2, dim_chunk=16)
# Where the bf16 tiles take one query a block (one decode query, a batch of sequences,
# each over its own keys). 8 warps beat 4 at every shape of runs 256-257 (ms, XLA's
# IEEE path in brackets): one query × 64K scores 0.214 / 0.361 (0.153); Top-K of batches
# 1 × 128K 0.260 / 0.401 (0.335), 8 × 64K 0.870 / 1.00 (0.585), 64 × 64K 4.95 / 5.89 (5.02).
IEEE_F32_ONE_QUERY_CONFIG = dataclasses.replace(IEEE_F32_CONFIG, block_t=1)


def config_for(q, k) -> ScorerConfig:
    """:func:`default_config` of a launch over queries ``q`` [T, H, D] and keys ``k``,
    f32 inputs' tiles from it as :func:`_f32_tiles` takes them."""
    t, h, d = q.shape
    if compute_dtype(q.dtype, k.dtype) != jnp.float32:
        return default_config(t, h, k.dtype == jnp.float8_e4m3fn)
    return _f32_tiles(default_config(t, h), h, d)


def _f32_tiles(cfg: ScorerConfig, heads: int, dim: int) -> ScorerConfig:
    """The tiles of an f32 launch whose bf16 tiles are ``cfg``: shrunk to fit shared
    memory for tensor-core dots (:func:`fit_f32_tensor_cores`), :data:`IEEE_F32_CONFIG`
    for IEEE ones (:data:`IEEE_F32_ONE_QUERY_CONFIG` where ``cfg`` has one query a block)."""
    if f32_dots.tensor_cores(jnp.float32):
        return fit_f32_tensor_cores(cfg, heads, dim)
    return IEEE_F32_ONE_QUERY_CONFIG if cfg.block_t == 1 else IEEE_F32_CONFIG


def f32_tensor_core_bytes(cfg: ScorerConfig, heads: int, dim: int) -> int:
    """Shared memory of a scorer program whose f32 dots run on the tensor cores: the
    pipelined key tiles [BS, D] and the queries' TF32 hi and lo parts [BT·H, D] (the
    dot's B operand), 4 bytes a value. At H 64, D 128 it is what the compiler asked in
    runs 244-245, to the byte (262,144 at BT 2, BS 128, 2 stages; 360,448 at BT 4, BS 64,
    3 stages)."""
    hp = next_pow2(heads, max(1, 16 // cfg.block_t))
    return 4 * next_pow2(dim, 16) * (cfg.num_stages * cfg.block_s + 2 * cfg.block_t * hp)


def fit_f32_tensor_cores(cfg: ScorerConfig, heads: int, dim: int) -> ScorerConfig:
    """``cfg`` shrunk until its f32 tensor-core tiles fit shared memory: fewer stages
    first, then fewer queries a block, then fewer keys a tile. Of the fits run 245 timed
    (H100, H 64, D 128), the first this finds was the fastest at both shapes: 1024 × 32K
    causal BT 2, BS 128, 1 stage 7.3 ms (six others 9.1-25); 8 × 64K BT 2, BS 64, 3
    stages 0.33 ms (five others 0.38-0.63)."""
    return f32_dots.shrink_to_fit(
        cfg,
        lambda c: f32_tensor_core_bytes(c, heads, dim),
        lambda c: "block_t" if c.block_t > 1 else "block_s" if c.block_s > 16 else None,
        "indexer scorer",
        f"H {heads}, D {dim}",
    )


def batch_config(heads: int) -> ScorerConfig:
    """Tiles for a batch of sequences, each query over keys of its own (serving decode).

    A block of one query, whatever the batch size: in a block of several, every key tile
    belongs to one sequence and the dot would compute the others' masked scores too. So
    these are the one-query decode tiles, and FP8 keys are widened in registers.
    """
    return default_config(1, heads)


def batch_config_for(q, k) -> ScorerConfig:
    """:func:`batch_config` of a batch launch over queries ``q`` [B, H, D] and keys
    ``k``, f32 inputs' tiles from it as :func:`_f32_tiles` takes them (one query a
    block in every case)."""
    cfg = batch_config(q.shape[1])
    if compute_dtype(q.dtype, k.dtype) != jnp.float32:
        return cfg
    return _f32_tiles(cfg, q.shape[1], q.shape[2])


def widens_fp8_in_memory(num_queries: int) -> bool:
    """Whether a launch of this many queries over shared keys widens FP8 in memory (see
    ``WIDEN_FP8_IN_MEMORY_FROM``); the screening kernel of DoSA follows the same rule."""
    threshold = WIDEN_FP8_IN_MEMORY_FROM
    return threshold is not None and num_queries >= threshold


def _widen_in_memory(t: int, q_dtype, k_dtype, compute, *, shared_keys: bool) -> bool:
    """Whether a launch widens its FP8 inputs before the kernel (see
    ``WIDEN_FP8_IN_MEMORY_FROM``). Only keys that many queries share: a batch of decode
    sequences reads each key once, and widening would copy the whole cache (or every
    page of a paged pool) on each step."""
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    has_fp8 = fp8 in (jnp.dtype(q_dtype), jnp.dtype(k_dtype))
    return bool(has_fp8 and jnp.dtype(compute) != fp8 and shared_keys and widens_fp8_in_memory(t))


def tile_span(lo, hi, tile: int):
    """In a kernel: [first, last) of the ``tile``-position tiles covering [lo, hi), empty
    (first == last) when hi ≤ lo. The scorer, the screening kernel, the expansion and the
    ``dq`` backward visit only these."""
    first = lo // tile
    return first, jnp.where(hi > lo, (hi + tile - 1) // tile, first)


def split_span(first, last, splits: int, split):
    """In a kernel: split ``split``'s share [begin, stop) of tiles [first, last) cut into
    ``splits`` equal runs (the last ones short or empty)."""
    per_split = (last - first + splits - 1) // splits
    begin = first + split * per_split
    return begin, jnp.minimum(begin + per_split, last)


def next_pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two ≥ ``n`` and ≥ ``minimum`` (Triton blocks are powers of two)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def compute_dtype(q_dtype, k_dtype, fp8_dot: bool = False):
    """Dtype both operands of the tensor-core dot are cast to (exact widening only)."""
    q_dtype, k_dtype = jnp.dtype(q_dtype), jnp.dtype(k_dtype)
    if jnp.float32 in (q_dtype, k_dtype):
        return jnp.dtype(jnp.float32)
    if jnp.bfloat16 in (q_dtype, k_dtype):
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float8_e4m3fn if fp8_dot else jnp.float16)


def _score_tile(q_parts, w, k_parts, scale, *, block_t, heads):
    """Scores [BT, BS] of one key tile for a block of queries (the one shared scorer).

    q_parts: [BT·H, D] compute dtype and k_parts: [BS, D] compute dtype, as equal-length
    sequences of slices along D (``ScorerConfig.dim_chunk``; one slice each unless it
    asks); w: [BT, H] f32; scale: [BS] f32, or None for unscaled keys (the same scores
    as a scale of 1).
    """
    logits = f32_dots.sliced_dot(k_parts, q_parts)
    # [BS, BT·H]; relu as where(x < 0) so NaN propagates (jnp.maximum drops it on GPU).
    relu = jnp.where(logits < 0, 0.0, logits)
    if block_t == 1:
        # One query: a sum along the logits' head axis. Through the [BS, 1, H] reshape and
        # the transpose below, the same scores took twice the instructions and 1.6× the
        # time (WORKSPACE.md, runs 104-105).
        scores = jnp.sum(relu * w, axis=1)
        return (scores if scale is None else scores * scale)[None, :]
    block_s = k_parts[0].shape[0]
    weighted = relu.reshape(block_s, block_t, heads) * w[None, :, :]
    scores = jnp.sum(weighted, axis=2)  # [BS, BT]
    if scale is not None:
        scores = scores * scale[:, None]
    return scores.T


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one scorer launch."""

    t: int
    s: int  # keys as the queries' ranges and the ids number them (virtual when paged)
    heads: int  # padded to a power of two
    dim: int  # padded to a power of two
    cfg: ScorerConfig
    compute: np.dtype
    key_list: bool  # keys come from a per-block id list, not a range
    list_len: int  # length of that list (multiple of block_s)
    records: bool  # write records ≥ τ instead of a dense matrix
    cap: int  # record capacity per query
    splits: int
    # The second launch of a dense output with -inf where a query sees nothing: it only
    # writes -inf over the key tiles no query of a block sees. In the scoring launch
    # itself that loop made the main loop 1.7× slower at block_t 2 (WORKSPACE.md, run 52).
    fill_only: bool
    interpret: bool
    page_size: int = 0  # > 0: key id i lives at row pages[i // P]·P + i % P of k
    has_scale: bool = True  # keys carry a per-key scale (k_scale given)
    # Dense launches may also write an exhaustive method's per-query report (see
    # :mod:`jsparse.ops.indexer.report`), from each query block's first split.
    report: bool = False
    # Records of a split launch: slots per (program, query) of a staging buffer (0: none,
    # each tile reserves its rows' room with a fetch-and-add; see STAGED_SPLIT_RECORDS).
    stage: int = 0
    # Dense output per query instead of per key (> 0): [T, row_cols], key id i of query t
    # at column i - start[t]. A batch of sequences, each query over its own keys, then
    # writes [B, S_max] instead of a [B, B·S_max] matrix that is mostly never read.
    row_cols: int = 0
    # Key lists: dense scores by list position, [T, list_len] (-inf where not visible),
    # and per (split, query) the count of visible scores with code ≥ τ. No prefix sum and
    # no scattered store a tile: the selection compacts afterwards (see score_list_triton).
    list_scores: bool = False


# Dense launches over a paged cache load each tile's page-table entries one tile ahead,
# so the key loads do not wait on them (see WORKSPACE.md, run 120). Two tiles ahead was
# slower (FP8 64 × 64K at P 64: 253 against 238 µs, run 298). Where a tile reads its
# entries as scalars the next tile's are loaded before the tile's own key loads (P 64:
# 242 → 238 µs, P 128 218 → 216); an entry a key is loaded after them (before: P 32
# 295 → 306 µs, runs 298 and 301).
PREFETCH_PAGES = True

# True: dense launches over a scaled cache (unpaged, or pages read a tile ahead as
# scalars) load the next tile's k_scale at the end of a tile and carry it. Loaded inside
# the tile, the scales' first reader comes ~165 instructions after the load, and the
# MMA's epilogue waits on them (7-11% of the FP8 scorer's stall samples, WORKSPACE.md,
# run 303); ahead, ~240 (sm_90 SASS of the CPU cross-lowering, session 70; loaded at
# the top of a tile, the pipeliner moved them between registers instead). Off until a
# GPU run measures it: False builds the same kernels as before the switch existed.
SCALE_PREFETCH = False


# Records of launches whose splits share a query. False: every tile reserves room in
# its rows' buffers with a scalar fetch-and-add, whose answer the tile's stores wait on.
# True: each program stages its records in STAGE_SLOTS slots a query of its own, with
# running offsets as a lone split does, and reserves and copies once a query when the
# stage fills or the loop ends. Witness decode's records pass (WORKSPACE.md, run 93):
# 64 × 64K 980 → 751 µs, 64 × 128K 1895 → 1486, 8 × 128K 276 → 228. The stages take
# programs × block_t × STAGE_SLOTS × 8 bytes (≤ ~35 MB: split launches have ≤ ~1056
# programs, and default tiles ≤ 4 queries).
STAGED_SPLIT_RECORDS = True
STAGE_SLOTS = 1024


def _optional_inputs(p):
    """Names of the inputs a launch passes after (q, w, k, start, end), in order. Only
    those its plan reads: each absent one would be a broadcast launched every call
    (decode: up to 2 µs a step)."""
    thresholded = p.records or p.list_scores
    names = ("scale",) * p.has_scale + ("tau",) * thresholded + ("ids", "n_ids") * p.key_list
    return names + ("pages",) * bool(p.page_size)


def _kernel(q_ref, w_ref, k_ref, start_ref, end_ref, *refs, p):
    names = _optional_inputs(p)
    optional = dict(zip(names, refs[: len(names)], strict=True))
    refs = refs[len(names) :]  # the outputs (and aliased inputs)
    scale_ref, tau_ref, pages_ref = (optional.get(n) for n in ("scale", "tau", "pages"))
    ids_ref, n_ids_ref = optional.get("ids"), optional.get("n_ids")
    bt, bs = p.cfg.block_t, p.cfg.block_s
    i = pl.program_id(0)
    split = pl.program_id(1)
    rows = i * bt + jnp.arange(bt, dtype=jnp.int32)
    row_ok = rows < p.t
    row_safe = jnp.where(row_ok, rows, 0)
    # Rows past T see nothing: start = S, end = 0. Ranges clamped as _checks.clamp_ranges
    # (traced ranges reach the kernel unchecked).
    start = jnp.clip(jnp.where(row_ok, plt.load(start_ref.at[row_safe]), p.s), 0, p.s)
    end = jnp.clip(jnp.where(row_ok, plt.load(end_ref.at[row_safe]), 0), start, p.s)
    zero = jnp.zeros((), q_ref.dtype)  # a typed `other`: Triton cannot cast i32 to fp8
    # The dot's contraction in slices (one unless cfg.dim_chunk asks).
    slices = f32_dots.contraction_slices(p.dim, p.cfg.dim_chunk)
    q_parts = [
        plt.load(q_ref.at[pl.ds(i * bt, bt), :, pl.ds(c, width)], mask=row_ok[:, None, None],
                 other=zero).astype(p.compute).reshape(bt * p.heads, width)
        for c, width in slices
    ]  # fmt: skip
    w = plt.load(w_ref.at[pl.ds(i * bt, bt), :], mask=row_ok[:, None], other=0.0)
    slice_dims = [jnp.arange(c, c + width, dtype=jnp.int32) for c, width in slices]

    # A key range's tiles over pages that hold whole tiles read one page-table entry a
    # tile, a scalar, not one a key; pages a whole fraction of a tile read the tile's
    # bs / P entries as scalars. FP8 64 × 64K (WORKSPACE.md, runs 293-294 and 298; dense
    # 220 µs): P 64 300 → 242, P 32 295 → 249, P 16 301 → 262. Other sizes (P 20) read an
    # entry a key.
    scalar_pages = (
        bool(p.page_size) and not p.key_list and (p.page_size % bs == 0 or bs % p.page_size == 0)
    )
    entries_a_tile = max(bs // p.page_size, 1) if scalar_pages else 0

    def tile_pages(j, ids=None):
        """Key tile j's physical pages (-1: none): [BS], or a tuple of the tile's
        entries as scalars when pages hold whole tiles or whole fractions of one. Tiles
        past the last read the last entry (never used). ``ids``: the tile's ids when
        already loaded (a key list's are a load)."""
        if scalar_pages:
            first, last = j * bs // p.page_size, p.s // p.page_size - 1
            return tuple(
                plt.load(pages_ref.at[jnp.minimum(first + e, last)]) for e in range(entries_a_tile)
            )
        ids = tile_ids(j) if ids is None else ids
        ok = (ids >= 0) & (ids < p.s)
        return plt.load(pages_ref.at[jnp.where(ok, ids, 0) // p.page_size], mask=ok, other=-1)

    def tile_rows(j, page=None):
        """Key tile j -> (ids [BS] (-1 or ≥ S: no key), rows of k [BS], row readable
        [BS]). ``page``: the tile's pages when already loaded (paged caches)."""
        ids = tile_ids(j)
        ok = (ids >= 0) & (ids < p.s)
        safe = jnp.where(ok, ids, 0)
        if p.page_size:
            page = tile_pages(j, ids) if page is None else page
            lane = jnp.arange(bs, dtype=jnp.int32)
            if entries_a_tile == 1:  # the tile's first row, then consecutive rows
                page = page[0]
                first_row = jnp.where(page >= 0, page * p.page_size + j * bs % p.page_size, 0)
                row = first_row + lane  # (a scalar plus a range: known contiguous)
                ok = ok & (page >= 0)
            elif entries_a_tile:  # each key's entry among the tile's, then its offset
                entries, page = page, page[0]
                for e in range(1, entries_a_tile):
                    page = jnp.where(lane >= e * p.page_size, entries[e], page)
                ok = ok & (page >= 0)
                row = jnp.where(ok, page * p.page_size + lane % p.page_size, 0)
            else:
                ok = ok & (page >= 0)
                row = jnp.where(ok, page * p.page_size + safe % p.page_size, 0)
        else:
            row = safe
        return ids, row, ok

    def tile_scale(j, page=None):
        """Key tile j's k_scale [BS] (0 where no key)."""
        _, row, ok = tile_rows(j, page)
        return plt.load(scale_ref.at[row], mask=ok, other=0.0)

    def tile_scores(j, page=None, scale=None):
        """Key tile j -> (ids [BS] (-1 or ≥ S: no key), scores [BT, BS], visible
        [BT, BS]). ``page``: the tile's pages when already loaded (paged caches);
        ``scale``: its k_scale when already loaded (``tile_scale``)."""
        ids, row, ok = tile_rows(j, page)
        k_parts = [
            plt.load(
                k_ref.at[row[:, None], dims[None, :]],
                mask=ok[:, None],
                other=jnp.zeros((), k_ref.dtype),
            )
            for dims in slice_dims
        ]
        if p.has_scale and scale is None:
            scale = plt.load(scale_ref.at[row], mask=ok, other=0.0)
        k_parts = [part.astype(p.compute) for part in k_parts]
        scores = _score_tile(q_parts, w, k_parts, scale, block_t=bt, heads=p.heads)
        visible = ok[None, :] & (ids[None, :] >= start[:, None]) & (ids[None, :] < end[:, None])
        return ids, scores, visible

    if p.key_list:
        # Only the tiles holding the block's listed ids (lists are filled from the front).
        n_listed = jnp.minimum(plt.load(n_ids_ref.at[i]), p.list_len)
        first, last = 0, (n_listed + bs - 1) // bs

        def tile_ids(j):
            return plt.load(ids_ref.at[i, pl.ds(j * bs, bs)])
    else:
        # Only the key tiles some query of this block can see (causal: about half).
        lo = jnp.min(jnp.where(row_ok, start, p.s))
        hi = jnp.max(jnp.where(row_ok & (end > start), end, 0))
        first, last = tile_span(lo, hi, bs)

        def tile_ids(j):
            return j * bs + jnp.arange(bs, dtype=jnp.int32)

    begin, stop = split_span(first, last, p.splits, split)

    if p.records or p.list_scores:
        tau = jnp.where(row_ok, plt.load(tau_ref.at[row_safe]), codes_lib.EMPTY_CODE)
    if p.list_scores:
        out_ref, count_ref = refs

        def list_body(j, kept):
            _, scores, visible = tile_scores(j)
            _, keep = _at_least(scores, visible, tau)
            pos = j * bs + jnp.arange(bs, dtype=jnp.int32)
            plt.store(
                out_ref.at[rows[:, None], pos[None, :]],
                jnp.where(visible, scores, _NEG_INF),
                mask=jnp.broadcast_to(row_ok[:, None], (bt, bs)),
            )
            return kept + jnp.sum(keep.astype(jnp.int32), axis=1)

        kept = jax.lax.fori_loop(begin, stop, list_body, jnp.zeros((bt,), jnp.int32))
        slot = jnp.where(row_ok, split * p.t + rows, p.splits * p.t)
        plt.store(count_ref.at[slot], kept, mask=row_ok)
        return

    if p.records:
        if p.stage:
            _staged_records(tile_scores, refs[-5:], tau, begin, stop, p)
            return
        codes_ref, rec_ids_ref, count_ref = refs[-3:]  # (aliased initial values come first)
        row_iota = jnp.arange(bt, dtype=jnp.int32)[:, None]

        def body(j, written):
            ids, code, keep = _tile_records(tile_scores, tau, j)
            keep_i = keep.astype(jnp.int32)
            counts = jnp.sum(keep_i, axis=1)  # [BT]
            if p.splits == 1:
                # This program owns its queries' records: a running offset, and the
                # records come out in ascending id order.
                base = written
            else:
                # Splits share a query: reserve room with a fetch-and-add. Order is then
                # arbitrary. Only rows that keep something: each fetch-and-add's answer
                # gates the tile's stores, and decode blocks pair sequences whose keys
                # are disjoint (or a masked row), so about half the rows of a tile keep
                # nothing.
                base = jnp.zeros((bt,), jnp.int32)
                for r in range(bt):
                    n_r = jnp.sum(jnp.where(row_iota[:, 0] == r, counts, 0))
                    t_r = jnp.minimum(i * bt + r, p.t - 1).astype(jnp.int32)
                    old = _reserve(count_ref, t_r, n_r)
                    base = jnp.where(row_iota[:, 0] == r, old, base)
            pos = base[:, None] + jnp.cumsum(keep_i, axis=1) - 1
            store = keep & (pos < p.cap)
            # Lanes not stored point past the end: interpret mode drops them, the GPU masks them.
            dst = jnp.where(store, rows[:, None] * p.cap + pos, p.t * p.cap)
            plt.store(codes_ref.at[dst], code, mask=store)
            plt.store(rec_ids_ref.at[dst], jnp.broadcast_to(ids[None, :], (bt, bs)), mask=store)
            return written + counts

        written = jax.lax.fori_loop(begin, stop, body, jnp.zeros((bt,), jnp.int32))
        if p.splits == 1:
            plt.store(count_ref.at[jnp.where(row_ok, rows, p.t)], written, mask=row_ok)
        return

    if p.report:  # the exhaustive report (jsparse.ops.indexer.report), by first splits
        out_ref, *report_refs = refs[-6:]
        pl.when(split == 0)(lambda: store_report(report_refs, rows, row_ok, end - start, p.t))
    else:
        out_ref = refs[-1]  # (the fill launch also sees the aliased scores before it)

    # (Key ranges only: a list's tile past its last would be read out of bounds.)
    prefetch = bool(p.page_size) and not p.key_list and PREFETCH_PAGES
    # (Scales ahead need the next tile's rows early: unpaged, or entries loaded ahead.)
    scale_ahead = (
        p.has_scale and not p.key_list and SCALE_PREFETCH
        and (not p.page_size or (prefetch and scalar_pages))
    )  # fmt: skip

    def dense_body(j, ahead):
        pages, scale = ahead
        if prefetch and scalar_pages:  # tile j + 1's entries, before this tile's loads
            current, pages = pages, tile_pages(j + 1)
            ids, scores, visible = tile_scores(j, current, scale)
        elif prefetch:  # tile j + 1's entries, after this tile's loads and dot
            ids, scores, visible = tile_scores(j, pages)
            pages = tile_pages(j + 1)
        else:
            ids, scores, visible = tile_scores(j, scale=scale)
        scores = jnp.where(visible, scores, _NEG_INF)
        if p.row_cols:
            col = ids[None, :] - start[:, None]
            in_bounds = row_ok[:, None] & (col >= 0) & (col < p.row_cols)
            col = jnp.where(in_bounds, col, p.row_cols)
        else:
            in_bounds = row_ok[:, None] & (ids[None, :] < p.s)
            col = jnp.where(in_bounds, ids[None, :], p.s)
        plt.store(out_ref.at[rows[:, None], col], scores, mask=in_bounds)
        if scale_ahead:  # tile j + 1's, last (see SCALE_PREFETCH)
            scale = tile_scale(j + 1, pages if prefetch else None)
        return pages, scale

    if not p.fill_only:
        pages = tile_pages(begin) if prefetch else None
        scale = tile_scale(begin, pages) if scale_ahead else None
        jax.lax.fori_loop(begin, stop, dense_body, (pages, scale))
    else:
        # Tiles outside [first, last) are invisible to every query of the block.
        n_all = (p.s + bs - 1) // bs
        outside = n_all - (last - first)
        per = (outside + p.splits - 1) // p.splits

        def fill_body(j, carry):
            tile = jnp.where(j < first, j, j + (last - first))
            ids = tile * bs + jnp.arange(bs, dtype=jnp.int32)
            in_bounds = row_ok[:, None] & (ids[None, :] < p.s)
            col = jnp.where(in_bounds, ids[None, :], p.s)
            plt.store(
                out_ref.at[rows[:, None], col],
                jnp.full((bt, bs), _NEG_INF, jnp.float32),
                mask=in_bounds,
            )
            return carry

        jax.lax.fori_loop(split * per, jnp.minimum((split + 1) * per, outside), fill_body, 0)


def _reserve(count_ref, t, n):
    """Scalar fetch-and-add of n records to query t's count (vector int atomics are
    unreliable on this backend), only when n > 0; returns the old count (0 if n = 0)."""
    return jax.lax.cond(
        n > 0,
        lambda: plt.atomic_add(count_ref, (t,), n),
        lambda: n * 0,  # a traced zero: a literal cannot be yielded
    )


def _at_least(scores, visible, tau):
    """Score codes [BT, BS] and which scores count against τ (visible, code ≥ τ): the
    records a records launch writes, the count a list-scores launch reports."""
    code = codes_lib.score_code(scores)
    return code, visible & (code >= tau[:, None])


def _tile_records(tile_scores, tau, j):
    """Key tile j's ids, score codes and which of them are records (≥ τ, visible)."""
    ids, scores, visible = tile_scores(j)
    code, keep = _at_least(scores, visible, tau)
    return ids, code, keep


def _staged_records(tile_scores, out_refs, tau, begin, stop, p):
    """The records of a split program's tiles [begin, stop), staged (``p.stage`` slots a
    query, running offsets), then reserved in each query's buffer with one fetch-and-add
    and copied there: when a tile would overfill the stage, and at the end. The stage's
    slots are written and read by different threads of the program, so a barrier
    separates the two (and the copy's reads from the next stores); interpret mode runs
    a program's operations in order and needs none."""
    codes_ref, rec_ids_ref, count_ref, stage_codes_ref, stage_ids_ref = out_refs
    bt, bs = p.cfg.block_t, p.cfg.block_s
    i = pl.program_id(0)
    program = i * p.splits + pl.program_id(1)
    lane = jnp.arange(bt, dtype=jnp.int32)
    stage_first = (program * bt + lane) * p.stage  # [BT]: each query's slots
    stage_trash = stage_codes_ref.shape[0]  # one past the last slot

    def barrier():
        if not p.interpret:
            plt.debug_barrier()

    def flush(staged):  # staged [BT] → zeros
        barrier()
        for r in range(bt):
            n_r = jnp.sum(jnp.where(lane == r, staged, 0))
            t_r = jnp.minimum(i * bt + r, p.t - 1).astype(jnp.int32)
            old = _reserve(count_ref, t_r, n_r)
            n_copy = jnp.clip(p.cap - old, 0, n_r)  # the count goes on past cap: overflow
            src_first = (program * bt + r) * p.stage

            def copy(c, carry, t_r=t_r, old=old, n_copy=n_copy, src_first=src_first):
                k = c * bs + jnp.arange(bs, dtype=jnp.int32)
                ok = k < n_copy
                src = src_first + jnp.where(ok, k, 0)
                vc = plt.load(stage_codes_ref.at[src], mask=ok, other=codes_lib.EMPTY_CODE)
                vi = plt.load(stage_ids_ref.at[src], mask=ok, other=-1)
                dst = jnp.where(ok, t_r * p.cap + old + k, p.t * p.cap)
                plt.store(codes_ref.at[dst], vc, mask=ok)
                plt.store(rec_ids_ref.at[dst], vi, mask=ok)
                return carry

            jax.lax.fori_loop(0, (n_copy + bs - 1) // bs, copy, 0)
        barrier()
        return staged * 0

    def body(j, staged):
        ids, code, keep = _tile_records(tile_scores, tau, j)
        keep_i = keep.astype(jnp.int32)
        counts = jnp.sum(keep_i, axis=1)
        staged = jax.lax.cond(jnp.max(staged + counts) > p.stage, flush, lambda s: s, staged)
        pos = staged[:, None] + jnp.cumsum(keep_i, axis=1) - 1  # < stage: counts ≤ BS ≤ stage
        dst = jnp.where(keep, stage_first[:, None] + pos, stage_trash)
        plt.store(stage_codes_ref.at[dst], code, mask=keep)
        plt.store(stage_ids_ref.at[dst], jnp.broadcast_to(ids[None, :], (bt, bs)), mask=keep)
        return staged + counts

    flush(jax.lax.fori_loop(begin, stop, body, jnp.zeros((bt,), jnp.int32)))


def _pad_heads_dims(q, weights, k, block_t):
    """Pads H and D to powers of two, BT·H and D to ≥ 16 (the smallest tensor-core tile).

    Padded heads have weight 0 and padded dims are zero, so no score changes.
    """
    _, h, d = q.shape
    hp = next_pow2(h, max(1, 16 // block_t))
    dp = next_pow2(d, 16)
    if hp != h:
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, hp - h)))
    if dp != d:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, dp - d)))
        k = jnp.pad(k, ((0, 0), (0, dp - d)))
    return q, weights, k


def _splits_for(q, k, s, key_ids, cfg):
    cfg = cfg or config_for(q, k)
    n_tb = -(-q.shape[0] // cfg.block_t)
    n = s if key_ids is None else key_ids.shape[1]
    return _default_splits(n_tb, -(-n // cfg.block_s))


# Programs a launch aims at, per SM (:func:`jsparse.backend.sm_count`; H200: 132).
# Decode launches of at most SMALL_LAUNCH_BLOCKS query blocks split their keys into half
# as many: their programs are short, and two per SM beat four at 1 and 8 queries × 64K
# and 128K, bf16 and fp8, while 64 queries (16-32 query blocks) lost 25% at two
# (WORKSPACE.md runs 61-62).
PROGRAMS_PER_SM = 4
SMALL_LAUNCH_BLOCKS = 4


def _default_splits(n_query_blocks: int, n_key_tiles: int) -> int:
    # decode (few queries) splits the key range instead of the queries
    target = PROGRAMS_PER_SM * backend.sm_count()
    target //= 2 if n_query_blocks <= SMALL_LAUNCH_BLOCKS else 1
    return int(max(1, min(n_key_tiles, -(-target // n_query_blocks))))


# Programs a batch launch (one query a block, each over keys of its own) aims at beyond
# SMALL_LAUNCH_BLOCKS sequences, per SM: eight, more than PROGRAMS_PER_SM's four. At 64
# sequences of 64K and 128K keys, 1056 programs beat 528 by 8% (bf16) and 12-15% (FP8,
# widened in registers: its loads wait on the conversion, so more programs keep more
# loads in flight), and 264 were no better than 528 (WORKSPACE.md, run 117b). FP8 keys
# gain again at sixteen an SM where each program keeps BATCH_FP8_MIN_TILES tiles or more:
# 64 × 64K / 128K 213 → 203 / 424 → 388 µs, but 8 × 64K / 128K (4 / 8 tiles a program)
# 31.0 → 33.7 / 55.6 → 57.1; bf16 lost at 64 sequences (run 118).
BATCH_PROGRAMS_PER_SM = 8
BATCH_FP8_PROGRAMS_PER_SM = 16
BATCH_FP8_MIN_TILES = 16


def batch_splits(num_sequences: int, s_max: int, cfg: ScorerConfig, fp8_keys: bool = False) -> int:
    """Key splits of each sequence's range in a batch launch (see BATCH_PROGRAMS_PER_SM);
    a few sequences split as decode does. ``fp8_keys``: FP8 keys, widened in registers."""
    n_tiles = -(-s_max // cfg.block_s)
    if num_sequences <= SMALL_LAUNCH_BLOCKS:
        return _default_splits(num_sequences, n_tiles)

    def splits(per_sm):
        return int(max(1, min(n_tiles, -(-per_sm * backend.sm_count() // num_sequences))))

    if fp8_keys and n_tiles // splits(BATCH_FP8_PROGRAMS_PER_SM) >= BATCH_FP8_MIN_TILES:
        return splits(BATCH_FP8_PROGRAMS_PER_SM)
    return splits(BATCH_PROGRAMS_PER_SM)


def _num_keys(k, page_table, page_size):
    """Key ids of a launch: rows of ``k``, or the page table's virtual slots."""
    return k.shape[0] if page_table is None else page_table.shape[0] * page_size


def _launch(
    q, weights, k, k_scale, start, end, *,
    tau_codes=None, key_ids=None, key_counts=None, records_cap=None, fill=False, cfg=None,
    splits=None, page_table=None, page_size=0, shared_keys=True, report=False, row_cols=0,
    list_scores=False,
):  # fmt: skip
    """One scorer launch. ``page_table`` [n_pages] int32 (-1: no page) with ``page_size``
    P: key ids run over n_pages·P virtual slots, id i stored at row
    page_table[i // P]·P + i % P of ``k`` (and of ``k_scale``). ``shared_keys`` False:
    each query sees keys of its own, which are then never widened in memory (see
    :func:`_widen_in_memory`); a paged pool is always so. ``report`` (dense, no fill):
    also returns the exhaustive report's five [T] rows after the scores. ``row_cols`` > 0
    (dense, no fill): scores as [T, row_cols], query t's key i at column i - start[t].
    ``list_scores`` (key lists, no records): see :func:`score_list_triton`."""
    backend.check_triton_offsets("indexer scorer", k=k)
    t, _, _ = q.shape
    if report and (records_cap is not None or fill):
        raise ValueError("_launch: report is for a dense launch without fill")
    if row_cols and (records_cap is not None or fill):
        raise ValueError("_launch: row_cols is for a dense launch without fill")
    if list_scores and (key_ids is None or records_cap is not None or fill or report or row_cols):
        raise ValueError("_launch: list_scores is for a key-list launch of plain scores")
    s = _num_keys(k, page_table, page_size)
    cfg = cfg or config_for(q, k)
    cdt = compute_dtype(q.dtype, k.dtype, cfg.fp8_dot)
    if f32_dots.tensor_cores(cdt):  # a given config too: refused here, not in the compiler
        need = f32_tensor_core_bytes(cfg, q.shape[1], q.shape[2])
        f32_dots.fits("indexer scorer", need, f"H {q.shape[1]}, D {q.shape[2]}, {cfg}")
    shared_keys = shared_keys and page_table is None
    if _widen_in_memory(t, q.dtype, k.dtype, cdt, shared_keys=shared_keys):
        q, k = q.astype(cdt), k.astype(cdt)
    q, weights, k = _pad_heads_dims(q, weights, k, cfg.block_t)
    hp, dp = q.shape[1], q.shape[2]
    n_tb = -(-t // cfg.block_t)
    if key_ids is None:
        list_len, ids, n_ids = 0, None, None
        n_tiles = -(-s // cfg.block_s)
    else:
        list_len = -(-key_ids.shape[1] // cfg.block_s) * cfg.block_s
        ids = jnp.pad(key_ids, ((0, 0), (0, list_len - key_ids.shape[1])), constant_values=-1)
        n_tiles = list_len // cfg.block_s
        if key_counts is None:
            n_ids = jnp.full((ids.shape[0],), list_len, jnp.int32)
        else:
            n_ids = key_counts.astype(jnp.int32)
    splits = splits or _default_splits(n_tb, n_tiles)
    records = records_cap is not None
    stage = max(STAGE_SLOTS, cfg.block_s) if records and splits > 1 and STAGED_SPLIT_RECORDS else 0
    tau = tau_codes
    if list_scores and tau is None:
        tau = jnp.full((t,), codes_lib.EMPTY_CODE, jnp.int32)  # count every visible key
    elif records and tau is None:
        tau = jnp.zeros((t,), jnp.int32)
    p = _Plan(
        t=t, s=s, heads=hp, dim=dp, cfg=cfg, compute=cdt, key_list=key_ids is not None,
        list_len=list_len, records=records, cap=records_cap or 0, splits=splits, fill_only=False,
        interpret=backend.is_interpret(), page_size=page_size if page_table is not None else 0,
        has_scale=k_scale is not None, report=report, stage=stage, row_cols=row_cols,
        list_scores=list_scores,
    )  # fmt: skip
    pages = None if page_table is None else page_table.astype(jnp.int32)
    given = dict(scale=k_scale, tau=tau, ids=ids, n_ids=n_ids, pages=pages)
    if records:
        out_shape = (
            jax.ShapeDtypeStruct((t * p.cap,), jnp.int32),
            jax.ShapeDtypeStruct((t * p.cap,), jnp.int32),
            jax.ShapeDtypeStruct((t,), jnp.int32),
        )
        initial = (
            jnp.full((t * p.cap,), codes_lib.EMPTY_CODE, jnp.int32),
            jnp.full((t * p.cap,), -1, jnp.int32),
            jnp.zeros((t,), jnp.int32),
        )
        if p.stage:  # the programs' stages: no init (nothing reads a slot it did not write)
            stage_slots = n_tb * splits * cfg.block_t * p.stage
            out_shape += (jax.ShapeDtypeStruct((stage_slots,), jnp.int32),) * 2
    elif list_scores:
        out_shape = (
            jax.ShapeDtypeStruct((t, list_len), jnp.float32),
            jax.ShapeDtypeStruct((splits * t,), jnp.int32),
        )
        initial = ()
    else:
        out_shape = (jax.ShapeDtypeStruct((t, row_cols or s), jnp.float32),)
        initial = ()
        if report:
            out_shape += report_shapes(t)
    inputs = (q, weights, k, start, end, *(given[n] for n in _optional_inputs(p)))

    def call(plan, initial, name):
        return pallas_call(
            functools.partial(_kernel, p=plan),
            grid=(n_tb, splits),
            out_shape=out_shape,
            input_output_aliases={len(inputs) + j: j for j in range(len(initial))},
            compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            interpret=plan.interpret,
            name=name,
        )(*inputs, *initial)

    if records:
        return call(p, initial, "jsparse_indexer_records")[:3]
    if list_scores:
        return call(p, (), "jsparse_indexer_list_scores")
    outs = call(p, (), "jsparse_indexer_scores")
    if fill:
        outs = call(dataclasses.replace(p, fill_only=True), outs, "jsparse_indexer_fill")
    return outs


@backend.jit_per_mode(static_argnames=("cfg",))
def indexer_scores_triton(q, weights, k, k_scale, start, end, *, cfg=None):
    """Dense [T, S] scores with -inf where not visible (the public ``indexer_scores``)."""
    (scores,) = _launch(q, weights, k, k_scale, start, end, fill=True, cfg=cfg)
    return scores


def score_records_triton(
    q, weights, k, k_scale, start, end, tau_codes, capacity, *, key_ids=None, key_counts=None,
    cfg=None, page_table=None, page_size=0, shared_keys=True, splits=None,
):  # fmt: skip
    """Records (code, key id) of every visible score with code ≥ ``tau_codes[t]``.

    Keys come from the whole visible range, or from ``key_ids`` [ceil(T/BT), N] (one id
    list per query block; -1 = unused). With ``key_counts`` [ceil(T/BT)], block b's ids
    are its first ``key_counts[b]`` entries and only those tiles are visited (survivor
    lists of the certified methods). Returns codes and ids [T, capacity], the true
    count per query, which may exceed ``capacity`` (overflow: records past the capacity
    are not stored), and whether each row's records are in ascending id order (one
    program per query block: the key range or list is not split). ``page_table`` and
    ``page_size``: a paged key cache (see :func:`_launch`); ids are virtual slots.
    ``shared_keys``: see :func:`_launch`. ``splits``: key splits of each query block's
    range (default: the rule for the launch's shape).
    """
    s = _num_keys(k, page_table, page_size)
    splits = splits or _splits_for(q, k, s, key_ids, cfg)
    codes, ids, counts = _launch(
        q, weights, k, k_scale, start, end,
        tau_codes=tau_codes, key_ids=key_ids, key_counts=key_counts, records_cap=capacity,
        cfg=cfg, splits=splits, page_table=page_table, page_size=page_size,
        shared_keys=shared_keys,
    )  # fmt: skip
    t = q.shape[0]
    return codes.reshape(t, capacity), ids.reshape(t, capacity), counts, splits == 1


def score_list_triton(
    q, weights, k, k_scale, start, end, key_ids, *, key_counts=None, tau_codes=None, cfg=None,
    splits=None,
):  # fmt: skip
    """Scores of listed keys by list position, and each query's count of them ≥ τ.

    ``key_ids`` [ceil(T/BT), N]: one id list per query block (-1 = no key); with
    ``key_counts``, block b's ids are its first ``key_counts[b]`` entries and only those
    tiles are visited. Returns (scores [T, N'] f32 with N' = N rounded up to the key
    tile: query t's score of its block's j-th listed key at column j, -inf where t does
    not see that key; columns of tiles past a block's count are not written; kept [T]:
    visible scores with code ≥ ``tau_codes[t]``, every visible one by default).

    What the certified methods' refinement and seeds write instead of records: the same
    scores (one scorer), without records' per-tile prefix sum and scattered store.
    """
    splits = splits or _splits_for(q, k, k.shape[0], key_ids, cfg)
    scores, kept = _launch(
        q, weights, k, k_scale, start, end, tau_codes=tau_codes, key_ids=key_ids,
        key_counts=key_counts, cfg=cfg, splits=splits, list_scores=True,
    )  # fmt: skip
    return scores, kept.reshape(splits, q.shape[0]).sum(axis=0)


def topk_base_triton(q, weights, k, top_k, k_scale, start, end, seeds, sort=True):
    from jsparse.ops.indexer import methods  # methods builds on this module

    del seeds
    return methods.topk_base(q, weights, k, top_k, k_scale, start, end, sort=sort)


def topk_full_triton(q, weights, k, top_k, k_scale, start, end, seeds, sort=True):
    from jsparse.ops.indexer import methods

    args = (q, weights, k, top_k, k_scale, start, end)
    if seeds is None or isinstance(seeds, int):
        return methods.topk_full(*args, n_seeds=seeds, sort=sort)
    return methods.topk_full(*args, seeds, sort=sort)
