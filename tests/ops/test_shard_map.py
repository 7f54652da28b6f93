"""The ops inside ``jax.shard_map`` (data-parallel serving: each device decodes its own
sequences). The Pallas kernels run under ``check_vma=False`` and give the unsharded
answer; under ``check_vma=True`` (the default) they refuse by name rather than fail
inside Pallas, and the references run. A mesh of every visible device (one on the CPU
test machines: the varying-axis types are checked all the same)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jsparse
from jsparse.ops.topk import topk_prefix

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


def _sharded(op, implementation, check_vma):
    fn, names = OPS[op]
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    specs = tuple(P() if n == "keys" else P("x") for n in names)
    placed = [
        jax.device_put(ARRAYS[n], NamedSharding(mesh, s)) for n, s in zip(names, specs, strict=True)
    ]

    def local(*xs):
        return fn(dict(ARRAYS, **dict(zip(names, xs, strict=True))), implementation)

    body = shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("x"), check_vma=check_vma)
    return jax.jit(body)(*placed)


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_kernels_under_check_vma_false_give_the_unsharded_answer(op, kernel_impl):
    want = OPS[op][0](ARRAYS, kernel_impl)
    np.testing.assert_allclose(_sharded(op, kernel_impl, False), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", sorted(OPS))
def test_under_check_vma_the_kernels_refuse_and_the_references_run(op, kernel_impl):
    with pytest.raises(NotImplementedError, match=r"shard_map only with check_vma=False"):
        _sharded(op, kernel_impl, True)
    want = OPS[op][0](ARRAYS, "reference")
    np.testing.assert_allclose(_sharded(op, "reference", True), want, rtol=1e-6, atol=1e-6)
