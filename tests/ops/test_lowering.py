"""Every Triton kernel lowers to CUDA for an H200 (no GPU needed)."""

import re

import jax
import jax.numpy as jnp
import pytest

import jsparse
from jsparse.ops.indexer import backward, methods
from jsparse.ops.indexer import triton as indexer_triton
from jsparse.ops.topk import triton as select
from jsparse.testing import lower_for_h200

T, H, D, S, K = 64, 64, 128, 8192, 2048
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn]


def _structs(dtype, t=T):
    f32, i32 = jnp.float32, jnp.int32
    return (
        jax.ShapeDtypeStruct((t, H, D), dtype),
        jax.ShapeDtypeStruct((t, H), f32),
        jax.ShapeDtypeStruct((S, D), dtype),
        jax.ShapeDtypeStruct((S,), f32),
        jax.ShapeDtypeStruct((t,), i32),
        jax.ShapeDtypeStruct((t,), i32),
    )


KERNELS = {
    "scores": lambda q, w, k, s, a, b: indexer_triton.indexer_scores_triton(q, w, k, s, a, b),
    "base": lambda q, w, k, s, a, b: methods.topk_base(q, w, k, K, s, a, b),
    "full": lambda q, w, k, s, a, b: methods.topk_full(q, w, k, K, s, a, b),
    # the scores' derivative (cotangent: the scores themselves, which have its shape)
    "scores_backward": lambda q, w, k, s, a, b: backward.indexer_scores_vjp_triton(
        indexer_triton.indexer_scores_triton(q, w, k, s, a, b), q, w, k, s, a, b
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("t", [1, T], ids=["decode", "chunk"])
def test_lowers_to_cuda(name, dtype, t):
    lowered = lower_for_h200(KERNELS[name], *_structs(dtype, t))
    assert "triton" in lowered.as_text().lower() or "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("t", [1, T], ids=["decode", "chunk"])
def test_base_with_the_report_kernel_lowers_to_cuda(t, monkeypatch):
    # the scorer writes base's report by default (KERNELS above): the report's own
    # kernel, which the switch and the Mosaic base use, lowers here
    monkeypatch.setattr(methods, "SCORER_WRITES_REPORT", False)
    lower_for_h200(KERNELS["base"], *_structs(jnp.float8_e4m3fn, t))


def test_fp8_widened_in_memory_lowers_to_cuda(monkeypatch):
    monkeypatch.setattr(indexer_triton, "WIDEN_FP8_IN_MEMORY_FROM", 1)
    lowered = lower_for_h200(KERNELS["base"], *_structs(jnp.float8_e4m3fn, T))
    converts = [line for line in lowered.as_text().splitlines() if "stablehlo.convert" in line]
    # q and k become f16 in memory before the kernel
    assert sum("xf8E4M3FN>) -> tensor<" in c and "xf16>" in c for c in converts) == 2


def test_selection_kernels_lower_to_cuda(monkeypatch):
    i32 = jnp.int32
    t, s, cap, n = 256, 65536, 4608, 30000
    scores = jax.ShapeDtypeStruct((t, s), jnp.float32)
    rng = jax.ShapeDtypeStruct((t,), i32)
    # split rows below SPLIT_KEEP_BITS_MIN_ROWS: the one-pass chunks and their merge
    monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ROWS", None)
    for chunks in (1, 8):
        for codes in (False, True):
            lower_for_h200(
                lambda x, a, b, c=chunks, w=codes: select.compact_rows(
                    x, a, b, K, cap, chunks=c, with_codes=w
                ),
                scores, rng, rng,
            )  # fmt: skip
    # split rows below SHARED_THETA_MIN_ROWS: each chunk program searches θ itself
    few = jax.ShapeDtypeStruct((8, s), jnp.float32)
    lower_for_h200(
        lambda x, a, b: select.compact_rows(x, a, b, K, cap, chunks=8, with_codes=True),
        few, jax.ShapeDtypeStruct((8,), i32), jax.ShapeDtypeStruct((8,), i32),
    )  # fmt: skip
    monkeypatch.undo()
    # split rows through keep bits, each chunk program writing its words
    monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ROWS", 1)
    monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ENTRIES", 1)
    for codes in (False, True):
        lower_for_h200(
            lambda x, a, b, w=codes: select.compact_rows(x, a, b, K, cap, chunks=8, with_codes=w),
            scores, rng, rng,
        )  # fmt: skip
    monkeypatch.undo()
    # whole rows in one pass (the keep bits are the default above)
    monkeypatch.setattr(select, "KEEP_BITS", False)
    lower_for_h200(lambda x, a, b: select.compact_rows(x, a, b, K, cap, chunks=1), scores, rng, rng)
    monkeypatch.undo()
    # codes from the merge by default (above); written as kept, in the chunk kernel; the
    # select's K-th search with its guess
    monkeypatch.setattr(select, "SPLIT_KEEP_BITS_MIN_ROWS", None)
    monkeypatch.setattr(select, "MERGE_WRITES_CODES", False)
    monkeypatch.setattr(select, "SELECT_GUESS", not select.SELECT_GUESS)
    lower_for_h200(
        lambda x, a, b: select.compact_rows(x, a, b, K, cap, chunks=8, with_codes=True),
        scores, rng, rng,
    )  # fmt: skip
    buf = jax.ShapeDtypeStruct((t, cap), i32)
    lower_for_h200(lambda c, i, m: select.select_candidates(c, i, m, K), buf, buf, rng)
    monkeypatch.undo()
    for width in (n, 30720):  # gathered and aligned block loads
        rec = jax.ShapeDtypeStruct((t, width), i32)
        lower_for_h200(
            lambda c, i, m: select.compact_records(c, i, m, K, cap, chunks=4), rec, rec, rng
        )
    lower_for_h200(lambda c, i, m: select.select_candidates(c, i, m, K), buf, buf, rng)
    lower_for_h200(lambda x, i, m: select.select_rows(x, i, m, K), scores, buf, rng)
    lower_for_h200(  # the unsorted output, written as scores
        lambda x, i, m: select.select_rows(x, i, m, K, scores_out=True), scores, buf, rng
    )
    big = jax.ShapeDtypeStruct((t, 3 * 8192), i32)  # too long to hold in registers
    lower_for_h200(lambda c, i, m: select.select_candidates(c, i, m, K), big, big, rng)
    topk = jax.ShapeDtypeStruct((8, K), i32)
    for id_ordered in (True, False):
        lower_for_h200(lambda c, i, o=id_ordered: select.rank_order(c, i, id_ordered=o), topk, topk)
    lower_for_h200(select.bitonic_order, topk, topk)
    few, few_counts = jax.ShapeDtypeStruct((8, cap), i32), jax.ShapeDtypeStruct((8,), i32)
    lower_for_h200(lambda c, i, m: select.rank_select(c, i, m, K), few, few, few_counts)
    lower_for_h200(lambda c, i, m: select.block_rank_select(c, i, m, K), few, few, few_counts)


def _num_warps(lowered):
    return sorted(set(re.findall(r"num_warps = (\d+)", lowered.as_text())))


def test_fewer_rows_than_sms_select_and_order_with_more_warps():
    # below the SM count one program's chain is the kernel: 8 warps for the select and
    # 16 for the bitonic order (run 126); from there on, the throughput configs 4 and 8
    i32 = jnp.int32
    for rows, select_warps, order_warps in ((64, "8", "16"), (256, "4", "8")):
        scores = jax.ShapeDtypeStruct((rows, 4096), jnp.float32)
        buf, counts = jax.ShapeDtypeStruct((rows, 256), i32), jax.ShapeDtypeStruct((rows,), i32)
        lowered = lower_for_h200(
            lambda x, i, m: select.select_rows(x, i, m, 64), scores, buf, counts
        )
        assert _num_warps(lowered) == [select_warps]
        topk = jax.ShapeDtypeStruct((rows, 64), i32)
        assert _num_warps(lower_for_h200(select.bitonic_order, topk, topk)) == [order_warps]


@pytest.mark.parametrize(
    "dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name
)
def test_paged_record_scorer_lowers_to_cuda(dtype):
    # Decode over a paged cache: 8 sequences, 64 pages of 64 slots each, a pool of 600 pages.
    b, pages, page = 8, 64, 64
    i32 = jnp.int32
    structs = (
        jax.ShapeDtypeStruct((b, H, D), dtype),
        jax.ShapeDtypeStruct((b, H), jnp.float32),
        jax.ShapeDtypeStruct((600 * page, D), dtype),
        jax.ShapeDtypeStruct((600 * page,), jnp.float32),
        jax.ShapeDtypeStruct((b,), i32),
        jax.ShapeDtypeStruct((b,), i32),
        jax.ShapeDtypeStruct((b,), i32),
        jax.ShapeDtypeStruct((b * pages,), i32),
    )

    def paged(q, w, k, s, start, end, tau, table):
        return indexer_triton.score_records_triton(
            q, w, k, s, start, end, tau, 4096, page_table=table, page_size=page
        )

    lowered = lower_for_h200(paged, *structs)
    assert "triton" in lowered.as_text().lower() or "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("with_scale", [False, True])
def test_dense_scorer_launch_takes_only_what_it_reads(with_scale):
    # A decode step pays ~1 µs for each broadcast launched to feed the scorer a dummy
    # operand (no k_scale, no τ, no key list, no page table); only q, weights, keys,
    # the ranges and a given k_scale go in.
    q, w, k, scale, a, b = _structs(jnp.bfloat16, t=8)
    fn = lambda q, w, k, s, a, b: methods.topk_base(q, w, k, K, s, a, b).indices  # noqa: E731
    text = lower_for_h200(fn, q, w, k, scale if with_scale else None, a, b).as_text()
    body = text[text.index("func.func private @topk_base") :]
    first_launch = body[: body.index("stablehlo.custom_call")]
    assert "broadcast_in_dim" not in first_launch
    operands = body[body.index("xla.gpu.triton(") :].split(")")[0].count("%")
    assert operands == 5 + with_scale


def test_decode_selection_builds_no_ranges(monkeypatch):
    # A decode step's top-budget selection once launched two small XLA kernels before the
    # compaction: a zero start per row, and its lengths repeated per head and clipped.
    # The kernels now read a one-entry constant start and the lengths as given: nothing
    # but reshapes comes before the first launch.
    from jsparse import backend
    from jsparse.selectors.base import top_budget

    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    scores = jax.ShapeDtypeStruct((4, 2, 8192), jnp.float32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    text = lower_for_h200(lambda x, n: top_budget(x, n, 64, ordered=False), scores, lengths)
    text = text.as_text()
    before = text[: text.index("stablehlo.custom_call")]
    for op in ("broadcast_in_dim", "clamp", "concatenate", "iota", "select"):
        assert f"stablehlo.{op}" not in before, op
    assert "dense<0> : tensor<1xi32>" in before


@pytest.mark.parametrize("op", ["indexer_topk", "indexer_topk_no_ranges", "topk"])
def test_traced_ranges_are_clamped_inside_the_kernels(monkeypatch, op):
    # Traced ranges must be clamped to the keys (a negative start once gave ids -5..-2),
    # but a clamp in XLA is a launch of its own before the first kernel: 1 µs of a
    # one-query decode step (run 218c). The Triton kernels clamp where they load them.
    # Absent ranges are constants, not a broadcast launched to build them.
    from jsparse import backend

    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    r = jax.ShapeDtypeStruct((1,), jnp.int32)
    if op == "indexer_topk":
        q, w, k, _, _, _ = _structs(jnp.bfloat16, t=1)
        args = (q, w, k, r, r)

        def fn(q, w, k, a, b):
            return jsparse.indexer_topk(q, w, k, K, kv_start=a, kv_end=b, implementation="triton")
    elif op == "indexer_topk_no_ranges":
        q, w, k, _, _, _ = _structs(jnp.bfloat16, t=8)
        args = (q, w, k)

        def fn(q, w, k):
            return jsparse.indexer_topk(q, w, k, K, implementation="triton")
    else:
        args = (jax.ShapeDtypeStruct((1, 8192), jnp.float32), r, r)

        def fn(x, a, b):
            return jsparse.topk(x, K, kv_start=a, kv_end=b, implementation="triton")

    text = lower_for_h200(fn, *args).as_text()
    before = text[: text.index("stablehlo.custom_call")]
    for name in ("clamp", "maximum", "minimum", "broadcast_in_dim"):
        assert f"stablehlo.{name}" not in before, name


def test_kernels_export_for_cuda_with_the_triton_check_disabled(monkeypatch):
    # What the README tells users of jax.export: refused by default (the Triton custom
    # call has no cross-version guarantee), exported with that one check disabled.
    from jax import export

    from jsparse import backend

    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    q, w, k, scale, _, _ = _structs(jnp.float8_e4m3fn, t=1)

    def fn(q, w, k, scale):
        return jsparse.indexer_topk(q, w, k, K, k_scale=scale).indices

    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        export.export(jax.jit(fn), platforms=["cuda"])(q, w, k, scale)
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[check])(
        q, w, k, scale
    )
    assert exported.platforms == ("cuda",) and "__gpu$xla.gpu.triton" in exported.mlir_module()
