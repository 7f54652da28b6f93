"""The records pass of launches whose splits share a query: staged records (one
reservation a query per stage flush) against a reservation per tile; and the key-list
launch that writes scores by list position instead of records."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import backend
from jsparse.ops.indexer import triton as scorer
from jsparse.ops.topk import codes as codes_lib
from jsparse.testing import lower_for_h200


def _inputs(t=3, h=4, d=16, s=1500, seed=0):
    kq, kw, kk = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (t, h, d)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (t, h))
    k = jax.random.normal(kk, (s, d)).astype(jnp.bfloat16)
    start = jnp.asarray([0, 200, 0][:t], jnp.int32)
    end = jnp.asarray([s, 1100, 40][:t], jnp.int32)  # a short row: fewer than a stage
    return q, w, k, start, end


def _records(monkeypatch, staged, slots, *args, **kwargs):
    monkeypatch.setattr(scorer, "STAGED_SPLIT_RECORDS", staged)
    monkeypatch.setattr(scorer, "STAGE_SLOTS", slots)
    codes, ids, counts, in_order = scorer.score_records_triton(*args, **kwargs)
    return np.asarray(codes), np.asarray(ids), np.asarray(counts), in_order


@pytest.mark.parametrize("slots", [16, 1024], ids=["flushes", "one-flush"])
@pytest.mark.parametrize("keys", ["range", "lists"])
def test_staged_split_records_equal_per_tile_reservation(monkeypatch, kernel_impl, slots, keys):
    q, w, k, start, end = _inputs()
    s = k.shape[0]
    cfg = scorer.ScorerConfig(block_t=2, block_s=16, num_warps=4, num_stages=1)
    monkeypatch.setattr(backend, "sm_count", lambda: 2)  # 8 programs: two splits a block
    # τ: about a quarter of each row's visible scores
    dense = np.asarray(scorer.indexer_scores_triton(q, w, k, None, start, end, cfg=cfg))
    quarter = np.nanquantile(np.where(np.isinf(dense), np.nan, dense), 0.75, axis=1)
    tau = codes_lib.score_code(jnp.asarray(quarter, jnp.float32))
    kwargs = dict(cfg=cfg)
    if keys == "lists":  # every third key, per query block
        ids = np.full((2, 600), -1, np.int32)
        ids[:, :500] = np.arange(0, s, 3)[:500]
        kwargs.update(key_ids=jnp.asarray(ids), key_counts=jnp.asarray([500, 480], jnp.int32))
    args = (q, w, k, None, start, end, tau)
    for cap in (2000, 40):  # roomy, and overflowing (the count runs on past cap)
        want = _records(monkeypatch, False, slots, *args, cap, **kwargs)
        got = _records(monkeypatch, True, slots, *args, cap, **kwargs)
        assert not want[3] and not got[3]  # split launches: records in no particular order
        np.testing.assert_array_equal(got[2], want[2])
        for r in range(q.shape[0]):
            n = min(int(want[2][r]), cap)
            got_set = set(zip(got[0][r, :n].tolist(), got[1][r, :n].tolist(), strict=True))
            want_set = set(zip(want[0][r, :n].tolist(), want[1][r, :n].tolist(), strict=True))
            assert len(got_set) == n  # no record written twice
            if int(want[2][r]) <= cap:  # which ones an overflowing row keeps is arbitrary
                assert got_set == want_set, (cap, r)
            # the slots past the stored ones keep their initial values
            assert np.all(got[0][r, n:] == codes_lib.EMPTY_CODE) and np.all(got[1][r, n:] == -1)


@pytest.mark.parametrize("splits", [1, 3])
def test_list_scores_are_the_dense_scores_by_list_position(kernel_impl, splits):
    # The certified methods' seeds and refinement: each query's scores of its block's
    # listed keys, by list position, and its count of visible scores ≥ τ, which must be
    # the records launch's count over the same lists.
    q, w, k, start, end = _inputs()
    s = k.shape[0]
    cfg = scorer.ScorerConfig(block_t=2, block_s=16, num_warps=4, num_stages=1)
    dense = np.asarray(scorer.indexer_scores_triton(q, w, k, None, start, end, cfg=cfg))
    ids = np.full((2, 600), -1, np.int32)
    ids[0, :500] = np.arange(0, s, 3)[:500]
    ids[1, :470] = np.arange(1, s, 3)[:470]
    counts = jnp.asarray([500, 470], jnp.int32)  # block 1: a partly filled last tile
    # τ: each row's median listed visible score, so a key sits exactly at τ (kept).
    tau = []
    for r in range(q.shape[0]):
        listed = ids[r // 2, : int(counts[r // 2])]
        row = dense[r, listed[(listed >= int(start[r])) & (listed < int(end[r]))]]
        tau.append(np.sort(row)[len(row) // 2])
    tau = codes_lib.score_code(jnp.asarray(tau, jnp.float32))
    kwargs = dict(key_ids=jnp.asarray(ids), key_counts=counts, cfg=cfg, splits=splits)
    got, kept = scorer.score_list_triton(q, w, k, None, start, end, tau_codes=tau, **kwargs)
    got = np.asarray(got)
    assert got.shape == (3, 608)
    want_seen = []
    for r in range(q.shape[0]):
        n = int(counts[r // 2])
        listed = ids[r // 2, :n]
        seen = (listed >= int(start[r])) & (listed < int(end[r]))
        want = np.where(seen, dense[r, np.maximum(listed, 0)], -np.inf)
        np.testing.assert_array_equal(got[r, :n], want, err_msg=f"row {r}")
        want_seen.append(int(seen.sum()))
    records = scorer.score_records_triton(q, w, k, None, start, end, tau, 2000, **kwargs)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(records[2]))
    # Without τ every visible listed key counts.
    _, seen_all = scorer.score_list_triton(q, w, k, None, start, end, **kwargs)
    np.testing.assert_array_equal(np.asarray(seen_all), want_seen)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "per-tile"])
def test_split_records_lower_to_cuda(monkeypatch, staged):
    monkeypatch.setattr(scorer, "STAGED_SPLIT_RECORDS", staged)
    t, s = 8, 65536
    q = jax.ShapeDtypeStruct((t, 64, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((t, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((s, 128), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((t,), jnp.int32)
    lowered = lower_for_h200(
        lambda q, w, k, a, b, tau: scorer.score_records_triton(q, w, k, None, a, b, tau, 4096)[:3],
        q, w, k, rows, rows, rows,
    )  # fmt: skip
    assert "jsparse_indexer_records" in lowered.as_text()
