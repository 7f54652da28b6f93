"""``SparseAttention``: a Flax NNX attention core that decodes over selected tokens.

It plugs into any model that calls an attention core the way
:mod:`jsparse.models.llama` does::

    core(q [B, T, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv],
         q_positions=[B, T], k_positions=[B, S]) -> [B, T, H, Dv]

with ``k``, ``v`` the whole cache and ``k_positions = -1`` on empty slots. A decode step
(T = 1) lets a selector pick ``budget`` tokens per KV head from the visible cache and
attends only those with :func:`jsparse.indexed_attention`, which reads the selected
rows in place; prefill (T > 1) runs the dense core, as the JSSA paper does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jsparse import _checks
from jsparse.ops.attention import indexed_attention
from jsparse.selectors import Selector, make_selector


class SelectorParams(nnx.Variable):
    """A layer's calibrated selector parameters (bases, maps), as model state: they
    travel with ``nnx.split`` / ``nnx.merge`` and into jitted calls as arguments."""


class SparseAttention(nnx.Module):
    """Decode attention over the ``budget`` tokens per KV head that ``selector`` picks.

    Args:
      selector: a :class:`jsparse.selectors.Selector`, or a name for
        :func:`jsparse.make_selector` (``selector_options`` go with it).
      params: this layer's calibrated parameters (``selector.calibrate`` or
        :func:`jsparse.load_bases`); ``{}`` for selectors that need none (``oracle``,
        ``quest``, ``full``).
      budget: tokens per KV head attended at each decode step (static).
      dense: the core for prefill (T > 1); default the model's exact
        :class:`jsparse.models.llama.DenseCausalAttention`.
      implementation: for :func:`jsparse.indexed_attention` (see :mod:`jsparse.backend`).

    The cache must hold each sequence's visible tokens in its first slots (slot order =
    position order, as :class:`jsparse.models.llama.KVCache` writes them): the
    selectors see a prefix of ``lengths[b]`` tokens. This is checked when the positions
    are concrete.
    """

    def __init__(
        self,
        selector: Selector | str,
        params: Mapping[str, Array] | None,
        budget: int,
        *,
        dense: nnx.Module | None = None,
        implementation: str | Sequence[str] | None = None,
        **selector_options,
    ):
        if isinstance(selector, str):
            selector = make_selector(selector, **selector_options)
        elif selector_options:
            raise ValueError(
                f"selector_options {sorted(selector_options)}: given with a built selector "
                f"({selector.describe()}); pass them to jsparse.make_selector instead"
            )
        if not isinstance(selector, Selector):
            raise ValueError(
                f"selector: got {type(selector).__name__}; expected a Selector or a name"
            )
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 1:
            raise ValueError(f"budget: got {budget!r}; expected an int ≥ 1 (tokens per KV head)")
        if dense is None:
            from jsparse.models.llama import DenseCausalAttention  # the model imports flax too

            dense = DenseCausalAttention()
        self.selector = selector
        self.params = SelectorParams(dict(params or {}))
        self.budget = int(budget)
        self.dense = dense
        self.implementation = implementation

    def __call__(
        self,
        q: Float[Array, "B T H D"],
        k: Float[Array, "B S Hkv D"],
        v: Float[Array, "B S Hkv Dv"],
        *,
        q_positions: Int[Array, "B T"],
        k_positions: Int[Array, "B S"],
    ) -> Float[Array, "B T H Dv"]:
        if q.shape[1] != 1:
            return self.dense(q, k, v, q_positions=q_positions, k_positions=k_positions)
        visible = (k_positions >= 0) & (k_positions <= q_positions[:, :1])
        _check_prefix(visible)
        lengths = jnp.sum(visible, axis=1, dtype=jnp.int32)
        idx = self.selector.select(self.params.get_value(), q[:, 0], k, lengths, self.budget)
        out = indexed_attention(q[:, 0], k, v, idx, implementation=self.implementation)
        return out[:, None]


def _check_prefix(visible):
    seen = _checks.concrete(visible)
    if seen is None:
        return
    count = seen.sum(axis=1)
    prefix = np.arange(seen.shape[1])[None, :] < count[:, None]
    bad = np.flatnonzero((seen != prefix).any(axis=1))
    if bad.size:
        raise ValueError(
            f"k_positions: sequence {bad[0]}'s visible slots are not its first "
            f"{count[bad[0]]} slots; SparseAttention's selectors need the cache in "
            "position order (as KVCache writes it)"
        )
