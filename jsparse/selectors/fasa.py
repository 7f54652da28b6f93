"""FASA: r original channels, kept as whole RoPE pairs (MATH.md §2.7)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jsparse.calibration.moments import Moments
from jsparse.selectors.base import ProjectedSelector, register

__all__ = ["FASASelector", "rope_pairs"]


def rope_pairs(head_dim: int, layout: str) -> jnp.ndarray:
    """``[D/2, 2]`` channel pairs that RoPE rotates together."""
    half = head_dim // 2
    i = jnp.arange(half)
    if layout == "rotate_half":  # Llama / Hugging Face: (i, i + D/2)
        return jnp.stack([i, i + half], axis=1)
    if layout == "interleaved":  # GPT-J / llama.cpp: (2i, 2i + 1)
        return jnp.stack([2 * i, 2 * i + 1], axis=1)
    raise ValueError(f"rope_layout: got {layout!r}; expected 'rotate_half' or 'interleaved'")


@register
@dataclasses.dataclass(frozen=True)
class FASASelector(ProjectedSelector):
    """Keeps the ``rank / 2`` RoPE pairs of largest calibrated contribution to ``q̄·k``.

    A pair ``p`` contributes ``q̄_p·k_p`` to the score; its calibrated contribution is the
    mean square over the product of the query and key distributions,
    ``E[(q̄_p·k_p)²] = tr(G_Q[p,p] G_K[p,p])`` (2×2 blocks of the second moments). Pairs
    are kept whole because RoPE rotates the two channels of a pair together: one channel
    alone carries a position-dependent mix of the pair's content. Params:
    ``{"selection": [Hkv, R, D]}`` (rows of the identity) and ``{"channels": [Hkv, R]}``.
    """

    rope_layout: str = "rotate_half"

    name: ClassVar[str] = "fasa"

    def __post_init__(self):
        super().__post_init__()
        if self.rank % 2:
            raise ValueError(f"fasa: rank must be even (whole RoPE pairs), got {self.rank}")
        rope_pairs(2, self.rope_layout)

    def pair_contribution(self, moments: Moments) -> jnp.ndarray:
        """``[*L, Hkv, D/2]`` mean-square contribution of each RoPE pair to ``q̄·k``."""
        d = moments.gram_q.shape[-1]
        pairs = rope_pairs(d, self.rope_layout)
        gq = moments.gram_q[..., pairs[:, :, None], pairs[:, None, :]]  # [Hkv, D/2, 2, 2]
        gk = moments.gram_k[..., pairs[:, :, None], pairs[:, None, :]]
        return jnp.einsum("...pij,...pji->...p", gq, gk, precision=jax.lax.Precision.HIGHEST)

    def calibrate_from_moments(self, moments: Moments):
        d = moments.gram_q.shape[-1]
        if self.rank > d:
            raise ValueError(f"fasa: rank {self.rank} exceeds head_dim {d}")
        pairs = rope_pairs(d, self.rope_layout)
        _, top = jax.lax.top_k(self.pair_contribution(moments), self.rank // 2)  # [Hkv, R/2]
        channels = jnp.sort(pairs[top].reshape(*top.shape[:-1], -1), axis=-1).astype(jnp.int32)
        selection = jax.nn.one_hot(channels, d, dtype=jnp.float32)  # [*L, Hkv, R, D]
        return {"channels": channels, "selection": selection}

    def maps(self, params):
        return params["selection"], params["selection"]
