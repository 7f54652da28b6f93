"""The decode-step benchmark checks every method before it times it, and the check can fail."""

import math

import jax.numpy as jnp

from bench import decode_step
from bench.run import main

CASE = dict(b=2, s=96, h=4, hkv=2, d=16, rank=4, budget=12)


def test_check_accepts_every_method_and_flags_a_wrong_answer():
    k, v, sel, params, state = decode_step.make_layer(CASE)
    q = jnp.ones((2, 4, 16), jnp.bfloat16) * jnp.arange(16, dtype=jnp.bfloat16) / 8
    lists, _ = decode_step.reference_lists(sel, params, q, k, state, CASE["budget"])
    inputs = dict(q=q, k=k, v=v, want_lists=lists, scale=1 / math.sqrt(16))
    out = {}
    for method in ("xla", "dense", "jssa"):
        fn = decode_step.step_fn(method, "reference", CASE, sel, params, on_gpu=False)
        out[method], after = fn(q, k, v, state)
        assert after.values.shape == state.values.shape
        assert decode_step.check(method, out[method], **inputs) == [], method
    assert decode_step.check("dense", out["jssa"], **inputs) != []  # 12 of 96 rows
    wrong = out["jssa"].at[1, 3, 0].add(jnp.bfloat16(1.0))
    assert decode_step.check("jssa", wrong, **inputs) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "decode_step.json"
    assert main(["--op", "decode-step", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    assert out.exists()
