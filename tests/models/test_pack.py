"""The numpy-only model pack: bit-identical weights without the gguf package."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tiny_gguf
from flax import nnx
from gguf import GGMLQuantizationType as QT
from gguf import quants
from test_gguf_loader import CFG
from test_llama import random_hf_weights

from jsparse.models.gguf_loader import load_model
from jsparse.models.pack import dequantize, export_pack, load_pack


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
