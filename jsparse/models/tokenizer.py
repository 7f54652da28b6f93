"""The tokenizer, rebuilt from the GGUF's own vocabulary and merges with ``tokenizers``.

SmolLM2 uses a GPT-2-style byte-level BPE (``tokenizer.ggml.model == "gpt2"``, pre-
tokenizer ``"smollm"``): digits are split one by one, then the GPT-2 regex and byte-to-
unicode mapping apply, with no prefix space. No BOS token is added (the GGUF says
``add_bos_token = false``). Control tokens (``<|im_start|>`` ...) are registered as
special tokens, so they are matched whole in text and dropped by ``decode``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["load_tokenizer", "tokenizer_from_gguf"]

_CONTROL = 3  # llama.cpp's token type for control tokens


def tokenizer_from_gguf(reader, path: str | os.PathLike = "<gguf>"):
    """A ``tokenizers.Tokenizer`` from an open ``gguf.GGUFReader``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    def field(key):
        f = reader.fields.get(key)
        if f is None:
            raise ValueError(f"{path}: GGUF metadata has no {key!r} (no tokenizer inside?)")
        return f.contents()

    def list_of(key, kind, value):
        if not isinstance(value, list):
            bad, where = [value], ""
        else:
            bad, where = [v for v in value if type(v) is not kind][:1], "an entry of "
        if bad:
            raise ValueError(
                f"{path}: GGUF metadata {key!r}: {where}type {type(bad[0]).__name__}; "
                f"expected a list of {kind.__name__}"
            )
        return value

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} unsupported; expected 'gpt2' (BPE)")
    tokens = list_of("tokenizer.ggml.tokens", str, field("tokenizer.ggml.tokens"))
    if not tokens:
        raise ValueError(f"{path}: GGUF metadata 'tokenizer.ggml.tokens' is empty")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: the GGUF vocabulary has duplicate tokens")
    # A malformed merge made `tokenizers` raise a TypeError or panic (a BaseException):
    # each is "left right", both pieces and their concatenation in the vocabulary.
    merges = []
    listed = list_of("tokenizer.ggml.merges", str, field("tokenizer.ggml.merges"))
    for i, merge in enumerate(listed):
        pair = merge.split(" ")
        if len(pair) != 2 or not all(pair) or any(t not in vocab for t in (*pair, "".join(pair))):
            raise ValueError(
                f"{path}: GGUF merge {i} is {merge!r}; expected 'left right', both pieces "
                f"and their concatenation tokens of the vocabulary"
            )
        merges.append(tuple(pair))
    types = reader.fields.get("tokenizer.ggml.token_type")
    types = types.contents() if types is not None else [1] * len(tokens)
    if len(list_of("tokenizer.ggml.token_type", int, types)) != len(tokens):
        raise ValueError(
            f"{path}: GGUF metadata 'tokenizer.ggml.token_type' has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


@functools.cache
def _load(path: str):
    from jsparse.models.gguf_loader import open_gguf

    return tokenizer_from_gguf(open_gguf(path), path)


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer of a GGUF file (default: the cached SmolLM2-135M-Instruct); cached."""
    if path is None:
        from jsparse import assets

        path = assets.model_path()
    return _load(str(Path(path).resolve()))
