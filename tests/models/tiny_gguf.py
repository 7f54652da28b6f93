"""Writes tiny Llama GGUF files with the ``gguf`` package, as llama.cpp would lay them out.

The permutation of q / k rows is written here from llama.cpp's description (per head,
rotate-half row i goes to interleaved row 2i, row i + D/2 to row 2i + 1), by explicit
indexing, independently of the loader's reshape-based code. ``gguf`` is imported only
by the functions that write or quantise (the GPU machine has no ``gguf``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows → llama.cpp's interleaved rows, one index at a time."""
    d_out = w.shape[0]
    d = d_out // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + i + d // 2]
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>"]
MERGES = ["h e", "Ġ t", "Ġt he", "i n", "Ġ a"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE."""
    tokens = CONTROL_TOKENS + sorted(set(bytes_to_unicode().values()))
    tokens += [m.replace(" ", "") for m in MERGES]
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    return tokens, types, MERGES


# Which tensors are stored quantised (the rest F32), to exercise both dequantisers.
QUANTISED = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_1", "ffn_up.weight": "Q4_1"}


def quant_type(name: str):
    from gguf import GGMLQuantizationType

    # "blk.3.attn_q.weight" -> "attn_q.weight"
    kind = QUANTISED.get(name.split(".", 2)[2] if name.startswith("blk.") else name)
    return None if kind is None else GGMLQuantizationType[kind]


def stored_values(name: str, w: np.ndarray) -> np.ndarray:
    """What a reader gets back for ``w``: the quantise → dequantise round trip."""
    from gguf import quants

    qt = quant_type(name)
    if qt is None:
        return w.astype(np.float32)
    return quants.dequantize(quants.quantize(w, qt), qt).astype(np.float32)


def write_tiny_gguf(
    path: Path,
    cfg: dict,
    hf_weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    permute: bool = True,
    drop: tuple[str, ...] = (),
    metadata: dict | None = None,
) -> Path:
    """``hf_weights``: GGUF names in the Hugging Face layout; q / k get interleaved here.
    ``metadata``: key -> ``(value, GGUFValueType)`` replacing (or adding) a key, or None
    leaving it out; an array value is written as an array of UINT32."""
    import gguf
    from gguf import quants

    metadata = dict(metadata or {})

    class Writer(gguf.GGUFWriter):
        def add_key_value(self, key, val, vtype, sub_type=None):
            if key in metadata:
                if metadata[key] is None:
                    return
                val, vtype = metadata.pop(key)
                if vtype == gguf.GGUFValueType.ARRAY:
                    sub_type = gguf.GGUFValueType.UINT32
            super().add_key_value(key, val, vtype, sub_type)

    writer = Writer(str(path), arch)
    writer.add_name("tiny")
    writer.add_basename("tiny-llama")
    writer.add_block_count(cfg["n_layers"])
    writer.add_context_length(cfg["max_seq_len"])
    writer.add_embedding_length(cfg["d_model"])
    writer.add_feed_forward_length(cfg["d_ff"])
    writer.add_head_count(cfg["n_heads"])
    writer.add_head_count_kv(cfg["n_kv_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["norm_eps"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])
    tokens, types, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    for key, entry in list(metadata.items()):  # keys the writer above does not write
        if entry is not None:
            writer.add_key_value(key, *entry)
    for name, w in hf_weights.items():
        if name in drop:
            continue
        if permute and name.endswith("attn_q.weight"):
            w = interleave_rows(w, cfg["n_heads"])
        elif permute and name.endswith("attn_k.weight"):
            w = interleave_rows(w, cfg["n_kv_heads"])
        qt = quant_type(name)
        if qt is None:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
        else:
            writer.add_tensor(name, quants.quantize(w.astype(np.float32), qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def deinterleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`interleave_rows`: llama.cpp's rows back to rotate-half rows."""
    d_out = w.shape[0]
    d = d_out // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + i] = w[h * d + 2 * i]
            out[h * d + i + d // 2] = w[h * d + 2 * i + 1]
    return out
