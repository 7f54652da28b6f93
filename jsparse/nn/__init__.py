"""Flax NNX modules that put jsparse's selection and kernels into JAX model definitions."""

from jsparse.nn.attention import SelectorParams, SparseAttention

__all__ = ["SelectorParams", "SparseAttention"]
