"""Orbax persistence of bases: bit-exact round trip and clear errors."""

import json

import numpy as np
import pytest

import jsparse
from jsparse.checkpoint import read_metadata

L, HKV, R, D = 3, 2, 4, 8


def _bases():
    rng = np.random.default_rng(0)
    basis = rng.standard_normal((L, HKV, R, D)).astype(np.float32)
    basis[0, 0, 0, 0] = np.float32(1e-38)  # a denormal-adjacent value survives exactly
    return {
        "basis": basis,
        "extra": {"channels": rng.integers(0, D, (L, HKV, R)).astype(np.int32)},
    }


def _meta(**over):
    meta = {
        "model": "test-model",
        "method": "jssa",
        "n_layers": L,
        "n_kv_heads": HKV,
        "head_dim": D,
        "rank": R,
        "calibration": {"data": ["synthetic"], "n_tokens": 1234},
    }
    meta.update(over)
    return meta


def test_round_trip_bit_exact(tmp_path):
    bases = _bases()
    path = jsparse.save_bases(tmp_path / "ckpt", bases, _meta())
    restored, meta = jsparse.load_bases(path, n_layers=L, n_kv_heads=HKV, head_dim=D, rank=R)
    for got, want in [
        (restored["basis"], bases["basis"]),
        (restored["extra"]["channels"], bases["extra"]["channels"]),
    ]:
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert meta["jsparse_version"] == jsparse.__version__
    assert meta["calibration"] == {"data": ["synthetic"], "n_tokens": 1234}
    assert meta["method"] == "jssa" and meta["rank"] == R


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        jsparse.load_bases(tmp_path / "absent")


def test_expectations_checked(tmp_path):
    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())
    with pytest.raises(ValueError, match="rank=4, expected 16"):
        jsparse.load_bases(path, rank=16)
    with pytest.raises(ValueError, match="n_kv_heads"):
        jsparse.load_bases(path, n_kv_heads=3)
    with pytest.raises(ValueError, match="method"):
        jsparse.load_bases(path, method="loki")


def test_save_refuses_inconsistent_shapes_and_existing_dirs(tmp_path):
    with pytest.raises(ValueError, match="rank, head_dim"):
        jsparse.save_bases(tmp_path / "a", _bases(), _meta(rank=8))
    with pytest.raises(ValueError, match="n_layers"):
        jsparse.save_bases(tmp_path / "b", _bases(), _meta(n_layers=30))
    with pytest.raises(ValueError, match="metadata lacks"):
        jsparse.save_bases(tmp_path / "c", _bases(), {"model": "x"})
    nan_basis = _bases()
    nan_basis["basis"][1, 0, 2, 3] = np.nan  # what calibrating on non-finite data under jit gives
    with pytest.raises(ValueError, match="basis has non-finite values"):
        jsparse.save_bases(tmp_path / "e", nan_basis, _meta())
    assert not (tmp_path / "e").exists()
    path = jsparse.save_bases(tmp_path / "d", _bases(), _meta())
    with pytest.raises(FileExistsError):
        jsparse.save_bases(path, _bases(), _meta())
    jsparse.save_bases(path, _bases(), _meta(model="again"), overwrite=True)
    assert read_metadata(path)["model"] == "again"


def test_overwrite_replaces_only_a_checkpoint(tmp_path):
    """overwrite=True must never delete a directory that is not a checkpoint (a wrong
    --out would take the user's files with it), nor a file."""
    other = tmp_path / "results"
    (other / "sub").mkdir(parents=True)
    (other / "important.txt").write_text("x")
    with pytest.raises(
        ValueError, match=r"holds \['important.txt', 'sub'\], so it is not a jsparse"
    ):
        jsparse.save_bases(other, _bases(), _meta(), overwrite=True)
    assert (other / "important.txt").read_text() == "x" and (other / "sub").is_dir()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("y")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        jsparse.save_bases(a_file, _bases(), _meta(), overwrite=True)
    assert a_file.read_text() == "y"
    with pytest.raises(ValueError, match="overwrite must be True or False, got 'no'"):
        jsparse.save_bases(tmp_path / "x", _bases(), _meta(), overwrite="no")
    incomplete = tmp_path / "incomplete"
    (incomplete / "arrays").mkdir(parents=True)  # a save cut before its metadata
    jsparse.save_bases(incomplete, _bases(), _meta(), overwrite=True)
    assert read_metadata(incomplete)["model"] == "test-model"


def test_save_refuses_what_would_not_load_back_and_writes_nothing(tmp_path):
    wide = _bases()
    wide["basis"] = wide["basis"].astype(np.float64)  # numpy's eigh gives float64
    with pytest.raises(ValueError, match="basis is float64; save 32-bit or narrower"):
        jsparse.save_bases(tmp_path / "f64", wide, _meta())
    assert not (tmp_path / "f64").exists()
    with pytest.raises(TypeError):
        jsparse.save_bases(tmp_path / "meta", _bases(), _meta(note=object()))
    assert not (tmp_path / "meta").exists()  # no partial directory blocks the next save
    jsparse.save_bases(tmp_path / "meta", _bases(), _meta())


def test_corrupt_metadata(tmp_path):
    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())
    meta_file = path / "metadata.json"
    meta_file.write_text(meta_file.read_text()[:40])
    with pytest.raises(ValueError, match="corrupt checkpoint metadata"):
        jsparse.load_bases(path)
    meta_file.unlink()
    with pytest.raises(ValueError, match="not a complete"):
        jsparse.load_bases(path)


def test_corrupt_arrays(tmp_path):
    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())
    data_files = [p for p in (path / "arrays").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for p in data_files:
        p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 2)])  # truncated
    with pytest.raises(ValueError, match="corrupt checkpoint"):
        jsparse.load_bases(path)


def test_tampered_values_fail_checksum(tmp_path):
    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())
    meta = json.loads((path / "metadata.json").read_text())
    meta["arrays"]["basis"]["sha256"] = "0" * 64
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="checksum"):
        jsparse.load_bases(path)


def test_a_failed_overwrite_keeps_the_checkpoint_it_would_replace(tmp_path, monkeypatch):
    """The new arrays are written beside the old checkpoint and moved in once complete:
    Orbax refusing them (once after the old one was already deleted) loses nothing."""
    import orbax.checkpoint as ocp

    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())

    def refuse(self, *args, **kwargs):
        raise ValueError("disk full")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", refuse)
    newer = _bases()
    newer["basis"] = newer["basis"] + 1
    with pytest.raises(ValueError, match="disk full"):
        jsparse.save_bases(path, newer, _meta(), overwrite=True)
    monkeypatch.undo()
    restored, _ = jsparse.load_bases(path)
    np.testing.assert_array_equal(restored["basis"], _bases()["basis"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left
    jsparse.save_bases(path, newer, _meta(), overwrite=True)
    np.testing.assert_array_equal(jsparse.load_bases(path)[0]["basis"], newer["basis"])


@pytest.mark.parametrize(
    "bases, message",
    [
        ({"a.b": 0, "a": {"b": 0}}, r"keys 'a\.b' and 'a/b' .* name one Orbax array"),
        ({"basis": 0, "extra": np.zeros((L, HKV, 0), np.int32)}, "extra is int32 of shape"),
        ({"basis": 0, "names": np.full((L, HKV), "x")}, "names is str32 of shape"),
        ({"extra": {}}, "bases hold no array"),
    ],
    ids=["orbax-name-collision", "zero-size", "strings", "only-empty-dicts"],
)
def test_save_refuses_what_orbax_cannot_store_before_touching_the_disk(tmp_path, bases, message):
    """Each once failed inside Orbax (after ``overwrite`` had deleted the old checkpoint)
    or, for colliding names, saved one array over another and never loaded."""
    basis = _bases()["basis"]
    bases = {k: (basis if isinstance(v, int) else v) for k, v in bases.items()}
    if "a" in bases:
        bases["a"] = {"b": basis + 1}
    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())
    with pytest.raises(ValueError, match=message):
        jsparse.save_bases(path, bases, _meta(), overwrite=True)
    np.testing.assert_array_equal(jsparse.load_bases(path)[0]["basis"], basis)


@pytest.mark.parametrize("arrays", [[1, 2], None, "x"])
def test_metadata_whose_arrays_is_not_a_dict_is_corrupt(tmp_path, arrays):
    path = jsparse.save_bases(tmp_path / "ckpt", _bases(), _meta())
    meta = json.loads((path / "metadata.json").read_text())
    meta["arrays"] = arrays
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="is not jsparse-bases/1 metadata"):
        jsparse.load_bases(path)
