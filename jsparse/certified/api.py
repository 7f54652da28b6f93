"""Entry points of the certified Top-K methods ``dense`` and ``dosa`` (MATH.md §1.8).

:func:`certified_topk` is what :func:`jsparse.indexer_topk` calls for ``method="dense"``
and ``method="dosa"`` (inputs already validated). :func:`dosa_topk` is the public entry
with every option of the certificate (variants, r, policy) and the per-query report.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtyping import Array, Float, Int

from jsparse import _autodiff, _checks, _chunking, backend
from jsparse.certified import planner
from jsparse.certified import reference as ref_impl
from jsparse.ops.indexer.result import IndexerTopK

METHODS = ("dense", "dosa")
POLICIES = ("auto", "always")


# Implementation options (``**options`` of :func:`dosa_topk`) and who takes them.
OPTIONS = {
    "list_capacity": "triton",  # survivor slots per scorer block
    "record_capacity": "triton",  # records per query of the unscreened queries
    "refine_block": "triton",  # queries per scorer block
    "screen_cfg": "triton",  # ScreenConfig of the screening kernel
    "splits": "triton",  # programs per screening tile along the keys
    "survivor_capacity": "reference",  # a modelled survivor buffer
}


def _check_options(options: dict) -> None:
    """ValueError naming an option that no implementation takes or a value out of range
    (before any tracing: a negative capacity used to fail deep inside a kernel)."""
    for name, value in options.items():
        if name not in OPTIONS:
            raise ValueError(
                f"{name}: not an option of the certified methods; expected one of {sorted(OPTIONS)}"
            )
        if value is None:
            continue
        if name == "screen_cfg":
            from jsparse.certified.triton import ScreenConfig

            if not isinstance(value, ScreenConfig):
                raise ValueError(
                    f"screen_cfg: expected a jsparse.certified.triton.ScreenConfig or None, "
                    f"got {value!r}"
                )
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive Python int or None, got {value!r}")
        if name == "refine_block" and value & (value - 1):
            raise ValueError(f"refine_block: expected a power of two, got {value}")


def _taking_options(name, fn):
    """``fn`` of implementation ``name``, refusing another implementation's options by
    name (rather than a TypeError, or one silently ignored)."""

    def call(*args, **kwargs):
        for option in kwargs.keys() & OPTIONS.keys():
            if OPTIONS[option] != name and kwargs[option] is not None:
                own = sorted(o for o, impl in OPTIONS.items() if impl == name)
                raise ValueError(
                    f"{option}: an option of implementation {OPTIONS[option]!r}; "
                    f"{name!r} (the one running) takes {own}"
                )
        own_kwargs = {o: v for o, v in kwargs.items() if OPTIONS.get(o, name) == name}
        return fn(*args, **own_kwargs)

    return call


def _triton(*args, **kwargs):
    from jsparse.certified import triton as triton_impl  # Pallas imports only when used

    return triton_impl.certified_topk_triton(*args, **kwargs)


def _implementations():
    return {
        "triton": _taking_options("triton", _triton),
        "reference": _taking_options("reference", ref_impl.certified_topk_reference),
    }


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
    _check_options(options)
    _checks.check_bool("sorted", sorted)
    _checks.check_bool("return_info", return_info)
    if policy not in POLICIES:
        raise ValueError(f"policy: got {policy!r}; expected one of {POLICIES}")
    start, end = _checks.clamp_ranges(start, end, k.shape[0])
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
      options: implementation options (:data:`OPTIONS`; Triton: ``list_capacity``,
        ``record_capacity``, ``refine_block``, ``screen_cfg``, ``splits``; reference:
        ``survivor_capacity``). A bad value, or an option of an implementation other than
        the one running, raises ValueError naming it.
    """
    from jsparse.ops.indexer import api

    start, end = api._validate(q, weights, k, k_scale, kv_start, kv_end)
    top_k = _checks.check_top_k(top_k)
    seeds = api._check_seeds(seeds, q.shape[0], start, end)

    def select(q, weights, k, k_scale, start, end, seeds, r):
        k, k_scale, start, end = api.no_keys_as_one_unseen(k, k_scale, start, end)

        def call(q, weights, start, end, seeds, r):
            return certified_topk(
                q, weights, k, top_k, k_scale, start, end, seeds,
                method=method, implementation=implementation, variant=variant, r=r,
                policy=policy, sorted=sorted, return_info=return_info, **options,
            )  # fmt: skip

        chunk = _chunking.queries_per_call(q.shape[0], k.shape[0])
        # r: "auto" and one int pass through the chunks; per-query values are chunked.
        return _chunking.over_query_chunks(call, chunk, q, weights, start, end, seeds, r)

    def ids_and_scores(out):
        result = out[0] if return_info else out
        return result.indices, result.scores

    return _autodiff.selection(
        select, api.scores_of_ids, ids_and_scores, (q, weights, k, k_scale, start, end, seeds, r)
    )
