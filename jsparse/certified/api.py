"""Entry points of the certified Top-K methods ``dense`` and ``dosa`` (MATH.md §1.8).

:func:`certified_topk` is what :func:`jsparse.indexer_topk` calls for ``method="dense"``
and ``method="dosa"`` (inputs already validated). :func:`dosa_topk` is the public entry
with every option of the certificate (variants, r, policy) and the per-query report.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtyping import Array, Float, Int

from jsparse import _checks, _chunking, backend
from jsparse.certified import planner
from jsparse.certified import reference as ref_impl
from jsparse.ops.indexer.result import IndexerTopK

METHODS = ("dense", "dosa")
POLICIES = ("auto", "always")


def _triton(*args, **kwargs):
    from jsparse.certified import triton as triton_impl  # Pallas imports only when used

    return triton_impl.certified_topk_triton(*args, **kwargs)


def _implementations():
    return {"triton": _triton, "reference": ref_impl.certified_topk_reference}


def certified_topk(
    q, weights, k, top_k, k_scale, start, end, seeds, *,
    method: str = "dosa",
    implementation: str | Sequence[str] | None = None,
    variant: str = "dosa",
    r: str | int | Sequence[int] = "auto",
    policy: str = "auto",
    sorted: bool = True,  # the name jsparse.indexer_topk uses
    return_info: bool = False,
    **options,
):  # fmt: skip
    """Certified Top-K of validated inputs (see :func:`dosa_topk` for the arguments).

    Returns :class:`IndexerTopK`, or ``(IndexerTopK, CertifiedInfo)`` with
    ``return_info=True``. ``options`` go to the implementation (Triton: capacities,
    ``refine_block``; reference: ``survivor_capacity``).
    """
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}; expected one of {METHODS}")
    planner.check_variant(variant)
    if policy not in POLICIES:
        raise ValueError(f"policy: got {policy!r}; expected one of {POLICIES}")
    result, info = backend.dispatch(
        f"indexer_topk[{method}]",
        _implementations(),
        implementation,
        q, weights, k, top_k, k_scale, start, end, seeds,
        method=method, variant=variant, r=r, policy=policy, sort=sorted, **options,
    )  # fmt: skip
    return (result, info) if return_info else result


def dosa_topk(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    top_k: int,
    *,
    k_scale: Float[Array, " S"] | None = None,
    kv_start: Int[Array, " T"] | None = None,
    kv_end: Int[Array, " T"] | None = None,
    method: str = "dosa",
    seeds: int | Int[Array, "T N"] | None = None,
    variant: str = "dosa",
    r: str | int | Sequence[int] = "auto",
    policy: str = "auto",
    sorted: bool = True,  # the name jsparse.indexer_topk uses
    implementation: str | Sequence[str] | None = None,
    return_info: bool = False,
    **options,
) -> IndexerTopK | tuple[IndexerTopK, ref_impl.CertifiedInfo]:
    """Exact Top-K by certified screening, with every knob of the certificate.

    Same inputs and answer as :func:`jsparse.indexer_topk` (``method`` "dense" or "dosa").

    Args:
      variant: certificate variant, one of :data:`jsparse.certified.planner.VARIANTS`
        (the paper's ablation); the answer is the same for all, only survival changes.
      r: retained heads per query: "auto" (per query, the cheapest width by a cost
        estimate on the seed sample), an int, or concrete ints [T].
      policy: "auto" screens a query only when the estimate says it pays (else it is
        scored in full like ``full``); "always" screens whenever the certificate is valid.
      sorted: as in :func:`jsparse.indexer_topk` (False: the exact set, unordered; the
        reference always sorts).
      return_info: also return :class:`~jsparse.certified.reference.CertifiedInfo`
        (the plan, which queries were screened, overflows).
      options: implementation options (Triton: ``list_capacity``, ``record_capacity``,
        ``refine_block``; reference: ``survivor_capacity``).
    """
    from jsparse.ops.indexer import api

    start, end = api._validate(q, weights, k, k_scale, kv_start, kv_end)
    top_k = _checks.check_top_k(top_k)
    seeds = api._check_seeds(seeds, q.shape[0], start, end)

    def call(q, weights, start, end, seeds, r):
        return certified_topk(
            q, weights, k, top_k, k_scale, start, end, seeds,
            method=method, implementation=implementation, variant=variant, r=r,
            policy=policy, sorted=sorted, return_info=return_info, **options,
        )  # fmt: skip

    chunk = _chunking.queries_per_call(q.shape[0], k.shape[0])
    # r: "auto" and one int pass through the chunks; per-query values are chunked.
    return _chunking.over_query_chunks(call, chunk, q, weights, start, end, seeds, r)
