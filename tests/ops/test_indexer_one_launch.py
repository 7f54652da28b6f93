"""The one-launch one-query Top-K (`jsparse/ops/indexer/one_launch.py`) against `base`
(the same scorer: ids and scores must be identical) and a float64 numpy oracle.
Interpreted, its five phases run as five launches; the GPU test runs the one launch
whose phases meet at barriers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import backend
from jsparse.ops.indexer import methods, one_launch
from jsparse.ops.topk import triton as select
from jsparse.testing import topk_mismatches
from tests.lowering import lower_for_h200

FP8 = jnp.float8_e4m3fn
H, D = 4, 16
PROGRAMS = one_launch.SAMPLE_PROGRAMS + 4  # four scoring programs: a short CPU run


def make(s, dtype, *, keys="normal", scale=False, seed=0, h=H, d=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, h, d)).astype(np.float32)
    w = rng.standard_normal((1, h)).astype(np.float32)
    k = rng.standard_normal((s, d)).astype(np.float32)
    if keys == "rounded":  # few distinct keys: scores tie in groups
        k = k[rng.integers(0, 6, s)]
        w = -np.abs(w)  # negative weights only: most scores are exactly 0
    elif keys == "equal":  # every score equal: the exact slow path
        k = np.ones_like(k)
    k_scale = jnp.asarray(rng.uniform(0.25, 4.0, s).astype(np.float32)) if scale else None
    return jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(k, dtype), k_scale


def oracle(q, w, k, k_scale, lo, hi):
    """float64 scores of the query's visible keys (-inf elsewhere)."""
    q64, w64 = np.asarray(q, np.float64)[0], np.asarray(w, np.float64)[0]
    k64 = np.asarray(k, np.float64)
    s = np.maximum(k64 @ q64.T, 0.0) @ w64
    if k_scale is not None:
        s = s * np.asarray(k_scale, np.float64)
    row = np.full(k64.shape[0], -np.inf)
    row[lo:hi] = s[lo:hi]
    return row[None]


def run_both(q, w, k, top_k, k_scale, lo, hi, programs=PROGRAMS):
    a, b = jnp.array([lo], jnp.int32), jnp.array([hi], jnp.int32)
    with backend.interpret_mode():
        got = one_launch.topk_one_launch(q, w, k, top_k, k_scale, a, b, programs=programs)
        want = methods.topk_base(q, w, k, top_k, k_scale, a, b)
    return got, want


@pytest.mark.parametrize(
    "dtype, s, lo, hi, keys, scale",
    [
        (jnp.bfloat16, 6000, 0, 6000, "normal", False),  # past the 4096-entry sample
        (FP8, 9000, 100, 8800, "normal", True),  # a range, FP8 with scales
        (jnp.float32, 9000, 0, 9000, "rounded", False),  # ties, negative weights
        (jnp.bfloat16, 5000, 0, 5000, "equal", False),  # all equal: the exact path
        (jnp.bfloat16, 700, 0, 30, "normal", False),  # fewer visible keys than K
        (jnp.bfloat16, 700, 10, 10, "normal", False),  # none visible
    ],
)
def test_matches_base_and_oracle(dtype, s, lo, hi, keys, scale):
    top_k = 64
    q, w, k, k_scale = make(s, dtype, keys=keys, scale=scale, seed=s)
    (ids, scores, count, path, sync), want = run_both(q, w, k, top_k, k_scale, lo, hi)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want.indices))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(want.scores))
    atol = 1e-2 if dtype != jnp.float32 else 1e-4
    assert not topk_mismatches(ids, scores, oracle(q, w, k, k_scale, lo, hi), top_k, atol)
    visible = hi - lo
    assert int(count[0]) >= min(top_k, visible)  # every Top-K entry was a candidate
    assert int(sync[5]) == 0  # no wait gave up
    # the path report: all-equal scores defeat the sampled θ, and the row is searched;
    # ties may take either slow path
    expected = {"normal": {select.FAST}, "equal": {select.SEARCHED}}
    assert int(path[0]) in expected.get(keys, {select.FAST, select.RETRIED, select.SEARCHED})


def test_more_programs_same_answer():
    """The split of tiles among programs does not change the answer."""
    q, w, k, _ = make(6000, jnp.bfloat16, seed=3)
    got_a, want = run_both(q, w, k, 64, None, 0, 6000, programs=PROGRAMS)
    got_b, _ = run_both(q, w, k, 64, None, 0, 6000, programs=PROGRAMS + 7)
    np.testing.assert_array_equal(np.asarray(got_a[0]), np.asarray(want.indices))
    np.testing.assert_array_equal(np.asarray(got_b[0]), np.asarray(want.indices))


@pytest.mark.parametrize(
    "dtype, keys, scale, buckets",
    [
        (jnp.bfloat16, "normal", False, 8),
        (FP8, "normal", True, 16),  # blocks of ranked slots straddle buckets
        (jnp.float32, "rounded", False, 8),  # ties inside a bucket
        (jnp.bfloat16, "equal", False, 8),  # the slow path's buffer is one group
    ],
)
def test_buckets_same_answer(monkeypatch, dtype, keys, scale, buckets):
    """Candidates grouped in code buckets and ranked within them: the same answer as
    ``base``, id for id (the grouping only restricts which pairs are compared)."""
    monkeypatch.setattr(one_launch, "BUCKETS", buckets)
    q, w, k, k_scale = make(9000, dtype, keys=keys, scale=scale, seed=7)
    (ids, scores, count, _, sync), want = run_both(q, w, k, 256, k_scale, 0, 9000)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want.indices))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(want.scores))
    assert int(count[0]) >= 256 and int(sync[5]) == 0


def test_program_count_out_of_range_is_an_error():
    q, w, k, _ = make(700, jnp.bfloat16)
    a, b = jnp.array([0], jnp.int32), jnp.array([700], jnp.int32)
    for programs in (one_launch.SAMPLE_PROGRAMS, backend.sm_count() + 1):
        with pytest.raises(ValueError, match="programs must exceed"):
            one_launch.topk_one_launch(q, w, k, 64, None, a, b, programs=programs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8])
def test_lowers_to_cuda(dtype):
    s = jax.ShapeDtypeStruct
    lower_for_h200(
        lambda q, w, k, ks, a, b: one_launch.topk_one_launch(q, w, k, 2048, ks, a, b),
        s((1, 64, 128), dtype), s((1, 64), jnp.float32), s((65536, 128), dtype),
        s((65536,), jnp.float32), s((1,), jnp.int32), s((1,), jnp.int32),
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_one_launch_matches_base_at_decode_size():
    """64K FP8 keys, K = 2048, one launch with barriers: the same ids and scores as
    `base`, no wait given up, on a random row with scales and on all-equal keys without
    (every score equal: the exact slow path, run inside the launch while the other
    programs wait; with scales the scores differ, run 141)."""
    if not backend.has_nvidia_gpu():
        pytest.skip("needs an NVIDIA GPU")
    for keys in ("normal", "equal"):
        scale = keys == "normal"
        q, w, k, k_scale = make(65536, FP8, keys=keys, scale=scale, seed=11, h=64, d=128)
        a, b = jnp.array([5], jnp.int32), jnp.array([65000], jnp.int32)
        ids, scores, _, path, sync = one_launch.topk_one_launch(q, w, k, 2048, k_scale, a, b)
        want = methods.topk_base(q, w, k, 2048, k_scale, a, b)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want.indices))
        np.testing.assert_array_equal(np.asarray(scores), np.asarray(want.scores))
        assert int(sync[5]) == 0
        assert int(path[0]) == (select.SEARCHED if keys == "equal" else select.FAST)
