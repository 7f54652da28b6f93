"""Pallas calls that keep JAX's varying-axis types.

Inside ``jax.shard_map`` with ``check_vma=True`` (its default) every value is typed by the
mesh axes it varies over, and a Pallas call must declare that type for its outputs
(JAX cannot see into a kernel). A kernel's outputs are functions of all its inputs, so
they vary over every axis that any input varies over: these wrappers declare exactly
that, when the kernel is called, so one kernel built once serves any mesh. Elsewhere
(outside ``shard_map``, or under ``check_vma=False``) JAX reads no such type.

Interpreted (``interpret=True``), a call is compiled once per distinct kernel and called
from the enclosing program (:func:`_outlined`; ``$JSPARSE_INLINE_INTERPRETED`` inlines).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


def varying_axes(args: Any) -> frozenset:
    """The mesh axes any array in ``args`` varies over (empty outside a checked
    ``shard_map``)."""
    axes = frozenset()
    for x in jax.tree.leaves(args):
        if isinstance(x, jax.Array):
            mat = getattr(jax.typeof(x), "manual_axis_type", None)
            axes |= frozenset(getattr(mat, "varying", ()) or ())
    return axes


def _typed(shapes: Any, args: tuple) -> tuple[Any, tuple]:
    """(``shapes``, ``args``) typed to vary over the axes any of ``args`` varies over.

    Each argument that varies over fewer axes is cast to vary over them all (no data
    moves), since an output aliased to an input takes the input's type; the shapes
    (ShapeDtypeStructs) then declare the arguments' common type, even when it is no axis
    (a checked ``shard_map`` wants it said)."""
    axes = varying_axes(args)
    if axes:
        args = jax.tree.map(lambda x: _vary(x, axes), args)
    arrays = [x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)]
    mat = getattr(jax.typeof(arrays[0]), "manual_axis_type", None) if arrays else None
    if mat is None:
        return shapes, args
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), shapes
    )
    return shapes, args


def _vary(x: Any, axes: frozenset) -> Any:
    if isinstance(x, np.ndarray):  # a constant: typed as varying over no axis
        x = jnp.asarray(x)
    if not isinstance(x, jax.Array):
        return x
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def pallas_call(kernel: Callable[..., None], *, out_shape: Any, **kwargs: Any) -> Callable:
    """``pl.pallas_call(kernel, out_shape=..., **kwargs)`` with the outputs' varying axes
    declared from the arguments it is called with."""

    def call(*args):
        shapes, args = _typed(out_shape, args)
        fn = pl.pallas_call(kernel, out_shape=shapes, **kwargs)
        if kwargs.get("interpret") and not varying_axes(args) and not os.environ.get(INLINE_ENV):
            return _outlined(fn, shapes, args)
        return fn(*args)

    return call


# Interpreted kernels, compiled, by their jaxpr and constants (see _outlined); the least
# recently used go past OUTLINED_KEPT, so that a long process (a test suite) does not
# hold every kernel it ever ran.
_OUTLINED: collections.OrderedDict[str, Callable] = collections.OrderedDict()
OUTLINED_KEPT = 256
# Set (to anything but "") to inline interpreted kernels into their callers' programs as
# plain Pallas does: for an A/B of the two, or to differentiate through a raw kernel.
INLINE_ENV = "JSPARSE_INLINE_INTERPRETED"


def _outlined(fn: Callable, shapes: Any, args: tuple) -> Any:
    """An interpreted Pallas call compiled as a program of its own, once per distinct
    kernel, and called from the enclosing program as a host callback.

    Interpreted, a kernel is an XLA loop over its grid that XLA compiles on the CPU, and
    inlined it is compiled again inside every program that calls it: the four `full`
    pipelines of one test compiled their shared kernels four times (~8 s each). The
    kernel's values are the same either way (the same jaxpr, compiled by the same XLA);
    it is not differentiable through the callback, which no op needs (each defines its
    own derivative). Under a checked ``shard_map`` (varying axes) the call stays inline."""
    import hashlib

    import jax.extend.core as jex

    leaves, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)))(*leaves)
    key = hashlib.sha256(str(closed.jaxpr).encode())
    for c in closed.consts:  # constants print as names only: their values are the key too
        c = np.asarray(c)
        key.update(f"{c.dtype}{c.shape}".encode() + c.tobytes())
    digest = key.hexdigest()
    compiled = _OUTLINED.get(digest)
    if compiled is None:  # (a new entry goes in last, the most recently used)
        compiled = _OUTLINED[digest] = jax.jit(jex.jaxpr_as_fun(closed))
        while len(_OUTLINED) > OUTLINED_KEPT:
            _OUTLINED.popitem(last=False)
    else:
        _OUTLINED.move_to_end(digest)
    out_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.out_avals]

    def host(*xs):
        return [np.asarray(o) for o in compiled(*xs)]

    outs = jax.pure_callback(host, out_types, *leaves, vmap_method="sequential")
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def mosaic_kernel(body: Callable[..., None], *, out_type: Any, **kwargs: Any) -> Callable:
    """``plgpu.kernel(body, out_type=..., **kwargs)``, typed as :func:`pallas_call`.
    jax 0.10.2 traces these kernels with the checks off, so their outputs come back
    typed as varying over no axis whatever was declared: they are cast after the call."""
    from jax.experimental.pallas import mosaic_gpu as plgpu  # needs absl-py on 0.10.2

    def call(*args):
        shapes, args = _typed(out_type, args)
        outs = plgpu.kernel(body, out_type=shapes, **kwargs)(*args)
        axes = varying_axes(args)
        return jax.tree.map(lambda x: _vary(x, axes), outs) if axes else outs

    return call
