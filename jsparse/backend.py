"""Implementation names, device detection and dispatch with fallback.

Every public op takes ``implementation=``:

* ``None``: the op's preferred order for the current device. On an NVIDIA GPU that
  is its Pallas kernels (fastest first); elsewhere the jnp reference. A kernel that
  raises ``NotImplementedError`` for the given input hands over to the next name.
  Opt-in kernels (``OPT_IN_IMPLEMENTATIONS``: ``"mosaic"``, whose FP8 scores round
  differently from the Triton scorer's and which has ``base`` only) are never chosen
  this way, only by name.
* a name (``"reference"``, ``"triton"``, ``"mosaic"``): exactly that one; its
  errors propagate, nothing falls back silently.
* a sequence of names: tried in order, falling back on ``NotImplementedError``; a
  name the op does not implement (``"mosaic"`` where it has no Mosaic kernel) is
  skipped, so one preference list serves every op. Alone, such a name raises
  ``NotImplementedError``; a name outside :data:`IMPLEMENTATIONS` is a ``ValueError``.

Derivatives. Every op is differentiable where its math is (``jsparse._autodiff``):

* ``indexer_scores``' Triton and Mosaic kernels have a backward of their own (two Triton
  kernels, :mod:`jsparse.ops.indexer.backward`): reverse mode only; forward mode
  through them raises, and ``implementation="reference"`` has both; a gradient of
  the gradient differentiates the backward kernels as the reference's backward;
* the other ops smooth in their float inputs (``indexed_attention``,
  ``indexed_mla_attention``, ``projected_scores``, ``projected_step``:
  ``dispatch(..., differentiable=True)``) run the kernel forward and take the derivative
  of their jnp reference, the same function, in forward and reverse mode (at the
  reference's memory cost);
* the Top-K ops return ids, which need no derivative, and the ids' scores, whose
  derivative is that of scoring exactly those ids again in jnp, for every method and
  implementation (forward and reverse mode);
* a kernel dispatched without either raises ``NotImplementedError`` naming the op once
  a gradient reaches its outputs, never an error from inside Pallas.

Pallas kernels run compiled on a GPU, or in Pallas interpret mode anywhere (the
kernel body executed as plain XLA ops, slow but faithful to the kernel's logic).
Interpret mode is switched on with :func:`interpret_mode` (tests, CPU benchmarks)
or ``JSPARSE_INTERPRET=1``. Dispatch reads it while tracing, so the library's own jits
above dispatch keep one trace per mode (:func:`jit_per_mode`); a jit of your own
keeps the mode it was first traced in.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax

from jsparse import _autodiff

__all__ = [
    "IMPLEMENTATIONS",
    "Implementation",
    "check_triton_offsets",
    "dispatch",
    "has_nvidia_gpu",
    "interpret_mode",
    "is_interpret",
    "jit_per_mode",
    "resolve",
]

Implementation = Literal["reference", "triton", "mosaic"]
IMPLEMENTATIONS: tuple[str, ...] = ("reference", "triton", "mosaic")
PALLAS_IMPLEMENTATIONS = frozenset({"triton", "mosaic"})
# Kernels only an explicit ``implementation=`` selects. The Mosaic GPU scorer is faster
# with FP8 keys on an H200 (WORKSPACE.md, run 15), but ``full``, ``dense`` and ``dosa``
# run on the Triton scorer only: choosing Mosaic for ``base`` alone would make methods
# of ``implementation=None`` disagree at near-ties.
OPT_IN_IMPLEMENTATIONS = frozenset({"mosaic"})

_log = logging.getLogger("jsparse")
_state = threading.local()


# The H200's SM count: the launch planners' unit where no GPU is visible (CPU tests,
# lowering for an abstract H200), and the count their per-SM targets were measured at.
DEFAULT_SM_COUNT = 132


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of the default GPU (its ``core_count``), else
    ``DEFAULT_SM_COUNT``: the unit in which every launch planner counts programs."""
    if not has_nvidia_gpu():
        return DEFAULT_SM_COUNT
    return int(getattr(jax.devices()[0], "core_count", 0) or DEFAULT_SM_COUNT)


@functools.cache
def has_nvidia_gpu() -> bool:
    """True when jax's default backend is an NVIDIA GPU."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and "nvidia" in device.device_kind.lower()


def is_interpret() -> bool:
    """Whether Pallas kernels run in interpret mode (see :func:`interpret_mode`)."""
    flag = getattr(_state, "interpret", None)
    if flag is None:
        return os.environ.get("JSPARSE_INTERPRET", "0") not in ("", "0", "false", "False")
    return flag


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Run Pallas kernels in interpret mode inside this block (thread-local)."""
    previous = getattr(_state, "interpret", None)
    _state.interpret = enabled
    try:
        yield
    finally:
        _state.interpret = previous


def jit_per_mode(fun: Callable | None = None, **jit_kwargs: Any) -> Callable:
    """``jax.jit(fun, **jit_kwargs)`` with one trace cache per :func:`is_interpret`.

    Dispatch reads the mode while tracing, so a library function jitted above it (a
    selector's ``select``, a model's step) would otherwise serve a trace made in one mode
    to calls in the other: the interpreted kernels silently not run.
    """
    if fun is None:
        return functools.partial(jit_per_mode, **jit_kwargs)

    def one_mode():
        # a function object of its own: JAX keys its trace cache on the function
        @functools.wraps(fun)
        def body(*args, **kwargs):
            return fun(*args, **kwargs)

        return jax.jit(body, **jit_kwargs)

    traced = {mode: one_mode() for mode in (False, True)}

    @functools.wraps(fun)
    def call(*args, **kwargs):
        return traced[is_interpret()](*args, **kwargs)

    return call


def _available(name: str) -> bool:
    if name == "reference":
        return True
    return is_interpret() or has_nvidia_gpu()


def resolve(
    implementation: str | Sequence[str] | None,
    preferred: Sequence[str],
) -> tuple[list[str], bool]:
    """Turns an ``implementation=`` argument into an ordered list of names.

    Returns ``(names, may_fall_back)``. ``preferred`` is the op's own order of its
    implementations, fastest first; it also defines which names the op knows.
    """
    known = tuple(preferred)
    names, may_fall_back = check_implementation(implementation)
    if names is None:
        # Interpret mode counts as "kernels available": whoever switched it on wants them.
        names = [
            n
            for n in known
            if n != "reference" and n not in OPT_IN_IMPLEMENTATIONS and _available(n)
        ]
        if "reference" in known:
            names.append("reference")
        return names, True
    # A name the library knows but this op does not implement is valid input it does not
    # support: skipped in a sequence (one preference list can serve several ops), refused
    # alone.
    offered = [name for name in names if name in known]
    if not offered:
        raise NotImplementedError(
            f"implementation: {implementation!r} is not implemented by this op; it has "
            f"{list(known)}"
        )
    return offered, may_fall_back


def check_implementation(
    implementation: str | Sequence[str] | None,
) -> tuple[list[str] | None, bool]:
    """``(names, may_fall_back)`` of an ``implementation=`` argument, names None for
    None; a ``ValueError`` for anything but None, a library name or a non-empty sequence
    of them. Also for a method that ignores the argument (``"xla"``), so that a typo
    never passes silently."""
    if implementation is None:
        return None, True
    if isinstance(implementation, str):
        names, may_fall_back = [implementation], False
    elif isinstance(implementation, Sequence) and all(isinstance(n, str) for n in implementation):
        names, may_fall_back = list(implementation), True
        if not names:
            raise ValueError("implementation: got an empty sequence; expected one or more names")
    else:
        raise ValueError(
            f"implementation: got {implementation!r}; expected None, a name or a sequence of "
            f"names of {list(IMPLEMENTATIONS)}"
        )
    for name in names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation: got {name!r}; expected one of {list(IMPLEMENTATIONS)}"
            )
    return names, may_fall_back


def dispatch(
    op: str,
    implementations: dict[str, Callable[..., Any]],
    implementation: str | Sequence[str] | None,
    /,
    *args: Any,
    differentiable: bool = False,
    backward: dict[str, Callable[..., Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """Calls the first implementation of ``op`` that accepts the input.

    ``implementations`` maps names to callables in the op's preferred order, all with
    one signature. ``differentiable``: the op's outputs are smooth functions of its float
    inputs, so a kernel's derivative is its ``"reference"``'s (module doc); otherwise a
    gradient reaching a kernel's float outputs raises ``NotImplementedError``.
    ``backward``: Pallas implementations with a backward kernel of their own,
    ``backward[name](cotangent, *args)`` (positional arguments only), used in reverse
    mode in place of the reference's derivative.
    """
    names, may_fall_back = resolve(implementation, tuple(implementations))
    errors: list[str] = []
    for name in names:
        if name in PALLAS_IMPLEMENTATIONS and not _available(name):
            message = (
                f"{op}: implementation {name!r} needs an NVIDIA GPU, or Pallas interpret mode "
                "(jsparse.backend.interpret_mode() or JSPARSE_INTERPRET=1)"
            )
            if may_fall_back:
                errors.append(message)
                continue
            raise NotImplementedError(message)
        if name in PALLAS_IMPLEMENTATIONS:
            _check_unvarying(op, name, args, kwargs)  # raised, never a silent fallback
        try:
            if name not in PALLAS_IMPLEMENTATIONS:
                return implementations[name](*args, **kwargs)
            kernel = _with_default_types(implementations[name])
            if backward and name in backward:
                if kwargs:
                    raise TypeError(f"{op}: a backward kernel takes positional arguments only")
                reference = implementations["reference"]
                return _autodiff.reverse_kernel(kernel, backward[name], reference, args)
            if differentiable:
                reference = implementations["reference"]
                return _autodiff.smooth_kernel(kernel, reference, args, kwargs)
            return _autodiff.no_derivative(op, name, kernel, args, kwargs)
        except NotImplementedError as err:
            if not may_fall_back:
                raise
            errors.append(f"{name}: {err}")
            _log.debug("%s: %s declined (%s), falling back", op, name, err)
    raise NotImplementedError(f"{op}: no implementation accepted the input: {'; '.join(errors)}")


def _check_unvarying(op: str, name: str, args, kwargs) -> None:
    """Inside ``jax.shard_map`` with ``check_vma=True`` (its default) every value is typed
    by the mesh axes it varies over. Compiled kernels declare their outputs' type
    (:mod:`jsparse._pallas`); Pallas interpret mode cannot run there (jax's interpreter
    evaluates the kernel body under those checks, where a kernel's constants do not
    vary and its loaded values do). Raised here, not from inside Pallas, and never a
    silent fallback. Under ``check_vma=False`` interpreted kernels run as anywhere."""
    if not is_interpret():
        return
    from jsparse._pallas import varying_axes  # imports Pallas

    varying = varying_axes((args, kwargs))
    if varying:
        raise NotImplementedError(
            f"{op}: the {name!r} kernels in Pallas interpret mode run inside jax.shard_map "
            f"only with check_vma=False (an input varies over mesh axes {sorted(varying)}); "
            "compiled on a GPU they run under either setting"
        )


def _with_default_types(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` traced with JAX's default type rules, whatever the caller set.

    The kernels' inputs are checked to be 32-bit or narrower, and their code is written
    for the defaults. With ``jax_enable_x64`` a sum of int32 is int64 and a Python int
    widens to it (loop carries then change type: a TypeError from inside the selection
    kernels); with ``jax_numpy_dtype_promotion="strict"`` a Python float may not meet an
    int32. Neither setting changes what the kernels compute.
    """

    @functools.wraps(kernel)
    def traced_with_default_types(*args, **kwargs):
        with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
            return kernel(*args, **kwargs)

    return traced_with_default_types


def check_triton_offsets(op: str, **operands) -> None:
    """Raises ``NotImplementedError`` for an operand that Pallas Triton would read at
    wrapped addresses.

    Its lowering (jax 0.10-0.11) computes element offsets in signed 32 bits unless the
    operand exceeds 4 GiB, so an operand of more than 2**31 elements but at most 4 GiB
    (only 1-byte dtypes: an FP8 cache of 2-4 GiB) has offsets past 2**31 that wrap
    negative: a silent wrong read or an illegal address (WORKSPACE.md, run 163). Under
    ``implementation=None`` the op then falls back to its reference.
    """
    for name, x in operands.items():
        if x is None:
            continue
        size = math.prod(x.shape)
        nbytes = size * x.dtype.itemsize
        if size > 2**31 and nbytes <= 2**32:
            raise NotImplementedError(
                f"{op}: {name} {tuple(x.shape)} {x.dtype} has {size} elements in {nbytes} "
                "bytes; Pallas Triton addresses an operand of 2**31 elements to 4 GiB with "
                "32-bit offsets that wrap"
            )
