"""Indexed MLA decode attention as a Pallas Triton kernel: listed latent rows, read in place.

One program owns one sequence, a block of ``block_h`` heads and a contiguous share of
the sequence's index list (split-K at small batch). Per step of ``block_n`` entries:

    ids      [BN]           the list's entries (-1 = empty)
    latent   [BN, Dc]       gathered straight from the cache (row b·S + id)
    rope     [BN, Dr]       the same rows' RoPE keys
    logits   [BH, BN]       q_c·latentᵀ + q_r·ropeᵀ: two tensor-core dots, f32 accumulation
    acc      [BH, Dc]       += softmax weights · latent (the latent is the value too)

so a listed row is read once per head block and serves as key and value; nothing is
copied out of the cache. Splits write running max, normaliser and unnormalised output,
merged by the indexed GQA kernel's merge launch (:func:`jsparse.ops.attention.triton.
merge_splits`); a list one program walks alone is normalised in place.
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
    default_splits,
    merge_splits,
    store_normalized,
)
from jsparse.ops.indexer.triton import next_pow2

# The default tiles (module constants, so that `bench/run.py --set` can A/B them).
BLOCK_N = 32  # list entries per step
MAX_BLOCK_H = 32  # heads per program
NUM_WARPS = 4
NUM_STAGES = 2


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    seq: int  # S
    heads: int  # H
    head_blocks: int
    group: int  # heads per block (the merge's and final store's "group")
    group_rows: int  # == group: a power of two ≥ 16
    latent: int  # Dc
    latent_pad: int
    rope: int  # Dr = D - Dc (0: no RoPE part)
    rope_pad: int
    dim: int  # D, the cache row
    vdim: int  # Dc: the output width (merge and final store read these names)
    vdim_pad: int
    list_len: int
    steps_per_split: int
    steps: int
    splits: int
    scale: float
    compute: jnp.dtype
    has_scale: bool
    has_v_scale: bool  # == has_scale: the merge applies the cache scale to the output
    cfg: MLAConfig
    interpret: bool


def _kernel(q_ref, ids_ref, cache_ref, *refs, p: _Plan):
    scale_ref, outs = (refs[0], refs[1:]) if p.has_scale else (None, refs)
    bn = p.cfg.block_n
    pair = pl.program_id(0)  # b·head_blocks + block
    split = pl.program_id(1)
    b, blk = pair // p.head_blocks, pair % p.head_blocks
    heads = blk * p.group + jnp.arange(p.group)
    real = heads < p.heads
    cdims = jnp.arange(p.latent_pad)
    zero = jnp.zeros((), cache_ref.dtype)  # typed `other`: Triton cannot cast i32 0 to fp8
    q_c = plt.load(
        q_ref.at[b, heads[:, None], cdims[None, :]],
        mask=real[:, None] & (cdims[None, :] < p.latent), other=0.0,
    ).astype(p.compute)  # fmt: skip
    if p.rope:
        rdims = jnp.arange(p.rope_pad)
        q_r = plt.load(
            q_ref.at[b, heads[:, None], p.latent + rdims[None, :]],
            mask=real[:, None] & (rdims[None, :] < p.rope), other=0.0,
        ).astype(p.compute)  # fmt: skip
    precision = jax.lax.Precision.HIGHEST if p.compute == jnp.float32 else None
    scale = p.scale
    if p.has_scale:
        scale = scale * plt.load(scale_ref.at[pair])

    def dot_t(a, x):  # a [BH, X] · x [BN, X]ᵀ
        return jax.lax.dot_general(
            a, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
            precision=precision,
        )  # fmt: skip

    def step(j, carry):
        m, l, acc = carry
        at = j * bn + jnp.arange(bn)
        ids = plt.load(ids_ref.at[b, at], mask=at < p.list_len, other=-1)
        ok = (ids >= 0) & (ids < p.seq)
        rows = b * p.seq + jnp.where(ok, ids, 0)
        lat = plt.load(
            cache_ref.at[rows[:, None], cdims[None, :]],
            mask=ok[:, None] & (cdims[None, :] < p.latent), other=zero,
        ).astype(p.compute)  # fmt: skip
        logits = dot_t(q_c, lat)
        if p.rope:
            rope = plt.load(
                cache_ref.at[rows[:, None], p.latent + rdims[None, :]],
                mask=ok[:, None] & (rdims[None, :] < p.rope), other=zero,
            ).astype(p.compute)  # fmt: skip
            logits = logits + dot_t(q_r, rope)
        logits = jnp.where(ok[None, :], logits * scale, -jnp.inf)  # [BH, BN]
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        # Subtract a finite max: a row that has seen only empty entries stays at 0 weight.
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        weights = jnp.exp(logits - base[:, None])
        alpha = jnp.exp(m - base)
        pv = jax.lax.dot_general(
            weights.astype(p.compute), lat, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32, precision=precision,
        )  # fmt: skip
        return m_new, l * alpha + jnp.sum(weights, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((p.group,), -jnp.inf, jnp.float32),
        jnp.zeros((p.group,), jnp.float32),
        jnp.zeros((p.group, p.latent_pad), jnp.float32),
    )
    first = split * p.steps_per_split
    last = jnp.minimum(first + p.steps_per_split, p.steps)
    m, l, acc = jax.lax.fori_loop(first, last, step, init)
    if p.splits == 1:  # the whole list in one program: normalise here, no merge launch
        v_scale = plt.load(scale_ref.at[pair]) if p.has_scale else None
        store_normalized(outs, pair, m, l, acc, v_scale, p)
        return
    acc_ref, m_ref, l_ref = outs
    plt.store(acc_ref.at[pair, split], acc)
    plt.store(m_ref.at[pair, split], m)
    plt.store(l_ref.at[pair, split], l)


@functools.partial(jax.jit, static_argnames=("latent_dim", "scale", "cfg", "splits"))
def indexed_mla_attention_triton(
    q, cache, indices, cache_scale, *, latent_dim, scale, cfg=None, splits=None
):
    """(out [B, H, Dc] in q's dtype, lse [B, H] float32); see
    :func:`jsparse.indexed_mla_attention`."""
    b, h, d = q.shape
    s, n = cache.shape[1], indices.shape[1]
    cfg = cfg or default_config(h)
    blocks = -(-h // cfg.block_h)
    steps = max(1, -(-n // cfg.block_n))
    pairs = b * blocks
    splits = splits or default_splits(pairs, steps)
    per_split = -(-steps // splits)
    splits = -(-steps // per_split)  # no program without a step
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    compute = jnp.dtype(q.dtype) if jnp.dtype(cache.dtype) == fp8 else jnp.dtype(cache.dtype)
    dc, dr = latent_dim, d - latent_dim
    has_scale = cache_scale is not None
    p = _Plan(
        seq=s, heads=h, head_blocks=blocks, group=cfg.block_h, group_rows=cfg.block_h,
        latent=dc, latent_pad=next_pow2(dc, 16), rope=dr, rope_pad=next_pow2(max(dr, 1), 16),
        dim=d, vdim=dc, vdim_pad=next_pow2(dc, 16), list_len=n, steps_per_split=per_split,
        steps=steps, splits=splits, scale=float(scale), compute=compute, has_scale=has_scale,
        has_v_scale=has_scale, cfg=cfg, interpret=backend.is_interpret(),
    )  # fmt: skip
    # Reshape only (free): the kernel masks the padded heads, dims and list tail.
    scales = [jnp.repeat(cache_scale.astype(jnp.float32), blocks)] if has_scale else []
    bh, dcp = cfg.block_h, p.latent_pad
    final = (
        jax.ShapeDtypeStruct((pairs, bh, dc), q.dtype),
        jax.ShapeDtypeStruct((pairs, bh), jnp.float32),
    )
    partial = (
        jax.ShapeDtypeStruct((pairs, splits, bh, dcp), jnp.float32),
        jax.ShapeDtypeStruct((pairs, splits, bh), jnp.float32),
        jax.ShapeDtypeStruct((pairs, splits, bh), jnp.float32),
    )
    outs = pl.pallas_call(
        functools.partial(_kernel, p=p),
        grid=(pairs, splits),
        out_shape=final if splits == 1 else partial,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=p.interpret,
        name="jsparse_indexed_mla_attention",
    )(q, indices, cache.reshape(b * s, d), *scales)
    if splits > 1:
        outs = merge_splits(outs, scales, p, final, "jsparse_indexed_mla_attention")
    out, lse = outs
    out = out.reshape(b, blocks * bh, dc)[:, :h]
    return out, lse.reshape(b, blocks * bh)[:, :h]
