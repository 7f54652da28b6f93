"""The DoSA bench's gate: base against the reference, every method equal to base, and
nothing timed that failed; its arguments are checked before any work."""

import functools
import json

import jax.numpy as jnp
import pytest

from bench import dosa


@pytest.fixture(autouse=True)
def _reference_methods(monkeypatch):
    """The methods by their jnp references (the gate is under test, not the kernels):
    seconds instead of the interpreted kernels' minute."""
    for owner, name in ((dosa, "dosa_topk"), (dosa.jsparse, "indexer_topk")):
        monkeypatch.setattr(
            owner, name, functools.partial(getattr(owner, name), implementation="reference")
        )


TINY = ["--prefill", "--shapes", "8x256", "--workloads", "iid", "--top-k", "8", "--iters", "1",
        "--no-diagnostics", "--no-refine-block", "--variants"]  # fmt: skip


def test_a_method_unequal_to_base_is_reported_and_not_timed(tmp_path, monkeypatch):
    right = dosa.dosa_topk

    def rolled(*args, **kwargs):  # right ids, wrong order
        res, info = right(*args, **kwargs)
        return res.replace(indices=jnp.roll(res.indices, 1, axis=1)), info

    monkeypatch.setattr(dosa, "dosa_topk", rolled)
    out = tmp_path / "dosa.json"
    assert dosa.main([*TINY, "--methods", "base", "dosa", "--json", str(out)]) == 1
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}  # strict JSON
    assert rows["base"]["status"] == "ok" and "median_ms" in rows["base"]
    assert rows["dosa"]["status"] == "CHECK FAILED: differs from base"
    assert "median_ms" not in rows["dosa"]


def test_base_is_checked_against_the_reference_even_when_not_timed(monkeypatch):
    right = dosa.jsparse.indexer_topk

    def shifted(*args, **kwargs):
        res = right(*args, **kwargs)
        return res.replace(scores=res.scores + 1.0)

    monkeypatch.setattr(dosa.jsparse, "indexer_topk", shifted)
    assert dosa.main([*TINY, "--methods", "dosa"]) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shapes", "8x"], "--shapes: expected NxM"),
        (["--workloads", "nope"], "--workloads: got 'nope'"),
        (["--methods", "nope"], "--methods: invalid choice"),
        (["--check-rows", "0"], "--check-rows: expected an int >= 1"),
    ],
)
def test_bad_arguments_stop_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        dosa.main(argv)
    assert message in capsys.readouterr().err
