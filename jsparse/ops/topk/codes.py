"""Order-preserving int32 codes of float32 scores.

Selection compares integers, never floats: the code of a score is an int32 whose
signed order is the float order, with two canonicalisations so that "equal score"
is one code (MATH.md §1.9, "records store an order-preserving integer code"):

* ``-0.0`` and ``+0.0`` are one score (IEEE says they are equal);
* every NaN is one value that ranks above ``+inf``, so a NaN score is never hidden
  by selection: it surfaces at the top of the result, where a caller sees it.

Order: ``EMPTY_CODE`` (no candidate) < code(-inf) < ... < code(+inf) < code(NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EMPTY_CODE = np.int32(np.iinfo(np.int32).min)
"""Code of an empty slot; below the code of every real score, -inf included."""

_CANONICAL_NAN_BITS = np.int32(0x7FC00000)
_LOW31 = np.int32(0x7FFFFFFF)


def score_code(scores: jax.Array) -> jax.Array:
    """int32 codes with ``code(a) < code(b)`` iff ``a < b`` (NaN highest, -0 == +0)."""
    x = scores.astype(jnp.float32)
    # -0.0 becomes +0.0 (not via `x + 0.0`: compilers may fold that away).
    x = jnp.where(x == 0, jnp.float32(0.0), x)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    bits = jnp.where(jnp.isnan(x), _CANONICAL_NAN_BITS, bits)
    # Non-negative floats already order as int32; negative ones order in reverse, so
    # flip their 31 magnitude bits (the arithmetic shift yields the all-ones mask).
    return bits ^ ((bits >> 31) & _LOW31)


def code_to_score(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`score_code` (NaN comes back canonical, -0 as +0).

    ``EMPTY_CODE`` maps to ``-inf``, the score of an empty slot.
    """
    codes = codes.astype(jnp.int32)
    bits = codes ^ ((codes >> 31) & _LOW31)
    scores = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(codes == EMPTY_CODE, -jnp.inf, scores)
