"""A trained DSA indexer against the training-free JSSA selector, at equal memory, on SmolLM2.

    python -m jsparse.assets fetch                   # SmolLM2-135M and the Austen novels, once
    python examples/indexer_vs_selectors.py          # 4 layers: 26 min on 2 CPU cores

Two ways to pick the tokens a decoding query attends to, given a few bytes per cached
token:

* **jssa_rd** (training-free): per KV head, a low-rank key projection calibrated from
  second moments of q and k, stored in FP8 + int4 (``jsparse.selectors``).
* **indexer** (trained): DeepSeek-V3.2's lightning indexer (``jsparse.nn.Indexer``), one
  FP8 key of ``D`` dims and its scale per token, shared by all heads, trained by
  ``distillation_loss`` to match the layer's attention summed over heads.

Both see the same text: windows of Emma (the indexer's training data and the selector's
calibration moments). Both are scored on held-out windows of Persuasion, each attended
from its own start, on the last ``--queries`` positions, with the recall protocol's
metrics (``jsparse.eval.recall``): the share of the per-KV-head oracle's top-budget
found, the attention mass on the selection, and the relative error of attention
restricted to it. Memory is compared per token per layer: the indexer costs ``D + 4``
bytes (FP8 key, f32 scale); jssa_rd gets the same bytes spread over the 3 KV heads.

References: the oracle (exact top-budget of each KV head's group-mean q·k, which needs
the full keys), the best single set for all heads (the top-budget of the attention
summed over heads), and the attention-sink + recency window (tokens 0-3 and the most
recent ones).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jsparse.eval.recall import RecallReference, select_causal
from jsparse.nn import Indexer
from jsparse.selectors.base import top_budget

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_indexer import fit  # the warm-up training loop of examples/train_indexer.py

METRICS = ("oracle_recall", "mass_recall", "output_error")
SINKS = 4


def capture(model, novel: str, offsets, window: int, layers):
    """{layer: {"x", "q", "k", "v": [N, window, ...]}} of windows of ``novel`` starting
    at ``offsets``, each run from its own start."""
    from jsparse import assets
    from jsparse.models.capture import capture_qkv

    out = {layer: {} for layer in layers}
    for offset in offsets:
        ids = assets.novel_token_ids(novel, offset, window)
        for layer, arrays in capture_qkv(model, ids, layers=layers, attention_input=True):
            for name, a in arrays.items():
                out[layer].setdefault(name, []).append(a)
    return {layer: {n: np.stack(a) for n, a in d.items()} for layer, d in out.items()}


def train_indexer(x, q, k, *, head_dim, heads, steps, batch, lr, seed):
    """An indexer (f32 keys while training) fitted to the attention of windows x/q/k."""
    indexer = Indexer(x.shape[-1], n_heads=heads, head_dim=head_dim, rope_dim=head_dim // 2,
                      top_k=1, cache_dtype=jnp.float32, rngs=nnx.Rngs(seed))  # fmt: skip
    losses = fit(indexer, x, q, k, steps=steps, batch=batch, lr=lr, seed=seed)
    return indexer, losses


def with_cache_dtype(trained: Indexer, cache_dtype, top_k: int) -> Indexer:
    """The trained indexer's parameters in a layer that caches ``cache_dtype`` keys and
    selects ``top_k``."""
    layer = Indexer(trained.wk.in_features, n_heads=trained.n_heads, head_dim=trained.head_dim,
                    rope_dim=trained.rope_dim, top_k=top_k, cache_dtype=cache_dtype,
                    method="xla", rngs=nnx.Rngs(0))  # fmt: skip
    nnx.update(layer, nnx.state(trained, nnx.Param))
    return layer


def indexer_selection(layer: Indexer, x, n_queries: int):
    """The indexer's ordered Top-K for the last ``n_queries`` tokens of ``x`` [C, d_model],
    as a server computes it: prefill of the earlier tokens, then one chunk."""
    context = x.shape[0]
    cache = layer.init_cache(1, context)
    _, cache = layer(jnp.asarray(x[None, : context - n_queries]), cache)
    top, _ = layer(jnp.asarray(x[None, context - n_queries :]), cache)
    return top.indices[0]  # [n_queries, K]


def shared(ids, n_kv_heads: int):
    """One selection [T, W] for every KV head: [T, Hkv, W]."""
    return jnp.broadcast_to(ids[:, None, :], (ids.shape[0], n_kv_heads, ids.shape[1]))


def sink_and_recent(lengths, budget: int):
    """Tokens 0..SINKS-1 and the most recent ``budget - SINKS`` (StreamingLLM's window)."""
    recent = lengths[:, None] - 1 - jnp.arange(budget - SINKS)[None, :]
    recent = jnp.where(recent >= SINKS, recent, -1)  # short prefixes: no repeats
    sinks = jnp.arange(SINKS)[None, :]
    sinks = jnp.where(sinks < lengths[:, None], sinks, -1)
    return jnp.concatenate([sinks, recent], axis=1).astype(jnp.int32)


def main(argv=None, model=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 18, 24])
    parser.add_argument("--window", type=int, default=1024, help="tokens a window")
    parser.add_argument("--train-windows", type=int, default=16, help="of Emma")
    parser.add_argument("--eval-windows", type=int, default=4, help="of Persuasion")
    parser.add_argument("--queries", type=int, default=256, help="last positions a window")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[32, 64],
                        help="indexer key sizes D (bytes D + 4 a token a layer)")  # fmt: skip
    parser.add_argument("--heads", type=int, default=16, help="indexer heads")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=2, help="windows a step")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    from jsparse.calibration.moments import compute_moments
    from jsparse.calibration.stream import stack_moments
    from jsparse.models.gguf_loader import load_model
    from jsparse.selectors.jssa_rd import JSSARDSelector

    started = time.time()
    model = load_model() if model is None else model
    w, nq = args.window, args.queries
    train = capture(model, "emma", [20_000 + i * w for i in range(args.train_windows)], w,
                    args.layers)  # fmt: skip
    held_out = capture(model, "persuasion", [10_000 + i * 2 * w for i in range(args.eval_windows)],
                       w, args.layers)  # fmt: skip
    n_kv_heads = train[args.layers[0]]["k"].shape[2]
    moments = {
        layer: compute_moments(jnp.asarray(d["q"].reshape(-1, *d["q"].shape[2:])),
                               jnp.asarray(d["k"].reshape(-1, *d["k"].shape[2:])))
        for layer, d in train.items()
    }  # fmt: skip
    stacked = stack_moments(list(moments.values()))
    # jssa_rd at the indexer's bytes per token and layer, shared over the KV heads
    rd = {dim: JSSARDSelector.planned(stacked, (dim + 4) / n_kv_heads) for dim in args.head_dims}

    k_max = max(args.budgets)
    lengths = jnp.arange(w - nq, w, dtype=jnp.int32) + 1
    results: dict = {}  # (label, budget) -> metric -> list over (layer, window)
    training = {}

    def record(label, budget, ref, idx):
        res = ref.metrics(idx, budget)
        for name in METRICS:
            results.setdefault((label, budget), {}).setdefault(name, []).append(
                float(jnp.mean(res[name]))
            )

    for layer in args.layers:
        d = train[layer]
        indexers = {}
        for dim in args.head_dims:
            t0 = time.time()
            trained, losses = train_indexer(
                d["x"], d["q"], d["k"], head_dim=dim, heads=args.heads, steps=args.steps,
                batch=args.batch, lr=args.lr, seed=layer,
            )  # fmt: skip
            first, last, secs = losses[0], float(np.mean(losses[-10:])), time.time() - t0
            training[(layer, dim)] = (first, last, secs)
            print(f"  layer {layer} indexer D{dim}: KL {first:.3f} -> {last:.3f} ({secs:.0f} s)",
                  flush=True)  # fmt: skip
            for dtype, tag in ((jnp.float8_e4m3fn, "fp8"), (jnp.float32, "f32")):
                indexers[f"indexer D{dim} {tag}"] = with_cache_dtype(trained, dtype, k_max)
        params = {dim: sel.calibrate_from_moments(moments[layer]) for dim, sel in rd.items()}
        e = held_out[layer]
        for n in range(e["x"].shape[0]):
            q, k, v = (jnp.asarray(e[name][n]) for name in ("q", "k", "v"))
            ref = RecallReference(q[w - nq :], k, v, lengths)
            summed = ref.probs.sum(axis=2).sum(axis=1)  # [T, S], every head's attention
            ordered = {lbl: indexer_selection(ix, e["x"][n], nq) for lbl, ix in indexers.items()}
            best = top_budget(summed[:, None], lengths, k_max)[:, 0]
            for budget in args.budgets:
                record("oracle (per KV head, full keys)", budget, ref, ref.oracle_ids(budget))
                record("best shared set", budget, ref, shared(best[:, :budget], n_kv_heads))
                record("sinks + recent", budget, ref,
                       shared(sink_and_recent(lengths, budget), n_kv_heads))  # fmt: skip
                for dim, sel in rd.items():
                    idx = select_causal(sel, params[dim], q[w - nq :], k, lengths, budget)
                    label = f"jssa_rd {sel.fp8_dims}+{sel.int4_dims} ({dim + 4} B)"
                    record(label, budget, ref, idx)
                for label, ids in ordered.items():
                    record(label, budget, ref, shared(ids[:, :budget], n_kv_heads))

    print(f"SmolLM2 layers {args.layers}; train/calibrate: {args.train_windows} x {w} tokens of "
          f"Emma; held out: {args.eval_windows} x {w} of Persuasion, last {nq} queries; "
          f"indexer {args.heads} heads, {args.steps} steps of {args.batch} windows "
          f"({time.time() - started:.0f} s)")  # fmt: skip
    for name in METRICS:
        print(f"\n{name} (mean over layers, windows, queries and KV heads)")
        print("| selector | " + " | ".join(f"B {b}" for b in args.budgets) + " |")
        print("|---|" + "---:|" * len(args.budgets))
        for label in dict.fromkeys(lbl for lbl, _ in results):
            cells = [np.mean(results[(label, b)][name]) for b in args.budgets]
            print(f"| {label} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    summary = {f"{label} @{b}": {n: float(np.mean(v)) for n, v in m.items()}
               for (label, b), m in results.items()}  # fmt: skip
    return {"summary": summary, "training": training}


if __name__ == "__main__":
    main()
