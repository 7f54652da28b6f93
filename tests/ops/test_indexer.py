"""The indexer: every method and implementation against an independent numpy oracle."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.ops.indexer import reference as indexer_reference
from jsparse.testing import topk_mismatches

FP8 = jnp.float8_e4m3fn
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": FP8}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    t: int
    h: int
    d: int
    s: int
    top_k: int
    ranges: str = "all"  # all | causal | packed | odd
    scale: bool = False
    keys: str = "gauss"  # gauss | ties | equal | structured

    def __str__(self):
        return self.name


CASES = [
    Case("odd", t=5, h=3, d=20, s=300, top_k=17, ranges="odd", scale=True),
    Case("causal", t=7, h=4, d=16, s=7, top_k=6, ranges="causal"),
    Case("prefill-chunk", t=6, h=8, d=32, s=700, top_k=50, ranges="causal", scale=True),
    Case("packed", t=8, h=4, d=16, s=64, top_k=6, ranges="packed"),
    Case("ties", t=4, h=4, d=16, s=200, top_k=30, keys="ties"),
    Case("all-equal", t=4, h=4, d=16, s=150, top_k=30, keys="equal"),
    Case("k>visible", t=3, h=4, d=16, s=10, top_k=30, ranges="odd"),
    # recent keys score highest (positive queries and weights): full's seed threshold
    # prunes most record writes (checked on the kernels)
    Case("structured", t=4, h=4, d=16, s=2048, top_k=30, keys="structured"),
]
_BY_NAME = {c.name: c for c in CASES}


@dataclasses.dataclass(frozen=True)
class Call:
    """Cases run as one call: same H, D, K and key scales, different data (each case's
    keys at their own offset in one key buffer, its queries' ranges moved with them).
    Interpret mode compiles each kernel per shape: one call per geometry, not per case."""

    name: str
    cases: tuple[Case, ...]

    def __str__(self):
        return self.name


# A batched call stays under 16 queries (the scorer's decode tiles, as each case alone
# gets) and every case but the last fills whole query blocks of 4 (checked when the
# inputs are built): a block never mixes cases, so each query's seeds come from its own
# case's range, as when the case runs alone; the last case ends on a partial block.
_CALL_CASES = (
    ("odd",),
    ("prefill-chunk",),
    ("packed", "causal"),
    ("ties", "all-equal", "structured", "k>visible"),
)
CALLS = [Call("+".join(names), tuple(_BY_NAME[n] for n in names)) for names in _CALL_CASES]


def make_inputs(case: Case, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.t, case.h, case.d)).astype(np.float32)
    k = rng.standard_normal((case.s, case.d)).astype(np.float32)
    w = rng.standard_normal((case.t, case.h)).astype(np.float32)
    if case.keys == "ties":
        k = k[rng.integers(0, 7, case.s)]  # only 7 distinct keys: scores tie in groups
    elif case.keys == "equal":
        k = np.broadcast_to(k[:1], k.shape).copy()  # every key the same: every score ties
    elif case.keys == "structured":
        q, w = np.abs(q), np.ones_like(w)
        k = k + np.linspace(-3, 3, case.s, dtype=np.float32)[:, None]
    scale = rng.uniform(0.25, 4.0, case.s).astype(np.float32) if case.scale else None
    if case.ranges == "all":
        start = np.zeros(case.t, np.int32)
        end = np.full(case.t, case.s, np.int32)
    elif case.ranges == "causal":
        # chunked prefill: the last t of s positions, each sees itself and the past
        end = np.arange(case.s - case.t + 1, case.s + 1, dtype=np.int32)
        start = np.zeros(case.t, np.int32)
    elif case.ranges == "packed":
        # two sequences packed: [0, 30) and [30, s); queries of each are causal in it
        half = case.t // 2
        end = np.concatenate(
            [np.arange(30 - half + 1, 31), np.arange(case.s - half + 1, case.s + 1)]
        )
        start = np.concatenate([np.zeros(half), np.full(case.t - half, 30)])
        end, start = end.astype(np.int32)[: case.t], start.astype(np.int32)[: case.t]
    else:  # odd: arbitrary ranges, an empty one included
        start = rng.integers(0, case.s, case.t).astype(np.int32)
        end = np.minimum(case.s, start + rng.integers(0, case.s, case.t)).astype(np.int32)
        start[0], end[0] = 3, 3
    qj = jnp.asarray(q, dtype)
    kj = jnp.asarray(k, dtype)
    return dict(
        q=qj,
        weights=jnp.asarray(w),
        k=kj,
        k_scale=None if scale is None else jnp.asarray(scale),
        kv_start=jnp.asarray(start),
        kv_end=jnp.asarray(end),
    )


def call_inputs(call: Call, dtype, seed=0):
    """(inputs, rows) of one call: each case's ``make_inputs`` with its keys at an offset
    in one buffer and its ranges moved with them; ``rows[name]`` slices its queries."""
    from jsparse.ops.indexer import triton as scorer

    cases = call.cases
    assert len({(c.h, c.d, c.top_k, c.scale) for c in cases}) == 1, call
    parts = [make_inputs(c, dtype, seed) for c in cases]
    t = sum(c.t for c in cases)
    block_t = scorer.default_config(t, cases[0].h, fp8_keys=dtype == FP8).block_t
    rows, starts, ends, t0, s0 = {}, [], [], 0, 0
    for c, part in zip(cases, parts, strict=True):
        assert t0 % block_t == 0, f"{c.name}: its queries must start a query block"
        rows[c.name] = slice(t0, t0 + c.t)
        starts.append(part["kv_start"] + s0)
        ends.append(part["kv_end"] + s0)
        t0, s0 = t0 + c.t, s0 + c.s

    def cat(name):
        return None if parts[0][name] is None else jnp.concatenate([p[name] for p in parts])

    inputs = dict(q=cat("q"), weights=cat("weights"), k=cat("k"), k_scale=cat("k_scale"))
    inputs.update(kv_start=jnp.concatenate(starts), kv_end=jnp.concatenate(ends))
    return inputs, rows


def numpy_scores(inputs):
    """Independent oracle in float64 (inputs first rounded to their dtype, as the library does)."""
    q = np.asarray(inputs["q"].astype(jnp.float32), np.float64)
    k = np.asarray(inputs["k"].astype(jnp.float32), np.float64)
    w = np.asarray(inputs["weights"], np.float64)
    logits = np.einsum("thd,sd->ths", q, k)
    s = np.einsum("th,ths->ts", w, np.maximum(logits, 0.0))
    if inputs["k_scale"] is not None:
        s = s * np.asarray(inputs["k_scale"], np.float64)[None, :]
    ids = np.arange(k.shape[0])[None, :]
    start = np.asarray(inputs["kv_start"])[:, None]
    end = np.asarray(inputs["kv_end"])[:, None]
    return np.where((ids >= start) & (ids < end), s, -np.inf)


def check_against_oracle(result, inputs, top_k, rtol, rows=None):
    """``rows``: {case: slice of its queries} (each case checked with its own tolerance)."""
    oracle = numpy_scores(inputs)
    problems = []
    for name, sl in (rows or {"": slice(None)}).items():
        o = oracle[sl]
        atol = rtol * (np.max(np.abs(o[np.isfinite(o)]), initial=0.0) + 1e-6)
        found = topk_mismatches(result.indices[sl], result.scores[sl], o, top_k, atol)
        problems += [f"{name} {p}" if name else p for p in found]
    assert not problems, "\n".join(problems[:10])


RTOL = {"f32": 1e-5, "bf16": 1e-5, "fp8": 1e-5}


@pytest.mark.parametrize("call", CALLS, ids=str)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_reference_methods_match_oracle(call, dtype):
    inputs, rows = call_inputs(call, DTYPES[dtype])
    top_k = call.cases[0].top_k
    results = {
        m: jsparse.indexer_topk(**inputs, top_k=top_k, method=m, implementation="reference")
        for m in ("base", "full")
    }
    check_against_oracle(results["base"], inputs, top_k, RTOL[dtype], rows)
    np.testing.assert_array_equal(results["full"].indices, results["base"].indices)
    np.testing.assert_array_equal(results["full"].scores, results["base"].scores)


# Interpret mode compiles every kernel per shape (~10 s each on 2 cores): on the CPU, bf16
# runs every case and fp8 the cases where its rounding matters; the GPU runs all. Two
# calls run in the tests that reuse their base and full (one trace each):
# prefill-chunk bf16 in test_prefill_chunk_unsorted_seeds_and_record_overflow, odd fp8
# in test_fp8_widened_in_memory_gives_the_same_answer.
_TRITON_ELSEWHERE = (("prefill-chunk", "bf16"), ("odd", "fp8"))
TRITON_CASES = [
    (c, dt) for c in CALLS for dt in ("bf16", "fp8", "f32")
    if (c.name, dt) not in _TRITON_ELSEWHERE and (
        backend.has_nvidia_gpu() or dt == "bf16"
        or (dt == "fp8" and c.name in ("odd", "prefill-chunk"))
    )
]  # fmt: skip


def triton_call_matches_oracle(call, dtype, kernel_impl):
    """base and full of one call on the kernels against the oracle and each other;
    returns (inputs, rows, base, full)."""
    inputs, rows = call_inputs(call, DTYPES[dtype], seed=1)
    top_k = call.cases[0].top_k
    base = jsparse.indexer_topk(**inputs, top_k=top_k, method="base", implementation=kernel_impl)
    full = jsparse.indexer_topk(**inputs, top_k=top_k, method="full", implementation=kernel_impl)
    check_against_oracle(base, inputs, top_k, RTOL[dtype], rows)
    # one scorer: identical ids and bitwise identical scores
    np.testing.assert_array_equal(full.indices, base.indices)
    np.testing.assert_array_equal(full.scores, base.scores)
    assert not np.any(full.fallback)
    visible = np.asarray(inputs["kv_end"] - inputs["kv_start"])
    candidates = np.asarray(full.candidates)
    assert np.all(candidates <= visible)
    for c in call.cases:
        if c.keys == "structured":  # the seed threshold prunes most writes
            sl = rows[c.name]
            assert np.all(candidates[sl] < visible[sl] // 8), (c.name, candidates[sl])
    return inputs, rows, base, full


@pytest.mark.parametrize(("call", "dtype"), TRITON_CASES, ids=lambda x: str(x))
def test_triton_methods_match_oracle_and_each_other(call, dtype, kernel_impl):
    triton_call_matches_oracle(call, dtype, kernel_impl)


def test_prefill_chunk_unsorted_seeds_and_record_overflow(kernel_impl):
    """The prefill-chunk call (bf16) against the oracle, then on its inputs: unsorted
    results are the same sets, explicit seeds give base's answer, and a record buffer far
    too small falls back to base exactly."""
    from jsparse.ops.indexer import methods

    call = next(c for c in CALLS if c.name == "prefill-chunk")
    inputs, _, base, full = triton_call_matches_oracle(call, "bf16", kernel_impl)
    case, top_k = call.cases[0], call.cases[0].top_k

    for method, ordered in (("base", base), ("full", full)):
        loose = jsparse.indexer_topk(
            **inputs, top_k=top_k, method=method, sorted=False, implementation=kernel_impl
        )
        for t in range(case.t):
            a, b = np.asarray(ordered.indices[t]), np.asarray(loose.indices[t])
            assert sorted(a.tolist()) == sorted(b.tolist()), method
            score_of = dict(zip(b.tolist(), np.asarray(loose.scores[t]).tolist(), strict=True))
            np.testing.assert_array_equal([score_of[i] for i in a], np.asarray(ordered.scores[t]))

    end = np.asarray(inputs["kv_end"])
    seeds = jnp.asarray(np.stack([np.arange(e - 60, e) for e in end]).astype(np.int32))
    for impl in ("reference", kernel_impl):
        want = base
        if impl == "reference":
            want = jsparse.indexer_topk(**inputs, top_k=top_k, implementation=impl)
        seeded = jsparse.indexer_topk(
            **inputs, top_k=top_k, method="full", seeds=seeds, implementation=impl
        )
        np.testing.assert_array_equal(seeded.indices, want.indices)

    args = [inputs[n] for n in ("q", "weights", "k")]
    overflow = methods.topk_full(
        *args, top_k, inputs["k_scale"], inputs["kv_start"], inputs["kv_end"],
        capacity=top_k,  # far too small: every query overflows
    )  # fmt: skip
    assert np.all(np.asarray(overflow.fallback)[np.asarray(overflow.visible) > top_k])
    np.testing.assert_array_equal(overflow.indices, base.indices)
    np.testing.assert_array_equal(overflow.scores, base.scores)


def test_fp8_widened_in_memory_gives_the_same_answer(kernel_impl, fp8_widening):
    # The odd call (fp8) against the oracle in registers (as at the default threshold:
    # 5 queries), then widened in memory.
    from jsparse.ops.indexer import triton as scorer

    call = next(c for c in CALLS if c.name == "odd")
    assert not scorer.widens_fp8_in_memory(call.cases[0].t)
    fp8_widening.set_threshold(None)
    inputs, _, before, _ = triton_call_matches_oracle(call, "fp8", kernel_impl)
    assert fp8_widening.decisions and not any(fp8_widening.decisions)

    def run(method):
        return jsparse.indexer_topk(
            **inputs, top_k=call.cases[0].top_k, method=method, implementation=kernel_impl
        )

    fp8_widening.set_threshold(1)
    base, full = run("base"), run("full")
    assert fp8_widening.decisions and all(fp8_widening.decisions)  # every launch widened
    np.testing.assert_array_equal(base.indices, before.indices)
    np.testing.assert_array_equal(base.scores, before.scores)
    np.testing.assert_array_equal(full.indices, base.indices)
    np.testing.assert_array_equal(full.scores, base.scores)


def test_fp8_tiles_follow_where_the_widening_happens(monkeypatch):
    from jsparse.ops.indexer import triton as scorer

    # Widened in memory, fp8 keys reach the kernel as f16 and take bf16's tiles; in
    # registers, more queries share each widened tile.
    monkeypatch.setattr(scorer, "WIDEN_FP8_IN_MEMORY_FROM", 16)
    assert scorer.default_config(8192, 64, fp8_keys=True).block_t == 2
    assert scorer.default_config(8, 64, fp8_keys=True).block_t == 4
    assert scorer.default_config(8, 64, fp8_keys=True).num_warps == 4  # decode: run 66
    assert scorer.default_config(8192, 64, fp8_keys=False).block_t == 2
    # decode: one query in a block of one (runs 104-105), 2-3 in blocks of two, 4-15 in
    # blocks of four, 64-key tiles (run 72)
    for fp8_keys in (False, True):
        assert scorer.default_config(1, 64, fp8_keys=fp8_keys).block_t == 1
        assert scorer.default_config(3, 64, fp8_keys=fp8_keys).block_t == 2
        assert scorer.default_config(8, 64, fp8_keys=fp8_keys).block_t == 4
        assert scorer.default_config(8, 64, fp8_keys=fp8_keys).block_s == 64
    assert scorer.default_config(1, 128, fp8_keys=False).block_t == 1
    monkeypatch.setattr(scorer, "WIDEN_FP8_IN_MEMORY_FROM", None)
    assert scorer.default_config(8192, 64, fp8_keys=True).block_t == 4
    fp8, f16, bf16 = jnp.float8_e4m3fn, jnp.float16, jnp.bfloat16
    assert not scorer._widen_in_memory(8192, fp8, fp8, f16, shared_keys=True)
    monkeypatch.setattr(scorer, "WIDEN_FP8_IN_MEMORY_FROM", 16)
    assert scorer._widen_in_memory(16, fp8, fp8, f16, shared_keys=True)
    assert not scorer._widen_in_memory(15, fp8, fp8, f16, shared_keys=True)
    assert not scorer._widen_in_memory(8192, fp8, fp8, fp8, shared_keys=True)  # fp8 dot
    assert not scorer._widen_in_memory(8192, bf16, bf16, bf16, shared_keys=True)
    # Keys of one query each (a decode batch, a paged pool): never copied.
    assert not scorer._widen_in_memory(64, fp8, fp8, f16, shared_keys=False)


def test_exhaustive_report_in_one_launch(kernel_impl):
    from jsparse.ops.indexer.report import exhaustive_report

    for t in (1, 3, 1500):  # one program, a partial one, two programs
        start = jnp.asarray(np.arange(t, dtype=np.int32) % 7)
        end = start + jnp.asarray(np.arange(t, dtype=np.int32) * 3)
        visible, candidates, survivors, threshold, fallback = exhaustive_report(start, end)
        for got in (visible, candidates, survivors):
            assert got.dtype == jnp.int32
            np.testing.assert_array_equal(got, np.asarray(end - start))
        assert threshold.dtype == jnp.float32 and np.isneginf(np.asarray(threshold)).all()
        assert fallback.dtype == jnp.bool_ and not np.asarray(fallback).any()


@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=str)
def test_scorer_written_report_is_the_reports(case, kernel_impl, monkeypatch):
    # base's report written by the scorer launch (one program per query block) equals
    # the report kernel's: every field, a partial last query block included
    from jsparse.ops.indexer import methods

    x = {n: None if v is None else jnp.asarray(v) for n, v in make_inputs(case, FP8).items()}
    args = (x["q"], x["weights"], x["k"], case.top_k, x["k_scale"], x["kv_start"], x["kv_end"])
    monkeypatch.setattr(methods, "SCORER_WRITES_REPORT", False)
    want = methods.topk_base(*args)
    monkeypatch.setattr(methods, "SCORER_WRITES_REPORT", True)
    jax.clear_caches()  # the switch is read when topk_base is traced
    got = methods.topk_base(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_query_block_matches_oracle(kernel_impl):
    """A single query runs the scorer's one-query block (its own epilogue, runs 104-105):
    odd heads (padded), scaled keys, a range that starts and ends inside a key tile."""
    from jsparse.ops.indexer import triton as scorer

    assert scorer.default_config(1, 3).block_t == 1
    case = Case("one", t=1, h=3, d=20, s=300, top_k=17, scale=True)
    inputs = make_inputs(case, jnp.bfloat16, seed=4)
    inputs["kv_start"], inputs["kv_end"] = jnp.array([5], jnp.int32), jnp.array([290], jnp.int32)
    scores = np.asarray(jsparse.indexer_scores(**inputs, implementation=kernel_impl), np.float64)
    oracle = numpy_scores(inputs)
    assert np.array_equal(np.isneginf(scores), np.isneginf(oracle))
    fin = np.isfinite(oracle)
    np.testing.assert_allclose(scores[fin], oracle[fin], rtol=1e-5, atol=1e-5)
    base, full = (
        jsparse.indexer_topk(**inputs, top_k=17, method=m, implementation=kernel_impl)
        for m in ("base", "full")
    )
    check_against_oracle(base, inputs, 17, RTOL["bf16"])
    np.testing.assert_array_equal(full.indices, base.indices)
    np.testing.assert_array_equal(full.scores, base.scores)


def test_triton_f32_interpret(kernel_impl):
    case = CASES[0]
    inputs = make_inputs(case, jnp.float32, seed=2)
    base = jsparse.indexer_topk(**inputs, top_k=case.top_k, implementation=kernel_impl)
    check_against_oracle(base, inputs, case.top_k, 1e-5)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_scores_match_oracle(dtype, kernel_impl):
    case = CASES[0]
    inputs = make_inputs(case, DTYPES[dtype], seed=3)
    oracle = numpy_scores(inputs)
    for impl in ("reference", kernel_impl):
        got = np.asarray(jsparse.indexer_scores(**inputs, implementation=impl), np.float64)
        assert np.array_equal(np.isneginf(got), np.isneginf(oracle))
        fin = np.isfinite(oracle)
        np.testing.assert_allclose(got[fin], oracle[fin], rtol=1e-5, atol=1e-5)


def test_xla_baseline_matches_oracle():
    case = CASES[2]
    inputs = make_inputs(case, jnp.bfloat16)
    result = jsparse.indexer_topk(**inputs, top_k=case.top_k, method="xla")
    check_against_oracle(result, inputs, case.top_k, 1e-5)


MIXED_PAIRS = [(a, b) for a in DTYPES for b in DTYPES if a != b and "fp8" in (a, b)]


@pytest.mark.parametrize(("q_dtype", "k_dtype"), MIXED_PAIRS, ids=lambda x: str(x))
def test_fp8_with_another_dtype_matches_oracle_in_every_method(q_dtype, k_dtype):
    """q and k each in any of the three dtypes: FP8 beside f32 or bf16 has no implicit
    promotion in jnp, and the ``xla`` baseline's einsum must still take it."""
    case = CASES[0]
    inputs = make_inputs(case, jnp.float32)
    inputs["q"] = inputs["q"].astype(DTYPES[q_dtype])
    inputs["k"] = inputs["k"].astype(DTYPES[k_dtype])
    base = jsparse.indexer_topk(**inputs, top_k=case.top_k, implementation="reference")
    check_against_oracle(base, inputs, case.top_k, 1e-5)
    xla = jsparse.indexer_topk(**inputs, top_k=case.top_k, method="xla")
    # XLA's f32 dot may round through TF32 on a GPU
    check_against_oracle(xla, inputs, case.top_k, 5e-3 if "f32" in (q_dtype, k_dtype) else 1e-5)


def test_ties_resolve_by_id(kernel_impl):
    """All-equal scores: the K smallest visible ids, in ascending order."""
    # The all-equal case in its call (the oracle test's compile): its first query's range
    # starts 10 keys into the case's keys, the other queries' at the case's first key.
    call = next(c for c in CALLS if "all-equal" in c.name)
    inputs, rows = call_inputs(call, jnp.bfloat16)
    eq, top_k = rows["all-equal"], call.cases[0].top_k
    inputs["kv_start"] = inputs["kv_start"].at[eq.start].add(10)
    first = np.asarray(inputs["kv_start"])[eq]
    assert first[0] == first[1] + 10 and np.all(first[1:] == first[1])
    for impl in ("reference", kernel_impl):
        for method in ("base", "full"):
            r = jsparse.indexer_topk(**inputs, top_k=top_k, method=method, implementation=impl)
            for i, a in zip(range(eq.start, eq.stop), first, strict=True):
                np.testing.assert_array_equal(r.indices[i], np.arange(a, a + top_k))


class TestNonFinite:
    """Scores follow IEEE arithmetic; NaN ranks above +inf, so it surfaces first."""

    def inputs(self):
        case = Case("nf", t=3, h=4, d=16, s=100, top_k=8)
        return make_inputs(case, jnp.float32, seed=7)

    @pytest.mark.parametrize("impl", ["reference", "triton"])
    @pytest.mark.parametrize("method", ["base", "full"])
    def test_nan_key_ranks_first(self, impl, method, interpret):
        inputs = self.inputs()
        inputs["k"] = inputs["k"].at[42, 3].set(jnp.nan)
        r = jsparse.indexer_topk(**inputs, top_k=8, method=method, implementation=impl)
        assert np.all(np.asarray(r.indices[:, 0]) == 42)
        assert np.all(np.isnan(np.asarray(r.scores[:, 0])))
        assert np.all(np.isfinite(np.asarray(r.scores[:, 1:])))

    @pytest.mark.parametrize("impl", ["reference", "triton"])
    def test_nan_weight_poisons_its_query_only(self, impl, interpret):
        inputs = self.inputs()
        inputs["weights"] = inputs["weights"].at[1, 0].set(jnp.nan)
        r = jsparse.indexer_topk(**inputs, top_k=8, implementation=impl)
        assert np.all(np.isnan(np.asarray(r.scores[1])))
        np.testing.assert_array_equal(r.indices[1], np.arange(8))  # all tie: ids ascending
        assert np.all(np.isfinite(np.asarray(r.scores)[[0, 2]]))

    @pytest.mark.parametrize("impl", ["reference", "triton"])
    def test_inf_query_gives_infinite_scores(self, impl, interpret):
        inputs = self.inputs()
        inputs["q"] = inputs["q"].at[0, 1, :].set(jnp.inf)
        inputs["weights"] = inputs["weights"].at[0, 1].set(1.0)
        ref = numpy_scores({**inputs})
        r = jsparse.indexer_topk(**inputs, top_k=8, implementation=impl)
        # keys whose dot with the inf head is +inf (no NaN from inf·0) score +inf or NaN
        top = np.asarray(r.scores[0])
        assert np.all(~np.isfinite(top[: int(np.sum(~np.isfinite(ref[0])))]))

    @pytest.mark.parametrize("bits", [0xFFC00000, 0x7FC00000, 0xFF800001, 0x80000000])
    def test_xla_ranks_scores_as_the_kernels_do(self, bits):
        """``xla`` selects with ``lax.top_k``, which orders by the sign bit too (-0
        below +0, a NaN with its sign bit set below -inf; XLA's CPU makes inf - inf
        such a NaN): its ranking must still be the kernels' one, NaN first, -0 as +0."""
        scores = np.random.default_rng(3).standard_normal((2, 40)).astype(np.float32)
        scores[:, [5, 17, 30]] = np.array(bits, np.uint32).view(np.float32)
        scores[:, 8] = 0.0
        scores = jnp.asarray(scores)
        visible = jnp.asarray([40, 20], jnp.int32)
        ids, values = indexer_reference.lax_topk(
            jnp.where(jnp.arange(40) < visible[:, None], scores, -jnp.inf), visible, 12
        )
        want_ids, want_values = jsparse.topk(
            scores, 12, kv_end=visible, sorted=True, implementation="reference"
        )
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(values, want_values)

    def test_xla_keeps_a_nan_score_from_inf_minus_inf(self, interpret):
        """A key at +inf under heads of both signs scores inf - inf = NaN."""
        inputs = self.inputs()
        inputs["k"] = inputs["k"].at[42, :].set(jnp.inf)
        inputs["weights"] = inputs["weights"].at[:, :2].set(jnp.asarray([1.0, -1.0]))
        inputs["q"] = jnp.abs(inputs["q"])  # every head's dot with key 42 is +inf
        base = jsparse.indexer_topk(**inputs, top_k=8, method="base", implementation="triton")
        xla = jsparse.indexer_topk(**inputs, top_k=8, method="xla")
        assert np.all(np.asarray(base.indices[:, 0]) == 42)
        np.testing.assert_array_equal(xla.indices, base.indices)


class TestBadInput:
    def ok(self):
        return make_inputs(CASES[0], jnp.bfloat16)

    @pytest.mark.parametrize(
        "change, message",
        [
            (lambda a: a.update(q=a["q"][0]), "q: expected rank 3"),
            (lambda a: a.update(k=a["k"][None]), "k: expected rank 2"),
            (lambda a: a.update(weights=a["weights"][:, :2]), "weights: shape"),
            (lambda a: a.update(weights=a["weights"].astype(jnp.bfloat16)), "weights: dtype"),
            (lambda a: a.update(k=a["k"][:, :7]), "k: shape"),
            (lambda a: a.update(q=a["q"].astype(jnp.float16)), "q: dtype float16"),
            (lambda a: a.update(k_scale=a["k_scale"][:5]), "k_scale: shape"),
            (lambda a: a.update(k_scale=a["k_scale"].at[3].set(0.0)), r"k_scale\[3\] = 0.0"),
            (lambda a: a.update(k_scale=a["k_scale"].at[4].set(jnp.inf)), r"k_scale\[4\] = inf"),
            (
                lambda a: a.update(
                    kv_start=a["kv_start"].at[1].set(200), kv_end=a["kv_end"].at[1].set(100)
                ),
                "kv_start > kv_end at query 1",
            ),
            (lambda a: a.update(kv_end=a["kv_end"].at[2].set(301)), r"kv_end\[2\] = 301"),
            (lambda a: a.update(kv_start=a["kv_start"].at[2].set(-1)), r"kv_start\[2\] = -1"),
            (lambda a: a.update(kv_end=a["kv_end"].astype(jnp.int16)), "kv_end: dtype int16"),
            (lambda a: a.update(kv_end=a["kv_end"][:2]), "kv_end: shape"),
        ],
    )
    def test_value_errors(self, change, message):
        inputs = self.ok()
        change(inputs)
        with pytest.raises(ValueError, match=message):
            jsparse.indexer_topk(**inputs, top_k=4, implementation="reference")

    @pytest.mark.parametrize("top_k", [0, -3, 2.5, True])
    def test_top_k(self, top_k):
        with pytest.raises(ValueError, match="top_k"):
            jsparse.indexer_topk(**self.ok(), top_k=top_k)

    def test_method_and_implementation_names(self):
        with pytest.raises(ValueError, match="method"):
            jsparse.indexer_topk(**self.ok(), top_k=4, method="fast")
        with pytest.raises(ValueError, match="implementation"):
            jsparse.indexer_topk(**self.ok(), top_k=4, implementation="cuda")

    def test_seeds_must_be_visible_and_distinct(self):
        inputs = self.ok()
        bad = jnp.zeros((5, 3), jnp.int32).at[1, 0].set(299)  # query 1 sees [start, end)
        with pytest.raises(ValueError, match="seeds"):
            jsparse.indexer_topk(**inputs, top_k=4, method="full", seeds=bad)
        first = int(inputs["kv_start"][2])  # visible to query 2
        repeated = jnp.full((5, 3), -1, jnp.int32).at[2, :2].set(first)
        with pytest.raises(ValueError, match="seeds: row 2 lists a key more than once"):
            jsparse.indexer_topk(**inputs, top_k=4, method="full", seeds=repeated)

    @pytest.mark.skipif(backend.has_nvidia_gpu(), reason="checks the no-GPU message")
    def test_explicit_kernel_without_gpu_says_so(self):
        with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
            jsparse.indexer_topk(**self.ok(), top_k=4, implementation="triton")


def test_default_implementation_falls_back_to_reference_on_cpu():
    if backend.has_nvidia_gpu():
        pytest.skip("CPU behaviour")
    inputs = make_inputs(CASES[1], jnp.bfloat16)
    r = jsparse.indexer_topk(**inputs, top_k=4)
    ref = jsparse.indexer_topk(**inputs, top_k=4, implementation="reference")
    np.testing.assert_array_equal(r.indices, ref.indices)


def test_jit_compatible():
    inputs = make_inputs(CASES[2], jnp.bfloat16)
    f = jax.jit(lambda a: jsparse.indexer_topk(**a, top_k=8, implementation="reference").indices)
    np.testing.assert_array_equal(
        f(inputs), jsparse.indexer_topk(**inputs, top_k=8, implementation="reference").indices
    )


@pytest.mark.parametrize(
    "impl, method",
    [("reference", "base"), ("reference", "xla"), ("triton", "base"), ("triton", "full"),
     ("reference", "dosa"), ("triton", "dosa")],
)  # fmt: skip
def test_traced_ranges_outside_the_keys_are_clamped(impl, method, interpret):
    """Under jit the ranges cannot be checked: kv_start is clamped to [0, S] and kv_end
    to [kv_start, S], in every method (the Triton base returned ids -5..-2 for a
    negative start, and xla ids past a range's end). Every method's answer is exact, so
    each is held to the reference's on the clamped ranges (a second interpreted DoSA
    call would double the test's ~20 s)."""
    inputs = make_inputs(CASES[0], jnp.bfloat16)  # S = 300, K = 17
    start = jnp.asarray([-5, 10, 299, 0, 40], jnp.int32)
    end = jnp.asarray([3, 400, 299, -7, 30], jnp.int32)
    clamped = dict(inputs, kv_start=jnp.clip(start, 0, 300))
    clamped["kv_end"] = jnp.clip(end, clamped["kv_start"], 300)
    run = jax.jit(lambda a: jsparse.indexer_topk(**a, top_k=17, method=method, implementation=impl))
    got = run(dict(inputs, kv_start=start, kv_end=end))
    want = jsparse.indexer_topk(**clamped, top_k=17, method="base", implementation="reference")
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.visible, want.visible)  # the report counts [start, end)
    assert np.all(np.asarray(got.indices)[0, 3:] == -1) and np.all(got.indices[2:] == -1)


@pytest.mark.parametrize(
    "impl, method",
    [("reference", "base"), ("reference", "xla"), ("triton", "base"), ("triton", "full"),
     ("reference", "dosa"), ("triton", "dosa"), ("triton", "dense")],
)  # fmt: skip
def test_no_keys_at_all(impl, method, interpret):
    """S = 0 is a valid cache (nothing written yet): rows of -1 / -inf, nothing visible,
    on every path (the Triton kernels crashed reading their first key tile)."""
    q, w = jnp.ones((3, 4, 16), jnp.bfloat16), jnp.ones((3, 4), jnp.float32)
    k, k_scale = jnp.ones((0, 16), jnp.bfloat16), jnp.ones((0,), jnp.float32)
    r = jsparse.indexer_topk(q, w, k, 5, k_scale=k_scale, method=method, implementation=impl)
    assert np.all(np.asarray(r.indices) == -1) and np.all(np.asarray(r.scores) == -np.inf)
    assert np.all(np.asarray(r.visible) == 0) and r.indices.shape == (3, 5)
    scores = jsparse.indexer_scores(q, w, k, implementation=impl if method != "xla" else None)
    assert scores.shape == (3, 0)


def test_query_chunks_keep_launches_within_two_to_the_30_once_split():
    # The 64K causal prefill (65,536 × 65,792 slots) must split; its launches stay at
    # ≤ 2^30 elements (run 55: 139 → 128 registers, 139.5 → 91.2 ms). Calls under the
    # int32 limit stay whole, even just over 2^30 (the 8192 × 128K chunk).
    from jsparse import _chunking

    chunk = _chunking.queries_per_call(65536, 65536)
    assert chunk % _chunking.ALIGN == 0
    assert chunk * _chunking.key_row(65536) <= 2**30 < (chunk + 256) * _chunking.key_row(65536)
    assert _chunking.queries_per_call(8192, 131072) == 8192
    assert _chunking.queries_per_call(32768, 32768) == 32768


def test_large_calls_run_in_query_chunks(monkeypatch):
    # Kernels address [T, row] buffers with int32 offsets: a call with T·row ≥ 2^31
    # (64K × 64K causal prefill) runs over query chunks. Shrink the limit to see it here.
    from jsparse import _chunking
    from jsparse.certified import dosa_topk

    rng = np.random.default_rng(5)
    t, h, d, s, top_k = 600, 2, 8, 300, 7
    q = jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((s, d)), jnp.float32)
    end = jnp.asarray(rng.integers(1, s + 1, t), jnp.int32)
    kw = dict(kv_end=end, implementation="reference")
    whole = {m: jsparse.indexer_topk(q, w, k, top_k, method=m, **kw) for m in ("xla", "base")}
    whole["dosa"] = dosa_topk(q, w, k, top_k, r=np.full(t, 1), **kw)
    scores = jsparse.indexer_scores(q, w, k, **kw)
    monkeypatch.setattr(_chunking, "INDEX_LIMIT", 256 * _chunking.key_row(s))
    assert _chunking.queries_per_chunk(t, _chunking.key_row(s)) == 256
    for m in ("xla", "base"):
        got = jsparse.indexer_topk(q, w, k, top_k, method=m, **kw)
        np.testing.assert_array_equal(got.indices, whole[m].indices)
        np.testing.assert_array_equal(got.visible, whole[m].visible)
    got = dosa_topk(q, w, k, top_k, r=np.full(t, 1), **kw)
    np.testing.assert_array_equal(got.indices, whole["dosa"].indices)
    np.testing.assert_array_equal(jsparse.indexer_scores(q, w, k, **kw), scores)
