"""Train a DSA indexer on a real model's hidden states to find the tokens its attention uses.

    python -m jsparse.assets fetch                 # SmolLM2-135M and the Austen novels, once
    python examples/train_indexer.py               # layer 12, 100 steps: ~2 min on 2 CPU cores

DeepSeek-V3.2 adds its lightning indexer to a trained dense model and first trains the
indexer alone: its softmax is fitted, by KL divergence, to the main attention's
distribution, summed over heads and L1-normalised (``jsparse.nn.distillation_loss``).
Here the dense model is SmolLM2-135M, which is GQA rather than MLA; its attention is
still a fine target. A :class:`jsparse.nn.Indexer` reads one layer's normalised hidden
states (the attention's input) and learns to score the keys that layer attends to.
Training text: Emma. Held out: Persuasion. Both are cut into windows, each attended
from its own start.

Reported on the held-out windows, before and after training:

* KL: the loss on held-out windows. The uniform distribution over the visible tokens
  is the reference point.
* recall@K: the share of the attention's mass (all heads) on the K tokens the
  indexer selects, over queries that see more than K tokens. Two references: the
  best any one set of K tokens can do (the attention's own top K), and the K most
  recent tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jsparse.nn import Indexer, causal_attention_probs, distillation_loss


def windows(window: int, *arrays):
    """Each [T, ...] array cut into [T // window, window, ...]."""
    n = arrays[0].shape[0] // window
    return tuple(a[: n * window].reshape(n, window, *a.shape[1:]) for a in arrays)


def fit(indexer: Indexer, x, q, k, *, steps: int, batch: int, lr: float, seed: int = 0):
    """Trains ``indexer`` in place on windows (x [N, W, C], q, k [N, W, heads, D]) of a
    frozen model's layer: ``steps`` Adam steps on ``batch`` random windows each.
    Returns the losses."""
    optimizer = nnx.Optimizer(indexer, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(indexer, optimizer, x, q, k):
        target = causal_attention_probs(q, k)  # the model is frozen
        loss_fn = lambda m: distillation_loss(m.scores(x), target)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(indexer)
        optimizer.update(indexer, grads)
        return loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        pick = rng.choice(x.shape[0], min(batch, x.shape[0]), replace=False)
        losses.append(float(step(indexer, optimizer, x[pick], q[pick], k[pick])))
    return losses


def recall(scores, probs, top_k: int) -> float:
    """Mean share of the attention's mass (over heads) on each query's ``top_k`` best
    ``scores``, over the queries that see more than ``top_k`` tokens."""
    ids = jax.lax.top_k(scores, top_k)[1]
    mass = probs.sum(axis=2) / probs.shape[2]
    return float(jnp.take_along_axis(mass, ids, axis=-1).sum(-1)[:, top_k:].mean())


def main(argv=None, model=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--window", type=int, default=512, help="tokens a window")
    parser.add_argument("--train-tokens", type=int, default=8192, help="of Emma")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="of Persuasion")
    parser.add_argument("--batch", type=int, default=4, help="windows a step")
    parser.add_argument("--heads", type=int, default=16, help="indexer heads (of 64 dims)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--top-k", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args(argv)

    from jsparse import assets
    from jsparse.models.capture import capture_qkv
    from jsparse.models.gguf_loader import load_model

    started = time.time()
    model = load_model() if model is None else model
    data = {}
    for split, novel, n in [("train", "emma", args.train_tokens),
                            ("eval", "persuasion", args.eval_tokens)]:  # fmt: skip
        ids = assets.novel_token_ids(novel, 0, n)
        ((_, arrays),) = capture_qkv(model, ids, layers=[args.layer], attention_input=True)
        data[split] = windows(args.window, *(jnp.asarray(arrays[name]) for name in ("x", "q", "k")))
    hidden, q, k = data["eval"]
    probs = causal_attention_probs(q, k)
    train_hidden, train_q, train_k = data["train"]

    indexer = Indexer(hidden.shape[-1], n_heads=args.heads, head_dim=64, rope_dim=32,
                      top_k=max(args.top_k), cache_dtype=jnp.float32, rngs=nnx.Rngs(0))  # fmt: skip

    def report():
        scores = indexer.scores(hidden)
        out = {"KL": float(distillation_loss(scores, probs))}
        out |= {f"recall@{kk}": recall(scores, probs, kk) for kk in args.top_k}
        return out

    w = args.window
    causal = jnp.broadcast_to(jnp.where(jnp.tril(jnp.ones((w, w), bool)), 0.0, -jnp.inf),
                              (*probs.shape[:2], w))  # fmt: skip
    references = {"KL": float(distillation_loss(causal, probs))}  # uniform over visible
    recency = causal + jnp.arange(w, dtype=jnp.float32)
    for kk in args.top_k:
        references[f"recall@{kk}"] = recall(probs.sum(axis=2), probs, kk)
        references[f"recall@{kk} recent"] = recall(recency, probs, kk)

    before = report()
    losses = fit(indexer, train_hidden, train_q, train_k, steps=args.steps, batch=args.batch,
                 lr=args.lr)  # fmt: skip
    after = report()

    print(f"SmolLM2 layer {args.layer}, indexer {args.heads} x 64, {args.steps} steps of "
          f"{args.batch} x {w} tokens of Emma; held out: {hidden.shape[0]} x {w} tokens of "
          f"Persuasion ({time.time() - started:.0f} s)")  # fmt: skip
    print(f"{'':<12}{'before':>9}{'after':>9}   reference")
    for name in before:
        ref = f"uniform {references[name]:.3f}" if name == "KL" else (
            f"best {references[name]:.3f}, most recent {references[name + ' recent']:.3f}"
        )  # fmt: skip
        print(f"{name:<12}{before[name]:>9.3f}{after[name]:>9.3f}   {ref}")
    return {"before": before, "after": after, "references": references, "losses": losses}


if __name__ == "__main__":
    main()
