"""The dense indexer scorer as a Pallas Mosaic GPU kernel (Hopper: TMA + wgmma).

    s[t, i] = k_scale[i] · Σ_h w[t, h] · relu(q[t, h] · k[i])          (MATH.md §1.1)

Why a second GPU kernel: the Triton scorer widened fp8 keys to f16 in registers, which
needs a register load of every key tile and so gives up the asynchronous global → shared
copy; on an H200 that fp8 path reached 36.5% of XLA's fp8 matmul rate (since then the
Triton scorer widens large launches once in memory and runs at 48%; this kernel's 51-57%
is still ahead, WORKSPACE.md runs 15 and 45). Here key tiles stream through shared
memory by TMA and feed the tensor cores directly (wgmma reads both operands from shared
memory), fp8 × fp8 natively or bf16 × bf16, into an f32 accumulator (Hopper's fp8 MMA
keeps fewer bits while it accumulates: scores round differently from the Triton
kernel's, which is why this is a separate, opt-in scorer).

Differences between compiled and interpreted runs, both forced by jax 0.10.2's Mosaic GPU
interpreter and both value-preserving: ``layout_cast`` is skipped (no interpreter rule),
and each block's queries arrive pre-transposed instead of as a transposed view (the
interpreter's wgmma cannot apply one). The cross-lowering test covers the compiled path.

Tiling (one CTA = one warpgroup = one block of BT queries × one run of key tiles; a
block's tiles are split over several CTAs when there are few blocks, as in decode):

    queries  q_smem [BT·H, D]     loaded once per CTA by TMA (rows t·H + h of q)
    keys     k_smem [BS, D]       one tile per pipeline step, multi-buffered TMA
    logits   acc    [BS, BT·H]    wgmma(k_smem, q_smemᵀ), f32 accumulator, K = D
    scores   [BT, BS]             relu, × w (per column), Σ over each query's H columns,
                                  × k_scale (per row), -inf where not visible

* Keys are the M side of the wgmma and query heads the N side (not the other way round):
  the sum over heads is then a reduction along the accumulator's minor axis, which a
  warpgroup does inside each thread plus a few lane shuffles, while summing over rows
  would need shared-memory traffic between warps. M = BS = 64·k fits one warpgroup's
  wgmma; N = BT·H ≤ 256 is the wgmma N limit.
* Both operands are K-major in shared memory (D contiguous in rows of k and of q), which
  fp8 wgmma requires; ``q_smem`` is passed transposed as a view, no data moves.
* The head reduction slices the accumulator at multiples of H columns, so H is padded
  (zero queries, zero weights) to a multiple of 8, the wgmma register tile width, and
  BT·H to a multiple of 32 (one block's weights must be a whole 128-byte copy).
* Causal tile skipping: a small Triton launch before the kernel (``_prologue``)
  computes, per query block, the key tiles some query of the block can see,
  ``[first, last)``, from the clamped ranges; the pipeline's grid is that many steps
  (a dynamic grid) and the other tiles of the block's rows are written -inf from one
  shared-memory tile of -inf, by TMA, without touching keys.
* Shapes are padded on the host to whole tiles (T to BT, S to BS) so that every TMA box
  is in bounds; padded keys are invisible, padded query rows are sliced away.

Interpret mode (``jsparse.backend.interpret_mode``) runs the kernel on the CPU through
Mosaic GPU's interpreter, which simulates shared memory, barriers and TMA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import mosaic_kernel, pallas_call
from jsparse.ops.indexer import methods
from jsparse.ops.indexer.report import report_shapes, store_report

_NEG_INF = float("-inf")
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_SUPPORTED = (jnp.dtype(jnp.bfloat16), _FP8)
# Per-block metadata row: first tile, number of visible tiles, BT starts, BT ends, padded
# to 32 int32: Mosaic GPU copies a multiple of 128 bytes (one byte per warpgroup thread).
_META = 32


@dataclasses.dataclass(frozen=True)
class MosaicScorerConfig:
    """Tiles of the Mosaic GPU scorer."""

    block_t: int = 2  # queries per CTA: N = block_t·H of the wgmma (≤ 256)
    block_s: int = 128  # keys per tile: M of the wgmma (a multiple of 64)
    max_concurrent_steps: int = 3  # key tiles in flight through shared memory
    # CTAs a query block's key tiles are split over (None: :func:`key_splits` decides; a
    # few query blocks alone, as in decode, would leave most SMs idle)
    key_splits: int | None = None

    def __post_init__(self):
        if self.block_t < 1 or self.block_t > (_META - 2) // 2:
            raise ValueError(f"MosaicScorerConfig.block_t must be in [1, 15], got {self.block_t}")
        if self.block_s < 64 or self.block_s % 64:
            raise ValueError(
                f"MosaicScorerConfig.block_s must be a positive multiple of 64, got {self.block_s}"
            )
        if self.max_concurrent_steps < 1:
            raise ValueError(
                "MosaicScorerConfig.max_concurrent_steps must be ≥ 1, "
                f"got {self.max_concurrent_steps}"
            )
        if self.key_splits is not None and self.key_splits < 1:
            raise ValueError(f"MosaicScorerConfig.key_splits must be ≥ 1, got {self.key_splits}")


def default_config(heads: int, num_queries: int) -> MosaicScorerConfig:
    """Two queries per CTA at H=64 (N = 128), one at H > 128 (N ≤ 256) or for a single
    query (a second, padded row would double the dot for nothing)."""
    return MosaicScorerConfig(block_t=max(1, min(2, 256 // max(heads, 1), num_queries)))


# CTAs a launch that splits key tiles aims at (H200: 132 SMs). Up to SMALL_LAUNCH_BLOCKS query
# blocks (1-8 queries): one wave, as many CTAs as fit the SMs by shared memory, at most
# two an SM: bf16 CTAs (~120-136 KB) fit one, and one query × 64K scored in 7.4 µs at
# 132 CTAs against 9.5 at 264, 8 queries 23.9 against 26.6; fp8 CTAs (~63-72 KB) fit
# two (5.6 µs at 264, 5.8 at 132). More blocks: 2 × 132, as before: 64 queries bf16 ran
# 229 µs at 288 CTAs and 264 at 160 (runs 114-116).
MAX_CTAS_PER_SM = 2
SMALL_LAUNCH_BLOCKS = 4
_SMEM_PER_SM = 228 * 1024


def key_splits(n_blocks: int, n_tiles: int, cfg: MosaicScorerConfig, smem_bytes: int) -> int:
    """CTAs per query block: the config's, or enough for the launch's target (above)."""
    if cfg.key_splits is not None:
        return max(1, min(cfg.key_splits, n_tiles))
    per_sm = MAX_CTAS_PER_SM
    if n_blocks <= SMALL_LAUNCH_BLOCKS:
        per_sm = max(1, min(MAX_CTAS_PER_SM, _SMEM_PER_SM // (smem_bytes + 1024)))
    return max(1, min(n_tiles, -(-backend.sm_count() * per_sm // n_blocks)))


def interpret_params():
    """Mosaic GPU interpret-mode parameters (public in jax ≥ 0.11.1, private before)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


_SMEM_LIMIT = 227 * 1024  # per CTA on sm_90


def _smem_bytes(n, d, itemsize, cfg):
    """Shared memory of one CTA: queries, key/scale tiles, weights, ranges, outputs."""
    bt, bs, steps = cfg.block_t, cfg.block_s, cfg.max_concurrent_steps
    buffers = [n * d * itemsize, steps * bs * d * itemsize, steps * bs * 4, n * 4, _META * 4]
    buffers += [2 * bt * bs * 4, bt * bs * 4]
    return sum(-(-b // 1024) * 1024 for b in buffers) + 1024  # 1 KiB-aligned, + barriers


def check_supported(q_shape, q_dtype, k_dtype, cfg: MosaicScorerConfig, extra_smem=0) -> None:
    """Raises ``NotImplementedError`` for valid inputs this kernel does not handle.
    ``extra_smem``: bytes of shared memory a CTA needs beside the tiles (a page table row)."""
    q_dtype, k_dtype = jnp.dtype(q_dtype), jnp.dtype(k_dtype)
    if q_dtype not in _SUPPORTED or k_dtype != q_dtype:
        raise NotImplementedError(
            f"mosaic indexer: q and k must both be bfloat16 or both float8_e4m3fn, got "
            f"q {q_dtype.name}, k {k_dtype.name} (use implementation='triton')"
        )
    _, h, d = q_shape
    if d % 64:
        raise NotImplementedError(
            f"mosaic indexer: head dim D = {d} must be a multiple of 64 (one 128-byte "
            "swizzled row of fp8, two of bf16)"
        )
    n = cfg.block_t * padded_heads(h, cfg.block_t)
    smem = _smem_bytes(n, d, q_dtype.itemsize, cfg) + extra_smem
    if smem > _SMEM_LIMIT:
        raise NotImplementedError(
            f"mosaic indexer: tiles need {smem} bytes of shared memory (BT·H = {n}, D = {d}, "
            f"BS = {cfg.block_s}, {cfg.max_concurrent_steps} steps, {extra_smem} more); an "
            f"H200 CTA has {_SMEM_LIMIT}: lower max_concurrent_steps or block_s"
        )
    if n > 256:
        raise NotImplementedError(
            f"mosaic indexer: block_t·H = {cfg.block_t}·{h} (padded: {n}) exceeds the wgmma "
            "N tile (256); use block_t = 1 or implementation='triton'"
        )


def _kernel(*refs, cfg, heads, splits, seq_tiles, page_tiles, has_scale, interpret):
    """``refs``: q, w, k, (k_scale,) meta, (pages,) out, scratch. ``seq_tiles`` > 0: a
    batch of sequences, block b's keys the ``seq_tiles`` tiles from tile b·seq_tiles of
    ``k`` (its output row's key ids are positions in its own sequence); 0: keys shared.
    ``page_tiles`` > 0: a batch read from a page pool instead, block b's page table row
    in ``pages`` (-1: no page), each page ``page_tiles`` tiles of ``k``."""
    q_ref, w_ref, k_ref, *refs = refs
    scale_ref, refs = refs[: int(has_scale)], refs[int(has_scale) :]
    meta_ref, *pages_ref, out_ref, scratch = refs
    q_smem, w_smem, meta_smem, out_smem, fill_smem, barriers, *pages_smem = scratch
    # Register layouts matter only to the compiler; the interpreter has no rule for
    # layout_cast (jax 0.10.2), and it is the identity on values.
    cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
    bt, bs = cfg.block_t, cfg.block_s
    n = bt * heads
    blk = lax.axis_index("blocks")
    split = lax.axis_index("splits")

    # Everything the CTA needs besides keys, once: its query rows, weights and ranges.
    rows = q_smem.shape[0]  # n compiled ([BT·H, D]); D interpreted ([D, BT·H], see _scores)
    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(blk * rows, rows)], q_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(blk * n, n)], w_smem, barriers.at[1])
    plgpu.copy_gmem_to_smem(meta_ref.at[blk], meta_smem, barriers.at[2])
    if page_tiles:
        plgpu.copy_gmem_to_smem(pages_ref[0].at[blk], pages_smem[0], barriers.at[3])
    for i in range(4 if page_tiles else 3):
        plgpu.barrier_wait(barriers.at[i])
    # This CTA's key tiles: [r0, r1), one of ``splits`` equal runs of the row's tiles;
    # the visible ones among them, [first, first + n_visible), stream through the
    # pipeline and the rest are filled with -inf.
    n_tiles = out_ref.shape[1] // bs
    per_split = -(-n_tiles // splits)
    r0 = jnp.minimum(split * per_split, n_tiles)
    r1 = jnp.minimum(r0 + per_split, n_tiles)
    first = jnp.clip(meta_smem[0], r0, r1)
    n_visible = jnp.clip(meta_smem[0] + meta_smem[1], r0, r1) - first
    starts = [meta_smem[2 + b] for b in range(bt)]
    ends = [meta_smem[2 + bt + b] for b in range(bt)]

    # [n] weights of the accumulator's columns (query b, head h at column b·H + h).
    w_cols = cast(w_smem[...], plgpu.Layout.WGMMA.reduce(0))
    w_tile = lax.broadcast_in_dim(w_cols, (bs, n), (1,))  # [BS, BT·H]

    key_base = blk * seq_tiles  # the block's sequence, in tiles of k (0: shared keys)

    def page_of(tile):  # the block's page holding its tile (-1: none)
        page = tile // page_tiles
        width = pages_smem[0].shape[1]  # the row is held as [R, width]
        return pages_smem[0][page // width, page % width]

    def key_tile(j):  # the row of tiles of k holding the j-th visible tile
        tile = first + j
        if page_tiles:  # an unallocated page reads page 0, and its scores are -inf
            return jnp.maximum(page_of(tile), 0) * page_tiles + tile % page_tiles
        return key_base + tile

    def step(indices, k_smem, *scale_smem):
        (j,) = indices
        tile = first + j
        slot = lax.rem(j, 2)

        def mma(acc_ref):
            q_kn = q_smem if interpret else q_smem.transpose((1, 0))  # [D, BT·H]
            plgpu.wgmma(acc_ref, k_smem, q_kn)
            return acc_ref[...]

        logits = pl.run_scoped(mma, plgpu.ACC((bs, n), jnp.float32))  # [BS, BT·H]
        # relu as where(x < 0): NaN propagates, as in the reference.
        weighted = jnp.where(logits < 0, 0.0, logits) * w_tile
        if has_scale:
            scale = cast(scale_smem[0][...], plgpu.Layout.WGMMA.reduce(1))  # [BS]
        ids = tile * bs + cast(lax.iota(jnp.int32, bs), plgpu.Layout.WGMMA.reduce(1))
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot is done
        for b in range(bt):
            scores = jnp.sum(weighted[:, b * heads : (b + 1) * heads], axis=1)  # [BS]
            if has_scale:
                scores = scores * scale
            visible = (ids >= starts[b]) & (ids < ends[b])
            if page_tiles:
                visible = visible & (page_of(tile) >= 0)
            out_smem[slot, b] = jnp.where(visible, scores, _NEG_INF)
        # Stores are ours, not the pipeline's (its out_specs copy with a predicate,
        # which jax 0.10.2's interpreter rejects): two output buffers, so this tile's
        # store overlaps the next tile's wgmma.
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[slot], out_ref.at[pl.ds(blk * bt, bt), pl.ds(tile * bs, bs)]
        )

    pipeline = plgpu.emit_pipeline(
        step,
        grid=(n_visible,),
        in_specs=[
            plgpu.BlockSpec(
                (bs, k_ref.shape[1]), lambda j: (key_tile(j), 0), transforms=_transforms(k_ref)
            ),
            *[plgpu.BlockSpec((bs,), lambda j: (key_tile(j),))] * has_scale,
        ],
        max_concurrent_steps=cfg.max_concurrent_steps,
    )
    pipeline(k_ref, *scale_ref)

    # Tiles no query of the block can see: -inf, straight from shared memory.
    # Row by row in the scores' own layout: a whole-tile splat has no register layout
    # for odd BT (a [3, 128] strided layout needs a multiple of 256 elements).
    neg_inf_row = cast(jnp.full((bs,), _NEG_INF, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    for b in range(bt):
        fill_smem[b] = neg_inf_row
    plgpu.commit_smem()

    @pl.loop(0, r1 - r0 - n_visible)
    def _fill(i):
        tile = r0 + jnp.where(i < first - r0, i, i + n_visible)
        plgpu.copy_smem_to_gmem(fill_smem, out_ref.at[pl.ds(blk * bt, bt), pl.ds(tile * bs, bs)])
        # Bound the number of stores in flight; the source tile is never rewritten.
        plgpu.wait_smem_to_gmem(8, wait_read_only=True)

    plgpu.wait_smem_to_gmem(0)


def _transforms(ref):
    """Tiling + swizzle of a wgmma operand in shared memory: rows of D elements."""
    itemsize = jnp.dtype(ref.dtype).itemsize
    swizzle = plgpu.find_swizzle(ref.shape[-1] * itemsize * 8)
    return (
        plgpu.TilingTransform((8, swizzle // itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def padded_heads(heads: int, block_t: int) -> int:
    """H rounded up so that H is a multiple of 8 and BT·H of 32.

    A block's weights, BT·H f32, are one copy to shared memory, and Mosaic GPU copies a
    multiple of 128 bytes. Padded heads have zero queries and weight 0: no score
    changes. H = 64 (DeepSeek) is never padded.
    """
    h = -(-heads // 8) * 8
    while (block_t * h) % 32:
        h += 8
    return h


# Query blocks a program of the prologue covers, in one warp: a program's tile is [16,
# 32]. The launch takes 1.5 µs at one query (runs 290-291), 1.9 at 8 sequences and 2.4-2.5
# at 64 (H100, run 292), as one program of 128 blocks at 4 warps did (2.5 at 64, H200,
# run 290): the tile's size is not what the 64-sequence launch pays for.
_PROLOGUE_BLOCKS = 16


def _prologue_kernel(start_ref, end_ref, meta_ref, *report_refs, t, num_keys, bt, bs):
    """Program per ``_PROLOGUE_BLOCKS`` query blocks: their meta rows (first visible tile,
    visible tile count, the BT starts, the BT ends; zero padding) and their queries'
    report, from ranges clamped as :func:`jsparse._checks.clamp_ranges` clamps them."""
    blocks = pl.program_id(0) * _PROLOGUE_BLOCKS + jnp.arange(_PROLOGUE_BLOCKS, dtype=jnp.int32)
    col = jnp.arange(_META, dtype=jnp.int32)[None, :]
    # Columns 2 .. 2 + BT hold the block's starts and the next BT its ends: each of those
    # columns loads its query's whole range, so one [blocks, 32] tile serves all fields.
    is_start, is_end = (col >= 2) & (col < 2 + bt), (col >= 2 + bt) & (col < 2 + 2 * bt)
    query = blocks[:, None] * bt + jnp.where(is_end, col - 2 - bt, col - 2)
    ok = (is_start | is_end) & (query < t)  # padded query rows see nothing: [0, 0)
    at = jnp.where(ok, query, 0)
    start = jnp.clip(plt.load(start_ref.at[at], mask=ok, other=0), 0, num_keys)
    end = jnp.clip(plt.load(end_ref.at[at], mask=ok, other=0), start, num_keys)
    start, end = jnp.where(ok, start, 0), jnp.where(ok, end, 0)
    seen = end > start
    lo = jnp.min(jnp.where(seen, start, jnp.iinfo(jnp.int32).max), axis=1)
    hi = jnp.max(jnp.where(seen, end, 0), axis=1)
    first = jnp.where(hi > 0, lo // bs, 0)[:, None]
    last = jnp.where(hi > 0, (hi + bs - 1) // bs, 0)[:, None]
    meta = jnp.where(is_start, start, jnp.where(is_end, end, 0))
    meta = jnp.where(col == 0, first, jnp.where(col == 1, last - first, meta))
    n_blocks = meta_ref.shape[0]
    in_launch = blocks[:, None] < n_blocks
    # Masked lanes aim one row past the end: dropped when interpreted (where masked-off
    # duplicates of a live row could land last), masked on the GPU.
    row = jnp.where(in_launch, blocks[:, None], n_blocks)
    plt.store(meta_ref.at[row, col], meta, mask=in_launch & (col >= 0))  # mask: [blocks, 32]
    store_report(report_refs, query, ok & is_start, end - start, t)


def _prologue(start, end, num_keys, t_pad, cfg, interpret):
    """(meta [T_pad / BT, 32] int32, the ``base`` report's five [T] rows), one launch.

    The Mosaic kernel reads its block's ranges from one 128-byte meta row by TMA. Left to
    XLA, clamping the ranges, building the rows and the report were three launches, 3.5
    µs of a one-query step on an H100; this one takes 1.5 (WORKSPACE.md, runs 289, 291)."""
    t = start.shape[0]
    n_blocks = t_pad // cfg.block_t
    kernel = functools.partial(
        _prologue_kernel, t=t, num_keys=num_keys, bt=cfg.block_t, bs=cfg.block_s
    )
    meta, *report = pallas_call(
        kernel,
        grid=(pl.cdiv(n_blocks, _PROLOGUE_BLOCKS),),
        out_shape=(jax.ShapeDtypeStruct((n_blocks, _META), jnp.int32), *report_shapes(t)),
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="jsparse_indexer_mosaic_prologue",
    )(start, end)
    return meta, tuple(report)


# Most elements a Mosaic GPU async copy moves along one dimension.
_PAGE_ROW = 256


@functools.partial(
    jax.jit, static_argnames=("cfg", "interpret", "seq_len", "page_size", "with_report")
)
def _scores(q, weights, k, k_scale, start, end, pages=None, *, cfg, interpret, seq_len=0,
            page_size=0, with_report=False):  # fmt: skip
    """[T, S] scores; ``seq_len`` > 0: a batch, query t over keys [t·seq_len, (t + 1)·
    seq_len) of ``k`` (a multiple of block_s; block_t 1), ranges and the [T, seq_len]
    output in positions within that sequence. With ``pages`` [T, R, W] (query t's page
    table row, page j at [t, j // W, j % W]; W a multiple of 32, at most 256) and
    ``page_size`` (a multiple of block_s), query t's key i is row pages[t, i // P]·P +
    i % P of the page pool ``k`` instead."""
    t, h, d = q.shape
    s = seq_len or k.shape[0]
    bt, bs = cfg.block_t, cfg.block_s
    hp = padded_heads(h, bt)
    if hp != h:
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
        weights = jnp.pad(weights, ((0, 0), (0, hp - h)))
        h = hp
    n = bt * h
    t_pad = -(-t // bt) * bt
    s_pad = -(-s // bs) * bs
    n_blocks = t_pad // bt
    q2 = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0))).reshape(t_pad * h, d)
    w2 = jnp.pad(weights.astype(jnp.float32), ((0, t_pad - t), (0, 0))).reshape(t_pad * h)
    # A batch's cache is whole tiles a sequence (checked): padding it would copy it.
    k2 = k if seq_len else jnp.pad(k, ((0, s_pad - s), (0, 0)))
    scale = () if k_scale is None else (k_scale.astype(jnp.float32),)
    if scale and not seq_len:
        scale = (jnp.pad(scale[0], (0, s_pad - s), constant_values=1.0),)
    meta, report = _prologue(start, end, s, t_pad, cfg, interpret)
    q_smem = plgpu.SMEM((n, d), q.dtype, transforms=_transforms(q2))
    if interpret:
        # jax 0.10.2's interpreter cannot apply a transposed view to a wgmma operand, so
        # there each block's queries arrive already transposed, [D, BT·H]; same product.
        q2 = q2.reshape(n_blocks, n, d).transpose(0, 2, 1).reshape(n_blocks * d, n)
        q_smem = plgpu.SMEM((d, n), q.dtype)

    smem = _smem_bytes(n, d, q.dtype.itemsize, cfg)
    paged = () if pages is None else (pages,)
    page_scratch = tuple(plgpu.SMEM(p.shape[1:], jnp.int32) for p in paged)
    page_bytes = sum(4 * p.shape[1] * p.shape[2] for p in paged)
    splits = key_splits(n_blocks, s_pad // bs, cfg, smem + page_bytes)
    kernel = mosaic_kernel(
        functools.partial(
            _kernel,
            cfg=cfg,
            heads=h,
            splits=splits,
            seq_tiles=seq_len // bs,
            page_tiles=page_size // bs,
            has_scale=bool(scale),
            interpret=interpret,
        ),
        out_type=jax.ShapeDtypeStruct((t_pad, s_pad), jnp.float32),
        grid=(n_blocks, splits),
        grid_names=("blocks", "splits"),
        scratch_types=[
            (
                q_smem,
                plgpu.SMEM((n,), jnp.float32),
                plgpu.SMEM((_META,), jnp.int32),
                plgpu.SMEM((2, bt, bs), jnp.float32),
                plgpu.SMEM((bt, bs), jnp.float32),
                plgpu.Barrier(num_barriers=4 if paged else 3),
                *page_scratch,
            )
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params() if interpret else None,
        kernel_name="jsparse_indexer_scores_mosaic",
    )
    out = kernel(q2, w2, k2, *scale, meta, *paged)
    if (t_pad, s_pad) != (t, s):
        out = out[:t, :s]
    return (out, report) if with_report else out


def batch_config(heads: int) -> MosaicScorerConfig:
    """A batch of sequences: one query a CTA, since every key tile belongs to one sequence
    (a second query's half of the dot would be masked away)."""
    del heads
    return MosaicScorerConfig(block_t=1)


def batch_scores_mosaic(q, weights, k_cache, k_scale, lengths, page_table=None, *, cfg=None,
                        with_report=False):  # fmt: skip
    """[B, S_max] scores of a batch (query b over the first ``lengths[b]`` keys of its own
    cache), -inf past each length; ``with_report``: (scores, ``base``'s report). The
    cache is dense, [B, S_max, D], or with ``page_table`` [B, M] a page pool [n_pages,
    P, D] (key i of sequence b at row i % P of page page_table[b, i // P]; -1: no page,
    its keys -inf; S_max = M·P).

    Raises ``NotImplementedError`` where tiles would cross a sequence or a page: S_max
    (dense) or P (paged) must be a multiple of block_s (paged: block_s is lowered to P
    when P is smaller), P a multiple of 64, and the page table row must fit in shared
    memory beside the tiles."""
    cfg = cfg or batch_config(q.shape[1])
    if cfg.block_t != 1:
        raise ValueError(f"batch_scores_mosaic: block_t must be 1, got {cfg.block_t}")
    n_rows, p, d = k_cache.shape  # p: S_max (dense) or the page size P
    pages, seq_len, page_size = None, p, 0
    if page_table is not None:
        if p % 64:
            raise NotImplementedError(
                f"mosaic indexer batch: page size P = {p} must be a multiple of 64 (a key "
                "tile is 64·k keys of one page; use implementation='triton')"
            )
        cfg = dataclasses.replace(cfg, block_s=min(cfg.block_s, p))
        m = page_table.shape[1]
        # Mosaic GPU copies rows of a multiple of 128 bytes, and at most 256 elements
        # along each dimension: a longer row is held as [R, 256].
        width = -(-m // 32) * 32 if m <= _PAGE_ROW else _PAGE_ROW
        m_pad = -(-m // width) * width
        if m_pad // width > _PAGE_ROW:
            raise NotImplementedError(
                f"mosaic indexer batch: a page table row of {m} pages is longer than "
                f"{_PAGE_ROW**2} (use implementation='triton')"
            )
        pages = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, m_pad - m)), constant_values=-1)
        pages = pages.reshape(pages.shape[0], m_pad // width, width)
        seq_len, page_size = m * p, p
    check_supported(q.shape, q.dtype, k_cache.dtype, cfg, 0 if pages is None else 4 * m_pad)
    if p % cfg.block_s:
        what = "S_max" if pages is None else "page size P"
        raise NotImplementedError(
            f"mosaic indexer batch: {what} = {p} must be a multiple of block_s = "
            f"{cfg.block_s} (a key tile must lie in one sequence's cache or one page; "
            "padding the cache would copy it every call; use implementation='triton')"
        )
    return _scores(
        q, weights, k_cache.reshape(n_rows * p, d),
        None if k_scale is None else k_scale.reshape(n_rows * p),
        jnp.zeros_like(lengths), lengths, pages, cfg=cfg, interpret=backend.is_interpret(),
        seq_len=seq_len, page_size=page_size, with_report=with_report,
    )  # fmt: skip


def indexer_scores_mosaic(q, weights, k, k_scale, start, end, *, cfg=None):
    """Dense [T, S] f32 scores with -inf where not visible (the public ``indexer_scores``)."""
    cfg = cfg or default_config(q.shape[1], q.shape[0])
    check_supported(q.shape, q.dtype, k.dtype, cfg)
    return _scores(q, weights, k, k_scale, start, end, cfg=cfg, interpret=backend.is_interpret())


@functools.partial(jax.jit, static_argnames=("top_k", "cfg", "sort", "interpret"))
def _topk_base(q, weights, k, top_k, k_scale, start, end, *, cfg, sort, interpret):
    scores, report = _scores(
        q, weights, k, k_scale, start, end, cfg=cfg, interpret=interpret, with_report=True
    )
    # Selection is the exact Triton selection of the ``base`` method, unchanged (it
    # clamps the ranges where it reads them, as the prologue did for the report).
    return methods.topk_from_scores(scores, start, end, top_k, sort=sort, report=report)


def topk_base_mosaic(q, weights, k, top_k, k_scale, start, end, seeds, sort=True, *, cfg=None):
    """``base``: every visible score from the Mosaic GPU scorer, then exact selection."""
    del seeds
    cfg = cfg or default_config(q.shape[1], q.shape[0])
    check_supported(q.shape, q.dtype, k.dtype, cfg)
    return _topk_base(
        q, weights, k, top_k, k_scale, start, end,
        cfg=cfg, sort=sort, interpret=backend.is_interpret(),
    )  # fmt: skip
