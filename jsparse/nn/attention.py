"""``SparseAttention``: a Flax NNX attention core that decodes over selected tokens.

It plugs into any model that calls an attention core the way
:mod:`jsparse.models.llama` does::

    core(q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv],
         q_positions=[B, T], k_positions=[B, S]) -> [B, T, H, Dv]

with ``k``, ``v`` the whole cache and ``k_positions = -1`` on empty slots. A decode step
(T = 1) lets a selector pick ``budget`` tokens per KV head from the visible cache and
attends only those with :func:`jsparse.indexed_attention`, which reads the selected
rows in place; prefill (T > 1) runs the dense core, as the JSSA paper does.

Selectors that score from a projected-key cache (JSSA and its relatives) keep that
cache as the core's state (``init_core_state``; the model carries it in its KV cache):
prefill projects the prompt's keys once, each decode step projects only the new key
and scores from the cache. Without a state (a model that does not carry one) each step
projects the visible keys again, which reads the whole K cache.

Serving caches: ``k_scale`` / ``v_scale`` ([B, Hkv]) mark an FP8 K/V cache and
``page_table`` ([B, M]) a paged one (``k``, ``v`` then page pools [n_pages, P, Hkv, D]),
as :func:`jsparse.indexed_attention` takes them; the decode step reads them in place and
widens only the new key for the projected cache. Prefill, and selectors without a
projected cache, see the cache as dense f32 (:class:`CacheView`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jsparse import _checks, backend
from jsparse.ops.attention import indexed_attention
from jsparse.ops.attention.reference import listed_locations
from jsparse.selectors import SELECTORS, ProjectedSelector, Selector, make_selector


class SelectorParams(nnx.Variable):
    """One of a layer's calibrated selector parameters (a basis, a map), as model state:
    they travel with ``nnx.split`` / ``nnx.merge`` and into jitted calls as arguments."""


def params_state(params) -> nnx.Dict:
    """A selector's params as layer state: one :class:`SelectorParams` per array, in an
    ``nnx.Dict``, so that ``nnx.to_pure_dict`` / ``replace_by_pure_dict`` round-trip them
    (a Variable holding a dict does not)."""
    return nnx.Dict({name: SelectorParams(value) for name, value in dict(params or {}).items()})


def params_values(state: nnx.Dict) -> dict:
    """The arrays of :func:`params_state`, as the selector takes them."""
    return {name: variable.get_value() for name, variable in state.items()}


class CacheView(NamedTuple):
    """A K (or V) cache as a decode core reads it: ``values`` dense [B, S, Hkv, D], or a
    page pool [n_pages, P, Hkv, D] with ``page_table`` [B, M] (token i of sequence b at
    slot ``i % P`` of page ``page_table[b, i // P]``, -1: none); FP8 with ``scale``
    [B, Hkv] (value = stored · scale), or as stored."""

    values: Array
    page_table: Array | None = None
    scale: Array | None = None

    def _widened(self, x, token_axes: int):
        """``x`` dequantised: f32 times the scale; without one, FP8 widened to f32 and
        other dtypes unchanged."""
        if self.scale is None:
            fp8 = jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn)
            return x.astype(jnp.float32) if fp8 else x
        scale = self.scale.astype(jnp.float32)
        return x.astype(jnp.float32) * scale.reshape(
            scale.shape[:1] + (1,) * token_axes + scale.shape[1:] + (1,)
        )

    @property
    def tokens(self) -> int:
        """S: the token slots of each sequence (M·P when paged)."""
        if self.page_table is None:
            return self.values.shape[1]
        return self.page_table.shape[1] * self.values.shape[1]

    def dense(self) -> Array:
        """[B, S, Hkv, D] (S = M·P when paged; a slot on a missing page reads the pool's
        first row, or zeros from a pool of no pages, which the positions must mark
        invisible)."""
        x = self.values
        if self.page_table is not None:
            slots = jnp.arange(self.tokens, dtype=jnp.int32)
            x = self._at(jnp.broadcast_to(slots, (self.page_table.shape[0], self.tokens)))
        return self._widened(x, 1)

    def rows(self, slot: Int[Array, " B"]) -> Array:
        """[B, Hkv, D]: each sequence's token at position ``slot[b]``."""
        return self._widened(self._at(slot), 0)

    def _at(self, slots: Int[Array, "B ..."]) -> Array:
        """The stored entries of tokens ``slots[b, ...]``: the decode kernels' reference
        lookup, dense or through the page table."""
        if self.values.shape[0] == 0:  # a pool of no pages: every slot is missing
            return jnp.zeros(slots.shape + self.values.shape[2:], self.values.dtype)
        _, i0, i1 = listed_locations(slots, self.values, self.page_table)
        return self.values[i0, i1]


def serving_view(name: str, cache, scale, page_table, k_positions, q_shape) -> CacheView:
    """``cache`` as a :class:`CacheView` after checking its serving arguments: ``scale``
    [B, Hkv] float32 > 0, ``page_table`` [B, M] int32 (pages of the pool or -1), and
    ``k_positions`` [B, S] covering the cache (S = M·P when paged)."""
    from jsparse.ops.attention.api import check_page_table

    b = q_shape[0]
    paged = page_table is not None
    _checks.check_rank(name, cache, 4, "[n_pages, P, Hkv, D]" if paged else "[B, S, Hkv, D]")
    _checks.check_floating(name, cache)
    s = cache.shape[1]
    if paged:
        s, _ = check_page_table(page_table, b, cache.shape[0], cache.shape[1], q_shape)
    else:
        _checks.check_dim(name, cache, 0, b, f"sequences B of q {tuple(q_shape)}")
    if scale is not None:
        _checks.check_rank(f"{name}_scale", scale, 2, "[B, Hkv]")
        _checks.check_dtype(f"{name}_scale", scale, (jnp.float32,))
        want = (b, cache.shape[2])
        if scale.shape != want:
            raise ValueError(
                f"{name}_scale: shape {tuple(scale.shape)}; expected [B, Hkv] = {want} "
                f"({name} {tuple(cache.shape)})"
            )
        _checks.check_positive_finite(f"{name}_scale", scale)
    _checks.check_rank("k_positions", k_positions, 2, "[B, S]")
    of_table = " (max_pages · P of the page table)" if paged else ""
    _checks.check_dim("k_positions", k_positions, 1, s, f"the cache's S{of_table}")
    return CacheView(cache, page_table, scale)


class SparseAttention(nnx.Module):
    """Decode attention over the ``budget`` tokens per KV head that ``selector`` picks.

    Args:
      selector: a :class:`jsparse.selectors.Selector`, or a name for
        :func:`jsparse.make_selector` (``selector_options`` go with it).
      params: this layer's calibrated parameters (``selector.calibrate`` or
        :func:`jsparse.load_bases`); ``{}`` for selectors that need none (``oracle``,
        ``quest``, ``full``).
      budget: tokens per KV head attended at each decode step (static).
      dense: the core for prefill (T > 1); default the model's exact
        :class:`jsparse.models.llama.DenseCausalAttention`.
      implementation: for :func:`jsparse.indexed_attention` (see :mod:`jsparse.backend`).
      fp8_headroom: the FP8 scale of the projected-key cache is the prompt keys' amax
        times this over 448; keys appended while decoding keep that scale and saturate
        beyond it (see :meth:`jsparse.selectors.ProjectedSelector.project_keys`).

    The cache must hold each sequence's visible tokens in its first slots (slot order =
    position order, as :class:`jsparse.models.llama.KVCache` writes them; with a kept
    projected cache the step's own key is the last of them): the selectors see a prefix
    of ``lengths[b]`` tokens. A call with concrete positions that breaks this (a hole,
    a wrapped ring buffer) raises; under ``jit`` such a sequence's output is NaN.
    """

    reads_fp8_caches = True  # a model passes an FP8 cache as stored, with its scales

    def __init__(
        self,
        selector: Selector | str,
        params: Mapping[str, Array] | None,
        budget: int,
        *,
        dense: nnx.Module | None = None,
        implementation: str | Sequence[str] | None = None,
        fp8_headroom: float = 2.0,
        **selector_options,
    ):
        selector = core_selector(
            selector, selector_options, budget, fp8_headroom, "KV head", params=params,
            implementation=implementation,
        )  # fmt: skip
        if dense is None:
            from jsparse.models.llama import DenseCausalAttention  # the model imports flax too

            dense = DenseCausalAttention()
        self.selector = selector
        self.params = params_state(params)
        self.budget = int(budget)
        self.dense = dense
        self.implementation = implementation
        self.fp8_headroom = float(fp8_headroom)

    @property
    def keeps_projected_cache(self) -> bool:
        """Whether decoding scores from a projected-key cache kept in the core's state."""
        return keeps_projected_cache(self.selector)

    def init_core_state(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int):
        """The empty projected-key cache (None for selectors that keep none)."""
        if not self.keeps_projected_cache:
            return None
        params = params_values(self.params)
        key_map = self.selector.checked_maps(params)[1]
        if key_map.shape[0] != n_kv_heads or key_map.shape[-1] != head_dim:
            raise ValueError(
                f"params: calibrated for {key_map.shape[0]} KV heads of dim "
                f"{key_map.shape[-1]}, the cache has {n_kv_heads} of dim {head_dim}"
            )
        return self.selector.empty_cache(params, batch, max_len)

    def __call__(
        self,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B S Hkv D"],
        v: Float[Array, "B S Hkv Dv"],
        *,
        q_positions: Int[Array, "B T"],
        k_positions: Int[Array, "B S"],
        core_state=None,
        k_scale: Float[Array, "B Hkv"] | None = None,
        v_scale: Float[Array, "B Hkv"] | None = None,
        page_table: Int[Array, "B M"] | None = None,
    ):
        """The attention output ``[B, T, H, Dv]``; with ``core_state``, also the updated
        state: ``(out, core_state)``. ``k_scale``, ``v_scale``, ``page_table``: an FP8
        and/or paged cache (module docstring)."""
        params = params_values(self.params)
        check_query(q, q_positions, k_positions)
        check_core_state(self.selector, params, core_state)
        keys = serving_view("k", k, k_scale, page_table, k_positions, q.shape)
        _checks.check_rank("v", v, 4, "like k's, with its own Dv")
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(
                f"v: shape {tuple(v.shape)}; expected k's {tuple(k.shape[:3])} on its first "
                f"three axes (the same rows and KV heads, any Dv)"
            )
        if q.shape[1] != 1:
            values = serving_view("v", v, v_scale, page_table, k_positions, q.shape).dense()
            dense_keys = keys.dense()
            out = self.dense(
                q, dense_keys, values, q_positions=q_positions, k_positions=k_positions
            ).astype(q.dtype)  # as a decode step's
            if core_state is None:
                return out
            return out, prefill_projection(self.selector, params, dense_keys, k_positions,
                                           self.fp8_headroom)  # fmt: skip
        idx, core_state, in_order = select_step(
            self.selector, params, q[:, 0], keys, q_positions, k_positions, self.budget,
            core_state,
        )  # fmt: skip
        out = indexed_attention(
            q[:, 0], k, v, idx, k_scale=k_scale, v_scale=v_scale, page_table=page_table,
            implementation=self.implementation,
        )[:, None]  # fmt: skip
        out = poisoned(out, in_order)
        return out if core_state is None else (out, core_state)


def keeps_projected_cache(selector) -> bool:
    """Whether a decode core with ``selector`` keeps a projected-key cache as its state."""
    return isinstance(selector, ProjectedSelector) and selector.keeps_projection


def check_core_state(selector, params, core_state):
    """A core_state only for a selector that keeps a projected cache, and then its cache
    for ``params`` (init_core_state's or a previous step's)."""
    if core_state is None:
        return
    if not keeps_projected_cache(selector):
        raise ValueError(
            f"core_state: the {selector.name!r} selector keeps no projected cache "
            "(init_core_state gives None); pass core_state=None"
        )
    selector.check_cache(params, core_state, name="core_state")


def check_query(q, q_positions, k_positions):
    """A core's ``q`` [B, T, ...] and integer positions: ``q_positions`` [B, T] (one per
    query, never broadcast: a ragged batch's rows differ) and ``k_positions`` [B, S]."""
    _checks.check_rank("q", q, 4, "[B, T, H, D]")
    _checks.check_rank("q_positions", q_positions, 2, "[B, T]")
    if q_positions.shape != q.shape[:2]:
        raise ValueError(
            f"q_positions: shape {tuple(q_positions.shape)}; expected [B, T] = "
            f"{tuple(q.shape[:2])} of q {tuple(q.shape)}"
        )
    for name, x in (("q_positions", q_positions), ("k_positions", k_positions)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}: dtype {x.dtype}; expected integer positions")


def prefill_projection(selector, params, k, k_positions, headroom: float):
    """The projected cache of a prefill's keys ``[B, S, Hkv, D]``. Empty slots borrow
    slot 0's key: projected, they are real keys' values, so they leave the scales alone
    (lengths keep them out of every selection)."""
    filled = (k_positions >= 0)[:, :, None, None]
    return selector.project_keys(params, jnp.where(filled, k, k[:, :1]), headroom=headroom)


def select_step(selector, params, q, keys: CacheView, q_positions, k_positions, budget: int,
                core_state):  # fmt: skip
    """(lists ``[B, Hkv, budget]``, core_state, in_order) of one decode step: ``q``
    [B, H, D] over the visible prefix of the ``keys`` cache. With a kept projected cache,
    the step's own key (the last visible slot) is appended first and selection scores
    the cache; without one, the selector projects the visible keys itself (reading them
    all). ``in_order``: None when the positions were concrete (and checked), else [B]
    bool, False for a sequence whose cache breaks :func:`check_prefix`'s layout (the
    caller poisons its output: :func:`poisoned`)."""
    visible = (k_positions >= 0) & (k_positions <= q_positions[:, :1])
    check_prefix(visible, k_positions, q_positions, kept=core_state is not None)
    lengths = jnp.sum(visible, axis=1, dtype=jnp.int32)
    cached = getattr(core_state, "values", None)  # a projected cache: one row per slot
    if cached is not None and tuple(cached.shape[:2]) != (q.shape[0], keys.tokens):
        raise ValueError(
            f"core_state: a projected cache of {tuple(cached.shape[:2])} [B, S]; expected "
            f"{(q.shape[0], keys.tokens)}, the K cache's (init_core_state with the cache's "
            "max_len)"
        )
    in_order = None
    if _checks.concrete(visible) is None:  # (concrete positions were checked above)
        in_order = laid_out_in_order(visible, k_positions, q_positions, kept=core_state is not None)
    # Attention does not care about the lists' order: the selection skips its final sort.
    if core_state is None:
        idx = selector.select(params, q, keys.dense(), lengths, budget, ordered=False)
        return idx, None, in_order
    slot = lengths - 1  # the cache is in position order
    k_new = keys.rows(jnp.maximum(slot, 0))  # [B, Hkv, D]
    idx, core_state = selector.decode_step(
        params, q, core_state, k_new, slot, lengths, budget, ordered=False
    )  # fmt: skip
    return idx, core_state, in_order


def laid_out_in_order(visible, k_positions, q_positions, *, kept: bool):
    """[B] bool: :func:`check_prefix`'s layout, as arrays (for traced positions): the
    fault planes OR'd and reduced once, a sibling of the count's reduction over the
    same positions (one pass where XLA fuses them; per-fault reductions took ~10 µs
    more at 32 × 128K, runs 284-285)."""
    planes = fault_planes(jnp, visible, k_positions, q_positions, kept=kept)
    return ~functools.reduce(operator.or_, planes).any(axis=1)


def poisoned(out, in_order):
    """``out`` [B, ...] with NaN for every sequence whose cache layout is out of order
    (``in_order`` False): under ``jit`` a layout that a concrete call refuses gives a
    loud answer, never a quietly wrong one."""
    if in_order is None:
        return out
    return jnp.where(in_order.reshape(-1, *[1] * (out.ndim - 1)), out, jnp.nan).astype(out.dtype)


def core_selector(
    selector, selector_options, budget, fp8_headroom, per: str, *, params=None,
    implementation=None,
) -> Selector:  # fmt: skip
    """A decode core's selector (built from a name and options, or given) after checking
    the core's budget (rows per ``per``), FP8 headroom, params and implementation."""
    if isinstance(selector, str):
        if selector not in SELECTORS:
            raise ValueError(f"selector: unknown name {selector!r}; known: {sorted(SELECTORS)}")
        selector = make_selector(selector, **selector_options)
    elif selector_options:
        raise ValueError(
            f"selector_options {sorted(selector_options)}: given with a built selector "
            f"({selector.describe()}); pass them to jsparse.make_selector instead"
        )
    if not isinstance(selector, Selector):
        raise ValueError(f"selector: got {type(selector).__name__}; expected a Selector or a name")
    if not _checks.is_int(budget) or budget < 1:
        raise ValueError(f"budget: got {budget!r}; expected an int ≥ 1 (tokens per {per})")
    if not (_checks.is_positive_finite(fp8_headroom) and fp8_headroom >= 1.0):
        raise ValueError(f"fp8_headroom: got {fp8_headroom!r}; expected a finite number >= 1")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(
            f"params: got {type(params).__name__}; expected a mapping of arrays (the "
            "selector's calibrate output or jsparse.load_bases), or None"
        )
    backend.check_implementation(implementation)  # used at the first decode step
    return selector


def check_prefix(visible, k_positions, q_positions, *, kept: bool):
    """When concrete: each sequence's visible slots are its first ones, in increasing
    position order; with a kept projected cache (``kept``) the last of them holds the
    step's own key (the slot its projection is appended at)."""
    seen = _checks.concrete(visible)
    if seen is None:
        return
    kp, qp = np.asarray(k_positions), np.asarray(q_positions)  # concrete, as visible is
    count = seen.sum(axis=1)
    faults = fault_planes(np, seen, kp, qp, kept=kept)
    not_prefix, unordered, stale = (p.any(axis=1) for p in faults)
    if not_prefix.any():
        b = np.flatnonzero(not_prefix)[0]
        raise ValueError(
            f"k_positions: sequence {b}'s visible slots are not its first "
            f"{count[b]} slots; SparseAttention's selectors need the cache in "
            "position order (as KVCache writes it)"
        )
    if unordered.any():  # a ring buffer after it wrapped, say
        b = np.flatnonzero(unordered)[0]
        raise ValueError(
            f"k_positions: sequence {b}'s visible slots hold positions out of order "
            f"({kp[b, : min(count[b], 8)].tolist()}...); the selectors need slot order = "
            "position order"
        )
    if stale.any():  # (the slots are a prefix here: its last is slot count - 1)
        b = np.flatnonzero(stale)[0]
        raise ValueError(
            f"k_positions: sequence {b}'s last visible slot holds position "
            f"{kp[b, count[b] - 1]}, not the step's {qp[b, 0]}: write the step's key before "
            "the core is called, at the slot after the sequence's previous ones"
        )


def fault_planes(xp, visible, k_positions, q_positions, *, kept: bool):
    """[B, S] bool planes of :func:`check_prefix`'s three faults, each slot read with its
    successor only (not the count, so the faults need no pass of their own): a visible
    slot after a hidden one (in a prefix a visible slot's predecessor is visible too); a
    visible successor whose position is not above the slot's; with ``kept``, the last
    visible slot (visible, its successor not) holding another position than the step's."""
    next_visible = xp.concatenate([visible[:, 1:], xp.zeros_like(visible[:, :1])], axis=1)
    next_position = xp.concatenate([k_positions[:, 1:], k_positions[:, -1:]], axis=1)
    not_prefix = next_visible & ~visible
    unordered = next_visible & (next_position <= k_positions)
    stale = xp.zeros_like(visible)
    if kept:
        stale = visible & ~next_visible & (k_positions != q_positions[:, :1])
    return not_prefix, unordered, stale
