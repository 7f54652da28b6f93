"""DeepSeek-V3.2's lightning indexer as a Flax NNX module, selecting with the exact Top-K.

Each token t asks with ``H`` small heads and each cached token i answers with one key
shared by every head (MATH.md §1.1)::

    s[t, i] = Σ_h w[t, h] · relu(q[t, h] · k[i]) · k_scale[i]

The module follows ``Indexer.forward`` of DeepSeek-V3.2: ``q = W_q · (query input)``
per head and ``k = LayerNorm(W_k x)``, RoPE on the first ``rope_dim`` dims of both
(rotate-half), a Hadamard rotation (``rotate_activation``), FP8 e4m3 with one scale per
key and per (query, head) (``act_quant`` at D = 128), and the head weights
``W_w x · H^-1/2 · D^-1/2`` times each query head's FP8 scale. The query input is ``x``,
or the model's query latent (V3.2: ``q_norm(wq_a(x))``) when ``query_dim`` is set.

Selection is exact (id for id the Top-K of full scoring, ties by lower id): every query
sees its sequence's keys up to its own position. A decode step (T = 1) selects with
:func:`jsparse.indexer_topk_batch` (``base``, ``xla``) or with witness thresholds
(:func:`jsparse.certified.indexer_topk_decode`, ``dosa``); prefill and chunked prefill
(T > 1) pack every sequence into one causal :func:`jsparse.indexer_topk` call, with any
method, whose kernels skip the key tiles no query of a tile can see. (The jnp reference
scores whole rows, so on a CPU a packed call of B sequences costs B times the work of
B separate calls.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jsparse import _checks
from jsparse.certified.decode import indexer_topk_decode
from jsparse.models.llama import apply_rope, rope_angles
from jsparse.ops.indexer import IndexerTopK, indexer_scores, indexer_topk, indexer_topk_batch
from jsparse.ops.indexer.api import METHODS
from jsparse.ops.indexer.prepare import hadamard, quantize_fp8, quantize_fp8_straight_through

CACHE_DTYPES = (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32)
BATCH_METHODS = ("xla", "base")  # what indexer_topk_batch selects with


class IndexerCache(NamedTuple):
    """One layer's indexer keys (a pytree): ``keys[b, :lengths[b]]`` filled in position
    order; ``scale`` the FP8 keys' per-key scales (None for bf16 / f32 keys);
    ``witnesses`` the ``dosa`` decode's witness ids (None for other methods)."""

    keys: Float[Array, "B S D"]
    scale: Float[Array, "B S"] | None
    lengths: Int[Array, " B"]
    witnesses: Int[Array, "B W"] | None = None


class Indexer(nnx.Module):
    """DeepSeek-V3.2's lightning indexer: ``x [B, T, d_model]`` and its cache in, the exact
    Top-K of every query's visible keys and the grown cache out.

    Args:
      d_model: width of ``x``.
      n_heads: indexer heads H (V3.2: 64).
      head_dim: D (V3.2: 128); a power of two when ``rotate``.
      rope_dim: leading dims of q and k that RoPE rotates (V3.2: 64); even, ≤ D.
      top_k: K, keys selected per query (V3.2: 2048).
      query_dim: width of the query input when it is not ``x`` (V3.2: the query latent,
        ``q_lora_rank`` = 1536); then every call passes ``query_input``.
      rope_theta: RoPE base.
      cache_dtype: float8_e4m3fn (V3.2: FP8 queries and keys with per-row scales),
        bfloat16 or float32 (no scales).
      rotate: apply the Hadamard rotation before the cast.
      method: ``"base"`` (default), ``"xla"``, ``"full"``, ``"dense"`` or ``"dosa"``
        (:func:`jsparse.indexer_topk`); every one returns the same ids.
      implementation: for the selection ops (see :mod:`jsparse.backend`).
      rngs: for the projections.
    """

    def __init__(
        self,
        d_model: int,
        *,
        n_heads: int = 64,
        head_dim: int = 128,
        rope_dim: int = 64,
        top_k: int = 2048,
        query_dim: int | None = None,
        rope_theta: float = 1e4,
        cache_dtype=jnp.float8_e4m3fn,
        rotate: bool = True,
        method: str = "base",
        implementation: str | Sequence[str] | None = None,
        rngs: nnx.Rngs,
    ):
        if rope_dim % 2 or not 0 <= rope_dim <= head_dim:
            raise ValueError(
                f"rope_dim: got {rope_dim}; expected an even number in [0, D={head_dim}]"
            )
        if rotate and head_dim & (head_dim - 1):
            raise ValueError(
                f"head_dim: got {head_dim}; the Hadamard rotation needs a power of two"
            )
        if method not in METHODS:
            raise ValueError(f"method: got {method!r}; expected one of {METHODS}")
        if jnp.dtype(cache_dtype) not in [jnp.dtype(d) for d in CACHE_DTYPES]:
            raise ValueError(
                f"cache_dtype: got {jnp.dtype(cache_dtype).name}; expected float8_e4m3fn, "
                "bfloat16 or float32"
            )
        self.top_k = _checks.check_top_k(top_k)
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.query_dim, self.rope_theta, self.rotate = query_dim, rope_theta, rotate
        self.cache_dtype = jnp.dtype(cache_dtype)
        self.method, self.implementation = method, implementation
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.wq = linear(query_dim or d_model, n_heads * head_dim)
        self.wk = linear(d_model, head_dim)
        self.k_norm = nnx.LayerNorm(head_dim, epsilon=1e-6, rngs=rngs)
        self.weights_proj = linear(d_model, n_heads)

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == jnp.dtype(jnp.float8_e4m3fn)

    def _rope_and_rotate(self, x, positions):
        r = self.rope_dim
        if r:
            cos, sin = rope_angles(positions, r, self.rope_theta)
            x = jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
        return hadamard(x) if self.rotate else x

    def queries(
        self,
        x: Float[Array, "B T C"],
        positions: Int[Array, "B T"],
        query_input=None,
        *,
        straight_through: bool = False,
    ) -> tuple[Float[Array, "B T H D"], Float[Array, "B T H"]]:
        """(queries in ``cache_dtype``, float32 head weights with each FP8 query head's
        scale folded in) of the tokens ``x`` at ``positions``. ``straight_through``
        (training): FP8 queries come as their values in bfloat16, differentiable
        (:func:`~jsparse.ops.indexer.prepare.quantize_fp8_straight_through`)."""
        if (query_input is None) != (self.query_dim is None):
            raise ValueError(
                "query_input: " + ("required" if self.query_dim else "not taken")
                + f" (query_dim = {self.query_dim})"
            )  # fmt: skip
        source = x if query_input is None else query_input
        width = self.wq.in_features
        if source.ndim != 3 or source.shape[:2] != x.shape[:2] or source.shape[2] != width:
            name = "x" if query_input is None else "query_input"
            raise ValueError(
                f"{name}: shape {tuple(source.shape)}; expected [B, T, {width}] with B, T of "
                f"x {tuple(x.shape)}"
            )
        b, t = x.shape[:2]
        h, d = self.n_heads, self.head_dim
        q = self.wq(source.astype(jnp.float32)).reshape(b, t, h, d)
        q = self._rope_and_rotate(q, positions)
        weights = self.weights_proj(x.astype(jnp.float32)) * (h**-0.5 * d**-0.5)
        if not self.fp8:
            return q.astype(self.cache_dtype), weights
        quantize = quantize_fp8_straight_through if straight_through else quantize_fp8
        q8, q_scale = quantize(q)  # one scale per (token, head)
        return q8, weights * q_scale

    def keys(
        self, x: Float[Array, "B T C"], positions: Int[Array, "B T"], *, straight_through=False
    ) -> tuple[Float[Array, "B T D"], Float[Array, "B T"] | None]:
        """(keys in ``cache_dtype``, their FP8 scales or None) of the tokens ``x``;
        ``straight_through`` as in :meth:`queries`."""
        k = self.k_norm(self.wk(x.astype(jnp.float32)))
        k = self._rope_and_rotate(k[:, :, None], positions)[:, :, 0]
        if not self.fp8:
            return k.astype(self.cache_dtype), None
        return (quantize_fp8_straight_through if straight_through else quantize_fp8)(k)

    def init_cache(self, batch: int, max_len: int) -> IndexerCache:
        """An empty cache for ``max_len`` tokens per sequence."""
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch, max_len: got {batch}, {max_len}; expected ≥ 1")
        scale = jnp.ones((batch, max_len), jnp.float32) if self.fp8 else None
        witnesses = None
        if self.method == "dosa":
            witnesses = jnp.full((batch, 2 * self.top_k), -1, jnp.int32)
        return IndexerCache(
            jnp.zeros((batch, max_len, self.head_dim), self.cache_dtype), scale,
            jnp.zeros((batch,), jnp.int32), witnesses,
        )  # fmt: skip

    def __call__(
        self, x: Float[Array, "B T C"], cache: IndexerCache, *, query_input=None
    ) -> tuple[IndexerTopK, IndexerCache]:
        """Writes the new tokens' keys, then selects for each new token the ``top_k`` keys
        of its sequence at positions ≤ its own.

        Returns (:class:`jsparse.IndexerTopK` with ``[B, T, ...]`` fields, ids being
        positions in the sequence, -1 / -inf past the visible count; the new cache).
        The caller keeps ``lengths + T ≤ max_len`` (checked when the lengths are
        concrete; under ``jit`` XLA would clamp the write).
        """
        _checks.check_rank("x", x, 3, "[B, T, d_model]")
        b, t, _ = x.shape
        self._check_cache(cache, b)
        _checks.check_cache_room(cache.lengths, t, cache.keys.shape[1])
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        q, weights = self.queries(x, positions, query_input)
        k_new, scale_new = self.keys(x, positions)
        write = jax.vmap(lambda old, new, at: jax.lax.dynamic_update_slice_in_dim(old, new, at, 0))
        keys = write(cache.keys, k_new, cache.lengths)
        scale = None if scale_new is None else write(cache.scale, scale_new, cache.lengths)
        lengths = cache.lengths + t
        witnesses = cache.witnesses
        if t == 1 and self.method in BATCH_METHODS:
            top = indexer_topk_batch(
                q[:, 0], weights[:, 0], keys, self.top_k, lengths=lengths, k_scale=scale,
                method=self.method, implementation=self.implementation,
            )  # fmt: skip
            top = jax.tree.map(lambda a: a[:, None], top)
        elif t == 1 and self.method == "dosa":
            top, witnesses = indexer_topk_decode(
                q[:, 0], weights[:, 0], keys, self.top_k, k_scale=scale, lengths=lengths,
                witnesses=witnesses, implementation=self.implementation,
            )  # fmt: skip
            top = jax.tree.map(lambda a: a[:, None], top)
        else:
            top = self._packed_topk(q, weights, keys, scale, positions)
            if witnesses is not None:  # the last token's Top-K seeds the next step
                last = top.indices[:, -1]
                witnesses = jnp.full_like(witnesses, -1).at[:, : last.shape[1]].set(last)
        return top, IndexerCache(keys, scale, lengths, witnesses)

    def _check_cache(self, cache: IndexerCache, batch: int) -> None:
        """A cache this layer made (``init_cache``) for ``batch`` sequences, not another
        layer's: the write into it would otherwise fail deep inside XLA."""
        keys = cache.keys
        want = f"[{batch}, max_len, {self.head_dim}] {self.cache_dtype.name}"
        if keys.ndim != 3 or keys.shape[0] != batch or keys.shape[2] != self.head_dim or (
            keys.dtype != self.cache_dtype
        ):  # fmt: skip
            raise ValueError(
                f"cache.keys: {tuple(keys.shape)} {keys.dtype.name}; expected {want} "
                "(this layer's init_cache)"
            )
        if (cache.scale is None) == self.fp8 or cache.lengths.shape != (batch,):
            raise ValueError(
                "cache: expected this layer's init_cache (FP8 keys carry scales [B, max_len], "
                f"others none; lengths [B]); got scale "
                f"{None if cache.scale is None else tuple(cache.scale.shape)}, lengths "
                f"{tuple(cache.lengths.shape)}"
            )

    def _packed_topk(self, q, weights, keys, scale, positions) -> IndexerTopK:
        """Every sequence's queries in one causal call over the concatenated caches:
        query (b, t) sees flat keys [b·S, b·S + position + 1)."""
        b, t, h, d = q.shape
        s_max = keys.shape[1]
        offset = (jnp.arange(b, dtype=jnp.int32) * s_max)[:, None]  # [B, 1]
        top = indexer_topk(
            q.reshape(b * t, h, d), weights.reshape(b * t, h), keys.reshape(b * s_max, d),
            self.top_k, k_scale=None if scale is None else scale.reshape(-1),
            kv_start=jnp.broadcast_to(offset, (b, t)).reshape(-1),
            kv_end=(offset + positions + 1).reshape(-1), method=self.method,
            implementation=self.implementation,
        )  # fmt: skip
        top = jax.tree.map(lambda a: a.reshape(b, t, *a.shape[1:]), top)
        ids = jnp.where(top.indices >= 0, top.indices - offset[:, :, None], -1)
        return top.replace(indices=ids)

    def scores(self, x: Float[Array, "B T C"], *, query_input=None) -> Float[Array, "B T T"]:
        """Every causal score of a sequence's tokens against each other (``-inf`` above
        the diagonal), through :func:`jsparse.indexer_scores`: differentiable, for
        training the indexer (:func:`distillation_loss`). No cache."""
        _checks.check_rank("x", x, 3, "[B, T, d_model]")
        b, t, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # FP8 values carried in bfloat16: a float8 array would round the gradient to E4M3
        q, weights = self.queries(x, positions, query_input, straight_through=True)
        k, scale = self.keys(x, positions, straight_through=True)
        if scale is None:  # a unit scale multiplies exactly
            scale = jnp.ones((b, t), jnp.float32)
        end = jnp.arange(1, t + 1, dtype=jnp.int32)

        def one(q, w, k, s):
            return indexer_scores(
                q, w, k, k_scale=s, kv_start=jnp.zeros_like(end), kv_end=end,
                implementation=self.implementation,
            )  # fmt: skip

        return jax.vmap(one)(q, weights, k, scale)


def causal_attention_probs(
    q: Float[Array, "B T H D"], k: Float[Array, "B T Hkv D"]
) -> Float[Array, "B T H T"]:
    """Causal softmax attention probabilities of a sequence's tokens (scale D^-1/2, GQA:
    query head h reads KV head h // (H / Hkv)): the target :func:`distillation_loss`
    fits the indexer to, from a frozen model's q and k."""
    group = q.shape[2] // k.shape[2]
    logits = jnp.einsum(
        "bthd,bshd->bths", q.astype(jnp.float32), jnp.repeat(k.astype(jnp.float32), group, 2)
    )
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None, :, None, :]
    return jax.nn.softmax(jnp.where(causal, logits * q.shape[-1] ** -0.5, -jnp.inf), axis=-1)


def distillation_loss(
    index_scores: Float[Array, "B T S"], attention: Float[Array, "B T H S"]
) -> Float[Array, ""]:
    """DeepSeek-V3.2's indexer training loss: Σ over queries of KL(p ‖ softmax(I)), with
    ``p`` the main attention's probabilities summed over heads and L1-normalised,
    averaged over the B·T queries.

    ``index_scores``: the indexer's scores, ``-inf`` where a key is not a candidate
    (invisible, or outside the selected set in sparse training); ``attention``: the main
    attention's probabilities (zero where not visible). Gradients reach the indexer
    only: the target is held fixed (``stop_gradient``), as in the paper.
    """
    target = jax.lax.stop_gradient(attention.astype(jnp.float32).sum(axis=2))  # [B, T, S]
    target = target / jnp.maximum(target.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    log_q = jax.nn.log_softmax(index_scores.astype(jnp.float32), axis=-1)
    keep = target > 0
    terms = jnp.where(keep, target * (jnp.log(jnp.where(keep, target, 1.0)) - log_q), 0.0)
    return terms.sum(axis=-1).mean()
