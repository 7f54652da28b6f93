"""Unit tests of each bound of the certificate (MATH.md §1.3-§1.7) and of the planner."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.certified import VARIANTS, make_plan, planner
from jsparse.ops.indexer.api import default_seed_ids
from tests.certified.dosa_cases import CONFIGS, Config, make_inputs

RNG = np.random.default_rng(0)


def relu(x):
    return np.maximum(x, 0.0)


def test_projection_bound():
    # [q_h·k]_+ ≤ β [q_a·k]_+ + ‖q_h − β q_a‖ ‖k‖ with the optimal β ≥ 0 (§1.4).
    for _ in range(200):
        d = RNG.integers(2, 20)
        qh, qa, k = RNG.standard_normal((3, d))
        qa *= RNG.choice([0.0, 1.0, 5.0])
        beta = max(0.0, qh @ qa / (qa @ qa)) if qa @ qa > 0 else 0.0
        lhs = relu(qh @ k)
        rhs = beta * relu(qa @ k) + np.linalg.norm(qh - beta * qa) * np.linalg.norm(k)
        assert lhs <= rhs + 1e-12


def test_negative_aggregate_bound():
    # [Σ_A |w_h| q_h · k]_+ ≤ Σ_A |w_h| [q_h·k]_+ (§1.5), for any A.
    for _ in range(200):
        n, d = RNG.integers(1, 8), RNG.integers(2, 16)
        q, k, w = RNG.standard_normal((n, d)), RNG.standard_normal(d), RNG.random(n)
        assert relu((w[:, None] * q).sum(0) @ k) <= (w * relu(q @ k)).sum() + 1e-12


def test_joint_allowance_bound():
    # Σ_P [u_h·k]_+ ≤ max_T ‖Σ_T u_h‖ ‖k‖ ≤ Σ_P ‖u_h‖ ‖k‖ (§1.4, joint form).
    for _ in range(100):
        n, d = RNG.integers(1, 6), RNG.integers(2, 10)
        u, k = RNG.standard_normal((n, d)), RNG.standard_normal(d)
        joint = max(
            np.linalg.norm(u[list(s)].sum(0))
            for m in range(1, n + 1)
            for s in itertools.combinations(range(n), m)
        )
        kn = np.linalg.norm(k)
        assert relu(u @ k).sum() <= joint * kn + 1e-12
        assert joint <= np.linalg.norm(u, axis=1).sum() + 1e-12


def _exact_allowance(q, w_pos, anchor, beta, omitted):
    """E_P of one query in float64: Σ_g min(Σ_g w‖d‖, max_T ‖Σ_T w d‖), d = q_h − β q_a."""
    heads = np.flatnonzero(omitted)
    u = w_pos[heads, None] * (q[heads] - beta[heads, None] * q[anchor[heads]])
    total = 0.0
    for g0 in range(0, len(heads), planner.JOINT_GROUP):
        ug = u[g0 : g0 + planner.JOINT_GROUP]
        tri = np.linalg.norm(ug, axis=1).sum()
        joint = max(
            np.linalg.norm(ug[list(c)].sum(0))
            for m in range(1, len(ug) + 1)
            for c in itertools.combinations(range(len(ug)), m)
        )
        total += min(tri, joint)
    return total


@pytest.mark.parametrize("case", ["random", "near_anchor", "tiny"])
def test_positive_allowance_encloses_the_exact_allowance(case):
    # E_P from the queries' f32 Gram matrix must be ≥ its float64 value and close to it.
    # near_anchor: each omitted head is its anchor times β plus a 1e-4 residual, so the
    # Gram entries cancel to ~1e-8 of their size: the slack keeps E_P above the exact
    # value, and the group falls back to the triangle form. tiny: queries times 2^-80 and
    # weights times 2^80, so u is as before but the Gram entries underflow to 0; the
    # norms' underflow floor keeps E_P above the exact value (the triangle form again).
    t, h, d = 3, 20, 32
    rng = np.random.default_rng(7)
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    w = rng.standard_normal((t, h)).astype(np.float32)
    omitted = (w > 0) & (np.arange(h)[None, :] >= 4)
    anchor = np.tile(np.arange(h) % 4, (t, 1)).astype(np.int32)
    beta = np.where(omitted, rng.uniform(0.2, 2.0, (t, h)), 0.0).astype(np.float32)
    if case == "near_anchor":
        resid = 1e-4 * rng.standard_normal((t, h, d))
        q_an = np.take_along_axis(q, anchor[:, :, None], axis=1)
        q = np.where(omitted[:, :, None], beta[:, :, None] * q_an + resid, q).astype(np.float32)
    elif case == "tiny":
        q, w = q * np.float32(2.0**-80), w * np.float32(2.0**80)
    q32 = jnp.asarray(q)
    gram = jnp.einsum("thd,tjd->thj", q32, q32, precision="highest")
    qn_up = planner._norm_up(q32)
    w_pos = np.where(omitted, w, 0.0).astype(np.float32)
    q64 = q.astype(np.float64)
    d_exact = q64 - beta[:, :, None] * np.take_along_axis(q64, anchor[:, :, None], axis=1)
    dn_up = jnp.asarray(np.linalg.norm(d_exact, axis=2) * (1 + 1e-6), jnp.float32)
    reach = qn_up + jnp.asarray(beta) * jnp.take_along_axis(qn_up, jnp.asarray(anchor), axis=1)
    e_pos = planner._positive_allowance(
        jnp.asarray(w_pos), dn_up, gram, reach, jnp.asarray(anchor), jnp.asarray(beta),
        jnp.asarray(omitted), d,
    )  # fmt: skip
    for i in range(t):
        wi = w_pos[i].astype(np.float64)
        want = _exact_allowance(q64[i], wi, anchor[i], beta[i], omitted[i])
        got = float(e_pos[i])
        assert want <= got, (i, want, got)
        if case == "random":
            assert got <= want * (1 + 1e-3), (i, want, got)
        else:  # the Gram's slack exceeds ‖Σ u‖²: the triangle form, never worse
            triangle = (wi * np.linalg.norm(d_exact[i], axis=1)).sum()
            assert got <= triangle * (1 + 1e-3), (i, got, triangle)


def _plan(inputs, top_k, variant="dosa", r="auto"):
    q, w, k, scale, start, end, _ = inputs
    seeds = default_seed_ids(start, end, top_k, num_keys=k.shape[0])
    plan = make_plan(
        q, w, k, scale, start, end, seeds, top_k, variant=variant, r=r, policy="always"
    )
    return plan


@pytest.mark.parametrize("variant", VARIANTS)
def test_plan_bound_in_exact_arithmetic(variant):
    # U = Σ ω [q̃·k]_+ − [(hi+lo)·k]_+ + E_P ‖k‖ ≥ s, in float64 from the plan's parts
    # (f32 inputs: the rows are the heads themselves), with the guard left out.
    cfg = CONFIGS[0]
    inputs = make_inputs(cfg, 3)
    q, w, k, _, _, _, _ = inputs
    plan = _plan(inputs, cfg.top_k, variant, r=2)
    q64, w64, k64 = (np.asarray(x, np.float64) for x in (q, w, k))
    s = np.einsum("th,ths->ts", w64, relu(np.einsum("thd,sd->ths", q64, k64)))
    rows = np.asarray(plan.rows, np.float64)
    x = np.einsum("twd,sd->tws", rows, k64)
    omega = np.asarray(plan.row_weights, np.float64)
    u = (omega[:, :, None] * relu(x)).sum(1) - relu(x[:, 0] + x[:, 1])
    u += np.asarray(plan.e_pos, np.float64)[:, None] * np.linalg.norm(k64, axis=1)[None]
    scale = (np.abs(w64) * np.linalg.norm(q64, axis=2)).sum(1)[:, None] * np.linalg.norm(k64, 1)
    assert np.all(u >= s - 1e-5 * scale)
    # The guard is what makes it hold for the computed scores; it is small for f32.
    b = (np.abs(w64) * np.linalg.norm(q64, axis=2)).sum(1)
    assert np.all(np.asarray(plan.guard) < 1e-4 * b)
    if variant == "no_neg":
        assert not np.asarray(plan.neg_set).any()
        np.testing.assert_array_equal(np.asarray(plan.rows[:, :2], np.float32), 0.0)


def test_plan_rows_hold_the_rounding_they_claim():
    # bf16 screening rows from f32 queries: the retained rows are the heads rounded to
    # bf16, and hi + lo carries v_A to ~16 bits. The guard's error terms assume exactly
    # this; XLA on a GPU drops a f32 → bf16 → f32 rounding inside one program unless it
    # is kept (jsparse._rounding), which made lo = 0 and the bound miss keys at τ.
    cfg = Config(5, 8, 16, 96, 6, "float32", "bfloat16")
    inputs = make_inputs(cfg, 1)
    q, w, *_ = inputs
    plan = _plan(inputs, cfg.top_k, "neg_all", r=2)
    rows = np.asarray(plan.rows.astype(jnp.float32), np.float64)
    heads = np.asarray(plan.heads)
    q_bf = np.asarray(q.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    for t in range(cfg.t):
        for j in range(planner.AUX_ROWS, rows.shape[1]):
            if heads[t, j] >= 0:
                np.testing.assert_array_equal(rows[t, j], q_bf[t, heads[t, j]])
    a_w = np.where(np.asarray(plan.neg_set), np.abs(np.asarray(w, np.float64)), 0.0)
    v = np.einsum("th,thd->td", a_w, np.asarray(q, np.float64))
    assert np.abs(v).max() > 0, "the case must have a negative aggregate"
    err = np.abs(rows[:, 0] + rows[:, 1] - v)
    assert np.all(err <= 2.0**-15 * np.abs(v).max(axis=1, keepdims=True))


def test_retained_heads_rule():
    # §1.3: |H+| ≤ r → all positives, then negatives by |w|‖q‖min(p, 1-p);
    # |H+| > r → the r strongest positives by w‖q‖.
    cfg = CONFIGS[0]  # H = 6
    q, w, k, scale, start, end, seeds = make_inputs(cfg, 4)
    signs = np.array([1, -1, 1, -1, -1, -1], np.float32)  # two positive heads
    w_few = jnp.abs(w) * signs
    plan = _plan((q, w_few, k, scale, start, end, seeds), cfg.top_k, r=3)
    heads = np.asarray(plan.heads)[:, 2:5]
    qn = np.linalg.norm(np.asarray(q, np.float64), axis=2)
    p = np.asarray(plan.p_active)
    for t in range(cfg.t):
        assert {0, 2} <= set(heads[t].tolist())
        neg = [1, 3, 4, 5]
        prio = [abs(float(w_few[t, h])) * qn[t, h] * min(p[t, h], 1 - p[t, h]) for h in neg]
        assert neg[int(np.argmax(prio))] in heads[t]
    w_many = jnp.abs(w)  # all positive
    plan = _plan((q, w_many, k, scale, start, end, seeds), cfg.top_k, r=3)
    for t in range(cfg.t):
        strength = np.asarray(w_many[t]) * qn[t]
        assert set(np.asarray(plan.heads)[t, 2:5].tolist()) == set(np.argsort(-strength)[:3])
        assert np.asarray(plan.omitted_pos)[t].sum() == 3
    # Every omitted positive head contributes to E_P (no projection can reach zero here).
    assert np.all(np.asarray(plan.e_pos) > 0)


def test_negative_set_per_variant():
    cfg = CONFIGS[0]
    q, w, k, scale, start, end, seeds = make_inputs(cfg, 6)
    w = -jnp.abs(w)  # all negative: every omitted head is a candidate for A
    sets = {}
    for variant in ("dosa", "neg_all", "no_neg"):
        plan = _plan((q, w, k, scale, start, end, seeds), cfg.top_k, variant, r=1)
        sets[variant] = np.asarray(plan.neg_set)
        omitted = np.ones((cfg.t, cfg.h), bool)
        omitted[np.arange(cfg.t)[:, None], np.asarray(plan.heads)[:, 2:3]] = False
    np.testing.assert_array_equal(sets["neg_all"], omitted)
    np.testing.assert_array_equal(sets["dosa"], omitted & (np.asarray(plan.p_active) >= 0.5))
    assert not sets["no_neg"].any()


def test_numerics_model():
    f32 = planner.numerics_for("triton", jnp.float32, jnp.float32, 128)
    bf = planner.numerics_for("triton", jnp.bfloat16, jnp.float8_e4m3fn, 128)
    f16 = planner.numerics_for("triton", jnp.float8_e4m3fn, jnp.float8_e4m3fn, 128)
    fp8 = planner.numerics_for("triton", jnp.float8_e4m3fn, jnp.float8_e4m3fn, 128, fp8_dot=True)
    assert f32.screen_dtype == "float32" and bf.screen_dtype == "bfloat16"
    # FP8 × FP8 widens to f16 by default: exact products, f32 accumulation.
    assert f32.scorer_rel < 1e-4 and bf.scorer_rel < 1e-4 and f16.scorer_rel < 1e-4
    assert fp8.scorer_rel >= 2.0**-7  # FP8 tensor-core accumulation keeps ~14 bits


def test_key_norms_round_up_and_flag_bad_keys():
    k = jnp.asarray(RNG.standard_normal((64, 16)), jnp.float32)
    k = k.at[3, 0].set(jnp.nan).at[5, 1].set(jnp.inf)
    scale = jnp.ones((64,), jnp.float32).at[7].set(0.0)
    norm, kmax, smax = planner.key_norms(k, scale)
    exact = np.linalg.norm(np.asarray(k, np.float64), axis=1)
    norm = np.asarray(norm)
    ok = np.ones(64, bool)
    ok[[3, 5, 7]] = False
    assert np.all(norm[ok] >= exact[ok]) and np.all(np.isinf(norm[~ok]))
    assert float(kmax) >= exact[ok].max() and float(smax) == 1.0


def test_one_certificate_laid_out_for_the_widest_width_serves_every_query():
    # With r given, the plan computes one certificate at Wmax and screens each query at
    # its own width: its rows, weights and allowances must be those of a certificate
    # computed at that width alone, and its guard at least as large (the epilogue and
    # rounding allowances for Wmax rows cover fewer) and of the same size.
    cfg = Config(6, 20, 16, 96, 6, "bfloat16", "float8_e4m3fn", scaled=True)
    inputs = make_inputs(cfg, 2)
    r_mixed = np.asarray([2, 14, 6, 18, 1, 9], np.int32)
    mixed = _plan(inputs, cfg.top_k, r=r_mixed)
    assert sorted(set(np.asarray(mixed.width).tolist())) == [8, 16, 32]
    for t, r in enumerate(r_mixed):
        alone = _plan(inputs, cfg.top_k, r=int(r))
        wt = int(mixed.width[t])
        assert int(alone.width[t]) == wt
        for name in ("rows", "row_weights", "heads"):
            got = np.asarray(getattr(mixed, name)[t, :wt].astype(jnp.float32))
            want = np.asarray(getattr(alone, name)[t, :wt].astype(jnp.float32))
            np.testing.assert_array_equal(got, want, err_msg=f"{name} of query {t}")
        np.testing.assert_array_equal(np.asarray(mixed.rows[t, wt:], np.float32), 0.0)
        for name in ("e_pos", "r", "est_survival"):
            np.testing.assert_array_equal(getattr(mixed, name)[t], getattr(alone, name)[t])
        g_mixed, g_alone = float(mixed.guard[t]), float(alone.guard[t])
        assert g_alone <= g_mixed <= 1.5 * g_alone


def test_survival_estimate_counts_the_recent_window_as_kept():
    # The sample leaves out the seeds' recent window (it would bias p_h); the estimate
    # adds it back as kept: est = f + (1 − f)·sampled, f = recent / visible.
    cfg = CONFIGS[0]
    q, w, k, scale, start, end, _ = make_inputs(cfg, 4)
    seeds = default_seed_ids(start, end, cfg.top_k, num_keys=k.shape[0])
    plan = _plan((q, w, k, scale, start, end, None), cfg.top_k)
    knorm, kmax, smax = planner.key_norms(k, scale)
    cols = planner.sample_seed_columns(seeds.shape[1], seeds.shape[1] // 2)
    num = planner.numerics_for("reference", q.dtype, k.dtype, q.shape[2])
    r = jnp.full((q.shape[0],), 2, jnp.int32)

    def est(recent):
        return planner.plan_from_threshold(
            q, w, k, scale, start, end, plan.tau_code, seeds[:, cols], r, knorm, kmax,
            smax, planner.variant_flags("dosa"), top_k=cfg.top_k, group=1, widths=(8,),
            numerics=num, policy="always", recent_keys=recent,
        ).est_survival  # fmt: skip

    sampled, with_recent = np.asarray(est(0)), np.asarray(est(24))
    vis = np.asarray(end - start, np.float32)
    f = np.minimum(24, vis) / np.maximum(vis, 1)
    np.testing.assert_allclose(with_recent, f + (1 - f) * sampled, rtol=1e-6)
    assert np.all(with_recent >= sampled)
