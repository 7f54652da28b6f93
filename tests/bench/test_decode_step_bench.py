"""The decode-step benchmark checks every method before it times it, and the check can fail."""

import math

import jax.numpy as jnp
import pytest

from bench import decode_step
from bench.run import main

CASE = dict(b=2, s=96, h=4, hkv=2, d=16, rank=4, budget=12)


@pytest.mark.parametrize(
    "serving", [{}, {"kv": "fp8", "page": 16}], ids=["dense-bf16", "paged-fp8"]
)
def test_check_accepts_every_method_and_flags_a_wrong_answer(serving):
    case = {**CASE, **serving}
    dense, cache, sel, params, state = decode_step.make_layer(case)
    q = jnp.ones((2, 4, 16), jnp.bfloat16) * jnp.arange(16, dtype=jnp.bfloat16) / 8
    keys = decode_step.key_view(cache)
    lists, _ = decode_step.reference_lists(sel, params, q, keys, state, CASE["budget"])
    inputs = dict(q=q, cache=cache, dense=dense, want_lists=lists, scale=1 / math.sqrt(16))
    out = {}
    for method in ("xla", "dense", "jssa"):
        fn = decode_step.step_fn(method, "reference", case, sel, params, on_gpu=False,
                                 dense=dense)  # fmt: skip
        if method == "dense":
            out[method], after = fn(q, *dense, {}, state)
        else:
            out[method], after = fn(q, cache["k"], cache["v"], decode_step.extras(cache), state)
        assert after.values.shape == state.values.shape
        assert decode_step.check(method, out[method], **inputs) == [], method
    assert decode_step.check("dense", out["jssa"], **inputs) != []  # 12 of 96 rows
    wrong = out["jssa"].at[1, 3, 0].add(jnp.bfloat16(1.0))
    assert decode_step.check("jssa", wrong, **inputs) != []


def test_the_cli_runs_the_smoke_preset(tmp_path):
    out = tmp_path / "decode_step.json"
    assert main(["--op", "decode-step", "--quiet", "--budget", "0.05", "--json", str(out)]) == 0
    assert out.exists()


def test_a_case_too_large_for_the_device_is_reported_not_a_traceback(tmp_path, monkeypatch):
    """The decode preset's 32 x 128K cases ran out of an 80 GB card's memory while the
    layer was built, and the run stopped with a traceback before the cases after it.
    Now each method's row says the case does not fit, the other cases run, and the run
    exits 0 (no method is at fault); any other error while building still raises."""
    import json

    build = decode_step.make_layer

    def make_layer(case, seed=0):
        if case.get("kv") == "fp8":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16GiB")
        return build(case, seed)

    monkeypatch.setattr(decode_step, "make_layer", make_layer)
    out = tmp_path / "rows.json"
    argv = ["--op", "decode-step", "--preset", "smoke", "--quiet", "--budget", "0.02",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    unfit = [r for r in rows if r["status"].startswith("does not fit this device")]
    assert {r["method"] for r in unfit} == set(decode_step.DEFAULT_METHODS)
    assert all("fp8" in r["case"] for r in unfit)
    assert [r["status"] for r in rows if r not in unfit] == ["ok"] * 3

    def broken(case, seed=0):
        raise ValueError("not a memory error")

    monkeypatch.setattr(decode_step, "make_layer", broken)
    with pytest.raises(ValueError, match="not a memory error"):
        main(argv)
