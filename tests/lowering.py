"""Lowering Pallas Triton kernels to CUDA on a machine without a GPU.

Interpret mode accepts operations the Triton backend rejects (sort, 3-D dots, odd
block shapes), so a green interpret test does not prove the GPU build. Lowering for an
abstract H200 runs the whole Pallas → Triton IR translation on the CPU and fails on
any unsupported primitive, shape or dtype. (It does not run Triton's own compiler.)
"""

from __future__ import annotations

import jax

from jsparse import backend


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
        try:
            device = jax.sharding.AbstractDevice(
                device_kind="NVIDIA H200", platform="gpu", num_cores=132
            )
            mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
            with jax.sharding.use_abstract_mesh(mesh):
                return traced.lower(lowering_platforms=("cuda",))
        except (AttributeError, TypeError):
            # Older jax lacks the abstract-device API; it lowers for a default sm_90 target.
            return traced.lower(lowering_platforms=("cuda",))
