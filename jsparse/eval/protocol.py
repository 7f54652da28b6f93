"""The recall evaluation protocol (the lead's ``bench/run.py --op recall``, ``bench/recall.py``).

1. **Calibrate** every calibrated selector from the second moments of calibration
   captures (novels disjoint from the evaluation text), streamed one (sequence, layer)
   at a time; all selectors share the same moments.
2. **Evaluate** on a held-out capture. Context ``C`` uses the capture's first ``C`` tokens
   (a causal forward pass makes them identical to a ``C``-token window). The queries are
   the last ``n_queries`` positions ``t`` of the window; query ``t`` sees keys ``0..t``
   and each selector picks ``budget`` of them per KV head from that prefix.
3. **Score** each selection against full attention with the original q, k, v
   (:mod:`jsparse.eval.recall`): oracle top-budget recall, attention-mass recall,
   relative output error, per (layer, KV head, query); averaged over KV heads and
   queries per layer, then over layers.

Methods are compared at equal scoring memory (bytes per token per KV head): a rank-r
projected cache in FP8 costs r bytes; QUEST's page min/max cost ``2·D·bytes/page``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jsparse import _checks
from jsparse.calibration.moments import Moments, normalize_trace
from jsparse.calibration.stiefel import subspace_overlap
from jsparse.eval.recall import RecallReference, select_causal
from jsparse.selectors.base import ProjectedSelector, Selector, make_selector

__all__ = [
    "Method",
    "default_methods",
    "evaluate_layer",
    "layer_diagnostics",
    "rate_distortion_methods",
    "summarize",
]

METRICS = ("oracle_recall", "mass_recall", "output_error")


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the comparison: a configured selector and its equal-memory group."""

    label: str  # e.g. "jssa r16"
    family: str  # e.g. "jssa" (one line per family in the plot)
    selector: Selector
    rank: int | None  # the equal-memory group: bytes per token = rank (FP8); None = no cache

    def bytes_per_token(self, head_dim: int) -> float:
        return self.selector.bytes_per_token(head_dim)


FAMILIES = (
    "oracle", "full", "jssa", "jssa-raw", "jssa-refined", "loki", "fasa", "kq_svd",
    "head_shared", "quest", "jssa_rd", "jssa_rd-shared",
)  # fmt: skip


def _check_families(families) -> None:
    unknown = sorted(set(families) - set(FAMILIES)) if families is not None else []
    if unknown:
        raise ValueError(f"families: unknown {unknown}; expected some of {list(FAMILIES)}")


def default_methods(
    ranks: Sequence[int], head_dim: int = 64, families: Sequence[str] | None = None
):
    """The comparison set. For each rank ``r``: JSSA (paper default, without trace
    normalisation, refined), Loki, FASA, KQ-SVD, head-shared voting, and QUEST at the
    same bytes per token; plus oracle and full once. ``families``: keep only these
    (names from :data:`FAMILIES`)."""
    _check_families(families)
    methods = [
        Method("oracle", "oracle", make_selector("oracle"), None),
        Method("full", "full", make_selector("full"), None),
    ]
    for r in ranks:
        methods += [
            Method(f"jssa r{r}", "jssa", make_selector("jssa", rank=r), r),
            Method(f"jssa-raw r{r}", "jssa-raw", make_selector("jssa", rank=r, normalize=False), r),
            Method(
                f"jssa-refined r{r}",
                "jssa-refined",
                make_selector("jssa", rank=r, refine_steps=1600, refine_lr=0.05),
                r,
            ),
            Method(f"loki r{r}", "loki", make_selector("loki", rank=r), r),
            Method(f"fasa r{r}", "fasa", make_selector("fasa", rank=r), r),
            Method(f"kq_svd r{r}", "kq_svd", make_selector("kq_svd", rank=r), r),
            Method(f"head_shared r{r}", "head_shared", make_selector("head_shared", rank=r), r),
        ]
        # QUEST at the same bytes per token: 2·D·bytes/page = r  ->  page = 2·D·bytes/r.
        for dtype, nbytes in (("bfloat16", 2), ("float8_e4m3fn", 1)):
            page = 2 * head_dim * nbytes // r
            if page >= 1 and 2 * head_dim * nbytes % r == 0 and page in (8, 16, 32):
                short = "bf16" if nbytes == 2 else "fp8"
                methods.append(
                    Method(
                        f"quest p{page}-{short} r{r}",
                        "quest",
                        make_selector("quest", page_size=page, cache_dtype=dtype),
                        r,
                    )
                )
    if families is not None:
        wanted = set(families)
        methods = [m for m in methods if m.family in wanted]
    return methods


def rate_distortion_methods(ranks: Sequence[int], moments: Moments, families=None):
    """``jssa_rd`` at the same bytes per token as each rank ``r`` (r bytes: the FP8 rank-r
    cache), its FP8/int4 split planned from the calibration ``moments`` of all layers
    (leading layer axis); ``jssa_rd-shared`` uses JSSA's shared basis (ablation)."""
    from jsparse.selectors.jssa_rd import JSSARDSelector

    _check_families(families)
    methods = []
    for r in ranks:
        for kind, family in (("exact", "jssa_rd"), ("shared", "jssa_rd-shared")):
            if families is not None and family not in families:
                continue
            sel = JSSARDSelector.planned(moments, float(r), maps_kind=kind)
            label = f"{family} r{r} ({sel.fp8_dims}+{sel.int4_dims})"
            methods.append(Method(label, family, sel, r))
    return methods


def layer_diagnostics(moments: Moments, methods: Sequence[Method], params: dict) -> dict:
    """Per-layer calibration facts: trace ratio, each projected method's exact objective
    ``E[(q̄ᵀ(I - AᵀB)k)²]`` on the unit-trace moments, and JSSA refinement overlap."""
    gq = np.asarray(normalize_trace(moments.gram_q), np.float64)
    gk = np.asarray(normalize_trace(moments.gram_k), np.float64)
    out = {
        "trace_ratio_q_over_k": float(
            np.mean(
                np.trace(moments.gram_q, axis1=-2, axis2=-1)
                / np.trace(moments.gram_k, axis1=-2, axis2=-1)
            )
        ),
        "objective": {},
        "overlap_refined_vs_closed_form": {},
    }
    d = gq.shape[-1]
    for m in methods:
        if not isinstance(m.selector, ProjectedSelector) or m.label not in params:
            continue
        a, b = (np.asarray(x, np.float64) for x in m.selector.maps(params[m.label]))
        resid = np.eye(d) - np.einsum("hrd,hre->hde", a, b)
        # E[(q̄ᵀ W k)²] = tr(Wᵀ G_Q W G_K) for the product distribution, W = I - AᵀB.
        value = np.einsum("hij,hik,hkl,hjl->h", resid, gq, resid, gk)
        out["objective"][m.label] = float(value.mean())
    for m in methods:
        if m.family == "jssa-refined" and m.label in params:
            base = f"jssa r{m.rank}"
            if base in params:
                ov = subspace_overlap(params[base]["basis"], params[m.label]["basis"])
                out["overlap_refined_vs_closed_form"][m.label] = float(jnp.mean(ov))
    return out


def evaluate_layer(
    methods: Sequence[Method],
    params: dict,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    contexts: Sequence[int],
    budgets: Sequence[int],
    n_queries: int,
    query_chunk: int = 64,
) -> list[dict]:
    """Metrics of every (context, method, budget) for one layer of the held-out capture.

    ``q [T, H, D]``, ``k, v [T, Hkv, D]`` hold at least ``max(contexts)`` tokens.
    Returns one record per (context, method, budget) with the metric means over
    (KV head, query) and the per-KV-head means.
    """
    n_queries = _checks.check_int("n_queries", n_queries, 1)
    query_chunk = _checks.check_int("query_chunk", query_chunk, 1)
    budgets = [_checks.check_int("budgets", b, 1) for b in budgets]
    contexts = [_checks.check_int("contexts", c, 1) for c in contexts]
    _check_activations(q, k, v, max(contexts, default=0))
    records = []
    for context in contexts:
        nq = min(n_queries, context)
        pos = np.arange(context - nq, context)
        lengths = jnp.asarray(pos + 1, jnp.int32)
        qe, ke, ve = jnp.asarray(q[pos]), jnp.asarray(k[:context]), jnp.asarray(v[:context])
        ref = RecallReference(qe, ke, ve, lengths)
        for m in methods:
            p = params.get(m.label, {})
            for budget in budgets:
                parts = [
                    select_causal(
                        m.selector,
                        p,
                        qe[i : i + query_chunk],
                        ke,
                        lengths[i : i + query_chunk],
                        budget,
                    )
                    for i in range(0, nq, query_chunk)
                ]
                idx = jnp.concatenate(parts, axis=0)
                res = ref.metrics(idx, budget)
                rec = {
                    "context": context,
                    "method": m.label,
                    "family": m.family,
                    "rank": m.rank,
                    "budget": budget,
                }
                for name in METRICS:
                    per_head = np.asarray(res[name]).mean(axis=0)
                    rec[name] = float(per_head.mean())
                    rec[name + "_per_kv_head"] = [float(x) for x in per_head]
                records.append(rec)
    return records


def _check_activations(q, k, v, tokens: int) -> None:
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"q, k, v: shapes {q.shape}, {k.shape}, {v.shape}; expected [T, H, D], "
            f"[T, Hkv, D], [T, Hkv, Dv]"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] < tokens:
            raise ValueError(f"{name}: {x.shape[0]} tokens; the longest context is {tokens}")
    if k.shape[2] != q.shape[2] or v.shape[1] != k.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q {q.shape}, k {k.shape}, v {v.shape}: expected k's head_dim equal to q's, v's "
            f"KV heads equal to k's, and query heads a multiple of KV heads"
        )


def summarize(records: Sequence[dict]) -> dict:
    """Layer-averaged metrics keyed by ``(context, method, budget)``."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[(r["context"], r["method"], r["budget"])].append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {name: float(np.mean([r[name] for r in rs])) for name in METRICS}
        out[key]["n_layers"] = len(rs)
        out[key]["family"] = rs[0]["family"]
        out[key]["rank"] = rs[0]["rank"]
    return out


def markdown_table(
    summary: dict, metric: str, context: int, methods: Sequence[str], budgets
) -> str:
    head = f"| method (ctx {context}, {metric}) | " + " | ".join(str(b) for b in budgets) + " |"
    lines = [head, "|---|" + "---:|" * len(budgets)]
    for label in methods:
        cells = []
        for b in budgets:
            value = summary.get((context, label, b), {}).get(metric)
            cells.append("" if value is None or math.isnan(value) else f"{value:.4f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
