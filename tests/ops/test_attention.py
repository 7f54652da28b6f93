"""Indexed decode attention: the kernel against the jnp reference, the reference
against a float64 numpy oracle, and the contract (empty slots, bad input, lowering)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.ops.attention import triton as attention_triton
from jsparse.testing import lower_for_h200
from tests.ops.decode_dtypes import DECODE_DTYPES
from tests.paging import shuffled_pages

F8 = jnp.float8_e4m3fn


def make(b, h, hkv, d, dv, s, n, dtype=jnp.float32, seed=0, cache_dtype=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, dv)).astype(np.float32)
    idx = rng.integers(-1, s, (b, hkv, n)).astype(np.int32)  # duplicates and empties
    cache_dtype = cache_dtype or dtype
    return (
        jnp.asarray(q, dtype), jnp.asarray(k, cache_dtype), jnp.asarray(v, cache_dtype),
        jnp.asarray(idx),
    )  # fmt: skip


def oracle(q, k, v, idx, scale, k_scale=None, v_scale=None):
    """float64 loops: each query head over its KV head's listed rows."""
    q, k, v, idx = (np.asarray(x, np.float64) if x.dtype != np.int32 else np.asarray(x)
                    for x in (np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)),
                              np.asarray(v.astype(jnp.float32)), np.asarray(idx)))  # fmt: skip
    b, h, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    out, lse = np.zeros((b, h, dv)), np.full((b, h), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hkv)
            rows = [int(j) for j in idx[bi, kv] if j >= 0]
            if not rows:
                continue
            ks = 1.0 if k_scale is None else float(k_scale[bi, kv])
            vs = 1.0 if v_scale is None else float(v_scale[bi, kv])
            logits = np.array([scale * ks * q[bi, hi] @ k[bi, j, kv] for j in rows])
            top = logits.max()
            p = np.exp(logits - top)
            out[bi, hi] = (
                vs * sum(pj * v[bi, j, kv] for pj, j in zip(p, rows, strict=True)) / p.sum()
            )
            lse[bi, hi] = top + math.log(p.sum())
    return out, lse


SHAPES = {
    # b, h, hkv, d, dv, s, n: odd head dims and list lengths, a group of 3 (SmolLM2's 9/3)
    "odd": (2, 6, 2, 40, 24, 53, 37),
    "smollm2": (1, 9, 3, 64, 64, 300, 130),
    "mha": (3, 4, 4, 16, 16, 20, 70),
    "odd-dims": (2, 4, 2, 41, 23, 30, 21),  # odd D and Dv: FP8 read byte by byte, not in words
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_matches_numpy_oracle(shape):
    q, k, v, idx = make(*SHAPES[shape])
    idx = idx.at[0, 0].set(-1)  # one list entirely empty
    scale = 0.3
    out, lse = jsparse.indexed_attention(
        q, k, v, idx, scale=scale, return_lse=True, implementation="reference"
    )
    want_out, want_lse = oracle(q, k, v, idx, scale)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)
    g = q.shape[1] // k.shape[2]
    assert np.all(np.asarray(out)[0, :g] == 0) and np.all(np.asarray(lse)[0, :g] == -np.inf)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(kernel_impl, shape, decode_dtypes, fp8_reading):
    dtype = decode_dtypes.name
    if fp8_reading == "words" and dtype != "float8":
        pytest.skip("only FP8 caches are read as words")
    q, k, v, idx = make(*SHAPES[shape], dtype=decode_dtypes.q, cache_dtype=decode_dtypes.cache,
                        seed=1)  # fmt: skip
    idx = idx.at[-1, 0].set(-1)  # one list empty: zeros and an lse of -inf
    b, hkv = idx.shape[:2]
    scales = {}
    if dtype == "float8":
        rng = np.random.default_rng(2)
        scales = {n: jnp.asarray(rng.uniform(0.5, 2.0, (b, hkv)), jnp.float32)
                  for n in ("k_scale", "v_scale")}  # fmt: skip
    out, lse = jsparse.indexed_attention(
        q, k, v, idx, return_lse=True, implementation=kernel_impl, **scales
    )
    ref, ref_lse = jsparse.indexed_attention(
        q, k, v, idx, return_lse=True, implementation="reference", **scales
    )
    assert out.dtype == q.dtype and out.shape == ref.shape and lse.dtype == jnp.float32
    tol = decode_dtypes.tol
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol
    )
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)


@pytest.mark.parametrize("magnitude", [1e6, 1e-7])
def test_fp8_words_with_q_beyond_f16s_range(kernel_impl, magnitude, monkeypatch):
    """FP8 caches read as words run f16 dots against a q rescaled per head: a q of
    magnitude 1e6 (past f16's 65504) or 1e-7 (among its subnormals) gives the
    reference's answer."""
    monkeypatch.setattr(attention_triton, "FP8_AS_WORDS", True)
    q, k, v, idx = make(2, 6, 2, 40, 24, 53, 37, dtype=jnp.float32, cache_dtype=F8, seed=5)
    q = (q * magnitude).astype(jnp.bfloat16)
    scales = dict(k_scale=jnp.full((2, 2), 0.5), v_scale=jnp.full((2, 2), 2.0))
    run = lambda impl: jsparse.indexed_attention(  # noqa: E731
        q, k, v, idx, scale=0.3 / magnitude, return_lse=True, implementation=impl, **scales
    )
    (out, lse), (ref, ref_lse) = run(kernel_impl), run("reference")
    tol = DECODE_DTYPES["float8"][2]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)  # fmt: skip
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)


def test_splits_give_the_same_answer(interpret):
    q, k, v, idx = make(*SHAPES["smollm2"], seed=3)
    run = lambda splits: attention_triton.indexed_attention_triton(  # noqa: E731
        q, k, v, idx, None, None, scale=0.125, splits=splits
    )
    one, lse1 = run(1)
    for splits in (3, 4):
        out, lse = run(splits)
        np.testing.assert_allclose(np.asarray(out), np.asarray(one), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), rtol=1e-6, atol=1e-6)
    cfg = attention_triton.AttentionConfig(block_n=16)
    small, _ = attention_triton.indexed_attention_triton(
        q, k, v, idx, None, None, scale=0.125, cfg=cfg, splits=3
    )
    np.testing.assert_allclose(np.asarray(small), np.asarray(one), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [16, 32])
def test_merge_value_blocks_give_the_same_answer(interpret, monkeypatch, block):
    """The merge weighting blocks of a head's values gives the whole row's answer, bit
    for bit (per value the same sums)."""
    q, k, v, idx = make(*SHAPES["smollm2"], seed=4)
    run = lambda: attention_triton.indexed_attention_triton(  # noqa: E731
        q, k, v, idx, None, None, scale=0.125, splits=3
    )
    want, want_lse = run()
    monkeypatch.setattr(attention_triton, "MERGE_VDIM_BLOCK", block)
    got, got_lse = run()  # read at call time: not a cached trace
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))


def test_every_row_listed_is_dense_attention(kernel_impl):
    """With every cache row listed, indexed attention is plain GQA softmax attention."""
    b, h, hkv, d, s = 2, 8, 2, 32, 45
    q, k, v, _ = make(b, h, hkv, d, d, s, 1, seed=4)
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, hkv, s))
    got = jsparse.indexed_attention(q, k, v, idx, implementation=kernel_impl)
    kg = jnp.repeat(k, h // hkv, axis=2)  # [B, S, H, D]
    vg = jnp.repeat(v, h // hkv, axis=2)
    logits = jnp.einsum("bhd,bshd->bhs", q, kg, precision="highest") / math.sqrt(d)
    want = jnp.einsum("bhs,bshd->bhd", jax.nn.softmax(logits, axis=-1), vg, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_a_selectors_lists_under_jit(kernel_impl):
    """A selector's [B, Hkv, budget] output feeds the op directly, inside one jit."""
    b, h, hkv, d, s, budget = 2, 6, 2, 32, 200, 24
    q, k, v, _ = make(b, h, hkv, d, d, s, 1, seed=5)
    lengths = jnp.asarray([200, 17], jnp.int32)  # the second sequence has fewer than budget
    sel = jsparse.make_selector("oracle")
    params = sel.calibrate(jnp.repeat(k[0], h // hkv, axis=1), k[0])  # [S, H, D], [S, Hkv, D]

    @jax.jit
    def step(q, k, v, lengths):
        idx = sel.select(params, q, k, lengths, budget)
        return idx, jsparse.indexed_attention(q, k, v, idx, implementation=kernel_impl)

    idx, got = step(q, k, v, lengths)
    assert np.all(np.asarray(idx)[1, :, 17:] == -1)
    want = jsparse.indexed_attention(q, k, v, idx, implementation="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_out_of_range_entries_under_jit_are_never_read(kernel_impl):
    q, k, v, idx = make(*SHAPES["odd"], seed=6)
    s = k.shape[1]
    bad = idx.at[:, :, ::5].set(s + 7).at[:, :, 1::7].set(-9)
    cleaned = jnp.where((bad >= 0) & (bad < s), bad, -1)
    run = jax.jit(lambda i: jsparse.indexed_attention(q, k, v, i, implementation=kernel_impl))
    np.testing.assert_array_equal(np.asarray(run(bad)), np.asarray(run(cleaned)))


@pytest.mark.parametrize("path", ["reference", "kernel", "kernel-merged"])
def test_non_finite_rows_reach_only_the_lists_naming_them(path, kernel_impl):
    """Row 0 (where empty slots point) is NaN/inf and listed by no one: lists with empty
    slots stay finite and empty lists stay zeros / -inf. A listed NaN key makes its
    heads' output and lse NaN (not zeros and -inf); a listed inf value makes the output
    non-finite and leaves lse finite. The float64 oracle reads only the listed rows."""
    q, k, v, _ = make(2, 4, 2, 16, 8, 20, 1, seed=9)
    k, v = k.at[:, 0].set(jnp.nan), v.at[:, 0].set(jnp.inf)
    k, v = k.at[0, 5, 1].set(jnp.nan), v.at[1, 8, 0].set(jnp.inf)
    idx = jnp.asarray(
        [[[3, -1, 7, -1, 9, 2], [5, 4, -1, 6, -1, -1]],  # clean with empties; NaN key
         [[8, 1, -1, 2, -1, -1], [-1] * 6]],  # inf value; nothing listed
        jnp.int32,
    )  # fmt: skip
    if path == "reference":
        out, lse = jsparse.indexed_attention(
            q, k, v, idx, scale=0.3, return_lse=True, implementation="reference"
        )
    else:
        splits = 3 if path == "kernel-merged" else 1
        out, lse = attention_triton.indexed_attention_triton(
            q, k, v, idx, None, None, scale=0.3, splits=splits
        )
    want_out, want_lse = oracle(q, k, v, idx, 0.3)
    assert np.isnan(want_lse[0, 2:]).all() and np.isinf(want_out[1, :2]).all()
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n, s", [(0, 10), (5, 0)], ids=["no-entries", "no-cache"])
def test_nothing_to_attend_gives_zeros(n, s):
    q, k, v, _ = make(2, 4, 2, 16, 8, max(s, 1), 1)
    k, v = k[:, :s], v[:, :s]
    idx = jnp.full((2, 2, n), -1, jnp.int32)
    out, lse = jsparse.indexed_attention(q, k, v, idx, return_lse=True)
    assert out.shape == (2, 4, 8) and np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(lse) == -np.inf)


@pytest.mark.parametrize("pages, columns", [(3, 0), (0, 2)], ids=["no-columns", "empty-pool"])
def test_a_page_table_that_reaches_no_key_gives_zeros(kernel_impl, pages, columns):
    """A table of no columns (S = 0) or a pool of no pages: an IndexError in the index
    check and a gather error inside the implementations, before."""
    q = jnp.ones((1, 2, 8), jnp.float32)
    pool = jnp.zeros((pages, 4, 1, 8), jnp.float32)
    out, lse = jsparse.indexed_attention(
        q, pool, pool, jnp.full((1, 1, 2), -1, jnp.int32), implementation=kernel_impl,
        page_table=jnp.full((1, columns), -1, jnp.int32), return_lse=True,
    )  # fmt: skip
    assert out.shape == (1, 2, 8) and np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(lse) == -np.inf)


def _bad_inputs():
    q, k, v, idx = make(2, 6, 2, 16, 8, 30, 5)
    ones = jnp.ones((2, 2), jnp.float32)
    # fmt: off
    return [
        ("rank", dict(q=q[0]), r"q: expected rank 3"),
        ("cache rank", dict(k=k[0]), r"k: expected rank 4"),
        ("q dtype", dict(q=q.astype(jnp.int32)), r"q: dtype int32"),
        ("mixed", dict(q=q.astype(jnp.bfloat16), k=k.astype(jnp.float16), v=v.astype(jnp.float16)),
         r"k: dtype float16 with q bfloat16; expected q's dtype, float8_e4m3fn, or bfloat16"),
        ("wider", dict(q=q.astype(jnp.bfloat16)), r"k: dtype float32 with q bfloat16"),
        ("k and v", dict(v=v.astype(jnp.float16)), r"k, v: dtypes float32 and float16"),
        ("index dtype", dict(indices=idx.astype(jnp.int16)), r"indices: dtype int16"),
        ("batch", dict(k=k[:1], v=v[:1]), r"k: axis 0 of shape \(1, 30, 2, 16\) is 1; expected 2"),
        ("head dim", dict(k=k[..., :8]), r"k: axis 3 .* expected 16"),
        ("v length", dict(v=v[:, :29]), r"v: axis 1 .* expected 30"),
        ("groups", dict(q=jnp.concatenate([q, q[:, :1]], axis=1)), r"q: 7 heads with 2 KV heads"),
        ("no head dim", dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]), "a head dimension D >= 1"),
        ("no value dim", dict(v=v[..., :0]), r"v: shape \(2, 30, 2, 0\); expected .* Dv >= 1"),
        ("list heads", dict(indices=idx[:, :1]), r"indices: axis 1 .* expected 2"),
        ("beyond S", dict(indices=idx.at[1, 0, 3].set(30)),
         r"indices: indices\[1, 0, 3\] = 30 is outside \[0, S\) = \[0, 30\)"),
        ("below -1", dict(indices=idx.at[0, 1, 0].set(-2)), r"indices\[0, 1, 0\] = -2"),
        ("scale", dict(scale=float("nan")), r"scale: got nan"),
        ("scale type", dict(scale=jnp.float32(0.5)), r"scale: got Array"),
        ("k_scale shape", dict(k_scale=jnp.ones((2,), jnp.float32)), r"k_scale: expected rank 2"),
        ("k_scale value", dict(k_scale=ones.at[1, 0].set(0.0)),
         r"k_scale: k_scale\[1, 0\] = 0.0; expected finite and > 0"),
        ("v_scale value", dict(v_scale=ones.at[0, 1].set(jnp.inf)), r"v_scale: v_scale\[0, 1\]"),
    ], dict(q=q, k=k, v=v, indices=idx)
    # fmt: on


@pytest.mark.parametrize("case", [c[0] for c in _bad_inputs()[0]])
def test_bad_input_names_the_argument(case):
    cases, good = _bad_inputs()
    _, change, message = next(c for c in cases if c[0] == case)
    args = {**good, **change}
    kwargs = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v", "indices")}
    with pytest.raises(ValueError, match=message):
        jsparse.indexed_attention(args["q"], args["k"], args["v"], args["indices"], **kwargs)


def test_a_numpy_scale_is_a_scale():
    q, k, v, idx = make(1, 2, 1, 16, 16, 8, 4)
    want = jsparse.indexed_attention(q, k, v, idx, scale=0.25)
    np.testing.assert_array_equal(
        jsparse.indexed_attention(q, k, v, idx, scale=np.float32(0.25)), want
    )


def test_unknown_implementation():
    q, k, v, idx = make(1, 2, 1, 16, 16, 8, 4)
    with pytest.raises(ValueError, match="implementation: got 'cuda'"):
        jsparse.indexed_attention(q, k, v, idx, implementation="cuda")
    # a name of the library that this op does not implement: valid, not supported
    with pytest.raises(NotImplementedError, match="'mosaic' is not implemented by this op"):
        jsparse.indexed_attention(q, k, v, idx, implementation="mosaic")


PAIRS = [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.float16, jnp.float16),
         (jnp.bfloat16, F8), (jnp.bfloat16, F8), (jnp.float32, jnp.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(
    "qdt, cdt, words", [(*pair, i == 4) for i, pair in enumerate(PAIRS)],
    ids=["bf16", "f32", "f16", "fp8", "fp8-words", "f32-over-bf16"],
)  # fmt: skip
@pytest.mark.parametrize("shape", [(4, 32, 8, 128, 128, 4096, 2048), (2, 6, 2, 80, 48, 300, 100)])
def test_lowers_to_cuda(qdt, cdt, words, shape, monkeypatch):
    monkeypatch.setattr(attention_triton, "FP8_AS_WORDS", words)
    b, h, hkv, d, dv, s, n = shape
    sds = jax.ShapeDtypeStruct
    args = [sds((b, h, d), qdt), sds((b, s, hkv, d), cdt), sds((b, s, hkv, dv), cdt),
            sds((b, hkv, n), jnp.int32)]  # fmt: skip
    scales = [sds((b, hkv), jnp.float32)] * 2 if cdt == F8 else [None, None]

    for splits in (None, 1, 5):  # the default; in place; a merge of a non-power-of-2 count

        def fn(q, k, v, i, *sc, splits=splits):
            return attention_triton.indexed_attention_triton(
                q, k, v, i, *(sc or scales), scale=0.1, splits=splits
            )

        lowered = lower_for_h200(fn, *args, *(scales if cdt == F8 else []))
        assert "jsparse_indexed_attention" in lowered.as_text()
        assert ("ui16" in lowered.as_text()) == words  # the cache as 16-bit words, or not


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("b, s", [(1, 131072), (32, 32768)])
def test_gpu_decode_shapes(b, s, cache, fp8_reading):
    """32 query / 8 KV heads, D = 128, budget 2048, lists from a real top-k."""
    if fp8_reading == "words" and cache != "fp8":
        pytest.skip("only FP8 caches are read as words")
    h, hkv, d, n = 32, 8, 128, 2048
    key = jax.random.PRNGKey(b)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    scores = jnp.einsum("bkd,bskd->bks", q[:, ::4].astype(jnp.float32), k.astype(jnp.float32))
    idx = jax.lax.top_k(scores, n)[1].astype(jnp.int32)
    idx = idx.at[:, :, -100:].set(-1)
    scales = {}
    if cache == "fp8":
        scales = dict(k_scale=jnp.full((b, hkv), 0.5), v_scale=jnp.full((b, hkv), 0.25))
        k, v = (k * 2).astype(F8), (v * 4).astype(F8)
    got = jsparse.indexed_attention(q, k, v, idx, implementation="triton", **scales)
    want = jsparse.indexed_attention(q, k, v, idx, implementation="reference", **scales)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2
    )


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["far-above-0", "far-below-0"])
def test_logits_far_from_zero_stay_finite(interpret, sign):
    """Every split subtracts its running max and the merge the largest: logits of ±5000
    give a uniform softmax over the listed rows, not inf or an all-zero output."""
    b, h, hkv, d, s, n = 1, 4, 1, 16, 40, 300
    q = jnp.ones((b, h, d), jnp.float32)
    k = jnp.full((b, s, hkv, d), sign * 5000.0 / d, jnp.float32)
    v = jnp.asarray(np.random.default_rng(7).standard_normal((b, s, hkv, d)), jnp.float32)
    idx = jnp.asarray(np.random.default_rng(8).integers(0, s, (b, hkv, n)), jnp.int32)
    for splits in (1, 5):  # 5: the merge pads to 8 splits
        out, lse = attention_triton.indexed_attention_triton(
            q, k, v, idx, None, None, scale=1.0, splits=splits
        )
        want = np.mean(np.asarray(v)[0, np.asarray(idx)[0, 0], 0], axis=0)
        np.testing.assert_allclose(np.asarray(out)[0], np.broadcast_to(want, (h, d)), atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse), sign * 5000.0 + np.log(n), rtol=1e-6)


def test_fp8_caches_of_2_to_4_gib_are_refused_not_misread(monkeypatch):
    """Read byte by byte, Pallas Triton would address these with wrapping 32-bit offsets
    (run 163): the kernel refuses them, and ``implementation=None`` falls back to the
    reference."""
    monkeypatch.setattr(attention_triton, "FP8_AS_WORDS", False)
    sds = jax.ShapeDtypeStruct
    b, s, hkv, d = 24, 131072, 8, 128  # 3.2 GB of FP8 keys
    q, idx = sds((b, 32, d), jnp.bfloat16), sds((b, hkv, 2048), jnp.int32)
    k = sds((b, s, hkv, d), F8)
    scales = sds((b, hkv), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"indexed_attention: k \(24, 131072, 8, 128\)"):
        jax.eval_shape(
            lambda *a: attention_triton.indexed_attention_triton(*a, scale=0.1),
            q, k, k, idx, scales, scales,
        )  # fmt: skip
    with jsparse.backend.interpret_mode(True):
        out = jax.eval_shape(
            lambda *a: jsparse.indexed_attention(*a[:4], k_scale=a[4], v_scale=a[5]),
            q, k, k, idx, scales, scales,
        )  # fmt: skip
    assert out.shape == (b, 32, d)


def test_fp8_caches_of_2_to_4_gib_lower_as_words(monkeypatch):
    """Read as 16-bit words, the same caches are addressed correctly and lower."""
    monkeypatch.setattr(attention_triton, "FP8_AS_WORDS", True)
    sds = jax.ShapeDtypeStruct
    b, s, hkv, d = 24, 131072, 8, 128
    q, idx = sds((b, 32, d), jnp.bfloat16), sds((b, hkv, 2048), jnp.int32)
    k, scales = sds((b, s, hkv, d), F8), sds((b, hkv), jnp.float32)
    fn = lambda *a: attention_triton.indexed_attention_triton(*a, scale=0.1)  # noqa: E731
    assert "jsparse_indexed_attention" in lower_for_h200(fn, q, k, k, idx, scales, scales).as_text()


def test_offset_check_is_about_one_byte_operands_of_2_to_4_gib():
    check = jsparse.backend.check_triton_offsets
    sds = jax.ShapeDtypeStruct
    check("op", x=sds((2**31,), F8), y=sds((2**31 + 1,), jnp.bfloat16), z=sds((2**32 + 1,), F8))
    with pytest.raises(NotImplementedError, match=r"op: w \(2147483649,\) float8_e4m3fn"):
        check("op", w=sds((2**31 + 1,), F8))


def paged(cache, page_size):
    """The same slots in a shuffled pool with 3 pages of noise: (pool [n_pages, P, Hkv,
    X], table [B, M]); K and V pools of one cache share the table (the same seed)."""
    b, s = cache.shape[:2]
    flat = cache.reshape(b, s, -1)
    pool, _, table = shuffled_pages(flat, np.ones((b, s)), [s] * b, page_size, spare_pages=3)
    return pool.reshape(-1, page_size, *cache.shape[2:]), table


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_a_paged_cache_gives_the_dense_answer(kernel_impl, dtype, fp8_reading, page_lookup):
    if fp8_reading == "words" and dtype != "float8":
        pytest.skip("only FP8 caches are read as words")
    fp8 = dtype == "float8"
    q, k, v, idx = make(2, 6, 2, 40, 24, 64, 50, dtype=jnp.bfloat16, seed=10,
                        cache_dtype=F8 if fp8 else None)  # fmt: skip
    extra = {}
    if fp8:
        extra = dict(k_scale=jnp.full((2, 2), 0.5, jnp.float32), v_scale=jnp.full((2, 2), 2.0))
    (kp, table), (vp, _) = paged(k, 16), paged(v, 16)
    dense = jsparse.indexed_attention(q, k, v, idx, implementation="reference", **extra)
    for impl in ("reference", kernel_impl):
        got = jsparse.indexed_attention(q, kp, vp, idx, page_table=table, implementation=impl,
                                        **extra)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(dense, np.float32),
                                   rtol=1e-2, atol=1e-2)  # fmt: skip


def test_unallocated_pages_are_refused_or_never_read(kernel_impl, page_lookup):
    q, k, v, idx = make(2, 4, 2, 16, 16, 64, 40, seed=11)
    (kp, table), (vp, _) = paged(k, 16), paged(v, 16)
    table = table.at[1, 3].set(-1)  # positions 48-63 of sequence 1 have no page
    on_missing = (idx >= 48) & (jnp.arange(2)[:, None, None] == 1)
    bad = jnp.where(on_missing, -1, idx).at[1, 0, 5].set(50)
    with pytest.raises(ValueError, match=r"indices\[1, 0, 5\] = 50 lies on page 3 of sequence 1"):
        jsparse.indexed_attention(q, kp, vp, bad, page_table=table)
    with pytest.raises(ValueError, match=r"page_table\[0, 2\] = 11; expected -1 or a page"):
        jsparse.indexed_attention(q, kp, vp, idx, page_table=table.at[0, 2].set(11))
    run = jax.jit(
        lambda i: jsparse.indexed_attention(
            q, kp, vp, i, page_table=table, implementation=kernel_impl
        )
    )
    assert on_missing.any()
    np.testing.assert_array_equal(
        np.asarray(run(idx)), np.asarray(run(jnp.where(on_missing, -1, idx)))
    )


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_traced_pages_outside_the_pool_are_never_read(impl, kernel_impl, page_lookup):
    """Under jit a page table cannot be checked: an entry outside [-1, n_pages) is no
    page (a kernel would read outside the pool), the same answer as -1 there."""
    q, k, v, idx = make(2, 4, 2, 16, 16, 64, 40, seed=11)
    (kp, table), (vp, _) = paged(k, 16), paged(v, 16)
    n_pages = kp.shape[0]
    bad = table.at[1, 3].set(n_pages + 4).at[0, 1].set(-9)
    missing = table.at[1, 3].set(-1).at[0, 1].set(-1)
    name = "reference" if impl == "reference" else kernel_impl
    run = jax.jit(
        lambda t: jsparse.indexed_attention(
            q, kp, vp, idx, page_table=t, return_lse=True, implementation=name
        )
    )
    got, want = run(bad), run(missing)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_paged_step_launches_nothing_before_the_kernel(monkeypatch):
    """A traced page table's entries outside the pool are masked where the kernel loads
    them: in XLA that mask was a launch of its own before the kernel (1 µs a step)."""
    monkeypatch.setattr(jsparse.backend, "has_nvidia_gpu", lambda: True)
    monkeypatch.setattr(attention_triton, "PAGES_BEFORE_LAUNCH", False)
    sds = jax.ShapeDtypeStruct
    pool = sds((256, 64, 8, 128), jnp.bfloat16)
    args = (sds((4, 32, 128), jnp.bfloat16), pool, pool, sds((4, 8, 512), jnp.int32),
            sds((4, 64), jnp.int32))  # fmt: skip

    def step(q, k, v, idx, table):
        return jsparse.indexed_attention(q, k, v, idx, page_table=table, implementation="triton")

    text = lower_for_h200(step, *args).as_text()
    before = text[: text.index("stablehlo.custom_call")]
    assert set(re.findall(r"stablehlo\.([a-z_]+)", before)) <= {"reshape"}


def test_paged_lowers_to_cuda(page_lookup):
    sds = jax.ShapeDtypeStruct
    pool = sds((4096, 16, 8, 128), jnp.bfloat16)
    args = [sds((8, 32, 128), jnp.bfloat16), pool, pool, sds((8, 8, 2048), jnp.int32),
            sds((8, 2048), jnp.int32)]  # fmt: skip

    def fn(q, k, v, idx, table):
        return attention_triton.indexed_attention_triton(
            q, k, v, idx, None, None, scale=0.1, page_table=table
        )

    assert "jsparse_indexed_attention" in lower_for_h200(fn, *args).as_text()


@pytest.mark.gpu
def test_gpu_paged_decode_shapes(page_lookup):
    """8 sequences × 32K in pages of 16 tokens, 32 / 8 heads, D 128, 2048 rows each."""
    b, s, h, hkv, d, n = 8, 32768, 32, 8, 128, 2048
    kq, kk, kv, ki = jax.random.split(jax.random.PRNGKey(6), 4)
    q = jax.random.normal(kq, (b, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    idx = jax.random.randint(ki, (b, hkv, n), -1, s, jnp.int32)
    (kp, table), (vp, _) = paged(k, 16), paged(v, 16)
    run = lambda impl: jsparse.indexed_attention(  # noqa: E731
        q, kp, vp, idx, page_table=table, implementation=impl
    )
    np.testing.assert_allclose(
        np.asarray(run("triton"), np.float32), np.asarray(run("reference"), np.float32),
        rtol=3e-2, atol=3e-2,
    )  # fmt: skip


def test_three_bf16_terms_carry_an_f32_value():
    """An f32 q over a bf16 cache enters bf16 dots as three bf16 terms: their sum misses
    the f32 value by at most 2^-24 of it, over f32's whole normal range."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal(4096) * np.exp2(rng.integers(-100, 100, 4096))
    x = jnp.asarray(x, jnp.float32)
    terms = attention_triton.bf16_terms(x, 3)
    assert all(t.dtype == jnp.bfloat16 for t in terms)
    total = sum(np.asarray(t, np.float64) for t in terms)
    assert np.all(np.abs(total - np.asarray(x, np.float64)) <= 2.0**-24 * np.abs(np.asarray(x)))
    two = sum(np.asarray(t, np.float64) for t in terms[:2])  # two would not do
    assert np.max(np.abs(two - np.asarray(x, np.float64)) / np.abs(np.asarray(x))) > 2.0**-20
