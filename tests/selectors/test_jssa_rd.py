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


def _centred_shares(maps, m):
    """``[Hkv, R]`` ``E[(A q̄)_r²] · Var[(B k)_r]`` of ``maps`` (A, B) [Hkv, R, D], unnormalised
    (numpy float64 oracle)."""
    a, b = (np.asarray(x, np.float64) for x in maps)
    gq, ck = np.asarray(m.gram_q, np.float64), np.asarray(m.cov_k, np.float64)
    return np.einsum("hrd,hde,hre->hr", a, gq, a) * np.einsum("hrd,hde,hre->hr", b, ck, b)


def _by_share(maps, m):
    """``maps`` [Hkv, R, D] reordered largest centred share first."""
    order = np.argsort(-_centred_shares(maps, m), axis=-1, kind="stable")
    return [np.take_along_axis(np.asarray(x, np.float64), order[..., None], axis=-2) for x in maps]


def test_exact_maps_are_kq_svds_largest_centred_shares():
    q, k, _, _ = _data()
    m = compute_moments(q, k)
    rd = make_selector("jssa_rd", fp8_dims=4, int4_dims=0).calibrate_from_moments(m)
    kq = make_selector("kq_svd", rank=D).calibrate_from_moments(m)
    want = _by_share((kq["query_map"], kq["key_map"]), m)
    for got, full in zip((rd["query_map"], rd["key_map"]), want, strict=True):
        np.testing.assert_allclose(got, full[:, :4], atol=1e-5)
    shared = make_selector("jssa_rd", fp8_dims=4, int4_dims=0, maps_kind="shared")
    basis = make_selector("jssa", rank=D).calibrate_from_moments(m)["basis"]
    np.testing.assert_allclose(
        shared.calibrate_from_moments(m)["query_map"],
        _by_share((basis, basis), m)[0][:, :4],
        atol=1e-5,
    )
    w = component_weights(rd["query_map"], rd["key_map"], m)
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-6)
    assert (np.diff(w, axis=-1) <= 1e-7).all()
    planned = JSSARDSelector.planned(m, 4.0)
    assert planned.bytes_per_token(D) <= 4.0 and planned.rank >= 4


def _plan_oracle(w, budget, kappa=4.0):
    """Every (fp8, int4) within ``budget``, each (row of ``w``)'s components given their
    format one by one as the selector stores them; the least mean distortion wins."""
    w = np.asarray(w, np.float64).reshape(-1, np.shape(w)[-1])
    eps4, eps8 = (kappa / 7) ** 2 / 12, (2.0**-4) ** 2 / 3
    best = None
    for fp8 in range(w.shape[1] + 1):
        for int4 in range(w.shape[1] + 1 - fp8):
            if fp8 + int4 == 0 or fp8 + int4 / 2 > budget:
                continue
            cost = 0.0
            for row in w:
                kept = sorted(row[: fp8 + int4], reverse=True)
                noise = [eps8] * fp8 + [eps4] * int4
                cost += sum(x * e for x, e in zip(kept, noise, strict=True))
                cost += row[fp8 + int4 :].sum()
            key = (round(cost / len(w), 12), fp8 + int4 / 2, fp8 + int4)
            best = min(best or (key, fp8, int4), (key, fp8, int4))
    return best[1], best[2]


def test_plan_is_the_least_distortion_within_the_budget():
    rng = np.random.default_rng(0)
    for trial in range(12):
        w = rng.dirichlet(np.full(7, 0.4), size=3)  # 3 heads, unsorted shares
        if trial % 3 == 0:
            w = np.sort(w, axis=-1)[:, ::-1]
        for budget in (0.5, 1.0, 1.49, 2.45, 4.0, 7.0):
            fp8, int4 = plan_bit_allocation(w, budget)
            assert fp8 + int4 / 2 <= budget
            assert (fp8, int4) == _plan_oracle(w, budget), (trial, budget)


def test_planned_spends_bits_on_the_keys_spread_not_their_mean():
    # A large constant offset on one direction of the keys (as real keys have) leads the
    # fit's raw-moment order but carries no centred variance: it must not get the bits.
    rng = np.random.default_rng(0)
    n = 4000
    q = rng.standard_normal((n, 2, 8)) * np.linspace(2, 0.5, 8)
    k = rng.standard_normal((n, 1, 8)) * np.array([0.05, 1.5, 1.2, 1.0, 0.8, 0.6, 0.4, 0.2])
    k[..., 0] += 10.0
    m = compute_moments(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32))
    kq = make_selector("kq_svd", rank=8).calibrate_from_moments(m)
    shares = np.sort(component_weights(kq["query_map"], kq["key_map"], m)[0])[::-1]
    for budget, least in ((1.0, 0.75), (3.0, 0.98)):
        sel = JSSARDSelector.planned(m, budget)
        assert sel.bytes_per_token(8) <= budget
        params = sel.calibrate_from_moments(m)
        kept = _by_share((params["query_map"], params["key_map"]), m)
        np.testing.assert_allclose(params["key_map"], kept[1], atol=1e-6)  # largest first
        # the kept components are the best sel.rank of the full fit, by centred share
        total = _centred_shares((kq["query_map"], kq["key_map"]), m).sum()
        got = _centred_shares((params["query_map"], params["key_map"]), m).sum()
        np.testing.assert_allclose(got / total, shares[: sel.rank].sum(), rtol=1e-4)
        assert got / total >= least


@pytest.mark.parametrize(
    ("weights", "budget", "kappa", "match"),
    [
        ([0.5, 0.5], 0.25, 4.0, "bytes_per_token"),
        ([0.5, 0.5], float("nan"), 4.0, "bytes_per_token"),
        ([0.5, 0.5], float("inf"), 4.0, "bytes_per_token"),
        ([0.5, 0.5], "16", 4.0, "bytes_per_token"),
        ([float("nan"), 0.5], 1.0, 4.0, "weights"),
        ([-0.1, 0.5], 1.0, 4.0, "weights"),
        ([], 1.0, 4.0, "weights"),
        ([0.5, 0.5], 1.0, 0.0, "kappa"),
    ],
)
def test_plan_refuses_bad_arguments(weights, budget, kappa, match):
    with pytest.raises(ValueError, match=match):
        plan_bit_allocation(weights, budget, kappa=kappa)


def test_other_selectors_params_are_named():
    q, k, qe, kb = _data()
    kq = make_selector("kq_svd", rank=4).calibrate(q, k)
    with pytest.raises(ValueError, match=r"params.*key_offset"):
        make_selector("jssa_rd", fp8_dims=2, int4_dims=2).select(kq, qe, kb, jnp.array([90] * 3), 8)


def test_a_decode_from_an_empty_cache_uses_calibrated_int4_scales():
    """A one-token prompt starts decoding from ``empty_cache``: int4 scale 1 stored most
    of a small component as 0 for the whole decode. The scales are now 4 calibrated
    standard deviations over 7, and the decode selects like a prefilled cache."""
    q, k, qe, kb = _data()
    k, kb = 0.25 * k, 0.25 * kb  # components of spread < 1 (scale 1: 58% stored, 0.88 overlap)
    sel = make_selector("jssa_rd", fp8_dims=2, int4_dims=6)
    params = sel.calibrate(q, k)
    b = np.asarray(params["key_map"], np.float64)
    cov = np.asarray(compute_moments(q, k).cov_k, np.float64)
    spread = np.sqrt(np.einsum("hrd,hde,hre->hr", b, cov, b))
    np.testing.assert_allclose(params["key_spread"], spread, rtol=1e-4)
    cache = sel.empty_cache(params, 3, 90)
    np.testing.assert_allclose(cache.low_scale[0], 4 * spread[:, 2:] / 7, rtol=1e-4)
    for t in range(90):
        cache = sel.append_keys(params, cache, kb[:, t], jnp.full((3,), t))
    prefilled = sel.project_keys(params, kb)
    stored = [int((np.asarray(c.low, np.int32) != 0).sum()) for c in (cache, prefilled)]
    assert stored[0] >= 0.9 * stored[1], stored
    lengths = jnp.array([90, 50, 7])
    got, want = (
        np.asarray(sel.select_projected(params, qe, c, lengths, 16)) for c in (cache, prefilled)
    )
    overlap = np.mean([len(set(a.ravel()) & set(w.ravel())) / len(set(w.ravel()))
                       for a, w in zip(got, want, strict=True)])  # fmt: skip
    assert overlap >= 0.95, overlap
    # bases saved before key_spread keep the old scale 1
    old = {name: v for name, v in params.items() if name != "key_spread"}
    np.testing.assert_array_equal(sel.empty_cache(old, 1, 4).low_scale, 1.0)
