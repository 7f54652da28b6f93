"""The indexer scorer in plain jnp: the reference every kernel is tested against.

    s[t, i] = k_scale[i] · Σ_h w[t, h] · relu(q[t, h] · k[i])          (MATH.md §1.1)

The reference accumulates in a fixed order (over D, then over H) with elementwise f32
arithmetic only. That makes the score of a (query, key) pair a pure function of the
pair, independent of array shapes, batching or which other keys are scored alongside
it. Every reference method (``base``, ``full``, ``dense``, ``dosa``) scores through
:func:`score_keys_reference`, so they agree id for id by construction, which is the
contract the exactness theorem needs (MATH.md §1.8: "the same scorer").

``relu`` here is ``where(x < 0, 0, x)``: NaN propagates into the score (a NaN input
gives a NaN score, which selection ranks first, visibly), on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jsparse.ops import f32_dots
from jsparse.ops.topk.codes import canonical_scores
from jsparse.ops.topk.reference import visible_key_ids  # also imported from here


def relu_keep_nan(x: jax.Array) -> jax.Array:
    return jnp.where(x < 0, jnp.zeros_like(x), x)


def _score_chunk(q, weights, k_rows, scale_rows, valid):
    # q [T, H, D] f32, weights [T, H], k_rows [T, N, D] f32, scale_rows/valid [T, N]
    h, d = q.shape[1:]

    def add_dim(i, acc):  # acc [T, H, N]
        qd = jax.lax.dynamic_index_in_dim(q, i, axis=2, keepdims=False)  # [T, H]
        kd = jax.lax.dynamic_index_in_dim(k_rows, i, axis=2, keepdims=False)  # [T, N]
        return acc + qd[:, :, None] * kd[:, None, :]

    # zeros typed like the inputs: inside jax.shard_map the loop carry must vary over
    # the mesh axes its inputs vary over (XLA folds the product of two zero broadcasts)
    zeros = jnp.zeros_like(q[:, :, :1]) * jnp.zeros_like(k_rows[:, None, :, 0])  # [T, H, N]
    logits = jax.lax.fori_loop(0, d, add_dim, zeros)
    relu = relu_keep_nan(logits)

    def add_head(i, acc):  # acc [T, N]
        wi = jax.lax.dynamic_index_in_dim(weights, i, axis=1, keepdims=False)  # [T]
        ri = jax.lax.dynamic_index_in_dim(relu, i, axis=1, keepdims=False)  # [T, N]
        return acc + wi[:, None] * ri

    scores = jax.lax.fori_loop(0, h, add_head, zeros[:, 0] * jnp.zeros_like(weights[:, :1]))
    return jnp.where(valid, scores * scale_rows, -jnp.inf)


def _score_chunk_matmul(q, weights, k_rows, scale_rows, valid):
    # _score_chunk's function as two batched matmuls in f32: its derivative
    logits = jnp.einsum("thd,tnd->thn", q, k_rows, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.einsum(
        "th,thn->tn", weights, relu_keep_nan(logits), precision=jax.lax.Precision.HIGHEST
    )
    return jnp.where(valid, scores * scale_rows, -jnp.inf)


def score_keys_reference(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    key_ids: Int[Array, "T N"],
    k_scale: Float[Array, " S"] | None = None,
    *,
    query_chunk: int = 64,
) -> Float[Array, "T N"]:
    """Scores of the listed keys for each query; ``-inf`` where ``key_ids == -1``.

    Inputs of any supported dtype are widened to f32 exactly (bf16 and fp8 embed in
    f32), so the arithmetic is the same for every dtype. Queries are processed in
    chunks of ``query_chunk`` to bound the [chunk, H, N] intermediate. The derivative
    (the Top-K ops' scores rescore their ids through here) is that of the same function
    as batched matmuls, which do not store the loops' steps.
    """
    scale = jnp.ones((k.shape[0],), jnp.float32) if k_scale is None else k_scale
    return _score_keys(q, weights, k, key_ids, scale, query_chunk)


def _by_query_chunks(score_chunk, q, weights, k, key_ids, scale, query_chunk):
    t, h, d = q.shape
    n = key_ids.shape[1]
    qf = q.astype(jnp.float32)
    kf = k.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    weights = weights.astype(jnp.float32)

    chunk = max(1, min(query_chunk, t))
    pad = (-t) % chunk
    if pad:
        qf = jnp.pad(qf, ((0, pad), (0, 0), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        key_ids = jnp.pad(key_ids, ((0, pad), (0, 0)), constant_values=-1)
    n_chunks = (t + pad) // chunk

    # A gradient recomputes each chunk rather than keeping every chunk's gathered keys
    # and ReLU masks (the Top-K ops' derivative rescores [T, K] ids through here: ~13 GB
    # of residuals at 8192 × 2048 × 64 heads otherwise); no change without one.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(args):
        qc, wc, ic = args
        valid = ic >= 0
        safe = jnp.where(valid, ic, 0)
        return score_chunk(qc, wc, kf[safe], scale[safe], valid)

    out = jax.lax.map(
        one_chunk,
        (
            qf.reshape(n_chunks, chunk, h, d),
            weights.reshape(n_chunks, chunk, h),
            key_ids.reshape(n_chunks, chunk, n),
        ),
    )
    return out.reshape(n_chunks * chunk, n)[:t]


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _score_keys(q, weights, k, key_ids, scale, query_chunk):
    return _by_query_chunks(_score_chunk, q, weights, k, key_ids, scale, query_chunk)


@_score_keys.defjvp
def _score_keys_jvp(query_chunk, primals, tangents):
    def matmuls(*args):
        return _by_query_chunks(_score_chunk_matmul, *args, query_chunk)

    return _score_keys(*primals, query_chunk), jax.jvp(matmuls, primals, tangents)[1]


@jax.custom_jvp
def indexer_scores_reference(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    k_scale: Float[Array, " S"] | None,
    kv_start: Int[Array, " T"],
    kv_end: Int[Array, " T"],
) -> Float[Array, "T S"]:
    """Scores of every key for every query; ``-inf`` where a key is not visible.

    Its derivative is taken through :func:`indexer_scores_einsum` in f32, the same
    function as matmuls: differentiating the elementwise loops above would keep every
    step of them (the gradient of a 1024-token causal window, 16 heads of 64, took 2.4 s
    on two CPU cores that way, 0.75 s now). It is the oracle of the kernels' own
    backward (:mod:`jsparse.ops.indexer.backward`)."""
    ids = visible_key_ids(kv_start, kv_end, k.shape[0])
    return score_keys_reference(q, weights, k, ids, k_scale)


@indexer_scores_reference.defjvp
def _scores_reference_jvp(primals, tangents):
    dense = functools.partial(indexer_scores_einsum, f32=True)
    return indexer_scores_reference(*primals), jax.jvp(dense, primals, tangents)[1]


def einsum_dtype(q_dtype, k_dtype):
    """The dtype the ``xla`` formulation's einsum takes both operands in. XLA has no
    generic FP8 einsum and FP8 promotes with no other type, so FP8 widens to bf16
    (exactly) first; then the wider of the two."""
    widened = [jnp.bfloat16 if jnp.dtype(x) == jnp.float8_e4m3fn else x for x in (q_dtype, k_dtype)]
    return jnp.promote_types(*widened)


def indexer_scores_einsum(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    k_scale: Float[Array, " S"] | None,
    kv_start: Int[Array, " T"],
    kv_end: Int[Array, " T"],
    *,
    query_chunk: int = 64,
    f32: bool = False,
) -> Float[Array, "T S"]:
    """The naive XLA formulation (einsum → relu → einsum), queries in chunks.

    This is the ``xla`` baseline of the benchmarks: what a JAX user writes today. It
    is close to, but not bitwise equal to, :func:`indexer_scores_reference`.
    ``f32``: every product in f32 at full precision, each chunk recomputed rather than
    stored by a gradient (the reference's derivative).
    """
    t, h, d = q.shape
    s = k.shape[0]
    compute = jnp.float32 if f32 else einsum_dtype(q.dtype, k.dtype)
    # f32 products as the kernels' f32 dots take them (jsparse.ops.f32_dots); never XLA's
    # default on a GPU, one TF32 product, whose scores were 6e-4 of a row's largest off
    # the f32 oracle (run 244)
    precision = f32_dots.xla_precision() if compute == jnp.float32 else None
    kc = k.astype(compute)
    chunk = max(1, min(query_chunk, t))
    pad = (-t) % chunk
    qp = jnp.pad(q.astype(compute), ((0, pad), (0, 0), (0, 0)))
    wp = jnp.pad(weights.astype(jnp.float32), ((0, pad), (0, 0)))
    n_chunks = (t + pad) // chunk

    def one_chunk(args):
        qc, wc = args
        logits = jnp.einsum(
            "thd,sd->ths", qc, kc, precision=precision, preferred_element_type=jnp.float32
        )
        return jnp.einsum("th,ths->ts", wc, relu_keep_nan(logits), precision=precision)

    if f32:
        one_chunk = jax.checkpoint(one_chunk, prevent_cse=False)
    out = jax.lax.map(
        one_chunk, (qp.reshape(n_chunks, chunk, h, d), wp.reshape(n_chunks, chunk, h))
    )
    out = out.reshape(n_chunks * chunk, s)[:t]
    if k_scale is not None:
        out = out * k_scale.astype(jnp.float32)[None, :]
    ids = jnp.arange(s)[None, :]
    visible = (ids >= kv_start[:, None]) & (ids < kv_end[:, None])
    return jnp.where(visible, out, -jnp.inf)


def lax_topk(scores: Float[Array, "T S"], visible: Int[Array, " T"], top_k: int):
    """The ``xla`` baseline's selection: ``lax.top_k`` of score rows (-inf where not
    visible), padded to K columns, -1 / -inf past each row's ``visible`` count. Scores
    are ranked as the kernels rank them (-0 as +0, every NaN above +inf).
    Returns (indices [T, K] int32, values [T, K])."""
    pad = max(0, top_k - scores.shape[1])
    if pad:
        scores = jnp.pad(scores, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    values, idx = jax.lax.top_k(canonical_scores(scores), top_k)  # the kernels' order
    empty = jnp.arange(top_k)[None, :] >= visible[:, None]
    return jnp.where(empty, -1, idx).astype(jnp.int32), jnp.where(empty, -jnp.inf, values)
