"""Dispatch state and the jits above it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.selectors import base, make_selector


def test_jit_per_mode_traces_once_per_mode():
    """A function jitted above dispatch sees the mode it is called in, not the one of
    its first trace (plain ``jax.jit`` served the first trace to both)."""
    seen = []

    @backend.jit_per_mode(static_argnames="k")
    def mode_plus(x, k):
        seen.append(backend.is_interpret())
        return x + int(backend.is_interpret()) + k

    assert int(mode_plus(jnp.int32(0), k=10)) == 10
    with backend.interpret_mode(True):
        assert int(mode_plus(jnp.int32(0), k=10)) == 11
    assert int(mode_plus(jnp.int32(0), k=10)) == 10
    assert seen == [False, True]  # each mode traced once, then its own cache


def test_select_outside_interpret_mode_then_inside_runs_the_kernels(monkeypatch):
    """The selector's jitted select once reused a reference trace inside interpret mode,
    so a kernel test after a reference call of the same shapes compared the reference
    with itself."""
    kernels_seen = []
    real = base.top_budget

    def spy(*args, **kwargs):
        kernels_seen.append(base._selection_kernels())
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "top_budget", spy)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 61, 1, 8)), jnp.float32)  # a shape of its own
    lengths = jnp.asarray([61], jnp.int32)
    sel = make_selector("oracle")
    want = sel.select({}, q, k, lengths, 5)
    with backend.interpret_mode(True):
        got = sel.select({}, q, k, lengths, 5)
    np.testing.assert_array_equal(got, want)
    assert kernels_seen == [backend.has_nvidia_gpu(), True]


@pytest.mark.parametrize(
    "implementation, error, message",
    [
        ("cuda", ValueError, r"implementation: got 'cuda'; expected one of"),
        (["reference", "cuda"], ValueError, r"implementation: got 'cuda'"),
        ([], ValueError, "empty sequence"),
        (3, ValueError, r"implementation: got 3; expected None, a name or a sequence"),
        ([3], ValueError, r"implementation: got \[3\]"),
        ("mosaic", NotImplementedError, "'mosaic' is not implemented by this op; it has"),
        (["mosaic"], NotImplementedError, r"\['mosaic'\] is not implemented by this op"),
    ],
)
def test_implementation_names_are_checked(implementation, error, message):
    """A name outside the library is a ValueError; a library name this op does not
    implement is valid input it does not support (NotImplementedError alone, skipped in
    a sequence: ``["mosaic", "triton", "reference"]`` raised a ValueError on every op
    without a Mosaic kernel); ``implementation=3`` raised a TypeError."""
    with pytest.raises(error, match=message):
        backend.resolve(implementation, ("triton", "reference"))


@pytest.mark.parametrize("op", ["indexer_topk", "indexer_topk_batch"])
def test_xla_checks_the_implementation_it_ignores(op):
    # method="xla" never dispatches, and let a misspelt name pass without a word.
    q, w = jnp.ones((2, 4, 8), jnp.float32), jnp.ones((2, 4), jnp.float32)
    if op == "indexer_topk":
        k = jnp.ones((16, 8), jnp.float32)
        call = functools.partial(jsparse.indexer_topk, q, w, k, 4, method="xla")
    else:
        k = jnp.ones((2, 16, 8), jnp.float32)
        lengths = jnp.asarray([16, 3], jnp.int32)
        call = functools.partial(
            jsparse.indexer_topk_batch, q, w, k, 4, lengths=lengths, method="xla"
        )
    assert call(implementation="reference").indices.shape == (2, 4)
    with pytest.raises(ValueError, match="implementation: got 'tritn'"):
        call(implementation="tritn")


def test_a_sequence_skips_names_this_op_does_not_implement():
    names, may_fall_back = backend.resolve(
        ["mosaic", "triton", "reference"], ("triton", "reference")
    )
    assert names == ["triton", "reference"] and may_fall_back
    q = jnp.ones((2, 4, 8), jnp.float32)
    k = jnp.ones((2, 16, 2, 8), jnp.float32)
    idx = jnp.zeros((2, 2, 3), jnp.int32)
    want = jsparse.indexed_attention(q, k, k, idx, implementation="reference")
    got = jsparse.indexed_attention(q, k, k, idx, implementation=["mosaic", "reference"])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _mode_ops():
    rng = np.random.default_rng(0)
    scores = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
    q, w = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32), jnp.ones((2, 4), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, 40, 16)), jnp.float32)
    qa, ka = jnp.ones((2, 4, 8), jnp.float32), jnp.ones((2, 16, 2, 8), jnp.float32)
    return {
        "topk": lambda: jsparse.topk(scores, 4, implementation="triton"),
        "indexer_topk": lambda: jsparse.indexer_topk(q, w, keys, 4, implementation="triton"),
        "indexer_topk_batch": lambda: jsparse.indexer_topk_batch(
            q, w, cache, 4, lengths=jnp.asarray([40, 7], jnp.int32), implementation="triton"
        ),
        "indexed_attention": lambda: jsparse.indexed_attention(
            qa, ka, ka, jnp.zeros((2, 2, 3), jnp.int32), implementation="triton"
        ),
    }


@pytest.mark.parametrize("op", sorted(_mode_ops()))
def test_a_compiled_call_after_an_interpreted_one_compiles(op, monkeypatch):
    """The ops' own jits kept one trace for both modes: on a GPU, a compiled call after
    an interpreted one of the same shapes ran the interpreter (and an interpreted test
    after a compiled call, the compiled kernels). Here the GPU is pretended: the second
    call must try to compile, which a CPU refuses."""
    if backend.has_nvidia_gpu():
        pytest.skip("pretends a GPU on a CPU machine")
    call = _mode_ops()[op]
    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    with backend.interpret_mode(True):
        jax.block_until_ready(call())
    with pytest.raises(Exception, match=r"[Ii]nterpret mode"):
        jax.block_until_ready(call())
