"""A real Llama-style model (SmolLM2-135M-Instruct) to compose jsparse attention into.

* :mod:`jsparse.models.llama`: the Flax NNX decoder with a swappable attention core.
* :mod:`jsparse.models.gguf_loader`: GGUF → config + weights (needs ``jsparse[real]``).
* :mod:`jsparse.models.tokenizer`: the tokenizer rebuilt from the GGUF's vocabulary.
* :mod:`jsparse.models.capture`: per-layer post-RoPE q / k / v of a text, saved per layer.
* :mod:`jsparse.models.perplexity`: the sliding-window perplexity protocol.

The GGUF, tokenizer and text readers import ``gguf`` / ``tokenizers`` / ``rdata``
lazily, so ``import jsparse.models`` works without the ``real`` extra.
"""

from jsparse.models.llama import (
    Attention,
    AttentionCore,
    Block,
    DenseCausalAttention,
    KVCache,
    Llama,
    LlamaConfig,
    forward_fn,
)

__all__ = [
    "Attention",
    "AttentionCore",
    "Block",
    "DenseCausalAttention",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "forward_fn",
]
