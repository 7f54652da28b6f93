"""Indexed MLA decode attention: every head of a sequence attends the latent rows its
one index list names, read in place (FlashMLA-style sparse MLA)."""

from jsparse.ops.mla.api import indexed_mla_attention

__all__ = ["indexed_mla_attention"]
