"""``jsparse.topk``: exact Top-K of dense score rows, against an independent numpy
oracle, for the kernels and the reference; and its input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse


def oracle(scores, start, end, k):
    """numpy: sort visible keys by (score descending with NaN first, id ascending)."""
    t = scores.shape[0]
    ids = np.full((t, k), -1, np.int64)
    vals = np.full((t, k), -np.inf, np.float32)
    for r in range(t):
        i = np.arange(start[r], end[r])
        x = scores[r, i].astype(np.float64)
        key = np.where(np.isnan(x), np.inf, x)
        rank_nan = np.isnan(x)
        x0 = np.where(x == 0, 0.0, key)  # -0 == +0
        order = np.lexsort((i, -x0, ~rank_nan))[:k]
        ids[r, : len(order)] = i[order]
        vals[r, : len(order)] = scores[r, i[order]]
    return ids, vals


def rows(kind, rng, t=5, s=3000):
    x = rng.standard_normal((t, s)).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "all-equal":
        x[:] = 0.25
    elif kind == "subnormal":  # ties among subnormals, both zeros: one order on every backend
        x = (rng.integers(-40, 41, x.shape) * np.float32(2.0**-149)).astype(np.float32)
        x[:, 1::11] = -0.0
    elif kind == "specials":
        x[:, ::5] = -np.inf
        x[:, 1::9] = np.inf
        x[:, 2::13] = np.nan
        x[:, 3::7] = -0.0
    start = np.array([0, 10, 2900, 0, 1500][:t], np.int32)
    end = np.array([s, 2000, s, 0, 1600][:t], np.int32)  # one empty row, one short row
    return x, start, end


@pytest.mark.parametrize("kind", ["gauss", "ties", "all-equal", "specials", "subnormal"])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_topk_matches_the_numpy_oracle(kind, impl, kernel_impl):
    rng = np.random.default_rng(3)
    x, start, end = rows(kind, rng)
    k = 150  # larger than the 100 keys the short row sees
    name = kernel_impl if impl == "kernel" else "reference"
    ids, vals = jsparse.topk(
        jnp.asarray(x), k, kv_start=jnp.asarray(start), kv_end=jnp.asarray(end),
        implementation=name,
    )  # fmt: skip
    want_ids, want_vals = oracle(x, start, end, k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(vals), want_vals)


def test_unsorted_is_the_same_set(kernel_impl):
    # the same (id, score) pairs, padding included (-1 / -inf past a short row's keys)
    rng = np.random.default_rng(4)
    x, start, end = rows("gauss", rng)
    start, end = np.array(start), np.array(end)
    start[1], end[1] = 10, 50  # 40 visible keys for a top-64
    args = dict(kv_start=jnp.asarray(start), kv_end=jnp.asarray(end), implementation=kernel_impl)
    ids, vals = jsparse.topk(jnp.asarray(x), 64, sorted=False, **args)
    want_ids, want_vals = oracle(x, start, end, 64)
    for r in range(x.shape[0]):
        got = zip(np.asarray(ids[r]).tolist(), np.asarray(vals[r]).tolist(), strict=True)
        want = zip(want_ids[r].tolist(), want_vals[r].tolist(), strict=True)
        assert sorted(got) == sorted(want), r


def test_defaults_jit_and_no_keys():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 40)).astype(np.float32))
    ids, _ = jax.jit(lambda x: jsparse.topk(x, 3))(x)
    np.testing.assert_array_equal(np.asarray(ids), oracle(np.asarray(x), [0, 0], [40, 40], 3)[0])
    ids, vals = jsparse.topk(jnp.zeros((2, 0), jnp.float32), 4)
    assert np.all(np.asarray(ids) == -1) and np.all(np.isneginf(np.asarray(vals)))


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_topk_prefix_is_topk_with_each_sequences_length(impl, kernel_impl):
    # three sequences of two rows each; lengths past S, negative and shorter than K are
    # clipped to [0, S], as a decode step's selection clipped them before
    rng = np.random.default_rng(6)
    x, _, _ = rows("ties", rng, t=6, s=3000)
    lengths = np.array([3100, -2, 90], np.int32)
    ends = np.repeat(np.clip(lengths, 0, 3000), 2)
    name = kernel_impl if impl == "kernel" else "reference"
    select = jax.jit(lambda x, n: jsparse.ops.topk.topk_prefix(x, n, 150, implementation=name))
    ids, vals = select(jnp.asarray(x), jnp.asarray(lengths))
    want_ids, want_vals = oracle(x, np.zeros(6, np.int32), ends, 150)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(vals), want_vals)


@pytest.mark.parametrize(
    "lengths, message",
    [
        (jnp.zeros((2, 1), jnp.int32), "lengths: expected rank 1"),
        (jnp.zeros((2,), jnp.float32), "lengths: dtype float32"),
        (jnp.zeros((4,), jnp.int32), r"lengths: shape \(4,\) against scores \(6, 40\)"),
        (jnp.zeros((0,), jnp.int32), "B dividing T"),
    ],
)
def test_topk_prefix_bad_lengths(lengths, message):
    with pytest.raises(ValueError, match=message):
        jsparse.ops.topk.topk_prefix(jnp.zeros((6, 40), jnp.float32), lengths, 3)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_traced_ranges_are_clamped(impl, interpret):
    """Under jit: kv_start clamped to [0, S], kv_end to [kv_start, S]."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 40)), jnp.float32)
    start, end = jnp.asarray([-3, 38, 5], jnp.int32), jnp.asarray([2, 99, -1], jnp.int32)
    got = jax.jit(lambda s, e: jsparse.topk(x, 4, kv_start=s, kv_end=e, implementation=impl))
    ids, _ = got(start, end)
    clamped = jnp.asarray([0, 38, 5], jnp.int32), jnp.asarray([2, 40, 5], jnp.int32)
    want, _ = jsparse.topk(x, 4, kv_start=clamped[0], kv_end=clamped[1], implementation=impl)
    np.testing.assert_array_equal(ids, want)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x: jsparse.topk(x[0], 3), "scores: expected rank 2"),
        (lambda x: jsparse.topk(x.astype(jnp.bfloat16), 3), "scores: dtype bfloat16"),
        (lambda x: jsparse.topk(x, 0), "top_k: expected top_k ≥ 1"),
        (lambda x: jsparse.topk(x, 2.0), "top_k: expected a positive Python int"),
        (lambda x: jsparse.topk(x, 2**31), r"top_k: got 2147483648; expected at most 2\^31 - 1"),
        (lambda x: jsparse.topk(x.tolist(), 3), "scores: got a list; expected an array"),
        (lambda x: jsparse.topk(x, 3, kv_end=jnp.array([9, 41], jnp.int32)), r"kv_end\[1\] = 41"),
        (lambda x: jsparse.topk(x, 3, kv_start=jnp.array([5, 0], jnp.int32),
                                kv_end=jnp.array([4, 9], jnp.int32)), "kv_start > kv_end"),
        (lambda x: jsparse.topk(x, 3, kv_start=jnp.zeros((3,), jnp.int32)),
         r"expected \[T\] = \(2,\)"),
        (lambda x: jsparse.topk(x, 3, implementation="cuda"), "implementation: got 'cuda'"),
        (lambda x: jsparse.topk(x, 3, sorted="no"), "sorted: expected True or False"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(call, message):
    x = jnp.zeros((2, 40), jnp.float32)
    with pytest.raises(ValueError, match=message):
        call(x)
