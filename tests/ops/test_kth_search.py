"""The exact K-th code search that the selection kernels run in registers
(:func:`jsparse.ops.topk.triton._kth_code`), as plain JAX against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse.ops.topk import triton as select
from jsparse.ops.topk.codes import EMPTY_CODE, score_code

N = 4096
I32 = np.iinfo(np.int32)


@jax.jit
def kth(codes, rank):
    return select._kth_code(codes, rank)


def rows(rng):
    """Code rows that stress the search: smooth tails, ties, huge spans, extremes."""
    normal = rng.standard_normal(N).astype(np.float32)
    yield "normal", np.asarray(score_code(jnp.asarray(normal)))
    yield (
        "top-tail",
        np.asarray(score_code(jnp.asarray(np.sort(normal)[-2800:]))).tolist() + [0] * (N - 2800),
    )
    yield "ties", rng.integers(-3, 4, N, dtype=np.int32)
    yield "one-value", np.full(N, 7, np.int32)
    yield "extremes", rng.choice(np.array([I32.min + 1, -1, 0, 1, I32.max - 1], np.int32), N)
    yield "uniform-int32", rng.integers(I32.min + 1, I32.max, N, dtype=np.int32)
    specials = normal.copy()
    specials[::7] = np.inf
    specials[::11] = -np.inf
    specials[::13] = np.nan
    yield "specials", np.asarray(score_code(jnp.asarray(specials)))


@pytest.mark.parametrize("seed", range(3))
def test_kth_code_is_the_exact_rank_th_largest(seed):
    rng = np.random.default_rng(seed)
    for name, codes in rows(rng):
        codes = np.asarray(codes, np.int32)
        for ok_fraction in (1.0, 0.6):
            ok = rng.random(N) < ok_fraction
            ok[0] = True
            live = np.sort(codes[ok])[::-1]
            # also ranks that end a run of equal codes: there a trial's count can hit
            # rank exactly, the search's early exit
            ends = [int(np.sum(live >= v)) for v in live[rng.integers(0, len(live), 6)]]
            for rank in (1, 2, 2048, len(live) // 2 + 1, len(live), *ends):
                rank = int(min(max(rank, 1), len(live)))
                dead_empty = np.where(ok, codes, EMPTY_CODE)  # what the kernels hold
                got = int(kth(jnp.asarray(dead_empty), jnp.int32(rank)))
                assert got == live[rank - 1], (name, ok_fraction, rank)
