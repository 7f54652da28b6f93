"""SparseAttention as the attention core of the NNX Llama: a full budget decodes exactly
like dense attention, a small one attends exactly the selected tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse
from jsparse.models.llama import DenseCausalAttention, Llama, LlamaConfig, forward_fn
from jsparse.nn.attention import prefill_projection
from tests.gradients import assert_kernels_differentiate_like_the_reference, weight_gradient

TINY = LlamaConfig(
    vocab_size=96, d_model=32, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=40,
    rope_theta=100.0, norm_eps=1e-5, max_seq_len=64, name="tiny",
)  # fmt: skip


def _model(core=None, seed=0, scale=20.0):
    model = Llama(TINY, core, rngs=nnx.Rngs(seed))
    # larger weights than the init's 0.02, so attention is far from uniform
    state = nnx.state(model, nnx.Param)
    model_state = jax.tree.map(lambda p: p * scale, state)
    nnx.update(model, model_state)
    return model


def _decode(model, tokens, steps, dtype=jnp.float32):
    """Prefill tokens[:, :-steps], then decode the rest one token at a time."""
    fwd = forward_fn(model)
    cache = model.init_cache(tokens.shape[0], 48, dtype)
    logits, cache = fwd(tokens[:, :-steps], cache)
    outs = [logits[:, -1]]
    for i in range(steps, 0, -1):
        logits, cache = fwd(tokens[:, -i : tokens.shape[1] - i + 1], cache)
        outs.append(logits[:, -1])
    return np.stack([np.asarray(o) for o in outs], axis=1)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 30)), jnp.int32)


@pytest.mark.parametrize("selector", ["oracle", "full"])
def test_a_budget_covering_the_context_decodes_like_dense(selector, kernel_impl):
    dense = _decode(_model(), TOKENS, steps=6)
    core = lambda i: jsparse.SparseAttention(selector, {}, 48, implementation=kernel_impl)  # noqa: E731
    sparse = _decode(_model(core), TOKENS, steps=6)
    np.testing.assert_allclose(sparse, dense, rtol=2e-4, atol=2e-4)


def test_a_small_budget_attends_exactly_the_selected_tokens():
    rng = np.random.default_rng(1)
    b, s, h, hkv, d, filled, budget = 2, 40, 6, 2, 8, 33, 5
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32)
    k_pos = jnp.where(jnp.arange(s) < filled, jnp.arange(s), -1)[None].repeat(b, 0)
    q_pos = jnp.full((b, 1), filled - 1, jnp.int32)
    sel = jsparse.make_selector("jssa", rank=4)
    params = sel.calibrate(
        jnp.asarray(rng.standard_normal((200, h, d)), jnp.float32),
        jnp.asarray(rng.standard_normal((200, hkv, d)), jnp.float32),
    )
    core = jsparse.SparseAttention(sel, params, budget)
    got = core(q, k, v, q_positions=q_pos, k_positions=k_pos)
    idx = sel.select(params, q[:, 0], k, jnp.full((b,), filled, jnp.int32), budget)
    assert np.all((np.asarray(idx) >= 0) & (np.asarray(idx) < filled))
    want = jsparse.indexed_attention(q[:, 0], k, v, idx, implementation="reference")
    np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-6, atol=1e-6)
    dense = DenseCausalAttention()(q, k, v, q_positions=q_pos, k_positions=k_pos)
    assert not np.allclose(np.asarray(got), np.asarray(dense), atol=1e-3)  # 5 of 33 tokens


def _calibration_samples(rng):
    return (
        jnp.asarray(rng.standard_normal((100, 6, 8)), jnp.float32),
        jnp.asarray(rng.standard_normal((100, 2, 8)), jnp.float32),
    )


def test_calibrated_layers_travel_with_the_model_state():
    rng = np.random.default_rng(2)
    sel = jsparse.make_selector("jssa", rank=4)
    params = [sel.calibrate(*_calibration_samples(rng)) for _ in range(TINY.n_layers)]
    model = _model(lambda i: jsparse.SparseAttention(sel, params[i], 8))
    state = nnx.state(model, jsparse.nn.SelectorParams)
    leaves = jax.tree.leaves(state)
    assert len(leaves) == TINY.n_layers * len(params[0])
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].attn.core.params["basis"].get_value()),
        np.asarray(params[1]["basis"]),
    )
    out = _decode(model, TOKENS, steps=3)  # prefill dense, then three sparse steps
    assert np.all(np.isfinite(out))
    assert not np.allclose(out[:, 1:], _decode(_model(), TOKENS, steps=3)[:, 1:], atol=1e-3)
    # a pure-dict round trip into a model built with other params decodes as this one
    others = [sel.calibrate(*_calibration_samples(rng)) for _ in range(TINY.n_layers)]
    fresh = _model(lambda i: jsparse.SparseAttention(sel, others[i], 8))
    state = nnx.state(fresh)
    nnx.replace_by_pure_dict(state, nnx.to_pure_dict(nnx.state(model)))
    nnx.update(fresh, state)
    np.testing.assert_array_equal(_decode(fresh, TOKENS, steps=3), out)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="budget: got 0"):
        jsparse.SparseAttention("oracle", {}, 0)
    with pytest.raises(ValueError, match="selector: got int"):
        jsparse.SparseAttention(3, {}, 8)
    with pytest.raises(ValueError, match=r"selector: unknown name 'jsssa'; known: \['fasa'"):
        jsparse.SparseAttention("jsssa", {}, 8)
    with pytest.raises(ValueError, match=r"selector_options \['rank'\]"):
        jsparse.SparseAttention(jsparse.make_selector("jssa"), {}, 8, rank=4)
    uncalibrated = jsparse.SparseAttention("jssa", {}, 8, rank=4)
    with pytest.raises(ValueError, match=r"params: the jssa selector needs its calibrated params"):
        uncalibrated.init_core_state(1, 16, 1, 8)
    with pytest.raises(ValueError, match=r"no 'basis' in \['kernel'\]"):
        jsparse.make_selector("jssa", rank=4).select(
            {"kernel": jnp.ones(3)}, jnp.ones((1, 2, 8)), jnp.ones((1, 6, 1, 8)),
            jnp.asarray([6], jnp.int32), 4,
        )  # fmt: skip
    core = jsparse.SparseAttention("oracle", {}, 4)
    q = jnp.ones((1, 1, 2, 8))
    k = jnp.ones((1, 6, 1, 8))
    scrambled = jnp.asarray([[0, -1, 2, 3, -1, -1]], jnp.int32)  # a hole before slot 2
    with pytest.raises(ValueError, match="k_positions: sequence 0's visible slots"):
        core(q, k, k, q_positions=jnp.asarray([[3]]), k_positions=scrambled)


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["oracle", "jssa"])
def test_gpu_full_budget_decode_compiled(selector):
    """The same equality with the Triton kernels compiled (f32 caches: tf32x3 dots, see
    jsparse.ops.f32_dots); ``jssa`` selects from its kept FP8 projected cache with the
    Top-K kernels."""
    dense = _decode(_model(), TOKENS, steps=4)
    sel, params = _calibrated("jssa", rank=4) if selector == "jssa" else (selector, {})
    core = lambda i: jsparse.SparseAttention(sel, params, 48, implementation="triton")  # noqa: E731
    model = _model(core)
    assert (model.init_cache(2, 48)[0].core_state is None) == (selector == "oracle")
    np.testing.assert_allclose(_decode(model, TOKENS, steps=4), dense, rtol=2e-4, atol=2e-4)


def test_misuse_of_a_core_is_named():
    """Each of these gave a raw TypeError / IndexError / AttributeError, or a silently
    wrong answer (a broadcast q_positions in a ragged batch; a projected cache of fewer
    slots than the K cache under jit; a ring-buffer cache with a kept projection)."""
    with pytest.raises(ValueError, match="implementation: got 'tritn'"):
        jsparse.SparseAttention("oracle", {}, 4, implementation="tritn")
    with pytest.raises(ValueError, match="fp8_headroom: got inf"):
        jsparse.SparseAttention("oracle", {}, 4, fp8_headroom=float("inf"))
    with pytest.raises(ValueError, match="params: got list"):
        jsparse.SparseAttention("oracle", [("basis", jnp.ones(3))], 4)
    core = jsparse.SparseAttention("oracle", {}, 4)
    q, k = jnp.ones((2, 1, 2, 8)), jnp.ones((2, 6, 1, 8))
    k_pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    q_pos = jnp.asarray([[5], [3]], jnp.int32)
    calls = [
        ("q: expected rank 4", dict(q=q[:, 0])),
        ("q_positions: expected rank 2", dict(q_positions=q_pos[:, 0])),
        (r"q_positions: shape \(1, 1\); expected \[B, T\] = \(2, 1\)", dict(q_positions=q_pos[:1])),
        ("q_positions: dtype float32", dict(q_positions=q_pos.astype(jnp.float32))),
        ("k_positions: dtype float32", dict(k_positions=k_pos.astype(jnp.float32))),
        ("k: dtype int32; expected a floating-point array", dict(k=k.astype(jnp.int32))),
    ]
    for message, change in calls:
        args = dict(q=q, k=k, q_positions=q_pos, k_positions=k_pos) | change
        with pytest.raises(ValueError, match=message):
            core(args["q"], args["k"], k, q_positions=args["q_positions"],
                 k_positions=args["k_positions"])  # fmt: skip

    sel, params = _calibrated("jssa", rank=4)
    kept = jsparse.SparseAttention(sel, params, 4)
    other = kept.init_core_state(2, 6, TINY.n_kv_heads, 8)
    for t in (1, 3):  # decode and prefill: AttributeErrors of the oracle selector
        with pytest.raises(ValueError, match="core_state: the 'oracle' selector keeps no"):
            core(jnp.ones((2, t, 2, 8)), k, k, q_positions=jnp.full((2, t), 5, jnp.int32),
                 k_positions=k_pos, core_state=other)  # fmt: skip
    q, k = jnp.ones((1, 1, TINY.n_heads, 8)), jnp.ones((1, 16, TINY.n_kv_heads, 8))
    small = kept.init_core_state(1, 8, TINY.n_kv_heads, 8)
    k_pos = jnp.arange(16, dtype=jnp.int32)[None]

    @jax.jit
    def step(state):
        return kept(q, k, k, q_positions=jnp.asarray([[11]]), k_positions=k_pos, core_state=state)

    with pytest.raises(ValueError, match=r"core_state: a projected cache of \(1, 8\) \[B, S\]"):
        step(small)
    # another layer's state (calibrated for one KV head), or not a state at all
    rng = np.random.default_rng(5)
    one_head = sel.calibrate(jnp.asarray(rng.standard_normal((50, TINY.n_heads, 8)), jnp.float32),
                             jnp.asarray(rng.standard_normal((50, 1, 8)), jnp.float32))  # fmt: skip
    for state, message in (
        (sel.empty_cache(one_head, 1, 16), r"core_state: ProjectedKeys \[.*\]; expected"),
        ((jnp.zeros((1, 16)),), r"core_state: tuple \[.*\]; expected ProjectedKeys"),
        (
            jnp.zeros((1, 16, 2, 4)),
            r"core_state: got an array \(1, 16, 2, 4\); expected this selector's cache",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            step(state)
    state = kept.init_core_state(1, 16, TINY.n_kv_heads, 8)
    ring = jnp.asarray([[16, 17, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]], jnp.int32)
    with pytest.raises(ValueError, match="sequence 0's visible slots hold positions out of order"):
        kept(q, k, k, q_positions=jnp.asarray([[17]]), k_positions=ring, core_state=state)
    with pytest.raises(ValueError, match="last visible slot holds position 9, not the step's 12"):
        kept(q, k, k, q_positions=jnp.asarray([[12]]),
             k_positions=jnp.where(k_pos < 10, k_pos, -1), core_state=state)  # fmt: skip


def _calibrated(name, **options):
    rng = np.random.default_rng(3)
    sel = jsparse.make_selector(name, **options)
    h, hkv, d = TINY.n_heads, TINY.n_kv_heads, TINY.head_dim
    params = sel.calibrate(
        jnp.asarray(rng.standard_normal((300, h, d)), jnp.float32),
        jnp.asarray(rng.standard_normal((300, hkv, d)), jnp.float32),
    )
    return sel, params


def _stateless(core):
    """The same core behind a plain function: the model then carries no core state, and
    each decode step projects the visible keys again."""
    return lambda q, k, v, **kw: core(q, k, v, **kw)


@pytest.mark.parametrize("name", ["jssa", "loki", "kq_svd"])
def test_the_kept_projected_cache_selects_like_projecting_every_step(name):
    """With a float32 cache, scales play no part: keeping the cache and re-projecting the
    whole context every step must select the same tokens, so decode the same logits."""
    sel, params = _calibrated(name, rank=4, cache_dtype="float32")
    core = lambda i: jsparse.SparseAttention(sel, params, 6)  # noqa: E731
    model = _model(core)
    assert model.init_cache(2, 48)[0].core_state is not None
    kept = _decode(model, TOKENS, steps=6)
    again = _decode(_model(lambda i: _stateless(core(i))), TOKENS, steps=6)
    assert _model(lambda i: _stateless(core(i))).init_cache(2, 48)[0].core_state is None
    np.testing.assert_allclose(kept, again, rtol=1e-5, atol=1e-5)
    assert not np.allclose(kept[:, 1:], _decode(_model(), TOKENS, steps=6)[:, 1:], atol=1e-3)


@pytest.mark.parametrize("name", ["jssa", "loki"])
def test_the_fused_step_decodes_like_the_separate_projections(name, kernel_impl, monkeypatch):
    """``FUSED_STEP``: the step's projections and cache write in one ``projected_step``
    launch select the same tokens as the selector's own methods (same logits)."""
    sel, params = _calibrated(name, rank=4)
    core = lambda i: jsparse.SparseAttention(sel, params, 6)  # noqa: E731
    monkeypatch.setattr(jsparse.selectors.base, "FUSED_STEP", False)
    separate = _decode(_model(core), TOKENS, steps=6)
    base = jsparse.selectors.base
    step, calls = base.projected_step, []
    monkeypatch.setattr(base, "FUSED_STEP", True)
    monkeypatch.setattr(base, "projected_step", lambda *a: calls.append(1) or step(*a))
    fused = _decode(_model(core), TOKENS, steps=6)
    assert calls  # the fused path ran (traced once per layer)
    np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["jssa", "jssa_rd", "head_shared"])
def test_a_budget_covering_the_context_decodes_like_dense_with_the_kept_cache(name):
    options = {"fp8_dims": 2, "int4_dims": 4} if name == "jssa_rd" else {"rank": 4}
    sel, params = _calibrated(name, **options)
    model = _model(lambda i: jsparse.SparseAttention(sel, params, 48))
    assert model.init_cache(2, 48)[0].core_state is not None
    np.testing.assert_allclose(
        _decode(model, TOKENS, steps=5), _decode(_model(), TOKENS, steps=5), rtol=2e-4, atol=2e-4
    )


def test_the_kept_cache_holds_each_key_once_at_its_slot():
    """After a prefill and three steps, the state is the projection of exactly the
    written keys, at their slots, with the prefill's FP8 scale (headroom 2)."""
    sel, params = _calibrated("jssa", rank=4)
    model = _model(lambda i: jsparse.SparseAttention(sel, params, 4))
    fwd = forward_fn(model)
    cache = model.init_cache(2, 40)
    _, cache = fwd(TOKENS[:, :20], cache)
    prefill_scale = np.asarray(cache[1].core_state.scale)
    for t in range(20, 23):
        _, cache = fwd(TOKENS[:, t : t + 1], cache)
    layer = cache[1]
    state = layer.core_state
    np.testing.assert_array_equal(np.asarray(state.scale), prefill_scale)
    k = layer.k[:, :23]
    proj = np.einsum("bshd,hrd->bshr", np.asarray(k, np.float64), np.asarray(params["basis"]))
    amax = np.abs(proj[:, :20]).max(axis=(1, 3))
    np.testing.assert_allclose(prefill_scale, 2.0 * amax / 448.0, rtol=1e-5)
    want = jsparse.selectors.base.quantize_with_scale(
        jnp.asarray(proj, jnp.float32), state.scale, "float8_e4m3fn"
    )
    got = state.values[:, :23]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_which_selectors_keep_a_projected_cache():
    """Projected selectors keep one (jssa_mla too, whose bytes per token depend on the
    row width); head_shared's "full" vote and the oracle read the keys themselves."""
    keeps = lambda sel: jsparse.SparseAttention(sel, {}, 8).keeps_projected_cache  # noqa: E731
    make = jsparse.make_selector
    assert keeps(make("jssa", rank=4)) and keeps(make("jssa_mla", rank=4, latent_dim=8))
    assert keeps(make("head_shared", rank=4))
    assert not keeps(make("head_shared", basis="full")) and not keeps(make("oracle"))


def test_an_fp8_kv_cache_decodes_close_to_f32_and_sparse_reads_it_in_place(kernel_impl):
    """The model's FP8 K/V cache (scales from the prompt's amax, headroom 2): the dense
    core (dequantised cache) stays close to f32 at the init's weight scale (the sharp,
    20× weights amplify FP8 rounding to tens of percent); SparseAttention with a budget
    covering the context, reading the FP8 cache with its scales, decodes like that
    dense core."""
    plain = _model(scale=1.0)
    err = np.abs(_decode(plain, TOKENS, 5, jnp.float8_e4m3fn) - _decode(plain, TOKENS, 5))
    assert 1e-5 < err.max() / np.abs(_decode(plain, TOKENS, 5)).max() < 0.02
    fp8 = _decode(_model(), TOKENS, steps=5, dtype=jnp.float8_e4m3fn)
    sel, params = _calibrated("jssa", rank=4)
    sparse = _model(lambda i: jsparse.SparseAttention(sel, params, 48, implementation=kernel_impl))
    got = _decode(sparse, TOKENS, steps=5, dtype=jnp.float8_e4m3fn)
    np.testing.assert_allclose(got, fp8, rtol=2e-4, atol=2e-4)


def test_an_fp8_kv_cache_holds_the_keys_to_fp8_rounding_with_the_prompts_scales():
    model = _model()
    fwd = forward_fn(model)
    _, f32 = fwd(TOKENS[:, :20], model.init_cache(2, 40))
    _, cache = fwd(TOKENS[:, :20], model.init_cache(2, 40, jnp.float8_e4m3fn))
    want, got = f32[0], cache[0]  # layer 0: its k, v do not depend on the cache's dtype
    assert got.k.dtype == jnp.float8_e4m3fn and got.v.dtype == jnp.float8_e4m3fn
    k, v = (np.asarray(x) for x in got.widened())
    for name, x, ref, scale in (("k", k, want.k, got.k_scale), ("v", v, want.v, got.v_scale)):
        ref, scale = np.asarray(ref), np.asarray(scale)[:, None, :, None]
        amax = np.abs(ref[:, :20]).max(axis=(1, 3), keepdims=True)
        np.testing.assert_allclose(scale, 2.0 * amax / 448.0, rtol=1e-5, err_msg=name)
        # e4m3: 3 mantissa bits (half-ulp 1/16), subnormal step 2**-9 of the scale
        bound = np.abs(ref) / 16 + scale * 2.0**-10 + 1e-7
        assert (np.abs(x - ref) <= bound).all(), name
    before = np.asarray(cache[0].v_scale)
    _, after = fwd(TOKENS[:, 20:21], cache)  # a decode step keeps the scales
    np.testing.assert_array_equal(np.asarray(after[0].v_scale), before)


@pytest.mark.parametrize("selector", ["oracle", "jssa"])
def test_a_sparse_decode_step_differentiates_like_the_reference(selector):
    """Gradients of a decode step's logits with respect to the weights (fine-tuning
    through sparse decoding): the Pallas path (selection ids, the attention kernel with
    its reference's derivative) gives the reference path's gradient."""
    sel, params = _calibrated("jssa", rank=4) if selector == "jssa" else (selector, {})

    def gradient(implementation):
        core = lambda i: jsparse.SparseAttention(sel, params, 8, implementation=implementation)  # noqa: E731
        model = _model(core, scale=3.0)
        cache = model.init_cache(TOKENS.shape[0], 48)
        _, cache = forward_fn(model)(TOKENS[:, :-1], cache)
        return weight_gradient(model, lambda m: m(TOKENS[:, -1:], cache)[0])

    assert_kernels_differentiate_like_the_reference(gradient)


@pytest.mark.parametrize("kept", [True, False])
def test_under_jit_a_cache_out_of_position_order_answers_nan(kept):
    """A hole, a wrapped ring buffer, a position written twice or (with a kept cache) a
    step whose key is not the last visible slot raise when the positions are concrete;
    under jit that sequence's output is NaN, the others' what they are alone."""
    sel, params = _calibrated("jssa", rank=4)
    core = jsparse.SparseAttention(sel, params, 4)
    rng = np.random.default_rng(6)
    s, hkv, d = 16, TINY.n_kv_heads, 8
    k = jnp.asarray(rng.standard_normal((5, s, hkv, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((5, 1, TINY.n_heads, d)), jnp.float32)
    slots = np.arange(s)
    k_pos = np.stack([
        np.where(slots < 12, slots, -1),                      # in order
        np.where((slots < 12) & (slots != 5), slots, -1),     # a hole at slot 5
        np.where(slots < 2, slots + 16, slots),               # a ring buffer that wrapped
        np.where(slots < 10, slots, -1),                      # the step's key not written
        np.where(slots < 13, slots - (slots >= 3), -1),       # a position written twice
    ]).astype(np.int32)  # fmt: skip
    q_pos = np.array([[11], [11], [17], [12], [11]], np.int32)

    def step(q, k, q_pos, k_pos):
        state = core.init_core_state(q.shape[0], s, hkv, d) if kept else None
        if kept:  # the kept cache as a prefill of the sequence's keys left it
            state = prefill_projection(sel, params, k, k_pos, 2.0)
        out = core(q, k, k, q_positions=q_pos, k_positions=k_pos, core_state=state)
        return out[0] if kept else out

    got = np.asarray(jax.jit(step)(q, k, jnp.asarray(q_pos), jnp.asarray(k_pos)))
    broken = [1, 2, 3, 4] if kept else [1, 2, 4]
    for b in range(5):
        if b in broken:
            assert np.isnan(got[b]).all(), b
            with pytest.raises(ValueError, match="k_positions: sequence 0's"):
                step(q[b : b + 1], k[b : b + 1], jnp.asarray(q_pos[b : b + 1]),
                     jnp.asarray(k_pos[b : b + 1]))  # fmt: skip
        else:
            alone = step(q[b : b + 1], k[b : b + 1], jnp.asarray(q_pos[b : b + 1]),
                         jnp.asarray(k_pos[b : b + 1]))  # fmt: skip
            np.testing.assert_allclose(got[b], np.asarray(alone)[0], rtol=1e-6, atol=1e-6)
