"""Every selector behind the one interface: contract, maths, bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.calibration import compute_moments
from jsparse.eval.synthetic import synthetic_qkv
from jsparse.selectors import SELECTORS, make_selector
from jsparse.selectors.quest import page_bounds, page_metadata

H, HKV, D = 6, 2, 16
RANKED = ("jssa", "loki", "fasa", "kq_svd", "head_shared")
ALL = sorted(SELECTORS)


def _config(name, rank=4):
    if name == "jssa_rd":
        return {"fp8_dims": 1, "int4_dims": rank - 1}
    if name == "jssa_mla":  # MLA: one KV head, a 12-dim latent and 4 RoPE dims
        return {"rank": rank, "latent_dim": 12}
    return {"rank": rank} if name in RANKED else {}


@functools.cache
def _data(s=70, b=3, hkv=HKV):
    q, k, _ = synthetic_qkv(jax.random.key(0), 512, n_heads=H, n_kv_heads=hkv, head_dim=D, latent=6)
    qe, ke, _ = synthetic_qkv(
        jax.random.key(0), s + b, n_heads=H, n_kv_heads=hkv, head_dim=D, latent=6, start=900
    )
    kb = jnp.stack([ke[i : i + s] for i in range(b)])  # [B, S, Hkv, D]
    return q, k, qe[s : s + b], kb


def _data_for(name):
    return _data(hkv=1) if name == "jssa_mla" else _data()


def _calibrated(name, **extra):
    q, k, _, _ = _data_for(name)
    config = _config(name, extra.pop("rank", 4))
    sel = make_selector(name, **{**config, **extra})
    return sel, sel.calibrate(q, k)


def test_registry():
    assert set(SELECTORS) >= {
        "jssa",
        "loki",
        "fasa",
        "kq_svd",
        "quest",
        "oracle",
        "head_shared",
        "full",
    }
    with pytest.raises(ValueError, match="name: unknown selector"):
        make_selector("nope")
    with pytest.raises(ValueError, match="unknown option"):
        make_selector("jssa", rnk=4)
    with pytest.raises(ValueError, match="cache_dtype"):
        make_selector("loki", cache_dtype="int4")
    with pytest.raises(ValueError, match="even"):
        make_selector("fasa", rank=5)


@pytest.mark.parametrize("name", ALL)
def test_contract(name):
    """Shape, dtype, distinct visible ids, -1 padding last, budget >= length gives all."""
    sel, params = _calibrated(name)
    _, _, q, k = _data_for(name)
    hkv = k.shape[2]
    lengths = jnp.array([70, 33, 5], jnp.int32)
    for budget in (8, 40, 80):
        idx = np.asarray(sel.select(params, q, k, lengths, budget))
        width = k.shape[1] if name == "full" else budget
        assert idx.shape == (3, hkv, width) and idx.dtype == np.int32
        for b, length in enumerate(np.asarray(lengths)):
            for h in range(hkv):
                row = idx[b, h]
                valid = row[row >= 0]
                assert len(set(valid.tolist())) == len(valid)
                assert (valid < length).all()
                n = min(length, width)
                assert (row[:n] >= 0).all() and (row[n:] == -1).all()
                if budget >= length:
                    assert sorted(valid.tolist()) == list(range(length))


def test_head_shared_same_set_for_every_kv_head():
    sel, params = _calibrated("head_shared")
    _, _, q, k = _data()
    idx = np.asarray(sel.select(params, q, k, jnp.array([70, 60, 50]), 16))
    np.testing.assert_array_equal(idx[:, 0], idx[:, 1])
    full = make_selector("head_shared", basis="full")
    idx = np.asarray(full.select({}, q, k, jnp.array([70, 60, 50]), 16))
    np.testing.assert_array_equal(idx[:, 0], idx[:, 1])


def test_jit_and_vmap():
    sel, params = _calibrated("jssa")
    _, _, q, k = _data()
    lengths = jnp.array([70, 50, 20], jnp.int32)
    eager = sel.select(params, q, k, lengths, 12)
    jitted = jax.jit(sel.select, static_argnames="budget")(params, q, k, lengths, budget=12)
    np.testing.assert_array_equal(eager, jitted)
    per = jax.vmap(lambda qq, kk, ll: sel.select(params, qq[None], kk[None], ll[None], 12)[0])
    np.testing.assert_array_equal(per(q, k, lengths), eager)


def test_ties_are_deterministic_lowest_position_first():
    sel = make_selector("oracle")
    q = jnp.ones((1, 2, 4))
    k = jnp.ones((1, 10, 1, 4))  # every score equal
    idx = sel.select({}, q, k, jnp.array([10]), 4)
    np.testing.assert_array_equal(idx[0, 0], [0, 1, 2, 3])


def test_streaming_calibration_equals_one_shot():
    q, k, _, _ = _data()
    sel = make_selector("jssa", rank=4)
    state = sel.calibration_state(HKV, D)
    for part in np.array_split(np.arange(q.shape[0]), 4):
        state = sel.update(state, q[part], k[part])
    np.testing.assert_allclose(
        sel.finalize(state)["basis"], sel.calibrate(q, k)["basis"], atol=2e-5
    )


def test_kq_svd_full_rank_reproduces_scores():
    q, k, qe, kb = _data()
    sel = make_selector("kq_svd", rank=D, cache_dtype="float32")
    params = sel.calibrate(q, k)
    a, b = params["query_map"], params["key_map"]
    np.testing.assert_allclose(
        np.einsum("hrd,hre->hde", a, b), np.broadcast_to(np.eye(D), (HKV, D, D)), atol=1e-4
    )
    lengths = jnp.full((kb.shape[0],), kb.shape[1])
    got = sel.scores(params, qe, kb, lengths)
    exact = make_selector("oracle").scores({}, qe, kb, lengths)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5 * float(jnp.abs(exact).max()))


@pytest.mark.parametrize("name", ["jssa", "loki", "kq_svd", "fasa"])
def test_full_rank_f32_matches_oracle(name):
    sel, params = _calibrated(name, rank=D, cache_dtype="float32")
    _, _, q, k = _data()
    lengths = jnp.array([70, 70, 70])
    got = np.asarray(sel.select(params, q, k, lengths, 20))
    ref = np.asarray(make_selector("oracle").select({}, q, k, lengths, 20))
    overlap = np.mean(
        [len(set(got[b, h]) & set(ref[b, h])) / 20 for b in range(3) for h in range(2)]
    )
    assert overlap >= 0.95


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_quest_page_bound_is_an_upper_bound(dtype):
    rng = np.random.default_rng(0)
    b, s, page = 2, 53, 8
    k = jnp.asarray(rng.standard_normal((b, s, HKV, D)) * 3.0, jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, HKV, D)), jnp.float32)
    lengths = jnp.array([53, 30])
    lo, hi = page_metadata(k, lengths, page, dtype)
    bounds = np.asarray(page_bounds(q, lo, hi))  # [B, Hkv, P]
    scores = np.einsum("bhd,bshd->bhs", q, k)
    for bi, length in enumerate(np.asarray(lengths)):
        for t in range(length):
            assert (bounds[bi, :, t // page] >= scores[bi, :, t] - 1e-4).all()
        assert np.isneginf(bounds[bi, :, -(-length // page) :]).all()  # no visible token
    if dtype == "float32":  # tight: some key reaches each channel's extreme
        exact = np.asarray(lo)[0, 0], np.asarray(hi)[0, 0]
        np.testing.assert_allclose(exact[0], np.asarray(k)[0, :page].min(axis=0))
        np.testing.assert_allclose(exact[1], np.asarray(k)[0, :page].max(axis=0))


def test_quest_selects_whole_pages_in_bound_order():
    sel = make_selector("quest", page_size=4, cache_dtype="float32")
    _, _, q, k = _data()
    idx = np.asarray(sel.select({}, q, k, jnp.array([70, 70, 70]), 12))
    for row in idx.reshape(-1, 12):
        pages = row.reshape(3, 4) // 4
        assert (pages == pages[:, :1]).all()  # each block of 4 is one page, in order
        np.testing.assert_array_equal(row.reshape(3, 4) % 4, np.tile(np.arange(4), (3, 1)))


def test_fasa_keeps_whole_rope_pairs():
    _sel, params = _calibrated("fasa", rank=6)
    ch = np.asarray(params["channels"])
    assert ch.shape == (HKV, 6)
    for row in ch:
        for c in row:
            assert (c + D // 2 if c < D // 2 else c - D // 2) in row
    sel2 = make_selector("fasa", rank=6, rope_layout="interleaved")
    ch2 = np.asarray(sel2.calibrate(*_data()[:2])["channels"])
    for row in ch2:
        assert all((c ^ 1) in row for c in row)


def test_fasa_picks_dominant_pairs():
    q, k, _, _ = _data()
    m = compute_moments(q, k)
    sel = make_selector("fasa", rank=4)
    contrib = np.asarray(sel.pair_contribution(m))
    chosen = np.asarray(sel.calibrate_from_moments(m)["channels"])
    for h in range(HKV):
        top = set(np.argsort(-contrib[h])[:2].tolist())
        assert top | {p + D // 2 for p in top} == set(chosen[h].tolist())


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16", "float32"])
def test_projected_cache_dtype_and_bytes(dtype):
    sel, params = _calibrated("jssa", cache_dtype=dtype)
    _, _, q, k = _data()
    cache = sel.project_keys(params, k)
    assert cache.values.shape == (3, 70, HKV, 4) and cache.values.dtype == jnp.dtype(dtype)
    exact = np.einsum("bshd,hrd->bshr", np.asarray(k, np.float64), params["basis"])
    approx = cache.values.astype(jnp.float32) * cache.scale[:, None, :, None]
    tol = {"float8_e4m3fn": 0.07, "bfloat16": 0.01, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(approx, exact, atol=tol * float(jnp.abs(exact).max()))
    assert sel.bytes_per_token(D) == 4 * {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4}[dtype]
    lengths = jnp.array([70, 70, 70])
    np.testing.assert_array_equal(
        sel.select_projected(params, q, cache, lengths, 9), sel.select(params, q, k, lengths, 9)
    )


@pytest.mark.parametrize(
    "name, extra", [("jssa", {"cache_dtype": "float8_e4m3fn"}), ("jssa_rd", {})]
)
def test_an_infinite_key_leaves_the_other_keys_cache_as_it_was(name, extra):
    """The FP8 and int4 scales come from the finite amax: one inf key saturates (or
    stores NaN) where it was an inf scale that stored every other key of its head as 0."""
    sel, params = _calibrated(name, **extra)
    _, _, _, k = _data()
    bad = k.at[0, 5, 0, 0].set(jnp.inf)
    got = jax.tree.leaves(sel.project_keys(params, bad))
    want = jax.tree.leaves(sel.project_keys(params, jnp.delete(k, 5, axis=1)))
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if g.ndim == 4:  # [B, S, Hkv, R] values: the other keys
            g = np.delete(g, 5, axis=1)
        np.testing.assert_array_equal(g, w)


def test_psd_sqrt_of_a_non_finite_matrix_is_nan():
    """kq_svd's G^{1/2} and G^{-1/2} from eigh: NaN for a non-finite matrix (eigh may
    return finite vectors for it), the exact roots for its finite batch neighbour."""
    from jsparse.selectors.kq_svd import psd_sqrt

    gram = np.stack([np.diag([4.0, 1, 9]), np.diag([4.0, 1, 9])]).astype(np.float32)
    gram[0, 2, 2] = np.nan  # on the diagonal: eigh returns finite vectors
    root, inv_root = psd_sqrt(jnp.asarray(gram), 1e-6)
    assert np.isnan(root[0]).all() and np.isnan(inv_root[0]).all()
    np.testing.assert_allclose(root[1], np.diag([2.0, 1, 3]), atol=1e-6)
    np.testing.assert_allclose(inv_root[1], np.diag([0.5, 1, 1 / 3]), atol=1e-6)


def test_equal_memory_bookkeeping():
    assert make_selector("jssa", rank=16).bytes_per_token(64) == 16
    assert make_selector("quest", page_size=16, cache_dtype="bfloat16").bytes_per_token(64) == 16
    assert make_selector("quest", page_size=32, cache_dtype="bfloat16").bytes_per_token(64) == 8
    assert make_selector("fasa", rank=8).bytes_per_token(64) == 8


def test_bad_select_inputs():
    sel, params = _calibrated("jssa")
    _, _, q, k = _data()
    ok = jnp.array([70, 70, 70])
    with pytest.raises(ValueError, match="rank 3"):
        sel.select(params, q[0], k, ok, 4)
    with pytest.raises(ValueError, match="lengths"):
        sel.select(params, q, k, jnp.array([71, 1, 1]), 4)
    with pytest.raises(ValueError, match="budget"):
        sel.select(params, q, k, ok, 0)
    for budget in (True, 2**31):  # a bool is not a count; ids are int32
        with pytest.raises(ValueError, match=r"budget: expected a static int in \[1, 2\^31 - 1\]"):
            sel.select(params, q, k, ok, budget)
    with pytest.raises(ValueError, match="q: dtype complex64; expected a floating-point array"):
        sel.select(params, q.astype(jnp.complex64), k, ok, 4)
    with pytest.raises(ValueError, match="k: dtype int32; expected a floating-point array"):
        sel.select(params, q, k.astype(jnp.int32), ok, 4)
    with pytest.raises(ValueError, match="q: got a list; expected an array"):
        sel.select(params, q.tolist(), k, ok, 4)
    with pytest.raises(ValueError, match="k: dtype int32; expected a floating-point array"):
        sel.calibrate(q, k[0, :3].astype(jnp.int32))
    with pytest.raises(ValueError, match="multiple"):
        sel.select(params, q[:, :5], k, ok, 4)
    with pytest.raises(ValueError, match="head_dim"):
        sel.select(params, q[..., :8], k[..., :8], ok, 4)
    with pytest.raises(ValueError, match="integer"):
        sel.select(params, q, k, ok.astype(jnp.float32), 4)


def test_quest_metadata_matches_masked_brute_force():
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((4, 37, HKV, D)), jnp.float32)
    lengths = jnp.array([37, 16, 9, 0])
    lo, hi = page_metadata(k, lengths, 8)
    kn = np.asarray(k)
    for b, n in enumerate(np.asarray(lengths)):
        for p in range(5):
            toks = kn[b, p * 8 : min((p + 1) * 8, n)]
            if len(toks) == 0:
                assert np.isposinf(lo[b, p]).all() and np.isneginf(hi[b, p]).all()
            else:
                np.testing.assert_array_equal(lo[b, p], toks.min(axis=0))
                np.testing.assert_array_equal(hi[b, p], toks.max(axis=0))


@pytest.mark.parametrize(
    "name, cache_dtype",
    [("jssa", "float8_e4m3fn"), ("jssa", "bfloat16"), ("jssa_rd", "mixed"),
     ("jssa_mla", "float8_e4m3fn")],
)  # fmt: skip
def test_appended_keys_equal_projecting_with_the_kept_scales(name, cache_dtype):
    """A decode cache (prefill of 50 keys, then 12 appended one at a time) equals the
    projection of all 62 keys quantised with the prefill's scales; an out-of-range slot
    writes nothing."""
    extra = {} if name == "jssa_rd" else {"cache_dtype": cache_dtype}
    sel, params = _calibrated(name, **extra)
    _, _, _, k = _data_for(name)  # [3, 70, Hkv, D]
    prefill = sel.project_keys(params, k[:, :50], headroom=2.0)
    # the prefill's values in the first 50 of 70 slots, its scales ([B, S, Hkv, R] = values)
    cache = jax.tree.map(
        lambda e, p: e.at[:, :50].set(p) if e.ndim == 4 else p,
        sel.empty_cache(params, 3, 70),
        prefill,
    )
    for t in range(50, 62):
        cache = sel.append_keys(params, cache, k[:, t], jnp.full((3,), t, jnp.int32))
    if name == "jssa_rd":
        want = sel._quantize(sel._centred(params, k[:, :62]), prefill.high_scale, prefill.low_scale)
        pairs = [(cache.high, want.high), (cache.low, want.low)]
    else:
        from jsparse.selectors.base import quantize_with_scale

        want = quantize_with_scale(sel._project(params, k[:, :62]), prefill.scale, cache_dtype)
        pairs = [(cache.values, want)]
    for got, exp in pairs:
        np.testing.assert_array_equal(
            np.asarray(got[:, :62], np.float32), np.asarray(exp, np.float32)
        )
        assert not np.asarray(got[:, 62:], np.float32).any()  # untouched
    before = jax.tree.leaves(cache)
    after = sel.append_keys(params, cache, k[:, 0], jnp.asarray([-1, 70, 99], jnp.int32))
    for a, b in zip(before, jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for bad in (0.5, float("inf"), float("nan"), True):  # inf once meant no headroom
        with pytest.raises(ValueError, match=r"headroom: got .*; expected a finite number >= 1"):
            sel.project_keys(params, k, headroom=bad)


def test_fp8_scale_of_a_huge_amax_times_headroom_does_not_overflow():
    """amax · headroom beyond float32's range once made the scale 1, so every key past
    448 saturated; it now stops at float32's largest over 448."""
    from jsparse.selectors.base import fp8_scale, quantize_with_scale

    proj = jnp.asarray([3e38, -1e38, 1.0, 0.0], jnp.float32).reshape(1, 4, 1, 1)
    scale = fp8_scale(proj, headroom=2.0)
    f32max = float(jnp.finfo(jnp.float32).max)
    np.testing.assert_allclose(float(scale[0, 0]), f32max / 448, rtol=1e-6)
    stored = np.asarray(quantize_with_scale(proj, scale, "float8_e4m3fn"), np.float32)
    dequantised = stored.ravel() * float(scale[0, 0])
    np.testing.assert_allclose(dequantised[:2], [3e38, -1e38], rtol=2**-3)  # E4M3's step
    assert np.isfinite(dequantised).all()


@pytest.mark.parametrize("name", ["jssa", "head_shared"])
def test_select_without_params_is_refused_by_name(name):
    _, _, q, k = _data()
    with pytest.raises(ValueError, match=f"params: the {name} selector needs its calibrated"):
        make_selector(name, rank=4).select({}, q, k, jnp.full((3,), 70), 4)


def test_full_lists_every_cached_token_for_an_empty_batch_too():
    _, _, q, k = _data()
    for batch in (0, 2):
        ids = make_selector("full").select({}, q[:batch], k[:batch], jnp.full((batch,), 9), 3)
        assert ids.shape == (batch, HKV, k.shape[1])


def test_head_shared_selects_the_same_from_its_projected_cache():
    sel, params = _calibrated("head_shared")
    _, _, q, k = _data()
    lengths = jnp.asarray([70, 41, 9], jnp.int32)
    np.testing.assert_array_equal(
        sel.select_projected(params, q, sel.project_keys(params, k), lengths, 7),
        sel.select(params, q, k, lengths, 7),
    )
    with pytest.raises(NotImplementedError, match="keeps no projected cache"):
        make_selector("head_shared", basis="full").select_projected({}, q, None, lengths, 7)


def test_which_selectors_take_the_fused_decode_step():
    """``projected_step`` is the step of selectors that only calibrate other maps; those
    that store or score their own way keep their methods."""
    plain = lambda name, **kw: make_selector(name, **kw)._plain_projections()  # noqa: E731
    for name in ("jssa", "loki", "kq_svd", "fasa"):
        assert plain(name, rank=4), name
    assert plain("jssa_mla", rank=4, latent_dim=8)
    assert not plain("jssa_rd", fp8_dims=2, int4_dims=4)
    assert not plain("head_shared", rank=4)


def test_the_fused_step_is_taken_where_it_measured_faster(monkeypatch):
    """Run 191: GQA steps gain at every batch, one sequence included; MLA's one KV head
    of 128 × 576 query values loses 4-10 µs at every batch, and 16 heads × 576 loses 7."""
    from jsparse.selectors import base

    pays = base.fused_step_pays
    assert pays((32, 32, 128), 8) and pays((8, 32, 128), 8) and pays((1, 32, 128), 8)
    assert not pays((32, 128, 576), 1) and not pays((1, 128, 576), 1)
    assert not pays((32, 16, 576), 1)
    monkeypatch.setattr(base, "FUSED_STEP", True)
    assert pays((1, 128, 576), 1)
    monkeypatch.setattr(base, "FUSED_STEP", False)
    assert not pays((32, 32, 128), 8)


@pytest.mark.parametrize("name", ["jssa", "jssa_rd"])
def test_the_decode_path_refuses_mismatched_inputs_by_name(name):
    """append_keys / select_projected / decode_step check what select checks, against the
    cache: a batch-1 key into a batch-2 cache once wrote sequence 0's key into sequence
    1's slot too (broadcast), and other mismatches failed deep inside jax."""
    sel, params = _calibrated(name)
    _, _, q, k = _data_for(name)  # q [B, H, D], k [B, S, Hkv, D]
    b, s = k.shape[:2]
    cache = sel.empty_cache(params, b, s)
    slots = jnp.zeros((b,), jnp.int32)
    lengths = jnp.full((b,), 5, jnp.int32)
    with pytest.raises(ValueError, match=r"k_new: shape \(1, "):
        sel.append_keys(params, cache, k[:1, 0], slots[:1])
    with pytest.raises(ValueError, match="slots: axis 0"):
        sel.append_keys(params, cache, k[:, 0], slots[:1])
    with pytest.raises(ValueError, match=r"q: axis 0 .* expected 3 \(sequences B of the cache"):
        sel.select_projected(params, q[:1], cache, lengths, 4)
    with pytest.raises(ValueError, match="lengths: expected rank 1"):
        sel.select_projected(params, q, cache, lengths[:, None], 4)
    with pytest.raises(ValueError, match="budget: expected a static int"):
        sel.decode_step(params, q, cache, k[:, 0], slots, lengths, 0)
    with pytest.raises(ValueError, match=rf"cache: got an array \({b}, {s}, 2, 4\); expected"):
        sel.select_projected(params, q, jnp.zeros((b, s, 2, 4)), lengths, 4)
    other = jax.tree.map(lambda x: x[..., :-1] if x.ndim == 4 else x, cache)
    with pytest.raises(ValueError, match="this selector's cache for these params"):
        sel.select_projected(params, q, other, lengths, 4)
    ids, _ = sel.decode_step(params, q, cache, k[:, 0], slots, lengths, 4)
    assert ids.shape == (b, k.shape[2], 4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-calls"])
def test_decode_step_takes_slots_of_any_integer_type(fused, monkeypatch):
    """append_keys takes int16 slots; the fused step once refused them (only int32
    reached projected_step), so the answer depended on which path ran."""
    from jsparse.selectors import base
    from tests.implementations import running

    monkeypatch.setattr(base, "FUSED_STEP", fused)
    sel, params = _calibrated("jssa")
    _, _, q, k = _data()
    b, s = k.shape[:2]
    prompt = jax.tree.map(
        lambda e, p: e.at[:, :20].set(p) if e.ndim == 4 else p,
        sel.empty_cache(params, b, s),
        sel.project_keys(params, k[:, :20], headroom=2.0),
    )
    lengths = jnp.full((b,), 21, jnp.int32)
    with running("triton"):
        steps = [
            sel.decode_step(params, q, prompt, k[:, 20], jnp.full((b,), 20, dtype), lengths, 6)
            for dtype in (jnp.int32, jnp.int16, jnp.uint8)
        ]
    for ids, cache in steps[1:]:
        np.testing.assert_array_equal(ids, steps[0][0])
        np.testing.assert_array_equal(
            np.asarray(cache.values, np.float32), np.asarray(steps[0][1].values, np.float32)
        )


@pytest.mark.parametrize("name", [*RANKED, "jssa_mla"])
def test_params_of_another_rank_are_refused_by_name(name):
    """A rank-2 selector given rank-4 params once scored with rank 4 while its cache
    layout and bytes_per_token said 2."""
    _, params = _calibrated(name, rank=4)
    other = make_selector(name, **_config(name, 2))
    _, _, q, k = _data_for(name)
    lengths = jnp.full((k.shape[0],), 5, jnp.int32)
    match = rf"params: maps of \[\d+\] rows for a {name} selector of rank 2"
    with pytest.raises(ValueError, match=match):
        other.select(params, q, k, lengths, 4)
    with pytest.raises(ValueError, match=match):
        other.project_keys(params, k)
    with pytest.raises(ValueError, match=match):
        other.empty_cache(params, 1, 8)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("kq_svd", {"rank": 4, "rcond": float("nan")}, "rcond: got nan; expected a number in"),
        ("kq_svd", {"rank": 4, "rcond": 2.0}, r"rcond: got 2.0"),  # zeroed every map
        ("jssa_rd", {"rcond": -1.0}, r"rcond: got -1.0"),
        ("jssa_rd", {"fp8_dims": 2.5}, "fp8_dims must be an int, got 2.5"),
        ("jssa", {"rank": True}, "rank: expected an int >= 1, got True"),
    ],
)  # fmt: skip
def test_bad_selector_options_are_refused_by_name(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_selector(name, **options)


def test_a_numpy_int_rank_is_an_int():
    assert make_selector("jssa", rank=np.int64(8)).rank == 8


@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_quest_ranks_a_page_holding_a_non_finite_key_first_not_as_empty(bad, dtype):
    """A +inf or NaN key scores first for every other selector (NaN ranks above +inf);
    QUEST once took the page's non-finite bound for an empty page's and ranked it last."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(np.abs(rng.standard_normal((1, 2, 8))), jnp.float32)
    k = rng.standard_normal((1, 32, 1, 8)).astype(np.float32)
    k[0, 3, 0, 0] = bad
    lengths = jnp.array([32], jnp.int32)
    sel = make_selector("quest", page_size=16, cache_dtype=dtype)
    ids = np.asarray(sel.select({}, q, jnp.asarray(k), lengths, 4)).ravel()
    np.testing.assert_array_equal(ids, [0, 1, 2, 3])  # page 0, tokens in position order
    assert (
        np.asarray(make_selector("oracle").select({}, q, jnp.asarray(k), lengths, 1))[0, 0, 0] == 3
    )
