"""Orbax persistence of calibrated bases (one method, all layers of a model).

A checkpoint is a directory::

    PATH/arrays/         Orbax StandardCheckpointer: the pytree of arrays
    PATH/metadata.json   model and shapes, method, rank, calibration data, jsparse
                         version, and per array its shape, dtype and SHA-256

``load_bases`` restores into an abstract target built from the metadata
(``jax.ShapeDtypeStruct``), checks the caller's expectations (layers, KV heads, head dim,
rank, method) before reading any array, and verifies every array's checksum, so a
truncated or altered checkpoint fails loudly instead of returning wrong bases.
Orbax is imported on first use, keeping ``import jsparse`` light.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT", "load_bases", "save_bases"]

FORMAT = "jsparse-bases/1"
REQUIRED_METADATA = ("model", "method", "n_layers", "n_kv_heads", "head_dim", "rank")
_ARRAYS = "arrays"
_META = "metadata.json"


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or "/" in key or not key:
            raise ValueError(f"bases: keys must be non-empty strings without '/', got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = value
    return flat


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def save_bases(
    path: str | Path,
    bases: Mapping[str, Any],
    metadata: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Writes ``bases`` (a nested dict of arrays) and ``metadata`` to directory ``path``.

    ``metadata`` must hold ``model``, ``method``, ``n_layers``, ``n_kv_heads``,
    ``head_dim`` and ``rank``; add ``calibration`` (data and token count) and anything
    else JSON can encode. ``jsparse_version`` and the array specs are added here.
    ``overwrite=True`` replaces a checkpoint (never another directory): the new one is
    written beside it and moved in once complete, so a failed save keeps the old one.
    Returns the absolute path.
    """
    import orbax.checkpoint as ocp

    from jsparse import __version__

    path = Path(path).absolute()
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:
        raise ValueError(
            f"save_bases: metadata lacks {missing}; required: {list(REQUIRED_METADATA)}"
        )
    if not isinstance(bases, Mapping) or not bases:
        raise ValueError(
            f"save_bases: bases must be a non-empty dict of arrays, got {type(bases).__name__}"
        )
    if not isinstance(overwrite, bool):
        raise ValueError(f"save_bases: overwrite must be True or False, got {overwrite!r}")
    flat = {name: np.asarray(value) for name, value in _flatten(bases).items()}
    if not flat:
        raise ValueError("save_bases: bases hold no array (only empty dicts)")
    _check_orbax_names(flat)
    _check_shapes({n: a.shape for n, a in flat.items()}, metadata, "save_bases")
    for name, a in flat.items():  # what Orbax refuses, refused before anything is written
        if a.size == 0 or a.dtype.kind in "OSUMm":
            raise ValueError(
                f"save_bases: {name} is {a.dtype.name} of shape {a.shape}; expected a "
                "non-empty numeric array"
            )
    for name, a in flat.items():  # jax restores 64-bit arrays as 32-bit unless x64 is on
        if a.dtype.itemsize == 8 and a.dtype.kind in "fiuc":
            raise ValueError(
                f"save_bases: {name} is {a.dtype.name}; save 32-bit or narrower arrays (jax "
                "restores 64-bit ones as 32-bit, so they would not load back as saved)"
            )
    for name, a in flat.items():  # a NaN basis (calibrated on non-finite data) selects nothing
        if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise ValueError(f"save_bases: {name} has non-finite values; a basis must be finite")
    meta = dict(metadata)
    meta["format"] = FORMAT
    meta["jsparse_version"] = __version__
    meta["arrays"] = {
        name: {"shape": list(a.shape), "dtype": a.dtype.name, "sha256": _digest(a)}
        for name, a in flat.items()
    }
    # encoded before anything is written: metadata JSON cannot hold leaves no partial save
    meta_text = json.dumps(meta, indent=2, sort_keys=True, default=_json_default)
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"save_bases: {path} exists (pass overwrite=True to replace it)")
        _check_replaceable(path)
    # Written beside the target and moved in place once complete, so a save that fails
    # (Orbax refusing an array, a full disk) leaves any checkpoint it replaces intact.
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.saving-{uuid.uuid4().hex[:12]}"
    staging.mkdir()  # mkdir, not mkdtemp: the checkpoint keeps the umask's permissions
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(staging / _ARRAYS, _unflatten(flat))
        # Written last: a directory without metadata.json is an incomplete save.
        (staging / _META).write_text(meta_text)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return path


def _check_orbax_names(flat: Mapping[str, Any]) -> None:
    """Orbax names each array by its key path joined with '.', so keys "a.b" and
    ("a", "b") would be written to one file and the checkpoint would never load."""
    seen: dict[str, str] = {}
    for name in flat:
        dotted = name.replace("/", ".")
        if dotted in seen:
            raise ValueError(
                f"save_bases: keys {seen[dotted]!r} and {name!r} (nested keys joined by '/') "
                "name one Orbax array; rename one of them"
            )
        seen[dotted] = name


def _check_replaceable(path: Path) -> None:
    """Refuses to let ``overwrite`` replace anything but a checkpoint directory
    (complete or not, an interrupted Orbax save's temporary directory included)."""
    if not path.is_dir() or path.is_symlink():
        raise ValueError(
            f"save_bases: {path} exists and is not a directory (or is a link); not replacing it"
        )
    leftover = f"{_ARRAYS}.orbax-checkpoint-tmp"
    names = [e.name for e in path.iterdir()]
    others = sorted(n for n in names if n not in (_ARRAYS, _META) and not n.startswith(leftover))
    if others:
        raise ValueError(
            f"save_bases: {path} holds {others[:5]}, so it is not a jsparse checkpoint; "
            "overwrite=True replaces only a checkpoint"
        )


def _check_shapes(shapes: Mapping[str, Any], meta: Mapping[str, Any], where: str) -> None:
    """Every array is per (layer, KV head); ``[L, Hkv, R, D]`` arrays are projection maps."""
    lead = (meta["n_layers"], meta["n_kv_heads"])
    for name, shape in shapes.items():
        shape = tuple(shape)
        if shape[:2] != lead:
            raise ValueError(
                f"{where}: array {name!r} has shape {shape}; expected leading axes "
                f"(n_layers, n_kv_heads) = {lead}"
            )
        if len(shape) == 4 and shape[2:] != (meta["rank"], meta["head_dim"]):
            raise ValueError(
                f"{where}: array {name!r} has shape {shape}; expected [n_layers, n_kv_heads, "
                f"rank, head_dim] = {(*lead, meta['rank'], meta['head_dim'])}"
            )


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"metadata value of type {type(value).__name__} is not JSON-serialisable")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a checkpoint, without reading its arrays."""
    path = Path(path).absolute()
    if not path.exists():
        raise FileNotFoundError(f"load_bases: no checkpoint at {path}")
    meta_file = path / _META
    if not meta_file.is_file():
        raise ValueError(f"load_bases: {path} is not a complete bases checkpoint (no {_META})")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"load_bases: corrupt checkpoint metadata {meta_file}: {err}") from err
    if (
        not isinstance(meta, dict)
        or meta.get("format") != FORMAT
        or not isinstance(meta.get("arrays"), dict)
    ):
        raise ValueError(f"load_bases: {meta_file} is not {FORMAT} metadata")
    return meta


def load_bases(
    path: str | Path,
    *,
    n_layers: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    rank: int | None = None,
    method: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores ``(bases, metadata)`` saved by :func:`save_bases`.

    Every keyword given is checked against the metadata before arrays are read; a
    mismatch (for example a rank or head count that is not the model's) raises
    ``ValueError`` naming both values. Raises ``FileNotFoundError`` for a missing path
    and ``ValueError`` for an incomplete or corrupt checkpoint.
    """
    import jax
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = read_metadata(path)
    expected = {
        "n_layers": n_layers,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "rank": rank,
        "method": method,
    }
    for key, want in expected.items():
        if want is not None and meta.get(key) != want:
            raise ValueError(
                f"load_bases: checkpoint {path} has {key}={meta.get(key)!r}, expected {want!r}"
            )
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    specs = meta["arrays"]
    try:
        _check_shapes({n: tuple(s["shape"]) for n, s in specs.items()}, meta, "load_bases")
    except (KeyError, TypeError) as err:
        raise ValueError(f"load_bases: corrupt metadata in {path / _META}: {err!r}") from err
    try:
        target = _unflatten(
            {
                name: jax.ShapeDtypeStruct(
                    tuple(spec["shape"]), np.dtype(spec["dtype"]), sharding=sharding
                )
                for name, spec in specs.items()
            }
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"load_bases: corrupt array specs in {path / _META}: {err}") from err
    if not (path / _ARRAYS).is_dir():
        raise ValueError(f"load_bases: {path} has metadata but no {_ARRAYS}/ directory")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(path / _ARRAYS, target)
    except Exception as err:  # tensorstore / orbax raise many types for damaged files
        raise ValueError(
            f"load_bases: corrupt checkpoint {path}: {type(err).__name__}: {err}"
        ) from err
    flat = _flatten(restored)
    if set(flat) != set(specs):
        raise ValueError(
            f"load_bases: corrupt checkpoint {path}: arrays {sorted(flat)} != {sorted(specs)}"
        )
    for name, spec in specs.items():
        a = np.asarray(flat[name])
        if (
            list(a.shape) != spec["shape"]
            or a.dtype.name != spec["dtype"]
            or _digest(a) != spec["sha256"]
        ):
            raise ValueError(
                f"load_bases: corrupt checkpoint {path}: array {name!r} fails its checksum"
            )
    return restored, meta
