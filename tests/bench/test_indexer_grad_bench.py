"""The derivative benchmark checks before it times, against a derivative it computes
apart from both methods, and its check can fail."""

import jax
import numpy as np
import pytest

from bench import indexer_grad
from bench.run import main
from jsparse import backend

CASE = dict(t=9, s=21, h=3, d=16, ranges="causal")


def test_the_analytic_derivative_equals_the_references_autodiff():
    inputs = indexer_grad.make_inputs(dict(CASE, dtype="f32"), seed=1)
    want = indexer_grad.oracle(inputs)
    got = jax.jit(indexer_grad.pullback_fn("reference"))(inputs)
    assert indexer_grad.check(want, got, tol=1e-6) == []
    # chunks that do not divide T give the same answer
    chunked = indexer_grad.analytic_vjp(**inputs, chunk=4)
    assert indexer_grad.check(want, chunked, tol=1e-6) == []


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_check_accepts_both_methods_and_flags_wrong_cotangents(dtype):
    inputs = indexer_grad.make_inputs(dict(CASE, dtype=dtype), seed=2)
    want = indexer_grad.oracle(inputs)
    tol = indexer_grad.CHECK_RTOL[dtype]
    reference = jax.jit(indexer_grad.pullback_fn("reference"))(inputs)
    assert indexer_grad.check(want, reference, tol) == []
    with backend.interpret_mode(True):
        kernels = jax.jit(indexer_grad.pullback_fn("triton"))(inputs)
    assert indexer_grad.check(want, kernels, tol) == []
    dq, dw, dk, dc = (np.asarray(x, np.float64) for x in want)
    assert indexer_grad.check(want, (dq * 1.02, dw, dk, dc), tol)  # 2% off
    assert indexer_grad.check(want, (dq, dw, dk[::-1], dc), tol)  # keys swapped
    assert indexer_grad.check(want, (dq, dw, dk, dc[:-1]), tol)  # wrong shape
    assert indexer_grad.check(want, (dq, dw * np.nan, dk, dc), tol)  # not finite


def test_fp8_is_refused_with_the_reason():
    with pytest.raises(SystemExit, match="bf16"):
        indexer_grad.make_inputs(dict(CASE, dtype="fp8"), seed=0)


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "grad.json"
    assert main(["--op", "indexer-grad", "--quiet", "--json", str(out)]) == 0
    assert out.exists()


def test_backward_configs_parse_and_a_wrong_one_is_refused():
    (cfg,) = indexer_grad.backward_configs("16,32,4,4,3,2")
    assert (cfg.block_t, cfg.block_s, cfg.head_groups, cfg.dq_heads) == (16, 32, 4, 2)
    assert (cfg.num_warps, cfg.num_stages) == (4, 3)
    assert indexer_grad.backward_configs(None) == [None]
    with pytest.raises(SystemExit, match="6 integers"):
        indexer_grad.backward_configs("16,32")
    assert main(["--op", "indexer-grad", "--quiet", "--backward-config", "16,16,2,4,2,1"]) == 0
