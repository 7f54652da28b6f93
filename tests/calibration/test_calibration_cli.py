"""`python -m jsparse.calibration` refuses bad flags by name before any work.

(Not test_cli.py: tests/eval has one, and these folders are not packages.)
"""

import jax
import pytest

from jsparse.calibration import cli, stream
from jsparse.eval.synthetic import write_synthetic_capture


@pytest.fixture
def no_work(monkeypatch):
    """Calibration that fails the test if it starts: every refusal comes before it."""

    def work(*args, **kwargs):
        raise AssertionError("started calibrating before refusing the flags")

    monkeypatch.setattr(stream, "moments_from_captures", work)
    monkeypatch.setattr(cli, "_synthetic_moments", work)


@pytest.fixture
def capture(tmp_path):
    write_synthetic_capture(tmp_path / "c", jax.random.key(0), 32, n_layers=1)  # head_dim 64
    return str(tmp_path / "c")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--synthetic-tokens", "64", "--window", "0"], "argument --window: expected an int >= 1"),
        (["--synthetic-tokens", "0"], "argument --synthetic-tokens: expected an int >= 1, got '0'"),
        (["--captures", "c", "--max-tokens", "-5"], "argument --max-tokens: expected an int >= 1"),
        (["--captures", "c", "--chunk", "0"], "argument --chunk: expected an int >= 1, got '0'"),
        (["--captures", "c", "--rank", "0"], "argument --rank: expected an int >= 1, got '0'"),
        (["--captures", "c", "--bytes", "0.25"], "--bytes: expected a number of bytes"),
        (["--captures", "c", "--bytes", "nan"], "--bytes: expected a number of bytes"),
    ],
)  # fmt: skip
def test_sizes_must_be_positive(flags, message, tmp_path, capsys, no_work):
    """--window 0 divided by zero; 0 or fewer tokens failed after the data was read."""
    with pytest.raises(SystemExit):
        cli.main([*flags, "--out", str(tmp_path / "out"), "--no-progress"])
    assert message in capsys.readouterr().err


def test_an_existing_out_is_refused_before_the_calibration(tmp_path, capture, no_work):
    """It was refused by save_bases, after all the work."""
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match=r"--out: .*out exists; pass --overwrite to replace it"):
        cli.main(["--captures", capture, "--out", str(tmp_path / "out"), "--no-progress"])


@pytest.mark.parametrize("where", ["file/x.json", "dir"])
def test_an_unwritable_json_is_refused_before_the_calibration(where, tmp_path, capture, no_work):
    """It failed after the checkpoint was written."""
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    out = tmp_path / "out"
    with pytest.raises(
        SystemExit, match=r"--json: cannot write .*: .*(not a directory|it is a dir)"
    ):
        cli.main(["--captures", capture, "--out", str(out), "--json", str(tmp_path / where)])
    assert not out.exists()


@pytest.mark.parametrize("source", ["captures", "synthetic"])
def test_a_rank_beyond_the_head_dim_is_refused_naming_it(source, tmp_path, capture, no_work):
    """--rank 100 at head_dim 64 failed in the eigenbasis fit, after the moments."""
    data = ["--captures", capture] if source == "captures" else ["--synthetic-tokens", "64"]
    with pytest.raises(SystemExit, match="--rank: got 100; expected at most head_dim = 64"):
        cli.main([*data, "--rank", "100", "--out", str(tmp_path / "out"), "--no-progress"])


def test_a_directory_that_is_not_a_capture_is_refused_naming_the_flag(tmp_path, no_work):
    with pytest.raises(SystemExit, match=r"--captures: not a capture directory \(no meta.json\)"):
        cli.main(["--captures", str(tmp_path), "--out", str(tmp_path / "out"), "--no-progress"])
