"""The numpy-only model pack: bit-identical weights without the gguf package."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import tiny_gguf
from flax import nnx

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402
from test_gguf_loader import CFG  # noqa: E402
from test_llama import random_hf_weights  # noqa: E402

from jsparse.models.gguf_loader import load_model  # noqa: E402
from jsparse.models.pack import dequantize, export_pack, load_pack  # noqa: E402


@pytest.mark.parametrize("kind", [QT.Q8_0, QT.Q4_1])
def test_dequantize_is_bit_identical_to_gguf(kind):
    w = np.random.default_rng(41).standard_normal((6, 96)).astype(np.float32) * 3
    raw = quants.quantize(w, kind)
    np.testing.assert_array_equal(dequantize(raw, kind.name, w.shape), quants.dequantize(raw, kind))


def test_pack_round_trip_in_parts(tmp_path):
    path = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", CFG.to_dict(), random_hf_weights(CFG))
    files = export_pack(tmp_path / "pack", gguf_path=path, max_part_bytes=20_000, with_tokens=False)
    parts = [f for f in files if f.name.startswith("weights_")]
    assert len(parts) > 1
    packed, direct = load_pack(tmp_path / "pack"), load_model(path)
    assert packed.config == direct.config
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)),
        nnx.to_pure_dict(nnx.state(packed)),
        nnx.to_pure_dict(nnx.state(direct)),
    )
    assert all(jax.tree.leaves(same))
    parts[-1].unlink()
    with pytest.raises(FileNotFoundError, match="pack parts missing"):
        load_pack(tmp_path / "pack")


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    path = tiny_gguf.write_tiny_gguf(d / "tiny.gguf", CFG.to_dict(), random_hf_weights(CFG))
    export_pack(d / "pack", gguf_path=path, max_part_bytes=20_000, with_tokens=False)
    return d / "pack"


def edited_pack(pack_dir, tmp_path, edit_manifest=None, edit_part=None):
    """A copy of ``pack_dir`` with its manifest and / or its first part edited."""
    out = tmp_path / "edited"
    shutil.copytree(pack_dir, out)
    manifest = json.loads((out / "manifest.json").read_text())
    if edit_manifest is not None:
        edit_manifest(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    if edit_part is not None:
        part = out / manifest["parts"][0]
        with np.load(part) as f:
            arrays = {k: f[k] for k in f.files}
        edit_part(arrays)
        np.savez(part, **arrays)
    return out


def first_of(kinds):
    return lambda m: next(n for n, e in m["tensors"].items() if e["type"] in kinds)


def retype(kinds, new):
    def edit(m):
        m["tensors"][first_of(kinds)(m)]["type"] = new

    return edit


@pytest.mark.parametrize(
    ("edit_manifest", "edit_part", "match"),
    [
        # a config key missing took its default; a misspelt one was dropped (wrong logits)
        (lambda m: m["config"].pop("rope_theta"), None, r"config: .*missing keys \['rope_theta'\]"),
        (
            lambda m: m["config"].__setitem__("rope_thta", m["config"].pop("rope_theta")),
            None,
            r"unknown keys \['rope_thta'\]",
        ),
        (lambda m: m["config"].__setitem__("rope_theta", 0), None, "LlamaConfig.rope_theta"),
        # F32 norms read as F16: converted values, a silently wrong model
        (retype({"F32"}, "F16"), None, r"weights_00\.npz: tensor .*: F16 \[\d+\] stored as"),
        (retype({"Q4_1", "Q8_0"}, "F32"), None, r"weights_00\.npz: tensor .*: F32 .* stored as"),
        (retype({"Q4_1"}, "Q8_0"), None, r"weights_00\.npz: tensor .*: Q8_0 .* stored as"),
        (
            lambda m: m["tensors"].pop(
                next(n for n, e in m["tensors"].items() if e["part"] == m["parts"][0])
            ),
            None,
            r"weights_00\.npz: tensor .* is missing from the manifest's index",
        ),
        (
            lambda m: m["tensors"][first_of({"F32"})(m)].__setitem__("shape", [-1]),
            None,
            r"shape \[-1\]; expected positive ints",
        ),
        (
            None,
            lambda a: a.update(
                {k: v.astype(np.float64) for k, v in a.items() if v.dtype == np.float32}
            ),
            "stored as .* float64 values",
        ),
        (None, lambda a: a.pop(sorted(a)[0]), "in the manifest but in no part"),
        (lambda m: m.__setitem__("parts", "weights_00.npz"), None, "'parts' is 'weights_00.npz'"),
    ],
)
def test_bad_packs_are_refused(pack_dir, tmp_path, edit_manifest, edit_part, match):
    with pytest.raises(ValueError, match=match):
        load_pack(edited_pack(pack_dir, tmp_path, edit_manifest, edit_part))


def test_truncated_part_names_the_file(pack_dir, tmp_path):
    out = edited_pack(pack_dir, tmp_path)
    part = out / "weights_00.npz"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"weights_00\.npz: unreadable pack part \(BadZipFile"):
        load_pack(out)


def test_dequantize_refuses_a_size_mismatch():
    with pytest.raises(ValueError, match=r"Q8_0 \[32\] stored as 35 uint8 values; expected 34"):
        dequantize(np.zeros(35, np.uint8), "Q8_0", (32,))
    with pytest.raises(ValueError, match="multiple of the 32-weight block"):
        dequantize(np.zeros(34, np.uint8), "Q8_0", (2, 16))
