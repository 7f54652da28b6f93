"""A real Llama-style model (SmolLM2-135M-Instruct) to compose jsparse attention into.

* :mod:`jsparse.models.llama`: the Flax NNX decoder with a swappable attention core.
* :mod:`jsparse.models.gguf_loader`: GGUF → config + weights (needs ``jsparse[real]``).
* :mod:`jsparse.models.tokenizer`: the tokenizer rebuilt from the GGUF's vocabulary.
* :mod:`jsparse.models.capture`: per-layer post-RoPE q / k / v of a text, saved per layer.
* :mod:`jsparse.models.perplexity`: the sliding-window perplexity protocol.
* :mod:`jsparse.models.pack`: a numpy-only copy of the GGUF's tensors.

``gguf`` / ``tokenizers`` / ``rdata`` are imported only where a file is read, so
``import jsparse.models`` works without the ``real`` extra. See README.md beside this file.
"""

from jsparse.models.capture import capture_qkv, capture_text, iter_capture, load_capture
from jsparse.models.gguf_loader import load_model
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
from jsparse.models.perplexity import perplexity, token_nll

__all__ = [
    "Attention",
    "AttentionCore",
    "Block",
    "DenseCausalAttention",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "capture_qkv",
    "capture_text",
    "forward_fn",
    "iter_capture",
    "load_capture",
    "load_model",
    "perplexity",
    "token_nll",
]
