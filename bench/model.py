"""Benchmarks of the real model: perplexity, forward throughput, q/k/v capture time.

    python bench/model.py perplexity [--novel prideprejudice] [--tokens 512 4096]
    python bench/model.py throughput [--context 2048 8192] [--weights real|synthetic]
    python bench/model.py capture [--novel persuasion] [--tokens 8192] [--out DIR]
    python bench/model.py sparse-decode [--prefill 2048] [--steps 192] [--budgets 32 64 128]

Every run prints the device, jax / flax versions and the git commit, checks its output
before timing it, and writes everything it printed to ``--json PATH`` as well.
``--weights synthetic`` runs SmolLM2-135M's shapes with random weights and needs no
assets: the forward pass does the same arithmetic on any values, so its timings stand
for the real model's (perplexity needs the real weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout: use this tree's jsparse
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from jsparse import assets  # noqa: E402
from jsparse._cli import check_writable, positive_int  # noqa: E402
from jsparse._environment import environment  # noqa: E402
from jsparse.models.llama import DenseCausalAttention, Llama, LlamaConfig, forward_fn  # noqa: E402

# Perplexity of this GGUF measured with Hugging Face transformers (REAL_DATA.md):
# Pride and Prejudice from its first token, no BOS, one window.
REFERENCE_PPL = {("prideprejudice", 0, 512): 16.1, ("prideprejudice", 0, 4096): 18.5}
PPL_TOLERANCE = 0.1  # the reference's rounding (0.05) and f32 against its arithmetic


def build_model(weights: str, query_chunk: int, key_chunk: int) -> Llama:
    def core(i):
        return DenseCausalAttention(query_chunk, key_chunk)

    if weights == "synthetic":
        return Llama(LlamaConfig.smollm2_135m(), core, rngs=nnx.Rngs(0))
    from jsparse.models.gguf_loader import load_model

    return load_model(core=core)


def tokens_for(weights: str, n: int, novel: str, offset: int, vocab: int) -> np.ndarray:
    if weights == "synthetic":
        return np.random.default_rng(0).integers(0, vocab, n).astype(np.int32)
    return np.asarray(assets.novel_token_ids(novel, offset, n))


def forward_flops(c: LlamaConfig, t: int) -> float:
    """Matmul FLOPs of one causal forward of t tokens (the attention's causal half only)."""
    per_token = c.n_heads * c.head_dim * c.d_model * 2  # q and o projections
    per_token += c.n_kv_heads * c.head_dim * c.d_model * 2  # k and v
    per_token += 3 * c.d_model * c.d_ff
    dense = 2 * t * (c.n_layers * per_token + c.vocab_size * c.d_model)
    attention = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * t * (t + 1) / 2
    return dense + attention


def reference_core(q, k, v, *, q_positions, k_positions):
    """The checks' attention: one masked softmax over every slot at full f32 precision,
    no blocks and no online softmax (what :class:`DenseCausalAttention` computes
    blockwise, skipping blocks)."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") / math.sqrt(q.shape[-1])
    kp, qp = k_positions[:, None, None, :], q_positions[:, None, :, None]
    probs = jax.nn.softmax(jnp.where((kp >= 0) & (kp <= qp), logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v, precision="highest")


# Tokens of the checks' prefix: past the dense core's first 512-query, 512-key block.
CHECK_TOKENS = 640
# Per-token NLL the checked program may differ by from the reference core's: summation
# order (and TF32 projections on a GPU, in both); a causal leak or a position error
# moves most tokens' NLL by tenths to units of a nat.
NLL_TOLERANCE = 2e-2


def _token_nll(logits, ids) -> np.ndarray:
    """NLL of ids[1:] from logits[:-1] ([T, V], [T]), float64."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)[:-1], axis=-1)
    return -np.asarray(
        jnp.take_along_axis(logp, jnp.asarray(ids)[1:, None], axis=-1)[:, 0], np.float64
    )


def _worst_nll_gap(got, want) -> int | None:
    """The token whose two NLLs differ most (a non-finite gap first), or None when every
    gap is finite and within :data:`NLL_TOLERANCE`."""
    gap = np.abs(got - want)
    if np.all(np.isfinite(gap)) and gap.max(initial=0.0) <= NLL_TOLERANCE:
        return None
    return int(np.argmax(np.where(np.isfinite(gap), gap, np.inf)))


def reference_problem(model: Llama, core, ids, logits) -> tuple[str | None, float]:
    """The timed program's ``logits`` of row 0 against the same weights with
    :func:`reference_core`, token by token over the first :data:`CHECK_TOKENS` (a causal
    model's prefix does not depend on what follows it); ``core`` is put back. Returns
    (the problem or None, the largest NLL gap: what the check saw)."""
    n = min(CHECK_TOKENS, ids.shape[1])
    model.set_core(lambda i: reference_core)
    try:
        want, _ = forward_fn(model)(jnp.asarray(ids[:1, :n]))
    finally:
        model.set_core(core)
    got_nll, want_nll = _token_nll(logits[0, :n], ids[0, :n]), _token_nll(want[0], ids[0, :n])
    worst = _worst_nll_gap(got_nll, want_nll)
    gap = float(np.max(np.abs(got_nll - want_nll), initial=0.0))
    if worst is None:
        return None, gap
    return (
        f"token {worst + 1}: NLL {got_nll[worst]:.4f}, the reference core's "
        f"{want_nll[worst]:.4f} (tolerance {NLL_TOLERANCE})"
    ), gap


def dense_core(args):
    return lambda i: DenseCausalAttention(args.query_chunk, args.key_chunk)


@jax.jit
def _mean_nll(logits, ids):
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def cmd_throughput(args) -> dict:
    model = build_model(args.weights, args.query_chunk, args.key_chunk)
    fwd = forward_fn(model)
    rows = []
    for t in args.context:
        ids = np.stack(
            [
                tokens_for(
                    args.weights, t, args.novel, args.offset + b * t, model.config.vocab_size
                )
                for b in range(args.batch)
            ]
        )
        t0 = time.perf_counter()
        logits, _ = fwd(ids)
        logits.block_until_ready()
        first = time.perf_counter() - t0
        # Check before timing: the prefix against the reference core, a sane perplexity.
        nll = float(_mean_nll(logits, jnp.asarray(ids)))
        problem, gap = reference_problem(model, dense_core(args), ids, logits)
        if problem or not np.isfinite(nll) or (args.weights == "real" and not nll < 5.0):
            raise SystemExit(f"throughput: CHECK FAILED at T={t}: {problem or f'mean NLL {nll}'}")
        del logits
        times, cpu = [], []
        for _ in tqdm(range(args.repeats), desc=f"forward T={t}", unit="run"):
            t0, c0 = time.perf_counter(), time.process_time()
            out, _ = fwd(ids)
            out.block_until_ready()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            del out
        median = statistics.median(times)
        flops = forward_flops(model.config, t) * args.batch
        row = {
            "context": t,
            "batch": args.batch,
            "compile_and_first_run_s": round(first, 3),
            "times_s": [round(x, 4) for x in times],
            "median_s": round(median, 4),
            "tokens_per_s": round(args.batch * t / median, 1),
            # Host CPU seconds of this process per run: on a shared CPU machine, wall time
            # also measures the neighbours; this does not.
            "process_cpu_s": [round(x, 2) for x in cpu],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "approx_tflops": round(flops / median / 1e12, 3),
            "check_mean_nll": round(nll, 4),
            "check_max_nll_gap": gap,
        }
        print(
            f"T={t:6d} batch={args.batch}: median {median:.3f} s "
            f"(min {min(times):.3f}, max {max(times):.3f}, n={len(times)}) -> "
            f"{row['tokens_per_s']:.1f} tok/s, ~{row['approx_tflops']:.3f} TFLOP/s; "
            f"first call (compile) {first:.1f} s; mean NLL {nll:.3f} (prefix within {gap:.1e} "
            f"nats of the reference core); process CPU s per run "
            f"{row['process_cpu_s']}; load average {row['load_average_after']}"
        )
        rows.append(row)
    return {"weights": args.weights, "rows": rows}


def cmd_capture(args) -> dict:
    from jsparse.models.capture import capture_meta, capture_qkv, save_capture

    model = build_model(args.weights, args.query_chunk, args.key_chunk)
    c = model.config
    ids = tokens_for(args.weights, args.tokens, args.novel, args.offset, c.vocab_size)
    layers = list(range(c.n_layers)) if args.layers is None else args.layers
    # Compile the per-layer step at this length once (layer 0 only), outside the timing.
    t0 = time.perf_counter()
    for _ in capture_qkv(model, ids, layers=[0]):
        pass
    compile_s = time.perf_counter() - t0
    per_layer = []
    nbytes = 0
    c_start = time.process_time()
    t_start = time.perf_counter()
    t0 = t_start
    stream = tqdm(capture_qkv(model, ids, layers=layers), total=len(layers), unit="layer")
    if args.out is None:
        for _, arrays in stream:
            if not all(np.isfinite(a).all() for a in arrays.values()):
                raise SystemExit("capture: non-finite q/k/v")
            nbytes += sum(a.nbytes for a in arrays.values())
            now = time.perf_counter()
            per_layer.append(now - t0)
            t0 = now
    else:
        meta = capture_meta(
            model, novel=args.novel, offset=args.offset, n_tokens=len(ids), layers=layers
        )
        save_capture(args.out, stream, meta=meta, tokens=ids)
        nbytes = sum(f.stat().st_size for f in Path(args.out).glob("layer_*.npz"))
    total = time.perf_counter() - t_start
    cpu_s = time.process_time() - c_start
    print(
        f"capture of {len(layers)} layers x {len(ids)} tokens: {total:.2f} s "
        f"({total / len(layers):.3f} s/layer{', written to ' + str(args.out) if args.out else ''})"
        f"; {nbytes / 2**20:.0f} MiB of q/k/v; compile (layer 0 at this length) {compile_s:.1f} s"
        f"; process CPU {cpu_s:.1f} s; load average {os.getloadavg()}"
    )
    return {
        "weights": args.weights,
        "novel": args.novel if args.weights == "real" else None,
        "offset": args.offset,
        "tokens": len(ids),
        "layers": len(layers),
        "total_s": round(total, 3),
        "process_cpu_s": round(cpu_s, 2),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "per_layer_s": [round(x, 4) for x in per_layer],
        "written_to": str(args.out) if args.out else None,
        "mib": round(nbytes / 2**20, 1),
        "compile_s": round(compile_s, 2),
    }


def cmd_perplexity(args) -> dict:
    from jsparse.models.gguf_loader import load_model
    from jsparse.models.perplexity import perplexity

    model = load_model(core=lambda i: DenseCausalAttention(args.query_chunk, args.key_chunk))
    rows = []
    for n in args.tokens:
        ids = assets.novel_token_ids(args.novel, args.offset, n)
        context = min(n, model.config.max_seq_len) if args.context_len is None else args.context_len
        # Check before timing: the model's prefix against the reference core, and the
        # perplexity against Hugging Face's where the protocol is its (one window).
        prefix = np.asarray(ids[: min(n, CHECK_TOKENS)])[None]
        logits, _ = forward_fn(model)(jnp.asarray(prefix))
        problem, gap = reference_problem(model, dense_core(args), prefix, logits)
        result = perplexity(model, ids, context_len=context, stride=args.stride)
        ref = REFERENCE_PPL.get((args.novel, args.offset, n)) if context >= n else None
        if problem is None and ref is not None and abs(result.perplexity - ref) > PPL_TOLERANCE:
            problem = f"perplexity {result.perplexity:.4f}, Hugging Face's ≈ {ref}"
        if problem:
            raise SystemExit(f"perplexity: CHECK FAILED at {n} tokens: {problem}")
        t0 = time.perf_counter()  # a second call: the first one compiled
        result = perplexity(model, ids, context_len=context, stride=args.stride, progress=True)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "novel": args.novel,
                "offset": args.offset,
                "tokens": n,
                "context_len": result.context_len,
                "stride": result.stride,
                "n_scored": result.n_scored,
                "perplexity": round(result.perplexity, 4),
                "mean_nll": round(result.mean_nll, 6),
                "reference_hf": ref,
                "check_max_nll_gap": gap,
                "seconds": round(seconds, 2),
            }
        )
        print(
            f"{args.novel} tokens [{args.offset}, {args.offset + n}) context {result.context_len} "
            f"stride {result.stride}: perplexity {result.perplexity:.4f} over {result.n_scored} "
            f"tokens" + (f" (Hugging Face reference ≈ {ref})" if ref else "") + f"; {seconds:.1f} s"
        )
    return {"rows": rows}


def cmd_sparse_decode(args) -> dict:
    """Token-by-token decoding with jsparse.SparseAttention in every layer against the
    dense core: the NLL of each decoded token. Prefill is dense for both (as
    SparseAttention does), so the decoded tokens are the only difference. Selectors are
    calibrated on a calibration novel's tokens, the text is held out."""
    import jsparse
    from jsparse.models.capture import capture_qkv
    from jsparse.models.gguf_loader import load_model

    model = load_model()
    calib = assets.novel_token_ids(args.calib_novel, 0, args.calib_tokens)
    captured = {i: d for i, d in capture_qkv(model, calib)}
    ids = np.asarray(assets.novel_token_ids(args.novel, args.offset, args.prefill + args.steps))

    kv_dtype = jnp.dtype(args.kv_dtype)

    def decode_nll(core, dtype=kv_dtype):
        model.set_core(core)
        fwd = forward_fn(model)
        cache = model.init_cache(1, args.prefill + args.steps, dtype)
        logits, cache = fwd(jnp.asarray(ids[None, : args.prefill]), cache)
        nll = []
        for i in range(args.prefill, args.prefill + args.steps):
            nll.append(-float(jax.nn.log_softmax(logits[0, -1])[ids[i]]))
            if i + 1 < args.prefill + args.steps:
                logits, cache = fwd(jnp.asarray(ids[None, i : i + 1]), cache)
        return np.asarray(nll)

    dense = decode_nll(dense_core(args), jnp.dtype(jnp.float32))  # the reference: an f32 cache
    # Check before comparing: the dense decode's NLLs (prefill, then a step a token from
    # the cache) against one causal forward of the same tokens with the reference core.
    model.set_core(lambda i: reference_core)
    whole, _ = forward_fn(model)(jnp.asarray(ids[None]))
    want = _token_nll(whole[0], ids)[args.prefill - 1 :]
    worst = _worst_nll_gap(dense, want)
    if worst is not None:
        raise SystemExit(
            f"sparse-decode: CHECK FAILED: the dense decode's NLL at step {worst} is "
            f"{dense[worst]:.4f}, one forward's {want[worst]:.4f} (tolerance {NLL_TOLERANCE})"
        )
    rows = [dict(core="dense", budget=None, kv_dtype="float32", mean_nll=float(dense.mean()),
                 perplexity=math.exp(dense.mean()), delta_nll=0.0)]  # fmt: skip
    print(f"dense: mean NLL {dense.mean():.4f} (perplexity {math.exp(dense.mean()):.3f}) "
          f"over {args.steps} decoded tokens")  # fmt: skip
    if kv_dtype != jnp.dtype(jnp.float32):
        nll = decode_nll(dense_core(args))
        delta = float(nll.mean() - dense.mean())
        rows.append(dict(core="dense", budget=None, kv_dtype=kv_dtype.name,
                         mean_nll=float(nll.mean()), perplexity=math.exp(nll.mean()),
                         delta_nll=delta))  # fmt: skip
        print(f"dense, {kv_dtype.name} K/V cache: mean NLL {nll.mean():.4f}, Δ {delta:+.4f} nats")
    for name in args.selectors:
        sel = jsparse.make_selector(name)
        params = [sel.calibrate(jnp.asarray(captured[i]["q"]), jnp.asarray(captured[i]["k"]))
                  for i in range(model.config.n_layers)]  # fmt: skip
        for budget in args.budgets:

            def core(i, sel=sel, params=params, budget=budget):
                layer = jsparse.SparseAttention(
                    sel, params[i], budget,
                    dense=DenseCausalAttention(args.query_chunk, args.key_chunk),
                )  # fmt: skip
                # A plain function carries no core state: every step re-projects the keys.
                return (lambda q, k, v, **kw: layer(q, k, v, **kw)) if args.reproject else layer

            nll = decode_nll(core)
            delta = float(nll.mean() - dense.mean())
            rows.append(dict(core=name, budget=budget, kv_dtype=kv_dtype.name,
                             mean_nll=float(nll.mean()), perplexity=math.exp(nll.mean()),
                             delta_nll=delta, reproject=args.reproject))  # fmt: skip
            mode = ", re-projected every step" if args.reproject else ""
            if kv_dtype != jnp.dtype(jnp.float32):
                mode += f", {kv_dtype.name} K/V cache"
            print(f"{sel.describe()} budget {budget}{mode}: mean NLL {nll.mean():.4f} "
                  f"(perplexity {math.exp(nll.mean()):.3f}), Δ {delta:+.4f} nats")  # fmt: skip
    return {"rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--query-chunk", type=positive_int, default=512, help="dense core query block"
    )
    parser.add_argument("--key-chunk", type=positive_int, default=512, help="dense core key block")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("perplexity", help="perplexity under jsparse.models.perplexity")
    p.add_argument("--novel", default=assets.PERPLEXITY_CHECK_NOVEL, choices=sorted(assets.NOVELS))
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[512, 4096])
    p.add_argument(
        "--context-len", type=positive_int, help="window (default: the text, up to 8192)"
    )
    p.add_argument("--stride", type=positive_int, help="default context_len // 2")

    p = sub.add_parser("throughput", help="forward tokens/s at each context length")
    p.add_argument("--context", type=positive_int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--weights", choices=("real", "synthetic"), default="real")
    p.add_argument("--novel", default=assets.EVALUATION_NOVELS[0], choices=sorted(assets.NOVELS))
    p.add_argument("--offset", type=int, default=0)

    p = sub.add_parser("capture", help="time capture_qkv over all layers")
    p.add_argument("--novel", default=assets.EVALUATION_NOVELS[0], choices=sorted(assets.NOVELS))
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--tokens", type=positive_int, default=8192)
    p.add_argument("--layers", type=int, nargs="+")
    p.add_argument("--out", type=Path, help="also write the capture directory here")
    p.add_argument("--weights", choices=("real", "synthetic"), default="real")

    p = sub.add_parser("sparse-decode", help="decoded tokens' NLL: SparseAttention vs dense")
    p.add_argument("--novel", default=assets.EVALUATION_NOVELS[0], choices=sorted(assets.NOVELS))
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--prefill", type=positive_int, default=2048, help="dense prefill tokens")
    p.add_argument("--steps", type=positive_int, default=192, help="tokens decoded one at a time")
    p.add_argument("--budgets", type=positive_int, nargs="+", default=[32, 64, 128])
    p.add_argument("--selectors", nargs="+", default=["oracle", "jssa_rd", "jssa"])
    p.add_argument("--calib-novel", default=assets.CALIBRATION_NOVELS[0],
                   choices=sorted(assets.CALIBRATION_NOVELS))  # fmt: skip
    p.add_argument("--calib-tokens", type=positive_int, default=16384,
                   help="calibration tokens; the exact-objective maps (jssa_rd, kq_svd) "
                   "overfit 2048 (WORKSPACE.md, session 28)")  # fmt: skip
    p.add_argument(
        "--kv-dtype",
        default="float32",
        choices=("float32", "float8_e4m3fn"),
        help="the model's K/V cache (the dense f32 cache stays the reference)",
    )
    p.add_argument("--reproject", action="store_true",
                   help="re-project the visible keys at every step (fresh FP8 / int4 scales) "
                   "instead of keeping the projected cache from the prefill")  # fmt: skip

    args = parser.parse_args(argv)
    check_writable("--json", args.json)
    env = environment()
    print(
        f"device {env['device']} (x{env['n_devices']}), {env['host_cpus']} host CPUs, "
        f"jax {env['jax']}, flax {env['flax']}, python {env['python']}, "
        f"commit {env['commit']}, {env['date']}"
    )
    print("command: python bench/model.py " + " ".join(sys.argv[1:] if argv is None else argv))
    run = {
        "perplexity": cmd_perplexity,
        "throughput": cmd_throughput,
        "capture": cmd_capture,
        "sparse-decode": cmd_sparse_decode,
    }
    result = run[args.command](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"command": args.command, "args": vars(args), "environment": env, **result}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
