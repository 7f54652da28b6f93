"""A Llama-architecture decoder in Flax NNX, with a swappable attention core.

The architecture of SmolLM2 (and Llama 2/3): pre-norm blocks with RMSNorm, rotary
position embeddings in the rotate-half layout, grouped-query attention, a SwiGLU MLP
and, for SmolLM2, an output head tied to the token embedding. Everything is float32.

The attention core is the one place a sparse method plugs in. ``Attention`` projects
and rotates q / k, writes k / v into the KV cache, and hands the core::

    core(q, k, v, q_positions=..., k_positions=...) -> out
      q            Float[Array, "B T H D"]     post-RoPE queries
      k            Float[Array, "B S Hkv D"]   post-RoPE keys (the whole cache, or this call's keys)
      v            Float[Array, "B S Hkv Dv"]
      q_positions  Int[Array, "B T"]           token position of each query
      k_positions  Int[Array, "B S"]           token position of each key slot, -1 = empty
      out          Float[Array, "B T H Dv"]

A query at position p may attend key slots with ``0 <= k_positions <= p`` (one that
sees none gets 0); slots need not be in position order. The core applies the
``1/sqrt(D)`` scale itself. Query head h reads KV head ``h // G``
(``G = H // Hkv``). The core may be an ``nnx.Module`` (then its state is part of the
model's) or any callable. :class:`DenseCausalAttention` is the exact default.

A core with ``reads_fp8_caches = True`` (:class:`jsparse.SparseAttention`) gets an FP8
cache as stored, with ``k_scale=`` and ``v_scale=`` [B, Hkv]; other cores get it
dequantised to f32.

A core that keeps a cache of its own beside K and V (a sparse method's projected-key
cache) defines ``init_core_state(batch, max_len, n_kv_heads, head_dim)``. Its value,
when not None, rides in each layer's :class:`KVCache` as ``core_state``; the model
then calls ``core(..., core_state=state)`` after appending this call's keys and
expects ``(out, new_state)`` back. It is a pytree, so it passes through ``jax.jit``
with the rest of the cache.

Prefill + decode: ``cache = model.init_cache(batch, max_len)``, then
``logits, cache = model(tokens, cache=cache)`` any number of times; each call appends
its tokens at positions ``cache.length ...``. All sequences of a batch share positions.

``max_seq_len`` is the trained context: it sizes the default cache, and perplexity
refuses windows past it. A call without a cache runs positions past it (rotary
embeddings extrapolate, as Hugging Face's Llama does): the model's quality there is
the caller's to judge.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jsparse import backend
from jsparse._checks import check_cache_room, concrete, is_int, is_positive_finite
from jsparse.selectors.base import fp8_first_write

__all__ = [
    "MLP",
    "Attention",
    "AttentionCore",
    "Block",
    "DenseCausalAttention",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "apply_rope",
    "forward_fn",
    "rope_angles",
]

# Full f32 matmuls: on NVIDIA GPUs jax's default precision lets XLA use TF32, whose 10-bit
# mantissa would break "the same logits to f32 tolerance" between devices and code paths.
HIGHEST = jax.lax.Precision.HIGHEST


_SIZE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "max_seq_len",
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-style decoder."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 8192
    tie_embeddings: bool = True
    name: str = "llama"

    def __post_init__(self):
        for field in _SIZE_FIELDS:
            value = getattr(self, field)
            if not is_int(value) or value < 1:
                raise ValueError(f"LlamaConfig.{field}: got {value!r}; expected an int >= 1")
        # A zero, negative or non-finite RoPE base or RMSNorm epsilon gives NaN logits.
        for field in ("rope_theta", "norm_eps"):
            value = getattr(self, field)
            if not is_positive_finite(value):
                raise ValueError(
                    f"LlamaConfig.{field}: got {value!r}; expected a finite number > 0"
                )
        if not isinstance(self.tie_embeddings, (bool, np.bool_)):  # "false" would be truthy
            raise ValueError(
                f"LlamaConfig.tie_embeddings: got {self.tie_embeddings!r}; expected a bool"
            )
        if not isinstance(self.name, str):
            raise ValueError(f"LlamaConfig.name: got {self.name!r}; expected a str")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention needs H = G * Hkv)"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim: got {self.head_dim}; RoPE needs it even")

    @property
    def group(self) -> int:
        """G: query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """The inverse of :meth:`to_dict`: every field, no other key. A missing key would
        take its default (a model without its rope_theta loads with 10000 and gives
        wrong logits) and a misspelt one would be dropped, so both are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"LlamaConfig.from_dict: got a {type(d).__name__}; expected a dict")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [k for k in names if k not in d]
        unknown = sorted(str(k) for k in d if k not in names)
        if missing or unknown:
            raise ValueError(
                f"LlamaConfig.from_dict: missing keys {missing}, unknown keys {unknown}; "
                f"expected exactly {names}"
            )
        return cls(**d)

    @classmethod
    def smollm2_135m(cls) -> LlamaConfig:
        """SmolLM2-135M(-Instruct), as its GGUF metadata gives it."""
        return cls(
            vocab_size=49152,
            d_model=576,
            n_layers=30,
            n_heads=9,
            n_kv_heads=3,
            head_dim=64,
            d_ff=1536,
            rope_theta=100_000.0,
            norm_eps=1e-5,
            max_seq_len=8192,
            tie_embeddings=True,
            name="SmolLM2-135M-Instruct",
        )


def _normal(rngs: nnx.Rngs, shape: Sequence[int], std: float = 0.02) -> jax.Array:
    return std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)


class Linear(nnx.Module):
    """``x @ kernel`` with ``kernel`` [d_in, d_out], no bias, full f32 precision."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_normal(rngs, (d_in, d_out)))

    def __call__(self, x: Float[Array, "... I"]) -> Float[Array, "... O"]:
        return jnp.einsum("...i,io->...o", x, self.kernel[...], precision=HIGHEST)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x²) + eps) * scale`` over the last axis."""

    def __init__(self, dim: int, eps: float = 1e-5):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: Float[Array, "... C"]) -> Float[Array, "... C"]:
        ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(ms + self.eps) * self.scale[...]


def rope_angles(
    positions: Int[Array, "B T"], head_dim: int, theta: float
) -> tuple[Float[Array, "B T D/2"], Float[Array, "B T D/2"]]:
    """cos and sin of ``position * theta^(-2i/D)``, i < D/2, computed in f32.

    The angle is a float32 product, as in Hugging Face's Llama; at position 8191 it is
    off by up to half an ulp of 8191 (≈ 5e-4 rad) from the exact angle.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "B T H D"], cos: Float[Array, "B T D/2"], sin: Float[Array, "B T D/2"]
) -> Float[Array, "B T H D"]:
    """Rotate-half RoPE: dimension i pairs with i + D/2 (not the interleaved 2i, 2i+1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class AttentionCore(Protocol):
    """What :class:`Attention` calls; see the module docstring for the contract."""

    def __call__(
        self,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B S Hkv D"],
        v: Float[Array, "B S Hkv Dv"],
        *,
        q_positions: Int[Array, "B T"],
        k_positions: Int[Array, "B S"],
    ) -> Float[Array, "B T H Dv"]: ...


class DenseCausalAttention(nnx.Module):
    """Exact softmax attention over every visible key, blockwise with an online softmax.

    Queries go ``query_chunk`` at a time (``lax.map``); for each query block the key
    slots are visited ``key_chunk`` at a time, flash-attention style (running max, sum
    and weighted values, Dao et al. 2022, Alg. 1), up to the last key block holding a
    slot visible to the block's latest query. Scores in memory are
    [B, H, query_chunk, key_chunk]; in a causal forward the blocks above the diagonal
    are never computed, and a decode step reads only the filled part of its cache.
    The result, in q's dtype, equals a plain softmax up to f32 summation order (f32
    accumulation whatever the inputs' dtype). Its derivative (grad or
    jvp) visits every key block, the unseen ones adding zeros: reverse mode cannot stop
    a loop at a traced count.
    """

    def __init__(self, query_chunk: int = 512, key_chunk: int = 512):
        if query_chunk < 1 or key_chunk < 1:
            raise ValueError(
                f"query_chunk, key_chunk: got {query_chunk}, {key_chunk}; expected >= 1"
            )
        self.query_chunk = query_chunk
        self.key_chunk = key_chunk

    def __call__(self, q, k, v, *, q_positions, k_positions):
        h, hkv = q.shape[2], k.shape[2]
        if h % hkv:
            raise ValueError(f"q has {h} heads, k has {hkv}: expected a multiple ({q.shape=})")
        return _dense_causal(q, k, v, q_positions, k_positions, self.query_chunk, self.key_chunk)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _dense_causal(q, k, v, q_positions, k_positions, query_chunk, key_chunk):
    return _blockwise_attention(
        q, k, v, q_positions, k_positions, query_chunk, key_chunk, skip_unseen=True
    )


@_dense_causal.defjvp
def _dense_causal_jvp(query_chunk, key_chunk, primals, tangents):
    # Skipping the key blocks no query of a block can see makes the loop's trip count a
    # traced value, which reverse mode cannot take; the derivative visits every block
    # (the unseen ones add exact zeros), so grad works and costs the full rectangle.
    q, k, v, q_positions, k_positions = primals
    out = _dense_causal(q, k, v, q_positions, k_positions, query_chunk, key_chunk)

    def every_block(q, k, v):
        return _blockwise_attention(
            q, k, v, q_positions, k_positions, query_chunk, key_chunk, skip_unseen=False
        )

    return out, jax.jvp(every_block, (q, k, v), tuple(tangents[:3]))[1]


def _blockwise_attention(q, k, v, q_positions, k_positions, query_chunk, key_chunk, *, skip_unseen):
    """:class:`DenseCausalAttention`'s computation; ``skip_unseen``: stop each query
    block's key loop after the last block it can see (a traced trip count)."""
    b, t, h, d = q.shape
    s_len, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    cq, ck = min(query_chunk, t), min(key_chunk, s_len)
    nq, nk = -(-t // cq), -(-s_len // ck)

    # Key blocks: [nk, B, Hkv, ck, D]; padded slots get position -1 (never visible).
    kpos = jnp.pad(k_positions, ((0, 0), (0, nk * ck - s_len)), constant_values=-1)
    kb = jnp.pad(k, ((0, 0), (0, nk * ck - s_len), (0, 0), (0, 0)))
    vb = jnp.pad(v, ((0, 0), (0, nk * ck - s_len), (0, 0), (0, 0)))
    kb = kb.reshape(b, nk, ck, hkv, d).transpose(1, 0, 3, 2, 4)
    vb = vb.reshape(b, nk, ck, hkv, dv).transpose(1, 0, 3, 2, 4)
    kpos = kpos.reshape(b, nk, ck).swapaxes(0, 1)  # [nk, B, ck]
    # The earliest visible position in each key block (int32 max when none).
    big = jnp.iinfo(jnp.int32).max
    first_pos = jnp.min(jnp.where(kpos >= 0, kpos, big), axis=(1, 2))  # [nk]

    # Query blocks: [nq, B, Hkv, G * cq, D]; rows are (g, query) pairs, g major.
    qb = jnp.pad(q, ((0, 0), (0, nq * cq - t), (0, 0), (0, 0)))
    qb = qb.reshape(b, nq, cq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
    qb = qb.reshape(nq, b, hkv, g * cq, d) * jnp.asarray(d**-0.5, q.dtype)
    qpos = jnp.pad(q_positions, ((0, 0), (0, nq * cq - t)), constant_values=-1)
    qpos = jnp.tile(qpos.reshape(b, nq, cq).swapaxes(0, 1), (1, 1, g))  # [nq, B, G*cq]

    def query_block(args):
        qc, qp = args  # [B, Hkv, G*cq, D], [B, G*cq]
        # Visit key blocks 0 .. the last one whose earliest position the block's latest
        # query can see (slots need not be in position order; in a cache they are).
        needed = first_pos <= jnp.max(qp)
        n_visit = jnp.max(jnp.where(needed, jnp.arange(1, nk + 1), 0))

        def key_block(j, carry):
            m, l, acc = carry
            s = jnp.einsum("bkqd,bksd->bkqs", qc, kb[j], precision=HIGHEST)
            kp = kpos[j][:, None, None, :]
            visible = (kp >= 0) & (kp <= qp[:, None, :, None])
            s = jnp.where(visible, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            correction = jnp.exp(m - shift)
            l = l * correction + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkqs,bksd->bkqd", p, vb[j], precision=HIGHEST)
            return m_new, l, acc * correction[..., None] + pv

        init = (
            jnp.full((b, hkv, g * cq), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, g * cq), jnp.float32),
            jnp.zeros((b, hkv, g * cq, dv), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(0, n_visit if skip_unseen else nk, key_block, init)
        # Padded query rows see nothing (l = 0): output 0 there instead of NaN.
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    out = jax.lax.map(query_block, (qb, qpos))  # [nq, B, Hkv, G*cq, Dv]
    out = out.reshape(nq, b, hkv, g, cq, dv).transpose(1, 0, 4, 2, 3, 5)
    return out.reshape(b, nq * cq, h, dv)[:, :t].astype(q.dtype)


class FunctionCore(nnx.Module):
    """Holds a plain function as an attention core (a static part of the model graph)."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, q, k, v, *, q_positions, k_positions):
        return self.fn(q, k, v, q_positions=q_positions, k_positions=k_positions)


def as_core_module(core: AttentionCore) -> nnx.Module:
    """``core`` itself when it is an ``nnx.Module``, else wrapped in a :class:`FunctionCore`."""
    if isinstance(core, nnx.Module):
        return core
    if not callable(core):
        raise ValueError(f"core: got {type(core).__name__}; expected a callable attention core")
    return FunctionCore(core)


FP8 = jnp.dtype(jnp.float8_e4m3fn)
# An FP8 K/V cache's scale per (sequence, KV head): the first write's amax times this
# over 448; later entries keep it and saturate beyond it.
FP8_KV_HEADROOM = 2.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One layer's cache. ``length``: tokens written so far (shared by the batch);
    ``core_state``: the attention core's own cache (see the module docstring), or None.
    An FP8 cache (``float8_e4m3fn`` k and v) has ``k_scale`` / ``v_scale`` [B, Hkv]
    (value = stored · scale), set by the first write."""

    k: Float[Array, "B S Hkv D"]
    v: Float[Array, "B S Hkv Dv"]
    positions: Int[Array, "B S"]  # token position of each slot, -1 = empty
    length: Int[Array, ""]
    core_state: Any = None
    k_scale: Float[Array, "B Hkv"] | None = None
    v_scale: Float[Array, "B Hkv"] | None = None

    @classmethod
    def empty(
        cls, batch: int, max_len: int, n_kv_heads: int, head_dim: int, core_state: Any = None,
        dtype=jnp.float32,
    ) -> KVCache:  # fmt: skip
        if not jnp.issubdtype(dtype, jnp.floating):  # an int8 cache truncated silently
            raise ValueError(
                f"dtype: {jnp.dtype(dtype)}; expected float32, a 16-bit float or {FP8}"
            )
        fp8 = jnp.dtype(dtype) == FP8

        def scale():  # one buffer each: the cache is donated to jitted steps
            return jnp.ones((batch, n_kv_heads), jnp.float32) if fp8 else None

        return cls(
            k=jnp.zeros((batch, max_len, n_kv_heads, head_dim), dtype),
            v=jnp.zeros((batch, max_len, n_kv_heads, head_dim), dtype),
            positions=jnp.full((batch, max_len), -1, jnp.int32),
            length=jnp.zeros((), jnp.int32),
            core_state=core_state,
            k_scale=scale(),
            v_scale=scale(),
        )

    def append(self, k, v, positions) -> KVCache:
        """Writes T new entries at slots ``length ... length + T - 1`` (FP8: scaled, the
        first write setting the scales)."""
        start = self.length
        k_scale, v_scale = self.k_scale, self.v_scale
        if k_scale is not None:
            k, k_scale = fp8_first_write(k, k_scale, start == 0, FP8_KV_HEADROOM)
            v, v_scale = fp8_first_write(v, v_scale, start == 0, FP8_KV_HEADROOM)
        return dataclasses.replace(
            self,
            k=jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), (0, start, 0, 0)),
            v=jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), (0, start, 0, 0)),
            positions=jax.lax.dynamic_update_slice(self.positions, positions, (0, start)),
            length=start + k.shape[1],
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def widened(self) -> tuple[Array, Array]:
        """(k, v) in f32: dequantised when FP8, as stored otherwise."""
        if self.k_scale is None:
            return self.k, self.v
        k = self.k.astype(jnp.float32) * self.k_scale[:, None, :, None]
        return k, self.v.astype(jnp.float32) * self.v_scale[:, None, :, None]


class Attention(nnx.Module):
    """GQA self-attention: projections and RoPE here, the attention itself in ``core``."""

    def __init__(self, config: LlamaConfig, core: AttentionCore | None = None, *, rngs):
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.rope_theta = c.rope_theta
        self.q_proj = Linear(c.d_model, c.n_heads * c.head_dim, rngs=rngs)
        self.k_proj = Linear(c.d_model, c.n_kv_heads * c.head_dim, rngs=rngs)
        self.v_proj = Linear(c.d_model, c.n_kv_heads * c.head_dim, rngs=rngs)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.d_model, rngs=rngs)
        self.core = as_core_module(core if core is not None else DenseCausalAttention())

    def project_qkv(self, x: Float[Array, "B T C"], positions: Int[Array, "B T"]):
        """Post-RoPE ``q`` [B, T, H, D], ``k`` [B, T, Hkv, D] and ``v`` [B, T, Hkv, D]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        cos, sin = rope_angles(positions, self.head_dim, self.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, positions, cache: KVCache | None = None):
        """Core attention + output projection; appends k / v to ``cache`` if given."""
        b, t = q.shape[:2]
        if cache is None:
            out = self.core(q, k, v, q_positions=positions, k_positions=positions)
        else:
            cache = cache.append(k, v, positions)
            kw = dict(q_positions=positions, k_positions=cache.positions)
            ck, cv = cache.k, cache.v
            if cache.k_scale is not None:  # FP8: scales to a core that reads them in place
                if getattr(self.core, "reads_fp8_caches", False):
                    kw |= dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
                else:
                    ck, cv = cache.widened()
            if cache.core_state is None:
                out = self.core(q, ck, cv, **kw)
            else:
                out, state = self.core(q, ck, cv, core_state=cache.core_state, **kw)
                cache = dataclasses.replace(cache, core_state=state)
        return self.o_proj(out.reshape(b, t, -1)), cache

    def __call__(self, x, positions, cache: KVCache | None = None):
        q, k, v = self.project_qkv(x, positions)
        return self.attend(q, k, v, positions, cache)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
        self.gate_proj = Linear(d_model, d_ff, rngs=rngs)
        self.up_proj = Linear(d_model, d_ff, rngs=rngs)
        self.down_proj = Linear(d_ff, d_model, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, core: AttentionCore | None = None, *, rngs):
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, core, rngs=rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config.d_model, config.d_ff, rngs=rngs)

    def __call__(self, x, positions, cache: KVCache | None = None):
        h, cache = self.attn(self.attn_norm(x), positions, cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache

    def forward_with_qkv(self, x, positions):
        """Like ``__call__`` without a cache, also returning this layer's post-RoPE q, k, v."""
        q, k, v = self.attn.project_qkv(self.attn_norm(x), positions)
        h, _ = self.attn.attend(q, k, v, positions)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), (q, k, v)


class Llama(nnx.Module):
    """The decoder. ``model(tokens, cache=None) -> (logits, cache)``.

    ``core`` makes the attention core of each layer: ``core(layer_index) ->
    AttentionCore`` (default: a :class:`DenseCausalAttention` per layer), so a sparse
    method can carry per-layer state (calibrated bases, say). :meth:`set_core` swaps
    the cores of a built or loaded model. Weights are random (std 0.02) until loaded;
    see :func:`jsparse.models.gguf_loader.load_model`.
    """

    def __init__(
        self,
        config: LlamaConfig,
        core: Callable[[int], AttentionCore] | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.embed = nnx.Param(_normal(rngs, (config.vocab_size, config.d_model)))
        self.layers = nnx.List(
            [
                Block(config, None if core is None else core(i), rngs=rngs)
                for i in range(config.n_layers)
            ]
        )
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        if not config.tie_embeddings:
            self.lm_head = Linear(config.d_model, config.vocab_size, rngs=rngs)

    def set_core(self, core: Callable[[int], AttentionCore]) -> None:
        """Replaces every layer's attention core with ``core(layer_index)``."""
        for i, layer in enumerate(self.layers):
            layer.attn.core = as_core_module(core(i))

    def init_cache(
        self, batch: int, max_len: int | None = None, dtype=jnp.float32
    ) -> tuple[KVCache, ...]:
        """An empty KV cache of ``max_len`` slots (default: the model's context) per layer,
        with each core's own state where its core defines ``init_core_state``. ``dtype``:
        float32, or ``float8_e4m3fn`` (scales per sequence and KV head, see
        :class:`KVCache`)."""
        c = self.config
        max_len = c.max_seq_len if max_len is None else max_len
        caches = []
        for layer in self.layers:
            init = getattr(layer.attn.core, "init_core_state", None)
            state = None if init is None else init(batch, max_len, c.n_kv_heads, c.head_dim)
            caches.append(
                KVCache.empty(batch, max_len, c.n_kv_heads, c.head_dim, state, dtype=dtype)
            )
        return tuple(caches)

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T C"]:
        return jnp.take(self.embed[...], tokens, axis=0)

    def positions_for(self, tokens, cache: Sequence[KVCache] | None):
        b, t = tokens.shape
        start = 0 if cache is None else cache[0].length
        return jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))

    def hidden_states(
        self, tokens: Int[Array, "B T"], cache: Sequence[KVCache] | None = None
    ) -> tuple[Float[Array, "B T C"], tuple[KVCache, ...] | None]:
        """The final-norm hidden states (what the output head reads) and the new cache."""
        _check_tokens(tokens, self.config, cache)
        positions = self.positions_for(tokens, cache)
        x = self.embed_tokens(tokens)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, None if cache is None else cache[i])
            new_cache.append(layer_cache)
        return self.norm(x), None if cache is None else tuple(new_cache)

    def logits(self, h: Float[Array, "... C"]) -> Float[Array, "... V"]:
        if self.config.tie_embeddings:
            return jnp.einsum("...c,vc->...v", h, self.embed[...], precision=HIGHEST)
        return self.lm_head(h)

    def __call__(self, tokens: Int[Array, "B T"], cache: Sequence[KVCache] | None = None):
        h, cache = self.hidden_states(tokens, cache)
        return self.logits(h), cache


def integer_ids(name: str, tokens) -> Any:
    """``tokens`` unchanged when it has an integer dtype; a nested list of python ints
    as a numpy array. A float, bool or other dtype is refused: converting it to int32
    would truncate (1.7 -> 1) or wrap silently."""
    if not hasattr(tokens, "dtype"):
        try:
            array = np.asarray(tokens)
        except ValueError as err:  # ragged nested lists
            raise ValueError(f"{name}: not an array of token ids ({err})") from None
        if array.size == 0:  # [] reads as float64
            array = array.astype(np.int32)
        elif array.dtype == object and all(
            isinstance(v, int) and not isinstance(v, bool) for v in array.flat
        ):  # python ints beyond uint64: no vocabulary holds them
            big = next(i for i, v in enumerate(array.flat) if not -(2**63) <= v < 2**63)
            pos = np.unravel_index(big, array.shape)
            raise ValueError(
                f"{name}: id {array.flat[big]} at position "
                f"{tuple(int(i) for i in pos) if array.ndim > 1 else big} is outside the int64 "
                f"range; expected ids in the model's vocabulary"
            )
        tokens = array
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"{name}: dtype {jnp.dtype(tokens.dtype).name} is not an integer type; "
            f"expected integer token ids"
        )
    return tokens


def check_id_range(name: str, values: np.ndarray, vocab_size: int) -> None:
    """Every id of the concrete ``values`` in ``[0, vocab_size)``; out of range, a
    gather would clamp, wrap or read NaN silently. Names the first bad id's position."""
    if not values.size:
        return
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        where = pos[0] if len(pos) == 1 else pos
        raise ValueError(
            f"{name}: ids must lie in [0, {vocab_size}); got {values[pos]} at position "
            f"{where} ({int(bad.sum())} out of range; min {values.min()}, max {values.max()})"
        )


def _check_tokens(tokens, config: LlamaConfig, cache) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens: expected rank 2 [B, T], got shape {tuple(tokens.shape)}")
    integer_ids("tokens", tokens)
    if 0 in tokens.shape:
        # Nothing to run: the attention blocks would divide by T = 0, the checks reduce
        # over no ids.
        raise ValueError(
            f"tokens: shape {tuple(tokens.shape)} is empty; expected B >= 1 sequences "
            f"of T >= 1 tokens"
        )
    if cache is not None:
        if len(cache) != config.n_layers:
            raise ValueError(f"cache: {len(cache)} layers, the model has {config.n_layers}")
        check_cache_room(cache[0].length, tokens.shape[1], cache[0].k.shape[1])
        if cache[0].k.shape[0] != tokens.shape[0]:
            raise ValueError(f"cache: batch {cache[0].k.shape[0]}, tokens batch {tokens.shape[0]}")
    values = concrete(tokens)
    if values is not None:
        check_id_range("tokens", values, config.vocab_size)


def forward_fn(model: Llama) -> Callable[..., Any]:
    """A jitted ``(tokens, cache=None) -> (logits, cache)`` closed over ``model``'s weights.

    The weights are passed to the compiled function as arguments (not baked in as
    constants); the model is split once, so repeated calls pay no graph traversal.
    Later changes to ``model`` are not seen: call this again after loading new weights.
    Inputs are checked here, on concrete values, before the compiled call.

    The cache passed in is donated: its buffers become the returned cache's, updated in
    place, so a decode step does not copy the whole K/V (and projected) cache. Use the
    returned cache; the one passed in is consumed (``logits, cache = fwd(x, cache)``).
    """
    graphdef, state = nnx.split(model)
    config = model.config

    @backend.jit_per_mode(donate_argnames="cache")
    def run(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache)

    def forward(tokens, cache=None):
        # Checked before the int32 conversion, which would truncate floats and wrap
        # ids >= 2^31 into range.
        tokens = integer_ids("tokens", tokens)
        _check_tokens(tokens, config, cache)
        return run(state, jnp.asarray(tokens, jnp.int32), cache)

    return forward
