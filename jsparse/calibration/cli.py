"""Calibrate a selector for every layer of a model and write an Orbax bases checkpoint.

    python -m jsparse.calibration --captures CAP_DIR [CAP_DIR ...] --rank 16 --out BASES_DIR
    python -m jsparse.calibration --synthetic-tokens 65536 --out /tmp/bases   # timing only

``--captures`` reads activation captures (see :mod:`jsparse.eval.captures`), one layer of
one sequence at a time. ``--synthetic-tokens`` generates SmolLM2-shaped post-RoPE
activations on the device instead (30 layers, 9 query heads, 3 KV heads, head_dim 64, in
windows of ``--window`` tokens, all layers per window at once): it measures the cost of
calibration itself where real activations cannot be carried, and its bases mean nothing.
The wall time is printed per phase (data, moments, fit, save).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._cli import check_writable, positive_int
from jsparse._environment import environment

__all__ = ["main"]


SYNTHETIC_SHAPE = (30, 9, 3, 64)  # layers, query heads, KV heads, head_dim (SmolLM2)


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _bytes_per_token(text: str) -> float:
    """An argparse type: jssa_rd's budget, at least one int4 dimension (half a byte)."""
    from jsparse.selectors.jssa_rd import MIN_BYTES_PER_TOKEN

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= MIN_BYTES_PER_TOKEN):
        raise argparse.ArgumentTypeError(
            f"expected a number of bytes >= {MIN_BYTES_PER_TOKEN}, got {text!r}"
        )
    return value


def _check_outputs(args) -> None:
    """``--out`` and ``--json`` refused before any work: an existing checkpoint without
    ``--overwrite`` was refused by ``save_bases`` after the calibration, and an unwritable
    ``--json`` failed after the checkpoint was written."""
    if Path(args.out).exists() and not args.overwrite:
        raise SystemExit(f"--out: {args.out} exists; pass --overwrite to replace it")
    check_writable("--json", args.json)


def _check_rank(args, selector, head_dim: int) -> None:
    """``--rank`` beyond the head dim failed deep in the eigenbasis fit; refused once the
    head dim is known, before the moments are computed (jssa_rd plans its own dims)."""
    if args.method != "jssa_rd" and selector.rank > head_dim:
        raise SystemExit(f"--rank: got {selector.rank}; expected at most head_dim = {head_dim}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jsparse.calibration", description=__doc__.split("\n")[0]
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--captures", nargs="+", help="calibration capture directories")
    src.add_argument(
        "--synthetic-tokens", type=positive_int, help="generate this many tokens on the device"
    )
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--method", default="jssa", help="a calibrated selector (default jssa)")
    p.add_argument(
        "--rank", type=positive_int, default=16, help="R (ignored by jssa_rd: see --bytes)"
    )
    p.add_argument(
        "--bytes",
        type=_bytes_per_token,
        default=16.0,
        help="jssa_rd: scoring bytes per token per KV head; the FP8/int4 split is planned "
        "from the calibration moments (default 16, JSSA's r = 16 FP8 budget for D = 64)",
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="selector options")
    p.add_argument("--max-tokens", type=positive_int, help="cap on calibration tokens (captures)")
    p.add_argument("--window", type=positive_int, default=8192, help="tokens per synthetic window")
    p.add_argument(
        "--chunk", type=positive_int, default=4096, help="tokens per moment update (captures)"
    )
    p.add_argument("--model", help="model name for the metadata (default: from the captures)")
    p.add_argument("--json", help="also write the timings and environment as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _synthetic_moments(n_tokens: int, window: int, timings: dict):
    from jsparse.calibration.moments import finalize_moments, init_moments, update_moments
    from jsparse.eval.synthetic import synthetic_qkv

    n_layers, n_heads, n_kv, d = SYNTHETIC_SHAPE

    @jax.jit
    def generate(start):
        def layer(key):
            q, k, _ = synthetic_qkv(
                key, window, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, start=start
            )
            return q, k

        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(n_layers))
        return jax.vmap(layer)(keys)  # [L, N, H, D], [L, N, Hkv, D]

    state = init_moments(n_kv, d, (n_layers,))
    n_windows = -(-n_tokens // window)
    for w in range(n_windows):
        t0 = time.perf_counter()
        q, k = jax.block_until_ready(generate(w * window))
        t1 = time.perf_counter()
        valid = min(window, n_tokens - w * window)
        mask = np.broadcast_to(np.arange(window) < valid, (n_layers, window))
        state = jax.block_until_ready(update_moments(state, q, k, mask))
        t2 = time.perf_counter()
        timings["data_s"] += t1 - t0
        timings["moments_s"] += t2 - t1
        if w == 0:  # the first window includes compilation
            timings["first_window_s"] = t2 - t0
    info = {
        "model": "synthetic (SmolLM2 shapes)",
        "sequences": [{"synthetic_windows": n_windows, "window": window}],
        "n_tokens": n_tokens,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": d,
    }
    return finalize_moments(state), info


def _selector(args, make_selector):
    """(the selector ``--method``, ``--rank`` and ``--set`` name, whether jssa_rd plans
    its split from ``--bytes``, the ``--set`` options); a bad flag stops with a message
    naming it."""
    from jsparse.selectors import SELECTORS

    bad = [item for item in args.set if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        raise SystemExit(f"--set: expected KEY=VALUE, got {bad}")
    options = dict(item.split("=", 1) for item in args.set)
    options = {key: _parse_value(value) for key, value in options.items()}
    if "rank" in options:
        raise SystemExit("--set rank=...: give the rank with --rank (jssa_rd: --bytes)")
    cls = SELECTORS.get(args.method)
    if cls is None:
        raise SystemExit(f"--method: got {args.method!r}; expected one of {sorted(SELECTORS)}")
    if not cls.calibrated:
        raise SystemExit(f"--method {args.method}: this selector has nothing to calibrate")
    planned = args.method == "jssa_rd" and not {"fp8_dims", "int4_dims"} & set(options)
    extra = {} if args.method == "jssa_rd" else {"rank": args.rank}
    try:
        return make_selector(args.method, **extra, **options), planned, options
    except (ValueError, TypeError) as err:
        raise SystemExit(f"--method {args.method} with --set {args.set}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    from jsparse.calibration.stream import moments_from_captures, stack_moments
    from jsparse.checkpoint import save_bases
    from jsparse.selectors import make_selector

    args = _parser().parse_args(argv)
    _check_outputs(args)
    env = environment()
    print(" | ".join(f"{k}: {env[k]}" for k in ("date", "device", "jax", "commit")))
    selector, planned, options = _selector(args, make_selector)
    if args.captures:
        from jsparse.eval.captures import read_meta

        try:
            metas = [read_meta(d) for d in args.captures]
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"--captures: {err}") from None
        _check_rank(args, selector, metas[0]["head_dim"])
    else:
        _check_rank(args, selector, SYNTHETIC_SHAPE[-1])

    timings = {"data_s": 0.0, "moments_s": 0.0}
    t_start = time.perf_counter()
    if args.captures:
        t0 = time.perf_counter()
        per_layer, info = moments_from_captures(
            args.captures,
            max_tokens=args.max_tokens,
            chunk=args.chunk,
            progress=not args.no_progress,
        )
        moments = stack_moments(per_layer)
        timings["data_and_moments_s"] = time.perf_counter() - t0
        del timings["data_s"], timings["moments_s"]
    else:
        moments, info = _synthetic_moments(args.synthetic_tokens, args.window, timings)

    t0 = time.perf_counter()
    if planned:
        from jsparse.selectors.jssa_rd import JSSARDSelector

        selector = JSSARDSelector.planned(moments, args.bytes, **options)
    params = jax.block_until_ready(selector.calibrate_from_moments(moments))  # all layers at once
    timings["fit_s"] = time.perf_counter() - t0
    t_calibrated = time.perf_counter()

    metadata = {
        "model": args.model or info["model"],
        "method": args.method,
        "selector": selector.describe(),
        "rank": selector.rank,
        "bytes_per_token": selector.bytes_per_token(info["head_dim"]),
        "n_layers": info["n_layers"],
        "n_heads": info["n_heads"],
        "n_kv_heads": info["n_kv_heads"],
        "head_dim": info["head_dim"],
        "calibration": {"data": info["sequences"], "n_tokens": info["n_tokens"]},
        "environment": env,
    }
    t0 = time.perf_counter()
    path = save_bases(
        args.out, {k: np.asarray(v) for k, v in params.items()}, metadata, overwrite=args.overwrite
    )
    timings["save_s"] = time.perf_counter() - t0
    timings["calibration_total_s"] = t_calibrated - t_start
    timings["total_s"] = time.perf_counter() - t_start

    print(
        f"calibrated {selector.describe()}: {info['n_layers']} layers x "
        f"{info['n_kv_heads']} KV heads from {info['n_tokens']} tokens -> {path}"
    )
    print("wall time: " + ", ".join(f"{k} {v:.2f}" for k, v in timings.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"environment": env, "timings": timings, "metadata": metadata}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
