"""Projected-key scores: the Triton kernel (interpreted, and lowered for an H200)
against the jnp reference and a float64 numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import backend
from jsparse.ops.projected import projected_scores, projected_step
from jsparse.ops.projected import triton as projected_triton
from jsparse.ops.projected.triton import projected_scores_triton, projected_step_triton
from jsparse.testing import lower_for_h200

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def _inputs(b, s, hkv, r, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, hkv, r)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((b, s, hkv, r)) * 4, DTYPES[dtype])
    return q, x


def _oracle(q, x):
    return np.einsum("bhr,bshr->bhs", np.asarray(q, np.float64), np.asarray(x, np.float64))


@pytest.mark.parametrize(
    "b, s, hkv, r, dtype",
    [
        (2, 300, 8, 32, "fp8"),
        (1, 37, 3, 16, "bf16"),
        (3, 129, 1, 4, "f32"),
        (2, 64, 5, 8, "fp8"),
        (2, 300, 1, 128, "fp8"),
    ],  # the last: MLA's one KV head of r + Dr
)
def test_kernel_matches_the_oracle(b, s, hkv, r, dtype):
    q, x = _inputs(b, s, hkv, r, dtype)
    want = _oracle(q, x)
    # f32 sums of R products in any order: within R ulps of the sum of magnitudes
    tol = (
        4
        * r
        * np.finfo(np.float32).eps
        * np.einsum(
            "bhr,bshr->bhs", np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(x, np.float64))
        )
    )
    for impl in ("reference", "triton"):
        with backend.interpret_mode(impl == "triton"):
            got = np.asarray(projected_scores(q, x, implementation=impl))
        assert got.shape == (b, hkv, s) and got.dtype == np.float32
        assert (np.abs(got - want) <= tol + 1e-30).all(), impl


def test_small_tiles_cover_every_token():
    q, x = _inputs(2, 100, 3, 8, "bf16", seed=1)
    with backend.interpret_mode():
        got = np.asarray(projected_scores_triton(q, x, block_s=16))
    np.testing.assert_allclose(got, _oracle(q, x), rtol=1e-5, atol=1e-4)


def test_a_rank_that_is_not_a_power_of_two_falls_back_or_says_so():
    q, x = _inputs(1, 20, 2, 6, "f32")
    with backend.interpret_mode():
        with pytest.raises(NotImplementedError, match="R a power of two, got R = 6"):
            projected_scores(q, x, implementation="triton")
        got = projected_scores(q, x)  # None: the kernel declines, the reference runs
    np.testing.assert_allclose(np.asarray(got), _oracle(q, x), rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_named():
    q, x = _inputs(2, 10, 2, 4, "f32")
    with pytest.raises(ValueError, match="q_proj"):
        projected_scores(q[0], x)
    with pytest.raises(ValueError, match="values"):
        projected_scores(q, x[:, :, :1])
    with pytest.raises(ValueError, match="q_proj"):
        projected_scores(q.astype(jnp.bfloat16), x)
    with pytest.raises(ValueError, match="values"):
        projected_scores(q, x.astype(jnp.int8))
    assert projected_scores(q, x[:, :0]).shape == (2, 2, 0)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_lowers_to_cuda(dtype):
    sds = jax.ShapeDtypeStruct
    for hkv, r, s in [(8, 32, 4099), (3, 16, 77), (1, 128, 4099)]:
        q, x = sds((2, hkv, r), jnp.float32), sds((2, s, hkv, r), DTYPES[dtype])
        text = lower_for_h200(projected_scores_triton, q, x).as_text()
        assert "jsparse_projected_scores" in text


@pytest.mark.gpu
@pytest.mark.parametrize("hkv, r", [(8, 32), (1, 128)], ids=["gqa", "mla"])
def test_gpu_kernel_matches_the_reference(hkv, r):
    q, x = _inputs(4, 70001, hkv, r, "fp8", seed=2)
    got = np.asarray(projected_scores(q, x, implementation="triton"))
    want = np.asarray(projected_scores(q, x, implementation="reference"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_fp8_caches_of_2_to_4_gib_are_refused_not_misread():
    """(WORKSPACE.md run 163.) The kernel refuses the cache; the op falls back."""
    import jsparse

    sds = jax.ShapeDtypeStruct
    q, values = sds((160, 8, 32), jnp.float32), sds((160, 65536, 8, 32), jnp.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="projected_scores: values"):
        jax.eval_shape(projected_triton.projected_scores_triton, q, values)
    with jsparse.backend.interpret_mode(True):
        assert jax.eval_shape(jsparse.ops.projected.projected_scores, q, values).shape == (
            160, 8, 65536,
        )  # fmt: skip


# ---- projected_step: a decode step's two projections and its cache write ----


def _step_inputs(b, h, hkv, d, r, s, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k_new = jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((hkv, r, d)) / np.sqrt(d), jnp.float32)
    bmap = jnp.asarray(rng.standard_normal((hkv, r, d)) / np.sqrt(d), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, s, hkv, r)), DTYPES[dtype])
    scale = jnp.asarray(rng.uniform(0.002, 0.02, (b, hkv)), jnp.float32)  # some rows clip
    slots = jnp.asarray(np.arange(b) * 7 % s, jnp.int32)
    return q, k_new, a, bmap, values, scale, slots


def _step_oracle(q, k_new, a, bmap, scale, fp8):
    """float64: (scale · A q̄, the stored row's exact value before rounding)."""
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    q, k_new, a, bmap, scale = map(f64, (q, k_new, a, bmap, scale))
    b, h, d = q.shape
    hkv = a.shape[0]
    q_mean = q.reshape(b, hkv, h // hkv, d).mean(axis=2)
    qp = np.einsum("bhd,hrd->bhr", q_mean, a) * scale[:, :, None]
    row = np.einsum("bhd,hrd->bhr", k_new, bmap)
    if fp8:
        row = np.clip(row / scale[:, :, None], -448, 448)
    return qp, row


@pytest.mark.parametrize(
    "b, h, hkv, d, r, s, dtype",
    [
        (3, 9, 3, 64, 16, 40, "fp8"),  # SmolLM2's 9 / 3 heads
        (2, 20, 1, 80, 8, 30, "fp8"),  # MLA-like: one KV head, D not a power of two
        (2, 32, 8, 128, 32, 50, "bf16"),
        (2, 4, 2, 24, 4, 9, "f32"),
        (2, 136, 1, 200, 8, 12, "bf16"),  # two partial chunks of heads and of D (128 each)
    ],
)
def test_step_kernel_and_reference_match_the_oracle(b, h, hkv, d, r, s, dtype):
    args = _step_inputs(b, h, hkv, d, r, s, dtype)
    values, slots = args[4], np.asarray(args[6])
    want_qp, want_row = _step_oracle(*args[:4], args[5], dtype == "fp8")
    spacing = {"fp8": 2.0**-3, "bf16": 2.0**-7, "f32": 2.0**-22}[dtype]  # relative, rounded
    for impl in ("reference", "triton"):
        with backend.interpret_mode(impl == "triton"):
            qp, got = projected_step(*args, implementation=impl)
        np.testing.assert_allclose(np.asarray(qp), want_qp, rtol=1e-5, atol=1e-7)
        got = np.asarray(got.astype(jnp.float32), np.float64)
        old = np.asarray(values.astype(jnp.float32), np.float64)
        written = np.zeros(got.shape[:2], bool)
        written[np.arange(b), slots] = True
        np.testing.assert_array_equal(got[~written], old[~written])  # nothing else moves
        new = got[np.arange(b), slots]
        assert (np.abs(new - want_row) <= spacing * np.abs(want_row) + 1e-6).all(), impl


def test_step_slots_outside_the_cache_write_nothing():
    q, k_new, a, bmap, values, scale, _ = _step_inputs(3, 8, 2, 32, 8, 12, "fp8", seed=1)
    slots = jnp.asarray([-1, 12, 5], jnp.int32)
    with backend.interpret_mode():
        _, got = projected_step(q, k_new, a, bmap, values, scale, slots, implementation="triton")
    _, want = projected_step(q, k_new, a, bmap, values, scale, slots, implementation="reference")
    f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(f32(got)[:2], f32(values)[:2])
    np.testing.assert_array_equal(f32(got)[2, :5], f32(values)[2, :5])
    np.testing.assert_array_equal(f32(want)[:2], f32(values)[:2])
    assert not np.array_equal(f32(got)[2, 5], f32(values)[2, 5])


def test_step_rank_not_a_power_of_two_falls_back_or_says_so():
    args = _step_inputs(2, 4, 2, 16, 6, 10, "bf16")
    with backend.interpret_mode():
        with pytest.raises(NotImplementedError, match="R a power of two, got R = 6"):
            projected_step(*args, implementation="triton")
        qp, _ = projected_step(*args)  # None: the kernel declines, the reference runs
    want, _ = projected_step(*args, implementation="reference")
    np.testing.assert_array_equal(np.asarray(qp), np.asarray(want))


def test_step_bad_inputs_are_named():
    q, k_new, a, bmap, values, scale, slots = _step_inputs(2, 6, 2, 16, 4, 10, "fp8")
    cases = [
        ("q", dict(q=q[:, :5])),  # 5 heads over 2 KV heads
        ("k_new", dict(k_new=k_new[:, :1])),
        ("query_map", dict(a=a[:, :, :8])),
        ("key_map", dict(bmap=bmap[:1])),
        ("scale", dict(scale=scale[:1])),
        ("slots", dict(slots=slots.astype(jnp.float32))),
        ("values", dict(values=values.astype(jnp.int8))),
        ("k_new", dict(k_new=k_new.astype(jnp.int32))),
        ("scale", dict(scale=scale.astype(jnp.int32))),
        (
            "q",
            dict(
                values=values[:, :, :0],
                k_new=k_new[:, :0],
                a=a[:0],
                bmap=bmap[:0],
                scale=scale[:, :0],
            ),
        ),  # no KV heads
        ("q", dict(q=q[0])),
    ]
    base = dict(q=q, k_new=k_new, a=a, bmap=bmap, values=values, scale=scale, slots=slots)
    for name, change in cases:
        args = {**base, **change}
        with pytest.raises(ValueError, match=name):
            projected_step(*args.values())


@pytest.mark.parametrize(
    "b, h, hkv, d, r, s",
    [(32, 32, 8, 128, 32, 131072), (8, 128, 1, 576, 64, 32768), (2, 9, 3, 64, 16, 40)],
    ids=["gqa-32x128K", "deepseek-mla", "smollm2"],
)
def test_step_lowers_to_cuda(b, h, hkv, d, r, s):
    sds = jax.ShapeDtypeStruct
    args = [
        sds((b, h, d), jnp.bfloat16), sds((b, hkv, d), jnp.bfloat16),
        sds((hkv, r, d), jnp.float32), sds((hkv, r, d), jnp.float32),
        sds((b, s, hkv, r), jnp.float8_e4m3fn), sds((b, hkv), jnp.float32), sds((b,), jnp.int32),
    ]  # fmt: skip
    text = lower_for_h200(projected_step_triton, *args).as_text()
    assert "jsparse_projected_step" in text
    fp8_q = [sds((b, h, d), jnp.float8_e4m3fn), sds((b, hkv, d), jnp.float8_e4m3fn)]
    assert (
        "jsparse_projected_step"
        in lower_for_h200(projected_step_triton, *fp8_q, *args[2:]).as_text()
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b, h, hkv, d, r", [(32, 32, 8, 128, 32), (8, 128, 1, 576, 64)], ids=["gqa", "mla"]
)
def test_gpu_step_matches_the_reference(b, h, hkv, d, r):
    args = _step_inputs(b, h, hkv, d, r, 4099, "fp8", seed=3)
    qp, got = projected_step(*args, implementation="triton")
    want_qp, want = projected_step(*args, implementation="reference")
    np.testing.assert_allclose(np.asarray(qp), np.asarray(want_qp), rtol=1e-5, atol=1e-7)
    f32 = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    np.testing.assert_allclose(f32(got), f32(want), rtol=2.0**-3, atol=0)
    # both round to nearest even: they differ only where f32 sums straddle a tie (a
    # truncating conversion would move about half of the written values)
    rows = np.arange(b), np.asarray(args[6])
    assert (f32(got)[rows] != f32(want)[rows]).mean() < 0.01


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("rows_at_once", [1, 7, 40])
def test_key_projection_in_slices_equals_widening_at_once(dtype, rows_at_once):
    """Keys narrower than f32 are widened a slice at a time above ``widen_at_once``
    elements (a prefill's cache widened at once would not fit beside it); every row is
    projected, the last slice's overlap included (3 x 41 rows is no multiple of 7 or 40)."""
    from jsparse.ops.projected.reference import key_projection

    rng = np.random.default_rng(3)
    hkv, d, r = 2, 16, 4
    k = jnp.asarray(rng.standard_normal((3, 41, hkv, d)), DTYPES[dtype])
    key_map = jnp.asarray(rng.standard_normal((hkv, r, d)), jnp.float32)
    at_once = key_projection(k, key_map)
    sliced = key_projection(k, key_map, widen_at_once=rows_at_once * hkv * d)
    assert sliced.shape == at_once.shape == (3, 41, hkv, r)
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(at_once), rtol=1e-6, atol=1e-6)
    oracle = np.einsum("...hd,hrd->...hr", np.asarray(k, np.float64), np.float64(key_map))
    np.testing.assert_allclose(np.asarray(sliced), oracle, rtol=1e-5, atol=1e-5)
