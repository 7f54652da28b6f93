"""The indexer kernels at DeepSeek-V3.2 shapes on a real GPU (``pytest -m gpu``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.testing import topk_mismatches

pytestmark = pytest.mark.gpu

H, D, K = 64, 128, 2048


def inputs(t, s, dtype, causal, seed=0):
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (t, H, D)) * 8.0
    k = jax.random.normal(kk, (s, D))
    scale = jnp.max(jnp.abs(k), axis=1) / 448.0
    end = jnp.arange(s - t + 1, s + 1, dtype=jnp.int32) if causal else jnp.full((t,), s, jnp.int32)
    return dict(
        q=q.astype(dtype), weights=jax.random.normal(kw, (t, H)) / np.sqrt(H * D),
        k=(k / scale[:, None]).astype(dtype), k_scale=scale,
        kv_start=jnp.zeros((t,), jnp.int32), kv_end=end,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "t, s, causal", [(1, 65536, False), (64, 131072, False), (1024, 32768, True)],
    ids=["decode1x64K", "decode64x128K", "chunk1Kx32K"],
)  # fmt: skip
def test_base_and_full_are_exact(t, s, causal, dtype):
    x = inputs(t, s, dtype, causal)
    base = jsparse.indexer_topk(**x, top_k=K, method="base", implementation="triton")
    full = jsparse.indexer_topk(**x, top_k=K, method="full", implementation="triton")
    np.testing.assert_array_equal(np.asarray(full.indices), np.asarray(base.indices))
    np.testing.assert_array_equal(np.asarray(full.scores), np.asarray(base.scores))
    rows = np.unique(np.linspace(0, t - 1, 4).astype(int))
    sub = {n: (v[rows] if n in ("q", "weights", "kv_start", "kv_end") else v) for n, v in x.items()}
    oracle = np.asarray(jsparse.indexer_scores(**sub, implementation="reference"), np.float64)
    atol = 1e-3 * np.max(np.abs(oracle[np.isfinite(oracle)]))
    problems = topk_mismatches(
        np.asarray(base.indices)[rows], np.asarray(base.scores)[rows], oracle, K, atol
    )
    assert not problems, problems[:5]


def test_base_report_is_its_ranges():
    # decode and a chunk past one report program (1024 queries): each report field
    x = inputs(1100, 4096, jnp.bfloat16, causal=True)
    got = jsparse.indexer_topk(**x, top_k=K, method="base", implementation="triton")
    want = np.asarray(x["kv_end"] - x["kv_start"])
    for field in (got.visible, got.candidates, got.survivors):
        np.testing.assert_array_equal(np.asarray(field), want)
    assert np.isneginf(np.asarray(got.threshold)).all() and not np.asarray(got.fallback).any()


@pytest.mark.parametrize("t", [1, 8])
def test_scorer_written_report_is_the_same_result(t, monkeypatch):
    from jsparse.ops.indexer import methods

    x = inputs(t, 65536, jnp.float8_e4m3fn, causal=False)
    x["kv_end"] = x["kv_end"].at[-1].set(1500)  # one row sees fewer keys than K
    args = (x["q"], x["weights"], x["k"], K, x["k_scale"], x["kv_start"], x["kv_end"])
    results = []
    for on in (False, True):
        monkeypatch.setattr(methods, "SCORER_WRITES_REPORT", on)
        jax.clear_caches()
        results.append(jax.tree.leaves(methods.topk_base(*args)))
    for a, b in zip(*results, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scores_kernel_matches_reference():
    x = inputs(16, 8192, jnp.bfloat16, causal=True)
    got = np.asarray(jsparse.indexer_scores(**x, implementation="triton"))
    want = np.asarray(jsparse.indexer_scores(**x, implementation="reference"))
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-4 * np.abs(want[fin]).max())


def test_all_equal_scores_take_smallest_ids():
    x = inputs(4, 20000, jnp.bfloat16, causal=False)
    x["k"] = jnp.broadcast_to(x["k"][:1], x["k"].shape)
    x["k_scale"] = None
    for method in ("base", "full"):
        r = jsparse.indexer_topk(**x, top_k=K, method=method, implementation="triton")
        np.testing.assert_array_equal(np.asarray(r.indices), np.tile(np.arange(K), (4, 1)))


@pytest.mark.parametrize("t, s", [(64, 16384), (1024, 32768)])
def test_fp8_widened_in_memory_scores_like_in_registers(t, s, monkeypatch):
    # The same f16 operands reach the same dot: the scores must be equal bit for bit,
    # or methods that widen differently would stop agreeing id for id.
    from jsparse.ops.indexer import triton as scorer

    x = inputs(t, s, jnp.float8_e4m3fn, causal=True)
    args = (x["q"], x["weights"], x["k"], x["k_scale"], x["kv_start"], x["kv_end"])
    monkeypatch.setattr(scorer, "WIDEN_FP8_IN_MEMORY_FROM", None)
    in_registers = np.asarray(scorer._launch(*args, fill=True)[0])
    monkeypatch.setattr(scorer, "WIDEN_FP8_IN_MEMORY_FROM", 1)
    in_memory = np.asarray(scorer._launch(*args, fill=True)[0])
    np.testing.assert_array_equal(in_memory, in_registers)
