"""Public projected-key scoring: :func:`projected_scores`."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jsparse import _checks, backend
from jsparse.ops.projected.reference import projected_scores_reference, projected_step_reference

CACHE_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn)


def projected_scores(
    q_proj: Float[Array, "B Hkv R"],
    values: Float[Array, "B S Hkv R"],
    *,
    implementation: str | Sequence[str] | None = None,
) -> Float[Array, "B Hkv S"]:
    """Every token's score for each KV head: ``Σ_r q_proj[b, h, r] · values[b, s, h, r]``.

    Args:
      q_proj: [B, Hkv, R] float32, each KV head's projected query (with any per-head
        dequantisation scale already multiplied in).
      values: [B, S, Hkv, R] float32, bfloat16 or float8_e4m3fn: the projected-key cache
        as stored (the selectors' ``ProjectedKeys.values``), widened to f32 on load.
      implementation: see :mod:`jsparse.backend` (``"triton"`` or ``"reference"``). The
        Triton kernel needs R a power of two (``NotImplementedError`` otherwise).

    Returns:
      float32 [B, Hkv, S]. The kernel sums each head's R products in its own order, so
      scores agree with the reference to f32 rounding, not bit for bit.
    """
    _checks.check_rank("q_proj", q_proj, 3, "[B, Hkv, R]")
    _checks.check_rank("values", values, 4, "[B, S, Hkv, R]")
    _checks.check_dtype("q_proj", q_proj, (jnp.float32,))
    _checks.check_dtype("values", values, CACHE_FLOATS)
    b, hkv, r = q_proj.shape
    _checks.check_dim("values", values, 0, b, f"B of q_proj {tuple(q_proj.shape)}")
    _checks.check_dim("values", values, 2, hkv, f"Hkv of q_proj {tuple(q_proj.shape)}")
    _checks.check_dim("values", values, 3, r, f"R of q_proj {tuple(q_proj.shape)}")
    if 0 in values.shape:
        return jnp.zeros((b, hkv, values.shape[1]), jnp.float32)
    return backend.dispatch(
        "projected_scores", _implementations(), implementation, q_proj, values,
        differentiable=True,
    )  # fmt: skip


def projected_step(
    q: Float[Array, "B H D"],
    k_new: Float[Array, "B Hkv D"],
    query_map: Float[Array, "Hkv R D"],
    key_map: Float[Array, "Hkv R D"],
    values: Float[Array, "B S Hkv R"],
    scale: Float[Array, "B Hkv"],
    slots: Int[Array, " B"],
    *,
    implementation: str | Sequence[str] | None = None,
) -> tuple[Float[Array, "B Hkv R"], Float[Array, "B S Hkv R"]]:
    """A projected selector's decode step before scoring, in one launch.

    Returns ``(q_proj, values)``: ``q_proj[b, h] = scale[b, h] · query_map[h] · q̄[b, h]``
    (f32; ``q̄`` the mean of KV head h's query heads), the query that
    :func:`projected_scores` takes; and ``values`` with ``values[b, slots[b], h]`` set to
    ``key_map[h] · k_new[b, h]`` stored as the cache stores it (FP8: divided by
    ``scale[b, h]`` and clipped to ±448). A slot outside [0, S) writes nothing. The
    selectors' ``project_queries`` (times the cache's scales) and ``append_keys``, which
    are the reference; the kernel sums in its own order, so both agree to f32 rounding
    (and a stored FP8 value may round to its neighbour). Donate ``values`` to have it
    updated in place.

    Args:
      q: [B, H, D] f32 or bf16, H a multiple of Hkv. k_new: [B, Hkv, D], the new keys.
      query_map, key_map: [Hkv, R, D] f32 (a selector's ``maps``).
      values: [B, S, Hkv, R] f32, bf16 or float8_e4m3fn; scale: [B, Hkv] f32.
      slots: [B] int32. implementation: ``"triton"`` (R a power of two, else
        ``NotImplementedError``) or ``"reference"``.
    """
    for name, x, rank, layout in (
        ("q", q, 3, "[B, H, D]"), ("k_new", k_new, 3, "[B, Hkv, D]"),
        ("query_map", query_map, 3, "[Hkv, R, D]"), ("key_map", key_map, 3, "[Hkv, R, D]"),
        ("values", values, 4, "[B, S, Hkv, R]"), ("scale", scale, 2, "[B, Hkv]"),
        ("slots", slots, 1, "[B]"),
    ):  # fmt: skip
        _checks.check_rank(name, x, rank, layout)
    _checks.check_dtype("values", values, CACHE_FLOATS)
    _checks.check_dtype("slots", slots, (jnp.int32,))
    floats = ("q", q), ("k_new", k_new), ("query_map", query_map), ("key_map", key_map)
    for name, x in (*floats, ("scale", scale)):
        _checks.check_floating(name, x)
    b, _, hkv, r = values.shape
    d = q.shape[2]
    for name, x, want in (
        ("q", q, (b, q.shape[1], d)), ("k_new", k_new, (b, hkv, d)),
        ("query_map", query_map, (hkv, r, d)), ("key_map", key_map, (hkv, r, d)),
        ("scale", scale, (b, hkv)), ("slots", slots, (b,)),
    ):  # fmt: skip
        if tuple(x.shape) != want:
            raise ValueError(
                f"{name}: shape {tuple(x.shape)}; expected {want} to match values "
                f"{tuple(values.shape)} [B, S, Hkv, R] and q's head dim D = {d}"
            )
    if hkv == 0 or q.shape[1] % hkv or q.shape[1] == 0:
        raise ValueError(
            f"q: {q.shape[1]} query heads; expected a positive multiple of Hkv = {hkv}"
        )
    if 0 in values.shape or d == 0:
        return projected_step_reference(q, k_new, query_map, key_map, values, scale, slots)
    return backend.dispatch(
        "projected_step", _step_implementations(), implementation,
        q, k_new, query_map, key_map, values, scale, slots, differentiable=True,
    )  # fmt: skip


@functools.cache  # one jit wrapper: a fresh one per call costs host time
def _implementations():
    from jsparse.ops.projected import triton  # Pallas imports only when used

    def run_triton(q_proj, values):
        if not triton.supported(values.shape[3]):
            raise NotImplementedError(
                f"projected_scores: the Triton kernel needs R a power of two, got "
                f"R = {values.shape[3]} (values {tuple(values.shape)})"
            )
        return triton.projected_scores_triton(q_proj, values)

    return {"triton": run_triton, "reference": jax.jit(projected_scores_reference)}


@functools.cache
def _step_implementations():
    from jsparse.ops.projected import triton

    def run_triton(q, k_new, query_map, key_map, values, scale, slots):
        if not triton.supported(values.shape[3]):
            raise NotImplementedError(
                f"projected_step: the Triton kernel needs R a power of two, got "
                f"R = {values.shape[3]} (values {tuple(values.shape)})"
            )
        return triton.projected_step_triton(q, k_new, query_map, key_map, values, scale, slots)

    return {"triton": run_triton, "reference": jax.jit(projected_step_reference)}
