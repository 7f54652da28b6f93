"""Public projected-key scoring: :func:`projected_scores`."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jsparse import _checks, backend
from jsparse.ops.projected.reference import projected_scores_reference

CACHE_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn)


def projected_scores(
    q_proj: Float[Array, "B Hkv R"],
    values: Float[Array, "B S Hkv R"],
    *,
    implementation: str | Sequence[str] | None = None,
) -> Float[Array, "B Hkv S"]:
    """Every token's score for each KV head: ``Σ_r q_proj[b, h, r] · values[b, s, h, r]``.

    Args:
      q_proj: [B, Hkv, R] float32, each KV head's projected query (with any per-head
        dequantisation scale already multiplied in).
      values: [B, S, Hkv, R] float32, bfloat16 or float8_e4m3fn: the projected-key cache
        as stored (the selectors' ``ProjectedKeys.values``), widened to f32 on load.
      implementation: see :mod:`jsparse.backend` (``"triton"`` or ``"reference"``). The
        Triton kernel needs R a power of two (``NotImplementedError`` otherwise).

    Returns:
      float32 [B, Hkv, S]. The kernel sums each head's R products in its own order, so
      scores agree with the reference to f32 rounding, not bit for bit.
    """
    _checks.check_rank("q_proj", q_proj, 3, "[B, Hkv, R]")
    _checks.check_rank("values", values, 4, "[B, S, Hkv, R]")
    _checks.check_dtype("q_proj", q_proj, (jnp.float32,))
    _checks.check_dtype("values", values, CACHE_FLOATS)
    b, hkv, r = q_proj.shape
    _checks.check_dim("values", values, 0, b, f"B of q_proj {tuple(q_proj.shape)}")
    _checks.check_dim("values", values, 2, hkv, f"Hkv of q_proj {tuple(q_proj.shape)}")
    _checks.check_dim("values", values, 3, r, f"R of q_proj {tuple(q_proj.shape)}")
    if 0 in values.shape:
        return jnp.zeros((b, hkv, values.shape[1]), jnp.float32)
    return backend.dispatch("projected_scores", _implementations(), implementation, q_proj, values)


@functools.cache  # one jit wrapper: a fresh one per call costs host time
def _implementations():
    from jsparse.ops.projected import triton  # Pallas imports only when used

    def run_triton(q_proj, values):
        if not triton.supported(values.shape[3]):
            raise NotImplementedError(
                f"projected_scores: the Triton kernel needs R a power of two, got "
                f"R = {values.shape[3]} (values {tuple(values.shape)})"
            )
        return triton.projected_scores_triton(q_proj, values)

    return {"triton": run_triton, "reference": jax.jit(projected_scores_reference)}
