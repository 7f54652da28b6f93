"""full: dense attention over every cached token (the accuracy ceiling)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jsparse.selectors.base import Selector, register

__all__ = ["FullSelector"]


@register
@dataclasses.dataclass(frozen=True)
class FullSelector(Selector):
    """Returns every visible token, whatever the budget: int32 ``[B, Hkv, S]``, ``-1`` beyond
    ``lengths[b]``. The one selector whose output width is ``S`` rather than ``budget``."""

    name: ClassVar[str] = "full"

    def _select_impl(self, params, q, k, lengths, budget, ordered=True):
        b, s, hkv, _ = k.shape
        pos = jnp.arange(s, dtype=jnp.int32)
        idx = jnp.where(pos[None, :] < lengths[:, None], pos[None, :], -1)
        return jnp.broadcast_to(idx[:, None, :], (b, hkv, s))

    def _width(self, cached, budget):
        return cached

    def scores(self, params, q, k, lengths):
        return jnp.zeros((k.shape[0], k.shape[2], k.shape[1]), jnp.float32)
