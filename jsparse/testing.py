"""Checks shared by the test suite and the benchmarks: the Top-K correctness gate, and
lowering Pallas Triton kernels to CUDA on a machine without a GPU.

Interpret mode accepts operations the Triton backend rejects (sort, 3-D dots, odd
block shapes), so a green interpret test does not prove the GPU build. Lowering for an
abstract H200 runs the whole Pallas → Triton IR translation on the CPU and fails on
any unsupported primitive, shape or dtype. (It does not run Triton's own compiler:
`bench/sass.py` does, where the `triton` package is installed.)
"""

from __future__ import annotations

import jax
import numpy as np

from jsparse import backend


def topk_mismatches(indices, scores, oracle_scores, top_k: int, atol: float) -> list[str]:
    """Differences between a Top-K result and Top-K of exact ``oracle_scores`` rows.

    ``oracle_scores``: [T, S] float64 with ``-inf`` for invisible keys. A result passes
    when, per row: padding is -1/-inf past the visible count; ids are distinct and each
    one's oracle score equals its reported score within ``atol``; the reported scores
    equal the oracle's sorted Top-K scores within ``atol``; and, where the K-th and
    (K+1)-th oracle scores are more than 4·atol apart, the id set is exactly the
    oracle's. Returns human-readable problems (empty list: pass).
    """
    indices = np.asarray(indices)
    scores = np.asarray(scores, np.float64)
    problems = []
    for t, row in enumerate(np.asarray(oracle_scores, np.float64)):
        finite = np.isfinite(row) | np.isnan(row)
        n = min(top_k, int((row > -np.inf).sum() + np.isnan(row).sum()))
        if not (np.all(indices[t, n:] == -1) and np.all(np.isneginf(scores[t, n:]))):
            problems.append(f"row {t}: padding past {n} visible keys is not -1/-inf")
        ids = indices[t, :n]
        if len(set(ids.tolist())) != n or np.any(ids < 0):
            problems.append(f"row {t}: ids not distinct or negative: {ids[:8]}...")
            continue
        order = np.lexsort((np.arange(row.size), -np.nan_to_num(row, nan=np.inf)))[:n]
        if not np.allclose(scores[t, :n], row[order], atol=atol, rtol=0, equal_nan=True):
            worst = np.nanmax(np.abs(scores[t, :n] - row[order]))
            problems.append(f"row {t}: top-{n} scores differ from the oracle by up to {worst:.3g}")
        if not np.allclose(row[ids], scores[t, :n], atol=atol, rtol=0, equal_nan=True):
            problems.append(f"row {t}: reported scores do not match the oracle at their ids")
        if n < finite.sum():
            rest = np.sort(row[np.isfinite(row)])[::-1]
            separated = n < rest.size and row[order[n - 1]] - rest[n] > 4 * atol
            if separated and set(ids.tolist()) != set(order.tolist()):
                problems.append(f"row {t}: id set differs from the oracle's")
    return problems


def order_mismatches(indices, scores) -> list[str]:
    """Rows not in the Top-K contract's order: score descending (NaN first, as the
    selection ranks it), equal scores by id ascending, then the -1 / -inf padding."""
    indices, scores = np.asarray(indices), np.asarray(scores, np.float64)
    problems = []
    for t in range(indices.shape[0]):
        n = int(np.sum(indices[t] >= 0))
        if np.any(indices[t, :n] < 0):
            problems.append(f"row {t}: padding (-1) before a listed id")
            continue
        key = -np.nan_to_num(scores[t, :n], nan=np.inf, posinf=np.finfo(np.float64).max)
        ids = indices[t, :n]
        later = (key[1:] < key[:-1]) | ((key[1:] == key[:-1]) & (ids[1:] < ids[:-1]))
        if later.any():
            at = int(np.flatnonzero(later)[0]) + 1
            problems.append(
                f"row {t}: entry {at} (id {ids[at]}, score {scores[t, at]:.6g}) is out of "
                f"order after id {ids[at - 1]} (score {scores[t, at - 1]:.6g})"
            )
    return problems


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
