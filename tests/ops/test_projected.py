"""Projected-key scores: the Triton kernel (interpreted, and lowered for an H200)
against the jnp reference and a float64 numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import backend
from jsparse.ops.projected import projected_scores
from jsparse.ops.projected import triton as projected_triton
from jsparse.ops.projected.triton import projected_scores_triton
from tests.lowering import lower_for_h200

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
