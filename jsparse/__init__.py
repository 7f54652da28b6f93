"""jsparse: sparse long-context attention for JAX on NVIDIA GPUs.

Shape letters used throughout (docstrings, jaxtyping annotations):

    B    batch (sequences)            T    queries (tokens asking)
    S    keys (tokens in the cache)   H    query / indexer heads
    Hkv  key-value heads              G    query heads per KV head (H // Hkv)
    D    head dim                     Dv   value head dim
    K    top_k (indexer Top-K)        R    rank of a scoring subspace
    budget  tokens selected per KV head in decoding (the paper's "top-B")

Index outputs are int32 with ``-1`` marking an empty slot; their scores are ``-inf``.
"""

from jsparse import backend
from jsparse.ops.indexer import IndexerTopK, indexer_scores, indexer_topk

__version__ = "0.1.0"

__all__ = [
    "IndexerTopK",
    "__version__",
    "backend",
    "indexer_scores",
    "indexer_topk",
    "indexer_topk_decode",
]


def __getattr__(name):
    # The certified package (planner, kernels) stays off the import path until used.
    if name == "indexer_topk_decode":
        from jsparse.certified import indexer_topk_decode

        return indexer_topk_decode
    raise AttributeError(f"module 'jsparse' has no attribute {name!r}")
