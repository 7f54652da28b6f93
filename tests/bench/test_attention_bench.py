"""The attention benchmark checks every method before it times it, and the check can fail."""

import math

import jax.numpy as jnp
import pytest

from bench import attention
from bench.run import main

CASE = dict(b=2, s=64, h=4, hkv=2, d=16, budget=12, dtype="fp8")


@pytest.mark.parametrize("page", [0, 16], ids=["dense", "paged"])
def test_check_accepts_every_method_and_flags_a_wrong_answer(page):
    cache = attention.make_cache({**CASE, "page": page}, seed=0)
    dense = attention.make_cache({**CASE, "dtype": "bf16"}, seed=0)
    q, idx = attention.make_query(CASE, seed=0)
    scale = 1 / math.sqrt(CASE["d"])
    inputs = dict(q=q, idx=idx, cache=cache, dense_cache=dense, scale=scale)
    out = {}
    for method in ("xla", "dense", "base"):
        fn = attention.method_fn(method, "reference", scale, heads=4, on_gpu=False)
        src = dense if method == "dense" else cache
        out[method] = fn(q, idx, src["k"], src["v"], src["k_scale"], src["v_scale"],
                         src["page_table"])  # fmt: skip
        assert attention.check(method, out[method], **inputs) == [], method
    assert attention.check("dense", out["xla"], **inputs) != []  # sparse is not dense
    wrong = out["xla"].at[1, 3, 0].add(jnp.bfloat16(1.0))
    assert attention.check("xla", wrong, **inputs) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "attention.json"
    assert main(["--op", "attention", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    assert out.exists()
