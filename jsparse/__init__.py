"""jsparse: sparse long-context attention for JAX on NVIDIA GPUs.

Shape letters used throughout (docstrings, jaxtyping annotations):

    B    batch (sequences)            T    queries (tokens asking)
    S    keys (tokens in the cache)   H    query / indexer heads
    Hkv  key-value heads              G    query heads per KV head (H // Hkv)
    D    head dim                     Dv   value head dim
    K    top_k (indexer Top-K)        R    rank of a scoring subspace
    L    layers
    budget  tokens selected per KV head in decoding (the paper's "top-B")

Index outputs are int32 with ``-1`` marking an empty slot; their scores are ``-inf``.

Token selection (JSSA and the baselines it is compared with)::

    sel = jsparse.make_selector()                         # DEFAULT_SELECTOR: "jssa_rd"
    sel = jsparse.make_selector("jssa", rank=16)          # the paper's method
    params = sel.calibrate(q_calib, k_calib)              # one layer
    idx = sel.select(params, q, k, lengths, budget)       # int32 [B, Hkv, budget]
    out = jsparse.indexed_attention(q, k, v, idx)         # [B, H, Dv], rows read in place

MLA decoding (one latent + RoPE row per token, one index set for every head)::

    sel = jsparse.make_selector("jssa_mla", rank=64)
    idx = sel.select(params, q_abs, cache[:, :, None], lengths, budget)[:, 0]  # [B, budget]
    out = jsparse.indexed_mla_attention(q_abs, cache, idx, scale=192**-0.5)  # [B, H, 512]

DeepSeek-V3.2's sparse attention in a Flax model (the indexer selects exactly)::

    indexer = jsparse.nn.Indexer(d_model, top_k=2048, rngs=rngs)
    layer = jsparse.nn.MLAAttention(d_model, n_heads, indexer=indexer, rngs=rngs)
    y, cache = layer(x, layer.init_cache(batch, max_len))  # each token attends its top 2048 rows
"""

from jsparse import backend
from jsparse.calibration import (
    Moments,
    MomentState,
    compute_moments,
    finalize_moments,
    init_moments,
    jssa_basis,
    normalize_trace,
    refine_basis,
    selection_objective,
    subspace_overlap,
    update_moments,
)
from jsparse.checkpoint import load_bases, save_bases
from jsparse.ops.attention import indexed_attention
from jsparse.ops.indexer import IndexerTopK, indexer_scores, indexer_topk, indexer_topk_batch
from jsparse.ops.mla import indexed_mla_attention
from jsparse.ops.topk import topk
from jsparse.selectors import DEFAULT_SELECTOR, SELECTORS, Selector, make_selector

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SELECTOR",
    "SELECTORS",
    "IndexerTopK",
    "MomentState",
    "Moments",
    "Selector",
    "SparseAttention",
    "__version__",
    "backend",
    "compute_moments",
    "finalize_moments",
    "indexed_attention",
    "indexed_mla_attention",
    "indexer_scores",
    "indexer_topk",
    "indexer_topk_batch",
    "indexer_topk_decode",
    "init_moments",
    "jssa_basis",
    "load_bases",
    "make_selector",
    "normalize_trace",
    "refine_basis",
    "save_bases",
    "selection_objective",
    "subspace_overlap",
    "topk",
    "update_moments",
]


def __getattr__(name):
    # The certified package (planner, kernels) and the Flax modules stay off the import
    # path until used.
    if name == "indexer_topk_decode":
        from jsparse.certified import indexer_topk_decode

        return indexer_topk_decode
    if name == "SparseAttention":
        from jsparse.nn import SparseAttention

        return SparseAttention
    raise AttributeError(f"module 'jsparse' has no attribute {name!r}")
