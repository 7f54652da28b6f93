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
