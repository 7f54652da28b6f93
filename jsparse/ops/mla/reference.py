"""The jnp reference of indexed MLA decode attention: gather the listed rows, attend.

Each token's cache row is ``[c ; k_r]``: its latent ``c`` (the first ``latent_dim``
values) and its RoPE key ``k_r`` (the rest), shared by every head. With absorbed
queries ``q[b, h] = [W_UKᵀ q_nope ; q_rope]``::

    out[b, h] = Σ_j p_j · c[b, idx_j]
    p         = softmax_j(scale · q[b, h] · [c ; k_r][b, idx_j])

over the non-empty entries ``idx_j`` of ``indices[b]`` (``-1`` = empty; an entry listed
twice counts twice). The output stays in latent space (``W_UV`` comes after). A list
with no entry gives zeros and a log-sum-exp of ``-inf``. All arithmetic is float32 at
full precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jsparse.ops.attention.reference import listed_locations, normalized, softmax_terms


def indexed_mla_attention_reference(
    q: Float[Array, "B H D"],
    cache: Float[Array, "B S D"],
    indices: Int[Array, "B N"],
    latent_dim: int,
    scale: float,
    cache_scale: Float[Array, " B"] | None = None,
    page_table: Int[Array, "B M"] | None = None,
) -> tuple[Float[Array, "B H Dc"], Float[Array, "B H"]]:
    """(out [B, H, latent_dim] float32, lse [B, H] float32); arguments as
    :func:`jsparse.indexed_mla_attention` (already validated)."""
    valid, first, second = listed_locations(indices, cache, page_table)  # [B, N]
    # An empty slot points at row 0; zeroed, so a non-finite row 0 cannot leak in (0·inf).
    rows = jnp.where(valid[..., None], cache[first, second].astype(jnp.float32), 0.0)  # [B, N, D]
    if cache_scale is not None:
        rows = rows * cache_scale[:, None, None]
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bhd,bnd->bhn", q.astype(jnp.float32), rows, precision=hi) * scale
    p, m, denom = softmax_terms(jnp.where(valid[:, None, :], logits, -jnp.inf))
    return normalized(
        jnp.einsum("bhn,bnc->bhc", p, rows[:, :, :latent_dim], precision=hi), m, denom
    )
