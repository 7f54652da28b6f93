"""A numpy-only copy of the GGUF model, for machines without ``gguf`` or the text.

``python -m jsparse.assets export-pack DIR`` writes::

    DIR/manifest.json       format, config (every LlamaConfig field), source GGUF sha256,
                            tensor index
    DIR/weights_XX.npz      the GGUF's tensors as stored: raw Q4_1 / Q8_0 blocks (uint8)
                            and F32 norms, split into parts of at most --max-part-mib
    DIR/tokens.npz          token ids (uint16) of the six novels, tokenised as
                            :func:`jsparse.assets.novel_token_ids` does

Nothing is re-quantised: the pack holds the same bits as the GGUF minus its tokenizer
(≈ 96.6 MB of tensor data for SmolLM2-135M: Q4_1 layers 66.4 MB, Q8_0 embedding 30.1 MB,
F32 norms 0.1 MB) and dequantises with the ggml block formats below, bit-identical to
``gguf.quants.dequantize``. Put DIR at ``$JSPARSE_CACHE/pack`` and the model loaders
and :func:`jsparse.assets.novel_token_ids` use it when the GGUF is absent.

ggml block formats (32 weights per block, along a row):

* Q8_0, 34 bytes: float16 scale ``d``, 32 × int8 ``q``; ``w = q * d``.
* Q4_1, 20 bytes: float16 ``d``, float16 ``m``, 16 bytes of nibbles (low nibbles are
  weights 0..15, high nibbles 16..31); ``w = d * q + m``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jsparse import _checks
from jsparse.assets import file_sha256
from jsparse.models.llama import AttentionCore, Llama, LlamaConfig

__all__ = ["FORMAT", "dequantize", "export_pack", "load_pack", "pack_token_ids"]

FORMAT = "jsparse.pack/1"
_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}


def dequantize(
    raw: np.ndarray, kind: str, shape: tuple[int, ...], *, name: str = "dequantize"
) -> np.ndarray:
    """float32 ``shape`` from the stored bytes of one tensor (``kind`` as in ggml).

    ``raw`` must be what the GGUF stores for ``kind`` and ``shape``: float32 / float16
    values for F32 / F16, uint8 blocks otherwise; anything else is refused (``name`` in
    the message), since a converted or reinterpreted array loads silently wrong."""
    if kind not in ("F32", "F16", *_BLOCK_BYTES):
        raise ValueError(f"{name}: tensor type {kind!r} unsupported; have F32, F16, Q8_0, Q4_1")
    if not shape or any(not _checks.is_int(n) or n < 1 for n in shape):
        raise ValueError(f"{name}: shape {list(shape)}; expected positive ints")
    raw = np.asarray(raw)
    count = int(np.prod(shape))
    if kind in ("F32", "F16"):
        dtype = np.dtype(np.float32 if kind == "F32" else np.float16)
        expected = f"{count} {dtype.name} values"
        ok = raw.dtype == dtype and raw.size == count
    else:
        nbytes = count // 32 * _BLOCK_BYTES[kind]
        expected = f"{nbytes} uint8 bytes ({count // 32} blocks of {_BLOCK_BYTES[kind]})"
        ok = shape[-1] % 32 == 0 and raw.dtype == np.uint8 and raw.size == nbytes
        if shape[-1] % 32:
            expected = "a last dimension that is a multiple of the 32-weight block"
    if not ok:
        raise ValueError(
            f"{name}: {kind} {list(shape)} stored as {raw.size} {raw.dtype.name} values; "
            f"expected {expected}"
        )
    if kind == "F32":
        return raw.reshape(shape)
    if kind == "F16":
        return raw.astype(np.float32).reshape(shape)
    blocks = np.ascontiguousarray(raw).reshape(-1, _BLOCK_BYTES[kind])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    if kind == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        w = q * d
    else:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = blocks[:, 4:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)
        w = d * q + m
    return w.reshape(shape)


def export_pack(
    out_dir: str | os.PathLike,
    *,
    gguf_path: str | os.PathLike | None = None,
    max_part_bytes: int = 60 * 2**20,
    with_tokens: bool = True,
) -> list[Path]:
    """Writes the pack (see the module docstring); returns the files written."""
    from jsparse import assets
    from jsparse.models.gguf_loader import config_from_gguf, open_gguf

    gguf_path = assets.model_path() if gguf_path is None else Path(gguf_path)
    reader = open_gguf(gguf_path)
    config = config_from_gguf(reader, gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    parts: list[dict[str, np.ndarray]] = [{}]
    sizes = [0]
    index = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in ("F32", "F16", *_BLOCK_BYTES):
            raise ValueError(f"{gguf_path}: tensor {t.name} has type {kind}; unsupported")
        raw = np.asarray(t.data)
        if raw.nbytes > max_part_bytes:
            raise ValueError(f"{t.name} ({raw.nbytes} bytes) exceeds max_part_bytes")
        if sizes[-1] + raw.nbytes > max_part_bytes:
            parts.append({})
            sizes.append(0)
        parts[-1][t.name] = raw
        sizes[-1] += raw.nbytes
        index[t.name] = {
            "type": kind,
            "shape": [int(s) for s in t.shape[::-1]],
            "part": f"weights_{len(parts) - 1:02d}.npz",
        }
    files = []
    for i, part in enumerate(parts):
        path = out / f"weights_{i:02d}.npz"
        np.savez(path, **part)
        files.append(path)
    manifest = {
        "format": FORMAT,
        "config": config.to_dict(),
        "source": {"file": Path(gguf_path).name, "sha256": file_sha256(Path(gguf_path))},
        "tensors": index,
        "parts": [f.name for f in files],
    }
    if with_tokens:
        from jsparse.models.tokenizer import load_tokenizer

        tok = load_tokenizer(gguf_path)
        if config.vocab_size > np.iinfo(np.uint16).max + 1:
            raise ValueError("vocabulary too large for uint16 token ids")
        ids = {
            novel: np.asarray(tok.encode(assets.novel_text(novel)).ids, np.uint16)
            for novel in assets.NOVELS
        }
        np.savez(out / "tokens.npz", **ids)
        files.append(out / "tokens.npz")
        manifest["tokens"] = "tokens.npz"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    files.append(out / "manifest.json")
    return files


def _manifest(pack_dir: Path) -> dict:
    path = pack_dir / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{pack_dir}: not a model pack (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise ValueError(f"{path}: format {found!r}, expected {FORMAT!r}")
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise ValueError(f"{path}: 'parts' is {parts!r}; expected a list of file names")
    missing = [p for p in parts if not (pack_dir / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{pack_dir}: pack parts missing: {missing}")
    return manifest


def load_pack(
    pack_dir: str | os.PathLike, *, core: Callable[[int], AttentionCore] | None = None
) -> Llama:
    """The model from a pack directory (numpy only; no ``gguf`` needed)."""
    from jsparse.models.gguf_loader import model_from_tensors

    pack_dir = Path(pack_dir)
    manifest = _manifest(pack_dir)
    try:
        config = LlamaConfig.from_dict(manifest.get("config"))
    except ValueError as err:
        raise ValueError(f"{pack_dir / 'manifest.json'}: config: {err}") from None
    index = manifest.get("tensors")
    if not isinstance(index, dict):
        raise ValueError(f"{pack_dir / 'manifest.json'}: no 'tensors' index")
    tensors = {}
    for part in manifest["parts"]:
        path = pack_dir / part
        try:
            f = np.load(path)
        except Exception as err:  # a truncated or corrupted part: BadZipFile, EOFError ...
            raise ValueError(f"{path}: unreadable pack part ({type(err).__name__}: {err})") from err
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError(f"{path}: not an .npz archive of tensors")
        with f:
            for name in f.files:
                entry = index.get(name)
                if not isinstance(entry, dict) or entry.get("part") != part:
                    where = "missing from" if entry is None else f"listed as {entry!r} in"
                    raise ValueError(f"{path}: tensor {name} is {where} the manifest's index")
                try:
                    raw = f[name]
                except Exception as err:  # a corrupted member
                    raise ValueError(
                        f"{path}: tensor {name} is unreadable ({type(err).__name__}: {err})"
                    ) from err
                tensors[name] = dequantize(
                    raw,
                    entry.get("type"),
                    tuple(entry.get("shape") or ()),
                    name=f"{path}: tensor {name}",
                )
    listed = sorted(set(index) - set(tensors))
    if listed:
        raise ValueError(f"{pack_dir}: tensors in the manifest but in no part: {listed[:8]}")
    return model_from_tensors(config, tensors, core=core, source=str(pack_dir))


def pack_token_ids(pack_dir: str | os.PathLike, novel: str) -> np.ndarray:
    """int32 token ids of a novel stored in a pack."""
    pack_dir = Path(pack_dir)
    manifest = _manifest(pack_dir)
    if "tokens" not in manifest:
        raise FileNotFoundError(f"{pack_dir}: the pack holds no token ids")
    with np.load(pack_dir / manifest["tokens"]) as f:
        return f[novel].astype(np.int32)
