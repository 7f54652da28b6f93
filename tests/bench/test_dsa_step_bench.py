"""The DSA decode-step benchmark checks every method before it times it, and the check
can fail."""

import json

import jax.numpy as jnp
import numpy as np

from bench import dsa_step
from bench.run import main

CASE = dict(b=2, s=96, h=8, dc=32, dr=8, hi=4, di=32, top_k=12)


def test_check_accepts_every_method_and_flags_a_wrong_answer():
    cache = dsa_step.make_step_inputs(CASE)
    queries = dsa_step.make_queries(CASE, 0)
    lists = dsa_step.selected_rows(queries, *cache[1:], top_k=12)
    inputs = dict(queries=queries, rows=cache[0], keys=cache[1], k_scale=cache[2],
                  lengths=cache[3], want_lists=lists, dc=32)  # fmt: skip
    out = {}
    for method in ("xla", "dense", "dsa"):
        out[method] = dsa_step.step_fn(method, "reference", CASE)(queries, *cache)
        assert dsa_step.check(method, out[method], **inputs) == [], method
    attended, top = out["dsa"]
    ids = top.indices
    assert attended.shape == out["xla"].shape == (2, 8, 32)
    np.testing.assert_array_equal(ids, lists)  # one scorer on the CPU
    assert dsa_step.check("dense", attended, **inputs) != []  # 12 of 96 rows
    wrong = attended.at[1, 3, 0].add(jnp.bfloat16(1.0))
    assert dsa_step.check("dsa", (wrong, top), **inputs) != []
    # dsa is checked on its own selection, which must be an exact Top-K
    outside = jnp.setdiff1d(jnp.arange(96), ids[1])[0]
    swapped = ids.at[1, 0].set(outside)  # a winner replaced by a loser
    swapped_top = top.replace(indices=swapped)
    assert any("sequence 1" in p for p in dsa_step.check("dsa", (attended, swapped_top), **inputs))
    assert dsa_step.check("xla", out["xla"], **inputs | {"want_lists": swapped}) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "dsa_step.json"
    assert main(["--op", "dsa-step", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"xla", "dense", "dsa"}
    assert all(r["status"] == "ok" for r in rows)
