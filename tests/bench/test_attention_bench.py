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
    # every sequence is checked, and a small shift everywhere is not BF16 rounding
    three = dict(inputs, q=jnp.concatenate([q, q[:1]]), idx=jnp.concatenate([idx, idx[:1]]))
    three["cache"] = {n: None if a is None else jnp.concatenate([a, a[:1]]) if page == 0 and
                      n != "page_table" else a for n, a in cache.items()}  # fmt: skip
    if page:
        three["cache"]["page_table"] = jnp.concatenate(
            [cache["page_table"], cache["page_table"][:1]]
        )
        three["cache"]["k_scale"] = jnp.concatenate([cache["k_scale"], cache["k_scale"][:1]])
        three["cache"]["v_scale"] = jnp.concatenate([cache["v_scale"], cache["v_scale"][:1]])
    middle = jnp.concatenate([out["xla"], out["xla"][:1]]).at[1].set(0)
    assert [p[:10] for p in attention.check("xla", middle, **three)] == ["sequence 1"]
    assert attention.check("xla", out["xla"] + 2e-2, **inputs) != []


def test_output_mismatch_allows_bf16_rounding_only():
    want = jnp.linspace(-1.0, 1.0, 64).reshape(4, 16)
    assert attention.output_mismatch(0, want.astype(jnp.bfloat16), want) == []
    assert attention.output_mismatch(0, want + 2e-2, want) != []  # the RMS error
    drift = want.at[0, 0].add(1e-2 * jnp.sign(want[0, 0]))  # one entry, within the max bound
    assert attention.output_mismatch(0, drift, want) == []
    noisy = want * (1 + 3e-2 * jnp.cos(jnp.arange(64.0)).reshape(4, 16))  # RMS > 2^-6
    assert attention.output_mismatch(0, noisy, want) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "attention.json"
    assert main(["--op", "attention", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    assert out.exists()
