"""Multi-head latent attention (MLA, DeepSeek-V2/V3) in Flax NNX, decoded densely or
over the tokens a selector picks.

Each token caches one row ``[c ; k_r]``: its normalised latent ``c`` (``latent_dim``)
and its RoPE key ``k_r`` (``rope_dim``), shared by every head. Attention runs in the
absorbed form: a head's query ``[q_nope ; q_rope]`` becomes ``[W_UKᵀ q_nope ; q_rope]``
against the rows, and the output ``o_c`` (latent) becomes ``W_UV o_c``, so the cache is
never expanded per head. Scores and outputs are those of the expanded form
``k_h = [W_UK,h c ; k_r]``, ``v_h = W_UV,h c`` (MATH.md §2.5).

The layer calls a core on the absorbed queries::

    core(q [B, T, H, D], rows [B, S, D], *, q_positions [B, T], k_positions [B, S],
         scale, latent_dim, core_state=None) -> out [B, T, H, Dc] (, core_state)

``DenseMLA`` attends every visible row; ``SparseMLA`` decodes (T = 1) over the
``budget`` rows a selector picks (``jssa_mla`` by default: one list per token for all
heads), with :func:`jsparse.indexed_mla_attention` reading them in place, and keeps the
selector's projected cache as its state.

DeepSeek-V3.2's sparse attention (DSA): a layer built with ``indexer=``
(:class:`jsparse.nn.Indexer`) selects, for every token, prefill included, the
``top_k`` rows the indexer scores highest, and its core (:class:`SelectedMLA`) attends
exactly those, reading them in place; the indexer keeps its own key cache in
``MLACache.indexer``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jsparse import _checks
from jsparse.models.llama import RMSNorm, apply_rope, rope_angles
from jsparse.nn.attention import (
    check_core_state,
    check_query,
    core_selector,
    keeps_projected_cache,
    params_state,
    params_values,
    poisoned,
    prefill_projection,
    select_step,
    serving_view,
)
from jsparse.nn.indexer import Indexer, IndexerCache
from jsparse.ops.mla import indexed_mla_attention
from jsparse.selectors import Selector
from jsparse.selectors.base import fp8_first_write

HIGHEST = jax.lax.Precision.HIGHEST


class MLACache(NamedTuple):
    """One layer's decode cache (a pytree): rows in position order, first ``lengths[b]``
    filled, the core's state (a selector's projected cache, or None), for FP8 rows
    one scale per sequence (row = stored · scale; set by the sequence's first write),
    and the indexer's keys when the layer has one."""

    rows: Float[Array, "B S D"]
    lengths: Int[Array, " B"]
    core_state: Any = None
    scale: Float[Array, " B"] | None = None
    indexer: IndexerCache | None = None


class DenseMLA(nnx.Module):
    """Absorbed softmax attention over every visible row (in f32, the output in q's
    dtype; the reference core).
    ``cache_scale`` [B]: FP8 rows, dequantised first."""

    def __call__(self, q, rows, *, q_positions, k_positions, scale, latent_dim, core_state=None,
                 cache_scale=None):  # fmt: skip
        if cache_scale is not None:
            rows = rows.astype(jnp.float32) * cache_scale.astype(jnp.float32)[:, None, None]
        logits = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), rows.astype(jnp.float32),
                            precision=HIGHEST) * scale  # fmt: skip
        visible = (k_positions[:, None, :] >= 0) & (
            k_positions[:, None, :] <= q_positions[:, :, None]
        )  # [B, T, S]
        logits = jnp.where(visible[:, :, None, :], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        p = jnp.where(visible[:, :, None, :], p, 0.0)  # a query with nothing visible: zeros
        out = jnp.einsum("bths,bsc->bthc", p, rows[..., :latent_dim].astype(jnp.float32),
                         precision=HIGHEST).astype(q.dtype)  # fmt: skip
        return out if core_state is None else (out, core_state)


class SparseMLA(nnx.Module):
    """MLA decoding over the ``budget`` rows a selector picks for each sequence.

    Args:
      selector: a :class:`jsparse.selectors.Selector` for one KV head of width
        ``latent_dim + rope_dim`` (``jssa_mla``, or ``oracle``), or a name.
      params: its calibrated parameters (``{}`` for ``oracle``).
      budget: rows attended at each decode step (static).
      implementation: for :func:`jsparse.indexed_mla_attention`.
      fp8_headroom: the projected cache's FP8 scale is the prompt's amax times this.

    Prefill (T > 1) runs :class:`DenseMLA` and projects the prompt's rows once; a decode
    step appends its own row's projection and selects from the kept cache.
    """

    def __init__(
        self,
        selector: Selector | str = "jssa_mla",
        params: Mapping[str, Array] | None = None,
        budget: int = 2048,
        *,
        implementation: str | Sequence[str] | None = None,
        fp8_headroom: float = 2.0,
        **selector_options,
    ):
        selector = core_selector(
            selector, selector_options, budget, fp8_headroom, "sequence", params=params,
            implementation=implementation,
        )  # fmt: skip
        self.selector = selector
        self.params = params_state(params)
        self.budget = int(budget)
        self.implementation = implementation
        self.fp8_headroom = float(fp8_headroom)
        self.dense = DenseMLA()

    @property
    def keeps_projected_cache(self) -> bool:
        """Whether decoding scores from a projected cache kept in the core's state."""
        return keeps_projected_cache(self.selector)

    def init_core_state(self, batch: int, max_len: int, width: int):
        """The empty projected cache of ``max_len`` rows (None for selectors without one)."""
        if not self.keeps_projected_cache:
            return None
        params = params_values(self.params)
        key_map = self.selector.checked_maps(params)[1]
        if key_map.shape[0] != 1 or key_map.shape[-1] != width:
            raise ValueError(
                f"params: calibrated for {key_map.shape[0]} KV heads of dim "
                f"{key_map.shape[-1]}; MLA rows are one KV head of dim {width}"
            )
        return self.selector.empty_cache(params, batch, max_len)

    def __call__(
        self, q, rows, *, q_positions, k_positions, scale, latent_dim, core_state=None,
        cache_scale: Float[Array, " B"] | None = None, page_table: Int[Array, "B M"] | None = None,
    ):  # fmt: skip
        """``cache_scale`` [B] marks an FP8 cache of rows, ``page_table`` [B, M] a paged
        one (``rows`` then a pool [n_pages, P, D]), as
        :func:`jsparse.indexed_mla_attention` takes them; prefill sees them as dense f32."""
        params = params_values(self.params)
        check_query(q, q_positions, k_positions)
        check_core_state(self.selector, params, core_state)
        calibrated = getattr(self.selector, "latent_dim", latent_dim)
        if calibrated != latent_dim:  # its map treats a row's first latent_dim values as c
            raise ValueError(
                f"latent_dim: the layer's rows hold {latent_dim} latent values; the selector "
                f"{self.selector.name!r} was made for latent_dim={calibrated}"
            )
        scale_2d = None
        if cache_scale is not None:
            _checks.check_rank("cache_scale", cache_scale, 1, "[B]")
            _checks.check_dim("cache_scale", cache_scale, 0, q.shape[0], f"B of q {q.shape}")
            scale_2d = cache_scale[:, None]
        # The rows as the selector's one KV head: [B, S, 1, D] (or a pool [N, P, 1, D]).
        view = serving_view("cache", rows[..., None, :], scale_2d, page_table, k_positions,
                            q.shape)  # fmt: skip
        if q.shape[1] != 1:
            dense_rows = view.dense()
            out = self.dense(
                q, dense_rows[:, :, 0], q_positions=q_positions, k_positions=k_positions,
                scale=scale, latent_dim=latent_dim,
            )  # fmt: skip
            if core_state is None:
                return out
            return out, prefill_projection(self.selector, params, dense_rows, k_positions,
                                           self.fp8_headroom)  # fmt: skip
        idx, core_state, in_order = select_step(
            self.selector, params, q[:, 0], view, q_positions, k_positions, self.budget,
            core_state,
        )  # fmt: skip
        out = indexed_mla_attention(
            q[:, 0], rows, idx[:, 0], scale=scale, latent_dim=latent_dim,
            cache_scale=cache_scale, page_table=page_table, implementation=self.implementation,
        )[:, None]  # fmt: skip
        out = poisoned(out, in_order)
        return out if core_state is None else (out, core_state)


class SelectedMLA(nnx.Module):
    """MLA over the rows the layer's indexer selected for each query (DeepSeek-V3.2's
    sparse attention), prefill and decode alike: ``indices [B, T, K]`` row positions,
    -1 for an empty slot, each query's at or before its own position.

    A decode step is one :func:`jsparse.indexed_mla_attention` call. Prefill attends
    each query's own list too: the B·T queries become that many one-query
    "sequences" whose page table points at their sequence's rows (one page of S rows
    each, or the sequence's own row of ``page_table``), so the rows are still read in
    place and nothing is gathered or copied.

    Serving caches, as :func:`jsparse.indexed_mla_attention` takes them:
    ``cache_scale`` [B] for FP8 rows, ``page_table`` [B, M] with ``rows`` a page pool
    [n_pages, P, D].
    """

    def __init__(self, *, implementation: str | Sequence[str] | None = None):
        self.implementation = implementation

    def __call__(
        self, q, rows, *, indices, q_positions, k_positions, scale, latent_dim, core_state=None,
        cache_scale: Float[Array, " B"] | None = None, page_table: Int[Array, "B M"] | None = None,
    ):  # fmt: skip
        del q_positions, k_positions  # the indexer only lists visible rows
        b, t, h, d = q.shape
        _checks.check_rank("indices", indices, 3, "[B, T, K]")
        if indices.shape[:2] != (b, t):
            raise ValueError(
                f"indices: shape {tuple(indices.shape)}; expected [B, T, K] with B, T of q "
                f"{tuple(q.shape)}"
            )
        kwargs = dict(scale=scale, latent_dim=latent_dim, implementation=self.implementation)
        if t == 1:
            out = indexed_mla_attention(
                q[:, 0], rows, indices[:, 0], cache_scale=cache_scale, page_table=page_table,
                **kwargs,
            )[:, None]  # fmt: skip
        else:
            # Checked here: gathered by owner, a table or scale of another batch would be
            # clamped into a right-looking one (sequence 1 reading sequence 0's pages).
            if page_table is not None:
                _checks.check_rank("page_table", page_table, 2, "[B, M]")
                _checks.check_dim("page_table", page_table, 0, b, "sequences B of q")
            if cache_scale is not None:
                _checks.check_rank("cache_scale", cache_scale, 1, "[B]")
                _checks.check_dim("cache_scale", cache_scale, 0, b, "sequences B of q")
            owner = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)  # [B·T]
            out = indexed_mla_attention(
                q.reshape(b * t, h, d), rows, indices.reshape(b * t, -1),
                cache_scale=None if cache_scale is None else cache_scale[owner],
                page_table=owner[:, None] if page_table is None else page_table[owner],
                **kwargs,
            ).reshape(b, t, h, -1)  # fmt: skip
        return out if core_state is None else (out, core_state)


class MLAAttention(nnx.Module):
    """A DeepSeek-V2/V3 MLA layer (no query LoRA): ``x [B, T, d_model]`` and its cache in,
    ``[B, T, d_model]`` and the grown cache out.

    ``q = W_Q x`` per head ``[q_nope ; q_rope]``; ``[c ; k_r] = W_KVa x`` with ``c``
    RMS-normalised; ``W_KVb`` maps ``c`` to each head's ``[k_nope ; v]``. RoPE
    (rotate-half, ``rope_theta``) on ``q_rope`` and ``k_r``; logits scaled by
    ``1/sqrt(nope_dim + rope_dim)``. ``core`` (default :class:`DenseMLA`) attends.

    ``indexer`` (an :class:`jsparse.nn.Indexer` reading this layer's input): DeepSeek
    sparse attention. Every token attends only the ``indexer.top_k`` rows the indexer
    selects for it, through :class:`SelectedMLA` (the default core then, and the only
    one that takes the selection).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        latent_dim: int = 512,
        rope_dim: int = 64,
        nope_dim: int = 128,
        v_dim: int = 128,
        rope_theta: float = 1e4,
        core: nnx.Module | None = None,
        indexer: Indexer | None = None,
        fp8_headroom: float = 2.0,
        rngs: nnx.Rngs,
    ):
        if rope_dim % 2:
            raise ValueError(f"rope_dim: got {rope_dim}; expected an even number (RoPE pairs)")
        self.d_model = d_model
        self.n_heads, self.latent_dim, self.rope_dim = n_heads, latent_dim, rope_dim
        self.nope_dim, self.v_dim, self.rope_theta = nope_dim, v_dim, rope_theta
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.q_proj = linear(d_model, n_heads * (nope_dim + rope_dim))
        self.kv_a = linear(d_model, latent_dim + rope_dim)
        self.kv_norm = RMSNorm(latent_dim)
        self.kv_b = linear(latent_dim, n_heads * (nope_dim + v_dim))
        self.o_proj = linear(n_heads * v_dim, d_model)
        if not fp8_headroom >= 1.0:
            raise ValueError(f"fp8_headroom: got {fp8_headroom!r}; expected a number >= 1")
        if indexer is not None and core is not None and not isinstance(core, SelectedMLA):
            raise ValueError(
                f"core: got {type(core).__name__} with an indexer; expected SelectedMLA "
                "(the core that attends the indexer's selection) or None"
            )
        self.indexer = indexer
        self.core = core if core is not None else SelectedMLA() if indexer else DenseMLA()
        self.scale = 1.0 / math.sqrt(nope_dim + rope_dim)
        self.fp8_headroom = float(fp8_headroom)

    def _check_call(self, x, cache: MLACache) -> None:
        """``x`` and a cache this layer made for its batch, with room for the new tokens:
        otherwise the write fails deep inside XLA, or (a full cache) clamps silently."""
        _checks.check_rank("x", x, 3, f"[B, T, {self.d_model}]")
        _checks.check_floating("x", x)
        b, t, c = x.shape
        if c != self.d_model or t < 1 or b < 1:
            raise ValueError(f"x: shape {tuple(x.shape)}; expected [B ≥ 1, T ≥ 1, {self.d_model}]")
        rows = cache.rows
        if rows.ndim != 3 or rows.shape[0] != b or rows.shape[2] != self.row_width:
            raise ValueError(
                f"cache.rows: shape {tuple(rows.shape)}; expected [{b}, max_len, "
                f"{self.row_width}] (this layer's init_cache for x's batch of {b})"
            )
        if cache.lengths.shape != (b,):
            raise ValueError(f"cache.lengths: shape {tuple(cache.lengths.shape)}; expected ({b},)")
        _checks.check_cache_room(cache.lengths, t, rows.shape[1])

    @property
    def row_width(self) -> int:
        return self.latent_dim + self.rope_dim

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> MLACache:
        """An empty cache of ``max_len`` rows in ``dtype``: a float dtype, or
        ``float8_e4m3fn`` with one scale per sequence, the amax of its first write (the
        prompt) times ``fp8_headroom`` over 448; later rows keep it and saturate."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch, max_len: got {batch}, {max_len}; expected ≥ 1")
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ValueError(
                f"dtype: got {jnp.dtype(dtype).name}; expected a float dtype or float8_e4m3fn"
            )
        state = None
        if hasattr(self.core, "init_core_state"):
            state = self.core.init_core_state(batch, max_len, self.row_width)
        fp8 = jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)
        keys = None if self.indexer is None else self.indexer.init_cache(batch, max_len)
        return MLACache(
            jnp.zeros((batch, max_len, self.row_width), dtype), jnp.zeros((batch,), jnp.int32),
            state, jnp.ones((batch,), jnp.float32) if fp8 else None, keys,
        )  # fmt: skip

    def up_projections(self):
        """(W_UK [Dc, H, nope], W_UV [Dc, H, v]): ``W_KVb`` split into each head's key and
        value up-projections of the latent."""
        w = self.kv_b.kernel[...].reshape(self.latent_dim, self.n_heads, -1)
        return w[..., : self.nope_dim], w[..., self.nope_dim :]

    def absorbed(self, x: Float[Array, "B T C"], positions: Int[Array, "B T"]):
        """(absorbed queries [B, T, H, Dc + Dr], cache rows [B, T, Dc + Dr]) of ``x`` at
        ``positions``: what the core sees, and what ``jssa_mla`` calibrates on."""
        b, t, _ = x.shape
        h, dc, dr = self.n_heads, self.latent_dim, self.rope_dim
        q = self.q_proj(x).reshape(b, t, h, self.nope_dim + dr)
        kv = self.kv_a(x)
        c = self.kv_norm(kv[..., :dc])
        cos, sin = rope_angles(positions, dr, self.rope_theta)
        q_rope = apply_rope(q[..., self.nope_dim :], cos, sin)
        k_rope = apply_rope(kv[..., None, dc:], cos, sin)[:, :, 0]
        w_uk, _ = self.up_projections()
        q_c = jnp.einsum("bthn,chn->bthc", q[..., : self.nope_dim], w_uk, precision=HIGHEST)
        return jnp.concatenate([q_c, q_rope], axis=-1), jnp.concatenate([c, k_rope], axis=-1)

    def __call__(self, x: Float[Array, "B T C"], cache: MLACache):
        """``x`` [B, T, d_model] written at each sequence's ``cache.lengths``; the caller
        keeps ``lengths + T ≤ max_len`` (checked when the lengths are concrete; under
        ``jit`` XLA would clamp the write)."""
        self._check_call(x, cache)
        b, t, _ = x.shape
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        q, new_rows = self.absorbed(x, positions)
        scale, stored = cache.scale, new_rows.astype(cache.rows.dtype)
        kwargs = {}
        if scale is not None:  # FP8 rows: a sequence's first write sets its scale
            # as one KV head of the projected caches' layout: [B, T, 1, D], scales [B, 1]
            first = (cache.lengths == 0)[:, None]
            stored, scale = fp8_first_write(new_rows[:, :, None], scale[:, None], first,
                                            self.fp8_headroom)  # fmt: skip
            stored, scale = stored[:, :, 0], scale[:, 0]
            kwargs["cache_scale"] = scale
        write = jax.vmap(lambda r, n, at: jax.lax.dynamic_update_slice(r, n, (at, 0)))
        rows = write(cache.rows, stored, cache.lengths)
        lengths = cache.lengths + t
        slots = jnp.arange(rows.shape[1], dtype=jnp.int32)[None, :]
        k_positions = jnp.where(slots < lengths[:, None], slots, -1)
        kwargs |= dict(q_positions=positions, k_positions=k_positions, scale=self.scale,
                       latent_dim=self.latent_dim)  # fmt: skip
        q = q.astype(jnp.float32 if scale is not None else rows.dtype)
        index_cache = cache.indexer
        if self.indexer is not None:
            if index_cache is None:
                raise ValueError("cache: has no indexer keys; make it with layer.init_cache")
            # Rows and indexer keys must cover the same tokens (a rollback of one alone
            # would select among the rows of rejected tokens): checked when concrete.
            ours, its = _checks.concrete(cache.lengths), _checks.concrete(index_cache.lengths)
            if ours is not None and its is not None and (ours != its).any():
                raise ValueError(
                    f"cache.indexer.lengths {its.tolist()} differ from cache.lengths "
                    f"{ours.tolist()}; roll both back together (cache._replace both)"
                )
            top, index_cache = self.indexer(x, index_cache)
            kwargs["indices"] = top.indices
        if cache.core_state is None:
            out, state = self.core(q, rows, **kwargs), None
        else:
            out, state = self.core(q, rows, core_state=cache.core_state, **kwargs)
        _, w_uv = self.up_projections()
        heads = jnp.einsum("bthc,chv->bthv", out.astype(jnp.float32), w_uv, precision=HIGHEST)
        y = self.o_proj(heads.reshape(b, t, -1).astype(x.dtype))
        return y, MLACache(rows, lengths, state, scale, index_cache)
