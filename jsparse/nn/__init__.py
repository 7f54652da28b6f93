"""Flax NNX modules that put jsparse's selection and kernels into JAX model definitions."""

from jsparse.nn.attention import SelectorParams, SparseAttention
from jsparse.nn.indexer import Indexer, IndexerCache, causal_attention_probs, distillation_loss
from jsparse.nn.mla import DenseMLA, MLAAttention, MLACache, SelectedMLA, SparseMLA

__all__ = [
    "DenseMLA",
    "Indexer",
    "IndexerCache",
    "MLAAttention",
    "MLACache",
    "SelectedMLA",
    "SelectorParams",
    "SparseAttention",
    "SparseMLA",
    "causal_attention_probs",
    "distillation_loss",
]
