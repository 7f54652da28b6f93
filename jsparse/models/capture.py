"""Activation capture: per-layer post-RoPE queries, keys and values of a real text.

Capture directory format (``jsparse.capture/1``; calibration and recall code read it)::

    <dir>/meta.json       model, novel, offset, n_tokens, n_layers, n_heads, n_kv_heads,
                          head_dim, rope_theta, dtype, plus: format, layers (captured
                          layer indices), first_position, rope
    <dir>/layer_XX.npz    one per captured layer (XX = 00 .. 29), arrays
                          q float32 [T, H, D]    post-RoPE
                          k float32 [T, Hkv, D]  post-RoPE
                          v float32 [T, Hkv, D]
    <dir>/tokens.npy      int32 [T], the token ids that were run

Token i of the capture sat at position ``first_position + i`` (0 + i: the window is run
from a fresh context, whatever its ``offset`` in the novel), and q / k were rotated with
that position (rotate-half RoPE, base ``rope_theta``). Query head h reads KV head
``h // (n_heads // n_kv_heads)``.

Capture streams: the model runs one layer at a time (one compiled block reused for
every layer), each layer's q / k / v go to host memory and to disk before the next
layer runs, and attention scores are never kept, so 8K tokens fit a small CPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jsparse import backend
from jsparse.models.llama import Llama

__all__ = [
    "FORMAT",
    "Capture",
    "capture_meta",
    "capture_qkv",
    "capture_text",
    "iter_capture",
    "load_capture",
    "save_capture",
]

FORMAT = "jsparse.capture/1"
META_KEYS = (
    "model",
    "novel",
    "offset",
    "n_tokens",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "rope_theta",
    "dtype",
)


@dataclasses.dataclass
class Capture:
    """A loaded capture: ``meta`` (meta.json) and ``layers[i] = {"q", "k", "v"}``."""

    meta: dict[str, Any]
    layers: dict[int, dict[str, np.ndarray]]
    tokens: np.ndarray | None = None


@backend.jit_per_mode(static_argnums=0)
def _block_step(graphdef, state, x, positions):
    return nnx.merge(graphdef, state).forward_with_qkv(x, positions)


@jax.jit
def _embed(table, tokens):
    return jnp.take(table, tokens, axis=0)


def capture_qkv(
    model: Llama,
    token_ids,
    *,
    layers: Sequence[int] | None = None,
    attention_input: bool = False,
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Yields ``(layer, {"q": [T, H, D], "k": [T, Hkv, D], "v": [T, Hkv, D]})``, and
    with ``attention_input`` also ``"x"`` [T, C]: the layer's normalised hidden states,
    what its attention (or an indexer beside it) reads.

    ``token_ids``: int [T], one sequence run from position 0. Layers are computed in
    order and only up to the last one asked for; ``layers=None`` means all. Each yield
    hands over float32 numpy arrays; nothing of earlier layers is kept here.
    """
    c = model.config
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids: expected a non-empty int vector [T], got {ids.shape}")
    if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"token_ids: ids must lie in [0, {c.vocab_size})")
    wanted = sorted(set(range(c.n_layers) if layers is None else layers))
    if wanted and (wanted[0] < 0 or wanted[-1] >= c.n_layers):
        raise ValueError(f"layers: got {list(layers)}; the model has layers 0..{c.n_layers - 1}")

    tokens = jnp.asarray(ids[None], jnp.int32)
    positions = jnp.arange(ids.size, dtype=jnp.int32)[None]
    x = _embed(model.embed[...], tokens)
    wanted_set = set(wanted)
    for i in range(wanted[-1] + 1 if wanted else 0):
        block = model.layers[i]
        arrays = {}
        if attention_input and i in wanted_set:
            arrays["x"] = np.asarray(block.attn_norm(x)[0])
        graphdef, state = nnx.split(block)
        x, (q, k, v) = _block_step(graphdef, state, x, positions)
        if i in wanted_set:
            yield i, arrays | {"q": np.asarray(q[0]), "k": np.asarray(k[0]), "v": np.asarray(v[0])}


def capture_meta(model: Llama, *, novel: str, offset: int, n_tokens: int, layers) -> dict:
    c = model.config
    return {
        "format": FORMAT,
        "model": c.name,
        "novel": novel,
        "offset": int(offset),
        "n_tokens": int(n_tokens),
        "n_layers": c.n_layers,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "rope_theta": float(c.rope_theta),
        "dtype": "float32",
        "layers": sorted(int(i) for i in layers),
        "first_position": 0,
        "rope": "rotate-half",
    }


def _layer_file(path: Path, layer: int) -> Path:
    return path / f"layer_{layer:02d}.npz"


def save_capture(
    path: str | os.PathLike,
    captures: Iterable[tuple[int, dict[str, np.ndarray]]],
    *,
    meta: dict[str, Any],
    tokens=None,
) -> Path:
    """Writes a capture directory, one layer file as each layer arrives.

    ``captures`` is what :func:`capture_qkv` yields (or any ``(layer, arrays)`` pairs);
    ``meta`` needs at least the keys of ``META_KEYS``. meta.json is written last, so a
    directory with a meta.json is complete.
    """
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"meta: missing keys {missing}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").unlink(missing_ok=True)
    written = []
    for layer, arrays in captures:
        for name, shape in (
            ("q", (meta["n_tokens"], meta["n_heads"], meta["head_dim"])),
            ("k", (meta["n_tokens"], meta["n_kv_heads"], meta["head_dim"])),
            ("v", (meta["n_tokens"], meta["n_kv_heads"], None)),
        ):
            a = arrays[name]
            if a.ndim != 3 or any(e not in (None, s) for e, s in zip(shape, a.shape, strict=True)):
                raise ValueError(f"layer {layer}: {name} has shape {a.shape}, expected {shape}")
        np.savez(
            _layer_file(path, layer),
            **{n: np.asarray(arrays[n], np.float32) for n in ("q", "k", "v")},
        )
        written.append(int(layer))
    if tokens is not None:
        np.save(path / "tokens.npy", np.asarray(tokens, np.int32))
    meta = {**meta, "layers": sorted(written)}
    (path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def _read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a capture directory (no meta.json)")
    return json.loads(meta_file.read_text())


def iter_capture(
    path: str | os.PathLike, layers: Sequence[int] | None = None
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Yields ``(layer, {"q", "k", "v"})`` one layer at a time, reading lazily."""
    path = Path(path)
    meta = _read_meta(path)
    available = meta.get("layers", list(range(meta["n_layers"])))
    chosen = available if layers is None else list(layers)
    absent = sorted(set(chosen) - set(available))
    if absent:
        raise ValueError(f"{path}: layers {absent} were not captured (have {available})")
    for layer in chosen:
        with np.load(_layer_file(path, layer)) as f:
            yield layer, {n: f[n] for n in ("q", "k", "v")}


def load_capture(path: str | os.PathLike, layers: Sequence[int] | None = None) -> Capture:
    """All (or the chosen) layers of a capture directory in memory."""
    path = Path(path)
    tokens_file = path / "tokens.npy"
    return Capture(
        meta=_read_meta(path),
        layers=dict(iter_capture(path, layers)),
        tokens=np.load(tokens_file) if tokens_file.is_file() else None,
    )


def capture_text(
    novel: str,
    offset: int,
    n_tokens: int,
    out_dir: str | os.PathLike,
    *,
    layers: Sequence[int] | None = None,
    model: Llama | None = None,
    progress: bool = True,
) -> Path:
    """Captures ``n_tokens`` tokens of an Austen novel from token ``offset`` into ``out_dir``.

    Loads the cached model when ``model`` is None; see :mod:`jsparse.assets` for the
    novels (:data:`jsparse.assets.CALIBRATION_NOVELS` / ``EVALUATION_NOVELS``).
    """
    from jsparse import assets
    from jsparse.models.gguf_loader import load_model

    ids = assets.novel_token_ids(novel, offset, n_tokens)
    model = load_model() if model is None else model
    chosen = list(range(model.config.n_layers)) if layers is None else list(layers)
    stream = capture_qkv(model, ids, layers=chosen)
    if progress:
        from tqdm.auto import tqdm

        stream = tqdm(stream, total=len(chosen), desc=f"capture {novel}", unit="layer")
    meta = capture_meta(model, novel=novel, offset=offset, n_tokens=len(ids), layers=chosen)
    return save_capture(out_dir, stream, meta=meta, tokens=ids)
