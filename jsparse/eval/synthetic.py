"""Synthetic post-RoPE activations with the structure real ones have, for tests only.

Low-rank-plus-noise queries and keys per KV head (a decaying spectrum, a shared key mean
offset, query heads of a group correlated with each other), then rotate-half RoPE at the
token positions. Good enough to exercise calibration and selection maths; recall measured
on this data says nothing about a real model and is never reported as a result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["apply_rope", "synthetic_qkv"]


def apply_rope(
    x: Float[Array, "T N D"], positions: Float[Array, " T"], theta: float = 1e5
) -> Float[Array, "T N D"]:
    """Rotate-half RoPE: dims ``i`` and ``i + D/2`` form a pair rotating at ``theta**(-2i/D)``."""
    d = x.shape[-1]
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = positions.astype(jnp.float32)[:, None] * freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@functools.partial(
    jax.jit,
    static_argnames=("n_tokens", "n_heads", "n_kv_heads", "head_dim", "latent", "noise", "theta"),
)
def synthetic_qkv(
    key: jax.Array,
    n_tokens: int,
    *,
    n_heads: int = 9,
    n_kv_heads: int = 3,
    head_dim: int = 64,
    latent: int = 12,
    noise: float = 0.3,
    start: int | jax.Array = 0,
    theta: float = 1e5,
) -> tuple[Float[Array, "T H D"], Float[Array, "T Hkv D"], Float[Array, "T Hkv D"]]:
    """``(q, k, v)`` for ``n_tokens`` consecutive positions starting at ``start``.

    The structure (projection matrices, means) depends only on ``key``'s first split, so
    two calls with the same ``key`` and different ``start`` give the same "model" on
    different "text".
    """
    g = n_heads // n_kv_heads
    k_model, k_data = jax.random.split(key)
    km = jax.random.split(k_model, 6)
    decay = 1.0 / (1.0 + jnp.arange(latent, dtype=jnp.float32))  # decaying spectrum
    w_k = jax.random.normal(km[0], (n_kv_heads, latent, head_dim)) * decay[:, None]
    w_q = jax.random.normal(km[1], (n_kv_heads, latent, head_dim)) * decay[:, None]
    w_q_heads = w_q[:, None] + 0.3 * jax.random.normal(km[2], (n_kv_heads, g, latent, head_dim))
    mean_k = 1.5 * jax.random.normal(km[3], (n_kv_heads, head_dim)) / jnp.sqrt(head_dim) * 4
    mean_q = 0.5 * jax.random.normal(km[4], (n_kv_heads, head_dim)) / jnp.sqrt(head_dim) * 4
    w_v = jax.random.normal(km[5], (n_kv_heads, latent, head_dim)) / jnp.sqrt(latent)

    kd = jax.random.split(jax.random.fold_in(k_data, start), 5)
    z_k = jax.random.normal(kd[0], (n_tokens, n_kv_heads, latent))
    z_q = 0.7 * z_k + 0.7 * jax.random.normal(kd[1], (n_tokens, n_kv_heads, latent))
    k = jnp.einsum("thl,hld->thd", z_k, w_k) + mean_k
    k = k + noise * jax.random.normal(kd[2], k.shape)
    q = jnp.einsum("thl,hgld->thgd", z_q, w_q_heads) + mean_q[:, None, :]
    q = q.reshape(n_tokens, n_heads, head_dim)
    q = q + noise * jax.random.normal(kd[3], q.shape)
    v = jnp.einsum("thl,hld->thd", z_k, w_v) + 0.5 * jax.random.normal(kd[4], k.shape)
    positions = start + jnp.arange(n_tokens)  # start may be traced
    return apply_rope(q, positions, theta), apply_rope(k, positions, theta), v


def write_synthetic_capture(
    out_dir,
    key: jax.Array,
    n_tokens: int,
    *,
    n_layers: int = 2,
    start: int = 0,
    n_heads: int = 9,
    n_kv_heads: int = 3,
    head_dim: int = 64,
) -> None:
    """A capture directory in the real captures' format, from :func:`synthetic_qkv`
    (layer ``l`` uses ``fold_in(key, l)``). For tests and smoke runs of the CLIs only."""
    import json
    from pathlib import Path

    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": "synthetic",
        "novel": "synthetic",
        "offset": start,
        "n_tokens": n_tokens,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "rope_theta": 1e5,
        "dtype": "float32",
    }
    (out / "meta.json").write_text(json.dumps(meta))
    for layer in range(n_layers):
        q, k, v = synthetic_qkv(
            jax.random.fold_in(key, layer),
            n_tokens,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            start=start,
        )
        np.savez(out / f"layer_{layer:02d}.npz", q=np.asarray(q), k=np.asarray(k), v=np.asarray(v))
