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


# Keys narrower than f32 are widened before the product. A prefill's cache widened at
# once would take 2-4x its own size (16 GiB for 32 x 128K x 8 x 128 BF16 keys, more than
# an 80 GB card has left beside the cache), so above this many elements the rows are
# projected a slice at a time: 1 GiB of f32 at most.
WIDEN_AT_ONCE = 1 << 28


def key_projection(
    k: Float[Array, "*N Hkv D"],
    key_map: Float[Array, "Hkv R D"],
    *,
    widen_at_once: int = WIDEN_AT_ONCE,
):
    """``B k`` [..., Hkv, R] in f32 (keys of another dtype widened ``widen_at_once``
    elements at a time at most)."""
    if k.dtype == jnp.float32 or k.size <= widen_at_once:
        return _key_projection(k, key_map)
    hkv, d = k.shape[-2:]
    rows = k.reshape(-1, hkv, d)
    n, rank = rows.shape[0], key_map.shape[1]
    chunk = max(1, widen_at_once // (hkv * d))

    def project_slice(i, out):
        # The last slice starts early instead of running past the end: the rows it
        # repeats get the same values again.
        start = jnp.minimum(i * chunk, n - chunk)
        part = jax.lax.dynamic_slice_in_dim(rows, start, chunk)
        return jax.lax.dynamic_update_slice_in_dim(out, _key_projection(part, key_map), start, 0)

    out = jnp.zeros((n, hkv, rank), jnp.float32)
    out = jax.lax.fori_loop(0, -(-n // chunk), project_slice, out)
    return out.reshape(*k.shape[:-2], hkv, rank)


def _key_projection(k, key_map):
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
