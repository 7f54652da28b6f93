"""GGUF → :class:`LlamaConfig` + NNX weights, dequantised to float32 with ``gguf``.

Layout facts this loader relies on (llama.cpp's ``convert_hf_to_gguf.py`` conventions):

* A GGUF tensor's ``shape`` lists ggml dimensions fastest first; the numpy array is the
  reverse, so a projection is stored [d_out, d_in] (PyTorch's ``nn.Linear`` layout) and
  becomes our [d_in, d_out] kernel by a transpose.
* llama.cpp permutes the rows of ``attn_q`` / ``attn_k`` of every head from the
  rotate-half RoPE layout (dimension i pairs with i + D/2) into the interleaved one
  (2i pairs with 2i + 1). :func:`unpermute_qk` undoes it, so our rotate-half RoPE sees
  the weights Hugging Face's model has. Dot products q·k are unchanged by the
  permutation; which pairs RoPE rotates together is not.
* Tied embeddings: no ``output.weight`` tensor; the head reads ``token_embd.weight``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jsparse import _checks
from jsparse.models.llama import AttentionCore, Llama, LlamaConfig

__all__ = [
    "config_from_gguf",
    "gguf_tensors",
    "load_model",
    "model_from_tensors",
    "open_gguf",
    "permute_qk",
    "unpermute_qk",
]

GGUF_MAGIC = b"GGUF"

_PER_LAYER = {
    # GGUF name suffix -> (path inside Block, transpose?, un-permute heads from config field)
    "attn_norm.weight": (("attn_norm", "scale"), False, None),
    "attn_q.weight": (("attn", "q_proj", "kernel"), True, "n_heads"),
    "attn_k.weight": (("attn", "k_proj", "kernel"), True, "n_kv_heads"),
    "attn_v.weight": (("attn", "v_proj", "kernel"), True, None),
    "attn_output.weight": (("attn", "o_proj", "kernel"), True, None),
    "ffn_norm.weight": (("mlp_norm", "scale"), False, None),
    "ffn_gate.weight": (("mlp", "gate_proj", "kernel"), True, None),
    "ffn_up.weight": (("mlp", "up_proj", "kernel"), True, None),
    "ffn_down.weight": (("mlp", "down_proj", "kernel"), True, None),
}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half row order → llama.cpp's interleaved order (what the GGUF stores)."""
    d_out, d_in = w.shape
    return w.reshape(n_head, 2, d_out // n_head // 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: per head, rows (2i, 2i+1) → (i, i + D/2)."""
    d_out, d_in = w.shape
    return w.reshape(n_head, d_out // n_head // 2, 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` for ``path``, with a clear error for a missing, foreign or
    truncated file (``FileNotFoundError`` / ``ValueError`` naming the file). The reader
    of an unchanged file (same size and modification time) is reused: parsing the
    SmolLM2 file's metadata (~294K fields, its vocabulary) takes ~6 s, and the model and
    its tokenizer each open it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _read_gguf(str(path.resolve()), str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_gguf(resolved: str, shown: str, size: int, mtime_ns: int):
    """:func:`open_gguf`'s reading and checks, once per (file, size, time); errors name
    the file as it was given (``shown``)."""
    import gguf

    path = Path(shown)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        reader = gguf.GGUFReader(resolved)
    except Exception as err:  # the reader raises struct/numpy/Value errors on bad bytes
        raise ValueError(
            f"{path}: unreadable GGUF ({type(err).__name__}: {err}); the file is truncated or "
            f"corrupted ({size} bytes)"
        ) from err
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"{path}: truncated: tensor {t.name} needs bytes up to {end}, the file has {size}"
            )
    _check_data_layout(reader, path, size)
    return reader


def _check_data_layout(reader, path, size: int) -> None:
    """Each tensor's bytes (its type and shape give their count) fill the data section
    up to the next tensor's offset, or the end of the file, but for the alignment
    padding: the reader trusts each offset and type on its own, so a type code changed
    F32 -> F16 or an offset moved by a block would load a silently wrong model."""
    align = int(reader.alignment)
    tensors = sorted(reader.tensors, key=lambda t: int(t.data_offset))
    start = int(reader.data_offset)

    def what(t):
        return f"tensor {t.name} ({t.tensor_type.name}, shape {[int(n) for n in t.shape]})"

    for t in tensors:
        if (int(t.data_offset) - start) % align:
            raise ValueError(
                f"{path}: {what(t)} at data offset {int(t.data_offset) - start} is not a "
                f"multiple of the file's alignment {align}"
            )
    if tensors and int(tensors[0].data_offset) != start:
        t = tensors[0]
        raise ValueError(
            f"{path}: {what(t)} starts at byte {int(t.data_offset)}; the data section starts "
            f"at {start} (its first tensor's offset should be 0, not {int(t.data_offset) - start})"
        )
    for i, t in enumerate(tensors):
        offset, n_bytes = int(t.data_offset), int(t.n_bytes)
        end = offset + n_bytes
        padded = -(-end // align) * align
        if i + 1 < len(tensors):
            nxt = tensors[i + 1]
            following = int(nxt.data_offset)
            if following < end:
                raise ValueError(
                    f"{path}: {what(t)} needs {n_bytes} bytes at {offset}..{end}, which overlap "
                    f"tensor {nxt.name} at {following}"
                )
            if following != padded:
                raise ValueError(
                    f"{path}: {what(t)} needs {n_bytes} bytes at {offset}..{end} (padded to "
                    f"{padded}), but the next tensor, {nxt.name}, starts at {following}: its "
                    f"type, shape or offset is wrong"
                )
        elif not end <= size <= padded:
            raise ValueError(
                f"{path}: {what(t)} needs {n_bytes} bytes at {offset}..{end} (padded to "
                f"{padded}), but the file ends at {size}: its type, shape or offset is wrong"
            )


def _field(reader, key: str, path, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"{path}: GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _int_field(reader, key: str, path, default: Any = ...) -> int:
    """A metadata count (>= 1): int() would truncate 32.9, parse "2", or fail on a
    per-layer array with a TypeError naming nothing."""
    value = _field(reader, key, path, default)
    if isinstance(value, list):
        raise ValueError(
            f"{path}: metadata {key!r} is a per-layer array {value[:8]}; this loader needs "
            f"one integer for every layer"
        )
    if not _checks.is_int(value) or value < 1:
        raise ValueError(f"{path}: metadata {key!r} is {value!r}; expected an integer >= 1")
    return int(value)


def _float_field(reader, key: str, path, default: Any = ...) -> float:
    """A positive, finite float metadata value, as :func:`_f32` reads it."""
    value = _field(reader, key, path, default)
    if not _checks.is_positive_finite(value):
        raise ValueError(f"{path}: metadata {key!r} is {value!r}; expected a finite number > 0")
    return _f32(value)


def config_from_gguf(reader, path: str | os.PathLike = "<gguf>") -> LlamaConfig:
    """The model's shapes and constants from the GGUF metadata; Llama architecture only."""
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported; this loader reads 'llama' GGUFs"
        )
    if _field(reader, "llama.rope.scaling.type", path, None) not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling is not supported")
    d_model = _int_field(reader, "llama.embedding_length", path)
    n_heads = _int_field(reader, "llama.attention.head_count", path)
    if d_model % n_heads and "llama.attention.key_length" not in reader.fields:
        raise ValueError(
            f"{path}: metadata 'llama.attention.head_count' is {n_heads}, which does not "
            f"divide 'llama.embedding_length' {d_model} (and no 'llama.attention.key_length')"
        )
    head_dim = _int_field(reader, "llama.attention.key_length", path, d_model // n_heads)
    value_dim = _int_field(reader, "llama.attention.value_length", path, head_dim)
    if value_dim != head_dim:
        raise ValueError(
            f"{path}: metadata 'llama.attention.value_length' is {value_dim}; this model "
            f"needs it equal to the key length {head_dim}"
        )
    rope_dims = _int_field(reader, "llama.rope.dimension_count", path, head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rope_dims} of {head_dim} dims) unsupported")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = _int_field(reader, "llama.vocab_size", path, int(embd.shape[-1]))
    return LlamaConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=_int_field(reader, "llama.block_count", path),
        n_heads=n_heads,
        n_kv_heads=_int_field(reader, "llama.attention.head_count_kv", path, n_heads),
        head_dim=head_dim,
        d_ff=_int_field(reader, "llama.feed_forward_length", path),
        rope_theta=_float_field(reader, "llama.rope.freq_base", path, 10_000.0),
        norm_eps=_float_field(reader, "llama.attention.layer_norm_rms_epsilon", path),
        max_seq_len=_int_field(reader, "llama.context_length", path),
        tie_embeddings="output.weight" not in names,
        # The file name says which model and which quantisation ("SmolLM2-135M-Instruct.Q4_1");
        # the metadata's general.name of this GGUF is a training-run label.
        name=Path(path).stem if Path(path).suffix == ".gguf" else "llama",
    )


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the value the model was configured with."""
    return float(str(np.float32(x)))


def gguf_tensors(reader, path: str | os.PathLike = "<gguf>") -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32, numpy layout ([d_out, d_in] for projections)."""
    from gguf import quants

    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind.startswith("I"):  # I8 ... I64: integers, not weights
            raise ValueError(f"{path}: tensor {t.name} has type {kind}; expected float weights")
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ValueError(
                f"{path}: tensor {t.name} has type {kind}, which gguf cannot dequantise ({err})"
            ) from None
        out[t.name] = np.asarray(w, dtype=np.float32).reshape(tuple(int(s) for s in t.shape[::-1]))
    return out


def _expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"token_embd.weight": (c.vocab_size, c.d_model), "output_norm.weight": (c.d_model,)}
    if not c.tie_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.d_model)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = {
        "attn_norm.weight": (c.d_model,),
        "attn_q.weight": (q, c.d_model),
        "attn_k.weight": (kv, c.d_model),
        "attn_v.weight": (kv, c.d_model),
        "attn_output.weight": (c.d_model, q),
        "ffn_norm.weight": (c.d_model,),
        "ffn_gate.weight": (c.d_ff, c.d_model),
        "ffn_up.weight": (c.d_ff, c.d_model),
        "ffn_down.weight": (c.d_model, c.d_ff),
    }
    for i in range(c.n_layers):
        shapes.update({f"blk.{i}.{k}": s for k, s in per_layer.items()})
    return shapes


def model_from_tensors(
    config: LlamaConfig,
    tensors: Mapping[str, np.ndarray],
    *,
    core: Callable[[int], AttentionCore] | None = None,
    source: str = "<tensors>",
) -> Llama:
    """A :class:`Llama` holding ``tensors`` (GGUF names, numpy layout, q/k permuted)."""
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"{source}: tensors do not match a Llama with {config.n_layers} layers: "
            f"missing {missing[:8]}, unexpected {unknown[:8]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{source}: {name} has shape {tensors[name].shape}, expected {shape}")

    # The weights' tree without the core: a core's own state (a selector's calibrated
    # bases) is not among the tensors, and an abstract core would keep only its shapes.
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    pure["embed"] = tensors["token_embd.weight"]
    pure["norm"]["scale"] = tensors["output_norm.weight"]
    if not config.tie_embeddings:
        pure["lm_head"]["kernel"] = tensors["output.weight"].T
    for i in range(config.n_layers):
        for suffix, (where, transpose, heads) in _PER_LAYER.items():
            w = tensors[f"blk.{i}.{suffix}"]
            if heads is not None:
                w = unpermute_qk(w, getattr(config, heads))
            if transpose:
                w = w.T
            node = pure["layers"][i]
            for key in where[:-1]:
                node = node[key]
            node[where[-1]] = w
    pure = _to_jax(pure)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    if core is not None:
        model.set_core(core)
    return model


def _to_jax(tree):
    import jax.numpy as jnp

    if isinstance(tree, dict):
        return {k: _to_jax(v) for k, v in tree.items()}
    return jnp.asarray(np.ascontiguousarray(tree, dtype=np.float32))


def load_model(
    path: str | os.PathLike | None = None,
    *,
    core: Callable[[int], AttentionCore] | None = None,
) -> Llama:
    """The model from a GGUF file (default: the cached SmolLM2-135M-Instruct).

    Without ``path``, falls back on a numpy pack in the cache (``export-pack``) when
    the GGUF is absent, and raises :class:`jsparse.assets.AssetsMissingError` with the
    fetch command when neither is there.
    """
    if path is None:
        from jsparse import assets

        try:
            path = assets.model_path()
        except assets.AssetsMissingError:
            if not (assets.pack_dir() / "manifest.json").is_file():
                raise
            from jsparse.models.pack import load_pack

            return load_pack(assets.pack_dir(), core=core)
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    return model_from_tensors(config, gguf_tensors(reader, path), core=core, source=str(path))
