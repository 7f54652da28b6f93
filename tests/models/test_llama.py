"""The NNX Llama against the independent numpy forward pass, and its KV cache."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import numpy_llama
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jsparse import backend
from jsparse.models.capture import capture_qkv
from jsparse.models.llama import DenseCausalAttention, Llama, LlamaConfig, forward_fn

TINY = LlamaConfig(
    vocab_size=96,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=40,
    rope_theta=100.0,  # a small base: every dimension pair rotates visibly in 20 tokens
    norm_eps=1e-5,
    max_seq_len=64,
    name="tiny",
)


def random_hf_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF names, Hugging Face layout ([d_out, d_in], rotate-half q / k rows)."""
    rng = np.random.default_rng(seed)

    def w(*shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {
        "token_embd.weight": w(cfg.vocab_size, cfg.d_model, std=1.0),
        "output_norm.weight": 1 + w(cfg.d_model, std=0.1),
    }
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": 1 + w(cfg.d_model, std=0.1),
            p + "attn_q.weight": w(q, cfg.d_model, std=0.4),
            p + "attn_k.weight": w(kv, cfg.d_model, std=0.4),
            p + "attn_v.weight": w(kv, cfg.d_model, std=0.3),
            p + "attn_output.weight": w(cfg.d_model, q, std=0.2),
            p + "ffn_norm.weight": 1 + w(cfg.d_model, std=0.1),
            p + "ffn_gate.weight": w(cfg.d_ff, cfg.d_model, std=0.3),
            p + "ffn_up.weight": w(cfg.d_ff, cfg.d_model, std=0.3),
            p + "ffn_down.weight": w(cfg.d_model, cfg.d_ff, std=0.2),
        }
    return out


def nnx_model(cfg: LlamaConfig, weights: dict[str, np.ndarray], core=None) -> Llama:
    """Puts HF-layout weights into a fresh NNX model (kernels are [d_in, d_out])."""
    model = Llama(cfg, core, rngs=nnx.Rngs(0))
    model.embed[...] = jnp.asarray(weights["token_embd.weight"])
    model.norm.scale[...] = jnp.asarray(weights["output_norm.weight"])
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        layer.attn_norm.scale[...] = jnp.asarray(weights[p + "attn_norm.weight"])
        layer.mlp_norm.scale[...] = jnp.asarray(weights[p + "ffn_norm.weight"])
        for proj, name in (
            (layer.attn.q_proj, "attn_q"),
            (layer.attn.k_proj, "attn_k"),
            (layer.attn.v_proj, "attn_v"),
            (layer.attn.o_proj, "attn_output"),
            (layer.mlp.gate_proj, "ffn_gate"),
            (layer.mlp.up_proj, "ffn_up"),
            (layer.mlp.down_proj, "ffn_down"),
        ):
            proj.kernel[...] = jnp.asarray(weights[p + name + ".weight"].T)
    return model


def np_cfg(cfg: LlamaConfig) -> dict:
    return cfg.to_dict()


def tokens_of(n, seed=1, vocab=TINY.vocab_size):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


CORES = {
    "default": None,
    "chunks-3x5": lambda i: DenseCausalAttention(query_chunk=3, key_chunk=5),
    "chunks-1x1": lambda i: DenseCausalAttention(query_chunk=1, key_chunk=1),
}


# f32 agreement with the float64 numpy pass. f32 GEMMs tile and split their reductions
# differently from numpy (and by batch size): measured up to 2.4e-5 on an H200, and
# 2.5e-5 on a CPU with AVX-512 (XLA's CPU code follows the CPU's features), where
# 2e-5 had held on others. A wrong mask, rotation or norm moves logits by O(1).
F32_TOL = 1e-4
BATCH_TOL = 2e-5 if backend.has_nvidia_gpu() else 1e-6


@pytest.mark.parametrize("core", list(CORES), ids=list(CORES))
def test_forward_matches_numpy(core):
    weights = random_hf_weights(TINY)
    model = nnx_model(TINY, weights, CORES[core])
    ids = tokens_of(19)
    ref = numpy_llama.forward(weights, np_cfg(TINY), ids)
    logits, cache = forward_fn(model)(ids[None])
    assert cache is None
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], rtol=F32_TOL, atol=F32_TOL)
    for layer, arrays in capture_qkv(model, ids):
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(
                arrays[name],
                ref[name][layer],
                rtol=F32_TOL,
                atol=F32_TOL,
                err_msg=f"{layer} {name}",
            )


def test_batch_rows_are_independent():
    weights = random_hf_weights(TINY)
    fwd = forward_fn(nnx_model(TINY, weights))
    a, b = tokens_of(11, seed=2), tokens_of(11, seed=3)
    both, _ = fwd(np.stack([a, b]))
    np.testing.assert_allclose(both[0], fwd(a[None])[0][0], rtol=BATCH_TOL, atol=BATCH_TOL)
    np.testing.assert_allclose(both[1], fwd(b[None])[0][0], rtol=BATCH_TOL, atol=BATCH_TOL)


def decode_vs_forward(model, ids, prefill: int, max_len: int):
    """(stepwise logits, full-forward logits): prefill, then one token per call."""
    fwd = forward_fn(model)
    full, _ = fwd(ids)
    cache = model.init_cache(ids.shape[0], max_len)
    logits, cache = fwd(ids[:, :prefill], cache)
    steps = [logits]
    for t in range(prefill, ids.shape[1]):
        logits, cache = fwd(ids[:, t : t + 1], cache)
        steps.append(logits)
    assert int(cache[0].length) == ids.shape[1]
    return np.concatenate([np.asarray(s) for s in steps], axis=1), np.asarray(full)


@pytest.mark.parametrize(("core", "prefill"), [("default", 1), ("default", 16), ("chunks-3x5", 7)])
def test_decode_matches_forward(core, prefill):
    weights = random_hf_weights(TINY, seed=4)
    model = nnx_model(TINY, weights, CORES[core])
    ids = np.stack([tokens_of(20, seed=5), tokens_of(20, seed=6)])
    steps, full = decode_vs_forward(model, ids, prefill, max_len=24)
    scale = np.abs(full).max()
    np.testing.assert_allclose(steps, full, rtol=0, atol=2e-6 * scale)


@pytest.mark.gpu
def test_decode_matches_forward_smollm2_shapes_gpu():
    """SmolLM2-135M shapes (30 layers, random weights): 300-token prefill + 12 steps."""
    cfg = LlamaConfig.smollm2_135m()
    model = Llama(cfg, rngs=nnx.Rngs(0))
    ids = tokens_of(312, seed=7, vocab=cfg.vocab_size)[None]
    steps, full = decode_vs_forward(model, ids, prefill=300, max_len=512)
    scale = np.abs(full).max()
    np.testing.assert_allclose(steps, full, rtol=0, atol=1e-5 * scale)
    assert jax.devices()[0].platform == "gpu"


def plain_softmax_attention(q, k, v, q_pos, k_pos):
    """numpy: one (sequence, head) at a time, explicit mask."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, t, h, v.shape[-1]))
    for bi in range(b):
        for head in range(h):
            s = q[bi, :, head] @ k[bi, :, head // g].T / np.sqrt(d)
            visible = (k_pos[bi][None, :] >= 0) & (k_pos[bi][None, :] <= q_pos[bi][:, None])
            for t_i in range(t):
                if not visible[t_i].any():
                    continue  # a query that sees no key gets 0
                row = np.where(visible[t_i], s[t_i], -np.inf)
                p = np.exp(row - row.max())
                out[bi, t_i, head] = (p / p.sum()) @ v[bi, :, head // g]
    return out


@pytest.mark.parametrize("chunks", [(512, 512), (4, 3), (1, 16)])
def test_dense_core_with_empty_and_unordered_slots(chunks):
    rng = np.random.default_rng(8)
    b, t, s, h, hkv, d = 2, 9, 14, 6, 2, 8
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    k_pos = np.stack([rng.permutation(s), rng.permutation(s)]).astype(np.int32)
    k_pos[:, [3, 11]] = -1  # empty slots in the middle
    q_pos = np.stack([np.arange(4, 4 + t), np.arange(5, 5 + t)]).astype(np.int32)
    core = DenseCausalAttention(*chunks)
    out = core(q, k, v, q_positions=jnp.asarray(q_pos), k_positions=jnp.asarray(k_pos))
    ref = plain_softmax_attention(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    data=st.data(),
    t=st.integers(1, 7),
    s=st.integers(1, 9),
    hkv=st.integers(1, 2),
    g=st.integers(1, 3),
    query_chunk=st.integers(1, 8),
    key_chunk=st.integers(1, 10),
)
def test_dense_core_any_slots(data, t, s, hkv, g, query_chunk, key_chunk):
    """Arbitrary slot positions (unordered, empty, invisible) and block sizes."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q = rng.standard_normal((1, t, hkv * g, 4)).astype(np.float32)
    k = rng.standard_normal((1, s, hkv, 4)).astype(np.float32)
    v = rng.standard_normal((1, s, hkv, 3)).astype(np.float32)
    k_pos = np.array([data.draw(st.lists(st.integers(-1, 24), min_size=s, max_size=s))])
    q_pos = np.array([data.draw(st.lists(st.integers(0, 12), min_size=t, max_size=t))])
    core = DenseCausalAttention(query_chunk, key_chunk)
    out = core(
        q,
        k,
        v,
        q_positions=jnp.asarray(q_pos, jnp.int32),
        k_positions=jnp.asarray(k_pos, jnp.int32),
    )
    ref = plain_softmax_attention(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [(512, 512), (4, 3)])
def test_dense_core_has_a_gradient_and_a_jvp(chunks):
    """Its key loop stops at a traced block count, which reverse mode cannot take; the
    derivative visits every block instead (a prefill's grad once raised inside jax)."""
    rng = np.random.default_rng(10)
    b, t, s, h, hkv, d = 1, 7, 11, 4, 2, 8
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, h, d), (b, s, hkv, d), (b, s, hkv, d))
    )
    k_pos = jnp.asarray([[0, 1, 2, 3, -1, 4, 5, 6, 7, 8, 9]], jnp.int32)
    q_pos = jnp.asarray([[-1, 1, 2, 3, 4, 5, 6]], jnp.int32)  # the first query sees nothing
    core = DenseCausalAttention(*chunks)

    def masked_softmax(q, k, v):
        kk, vv = (jnp.repeat(x, h // hkv, axis=2) for x in (k, v))
        scores = jnp.einsum("bthd,bshd->bhts", q, kk, precision="highest") / np.sqrt(d)
        kp = k_pos[:, None, None, :]
        seen = (kp >= 0) & (kp <= q_pos[:, None, :, None])
        p = jax.nn.softmax(jnp.where(seen, scores, -1e30), axis=-1) * seen.any(-1, keepdims=True)
        return jnp.einsum("bhts,bshd->bthd", p, vv, precision="highest")

    weights = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    ours = lambda q, k, v: core(q, k, v, q_positions=q_pos, k_positions=k_pos)  # noqa: E731
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(masked_softmax), argnums=(0, 1, 2))(q, k, v)
    for g_got, g_want in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=1e-5, atol=1e-6)
    tangents = (jnp.ones_like(q), jnp.zeros_like(k), jnp.ones_like(v))
    _, t_got = jax.jvp(ours, (q, k, v), tangents)
    _, t_want = jax.jvp(masked_softmax, (q, k, v), tangents)
    np.testing.assert_allclose(np.asarray(t_got), np.asarray(t_want), rtol=1e-5, atol=1e-6)


def test_dense_core_visits_a_late_block_holding_early_positions():
    """Slots in blocks of 2: only the last block is visible to the query at position 5."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 1, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 6, 1, 4)).astype(np.float32)
    v = rng.standard_normal((1, 6, 1, 4)).astype(np.float32)
    k_pos = np.array([[10, 11, 12, 13, 0, 1]], np.int32)
    q_pos = np.array([[5]], np.int32)
    out = DenseCausalAttention(query_chunk=1, key_chunk=2)(
        q, k, v, q_positions=jnp.asarray(q_pos), k_positions=jnp.asarray(k_pos)
    )
    ref = plain_softmax_attention(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_swapped_core_is_called_and_agrees():
    """Any callable with the core's signature plugs in; here jax.nn.dot_product_attention."""
    calls = []

    def sdpa_core(q, k, v, *, q_positions, k_positions):
        calls.append(q.shape)
        mask = (k_positions[:, None, None, :] >= 0) & (
            k_positions[:, None, None, :] <= q_positions[:, None, :, None]
        )
        with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    weights = random_hf_weights(TINY)
    model = nnx_model(TINY, weights)
    ids = tokens_of(10)
    dense, _ = forward_fn(model)(ids[None])
    model.set_core(lambda i: sdpa_core)
    swapped, _ = forward_fn(model)(ids[None])
    assert calls, "the swapped core was not called"
    # Two f32 attention cores differ by reassociation: 2e-5 measured on an H200.
    np.testing.assert_allclose(np.asarray(swapped), np.asarray(dense), rtol=F32_TOL, atol=F32_TOL)


def test_input_errors():
    model = nnx_model(TINY, random_hf_weights(TINY))
    fwd = forward_fn(model)
    with pytest.raises(ValueError, match="ids must lie in"):
        fwd(np.array([[1, TINY.vocab_size]]))
    with pytest.raises(ValueError, match="rank 2"):
        fwd(np.array([1, 2]))
    cache = model.init_cache(1, 4)
    with pytest.raises(ValueError, match=r"lengths 0 \+ T = 5 new tokens exceed max_len = 4"):
        fwd(tokens_of(5)[None], cache)
    with pytest.raises(ValueError, match="multiple of"):
        LlamaConfig(
            vocab_size=8, d_model=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4, d_ff=8
        )


def test_a_decode_step_consumes_the_cache_it_is_given():
    """forward_fn donates the cache: the step updates it in place instead of copying
    every layer's K/V cache, and the cache passed in is consumed."""
    model = nnx_model(TINY, random_hf_weights(TINY))
    fwd = forward_fn(model)
    ids = tokens_of(6, seed=4)[None]
    _, cache = fwd(ids[:, :5], model.init_cache(1, 8))
    before = cache[0].k
    _, after = fwd(ids[:, 5:], cache)
    assert before.is_deleted() and int(after[0].length) == 6


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        # forward_fn converted to int32 before checking: floats truncated, ids wrapped
        (np.array([[1.5, 2.7, 3.2]]), "tokens: dtype float64 is not an integer type"),
        ([[1.0, 2.0]], "tokens: dtype float64"),
        (np.array([[True, False]]), "tokens: dtype bool"),
        (np.array([[1, 2**32 + 1, 3]]), r"got 4294967297 at position \(0, 1\)"),
        ([[1, 2, 2**70]], r"tokens: id 1180591620717411303424 at position \(0, 2\)"),
        (np.array([[1, 2], [3, -1]]), r"got -1 at position \(1, 1\)"),
        # empty inputs: a ZeroDivisionError (T = 0) or a numpy reduction error (B = 0)
        (np.zeros((1, 0), np.int32), r"tokens: shape \(1, 0\) is empty"),
        (np.zeros((0, 3), np.int32), r"tokens: shape \(0, 3\) is empty"),
        ([[]], r"tokens: shape \(1, 0\) is empty"),
    ],
)
def test_bad_tokens_are_refused_before_conversion(tokens, match):
    model = nnx_model(TINY, random_hf_weights(TINY))
    with pytest.raises(ValueError, match=match):
        forward_fn(model)(tokens)
    if hasattr(tokens, "dtype"):
        with pytest.raises(ValueError, match=match):
            model(jnp.asarray(tokens) if tokens.dtype.itemsize <= 4 else tokens)


def test_empty_decode_step_is_refused():
    model = nnx_model(TINY, random_hf_weights(TINY))
    with pytest.raises(ValueError, match=r"tokens: shape \(1, 0\) is empty"):
        forward_fn(model)(np.zeros((1, 0), np.int32), model.init_cache(1, 8))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("d_ff", 0, "LlamaConfig.d_ff: got 0; expected an int >= 1"),
        ("max_seq_len", 0, "LlamaConfig.max_seq_len: got 0"),
        ("d_model", 32.0, "LlamaConfig.d_model: got 32.0; expected an int"),
        ("n_layers", True, "LlamaConfig.n_layers: got True"),
        ("rope_theta", 0.0, "LlamaConfig.rope_theta: got 0.0; expected a finite number > 0"),
        ("rope_theta", -100.0, "LlamaConfig.rope_theta: got -100.0"),
        ("rope_theta", float("inf"), "LlamaConfig.rope_theta: got inf"),
        ("rope_theta", float("nan"), "LlamaConfig.rope_theta: got nan"),
        ("rope_theta", "1e4", "LlamaConfig.rope_theta: got '1e4'"),
        ("norm_eps", 0.0, "LlamaConfig.norm_eps: got 0.0"),
        ("norm_eps", -1e-5, "LlamaConfig.norm_eps: got -1e-05"),
        ("norm_eps", float("nan"), "LlamaConfig.norm_eps: got nan"),
        ("tie_embeddings", "false", "LlamaConfig.tie_embeddings: got 'false'; expected a bool"),
        ("name", None, "LlamaConfig.name: got None"),
    ],
)
def test_config_fields_are_validated(field, value, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        LlamaConfig(**{**TINY.to_dict(), field: value})


def test_config_from_dict_is_exact():
    assert LlamaConfig.from_dict(TINY.to_dict()) == TINY
    without = {k: v for k, v in TINY.to_dict().items() if k != "rope_theta"}
    # A missing key used to take its default (rope_theta 10000: wrong logits).
    with pytest.raises(ValueError, match=r"missing keys \['rope_theta'\], unknown keys \[\]"):
        LlamaConfig.from_dict(without)
    # A misspelt key used to be dropped silently.
    with pytest.raises(
        ValueError, match=r"missing keys \['rope_theta'\], unknown keys \['rope_thta'\]"
    ):
        LlamaConfig.from_dict({**without, "rope_thta": 100.0})
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        LlamaConfig.from_dict({**TINY.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match="got a list; expected a dict"):
        LlamaConfig.from_dict([])


def test_a_cache_of_integers_is_refused():
    # init_cache(dtype=jnp.int8) truncated K and V silently (logits 0.11 off).
    from jsparse.models.llama import KVCache

    with pytest.raises(ValueError, match="dtype: int8; expected float32"):
        KVCache.empty(1, 4, 1, 8, dtype=jnp.int8)
    assert KVCache.empty(1, 4, 1, 8, dtype=jnp.bfloat16).k.dtype == jnp.bfloat16
