"""Exactness of the certified methods (reference implementation) against ``base``.

Property tests over shapes, dtypes, ranges, seeds, methods, variants and r, with random
and adversarial data; an instrumented check that no rejected key reaches τ (and that the
bound dominates the computed score); a planted survivor overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jsparse
from jsparse.certified import VARIANTS, dosa_topk, planner
from jsparse.certified import reference as cref
from jsparse.ops.indexer import reference as scorer
from jsparse.ops.topk.codes import score_code
from tests.certified.dosa_cases import (
    ADVERSARIAL,
    CONFIGS,
    METHODS,
    PROPERTY_SETTINGS,
    R_CHOICES,
    Config,
    make_inputs,
    times_pow2,
)


def _run(cfg, inputs, method="dosa", variant="dosa", r="auto", **options):
    q, w, k, scale, start, end, seeds = inputs
    base = jsparse.indexer_topk(
        q, w, k, cfg.top_k, k_scale=scale, kv_start=start, kv_end=end, implementation="reference"
    )
    res, info = dosa_topk(
        q, w, k, cfg.top_k, k_scale=scale, kv_start=start, kv_end=end, seeds=seeds,
        method=method, variant=variant, r=r, policy="always", implementation="reference",
        return_info=True, **options,
    )  # fmt: skip
    return base, res, info


@jax.jit
def _certificate_violations(plan, q, w, k, scale, start, end):
    ids = scorer.visible_key_ids(start, end, k.shape[0])
    knorm, _, _ = planner.key_norms(k, scale)
    safe = jnp.where(ids >= 0, ids, 0)
    bounds = cref.screen_bounds(plan, k, scale, knorm, ids)
    scores = scorer.score_keys_reference(q, w, k, ids, scale)
    visible = ids >= 0
    rejected = cref.rejected_mask(plan, bounds, knorm[safe]) & visible
    reaches = score_code(scores) >= plan.tau_code[:, None]
    used = visible & plan.prune[:, None] & jnp.isfinite(knorm[safe])
    below = used & ~(scores <= bounds) & ~jnp.isnan(scores) & ~jnp.isnan(bounds)
    return jnp.sum(rejected & reaches), jnp.sum(below)


def _check_certificate(inputs, info):
    """No rejected key has s_ref ≥ τ; and s_ref ≤ U^num wherever the bound is used."""
    q, w, k, scale, start, end, _ = inputs
    lost, below = _certificate_violations(info.plan, q, w, k, scale, start, end)
    assert int(lost) == 0, f"{int(lost)} rejected keys score ≥ τ"
    assert int(below) == 0, f"the bound is below the computed score for {int(below)} keys"


def _check_equal(base, res):
    np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(base.indices))
    b, r = np.asarray(base.scores), np.asarray(res.scores)
    np.testing.assert_array_equal(np.isnan(b), np.isnan(r))
    np.testing.assert_array_equal(b[~np.isnan(b)], r[~np.isnan(r)])


@settings(**PROPERTY_SETTINGS)
@given(
    cfg=st.sampled_from(CONFIGS),
    seed=st.integers(0, 2**31 - 1),
    adversarial=st.sampled_from(ADVERSARIAL),
    method=st.sampled_from(METHODS),
    variant=st.sampled_from(VARIANTS),
    r=st.sampled_from(R_CHOICES),
)
def test_certified_equals_base(cfg, seed, adversarial, method, variant, r):
    inputs = make_inputs(cfg, seed, adversarial)
    base, res, info = _run(cfg, inputs, method, variant, r)
    _check_equal(base, res)
    _check_certificate(inputs, info)
    assert np.all(np.asarray(res.survivors) <= np.asarray(res.visible))
    assert np.all(np.asarray(res.fallback) == ~np.asarray(info.screened))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("adversarial", ADVERSARIAL)
def test_every_adversarial_case_and_variant(adversarial, variant):
    # Every adversarial family under every variant at least once (one compile).
    cfg = CONFIGS[0]
    inputs = make_inputs(cfg, 1234, adversarial)
    base, res, info = _run(cfg, inputs, variant=variant)
    _check_equal(base, res)
    _check_certificate(inputs, info)


def test_screening_prunes_structured_data():
    # Not a correctness property: a check that the certificate is not vacuous.
    cfg = CONFIGS[0]
    _, res, info = _run(cfg, make_inputs(cfg, 7))
    screened = np.asarray(info.screened)
    assert screened.any()
    surv = np.asarray(res.survivors)[screened] / np.asarray(res.visible)[screened]
    assert surv.mean() < 0.9


def test_planted_survivor_overflow_falls_back_exactly():
    cfg = CONFIGS[0]
    base, res, info = _run(cfg, make_inputs(cfg, 99), survivor_capacity=cfg.top_k - 1)
    _check_equal(base, res)
    overflow = np.asarray(info.survivor_overflow)
    # At least K keys survive (every key ≥ τ does), so K - 1 slots always overflow.
    np.testing.assert_array_equal(overflow, np.asarray(info.plan.prune))
    assert overflow.any()
    assert np.all(np.asarray(res.fallback)[overflow])
    np.testing.assert_array_equal(
        np.asarray(res.survivors)[overflow], np.asarray(res.visible)[overflow]
    )


def test_nonfinite_query_disables_pruning():
    cfg = CONFIGS[0]
    q, w, k, scale, start, end, seeds = make_inputs(cfg, 5)
    q = q.at[2, 0, 0].set(jnp.nan)
    base, res, info = _run(cfg, (q, w, k, scale, start, end, seeds))
    _check_equal(base, res)
    assert not bool(info.plan.prune[2])
    assert int(info.plan.reason[2]) & planner.REASON_NONFINITE
    assert bool(res.fallback[2])


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=lambda c: c.id)
@pytest.mark.parametrize("kind", ["tiny_queries", "tiny_keys", "mixed_heads", "tiny_weights"])
def test_extreme_magnitudes_stay_exact(cfg, kind):
    # Queries or keys below 2^-63 have squares that underflow f32: every norm, Gram entry
    # and folded weight of the plan must still enclose (they once came out 0, and the
    # bound fell below the score: keys lost for 34 of 120 such inputs).
    q, w, k, scale, start, end, seeds = make_inputs(cfg, 3)
    h = q.shape[1]
    if kind == "tiny_queries":
        q = times_pow2(q, np.float32(-75))
    elif kind == "tiny_keys":
        k = times_pow2(k, np.float32(-70))
    elif kind == "mixed_heads":  # each head's share of the score kept comparable
        e_h = -np.arange(h, dtype=np.float32) * (90 / max(h - 1, 1)) - (90 if h == 1 else 0)
        q = times_pow2(q, e_h[None, :, None])
        w = times_pow2(w, -e_h[None, :])
    else:
        w = times_pow2(w, np.float32(-110))
    inputs = (q, w, k, scale, start, end, seeds)
    base, res, info = _run(cfg, inputs)
    _check_equal(base, res)
    _check_certificate(inputs, info)
    assert np.asarray(info.plan.prune).all()  # screened, not waved through unscreened


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(survivor_capacity=-1), "survivor_capacity: expected a positive Python int"),
        (dict(survivor_capacity=2.5), "survivor_capacity: expected a positive Python int"),
        (dict(list_capacity=0), "list_capacity: expected a positive Python int"),
        (dict(splits=True), "splits: expected a positive Python int"),
        (dict(refine_block=3), "refine_block: expected a power of two, got 3"),
        (dict(capacity=4), r"capacity: not an option of the certified methods; expected one of"),
        # an option of the Triton kernels, on the reference: named, not a TypeError
        (dict(list_capacity=8), r"list_capacity: an option of implementation 'triton'"),
    ],
)
def test_bad_implementation_options_name_the_option(options, message):
    q, w, k, _, start, end, _ = make_inputs(CONFIGS[0], 0)
    with pytest.raises(ValueError, match=message):
        dosa_topk(q, w, k, 4, kv_start=start, kv_end=end, implementation="reference", **options)


def _seed_trap():
    """Two queries over keys [0, 32) of 64; keys 40+ score ten times higher."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    w = jnp.asarray(np.abs(rng.standard_normal((2, 4))), jnp.float32)
    k = rng.standard_normal((64, 16)).astype(np.float32)
    k[40:] *= 10
    return q, w, jnp.asarray(k), jnp.full((2,), 32, jnp.int32)


@pytest.mark.parametrize("bad", ["repeated", "invisible"])
@pytest.mark.parametrize(
    ("impl", "method"),
    [("reference", "dosa"), ("reference", "dense"), ("reference", "full"), ("triton", "dosa")],
)
def test_traced_seeds_that_repeat_or_are_not_visible_keep_the_answer_exact(impl, method, bad):
    """Explicit seeds are checked only when concrete. Under jit the reference once took
    τ from the best key listed K times (or from keys past the range) and returned one id
    and three -1 per row, without a fallback."""
    q, w, k, end = _seed_trap()
    top_k = 4
    want = jsparse.indexer_topk(q, w, k, top_k, kv_end=end, implementation="reference")
    if bad == "repeated":
        seeds = jnp.repeat(want.indices[:, :1], top_k, axis=1)
    else:
        seeds = jnp.tile(jnp.arange(40, 40 + top_k, dtype=jnp.int32), (2, 1))
    with pytest.raises(ValueError, match="seeds: "):  # concrete: refused by name
        jsparse.indexer_topk(q, w, k, top_k, kv_end=end, seeds=seeds, method=method)

    @jax.jit
    def select(seeds):
        if method == "full":
            return jsparse.indexer_topk(
                q, w, k, top_k, kv_end=end, seeds=seeds, method="full", implementation=impl
            )
        return dosa_topk(
            q, w, k, top_k, kv_end=end, seeds=seeds, method=method, policy="always",
            implementation=impl,
        )  # fmt: skip

    with jsparse.backend.interpret_mode(impl == "triton" and not jsparse.backend.has_nvidia_gpu()):
        got = select(seeds)
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
    np.testing.assert_allclose(np.asarray(got.scores), np.asarray(want.scores), rtol=1e-6)


def test_usable_seed_ids_drop_repeats_and_invisible_ids_in_place():
    from jsparse.ops.indexer.methods import usable_seed_ids

    seeds = jnp.array([[5, 3, 5, -1, 3, 9], [0, 0, 0, 2, 7, 1]], jnp.int32)
    got = usable_seed_ids(seeds, jnp.array([3, 0]), jnp.array([9, 7]))
    np.testing.assert_array_equal(got, [[5, 3, -1, -1, -1, -1], [0, -1, -1, 2, -1, 1]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(seeds=np.full((2, 4), -5, np.int32)), r"seeds\[0, 0\] = -5; expected key ids or -1"),
     (dict(return_info=1), "return_info: expected True or False, got 1"),
     (dict(screen_cfg=5, implementation="triton"), "screen_cfg: expected a .*ScreenConfig"),
     (dict(screen_cfg={"block_s": 16}, implementation="triton"), "screen_cfg: expected")],
)  # fmt: skip
def test_bad_seeds_and_flags_name_the_argument(kwargs, message):
    q, w, k, end = _seed_trap()
    kwargs.setdefault("implementation", "reference")
    with pytest.raises(ValueError, match=message):
        dosa_topk(q, w, k, 4, kv_end=end, **kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_allowance_covers_flushed_gram_entries(seed):
    # Eight parallel positive heads of components ~2^-64 (each square flushes to zero, so
    # the queries' Gram matrix comes out 0) and keys parallel to them: the bound is tight,
    # and without the Gram slack's underflow term E_P's joint form was ~64× too small
    # (keys lost on XLA's CPU, which flushes subnormals as a GPU may).
    cfg = Config(6, 8, 16, 80, 8)
    rng = np.random.default_rng(seed)
    v = rng.uniform(1.0, 1.4, cfg.d) * rng.choice([-1, 1], cfg.d)
    c = rng.uniform(0.5, 1.5, (cfg.t, cfg.h))
    q = jnp.asarray(c[:, :, None] * v[None, None, :] * 2.0**-64, jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, (cfg.t, cfg.h)) * 2.0**58, jnp.float32)
    k = jnp.asarray(rng.uniform(0.1, 2.0, (cfg.s, 1)) * v[None, :], jnp.float32)
    start, end = jnp.zeros((cfg.t,), jnp.int32), jnp.full((cfg.t,), cfg.s, jnp.int32)
    inputs = (q, w, k, None, start, end, None)
    base, res, info = _run(cfg, inputs, r=1)
    _check_equal(base, res)
    _check_certificate(inputs, info)
    assert np.asarray(info.plan.prune).all()
