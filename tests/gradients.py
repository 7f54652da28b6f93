"""Gradients of a Flax layer's decode step with respect to its weights, compared
between the reference path and the Pallas kernels (interpreted on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.implementations import running


def weight_gradient(module, step) -> list:
    """The leaves of d Σ tanh(step(module)) / d (module's nnx.Param weights), jitted."""
    graphdef, weights, rest = nnx.split(module, nnx.Param, ...)

    def loss(weights):
        return jnp.sum(jnp.tanh(step(nnx.merge(graphdef, weights, rest))))

    return jax.tree.leaves(jax.jit(jax.grad(loss))(weights))


def assert_kernels_differentiate_like_the_reference(gradient) -> None:
    """``gradient(implementation)`` -> leaves, equal for "triton" and "reference"."""
    want = gradient("reference")
    with running("triton") as name:
        got = gradient(name)
    assert sum(float(jnp.abs(g).max()) for g in want) > 0
    for g, w in zip(got, want, strict=True):
        scale = max(1.0, float(jnp.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * scale)
