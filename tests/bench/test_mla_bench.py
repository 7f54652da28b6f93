"""The MLA benchmark checks every method before it times it, and the check can fail."""

import json

import jax.numpy as jnp
import pytest

from bench import mla
from bench.run import main

CASE = dict(b=2, s=80, h=16, dc=32, dr=16, budget=24, dtype="bf16")


@pytest.mark.parametrize("dtype, page", [("bf16", 0), ("fp8", 16)], ids=["dense", "paged-fp8"])
def test_check_accepts_every_method_and_flags_a_wrong_answer(dtype, page):
    cache, bf16 = mla.make_cache({**CASE, "dtype": dtype, "page": page}, seed=0)
    dense = dict(cache=bf16, cache_scale=None, page_table=None)
    q, idx = mla.make_query(CASE, seed=0)
    out = {}
    for method in ("xla", "dense", "base"):
        fn = mla.method_fn(method, "reference", CASE["dc"])
        src = dense if method == "dense" else cache
        out[method] = fn(q, idx, src["cache"], src["cache_scale"], src["page_table"])
        assert out[method].shape == (2, 16, 32)
        assert mla.check(method, out[method], q=q, idx=idx, src=src, dc=32) == [], method
    assert mla.check("dense", out["base"], q=q, idx=idx, src=cache, dc=32) != []  # 24 of 80
    wrong = out["base"].at[1, 3, 0].add(jnp.bfloat16(1.0))
    assert mla.check("base", wrong, q=q, idx=idx, src=cache, dc=32) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "mla.json"
    assert main(["--op", "mla", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"xla", "dense", "base"}
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in rows)
