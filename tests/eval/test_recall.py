"""Recall metrics against a brute-force numpy computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.eval import recall
from jsparse.eval.recall import RecallReference, select_causal, selection_mask
from jsparse.eval.synthetic import synthetic_qkv
from jsparse.selectors import make_selector


def _softmax(x):
    x = x - x.max()
    e = np.exp(x)
    return e / e.sum()


def _brute(q, k, v, lengths, idx, budget):
    t_n, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    out = {n: np.zeros((t_n, hkv)) for n in ("oracle_recall", "mass_recall", "output_error")}
    for t in range(t_n):
        n = lengths[t]
        for kh in range(hkv):
            qm = q[t, kh * g : (kh + 1) * g].mean(axis=0)
            scores = k[:n, kh] @ qm
            oracle = set(np.argsort(-scores, kind="stable")[:budget].tolist())
            chosen = {i for i in idx[t, kh].tolist() if i >= 0}
            out["oracle_recall"][t, kh] = len(oracle & chosen) / min(budget, n)
            masses, errs = [], []
            for gi in range(g):
                p = _softmax(k[:n, kh] @ q[t, kh * g + gi] / np.sqrt(d))
                sel = np.zeros(n, bool)
                sel[list(chosen)] = True
                masses.append(p[sel].sum())
                full = p @ v[:n, kh]
                sparse = (p * sel) @ v[:n, kh] / p[sel].sum()
                errs.append(np.linalg.norm(sparse - full) / np.linalg.norm(full))
            out["mass_recall"][t, kh] = np.mean(masses)
            out["output_error"][t, kh] = np.mean(errs)
    return out


def test_metrics_match_brute_force():
    q, k, v = (
        np.asarray(x, np.float64)
        for x in synthetic_qkv(jax.random.key(3), 96, n_heads=4, n_kv_heads=2, head_dim=8, latent=4)
    )
    pos = np.arange(80, 96)
    lengths = pos + 1
    rng = np.random.default_rng(0)
    budget = 10
    idx = np.full((16, 2, budget), -1, np.int32)
    for t in range(16):
        for h in range(2):
            m = rng.integers(1, budget + 1)
            idx[t, h, :m] = rng.choice(lengths[t], m, replace=False)
    ref = RecallReference(
        jnp.asarray(q[pos], jnp.float32),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(v, jnp.float32),
        jnp.asarray(lengths),
    )
    want = _brute(q[pos], k, v, lengths, idx, budget)
    denom = jnp.minimum(budget, ref.lengths).astype(jnp.float32)
    args = (ref.probs, ref.out, ref.v, jnp.asarray(idx), ref.oracle_mask(budget), denom)
    for path in (recall._metrics_gather, recall._metrics_dense):
        got = path(*args)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-5, err_msg=name)


def test_oracle_and_full_are_perfect():
    q, k, v = synthetic_qkv(jax.random.key(4), 200, n_heads=6, n_kv_heads=2, head_dim=16, latent=4)
    pos = jnp.arange(150, 200)
    ref = RecallReference(q[pos], k, v, pos + 1)
    oracle = select_causal(make_selector("oracle"), {}, q[pos], k, pos + 1, 32)
    np.testing.assert_allclose(ref.metrics(oracle, 32)["oracle_recall"], 1.0)
    full = select_causal(make_selector("full"), {}, q[pos], k, pos + 1, 32)
    m = ref.metrics(full, 32)
    np.testing.assert_allclose(m["mass_recall"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(m["output_error"], 0.0, atol=1e-5)


def test_select_causal_equals_per_query_select():
    q, k, _ = synthetic_qkv(jax.random.key(5), 120, n_heads=6, n_kv_heads=2, head_dim=16, latent=4)
    sel = make_selector("quest", page_size=8)
    pos = jnp.arange(100, 120)
    batched = select_causal(sel, {}, q[pos], k, pos + 1, 24)
    for i, t in enumerate(np.asarray(pos)):
        one = sel.select({}, q[t][None], k[None], jnp.array([t + 1]), 24)[0]
        np.testing.assert_array_equal(batched[i], one)


def test_selection_mask_ignores_padding():
    idx = jnp.array([[[0, 2, -1]]], jnp.int32)
    np.testing.assert_array_equal(selection_mask(idx, 4)[0, 0], [True, False, True, False])


def test_metrics_refuse_selections_they_would_miscount():
    """A duplicate id counted twice on the gather path (recall 4.0), once on the dense
    one (0.25); an id past S read out of range; budget 0 gave NaN."""
    q, k, v = synthetic_qkv(jax.random.key(6), 64, n_heads=4, n_kv_heads=2, head_dim=8, latent=4)
    pos = jnp.arange(60, 64)
    ref = RecallReference(q[pos], k, v, pos + 1)
    good = select_causal(make_selector("oracle"), {}, q[pos], k, pos + 1, 4)
    ref.metrics(good, 4)
    repeated = good.at[0, 0, 1].set(good[0, 0, 0])
    with pytest.raises(ValueError, match="idx: a row lists a key more than once"):
        ref.metrics(repeated, 4)
    with pytest.raises(ValueError, match="idx: ids must be < S = 64"):
        ref.metrics(good.at[1, 1, 0].set(64), 4)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="budget: expected an int >= 1"):
            ref.metrics(good, bad)


def test_families_name_every_method_family_and_nothing_else():
    from jsparse.eval import protocol

    made = {m.family for m in protocol.default_methods([8, 16], head_dim=64)}
    assert made | {"jssa_rd", "jssa_rd-shared"} == set(protocol.FAMILIES)
    with pytest.raises(ValueError, match=r"families: unknown \['lokii'\]; expected some of"):
        protocol.default_methods([8], families=["jssa", "lokii"])


def test_reference_refuses_lengths_outside_one_to_s():
    """A length past S scored oracle recall 0.8 for every key selected; 0 gave NaN."""
    q, k, v = synthetic_qkv(jax.random.key(7), 16, n_heads=2, n_kv_heads=1, head_dim=8, latent=4)
    for lengths in ([16, 20], [0, 16], [-1, 16]):
        with pytest.raises(ValueError, match=r"lengths: expected every length in \[1, S = 16\]"):
            RecallReference(q[:2], k, v, jnp.asarray(lengths, jnp.int32))
    RecallReference(q[:2], k, v, jnp.asarray([1, 16], jnp.int32))


def test_metrics_refuse_more_ids_than_the_budget_except_every_visible_key():
    """5 ids at budget 2 scored as if within budget; the `full` selector's every visible
    key (the accuracy ceiling, wider by design) is still scored."""
    q, k, v = synthetic_qkv(jax.random.key(8), 16, n_heads=2, n_kv_heads=1, head_dim=8, latent=4)
    lengths = jnp.asarray([12, 16], jnp.int32)
    ref = RecallReference(q[jnp.asarray([11, 15])], k, v, lengths)
    every = jnp.where(jnp.arange(16) < lengths[:, None], jnp.arange(16), -1)[:, None, :]
    m = ref.metrics(every.astype(jnp.int32), 2)  # every visible key: the dense ceiling
    np.testing.assert_allclose(m["oracle_recall"], 1.0)
    five = jnp.full((2, 1, 8), -1, jnp.int32).at[:, :, :5].set(jnp.arange(5))
    with pytest.raises(ValueError, match=r"selects 5 ids, more than budget = 2"):
        ref.metrics(five, 2)
    ref.metrics(five, 5)
    past = every.at[0, 0, 12].set(12)  # 13 ids for a query that sees 12 keys
    with pytest.raises(ValueError, match=r"\(query 0, KV head 0\) selects 13 ids"):
        ref.metrics(past.astype(jnp.int32), 2)
