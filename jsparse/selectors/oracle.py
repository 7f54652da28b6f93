"""oracle: exact top-budget of the full-dimensional group-mean scores (MATH.md §2.7)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jsparse.selectors.base import Selector, register

__all__ = ["OracleSelector"]


@register
@dataclasses.dataclass(frozen=True)
class OracleSelector(Selector):
    """Scores ``q̄·k`` with the full keys: the set every approximate selector aims at.

    It reads the whole key cache (``2·D`` bytes per token per KV head in BF16) and keeps
    no extra memory; ``bytes_per_token`` reports 0 extra bytes.
    """

    name: ClassVar[str] = "oracle"

    def scores(self, params, q, k, lengths):
        hkv = k.shape[2]
        qm = q.astype(jnp.float32).reshape(q.shape[0], hkv, -1, q.shape[-1]).mean(axis=2)
        return jnp.einsum(
            "bhd,bshd->bhs", qm, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
