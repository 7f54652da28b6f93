"""Indexed MLA decode attention: the kernel against the jnp reference, the reference
against a float64 numpy oracle, and the contract (empty slots, bad input, lowering)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.ops.attention import triton as attention_triton
from jsparse.ops.mla import triton as mla_triton
from jsparse.testing import lower_for_h200
from tests.ops.decode_dtypes import DECODE_DTYPES
from tests.paging import shuffled_pages

F8 = jnp.float8_e4m3fn


def make(b, h, dc, dr, s, n, dtype=jnp.float32, seed=0, cache_dtype=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, dc + dr)).astype(np.float32)
    cache = rng.standard_normal((b, s, dc + dr)).astype(np.float32)
    idx = rng.integers(-1, s, (b, n)).astype(np.int32)  # duplicates and empties
    cache_dtype = cache_dtype or dtype
    return jnp.asarray(q, dtype), jnp.asarray(cache, cache_dtype), jnp.asarray(idx)


def oracle(q, cache, idx, dc, scale, cache_scale=None):
    """float64 loops: each head over its sequence's listed rows; values = latents."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    cache = np.asarray(cache.astype(jnp.float32), np.float64)
    idx = np.asarray(idx)
    b, h, _ = q.shape
    out, lse = np.zeros((b, h, dc)), np.full((b, h), -np.inf)
    for bi in range(b):
        rows = [int(j) for j in idx[bi] if j >= 0]
        if not rows:
            continue
        cs = 1.0 if cache_scale is None else float(cache_scale[bi])
        for hi in range(h):
            logits = np.array([scale * cs * q[bi, hi] @ cache[bi, j] for j in rows])
            top = logits.max()
            p = np.exp(logits - top)
            values = sum(pj * cache[bi, j, :dc] for pj, j in zip(p, rows, strict=True))
            out[bi, hi] = cs * values / p.sum()
            lse[bi, hi] = top + math.log(p.sum())
    return out, lse


SHAPES = {
    # b, h, dc, dr, s, n
    "odd": (2, 6, 40, 8, 53, 37),  # Dc and the list not powers of two
    "two-blocks": (1, 40, 64, 16, 90, 70),  # 40 heads: two head blocks of 32, one padded
    "no-rope": (3, 4, 32, 0, 20, 33),  # Dr = 0
    "odd-rope": (2, 6, 40, 7, 53, 37),  # an odd row: FP8 read byte by byte, not in words
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_matches_numpy_oracle(shape):
    dc = SHAPES[shape][2]
    q, cache, idx = make(*SHAPES[shape])
    idx = idx.at[0].set(-1)  # one list entirely empty
    out, lse = jsparse.indexed_mla_attention(
        q, cache, idx, scale=0.2, latent_dim=dc, return_lse=True, implementation="reference"
    )
    want_out, want_lse = oracle(q, cache, idx, dc, 0.2)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(out)[0] == 0) and np.all(np.asarray(lse)[0] == -np.inf)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_reference(kernel_impl, shape, decode_dtypes, fp8_reading):
    dtype = decode_dtypes.name
    if fp8_reading == "bytes" and dtype != "float8":
        pytest.skip("only FP8 caches are read as words or bytes")
    b, h, dc = SHAPES[shape][:3]
    q, cache, idx = make(*SHAPES[shape], dtype=decode_dtypes.q, seed=1,
                         cache_dtype=decode_dtypes.cache)  # fmt: skip
    idx = idx.at[-1].set(-1)  # one list empty: zeros and an lse of -inf
    extra = {}
    if dtype == "float8":
        extra["cache_scale"] = jnp.asarray(np.random.default_rng(2).uniform(0.5, 2, b), jnp.float32)
    run = lambda impl: jsparse.indexed_mla_attention(  # noqa: E731
        q, cache, idx, scale=0.15, latent_dim=dc, return_lse=True, implementation=impl, **extra
    )
    (out, lse), (ref, ref_lse) = run(kernel_impl), run("reference")
    assert out.dtype == q.dtype and out.shape == (b, h, dc) and lse.dtype == jnp.float32
    tol = decode_dtypes.tol
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol
    )
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)


@pytest.mark.parametrize("fp8_dot", ["float16", "bfloat16"])
@pytest.mark.parametrize("magnitude", [1e6, 1e-7])
def test_fp8_cache_with_q_beyond_f16s_range(kernel_impl, fp8_dot, magnitude, monkeypatch):
    """Over an FP8 cache a bf16 q is rescaled per head into f16 (the default dots'
    dtype): a q of magnitude 1e6 (past f16's 65504) or 1e-7 (among its subnormals)
    gives the reference's answer, as with bf16 dots."""
    monkeypatch.setattr(mla_triton, "FP8_DOT_DTYPE", fp8_dot)
    b, h, dc, dr, s, n = 2, 20, 40, 8, 60, 33
    q, cache, idx = make(b, h, dc, dr, s, n, seed=5, cache_dtype=F8)
    q = (q * magnitude).astype(jnp.bfloat16)
    run = lambda impl: jsparse.indexed_mla_attention(  # noqa: E731
        q, cache, idx, scale=0.3 / magnitude, latent_dim=dc, return_lse=True,
        cache_scale=jnp.asarray([0.5, 2.0], jnp.float32), implementation=impl,
    )  # fmt: skip
    (out, lse), (ref, ref_lse) = run(kernel_impl), run("reference")
    tol = DECODE_DTYPES["float8"][2]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)  # fmt: skip
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=tol, atol=tol)


def test_splits_and_tiles_give_the_same_answer(interpret):
    q, cache, idx = make(1, 20, 64, 16, 300, 130, seed=3)
    run = lambda splits, cfg=None: mla_triton.indexed_mla_attention_triton(  # noqa: E731
        q, cache, idx, None, latent_dim=64, scale=0.1, splits=splits, cfg=cfg
    )
    one, lse1 = run(1)
    for splits, cfg in [(3, None), (5, None), (2, mla_triton.MLAConfig(block_n=16, block_h=16))]:
        out, lse = run(splits, cfg)
        np.testing.assert_allclose(np.asarray(out), np.asarray(one), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [16, 32])
def test_merge_value_blocks_give_the_same_answer(interpret, monkeypatch, block):
    """The merge weighting blocks of a head's latent values gives the whole row's
    answer, bit for bit (per value the same sums), FP8 scales included."""
    q, cache, idx = make(2, 20, 64, 16, 300, 130, seed=6, cache_dtype=F8)
    cache_scale = jnp.asarray([0.5, 2.0], jnp.float32)
    run = lambda: mla_triton.indexed_mla_attention_triton(  # noqa: E731
        q, cache, idx, cache_scale, latent_dim=64, scale=0.1, splits=3
    )
    want, want_lse = run()
    monkeypatch.setattr(attention_triton, "MERGE_VDIM_BLOCK", block)
    got, got_lse = run()  # read at call time: not a cached trace
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(want_lse))


@pytest.mark.parametrize("b, blocks", [(1, 4), (8, 1)])
def test_merge_value_blocks_only_within_one_wave(b, blocks):
    """DeepSeek's 128 heads: one sequence's merge has 128 (pair, head) programs, one
    wave, and takes 4 blocks of 128 values each (run 185: −1.7 µs); 8 sequences' 1024
    programs already fill the GPU and keep whole rows (blocks cost +2.7 µs there)."""
    sds = jax.ShapeDtypeStruct
    shapes = [sds((b, 128, 576), jnp.bfloat16), sds((b, 4096, 576), jnp.bfloat16),
              sds((b, 2048), jnp.int32)]  # fmt: skip

    def fn(q, c, i):
        return mla_triton.indexed_mla_attention_triton(q, c, i, None, latent_dim=512, scale=0.1)

    calls = lower_for_h200(fn, *shapes).as_text().split("stablehlo.custom_call")
    (merge,) = [c for c in calls if 'name = "jsparse_indexed_mla_attention_merge"' in c]
    assert f"grid_z = {blocks} : i32" in merge


@pytest.mark.parametrize("block", [8, 24, 128.0])
def test_merge_value_block_must_be_a_power_of_two(monkeypatch, block):
    q, cache, idx = make(1, 4, 32, 8, 50, 20)
    monkeypatch.setattr(attention_triton, "MERGE_VDIM_BLOCK", block)
    with pytest.raises(ValueError, match="MERGE_VDIM_BLOCK"):
        mla_triton.indexed_mla_attention_triton(q, cache, idx, None, latent_dim=32, scale=0.1)


def test_every_row_listed_is_dense_mla(kernel_impl):
    """Every cache row listed: plain softmax attention with keys [c; k_r], values c."""
    b, h, dc, dr, s = 2, 16, 32, 16, 45
    q, cache, _ = make(b, h, dc, dr, s, 1, seed=4)
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    got = jsparse.indexed_mla_attention(q, cache, idx, scale=0.125, latent_dim=dc,
                                        implementation=kernel_impl)  # fmt: skip
    logits = jnp.einsum("bhd,bsd->bhs", q, cache, precision="highest") * 0.125
    want = jnp.einsum("bhs,bsc->bhc", jax.nn.softmax(logits, -1), cache[..., :dc],
                      precision="highest")  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_out_of_range_entries_under_jit_are_never_read(kernel_impl):
    q, cache, idx = make(*SHAPES["odd"], seed=6)
    s = cache.shape[1]
    bad = idx.at[:, ::5].set(s + 7).at[:, 1::7].set(-9)
    cleaned = jnp.where((bad >= 0) & (bad < s), bad, -1)
    run = jax.jit(lambda i: jsparse.indexed_mla_attention(
        q, cache, i, scale=0.2, latent_dim=40, implementation=kernel_impl))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(run(bad)), np.asarray(run(cleaned)))


@pytest.mark.parametrize("path", ["reference", "kernel", "kernel-merged"])
def test_non_finite_rows_reach_only_the_lists_naming_them(path, kernel_impl):
    """Row 0 (where empty slots point) is NaN and listed by no one: a list with empty
    slots stays finite and an empty list zeros / -inf; a listed row with a NaN RoPE key
    makes its sequence's outputs and lse NaN (not zeros and -inf)."""
    q, cache, _ = make(3, 4, 16, 8, 20, 1, seed=9)
    cache = cache.at[:, 0].set(jnp.nan).at[1, 5, 20].set(jnp.nan)
    idx = jnp.asarray([[3, -1, 7, -1, 9, 2], [5, 4, -1, 6, -1, -1], [-1] * 6], jnp.int32)
    if path == "reference":
        out, lse = jsparse.indexed_mla_attention(
            q, cache, idx, scale=0.3, latent_dim=16, return_lse=True, implementation="reference"
        )
    else:
        splits = 3 if path == "kernel-merged" else 1
        out, lse = mla_triton.indexed_mla_attention_triton(
            q, cache, idx, None, latent_dim=16, scale=0.3, splits=splits
        )
    want_out, want_lse = oracle(q, cache, idx, 16, 0.3)
    assert np.isnan(want_lse[1]).all() and np.isfinite(want_out[0]).all()
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n, s", [(0, 10), (5, 0)], ids=["no-entries", "no-cache"])
def test_nothing_to_attend_gives_zeros(n, s):
    q, cache, _ = make(2, 4, 16, 8, max(s, 1), 1)
    idx = jnp.full((2, n), -1, jnp.int32)
    out, lse = jsparse.indexed_mla_attention(
        q, cache[:, :s], idx, scale=0.3, latent_dim=16, return_lse=True
    )
    assert out.shape == (2, 4, 16) and np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(lse) == -np.inf)


@pytest.mark.parametrize("pages, columns", [(3, 0), (0, 2)], ids=["no-columns", "empty-pool"])
def test_a_page_table_that_reaches_no_key_gives_zeros(kernel_impl, pages, columns):
    q = jnp.ones((1, 2, 8), jnp.float32)
    out, lse = jsparse.indexed_mla_attention(
        q, jnp.zeros((pages, 4, 8), jnp.float32), jnp.full((1, 2), -1, jnp.int32), scale=0.2,
        latent_dim=4, page_table=jnp.full((1, columns), -1, jnp.int32), return_lse=True,
        implementation=kernel_impl,
    )  # fmt: skip
    assert out.shape == (1, 2, 4) and np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(lse) == -np.inf)


def _bad_inputs():
    q, cache, idx = make(2, 6, 16, 8, 30, 5)
    # fmt: off
    return [
        ("rank", dict(q=q[0]), r"q: expected rank 3"),
        ("cache rank", dict(cache=cache[:, :, None]), r"cache: expected rank 3"),
        ("q dtype", dict(q=q.astype(jnp.int32)), r"q: dtype int32"),
        ("wider", dict(q=q.astype(jnp.bfloat16)), r"cache: dtype float32 with q bfloat16"),
        ("index dtype", dict(indices=idx.astype(jnp.int16)), r"indices: dtype int16"),
        ("index rank", dict(indices=idx[:, None]), r"indices: expected rank 2"),
        ("batch", dict(cache=cache[:1]), r"cache: axis 0 of shape \(1, 30, 24\) is 1; expected 2"),
        ("row width", dict(cache=cache[..., :20]), r"cache: axis 2 .* expected 24"),
        ("list batch", dict(indices=idx[:1]), r"indices: axis 0 .* expected 2"),
        ("latent_dim", dict(latent_dim=25),
         r"latent_dim: got 25; expected an int in \[1, D = 24\]"),
        ("latent_dim 0", dict(latent_dim=0), r"latent_dim: got 0"),
        ("beyond S", dict(indices=idx.at[1, 3].set(30)),
         r"indices: indices\[1, 3\] = 30 is outside \[0, S\) = \[0, 30\)"),
        ("below -1", dict(indices=idx.at[0, 0].set(-2)), r"indices\[0, 0\] = -2"),
        ("scale", dict(scale=float("inf")), r"scale: got inf"),
        ("scale type", dict(scale=jnp.float32(0.5)), r"scale: got Array"),
        ("cache_scale rank", dict(cache_scale=jnp.ones((2, 1), jnp.float32)),
         r"cache_scale: expected rank 1"),
        ("cache_scale value", dict(cache_scale=jnp.asarray([1.0, -1.0], jnp.float32)),
         r"cache_scale: cache_scale\[1\] = -1.0; expected finite and > 0"),
    ], dict(q=q, cache=cache, indices=idx, scale=0.25, latent_dim=16)
    # fmt: on


@pytest.mark.parametrize("case", [c[0] for c in _bad_inputs()[0]])
def test_bad_input_names_the_argument(case):
    cases, good = _bad_inputs()
    _, change, message = next(c for c in cases if c[0] == case)
    args = {**good, **change}
    q, cache, idx = args.pop("q"), args.pop("cache"), args.pop("indices")
    with pytest.raises(ValueError, match=message):
        jsparse.indexed_mla_attention(q, cache, idx, **args)


def test_config_is_checked():
    with pytest.raises(ValueError, match="block_h must be a power of two ≥ 16, got 24"):
        mla_triton.MLAConfig(block_h=24)


PAIRS = [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32), (jnp.bfloat16, F8),
         (jnp.float32, jnp.bfloat16)]  # fmt: skip


@pytest.mark.parametrize("qdt, cdt", PAIRS, ids=["bf16", "f32", "fp8", "f32-over-bf16"])
@pytest.mark.parametrize(
    "shape", [(4, 128, 512, 64, 4096, 2048), (2, 20, 40, 8, 300, 100), (2, 20, 40, 7, 300, 100)]
)
def test_lowers_to_cuda(qdt, cdt, shape):
    b, h, dc, dr, s, n = shape
    sds = jax.ShapeDtypeStruct
    args = [sds((b, h, dc + dr), qdt), sds((b, s, dc + dr), cdt), sds((b, n), jnp.int32)]
    scale = [sds((b,), jnp.float32)] if cdt == F8 else []
    for splits in (None, 1, 5):  # the default; in place; a merge of a non-power-of-2 count

        def fn(q, c, i, *sc, splits=splits):
            return mla_triton.indexed_mla_attention_triton(
                q, c, i, sc[0] if sc else None, latent_dim=dc, scale=0.1, splits=splits
            )

        lowered = lower_for_h200(fn, *args, *scale)
        assert "jsparse_indexed_mla_attention" in lowered.as_text()


def test_merge_value_blocks_lower_to_cuda(monkeypatch):
    """DeepSeek's 512 latent values merged in blocks of 128: a 3-D merge grid."""
    monkeypatch.setattr(attention_triton, "MERGE_VDIM_BLOCK", 128)
    sds = jax.ShapeDtypeStruct
    args = [sds((1, 128, 576), jnp.bfloat16), sds((1, 4096, 576), jnp.bfloat16),
            sds((1, 2048), jnp.int32)]  # fmt: skip

    def fn(q, c, i):
        return mla_triton.indexed_mla_attention_triton(q, c, i, None, latent_dim=512, scale=0.1)

    assert "jsparse_indexed_mla_attention_merge" in lower_for_h200(fn, *args).as_text()


def test_fp8_caches_of_2_to_4_gib(monkeypatch):
    """A DeepSeek FP8 cache of 128 × 32K rows (2.4 GB) is read as 16-bit words and
    lowers even with bytes asked for; an odd row width (read byte by byte) of that size
    is refused, not misread."""
    monkeypatch.setattr(mla_triton, "FP8_AS_WORDS", False)
    sds = jax.ShapeDtypeStruct
    q, idx = sds((128, 16, 576), jnp.bfloat16), sds((128, 2048), jnp.int32)
    big = sds((128, 32768, 576), F8)

    def fn(q, c, i, cs, dc=512):
        return mla_triton.indexed_mla_attention_triton(q, c, i, cs, latent_dim=dc, scale=0.1)

    lowered = lower_for_h200(fn, q, big, idx, sds((128,), jnp.float32))
    assert "jsparse_indexed_mla_attention" in lowered.as_text()
    odd = sds((128, 32768, 577), F8)
    with pytest.raises(NotImplementedError, match=r"cache \(4194304, 577\) float8_e4m3fn"):
        jax.eval_shape(
            functools.partial(fn, dc=513), sds((128, 16, 577), jnp.bfloat16), odd, idx,
            sds((128,), jnp.float32),
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("merge_block", [None, 128])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("b, h", [(1, 128), (16, 16)])
def test_gpu_deepseek_shapes(b, h, cache, merge_block, monkeypatch):
    """DeepSeek-V3 MLA (Dc 512, Dr 64), 64K context, 2048 listed rows; the merge over
    whole rows and over blocks of 128 latent values."""
    monkeypatch.setattr(attention_triton, "MERGE_VDIM_BLOCK", merge_block)
    s, n, dc = 65536, 2048, 512
    kq, kc, ki = jax.random.split(jax.random.PRNGKey(b), 3)
    q = jax.random.normal(kq, (b, h, dc + 64), jnp.bfloat16)
    c = jax.random.normal(kc, (b, s, dc + 64), jnp.bfloat16)
    idx = jax.random.randint(ki, (b, n), -1, s, jnp.int32)
    extra = {}
    if cache == "fp8":
        c, extra = (c * 4).astype(F8), dict(cache_scale=jnp.full((b,), 0.25, jnp.float32))
    run = lambda impl: jsparse.indexed_mla_attention(  # noqa: E731
        q, c, idx, scale=192**-0.5, latent_dim=dc, implementation=impl, **extra
    )
    np.testing.assert_allclose(
        np.asarray(run("triton"), np.float32), np.asarray(run("reference"), np.float32),
        rtol=3e-2, atol=3e-2,
    )  # fmt: skip


def paged(cache, page_size):
    """The same rows in a shuffled pool with 3 pages of noise: (pool [n_pages, P, D],
    table [B, M])."""
    b, s = cache.shape[:2]
    pool, _, table = shuffled_pages(cache, np.ones((b, s)), [s] * b, page_size, spare_pages=3)
    return pool, table


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_a_paged_cache_gives_the_dense_answer(kernel_impl, dtype, fp8_reading, page_lookup):
    if fp8_reading == "bytes" and dtype != "float8":
        pytest.skip("only FP8 caches are read as words or bytes")
    fp8 = dtype == "float8"
    q, cache, idx = make(2, 20, 40, 8, 64, 50, dtype=jnp.bfloat16, seed=8,
                         cache_dtype=F8 if fp8 else None)  # fmt: skip
    extra = {"cache_scale": jnp.asarray([0.5, 2.0], jnp.float32)} if fp8 else {}
    pool, table = paged(cache, 16)
    run = lambda impl, **kw: jsparse.indexed_mla_attention(  # noqa: E731
        q, kw.pop("cache", cache), idx, scale=0.2, latent_dim=40, implementation=impl,
        **extra, **kw,
    )  # fmt: skip
    dense = run("reference")
    for impl in ("reference", kernel_impl):
        got = run(impl, cache=pool, page_table=table)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(dense, np.float32),
                                   rtol=1e-2, atol=1e-2)  # fmt: skip


def test_unallocated_pages_are_refused_or_never_read(kernel_impl, page_lookup):
    q, cache, idx = make(2, 16, 32, 8, 64, 40, seed=9)
    pool, table = paged(cache, 16)
    table = table.at[1, 3].set(-1)  # positions 48-63 of sequence 1 have no page
    on_missing = (idx >= 48) & (jnp.arange(2)[:, None] == 1)
    bad = jnp.where(on_missing, -1, idx).at[1, 5].set(50)
    with pytest.raises(ValueError, match=r"indices\[1, 5\] = 50 lies on page 3 of sequence 1"):
        jsparse.indexed_mla_attention(q, pool, bad, scale=0.2, latent_dim=32, page_table=table)
    with pytest.raises(ValueError, match=r"page_table\[0, 2\] = 11; expected -1 or a page"):
        jsparse.indexed_mla_attention(q, pool, idx, scale=0.2, latent_dim=32,
                                      page_table=table.at[0, 2].set(11))  # fmt: skip
    run = jax.jit(
        lambda i: jsparse.indexed_mla_attention(
            q, pool, i, scale=0.2, latent_dim=32, page_table=table, implementation=kernel_impl
        )
    )
    assert on_missing.any()
    np.testing.assert_array_equal(
        np.asarray(run(idx)), np.asarray(run(jnp.where(on_missing, -1, idx)))
    )


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_traced_pages_outside_the_pool_are_never_read(impl, kernel_impl, page_lookup):
    """Under jit: a page table entry outside [-1, n_pages) is no page, as -1 is."""
    q, cache, idx = make(2, 16, 32, 8, 64, 40, seed=9)
    pool, table = paged(cache, 16)
    bad = table.at[1, 3].set(pool.shape[0] + 4).at[0, 1].set(-9)
    missing = table.at[1, 3].set(-1).at[0, 1].set(-1)
    name = "reference" if impl == "reference" else kernel_impl
    run = jax.jit(lambda t: jsparse.indexed_mla_attention(
        q, pool, idx, scale=0.2, latent_dim=32, page_table=t, return_lse=True,
        implementation=name))  # fmt: skip
    got, want = run(bad), run(missing)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_paged_lowers_to_cuda(page_lookup):
    sds = jax.ShapeDtypeStruct
    args = [sds((8, 128, 576), jnp.bfloat16), sds((4096, 64, 576), F8), sds((8, 2048), jnp.int32),
            sds((8,), jnp.float32), sds((8, 512), jnp.int32)]  # fmt: skip

    def fn(q, pool, idx, cs, table):
        return mla_triton.indexed_mla_attention_triton(
            q, pool, idx, cs, latent_dim=512, scale=0.1, page_table=table
        )

    assert "jsparse_indexed_mla_attention" in lower_for_h200(fn, *args).as_text()


@pytest.mark.gpu
def test_gpu_paged_deepseek_shapes(page_lookup):
    """8 sequences × 32K in pages of 64 rows (FlashMLA's block), 128 heads, 2048 rows."""
    b, s, n, dc = 8, 32768, 2048, 512
    kq, kc, ki = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(kq, (b, 128, dc + 64), jnp.bfloat16)
    cache = jax.random.normal(kc, (b, s, dc + 64), jnp.bfloat16)
    idx = jax.random.randint(ki, (b, n), -1, s, jnp.int32)
    pool, table = paged(cache, 64)
    run = lambda impl: jsparse.indexed_mla_attention(  # noqa: E731
        q, pool, idx, scale=192**-0.5, latent_dim=dc, page_table=table, implementation=impl
    )
    np.testing.assert_allclose(
        np.asarray(run("triton"), np.float32), np.asarray(run("reference"), np.float32),
        rtol=3e-2, atol=3e-2,
    )  # fmt: skip
