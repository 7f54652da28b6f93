"""jssa_rd: JSSA's objective solved exactly, with a rate-distortion scoring cache.

Two changes to JSSA (MATH.md §2.1-2.4), each measured on held-out SmolLM2 activations
(WORKSPACE.md, "JSSA selectors"):

1. **The exact minimiser of the selection objective.** JSSA minimises an AM-GM upper
   bound of ``E[(q̄ᵀ(I - P)k)²]`` over shared subspaces ``P = MᵀM``. Allowing the query and
   key maps to differ, ``q̄·k ≈ (A q̄)·(B k)``, the same objective has an exact closed-form
   minimiser, the rank-R SVD of ``G_Q^{1/2} G_K^{1/2}`` (Eckart-Young; the KQ-SVD
   factorisation of §2.7). Of its components the selector keeps the R with the largest
   share of the *centred* score variance, largest first: a key's mean shifts every score
   of a query alike and ranks nothing, so it earns no bits.
   ``maps_kind="shared"`` keeps JSSA's closed-form basis instead (for ablations).

2. **Rate-distortion allocation of the byte budget.** JSSA spends its budget uniformly:
   ``R`` dims × 8 bits. The score variance is far from uniform over components (on
   SmolLM2 the first two carry most of it), and a truncated component costs its whole
   variance while a 4-bit one costs a few percent of it. So, for the same bytes per token,
   the leading ``fp8_dims`` components are stored in FP8 and the next ``int4_dims`` in
   4-bit integers: greedy reverse water-filling (:func:`plan_bit_allocation`) picks the
   split from the calibrated component variances. Every stored coordinate is centred by
   its calibrated mean first: that shifts all scores of a query by one constant (ranking
   unchanged) and keeps the quantisers' range on the part of the key that varies.

Cache per token per KV head: ``fp8_dims + int4_dims / 2`` bytes (int4 packed two per
byte; per-(sequence, KV head) FP8 scale and per-(sequence, KV head, dim) int4 scales are
per-sequence constants). Scales are the amax of the keys given to ``project_keys``, as
for the FP8 cache of the other selectors. int4 has no NaN: a NaN in a key's int4 dims
stores 0 there (its mean), while one in its FP8 dims makes the key's score NaN.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jsparse import _checks
from jsparse.calibration.eigenbasis import jssa_basis
from jsparse.calibration.moments import Moments
from jsparse.selectors.base import (
    HIGHEST,
    ProjectedSelector,
    amax_scale,
    finite_amax,
    fp8_scale,
    quantize_with_scale,
    register,
    write_token_rows,
)
from jsparse.selectors.kq_svd import _fit as _kq_svd_fit
from jsparse.selectors.kq_svd import check_rcond

__all__ = ["JSSARDSelector", "MixedKeys", "component_weights", "plan_bit_allocation"]

_FP8 = jnp.float8_e4m3fn
_INT4_MAX = 7  # symmetric levels -7..7
# Quantisation noise variance relative to the component's variance (MATH: uniform noise,
# step²/12): FP8 e4m3 has 3 mantissa bits (relative step 2^-3, so (2^-4)²/3 of x²);
# int4 with an amax scale has step amax/7, i.e. (kappa/7)²/12 of σ², kappa = amax/σ.
FP8_REL_NOISE = (2.0**-4) ** 2 / 3
MIN_BYTES_PER_TOKEN = 0.5  # one int4 component
EMPTY_CACHE_KAPPA = 4.0  # amax / std of ~8K Gaussian samples (the planner's kappa)


def component_weights(a, b, moments: Moments) -> np.ndarray:
    """``[*L, Hkv, R]`` share of the centred score variance carried by each component:
    ``E[(A q̄)_r²] · Var[(B k)_r]``, normalised to sum to 1 per (layer, KV head). Centred,
    because a key's mean shifts every score of a query by one constant and ranks nothing."""
    return np.asarray(_shares(a, b, moments), np.float64)


def _shares(a, b, moments: Moments) -> Array:
    """:func:`component_weights` in jnp (f32), so that calibration can run under ``jit``."""
    a = jnp.asarray(a, jnp.float32)
    wq = jnp.einsum("...rd,...de,...re->...r", a, moments.gram_q, a, precision=HIGHEST)
    w = jnp.maximum(wq * _key_variance(b, moments), 0.0)
    return w / jnp.maximum(w.sum(axis=-1, keepdims=True), 1e-30)


def _key_variance(b, moments: Moments) -> Array:
    """``Var[(B k)_r]`` ``[*L, Hkv, R]`` of the key map's components (f32)."""
    b = jnp.asarray(b, jnp.float32)
    return jnp.einsum("...rd,...de,...re->...r", b, moments.cov_k, b, precision=HIGHEST)


def plan_bit_allocation(weights, bytes_per_token: float, *, kappa: float = 4.0) -> tuple[int, int]:
    """``(fp8_dims, int4_dims)`` for a budget of ``bytes_per_token``: the split whose
    modelled distortion is least among those a :class:`JSSARDSelector` can apply.

    ``weights [..., R]`` are component variance shares (:func:`component_weights`) in the
    order the selector keeps components (largest first); leading axes are averaged
    (one split for a whole model keeps shapes uniform). A selector of rank
    ``n = fp8 + int4`` keeps the first ``n`` components and stores the ``fp8`` of them
    with the largest shares in FP8 (it orders its components by share), so a split costs
    each (layer, KV head) ``Σ_dropped w + ε8 Σ_FP8 w + ε4 Σ_int4 w``, with ``ε4 =
    (kappa/7)²/12`` the int4 noise of an amax scale and ``ε8`` = :data:`FP8_REL_NOISE`.
    ``kappa`` is a dimension's amax over its standard deviation (≈ 4 for 8K Gaussian
    samples). Every split within the budget is tried (at most R²/2); ties go to fewer
    bytes, then fewer components.
    """
    w = np.asarray(weights, np.float64)
    if w.ndim < 1 or w.shape[-1] < 1 or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(
            f"weights: expected finite shares >= 0 of shape [..., R], R >= 1, got shape "
            f"{w.shape}{'' if w.size == 0 else f' in [{w.min()}, {w.max()}]'}"
        )
    budget = _checks.finite_real(bytes_per_token)
    if budget is None or budget < MIN_BYTES_PER_TOKEN:
        raise ValueError(
            f"bytes_per_token: got {bytes_per_token!r}; expected a finite number >= "
            f"{MIN_BYTES_PER_TOKEN} (one int4 component)"
        )
    if _checks.finite_real(kappa) is None or kappa <= 0:
        raise ValueError(f"kappa: got {kappa!r}; expected a finite number > 0")
    w = w.reshape(-1, w.shape[-1])
    eps4, eps8 = (kappa / _INT4_MAX) ** 2 / 12, FP8_REL_NOISE
    best = None
    for n in range(1, w.shape[1] + 1):
        kept = -np.sort(-w[:, :n], axis=1)  # the first n, largest first: FP8 takes a prefix
        top = np.concatenate([np.zeros((w.shape[0], 1)), np.cumsum(kept, axis=1)], axis=1)
        fp8 = np.arange(n + 1)
        cost = (w[:, n:].sum(1)[:, None] + eps8 * top + eps4 * (top[:, -1:] - top)).mean(0)
        spent = fp8 + (n - fp8) / 2
        for f in np.flatnonzero(spent <= budget):
            key = (cost[f], spent[f], n)
            if best is None or key < best[0]:
                best = (key, int(f), int(n - f))
    return best[1], best[2]


class MixedKeys(NamedTuple):
    """The rate-distortion scoring cache of :class:`JSSARDSelector`."""

    high: Array  # [B, S, Hkv, fp8_dims] float8_e4m3fn
    high_scale: Float[Array, "B Hkv"]
    low: Array  # [B, S, Hkv, int4_dims] int4
    low_scale: Float[Array, "B Hkv R4"]


@register
@dataclasses.dataclass(frozen=True)
class JSSARDSelector(ProjectedSelector):
    """Per-KV-head selection with the group-mean query, exact-objective maps and a
    mixed FP8 / int4 projected-key cache (see the module docstring).

    Options: ``fp8_dims`` and ``int4_dims`` (``rank`` = their sum is derived and must not
    be passed differently), ``maps_kind`` (``"exact"`` or ``"shared"``), ``rcond``. The
    default split (3 + 26 = 16 bytes per token) is what :meth:`planned` gives on SmolLM2's
    calibration moments at 16 bytes; plan your own for another model or budget.
    Params: ``query_map``, ``key_map`` ``[Hkv, R, D]``, ``key_offset [Hkv, R]`` and
    ``key_spread [Hkv, R]`` (the calibrated standard deviation of each stored component).
    """

    fp8_dims: int = 3
    int4_dims: int = 26
    maps_kind: str = "exact"
    rcond: float = 1e-6
    rank: int = 0  # derived: fp8_dims + int4_dims
    cache_dtype: str = "mixed"

    name: ClassVar[str] = "jssa_rd"

    def __post_init__(self):
        for field in ("fp8_dims", "int4_dims"):
            value = getattr(self, field)
            if not _checks.is_int(value):
                raise ValueError(f"jssa_rd: {field} must be an int, got {value!r}")
        check_rcond(self.rcond)
        if self.fp8_dims < 0 or self.int4_dims < 0 or self.fp8_dims + self.int4_dims < 1:
            raise ValueError(
                f"jssa_rd: need fp8_dims, int4_dims >= 0 and a positive total, got "
                f"{self.fp8_dims=}, {self.int4_dims=}"
            )
        total = self.fp8_dims + self.int4_dims
        if self.rank not in (0, total):
            raise ValueError(f"jssa_rd: rank is fp8_dims + int4_dims = {total}, got {self.rank}")
        object.__setattr__(self, "rank", total)
        if self.cache_dtype != "mixed":
            raise ValueError(f"jssa_rd: cache_dtype is always 'mixed', got {self.cache_dtype!r}")
        if self.maps_kind not in ("exact", "shared"):
            raise ValueError(
                f"jssa_rd: maps_kind must be 'exact' or 'shared', got {self.maps_kind!r}"
            )

    def bytes_per_token(self, head_dim: int) -> float:
        return self.fp8_dims + self.int4_dims / 2

    @classmethod
    def planned(
        cls,
        moments: Moments,
        bytes_per_token: float,
        *,
        maps_kind: str = "exact",
        kappa: float = 4.0,
        rcond: float = 1e-6,
    ) -> JSSARDSelector:
        """The selector whose FP8 / int4 split :func:`plan_bit_allocation` chooses for
        ``bytes_per_token`` from calibration ``moments`` (any leading axes: one split)."""
        selector = cls(fp8_dims=1, int4_dims=0, maps_kind=maps_kind, rcond=rcond)
        fitted = selector._fit_by_share(moments)  # what every rank keeps a prefix of
        weights = component_weights(fitted["query_map"], fitted["key_map"], moments)
        fp8, int4 = plan_bit_allocation(weights, bytes_per_token, kappa=kappa)
        return cls(fp8_dims=fp8, int4_dims=int4, maps_kind=maps_kind, rcond=rcond)

    def calibrate_from_moments(self, moments: Moments):
        d = moments.gram_q.shape[-1]
        if self.rank > d:
            raise ValueError(f"jssa_rd: rank {self.rank} exceeds head_dim {d}")
        params = {name: m[..., : self.rank, :] for name, m in self._fit_by_share(moments).items()}
        b = params["key_map"]
        params["key_offset"] = jnp.einsum("...rd,...d->...r", b, moments.mean_k, precision=HIGHEST)
        params["key_spread"] = jnp.sqrt(jnp.maximum(_key_variance(b, moments), 0.0))
        return params

    def _fit_by_share(self, moments: Moments) -> dict:
        """All ``D`` components of the fit, largest centred share first.

        The fit orders them by raw second moments, where a key's mean (large in real
        models' keys) can lead while it ranks nothing; by their centred share, the kept
        ``rank`` components and the FP8 ones among them (the leading ``fp8_dims``) are
        those that rank keys the most."""
        d = moments.gram_q.shape[-1]
        if self.maps_kind == "exact":
            maps = dict(_kq_svd_fit(moments.gram_q, moments.gram_k, d, self.rcond))
        else:
            basis = jssa_basis(moments, d)
            maps = {"query_map": basis, "key_map": basis}
        order = jnp.argsort(-_shares(maps["query_map"], maps["key_map"], moments), axis=-1)
        return {name: jnp.take_along_axis(m, order[..., None], axis=-2) for name, m in maps.items()}

    def maps(self, params):
        if "key_offset" not in params:  # the cache is centred by it
            raise KeyError("key_offset")  # checked_maps turns it into a ValueError
        return params["query_map"], params["key_map"]

    def project_keys(self, params, k, *, headroom: float = 1.0) -> MixedKeys:
        """The mixed cache; ``headroom`` widens the FP8 scale only (see
        :meth:`ProjectedSelector.project_keys`): int4 levels are uniform, so a wider
        int4 range would cost resolution on every key, and appended keys clip instead."""
        x = self._centred(params, k)
        hi, lo = x[..., : self.fp8_dims], x[..., self.fp8_dims :]
        hi_scale = fp8_scale(hi, headroom)  # [B, Hkv]
        lo_scale = amax_scale(finite_amax(lo, axis=1), _INT4_MAX)  # [B, Hkv, R4]
        return self._quantize(x, hi_scale, lo_scale)

    def _centred(self, params, k):
        proj = self._project(params, k)  # [B, S, Hkv, R]
        return proj - params["key_offset"]  # centred: a per-query constant shift

    def _quantize(self, x, hi_scale, lo_scale) -> MixedKeys:
        """``x`` ([B, S, Hkv, R], centred) in the mixed format with the given scales."""
        hi, lo = x[..., : self.fp8_dims], x[..., self.fp8_dims :]
        high = quantize_with_scale(hi, hi_scale, "float8_e4m3fn")
        low = jnp.clip(jnp.round(lo / lo_scale[:, None]), -_INT4_MAX, _INT4_MAX).astype(jnp.int4)
        return MixedKeys(high, hi_scale, low, lo_scale)

    def empty_cache(self, params, batch: int, slots: int) -> MixedKeys:
        """A zero cache; FP8 scale 1 as every selector's, int4 scales from calibration.

        int4 levels are uniform, so scale 1 (a step of 1 whatever the component's spread)
        would store most of a small component as 0 for a whole decode that starts here
        (a one-token prompt): the scales are :data:`EMPTY_CACHE_KAPPA` calibrated
        standard deviations (``key_spread``) over 7 instead, as an amax of as many
        tokens would give. Bases saved without ``key_spread`` keep scale 1."""
        hkv = params["key_map"].shape[0]
        spread = params.get("key_spread")
        if spread is None:
            low_scale = jnp.ones((hkv, self.int4_dims), jnp.float32)
        else:
            low_scale = amax_scale(EMPTY_CACHE_KAPPA * spread[:, self.fp8_dims :], _INT4_MAX)
        return MixedKeys(
            jnp.zeros((batch, slots, hkv, self.fp8_dims), _FP8),
            jnp.ones((batch, hkv), jnp.float32),
            jnp.zeros((batch, slots, hkv, self.int4_dims), jnp.int4),
            jnp.broadcast_to(low_scale, (batch, hkv, self.int4_dims)).astype(jnp.float32),
        )

    def append_keys(self, params, cache: MixedKeys, k_new, slots) -> MixedKeys:
        self._check_append(params, cache, k_new, slots)
        x = self._centred(params, k_new[:, None])  # [B, 1, Hkv, R]
        row = self._quantize(x, cache.high_scale, cache.low_scale)
        return cache._replace(
            high=write_token_rows(cache.high, row.high[:, 0], slots),
            low=write_token_rows(cache.low, row.low[:, 0], slots),
        )

    def dequantize(self, params, cache: MixedKeys) -> Float[Array, "B S Hkv R"]:
        """The cached projection in f32 (offset added back)."""
        hi = cache.high.astype(jnp.float32) * cache.high_scale[:, None, :, None]
        lo = cache.low.astype(jnp.float32) * cache.low_scale[:, None]
        return jnp.concatenate([hi, lo], axis=-1) + params["key_offset"][None, None]

    def scores_projected(self, params, q, cache: MixedKeys):
        qp = self.project_queries(params, q)
        return jnp.einsum("bhr,bshr->bhs", qp, self.dequantize(params, cache), precision=HIGHEST)
