"""How the Triton kernels multiply f32 operands (f32 inputs only; bf16 and FP8 inputs
always take the tensor cores at their own precision). Two modes:

* ``"ieee"``: ``Precision.HIGHEST``. Pallas Triton lowers it to IEEE dots on the FMA
  units: exact f32 products, but slow. The indexer's backward ran at 0.84 TFLOP/s on
  an H100 (T = S = 4096, H 64, D 128: 657 ms against XLA's 39 ms, run 240).
* ``"tf32x3"``: three TF32 tensor-core products, a_hi·b_hi + a_hi·b_lo + a_lo·b_hi,
  where a_hi is a rounded to TF32 and a_lo the rest rounded to TF32. Each product errs
  by at most ~3·2^-22 of |a||b| before the f32 accumulation (the dropped a_lo·b_lo and
  the lo parts' rounding); :func:`extra_relative_error` tells DoSA's certificate, which
  stays exact.

The mode follows JAX's own setting, ``jax.default_matmul_precision``, so that it is part
of every trace and compiled kernel keyed on it: ``"highest"``, ``"float32"`` or
``"F32_F32_F32"`` ask for ``"ieee"``, ``"TF32_TF32_F32_X3"`` for ``"tf32x3"``. Unset, or
set to a value below f32 precision (the kernels never multiply f32 inputs at less than
near-f32), the kernels take :data:`DEFAULT`. Pallas interpret mode on a CPU runs both
modes as IEEE dots (the CPU has no TF32).

``"tf32x3"`` is not yet usable on a GPU: with f32 operands on the tensor cores, every
kernel's f32 tiles overflowed shared memory on an H100 (256-353 KiB asked of 227 KiB:
the scorer, its record and DoSA launches and the backward, run 244). Until their tiles
are sized for it (:data:`TF32X3_KERNELS`), a kernel asked for it raises
``NotImplementedError``, so that ``implementation=None`` hands over to the jnp
reference and a kernel named explicitly says why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jsparse import backend

MODES = ("ieee", "tf32x3")
# The mode where jax.default_matmul_precision asks for neither.
DEFAULT = "ieee"
_ASKS_IEEE = ("highest", "float32", "F32_F32_F32")
_ASKS_TF32X3 = ("TF32_TF32_F32_X3",)
# Whether the compiled kernels take "tf32x3" (off: their f32 tiles overflow shared memory
# in that mode, run 244). On for measurement and cross-lowering tests only.
TF32X3_KERNELS = False


def mode() -> str:
    """The f32 kernel dots' mode in the current trace (see the module's docstring)."""
    if DEFAULT not in MODES:
        raise ValueError(f"jsparse.ops.f32_dots.DEFAULT is {DEFAULT!r}; expected one of {MODES}")
    asked = jax.config.jax_default_matmul_precision
    if asked in _ASKS_IEEE:
        return "ieee"
    if asked in _ASKS_TF32X3:
        return "tf32x3"
    return DEFAULT


def precision(compute_dtype):
    """The ``precision`` of a kernel dot whose operands are ``compute_dtype``: None
    (the dtype's own tensor-core path) unless they are f32."""
    if jnp.dtype(compute_dtype) != jnp.float32:
        return None
    if mode() == "tf32x3" and not backend.is_interpret():
        if not TF32X3_KERNELS:
            raise NotImplementedError(
                "f32 inputs under jax.default_matmul_precision "
                f"{jax.config.jax_default_matmul_precision!r} (f32_dots mode 'tf32x3'): the "
                "Triton kernels' f32 tiles do not fit shared memory in this mode yet; ask for "
                "'highest' (IEEE dots) or use implementation='reference'"
            )
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def extra_relative_error() -> float:
    """What the f32 kernel dots may err by beyond IEEE f32 products, as a fraction of
    Σ|a_d b_d|: 0 for ``"ieee"``; 2^-20 for ``"tf32x3"`` (≥ 3.01·2^-22, the bound above,
    with a margin). Its three products also mean 3× the additions: see
    :func:`accumulated_terms`."""
    return 2.0**-20 if mode() == "tf32x3" else 0.0


def accumulated_terms(dim: int) -> int:
    """How many products an f32 kernel dot over ``dim`` accumulates."""
    return 3 * dim if mode() == "tf32x3" else dim
