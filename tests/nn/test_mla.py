"""The MLA layer: absorbed attention equals the expanded heads, prefill + decode equals
one causal pass, and SparseMLA with a full budget decodes exactly like dense."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse
from jsparse.models.llama import apply_rope, rope_angles
from jsparse.nn.mla import DenseMLA, MLAAttention, SparseMLA
from tests.gradients import assert_kernels_differentiate_like_the_reference, weight_gradient

DIMS = dict(latent_dim=32, rope_dim=8, nope_dim=16, v_dim=12)
D_MODEL, HEADS = 48, 4


def layer(core=None, seed=0):
    return MLAAttention(D_MODEL, HEADS, **DIMS, core=core, rngs=nnx.Rngs(seed))


def inputs(b, t, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (b, t, D_MODEL), jnp.float32)


def expanded(mla: MLAAttention, x):
    """Causal MHA with every head's keys and values expanded from the latent."""
    b, t, _ = x.shape
    dc, dr, dn = DIMS["latent_dim"], DIMS["rope_dim"], DIMS["nope_dim"]
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    q = mla.q_proj(x).reshape(b, t, HEADS, dn + dr)
    kv = mla.kv_a(x)
    c = mla.kv_norm(kv[..., :dc])
    cos, sin = rope_angles(pos, dr, mla.rope_theta)
    q = jnp.concatenate([q[..., :dn], apply_rope(q[..., dn:], cos, sin)], axis=-1)
    k_r = apply_rope(kv[..., None, dc:], cos, sin)  # [B, T, 1, Dr]
    kvb = mla.kv_b(c).reshape(b, t, HEADS, dn + DIMS["v_dim"])
    k = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_r, (b, t, HEADS, dr))], axis=-1)
    v = kvb[..., dn:]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * mla.scale
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    heads = jnp.einsum("bhqk,bkhv->bqhv", jax.nn.softmax(logits, -1), v, precision="highest")
    return mla.o_proj(heads.reshape(b, t, -1))


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """The layer's projections at full f32 precision (a GPU defaults to TF32), so the
    absorbed and expanded forms compare at f32 rounding."""
    with jax.default_matmul_precision("highest"):
        yield


def test_absorbed_prefill_equals_expanded_heads():
    mla, x = layer(), inputs(2, 11)
    y, cache = mla(x, mla.init_cache(2, 16))
    np.testing.assert_allclose(np.asarray(y), np.asarray(expanded(mla, x)), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [11, 11])
    assert not np.asarray(cache.rows[:, 11:]).any()


def test_prefill_then_decode_equals_one_causal_pass():
    mla, x = layer(), inputs(2, 14)
    want = expanded(mla, x)
    y, cache = mla(x[:, :9], mla.init_cache(2, 16))
    step = nnx.jit(lambda m, xt, c: m(xt, c))
    outs = [y]
    for t in range(9, 14):
        yt, cache = step(mla, x[:, t : t + 1], cache)
        outs.append(yt)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(want),
                               rtol=1e-4, atol=1e-5)  # fmt: skip


def calibrated(mla, n=96):
    x = inputs(2, n, seed=7)
    pos = jnp.broadcast_to(jnp.arange(n), (2, n))
    q, rows = mla.absorbed(x, pos)
    sel = jsparse.make_selector("jssa_mla", rank=8, latent_dim=DIMS["latent_dim"])
    return sel, sel.calibrate(
        q.reshape(-1, HEADS, q.shape[-1]), rows.reshape(-1, 1, rows.shape[-1])
    )


def test_sparse_decoding_with_every_row_equals_dense(kernel_impl):
    dense = layer()
    sel, params = calibrated(dense)
    sparse = layer(SparseMLA(sel, params, budget=32, implementation=kernel_impl))
    x = inputs(2, 24, seed=3)
    results = []
    for mla in (dense, sparse):
        y, cache = mla(x[:, :18], mla.init_cache(2, 32))
        assert (cache.core_state is not None) == (mla is sparse)
        outs = [y]
        for t in range(18, 24):
            yt, cache = mla(x[:, t : t + 1], cache)
            outs.append(yt)
        results.append(np.asarray(jnp.concatenate(outs, 1)))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-4, atol=1e-5)


def test_the_fused_step_decodes_like_the_separate_projections(kernel_impl, monkeypatch):
    """``FUSED_STEP`` for ``jssa_mla`` (one KV head, every query head's mean): a small
    budget selects the same rows as the selector's own methods."""
    dense = layer()
    sel, params = calibrated(dense)
    x = inputs(2, 24, seed=5)

    def decode():
        mla = layer(SparseMLA(sel, params, budget=6, implementation=kernel_impl))
        y, cache = mla(x[:, :18], mla.init_cache(2, 32))
        outs = [y]
        for t in range(18, 24):
            yt, cache = mla(x[:, t : t + 1], cache)
            outs.append(yt)
        return np.asarray(jnp.concatenate(outs, 1))

    monkeypatch.setattr(jsparse.selectors.base, "FUSED_STEP", False)
    separate = decode()
    base = jsparse.selectors.base
    step, calls = base.projected_step, []
    monkeypatch.setattr(base, "FUSED_STEP", True)
    monkeypatch.setattr(base, "projected_step", lambda *a: calls.append(1) or step(*a))
    fused = decode()
    assert calls
    np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-6)


def test_a_small_budget_attends_the_selected_rows(kernel_impl):
    """Budget 6 of 20 rows, oracle selector: the step equals dense attention over the
    oracle's 6 rows."""
    core = SparseMLA("oracle", {}, budget=6, implementation=kernel_impl)
    mla = layer(core)
    x = inputs(1, 20, seed=4)
    _, cache = mla(x[:, :19], mla.init_cache(1, 24))
    y, after = mla(x[:, 19:], cache)
    q, _ = mla.absorbed(x[:, 19:], jnp.array([[19]]))
    scores = jnp.einsum("hd,sd->s", q[0, 0].mean(0, keepdims=True), after.rows[0, :20])
    keep = np.sort(np.argsort(-np.asarray(scores), kind="stable")[:6])
    rows = after.rows[:, keep]
    out = DenseMLA()(q, rows, q_positions=jnp.array([[6]]), k_positions=jnp.arange(6)[None],
                     scale=mla.scale, latent_dim=DIMS["latent_dim"])  # fmt: skip
    _, w_uv = mla.up_projections()
    want = mla.o_proj(jnp.einsum("bthc,chv->bthv", out, w_uv).reshape(1, 1, -1))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_bad_configuration():
    with pytest.raises(ValueError, match="budget: got 0"):
        SparseMLA("oracle", {}, budget=0)
    with pytest.raises(ValueError, match="rope_dim: got 7"):
        MLAAttention(8, 2, latent_dim=8, rope_dim=7, nope_dim=4, v_dim=4, rngs=nnx.Rngs(0))
    sel = jsparse.make_selector("jssa_mla", rank=4, latent_dim=16)
    q = jax.random.normal(jax.random.PRNGKey(0), (64, HEADS, 24))
    params = sel.calibrate(q, q[:, :1])
    with pytest.raises(ValueError, match="MLA rows are one KV head of dim 40"):
        layer(SparseMLA(sel, params, budget=4)).init_cache(1, 8)
    # rows as wide as the layer's, but a selector made for another split into latent and
    # RoPE dims would read RoPE values as latent ones
    other = jsparse.make_selector("jssa_mla", rank=4, latent_dim=24)
    rows = jax.random.normal(jax.random.PRNGKey(1), (64, 1, 40))
    mla = layer(SparseMLA(other, other.calibrate(rows, rows), budget=4))
    cache = mla.init_cache(1, 8)
    with pytest.raises(ValueError, match=r"latent_dim: the layer's rows hold 32 .* latent_dim=24"):
        mla(inputs(1, 1), cache)


def test_bad_inputs_and_caches_are_refused_by_name():
    mla = layer()
    with pytest.raises(ValueError, match="dtype: got int8"):
        mla.init_cache(1, 8, jnp.int8)  # rows would be truncated to integers
    with pytest.raises(ValueError, match="batch, max_len: got 0, 4"):
        mla.init_cache(0, 4)
    cache = mla.init_cache(1, 4)
    with pytest.raises(ValueError, match=r"x: expected rank 3 \[B, T, 48\]"):
        mla(inputs(1, 3)[0], cache)
    with pytest.raises(ValueError, match=r"x: shape \(1, 3, 16\)"):
        mla(inputs(1, 3)[..., :16], cache)
    with pytest.raises(ValueError, match=r"x: shape \(1, 0, 48\)"):
        mla(inputs(1, 0), cache)
    with pytest.raises(ValueError, match=r"cache.rows: shape \(1, 4, 40\); expected \[2,"):
        mla(inputs(2, 3), cache)
    with pytest.raises(ValueError, match=r"lengths \[0\] \+ T = 5 new tokens exceed max_len = 4"):
        mla(inputs(1, 5), cache)
    _, cache = mla(inputs(1, 3), cache)
    # a full cache would clamp the write and attend wrong rows without a word
    with pytest.raises(ValueError, match=r"lengths \[3\] \+ T = 2 new tokens exceed max_len = 4"):
        mla(inputs(1, 2), cache)
    _, cache = mla(inputs(1, 1), cache)  # the last row fits
    np.testing.assert_array_equal(cache.lengths, [4])


def _decode(mla, x, prefill, dtype):
    y, cache = mla(x[:, :prefill], mla.init_cache(x.shape[0], 32, dtype))
    outs = [y]
    for t in range(prefill, x.shape[1]):
        yt, cache = mla(x[:, t : t + 1], cache)
        outs.append(yt)
    return np.asarray(jnp.concatenate(outs, 1)), cache


def test_an_fp8_cache_keeps_the_prompts_scale_and_decodes_close_to_f32():
    mla, x = layer(), inputs(2, 24, seed=5)
    want, _ = _decode(mla, x, 18, jnp.float32)
    got, cache = _decode(mla, x, 18, jnp.float8_e4m3fn)
    assert cache.rows.dtype == jnp.float8_e4m3fn
    _, prompt_rows = mla.absorbed(x[:, :18], jnp.broadcast_to(jnp.arange(18), (2, 18)))
    amax = np.abs(np.asarray(prompt_rows)).max(axis=(1, 2))
    np.testing.assert_allclose(np.asarray(cache.scale), 2.0 * amax / 448.0, rtol=1e-6)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-4 < err < 0.05, err  # FP8 rounding shows, and stays small


def test_sparse_decoding_of_an_fp8_cache_with_every_row_equals_dense(kernel_impl):
    """Both cores read the same FP8 rows: SparseMLA through indexed_mla_attention's
    cache_scale, DenseMLA dequantising them."""
    dense = layer()
    sel, params = calibrated(dense)
    sparse = layer(SparseMLA(sel, params, budget=32, implementation=kernel_impl))
    x = inputs(2, 24, seed=3)
    want, _ = _decode(dense, x, 18, jnp.float8_e4m3fn)
    got, cache = _decode(sparse, x, 18, jnp.float8_e4m3fn)
    assert cache.core_state is not None
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_sparse_decode_step_differentiates_like_the_reference():
    """The gradient of a SparseMLA decode step with respect to the layer's weights: the
    Pallas path (selection ids, the indexed MLA kernel with its reference's derivative)
    gives the reference path's."""
    sel, params = calibrated(layer())
    x = inputs(2, 20, seed=9)

    def gradient(implementation):
        mla = layer(SparseMLA(sel, params, budget=6, implementation=implementation))
        _, cache = mla(x[:, :19], mla.init_cache(2, 32))
        return weight_gradient(mla, lambda m: m(x[:, 19:], cache)[0])

    assert_kernels_differentiate_like_the_reference(gradient)


def test_under_jit_rows_out_of_position_order_answer_nan():
    """As SparseAttention's: a hole in a sequence's rows raises when the positions are
    concrete; under jit that sequence's output is NaN and the other's finite."""
    core = SparseMLA("oracle", {}, budget=4)
    rng = np.random.default_rng(8)
    rows = jnp.asarray(rng.standard_normal((2, 12, 20)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 20)), jnp.float32)
    slots = np.arange(12)
    in_order, holed = np.where(slots < 9, slots, -1), np.where(slots != 3, slots, -1)
    k_pos = jnp.asarray(np.stack([in_order, np.minimum(in_order, holed)]), jnp.int32)
    q_pos = jnp.asarray([[8], [8]], jnp.int32)

    def step(q, q_pos, k_pos):
        return core(q, rows[: q.shape[0]], q_positions=q_pos, k_positions=k_pos, scale=0.2,
                    latent_dim=16)  # fmt: skip

    got = np.asarray(jax.jit(step)(q, q_pos, k_pos))
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
    with pytest.raises(ValueError, match="k_positions: sequence 1's visible slots are not"):
        step(q, q_pos, k_pos)
