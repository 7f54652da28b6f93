"""The jnp reference of :func:`jsparse.ops.projected.projected_scores`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def projected_scores_reference(
    q_proj: Float[Array, "B Hkv R"], values: Float[Array, "B S Hkv R"]
) -> Float[Array, "B Hkv S"]:
    """``scores[b, h, s] = Σ_r q_proj[b, h, r] · values[b, s, h, r]`` in float32."""
    x = values.astype(jnp.float32)
    return jnp.einsum("bhr,bshr->bhs", q_proj, x, precision=jax.lax.Precision.HIGHEST)
