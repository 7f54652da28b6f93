"""The GGUF loader and tokenizer on tiny GGUF files written by the tests."""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import numpy_llama
import pytest
import tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from test_llama import random_hf_weights

from jsparse.models.capture import capture_qkv
from jsparse.models.gguf_loader import load_model, open_gguf, permute_qk, unpermute_qk
from jsparse.models.llama import LlamaConfig, forward_fn
from jsparse.models.tokenizer import load_tokenizer

CFG = LlamaConfig(
    vocab_size=len(tiny_gguf.tiny_vocab()[0]),
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    rope_theta=100.0,
    norm_eps=1e-5,
    max_seq_len=128,
    name="tiny",  # the GGUF's file stem
)


@pytest.fixture(scope="module")
def weights():
    return random_hf_weights(CFG, seed=11)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, weights):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return tiny_gguf.write_tiny_gguf(path, CFG.to_dict(), weights)


def test_config_read_from_metadata(gguf_path):
    assert load_model(gguf_path).config == CFG


def test_loaded_model_matches_numpy(gguf_path, weights):
    """Logits and post-RoPE q / k / v equal the numpy pass on the dequantised HF weights.

    The file stores q / k rows interleaved; only a correct un-permutation makes RoPE
    rotate the same pairs as the numpy pass (q·k alone would not notice).
    """
    stored = {name: tiny_gguf.stored_values(name, w) for name, w in weights.items()}
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 21)
    ref = numpy_llama.forward(stored, CFG.to_dict(), ids)
    model = load_model(gguf_path)
    logits, _ = forward_fn(model)(ids[None])
    # f32 against the f64 numpy pass: ~3e-5 apart on some CPU builds; a wrong
    # un-permutation moves them by units (26 on this model)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["logits"], rtol=1e-4, atol=1e-4)
    for layer, arrays in capture_qkv(model, ids):
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(arrays[name], ref[name][layer], rtol=2e-5, atol=2e-5)
        # Scores of every query with every key, per KV group: what attention sees.
        q, k = arrays["q"].reshape(len(ids), CFG.n_kv_heads, -1, CFG.head_dim), arrays["k"]
        rq = ref["q"][layer].reshape(q.shape)
        np.testing.assert_allclose(
            np.einsum("tkgd,skd->kgts", q, k),
            np.einsum("tkgd,skd->kgts", rq, ref["k"][layer]),
            rtol=1e-4,
            atol=1e-4,
        )


def test_without_unpermuting_rope_pairs_differ(tmp_path, weights):
    """Control: a file whose q / k were not interleaved loads into different q / k."""
    path = tiny_gguf.write_tiny_gguf(tmp_path / "plain.gguf", CFG.to_dict(), weights, permute=False)
    stored = {name: tiny_gguf.stored_values(name, w) for name, w in weights.items()}
    ids = np.arange(12)
    ref = numpy_llama.forward(stored, CFG.to_dict(), ids, n_layers=1)
    (_, arrays), *_ = capture_qkv(load_model(path), ids, layers=[0])
    assert np.abs(arrays["q"] - ref["q"][0]).max() > 1e-2


def test_permutation_helpers_match_llama_cpp_layout():
    w = np.random.default_rng(1).standard_normal((24, 5)).astype(np.float32)
    np.testing.assert_array_equal(permute_qk(w, 3), tiny_gguf.interleave_rows(w, 3))
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)


def test_tokenizer_from_gguf(gguf_path):
    tok = load_tokenizer(gguf_path)
    tokens, _, _ = tiny_gguf.tiny_vocab()
    # Merges apply, digits are split one by one, no prefix space and no BOS are added.
    pieces = [tokens[i] for i in tok.encode("the cat in 42").ids]
    assert pieces == ["t", "he", "Ġ", "c", "a", "t", "Ġ", "in", "Ġ", "4", "2"]
    assert [tokens[i] for i in tok.encode(" the 42").ids] == ["Ġthe", "Ġ", "4", "2"]
    assert tok.decode(tok.encode("the cat in 42").ids) == "the cat in 42"
    assert tok.encode("<|im_start|>he").ids == [1, tokens.index("he")]


def _tokenizer_reader(**changes):
    """A stand-in for ``gguf.GGUFReader``'s tokenizer fields: three tokens, one merge."""
    from types import SimpleNamespace

    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [1, 1, 1],
        **changes,
    }
    return SimpleNamespace(
        fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items()}
    )


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tokenizer.ggml.merges": ["ab"]}, "merge 0 is 'ab'; expected 'left right'"),
        ({"tokenizer.ggml.merges": ["a c"]}, "merge 0 is 'a c'"),
        ({"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1]},
         "merge 0 is 'a b'"),  # `tokenizers` panicked: 'ab' is no token
        ({"tokenizer.ggml.merges": "a b"}, "merges': type str; expected a list of str"),
        ({"tokenizer.ggml.tokens": ["a", 2, "ab"]}, "an entry of type int; expected a list of str"),
        ({"tokenizer.ggml.tokens": []}, "'tokenizer.ggml.tokens' is empty"),
        ({"tokenizer.ggml.token_type": [1]}, "has 1 entries for 3 tokens"),
        ({"tokenizer.ggml.token_type": ["1", "1", "1"]}, "type str; expected a list of int"),
    ],
)  # fmt: skip
def test_malformed_tokenizer_metadata_is_named(changes, message):
    """Malformed merges made `tokenizers` raise a TypeError or panic (a BaseException
    that ``except Exception`` does not catch); token types of another length raised
    zip's error. Each is a ValueError naming the file and the field."""
    from jsparse.models.tokenizer import tokenizer_from_gguf

    assert tokenizer_from_gguf(_tokenizer_reader(), "t.gguf").encode("ab").ids == [2]
    with pytest.raises(ValueError, match="^t.gguf: .*" + re.escape(message)):
        tokenizer_from_gguf(_tokenizer_reader(**changes), "t.gguf")


def test_an_unchanged_file_is_parsed_once_and_a_rewritten_one_again(tmp_path, weights):
    """The model and its tokenizer share one parse of a file; a file written again (new
    size or time) is read anew, never answered from the old parse."""
    path = tiny_gguf.write_tiny_gguf(tmp_path / "tiny.gguf", CFG.to_dict(), weights)
    first = open_gguf(path)
    assert open_gguf(str(path)) is first
    smaller = dict(CFG.to_dict(), n_layers=1)
    tiny_gguf.write_tiny_gguf(path, smaller, weights, drop=tuple(
        n for n in weights if n.startswith("blk.1.")
    ))  # fmt: skip
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a new time either way
    again = open_gguf(path)
    assert again is not first
    assert load_model(path).config.n_layers == 1


@pytest.mark.parametrize("keep", [0.004, 0.5, 0.99])
def test_truncated_file_is_a_clear_error(gguf_path, tmp_path, keep):
    data = gguf_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|corrupted)"):
        load_model(cut)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(bad)


def test_non_llama_architecture(tmp_path, weights):
    path = tiny_gguf.write_tiny_gguf(tmp_path / "gpt2.gguf", CFG.to_dict(), weights, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_model(path)


def test_missing_tensor(tmp_path, weights):
    path = tiny_gguf.write_tiny_gguf(
        tmp_path / "holes.gguf", CFG.to_dict(), weights, drop=("blk.1.ffn_up.weight",)
    )
    with pytest.raises(ValueError, match=r"missing \['blk.1.ffn_up.weight'\]"):
        load_model(path)


def test_load_model_with_a_calibrated_core_keeps_its_params(gguf_path):
    """``load_model(core=...)`` (the README's example): each layer's core holds the
    calibrated params it was given (not the abstract shapes of the weights' tree), and
    with a budget covering the context the sparse model's logits are the dense model's."""
    import jax.numpy as jnp

    import jsparse

    rng = np.random.default_rng(3)
    sel = jsparse.make_selector("jssa", rank=4)
    q_cal = jnp.asarray(rng.standard_normal((64, CFG.n_heads, CFG.head_dim)), jnp.float32)
    k_cal = jnp.asarray(rng.standard_normal((64, CFG.n_kv_heads, CFG.head_dim)), jnp.float32)
    params = [sel.calibrate(q_cal * (i + 1), k_cal) for i in range(CFG.n_layers)]
    sparse = load_model(gguf_path, core=lambda i: jsparse.SparseAttention(sel, params[i], 64))
    for i, layer in enumerate(sparse.layers):
        held = layer.attn.core.params["basis"].get_value()
        np.testing.assert_array_equal(np.asarray(held), np.asarray(params[i]["basis"]))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 17)
    dense_logits, _ = forward_fn(load_model(gguf_path))(ids[None])
    sparse_logits, _ = forward_fn(sparse)(ids[None])
    np.testing.assert_allclose(np.asarray(sparse_logits), np.asarray(dense_logits), atol=1e-5)


def tensor_info(data: bytes, path, name: str) -> dict[str, int]:
    """Byte positions of tensor ``name``'s type code and data offset in its info record."""
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    at = t.field.offset
    at += 8 + struct.unpack_from("<Q", data, at)[0]  # name
    at += 4 + 8 * struct.unpack_from("<I", data, at)[0]  # n_dims, dims
    return {"type": at, "offset": at + 4}


def patched(gguf_path, tmp_path, name, field, value_of) -> object:
    """A copy of the file with tensor ``name``'s ``field`` set to ``value_of(old)``; a
    type given by name ("F16")."""
    import gguf

    data = bytearray(gguf_path.read_bytes())
    at = tensor_info(bytes(data), gguf_path, name)[field]
    fmt = "<I" if field == "type" else "<Q"
    value = value_of(struct.unpack_from(fmt, data, at)[0])
    if isinstance(value, str):
        value = gguf.GGMLQuantizationType[value]
    struct.pack_into(fmt, data, at, value)
    out = tmp_path / "patched.gguf"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    ("name", "field", "value_of", "match"),
    [
        # Each loaded silently wrong before: the reader trusts every type and offset.
        (
            "blk.0.attn_norm.weight",
            "type",
            lambda _: "F16",
            r"attn_norm\.weight \(F16, shape \[32\]\) needs 64 bytes",
        ),
        ("blk.0.attn_norm.weight", "type", lambda _: "BF16", r"attn_norm\.weight \(BF16"),
        ("blk.0.attn_q.weight", "type", lambda _: "Q4_0", r"attn_q\.weight \(Q4_0.*next tensor"),
        ("blk.0.attn_q.weight", "type", lambda _: "Q5_0", r"attn_q\.weight \(Q5_0.*which overlap"),
        (
            "token_embd.weight",
            "type",
            lambda _: "Q8_1",
            r"token_embd\.weight \(Q8_1.*which overlap",
        ),
        (
            "blk.0.attn_q.weight",
            "offset",
            lambda v: v + 32,
            r"attn_norm\.weight .* the next tensor, blk\.0\.attn_q\.weight, starts",
        ),
        (
            "blk.0.attn_q.weight",
            "offset",
            lambda v: v + 4,
            r"attn_q\.weight .* not a multiple of the file's alignment 32",
        ),
        ("blk.1.ffn_down.weight", "offset", lambda v: v - 32, r"which overlap"),
        (
            "token_embd.weight",
            "offset",
            lambda v: v + 32,
            r"token_embd\.weight .* starts at byte \d+; the data section starts at",
        ),
        # as large as F32: caught by its type (gguf's I32 dequantiser raised a bare
        # NotImplementedError)
        (
            "blk.0.attn_norm.weight",
            "type",
            lambda _: "I32",
            r"tensor blk\.0\.attn_norm\.weight has type I32; expected float",
        ),
    ],
)
def test_inconsistent_tensor_data_is_refused(gguf_path, tmp_path, name, field, value_of, match):
    bad = patched(gguf_path, tmp_path, name, field, value_of)
    with pytest.raises(ValueError, match=r"patched\.gguf: (tensor )?.*" + match):
        load_model(bad)


def test_last_tensor_must_end_the_file(gguf_path, tmp_path):
    longer = tmp_path / "longer.gguf"
    longer.write_bytes(gguf_path.read_bytes() + bytes(64))
    with pytest.raises(ValueError, match=r"longer\.gguf: tensor .* but the file ends at"):
        load_model(longer)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("llama.attention.head_count", (0, "UINT32"), "is 0; expected an integer >= 1"),
        ("llama.attention.head_count_kv", (0, "UINT32"), "is 0; expected an integer >= 1"),
        ("llama.attention.head_count", ([4, 4], "ARRAY"), r"is a per-layer array \[4, 4\]"),
        ("llama.attention.head_count_kv", ([2, 2], "ARRAY"), r"is a per-layer array"),
        ("llama.block_count", ("2", "STRING"), "is '2'; expected an integer"),
        ("llama.block_count", (2.0, "FLOAT32"), r"is 2\.0; expected an integer"),
        ("llama.embedding_length", (32.9, "FLOAT32"), r"is 32\.9\d*; expected an integer"),
        ("llama.context_length", (-5, "INT32"), "is -5; expected an integer >= 1"),
        ("llama.rope.freq_base", ("100", "STRING"), "is '100'; expected a finite number > 0"),
        ("llama.rope.freq_base", (0.0, "FLOAT32"), r"is 0\.0; expected a finite number > 0"),
        ("llama.attention.layer_norm_rms_epsilon", (-1.0, "FLOAT32"), r"is -1\.0"),
        ("llama.attention.head_count", (3, "UINT32"), "is 3, which does not divide"),
        ("llama.attention.value_length", (16, "UINT32"), "is 16; this model needs it equal"),
    ],
)
def test_bad_metadata_names_its_key(tmp_path, weights, key, value, match):
    # Were ZeroDivisionError / TypeError, or loaded truncated or parsed ("2", 32.9).
    import gguf

    entry = (value[0], gguf.GGUFValueType[value[1]])
    path = tiny_gguf.write_tiny_gguf(
        tmp_path / "meta.gguf", CFG.to_dict(), weights, metadata={key: entry}
    )
    with pytest.raises(ValueError, match=rf"meta\.gguf: metadata '{re.escape(key)}' {match}"):
        load_model(path)
