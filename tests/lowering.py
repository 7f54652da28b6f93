"""Lowering Pallas Triton kernels to CUDA on a machine without a GPU.

Interpret mode accepts operations the Triton backend rejects (sort, 3-D dots, odd
block shapes), so a green interpret test does not prove the GPU build. Lowering for an
abstract H200 runs the whole Pallas → Triton IR translation on the CPU and fails on
any unsupported primitive, shape or dtype. (It does not run Triton's own compiler.)
"""

from __future__ import annotations

import jax

from jsparse import backend


def _h200():
    """An abstract H200, or None where jax lacks the abstract-device API."""
    try:
        return jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    except (AttributeError, TypeError):
        return None


def h200_mesh(axis_names: tuple[str, ...]):
    """A mesh of one abstract H200 per named axis (size 1 each), for ``jax.shard_map``."""
    sizes = (1,) * len(axis_names)
    device = _h200()
    if device is None:
        return jax.sharding.AbstractMesh(sizes, axis_names)
    return jax.sharding.AbstractMesh(sizes, axis_names, abstract_device=device)


def lower_for_h200(fn, *args, **kwargs):
    """Lowers ``jax.jit(fn)`` for CUDA with ShapeDtypeStruct (or array) arguments."""
    structs = jax.tree.map(
        lambda a: (
            a if isinstance(a, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(a.shape, a.dtype)
        ),
        args,
    )
    with backend.interpret_mode(False):
        traced = jax.jit(fn, **kwargs).trace(*structs)
        device = _h200()
        if device is None:  # older jax lowers for a default sm_90 target
            return traced.lower(lowering_platforms=("cuda",))
        with jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((), (), abstract_device=device)
        ):
            return traced.lower(lowering_platforms=("cuda",))
