"""DoSA: certified screening and exact Top-K of a DSA indexer (MATH.md Part 1).

* :func:`dosa_topk` / :func:`certified_topk`: prefill (``dense`` and ``dosa`` methods),
* :func:`indexer_topk_decode`: decoding with witness thresholds (MATH.md §1.10),
* :func:`make_plan` / :class:`Plan`: the per-query certificate, inspectable,
* :func:`diagnose`: seed deficit and bound slack per query (MATH.md §1.8),
* :mod:`jsparse.certified.workloads`: named input generators for measuring pruning.
"""

from jsparse.certified.api import certified_topk, dosa_topk
from jsparse.certified.decode import indexer_topk_decode
from jsparse.certified.planner import VARIANTS, Plan, make_plan
from jsparse.certified.reference import CertifiedInfo, Diagnostics, diagnose

__all__ = [
    "VARIANTS",
    "CertifiedInfo",
    "Diagnostics",
    "Plan",
    "certified_topk",
    "diagnose",
    "dosa_topk",
    "indexer_topk_decode",
    "make_plan",
]
