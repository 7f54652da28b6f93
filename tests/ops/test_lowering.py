"""Every Triton kernel lowers to CUDA for an H200 (no GPU needed)."""

import jax
import jax.numpy as jnp
import pytest

from jsparse.ops.indexer import methods
from jsparse.ops.indexer import triton as indexer_triton
from tests.lowering import lower_for_h200

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
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("t", [1, T], ids=["decode", "chunk"])
def test_lowers_to_cuda(name, dtype, t):
    lowered = lower_for_h200(KERNELS[name], *_structs(dtype, t))
    assert "triton" in lowered.as_text().lower() or "__gpu$xla.gpu.triton" in lowered.as_text()
