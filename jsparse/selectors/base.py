"""One interface for every token selector, and the registry.

Per layer::

    sel = make_selector("jssa", rank=16)                  # any name in SELECTORS
    params = sel.calibrate(q_calib, k_calib)              # [N, H, D], [N, Hkv, D] post-RoPE
    idx = sel.select(params, q, k, lengths, budget)       # q [B, H, D], k [B, S, Hkv, D],
                                                          # lengths [B] -> int32 [B, Hkv, budget]

Streaming calibration over many sequences (one pass feeds every selector)::

    state = sel.calibration_state(n_kv_heads, head_dim)
    for q, k in chunks:
        state = sel.update(state, q, k)
    params = sel.finalize(state)          # == sel.calibrate_from_moments(finalize_moments(state))

Contract of ``select``:

* ``idx[b, h]`` lists ``min(budget, lengths[b])`` distinct token positions in
  ``[0, lengths[b])`` for KV head ``h``, best first (score descending, then position
  ascending: deterministic ties), then ``-1`` in the empty slots. Tokens at or beyond
  ``lengths[b]`` are never selected. With ``budget >= lengths[b]`` every visible token is
  returned. ``full`` is the one exception on width: it returns all ``S`` positions.
* ``budget`` is static (one compilation per budget); everything else can be traced, so
  ``jax.jit(sel.select, static_argnames="budget")`` and ``jax.vmap`` work.
* Selectors with a projected-key cache (jssa, jssa_*, loki, fasa, kq_svd, head_shared)
  also expose ``project_keys(params, k) -> ProjectedKeys`` (the cache as stored, in
  ``cache_dtype``) and ``select_projected(params, q, cache, lengths, budget)``. For
  decoding, ``empty_cache(params, batch, slots)`` allocates one and
  ``append_keys(params, cache, k_new, slots)`` writes one token's projection per
  sequence with the cache's existing scales, so a step never re-projects the context;
  ``decode_step(params, q, cache, k_new, slots, lengths, budget)`` is the two in turn
  (their projections in one kernel, for selectors that only calibrate other maps,
  where :func:`fused_step_pays`).
  ``bytes_per_token(head_dim)`` is the scoring-side memory per token per KV head, the
  quantity "equal memory" compares.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jsparse import _checks, backend
from jsparse._rounding import round_to
from jsparse.calibration.moments import (
    Moments,
    MomentState,
    compute_moments,
    finalize_moments,
    init_moments,
    update_moments,
)
from jsparse.ops.projected import projected_scores, projected_step
from jsparse.ops.projected.reference import key_projection, query_projection
from jsparse.ops.topk.codes import canonical_scores

__all__ = [
    "CACHE_DTYPES",
    "DEFAULT_SELECTOR",
    "SELECTORS",
    "ProjectedKeys",
    "ProjectedSelector",
    "Selector",
    "make_selector",
    "register",
    "top_budget",
]

Params = dict[str, Array]
HIGHEST = jax.lax.Precision.HIGHEST
# A decode step's projections (the query's, times the cache's scales, and the new key's
# into the cache) in one Pallas launch (`projected_step`) instead of XLA's three to five
# small fusions (run 179: a dot, a concatenate, transposes, the cache write). One
# program a (sequence, KV head) averages its G query heads of D values in chunks that
# wait on each other. Run 191, GPU busy µs of the whole step against the unfused one
# (run 189): GQA (G·D = 512) −0.9 / −1.4 at one sequence (32K / 128K), −2.7 / −3 at 8,
# −2 / −3 at 32; MLA (one KV head, G·D = 128 × 576) +4 to +10 at every batch, its
# kernel 16-20 µs in the step against ~7-14 of XLA glue (+7 at 16 heads).
# None: on where each program averages at most FUSED_STEP_MAX_QUERY_VALUES; True /
# False: always / never.
FUSED_STEP: bool | None = None
FUSED_STEP_MAX_QUERY_VALUES = 4096


def fused_step_pays(q_shape, kv_heads: int) -> bool:
    """Whether a decode step of queries ``q_shape`` [B, H, D] over ``kv_heads`` KV heads
    takes ``projected_step`` (``FUSED_STEP``)."""
    if FUSED_STEP is not None:
        return bool(FUSED_STEP)
    _, h, d = q_shape
    return (h // kv_heads) * d <= FUSED_STEP_MAX_QUERY_VALUES


# name -> (dtype, bytes per value). FP8 is the paper's default scoring cache (App. E.2).
CACHE_DTYPES: dict[str, tuple[Any, int]] = {
    "float8_e4m3fn": (jnp.float8_e4m3fn, 1),
    "bfloat16": (jnp.bfloat16, 2),
    "float32": (jnp.float32, 4),
}

SELECTORS: dict[str, type[Selector]] = {}

# The best selector at equal scoring memory on held-out real activations (WORKSPACE.md,
# "JSSA selectors"); the paper's method stays available, unchanged, as "jssa".
DEFAULT_SELECTOR = "jssa_rd"


def register(cls: type[Selector]) -> type[Selector]:
    """Class decorator: adds a selector class to :data:`SELECTORS` under ``cls.name``."""
    if cls.name in SELECTORS:
        raise ValueError(f"selector {cls.name!r} is already registered")
    SELECTORS[cls.name] = cls
    return cls


def make_selector(name: str = DEFAULT_SELECTOR, **config: Any) -> Selector:
    """The selector called ``name`` (default :data:`DEFAULT_SELECTOR`) with its
    configuration (see each class for options)."""
    try:
        cls = SELECTORS[name]
    except KeyError:
        raise ValueError(f"name: unknown selector {name!r}; known: {sorted(SELECTORS)}") from None
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(
            f"selector {name!r}: unknown option(s) {unknown}; options: {sorted(fields)}"
        )
    return cls(**config)


class ProjectedKeys(NamedTuple):
    """A projected-key scoring cache: ``values * scale[:, None, :, None]`` ≈ the f32 projection."""

    values: Array  # [B, S, Hkv, R] in the cache dtype
    scale: Float[Array, "B Hkv"]  # f32; 1 for bfloat16 / float32 caches


def _selection_kernels() -> bool:
    """Whether :func:`top_budget` selects with the Pallas kernels (GPU or interpret mode)."""
    from jsparse import backend

    return backend.has_nvidia_gpu() or backend.is_interpret()


def top_budget(
    scores: Float[Array, "B Hkv S"], lengths: Int[Array, " B"], budget: int, *,
    ordered: bool = True,
) -> Int[Array, "B Hkv budget"]:  # fmt: skip
    """Top-``budget`` positions per row, invisible tokens masked, ``-1`` padded, in the
    order score descending, then position ascending (deterministic ties).

    On an NVIDIA GPU (or in Pallas interpret mode) this is
    :func:`jsparse.ops.topk.topk_prefix`, the indexer's exact selection kernels, which
    keep that order; elsewhere
    ``jax.lax.top_k``, which returns equal scores lowest index first. Both give the same
    positions (scores ranked as the kernels rank them: -0 as +0, every NaN above +inf);
    ``lax.top_k`` sorts every row, the kernels do not.
    ``ordered=False``: the same positions in the kernels' own order (mostly ascending
    position), without their final sort: for a consumer that does not care, such as
    attention over the lists.
    """
    b, hkv, s = scores.shape
    if _selection_kernels() and b * hkv > 0:
        from jsparse.ops.topk import topk_prefix  # Pallas imports only when used

        rows = scores.reshape(b * hkv, s).astype(jnp.float32)
        lengths = lengths.astype(jnp.int32)  # clipped to [0, S] by the kernels
        idx, _ = topk_prefix(rows, lengths, budget, sorted=ordered, implementation="triton")
        return idx.reshape(b, hkv, budget)
    pos = jnp.arange(s, dtype=jnp.int32)
    visible = pos[None, None, :] < lengths[:, None, None]
    masked = jnp.where(visible, canonical_scores(scores), -jnp.inf)
    kk = min(budget, s)
    _, idx = jax.lax.top_k(masked, kk)
    idx = idx.astype(jnp.int32)
    idx = jnp.where(idx < lengths[:, None, None], idx, -1)
    if budget > s:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, budget - s)), constant_values=-1)
    return idx


def check_select_inputs(q, k, lengths, budget, *, head_dim: int | None = None) -> None:
    """Shape and value checks shared by every selector (values only when concrete)."""
    _checks.check_rank("q", q, 3, "[B, H, D]")
    _checks.check_rank("k", k, 4, "[B, S, Hkv, D]")
    _checks.check_rank("lengths", lengths, 1, "[B]")
    _checks.check_floating("q", q)
    _checks.check_floating("k", k)
    _checks.check_dim("k", k, 0, q.shape[0], "batch B of q")
    _checks.check_dim("k", k, 3, q.shape[2], "head_dim D of q")
    _checks.check_dim("lengths", lengths, 0, q.shape[0], "batch B of q")
    if head_dim is not None:
        _checks.check_dim("q", q, 2, head_dim, "head_dim of the calibrated params")
    if q.shape[1] % k.shape[2]:
        raise ValueError(
            f"q has {q.shape[1]} query heads, not a multiple of the {k.shape[2]} KV heads of "
            f"k (q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})"
        )
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths: expected an integer dtype, got {lengths.dtype}")
    if (
        not _checks.is_int(budget)
        or not 1 <= budget <= _checks.INT32_MAX
    ):  # fmt: skip
        raise ValueError(f"budget: expected a static int in [1, 2^31 - 1], got {budget!r}")
    values = _checks.concrete(lengths)
    if values is not None and ((values < 0).any() or (values > k.shape[1]).any()):
        raise ValueError(f"lengths: every entry must be in [0, S={k.shape[1]}], got {values}")


@dataclasses.dataclass(frozen=True)
class Selector:
    """Base class. Subclasses set ``name`` and implement ``scores`` (and calibration)."""

    name: ClassVar[str] = ""
    calibrated: ClassVar[bool] = False  # whether calibrate() learns anything

    # --- calibration -------------------------------------------------------------------
    def calibration_state(self, n_kv_heads: int, head_dim: int) -> MomentState:
        """An empty streaming accumulator (the same one for every selector)."""
        return init_moments(n_kv_heads, head_dim)

    def update(self, state: MomentState, q: Float[Array, "N H D"], k: Float[Array, "N Hkv D"]):
        """Adds a chunk of post-RoPE calibration queries and keys to ``state``."""
        return update_moments(state, q, k)

    def finalize(self, state: MomentState) -> Params:
        return self.calibrate_from_moments(finalize_moments(state))

    def calibrate(self, q: Float[Array, "N H D"], k: Float[Array, "N Hkv D"]) -> Params:
        """Params of one layer from calibration queries ``[N, H, D]`` and keys ``[N, Hkv, D]``."""
        _checks.check_rank("q", q, 3, "[N, H, D]")
        _checks.check_rank("k", k, 3, "[N, Hkv, D]")
        return self.calibrate_from_moments(compute_moments(q, k))

    def calibrate_from_moments(self, moments: Moments) -> Params:
        """Params of one layer from finalized moments (``gram_q`` shaped ``[Hkv, D, D]``)."""
        return {}

    # --- selection ---------------------------------------------------------------------
    def scores(
        self,
        params: Params,
        q: Float[Array, "B H D"],
        k: Float[Array, "B S Hkv D"],
        lengths: Int[Array, " B"],
    ) -> Float[Array, "B Hkv S"]:
        """Per-token ranking scores (higher = keep). Scores of tokens at or beyond
        ``lengths`` are arbitrary: ``select`` masks them."""
        raise NotImplementedError

    def select(
        self,
        params: Params,
        q: Float[Array, "B H D"],
        k: Float[Array, "B S Hkv D"],
        lengths: Int[Array, " B"],
        budget: int,
        *,
        ordered: bool = True,
    ) -> Int[Array, "B Hkv budget"]:
        """Token positions per KV head: int32 ``[B, Hkv, budget]``, ``-1`` padded, by
        score descending (``ordered=False``: any order, see :func:`top_budget`)."""
        check_select_inputs(q, k, lengths, budget, head_dim=self._head_dim(params))
        if q.shape[0] == 0:  # an empty batch (no sequence in flight) selects nothing
            return jnp.zeros((0, k.shape[2], self._width(k.shape[1], budget)), jnp.int32)
        return _select(self, params, q, k, lengths, budget, bool(ordered))

    def _select_impl(self, params, q, k, lengths, budget, ordered=True):
        return top_budget(self.scores(params, q, k, lengths), lengths, budget, ordered=ordered)

    def _width(self, cached: int, budget: int) -> int:
        """The lists' width for ``cached`` tokens a sequence: ``budget``."""
        return budget

    def _head_dim(self, params: Params) -> int | None:
        return None

    def bytes_per_token(self, head_dim: int) -> float:
        """Extra scoring-side memory per token per KV head, in bytes (0: reads the KV cache)."""
        return 0.0

    def describe(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{self.name}({fields})"


@backend.jit_per_mode(static_argnums=(0, 5, 6))
def _select(sel: Selector, params, q, k, lengths, budget, ordered):
    return sel._select_impl(params, q, k, lengths, budget, ordered)


@dataclasses.dataclass(frozen=True)
class ProjectedSelector(Selector):
    """Scores ``(A q̄)·(B k)`` per KV head, keys cached as ``B k`` in ``cache_dtype``.

    Subclasses return ``(A, B)`` (each ``[Hkv, R, D]``) from ``maps(params)``; for a shared
    subspace (JSSA, Loki) ``A = B = M``. FP8 caches use one scale per (sequence, KV head),
    the amax of the keys given to ``project_keys`` over 448; a per-head scale multiplies
    every score of that head alike, so only the FP8 rounding of the values affects ranking.
    """

    rank: int = 16
    cache_dtype: str = "float8_e4m3fn"

    calibrated: ClassVar[bool] = True

    def __post_init__(self):
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(
                f"cache_dtype: got {self.cache_dtype!r}; expected one of {sorted(CACHE_DTYPES)}"
            )
        object.__setattr__(self, "rank", _checks.check_int("rank", self.rank, 1))

    def maps(self, params: Params) -> tuple[Float[Array, "Hkv R D"], Float[Array, "Hkv R D"]]:
        raise NotImplementedError

    def _head_dim(self, params: Params) -> int | None:
        return self.checked_maps(params)[1].shape[-1]

    def checked_maps(self, params: Params):
        """:meth:`maps`, or a ValueError naming ``params`` when they are not this
        selector's calibrated params (empty, another selector's, or of another rank: the
        cache and ``bytes_per_token`` follow ``rank``)."""
        try:
            maps = self.maps(params)
        except KeyError as missing:
            raise ValueError(
                f"params: the {self.name} selector needs its calibrated params (no "
                f"{missing.args[0]!r} in {sorted(params)}); make them with "
                "selector.calibrate(q, k)"
            ) from None
        widths, want = {m.shape[1] for m in maps}, self.projected_width(maps[1].shape[-1])
        if widths != {want}:
            raise ValueError(
                f"params: maps of {sorted(widths)} rows for a {self.name} selector of rank "
                f"{self.rank} ({want} rows); calibrate this selector, or make one with the "
                "params' rank"
            )
        return maps

    def projected_width(self, head_dim: int) -> int:
        """Values per token and KV head in the scoring cache (the maps' rows): ``rank``."""
        return self.rank

    def bytes_per_token(self, head_dim: int) -> float:
        return float(self.projected_width(head_dim) * CACHE_DTYPES[self.cache_dtype][1])

    def check_cache(self, params: Params, cache, name: str = "cache") -> tuple[int, int]:
        """(B, S) of ``cache`` when it is this selector's cache for ``params`` (what
        :meth:`empty_cache` or :meth:`project_keys` makes, leaf for leaf), else a
        ValueError naming ``cache`` (as ``name``): a decode step would otherwise write or
        read another layout, or another sequence's rows."""
        leaves = jax.tree.leaves(cache)
        if not isinstance(cache, tuple) or not leaves or leaves[0].ndim < 2:
            got = (
                f"an array {tuple(cache.shape)}"
                if hasattr(cache, "shape")
                else type(cache).__name__
            )
            raise ValueError(
                f"{name}: got {got}; expected this selector's cache (empty_cache or project_keys)"
            )
        b, s = leaves[0].shape[:2]
        want = self._cache_layout(params, b, s)
        got_leaves = [(tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves]
        want_leaves = [(tuple(x.shape), jnp.dtype(x.dtype).name) for x in jax.tree.leaves(want)]
        if jax.tree.structure(cache) != jax.tree.structure(want) or got_leaves != want_leaves:
            raise ValueError(
                f"{name}: {type(cache).__name__} {got_leaves}; expected {type(want).__name__} "
                f"{want_leaves} (this selector's cache for these params, B = {b}, S = {s})"
            )
        return b, s

    def _cache_layout(self, params: Params, b: int, s: int):
        """The shapes of ``empty_cache(params, b, s)``, kept per selector and params
        shapes: a decode step checks its cache at every call (a layer's too), and the
        ``eval_shape`` behind it costs ~1 ms of host time eagerly."""
        try:
            shapes = tuple(
                sorted((k, tuple(v.shape), jnp.dtype(v.dtype).name) for k, v in params.items())
            )
        except (AttributeError, TypeError):  # not a mapping of arrays: no key to keep it by
            return jax.eval_shape(lambda: self.empty_cache(params, b, s))
        return _empty_cache_layout(self, shapes, b, s)

    def check_step_inputs(self, params, q, cache, lengths, budget, k_new=None, slots=None):
        """The decode path's checks (``select``'s, against the cache): q, lengths and
        budget; with ``k_new`` and ``slots``, :meth:`append_keys`' too."""
        hkv, _, d = self.checked_maps(params)[1].shape
        b, s = self.check_cache(params, cache)
        _checks.check_rank("q", q, 3, "[B, H, D]")
        _checks.check_dim("q", q, 0, b, "sequences B of the cache")
        _checks.check_dim("q", q, 2, d, "head_dim of the calibrated params")
        keys = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.float32)  # what the cache stands for
        check_select_inputs(q, keys, lengths, budget, head_dim=d)
        if k_new is not None:
            _check_new_keys(k_new, slots, (b, hkv, d))

    @property
    def keeps_projection(self) -> bool:
        """Whether decoding scores from a kept cache of projected keys (``project_keys``,
        ``append_keys``, ``select_projected``), rather than from the keys themselves."""
        return True

    def project_queries(self, params: Params, q: Float[Array, "B H D"]) -> Float[Array, "B Hkv R"]:
        """``A q̄`` in f32, ``q̄`` the mean of each KV head's query heads."""
        return query_projection(q, self.maps(params)[0])

    def project_keys(
        self, params: Params, k: Float[Array, "B S Hkv D"], *, headroom: float = 1.0
    ) -> ProjectedKeys:
        """The scoring cache ``B k`` as stored (``cache_dtype``) with its per-head scale.

        ``headroom`` (finite, ≥ 1) widens the FP8 scale past the amax of ``k`` so that keys appended
        later (:meth:`append_keys`, which keeps the scale) saturate less often; FP8 is a
        floating-point format, so this costs only the bottom of its exponent range.
        """
        return quantize_cache(self._project(params, k), self.cache_dtype, headroom=headroom)

    def _project(self, params: Params, k: Float[Array, "B S Hkv D"]) -> Float[Array, "B S Hkv R"]:
        _, b = self.checked_maps(params)
        _checks.check_rank("k", k, 4, "[B, S, Hkv, D]")
        _checks.check_dim("k", k, 2, b.shape[0], "KV heads of the calibrated params")
        _checks.check_dim("k", k, 3, b.shape[-1], "head_dim of the calibrated params")
        return key_projection(k, b)

    def empty_cache(self, params: Params, batch: int, slots: int) -> ProjectedKeys:
        """A zero cache of ``slots`` tokens per sequence, scales 1 (``project_keys`` of a
        prefill replaces it; decoding from it directly keeps scale 1)."""
        hkv, rank, _ = self.checked_maps(params)[1].shape
        dtype, _ = CACHE_DTYPES[self.cache_dtype]
        return ProjectedKeys(
            jnp.zeros((batch, slots, hkv, rank), dtype), jnp.ones((batch, hkv), jnp.float32)
        )

    def append_keys(
        self,
        params: Params,
        cache: ProjectedKeys,
        k_new: Float[Array, "B Hkv D"],
        slots: Int[Array, " B"],
    ) -> ProjectedKeys:
        """``cache`` with sequence b's slot ``slots[b]`` holding the projection of
        ``k_new[b]``, quantised with the cache's scales (FP8 values beyond them saturate).
        One decode step's update: it reads one key per sequence, not the context."""
        self._check_append(params, cache, k_new, slots)
        proj = self._project(params, k_new[:, None])[:, 0]  # [B, Hkv, R]
        row = quantize_with_scale(proj, cache.scale, self.cache_dtype)
        return cache._replace(values=write_token_rows(cache.values, row, slots))

    def _check_append(self, params, cache, k_new, slots) -> None:
        """:meth:`append_keys`' checks: the cache, ``k_new`` [B, Hkv, D], ``slots`` [B]."""
        hkv, _, d = self.checked_maps(params)[1].shape
        b, _ = self.check_cache(params, cache)
        _check_new_keys(k_new, slots, (b, hkv, d))

    def scores_projected(self, params: Params, q, cache: ProjectedKeys) -> Float[Array, "B Hkv S"]:
        # The per-head scale goes on the query: one pass over the scores fewer.
        qp = self.project_queries(params, q) * cache.scale[:, :, None]
        return projected_scores(qp, cache.values)

    def scores(self, params, q, k, lengths):
        return self.scores_projected(params, q, self.project_keys(params, k))

    def decode_step(
        self,
        params: Params,
        q: Float[Array, "B H D"],
        cache: ProjectedKeys,
        k_new: Float[Array, "B Hkv D"],
        slots: Int[Array, " B"],
        lengths: Int[Array, " B"],
        budget: int,
        *,
        ordered: bool = True,
    ) -> tuple[Int[Array, "B Hkv budget"], ProjectedKeys]:
        """(lists, cache) of one decode step: :meth:`append_keys` of ``k_new`` at
        ``slots``, then :meth:`select_projected`. Where the Pallas kernels run, for a
        selector that keeps this class's projections and where it pays
        (:func:`fused_step_pays`), both projections and the cache write are one
        ``projected_step`` launch."""
        fused = _selection_kernels() and self._plain_projections()
        if fused:  # before fused_step_pays reads the shapes; unfused, the two calls check
            self.check_step_inputs(params, q, cache, lengths, budget, k_new, slots)
        if fused and fused_step_pays(q.shape, k_new.shape[1]):
            a, b = self.maps(params)
            slots = jnp.asarray(slots).astype(jnp.int32)  # any integer type, as append_keys
            qp, values = projected_step(q, k_new, a, b, cache.values, cache.scale, slots)
            cache = cache._replace(values=values)
            return top_budget(projected_scores(qp, values), lengths, budget, ordered=ordered), cache
        cache = self.append_keys(params, cache, k_new, slots)
        return self.select_projected(params, q, cache, lengths, budget, ordered=ordered), cache

    def _plain_projections(self) -> bool:
        """Whether this selector projects, stores and scores as this class does (its
        subclasses that only calibrate other maps), so that ``projected_step`` is its
        step."""
        own = ("project_queries", "_project", "append_keys", "scores_projected", "select_projected")
        return all(getattr(type(self), n) is getattr(ProjectedSelector, n) for n in own)

    def select_projected(
        self,
        params: Params,
        q: Float[Array, "B H D"],
        cache: ProjectedKeys,
        lengths: Int[Array, " B"],
        budget: int,
        *,
        ordered: bool = True,
    ) -> Int[Array, "B Hkv budget"]:
        """``select`` from an already projected cache (the decoding path)."""
        self.check_step_inputs(params, q, cache, lengths, budget)
        scores = self.scores_projected(params, q, cache)
        return top_budget(scores, lengths, budget, ordered=ordered)


def _check_new_keys(k_new, slots, shape: tuple[int, int, int]) -> None:
    """A decode step's new keys, ``shape`` = (B, Hkv, D) of the cache and params, and
    their [B] integer slots (one outside [0, S) writes nothing: a sequence not stepping)."""
    _checks.check_rank("k_new", k_new, 3, "[B, Hkv, D]")
    _checks.check_floating("k_new", k_new)
    if tuple(k_new.shape) != shape:
        raise ValueError(f"k_new: shape {tuple(k_new.shape)}; expected [B, Hkv, D] = {shape}")
    b = shape[0]
    _checks.check_rank("slots", slots, 1, "[B]")
    _checks.check_dim("slots", slots, 0, b, "sequences B of the cache")
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots: expected an integer dtype, got {slots.dtype}")


def quantize_cache(
    proj: Float[Array, "B S Hkv R"], cache_dtype: str, *, headroom: float = 1.0
) -> ProjectedKeys:
    """The stored cache of ``proj``: FP8 with one scale per (sequence, KV head), the amax
    times ``headroom`` over 448; bfloat16 / float32 rounded, scale 1."""
    _check_headroom(headroom)
    ones = jnp.ones((proj.shape[0], proj.shape[2]), jnp.float32)
    if cache_dtype != "float8_e4m3fn":
        return ProjectedKeys(quantize_with_scale(proj, ones, cache_dtype), ones)
    scale = fp8_scale(proj, headroom)
    return ProjectedKeys(quantize_with_scale(proj, scale, cache_dtype), scale)


def fp8_scale(proj: Float[Array, "B S Hkv R"], headroom: float = 1.0) -> Float[Array, "B Hkv"]:
    """One FP8 scale per (sequence, KV head): the finite amax of ``proj`` times
    ``headroom`` over 448 (1 where it is 0). An inf then saturates at ±448 instead of
    making the scale inf, which would store every other key of the head as 0."""
    _check_headroom(headroom)
    fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
    # an amax near float32's largest times headroom must not overflow to inf (scale 1)
    widened = jnp.minimum(finite_amax(proj, axis=(1, 3)) * headroom, jnp.finfo(jnp.float32).max)
    return amax_scale(widened, fmax)


def finite_amax(x: Array, axis) -> Array:
    """max |x| over ``axis`` among the finite entries (0 where there is none)."""
    return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=axis, initial=0.0)


def amax_scale(amax: Array, levels: float) -> Array:
    """``amax / levels``, a normal float32 at least (an underflow to 0 would divide the
    keys by 0); 1 where ``amax`` is 0 or not finite."""
    ok = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(ok, jnp.maximum(amax / levels, jnp.finfo(jnp.float32).tiny), 1.0)


def _check_headroom(headroom: float) -> None:
    value = _checks.finite_real(headroom)
    if value is None or value < 1.0:
        raise ValueError(f"headroom: got {headroom!r}; expected a finite number >= 1")


def quantize_with_scale(
    proj: Float[Array, "B *S Hkv R"], scale: Float[Array, "B Hkv"], cache_dtype: str
) -> Array:
    """``proj / scale`` in ``cache_dtype`` (FP8 clipped to ±448: e4m3fn has no inf, an
    unclipped overflow would become NaN); ``proj`` is ``[B, S, Hkv, R]`` or ``[B, Hkv, R]``."""
    dtype, _ = CACHE_DTYPES[cache_dtype]
    if cache_dtype != "float8_e4m3fn":
        return round_to(proj, dtype)
    fmax = float(jnp.finfo(dtype).max)
    s = scale[:, None, :, None] if proj.ndim == 4 else scale[:, :, None]
    return round_to(jnp.clip(proj / s, -fmax, fmax), dtype)


def fp8_first_write(
    x: Float[Array, "B T Hkv R"], scale: Float[Array, "B Hkv"], first, headroom: float
) -> tuple[Array, Array]:
    """(``x`` in FP8 at the scale, the scale) of a cache whose scale the first write
    sets: where ``first`` (a bool broadcasting to ``scale``) the scale becomes this
    write's :func:`fp8_scale`; later writes keep it and saturate. The models' FP8 K/V and
    MLA caches."""
    scale = jnp.where(first, fp8_scale(x, headroom), scale)
    return quantize_with_scale(x, scale, "float8_e4m3fn"), scale


def write_token_rows(values: Array, rows: Array, slots: Int[Array, " B"]) -> Array:
    """``values`` [B, S, ...] with ``values[b, slots[b]] = rows[b]``; a slot outside
    [0, S) writes nothing (not numpy's wrap-around of a negative index)."""
    slots = jnp.where(slots < 0, values.shape[1], slots)
    return values.at[jnp.arange(values.shape[0]), slots].set(rows.astype(values.dtype), mode="drop")


@functools.lru_cache(maxsize=256)
def _empty_cache_layout(selector: ProjectedSelector, shapes: tuple, b: int, s: int):
    """``selector.empty_cache``'s shapes for params of ``shapes`` ((name, shape, dtype)
    each): it reads only the params' shapes, so abstract ones give the same answer."""
    structs = {k: jax.ShapeDtypeStruct(shape, dtype) for k, shape, dtype in shapes}
    return jax.eval_shape(lambda p: selector.empty_cache(p, b, s), structs)
