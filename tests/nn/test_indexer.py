"""The DSA indexer layer: its selection is the exact Top-K of its own scores for every
query, a decode step selects what prefill of the whole sequence selects, sequences of a
batch do not see each other, and an MLA layer with an indexer attends exactly the rows
the indexer selects (all of them: dense attention)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jsparse import backend
from jsparse.nn import (
    DenseMLA,
    Indexer,
    MLAAttention,
    SelectedMLA,
    causal_attention_probs,
    distillation_loss,
)
from jsparse.ops.indexer.prepare import hadamard
from jsparse.testing import lower_for_h200, topk_mismatches
from tests.gradients import assert_kernels_differentiate_like_the_reference, weight_gradient
from tests.implementations import running
from tests.paging import shuffled_pages

D_MODEL, HEADS, DIM, ROPE = 48, 4, 16, 8
MLA_DIMS = dict(latent_dim=32, rope_dim=8, nope_dim=16, v_dim=12)
FP8, BF16 = jnp.float8_e4m3fn, jnp.bfloat16


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """Projections at full f32 precision on a GPU too, so the oracle recomputes them."""
    with jax.default_matmul_precision("highest"):
        yield


def indexer(top_k=5, *, method="base", impl="reference", cache_dtype=FP8, seed=0, **kw):
    return Indexer(
        D_MODEL, n_heads=HEADS, head_dim=DIM, rope_dim=ROPE, top_k=top_k, method=method,
        cache_dtype=cache_dtype, implementation=impl, rngs=nnx.Rngs(seed), **kw,
    )  # fmt: skip


def mla(core, index=None):
    return MLAAttention(D_MODEL, HEADS, **MLA_DIMS, core=core, indexer=index, rngs=nnx.Rngs(0))


def dsa(top_k, impl):
    """An MLA layer whose indexer selects ``top_k`` rows for every token."""
    return mla(SelectedMLA(implementation=impl), indexer(top_k, impl=impl))


def tokens(b, t, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, t, D_MODEL), jnp.float32)


def oracle_scores(layer: Indexer, x, positions, query_input=None, asking=slice(None)):
    """[B, T, S] float64 scores of the tokens ``asking`` (default all) against every
    token, from the layer's own quantised queries and keys, numpy arithmetic; -inf past
    each query's position."""
    ql = None if query_input is None else query_input[:, asking]
    q, w = layer.queries(x[:, asking], positions[:, asking], ql)
    k, scale = layer.keys(x, positions)
    return numpy_scores(q, w, k, scale, positions[:, asking])


def numpy_scores(q, w, k, scale, positions):
    """[B, T, S] float64 scores of queries q [B, T, H, D] (weights w [B, T, H]) against
    keys k [B, S, D] times ``scale`` [B, S] (or None); -inf past each query's
    position [B, T]."""
    q, w, k = (np.asarray(a.astype(jnp.float32), np.float64) for a in (q, w, k))
    if scale is not None:
        k = k * np.asarray(scale, np.float64)[..., None]
    dots = np.einsum("bthd,bsd->bths", q, k)
    s = np.einsum("bth,bths->bts", w, np.maximum(dots, 0.0))
    pos = np.asarray(positions)
    return np.where(np.arange(s.shape[-1])[None, None, :] <= pos[:, :, None], s, -np.inf)


def decode_all(layer: Indexer, x, prompt: int, max_len=None):
    """Prefill of ``prompt`` tokens, then one decode step per remaining token: every
    token's selection, [B, T, K], and the final cache."""
    b, t, _ = x.shape
    cache = layer.init_cache(b, max_len or t)
    top, cache = layer(x[:, :prompt], cache)
    picked = [top.indices]
    for i in range(prompt, t):
        top, cache = layer(x[:, i : i + 1], cache)
        picked.append(top.indices)
    return np.concatenate([np.asarray(p) for p in picked], axis=1), cache


@pytest.mark.parametrize(
    "method, cache_dtype",
    [("xla", FP8), ("base", FP8), ("full", BF16), ("dense", FP8), ("dosa", FP8),
     ("base", jnp.float32)],
)  # fmt: skip
def test_prefill_selects_each_querys_exact_topk(method, cache_dtype):
    layer, x = indexer(6, method=method, cache_dtype=cache_dtype), tokens(2, 13)
    top, cache = layer(x, layer.init_cache(2, 16))
    pos = jnp.broadcast_to(jnp.arange(13), (2, 13))
    want = oracle_scores(layer, x, pos)
    for b in range(2):
        assert not topk_mismatches(top.indices[b], top.scores[b], want[b], 6, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [13, 13])
    assert cache.keys.dtype == cache_dtype
    assert (cache.scale is None) == (cache_dtype != FP8)


@pytest.mark.parametrize(
    "method, impl_name",
    [("base", "reference"), ("base", "triton"), ("dosa", "reference"), ("xla", "reference"),
     ("full", "reference")],
)  # fmt: skip
def test_decode_steps_select_what_prefill_of_the_whole_sequence_selects(method, impl_name):
    """Decode selects through the batch op (``base``, ``xla``), the witness decode
    (``dosa``) or the packed op (``full``); prefill through the packed op. (The witness
    decode's kernels against ``base``: tests/certified/test_dosa_decode.py.)"""
    x = tokens(2, 14)
    with running(impl_name) as impl:
        whole, _ = indexer(5, method=method, impl=impl)(x, indexer(5).init_cache(2, 16))
        stepped, cache = decode_all(indexer(5, method=method, impl=impl), x, 9, max_len=16)
    np.testing.assert_array_equal(stepped, np.asarray(whole.indices))
    if method == "dosa":  # the witnesses hold the last Top-K, distinct, -1 padded
        wit = np.asarray(cache.witnesses)
        assert wit.shape == (2, 10)
        for row, last in zip(wit, stepped[:, -1], strict=True):
            kept = row[row >= 0]
            assert len(set(kept.tolist())) == kept.size and set(last.tolist()) <= set(kept)


def test_sequences_of_a_batch_do_not_see_each_other():
    """A chunk of 4 tokens over caches of different lengths (3 and 7): each sequence's
    selection equals that sequence run alone. (The kernels take the same packed call in
    the decode test's prefill.)"""
    layer, x = indexer(4), tokens(2, 11)
    cache = layer.init_cache(2, 12)
    _, c0 = layer(x[:1, :3], layer.init_cache(1, 12))
    _, c1 = layer(x[1:, :7], layer.init_cache(1, 12))
    cache = jax.tree.map(lambda a, u, v: a.at[0].set(u[0]).at[1].set(v[0]), cache, c0, c1)
    chunk = jnp.stack([x[0, 3:7], x[1, 7:11]])
    together, after = layer(chunk, cache)
    np.testing.assert_array_equal(after.lengths, [7, 11])
    for b, c in enumerate((c0, c1)):
        alone, _ = layer(chunk[b : b + 1], c)
        # XLA may round a projection of 2 sequences differently from one's: ulps apart
        np.testing.assert_array_equal(np.asarray(together.indices[b]), np.asarray(alone.indices[0]))
        np.testing.assert_allclose(together.scores[b], alone.scores[0], rtol=1e-5, atol=1e-6)


def test_query_latent_input_and_jit():
    """Queries from a query latent (V3.2's ``q_norm(wq_a(x))``), a decode step under
    ``nnx.jit`` (traced lengths), against the oracle."""
    layer = indexer(4, query_dim=24)
    x, latent = tokens(1, 10), tokens(1, 10, seed=3)[..., :24]
    cache = layer.init_cache(1, 12)
    _, cache = layer(x[:, :9], cache, query_input=latent[:, :9])
    step = nnx.jit(lambda m, x, c, ql: m(x, c, query_input=ql))
    top, cache = step(layer, x[:, 9:], cache, latent[:, 9:])
    pos = jnp.arange(10)[None]
    want = oracle_scores(layer, x, pos, latent, asking=slice(9, None))
    assert not topk_mismatches(top.indices[0], top.scores[0], want[0], 4, atol=1e-5)
    with pytest.raises(ValueError, match="query_input: required"):
        layer(x[:, :1], cache)


@pytest.mark.parametrize("top_k, impl_name", [(64, "reference"), (3, "reference"), (3, "triton")])
def test_mla_attends_exactly_the_rows_the_indexer_selects(top_k, impl_name):
    """With K ≥ the context the layer is dense MLA; with K = 3 it equals softmax
    attention restricted to each token's selection, computed here from the absorbed
    queries and rows (prefill and decode steps; interpreted kernels: two steps)."""
    b, t, prompt = 2, 10 if impl_name == "triton" else 12, 8

    x = tokens(b, t)
    with running(impl_name) as impl:
        layer = dsa(top_k, impl)
        cache = layer.init_cache(b, 16)
        y, cache = layer(x[:, :prompt], cache)
        ys = [y]
        for i in range(prompt, t):
            y, cache = layer(x[:, i : i + 1], cache)
            ys.append(y)
    got = np.concatenate([np.asarray(y) for y in ys], axis=1)

    if top_k >= t:
        want, _ = mla(DenseMLA())(x, mla(DenseMLA()).init_cache(b, 16))
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)
        return
    picked, _ = decode_all(indexer(top_k), x, prompt, max_len=16)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    q, rows = layer.absorbed(x, pos)
    logits = jnp.einsum("bthd,bsd->bths", q, rows, precision="highest") * layer.scale
    chosen = np.zeros((b, t, t), bool)
    for bi, ti in np.ndindex(b, t):
        chosen[bi, ti, picked[bi, ti][picked[bi, ti] >= 0]] = True
    assert chosen.sum(-1).max() == top_k and not np.triu(chosen, 1).any()
    p = jax.nn.softmax(jnp.where(chosen[:, :, None], logits, -jnp.inf), axis=-1)
    heads = jnp.einsum("bths,bsc->bthc", p, rows[..., : MLA_DIMS["latent_dim"]],
                       precision="highest")  # fmt: skip
    _, w_uv = layer.up_projections()
    out = jnp.einsum("bthc,chv->bthv", heads, w_uv, precision="highest")
    want = layer.o_proj(out.reshape(b, t, -1))
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)


def test_distillation_loss_is_the_kl_and_trains_the_indexer():
    """(The scorer kernel's derivative is the reference's: tests/ops/test_derivatives.py.)"""
    layer, x = indexer(4, cache_dtype=jnp.float32), tokens(2, 7)
    rng = np.random.default_rng(0)
    attn = rng.random((2, 7, 3, 7)) * np.tril(np.ones((7, 7)))[None, :, None]
    attn /= attn.sum(-1, keepdims=True)
    s = np.asarray(layer.scores(x), np.float64)
    p = attn.sum(2) / attn.sum(2).sum(-1, keepdims=True)
    log_q = s - np.log(np.exp(s).sum(-1, keepdims=True))  # exp(-inf) = 0
    used = p > 0  # the causal keys: log_q is finite there
    kl = np.where(used, p * (np.log(np.where(used, p, 1)) - np.where(used, log_q, 0)), 0)
    kl = kl.sum(-1).mean()
    loss = distillation_loss(layer.scores(x), jnp.asarray(attn, jnp.float32))
    np.testing.assert_allclose(float(loss), kl, rtol=1e-5)

    graph, params, rest = nnx.split(layer, nnx.Param, ...)
    grad = jax.grad(lambda prm: distillation_loss(nnx.merge(graph, prm, rest).scores(x), attn))
    g = {k: np.asarray(v) for k, v in nnx.to_flat_state(grad(params))}
    assert all(np.isfinite(v).all() for v in g.values())
    assert np.abs(g[("wq", "kernel")]).max() > 0 and np.abs(g[("wk", "kernel")]).max() > 0


def test_fp8_quantisation_for_training_passes_the_gradient_through():
    """Forward: the FP8 payload's values exactly; backward: the cast as the identity.
    Through a float8 array the cotangents would be rounded to E4M3 (and below 2^-9 to 0)."""
    from jsparse.ops.indexer.prepare import quantize_fp8, quantize_fp8_straight_through

    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 32)), jnp.float32)
    c = jnp.asarray(np.random.default_rng(2).standard_normal((5, 32)) * 1e-3, jnp.float32)
    values, scale = quantize_fp8_straight_through(x)
    payload, scale8 = quantize_fp8(x)
    assert values.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(payload, np.float32))
    np.testing.assert_array_equal(scale, scale8)

    def loss(quantize):
        return lambda x: jnp.sum(c * quantize(x)[0].astype(jnp.float32))

    # the same function with the cast taken out
    want = jax.grad(lambda x: jnp.sum(c * x / jnp.max(jnp.abs(x), -1, keepdims=True) * 448.0))(x)
    got = jax.grad(loss(quantize_fp8_straight_through))(x)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    through_fp8 = jax.grad(loss(quantize_fp8))(x)  # what the float8 path gave
    assert np.abs(through_fp8 - want).max() > 0.1 * np.abs(want).max()


def test_an_fp8_indexer_trains_along_the_f32_gradient():
    """``Indexer.scores`` with FP8 keys: the projections' gradients point where the f32
    indexer's do (before: cosine 0.24 and -0.01)."""
    x = jax.random.normal(jax.random.key(0), (2, 64, 64))
    qt, kt = (jax.random.normal(jax.random.key(i), (2, 64, 2, 16)) for i in (1, 2))
    target = causal_attention_probs(qt, kt)
    grads = {}
    for dtype in (jnp.float32, jnp.float8_e4m3fn):
        layer = Indexer(64, n_heads=4, head_dim=32, rope_dim=16, top_k=8, cache_dtype=dtype,
                        rngs=nnx.Rngs(0))  # fmt: skip
        grads[dtype] = nnx.grad(lambda m: distillation_loss(m.scores(x), target))(layer)
    for name in ("wq", "wk", "weights_proj"):
        a, b = (np.asarray(getattr(grads[d], name).kernel[...]).ravel() for d in grads)
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.98, name


def test_the_distillation_target_is_causal_gqa_softmax_attention():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 6, 4, 8)), rng.standard_normal((2, 6, 2, 8))
    got = np.asarray(
        causal_attention_probs(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.bfloat16))
    )
    k = np.asarray(jnp.asarray(k, jnp.bfloat16), np.float64)  # what the function read
    for b, t, h in np.ndindex(2, 6, 4):
        logits = q[b, t, h] @ k[b, : t + 1, h // 2].T / np.sqrt(8)  # heads 0, 1 read KV head 0
        want = np.exp(logits - logits.max())
        np.testing.assert_allclose(got[b, t, h, : t + 1], want / want.sum(), rtol=1e-4)
        assert (got[b, t, h, t + 1 :] == 0).all()


def test_fp8_rows_with_an_indexer_covering_the_context_equal_dense_fp8_rows():
    """An FP8 row cache (one scale per sequence): prefill passes each query its
    sequence's scale through the page-table fold, decode the batch's."""
    x = tokens(2, 11)
    outs = []
    for layer in (dsa(64, "reference"), mla(DenseMLA())):
        cache = layer.init_cache(2, 16, FP8)
        ys = []
        for lo, hi in [(0, 8), (8, 9), (9, 10), (10, 11)]:
            y, cache = layer(x[:, lo:hi], cache)
            ys.append(np.asarray(y))
        assert cache.scale is not None
        outs.append(np.concatenate(ys, axis=1))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t", [1, 4])
def test_selected_mla_reads_a_paged_cache_like_the_dense_one(t):
    """A serving cache: the rows in a shuffled page pool (8-row pages, the pages past a
    sequence's length unallocated), decode (T = 1) and a chunk (T = 4) whose fold
    takes each query's own sequence's row of the table."""
    rng = np.random.default_rng(t)
    b, s, d, lengths = 2, 32, 40, np.array([32, 20])
    rows = jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, HEADS, d)), jnp.float32)
    ids = np.full((b, t, 6), -1, np.int32)
    for bi, ti in np.ndindex(b, t):
        pos = lengths[bi] - t + ti
        ids[bi, ti, :5] = rng.choice(pos + 1, 5, replace=False)  # and one empty slot
    pool, _, table = shuffled_pages(rows, np.ones((b, s)), lengths, 8, spare_pages=3)
    kw = dict(indices=jnp.asarray(ids), q_positions=None, k_positions=None, scale=0.3,
              latent_dim=32)  # fmt: skip
    with running("triton") as impl:
        core = SelectedMLA(implementation=impl)
        paged = core(q, pool, page_table=table, **kw)
        dense = core(q, rows, **kw)
    assert paged.shape == (b, t, HEADS, 32)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [1, 5])
def test_a_dsa_step_differentiates_like_the_reference(t):
    """The weight gradient of a decode step (T = 1) and of a prefill chunk (T = 5) of
    the MLA layer with an indexer: the kernels give the reference's. The attention's
    weights get it through the selected rows; the indexer's ids carry none."""
    x = tokens(2, 9 + t)

    def gradient(implementation):
        layer = dsa(4, implementation)
        _, cache = layer(x[:, :9], layer.init_cache(2, 16))
        return weight_gradient(layer, lambda m: m(x[:, 9:], cache)[0])

    assert_kernels_differentiate_like_the_reference(gradient)


def test_hadamard_is_orthonormal():
    x = jax.random.normal(jax.random.key(0), (3, 16))
    rot = hadamard(jnp.eye(16))
    np.testing.assert_allclose(np.asarray(rot @ rot.T), np.eye(16), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(hadamard(x), axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        hadamard(jnp.ones((2, 12)))


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(rope_dim=3), "rope_dim: got 3"), (dict(rope_dim=24), "rope_dim: got 24"),
     (dict(head_dim=24), "head_dim: got 24"), (dict(method="topk"), "method: got 'topk'"),
     (dict(cache_dtype=jnp.float16), "cache_dtype: got float16"),
     (dict(top_k=0), "top_k")],
)  # fmt: skip
def test_bad_configuration_names_the_argument(kwargs, match):
    kw = dict(n_heads=HEADS, head_dim=DIM, rope_dim=ROPE) | kwargs
    with pytest.raises(ValueError, match=match):
        Indexer(D_MODEL, rngs=nnx.Rngs(0), **kw)


def test_bad_calls_name_the_argument():
    layer = indexer(4)
    cache = layer.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"exceed max_len = 8"):
        layer(tokens(2, 9), cache)
    with pytest.raises(ValueError, match=r"x: .*rank"):
        layer(tokens(2, 3)[0], cache)
    with pytest.raises(ValueError, match="query_input: not taken"):
        layer(tokens(2, 3), cache, query_input=tokens(2, 3))
    with pytest.raises(ValueError, match=r"x: shape \(2, 3, 40\); expected \[B, T, 48\]"):
        layer(tokens(2, 3)[..., :40], cache)
    with pytest.raises(ValueError, match=r"cache.keys: \(2, 8, 16\) bfloat16; expected"):
        layer(tokens(2, 3), indexer(4, cache_dtype=BF16).init_cache(2, 8))
    with pytest.raises(ValueError, match=r"cache.keys: \(3, 8, 16\)"):
        layer(tokens(2, 3), layer.init_cache(3, 8))
    with pytest.raises(ValueError, match="core: got DenseMLA with an indexer"):
        mla(DenseMLA(), layer)
    # A rollback of the rows alone (speculative decoding's rejected tokens) attended the
    # rejected rows the indexer still listed.
    dsa = mla(SelectedMLA(), layer)
    _, filled = dsa(tokens(2, 5), dsa.init_cache(2, 8))
    with pytest.raises(
        ValueError, match=r"cache.indexer.lengths \[5, 5\] differ from cache.lengths \[3, 3\]"
    ):
        dsa(tokens(2, 1), filled._replace(lengths=filled.lengths - 2))


@pytest.mark.parametrize("t", [1, 128])
def test_dsa_steps_lower_for_an_h200(t, monkeypatch):
    """V3.2's sizes (64 indexer heads of 128, K = 2048, FP8 keys; MLA rows of 512 + 64)
    at a 32K cache: the kernels of a decode step (batch Top-K, indexed MLA) and of a
    prefill chunk (packed causal Top-K, indexed MLA through the page table) lower to
    CUDA."""
    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    index = Indexer(256, top_k=2048, implementation="triton", rngs=nnx.Rngs(0))
    layer = MLAAttention(256, 16, core=SelectedMLA(implementation="triton"), indexer=index,
                         rngs=nnx.Rngs(0))  # fmt: skip
    graph, state = nnx.split(layer)
    cache = jax.eval_shape(functools.partial(layer.init_cache, 2, 32768, FP8))

    def step(state, x, cache):
        return nnx.merge(graph, state)(x, cache)

    x = jax.ShapeDtypeStruct((2, t, 256), jnp.float32)
    text = lower_for_h200(step, state, x, cache).as_text()
    assert "jsparse_indexed_mla_attention" in text and text.count("__gpu$xla.gpu.triton") >= 2


def _own_inputs_mismatches(top, q, w, cache, rows, b):
    """``topk_mismatches`` of a step's rows ``rows`` against numpy scores of the FP8
    queries ``q`` / weights ``w`` it computed and the cache it read; tolerance: the FP8
    tensor cores' accumulation (1e-3 of the row's largest score, the indexer bench's)."""
    seen = np.asarray(cache.lengths[b]) - q.shape[1] + np.asarray(rows)  # each row's position
    one = slice(b, b + 1)
    scores = numpy_scores(q[one, rows], w[one, rows], cache.keys[one], cache.scale[one],
                          seen[None])[0]  # fmt: skip
    atol = 1e-3 * np.max(np.abs(scores[np.isfinite(scores)]))
    k = top.indices.shape[-1]
    return topk_mismatches(top.indices[b, rows], top.scores[b, rows], scores, k, atol)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["base", "dosa"])
def test_gpu_deepseek_sizes_decode_and_chunks_select_exactly(method):
    """V3.2's indexer (64 heads of 128, RoPE 64, FP8, K = 2048) compiled: a 6144-token
    prompt in two chunks, then 4 decode steps, and the prefill of the whole sequence.
    Every step's rows (sampled) are the exact Top-K of the queries it projected and the
    keys it read, and the steps select what the whole prefill selects but for near-ties.

    Not id for id on a GPU (run 226): XLA's projections of a 4096-token chunk and of
    the whole sequence round differently (the matmul's algorithm depends on its shape),
    an FP8 cast then and then lands a query on the next value, and keys at the K-th
    score closer than that swap (922 of 25M ids). On the CPU the two are identical and
    the non-``gpu`` tests above assert it."""
    b, prompt, steps = 2, 6144, 4
    t = prompt + steps
    x = jax.random.normal(jax.random.key(5), (b, t, 256), jnp.float32)

    def layer():
        return Indexer(256, top_k=2048, method=method, rngs=nnx.Rngs(0))

    @nnx.jit
    def step(m, x, c):  # the queries beside the step: XLA computes them once (CSE)
        pos = c.lengths[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
        top, grown = m(x, c)
        return top, grown, *m.queries(x, pos)

    index = layer()
    whole = step(index, x, index.init_cache(b, 8192))
    cache = index.init_cache(b, 8192)
    picked = []
    for lo, hi in [(0, 4096), (4096, prompt)] + [(i, i + 1) for i in range(prompt, t)]:
        top, cache, q, w = step(index, x[:, lo:hi], cache)
        rows = sorted({0, (hi - lo) // 3, hi - lo - 1})
        for bi in range(b):
            problems = _own_inputs_mismatches(top, q, w, cache, rows, bi)
            assert not problems, (lo, bi, problems[:3])
        picked.append(np.asarray(top.indices))
    top, full_cache, q, w = whole
    for bi in range(b):
        problems = _own_inputs_mismatches(top, q, w, full_cache, [0, 3000, t - 2, t - 1], bi)
        assert not problems, ("whole", bi, problems[:3])
    # near-ties only: a wrong cache row or range would differ in far more places
    differ = np.mean(np.concatenate(picked, axis=1) != np.asarray(top.indices))
    assert differ < 1e-3, differ


@pytest.mark.gpu
def test_gpu_deepseek_sizes_dsa_layer_equals_its_reference():
    """An MLA layer with V3.2's rows (512 + 64) and indexer (64 × 128, FP8, K = 2048),
    compiled, BF16 rows: after a 4096-token prompt, a 64-token chunk and a decode step
    give the output of the same layer with the reference attention on the same cache.
    Both select with the kernels: a GPU's FP8 tensor cores and the reference scorer may
    break near-ties at the K-th score differently, both exact for their own arithmetic
    (the selection has its own test above), so only the attention's rounding differs."""
    b, prompt = 2, 4096
    x = jax.random.normal(jax.random.key(7), (b, prompt + 65, 256), jnp.float32)

    def layer(core_impl):
        index = Indexer(256, top_k=2048, rngs=nnx.Rngs(0))
        return MLAAttention(256, 16, core=SelectedMLA(implementation=core_impl), indexer=index,
                            rngs=nnx.Rngs(1))  # fmt: skip

    kernels, reference = layer(None), layer("reference")
    step = nnx.jit(lambda m, x, c: m(x, c))
    cache = kernels.init_cache(b, prompt + 128, jnp.bfloat16)
    _, cache = step(kernels, x[:, :prompt], cache)
    for lo, hi in [(prompt, prompt + 64), (prompt + 64, prompt + 65)]:
        got, after = step(kernels, x[:, lo:hi], cache)
        want, _ = step(reference, x[:, lo:hi], cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
        cache = after
