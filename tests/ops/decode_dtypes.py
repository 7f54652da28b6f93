"""The (q, cache) dtype pairs the decode kernels' tests take, with their tolerances
(the ``decode_dtypes`` fixture of ``conftest.py``)."""

from typing import NamedTuple

import jax.numpy as jnp


class DecodeDtypes(NamedTuple):
    name: str
    q: object  # q's dtype
    cache: object  # the cache's
    tol: float  # kernel against reference, absolute and relative


# FP8 caches meet a bf16 q; an f32 q over a bf16 cache runs f32-level dots.
DECODE_DTYPES = {
    "float32": (jnp.float32, jnp.float32, 2e-5),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16, 3e-2),
    "float16": (jnp.float16, jnp.float16, 4e-3),
    "float8": (jnp.bfloat16, jnp.float8_e4m3fn, 3e-2),
    "float32-over-bfloat16": (jnp.float32, jnp.bfloat16, 2e-5),
}
