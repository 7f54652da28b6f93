"""The recall and calibration CLIs run end to end on tiny synthetic captures."""

import importlib.util
import json
from pathlib import Path

import jax
import pytest

import jsparse
from jsparse.calibration.cli import main as calibrate_main
from jsparse.eval.synthetic import write_synthetic_capture

ROOT = Path(__file__).resolve().parents[2]


def _bench_recall():
    spec = importlib.util.spec_from_file_location("bench_recall", ROOT / "bench" / "recall.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recall_cli_synthetic(tmp_path):
    out = tmp_path / "r.json"
    args = ["--synthetic", "--ranks", "8", "--families", "jssa", "oracle", "quest"]
    args += ["--budgets", "16", "--layers", "0", "--json", str(out), "--no-progress"]
    assert _bench_recall().main(args) == 0
    data = json.loads(out.read_text())
    assert data["config"]["synthetic"] is True
    methods = {r["method"] for r in data["records"]}
    assert {"oracle", "jssa r8", "quest p32-bf16 r8"} <= methods
    assert all(r["method"] != "oracle" or r["oracle_recall"] == 1.0 for r in data["records"])
    assert data["environment"]["jax"] == jax.__version__


def test_calibration_cli_writes_checkpoint(tmp_path):
    caps = []
    for i in range(2):
        write_synthetic_capture(
            tmp_path / f"c{i}", jax.random.key(0), 96, n_layers=2, start=1000 * i
        )
        caps.append(str(tmp_path / f"c{i}"))
    out = tmp_path / "bases"
    args = ["--captures", *caps, "--rank", "8", "--out", str(out), "--chunk", "64", "--no-progress"]
    assert calibrate_main(args) == 0
    bases, meta = jsparse.load_bases(out, n_layers=2, n_kv_heads=3, head_dim=64, rank=8)
    assert bases["basis"].shape == (2, 3, 8, 64)
    assert meta["calibration"]["n_tokens"] == 192 and meta["method"] == "jssa"
    args = ["--captures", *caps, "--method", "fasa", "--rank", "8", "--out", str(tmp_path / "f")]
    assert calibrate_main([*args, "--max-tokens", "100", "--no-progress"]) == 0
    _, meta = jsparse.load_bases(tmp_path / "f", method="fasa")
    assert meta["calibration"]["n_tokens"] == 100


def test_calibration_cli_plans_jssa_rd(tmp_path):
    write_synthetic_capture(tmp_path / "c", jax.random.key(0), 128, n_layers=2)
    out = tmp_path / "rd"
    args = ["--captures", str(tmp_path / "c"), "--method", "jssa_rd", "--bytes", "8"]
    assert calibrate_main([*args, "--out", str(out), "--no-progress"]) == 0
    bases, meta = jsparse.load_bases(out, method="jssa_rd")
    assert meta["bytes_per_token"] <= 8
    assert bases["query_map"].shape == (2, 3, meta["rank"], 64)
    assert bases["key_offset"].shape == (2, 3, meta["rank"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "full"], "--method full: this selector has nothing to calibrate"),
        (["--method", "nope"], r"--method: got 'nope'; expected one of \["),
        (["--set", "foo"], r"--set: expected KEY=VALUE, got \['foo'\]"),
        (["--set", "rank=8"], "give the rank with --rank"),
        (["--set", "refine_steps=abc"], "refine_steps: expected an int >= 0, got 'abc'"),
        (["--method", "jssa_rd", "--set", "fp8_dims=2.5"], "fp8_dims must be an int, got 2.5"),
    ],
)  # fmt: skip
def test_calibration_cli_refuses_bad_flags_before_any_work(tmp_path, flags, message):
    out = tmp_path / "bases"
    with pytest.raises(SystemExit, match=message):
        calibrate_main(["--synthetic-tokens", "512", "--window", "512", "--out", str(out), *flags])
    assert not out.exists()
