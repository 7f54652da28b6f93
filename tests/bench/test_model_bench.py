"""The model bench checks its program against a reference attention core before timing."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench import model as bench_model
from jsparse.models.llama import DenseCausalAttention, Llama, LlamaConfig, forward_fn

TINY = LlamaConfig(
    vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=40,
    rope_theta=100.0, norm_eps=1e-5, max_seq_len=64, name="tiny",
)  # fmt: skip


def _leaky(q, k, v, *, q_positions, k_positions):
    """Every slot visible: the future leaks in."""
    return bench_model.reference_core(
        q, k, v, q_positions=jnp.full_like(q_positions, 10**6), k_positions=k_positions
    )


@pytest.mark.parametrize("core, passes", [("dense", True), ("leaky", False)])
def test_reference_problem_tells_a_causal_model_from_a_leaky_one(core, passes):
    chosen = (lambda i: DenseCausalAttention(8, 8)) if core == "dense" else (lambda i: _leaky)
    model = Llama(TINY, chosen, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 40)).astype(np.int32)
    logits, _ = forward_fn(model)(jnp.asarray(ids))
    problem, gap = bench_model.reference_problem(model, chosen, ids, logits)
    assert (problem is None) == passes, problem
    assert (gap <= bench_model.NLL_TOLERANCE) == passes, gap
    assert isinstance(model.layers[0].attn.core, DenseCausalAttention) == (core == "dense")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sparse-decode", "--steps", "0"], "--steps: expected an int >= 1"),
        (["throughput", "--context", "0"], "--context: expected an int >= 1"),
        (["throughput", "--repeats", "0"], "--repeats: expected an int >= 1"),
    ],
)
def test_bad_sizes_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_model.main(argv)
    assert message in capsys.readouterr().err
