"""jssa_rd: exact-objective maps and the rate-distortion (FP8 + int4) cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.calibration import compute_moments
from jsparse.eval.synthetic import synthetic_qkv
from jsparse.selectors import make_selector
from jsparse.selectors.jssa_rd import JSSARDSelector, component_weights, plan_bit_allocation

H, HKV, D = 6, 2, 16


def _data():
    q, k, _ = synthetic_qkv(jax.random.key(0), 512, n_heads=H, n_kv_heads=HKV, head_dim=D, latent=6)
    qe, ke, _ = synthetic_qkv(
        jax.random.key(0), 90, n_heads=H, n_kv_heads=HKV, head_dim=D, latent=6, start=900
    )
    return q, k, qe[-3:], jnp.broadcast_to(ke[None], (3, *ke.shape))


def test_plan_by_hand():
    # eps4 = (4/7)^2/12 ≈ 0.0272: int4 on components 0, 1, 2 (gains .876, .049, .029) beats
    # upgrading component 0 to FP8 (.023), which beats int4 on component 3 (.0195).
    assert plan_bit_allocation([0.9, 0.05, 0.03, 0.02], 2.0, kappa=4.0) == (1, 2)
    assert plan_bit_allocation([0.25] * 4, 2.0) == (0, 4)  # flat spectrum: rank first
    assert plan_bit_allocation([1.0, 0, 0, 0], 2.0) == (1, 0)  # nothing else to gain


def test_options_and_bytes():
    sel = make_selector()  # the default selector
    assert sel.name == "jssa_rd"
    assert (sel.fp8_dims, sel.int4_dims, sel.rank) == (3, 26, 29)
    assert sel.bytes_per_token(64) == 16
    with pytest.raises(ValueError, match="rank"):
        make_selector("jssa_rd", fp8_dims=2, int4_dims=2, rank=16)
    with pytest.raises(ValueError, match="maps_kind"):
        make_selector("jssa_rd", maps_kind="other")


def test_cache_round_trip_and_projected_select():
    q, k, qe, kb = _data()
    sel = make_selector("jssa_rd", fp8_dims=2, int4_dims=6)
    params = sel.calibrate(q, k)
    cache = sel.project_keys(params, kb)
    assert cache.high.dtype == jnp.float8_e4m3fn and cache.low.dtype == jnp.int4
    assert cache.high.shape == (3, 90, HKV, 2) and cache.low.shape == (3, 90, HKV, 6)
    exact = np.einsum("bshd,hrd->bshr", np.asarray(kb, np.float64), params["key_map"])
    approx = sel.dequantize(params, cache)
    centred = exact - params["key_offset"]
    hi_tol = 2.0**-4 * jnp.abs(centred[..., :2]).max(axis=(1, 3))[:, None, :, None] + 1e-6
    assert (jnp.abs(approx - exact)[..., :2] <= hi_tol).all()
    lo_tol = 0.5 * cache.low_scale[:, None] * (1 + 1e-5)
    assert (jnp.abs(approx - exact)[..., 2:] <= lo_tol).all()
    lengths = jnp.array([90, 50, 7])
    np.testing.assert_array_equal(
        sel.select_projected(params, qe, cache, lengths, 16),
        sel.select(params, qe, kb, lengths, 16),
    )


def test_exact_maps_match_kq_svd_and_planning():
    q, k, _, _ = _data()
    m = compute_moments(q, k)
    rd = make_selector("jssa_rd", fp8_dims=4, int4_dims=0).calibrate_from_moments(m)
    kq = make_selector("kq_svd", rank=4).calibrate_from_moments(m)
    np.testing.assert_allclose(rd["query_map"], kq["query_map"], atol=1e-6)
    shared = make_selector("jssa_rd", fp8_dims=4, int4_dims=0, maps_kind="shared")
    basis = make_selector("jssa", rank=4).calibrate_from_moments(m)["basis"]
    np.testing.assert_allclose(shared.calibrate_from_moments(m)["query_map"], basis, atol=1e-6)
    w = component_weights(rd["query_map"], rd["key_map"], m)
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-6)
    planned = JSSARDSelector.planned(m, 4.0)
    assert planned.bytes_per_token(D) <= 4.0 and planned.rank >= 4
