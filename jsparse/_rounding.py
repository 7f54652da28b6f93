"""Rounding that XLA keeps.

Inside one compiled program XLA may drop the rounding of a conversion pair such as
f32 → bf16 → f32 (``xla_allow_excess_precision``, on by default; its GPU pipeline removes
such pairs, its CPU pipeline does not). Code whose correctness rests on the rounded value
(the certificate's error terms, a simulated FP8 cache) must round through
:func:`round_to`, which puts an optimisation barrier between the conversions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_to(x: jax.Array, dtype) -> jax.Array:
    """``x`` converted to ``dtype``; later conversions see the rounded value, on every
    backend."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    return jax.lax.optimization_barrier(x.astype(dtype))
