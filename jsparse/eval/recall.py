"""Recall of token selectors against full attention (MATH.md §2.8).

All metrics use the ORIGINAL full-dimensional q, k, v: causal visibility (the query at
position ``t`` sees keys ``0..t``, i.e. ``lengths = t + 1``), softmax with scale
``1/sqrt(D)`` in f32. For one selection ``idx`` (int32 ``[T, Hkv, W]``, ``-1`` = empty):

* **oracle top-budget recall**: ``|I ∩ I*| / min(budget, length)`` per (query, KV head),
  ``I*`` the exact top-``budget`` of the group-mean scores ``q̄·k`` (the oracle selector);
* **attention-mass recall**: per query head, the softmax mass of full attention that falls
  on its KV head's selected tokens; averaged over the ``G`` heads of the KV head;
* **relative output error**: ``‖o_sparse - o_full‖ / ‖o_full‖`` per query head, where
  ``o_sparse`` is softmax attention restricted to the selected tokens; averaged over the
  ``G`` heads of the KV head.

Each metric comes back as ``[T, Hkv]``: one value per (query, KV head); callers average.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jsparse import _checks, backend
from jsparse.selectors.base import Selector, top_budget

__all__ = ["RecallReference", "select_causal", "selection_mask"]

_HIGHEST = jax.lax.Precision.HIGHEST


def selection_mask(idx: Int[Array, "T Hkv W"], n_keys: int) -> Bool[Array, "T Hkv S"]:
    """Boolean membership mask of an index list (``-1`` entries are ignored)."""
    t, h, _ = idx.shape
    safe = jnp.where(idx < 0, n_keys, idx)  # out of range: dropped by the scatter
    mask = jnp.zeros((t, h, n_keys), bool)
    ti = jnp.arange(t)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return mask.at[ti, hi, safe].set(True, mode="drop")


@backend.jit_per_mode(static_argnames=("sel", "budget"))
def select_causal(
    sel: Selector,
    params,
    q: Float[Array, "T H D"],
    k: Float[Array, "S Hkv D"],
    lengths: Int[Array, " T"],
    budget: int,
) -> Int[Array, "T Hkv W"]:
    """``sel.select`` for ``T`` decoding queries over one shared key cache, each query
    seeing its own prefix ``k[:lengths[t]]`` (keys are projected once, not per query)."""

    def one(qt, lt):
        return sel._select_impl(params, qt[None], k[None], lt[None], budget)[0]

    return jax.vmap(one)(q, lengths)


@jax.jit
def _dense(q, k, v, lengths):
    t, h, d = q.shape
    s, hkv, _ = k.shape
    qh = q.astype(jnp.float32).reshape(t, hkv, h // hkv, d)
    logits = jnp.einsum("thgd,shd->thgs", qh, k.astype(jnp.float32), precision=_HIGHEST)
    visible = jnp.arange(s)[None, :] < lengths[:, None]  # [T, S]
    logits = jnp.where(visible[:, None, None, :], logits / math.sqrt(d), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)  # [T, Hkv, G, S]
    out = jnp.einsum("thgs,shd->thgd", probs, v.astype(jnp.float32), precision=_HIGHEST)
    return probs, out


def _finish(mass, out, out_full, hits, denom):
    out = out / jnp.where(mass > 0, mass, 1.0)[..., None]
    err = jnp.linalg.norm(out - out_full, axis=-1) / jnp.maximum(
        jnp.linalg.norm(out_full, axis=-1), 1e-30
    )
    err = jnp.where(mass > 0, err, 1.0)
    return {
        "oracle_recall": hits / denom[:, None],
        "mass_recall": mass.mean(axis=-1),
        "output_error": err.mean(axis=-1),
    }


@jax.jit
def _metrics_dense(probs, out_full, v, idx, oracle_mask, denom):
    """Through an ``[T, Hkv, S]`` membership mask: for wide selections."""
    mask = selection_mask(idx, probs.shape[-1])
    pm = probs * mask[:, :, None, :].astype(jnp.float32)  # [T, Hkv, G, S]
    mass = pm.sum(axis=-1)  # [T, Hkv, G]
    out = jnp.einsum("thgs,shd->thgd", pm, v.astype(jnp.float32), precision=_HIGHEST)
    hits = jnp.sum(mask & oracle_mask, axis=-1).astype(jnp.float32)  # [T, Hkv]
    return _finish(mass, out, out_full, hits, denom)


@jax.jit
def _metrics_gather(probs, out_full, v, idx, oracle_mask, denom):
    """Through the selected ids only (``W`` ≪ ``S``): gathers probabilities and values.
    Selections hold distinct ids (the selector contract), so nothing is counted twice."""
    valid = idx >= 0  # [T, Hkv, W]
    safe = jnp.where(valid, idx, 0)
    w = valid.astype(jnp.float32)
    p_sel = jnp.take_along_axis(probs, safe[:, :, None, :], axis=-1) * w[:, :, None, :]
    mass = p_sel.sum(axis=-1)  # [T, Hkv, G]
    v_heads = jnp.swapaxes(v.astype(jnp.float32), 0, 1)  # [Hkv, S, Dv]
    v_sel = v_heads[jnp.arange(idx.shape[1])[None, :, None], safe]  # [T, Hkv, W, Dv]
    out = jnp.einsum("thgw,thwd->thgd", p_sel, v_sel, precision=_HIGHEST)
    hits = jnp.sum(jnp.take_along_axis(oracle_mask, safe, axis=-1) & valid, axis=-1)
    return _finish(mass, out, out_full, hits.astype(jnp.float32), denom)


class RecallReference:
    """Full attention for ``T`` causal queries over one key cache, computed once and
    reused to score any number of selections.

    ``q [T, H, D]`` are the queries at positions ``lengths - 1``; ``k, v [S, Hkv, D]``.
    """

    def __init__(
        self,
        q: Float[Array, "T H D"],
        k: Float[Array, "S Hkv D"],
        v: Float[Array, "S Hkv Dv"],
        lengths: Int[Array, " T"],
    ):
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or lengths.shape != (q.shape[0],):
            raise ValueError(
                f"RecallReference: expected q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv], "
                f"lengths [T]; got {q.shape}, {k.shape}, {v.shape}, {lengths.shape}"
            )
        seen = _checks.concrete(lengths)  # (under jit: not checked)
        if seen is not None and seen.size and not ((seen >= 1) & (seen <= k.shape[0])).all():
            # 0 gave NaN recalls, a length past S a recall scored against S keys only
            raise ValueError(
                f"lengths: expected every length in [1, S = {k.shape[0]}], got {seen.tolist()}"
            )
        self.q, self.k, self.v = q, k, v
        self.lengths = jnp.asarray(lengths, jnp.int32)
        self.probs, self.out = _dense(q, k, v, self.lengths)
        self._oracle: dict[int, Bool[Array, "T Hkv S"]] = {}

    @property
    def n_keys(self) -> int:
        return self.k.shape[0]

    def oracle_ids(self, budget: int) -> Int[Array, "T Hkv budget"]:
        """The oracle selector's ids: the exact top-``budget`` of each KV head's group-mean
        ``q̄·k`` over the full keys."""
        return _oracle_idx(self.q, self.k, self.lengths, budget)

    def oracle_mask(self, budget: int) -> Bool[Array, "T Hkv S"]:
        """Membership of the exact top-``budget`` of ``q̄·k`` (cached per budget)."""
        if budget not in self._oracle:
            self._oracle[budget] = selection_mask(self.oracle_ids(budget), self.n_keys)
        return self._oracle[budget]

    def metrics(self, idx: Int[Array, "T Hkv W"], budget: int) -> dict[str, Float[Array, "T Hkv"]]:
        """The three metrics of one selection, each ``[T, Hkv]``."""
        if idx.shape[:2] != (self.q.shape[0], self.k.shape[1]):
            raise ValueError(
                f"idx: expected [T={self.q.shape[0]}, Hkv={self.k.shape[1]}, W], got {idx.shape}"
            )
        _checks.check_int("budget", budget, 1)
        ids = _checks.concrete(idx)
        if ids is not None and ids.size:
            if ids.max() >= self.n_keys:
                raise ValueError(
                    f"idx: ids must be < S = {self.n_keys} (-1 = empty), got {ids.max()}"
                )
            if _checks.first_repeating_row(ids) is not None:
                raise ValueError("idx: a row lists a key more than once (recall counts each once)")
            self._check_width(ids, budget)
        denom = jnp.minimum(budget, self.lengths).astype(jnp.float32)
        fn = _metrics_gather if 4 * idx.shape[-1] <= self.n_keys else _metrics_dense
        return fn(self.probs, self.out, self.v, idx, self.oracle_mask(budget), denom)

    def _check_width(self, ids, budget: int) -> None:
        """A row may list more than ``budget`` ids only as the dense ceiling (the ``full``
        selector: every visible key, whatever the budget); other wider selections scored
        as if within budget (5 ids at budget 2 could score recall 1.0). Skipped under jit."""
        lengths = _checks.concrete(self.lengths)
        if lengths is None:
            return
        valid = ids >= 0
        count = valid.sum(axis=-1)  # [T, Hkv]
        visible = np.where(valid, ids < lengths[:, None, None], True).all(axis=-1)
        ceiling = (count == lengths[:, None]) & visible  # distinct ids (checked): the prefix
        wide = (count > budget) & ~ceiling
        if wide.any():
            t, h = np.argwhere(wide)[0]
            raise ValueError(
                f"idx: row (query {t}, KV head {h}) selects {count[t, h]} ids, more than "
                f"budget = {budget} (wider only as every visible key, {lengths[t]})"
            )


@backend.jit_per_mode(static_argnames=("budget",))
def _oracle_idx(q, k, lengths, budget):
    t, h, d = q.shape
    hkv = k.shape[1]
    qm = q.astype(jnp.float32).reshape(t, hkv, h // hkv, d).mean(axis=2)
    scores = jnp.einsum("thd,shd->ths", qm, k.astype(jnp.float32), precision=_HIGHEST)
    return top_budget(scores, lengths, budget)
