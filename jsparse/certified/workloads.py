"""Named indexer workloads for measuring pruning (survival depends on the data).

* ``iid``: Gaussian queries, keys and signed weights: no structure at all, the
  pessimistic case for both the seeds and the certificate.
* ``deepseek_like``: inputs built the way the DeepSeek-V3.2 lightning indexer builds
  them (``deepseek-ai/DeepSeek-V3.2-Exp``, ``inference/model.py``, class ``Indexer``),
  from synthetic hidden states with text-like locality. Each modelling choice is
  listed in :func:`deepseek_like`, with the line of that code it follows or the
  assumption it makes where the code cannot say (trained weights are not available
  here: the projections are random, coupled only as documented).
* ``low_survival``: a constructed case where the certificate is nearly exact and the
  seeds find the true threshold, so survival is a few percent by design. It exists to
  measure the kernels' speed in the regime the paper reports (2.65% survival), not to
  say anything about real data.
* :func:`from_arrays`: real indexer inputs (e.g. from the issue that distils an indexer
  into a real model), quantised like DeepSeek's key cache if asked. Those are the
  numbers that count.

Every generator returns a :class:`Workload` whose fields feed :func:`jsparse.indexer_topk`
directly. Generation runs in JAX on the default device (a GPU for the benchmark sizes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse.ops.indexer.prepare import hadamard, quantize_fp8


@dataclasses.dataclass(frozen=True)
class Workload:
    """Inputs of one indexer call (fields as in :func:`jsparse.indexer_topk`)."""

    name: str
    q: Float[Array, "T H D"]
    weights: Float[Array, "T H"]
    k: Float[Array, "S D"]
    k_scale: Float[Array, " S"] | None
    kv_start: Int[Array, " T"]
    kv_end: Int[Array, " T"]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        t, h, d = self.q.shape
        return t, self.k.shape[0], h, d


@dataclasses.dataclass(frozen=True)
class DecodeWorkload:
    """A batch of sequences decoded for ``steps`` steps (for :func:`indexer_topk_decode`).

    Step n's query of sequence b is ``q[n, b]``; it sees keys 0 .. lengths[b] + n.
    """

    name: str
    q: Float[Array, "N B H D"]
    weights: Float[Array, "N B H"]
    k_cache: Float[Array, "B S D"]
    k_scale: Float[Array, "B S"] | None
    lengths: Int[Array, " B"]  # visible keys at step 0

    def step(self, n: int):
        """(q, weights, lengths) of step n."""
        return self.q[n], self.weights[n], self.lengths + n + 1


def _ranges(num_queries: int, num_keys: int, causal: bool):
    """Query t at position S − T + t: a prefill chunk (T < S) or a full prefill (T = S)."""
    t = jnp.arange(num_queries, dtype=jnp.int32)
    start = jnp.zeros((num_queries,), jnp.int32)
    if not causal:
        return start, jnp.full((num_queries,), num_keys, jnp.int32)
    return start, num_keys - num_queries + t + 1


def iid(
    num_queries: int, num_keys: int, *, heads: int = 64, dim: int = 128, causal: bool = True,
    seed: int = 0, fp8_queries: bool = False,
) -> Workload:  # fmt: skip
    """i.i.d. N(0, 1) queries and keys, N(0, 1/(H·D)) signed weights; FP8 keys."""
    q, w, k8, k_scale = _iid_core(
        jax.random.key(seed), num_queries=num_queries, num_keys=num_keys, heads=heads, dim=dim,
        fp8_queries=fp8_queries,
    )  # fmt: skip
    start, end = _ranges(num_queries, num_keys, causal)
    return Workload("iid", q, w, k8, k_scale, start, end)


@functools.partial(
    jax.jit, static_argnames=("num_queries", "num_keys", "heads", "dim", "fp8_queries")
)
def _iid_core(key, *, num_queries, num_keys, heads, dim, fp8_queries):
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (num_queries, heads, dim), jnp.float32)
    k = jax.random.normal(kk, (num_keys, dim), jnp.float32)
    w = jax.random.normal(kw, (num_queries, heads), jnp.float32) / math.sqrt(heads * dim)
    k8, k_scale = quantize_fp8(k)
    q, w = _queries(q, w, fp8_queries)
    return q, w, k8, k_scale


def _queries(q, w, fp8):
    """bf16 queries, or FP8 with the per-head scale folded into the weights (DeepSeek)."""
    if not fp8:
        return q.astype(jnp.bfloat16), w
    q8, q_scale = quantize_fp8(q)
    return q8, (w * q_scale).astype(jnp.float32)


def _rope_half(x, positions, rope_dim: int, theta: float = 10000.0):
    """RoPE on the first ``rope_dim`` dims (at most half of them), rotate-half layout."""
    rope_dim = min(rope_dim, x.shape[-1] // 2)
    half = rope_dim // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [N, half]
    shape = (ang.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = jnp.cos(ang).reshape(shape), jnp.sin(ang).reshape(shape)
    x1, x2, rest = x[..., :half], x[..., half:rope_dim], x[..., rope_dim:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _linear_recurrence(a: float, b: Float[Array, "N M"]) -> Float[Array, "N M"]:
    """y_t = a·y_{t-1} + b_t (y_{-1} = 0), as a parallel scan."""

    def combine(left, right):
        return left[0] * right[0], left[1] * right[0] + right[1]

    coeff = jnp.full((b.shape[0], 1), a, b.dtype)
    return jax.lax.associative_scan(combine, (coeff, b))[1]


def _rms_norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _layer_norm(x, eps=1e-6):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps)


@dataclasses.dataclass(frozen=True)
class DeepSeekLikeParams:
    """Knobs of :func:`deepseek_like`, fixed a priori (not tuned for pruning).

    Sizes follow DeepSeek-V3.2 (``index_n_heads=64``, ``index_head_dim=128``,
    ``qk_rope_head_dim=64``) except the model width, scaled down from 7168 (only the
    geometry after the projections matters to the indexer).
    """

    model_dim: int = 1024
    q_lora_rank: int = 384  # 1536 in V3.2, scaled with model_dim
    rope_dim: int = 64
    rope_theta: float = 10000.0
    segment_mean: float = 512.0  # mean tokens per topic segment (paragraph-scale)
    local_corr: float = 0.98  # per-token correlation of the local state (~50 tokens)
    mean_weight: float = 1.0  # residual-stream mean component, relative to topic
    local_weight: float = 0.7
    noise_weight: float = 0.5
    query_key_coupling: float = 0.5  # share of a head's query map aligned with W_k


def _hidden_states(key, n: int, p: DeepSeekLikeParams):
    """Synthetic residual stream with text-like locality, RMS-normalised (``attn_norm``)."""
    k_mean, k_topic, k_seg, k_local, k_noise = jax.random.split(key, 5)
    mean = jax.random.normal(k_mean, (p.model_dim,))
    breaks = jax.random.uniform(k_seg, (n,)) < 1.0 / p.segment_mean
    segment = jnp.cumsum(breaks)
    n_topics = 4096
    topics = jax.random.normal(k_topic, (n_topics, p.model_dim))
    topic = topics[segment % n_topics]
    eps = jax.random.normal(k_local, (n, p.model_dim)) * math.sqrt(1 - p.local_corr**2)
    local = _linear_recurrence(p.local_corr, eps)
    noise = jax.random.normal(k_noise, (n, p.model_dim))
    x = p.mean_weight * mean + topic + p.local_weight * local + p.noise_weight * noise
    return _rms_norm(x)


@dataclasses.dataclass(frozen=True)
class _IndexerWeights:
    wq_a: jax.Array  # [model_dim, q_lora_rank]
    wq_b: jax.Array  # [q_lora_rank, H·D]
    wk: jax.Array  # [model_dim, D]
    w_proj: jax.Array  # [model_dim, H]


def _indexer_weights(key, heads, dim, p: DeepSeekLikeParams) -> _IndexerWeights:
    """Random projections at the usual 1/√fan_in scale, with one documented coupling.

    A trained indexer's query map is correlated with its key map (it is trained to
    find the tokens attention uses); random maps would make q·k independent of how
    similar two hidden states are. Each head's query map is therefore
    ``c·(W_k mixed by a random rotation-like map) + √(1−c²)·(independent map)`` with
    c = ``query_key_coupling`` for the part that ``wq_b ∘ wq_a`` can express.
    """
    ka, kb, kk, kw, kc = jax.random.split(key, 5)
    m, r = p.model_dim, p.q_lora_rank
    wq_a = jax.random.normal(ka, (m, r)) / math.sqrt(m)
    wk = jax.random.normal(kk, (m, dim)) / math.sqrt(m)
    w_proj = jax.random.normal(kw, (m, heads)) / math.sqrt(m)
    # Least-squares map from the q_lora space onto W_k's outputs, per head mixed.
    wk_from_lora = jnp.linalg.lstsq(wq_a, wk)[0]  # [r, D]
    mix = jnp.eye(dim)[None] + 0.5 * jax.random.normal(kc, (heads, dim, dim)) / math.sqrt(dim)
    aligned = jnp.einsum("rd,hde->rhe", wk_from_lora, mix)
    aligned = aligned / jnp.std(aligned) / math.sqrt(r)
    indep = jax.random.normal(kb, (r, heads, dim)) / math.sqrt(r)
    c = p.query_key_coupling
    wq_b = (c * aligned + math.sqrt(1 - c * c) * indep).reshape(r, heads * dim)
    return _IndexerWeights(wq_a, wq_b, wk, w_proj)


def _query_inputs(x, positions, weights: _IndexerWeights, heads, dim, p, fp8_queries):
    """Queries and weights of the DeepSeek-V3.2 ``Indexer.forward`` from hidden states."""
    qr = _rms_norm(x @ weights.wq_a)  # MLA: qr = q_norm(wq_a(x))
    q = (qr @ weights.wq_b).reshape(x.shape[0], heads, dim)  # wq_b(qr), 'b s (h d)'
    q = _rope_half(q, positions, p.rope_dim, p.rope_theta)  # rope on q_pe = q[..., :64]
    q = hadamard(q)  # rotate_activation
    # weights_proj(x) · H^-1/2, then · q_scale · D^-1/2 (softmax_scale)
    w = (x @ weights.w_proj) * heads**-0.5 * dim**-0.5
    return _queries(q, w, fp8_queries)  # act_quant(q, 128): per (token, head)


def _keys_chunked(x, positions, weights, p, chunk: int = 16384):
    """FP8 keys of every token (``k_norm(wk(x))``, RoPE, Hadamard, ``act_quant``)."""
    outs, scales = [], []
    for i in range(0, x.shape[0], chunk):
        xi, pi = x[i : i + chunk], positions[i : i + chunk]
        k = _layer_norm(xi @ weights.wk)  # k_norm is a LayerNorm
        k = hadamard(_rope_half(k, pi, p.rope_dim, p.rope_theta))
        k8, s = quantize_fp8(k)  # one scale per key (D = 128 = the block size)
        outs.append(k8)
        scales.append(s)
    return jnp.concatenate(outs), jnp.concatenate(scales)


@functools.partial(jax.jit, static_argnames=("num_keys", "heads", "dim", "fp8_queries", "p"))
def _deepseek_core(key, query_positions, *, num_keys, heads, dim, fp8_queries, p):
    kx, kw = jax.random.split(key)
    x = _hidden_states(kx, num_keys, p)
    weights = _indexer_weights(kw, heads, dim, p)
    positions = jnp.arange(num_keys, dtype=jnp.int32)
    k8, k_scale = _keys_chunked(x, positions, weights, p)
    q, w = _query_inputs(x[query_positions], query_positions, weights, heads, dim, p, fp8_queries)
    return q, w, k8, k_scale


def deepseek_like(
    num_queries: int, num_keys: int, *, heads: int = 64, dim: int = 128, causal: bool = True,
    seed: int = 0, fp8_queries: bool = True, params: DeepSeekLikeParams | None = None,
) -> Workload:  # fmt: skip
    """Indexer inputs shaped like DeepSeek-V3.2's, from synthetic text-like hidden states.

    Modelling choices, with the part of ``Indexer.forward`` (DeepSeek-V3.2-Exp
    ``inference/model.py``) each follows:

    * hidden states: RMS-normalised (the block's ``attn_norm`` precedes attention) sum
      of a shared mean direction (residual streams have one), a topic per segment of
      ~512 tokens and a slowly varying local state: causal text-like locality, an
      assumption (the code takes real activations).
    * ``q = wq_b(qr)`` with ``qr = q_norm(wq_a(x))`` (RMSNorm, low rank), 64 heads of
      128 dims; ``k = k_norm(wk(x))`` with ``k_norm`` a LayerNorm; one key per token
      shared by all heads.
    * RoPE on the first 64 of 128 dims (``torch.split(q, [rope_head_dim, ...])``, the
      rope part first), non-interleaved (the Nov 2025 fix), theta 10000.
    * ``rotate_activation``: a Hadamard transform (scale D^-1/2) of q and k.
    * ``act_quant(·, 128)``: FP8 e4m3 with one scale per 128 values: per key, and per
      (query, head); the query scale is folded into the weights as in
      ``weights * q_scale``.
    * weights: ``weights_proj(x) · n_heads^-1/2 · softmax_scale`` (D^-1/2), a linear map
      of the hidden state without bias, hence signed, about half the heads positive.
    * query/key coupling: see :class:`DeepSeekLikeParams` (an assumption: the trained
      maps are not available; random ones would make retrieval meaningless).

    Query t sits at position S − T + t (a prefill chunk ending the context, or the
    whole prefill when T = S) and sees keys 0 .. its position (``causal``).
    """
    p = params or DeepSeekLikeParams()
    qpos = jnp.arange(num_keys - num_queries, num_keys, dtype=jnp.int32)
    q, w, k8, k_scale = _deepseek_core(
        jax.random.key(seed), qpos, num_keys=num_keys, heads=heads, dim=dim,
        fp8_queries=fp8_queries, p=p,
    )  # fmt: skip
    start, end = _ranges(num_queries, num_keys, causal)
    return Workload("deepseek_like", q, w, k8, k_scale, start, end)


def low_survival(
    num_queries: int, num_keys: int, *, heads: int = 64, dim: int = 128, causal: bool = True,
    seed: int = 0, positive_heads: int = 4,
) -> Workload:  # fmt: skip
    """Constructed so that survival is a few percent: for timing the kernels only.

    * ``positive_heads`` heads (≤ r) with positive weight: the planner retains all of
      them, so the positive part of the bound is exact;
    * the other heads have negative weights and queries along the keys' shared mean
      direction, so they are active on every key: the aggregate row A (majority
      support) reproduces their contribution exactly;
    * keys carry a component the positive heads look for that grows with position
      (an exaggerated recency bias), so each query's true Top-K are about its K most
      recent keys, which the recent half of the default seeds contains: τ ≈ τ*.
    Survival is then about K / (visible keys) plus FP8 blur.
    """
    q, w, k8, k_scale = _low_survival_core(
        jax.random.key(seed), num_queries=num_queries, num_keys=num_keys, heads=heads, dim=dim,
        positive_heads=positive_heads,
    )  # fmt: skip
    start, end = _ranges(num_queries, num_keys, causal)
    return Workload("low_survival", q, w, k8, k_scale, start, end)


@functools.partial(
    jax.jit, static_argnames=("num_queries", "num_keys", "heads", "dim", "positive_heads")
)
def _low_survival_core(key, *, num_queries, num_keys, heads, dim, positive_heads):
    kk, kq, kd, kn = jax.random.split(key, 4)
    mean = jax.random.normal(kd, (dim,))
    mean = mean / jnp.linalg.norm(mean)
    target = jax.random.normal(kn, (dim,))
    target = target - (target @ mean) * mean
    target = target / jnp.linalg.norm(target)
    ramp = jnp.arange(num_keys, dtype=jnp.float32) / num_keys
    k = 4.0 * mean + 0.3 * jax.random.normal(kk, (num_keys, dim)) / math.sqrt(dim)
    k = k + 2.0 * ramp[:, None] * target
    q = 0.2 * jax.random.normal(kq, (num_queries, heads, dim)) / math.sqrt(dim)
    q = q.at[:, :positive_heads].add(target)
    q = q.at[:, positive_heads:].add(mean)
    w = jnp.concatenate(
        [
            jnp.full((num_queries, positive_heads), 1.0),
            -jnp.full((num_queries, heads - positive_heads), 0.1),
        ],
        axis=1,
    ) / math.sqrt(heads * dim)
    k8, k_scale = quantize_fp8(k)
    return q.astype(jnp.bfloat16), w, k8, k_scale


def from_arrays(
    q, weights, k, *, k_scale=None, kv_start=None, kv_end=None, quantize_keys: bool = False,
    name: str = "real",
) -> Workload:  # fmt: skip
    """Wraps real indexer inputs (e.g. dumped from a model) as a :class:`Workload`.

    ``q`` [T, H, D], ``weights`` [T, H] (with every scale the model folds in), ``k``
    [S, D]. With ``quantize_keys`` the keys are stored like DeepSeek's cache (FP8 with
    one scale per key, :func:`quantize_fp8`). Default ranges: causal, query t at
    position S − T + t.
    """
    q = jnp.asarray(q)
    k = jnp.asarray(k)
    weights = jnp.asarray(weights, jnp.float32)
    if quantize_keys:
        if k_scale is not None:
            raise ValueError(
                "from_arrays: quantize_keys=True computes k_scale; pass one or the other"
            )
        k, k_scale = quantize_fp8(k.astype(jnp.float32))
    t, s = q.shape[0], k.shape[0]
    start, end = _ranges(t, s, True)
    start = start if kv_start is None else jnp.asarray(kv_start, jnp.int32)
    end = end if kv_end is None else jnp.asarray(kv_end, jnp.int32)
    return Workload(name, q, weights, k, k_scale, start, end)


WORKLOADS = {"iid": iid, "deepseek_like": deepseek_like, "low_survival": low_survival}


def make(name: str, num_queries: int, num_keys: int, **kwargs) -> Workload:
    """The named workload (``iid``, ``deepseek_like``, ``low_survival``)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: got {name!r}; expected one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](num_queries, num_keys, **kwargs)


def make_decode(
    name: str, batch: int, length: int, steps: int, *, heads: int = 64, dim: int = 128,
    seed: int = 0, length_spread: float = 0.1,
) -> DecodeWorkload:  # fmt: skip
    """``batch`` independent sequences of different lengths decoded for ``steps`` steps.

    Sequence b has ``lengths[b]`` ∈ [(1 − spread)·length, length] keys before step 0.
    Every sequence is generated over ``length + steps`` tokens (one compile); step n's
    query of sequence b is the token at position lengths[b] + n, so successive queries
    follow the context (temporal coherence). ``name``: "deepseek_like" or "iid".
    """
    total = length + steps
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, length - rng.integers(0, int(length * length_spread) + 1, batch))
    caches, scales, qs, ws = [], [], [], []
    for b in range(batch):
        key = jax.random.key(seed * 1000 + b)
        if name == "deepseek_like":
            qpos = jnp.asarray(lengths[b] + np.arange(steps), jnp.int32)
            q, w, k8, k_scale = _deepseek_core(
                key, qpos, num_keys=total, heads=heads, dim=dim, fp8_queries=True,
                p=DeepSeekLikeParams(),
            )  # fmt: skip
        elif name == "iid":
            q, w, k8, k_scale = _iid_core(
                key, num_queries=steps, num_keys=total, heads=heads, dim=dim, fp8_queries=False
            )
        else:
            raise ValueError(f"make_decode: workload {name!r} is not one of 'deepseek_like', 'iid'")
        caches.append(k8)
        scales.append(k_scale)
        qs.append(q)
        ws.append(w)
    return DecodeWorkload(
        name,
        jnp.stack(qs, axis=1),
        jnp.stack(ws, axis=1),
        jnp.stack(caches),
        jnp.stack(scales),
        jnp.asarray(lengths, jnp.int32),
    )


def page_cache(
    k_cache: Float[Array, "B S D"],
    k_scale: Float[Array, "B S"] | None,
    page_size: int,
    *,
    spare_pages: int = 0,
    seed: int = 0,
) -> tuple[Float[Array, "N P D"], Float[Array, "N P"] | None, Int[Array, "B M"]]:
    """A dense decode cache scattered into a shuffled page pool, as a serving engine's
    allocator leaves it: (pool [N, P, D], scales [N, P] or None, page_table [B, ⌈S/P⌉]).

    Page m of sequence b goes to a random slot of the pool; ``spare_pages`` extra slots
    stay zero (no sequence points at them).
    """
    if page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size}")
    b, s_max, d = k_cache.shape
    m = -(-s_max // page_size)
    pad = m * page_size - s_max  # the last page's tail: past every length
    k_cache = jnp.pad(k_cache, ((0, 0), (0, pad), (0, 0)))
    if k_scale is not None:
        k_scale = jnp.pad(k_scale, ((0, 0), (0, pad)), constant_values=1.0)
    n = b * m + spare_pages
    slots = jnp.asarray(np.random.default_rng(seed).permutation(n)[: b * m], jnp.int32)
    pool = jnp.zeros((n, page_size, d), k_cache.dtype)
    pool = pool.at[slots].set(k_cache.reshape(b * m, page_size, d))
    scales = None
    if k_scale is not None:
        scales = jnp.ones((n, page_size), jnp.float32)
        scales = scales.at[slots].set(k_scale.reshape(b * m, page_size))
    return pool, scales, slots.reshape(b, m)
