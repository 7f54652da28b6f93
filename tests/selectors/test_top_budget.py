"""The selectors' top-budget step: the exact Top-K kernels (GPU, interpret mode) and
``lax.top_k`` (elsewhere) pick the same positions in the same order; unordered lists
hold the same positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.selectors import base
from jsparse.selectors.base import top_budget

# rows cut by the budget, a budget beyond S, long rows; each with shorter rows beside
CASES = pytest.mark.parametrize(
    "s, budget, lengths",
    [(300, 40, [300, 17, 0]), (64, 100, [64, 5, 63]), (1000, 256, [999, 1000, 300])],
    ids=["cut", "budget-beyond-S", "long"],
)  # fmt: skip


def _scores(b, hkv, s, seed=0):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((b, hkv, s)).astype(np.float32)
    scores[0, 0, ::3] = 0.5  # ties, some straddling the cut
    scores[-1, -1] = 1.0  # a row of equal scores
    return jnp.asarray(scores)


@CASES
def test_kernels_and_lax_top_k_agree(monkeypatch, interpret, s, budget, lengths):
    scores = _scores(len(lengths), 2, s)
    lengths = jnp.asarray(lengths, jnp.int32)
    monkeypatch.setattr(base, "_selection_kernels", lambda: False)
    want = np.asarray(top_budget(scores, lengths, budget))
    monkeypatch.setattr(base, "_selection_kernels", lambda: True)
    got = np.asarray(top_budget(scores, lengths, budget))
    np.testing.assert_array_equal(got, want)
    assert np.all(got[1][:, min(int(lengths[1]), budget) :] == -1)


@CASES
def test_unordered_lists_hold_the_same_positions(monkeypatch, interpret, s, budget, lengths):
    """``ordered=False`` (what attention asks for) skips the kernels' final sort: each
    row holds the same positions and padding, in another order."""
    scores = _scores(len(lengths), 2, s)
    lengths = jnp.asarray(lengths, jnp.int32)
    monkeypatch.setattr(base, "_selection_kernels", lambda: True)
    want = np.asarray(top_budget(scores, lengths, budget))
    got = np.asarray(top_budget(scores, lengths, budget, ordered=False))
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1))
    if s == 1000:  # random scores: score order is not the kernels' own order
        assert not np.array_equal(got, want)


def test_signed_zeros_nans_and_subnormals_rank_as_in_the_kernels(monkeypatch, interpret):
    """``lax.top_k`` orders by the sign bit as well: -0 below +0, and a NaN with its
    sign bit set (what XLA's CPU makes of inf - inf) below -inf. The kernels rank -0
    as +0 and every NaN above +inf; the fallback must pick the same positions."""
    bits = np.array(
        [0x80000000, 0, 0x80000000, 0xFFC00000, 0x3F800000, 0, 0x7FC00000, 0xFF800000,
         0x00000001, 0x80000001, 0xFFFFFFFF, 0x7F800000, 0x80000000, 0x007FFFFF],
        np.uint32,
    )  # fmt: skip
    row = bits.view(np.float32)
    scores = jnp.asarray(np.stack([row, row[::-1]])[:, None, :])  # [2, 1, 14]
    lengths = jnp.asarray([14, 11], jnp.int32)
    for budget in (3, 8, 14):
        monkeypatch.setattr(base, "_selection_kernels", lambda: False)
        want = np.asarray(top_budget(scores, lengths, budget))
        monkeypatch.setattr(base, "_selection_kernels", lambda: True)
        got = np.asarray(top_budget(scores, lengths, budget))
        np.testing.assert_array_equal(got, want)
    assert list(got[0, 0, :5]) == [3, 6, 10, 11, 4]  # the NaNs by position, +inf, 1.0


@pytest.mark.gpu
def test_gpu_kernels_and_lax_top_k_agree(monkeypatch):
    scores = _scores(8, 8, 131072, seed=1)
    lengths = jnp.asarray([131072, 70000, 2048, 2047, 100, 131071, 99999, 65536], jnp.int32)
    monkeypatch.setattr(base, "_selection_kernels", lambda: False)
    want = np.asarray(top_budget(scores, lengths, 2048))
    monkeypatch.setattr(base, "_selection_kernels", lambda: True)
    np.testing.assert_array_equal(np.asarray(top_budget(scores, lengths, 2048)), want)
    per = jax.vmap(lambda sc, ln: top_budget(sc[None], ln[None], 2048)[0])  # compiled, batched
    np.testing.assert_array_equal(np.asarray(per(scores, lengths)), want)
    loose = np.asarray(top_budget(scores, lengths, 2048, ordered=False))
    np.testing.assert_array_equal(np.sort(loose, axis=-1), np.sort(want, axis=-1))


def test_kernels_under_vmap(monkeypatch, interpret):
    """``jax.vmap(sel.select)`` is part of the selector contract: the kernels batch too."""
    scores = _scores(3, 2, 200)
    lengths = jnp.asarray([200, 50, 7], jnp.int32)
    monkeypatch.setattr(base, "_selection_kernels", lambda: False)
    want = np.asarray(top_budget(scores, lengths, 16))
    monkeypatch.setattr(base, "_selection_kernels", lambda: True)
    per = jax.vmap(lambda sc, ln: top_budget(sc[None], ln[None], 16)[0])
    np.testing.assert_array_equal(np.asarray(per(scores, lengths)), want)


def test_an_empty_batch_selects_nothing(monkeypatch, interpret):
    monkeypatch.setattr(base, "_selection_kernels", lambda: True)
    idx = top_budget(jnp.zeros((0, 2, 50)), jnp.zeros((0,), jnp.int32), 8)
    assert idx.shape == (0, 2, 8)


def test_select_over_an_empty_batch():
    """No sequence in flight: [0, Hkv, budget] (a reshape divided by B = 0 before)."""
    import jsparse

    sel = jsparse.make_selector("jssa", rank=2)
    rng = np.random.default_rng(0)
    params = sel.calibrate(jnp.asarray(rng.standard_normal((20, 4, 8)), jnp.float32),
                           jnp.asarray(rng.standard_normal((20, 2, 8)), jnp.float32))  # fmt: skip
    idx = sel.select(
        params, jnp.ones((0, 4, 8)), jnp.ones((0, 5, 2, 8)), jnp.zeros((0,), jnp.int32), 3
    )
    assert idx.shape == (0, 2, 3) and idx.dtype == jnp.int32
