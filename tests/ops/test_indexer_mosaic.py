"""The Mosaic GPU scorer: interpreted on the CPU, cross-lowered to CUDA, and on a GPU.

Error bound used throughout. bf16 and e4m3 values have at most 8 significant bits, so
every product q·k is exact in f32 and the kernel and the reference differ only in the
order of their f32 additions (over D inside the wgmma, then over H after the relu).
Summing n terms in f32 in any order is off by at most about n·u·Σ|terms| (u = 2⁻²⁴);
relu and the weights do not enlarge that, so per score

    |kernel - reference| ≤ (D + H) · u · k_scale · Σ_h |w_h| Σ_d |q_hd k_d|

and the tests assert it with a factor 2 of slack (both sides round). On the GPU the
tensor cores' own accumulation is looser for fp8 (see ``GPU_UNIT_ROUNDOFF``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.ops.indexer import mosaic
from jsparse.testing import lower_for_h200, topk_mismatches
from tests.paging import shuffled_pages

FP8 = jnp.float8_e4m3fn
DTYPES = {"bf16": jnp.bfloat16, "fp8": FP8}
F32_UNIT_ROUNDOFF = 2.0**-24
# Hopper's FP8 MMA keeps only about 14 bits while it accumulates (DeepSeek-V3 report,
# §3.3.2); bf16 MMA accumulates in f32. Not yet checked on our H200.
GPU_UNIT_ROUNDOFF = {"bf16": 2.0**-22, "fp8": 2.0**-13}


def unit_roundoff(dtype: str) -> float:
    """The bound's unit for this run: the tensor cores' when compiled on a GPU (the
    ``mosaic_interpret`` fixture), f32's when interpreted."""
    return GPU_UNIT_ROUNDOFF[dtype] if backend.has_nvidia_gpu() else F32_UNIT_ROUNDOFF


@pytest.fixture
def mosaic_interpret():
    """Compiled on a GPU, interpreted (Mosaic GPU and Triton interpreters) elsewhere."""
    if backend.has_nvidia_gpu():
        yield
    else:
        with backend.interpret_mode(True):
            yield


def make_inputs(t, h, d, s, dtype, *, ranges, scale, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    k = rng.standard_normal((s, d)).astype(np.float32)
    w = rng.standard_normal((t, h)).astype(np.float32)
    if ranges == "all":
        start, end = np.zeros(t, np.int32), np.full(t, s, np.int32)
    elif ranges == "causal":  # chunked prefill: the last t of s positions
        start, end = np.zeros(t, np.int32), np.arange(s - t + 1, s + 1, dtype=np.int32)
    else:  # odd: arbitrary ranges, one empty, one a single key, one ending mid-tile
        start = rng.integers(0, s, t).astype(np.int32)
        end = np.minimum(s, start + rng.integers(0, s, t)).astype(np.int32)
        start[0], end[0] = 3, 3
        start[1 % t], end[1 % t] = s - 1, s
    return dict(
        q=jnp.asarray(q, dtype),
        weights=jnp.asarray(w),
        k=jnp.asarray(k, dtype),
        k_scale=jnp.asarray(rng.uniform(0.25, 4.0, s), jnp.float32) if scale else None,
        kv_start=jnp.asarray(start),
        kv_end=jnp.asarray(end),
    )


def error_bound(x, unit_roundoff, *, keys="k", spec="th,thd,sd->ts"):
    """[T, S] bound on the summation-order error of each score (module docstring); a
    batch's [B, S_max] with ``keys="k_cache"`` and its own einsum ``spec``."""
    q = np.abs(np.asarray(x["q"].astype(jnp.float32), np.float64))
    k = np.abs(np.asarray(x[keys].astype(jnp.float32), np.float64))
    w = np.abs(np.asarray(x["weights"], np.float64))
    magnitude = np.einsum(spec, w, q, k)
    if x["k_scale"] is not None:
        magnitude = magnitude * np.asarray(x["k_scale"], np.float64)  # [S] or [B, S]
    _, h, d = q.shape
    return 2.0 * (d + h) * unit_roundoff * magnitude


def assert_scores_close(got, want, bound):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))  # same visibility
    fin = np.isfinite(want)
    assert np.all(np.isfinite(got[fin]))
    excess = np.abs(got[fin] - want[fin]) - bound[fin]
    assert np.all(excess <= 0), f"worst excess over the bound: {excess.max():.3g}"


# (name, T, H, D, S, ranges, k_scale): odd T (a padded query row) and S (a padded key
# tile), a block whose queries see nothing, H = 12 (padded to 16), D = 64 and 128.
CASES = [
    ("odd", 5, 64, 64, 300, "odd", True),
    ("causal", 6, 16, 128, 520, "causal", False),
    ("all-h12", 4, 12, 64, 256, "all", True),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_scores_match_reference(case, dtype, mosaic_interpret):
    _, t, h, d, s, ranges, scale = case
    x = make_inputs(t, h, d, s, DTYPES[dtype], ranges=ranges, scale=scale)
    got = jsparse.indexer_scores(**x, implementation="mosaic")
    want = jsparse.indexer_scores(**x, implementation="reference")
    assert_scores_close(got, want, error_bound(x, unit_roundoff(dtype)))


def test_block_sizes_and_pipeline_depth(mosaic_interpret):
    """Other tiles give the same scores: BT = 1 and 3, BS = 64, a single-buffered pipeline,
    key tiles split over several CTAs."""
    x = make_inputs(7, 16, 64, 200, FP8, ranges="odd", scale=True, seed=4)
    want = jsparse.indexer_scores(**x, implementation="reference")
    bound = error_bound(x, unit_roundoff("fp8"))
    args = (x["q"], x["weights"], x["k"], x["k_scale"], x["kv_start"], x["kv_end"])
    for cfg in (
        mosaic.MosaicScorerConfig(block_t=1, block_s=64, max_concurrent_steps=1),
        mosaic.MosaicScorerConfig(block_t=3, block_s=128, max_concurrent_steps=2),
        # 4 key tiles over 3 CTAs a block (runs of 2, 2, 0): visible and filled tiles
        # in every run, and a CTA with no tile at all
        mosaic.MosaicScorerConfig(block_t=2, block_s=64, max_concurrent_steps=2, key_splits=3),
    ):
        assert_scores_close(mosaic.indexer_scores_mosaic(*args, cfg=cfg), want, bound)


def test_topk_base_matches_reference_id_for_id(mosaic_interpret):
    t, s, top_k = 6, 700, 50
    x = make_inputs(t, 64, 64, s, FP8, ranges="causal", scale=True, seed=5)
    got = jsparse.indexer_topk(**x, top_k=top_k, implementation="mosaic")
    want = jsparse.indexer_topk(**x, top_k=top_k, implementation="reference")
    # Scores agree to within the bound, so the ids may differ only where two scores are
    # closer than it: compare tie-robustly against the reference scores.
    oracle = np.asarray(jsparse.indexer_scores(**x, implementation="reference"), np.float64)
    atol = float(np.max(error_bound(x, unit_roundoff("fp8"))))
    problems = topk_mismatches(got.indices, got.scores, oracle, top_k, atol)
    assert not problems, "\n".join(problems[:10])
    # Gaussian data has no near-ties at this size: the answer is the reference's, id for id.
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
    np.testing.assert_array_equal(np.asarray(got.visible), np.asarray(want.visible))


def block_table_oracle(start, end, s, bt, bs):
    """Independent numpy construction of the prologue's meta rows and visible counts."""
    t = len(start)
    start = np.clip(start, 0, s)
    end = np.clip(end, start, s)
    n_blocks = -(-t // bt)
    meta = np.zeros((n_blocks, 32), np.int64)
    for b in range(n_blocks):
        rows = range(b * bt, min(t, (b + 1) * bt))
        seen = [r for r in rows if end[r] > start[r]]
        if seen:
            lo, hi = min(start[r] for r in seen), max(end[r] for r in seen)
            meta[b, 0], meta[b, 1] = lo // bs, -(-hi // bs) - lo // bs
        for j, r in enumerate(rows):
            meta[b, 2 + j], meta[b, 2 + bt + j] = start[r], end[r]
    return meta, end - start


@pytest.mark.parametrize("bt", [1, 2, 3])
def test_prologue_block_table_and_report(bt, mosaic_interpret):
    """The one-launch prologue: each block's visible tiles and ranges (clamped as the
    reference clamps traced ranges: negative starts, ends past S, ends before starts)
    over several of its programs, and the ``base`` report of every query."""
    rng = np.random.default_rng(bt)
    t, s, bs = 301, 1000, 64  # 301 / BT blocks: many programs, the last one part-filled
    start = rng.integers(-50, s + 50, t).astype(np.int32)
    end = (start + rng.integers(-20, 400, t)).astype(np.int32)
    start[:4], end[:4] = [0, -3, 990, 5], [0, 2000, 1000, 4]
    cfg = mosaic.MosaicScorerConfig(block_t=bt, block_s=bs)
    t_pad = -(-t // bt) * bt
    meta, report = mosaic._prologue(
        jnp.asarray(start), jnp.asarray(end), s, t_pad, cfg, backend.is_interpret()
    )
    want_meta, visible = block_table_oracle(start.astype(np.int64), end.astype(np.int64), s, bt, bs)
    np.testing.assert_array_equal(np.asarray(meta), want_meta)
    for field in report[:3]:
        np.testing.assert_array_equal(np.asarray(field), visible)
    assert np.all(np.isneginf(np.asarray(report[3]))) and not np.any(np.asarray(report[4]))


def test_traced_ranges_outside_the_keys_are_clamped(mosaic_interpret):
    """Under ``jit`` ranges are not checked: ``mosaic`` reads them clamped, as the
    reference does, for the scores, the Top-K and its report."""
    t, s, top_k = 4, 300, 20
    x = make_inputs(t, 16, 64, s, jnp.bfloat16, ranges="all", scale=False, seed=8)
    x["kv_start"] = jnp.asarray([-7, 250, 100, 0], jnp.int32)
    x["kv_end"] = jnp.asarray([40, 900, 90, 300], jnp.int32)  # row 2 ends before it starts

    def run(impl):
        scores = jax.jit(functools.partial(jsparse.indexer_scores, implementation=impl))(**x)
        topk = jax.jit(functools.partial(jsparse.indexer_topk, top_k=top_k, implementation=impl))(
            **x
        )
        return scores, topk

    (got_scores, got), (want_scores, want) = run("mosaic"), run("reference")
    assert_scores_close(got_scores, want_scores, error_bound(x, unit_roundoff("bf16")))
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
    for field in ("visible", "candidates", "survivors", "fallback"):
        got_field, want_field = getattr(got, field), getattr(want, field)
        np.testing.assert_array_equal(np.asarray(got_field), np.asarray(want_field))


def test_not_the_default():
    """``implementation=None`` never picks the unmeasured Mosaic kernel."""
    names, _ = backend.resolve(None, ("triton", "mosaic", "reference"))
    assert "mosaic" not in names
    with backend.interpret_mode(True):
        names, _ = backend.resolve(None, ("triton", "mosaic", "reference"))
    assert names == ["triton", "reference"]


@pytest.mark.parametrize(
    ("q_dtype", "k_dtype", "h", "d", "match"),
    [
        (jnp.float32, jnp.float32, 64, 128, "bfloat16 or both float8"),
        (jnp.bfloat16, FP8, 64, 128, "bfloat16 or both float8"),
        (jnp.bfloat16, jnp.bfloat16, 64, 96, "multiple of 64"),
        (FP8, FP8, 256, 128, "wgmma N tile"),
        (jnp.bfloat16, jnp.bfloat16, 128, 512, "shared memory"),
    ],
)
def test_unsupported_inputs_raise_not_implemented(q_dtype, k_dtype, h, d, match):
    q = jnp.zeros((4, h, d), q_dtype)
    k = jnp.zeros((128, d), k_dtype)
    w = jnp.ones((4, h), jnp.float32)
    cfg = mosaic.MosaicScorerConfig(block_t=2)
    with backend.interpret_mode(True), pytest.raises(NotImplementedError, match=match):
        mosaic.indexer_scores_mosaic(q, w, k, None, None, None, cfg=cfg)


def test_falls_back_when_named_in_a_sequence():
    x = make_inputs(3, 4, 16, 40, jnp.float32, ranges="all", scale=False)
    with backend.interpret_mode(True):
        got = jsparse.indexer_scores(**x, implementation=("mosaic", "reference"))
    want = jsparse.indexer_scores(**x, implementation="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def make_batch(dtype, lengths, s_max, h=16, d=64, *, scale, seed=0):
    """A batch of sequences, one query each over a dense cache of its own."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    return dict(
        q=jnp.asarray(rng.standard_normal((b, h, d)), dtype),
        weights=jnp.asarray(rng.standard_normal((b, h)), jnp.float32),
        k_cache=jnp.asarray(rng.standard_normal((b, s_max, d)), dtype),
        k_scale=jnp.asarray(rng.uniform(0.25, 4.0, (b, s_max)), jnp.float32) if scale else None,
        lengths=jnp.asarray(lengths, jnp.int32),
    )


def batch_error_bound(x, unit_roundoff):
    return error_bound(x, unit_roundoff, keys="k_cache", spec="bh,bhd,bsd->bs")


@pytest.mark.parametrize("scale", [True, False], ids=["scaled", "unscaled"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_batch_base_matches_reference(dtype, scale, mosaic_interpret):
    """Each query over its own cache: a whole one, an empty one, one shorter than K and
    one ending mid-tile; three tiles a sequence split over CTAs."""
    x = make_batch(DTYPES[dtype], [384, 0, 5, 200], 384, scale=scale, seed=6)
    top_k = 40
    got = jsparse.indexer_topk_batch(**x, top_k=top_k, implementation="mosaic")
    want = jsparse.indexer_topk_batch(**x, top_k=top_k, implementation="reference")
    s_max = x["k_cache"].shape[1]
    visible = np.arange(s_max)[None, :] < np.asarray(x["lengths"])[:, None]
    oracle = np.where(visible, np.asarray(scores_of_batch(x)), -np.inf)
    atol = float(np.max(batch_error_bound(x, unit_roundoff(dtype))))
    problems = topk_mismatches(got.indices, got.scores, oracle, top_k, atol)
    assert not problems, "\n".join(problems[:10])
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
    np.testing.assert_array_equal(np.asarray(got.visible), np.asarray(want.visible))


def scores_of_batch(x):
    """float64 scores [B, S_max] of every key of each sequence's cache."""
    q = np.asarray(x["q"].astype(jnp.float32), np.float64)
    k = np.asarray(x["k_cache"].astype(jnp.float32), np.float64)
    w = np.asarray(x["weights"], np.float64)
    s = np.einsum("bh,bhs->bs", w, np.maximum(np.einsum("bhd,bsd->bhs", q, k), 0.0))
    return s if x["k_scale"] is None else s * np.asarray(x["k_scale"], np.float64)


def test_batch_scores_split_over_ctas(mosaic_interpret):
    """Five tiles a sequence over three CTAs (runs of 2, 2, 1), 64-key tiles."""
    x = make_batch(FP8, [320, 1, 130], 320, scale=True, seed=7)
    cfg = mosaic.MosaicScorerConfig(block_t=1, block_s=64, max_concurrent_steps=2, key_splits=3)
    args = (x["q"], x["weights"], x["k_cache"], x["k_scale"], x["lengths"])
    got = np.asarray(mosaic.batch_scores_mosaic(*args, cfg=cfg), np.float64)
    visible = np.arange(320)[None, :] < np.asarray(x["lengths"])[:, None]
    want = np.where(visible, scores_of_batch(x), -np.inf)
    assert_scores_close(got, want, batch_error_bound(x, unit_roundoff("fp8")))


def test_batch_declines_what_it_cannot_read():
    """Caches of partial tiles and pages not a multiple of 64 keys raise
    NotImplementedError by name, and a sequence of implementations falls back to Triton."""
    x = make_batch(jnp.bfloat16, [300, 7], 300, scale=False, seed=8)
    with backend.interpret_mode(True):
        with pytest.raises(NotImplementedError, match="multiple of block_s"):
            jsparse.indexer_topk_batch(**x, top_k=8, implementation="mosaic")
        table = jnp.zeros((2, 3), jnp.int32)
        pool = jnp.zeros((4, 32, 64), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match="multiple of 64"):
            jsparse.indexer_topk_batch(
                x["q"], x["weights"], pool, 8, lengths=jnp.asarray([96, 7], jnp.int32),
                page_table=table, implementation="mosaic",
            )  # fmt: skip
        got = jsparse.indexer_topk_batch(**x, top_k=8, implementation=("mosaic", "triton"))
    want = jsparse.indexer_topk_batch(**x, top_k=8, implementation="reference")
    np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))


@pytest.mark.parametrize("page_size", [64, 128])
def test_batch_paged_scores_equal_dense(page_size, mosaic_interpret):
    """The same keys in a shuffled page pool (pages past each length unallocated) give
    the dense cache's scores bit for bit at the same tiles; a page left unallocated
    inside a length gives -inf there, and the rest is unchanged."""
    lengths = np.array([256, 0, 130], np.int32)
    x = make_batch(FP8, lengths, 256, scale=True, seed=9)
    pool, pool_scale, table = shuffled_pages(
        x["k_cache"], x["k_scale"], lengths, page_size, spare_pages=3, seed=9
    )
    cfg = mosaic.MosaicScorerConfig(block_t=1, block_s=64, key_splits=2)
    head = (x["q"], x["weights"])
    dense = np.asarray(mosaic.batch_scores_mosaic(
        *head, x["k_cache"], x["k_scale"], x["lengths"], cfg=cfg))  # fmt: skip
    paged = np.asarray(mosaic.batch_scores_mosaic(
        *head, pool, pool_scale, x["lengths"], table, cfg=cfg))  # fmt: skip
    np.testing.assert_array_equal(paged, dense)
    holed = np.asarray(mosaic.batch_scores_mosaic(
        *head, pool, pool_scale, x["lengths"], table.at[0, 1].set(-1), cfg=cfg))  # fmt: skip
    hole = np.zeros(256, bool)
    hole[page_size : 2 * page_size] = True
    assert np.all(np.isneginf(holed[0, hole]))
    np.testing.assert_array_equal(holed[0, ~hole], dense[0, ~hole])
    np.testing.assert_array_equal(holed[1:], dense[1:])


def test_batch_paged_long_page_rows(mosaic_interpret):
    """Page table rows longer than 256 pages (Mosaic GPU copies at most 256 elements a
    dimension, so a row is held as [R, 256]; run 135 failed there): scores equal the
    dense cache's bit for bit, pages on both sides of the 256th included."""
    lengths = np.array([64 * 300, 64 * 260 + 17], np.int32)
    x = make_batch(FP8, lengths, 64 * 300, h=4, d=64, scale=True, seed=3)
    pool, pool_scale, table = shuffled_pages(
        x["k_cache"], x["k_scale"], lengths, 64, spare_pages=3, seed=3
    )
    cfg = mosaic.MosaicScorerConfig(block_t=1, block_s=64, key_splits=2)
    head = (x["q"], x["weights"])
    dense = mosaic.batch_scores_mosaic(*head, x["k_cache"], x["k_scale"], x["lengths"], cfg=cfg)
    paged = mosaic.batch_scores_mosaic(*head, pool, pool_scale, x["lengths"], table, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(paged), np.asarray(dense))


@pytest.mark.parametrize("paged", [False, True, "long"], ids=["dense", "paged", "paged-long"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_batch_lowers_to_cuda(dtype, paged):
    """Serving decode's shape: 64 sequences × 8192 keys, H = 64, D = 128; paged: pages of
    64 keys in a pool of 9000; paged-long: 64K keys a sequence, 1024 pages a row."""
    b, s, h, d = 64, 65536 if paged == "long" else 8192, 64, 128
    paged = bool(paged)
    f32, i32 = jnp.float32, jnp.int32
    cache = (9000, 64, d) if paged else (b, s, d)
    structs = (
        jax.ShapeDtypeStruct((b, h, d), DTYPES[dtype]),
        jax.ShapeDtypeStruct((b, h), f32),
        jax.ShapeDtypeStruct(cache, DTYPES[dtype]),
        jax.ShapeDtypeStruct(cache[:2], f32),
        jax.ShapeDtypeStruct((b,), i32),
        *[jax.ShapeDtypeStruct((b, s // 64), i32)] * paged,
    )
    lowered = lower_for_h200(mosaic.batch_scores_mosaic, *structs)
    assert "mosaic_gpu" in lowered.as_text()


# (name, T, H, D, S, config or None for the default)
LOWERING_CASES = [
    ("decode", 1, 64, 128, 8192, None),
    ("chunk", 64, 64, 128, 8192, None),
    ("small-tiles", 7, 12, 64, 300, mosaic.MosaicScorerConfig(3, 64, 1)),
    ("wide", 8, 128, 256, 4096, mosaic.MosaicScorerConfig(1, 128, 2)),
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: c[0])
def test_lowers_to_cuda(dtype, case):
    """The whole Pallas → Mosaic GPU lowering (register layouts, wgmma operand checks, TMA
    copy sizes) runs on the CPU; only the final MLIR → PTX compile needs the GPU."""
    _, t, h, d, s, cfg = case
    f32, i32 = jnp.float32, jnp.int32
    structs = (
        jax.ShapeDtypeStruct((t, h, d), DTYPES[dtype]),
        jax.ShapeDtypeStruct((t, h), f32),
        jax.ShapeDtypeStruct((s, d), DTYPES[dtype]),
        jax.ShapeDtypeStruct((s,), f32),
        jax.ShapeDtypeStruct((t,), i32),
        jax.ShapeDtypeStruct((t,), i32),
    )
    lowered = lower_for_h200(functools.partial(mosaic.indexer_scores_mosaic, cfg=cfg), *structs)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
def test_real_size_fp8_matches_reference():
    t, h, d, s = 256, 64, 128, 16384
    kq, kk, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    k = jax.random.normal(kk, (s, d))
    scale = jnp.max(jnp.abs(k), axis=1) / 448.0
    x = dict(
        q=(jax.random.normal(kq, (t, h, d)) * 8.0).astype(FP8),
        weights=jax.random.normal(kw, (t, h)) / np.sqrt(h * d),
        k=(k / scale[:, None]).astype(FP8),
        k_scale=scale,
        kv_start=jnp.zeros((t,), jnp.int32),
        kv_end=jnp.arange(s - t + 1, s + 1, dtype=jnp.int32),
    )
    got = jsparse.indexer_scores(**x, implementation="mosaic")
    want = jsparse.indexer_scores(**x, implementation="reference")
    assert_scores_close(got, want, error_bound(x, GPU_UNIT_ROUNDOFF["fp8"]))


@pytest.mark.gpu
def test_gpu_batch_paged_matches_dense_at_decode_size():
    """16 sequences of up to 64K FP8 keys in pages of 64, compiled: the page pool gives
    the dense cache's scores bit for bit at the same tiles, and the same Top-K."""
    rng = np.random.default_rng(10)
    b, s_max, top_k = 16, 65536, 2048
    lengths = rng.integers(1, s_max + 1, b).astype(np.int32)
    lengths[:3] = [s_max, 1000, 0]
    x = make_batch(FP8, lengths, s_max, h=64, d=128, scale=True, seed=10)
    pool, pool_scale, table = shuffled_pages(
        x["k_cache"], x["k_scale"], lengths, 64, spare_pages=5, seed=10
    )
    cfg = mosaic.MosaicScorerConfig(block_t=1, block_s=64)
    head = (x["q"], x["weights"])
    dense = mosaic.batch_scores_mosaic(*head, x["k_cache"], x["k_scale"], x["lengths"], cfg=cfg)
    paged = mosaic.batch_scores_mosaic(*head, pool, pool_scale, x["lengths"], table, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(paged), np.asarray(dense))
    got = jsparse.indexer_topk_batch(
        *head, pool, top_k, lengths=x["lengths"], k_scale=pool_scale, page_table=table,
        implementation="mosaic",
    )  # fmt: skip
    oracle = np.where(np.arange(s_max)[None, :] < lengths[:, None], scores_of_batch(x), -np.inf)
    atol = float(np.max(batch_error_bound(x, GPU_UNIT_ROUNDOFF["fp8"])))
    problems = topk_mismatches(got.indices, got.scores, oracle, top_k, atol)
    assert not problems, "\n".join(problems[:10])
