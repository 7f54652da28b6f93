"""The indexer scores' backward kernels (``jsparse.ops.indexer.backward``) against the
reference's derivative: f32 einsums, the same function (interpreted on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.ops.indexer import api
from jsparse.ops.indexer.backward import BackwardConfig, indexer_scores_vjp_triton
from jsparse.ops.indexer.reference import indexer_scores_einsum
from tests.implementations import running

RNG = np.random.default_rng(11)


def _inputs(t, h, d, s, dtype, ranges, scaled=True):
    q = jnp.asarray(RNG.standard_normal((t, h, d)), dtype)
    w = jnp.asarray(RNG.standard_normal((t, h)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((s, d)), dtype)
    scale = jnp.asarray(RNG.uniform(0.5, 2.0, s), jnp.float32) if scaled else None
    if ranges == "causal":  # the last T of S positions
        start = np.zeros(t, np.int32)
        end = np.arange(1, t + 1, dtype=np.int32) + (s - t)
    elif ranges == "packed":  # three sequences packed, each causal within itself
        cuts = np.sort(RNG.choice(np.arange(1, s), 2, replace=False))
        pos = np.sort(RNG.integers(0, s, t))
        start = np.select([pos < cuts[0], pos < cuts[1]], [0, cuts[0]], cuts[1]).astype(np.int32)
        end = (pos + 1).astype(np.int32)
    else:  # any ranges, some empty
        start = RNG.integers(0, s, t).astype(np.int32)
        end = np.minimum(start + RNG.integers(0, s, t), s).astype(np.int32)
    cotangent = jnp.asarray(RNG.standard_normal((t, s)), jnp.float32)
    return q, w, k, scale, jnp.asarray(start), jnp.asarray(end), cotangent


def _oracle(cotangent, q, w, k, scale, start, end):
    """The reference's derivative: f32 einsums at full precision, widened inputs."""
    f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731

    def scores(q, w, k, scale):
        return indexer_scores_einsum(q, w, k, scale, start, end, f32=True)

    primals = (f32(q), w, f32(k), scale)
    if scale is None:
        _, vjp = jax.vjp(lambda q, w, k: scores(q, w, k, None), *primals[:3])
        return (*vjp(cotangent), None)
    _, vjp = jax.vjp(scores, *primals)
    return vjp(cotangent)


def _compare(got, want, tol):
    """Relative Frobenius error ≤ ``tol`` for each cotangent. Not entry by entry: where a
    logit is within rounding of 0, the ReLU's gate (and so a whole term of that entry's
    sum) can differ between any two arithmetics (run 228: one such term was 5.8e-3 of
    the largest dq entry at 4096 tokens, bf16)."""
    for name, a, b in zip(("dq", "dweights", "dk", "dk_scale"), got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == np.float32 and a.shape == b.shape, name
        size = np.linalg.norm(b)
        assert size > 0, name
        error = float(np.linalg.norm(a - b) / size)
        assert error <= tol, f"{name}: relative error {error:.2e} > {tol:.0e}"


CASES = {
    # T, H, D, S: odd sizes (padded heads and dims, partial tiles), T < 16, several tiles
    "f32-causal": (37, 5, 24, 101, jnp.float32, "causal", True),
    "f32-packed-unscaled": (70, 3, 16, 150, jnp.float32, "packed", False),
    "bf16-any": (37, 5, 24, 101, jnp.bfloat16, "any", True),
    "fp8-causal": (70, 8, 16, 150, jnp.float8_e4m3fn, "causal", False),
    "fp8-one-query": (1, 4, 32, 77, jnp.float8_e4m3fn, "any", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_kernels_equal_the_reference_derivative(case):
    _check_case(case, dq_heads=1)


@pytest.mark.parametrize("case", ["bf16-any", "f32-packed-unscaled"])  # odd H: padded heads
def test_backward_kernels_with_several_heads_a_dq_program(case):
    _check_case(case, dq_heads=2)


def _check_case(case, dq_heads):
    t, h, d, s, dtype, ranges, scaled = CASES[case]
    cotangent, *args = (lambda x: (x[-1], *x[:-1]))(_inputs(t, h, d, s, dtype, ranges, scaled))
    want = _oracle(cotangent, *args)
    # several tiles each way
    cfg = BackwardConfig(block_t=16, block_s=32, head_groups=2, dq_heads=dq_heads)
    with running("triton"):
        got = indexer_scores_vjp_triton(cotangent, *args, cfg=cfg)
    # f32: the same products in another order; bf16 / FP8: the gated cotangent is
    # rounded to bf16 for the second dot (≤ 2^-9 a term; measured 1.1-1.8e-3)
    _compare(got, want, 1e-6 if dtype == jnp.float32 else 4e-3)


@pytest.mark.parametrize(
    "field, value, message",
    [("block_t", 48, "a power of two"), ("block_s", 8, "≥ 16"), ("dq_heads", 0, "≥ 1"),
     ("head_groups", 0, "≥ 1"), ("num_warps", 3, "a power of two"), ("num_stages", 0, "≥ 1")],
)  # fmt: skip
def test_backward_config_refuses_bad_tiles_by_name(field, value, message):
    with pytest.raises(ValueError, match=f"BackwardConfig.{field} must be {message}, got {value}"):
        BackwardConfig(**{field: value})


def test_backward_reads_the_cotangent_only_where_visible():
    # a cotangent that is huge where no key is visible must not leak into the result
    t, h, d, s = 20, 2, 16, 40
    q, w, k, scale, start, end, cotangent = _inputs(t, h, d, s, jnp.float32, "any")
    ids = jnp.arange(s)[None, :]
    visible = (ids >= start[:, None]) & (ids < end[:, None])
    poisoned = jnp.where(visible, cotangent, 1e30)
    want = _oracle(cotangent, q, w, k, scale, start, end)
    with running("triton"):
        got = indexer_scores_vjp_triton(poisoned, q, w, k, scale, start, end)
    _compare(got, want, 1e-6)


def _loss(q, w, k, scale, start, end, target, implementation):
    scores = jsparse.indexer_scores(
        q, w, k, k_scale=scale, kv_start=start, kv_end=end, implementation=implementation
    )
    return jnp.sum(jnp.where(jnp.isfinite(scores), jnp.sin(scores) * target, 0.0))


@pytest.mark.parametrize(
    "dtype, precision, kernels",
    [(jnp.float32, None, True), (jnp.float32, "highest", False), (jnp.bfloat16, None, True)],
    ids=["f32", "f32-highest", "bf16"],
)
def test_grad_through_indexer_scores_uses_the_kernels_except_for_ieee_f32(
    dtype, precision, kernels, monkeypatch
):
    """f32 inputs asked for IEEE dots take the reference's derivative: the kernels' IEEE
    f32 dots were 17× slower than XLA's on an H100 (run 240); with the default tf32x3
    dots they take the kernels."""
    q, w, k, scale, start, end, target = _inputs(19, 4, 16, 45, dtype, "causal")
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2, 3)), static_argnums=7)
    with jax.default_matmul_precision("highest"):
        want = grad(q, w, k, scale, start, end, target, "reference")
    called = []
    real = api._score_backward

    def counting():
        return {n: (lambda *a, n=n, f=f: called.append(n) or f(*a)) for n, f in real().items()}

    monkeypatch.setattr(api, "_score_backward", counting)
    with running("triton") as name, jax.default_matmul_precision(precision):
        got = grad(q, w, k, scale, start, end, target, name)
    assert called == (["triton"] if kernels else [])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        tol = 2e-5 if dtype == jnp.float32 else 1e-2  # bf16: the cotangent's own rounding
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_forward_mode_needs_the_reference_or_ieee_f32():
    q, w, k, scale, start, end, target = _inputs(5, 2, 16, 20, jnp.bfloat16, "causal")
    tangent = jnp.ones_like(q)
    jax.jvp(lambda q: _loss(q, w, k, scale, start, end, target, "reference"), (q,), (tangent,))
    with running("triton") as name, pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: _loss(q, w, k, scale, start, end, target, name), (q,), (tangent,))
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    with running("triton") as name, pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: _loss(q, w, k32, scale, start, end, target, name), (q32,), (q32,))
    # IEEE f32 dots differentiate by the reference's derivative, in either mode
    with running("triton") as name, jax.default_matmul_precision("highest"):
        jax.jvp(lambda q: _loss(q, w, k32, scale, start, end, target, name), (q32,), (q32,))


def test_vmapped_grad_matches_the_reference():
    # the Indexer's training loss vmaps the scores over a batch
    batch = [_inputs(12, 2, 16, 12, jnp.bfloat16, "causal") for _ in range(2)]
    q, w, k, scale, start, end, target = (jnp.stack(x) for x in zip(*batch, strict=True))

    def grads(implementation):
        loss = lambda q, w, k, s: _loss(q, w, k, s, start[0], end[0], target[0], implementation)  # noqa: E731
        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 2))))(q, w, k, scale)

    want = grads("reference")
    with running("triton") as name:
        got = grads(name)
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * np.abs(b).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gpu_backward_at_indexer_training_size(dtype):
    # DeepSeek-V3.2's indexer (64 heads of 128), one causal 2048-token window
    q, w, k, scale, start, end, cotangent = _inputs(2048, 64, 128, 2048, dtype, "causal")
    w = w / 8.0
    want = _oracle(cotangent, q, w, k, scale, start, end)
    with backend.interpret_mode(False):
        got = indexer_scores_vjp_triton(cotangent, q, w, k, scale, start, end)
    _compare(got, want, 4e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_second_order_gradient_through_the_backward_kernels(dtype, monkeypatch):
    """A gradient of a gradient (here a Hessian-vector product in q, then d/dk and
    d/dweights of it) differentiates the backward kernels by the reference's tangent."""
    q, w, k, scale, start, end, target = _inputs(13, 3, 16, 29, dtype, "any")
    v = jnp.asarray(RNG.standard_normal(q.shape), jnp.float32)

    def outer(implementation):
        def inner(q, w, k, scale):
            dq = jax.grad(_loss)(q, w, k, scale, start, end, target, implementation)
            return jnp.sum(dq.astype(jnp.float32) * v)

        return jax.jit(jax.grad(inner, argnums=(1, 2, 3)))(q, w, k, scale)

    want = outer("reference")
    called = []
    real = api._score_backward

    def counting():
        return {n: (lambda *a, n=n, f=f: called.append(n) or f(*a)) for n, f in real().items()}

    monkeypatch.setattr(api, "_score_backward", counting)
    with running("triton") as name:
        got = outer(name)
    assert called == ["triton"]  # the first-order gradient still runs the kernels
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(b).max() > 0
        tol = 1e-4 if dtype == jnp.float32 else 2e-2  # bf16: the cotangent's own rounding
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


def test_relu_derivative_is_one_at_zero_in_every_implementation():
    """Small integers make q·k == 0 exactly for many pairs; every implementation gates
    those pairs open (derivative 1 at 0, documented in ``indexer_scores``)."""
    rng = np.random.default_rng(5)
    t, h, d, s = 9, 3, 8, 40
    q = rng.integers(-1, 2, (t, h, d)).astype(np.float32)
    w = rng.integers(-3, 4, (t, h)).astype(np.float32)
    k = rng.integers(-1, 2, (s, d)).astype(np.float32)
    g = rng.integers(-2, 3, (t, s)).astype(np.float32)
    logits = np.einsum("thd,sd->ths", q, k)
    assert (logits == 0).sum() > 50

    def oracle_dq(gate_at_zero):
        gate = np.where(logits > 0, 1.0, np.where(logits == 0, gate_at_zero, 0.0))
        return np.einsum("ts,th,ths,sd->thd", g, w, gate, k)

    want, closed = oracle_dq(1.0), oracle_dq(0.0)
    assert np.abs(want - closed).max() > 1  # the convention shows in dq

    def dq(implementation):
        loss = lambda q: jnp.sum(jsparse.indexer_scores(q, w, k, implementation=implementation) * g)  # noqa: E731
        return np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(q)))

    np.testing.assert_array_equal(dq("reference"), want)
    with running("triton") as name:
        np.testing.assert_array_equal(dq(name), want)
