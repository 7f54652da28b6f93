"""Public entry points of the DSA indexer: scores and exact Top-K.

    s[t, i] = k_scale[i] · Σ_h weights[t, h] · relu(q[t, h] · k[i]),   kv_start[t] ≤ i < kv_end[t]

Methods of :func:`indexer_topk` (MATH.md §1.9 names):

* ``xla``: the naive baseline, einsum → relu → einsum → ``lax.top_k``, always XLA.
* ``base``: score every visible key, write every score, then exact selection.
* ``full``: score a seed set first; its K-th score τ is a lower bound on the true K-th
  score (MATH.md §1.2), so the full pass writes only records with score ≥ τ and
  selection reads only those (the LiteTopK idea).
* ``dense`` / ``dosa``: certified screening first (see :mod:`jsparse.certified`).

``base``, ``full``, ``dense`` and ``dosa`` of one implementation share one scorer, so
their answers are identical id for id. Answers are ordered by score descending, then
key id ascending; rows with fewer than ``top_k`` visible keys are padded with -1/-inf.

float32 inputs: the kernels multiply them as :mod:`jsparse.ops.f32_dots` says, three
TF32 tensor-core products unless ``jax.default_matmul_precision("highest")`` asks for
IEEE f32 (slower); ``xla`` follows the same setting. bfloat16 and FP8 inputs always
take the tensor cores.

Non-finite values: scores follow IEEE arithmetic with a NaN-propagating relu, and
selection ranks NaN above +inf (and treats -0 as +0), so a NaN score is returned at the
top of its row rather than silently dropped. ``full`` remains exact under that total
order. The certified methods fall back to full scoring for a query whose q, weights,
τ or guard is not finite; a key with a non-finite component (or an invalid scale) is
never screened out, so its query stays exact without a fallback.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jsparse import _autodiff, _checks, _chunking, backend
from jsparse.ops.indexer import reference
from jsparse.ops.indexer.methods import default_seed_count, recent_and_strided_ids, usable_seed_ids
from jsparse.ops.indexer.result import IndexerTopK, exhaustive_result
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code
from jsparse.ops.topk.reference import select_topk_reference

METHODS = ("xla", "base", "full", "dense", "dosa")
# False: the kernels' scores take the reference's derivative (XLA einsums in f32) in
# place of the backward kernels; for side-by-side timing (WORKSPACE.md, run 228).
SCORES_BACKWARD_KERNELS = True


def _validate(q, weights, k, k_scale, kv_start, kv_end):
    """Checks shapes, dtypes and (when concrete) values; returns defaulted ranges."""
    _checks.check_rank("q", q, 3, "[T, H, D]")
    _checks.check_rank("weights", weights, 2, "[T, H]")
    _checks.check_rank("k", k, 2, "[S, D]")
    _checks.check_dtype("q", q, _checks.INPUT_FLOATS)
    _checks.check_dtype("k", k, _checks.INPUT_FLOATS)
    _checks.check_dtype("weights", weights, (jnp.float32,))
    t, h, d = q.shape
    s = k.shape[0]
    if weights.shape != (t, h):
        raise ValueError(
            f"weights: shape {tuple(weights.shape)} does not match q {tuple(q.shape)}; "
            f"expected [T, H] = ({t}, {h})"
        )
    if k.shape[1] != d:
        raise ValueError(
            f"k: shape {tuple(k.shape)} has head dim {k.shape[1]}; q {tuple(q.shape)} has D = {d}"
        )
    if t == 0 or h == 0 or d == 0:
        raise ValueError(f"q: shape {tuple(q.shape)} has an empty axis; expected T, H, D ≥ 1")
    if k_scale is not None:
        _checks.check_rank("k_scale", k_scale, 1, "[S]")
        _checks.check_dtype("k_scale", k_scale, (jnp.float32,))
        if k_scale.shape[0] != s:
            raise ValueError(
                f"k_scale: shape {tuple(k_scale.shape)}; expected [S] = ({s},) to match "
                f"k {tuple(k.shape)}"
            )
        values = _checks.concrete(k_scale)
        if values is not None and values.size:
            bad = ~(np.isfinite(values) & (values > 0))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"k_scale: every scale must be finite and > 0; k_scale[{i}] = {values[i]} "
                    f"({int(bad.sum())} bad of {values.size})"
                )
    start, end = _checks.check_ranges(kv_start, kv_end, t, s, f"q {tuple(q.shape)}")
    return start, end


def indexer_scores(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    *,
    k_scale: Float[Array, " S"] | None = None,
    kv_start: Int[Array, " T"] | None = None,
    kv_end: Int[Array, " T"] | None = None,
    implementation: str | Sequence[str] | None = None,
) -> Float[Array, "T S"]:
    """Indexer scores of every key for every query (f32), ``-inf`` where not visible.

    Args:
      q: [T, H, D] queries (float32, bfloat16 or float8_e4m3fn).
      weights: [T, H] float32 signed head weights.
      k: [S, D] keys (float32, bfloat16 or float8_e4m3fn).
      k_scale: optional [S] float32 > 0 multiplying key i (FP8 dequantisation scale).
      kv_start, kv_end: optional [T] int32; query t sees keys kv_start[t] ≤ i < kv_end[t]
        (default: all S keys). Checked when concrete; under ``jit`` kv_start is clamped
        to [0, S] and kv_end to [kv_start, S].
      implementation: see :mod:`jsparse.backend`.

    Derivatives: the ReLU's derivative is 1 at 0 (a key with q·k = 0 passes its head's
    gradient) in every implementation. The Pallas kernels have backward kernels of
    their own (reverse mode); a gradient of that gradient takes the reference's.
    """
    start, end = _validate(q, weights, k, k_scale, kv_start, kv_end)
    if k.shape[0] == 0:  # no keys: nothing to score (the kernels need one key tile)
        return jnp.zeros((q.shape[0], 0), jnp.float32)

    def call(q, weights, start, end):
        return backend.dispatch(
            "indexer_scores", _score_implementations(), implementation,
            q, weights, k, k_scale, start, end, differentiable=True,
            backward=_score_backward() if _backward_kernels_pay(q, k) else None,
        )  # fmt: skip

    chunk = _chunking.queries_per_call(q.shape[0], k.shape[0])
    return _chunking.over_query_chunks(call, chunk, q, weights, start, end)


def indexer_topk(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    top_k: int,
    *,
    k_scale: Float[Array, " S"] | None = None,
    kv_start: Int[Array, " T"] | None = None,
    kv_end: Int[Array, " T"] | None = None,
    method: str = "base",
    seeds: int | Int[Array, "T N"] | None = None,
    sorted: bool = True,
    implementation: str | Sequence[str] | None = None,
) -> IndexerTopK:
    """Exact Top-K keys of the indexer score for every query.

    Queries may share keys (prefill, several decode queries over one cache). For a batch
    of sequences, each query over keys of its own, use
    :func:`jsparse.indexer_topk_batch`: here a flattened cache would be treated as shared
    (FP8 widened in memory every call, several queries dotted with each key tile).

    Args:
      q, weights, k, k_scale, kv_start, kv_end: as in :func:`indexer_scores`.
      top_k: K, the number of keys to return per query.
      method: ``"xla"``, ``"base"``, ``"full"``, ``"dense"`` or ``"dosa"`` (module doc).
      seeds: for the thresholded methods (``full``, ``dense``, ``dosa``; ``base`` and
        ``xla`` score every key and ignore it): the number of seed keys per query
        (default a heuristic, see :func:`default_seed_ids`) or explicit [T, N] int32
        seed ids (-1 = unused slot; each must be visible to its query and distinct:
        refused when concrete, dropped under ``jit``).
      sorted: order each row by score descending, then id ascending (default). With
        False the row holds the same exact Top-K set in an order the implementation
        chooses (the Triton kernels: ascending id when the key range was not split and
        the call has many queries; a few queries come out ordered anyway),
        which saves one sort of K entries per query.
      implementation: see :mod:`jsparse.backend`; ignored by ``xla`` (but checked).

    Returns:
      :class:`IndexerTopK`.
    """
    start, end = _validate(q, weights, k, k_scale, kv_start, kv_end)
    top_k = _checks.check_top_k(top_k)
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}; expected one of {METHODS}")
    _checks.check_bool("sorted", sorted)
    backend.check_implementation(implementation)  # xla ignores it: a typo still raises
    seeds = None if method == "xla" else _check_seeds(seeds, q.shape[0], start, end)

    def select(q, weights, k, k_scale, start, end, seeds):
        k, k_scale, start, end = no_keys_as_one_unseen(k, k_scale, start, end)

        def call(q, weights, start, end, seeds):
            if method == "xla":
                return _topk_xla(q, weights, k, k_scale, start, end, top_k)
            if method in ("dense", "dosa"):
                from jsparse import certified  # the planner stays off the import path until used

                return certified.certified_topk(
                    q, weights, k, top_k, k_scale, start, end, seeds,
                    method=method, sorted=sorted, implementation=implementation,
                )  # fmt: skip
            return backend.dispatch(
                f"indexer_topk[{method}]", _topk_implementations(method), implementation,
                q, weights, k, top_k, k_scale, start, end, seeds, sorted,
            )  # fmt: skip

        chunk = _chunking.queries_per_call(q.shape[0], k.shape[0])
        return _chunking.over_query_chunks(call, chunk, q, weights, start, end, seeds)

    return _autodiff.selection(
        select, scores_of_ids, _ids_and_scores, (q, weights, k, k_scale, start, end, seeds)
    )


def scores_of_ids(ids, q, weights, k, k_scale, *_):
    """[T, N] scores of the key ids ``ids`` (-1: -inf): the derivative of a Top-K's scores
    (:mod:`jsparse._autodiff`)."""
    if k.shape[0] == 0:
        return jnp.full(ids.shape, -jnp.inf, jnp.float32)
    return reference.score_keys_reference(q, weights, k, ids, k_scale)


def _ids_and_scores(result: IndexerTopK):
    return result.indices, result.scores


def no_keys_as_one_unseen(k, k_scale, start, end):
    """An empty key set (S = 0) as one zero key that no query sees: every method and
    implementation then runs on its usual path (the kernels need a key tile) and returns
    rows of -1 / -inf with nothing visible. Other inputs pass through unchanged."""
    if k.shape[0]:
        return k, k_scale, start, end
    k = jnp.zeros((1, k.shape[1]), k.dtype)
    k_scale = None if k_scale is None else jnp.ones((1,), jnp.float32)
    return k, k_scale, jnp.zeros_like(start), jnp.zeros_like(end)


def _check_seeds(seeds, t, start, end):
    """None, a positive seed count, or validated explicit [T, N] seed ids."""
    if seeds is None:
        return None
    if isinstance(seeds, int | np.integer) and not isinstance(seeds, bool):
        if seeds < 1:
            raise ValueError(f"seeds: expected a positive count or [T, N] int32 ids, got {seeds}")
        return int(seeds)
    _checks.check_rank("seeds", seeds, 2, "[T, N]")
    _checks.check_dtype("seeds", seeds, (jnp.int32,))
    if seeds.shape[0] != t:
        raise ValueError(f"seeds: shape {tuple(seeds.shape)}; expected [T, N] with T = {t}")
    ids = _checks.concrete(seeds)
    s_np, e_np = _checks.concrete(start), _checks.concrete(end)
    if ids is not None and s_np is not None and e_np is not None:
        if (ids < -1).any():
            row, col = np.argwhere(ids < -1)[0]
            raise ValueError(
                f"seeds: seeds[{row}, {col}] = {ids[row, col]}; expected key ids or -1 (unused)"
            )
        used = ids >= 0
        outside = used & ((ids < s_np[:, None]) | (ids >= e_np[:, None]))
        if outside.any():
            row, col = np.argwhere(outside)[0]
            raise ValueError(
                f"seeds: seeds[{row}, {col}] = {ids[row, col]} is not visible to query {row} "
                f"(range [{s_np[row]}, {e_np[row]}))"
            )
        row = _checks.first_repeating_row(ids)
        if row is not None:
            raise ValueError(f"seeds: row {row} lists a key more than once")
    return seeds


def default_seed_ids(
    kv_start: Int[Array, " T"],
    kv_end: Int[Array, " T"],
    top_k: int,
    *,
    n_seeds: int | None = None,
    num_keys: int,
) -> Int[Array, "T N"]:
    """Distinct visible seed keys per query: the most recent half, a strided sample of the rest.

    Recent keys score high on causal text (locality); the strided sample covers the
    rest of the range. Queries with fewer visible keys than seeds use all of them.
    """
    n = default_seed_count(top_k, num_keys) if n_seeds is None else n_seeds
    return recent_and_strided_ids(kv_start, kv_end, min(n, num_keys))


def _topk_xla(q, weights, k, k_scale, start, end, top_k):
    start, end = _checks.clamp_ranges(start, end, k.shape[0])
    scores = reference.indexer_scores_einsum(q, weights, k, k_scale, start, end)
    visible = (end - start).astype(jnp.int32)
    return exhaustive_result(*reference.lax_topk(scores, visible, top_k), visible)


@functools.partial(jax.jit, static_argnames=("top_k", "sort"))
def _topk_base_reference(q, weights, k, top_k, k_scale, start, end, seeds, sort=True):
    del seeds, sort  # the reference always sorts
    ids = reference.visible_key_ids(start, end, k.shape[0])
    scores = reference.score_keys_reference(q, weights, k, ids, k_scale)
    indices, values = select_topk_reference(scores, ids, top_k)
    return exhaustive_result(indices, values, (end - start).astype(jnp.int32))


def _topk_full_reference(q, weights, k, top_k, k_scale, start, end, seeds, sort=True):
    del sort  # the reference always sorts
    if seeds is None or isinstance(seeds, int):
        seeds = default_seed_ids(start, end, top_k, n_seeds=seeds, num_keys=k.shape[0])
    return _topk_full_reference_jit(q, weights, k, top_k, k_scale, start, end, seeds)


@functools.partial(jax.jit, static_argnames=("top_k",))
def _topk_full_reference_jit(q, weights, k, top_k, k_scale, start, end, seed_ids):
    seed_ids = usable_seed_ids(seed_ids, start, end)
    seed_scores = reference.score_keys_reference(q, weights, k, seed_ids, k_scale)
    tau_code = seed_threshold_code(seed_scores, seed_ids, top_k)
    ids = reference.visible_key_ids(start, end, k.shape[0])
    scores = reference.score_keys_reference(q, weights, k, ids, k_scale)
    codes = jnp.where(ids >= 0, score_code(scores), EMPTY_CODE)
    keep = (ids >= 0) & (codes >= tau_code[:, None])
    record_ids = jnp.where(keep, ids, -1)
    indices, values = select_topk_reference(scores, record_ids, top_k)
    visible = (end - start).astype(jnp.int32)
    return IndexerTopK(
        indices=indices,
        scores=values,
        visible=visible,
        candidates=jnp.sum(keep, axis=1).astype(jnp.int32),
        survivors=visible,
        threshold=code_to_score(tau_code),
        fallback=jnp.zeros(q.shape[:1], bool),
    )


def seed_threshold_code(
    seed_scores: Float[Array, "T N"], seed_ids: Int[Array, "T N"], top_k: int
) -> Int[Array, " T"]:
    """Code of τ, the K-th largest seed score; ``EMPTY_CODE`` when fewer than K seeds.

    With fewer than K seeds there is no certified lower bound on the K-th score, so
    every visible key must be kept (EMPTY_CODE is below every real code).
    """
    codes = jnp.where(seed_ids >= 0, score_code(seed_scores), EMPTY_CODE)
    if codes.shape[1] < top_k:
        return jnp.full(codes.shape[:1], EMPTY_CODE, jnp.int32)
    return jax.lax.top_k(codes, top_k)[0][:, top_k - 1]


def _mosaic(name):
    # Imported when called, not when listed: a Mosaic import problem on some jax version
    # must not break the other implementations.
    def call(*args, **kwargs):
        from jsparse.ops.indexer import mosaic

        return getattr(mosaic, name)(*args, **kwargs)

    return call


def _clamping(fn, at):
    """``fn`` with its ranges, positional arguments ``at`` and ``at + 1``, clamped first
    (:func:`jsparse._checks.clamp_ranges`; ``k`` is argument 2): for the implementations
    whose kernels do not clamp traced ranges where they load them, as Triton's do."""

    def call(*args, **kwargs):
        args = list(args)
        args[at], args[at + 1] = _checks.clamp_ranges(args[at], args[at + 1], args[2].shape[0])
        return fn(*args, **kwargs)

    return call


@functools.cache  # built once: a fresh jax.jit wrapper per call costs ~1 ms of host time
def _score_implementations():
    # Pallas imports only when used. "mosaic" is opt-in (backend.OPT_IN_IMPLEMENTATIONS).
    from jsparse.ops.indexer import triton as triton_impl

    return {
        "triton": triton_impl.indexer_scores_triton,
        "mosaic": _mosaic("indexer_scores_mosaic"),  # its prologue clamps the ranges
        "reference": _clamping(jax.jit(reference.indexer_scores_reference), 4),
    }


def _backward_kernels_pay(q, k) -> bool:
    """Whether the scores differentiate by the backward kernels (else by the reference's
    derivative, XLA einsums): see :func:`jsparse.ops.indexer.backward.kernels_take` (f32
    inputs only with tensor-core dots)."""
    from jsparse.ops.indexer.backward import kernels_take  # Pallas imports only when used

    return SCORES_BACKWARD_KERNELS and kernels_take(q.dtype, k.dtype, q.shape[-1])


def _score_backward():
    from jsparse.ops.indexer.backward import indexer_scores_vjp_triton

    # the derivative of the scores' function: one backward for either forward kernel.
    # Cotangents take their primal's dtype (a float8 one rounds to E4M3, as JAX's own).
    def backward(cotangent, q, weights, k, k_scale, start, end):
        grads = indexer_scores_vjp_triton(cotangent, q, weights, k, k_scale, start, end)
        primals = (q, weights, k, k_scale)
        pairs = zip(grads, primals, strict=True)
        typed = (None if x is None else g.astype(x.dtype) for g, x in pairs)
        return *typed, None, None

    return {"triton": backward, "mosaic": backward}


def _topk_implementations(method):
    from jsparse.ops.indexer import triton as triton_impl  # Pallas imports only when used

    if method == "base":
        return {
            "triton": triton_impl.topk_base_triton,  # its kernels clamp the ranges
            "mosaic": _mosaic("topk_base_mosaic"),  # prologue and selection clamp them
            "reference": _clamping(_topk_base_reference, 5),
        }
    return {
        "triton": _clamping(triton_impl.topk_full_triton, 5),
        "reference": _clamping(_topk_full_reference, 5),
    }
