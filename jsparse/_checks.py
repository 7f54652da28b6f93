"""Input validation shared by the public ops: precise ``ValueError``s on bad input."""

from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

FLOAT8 = jnp.float8_e4m3fn
INPUT_FLOATS = (jnp.float32, jnp.bfloat16, FLOAT8)


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_dtype(name: str, x, allowed: Iterable) -> None:
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise ValueError(f"{name}: dtype {dtype_name(x.dtype)} is not supported; expected {names}")


def check_dim(name: str, x, axis: int, expected: int, what: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name}: axis {axis} of shape {tuple(x.shape)} is {x.shape[axis]}; "
            f"expected {expected} ({what})"
        )


def concrete(x):
    """A numpy copy of ``x`` when it is concrete, else None (inside jit: skip value checks)."""
    try:
        return np.asarray(x)
    except Exception:  # jax.errors.TracerArrayConversionError and friends
        return None
