"""Stiefel refinement: exact objective, monotone history, orthonormality, overlap."""

import jax
import numpy as np
import pytest

from jsparse.calibration import (
    compute_moments,
    jssa_basis,
    normalize_trace,
    qr_retraction,
    refine_basis,
    selection_objective,
    subspace_overlap,
)
from jsparse.eval.synthetic import synthetic_qkv


def test_objective_is_mean_squared_score_error_over_all_pairs():
    rng = np.random.default_rng(0)
    d, r = 8, 3
    qm = rng.standard_normal((50, d))
    k = rng.standard_normal((40, d)) + 1.0
    m, _ = np.linalg.qr(rng.standard_normal((d, r)))
    resid = np.eye(d) - m @ m.T
    err = qm @ resid @ k.T  # every (query, key) pair: the product distribution
    gq, gk = qm.T @ qm / 50, k.T @ k / 40
    value = selection_objective(
        m.T.astype(np.float32), gq.astype(np.float32), gk.astype(np.float32)
    )
    np.testing.assert_allclose(value, np.mean(err**2), rtol=1e-4)


def _calibrated(rank):
    q, k, _ = synthetic_qkv(jax.random.key(0), 1024)
    moments = compute_moments(q, k)
    return (
        jssa_basis(moments, rank),
        normalize_trace(moments.gram_q),
        normalize_trace(moments.gram_k),
    )


@pytest.mark.parametrize("lr", [0.05, 50.0], ids=["paper-lr", "too-large-lr"])
def test_refinement_monotone_and_orthonormal(lr):
    basis, gq, gk = _calibrated(8)
    out = refine_basis(basis, gq, gk, steps=150, lr=lr)
    history = np.asarray(out.history)
    assert history.shape == (151, 3)
    assert (np.diff(history, axis=0) <= 0).all(), "objective increased during refinement"
    m = np.asarray(out.basis, np.float64)  # checked in float64: a GPU matmul would use TF32
    gram = m @ np.swapaxes(m, -1, -2)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(8), gram.shape), atol=1e-5)
    np.testing.assert_allclose(history[0], selection_objective(basis, gq, gk), rtol=1e-5)


def test_random_start_is_optimised():
    """From a random basis the same iteration makes real progress (it is not stalled)."""
    basis, gq, gk = _calibrated(8)
    random = qr_retraction(jax.random.normal(jax.random.key(1), basis.shape))
    out = refine_basis(random, gq, gk, steps=300, lr=20.0)
    h = np.asarray(out.history)
    assert (h[-1] < 0.7 * h[0]).all()
    assert (np.diff(h, axis=0) <= 0).all()


def test_qr_retraction_and_overlap():
    x = jax.random.normal(jax.random.key(2), (4, 5, 12))
    m = np.asarray(qr_retraction(x), np.float64)
    np.testing.assert_allclose(
        m @ np.swapaxes(m, -1, -2), np.broadcast_to(np.eye(5), (4, 5, 5)), atol=1e-5
    )
    _, _r = np.linalg.qr(np.swapaxes(np.asarray(x), -1, -2))
    # Same span as x, positive-diagonal convention.
    np.testing.assert_allclose(
        subspace_overlap(m, qr_retraction(np.asarray(x) * 3.0)), 1.0, atol=1e-5
    )
    rot = np.linalg.qr(np.random.default_rng(0).standard_normal((5, 5)))[0]
    np.testing.assert_allclose(subspace_overlap(m, rot @ np.asarray(m)), 1.0, atol=1e-5)
    e = np.eye(12, dtype=np.float32)
    np.testing.assert_allclose(subspace_overlap(e[:5][None], e[5:10][None]), 0.0, atol=1e-7)


def test_bad_inputs():
    basis, gq, gk = _calibrated(4)
    with pytest.raises(ValueError, match="leading"):
        refine_basis(basis[:2], gq, gk, steps=1)
    # more rows than D once came back as a D × D basis of another shape
    d = gq.shape[-1]
    tall = np.zeros((*gq.shape[:-2], d + 1, d), np.float32)
    with pytest.raises(ValueError, match=rf"rank R = {d + 1} > D = {d}"):
        refine_basis(tall, gq, gk, steps=1)
    with pytest.raises(ValueError, match=r"steps: expected an int >= 0, got 2\.5"):
        refine_basis(basis, gq, gk, steps=2.5)
    for lr in (float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="need a finite lr > 0"):
            refine_basis(basis, gq, gk, steps=1, lr=lr)
    with pytest.raises(ValueError, match="lr"):
        refine_basis(basis, gq, gk, steps=1, lr=0.0)
