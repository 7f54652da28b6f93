"""Interpreted Pallas calls (``jsparse._pallas``): compiled once per distinct kernel and
called from the enclosing program, with the inline call's values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jsparse import _pallas


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    """Each test counts entries from an empty cache (a worker's may be full)."""
    monkeypatch.setattr(_pallas, "_OUTLINED", type(_pallas._OUTLINED)())


def _affine_kernel(x_ref, o_ref, *, a):
    o_ref[...] = x_ref[...] * a + 1.0


def _affine(x, a, interpret=True):
    kernel = functools.partial(_affine_kernel, a=a)
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if interpret is None:  # the plain Pallas call, inline
        return pl.pallas_call(kernel, out_shape=shape, interpret=True)(x)
    return _pallas.pallas_call(kernel, out_shape=shape, interpret=interpret)(x)


def test_a_kernel_is_compiled_once_for_every_program_that_calls_it():
    x = jnp.arange(8, dtype=jnp.float32)
    first = jax.jit(lambda x: _affine(x, 2.0) + 5.0)(x)
    second = jax.jit(lambda x: jnp.sum(_affine(x, 2.0)))(x)  # another program, same kernel
    assert len(_pallas._OUTLINED) == 1
    np.testing.assert_array_equal(first, x * 2.0 + 1.0 + 5.0)
    assert float(second) == float(jnp.sum(x * 2.0 + 1.0))


def test_kernels_that_differ_in_a_constant_are_told_apart():
    x = jnp.arange(8, dtype=jnp.float32)
    np.testing.assert_array_equal(_affine(x, 2.5), x * 2.5 + 1.0)
    np.testing.assert_array_equal(_affine(x, 3.5), x * 3.5 + 1.0)
    assert len(_pallas._OUTLINED) == 2


def test_outlined_calls_equal_the_inline_call_under_jit_and_vmap():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 16), jnp.float32)
    want = jax.vmap(lambda r: _affine(r, 0.1, interpret=None))(x)
    got = jax.jit(jax.vmap(lambda r: _affine(r, 0.1)))(x)
    np.testing.assert_array_equal(got, want)


def test_compiled_calls_are_not_outlined():
    # interpret=False builds the Triton call; only its trace is checked (no GPU here).
    x = jax.ShapeDtypeStruct((16,), jnp.float32)
    text = str(jax.make_jaxpr(lambda x: _affine(x, 2.0, interpret=False))(x))
    assert "pallas_call" in text and "callback" not in text
    assert not _pallas._OUTLINED


def test_the_switch_inlines_interpreted_calls(monkeypatch):
    monkeypatch.setenv(_pallas.INLINE_ENV, "1")
    x = jnp.arange(8, dtype=jnp.float32)
    text = str(jax.make_jaxpr(lambda x: _affine(x, 4.5))(x))
    assert "pallas_call" in text and "callback" not in text
    np.testing.assert_array_equal(_affine(x, 4.5), x * 4.5 + 1.0)
    assert not _pallas._OUTLINED


def test_the_least_recently_used_kernels_go_past_the_bound(monkeypatch):
    monkeypatch.setattr(_pallas, "OUTLINED_KEPT", 2)
    x = jnp.arange(8, dtype=jnp.float32)
    for a in (5.5, 6.5, 5.5, 7.5):  # 5.5 used again before 7.5 comes: 6.5 goes
        np.testing.assert_array_equal(_affine(x, a), x * a + 1.0)
    kept = dict(_pallas._OUTLINED)
    assert len(kept) == 2
    np.testing.assert_array_equal(_affine(x, 5.5), x * 5.5 + 1.0)
    assert dict(_pallas._OUTLINED) == kept  # 5.5 was kept: a hit, nothing evicted
    np.testing.assert_array_equal(_affine(x, 6.5), x * 6.5 + 1.0)
    assert dict(_pallas._OUTLINED) != kept  # 6.5 had gone: compiled again
