"""How the Triton kernels multiply f32 operands (f32 inputs only; bf16 and FP8 inputs
always take the tensor cores at their own precision).

* ``"ieee"`` (the default): ``Precision.HIGHEST``. Pallas Triton lowers it to IEEE dots
  on the FMA units: exact f32 products, but slow. The indexer's backward ran at 0.84
  TFLOP/s on an H100 (T = S = 4096, H 64, D 128: 657 ms against XLA's 39 ms, run 240).
* ``"tf32x3"``: three TF32 tensor-core products, a_hi·b_hi + a_hi·b_lo + a_lo·b_hi,
  where a_hi is a rounded to TF32 and a_lo the rest rounded to TF32. Each product errs
  by at most ~3·2^-22 of |a||b| before the f32 accumulation (the dropped a_lo·b_lo and
  the lo parts' rounding), and :func:`extra_relative_error` says so to DoSA's
  certificate, which stays exact. Pallas interpret mode on a CPU runs these dots as
  ``"ieee"`` (the CPU has no such algorithm).

Set :data:`MODE` before the first call of a kernel: it is read when a kernel is traced,
and a compiled kernel keeps the mode it was traced with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MODES = ("ieee", "tf32x3")
MODE = "ieee"


def _mode() -> str:
    if MODE not in MODES:
        raise ValueError(f"jsparse.ops.f32_dots.MODE is {MODE!r}; expected one of {MODES}")
    return MODE


def precision(compute_dtype):
    """The ``precision`` of a kernel dot whose operands are ``compute_dtype``: None
    (the dtype's own tensor-core path) unless they are f32."""
    from jsparse import backend

    if jnp.dtype(compute_dtype) != jnp.float32:
        return None
    if _mode() == "tf32x3" and not backend.is_interpret():
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def extra_relative_error() -> float:
    """What the f32 kernel dots may err by beyond IEEE f32 products, as a fraction of
    Σ|a_d b_d|: 0 for ``"ieee"``; 2^-20 for ``"tf32x3"`` (≥ 3.01·2^-22, the bound above,
    with a margin). Its three products also mean 3× the additions: see
    :func:`accumulated_terms`."""
    return 2.0**-20 if _mode() == "tf32x3" else 0.0


def accumulated_terms(dim: int) -> int:
    """How many products an f32 kernel dot over ``dim`` accumulates."""
    return 3 * dim if _mode() == "tf32x3" else dim
