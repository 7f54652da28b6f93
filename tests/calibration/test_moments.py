"""Streaming second moments against numpy."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.calibration import (
    compute_moments,
    finalize_moments,
    group_mean_queries,
    init_moments,
    normalize_trace,
    update_moments,
)
from jsparse.calibration.stream import moments_from_captures


def _numpy_moments(q, k, n_kv):
    n, h, d = q.shape
    qm = q.reshape(n, n_kv, h // n_kv, d).mean(axis=2).astype(np.float64)
    k = k.astype(np.float64)
    return (
        np.einsum("nhd,nhe->hde", qm, qm) / n,
        np.einsum("nhd,nhe->hde", k, k) / n,
        qm.mean(axis=0),
        k.mean(axis=0),
    )


@pytest.mark.parametrize("chunks", [1, 3], ids=["one-shot", "three-chunks"])
def test_streaming_matches_numpy(chunks):
    rng = np.random.default_rng(0)
    n, h, hkv, d = 301, 6, 2, 16
    q = rng.standard_normal((n, h, d)).astype(np.float32)
    k = (rng.standard_normal((n, hkv, d)) + 2.0).astype(np.float32)
    state = init_moments(hkv, d)
    for part in np.array_split(np.arange(n), chunks):
        state = update_moments(state, q[part], k[part])
    m = finalize_moments(state)
    gq, gk, mq, mk = _numpy_moments(q, k, hkv)
    np.testing.assert_allclose(m.gram_q, gq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.gram_k, gk, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.mean_q, mq, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.mean_k, mk, rtol=1e-5, atol=1e-6)
    assert float(m.n_tokens) == n
    np.testing.assert_allclose(m.cov_k, gk - mk[:, :, None] * mk[:, None, :], atol=1e-4)


def test_mask_and_layer_axis():
    rng = np.random.default_rng(1)
    n_layers, n, h, hkv, d = 2, 40, 4, 2, 8
    q = rng.standard_normal((n_layers, n, h, d)).astype(np.float32)
    k = rng.standard_normal((n_layers, n, hkv, d)).astype(np.float32)
    mask = np.zeros((n_layers, n), bool)
    mask[:, :25] = True  # a padded chunk: only the first 25 tokens are real
    m = finalize_moments(update_moments(init_moments(hkv, d, (n_layers,)), q, k, mask))
    for layer in range(n_layers):
        gq, gk, _, _ = _numpy_moments(q[layer, :25], k[layer, :25], hkv)
        np.testing.assert_allclose(m.gram_q[layer], gq, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.layer(layer).gram_k, gk, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(m.n_tokens, [25, 25])
    # masked-out padding holding NaN or inf adds nothing (a multiply by 0 once made NaN)
    for bad in (np.nan, np.inf):
        q2, k2 = q.copy(), k.copy()
        q2[:, 30], k2[:, 31] = bad, bad
        m2 = finalize_moments(update_moments(init_moments(hkv, d, (n_layers,)), q2, k2, mask))
        np.testing.assert_array_equal(np.asarray(m2.gram_k), np.asarray(m.gram_k))
        np.testing.assert_array_equal(np.asarray(m2.gram_q), np.asarray(m.gram_q))
    # the mask selects tokens; any other dtype would weight them
    for weights in (mask.astype(np.int32) * 3, mask.astype(np.float32)):
        with pytest.raises(ValueError, match=f"mask: dtype {weights.dtype}; expected bool"):
            update_moments(init_moments(hkv, d, (n_layers,)), q, k, weights)


def test_group_mean_and_trace():
    q = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    qm = group_mean_queries(q, 2)  # heads 0-2 -> KV head 0, heads 3-5 -> KV head 1
    np.testing.assert_allclose(qm[:, 0], q[:, 0:3].mean(axis=1))
    np.testing.assert_allclose(qm[:, 1], q[:, 3:6].mean(axis=1))
    g = compute_moments(q, np.ones((2, 2, 4), np.float32)).gram_q
    np.testing.assert_allclose(
        np.trace(normalize_trace(g), axis1=-2, axis2=-1), [1.0, 1.0], rtol=1e-6
    )
    np.testing.assert_array_equal(normalize_trace(np.zeros((3, 3), np.float32)), 0.0)


def test_trace_of_a_numpy_f64_gram_without_a_warning():
    # jax's f32, as for any NumPy f64 input; no "float64 truncated" warning on the way
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = normalize_trace(2.0 * np.eye(3))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np.eye(3) / 3, rtol=1e-6)


def test_bad_inputs():
    state = init_moments(2, 8)
    with pytest.raises(ValueError, match="KV heads"):
        update_moments(state, np.zeros((5, 4, 8)), np.zeros((5, 3, 8)))
    with pytest.raises(ValueError, match="head_dim"):
        update_moments(state, np.zeros((5, 4, 8)), np.zeros((5, 2, 7)))
    with pytest.raises(ValueError, match="tokens"):
        update_moments(state, np.zeros((4, 4, 8)), np.zeros((5, 2, 8)))
    with pytest.raises(ValueError, match="multiple"):
        update_moments(state, np.zeros((5, 3, 8)), np.zeros((5, 2, 8)))
    with pytest.raises(ValueError, match="no calibration token"):
        finalize_moments(init_moments(2, 8))


def test_jit_update_inside_scan():
    """The state is a pytree: updates compose under jit/scan."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 10, 4, 8)).astype(np.float32)
    k = rng.standard_normal((4, 10, 2, 8)).astype(np.float32)

    @jax.jit
    def run(q, k):
        def body(state, chunk):
            return update_moments(state, *chunk), None

        state, _ = jax.lax.scan(body, init_moments(2, 8), (q, k))
        return finalize_moments(state)

    m = run(q, k)
    ref = compute_moments(q.reshape(40, 4, 8), k.reshape(40, 2, 8))
    np.testing.assert_allclose(m.gram_k, ref.gram_k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "who, change",
    [
        ("queries", lambda q, k: (q.at[3, 5, 2].set(np.nan), k)),  # layer-free; KV head 1
        ("keys", lambda q, k: (q, k.at[7, 1, 0].set(np.inf))),
        ("queries", lambda q, k: (q.at[:, 4:].multiply(1e20), k)),  # squares overflow
    ],
    ids=["nan-query", "inf-key", "overflowing-squares"],
)
def test_non_finite_moments_are_refused(who, change):
    """eigh of a NaN matrix can return finite numbers: a basis calibrated on them
    would look fine and select at random, so finalize_moments refuses them."""
    rng = np.random.default_rng(4)
    q = jax.numpy.asarray(rng.standard_normal((20, 8, 6)), np.float32)
    k = jax.numpy.asarray(rng.standard_normal((20, 2, 6)), np.float32)
    with pytest.raises(ValueError, match=rf"the {who}' moments at .* = \[1\] are not finite"):
        compute_moments(*change(q, k))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: init_moments(1, 4.5), r"head_dim: expected an int >= 1, got 4\.5"),
        (lambda: init_moments(2, 8, (-1,)), "batch_shape: expected an int >= 0, got -1"),
        (lambda: group_mean_queries(np.zeros((3, 4, 8)), 0), "n_kv_heads: expected an int >= 1"),
        (lambda: moments_from_captures(["unread"], chunk=0), "chunk: expected an int >= 1"),
    ],
    ids=["float-dim", "negative-batch", "zero-kv-heads", "zero-chunk"],
)  # fmt: skip
def test_counts_are_refused_by_name(call, message):
    """Each once raised TypeError or ZeroDivisionError from inside jax or Python."""
    with pytest.raises(ValueError, match=message):
        call()


def test_a_layer_a_capture_lacks_is_refused_before_reading(tmp_path, monkeypatch):
    """A capture that stopped after some layers (meta ``layers``) failed at the first
    missing layer file, after the earlier layers had been read; the error now names the
    capture and its layers before any file is read."""
    import json

    from jsparse.calibration import stream
    from jsparse.eval.synthetic import write_synthetic_capture

    write_synthetic_capture(tmp_path / "a", jax.random.PRNGKey(0), 32, n_layers=3)
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    (tmp_path / "a" / "meta.json").write_text(json.dumps({**meta, "layers": [0, 1]}))

    def no_read(*args, **kwargs):
        raise AssertionError("read a layer before refusing")

    monkeypatch.setattr(stream, "read_layer", no_read)
    for layers in (None, [2]):
        with pytest.raises(ValueError, match=r"not hold layers \[2\] \(it has \[0, 1\] of 3\)"):
            moments_from_captures([tmp_path / "a"], layers=layers, progress=False)


@pytest.mark.parametrize("size", [1e30, 1e38, 3e38], ids=["1e30", "1e38", "3e38"])
def test_unit_trace_holds_up_to_float32s_largest(size):
    """Past a trace of ~8.5e37 every entry came out 0 (XLA divides by the reciprocal,
    which flushes), and a trace past float32's largest overflowed."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 4, 4))
    g64 = a @ np.swapaxes(a, -1, -2)
    g64 *= size / np.max(np.diagonal(g64, axis1=-2, axis2=-1))
    want = g64 / np.trace(g64, axis1=-2, axis2=-1)[:, None, None]
    for fn in (normalize_trace, jax.jit(normalize_trace)):
        np.testing.assert_allclose(fn(g64.astype(np.float32)), want, rtol=1e-5, atol=1e-7)
