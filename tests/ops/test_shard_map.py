"""The ops inside ``jax.shard_map`` (data-parallel serving: each device decodes its own
sequences). Under ``check_vma=False`` the kernels give the unsharded answer, interpreted
or compiled. Under ``check_vma=True`` (the default) each kernel declares its outputs to
vary over the axes its inputs vary over: compiled, they give the unsharded answer (a
``gpu`` test) and lower to CUDA with those types (on the CPU); interpreted, they refuse
by name (jax's interpreter cannot run under the checks) and the references run. A mesh
of every visible device (one on the CPU test machines: the types are checked all the
same)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jsparse
from jsparse import backend
from jsparse.ops.topk import topk_prefix
from jsparse.testing import h200_mesh, lower_for_h200

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # jax < 0.7
    from jax.experimental.shard_map import shard_map

RNG = np.random.default_rng(5)
B, H, HKV, D, S, N, K = 4, 8, 2, 32, 200, 16, 8


def _f32(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


ARRAYS = {
    "q": _f32(B, H, D),
    "w": _f32(B, H),
    "k": _f32(B, S, HKV, D),
    "v": _f32(B, S, HKV, D),
    "lists": jnp.asarray(RNG.integers(-1, S, (B, HKV, N)), jnp.int32),
    "cache": _f32(B, S, D),
    "lengths": jnp.asarray([S, 100, 30, 150], jnp.int32),
    "scores": _f32(B, S),
    "keys": _f32(S, D),  # shared by every device (replicated)
    "q64": _f32(B, H, 64),  # the Mosaic scorer's shapes: D a multiple of 64
    "keys64": _f32(S, 64),
}

OPS = {
    "indexed_attention": (
        lambda a, i: jsparse.indexed_attention(
            a["q"], a["k"], a["v"], a["lists"], implementation=i
        ),
        ["q", "k", "v", "lists"],
    ),
    "indexed_mla_attention": (
        lambda a, i: jsparse.indexed_mla_attention(
            a["q"], a["cache"], a["lists"][:, 0], latent_dim=16, scale=0.2, implementation=i
        ),
        ["q", "cache", "lists"],
    ),
    "indexer_topk_batch": (
        lambda a, i: (
            jsparse.indexer_topk_batch(
                a["q"], a["w"], a["cache"], K, lengths=a["lengths"], implementation=i
            ).indices
        ),
        ["q", "w", "cache", "lengths"],
    ),
    "indexer_topk_decode": (
        lambda a, i: (
            jsparse.indexer_topk_decode(
                a["q"], a["w"], a["cache"], K, lengths=a["lengths"], implementation=i
            )[0].indices
        ),
        ["q", "w", "cache", "lengths"],
    ),
    "topk_prefix": (
        lambda a, i: topk_prefix(a["scores"], a["lengths"], K, implementation=i)[0],
        ["scores", "lengths"],
    ),
    # queries sharded, keys replicated (DoSA's kernels too, by a scan: 30 s interpreted)
    "indexer_topk": (
        lambda a, i: jsparse.indexer_topk(a["q"], a["w"], a["keys"], K, implementation=i).indices,
        ["q", "w", "keys"],
    ),
}


# every op, the Mosaic scorer and a derivative: compiled or lowered only
ALL_OPS = dict(
    OPS,
    indexer_topk_mosaic=(
        lambda a, i: (
            jsparse.indexer_topk(
                a["q64"].astype(jnp.bfloat16),
                a["w"],
                a["keys64"].astype(jnp.bfloat16),
                K,
                implementation="mosaic" if i == "triton" else i,
            ).indices
        ),
        ["q64", "w", "keys64"],
    ),
    # the scorer's derivative (its backward kernels) for sharded queries and for the
    # replicated keys, whose cotangent sums every shard's
    indexer_scores_grad=(
        lambda a, i: jax.grad(
            lambda q: jnp.sum(jsparse.indexer_scores(q, a["w"], a["keys"], implementation=i) ** 2)
        )(a["q"]),
        ["q", "w", "keys"],
    ),
    indexer_scores_grad_keys=(
        lambda a, i: jax.grad(
            lambda k: jnp.sum(jsparse.indexer_scores(a["q"], a["w"], k, implementation=i) ** 2)
        )(a["keys"]),
        ["q", "w", "keys"],
    ),
)


def _specs(names):
    """Every input sharded over "x" by its leading axis, shared keys replicated."""
    return tuple(P() if n.startswith("keys") else P("x") for n in names)


def _sharded(op, implementation, check_vma):
    fn, names = ALL_OPS[op]
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    specs = _specs(names)
    placed = [
        jax.device_put(ARRAYS[n], NamedSharding(mesh, s)) for n, s in zip(names, specs, strict=True)
    ]

    def local(*xs):
        return fn(dict(ARRAYS, **dict(zip(names, xs, strict=True))), implementation)

    body = shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=check_vma)
    return jax.jit(body)(*placed)


def _assert_unsharded_answer(op, got, want):
    # The keys' gradient adds the backward kernel's head-group partial sums in XLA,
    # whose reduction order may differ between two compiled programs (on an H100,
    # 6.1e-5 where the largest entry is ~170, run 266): a few ulps of the largest term.
    scale = np.abs(np.asarray(want)).max() if op.startswith("indexer_scores_grad") else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_kernels_under_check_vma_false_give_the_unsharded_answer(op, kernel_impl):
    want = OPS[op][0](ARRAYS, kernel_impl)
    _assert_unsharded_answer(op, _sharded(op, kernel_impl, False), want)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(ALL_OPS))
def test_under_check_vma_the_compiled_kernels_give_the_unsharded_answer(op):
    want = ALL_OPS[op][0](ARRAYS, "triton")
    _assert_unsharded_answer(op, _sharded(op, "triton", True), want)


@pytest.mark.parametrize("op", sorted(OPS))
def test_under_check_vma_interpreted_kernels_refuse_and_the_references_run(op, interpret):
    with pytest.raises(NotImplementedError, match=r"interpret mode .* only with check_vma=False"):
        _sharded(op, "triton", True)
    want = OPS[op][0](ARRAYS, "reference")
    np.testing.assert_allclose(_sharded(op, "reference", True), want, rtol=1e-6, atol=1e-6)


def _kernel_types(jaxpr):
    """(axes the inputs vary over, axes each output varies over) of every ``pallas_call``
    in ``jaxpr`` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            varying = [v.aval.manual_axis_type.varying for v in eqn.invars]
            yield (
                frozenset().union(*varying),
                [v.aval.manual_axis_type.varying for v in eqn.outvars],
            )
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _kernel_types(inner)


@pytest.mark.parametrize("op", sorted(ALL_OPS))
def test_under_check_vma_every_kernel_declares_varying_outputs_and_lowers_to_cuda(op, monkeypatch):
    monkeypatch.setattr(backend, "has_nvidia_gpu", lambda: True)
    fn, names = ALL_OPS[op]
    specs = _specs(names)

    def local(*xs):
        return fn(dict(ARRAYS, **dict(zip(names, xs, strict=True))), "triton")

    mesh = h200_mesh(("x",))
    body = shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x"))
    # placed as in_specs says (jax 0.11 checks the arguments' shardings against it)
    structs = [
        jax.ShapeDtypeStruct(ARRAYS[n].shape, ARRAYS[n].dtype, sharding=NamedSharding(mesh, p))
        for n, p in zip(names, specs, strict=True)
    ]
    lowered = lower_for_h200(body, *structs)
    with backend.interpret_mode(False):
        jaxpr = jax.make_jaxpr(body)(*structs).jaxpr
    kernels = list(_kernel_types(jaxpr))
    assert any(inputs == {"x"} for inputs, _ in kernels), "no kernel reads the sharded input"
    for inputs, outputs in kernels:  # an output varies where its kernel's inputs do
        assert outputs == [inputs] * len(outputs), (inputs, outputs)
    assert ("mosaic_gpu" if "mosaic" in op else "__gpu$xla.gpu.triton") in lowered.as_text()
