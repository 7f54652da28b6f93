"""DoSA benchmark: base / full / dense / dosa, certificate variants, and decode.

    python -m bench.dosa                      # everything of the issue (H200: ~minutes)
    python -m bench.dosa --prefill --workloads low_survival --keys 131072
    python -m bench.dosa --decode --json out.json
    python -m bench.dosa --prefill --shapes 65536x65536 --methods base dosa   # causal 64K
    python -m bench.dosa --smoke              # tiny shapes, any machine (interpret mode on CPU)

Entry point ``main(argv)`` (``bench/run.py --op dosa`` can forward its arguments here).

Prefill (MATH.md §1.9, the paper's Figures 7 and 9): for each workload and shape, every
method's answer is checked against ``base`` first (a mismatch is reported and no speedup
is printed for it), then timed (median of ``--iters`` after warm-up, with the spread).
Per method: latency, speedup over base, screening survival (% of visible keys kept by
the certificate, over screened queries), records per query, fallback %. The
certificate variants run with ``policy="always"`` (screen every valid query) so their
survival and time show the certificate itself; ``dosa`` in the method table uses the
default ``policy="auto"``, which skips screening where the seed sample says it cannot
pay. Seed deficit b = τ* − τ and bound slack δ = U − s come from
:func:`jsparse.certified.diagnose` on a sample of queries.

Decode (MATH.md §1.10): B sequences × context, a few steps; witness thresholds against
``base`` over the same batch (``jsparse.indexer_topk_batch``): latency, records written
per query, and the cut in written records (visible keys / records).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from bench import common, indexer
from jsparse import backend
from jsparse.certified import (
    VARIANTS,
    diagnose,
    dosa_topk,
    indexer_topk_decode,
    make_plan,
    workloads,
)
from jsparse.certified.reference import select_queries
from jsparse.ops.indexer.api import default_seed_ids

TOP_K = 2048
HEADS, DIM = 64, 128
PREFILL_SHAPES = ((8192, 32768), (8192, 65536), (8192, 131072), (65536, 65536))
DECODE_SHAPES = ((1, 65536), (8, 65536), (64, 65536), (1, 131072), (8, 131072), (64, 131072))
SMOKE_PREFILL = ((32, 512),)
SMOKE_DECODE = ((2, 512),)


def _jitted(fn, *args):
    """``fn(*args)`` compiled as one program, with the arrays as arguments (not baked-in
    constants): what a model's jitted step pays, without per-call Python dispatch and the
    eager API's host-side value checks, which cost ~0.5-1 ms per decode call."""
    compiled = jax.jit(fn)
    return lambda: compiled(*args)


def _time(fn, iters: int, warmup: int = 2):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def _same(a, b) -> bool:
    """Id for id and score for score: methods that share the scorer must agree exactly."""
    return bool(
        np.array_equal(np.asarray(a.indices), np.asarray(b.indices))
        and np.array_equal(np.asarray(a.scores), np.asarray(b.scores), equal_nan=True)
    )


def _dtype_name(x) -> str:
    """The indexer bench's name of ``x``'s dtype (its check's tolerance is per name)."""
    return next(n for n, d in indexer.DTYPES.items() if jnp.dtype(d) == x.dtype)


def _reference_problems(result, inputs: dict, top_k: int, check_rows: int) -> list[str]:
    """``base``'s answer against the jnp reference scorer (the indexer bench's check):
    the answer every other method must then equal exactly."""
    keys = inputs["k_cache"] if "k_cache" in inputs else inputs["k"]
    case = dict(
        t=inputs["q"].shape[0], top_k=top_k, dtype=_dtype_name(keys),
        ranges="batch" if "k_cache" in inputs else "ranges",
    )  # fmt: skip
    return indexer.check(case, inputs, result, check_rows)


def _frac(num, den, mask=None):
    num, den = np.asarray(num, np.float64), np.maximum(np.asarray(den, np.float64), 1)
    if mask is not None:
        if not np.any(mask):
            return float("nan")
        num, den = num[mask], den[mask]
    return float(np.mean(num / den))


def _diagnostics(info, wl, top_k, n_sample):
    t = wl.q.shape[0]
    rows = jnp.asarray(np.linspace(0, t - 1, n_sample).astype(np.int32))
    d = diagnose(
        select_queries(info.plan, rows), wl.q[rows], wl.weights[rows], wl.k, wl.k_scale,
        wl.kv_start[rows], wl.kv_end[rows], top_k=top_k,
    )  # fmt: skip
    return _summary(d)


def _summary(d):
    """Medians and means of a :class:`Diagnostics` over its queries."""
    scale = np.abs(np.asarray(d.tau_star))
    return {
        "seed_deficit_rel_median": float(np.nanmedian(np.asarray(d.seed_deficit) / scale)),
        # above_tau: the survival an exact certificate would give with these seeds
        "above_tau_pct": 100 * float(np.mean(np.asarray(d.above_tau))),
        "above_tau_star_pct": 100 * float(np.mean(np.asarray(d.above_tau_star))),
        "survival_pct_sample": 100 * float(np.mean(np.asarray(d.survival))),
        "slack_rel_median": float(np.nanmedian(np.asarray(d.slack_rel_median))),
    }


def run_certificate(wl, args, out):
    """Figure 9's survival column without timing: every variant's bound on a strided
    sample of queries (reference arithmetic with per-query default seeds, any machine:
    survival is a property of the data and the certificate, not of the hardware)."""
    t, s, _, _ = wl.shape
    top_k = min(args.top_k, s)
    rows = jnp.asarray(np.linspace(0, t - 1, args.diag_queries).astype(np.int32))
    q, w, start, end = wl.q[rows], wl.weights[rows], wl.kv_start[rows], wl.kv_end[rows]
    seeds = default_seed_ids(start, end, top_k, num_keys=s)
    print(f"\n| {wl.name} T={t} S={s}, {len(rows)} queries | survival % | above τ % | "
          "above τ* % | seed deficit | slack | r |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for variant, r in ((v, r) for v in args.variants for r in args.r):
        r = r if r == "auto" else int(r)
        plan = make_plan(
            q, w, wl.k, wl.k_scale, start, end, seeds, top_k, r=r, variant=variant,
            policy="always",
        )  # fmt: skip
        summary = _summary(diagnose(plan, q, w, wl.k, wl.k_scale, start, end, top_k=top_k))
        row = {
            "workload": wl.name, "T": t, "S": s, "variant": variant, "r_arg": r,
            "queries": len(rows), "survival_pct": summary.pop("survival_pct_sample"),
            **summary, "mean_r": float(np.mean(np.asarray(plan.r))),
        }  # fmt: skip
        out.append(row)
        print(
            f"| {variant}, r={r} | {row['survival_pct']:.2f} | {row['above_tau_pct']:.2f} | "
            f"{row['above_tau_star_pct']:.2f} | {row['seed_deficit_rel_median']:.3g} | "
            f"{row['slack_rel_median']:.3g} | {row['mean_r']:.1f} |"
        )


def _unpack(got):
    """(result, info) of a method's call (``info`` None for ``base`` and ``full``)."""
    return got if isinstance(got, tuple) else (got, None)


def _prefill_inputs(wl) -> dict:
    return dict(q=wl.q, weights=wl.weights, k=wl.k, k_scale=wl.k_scale, kv_start=wl.kv_start,
                kv_end=wl.kv_end)  # fmt: skip


def run_prefill(wl, args, out):
    t, s, _, _ = wl.shape
    arrays = (wl.q, wl.weights, wl.k, wl.k_scale, wl.kv_start, wl.kv_end)
    top_k = min(args.top_k, s)

    def call(method="dosa", **opts):
        if method in ("base", "full"):
            fn, opts = jsparse.indexer_topk, dict(method=method)
        else:
            fn, opts = dosa_topk, dict(method=method, return_info=True, **opts)
        return _jitted(
            lambda q, w, k, ks, st, en: fn(
                q, w, k, top_k, k_scale=ks, kv_start=st, kv_end=en, **opts
            ),
            *arrays,
        )

    calls = {
        "base": call("base"),
        "full": call("full"),
        "dense": call("dense"),
        "dosa": call("dosa"),
    }
    if args.refine_block:
        # Scorer blocks of 4 queries for every scoring launch (a coarser shared stream):
        # fewer key loads, more wasted evaluations; exact against base with that block.
        calls["dosa[refine_block=4]"] = call(refine_block=4)
    if args.screen_configs:
        from jsparse.certified.triton import ScreenConfig  # Pallas: only for the sweep
    for spec in args.screen_configs or ():
        # Screening tile sweep: block_s,tile_rows,num_warps,num_stages (ScreenConfig).
        calls[f"dosa[screen={spec}]"] = call(
            screen_cfg=ScreenConfig(*(int(x) for x in spec.split(",")))
        )
    for variant in args.variants:
        calls[f"dosa[{variant},always]"] = call(variant=variant, policy="always")
    # base first, checked against the reference, whether or not it is timed: every
    # method's answer must equal it id for id (one scorer), or the method is not timed.
    base, _ = _unpack(calls["base"]())
    problems = _reference_problems(base, _prefill_inputs(wl), top_k, args.check_rows)
    rows = []
    for name, fn in calls.items():
        if args.methods and name.split("[")[0] not in args.methods:
            continue
        res, info = _unpack(fn())
        row = {"workload": wl.name, "T": t, "S": s, "method": name}
        if problems:
            row.update(exact=False, status="CHECK FAILED: base: " + problems[0])
        elif not _same(res, base):
            row.update(exact=False, status="CHECK FAILED: differs from base")
        else:
            row.update(exact=True, status="ok")
            row.update(_time(fn, args.iters))
        vis = np.asarray(res.visible)
        row["records_per_query"] = float(np.mean(np.asarray(res.candidates)))
        row["fallback_pct"] = 100 * float(np.mean(np.asarray(res.fallback)))
        if info is not None:
            screened = np.asarray(info.screened)
            row["screened_pct"] = 100 * float(np.mean(screened))
            row["survival_pct"] = 100 * _frac(res.survivors, vis, screened)
            row["list_pct"] = 100 * _frac(info.list_length, vis, screened)
            row["est_survival_pct"] = 100 * float(np.mean(np.asarray(info.plan.est_survival)))
            reasons = np.asarray(info.plan.reason)
            row["not_pruned_reasons"] = {
                str(b): int(np.sum((reasons & b) != 0)) for b in (1, 2, 4, 8, 16)
            }
            row["mean_r"] = float(np.mean(np.asarray(info.plan.r)))
            if args.diagnostics:
                row.update(_diagnostics(info, wl, top_k, args.diag_queries))
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.append(row)
    _print_tables(rows)


def _print_tables(rows):
    by = {r["method"]: r for r in rows}
    base = by.get("base")
    if not base:
        return
    print(f"\n| {rows[0]['workload']} T={base['T']} S={base['S']} | ms | × base | surv % | "
          "records | fallback % | exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["exact"]:
            print(f"| {r['method']} | not timed | | | | | {r['status']} |")
            continue
        speed = base["median_ms"] / r["median_ms"] if base["exact"] else float("nan")
        surv = r.get("survival_pct", float("nan"))
        print(
            f"| {r['method']} | {r['median_ms']:.2f} | {speed:.2f} | {surv:.2f} | "
            f"{r['records_per_query']:.0f} | {r['fallback_pct']:.1f} | {r['exact']} |"
        )
    print()


def run_decode(name, batch, length, args, out, heads=HEADS, dim=DIM):
    steps = args.decode_steps
    wl = workloads.make_decode(name, batch, length, steps, heads=heads, dim=dim, seed=0)
    b = wl.k_cache.shape[0]
    top_k = min(args.top_k, int(np.min(np.asarray(wl.lengths))))
    witnesses = jnp.full((b, 2 * top_k), -1, jnp.int32)
    paged_witnesses = None
    if args.page_size:
        pool, pool_scale, table = workloads.page_cache(
            wl.k_cache, wl.k_scale, args.page_size, spare_pages=b
        )
        paged_witnesses = witnesses
    rows = []
    for n in range(steps):
        q, w, lengths = wl.step(n)

        base_fn = _jitted(
            lambda q, w, kc, ks, lens: jsparse.indexer_topk_batch(
                q, w, kc, top_k, k_scale=ks, lengths=lens
            ),
            q, w, wl.k_cache, wl.k_scale, lengths,
        )  # fmt: skip

        def decode_fn(cache, scale, wit, tab=None, q=q, w=w, lengths=lengths):
            return _jitted(
                lambda q, w, kc, ks, lens, wit, tab: indexer_topk_decode(
                    q, w, kc, top_k, k_scale=ks, lengths=lens, witnesses=wit, page_table=tab
                ),
                q, w, cache, scale, lengths, wit, tab,
            )  # fmt: skip

        dosa_fn = decode_fn(wl.k_cache, wl.k_scale, witnesses)
        if args.page_size:
            paged_fn = decode_fn(pool, pool_scale, paged_witnesses, table)

        base = base_fn()
        res, new_witnesses = dosa_fn()
        # Every step is checked, step 0 (default seeds) too: base against the reference,
        # the witness steps against base; a failed step is reported and not timed.
        inputs = dict(q=q, weights=w, k_cache=wl.k_cache, k_scale=wl.k_scale, lengths=lengths)
        problems = _reference_problems(base, inputs, top_k, args.check_rows)
        problems += [] if _same(res, base) else ["dosa differs from base"]
        if args.page_size:
            paged, paged_witnesses_next = paged_fn()
            problems += [] if _same(paged, base) else ["paged dosa differs from base"]
        exact = not problems
        if not exact:
            row = {"workload": name, "batch": batch, "context": length, "step": n,
                   "exact": False, "status": "CHECK FAILED: " + problems[0]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.append(row)
        elif n > 0:  # step 0 has no witnesses yet (default seeds): checked, not timed
            tb, td = _time(base_fn, args.iters), _time(dosa_fn, args.iters)
            records = np.asarray(res.candidates, np.float64)
            vis = np.asarray(lengths, np.float64)
            row = {
                "workload": name, "batch": batch, "context": length, "step": n,
                "exact": True, "status": "ok",
                "base_ms": tb["median_ms"], "dosa_ms": td["median_ms"],
                "base_spread_ms": [tb["min_ms"], tb["max_ms"]],
                "dosa_spread_ms": [td["min_ms"], td["max_ms"]],
                "records_per_query": float(records.mean()),
                "record_cut": float(vis.sum() / max(records.sum(), 1)),
                "fallback_pct": 100 * float(np.mean(np.asarray(res.fallback))),
            }  # fmt: skip
            if args.page_size:
                tp = _time(paged_fn, args.iters)
                row.update(page_size=args.page_size, paged_ms=tp["median_ms"])
                row["paged_spread_ms"] = [tp["min_ms"], tp["max_ms"]]
            if args.device_time:  # GPU busy µs a step: host medians of such steps move ~20%
                for name, fn in (("base", base_fn), ("dosa", dosa_fn)):
                    kernels = common.device_busy_by_kernel(fn, [()])
                    if kernels:
                        row[f"{name}_busy_us"] = 1e6 * sum(kernels.values())
                        top = list(kernels.items())[:4]
                        row[f"{name}_kernels_us"] = {k: round(1e6 * v, 1) for k, v in top}
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.append(row)
        witnesses = new_witnesses
        if args.page_size:
            paged_witnesses = paged_witnesses_next
    timed = [r for r in rows if r["exact"]]
    if not all(r["exact"] for r in rows):
        print(f"| decode {name} B={batch} S={length} | {rows[0]['status']} | not timed |")
    elif timed:
        r = timed[-1]
        busy = (
            f" busy base {r['base_busy_us']:.1f} µs | dosa {r['dosa_busy_us']:.1f} µs |"
            if "dosa_busy_us" in r and "base_busy_us" in r
            else ""
        )
        print(
            f"| decode {name} B={batch} S={length} | base {r['base_ms']:.3f} ms | dosa "
            f"{r['dosa_ms']:.3f} ms | records/query {r['records_per_query']:.0f} | cut "
            f"{r['record_cut']:.1f}× | exact True |"
            + (f" paged (P={args.page_size}) {r['paged_ms']:.3f} ms |" if args.page_size else "")
            + busy
        )


def _shape(text: str) -> tuple[int, int]:
    """An argparse type: ``"8192x131072"`` -> (8192, 131072), both ints >= 1."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected NxM with two ints >= 1, got {text!r}")
    return int(parts[0]), int(parts[1])


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return int(text)


METHODS = ("base", "full", "dense", "dosa")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench.dosa", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write every row to this JSON file")
    parser.add_argument("--prefill", action="store_true", help="prefill only")
    parser.add_argument("--decode", action="store_true", help="decode only")
    parser.add_argument("--workloads", default="iid,deepseek_like,low_survival")
    parser.add_argument(
        "--keys", type=common.positive_int, nargs="*", help="prefill key counts (default all)"
    )
    parser.add_argument(
        "--queries", type=common.positive_int, help="prefill queries (default per shape)"
    )
    parser.add_argument(
        "--shapes",
        nargs="*",
        type=_shape,
        metavar="TxS",
        help="prefill queries x keys (default all)",
    )
    parser.add_argument("--methods", nargs="*", choices=METHODS, help="a subset (default all)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--top-k", type=common.positive_int, default=TOP_K)
    parser.add_argument("--iters", type=common.positive_int, default=5)
    parser.add_argument("--decode-steps", type=common.positive_int, default=3)
    parser.add_argument(
        "--decode-shapes",
        nargs="*",
        type=_shape,
        metavar="BxS",
        help="decode batch x context (default all)",
    )
    parser.add_argument(
        "--page-size", type=_non_negative_int, default=0,
        help="decode: also run from a shuffled paged cache with pages of this many keys",
    )  # fmt: skip
    parser.add_argument(
        "--device-time", action="store_true",
        help="decode: also the GPU busy time per step from a profiler trace (kernels only)",
    )  # fmt: skip
    parser.add_argument("--refine-block", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--diag-queries", type=common.positive_int, default=8)
    parser.add_argument(
        "--check-rows", type=common.positive_int, default=16,
        help="queries of a long prefill checked against the reference (decode: every one)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpret)")
    parser.add_argument(
        "--screen-configs",
        nargs="*",
        metavar="BS,ROWS,WARPS,STAGES",
        help="extra dosa rows with these screening tiles (jsparse.certified.triton.ScreenConfig)",
    )
    parser.add_argument(
        "--certificate",
        action="store_true",
        help="per-variant survival on a query sample only (reference arithmetic, no timing)",
    )
    parser.add_argument(
        "--r", nargs="*", default=["auto"], help="retained heads for --certificate (auto or ints)"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(workloads.WORKLOADS))
    if unknown or not names:
        parser.error(
            f"--workloads: got {args.workloads!r}; expected a comma-separated subset of "
            f"{', '.join(sorted(workloads.WORKLOADS))}"
        )
    common.check_writable("--json", args.json)

    env = common.environment()  # JSPARSE_COMMIT names the commit on copies without .git
    print("jsparse bench dosa | " + " | ".join(f"{k} {v}" for k, v in env.items()))
    if args.smoke:
        args.top_k = min(args.top_k, 32)
        args.iters = min(args.iters, 1)
        args.decode_steps = min(args.decode_steps, 2)
        args.diag_queries = min(args.diag_queries, 2)
    if not backend.has_nvidia_gpu():
        print("no NVIDIA GPU: Pallas kernels run in interpret mode (timings meaningless)")
    rows: list[dict] = []
    with backend.interpret_mode(not backend.has_nvidia_gpu()):
        if not args.decode:
            shapes = SMOKE_PREFILL if args.smoke else PREFILL_SHAPES
            if args.shapes:
                shapes = args.shapes
            for t, s in shapes:
                if args.keys and s not in args.keys:
                    continue
                t = args.queries or t
                for name in names:
                    kw = dict(heads=16, dim=32) if args.smoke else dict(heads=HEADS, dim=DIM)
                    wl = workloads.make(name, t, s, seed=0, **kw)
                    (run_certificate if args.certificate else run_prefill)(wl, args, rows)
        if not args.prefill and not args.certificate:
            shapes = SMOKE_DECODE if args.smoke else DECODE_SHAPES
            if args.decode_shapes:
                shapes = args.decode_shapes
            kw = dict(heads=16, dim=32) if args.smoke else {}
            for batch, length in shapes:
                run_decode("deepseek_like", batch, length, args, rows, **kw)
    if args.json:
        payload = {"env": env, "args": vars(args) | {"json": str(args.json)}, "rows": rows}
        args.json.write_text(json.dumps(common.strict_json(payload), indent=1, allow_nan=False))
    bad = [r for r in rows if not r.get("exact", True)]
    if bad:
        print(f"CHECK FAILED in {len(bad)} rows (not timed): " + bad[0]["status"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
