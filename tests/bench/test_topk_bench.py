"""The selection benchmark checks before it times, and its check can fail."""

import jax.numpy as jnp
import numpy as np

from bench import topk
from bench.run import main
from jsparse import backend


def _case():
    case = dict(t=3, s=300, top_k=20, ranges="causal")
    inputs = topk.make_inputs(case, seed=1)
    want = topk.select_fn("base", 20, sort=True, impl="reference")(**inputs)
    return inputs, tuple(np.asarray(x) for x in want)


def test_check_accepts_the_reference_and_flags_a_wrong_id():
    inputs, (ids, scores) = _case()
    assert topk.check(inputs, (ids, scores), top_k=20, rows=3, in_order=True) == []
    shuffled = ids[:, ::-1].copy(), scores[:, ::-1].copy()  # ids and values together
    assert topk.check(inputs, shuffled, top_k=20, rows=3, in_order=False) == []
    assert topk.check(inputs, shuffled, top_k=20, rows=3, in_order=True) != []
    wrong = ids.copy()
    wrong[1, 5] = 299  # a key row 1 cannot see
    assert topk.check(inputs, (wrong, scores), top_k=20, rows=3, in_order=False) != []
    # the values are checked too, each against its own id's score
    for values in (-scores, scores + 1, np.where(np.arange(20) == 19, scores[:, :1], scores)):
        assert topk.check(inputs, (ids, values), top_k=20, rows=3, in_order=True) != []


def test_check_uses_its_own_oracle_not_the_api(monkeypatch):
    """A broken ``jsparse.topk`` used to break the check's reference too (it called it)."""
    inputs, (ids, scores) = _case()
    monkeypatch.setattr(topk.jsparse, "topk", lambda *a, **k: (ids[:, ::-1], scores[:, ::-1]))
    assert topk.check(inputs, (ids, scores), top_k=20, rows=3, in_order=True) == []


def test_xla_and_the_kernels_agree_with_the_reference():
    inputs, want = _case()
    xla = topk.select_fn("xla", 20, sort=True, impl="triton")(**inputs)
    np.testing.assert_array_equal(np.asarray(xla[0]), want[0])
    with backend.interpret_mode(True):
        got = topk.select_fn("base", 20, sort=True, impl="triton")(**inputs)
    np.testing.assert_array_equal(np.asarray(got[0]), want[0])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(jnp.asarray(want[1])))


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "topk.json"
    assert main(["--op", "topk", "--quiet", "--unsorted", "--json", str(out)]) == 0
    assert out.exists()


def test_a_red_check_is_not_timed_and_an_error_is_reported():
    from bench import common

    sets = [jnp.arange(4.0)]
    row = dict(case="c", method="m")
    common.check_then_time(
        row, lambda x: x + 1, sets, lambda r: ["wrong"], budget_s=0.01, device_time=False,
        nbytes=16, floor_s=1e-9,
    )  # fmt: skip
    assert row["status"] == "CHECK FAILED: wrong" and "ms" not in row

    def out_of_memory(x):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    row = dict(case="c", method="m")
    common.check_then_time(
        row, out_of_memory, sets, lambda r: [], budget_s=0.01, device_time=False,
        nbytes=16, floor_s=1e-9,
    )  # fmt: skip
    assert row["status"].startswith("out of memory") and "ms" not in row
    row = dict(case="c", method="m")
    common.check_then_time(
        row, lambda x: x + 1, sets, lambda r: [], budget_s=0.01, device_time=False,
        nbytes=16, floor_s=1e-9,
    )  # fmt: skip
    assert row["status"] == "ok" and row["ms"] > 0
