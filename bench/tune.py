"""Tile sweep and per-stage timing of the indexer pipeline on one shape.

    python bench/tune.py --t 8192 --s 65536 --dtype fp8 bf16 --causal

Prints, per scorer tile config, the time of the dense scoring kernel alone (TFLOP/s of
useful pairs), then for the best config the time of each selection stage, and XLA's
own sort and top_k on the same sizes for comparison. Every stage is checked before it
is timed (scores against the reference on a few rows, the selected set against a sort).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.indexer import make_inputs, visible_pairs
from jsparse import backend
from jsparse.ops.indexer import methods
from jsparse.ops.indexer import triton as scorer
from jsparse.ops.topk import triton as select
from jsparse.ops.topk.codes import score_code

CONFIGS = [
    (1, 128, 4, 2),
    (2, 128, 4, 2),
    (2, 128, 8, 2),
    (2, 128, 8, 3),
    (2, 64, 4, 3),
    (4, 64, 8, 2),
    (4, 128, 8, 2),
    (2, 256, 8, 2),
]


SELECT_CONFIGS = [
    (1024, 4, 1),
    (1024, 4, 3),
    (2048, 8, 3),
    (4096, 8, 2),
    (4096, 16, 2),
    (8192, 16, 1),
]


def tune_dtype(args, dtype, floors, configs, rows):
    """Config sweep of the scorer, then per-stage timing with the best config."""
    case = dict(t=args.t, s=args.s, h=args.h, d=args.d, top_k=args.top_k, dtype=dtype,
                ranges="causal" if args.causal else "all")  # fmt: skip
    x = make_inputs(case, seed=0)
    a = (x["q"], x["weights"], x["k"], x["k_scale"], x["kv_start"], x["kv_end"])
    pairs = visible_pairs(x)
    flops = pairs * 2 * args.h * args.d
    rate = floors.matmul_flops_per_s[dtype]
    ref_rows = jnp.arange(0, args.t, max(1, args.t // 4))
    sub = (a[0][ref_rows], a[1][ref_rows], a[2], a[3], a[4][ref_rows], a[5][ref_rows])
    from jsparse.ops.indexer import reference

    want = np.asarray(reference.indexer_scores_reference(*sub))
    best = None
    for bt, bs, nw, ns, *fp8_dot in configs:
        cfg = scorer.ScorerConfig(
            block_t=bt,
            block_s=bs,
            num_warps=nw,
            num_stages=ns,
            fp8_dot=bool(fp8_dot and fp8_dot[0]),
        )
        fn = jax.jit(lambda *a, cfg=cfg: scorer._launch(*a, cfg=cfg)[0])
        try:
            got = np.asarray(fn(*a))[np.asarray(ref_rows)]
        except Exception as err:
            print(f"{dtype} {cfg}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        vis = np.isfinite(want)
        err = np.max(np.abs(got[vis] - want[vis])) / np.max(np.abs(want[vis]))
        t = common.time_fn(fn, [a], budget_s=0.5)
        tf = flops / t.median_s / 1e12
        row = dict(stage="score", dtype=dtype, config=str(cfg), ms=1e3 * t.median_s,
                   tflops=tf, pct_xla=100 * tf * 1e12 / rate, rel_err=err)  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        if err < 1e-2 and (best is None or t.median_s < best[1]):
            best = (cfg, t.median_s)
    if best is None:
        return
    cfg = best[0]
    scores = jax.jit(lambda *a: scorer._launch(*a, cfg=cfg)[0])(*a)
    start, end = x["kv_start"], x["kv_end"]
    k = args.top_k
    cap = methods.candidate_capacity(k, args.s)
    best_sel = None
    for blk, nw, ns in SELECT_CONFIGS:
        scfg = select.SelectConfig(block=blk, num_warps=nw, num_stages=ns)
        fn = jax.jit(lambda s, a, b, scfg=scfg: select.compact_rows(s, a, b, k, cap, scfg))
        t = common.time_fn(fn, [(scores, start, end)], budget_s=0.3)
        row = dict(stage="compact_rows", dtype=dtype, config=str(scfg), ms=1e3 * t.median_s)
        rows.append(row)
        print(row, flush=True)
        if best_sel is None or t.median_s < best_sel[1]:
            best_sel = (scfg, t.median_s)
    scfg = best_sel[0]
    compact = jax.jit(lambda s, a, b: select.compact_rows(s, a, b, k, cap, scfg))
    ci, cn, slow = compact(scores, start, end)
    sel = jax.jit(lambda x, i, n: select.select_rows(x, i, n, k))
    sc, si, _ = sel(scores, ci, cn)
    order = jax.jit(select.order_topk)
    oi, _ = order(sc, si)
    # check the selection on a few rows against a full sort
    for r in np.asarray(ref_rows)[:3]:
        row = np.asarray(scores[r])[: int(end[r])]
        codes = np.asarray(score_code(jnp.asarray(row)))
        want_ids = np.lexsort((np.arange(row.size), -codes.astype(np.int64)))[:k]
        assert np.array_equal(np.asarray(oi[r]), want_ids), f"selection wrong at row {r}"
    stages = {
        "compact_rows": (compact, (scores, start, end)),
        "select_rows": (sel, (scores, ci, cn)),
        "order_topk": (order, (sc, si)),
        "lax.top_k on scores": (jax.jit(lambda s: jax.lax.top_k(s, k)), (scores,)),
        "topk_base (all stages)": (
            jax.jit(lambda *a: methods.topk_base(*a[:3], k, *a[3:], cfg=cfg)), a),
        "topk_base unsorted": (
            jax.jit(lambda *a: methods.topk_base(*a[:3], k, *a[3:], cfg=cfg, sort=False)), a),
        "topk_full (all stages)": (
            jax.jit(lambda *a: methods.topk_full(*a[:3], k, *a[3:], cfg=cfg)), a),
    }  # fmt: skip
    print(f"{dtype}: rows off the fast path in compact_rows: {int(jnp.sum(slow > 0))} of {args.t}")
    for name, (fn, fa) in stages.items():
        t = common.time_fn(fn, [fa], budget_s=0.5)
        row = dict(stage=name, dtype=dtype, config=str(cfg), ms=1e3 * t.median_s)
        rows.append(row)
        print(row, flush=True)
    full = methods.topk_full(*a[:3], k, *a[3:], cfg=cfg)
    print(f"{dtype}: full records/query mean {float(jnp.mean(full.candidates)):.0f}, "
          f"fallbacks {int(jnp.sum(full.fallback))}")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--t", type=int, default=8192)
    p.add_argument("--s", type=int, default=65536)
    p.add_argument("--h", type=int, default=64)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--dtype", nargs="+", default=["fp8", "bf16"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--configs", default=None, help="bt,bs,warps,stages;... (default: a sweep)")
    common.add_widen_argument(p)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    common.apply_widen_argument(args)
    env = common.environment()
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    floors = common.measure_floors(args.dtype, on_gpu=backend.has_nvidia_gpu())
    print(floors.describe())
    configs = CONFIGS
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    rows = []
    for dtype in args.dtype:
        tune_dtype(args, dtype, floors, configs, rows)
    common.write_json(args.json, {"env": env, "floors": floors.as_dict(), "rows": rows})


if __name__ == "__main__":
    main()
