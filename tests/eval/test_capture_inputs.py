"""What the recall evaluation refuses, each before it scores anything: captures holding
non-finite values or fewer tokens than meta.json says, calibration captures of other
heads, repeated flag values, and bad arguments to ``evaluate_layer``."""

import jax
import numpy as np
import pytest

from bench import recall
from jsparse.eval import protocol
from jsparse.eval.captures import read_layer
from jsparse.eval.synthetic import write_synthetic_capture


def _capture(path, n_tokens=64, **shape):
    write_synthetic_capture(path, jax.random.PRNGKey(0), n_tokens, n_layers=1, **shape)
    return path


def _rewrite_layer(path, **change):
    file = path / "layer_00.npz"
    with np.load(file) as f:
        arrays = {n: f[n] for n in ("q", "k", "v")}
    np.savez(file, **{**arrays, **change})


def test_a_non_finite_value_is_refused_by_file_array_and_token(tmp_path):
    """One NaN key ranked first in every exact top-k and the run printed a plausible
    table (its mass recall NaN, shown as an empty cell)."""
    cap = _capture(tmp_path / "c")
    with np.load(cap / "layer_00.npz") as f:
        k = f["k"].copy()
    k[3, 0, 5] = np.nan
    _rewrite_layer(cap, k=k)
    with pytest.raises(ValueError, match=r"layer_00\.npz: k is not finite at token 3"):
        read_layer(cap, 0)


def test_a_file_shorter_than_asked_is_refused(tmp_path):
    """meta.json saying more tokens than the files hold: calibration counted tokens it
    never read (and skipped the next capture under a token cap)."""
    cap = _capture(tmp_path / "c")
    assert read_layer(cap, 0, 40)[0].shape[0] == 40
    with pytest.raises(ValueError, match="holds 64 tokens, 100 asked for"):
        read_layer(cap, 0, 100)


def _run(tmp_path, *extra, eval_shape=None):
    calib = _capture(tmp_path / "calib")
    ev = _capture(tmp_path / "eval", **(eval_shape or {}))
    argv = ["--calib", str(calib), "--eval", str(ev), "--contexts", "32", "--no-progress"]
    return recall.main([*argv, *extra])


@pytest.mark.parametrize(
    "extra, eval_shape, message",
    [
        (["--layers", "0", "0"], None, "--layers: 0 given more than once"),
        (["--budgets", "4", "8", "4"], None, "--budgets: 4 given more than once"),
        (["--contexts", "32", "32"], None, "--contexts: 32 given more than once"),
        ([], {"n_kv_heads": 1}, "n_kv_heads 3; the --eval capture has n_kv_heads 1"),
        ([], {"head_dim": 32}, "head_dim 64; the --eval capture has head_dim 32"),
        (["--contexts", "128"], None, "--contexts: 128 is longer than the --eval capture's 64"),
    ],
)
def test_the_cli_refuses_before_calibrating(tmp_path, capsys, monkeypatch, extra, eval_shape,
                                            message):  # fmt: skip
    """A repeated layer weighed twice in the means over layers; a calibration capture of
    other heads was scored without a word (other query heads) or failed deep in the
    selector (other KV heads, head_dim) after the calibration, as did a context longer
    than the evaluation capture."""

    def no_work(*args, **kwargs):
        raise AssertionError("calibrated before refusing")

    monkeypatch.setattr(recall, "moments_from_captures", no_work)
    with pytest.raises(SystemExit):
        _run(tmp_path, *extra, eval_shape=eval_shape)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(budgets=[2.5]), "budgets: expected an int >= 1, got 2.5"),
        (dict(budgets=[0]), "budgets: expected an int >= 1, got 0"),
        (dict(contexts=[0]), "contexts: expected an int >= 1, got 0"),
        (dict(n_queries=0), "n_queries: expected an int >= 1, got 0"),
        (dict(query_chunk=0), "query_chunk: expected an int >= 1, got 0"),
        (dict(contexts=[65]), "q: 64 tokens; the longest context is 65"),
        (dict(q=np.zeros((64, 3, 16), np.float32)), "query heads a multiple of KV heads"),
        (dict(v=np.zeros((20, 2, 16), np.float32)), "v: 20 tokens; the longest context is 32"),
    ],
)
def test_evaluate_layer_names_a_bad_argument(change, message):
    """Raw errors before: top_k's "k must be nonnegative", "need at least one array to
    concatenate", range()'s zero step, a reshape TypeError, an einsum error."""
    rng = np.random.default_rng(0)
    args = dict(
        q=rng.standard_normal((64, 4, 16)).astype(np.float32),
        k=rng.standard_normal((64, 2, 16)).astype(np.float32),
        v=rng.standard_normal((64, 2, 16)).astype(np.float32),
        contexts=[32], budgets=[4], n_queries=8, query_chunk=4,
    )  # fmt: skip
    methods = protocol.default_methods([4], 16, ["oracle"])
    assert protocol.evaluate_layer(methods, {}, **args)  # the unchanged call runs
    with pytest.raises(ValueError, match=message):
        protocol.evaluate_layer(methods, {}, **{**args, **change})


@pytest.mark.parametrize(
    "calib, evaluated, want",
    [
        ((0, 600), 512, ["emma [0, 512)"]),  # the same tokens
        ((500, 600), 512, ["emma [500, 512)"]),  # 12 tokens shared
        ((512, 600), 512, []),  # adjacent: held out
        ((0, 600), 0, []),
    ],
)
def test_overlap_is_the_shared_tokens_not_the_novel(calib, evaluated, want):
    """The guard warned whenever the held-out novel was also calibrated on, wherever,
    and wrote nothing to the JSON; it now names the shared token range."""
    sequences = [{"novel": "emma", "offset": calib[0], "n_tokens": calib[1]},
                 {"novel": "persuasion", "offset": 0, "n_tokens": 10_000}]  # fmt: skip
    assert recall.overlapping_text(sequences, {"novel": "emma", "offset": 0}, evaluated) == want
