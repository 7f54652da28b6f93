"""JSSA for multi-head latent attention (MATH.md §2.5).

An MLA token caches one latent ``c`` (Dc = 512 in DeepSeek-V2/V3) and one RoPE key
``k_r`` (Dr = 64), shared by every head; absorbed queries ``[W_UKᵀ q_nope ; q_rope]``
score ``q_c·c + q_r·k_r``. JSSA-MLA averages the absorbed queries over all heads,
calibrates ``M ∈ R^{r×Dc}`` on the latent part with JSSA's formula, and scores
``(M q̄_c)·(M c) + q̄_r·k_r`` from a cache of ``[M c ; k_r]`` (r + Dr values, FP8).

In the selector interface an MLA layer is one KV head of width D = Dc + Dr
(``q [B, H, D]``, ``k [B, S, 1, D]``), and the map is the block-diagonal
``E = diag(M, I_Dr)``, itself row-orthonormal: ``(E q̄)·(E k)`` is the score above, so
the projected cache, its FP8 scale, appends and the scoring kernel are JSSA's own. One
index list per token serves every head (:func:`jsparse.indexed_mla_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jsparse import _checks
from jsparse.calibration.moments import Moments
from jsparse.selectors.base import register
from jsparse.selectors.jssa import JSSASelector

__all__ = ["JSSAMLASelector", "embed_latent_basis"]


@register
@dataclasses.dataclass(frozen=True)
class JSSAMLASelector(JSSASelector):
    """Scores ``(M q̄_c)·(M c) + q̄_r·k_r``, ``M = TopEig_r(G̃_Q + G̃_K)`` of the latent part.

    Options: ``rank`` (r, latent dims kept; the paper: 64), ``latent_dim`` (Dc), and
    ``jssa``'s ``cache_dtype``, ``normalize``, ``refine_steps`` / ``refine_lr``, which
    apply to ``M``. Params: ``{"basis": [1, r + Dr, D]}``, the block-diagonal map
    ``diag(M, I_Dr)``.
    """

    rank: int = 64
    latent_dim: int = 512

    name: ClassVar[str] = "jssa_mla"

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(
            self, "latent_dim", _checks.check_int("latent_dim", self.latent_dim, self.rank)
        )

    def calibrate_from_moments(self, moments: Moments):
        hkv, d = moments.gram_q.shape[-3], moments.gram_q.shape[-1]
        if hkv != 1:
            raise ValueError(
                f"jssa_mla: moments of {hkv} KV heads; MLA caches one latent row per token, "
                "expected keys [N, 1, D] (all heads share it)"
            )
        dc = self.latent_dim
        if dc > d:
            raise ValueError(f"jssa_mla: latent_dim {dc} exceeds the row width D = {d}")
        latent = Moments(
            moments.gram_q[..., :dc, :dc], moments.gram_k[..., :dc, :dc],
            moments.mean_q[..., :dc], moments.mean_k[..., :dc], moments.n_tokens,
        )  # fmt: skip
        # JSSA's basis (and optional refinement) of the latent block, then diag(M, I).
        basis = super().calibrate_from_moments(latent)["basis"]
        return {"basis": embed_latent_basis(basis, d)}

    def projected_width(self, head_dim: int) -> int:
        """``[M c ; k_r]``: r + (D - Dc) values per token (128 bytes in FP8 for V3)."""
        return self.rank + head_dim - self.latent_dim


def embed_latent_basis(basis, width: int):
    """``diag(M, I)``: ``[*L, r, Dc]`` → ``[*L, r + width - Dc, width]``, the latent basis
    followed by the identity on the RoPE dims (row-orthonormal when ``M`` is)."""
    r, dc = basis.shape[-2:]
    dr = width - dc
    lead = basis.shape[:-2]
    top = jnp.concatenate([basis, jnp.zeros((*lead, r, dr), basis.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dr, width, dc, dtype=basis.dtype), (*lead, dr, width))
    return jnp.concatenate([top, eye], axis=-2)
