"""How DeepSeek-V3.2 prepares the indexer's inputs: a Hadamard rotation and per-row FP8.

``rotate_activation`` spreads each vector's energy over all D dims before the FP8 cast,
so that one large coordinate does not set the scale for the rest; ``act_quant`` with a
block of 128 values gives one scale per key and per (query, head) when D = 128. The
query's scale is folded into the head weights, which the indexer score takes in f32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: Float[Array, "... D"], axis: int = -1):
    """Per-row FP8 e4m3 quantisation with scale amax / 448 (DeepSeek's ``act_quant``).

    Returns (payload float8_e4m3fn, scale float32 with ``axis`` dropped), ``x ≈ payload ·
    scale``; an all-zero row gets scale 1.
    """
    scale = _fp8_scale(x, axis)
    payload = (x / scale).astype(jnp.float8_e4m3fn)
    return payload, jnp.squeeze(scale, axis)


def _fp8_scale(x, axis):
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def quantize_fp8_straight_through(x: Float[Array, "... D"], axis: int = -1):
    """:func:`quantize_fp8` for training: (the payload's values as bfloat16, scale).

    E4M3 values are exact in bfloat16, so the forward values are the FP8 payload's. The
    derivative treats the cast as the identity (a straight-through estimator) and
    carries cotangents in bfloat16. A float8 array on the differentiated path would
    round every cotangent to E4M3 (3 mantissa bits, nothing below 2^-9): an FP8
    indexer's projection gradients then point elsewhere (cosine 0.24 and -0.01 to the
    f32 indexer's on the same data; 0.995 through this, the rest being FP8's forward
    rounding)."""
    scale = _fp8_scale(x, axis)
    scaled = x / scale
    payload = jax.lax.stop_gradient(scaled.astype(jnp.float8_e4m3fn).astype(jnp.bfloat16))
    through = (scaled - jax.lax.stop_gradient(scaled)).astype(jnp.bfloat16)  # 0, derivative 1
    return payload + through, jnp.squeeze(scale, axis)


def hadamard(x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    """Orthonormal Walsh-Hadamard transform of the last axis (``rotate_activation``);
    D must be a power of two. Full f32 precision: a TF32 rotation would round keys
    before their FP8 cast. One dense GEMM, though a butterfly or Kronecker factors do
    fewer FLOPs: each factor is a pass over the whole tensor, and at V3.2's query size
    they were 2-5× slower (WORKSPACE.md, run 237)."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"x: last axis {d}; the Hadamard rotation needs a power of two")
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    rotation = jnp.asarray(h / math.sqrt(d), x.dtype)
    return jnp.matmul(x, rotation, precision=jax.lax.Precision.HIGHEST)
