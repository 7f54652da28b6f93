"""Derivatives of the library's ops, which run Pallas kernels.

Four rules (user-facing summary in :mod:`jsparse.backend`'s module doc):

* :func:`reverse_kernel`: an op with a backward kernel of its own (``indexer_scores``)
  runs it in reverse mode (``jax.custom_vjp``; forward mode then needs the reference).
  The backward kernel's own derivative (a second-order gradient, a Hessian-vector
  product) is the reference's, as in :func:`smooth_kernel`.
* :func:`smooth_kernel`: an op whose outputs are smooth in its float inputs (scores,
  attention over given lists) runs the kernel forward and takes the tangent from the
  op's jnp reference, the same function; forward and reverse mode.
* :func:`selection`: a Top-K op returns ids, which need no derivative, and the scores
  of those ids, whose derivative is the derivative of scoring exactly those ids again
  in jnp. Every implementation gets it (the references included: their scores pass
  through integer codes, which would otherwise make the gradient a silent zero), and
  nothing inside the op is differentiated (DoSA's planner has no derivative). Forward
  and reverse mode (``jax.custom_jvp``).
* :func:`no_derivative`: any other kernel raises ``NotImplementedError`` naming the op
  once a gradient reaches its outputs; none is raised when only its ids are used.

The array arguments of the wrapped call become the wrapper's explicit inputs (JAX
differentiates only those); everything else (Python numbers, flags, None, numpy
constants) is closed over as the static part. A call on concrete arrays only cannot be
differentiated (``jax.grad`` passes tracers), so it runs unwrapped: a custom rule
costs ~0.8 ms of host time per eager call, and nothing under ``jit`` (the lowered
module is unchanged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse import _checks


def _explicit_arrays(args: tuple, kwargs: dict):
    """(arrays, bind): the jax arrays among ``args`` / ``kwargs``, and ``bind(fn)``, which
    calls ``fn(*args, **kwargs)`` with given arrays in their places."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]

    def bind(fn: Callable) -> Callable:
        def call(*arrays):
            filled = list(leaves)
            for i, x in zip(slots, arrays, strict=True):
                filled[i] = x
            a, kw = jax.tree.unflatten(tree, filled)
            return fn(*a, **kw)

        return call

    return [leaves[i] for i in slots], bind


def _tangent_like(primal, tangent):
    if jnp.issubdtype(primal.dtype, jnp.floating):
        return tangent.astype(primal.dtype)
    return tangent


def _traced(arrays) -> bool:
    return any(_checks.is_traced(x) for x in arrays)


def smooth_kernel(kernel: Callable, reference: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel(*args, **kwargs)``, differentiated as ``reference`` (same signature)."""
    arrays, bind = _explicit_arrays(args, kwargs)
    run_kernel = bind(kernel)
    if not _traced(arrays):
        return run_kernel(*arrays)
    return _reference_tangents(run_kernel, bind(reference))(*arrays)


def _reference_tangents(run: Callable, reference: Callable) -> Callable:
    """``run``, whose forward-mode tangent is ``reference``'s (same arguments)."""
    smooth = jax.custom_jvp(run)

    @smooth.defjvp
    def _(primals, tangents):
        _, tangent_out = jax.jvp(reference, primals, tangents)
        out = run(*primals)
        # a kernel may return its inputs' dtype where the reference returns f32
        return out, jax.tree.map(_tangent_like, out, tangent_out)

    return smooth


def reverse_kernel(kernel: Callable, backward: Callable, reference: Callable, args: tuple) -> Any:
    """``kernel(*args)``, whose reverse-mode derivative is ``backward(cotangent, *args)``:
    one cotangent per positional argument (None: no cotangent). ``args`` are flat:
    arrays, None or static values (their derivative is by position). ``reference``
    (same signature as ``kernel``) differentiates the backward in turn."""
    if any(len(jax.tree.leaves(a)) > 1 for a in args):
        raise TypeError("reverse_kernel: every argument must be an array, None or a static value")
    arrays, bind = _explicit_arrays(args, {})
    run = bind(kernel)
    if not _traced(arrays):
        return run(*arrays)
    positions = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    inexact = [j for j, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.inexact)]
    op = jax.custom_vjp(run)

    # Pallas calls have no derivative of their own, so a gradient of the gradient (which
    # differentiates this forward and the backward below) takes the reference's tangents.
    forward_kernel = _reference_tangents(run, bind(reference))

    def forward(*arrays):
        return forward_kernel(*arrays), arrays

    def kernel_cotangents(cotangent, *arrays):
        per_arg = bind(functools.partial(backward, cotangent))(*arrays)
        return tuple(per_arg[positions[j]] for j in inexact)

    def reference_cotangents(cotangent, *arrays):
        _, vjp = jax.vjp(bind(reference), *arrays)
        per_array = vjp(cotangent)
        return tuple(per_array[j] for j in inexact)

    backward_kernel = _reference_tangents(kernel_cotangents, reference_cotangents)

    def backward_rule(arrays, cotangent):
        from jsparse._pallas import varying_axes  # imports Pallas, as the kernels do

        def typed(ct, primal):
            # Inside a checked shard_map a primal that does not vary over a mesh axis
            # (replicated keys) takes the sum of every shard's cotangent, as JAX's own
            # transpose of the cast to varying does.
            extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
            return jax.lax.psum(ct, extra) if extra else ct

        computed = dict(zip(inexact, backward_kernel(cotangent, *arrays), strict=True))
        return tuple(typed(computed[j], a) if j in computed else None for j, a in enumerate(arrays))

    op.defvjp(forward, backward_rule)
    return op(*arrays)


def no_derivative(op: str, name: str, kernel: Callable, args: tuple, kwargs: dict) -> Any:
    """``kernel(*args, **kwargs)``; a gradient reaching its outputs raises."""
    arrays, bind = _explicit_arrays(args, kwargs)
    run_kernel = bind(kernel)
    if not _traced(arrays):
        return run_kernel(*arrays)
    refused = jax.custom_vjp(run_kernel)

    def forward(*arrays):
        return run_kernel(*arrays), None

    def backward(_, cotangents):
        raise NotImplementedError(
            f"{op}: the {name!r} kernels have no derivative; differentiate with "
            "implementation='reference', or lax.stop_gradient their outputs"
        )

    refused.defvjp(forward, backward)
    return refused(*arrays)


def selection(
    select: Callable,
    rescore: Callable,
    picked: Callable,
    args: tuple,
) -> Any:
    """``select(*args)``, whose selected scores differentiate as ``rescore``.

    Args:
      select: the op's body; its output holds ids and their scores.
      rescore: ``rescore(ids, *args) -> scores``: the scores of the given ids (-1: an
        empty slot, any value), in differentiable jnp.
      picked: ``picked(output) -> (ids, scores)``, ``scores`` one of the output's leaves.
      args: ``select``'s arguments.
    """
    arrays, bind = _explicit_arrays(args, {})
    run = bind(select)
    if not _traced(arrays):
        return run(*arrays)
    op = jax.custom_jvp(run)

    @op.defjvp
    def _(primals, tangents):
        out = run(*primals)
        ids, scores = picked(out)
        floats = [j for j, a in enumerate(primals) if jnp.issubdtype(a.dtype, jnp.inexact)]

        def rescored(*xs):  # the float inputs in; the ids, and every other input, held
            filled = list(primals)
            for j, x in zip(floats, xs, strict=True):
                filled[j] = x
            return bind(functools.partial(rescore, ids))(*filled)

        _, tangent = jax.jvp(rescored, [primals[j] for j in floats], [tangents[j] for j in floats])
        # an empty slot's score is -inf whatever the inputs: its tangent is zero
        tangent = jnp.where(ids >= 0, tangent.astype(scores.dtype), 0.0)
        leaves, tree = jax.tree.flatten(out)
        zeros = [_zero_tangent(leaf) for leaf in leaves]
        zeros[next(i for i, leaf in enumerate(leaves) if leaf is scores)] = tangent
        return out, jax.tree.unflatten(tree, zeros)

    return op(*arrays)


def _zero_tangent(primal):
    if jnp.issubdtype(primal.dtype, jnp.inexact):
        return jnp.zeros_like(primal)
    return np.zeros(primal.shape, jax.dtypes.float0)
