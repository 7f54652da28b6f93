"""The closed-form JSSA basis against numpy's eigh."""

import numpy as np
import pytest

from jsparse.calibration import Moments, jssa_basis, normalize_trace, top_eigenvectors


def _spd(rng, d, eigenvalues):
    u, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (u * eigenvalues) @ u.T


def _moments(gq, gk):
    d = gq.shape[-1]
    z = np.zeros(gq.shape[:-1], np.float32)
    return Moments(gq.astype(np.float32), gk.astype(np.float32), z, z, np.ones(()) * d)


def test_matches_numpy_eigh_distinct_spectrum():
    rng = np.random.default_rng(0)
    d, r = 16, 5
    gq = _spd(rng, d, np.geomspace(10.0, 0.01, d))[None]
    gk = _spd(rng, d, np.geomspace(40.0, 0.1, d))[None]
    basis = np.asarray(jssa_basis(_moments(gq, gk), r))[0]
    target = gq[0] / np.trace(gq[0]) + gk[0] / np.trace(gk[0])
    _w, v = np.linalg.eigh(target)
    ref = v[:, ::-1][:, :r].T
    # Distinct eigenvalues: each row equals numpy's eigenvector up to sign.
    np.testing.assert_allclose(np.abs(np.sum(basis * ref, axis=1)), 1.0, atol=1e-5)
    np.testing.assert_allclose(basis @ basis.T, np.eye(r), atol=1e-5)


def test_equal_eigenvalues_same_subspace():
    """With a repeated eigenvalue inside the top r only the subspace is defined."""
    rng = np.random.default_rng(1)
    d, r = 12, 4
    eig = np.array([5.0, 3.0, 3.0, 3.0] + [0.5] * 8)  # gap after the 4th
    sym = _spd(rng, d, eig)
    rows, values = top_eigenvectors(sym.astype(np.float32), r)
    np.testing.assert_allclose(values, eig[:r], rtol=1e-5)
    _w, v = np.linalg.eigh(sym)
    p_ref = v[:, -r:] @ v[:, -r:].T
    p = np.asarray(rows).T @ np.asarray(rows)
    np.testing.assert_allclose(p, p_ref, atol=1e-5)


def test_trace_normalisation_flag():
    rng = np.random.default_rng(2)
    d, r = 10, 3
    gq = _spd(rng, d, np.geomspace(1.0, 0.01, d))[None]
    gk = 100.0 * _spd(rng, d, np.geomspace(1.0, 0.01, d))[None]  # key moment dominates
    raw = np.asarray(jssa_basis(_moments(gq, gk), r, normalize=False))[0]
    _, v = np.linalg.eigh(gq[0] + gk[0])
    np.testing.assert_allclose(np.abs(np.sum(raw * v[:, ::-1][:, :r].T, axis=1)), 1.0, atol=1e-4)
    normed = np.asarray(jssa_basis(_moments(gq, gk), r))[0]
    target = np.asarray(normalize_trace(gq[0]) + normalize_trace(gk[0]))
    _w, v = np.linalg.eigh(target)
    np.testing.assert_allclose(np.abs(np.sum(normed * v[:, ::-1][:, :r].T, axis=1)), 1.0, atol=1e-4)


def test_deterministic_signs_and_batching():
    rng = np.random.default_rng(3)
    sym = np.stack([_spd(rng, 8, np.geomspace(4, 0.1, 8)) for _ in range(6)]).reshape(2, 3, 8, 8)
    rows, _ = top_eigenvectors(sym.astype(np.float32), 3)
    assert rows.shape == (2, 3, 3, 8)
    pivot = np.take_along_axis(np.asarray(rows), np.abs(rows).argmax(-1)[..., None], -1)
    assert (pivot > 0).all()
    again, _ = top_eigenvectors(sym.astype(np.float32), 3)
    np.testing.assert_array_equal(rows, again)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank"):
        top_eigenvectors(np.eye(4, dtype=np.float32), 5)


def test_non_finite_matrices_give_nan_not_an_arbitrary_basis():
    """Under jit nothing can raise: a matrix with a NaN or inf gives a NaN basis (eigh
    may return finite vectors for it); its batch neighbours are unaffected."""
    sym = np.stack([np.eye(4), np.eye(4), np.diag([4.0, 3, 2, 1])]).astype(np.float32)
    sym[0, 2, 2] = np.nan  # on the diagonal: eigh returns finite vectors
    sym[1, 3, 3] = np.inf
    rows, values = top_eigenvectors(sym, 2)
    assert np.isnan(rows[:2]).all() and np.isnan(values[:2]).all()
    np.testing.assert_allclose(np.abs(rows[2]), np.eye(4)[:2], atol=1e-6)
    np.testing.assert_allclose(values[2], [4.0, 3.0])


def test_a_float16_matrix_near_its_largest_value_symmetrises_without_overflow():
    """The symmetrisation once added the matrix to its transpose in the input dtype,
    so a float16 entry of 40000 (twice of which passes float16's 65504) became inf."""
    sym = np.diag([40000.0, 1.0]).astype(np.float16)
    vectors, values = top_eigenvectors(sym, 1)
    np.testing.assert_array_equal(np.asarray(vectors), [[1.0, 0.0]])
    np.testing.assert_allclose(np.asarray(values), [40000.0])


def test_rank_and_shape_are_refused_by_name():
    sym = np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match="rank must be in"):
        top_eigenvectors(sym, 2.0)
    with pytest.raises(ValueError, match=r"sym has shape \(4, 3\); expected \[\*L, D, D\]"):
        top_eigenvectors(sym[:, :3], 2)
