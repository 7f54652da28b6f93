"""Derivatives through the ops (``jsparse.backend``'s module doc, ``jsparse._autodiff``).

* Smooth ops (scores, attention, the projected step) differentiate like their jnp
  reference, forward and reverse mode, jitted and vmapped.
* The Top-K ops' scores differentiate as the scores of exactly the returned ids,
  checked against an einsum oracle at those ids, for every method and implementation,
  in reverse and forward mode; a gradient through the ids alone works wherever the reference's does.
* A kernel dispatched with no derivative refuses by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.certified import dosa_topk
from jsparse.ops.projected import projected_scores, projected_step
from jsparse.ops.topk import topk_prefix
from tests.implementations import running

RNG = np.random.default_rng(7)
T, H, D, S, K = 3, 4, 16, 37, 5
B, HKV, G, DV, N, R = 2, 2, 3, 8, 6, 4


def _array(shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


Q, W, KEYS = _array((T, H, D)), _array((T, H)), _array((S, D))
K_SCALE = jnp.asarray(RNG.uniform(0.5, 2.0, S), jnp.float32)
QA, KA, VA = _array((B, HKV * G, D)), _array((B, S, HKV, D)), _array((B, S, HKV, DV))
LISTS = jnp.asarray(RNG.integers(-1, S, (B, HKV, N)), jnp.int32)  # -1: empty slots
MLA_CACHE = _array((B, S, D))
Q_PROJ, VALUES = _array((B, HKV, R)), _array((B, S, HKV, R))
MAPS = _array((HKV, R, D)), _array((HKV, R, D))
NOT_FINITE = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)  # noqa: E731


@pytest.fixture(params=["reference", "triton"])
def implementation(request):
    """Either implementation; the Pallas one interpreted on the CPU, compiled on a GPU."""
    with running(request.param) as name:
        yield name


def _grad(loss, x, implementation):
    return np.asarray(jax.jit(jax.grad(lambda x: loss(x, implementation)))(x))


def _attention(q=QA, k=KA, v=VA, i=None):
    return jsparse.indexed_attention(q, k, v, LISTS, implementation=i)


def _mla(q=QA, cache=MLA_CACHE, i=None):
    return jsparse.indexed_mla_attention(
        q, cache, LISTS[:, 0], latent_dim=12, scale=0.3, implementation=i
    )


def _step(q, i):
    q_proj, values = projected_step(q, KA[:, 3], *MAPS, VALUES, jnp.ones((B, HKV)),
                                    jnp.array([5, 9]), implementation=i)  # fmt: skip
    return q_proj.sum() + jnp.sin(values).sum()


ENDS = jnp.array([30, 37, 9], jnp.int32)
SMOOTH = {
    "indexer_scores/q": (lambda x, i: jsparse.indexer_scores(x, W, KEYS, implementation=i), Q),
    "indexer_scores/k": (
        lambda x, i: jsparse.indexer_scores(Q, W, x, kv_end=ENDS, implementation=i),
        KEYS,
    ),
    "indexed_attention/q": (lambda x, i: _attention(q=x, i=i), QA),
    "indexed_attention/k": (lambda x, i: _attention(k=x, i=i), KA),
    "indexed_attention/v": (lambda x, i: _attention(v=x, i=i), VA),
    "indexed_attention/q-bf16": (
        lambda x, i: _attention(x, KA.astype(jnp.bfloat16), VA.astype(jnp.bfloat16), i),
        QA.astype(jnp.bfloat16),
    ),
    "indexed_mla_attention/q": (lambda x, i: _mla(q=x, i=i), QA),
    "indexed_mla_attention/cache": (lambda x, i: _mla(cache=x, i=i), MLA_CACHE),
    "projected_scores/values": (lambda x, i: projected_scores(Q_PROJ, x, implementation=i), VALUES),
    "projected_step/q": (_step, QA),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SMOOTH))
def test_smooth_ops_differentiate_like_their_reference(case, kernel_impl):
    op, x = SMOOTH[case]
    loss = lambda x, i: jnp.sum(jnp.sin(NOT_FINITE(op(x, i))))  # noqa: E731
    ref, kernel = _grad(loss, x, "reference"), _grad(loss, x, kernel_impl)
    assert kernel.dtype == ref.dtype == x.dtype and np.abs(ref.astype(np.float32)).max() > 0
    tol = 1e-2 if x.dtype == jnp.bfloat16 else 2e-5
    ref, kernel = ref.astype(np.float32), kernel.astype(np.float32)
    np.testing.assert_allclose(kernel, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_forward_mode_and_vmap_through_a_smooth_kernel(kernel_impl):
    tangent = _array(QA.shape)
    ref = jax.jvp(lambda q: _attention(q=q, i="reference"), (QA,), (tangent,))
    kernel = jax.jvp(lambda q: _attention(q=q, i=kernel_impl), (QA,), (tangent,))
    for a, b in zip(kernel, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    stacked = jnp.stack([QA, 2 * QA])
    rows = {
        i: jax.vmap(jax.grad(lambda q, i=i: jnp.sum(_attention(q=q, i=i) ** 2)))(stacked)
        for i in ("reference", kernel_impl)
    }
    np.testing.assert_allclose(rows[kernel_impl], rows["reference"], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("op", ["indexer_scores_reference", "score_keys_reference"])
def test_the_scorer_reference_differentiates_like_its_loops(op):
    """The scorer reference takes its derivative from a matmul formulation (its loops
    would store every step); it must equal autodiff of those loops, for every float
    input, both modes, with a key scale and ranges (or listed ids, -1 included)."""
    from jsparse.ops.indexer import reference

    starts = jnp.array([0, 4, 9], jnp.int32)
    ids = reference.visible_key_ids(starts, ENDS, S)
    if op == "score_keys_reference":  # any listed ids, repeats and empty slots included
        ids = jnp.asarray(RNG.integers(-1, S, (T, 11)), jnp.int32)
    primals = (Q, W, KEYS, K_SCALE)
    tangents = tuple(_array(x.shape) for x in primals)

    def through_rule(q, w, k, scale):
        if op == "indexer_scores_reference":
            return reference.indexer_scores_reference(q, w, k, scale, starts, ENDS)
        return reference.score_keys_reference(q, w, k, ids, scale)

    def through_loops(q, w, k, scale):
        return reference._by_query_chunks(reference._score_chunk, q, w, k, ids, scale, 64)

    want = jax.jvp(through_loops, primals, tangents)
    got = jax.jvp(through_rule, primals, tangents)
    np.testing.assert_array_equal(got[0], want[0])  # the loops' values
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(want[1])).max() > 0
    loss = lambda f: lambda *x: jnp.sum(jnp.sin(NOT_FINITE(f(*x))))  # noqa: E731
    grad = lambda f: jax.grad(loss(f), argnums=(0, 1, 2, 3))(*primals)  # noqa: E731
    for g, w in zip(grad(through_rule), grad(through_loops), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def _oracle(q, weights, keys, scale, ids):
    """Σ_h w·relu(q·k)·scale of the given rows ([T, N, D] keys), -1 ids: 0. In f32: a
    GPU's default f32 matmul is TF32, 1e-3 off (run 225)."""
    f32, highest = jnp.float32, jax.lax.Precision.HIGHEST
    logits = jnp.einsum("thd,tnd->thn", q.astype(f32), keys.astype(f32), precision=highest)
    relu = jnp.where(logits < 0, 0.0, logits)  # the library's ReLU: derivative 1 at 0
    scores = jnp.einsum("th,thn->tn", weights, relu, precision=highest)
    scores = scores * scale
    return jnp.where(ids >= 0, scores, 0.0)


def _shared_keys(ids, q, k):
    safe = jnp.maximum(ids, 0)
    return _oracle(q, W, k[safe], K_SCALE[safe], ids)


BATCH_KEYS = _array((B, S, D))
# a pool of 8-key pages, the table scrambled (page 7 of 0..9 unused, the last page absent)
PAGES = np.array([[5, 0, 8, 2, 9], [1, 6, 3, 4, -1]], np.int32)


def _paged(k):
    """The dense [B, S, D] keys written into the pool through PAGES."""
    pages = jnp.pad(k, ((0, 0), (0, 5 * 8 - S), (0, 0))).reshape(B, 5, 8, D)
    absent_last = np.where(PAGES < 0, 10, PAGES)[:, :, None]  # dropped, not wrapped to page 9
    return jnp.zeros((10, 8, D)).at[absent_last, np.arange(8)].set(pages, mode="drop")


LENGTHS = jnp.array([S, 20])


def _batch_keys(ids, q, k):
    safe = jnp.maximum(ids, 0)
    return _oracle(q[:B], W[:B], jnp.take_along_axis(k, safe[..., None], 1), 1.0, ids)


def _shared(method):
    def select(q, k, i):
        return jsparse.indexer_topk(q, W, k, K, k_scale=K_SCALE, method=method,
                                    kv_end=jnp.array([S, 30, 2]), implementation=i)  # fmt: skip

    return select, _shared_keys


def _dosa_topk(q, k, i):
    return dosa_topk(q, W, k, K, k_scale=K_SCALE, implementation=i)


def _batch(paged):
    def select(q, k, i):
        cache, table = (_paged(k), PAGES) if paged else (k, None)
        return jsparse.indexer_topk_batch(q[:B], W[:B], cache, K, lengths=LENGTHS,
                                          page_table=table, implementation=i)  # fmt: skip

    return select, _batch_keys


def _decode(q, k, i):
    return jsparse.indexer_topk_decode(q[:B], W[:B], k, K, lengths=LENGTHS, implementation=i)[0]


SELECTIONS = {
    **{f"indexer_topk[{m}]": _shared(m) for m in ("xla", "base", "full", "dense", "dosa")},
    "indexer_topk_batch/dense": _batch(False),
    "indexer_topk_batch/paged": _batch(True),
    "indexer_topk_decode": (_decode, _batch_keys),
}


def _assert_scores_differentiate_at_the_returned_ids(select, oracle, impl, tol=1e-5):
    keys = BATCH_KEYS if oracle is _batch_keys else KEYS
    ids = select(Q, keys, impl).indices

    def loss(q, k):
        return jnp.sum(jnp.sin(NOT_FINITE(select(q, k, impl).scores)))

    def expected(q, k):
        return jnp.sum(jnp.where(ids >= 0, jnp.sin(oracle(ids, q, k)), 0.0))

    got, want = jax.grad(loss, (0, 1))(Q, keys), jax.grad(expected, (0, 1))(Q, keys)
    for g, e in zip(got, want, strict=True):
        assert np.abs(np.asarray(e)).max() > 0
        np.testing.assert_allclose(g, e, rtol=0, atol=tol * np.abs(np.asarray(e)).max())


@pytest.mark.parametrize("op", sorted(SELECTIONS))
def test_topk_scores_differentiate_as_the_scores_of_the_returned_ids(op, implementation):
    # The xla baseline is what a JAX user writes: einsums at XLA's default precision,
    # forward and backward, which on a GPU is TF32 (~1e-3 a product; run 228: up to
    # 2.5e-3 of the largest entry against the f32 oracle). A wrong id is off by O(1).
    tol = 1e-2 if op == "indexer_topk[xla]" and backend.has_nvidia_gpu() else 1e-5
    _assert_scores_differentiate_at_the_returned_ids(*SELECTIONS[op], implementation, tol)


def test_dosa_topk_scores_differentiate_likewise():
    # its own wrapper, the same for every implementation (indexer_topk[dosa] runs the kernels)
    _assert_scores_differentiate_at_the_returned_ids(_dosa_topk, _shared_keys, "reference")


FORWARD_MODE = ["indexer_topk[dosa]", "indexer_topk_batch/paged", "indexer_topk_decode"]


@pytest.mark.parametrize("op", FORWARD_MODE)
def test_topk_scores_have_a_forward_mode_derivative_too(op, kernel_impl):
    """jax.jvp sees the same rule: the tangent of scoring the returned ids again."""
    select, oracle = SELECTIONS[op]
    keys = BATCH_KEYS if oracle is _batch_keys else KEYS
    ids = select(Q, keys, kernel_impl).indices
    tangents = _array(Q.shape), _array(keys.shape)
    got = jax.jvp(lambda q, k: NOT_FINITE(select(q, k, kernel_impl).scores), (Q, keys), tangents)
    want = jax.jvp(lambda q, k: oracle(ids, q, k), (Q, keys), tangents)
    assert np.abs(np.asarray(want[1])).max() > 0
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5 * np.abs(want[1]).max())


def test_reverse_mode_keeps_the_inputs_not_the_rows_of_every_selected_id():
    """Between its passes a selection's gradient holds its inputs and [T, K] arrays (the
    ids), never the [T, K, D] rows or [T, H, K] logits of its tangent: the rescoring
    reference keeps none (a naive gather-and-einsum rescorer fails this)."""
    t, h, d, s, k = 16, 8, 32, 512, 128
    q, w, keys = _array((t, h, d)), _array((t, h)), _array((s, d))

    def scores(q, w, keys):
        return jsparse.indexer_topk(q, w, keys, k, implementation="reference").scores

    _, pullback = jax.vjp(scores, q, w, keys)
    held = [x.size for x in jax.tree.leaves(pullback)]
    assert max(held) == s * d  # the keys themselves
    assert sum(held) < q.size + w.size + keys.size + 4 * t * k


@pytest.mark.parametrize("op", ["indexer_topk[dosa]", "indexer_topk_batch/paged"])
def test_a_gradient_through_the_ids_alone(op, kernel_impl):
    """A sparse step's use: gather the selected keys, differentiate the rest."""
    select, _ = SELECTIONS[op]
    keys = KEYS if "dosa" in op else BATCH_KEYS

    def loss(q, i):
        ids = select(q, keys, i).indices
        safe = jnp.maximum(ids, 0)
        rows = jnp.take_along_axis(keys, safe[..., None], 1) if keys.ndim == 3 else keys[safe]
        return jnp.sum(jnp.where(ids[..., None] >= 0, rows, 0.0).sum(1) * q[: ids.shape[0], 0])

    grads = [jax.grad(loss)(Q, i) for i in ("reference", kernel_impl)]
    assert np.abs(np.asarray(grads[0])).max() > 0
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-6, atol=1e-6)


def test_topk_values_differentiate_as_the_selected_entries(implementation):
    impl = implementation
    scores = _array((4, S))
    lengths = jnp.array([S, 3])
    for select in (
        lambda s: jsparse.topk(s, K, kv_start=jnp.array([0, 2, 5, 36]), implementation=impl),
        lambda s: topk_prefix(s, lengths, K, implementation=impl),
    ):
        ids = select(scores)[0]
        got = jax.grad(lambda s, f=select: jnp.sum(jnp.sin(NOT_FINITE(f(s)[1]))))(scores)
        want = np.zeros(scores.shape, np.float32)
        for t, row in enumerate(np.asarray(ids)):
            for i in row[row >= 0]:
                want[t, i] = np.cos(float(scores[t, i]))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        tangent = _array(scores.shape)
        _, got = jax.jvp(lambda s, f=select: f(s)[1], (scores,), (tangent,))
        want = np.where(ids >= 0, np.take_along_axis(tangent, np.maximum(ids, 0), 1), 0)
        np.testing.assert_array_equal(got, want)


def test_a_kernel_without_a_derivative_refuses_by_name(interpret):
    table = {"triton": lambda x: x * 2, "reference": lambda x: x * 2}
    call = lambda x: backend.dispatch("toy_op", table, "triton", x)  # noqa: E731
    np.testing.assert_array_equal(call(jnp.ones(3)), 2 * np.ones(3))
    with pytest.raises(
        NotImplementedError, match="toy_op: the 'triton' kernels have no derivative"
    ):
        jax.grad(lambda x: call(x).sum())(jnp.ones(3))
    # nothing is raised where no gradient reaches the kernel's outputs
    assert (
        jax.grad(lambda x: jnp.sum(x) + 0 * jax.lax.stop_gradient(call(x)).sum())(jnp.ones(3)).sum()
        == 3
    )
    # with a declared derivative, the reference's
    smooth = lambda x: backend.dispatch("toy_op", table, "triton", x, differentiable=True)  # noqa: E731
    np.testing.assert_array_equal(jax.grad(lambda x: smooth(x).sum())(jnp.ones(3)), 2 * np.ones(3))


@pytest.mark.parametrize("op", ["indexer_topk", "indexer_topk_batch", "indexed_attention", "mla"])
def test_gradients_lower_to_cuda(op, monkeypatch):
    """The differentiated step still runs the kernels forward on a GPU: lowered for an
    H200, the gradient holds the Triton launch and lowers (no interpret-only path)."""
    from jsparse.testing import lower_for_h200

    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    bf16 = jnp.bfloat16
    if op == "indexer_topk":

        def loss(q, w, k):
            return jnp.sum(NOT_FINITE(jsparse.indexer_topk(q, w, k, 64).scores))

        args = (_array((2, 8, 64), bf16), _array((2, 8)), _array((1024, 64), bf16))
    elif op == "indexer_topk_batch":

        def loss(q, w, k):
            lengths = jnp.array([1000, 600], jnp.int32)
            return jnp.sum(
                NOT_FINITE(jsparse.indexer_topk_batch(q, w, k, 64, lengths=lengths).scores)
            )

        args = (_array((2, 8, 64), bf16), _array((2, 8)), _array((2, 1024, 64), bf16))
    elif op == "indexed_attention":

        def loss(q, k, v):
            return jnp.sum(jsparse.indexed_attention(q, k, v, LISTS) ** 2)

        args = (
            _array((B, 8, 64), bf16),
            _array((B, 512, HKV, 64), bf16),
            _array((B, 512, HKV, 64), bf16),
        )
    else:

        def loss(q, cache):
            return jnp.sum(
                jsparse.indexed_mla_attention(q, cache, LISTS[:, 0], latent_dim=64, scale=0.1) ** 2
            )

        args = (_array((B, 16, 96), bf16), _array((B, 512, 96), bf16))
    text = lower_for_h200(jax.grad(loss, range(len(args))), *args).as_text()
    assert "stablehlo.custom_call @__gpu$xla.gpu.triton" in text
