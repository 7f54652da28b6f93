"""Indexed decode attention: attend only the K/V rows a selector listed, read in place."""

from jsparse.ops.attention.api import indexed_attention

__all__ = ["indexed_attention"]
