"""The jnp reference of indexed decode attention: gather the listed rows, then attend.

Every query head h of sequence b attends the K/V rows that its KV head's list names::

    out[b, h] = Σ_j p_j · v[b, idx_j, h // G]
    p         = softmax_j(scale · q[b, h] · k[b, idx_j, h // G])

over the non-empty entries ``idx_j`` of ``indices[b, h // G]`` (``-1`` = empty; an entry
listed twice counts twice, as attention over the gathered list would). A row with no
entry gives zeros and a log-sum-exp of ``-inf``. All arithmetic is float32 at full
precision, so the kernels are compared with it rather than with each other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def indexed_attention_reference(
    q: Float[Array, "B H D"],
    k: Float[Array, "B S Hkv D"],
    v: Float[Array, "B S Hkv Dv"],
    indices: Int[Array, "B Hkv N"],
    scale: float,
    k_scale: Float[Array, "B Hkv"] | None = None,
    v_scale: Float[Array, "B Hkv"] | None = None,
    page_table: Int[Array, "B M"] | None = None,
) -> tuple[Float[Array, "B H Dv"], Float[Array, "B H"]]:
    """(out [B, H, Dv] float32, lse [B, H] float32); arguments as
    :func:`jsparse.indexed_attention` (indices already validated)."""
    b, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    valid, first, second = listed_locations(indices, k, page_table)  # [B, Hkv, N]
    heads = jnp.arange(hkv)[None, :, None]

    def rows(cache):  # -> [B, Hkv, N, X], the listed rows of each KV head
        return cache[first, second, heads].astype(jnp.float32)

    # An empty slot points at row 0; zeroed, so a non-finite row 0 cannot leak in (0·inf).
    kr, vr = (jnp.where(valid[..., None], rows(c), 0.0) for c in (k, v))
    if k_scale is not None:
        kr = kr * k_scale[:, :, None, None]
    if v_scale is not None:
        vr = vr * v_scale[:, :, None, None]
    qg = q.astype(jnp.float32).reshape(b, hkv, g, d)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bkgd,bknd->bkgn", qg, kr, precision=hi) * scale
    p, m, denom = softmax_terms(jnp.where(valid[:, :, None, :], logits, -jnp.inf))
    out, lse = normalized(jnp.einsum("bkgn,bknd->bkgd", p, vr, precision=hi), m, denom)
    return out.reshape(b, h, -1), lse.reshape(b, h)


def softmax_terms(logits):
    """(p, m, Σp) over the last axis of ``logits`` (-inf where nothing is listed): the
    weights exp(logits - m) under the row's max m, which is 0 for a row with no finite
    or +inf logit (nothing to subtract). A NaN or +inf logit makes p and Σp NaN."""
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(logits - m)
    return p, m, jnp.sum(p, axis=-1, keepdims=True)


def normalized(weighted, m, denom):
    """(out, lse) from Σ p·v, m and Σp of :func:`softmax_terms`: zeros and -inf where
    nothing was attended (Σp = 0); a NaN Σp stays NaN in both, as the kernels leave it."""
    some = denom != 0
    out = jnp.where(some, weighted / jnp.where(some, denom, 1.0), 0.0)
    lse = jnp.where(
        some[..., 0], m[..., 0] + jnp.log(jnp.where(some, denom, 1.0)[..., 0]), -jnp.inf
    )
    return out, lse


def listed_locations(indices: Int[Array, "B ..."], cache, page_table=None):
    """(valid, i0, i1): list entry ``indices[b, ...]`` is ``cache[i0, i1]``, the first
    two axes of a dense ``[B, S, ...]`` cache or of a ``[n_pages, P, ...]`` pool with
    ``page_table`` (token i of sequence b: slot i % P of page ``table[b, i // P]``).
    ``valid``: the entry lies in [0, S) (S = max_pages · P when paged), on a page of the
    pool (a table entry outside [0, n_pages) is no page, as the kernels read it);
    invalid entries point at (b or page 0, slot 0)."""
    lead = jnp.arange(indices.shape[0]).reshape(-1, *[1] * (indices.ndim - 1))
    p = cache.shape[1]
    s = p if page_table is None else page_table.shape[1] * p
    valid = (indices >= 0) & (indices < s)
    at = jnp.where(valid, indices, 0)
    if page_table is None:
        return valid, lead, at
    page = jnp.asarray(page_table)[lead, at // p]  # (a numpy table indexed by traced ids)
    valid = valid & (page >= 0) & (page < cache.shape[0])
    return valid, jnp.where(valid, page, 0), at % p
