"""Bench flags: `--widen-fp8-from` parsed, applied and written to JSON; per-op help."""

import argparse
import importlib
import json
import re

import pytest

from bench import common, indexer


def test_widen_flag_parses_counts_and_never_and_rejects_the_rest(tmp_path):
    parser = argparse.ArgumentParser()
    indexer.add_arguments(parser)
    assert parser.parse_args([]).widen_fp8_from is None  # the library's default
    never = parser.parse_args(["--widen-fp8-from", "never"]).widen_fp8_from
    assert common.widen_setting(never) is None
    assert common.widen_setting(parser.parse_args(["--widen-fp8-from", "16"]).widen_fp8_from) == 16
    for bad in ("0", "-3", "sometimes"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--widen-fp8-from", bad])
    # The run's arguments go into its JSON (run 48 failed there once).
    out = tmp_path / "args.json"
    common.write_json(str(out), {"args": vars(parser.parse_args(["--widen-fp8-from", "never"]))})
    assert json.loads(out.read_text())["args"]["widen_fp8_from"] == "never"


def test_widen_flag_sets_the_scorer_only_when_given(monkeypatch):
    from jsparse.ops.indexer import triton as scorer

    parser = argparse.ArgumentParser()
    common.add_widen_argument(parser)
    monkeypatch.setattr(scorer, "WIDEN_FP8_IN_MEMORY_FROM", 16)
    common.apply_widen_argument(parser.parse_args([]))
    assert scorer.WIDEN_FP8_IN_MEMORY_FROM == 16  # the library's default stays
    common.apply_widen_argument(parser.parse_args(["--widen-fp8-from", "never"]))
    assert scorer.WIDEN_FP8_IN_MEMORY_FROM is None
    common.apply_widen_argument(parser.parse_args(["--widen-fp8-from", "64"]))
    assert scorer.WIDEN_FP8_IN_MEMORY_FROM == 64


def test_op_help_lists_the_ops_own_flags(capsys):
    from bench.run import main

    with pytest.raises(SystemExit):
        main(["--op", "indexer", "--help"])
    assert "--widen-fp8-from" in capsys.readouterr().out


def test_set_flag_sets_module_constants_and_rejects_the_rest(monkeypatch):
    from bench import run
    from jsparse.ops.topk import triton as select

    monkeypatch.setattr(select, "BLOCK_RANK_MIN_ROWS", select.BLOCK_RANK_MIN_ROWS)
    rest, applied = run.apply_settings(
        ["--op", "indexer", "--set", "jsparse.ops.topk.triton.BLOCK_RANK_MIN_ROWS=8", "--quiet"]
    )
    assert rest == ["--op", "indexer", "--quiet"]
    assert applied == ["jsparse.ops.topk.triton.BLOCK_RANK_MIN_ROWS=8"]
    assert select.BLOCK_RANK_MIN_ROWS == 8
    run.apply_settings(["--set=jsparse.ops.topk.triton.BLOCK_RANK_MIN_ROWS=16"])
    assert select.BLOCK_RANK_MIN_ROWS == 16
    name = "jsparse.ops.topk.triton.BLOCK_RANK_MIN_ROWS"
    for bad in ("jsparse.ops.topk.triton.NO_SUCH=1", "BLOCK_RANK_MIN_ROWS=8", name, name + "=a b"):
        with pytest.raises(SystemExit):
            run.apply_settings(["--set", bad])
    assert select.BLOCK_RANK_MIN_ROWS == 16


def test_an_unknown_preset_names_the_ones_there_are(capsys):
    from bench.run import main

    with pytest.raises(SystemExit):
        main(["--op", "attention", "--preset", "no-such"])
    err = capsys.readouterr().err
    assert "--preset 'no-such': configs/attention.toml has decode, gpu-smoke" in err


@pytest.mark.parametrize(
    "op", ["attention", "decode-step", "dsa-step", "indexer", "indexer-grad", "mla", "mla-step",
           "topk"],
)  # fmt: skip
def test_an_unknown_method_stops_the_run_before_any_work(op, monkeypatch):
    """The indexer once printed error rows and exited 0; the other ops stopped only when
    the method was dispatched, after the floors were measured and inputs built."""
    from bench import common
    from bench.run import main

    def no_work(*args, **kwargs):
        raise AssertionError("measured floors before refusing the method")

    monkeypatch.setattr(common, "measure_floors", no_work)
    with pytest.raises(SystemExit, match=rf"--op {op} has methods .*, not \['nope'\]"):
        main(["--op", op, "--method", "xla", "nope", "--quiet"])


def test_timing_budget_and_recall_flags_are_checked_by_the_parser(capsys):
    from bench import recall
    from bench.run import main

    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            main(["--op", "indexer", "--budget", bad])
        assert "expected a positive number of seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recall._parser().parse_args(["--synthetic", "--budgets", "0"])
    assert "expected an int >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recall._parser().parse_args(["--synthetic", "--families", "jssa", "lokii"])
    assert "--families: invalid choice: 'lokii'" in capsys.readouterr().err


def test_op_with_an_equals_sign_forwards_to_the_ops_own_command_line(capsys):
    """`--op=dosa` was not forwarded: the parser's choices took it, then KeyError 'dosa'."""
    from bench import run

    assert run._cli_op(["--quiet", "--op=dosa", "--smoke"]) == ("dosa", ["--quiet", "--smoke"])
    assert run._cli_op(["--op", "recall", "--synthetic"]) == ("recall", ["--synthetic"])
    assert run._cli_op(["--op=indexer"]) is None
    with pytest.raises(SystemExit):  # bench/recall.py's own parser answers
        run.main(["--op=recall", "--report", "/no/such/report.json"])
    assert "--report: no such file /no/such/report.json" in capsys.readouterr().err


def test_set_names_a_module_that_does_not_exist():
    from bench import run

    with pytest.raises(SystemExit, match=r"--set: no module jsparse\.nomod"):
        run.apply_settings(["--set", "jsparse.nomod.X=1"])


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--check-rows", "0", "expected an int >= 1, got '0'"),
        ("--check-rows", "x", "expected an int >= 1, got 'x'"),
        ("--scorer-config", "1,2", "got '1,2'; expected 4 integers block_t,block_s,"),
        ("--scorer-config", "a,b,c,d", "got 'a,b,c,d'; expected 4 integers"),
        ("--scorer-config", "3,128,8,2", "got '3,128,8,2': ScorerConfig.block_t must be a power"),
    ],
)  # fmt: skip
def test_indexer_flags_are_checked_by_the_parser(flag, value, message, capsys):
    """--check-rows 0 ran the case and failed inside the check; a bad --scorer-config
    failed unpacking or in int() once the run started."""
    parser = argparse.ArgumentParser()
    indexer.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err
    assert indexer._scorer_config(parser.parse_args([]).scorer_config) is None
    cfg = indexer._scorer_config(parser.parse_args(["--scorer-config", "2,64,4,3"]).scorer_config)
    assert (cfg.block_t, cfg.block_s, cfg.num_warps, cfg.num_stages) == (2, 64, 4, 3)


@pytest.mark.parametrize(
    "value, message",
    [
        ("a,b,c,d,e,f", "got 'a,b,c,d,e,f'; expected 6 integers block_t,block_s,head_groups,"),
        ("1,2,3", "got '1,2,3'; expected 6 integers"),
        ("16,16,2,4,2,1;8,16,2,4,2,1", "got '8,16,2,4,2,1': BackwardConfig.block_t must be ≥ 16"),
    ],
)  # fmt: skip
def test_backward_config_is_checked_by_the_parser(value, message, capsys):
    from bench import indexer_grad

    parser = argparse.ArgumentParser()
    indexer_grad.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--backward-config", value])
    assert f"argument --backward-config: {message}" in capsys.readouterr().err
    good = parser.parse_args(["--backward-config", "16,32,4,4,3,2"]).backward_config
    assert indexer_grad.backward_configs(good)[0].block_s == 32


def _no_floors(monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("measured floors before refusing the run")

    monkeypatch.setattr(common, "measure_floors", no_work)


@pytest.mark.parametrize("where", ["file/x.json", "dir"])
def test_an_unwritable_json_stops_the_run_before_any_work(where, tmp_path, monkeypatch):
    """--json under a file (or naming a directory) failed in write_json, after the run."""
    from bench.run import main

    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    _no_floors(monkeypatch)
    with pytest.raises(SystemExit, match=re.escape(f"--json: cannot write {tmp_path / where}: ")):
        main(["--op", "topk", "--quiet", "--json", str(tmp_path / where)])
    common.check_writable("--json", str(tmp_path / "new" / "x.json"))  # the parent is made
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "x.json").exists()


@pytest.mark.parametrize(
    "method, status, code",
    [
        ("base", "ok", 0),
        ("base", "CHECK FAILED: ids differ", 1),
        ("base", "error: ValueError: no", 1),
        ("base", "out of memory: XlaRuntimeError: RESOURCE_EXHAUSTED", 1),
        ("xla", "out of memory: XlaRuntimeError: RESOURCE_EXHAUSTED", 0),  # the naive baseline
        ("xla", "error: ValueError: no", 1),
        ("base", "does not fit this device: XlaRuntimeError: RESOURCE_EXHAUSTED", 0),
    ],
)
def test_any_row_that_is_not_ok_fails_the_run(method, status, code, monkeypatch):
    """A row whose method raised ("error: ...") exited 0: only CHECK rows counted. Only
    the naive baseline may run out of memory (the targets hold where it fits), and a
    case too large to build on this device runs no method at all."""
    from bench import topk
    from bench.run import main

    monkeypatch.setattr(common, "measure_floors", lambda *a, **k: common.Floors(1.0, {}))
    other = "base" if method == "xla" else "xla"
    rows = [dict(case="c", method=other, status="ok"), dict(case="c", method=method, status=status)]
    monkeypatch.setattr(topk, "run", lambda *a: rows)
    assert main(["--op", "topk", "--quiet", "--backend", "xla"]) == code


def _write_presets(tmp_path, monkeypatch, op, text):
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / f"{op}.toml").write_text(text)
    monkeypatch.setattr(common, "ROOT", tmp_path)


@pytest.mark.parametrize(
    "op, case, message",
    [
        ("indexer", 't = 4, s = 64, h = 2, d = 8, top_k = 8, dtype = "fp16", ranges = "all"',
         "dtype='fp16': expected one of bf16, fp8, f32"),
        ("indexer", 't = 128, s = 64, h = 2, d = 8, top_k = 8, dtype = "bf16", ranges = "causal"',
         "t=128: expected at most s=64"),
        ("indexer", 't = 4, s = 64, h = 2, d = 8, top_k = 0, dtype = "bf16", ranges = "all"',
         "top_k=0: expected a positive int"),
        ("indexer", 't = 4, s = 64, h = 2, d = 8, top_k = 8, dtype = "bf16", ranges = "some"',
         "ranges='some': expected one of all, causal, batch"),
        ("attention", 'b = 2, s = 64, h = 8, hkv = 2, d = 8, budget = [16, 0], dtype = "bf16"',
         "budget=0: expected a positive int"),
        ("attention", 'b = 2, s = 64, h = 8, hkv = 2, d = 8, budget = 128, dtype = "bf16"',
         "budget=128: expected at most s=64"),
        ("attention", 'b = 2, s = 64, h = 6, hkv = 4, d = 8, budget = 16, dtype = "bf16"',
         "h=6: expected a multiple of hkv=4"),
        ("attention", 'b = 2, s = 64, h = 8, hkv = 2, d = 8, budget = 16, dtype = "fp8", page = 24',
         "page=24: expected a divisor of s=64"),
        ("decode-step", 'b = 2, s = 64, h = 8, hkv = 2, d = 8, rank = 16, budget = 16',
         "rank=16: expected at most d=8"),
        ("attention", 'b = 2, s = 64, h = 8, hkv = 2, d = 8, budget = 16, dtype = "f32"',
         "dtype='f32': expected one of bf16, fp8"),  # the op's own list (bench.attention)
    ],
)  # fmt: skip
def test_a_bad_preset_field_is_named_before_any_work(op, case, message, tmp_path, monkeypatch):
    """A preset with dtype fp16 gave KeyError 'fp16' in measure_floors; the others a
    shape error or a wrong answer deep in a case."""
    from bench.run import main

    _write_presets(tmp_path, monkeypatch, op, f"[bad]\ncases = [{{ {case} }}]\n")
    _no_floors(monkeypatch)
    with pytest.raises(SystemExit, match=rf"configs/{op}.toml: preset bad: {message}"):
        main(["--op", op, "--preset", "bad", "--quiet", "--backend", "xla"])


def test_every_shipped_preset_passes_the_preset_check():
    from bench import run

    for op in run.OPS:
        for name, preset in common.load_presets(op).items():
            module = importlib.import_module(run.OPS[op])
            common.check_preset(op, name, preset, getattr(module, "DTYPES", common.DTYPE_NAMES))


def test_recall_flags_are_checked_before_the_run(capsys, monkeypatch):
    """--query-chunk 0 failed in range(), --calib-tokens -1 after reading every capture,
    --layers -1 or past the captures' at the layer's file after the calibration."""
    from bench import recall

    for flag, value in (("--query-chunk", "0"), ("--calib-tokens", "-1"), ("--layers", "-1")):
        with pytest.raises(SystemExit):
            recall._parser().parse_args(["--synthetic", flag, value])
        assert f"argument {flag}: expected" in capsys.readouterr().err

    def no_work(*args, **kwargs):
        raise AssertionError("calibrated before refusing --layers")

    monkeypatch.setattr(recall, "moments_from_captures", no_work)
    with pytest.raises(SystemExit):
        recall.main(["--synthetic", "--layers", "0", "7", "--no-progress"])
    assert "--layers: [7]; the captures all hold layers [0, 1]" in capsys.readouterr().err


def test_recall_runs_the_layers_every_capture_holds(tmp_path, capsys, monkeypatch):
    """The default was ``range(n_layers)`` of the evaluation capture, so a capture that
    stopped after some layers (meta ``layers``) failed at the first missing file, after
    the calibration. Now the default is the layers every capture holds."""
    import json

    import jax

    from bench import recall
    from jsparse.eval.synthetic import write_synthetic_capture

    for name in ("calib", "eval"):
        write_synthetic_capture(tmp_path / name, jax.random.PRNGKey(0), 64, n_layers=3)
    meta_file = tmp_path / "eval" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "layers": [0, 2]}))  # layer 1 not captured
    (tmp_path / "eval" / "layer_01.npz").unlink()
    chosen = []

    def stop(calib, *, layers, **kwargs):
        chosen.append(layers)
        raise KeyboardInterrupt  # past the argument checks: enough

    monkeypatch.setattr(recall, "moments_from_captures", stop)
    argv = ["--calib", str(tmp_path / "calib"), "--eval", str(tmp_path / "eval"), "--no-progress",
            "--contexts", "32"]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        recall.main(argv)
    assert chosen == [[0, 2]]
    with pytest.raises(SystemExit):
        recall.main([*argv, "--layers", "1"])
    assert "--layers: [1]; the captures all hold layers [0, 2]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "message, kind",
    [("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB", "out of memory"), ("bad", "error")],
)
def test_a_method_that_raises_is_reported_by_kind(message, kind):
    def fails(_):
        raise RuntimeError(message)

    row = dict(case="c", method="xla")
    common.check_then_time(row, fails, [None], lambda r: [], budget_s=0.1, device_time=False,
                           nbytes=1.0, floor_s=1.0)  # fmt: skip
    assert row["status"] == f"{kind}: RuntimeError: {message}"


def test_json_is_strict(tmp_path):
    """NaN (a floor the device could not measure) was written as the non-JSON NaN."""
    import json

    import numpy as np

    out = tmp_path / "r.json"
    common.write_json(str(out), {"floor": float("nan"), "ms": np.float32(1.5), "at": tmp_path})
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(c)) == {
        "floor": None, "ms": 1.5, "at": str(tmp_path),
    }  # fmt: skip


def test_topk_check_rows_is_checked_by_the_parser(capsys):
    """--check-rows 0 ran the selection and failed inside the check (as the indexer's)."""
    from bench import topk

    parser = argparse.ArgumentParser()
    topk.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--check-rows", "0"])
    assert "argument --check-rows: expected an int >= 1, got '0'" in capsys.readouterr().err
