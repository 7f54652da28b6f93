"""The shared input checks, on their own: what they accept and how they word a refusal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsparse import _checks


def test_cache_room_accepts_a_cache_that_fills_exactly():
    _checks.check_cache_room(np.array([3, 0]), 5, 8)  # 3 + 5 = 8: full, not past
    _checks.check_cache_room(jnp.int32(6), 2, 8)  # one length for all sequences


@pytest.mark.parametrize(
    "lengths, t, match",
    [(np.array([3, 7]), 2, r"lengths \[3, 7\] \+ T = 2 new tokens exceed max_len = 8"),
     (jnp.int32(8), 1, r"lengths 8 \+ T = 1 new tokens exceed max_len = 8")],
)  # fmt: skip
def test_cache_room_names_the_lengths_and_the_room(lengths, t, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_cache_room(lengths, t, 8)


def test_cache_room_under_jit_still_refuses_more_tokens_than_rows():
    # Traced lengths cannot be checked, but T > max_len is wrong whatever they hold.
    jax.jit(lambda n: _checks.check_cache_room(n, 8, 8) or n)(jnp.int32(0))
    with pytest.raises(ValueError, match=r"lengths \? \+ T = 9 new tokens exceed max_len = 8"):
        jax.jit(lambda n: _checks.check_cache_room(n, 9, 8) or n)(jnp.int32(0))
