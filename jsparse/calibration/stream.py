"""Streaming calibration over activation captures, one (sequence, layer) at a time.

Memory stays at one layer of one sequence: each capture's layer file is read, cut into
fixed-size chunks (the last one padded and masked, so one compilation serves all) and
added to that layer's accumulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jsparse import _checks
from jsparse.calibration.moments import Moments, finalize_moments, init_moments, update_moments
from jsparse.eval.captures import captured_layers, read_layer, read_meta

__all__ = ["moments_from_captures", "stack_moments"]


def _chunks(q: np.ndarray, k: np.ndarray, chunk: int):
    n = q.shape[0]
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        mask = np.zeros(chunk, bool)
        mask[: stop - start] = True
        pad = chunk - (stop - start)
        qc = np.pad(q[start:stop], ((0, pad), (0, 0), (0, 0)))
        kc = np.pad(k[start:stop], ((0, pad), (0, 0), (0, 0)))
        yield qc, kc, mask


def moments_from_captures(
    dirs: Sequence[str | Path],
    *,
    layers: Sequence[int] | None = None,
    max_tokens: int | None = None,
    chunk: int = 4096,
    progress: bool = True,
) -> tuple[list[Moments], dict]:
    """Per-layer :class:`Moments` over the capture directories ``dirs``.

    ``max_tokens`` caps the total number of calibration tokens (taken in ``dirs`` order,
    each capture from its start). Returns the moments (one per requested layer) and a
    description of the data for checkpoint metadata.
    """
    from tqdm.auto import tqdm

    if not dirs:
        raise ValueError("moments_from_captures: no calibration capture given")
    chunk = _checks.check_int("chunk", chunk, 1)
    metas = [read_meta(d) for d in dirs]
    first = metas[0]
    shape_keys = ("n_layers", "n_heads", "n_kv_heads", "head_dim")
    for d, meta in zip(dirs, metas, strict=True):
        if any(meta[key] != first[key] for key in shape_keys):
            raise ValueError(
                f"capture {d} has shapes { {k: meta[k] for k in shape_keys} }, "
                f"unlike {dirs[0]}: { {k: first[k] for k in shape_keys} }"
            )
    layers = list(range(first["n_layers"])) if layers is None else list(layers)
    for d, meta in zip(dirs, metas, strict=True):  # before any is read, not at its file
        absent = sorted(set(layers) - set(captured_layers(meta)))
        if absent:
            raise ValueError(
                f"layers: capture {d} does not hold layers {absent} (it has "
                f"{captured_layers(meta)} of {meta['n_layers']})"
            )
    states = {layer: init_moments(first["n_kv_heads"], first["head_dim"]) for layer in layers}
    used, remaining = [], max_tokens
    bar = tqdm(
        total=len(dirs) * len(layers), desc="calibration", unit="layer", disable=not progress
    )
    for d, meta in zip(dirs, metas, strict=True):
        n = meta["n_tokens"] if remaining is None else min(meta["n_tokens"], remaining)
        if n <= 0:
            break
        for layer in layers:
            q, k, _ = read_layer(d, layer, n)
            for qc, kc, mask in _chunks(q, k, chunk):
                states[layer] = update_moments(states[layer], qc, kc, mask)
            bar.update()
        used.append(
            {key: meta.get(key) for key in ("novel", "offset")} | {"n_tokens": n, "path": str(d)}
        )
        if remaining is not None:
            remaining -= n
    bar.close()
    info = {
        "model": first.get("model"),
        "sequences": used,
        "n_tokens": int(sum(u["n_tokens"] for u in used)),
        **{key: first[key] for key in shape_keys},
    }
    return [finalize_moments(states[layer]) for layer in layers], info


def stack_moments(per_layer: Sequence[Moments]) -> Moments:
    """One :class:`Moments` with a leading layer axis."""
    return Moments(
        *(np.stack([np.asarray(getattr(m, f)) for m in per_layer]) for f in Moments._fields)
    )
