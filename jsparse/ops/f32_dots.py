"""How the Triton kernels multiply f32 operands (f32 inputs only; bf16 and FP8 inputs
always take the tensor cores at their own precision): the indexer scorer and its
backward, DoSA's screen and GQA attention (whose f32 q over a bf16 cache takes three
bf16 terms instead in ``"tf32x3"`` mode: ``attention.triton.bf16_terms``). (MLA
attention multiplies f32 q as IEEE f32 in either mode, over any cache: at its decode
shapes that was 5× faster than tf32x3, run 251.) Two modes:

* ``"tf32x3"`` (the default): three TF32 tensor-core products, a_hi·b_hi + a_hi·b_lo +
  a_lo·b_hi, where a_hi is a rounded to TF32 and a_lo the rest rounded to TF32. Each
  product errs by at most ~3·2^-22 of |a||b| before the f32 accumulation (the dropped
  a_lo·b_lo and the lo parts' rounding); :func:`extra_relative_error` tells DoSA's
  certificate, which stays exact. On an H100 (run 246): scores within 8.5e-7 of a
  row's largest of IEEE f32 ones; the scorer at 78 TFLOP/s, 3.7× XLA's same-arithmetic
  baseline at 1024 × 32K causal; the scores' derivative within 2.3e-4 (relative
  Frobenius) of a float64 one at T = S = 4096 causal, H 64, D 128.
* ``"ieee"``: ``Precision.HIGHEST``. Pallas Triton lowers it to IEEE dots on the FMA
  units: exact f32 products, but slow, and an FMA dot holds each thread's operands whole
  along the contraction in registers, so the scorer and DoSA's screen multiply D in
  slices of 16 (``dim_chunk``) on tiles of their own. On an H100 at H 64, D 128: the
  scorer 41.5 ms at 1024 × 32K causal against XLA's IEEE einsum's 27.0 (run 253; 78 ms
  with D whole), DoSA 17 ms on a workload its bound prunes (run 255); the indexer's
  backward took 657 ms against XLA's 39 (T = S = 4096, run 240), so IEEE f32 gradients
  take the reference's derivative.

The mode follows JAX's own setting, ``jax.default_matmul_precision``, so that it is part
of every trace and compiled kernel keyed on it: ``"highest"``, ``"float32"`` or
``"F32_F32_F32"`` ask for ``"ieee"``, ``"TF32_TF32_F32_X3"`` for ``"tf32x3"``. Unset, or
set to a value below f32 precision (the kernels never multiply f32 inputs at less than
near-f32), the kernels take :data:`DEFAULT`. That is JAX's own convention turned up a
notch: unset, XLA multiplies f32 on a GPU in one TF32 product (errors ~1e-3); asked
for "highest", in IEEE f32. The XLA parts of the library (the ``xla`` baselines, the
reference's derivative on a GPU) follow the same mode (:func:`xla_precision`). Pallas
interpret mode on a CPU runs both modes as IEEE dots (the CPU has no TF32).

With f32 operands on the tensor cores Triton stages more in shared memory than the
tiles sized for bf16 allow (every f32 kernel overflowed it on an H100, run 244): it
splits each operand into TF32 hi and lo parts, and a dot's B operand sits in shared
memory twice, at 4 bytes a value. So each kernel takes tiles of its own in
``"tf32x3"`` mode (:func:`tensor_cores` tells it), sized by a model of the bytes its dots
stage (runs 244-246 measured them), and :func:`fits` refuses a shape no tile fits with
``NotImplementedError`` (``implementation=None`` then hands over to the jnp reference).
IEEE dots keep their operands in registers and take tiles of their own instead (the
scorer's ``IEEE_F32_CONFIG``, the screen's ``IEEE_F32_SCREEN_CONFIG``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jsparse import backend

MODES = ("ieee", "tf32x3")
# The mode where jax.default_matmul_precision asks for neither.
DEFAULT = "tf32x3"
_ASKS_IEEE = ("highest", "float32", "F32_F32_F32")
_ASKS_TF32X3 = ("TF32_TF32_F32_X3",)
# Shared memory a Triton program may use on sm_90 (H100, H200: 227 KiB), less a margin
# for the scratch of reductions and layout conversions that the tile models leave out.
SHARED_MEMORY = 232_448 - 2048


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
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def xla_precision():
    """The same products in an XLA dot (the baselines'): ``"tf32x3"`` as XLA's
    TF32_TF32_F32_X3 algorithm on a GPU (a CPU has no TF32 and rejects it), else
    ``Precision.HIGHEST``."""
    if mode() == "tf32x3" and jax.default_backend() == "gpu":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.Precision.HIGHEST


def tensor_cores(compute_dtype) -> bool:
    """Whether a kernel's dots of ``compute_dtype`` operands are f32 on the tensor cores
    (``"tf32x3"``), and so need the kernel's f32 tiles. The same answer in interpret
    mode, so that a CPU traces the tiles a GPU compiles."""
    return jnp.dtype(compute_dtype) == jnp.float32 and mode() == "tf32x3"


def fits(kernel: str, shared_bytes: int, what: str) -> None:
    """Raise ``NotImplementedError`` when a kernel's f32 tile (``what``: the shape and
    tile) needs more than :data:`SHARED_MEMORY` in ``"tf32x3"`` mode."""
    if shared_bytes > SHARED_MEMORY:
        raise NotImplementedError(
            f"{kernel}: f32 inputs under jax.default_matmul_precision "
            f"{jax.config.jax_default_matmul_precision!r} (f32_dots mode 'tf32x3') need "
            f"{shared_bytes} bytes of shared memory at {what}, more than {SHARED_MEMORY}; "
            "ask for 'highest' (IEEE dots) or use implementation='reference'"
        )


def shrink_to_fit(cfg, shared_bytes: Callable, halvable: Callable, kernel: str, what: str):
    """``cfg`` (a kernel's frozen tile dataclass, with ``num_stages``) shrunk until
    ``shared_bytes(cfg)`` fits :data:`SHARED_MEMORY`: one pipeline stage fewer at a time,
    then, with the stages restored, the field that ``halvable(cfg)`` names halved; when it
    names none (None), :func:`fits` refuses the shape (``what``)."""
    fitted = cfg
    while (need := shared_bytes(fitted)) > SHARED_MEMORY:
        if fitted.num_stages > 1:
            fitted = dataclasses.replace(fitted, num_stages=fitted.num_stages - 1)
            continue
        field = halvable(fitted)
        if field is None:
            fits(kernel, need, f"{what} in the smallest tile")
        halved = {field: getattr(fitted, field) // 2, "num_stages": cfg.num_stages}
        fitted = dataclasses.replace(fitted, **halved)
    return fitted


def check_dim_chunk(owner: str, dim_chunk: int) -> None:
    """A tile config's ``dim_chunk``: 0 (the whole contraction in one dot) or a power of
    two ≥ 16 (a dot's smallest K)."""
    if dim_chunk and (dim_chunk < 16 or dim_chunk & (dim_chunk - 1)):
        raise ValueError(f"{owner}.dim_chunk must be 0 or a power of two ≥ 16, got {dim_chunk}")


def contraction_slices(dim: int, dim_chunk: int) -> list[tuple[int, int]]:
    """(start, width) of each slice of a padded contraction of ``dim`` (a power of two)
    multiplied ``dim_chunk`` at a time; one slice for 0 or ``dim_chunk ≥ dim``. IEEE
    (FMA) dots hold each thread's operands whole along the contraction in registers, so
    their kernels multiply it in slices (runs 253, 255)."""
    width = min(dim_chunk or dim, dim)
    return [(start, width) for start in range(0, dim, width)]


def sliced_dot(lhs_parts, rhs_parts):
    """Σ_i lhs_i · rhs_iᵀ (each pair contracted over its last axis) into one f32
    accumulator, in slice order: the dot of the whole operands, whose contraction arrives
    in the slices of :func:`contraction_slices`. Multiplied as :func:`precision` says for
    the operands' dtype; one slice is one dot."""
    mode_precision = precision(rhs_parts[0].dtype)
    acc = None
    for lhs, rhs in zip(lhs_parts, rhs_parts, strict=True):
        dot = jax.lax.dot_general(
            lhs, rhs, (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32, precision=mode_precision,
        )  # fmt: skip
        acc = dot if acc is None else acc + dot
    return acc


def extra_relative_error() -> float:
    """What the f32 kernel dots may err by beyond IEEE f32 products, as a fraction of
    Σ|a_d b_d|: 0 for ``"ieee"``; 2^-20 for ``"tf32x3"`` (≥ 3.01·2^-22, the bound above,
    with a margin). Its three products also mean 3× the additions: see
    :func:`accumulated_terms`."""
    return 2.0**-20 if mode() == "tf32x3" else 0.0


def accumulated_terms(dim: int) -> int:
    """How many products an f32 kernel dot over ``dim`` accumulates."""
    return 3 * dim if mode() == "tf32x3" else dim
