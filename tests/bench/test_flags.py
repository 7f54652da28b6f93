"""Bench flags: `--widen-fp8-from` parsed, applied and written to JSON; per-op help."""

import argparse
import json

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
    assert "expected an int >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recall._parser().parse_args(["--synthetic", "--families", "jssa", "lokii"])
    assert "--families: invalid choice: 'lokii'" in capsys.readouterr().err
