"""Projected-key scores as a Pallas Triton kernel.

One program scores ``block_s`` tokens of one sequence for every KV head at once. A
token's projected keys for all heads are one contiguous row of ``Hkv·R`` values (the
cache's [B, S, Hkv, R] layout), so the program loads a [block_s, Hkv·R] tile of whole
rows. Widened to f32, the tile is multiplied by the queries and reduced over each
head's R columns (a [block_s, Hkv, R] view, hence R a power of two), and the
[Hkv, block_s] scores are stored. The job is a stream over the cache, so the tile is
sized for bytes in flight (16 KiB), not for arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import pallas_call
from jsparse.ops.indexer.triton import next_pow2

# Bytes of cache one program loads. Runs 160-161: 16 KiB (64 rows of 256 B) is 1-2% ahead
# of 8 and 32 KiB; 64 KiB and up spill the widened tile. Warps (4 or 8) and storing the
# scores along tokens instead of heads changed nothing (3.5-3.7 TB/s).
TILE_BYTES = 16 * 1024
NUM_WARPS = 4
# One [block_s, R] load, row sum and store per KV head instead of the [block_s, Hkv, R]
# view was 2.3× slower (run 172: 292 → 667 µs at 32 × 128K × 8 heads), so the view stays.


@dataclasses.dataclass(frozen=True)
class _Plan:
    seq: int
    kv_heads: int
    heads_pad: int
    rank: int
    block_s: int
    interpret: bool


def supported(rank: int) -> bool:
    """Whether the kernel takes this projected rank (a power of two: the per-head view)."""
    return rank >= 1 and rank & (rank - 1) == 0


def _kernel(q_ref, x_ref, out_ref, *, p: _Plan):
    b, j = pl.program_id(0), pl.program_id(1)
    tokens = j * p.block_s + jnp.arange(p.block_s, dtype=jnp.int32)
    in_seq = tokens < p.seq
    rows = b * p.seq + tokens
    zero = jnp.zeros((), x_ref.dtype)  # (a Python 0 cannot be cast to FP8 here)
    heads = jnp.arange(p.heads_pad, dtype=jnp.int32)
    cols = jnp.arange(p.heads_pad * p.rank, dtype=jnp.int32)
    width = p.kv_heads * p.rank
    q = plt.load(q_ref.at[b, cols], mask=cols < width, other=0.0)  # [Hp·R] f32
    mask = in_seq[:, None] & (cols[None, :] < width)
    x = plt.load(x_ref.at[rows[:, None], cols[None, :]], mask=mask, other=zero)
    prod = x.astype(jnp.float32) * q[None, :]
    if p.heads_pad == 1:
        # One KV head (MLA): reduce the rows as they are. The [BS, 1, R] view costs 5.9×
        # (run 169: 790 against 135 µs at 32 × 128K, R = 128), a layout conversion.
        scores = jnp.sum(prod, axis=1)[:, None]
    else:
        scores = jnp.sum(prod.reshape(p.block_s, p.heads_pad, p.rank), axis=2)  # [BS, Hp]
    out_at = out_ref.at[b * p.kv_heads + heads[None, :], tokens[:, None]]
    plt.store(out_at, scores, mask=in_seq[:, None] & (heads[None, :] < p.kv_heads))


@backend.jit_per_mode(static_argnames=("block_s",))
def projected_scores_triton(q_proj, values, *, block_s: int | None = None):
    """float32 [B, Hkv, S]; see :func:`jsparse.ops.projected.projected_scores`."""
    backend.check_triton_offsets("projected_scores", values=values)
    b, s, hkv, r = values.shape
    hp = next_pow2(hkv, 1)
    row_bytes = hp * r * jnp.dtype(values.dtype).itemsize
    if block_s is None:
        block_s = max(16, min(1024, TILE_BYTES // row_bytes))
        block_s = min(block_s, next_pow2(s, 16))
    p = _Plan(seq=s, kv_heads=hkv, heads_pad=hp, rank=r, block_s=block_s,
              interpret=backend.is_interpret())  # fmt: skip
    q = jnp.pad(q_proj.astype(jnp.float32).reshape(b, hkv * r), ((0, 0), (0, (hp - hkv) * r)))
    out = pallas_call(
        functools.partial(_kernel, p=p),
        grid=(b, pl.cdiv(s, block_s)),
        out_shape=jax.ShapeDtypeStruct((b * hkv, s), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=p.interpret,
        name="jsparse_projected_scores",
    )(q, values.reshape(b * s, hkv * r))
    return out.reshape(b, hkv, s)


# The decode step's projections (`projected_step`): one program per (sequence, KV head)
# averages the head's query heads, applies both maps, scales the query, quantises the key
# and stores it in the cache in place. Walked in chunks of the head dimension (and of
# the query heads); each chunk's loads wait for the last chunk's sums, so the chunks are
# a chain of memory latencies and the fewer the better. Run 191, the kernel alone at
# MLA's 128 heads × 576 (GPU busy µs, any batch): (16, 64) 37, (128, 64) 14.5, (128, 128)
# 10.3 at 4 warps and 9.7-10.4 at 8; GQA's 4 × 128 at one sequence 3.2 → 1.7. Two
# software-pipeline stages changed nothing.
STEP_D_CHUNK = 128
STEP_HEAD_CHUNK = 128
STEP_NUM_WARPS = 8  # the step's own, apart from the scores kernel's NUM_WARPS


@dataclasses.dataclass(frozen=True)
class _StepPlan:
    seq: int
    heads: int  # query heads per KV head
    kv_heads: int
    dim: int
    rank: int
    d_chunk: int
    head_chunk: int
    fp8: bool
    interpret: bool


def _step_kernel(q_ref, k_ref, a_ref, b_ref, scale_ref, slot_ref, _values_in, qp_ref, values_ref,
                 *, p: _StepPlan):  # fmt: skip
    b, h = pl.program_id(0), pl.program_id(1)
    ranks = jnp.arange(p.rank, dtype=jnp.int32)
    lanes = jnp.arange(p.d_chunk, dtype=jnp.int32)
    group = jnp.arange(p.head_chunk, dtype=jnp.int32)
    first_head = (b * p.kv_heads + h) * p.heads  # q is [B·H, D]

    def chunk(c, accs):
        acc_q, acc_k = accs
        dims = c * p.d_chunk + lanes
        in_dim = dims < p.dim

        def add_heads(j, total):
            heads = j * p.head_chunk + group
            ok = (heads < p.heads)[:, None] & in_dim[None, :]
            at = q_ref.at[first_head + heads[:, None], dims[None, :]]
            x = plt.load(at, mask=ok, other=jnp.zeros((), q_ref.dtype))  # (FP8: no Python 0)
            return total + jnp.sum(x.astype(jnp.float32), axis=0)

        n_head_chunks = -(-p.heads // p.head_chunk)
        q_sum = jax.lax.fori_loop(0, n_head_chunks, add_heads, jnp.zeros((p.d_chunk,), jnp.float32))
        q_mean = q_sum / p.heads
        k_at = k_ref.at[b * p.kv_heads + h, dims]
        k_new = plt.load(k_at, mask=in_dim, other=jnp.zeros((), k_ref.dtype))
        tile = jnp.broadcast_to(in_dim[None, :], (p.rank, p.d_chunk))  # R: a power of two
        maps_at = (h * p.rank + ranks[:, None], dims[None, :])
        a = plt.load(a_ref.at[maps_at], mask=tile, other=0.0)
        bm = plt.load(b_ref.at[maps_at], mask=tile, other=0.0)
        acc_q = acc_q + jnp.sum(a * q_mean[None, :], axis=1)
        acc_k = acc_k + jnp.sum(bm * k_new.astype(jnp.float32)[None, :], axis=1)
        return acc_q, acc_k

    zeros = jnp.zeros((p.rank,), jnp.float32)
    acc_q, acc_k = jax.lax.fori_loop(0, -(-p.dim // p.d_chunk), chunk, (zeros, zeros))
    scale = plt.load(scale_ref.at[b * p.kv_heads + h])
    plt.store(qp_ref.at[b * p.kv_heads + h, ranks], acc_q * scale)
    if p.fp8:  # quantize_with_scale: divided by the scale, clipped to e4m3fn's range
        fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
        acc_k = jnp.clip(acc_k / scale, -fmax, fmax)
    slot = plt.load(slot_ref.at[b])
    live = (slot >= 0) & (slot < p.seq)
    # A dead slot stores nothing; its lanes point at row 0 of the sequence, never at
    # another program's row (interpret mode writes masked lanes' old values back).
    row = b * p.seq + jnp.where(live, slot, 0)
    at = values_ref.at[row, h * p.rank + ranks]
    plt.store(at, acc_k.astype(values_ref.dtype), mask=jnp.broadcast_to(live, (p.rank,)))


@backend.jit_per_mode
def projected_step_triton(q, k_new, query_map, key_map, values, scale, slots):
    """(q_proj [B, Hkv, R] f32, values); see :func:`jsparse.ops.projected.projected_step`.
    ``values`` is updated in place when the caller donates it."""
    backend.check_triton_offsets("projected_step", values=values)
    b, s, hkv, r = values.shape
    h, d = q.shape[1], q.shape[2]
    g = h // hkv
    p = _StepPlan(
        seq=s, heads=g, kv_heads=hkv, dim=d, rank=r,
        d_chunk=min(STEP_D_CHUNK, next_pow2(d, 16)),
        head_chunk=min(STEP_HEAD_CHUNK, next_pow2(g, 1)),
        fp8=jnp.dtype(values.dtype) == jnp.dtype(jnp.float8_e4m3fn),
        interpret=backend.is_interpret(),
    )  # fmt: skip
    qp, rows = pallas_call(
        functools.partial(_step_kernel, p=p),
        grid=(b, hkv),
        out_shape=(
            jax.ShapeDtypeStruct((b * hkv, r), jnp.float32),
            jax.ShapeDtypeStruct((b * s, hkv * r), values.dtype),
        ),
        input_output_aliases={6: 1},
        compiler_params=plt.CompilerParams(num_warps=STEP_NUM_WARPS, num_stages=1),
        interpret=p.interpret,
        name="jsparse_projected_step",
    )(
        q.reshape(b * h, d), k_new.reshape(b * hkv, d),
        query_map.astype(jnp.float32).reshape(hkv * r, d),
        key_map.astype(jnp.float32).reshape(hkv * r, d),
        scale.astype(jnp.float32).reshape(b * hkv), slots.astype(jnp.int32),
        values.reshape(b * s, hkv * r),
    )  # fmt: skip
    return qp.reshape(b, hkv, r), rows.reshape(b, s, hkv, r)
