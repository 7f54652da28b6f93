"""Pallas calls that keep JAX's varying-axis types.

Inside ``jax.shard_map`` with ``check_vma=True`` (its default) every value is typed by the
mesh axes it varies over, and a Pallas call must declare that type for its outputs
(JAX cannot see into a kernel). A kernel's outputs are functions of all its inputs, so
they vary over every axis that any input varies over: these wrappers declare exactly
that, when the kernel is called, so one kernel built once serves any mesh. Elsewhere
(outside ``shard_map``, or under ``check_vma=False``) JAX reads no such type.
"""

from __future__ import annotations

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
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*args)

    return call


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
