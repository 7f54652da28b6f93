"""The MLA decode-step benchmark checks every method before it times it, and the check
can fail."""

import json

import jax.numpy as jnp
import pytest

from bench import mla_step
from bench.run import main

CASE = dict(b=2, s=96, h=8, dc=32, dr=8, rank=8, budget=12)


@pytest.mark.parametrize(
    "serving", [{}, {"dtype": "fp8", "page": 16}], ids=["dense-bf16", "paged-fp8"]
)
def test_check_accepts_every_method_and_flags_a_wrong_answer(serving):
    case = {**CASE, **serving}
    rows, src, sel, params, state = mla_step.make_layer(case)
    q = jnp.ones((2, 8, 40), jnp.bfloat16) * jnp.arange(40, dtype=jnp.bfloat16) / 20
    view = mla_step.row_view(src)
    lists, _ = mla_step.reference_lists(sel, params, q, view, state, CASE["budget"])
    inputs = dict(q=q, src=src, rows=rows, want_lists=lists, dc=32)
    out = {}
    for method in ("xla", "dense", "jssa"):
        fn = mla_step.step_fn(method, "reference", case, sel, params)
        if method == "dense":
            out[method], after = fn(q, rows, {}, state)
        else:
            out[method], after = fn(q, src["cache"], mla_step.extras(src), state)
        assert out[method].shape == (2, 8, 32)
        assert after.values.shape == state.values.shape
        assert mla_step.check(method, out[method], **inputs) == [], method
    assert mla_step.check("dense", out["jssa"], **inputs) != []  # 12 of 96 rows
    wrong = out["jssa"].at[1, 3, 0].add(jnp.bfloat16(1.0))
    assert mla_step.check("jssa", wrong, **inputs) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "mla_step.json"
    assert main(["--op", "mla-step", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"xla", "dense", "jssa"}
    assert all(r["status"] == "ok" for r in rows)
