"""Activation capture: streaming per layer, the directory format, save / load round trips."""

from __future__ import annotations

import json

import numpy as np
import numpy_llama
import pytest
from test_llama import TINY, nnx_model, random_hf_weights, tokens_of

from jsparse.models.capture import (
    META_KEYS,
    capture_meta,
    capture_qkv,
    iter_capture,
    load_capture,
    save_capture,
)

CFG4 = TINY.__class__(**{**TINY.to_dict(), "n_layers": 4})


@pytest.fixture(scope="module")
def tiny():
    weights = random_hf_weights(CFG4, seed=21)
    return nnx_model(CFG4, weights), weights


def test_layers_subset_in_order_and_equal_to_numpy(tiny):
    model, weights = tiny
    ids = tokens_of(15, seed=22)
    ref = numpy_llama.forward(weights, CFG4.to_dict(), ids, n_layers=3)
    got = list(capture_qkv(model, ids, layers=[2, 0], attention_input=True))
    assert [layer for layer, _ in got] == [0, 2]
    for layer, arrays in got:
        assert arrays["q"].shape == (15, CFG4.n_heads, CFG4.head_dim)
        assert arrays["k"].shape == (15, CFG4.n_kv_heads, CFG4.head_dim)
        assert arrays["x"].shape == (15, CFG4.d_model)
        assert all(a.dtype == np.float32 for a in arrays.values())
        for name in ("x", "q", "k", "v"):
            np.testing.assert_allclose(arrays[name], ref[name][layer], rtol=2e-5, atol=2e-5)
    assert sorted(dict(capture_qkv(model, ids, layers=[1]))[1]) == ["k", "q", "v"]


def test_save_load_iter_round_trip(tiny, tmp_path):
    model, _ = tiny
    ids = tokens_of(9, seed=23)
    meta = capture_meta(model, novel="persuasion", offset=100, n_tokens=9, layers=range(4))
    out = save_capture(tmp_path / "cap", capture_qkv(model, ids), meta=meta, tokens=ids)
    assert sorted(p.name for p in out.iterdir()) == [
        "layer_00.npz",
        "layer_01.npz",
        "layer_02.npz",
        "layer_03.npz",
        "meta.json",
        "tokens.npy",
    ]
    on_disk = json.loads((out / "meta.json").read_text())
    assert set(META_KEYS) <= set(on_disk)
    assert on_disk["offset"] == 100 and on_disk["n_layers"] == 4 and on_disk["dtype"] == "float32"
    with np.load(out / "layer_02.npz") as f:
        assert sorted(f.files) == ["k", "q", "v"]

    loaded = load_capture(out, layers=[1, 3])
    assert sorted(loaded.layers) == [1, 3]
    np.testing.assert_array_equal(loaded.tokens, ids)
    direct = dict(capture_qkv(model, ids, layers=[3]))
    np.testing.assert_array_equal(loaded.layers[3]["k"], direct[3]["k"])
    assert [layer for layer, _ in iter_capture(out)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="were not captured"):
        list(iter_capture(out, layers=[7]))


def test_errors(tiny, tmp_path):
    model, _ = tiny
    with pytest.raises(ValueError, match="layers"):
        list(capture_qkv(model, tokens_of(4), layers=[4]))
    with pytest.raises(ValueError, match="token_ids"):
        list(capture_qkv(model, np.zeros((2, 3), np.int32)))
    with pytest.raises(FileNotFoundError, match=r"no meta\.json"):
        load_capture(tmp_path)
    with pytest.raises(ValueError, match="missing keys"):
        save_capture(tmp_path / "x", [], meta={"model": "m"})
