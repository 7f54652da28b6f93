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


def query_projection(q: Float[Array, "B H D"], query_map: Float[Array, "Hkv R D"]):
    """``A q̄`` [B, Hkv, R] in f32, ``q̄`` the mean of each KV head's query heads."""
    hkv = query_map.shape[0]
    qm = q.astype(jnp.float32).reshape(q.shape[0], hkv, -1, q.shape[-1]).mean(axis=2)
    return jnp.einsum("bhd,hrd->bhr", qm, query_map, precision=jax.lax.Precision.HIGHEST)


def key_projection(k: Float[Array, "*N Hkv D"], key_map: Float[Array, "Hkv R D"]):
    """``B k`` [..., Hkv, R] in f32."""
    x = k.astype(jnp.float32)
    return jnp.einsum("...hd,hrd->...hr", x, key_map, precision=jax.lax.Precision.HIGHEST)


def projected_step_reference(q, k_new, query_map, key_map, values, scale, slots):
    """(:func:`query_projection` times ``scale`` [B, Hkv, R] f32; ``values`` with
    sequence b's slot ``slots[b]`` holding :func:`key_projection` of ``k_new[b]``,
    quantised with ``scale``): a projected selector's decode step, its
    ``project_queries`` times the cache's scales and its ``append_keys``."""
    from jsparse.selectors.base import quantize_with_scale, write_token_rows  # (a cycle)

    qp = query_projection(q, query_map) * scale[:, :, None]
    row = quantize_with_scale(key_projection(k_new, key_map), scale, jnp.dtype(values.dtype).name)
    return qp, write_token_rows(values, row, slots)
