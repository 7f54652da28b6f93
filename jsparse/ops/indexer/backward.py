"""The indexer scores' derivative as two Pallas Triton kernels (reverse mode).

For a cotangent g [T, S] of ``s[t, i] = c[i] · Σ_h w[t, h] · relu(q[t, h] · k[i])``
(zero where key i is not visible to query t), with a = g · c and the ReLU's gate
m = [q[t, h] · k[i] ≥ 0] (the reference's ``where(x < 0, 0, x)``, derivative 1 at 0):

    dq[t, h] = w[t, h] · Σ_i a[t, i] · m · k[i]         dw[t, h] = Σ_i a[t, i] · relu(q·k)
    dk[i]    = Σ_t Σ_h a[t, i] · w[t, h] · m · q[t, h]  dc[i]    = Σ_t g[t, i] · s[t, i] / c[i]

The reference's derivative (the jnp einsums of ``reference.py`` in f32, every chunk's
[T, H, S] logits recomputed) is the function these kernels compute; it is their test
oracle. Like a flash-attention backward, each kernel recomputes the logits of its tile
on the tensor cores and never stores them:

* ``dq``/``dw``: a program owns BT queries and a few heads and loops over the key
  tiles its queries can see (causal: about half), two dots a tile and head.
* ``dk``/``dc``: a program owns BS keys and a group of heads and loops over the query
  tiles that can see them (found before the launch from the ranges), two dots a tile
  and head; the groups' partial sums are added afterwards (more programs at short S).

Rounding: the logits are the forward's (bf16 or FP8 operands widened exactly to bf16,
FP8 once in memory before the launches; f32 accumulation). The second dot of each pair
takes the gated cotangent a·m (times w for dk) rounded to bf16, as flash-attention
backwards do; so a gradient differs from the reference's f32 one by ~2^-9 of its
terms' size (bf16 and FP8 inputs). For f32 inputs every operand stays f32, multiplied
as :mod:`jsparse.ops.f32_dots` says (tf32x3 by default). Where a logit is within rounding
of 0 the ReLU's gate, and so a whole term, can differ between any two arithmetics:
compare gradients by norm, not entry by entry.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import pallas_call
from jsparse.ops import f32_dots
from jsparse.ops.indexer.methods import block_ranges
from jsparse.ops.indexer.triton import next_pow2, tile_span


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Tiles of both kernels (powers of two, ≥ 16: the smallest tensor-core tile).
    Measured best of 19 on an H100 at T = S = 4096 causal, H 64, D 128, bf16 (runs
    230-231, GPU busy): 1.53 ms (dq 0.88, dk 0.64) against 2.20 at 4 groups and 2 stages;
    8 warps, or 128-row tiles, were 1.5-2.5× slower. Two heads a dq program load each
    key and cotangent tile once for both: dq 0.90 → 0.69 ms (run 235; the launch was
    bound by those loads from L2)."""

    block_t: int = 64  # queries a tile
    block_s: int = 64  # keys a tile
    head_groups: int = 8  # dk programs per key tile, each over H / head_groups heads
    dq_heads: int = 2  # heads a dq program owns (each key and cotangent tile loaded once for them)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_t", "block_s", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BackwardConfig.{name} must be a power of two, got {value}")
        for name, least in (("block_t", 16), ("block_s", 16), ("head_groups", 1),
                            ("dq_heads", 1), ("num_stages", 1)):  # fmt: skip
            if getattr(self, name) < least:
                raise ValueError(
                    f"BackwardConfig.{name} must be ≥ {least}, got {getattr(self, name)}"
                )


# f32 operands on the tensor cores (the "tf32x3" mode of jsparse.ops.f32_dots): the
# default tiles asked 360,960 bytes of shared memory (run 244) and two heads a dq program
# 311,552 even at 2 stages. Each kernel timed alone (runs 245-246, H100, T = S = 4096
# causal, H 64, D 128, ms of the vjp with the other kernel's output zeros): dq + dk at
# 32 × 32, one head, 3 stages 8.1 + 8.5; at 32 × 64, 2 stages 7.8 + 10.8; 64 × 64 12.4 +
# 14.7; 8 warps 15.4 + 19.8.
F32_TENSOR_CORE_CONFIG = BackwardConfig(
    block_t=32, block_s=32, head_groups=8, dq_heads=1, num_warps=4, num_stages=3
)
# The widest (padded) D those tiles were measured at; wider f32 inputs take the
# reference's derivative in that mode.
F32_TENSOR_CORE_MAX_DIM = 128


def kernels_take(q_dtype, k_dtype, dim: int) -> bool:
    """Whether these kernels' default tiles take inputs of these dtypes and D: always for
    bf16 and FP8; for f32 only with tensor-core dots (IEEE f32 dots run off the tensor
    cores: 657 ms against XLA's 39 ms at T = S = 4096 causal, H 64, D 128, run 240) and
    D the tiles fit."""
    compute = _compute_dtype(q_dtype, k_dtype)
    if compute != jnp.float32:
        return True
    return f32_dots.tensor_cores(compute) and next_pow2(dim, 16) <= F32_TENSOR_CORE_MAX_DIM


@dataclasses.dataclass(frozen=True)
class _Plan:
    t: int
    s: int
    heads: int
    dim: int
    block_t: int
    block_s: int
    heads_per_group: int
    dq_heads: int
    compute: jnp.dtype


def _dot(a, b, contract_b, p):
    """a [M, K] · b (contracting b's axis ``contract_b``) in f32 on the tensor cores."""
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())),
        preferred_element_type=jnp.float32, precision=f32_dots.precision(p.compute),
    )  # fmt: skip


def _query_rows(i, start_ref, end_ref, p):
    """Whether each row of query tile ``i`` exists, and the rows' clamped ranges."""
    rows = i * p.block_t + jnp.arange(p.block_t, dtype=jnp.int32)
    row_ok = rows < p.t
    safe = jnp.where(row_ok, rows, 0)
    start = jnp.clip(jnp.where(row_ok, plt.load(start_ref.at[safe]), p.s), 0, p.s)
    end = jnp.clip(jnp.where(row_ok, plt.load(end_ref.at[safe]), 0), start, p.s)
    return row_ok, start, end


def _key_tile(j, k_ref, scale_ref, p):
    ids = j * p.block_s + jnp.arange(p.block_s, dtype=jnp.int32)
    ok = ids < p.s
    k_tile = plt.load(k_ref.at[pl.ds(j * p.block_s, p.block_s), :], mask=ok[:, None], other=0.0)
    scale = plt.load(scale_ref.at[pl.ds(j * p.block_s, p.block_s)], mask=ok, other=0.0)
    return ids, ok, k_tile, scale


def _cotangent_tile(g_ref, i, j, row_ok, ok, p):
    return plt.load(
        g_ref.at[pl.ds(i * p.block_t, p.block_t), pl.ds(j * p.block_s, p.block_s)],
        mask=row_ok[:, None] & ok[None, :],
        other=0.0,
    )  # [BT, BS]


def _dq_kernel(q_ref, w_ref, k_ref, scale_ref, start_ref, end_ref, g_ref, dq_ref, dw_ref, *, p):
    heads = [pl.program_id(0) * p.dq_heads + hh for hh in range(p.dq_heads)]
    i = pl.program_id(1)
    row_ok, start, end = _query_rows(i, start_ref, end_ref, p)
    tile = pl.ds(i * p.block_t, p.block_t)
    qs = [plt.load(q_ref.at[tile, h, :], mask=row_ok[:, None], other=0.0) for h in heads]
    # only the key tiles some query of the tile sees
    lo = jnp.min(jnp.where(row_ok & (end > start), start, p.s))
    hi = jnp.max(jnp.where(row_ok & (end > start), end, 0))
    first, last = tile_span(lo, hi, p.block_s)

    def body(j, carry):
        ids, ok, k_tile, scale = _key_tile(j, k_ref, scale_ref, p)
        visible = ok[None, :] & (ids[None, :] >= start[:, None]) & (ids[None, :] < end[:, None])
        a = jnp.where(visible, _cotangent_tile(g_ref, i, j, row_ok, ok, p) * scale[None, :], 0.0)
        out = []
        for q, (dq, dw) in zip(qs, carry, strict=True):
            logits = _dot(q, k_tile, 1, p)  # [BT, BS]
            gated = jnp.where(logits < 0, 0.0, a)
            dw = dw + jnp.sum(gated * logits, axis=1)
            dq = dq + _dot(gated.astype(p.compute), k_tile, 0, p)  # [BT, D]
            out.append((dq, dw))
        return tuple(out)

    zeros = (jnp.zeros((p.block_t, p.dim), jnp.float32), jnp.zeros((p.block_t,), jnp.float32))
    sums = jax.lax.fori_loop(first, last, body, (zeros,) * p.dq_heads)
    for h, (dq, dw) in zip(heads, sums, strict=True):
        w = plt.load(w_ref.at[tile, h], mask=row_ok, other=0.0)
        plt.store(dq_ref.at[tile, h, :], dq * w[:, None], mask=row_ok[:, None])
        plt.store(dw_ref.at[tile, h], dw, mask=row_ok)


def _dk_kernel(
    q_ref, w_ref, k_ref, scale_ref, start_ref, end_ref, g_ref, first_ref, last_ref,
    dk_ref, dc_ref, *, p,
):  # fmt: skip
    group = pl.program_id(0)
    j = pl.program_id(1)
    ids, ok, k_tile, scale = _key_tile(j, k_ref, scale_ref, p)
    keys = pl.ds(j * p.block_s, p.block_s)

    def query_tile(i, carry):
        dk, dc = carry
        row_ok, start, end = _query_rows(i, start_ref, end_ref, p)
        visible = ok[:, None] & (ids[:, None] >= start[None, :]) & (ids[:, None] < end[None, :])
        g = jnp.where(visible, _cotangent_tile(g_ref, i, j, row_ok, ok, p).T, 0.0)  # [BS, BT]
        a = g * scale[:, None]
        tile = pl.ds(i * p.block_t, p.block_t)

        def head(hh, carry):
            dk, raw = carry
            h = group * p.heads_per_group + hh
            q = plt.load(q_ref.at[tile, h, :], mask=row_ok[:, None], other=0.0)
            w = plt.load(w_ref.at[tile, h], mask=row_ok, other=0.0)
            logits = _dot(k_tile, q, 1, p)  # [BS, BT]
            relu = jnp.where(logits < 0, 0.0, logits)
            gated = jnp.where(logits < 0, 0.0, a * w[None, :])
            dk = dk + _dot(gated.astype(p.compute), q, 0, p)  # [BS, D]
            return dk, raw + relu * w[None, :]

        raw = jnp.zeros((p.block_s, p.block_t), jnp.float32)
        dk, raw = jax.lax.fori_loop(0, p.heads_per_group, head, (dk, raw))
        return dk, dc + jnp.sum(g * raw, axis=1)

    first = plt.load(first_ref.at[j])
    last = plt.load(last_ref.at[j])
    zeros = (jnp.zeros((p.block_s, p.dim), jnp.float32), jnp.zeros((p.block_s,), jnp.float32))
    dk, dc = jax.lax.fori_loop(first, last, query_tile, zeros)
    plt.store(dk_ref.at[group, keys, :], dk, mask=ok[:, None])
    plt.store(dc_ref.at[group, keys], dc, mask=ok)


def _query_tiles_of_key_tiles(start, end, p):
    """[first, last) of the query tiles that may see each key tile (the tiles between
    two that do are visited too, and masked: packed ranges keep them contiguous)."""
    n_tb = -(-p.t // p.block_t)
    n_sb = -(-p.s // p.block_s)
    lo, hi = block_ranges(start, end, p.block_t, p.s)
    tile_lo = jnp.arange(n_sb, dtype=jnp.int32)[:, None] * p.block_s
    sees = (lo[None, :] < tile_lo + p.block_s) & (hi[None, :] > tile_lo) & (hi > lo)[None, :]
    any_tile = sees.any(axis=1)
    first = jnp.where(any_tile, jnp.argmax(sees, axis=1), 0).astype(jnp.int32)
    last = jnp.where(any_tile, n_tb - jnp.argmax(sees[:, ::-1], axis=1), 0).astype(jnp.int32)
    return first, last


def _compute_dtype(q_dtype, k_dtype):
    # bf16 and FP8 widen exactly to bf16 (e4m3 spans 2^-9 .. 448; f16 would flush the
    # gated cotangent's small values); f32 inputs stay f32
    if jnp.float32 in (jnp.dtype(q_dtype), jnp.dtype(k_dtype)):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(jnp.bfloat16)


@backend.jit_per_mode(static_argnames=("cfg",))
def indexer_scores_vjp_triton(cotangent, q, weights, k, k_scale, start, end, *, cfg=None):
    """Cotangents (dq, dweights, dk, dk_scale), all f32, of ``indexer_scores`` at (q,
    weights, k, k_scale, start, end) for the scores' cotangent [T, S] (read where
    visible only); dk_scale is None when k_scale is."""
    t, h, d = q.shape
    s = k.shape[0]
    dp = next_pow2(d, 16)
    compute = _compute_dtype(q.dtype, k.dtype)
    if cfg is None and f32_dots.tensor_cores(compute):
        if dp > F32_TENSOR_CORE_MAX_DIM:
            raise NotImplementedError(
                f"indexer scores derivative: f32 inputs with tensor-core dots (f32_dots mode "
                f"'tf32x3') have tiles for D ≤ {F32_TENSOR_CORE_MAX_DIM}, got D {d}; ask for "
                "'highest' or use the reference's derivative"
            )
        cfg = F32_TENSOR_CORE_CONFIG
    cfg = cfg or BackwardConfig()
    multiple = cfg.head_groups * cfg.dq_heads // math.gcd(cfg.head_groups, cfg.dq_heads)
    hp = -(-h // multiple) * multiple
    p = _Plan(
        t=t, s=s, heads=hp, dim=dp, block_t=min(cfg.block_t, next_pow2(t, 16)),
        block_s=min(cfg.block_s, next_pow2(s, 16)), heads_per_group=hp // cfg.head_groups,
        dq_heads=cfg.dq_heads, compute=compute,
    )  # fmt: skip
    # FP8 widened once in memory, not tile by tile after each load (run 232: the FP8
    # kernels took 2.55 ms against bf16's 1.56; a tile widened in registers cannot be
    # streamed into shared memory asynchronously), so the kernels load p.compute
    qp = jnp.pad(q.astype(p.compute), ((0, 0), (0, hp - h), (0, dp - d)))
    wp = jnp.pad(weights, ((0, 0), (0, hp - h)))
    kp = jnp.pad(k.astype(p.compute), ((0, 0), (0, dp - d)))
    scale = jnp.ones((s,), jnp.float32) if k_scale is None else k_scale.astype(jnp.float32)
    g = cotangent.astype(jnp.float32)
    # the operands the kernels read (after widening no 1-byte one is left)
    backend.check_triton_offsets("indexer scores derivative", q=qp, k=kp, cotangent=g)
    n_tb, n_sb = -(-t // p.block_t), -(-s // p.block_s)
    params = plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    inputs = (qp, wp, kp, scale, start, end, g)
    dq, dw = pallas_call(
        functools.partial(_dq_kernel, p=p),
        # heads vary fastest: a query tile's programs share g and q rows
        grid=(hp // cfg.dq_heads, n_tb),
        out_shape=(
            jax.ShapeDtypeStruct((t, hp, dp), jnp.float32),
            jax.ShapeDtypeStruct((t, hp), jnp.float32),
        ),
        compiler_params=params,
        interpret=backend.is_interpret(),
        name="jsparse_indexer_scores_dq",
    )(*inputs)
    first, last = _query_tiles_of_key_tiles(start, end, p)
    dk, dc = pallas_call(
        functools.partial(_dk_kernel, p=p),
        grid=(cfg.head_groups, n_sb),
        out_shape=(
            jax.ShapeDtypeStruct((cfg.head_groups, s, dp), jnp.float32),
            jax.ShapeDtypeStruct((cfg.head_groups, s), jnp.float32),
        ),
        compiler_params=params,
        interpret=backend.is_interpret(),
        name="jsparse_indexer_scores_dk",
    )(*inputs, first, last)
    dc = None if k_scale is None else dc.sum(axis=0)
    return dq[:, :h, :d], dw[:, :h], dk.sum(axis=0)[:, :d], dc
