"""Indexed MLA decode attention as a Pallas Triton kernel: listed latent rows, read in place.

One program owns one sequence, a block of ``block_h`` heads and a contiguous share of
the sequence's index list (split-K at small batch). Per step of ``block_n`` entries:

    ids      [BN]           the list's entries (-1 = empty)
    latent   [BN, Dc]       gathered straight from the cache (row b·S + id)
    rope     [BN, Dr]       the same rows' RoPE keys
    logits   [BH, BN]       q_c·latentᵀ + q_r·ropeᵀ: two tensor-core dots, f32 accumulation
    acc      [BH, Dc]       += softmax weights · latent (the latent is the value too)

so a listed row is read once per head block and serves as key and value; nothing is
copied out of the cache. An FP8 cache (even Dc and Dr) is read as 16-bit words, each
two values: the low and high bytes are two planes with their own halves of q and of the
accumulator, and the kernel stores the output's halves interleaved. Words are faster
than bytes (run 167), and Pallas Triton would address a 1-byte cache of 2-4 GiB with
wrapping 32-bit offsets (run 163). The FP8 tiles widen to f16 and the dots run in f16
against a q rescaled per head (one conversion per pair; FP8 → bf16 takes a longer
sequence on sm90, run 166).

Splits write running max, normaliser and unnormalised output, merged by the indexed
GQA kernel's merge launch (:func:`jsparse.ops.attention.triton.launch_split_k`); a list
one program walks alone is normalised in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse.ops.attention.triton import (
    MIN_GROUP_ROWS,
    accumulated,
    bf16_term_count,
    bf16_terms,
    cache_geometry,
    fp8_planes,
    fp8_words,
    launch_split_k,
    listed_slots,
    looked_up_first,
    merge_vdim_block,
    q_planes,
    rescaled_f16,
    softmax_weights,
    split_list,
    store_normalized,
    store_planes,
)
from jsparse.ops.indexer.triton import next_pow2

# The default tiles (module constants, so that `bench/run.py --set` can A/B them).
BLOCK_N = 64  # list entries per step (run 163, 128 × 32K, 128 heads: 424 µs; 32: 459)
MAX_BLOCK_H = 32  # heads per program
NUM_WARPS = 4
NUM_STAGES = 3  # run 164: 310 µs against 341 at 2 (128 × 32K, 128 heads, bf16)
# FP8 caches with even Dc and Dr are read as 16-bit words (False: byte by byte where
# the cache is small enough to be addressed in bytes; see the wrapper).
FP8_AS_WORDS = True
# Paged caches: every listed token's page looked up before the launch (one XLA gather
# over the lists), so the kernel's row loads wait on one load, not two. Paged rows at 128
# heads: 1.8× dense's time with the lookups in the kernel (run 172), 1.01× this way
# (run 174: 32 × 32K 125 → 126 µs); at 16 heads +5-23% → +5-9% (the gather, ~1.7 µs).
PAGES_BEFORE_LAUNCH = True
# The dots' dtype over an FP8 cache: "float16" (q rescaled per head by a power of two
# into f16's range) or "bfloat16" (q as it is).
FP8_DOT_DTYPE = "float16"


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Tiles: list entries per step, heads per program, warps, pipeline stages."""

    block_n: int = BLOCK_N
    block_h: int = MAX_BLOCK_H
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES

    def __post_init__(self):
        for name in ("block_n", "block_h"):
            n = getattr(self, name)
            if n < 16 or n & (n - 1):
                raise ValueError(f"MLAConfig.{name} must be a power of two ≥ 16, got {n}")
        w = self.num_warps
        if w < 1 or w & (w - 1):
            raise ValueError(f"MLAConfig.num_warps must be a power of two, got {w}")
        if self.num_stages < 1:
            raise ValueError(f"MLAConfig.num_stages must be ≥ 1, got {self.num_stages}")


def default_config(heads: int) -> MLAConfig:
    """Head blocks of up to MAX_BLOCK_H (fewer heads: one block, padded to the dot's 16
    rows), the module's tiles read at call time."""
    return MLAConfig(
        block_n=BLOCK_N, block_h=min(next_pow2(heads, MIN_GROUP_ROWS), MAX_BLOCK_H),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip


def f32_config(heads: int) -> MLAConfig:
    """Tiles for f32 caches, whose dots are IEEE f32 in either mode of
    :mod:`jsparse.ops.f32_dots`: at decode shapes IEEE on small tiles beat tf32x3, and is
    exact. H100, 8 sequences × 8K, 128 heads, D 576, 2048 entries, wall ms (runs 245,
    251): IEEE 32 entries × 16 heads, 1 stage 0.33 (16 × 16 or 16 × 32, 2 stages 0.35;
    the default 64 × 32 2.78); tf32x3 at its best fit, 16 × 16, 1.74 (its default asked
    295,424 bytes of shared memory for the tile's TF32 hi and lo parts)."""
    return MLAConfig(
        block_n=32, block_h=min(next_pow2(heads, MIN_GROUP_ROWS), 16), num_warps=4,
        num_stages=1,
    )  # fmt: skip


def terms_config(heads: int) -> MLAConfig:
    """Tiles for an f32 q over a bf16 cache (three bf16 terms of q a dot): half the
    default's heads and entries a program, so q's three copies fit beside the
    accumulator. H100, 128 heads, D 576, 2048 entries of 32K, µs (run 284): 104 / 291
    at 8 / 32 sequences against the default tile's 132 / 561; 8 warps or 64 entries at
    16 heads 169 / 528-531."""
    return MLAConfig(
        block_n=32, block_h=min(next_pow2(heads, MIN_GROUP_ROWS), 16), num_warps=4,
        num_stages=3,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Plan:
    seq: int  # S (virtual: max_pages · P when paged)
    page_size: int  # P of a paged cache, 0 for a dense [B, S, D] one
    pooled: bool  # the lists hold slots of the whole cache (pages looked up before)
    n_pages: int  # pages in the pool read through a table (0: none)
    heads: int  # H
    head_blocks: int
    group: int  # heads per block (the merge's "group"): a power of two ≥ 16
    planes: int  # 1, or 2 for a packed FP8 cache (low and high bytes of each word)
    latent: int  # latent values per plane (Dc, or Dc/2 packed)
    latent_pad: int
    rope: int  # RoPE values per plane (0: no RoPE part)
    rope_pad: int
    vdim: int  # Dc: the output width (the merge reads these names)
    vdim_pad: int
    list_len: int
    steps_per_split: int
    steps: int
    splits: int
    scale: float
    compute: jnp.dtype
    q_rescaled: bool  # the kernel rescales q per head for f16 dots (FP8, bf16 q)
    terms: int  # 1, or 3: an f32 q (and the weights) as bf16 terms against a bf16 cache
    has_scale: bool
    cfg: MLAConfig
    interpret: bool

    # The names the shared split-K launch reads (jsparse.ops.attention.triton).
    @property
    def group_rows(self) -> int:
        return self.group  # already a power of two ≥ 16

    @property
    def has_v_scale(self) -> bool:
        return self.has_scale  # the merge applies the cache scale to the output


def _kernel(q_ref, ids_ref, cache_ref, *refs, p: _Plan):
    """q is [B, H, Dc + Dr] in its own order; the cache row is [latent | RoPE] values, or
    words of two FP8 values (then q's even and odd dims of each part are the two planes,
    and the output's planes are stored interleaved). A paged cache's page table comes
    first in ``refs``."""
    table_ref, refs = (refs[0], refs[1:]) if p.page_size else (None, refs)
    scale_ref, outs = (refs[0], refs[1:]) if p.has_scale else (None, refs)
    bn = p.cfg.block_n
    pair = pl.program_id(0)  # b·head_blocks + block
    split = pl.program_id(1)
    b, blk = pair // p.head_blocks, pair % p.head_blocks
    heads = blk * p.group + jnp.arange(p.group)
    real = heads < p.heads
    cdims, rdims = jnp.arange(p.latent_pad), jnp.arange(p.rope_pad)
    zero = jnp.zeros((), cache_ref.dtype)  # typed `other`: Triton cannot cast i32 0 to fp8

    q_c = q_planes(q_ref, (b,), heads, real, 0, cdims, p.latent, p.planes)
    dc = p.planes * p.latent
    q_r = q_planes(q_ref, (b,), heads, real, dc, rdims, p.rope, p.planes) if p.rope else []
    scale = p.scale
    if p.has_scale:
        scale = scale * plt.load(scale_ref.at[pair])
    if p.q_rescaled:
        q, unshift = rescaled_f16(q_c + q_r)
        q_c, q_r = q[: len(q_c)], q[len(q_c) :]
        scale = scale * unshift[:, None]
    if p.terms > 1:  # an f32 q over a bf16 cache: bf16 terms against the exact rows
        q_c, q_r = bf16_terms(q_c[0], p.terms), (bf16_terms(q_r[0], p.terms) if q_r else [])
    else:
        q_c, q_r = [x.astype(p.compute) for x in q_c], [x.astype(p.compute) for x in q_r]
    # f32 caches: IEEE dots in either f32_dots mode (faster here than tf32x3, f32_config);
    # a bf16 cache under an f32 q: bf16 dots of bf16 terms (attention's bf16_term_count)
    precision = jax.lax.Precision.HIGHEST if p.compute == jnp.float32 else None

    def step(j, carry):
        m, l, accs = carry
        at = j * bn + jnp.arange(bn)
        ids = plt.load(ids_ref.at[b, at], mask=at < p.list_len, other=-1)
        ok, rows = listed_slots(ids, 0 if p.pooled else b, table_ref, p.seq, p.page_size, p.n_pages)

        def load_rows(start, dims, width):
            mask = ok[:, None] & (dims[None, :] < width)
            tile = plt.load(cache_ref.at[rows[:, None], start + dims[None, :]], mask=mask,
                            other=zero)  # fmt: skip
            return fp8_planes(tile, p.planes, p.compute)

        lat = load_rows(0, cdims, p.latent)
        # p.terms copies of the tile's planes: with bf16 terms each meets the one bf16 plane
        logits = sum(_dot_t(qi, ki, precision) for qi, ki in zip(q_c, lat * p.terms, strict=True))
        if p.rope:
            rope = load_rows(p.latent, rdims, p.rope) * p.terms
            logits += sum(_dot_t(qi, ki, precision) for qi, ki in zip(q_r, rope, strict=True))
        logits = jnp.where(ok[None, :], logits * scale, -jnp.inf)  # [BH, BN]
        m_new, weights, alpha = softmax_weights(m, logits)
        return m_new, *accumulated(l, accs, weights, alpha, lat, p.compute, precision, p.terms)

    init = (
        jnp.full((p.group,), -jnp.inf, jnp.float32),
        jnp.zeros((p.group,), jnp.float32),
        tuple(jnp.zeros((p.group, p.latent_pad), jnp.float32) for _ in range(p.planes)),
    )
    first = split * p.steps_per_split
    last = jnp.minimum(first + p.steps_per_split, p.steps)
    m, l, accs = jax.lax.fori_loop(first, last, step, init)
    every = jnp.arange(p.group) >= 0  # padded heads too: the wrapper slices them off
    if p.splits == 1:  # the whole list in one program: normalise here, no merge launch
        cache_scale = plt.load(scale_ref.at[pair]) if p.has_scale else None
        store_normalized(outs, pair, m, l, accs, cache_scale, every, p.latent)
        return
    acc_ref, m_ref, l_ref = outs
    store_planes(acc_ref, (pair, split), accs, every, p.latent)
    plt.store(m_ref.at[pair, split], m)
    plt.store(l_ref.at[pair, split], l)


def _dot_t(a, x, precision):  # a [BH, X] · x [BN, X]ᵀ
    return jax.lax.dot_general(
        a, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )


def indexed_mla_attention_triton(
    q, cache, indices, cache_scale, *, latent_dim, scale, page_table=None, cfg=None, splits=None
):
    """(out [B, H, Dc] in q's dtype, lse [B, H] float32); see
    :func:`jsparse.indexed_mla_attention`. The module's tiles and FP8 switch (and the
    shared ``MERGE_VDIM_BLOCK``) are read here, at call time, so that a changed setting
    is never hidden by a cached trace."""
    d, dc = q.shape[-1], latent_dim
    # An FP8 cache is read as 16-bit words holding two values: with f16 dots, 1.3-1.6×
    # faster than bytes (run 167). Past 2**31 values words are needed: Pallas Triton
    # addresses a 1-byte operand of 2-4 GiB with 32-bit offsets that wrap (a 128 × 32K
    # DeepSeek cache is 2.4 GB: run 163 read garbage for its last sequences).
    packed = (
        jnp.dtype(cache.dtype) == jnp.dtype(jnp.float8_e4m3fn) and dc % 2 == 0
        and (d - dc) % 2 == 0 and (FP8_AS_WORDS or cache.size > 2**31)
    )  # fmt: skip
    fp8_dot = jnp.dtype(FP8_DOT_DTYPE)
    if fp8_dot not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"FP8_DOT_DTYPE must be 'float16' or 'bfloat16', got {FP8_DOT_DTYPE!r}")
    return _indexed_mla_attention(
        q, cache, indices, cache_scale, page_table, latent_dim=latent_dim, scale=scale,
        cfg=cfg or _default_config(q, cache), splits=splits, packed=packed,
        fp8_dot=fp8_dot.name, pages_first=PAGES_BEFORE_LAUNCH, merge_block=merge_vdim_block(),
    )  # fmt: skip


def _default_config(q, cache) -> MLAConfig:
    if jnp.dtype(q.dtype) == jnp.float32:
        terms = bf16_term_count(q, cache) > 1
        return (terms_config if terms else f32_config)(q.shape[1])
    return default_config(q.shape[1])


@backend.jit_per_mode(
    static_argnames=(
        "latent_dim", "scale", "cfg", "splits", "packed", "fp8_dot", "pages_first", "merge_block",
    ),
)  # fmt: skip
def _indexed_mla_attention(
    q, cache, indices, cache_scale, page_table, *, latent_dim, scale, cfg, splits, packed,
    fp8_dot, pages_first, merge_block,
):  # fmt: skip
    b, h, d = q.shape
    n = indices.shape[1]
    indices, page_table, s, pooled = looked_up_first(indices, cache, page_table, pages_first)
    pool, page_size, _ = cache_geometry(cache, page_table)
    blocks = -(-h // cfg.block_h)
    pairs = b * blocks
    steps, per_split, splits = split_list(pairs, n, cfg.block_n, splits)
    compute = jnp.dtype(q.dtype)  # a narrower cache (FP8, or 16-bit under f32) widens to it
    out_dtype = q.dtype
    # A bf16 q over an FP8 cache: FP8 widens to f16 in one conversion, to bf16 in a
    # longer sequence (an f32 q keeps f32 dots).
    q_rescaled = (
        compute == jnp.dtype(jnp.bfloat16)
        and fp8_dot == "float16"
        and (jnp.dtype(cache.dtype) == jnp.dtype(jnp.float8_e4m3fn))
    )
    compute = jnp.dtype(jnp.float16) if q_rescaled else compute  # q rescaled in the kernel
    terms = bf16_term_count(q, cache)
    compute = jnp.dtype(jnp.bfloat16) if terms > 1 else compute
    dc, dr = latent_dim, d - latent_dim
    planes = 2 if packed else 1
    if packed:
        rows = fp8_words(cache.reshape(pool, d), d)
    else:
        rows = cache.reshape(pool, d)
        backend.check_triton_offsets("indexed_mla_attention", cache=rows)
    has_scale = cache_scale is not None
    lat, rope = dc // planes, dr // planes
    p = _Plan(
        seq=s, page_size=page_size, pooled=pooled,
        n_pages=pool // page_size if page_size else 0,
        heads=h, head_blocks=blocks, group=cfg.block_h,
        planes=planes, latent=lat, latent_pad=next_pow2(lat, 16), rope=rope,
        rope_pad=next_pow2(max(rope, 1), 16), vdim=dc, vdim_pad=next_pow2(dc, 16),
        list_len=n, steps_per_split=per_split, steps=steps, splits=splits, scale=float(scale),
        compute=compute, q_rescaled=q_rescaled, terms=terms, has_scale=has_scale, cfg=cfg,
        interpret=backend.is_interpret(),
    )  # fmt: skip
    scales = [jnp.repeat(cache_scale.astype(jnp.float32), blocks)] if has_scale else []
    table = [] if page_table is None else [page_table]
    out, lse = launch_split_k(
        functools.partial(_kernel, p=p), p, [q, indices, rows, *table, *scales],
        scales, pairs=pairs, dtype=out_dtype, name="jsparse_indexed_mla_attention",
        merge_block=merge_block,
    )  # fmt: skip
    bh = cfg.block_h
    out = out.reshape(b, blocks * bh, dc)[:, :h]
    return out, lse.reshape(b, blocks * bh)[:, :h]
