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


@functools.partial(jax.jit, static_argnames=("block_s",))
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
    out = pl.pallas_call(
        functools.partial(_kernel, p=p),
        grid=(b, pl.cdiv(s, block_s)),
        out_shape=jax.ShapeDtypeStruct((b * hkv, s), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=p.interpret,
        name="jsparse_projected_scores",
    )(q, values.reshape(b * s, hkv * r))
    return out.reshape(b, hkv, s)
