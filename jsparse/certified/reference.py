"""DoSA in plain jnp: screening bounds, the certified pipeline, and its diagnostics.

Exact by construction against the reference ``base``: τ, the refinement and the
selection all go through :func:`jsparse.ops.indexer.reference.score_keys_reference`,
whose score of a (query, key) pair does not depend on what else is scored, and the
screening bound dominates that scorer's arithmetic (the plan's guard, MATH.md §1.7).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jsparse.certified import planner
from jsparse.ops.indexer import reference as scorer
from jsparse.ops.indexer.result import IndexerTopK
from jsparse.ops.topk.codes import code_to_score, score_code
from jsparse.ops.topk.reference import select_topk_reference


@struct.dataclass
class CertifiedInfo:
    """What the certified pipeline did, per query (beside :class:`IndexerTopK`).

    Attributes:
      plan: the :class:`~jsparse.certified.planner.Plan`.
      screened: Bool[T] the query went through screening (plan.prune and no overflow).
      survivor_overflow: Bool[T] its survivor buffer overflowed (answered by full scoring).
      record_overflow: Bool[T] its record buffer overflowed (answered by base).
      list_length: Int32[T] keys refined for the query (its block's survivor union).
    """

    plan: planner.Plan
    screened: Bool[Array, " T"]
    survivor_overflow: Bool[Array, " T"]
    record_overflow: Bool[Array, " T"]
    list_length: Int[Array, " T"]


def screen_bounds(
    plan: planner.Plan,
    k: Float[Array, "S D"],
    k_scale: Float[Array, " S"] | None,
    knorm: Float[Array, " S"],
    key_ids: Int[Array, "T N"],
    *,
    query_chunk: int = 16,
) -> Float[Array, "T N"]:
    """U^num of the listed keys for each query (MATH.md §1.6-§1.7), f32; -inf for id -1.

    The formula of the screening kernel with f32 dots (Precision.HIGHEST) of the plan's
    rows: ``(Σ_j ω_j [q̃_j·k]_+ − [(hi+lo)·k]_+ + (E_P + C)‖k‖↑ + c_abs) · α``.
    """
    t, n = key_ids.shape
    rows = plan.rows.astype(jnp.float32)
    kf = k.astype(jnp.float32)
    scale = jnp.ones((k.shape[0],), jnp.float32) if k_scale is None else k_scale
    chunk = max(1, min(query_chunk, t))
    pad = (-t) % chunk

    def padded(x, value=0):
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=value)

    def one_chunk(args):
        rw, om, ec, ca, ids = args
        ok = ids >= 0
        safe = jnp.where(ok, ids, 0)
        x = jnp.einsum(
            "cwd,cnd->cwn", rw, kf[safe], precision=jax.lax.Precision.HIGHEST
        )  # [chunk, W, N]
        relu = jnp.where(x < 0, 0.0, x)
        ret = jnp.sum(relu * om[:, :, None], axis=1)
        aux = x[:, 0] + x[:, 1]
        u = ret - jnp.where(aux < 0, 0.0, aux) + ec[:, None] * knorm[safe] + ca[:, None]
        return jnp.where(ok, u * scale[safe], -jnp.inf)

    n_chunks = (t + pad) // chunk
    out = jax.lax.map(
        one_chunk,
        (
            padded(rows).reshape(n_chunks, chunk, *rows.shape[1:]),
            padded(plan.row_weights).reshape(n_chunks, chunk, -1),
            padded(plan.e_coef).reshape(n_chunks, chunk),
            padded(plan.c_abs).reshape(n_chunks, chunk),
            padded(key_ids, -1).reshape(n_chunks, chunk, n),
        ),
    )
    return out.reshape(n_chunks * chunk, n)[:t]


def rejected_mask(plan, bounds, knorm_rows):
    """Keys the certificate rejects: U^num < τ (as codes), finite key norm, pruned query."""
    below = score_code(bounds) < plan.tau_code[:, None]
    return plan.prune[:, None] & below & jnp.isfinite(knorm_rows)


def default_seeds(seeds, start, end, top_k, num_keys):
    from jsparse.ops.indexer.api import default_seed_ids

    if seeds is None or isinstance(seeds, int):
        return default_seed_ids(start, end, top_k, n_seeds=seeds, num_keys=num_keys), True
    return seeds, False


def certified_topk_reference(
    q, weights, k, top_k, k_scale, start, end, seeds, *,
    method="dosa", variant="dosa", r="auto", policy="auto", survivor_capacity=None, sort=True,
):  # fmt: skip
    """``dense`` / ``dosa`` with the reference scorer. Returns (IndexerTopK, CertifiedInfo).

    ``survivor_capacity`` (optional) models a survivor buffer: a query with more
    survivors falls back to full scoring, as the kernels do. The reference always sorts
    (``sort`` is accepted for the common interface).
    """
    del sort
    seed_ids, is_default = default_seeds(seeds, start, end, top_k, k.shape[0])
    t, h, _ = q.shape
    widths, r_arr = planner.resolve_r(r, t, h)
    result, info = _pipeline(
        q, weights, k, k_scale, start, end, seed_ids, r_arr, planner.variant_flags(variant),
        jnp.asarray(method == "dense"), top_k=top_k, widths=widths, policy=policy,
        skip=seed_ids.shape[1] // 2 if is_default else 0, capacity=survivor_capacity,
    )  # fmt: skip
    return result, info.replace(plan=info.plan.replace(variant=variant))


@functools.partial(
    jax.jit,
    static_argnames=("top_k", "widths", "policy", "skip", "capacity"),
)
def _pipeline(
    q, weights, k, k_scale, start, end, seed_ids, r_arr, flags, dense, *,
    top_k, widths, policy, skip, capacity,
):  # fmt: skip
    from jsparse.ops.indexer.api import seed_threshold_code
    from jsparse.ops.indexer.methods import usable_seed_ids

    s = k.shape[0]
    seed_ids = usable_seed_ids(seed_ids, start, end)
    seed_scores = scorer.score_keys_reference(q, weights, k, seed_ids, k_scale)
    tau = seed_threshold_code(seed_scores, seed_ids, top_k)
    knorm, kmax, smax = planner.key_norms(k, k_scale)
    cols = planner.sample_seed_columns(seed_ids.shape[1], skip)
    numerics = planner.numerics_for("reference", q.dtype, k.dtype, q.shape[2])
    plan = planner.plan_from_threshold(
        q, weights, k, k_scale, start, end, tau, seed_ids[:, cols], r_arr, knorm, kmax, smax,
        flags, top_k=top_k, group=1, widths=widths, numerics=numerics, policy=policy,
        list_capacity=capacity, recent_keys=skip,
    )  # fmt: skip
    ids = scorer.visible_key_ids(start, end, s)
    visible = ids >= 0
    safe = jnp.where(visible, ids, 0)
    bounds = screen_bounds(plan, k, k_scale, knorm, ids)
    survive = visible & ~rejected_mask(plan, bounds, knorm[safe])
    n_surv = jnp.sum(survive, axis=1).astype(jnp.int32)
    overflow = jnp.zeros_like(plan.prune)
    if capacity is not None:
        overflow = plan.prune & (n_surv > capacity)
    screened = plan.prune & ~overflow
    survive = jnp.where(screened[:, None], survive, visible)

    # The refinement scores the survivors with the one scorer: scoring every visible key
    # and masking gives the same values (the reference score of a pair is context-free).
    scores = scorer.score_keys_reference(q, weights, k, ids, k_scale)
    above = score_code(scores) >= tau[:, None]
    # dense: every survivor of a screened query is written; dosa: only those ≥ τ.
    records = survive & (above | (dense & screened[:, None]))
    indices, values = select_topk_reference(scores, jnp.where(records, ids, -1), top_k)
    n_visible = (end - start).astype(jnp.int32)
    result = IndexerTopK(
        indices=indices,
        scores=values,
        visible=n_visible,
        candidates=jnp.sum(records, axis=1).astype(jnp.int32),
        survivors=jnp.where(screened, n_surv, n_visible),
        threshold=code_to_score(tau),
        fallback=~screened,
    )
    info = CertifiedInfo(
        plan=plan,
        screened=screened,
        survivor_overflow=overflow,
        record_overflow=jnp.zeros_like(overflow),
        list_length=jnp.where(screened, n_surv, n_visible),
    )
    return result, info


@struct.dataclass
class Diagnostics:
    """Where survival comes from, per query (MATH.md §1.8 "slack").

    Attributes:
      tau: Float32[T] the seed threshold τ.
      tau_star: Float32[T] the true K-th score τ* (-inf with fewer than K visible keys).
      seed_deficit: Float32[T] b = τ* − τ (≥ 0; 0 means the seeds found the K-th score).
      survival: Float32[T] fraction of visible keys with U^num ≥ τ (screening survivors).
      above_tau: Float32[T] fraction with s ≥ τ: the survival an exact bound would give.
      above_tau_star: Float32[T] fraction with s ≥ τ*: the survival of a perfect seed too.
      slack_mean, slack_median, slack_max: Float32[T] δ = U^num − s over the survivors.
      slack_rel_median: Float32[T] median of δ / (|τ| + |s|): slack in units of the scores.
    """

    tau: Float[Array, " T"]
    tau_star: Float[Array, " T"]
    seed_deficit: Float[Array, " T"]
    survival: Float[Array, " T"]
    above_tau: Float[Array, " T"]
    above_tau_star: Float[Array, " T"]
    slack_mean: Float[Array, " T"]
    slack_median: Float[Array, " T"]
    slack_max: Float[Array, " T"]
    slack_rel_median: Float[Array, " T"]


@functools.partial(jax.jit, static_argnames=("top_k",))
def diagnose(
    plan: planner.Plan,
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    k_scale: Float[Array, " S"] | None,
    start: Int[Array, " T"],
    end: Int[Array, " T"],
    *,
    top_k: int,
) -> Diagnostics:
    """Seed deficit and bound slack of ``plan`` for its queries (reference arithmetic).

    Scores every visible key of every query given: pass a sample of queries (rows of the
    plan with :func:`select_queries`) for large inputs.
    """
    s = k.shape[0]
    ids = scorer.visible_key_ids(start, end, s)
    visible = ids >= 0
    knorm, _, _ = planner.key_norms(k, k_scale)
    bounds = screen_bounds(plan, k, k_scale, knorm, ids)
    scores = scorer.score_keys_reference(q, weights, k, ids, k_scale)
    _, top = select_topk_reference(scores, ids, top_k)
    tau_star = top[:, top_k - 1]
    tau = code_to_score(plan.tau_code)
    codes = score_code(scores)
    survive = visible & (score_code(bounds) >= plan.tau_code[:, None])
    n_vis = jnp.maximum(jnp.sum(visible, axis=1), 1)

    def frac(mask):
        return (jnp.sum(mask & visible, axis=1) / n_vis).astype(jnp.float32)

    slack = jnp.where(survive, bounds - scores, jnp.nan)
    rel = slack / (jnp.abs(tau)[:, None] + jnp.abs(scores))
    return Diagnostics(
        tau=tau,
        tau_star=tau_star,
        seed_deficit=tau_star - tau,
        survival=frac(survive),
        above_tau=frac(codes >= plan.tau_code[:, None]),
        above_tau_star=frac(codes >= score_code(tau_star)[:, None]),
        slack_mean=jnp.nanmean(slack, axis=1),
        slack_median=jnp.nanmedian(slack, axis=1),
        slack_max=jnp.nanmax(jnp.where(survive, slack, -jnp.inf), axis=1),
        slack_rel_median=jnp.nanmedian(rel, axis=1),
    )


def select_queries(plan: planner.Plan, rows: Int[Array, " n"]) -> planner.Plan:
    """The plan restricted to some queries (for sampled diagnostics)."""
    return jax.tree_util.tree_map(lambda x: x[rows], plan)
