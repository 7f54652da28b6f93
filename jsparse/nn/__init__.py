"""Flax NNX modules that put jsparse's selection and kernels into JAX model definitions."""

from jsparse.nn.attention import SelectorParams, SparseAttention
from jsparse.nn.mla import DenseMLA, MLAAttention, MLACache, SparseMLA

__all__ = ["DenseMLA", "MLAAttention", "MLACache", "SelectorParams", "SparseAttention", "SparseMLA"]
