"""QUEST: page-level selection from per-channel key bounds (MATH.md §2.7)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jsparse.selectors.base import CACHE_DTYPES, Selector, amax_scale, finite_amax, register

__all__ = ["QuestSelector", "page_bounds", "page_metadata"]

# Unit roundoff of the metadata dtypes, for rounding bounds outward (see page_metadata).
_UNIT_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-8, "float8_e4m3fn": 2.0**-4}


def page_metadata(
    k: Float[Array, "B S Hkv D"], lengths: Int[Array, " B"], page_size: int, dtype: str = "float32"
) -> tuple[Float[Array, "B P Hkv D"], Float[Array, "B P Hkv D"]]:
    """Per page and channel, the min and max of the visible keys (``P = ceil(S / page)``).

    Pages with no visible token get ``min = +inf, max = -inf``. Rounded metadata
    (``bfloat16``, ``float8_e4m3fn``) is widened before rounding so the stored min never
    exceeds the true min and the stored max is never below the true max; FP8 uses one
    scale per (sequence, KV head) and an absolute margin for its subnormal range.
    """
    b, s, hkv, d = k.shape
    n_pages = -(-s // page_size)
    pad = n_pages * page_size - s
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    kp = kp.reshape(b, n_pages, page_size, hkv, d)
    # Pages before the one holding the last visible token are complete: their min/max do
    # not depend on ``lengths`` (under vmap over queries they are computed once). Only
    # the last visible page is reduced over its visible tokens; later pages are empty.
    in_range = (jnp.arange(n_pages * page_size) < s).reshape(1, n_pages, page_size, 1, 1)
    full_lo = jnp.where(in_range, kp, jnp.inf).min(axis=2)
    full_hi = jnp.where(in_range, kp, -jnp.inf).max(axis=2)
    last = (lengths - 1) // page_size  # [B]; -1 when nothing is visible
    tail = jnp.take_along_axis(kp, jnp.clip(last, 0)[:, None, None, None, None], axis=1)[:, 0]
    tail_pos = jnp.clip(last, 0)[:, None] * page_size + jnp.arange(page_size)[None, :]
    tail_ok = (tail_pos < lengths[:, None])[:, :, None, None]  # [B, page, 1, 1]
    tail_lo = jnp.where(tail_ok, tail, jnp.inf).min(axis=1)  # [B, Hkv, D]
    tail_hi = jnp.where(tail_ok, tail, -jnp.inf).max(axis=1)
    page = jnp.arange(n_pages)[None, :, None, None]
    last_b = last[:, None, None, None]
    lo = jnp.where(page < last_b, full_lo, jnp.where(page == last_b, tail_lo[:, None], jnp.inf))
    hi = jnp.where(page < last_b, full_hi, jnp.where(page == last_b, tail_hi[:, None], -jnp.inf))
    if dtype == "float32":
        return lo, hi
    u = _UNIT_ROUNDOFF[dtype]
    store, _ = CACHE_DTYPES[dtype]
    scale = jnp.ones((b, 1, hkv, 1), jnp.float32)
    margin = 0.0
    if dtype == "float8_e4m3fn":
        fmax = float(jnp.finfo(store).max)
        amax = jnp.maximum(finite_amax(hi, axis=(1, 3)), finite_amax(lo, axis=(1, 3)))
        scale = amax_scale(amax, 0.5 * fmax)[:, None, :, None]  # headroom for the widening
        margin = 2.0**-9  # the smallest e4m3fn subnormal

    def widen(x, direction):
        y = x / scale
        y = y + direction * (2 * u * jnp.abs(y) + margin)
        y = y.astype(store).astype(jnp.float32) * scale
        # ±inf (an empty page's marker, or a non-finite key) as they were: FP8 has no inf
        return jnp.where(jnp.isfinite(x), y, x)

    return widen(lo, -1.0), widen(hi, 1.0)


def page_bounds(
    q: Float[Array, "B Hkv D"], lo: Float[Array, "B P Hkv D"], hi: Float[Array, "B P Hkv D"]
) -> Float[Array, "B Hkv P"]:
    """``Σ_d max(q_d m_d, q_d M_d)`` ≥ ``q·k`` for every key ``k`` of the page; -inf for
    a page with no visible key (``page_metadata``'s min = +inf, max = -inf). A page
    holding a non-finite key gets the bound its arithmetic gives (+inf, or NaN, which
    ranks first as a NaN score does), not the empty page's -inf."""
    empty = ((lo == jnp.inf) & (hi == -jnp.inf)).all(axis=-1)  # [B, P, Hkv]
    lo_t = jnp.where(empty[..., None], 0.0, lo)  # no 0·inf on an empty page
    hi_t = jnp.where(empty[..., None], 0.0, hi)
    bound = jnp.maximum(q[:, None] * lo_t, q[:, None] * hi_t).sum(axis=-1)  # [B, P, Hkv]
    return jnp.swapaxes(jnp.where(empty, -jnp.inf, bound), 1, 2)


@register
@dataclasses.dataclass(frozen=True)
class QuestSelector(Selector):
    """Pages of ``page_size`` tokens ranked by their bound on ``q̄·k``; best pages first.

    The token order is: pages by bound descending (ties: earlier page first), tokens of a
    page in position order; the first ``budget`` visible tokens of that order are
    returned, so a budget that is not a multiple of the page size cuts the last page.
    Per KV head with the group-mean query, like every per-KV-head selector here.
    Memory: ``2 · D`` values per page, i.e. ``2 · D · bytes(dtype) / page_size`` bytes per
    token per KV head (16 B for D = 64, page 16, bfloat16: the same as JSSA at r = 16 in
    FP8). No calibration.
    """

    page_size: int = 16
    cache_dtype: str = "bfloat16"

    name: ClassVar[str] = "quest"

    def __post_init__(self):
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"cache_dtype: got {self.cache_dtype!r}; expected one of {sorted(CACHE_DTYPES)}"
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size: expected an int >= 1, got {self.page_size!r}")

    def bytes_per_token(self, head_dim: int) -> float:
        return 2 * head_dim * CACHE_DTYPES[self.cache_dtype][1] / self.page_size

    def scores(self, params, q, k, lengths):
        hkv = k.shape[2]
        qm = q.astype(jnp.float32).reshape(q.shape[0], hkv, -1, q.shape[-1]).mean(axis=2)
        lo, hi = page_metadata(k, lengths, self.page_size, self.cache_dtype)
        bounds = page_bounds(qm, lo, hi)  # [B, Hkv, P]
        # Every token carries its page's bound; top_k's lowest-index-first tie rule then
        # yields whole pages in bound order, tokens in position order.
        return jnp.repeat(bounds, self.page_size, axis=-1)[..., : k.shape[1]]
