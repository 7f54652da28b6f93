"""The per-query report of methods that score every visible key (``base``), in one launch.

Its fields are the same [T] row for three of them (visible keys) and two constants (no
threshold, no fallback). Left to XLA they are three launches a call (a subtract, a
broadcast or copy per distinct output): 2.6-3.1 µs of a 30-60 µs decode step on the
H200 (WORKSPACE.md, run 66). A model that keeps only the indices pays none of it (XLA
drops unused outputs); a caller that returns the whole result pays one small launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import pallas_call

_BLOCK = 1024  # queries per program


def store_report(refs, rows, ok, visible, t):
    """Inside a kernel: the report of ``rows`` (those with ``ok``) into its five [T] refs
    (visible, candidates, survivors, threshold, fallback), given their visible counts."""
    dst = jnp.where(ok, rows, t)  # one past the end: dropped when interpreted, masked on GPU
    for ref in refs[:3]:
        plt.store(ref.at[dst], visible, mask=ok)
    plt.store(refs[3].at[dst], jnp.full(rows.shape, -jnp.inf, jnp.float32), mask=ok)
    plt.store(refs[4].at[dst], jnp.zeros(rows.shape, jnp.bool_), mask=ok)


def report_shapes(t):
    """The five [T] outputs :func:`store_report` writes, as a launch's out_shape."""
    i32 = jax.ShapeDtypeStruct((t,), jnp.int32)
    return (i32, i32, i32, jax.ShapeDtypeStruct((t,), jnp.float32),
            jax.ShapeDtypeStruct((t,), jnp.bool_))  # fmt: skip


def _report_kernel(start_ref, end_ref, *report_refs, t):
    rows = pl.program_id(0) * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)
    ok = rows < t
    at = jnp.where(ok, rows, 0)
    end = plt.load(end_ref.at[at], mask=ok, other=0)
    store_report(report_refs, rows, ok, end - plt.load(start_ref.at[at], mask=ok, other=0), t)


def exhaustive_report(start, end):
    """(visible, candidates, survivors, threshold, fallback) [T] of a method that scored
    every visible key of ``[start, end)``: end - start three times, -inf, False."""
    t = start.shape[0]
    return pallas_call(
        functools.partial(_report_kernel, t=t),
        grid=(pl.cdiv(t, _BLOCK),),
        out_shape=report_shapes(t),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=backend.is_interpret(),
        name="jsparse_indexer_report",
    )(start, end)
