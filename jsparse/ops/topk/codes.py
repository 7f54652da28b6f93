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
_INF_BITS = np.int32(0x7F800000)
_NEG_ZERO_BITS = np.int32(np.iinfo(np.int32).min)  # 0x80000000


def score_code(scores: jax.Array) -> jax.Array:
    """int32 codes with ``code(a) < code(b)`` iff ``a < b`` (NaN highest, -0 == +0).

    Integer operations only: a float test such as ``x == 0`` reads subnormals as zero
    where the runtime flushes them (XLA's CPU does, a GPU by default does not), which
    gave subnormal scores different codes, and a different Top-K, on the two."""
    bits = _canonical_bits(scores)
    # Non-negative floats already order as int32; negative ones order in reverse, so
    # flip their 31 magnitude bits (the arithmetic shift yields the all-ones mask).
    return bits ^ ((bits >> 31) & _LOW31)


def canonical_scores(scores: jax.Array) -> jax.Array:
    """float32 ``scores`` with -0 as +0 and every NaN as the one positive NaN: the
    scores as :func:`score_code` ranks them, for a selection that compares floats.
    ``lax.top_k`` orders by the sign bit too, so it puts -0 below +0 and a NaN with its
    sign bit set below -inf, and XLA's CPU makes inf - inf such a NaN."""
    return jax.lax.bitcast_convert_type(_canonical_bits(scores), jnp.float32)


def _canonical_bits(scores: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    bits = jnp.where(bits == _NEG_ZERO_BITS, 0, bits)  # -0.0 is +0.0
    return jnp.where((bits & _LOW31) > _INF_BITS, _CANONICAL_NAN_BITS, bits)  # any NaN


def code_to_score(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`score_code` (NaN comes back canonical, -0 as +0).

    ``EMPTY_CODE`` maps to ``-inf``, the score of an empty slot.
    """
    codes = codes.astype(jnp.int32)
    bits = codes ^ ((codes >> 31) & _LOW31)
    scores = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(codes == EMPTY_CODE, -jnp.inf, scores)
