"""Reading activation captures (post-RoPE q, k and v of a real model on real text).

A capture is a directory with ``meta.json`` (model, novel, token offset, ``n_tokens``,
``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``rope_theta``, dtype) and one
``layer_XX.npz`` per layer holding ``q`` f32 ``[T, H, D]``, ``k`` and ``v`` f32
``[T, Hkv, D]``. Token ``t`` of a capture is position ``t`` of a causal forward pass that
started at the capture's first token, so its first ``C`` tokens are exactly what a
``C``-token window would give.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["captured_layers", "read_layer", "read_meta"]

_META_KEYS = ("n_tokens", "n_layers", "n_heads", "n_kv_heads", "head_dim")


def read_meta(path: str | Path) -> dict:
    """``meta.json`` of a capture, checked for the fields the evaluation needs."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"not a capture directory (no meta.json): {path}")
    meta = json.loads(meta_file.read_text())
    missing = [key for key in _META_KEYS if key not in meta]
    if missing:
        raise ValueError(f"{meta_file}: missing field(s) {missing}")
    return meta


def captured_layers(meta: dict) -> list[int]:
    """The layers a capture holds: meta's ``layers`` (a capture may stop after some, or
    hold a chosen few), every one of ``n_layers`` for captures written without it."""
    return sorted(int(i) for i in meta.get("layers", range(meta["n_layers"])))


def read_layer(
    path: str | Path, layer: int, n_tokens: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, k, v)`` of one layer, optionally only the first ``n_tokens`` tokens (the
    file must hold that many). Every value must be finite: a NaN key ranks first in
    every exact top-k and would be scored as a fine recall."""
    file = Path(path) / f"layer_{layer:02d}.npz"
    if not file.is_file():
        raise FileNotFoundError(f"capture layer file not found: {file}")
    with np.load(file) as data:
        q, k, v = (np.asarray(data[name][:n_tokens], np.float32) for name in ("q", "k", "v"))
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"{file}: bad shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if n_tokens is not None and q.shape[0] < n_tokens:
        raise ValueError(
            f"{file}: holds {q.shape[0]} tokens, {n_tokens} asked for (meta.json's n_tokens?)"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        bad = np.flatnonzero(~np.isfinite(x).reshape(x.shape[0], -1).all(axis=1))
        if bad.size:
            raise ValueError(
                f"{file}: {name} is not finite at token {int(bad[0])} ({bad.size} tokens)"
            )
    return q, k, v
