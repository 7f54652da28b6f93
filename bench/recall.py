"""Recall of every token selector on captured activations of a real model.

    python bench/recall.py --calib CAP [CAP ...] --eval HELD_OUT_CAP \
        [--contexts 2048 4096 8192] [--queries 256] [--ranks 8 16] \
        [--budgets 64 128 256 512] [--layers 0 1 ...] [--json OUT.json] [--plot OUT.png]
    python bench/recall.py --synthetic          # smoke test of the pipeline, NOT a result

The protocol is documented in ``jsparse/eval/protocol.py``. ``main(argv)`` is the entry
point the lead's ``bench/run.py --op recall`` calls.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jsparse._cli import check_writable, positive_int  # noqa: E402
from jsparse._environment import environment  # noqa: E402
from jsparse.calibration.stream import moments_from_captures, stack_moments  # noqa: E402
from jsparse.eval import protocol  # noqa: E402
from jsparse.eval.captures import captured_layers, read_layer, read_meta  # noqa: E402

# What a calibration capture must share with the evaluation capture.
SAME_SHAPES = ("n_heads", "n_kv_heads", "head_dim")


def overlapping_text(sequences: list[dict], eval_meta: dict, tokens: int) -> list[str]:
    """The calibration sequences (``novel``, ``offset``, ``n_tokens`` read) whose tokens
    overlap the first ``tokens`` evaluated from ``eval_meta``'s offset, as
    "novel [start, end)" of the shared tokens. The same novel elsewhere is held out."""
    start = eval_meta.get("offset")
    if start is None:  # a capture that does not say where its text began
        return []
    end = start + tokens
    shared = []
    for seq in sequences:
        lo, n = seq.get("offset"), seq["n_tokens"]
        if seq.get("novel") != eval_meta.get("novel") or lo is None:
            continue
        a, b = max(lo, start), min(lo + n, end)
        if a < b:
            shared.append(f"{seq['novel']} [{a}, {b})")
    return shared


def _layer(text: str) -> int:
    """A layer number; checked against the capture's layers once its meta is read."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a layer number >= 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/recall.py", description=__doc__.split("\n")[0])
    p.add_argument("--calib", nargs="+", help="calibration capture directories")
    p.add_argument("--eval", help="held-out capture directory")
    p.add_argument("--synthetic", action="store_true", help="tiny synthetic smoke run")
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[2048, 4096, 8192])
    p.add_argument(
        "--queries", type=positive_int, default=256, help="last positions of each window"
    )
    p.add_argument("--ranks", nargs="+", type=positive_int, default=[8, 16])
    p.add_argument("--budgets", nargs="+", type=positive_int, default=[64, 128, 256, 512])
    p.add_argument("--layers", nargs="+", type=_layer, help="default: every layer")
    p.add_argument(
        "--families", nargs="+", choices=protocol.FAMILIES, help="only these method families"
    )
    # (0 or fewer calibration tokens, or a query chunk of 0, failed deep in the run)
    p.add_argument("--calib-tokens", type=positive_int, help="cap on calibration tokens")
    p.add_argument("--query-chunk", type=positive_int, default=64)
    p.add_argument("--json", help="write every record and the summary here")
    p.add_argument("--plot", help="write recall-vs-budget plots here (PNG)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report", help="only print the tables of an earlier --json output")
    return p


def report(path: str) -> None:
    """Markdown tables of an earlier run, grouped by scoring bytes per token."""
    data = json.loads(Path(path).read_text())
    cfg = data["config"]
    summary = {(r["context"], r["method"], r["budget"]): r for r in data["summary"]}
    per_bytes: dict = {}
    for label, nbytes in cfg["bytes_per_token"].items():
        per_bytes.setdefault(nbytes, []).append(label)
    env = data["environment"]
    commit = env.get("commit", env.get("git_commit"))  # runs before 2026-11-29 22:30 say git_commit
    print(f"{env['date']} | {env['device']} | jax {env['jax']} | {commit}")
    print(
        f"eval {cfg['eval_meta'].get('novel')} offset {cfg['eval_meta'].get('offset')}, "
        f"{len(cfg['layers'])} layers, {cfg['queries']} queries per context; calibration "
        f"{data['calibration']['n_tokens']} tokens"
    )
    for metric in protocol.METRICS:
        for nbytes in sorted(per_bytes, reverse=True):
            labels = per_bytes[nbytes] if nbytes else ["oracle", "full"]
            if nbytes:
                labels = ["oracle", *labels]
            for context in cfg["contexts"]:
                print(f"\n{metric}, {nbytes:g} B/token/KV head, context {context}")
                print(protocol.markdown_table(summary, metric, context, labels, cfg["budgets"]))
    context, budget = max(cfg["contexts"]), 256 if 256 in cfg["budgets"] else cfg["budgets"][0]
    top_rank = max(cfg["ranks"])
    keep = {"jssa", "loki", "fasa", "kq_svd", "quest", "jssa_rd"}
    labels = []
    for r in data["records"]:
        if r["family"] in keep and r["rank"] == top_rank and r["method"] not in labels:
            labels.append(r["method"])
    by_layer: dict = {}
    for r in data["records"]:
        if r["context"] == context and r["budget"] == budget:
            by_layer.setdefault(r["layer"], {})[r["method"]] = r["oracle_recall"]
    print(f"\noracle recall per layer, context {context}, budget {budget}")
    print("| layer | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for layer in sorted(by_layer):
        row = by_layer[layer]
        print(
            f"| {layer} | " + " | ".join(f"{row.get(m, float('nan')):.3f}" for m in labels) + " |"
        )


def _synthetic_captures(tmp: Path) -> tuple[list[str], str]:
    from jsparse.eval.synthetic import write_synthetic_capture

    key = jax.random.key(0)
    calib = []
    for i in range(2):
        d = tmp / f"calib{i}"
        write_synthetic_capture(d, key, 1024, n_layers=2, start=10_000 * (i + 1))
        calib.append(str(d))
    write_synthetic_capture(tmp / "eval", key, 1024, n_layers=2, start=50_000)
    return calib, str(tmp / "eval")


def plot(summary: dict, contexts, budgets, ranks, path: str, header: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(metric, r) for metric in ("oracle_recall", "mass_recall") for r in ranks]
    fig, axes = plt.subplots(
        len(rows), len(contexts), figsize=(4.2 * len(contexts), 3.3 * len(rows)), squeeze=False
    )
    labels = sorted({key[1] for key in summary})
    cmap = plt.get_cmap("tab20")
    stems = sorted({re.sub(r" r\d+.*", "", label) for label in labels})
    stem_color = {stem: cmap(i % 20) for i, stem in enumerate(stems)}
    colors = {label: stem_color[re.sub(r" r\d+.*", "", label)] for label in labels}
    for (metric, r), ax_row in zip(rows, axes, strict=True):
        for context, ax in zip(contexts, ax_row, strict=True):
            for label in labels:
                entry = [summary.get((context, label, b)) for b in budgets]
                if any(e is None for e in entry):
                    continue
                if entry[0]["rank"] not in (None, r) or entry[0]["family"] == "full":
                    continue
                family = entry[0]["family"]
                style = "--" if entry[0]["rank"] is None else (":" if "-" in family else "-")
                color = "black" if family == "oracle" else colors[label]
                width = 2.2 if family in ("jssa", "jssa_rd") else 1.2
                ax.plot(
                    budgets,
                    [e[metric] for e in entry],
                    style,
                    color=color,
                    lw=width,
                    marker="o",
                    ms=3,
                    label=label,
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_title(f"{metric}, r={r} ({r} B/token), ctx {context}", fontsize=9)
            ax.set_xlabel("budget (tokens per KV head)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(header, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.report and not Path(args.report).is_file():
        parser.error(f"--report: no such file {args.report}")
    # the outputs' paths, before the run rather than after it
    check_writable("--plot", args.plot)
    if not args.report:
        check_writable("--json", args.json)
    if args.report:
        report(args.report)
        if args.plot:
            data = json.loads(Path(args.report).read_text())
            cfg = data["config"]
            summary = {(r["context"], r["method"], r["budget"]): r for r in data["summary"]}
            meta = cfg["eval_meta"]
            header = (
                f"{meta.get('model')} held-out {meta.get('novel')} @{meta.get('offset')}, "
                f"{len(cfg['layers'])} layers, {cfg['queries']} queries/context; "
                f"{data['environment'].get('commit', data['environment'].get('git_commit'))}"
            )
            plot(summary, cfg["contexts"], cfg["budgets"], cfg["ranks"], args.plot, header)
        return 0
    env = environment()
    print(" | ".join(f"{k}: {env[k]}" for k in ("date", "device", "jax", "commit")))
    tmp = None
    if args.synthetic:
        print("SYNTHETIC DATA: a smoke test of the pipeline; these numbers are not a result.")
        tmp = tempfile.TemporaryDirectory()
        args.calib, args.eval = _synthetic_captures(Path(tmp.name))
        args.contexts, args.queries = [512, 1024], min(args.queries, 32)
        args.budgets = [b for b in args.budgets if b <= 128] or [16, 64]
    if not args.calib or not args.eval:
        raise SystemExit("give --calib and --eval capture directories (or --synthetic)")
    # A repeated value ran twice and weighed twice in the means over layers (or printed
    # its rows twice).
    for flag in ("calib", "contexts", "ranks", "budgets", "layers"):
        values = getattr(args, flag) or []
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            parser.error(f"--{flag}: {', '.join(repeated)} given more than once")

    eval_meta = read_meta(args.eval)
    calib_metas = [read_meta(d) for d in args.calib]
    # The evaluation scores with bases calibrated on the other captures: the same heads.
    for d, meta in zip(args.calib, calib_metas, strict=True):
        differ = [key for key in SAME_SHAPES if meta[key] != eval_meta[key]]
        if differ:
            parser.error(
                f"--calib {d}: {', '.join(f'{key} {meta[key]}' for key in differ)}; the --eval "
                f"capture has {', '.join(f'{key} {eval_meta[key]}' for key in differ)}"
            )
    if max(args.contexts) > eval_meta["n_tokens"]:
        parser.error(
            f"--contexts: {max(args.contexts)} is longer than the --eval capture's "
            f"{eval_meta['n_tokens']} tokens"
        )
    # A layer one of the captures lacks used to stop the run at its file, after the
    # calibration; by default, every layer that all of them hold.
    held = set(captured_layers(eval_meta))
    for meta in calib_metas:
        held &= set(captured_layers(meta))
    missing = sorted(set(args.layers or []) - held)
    if missing:
        parser.error(f"--layers: {missing}; the captures all hold layers {sorted(held)}")
    layers = args.layers or sorted(held)
    if not layers:
        parser.error("--calib, --eval: the captures hold no layer in common")
    head_dim = eval_meta["head_dim"]
    methods = protocol.default_methods(args.ranks, head_dim, args.families)
    t0 = time.perf_counter()
    per_layer_moments, calib_info = moments_from_captures(
        args.calib, layers=layers, max_tokens=args.calib_tokens, progress=not args.no_progress
    )
    calib_s = time.perf_counter() - t0
    methods += protocol.rate_distortion_methods(
        args.ranks, stack_moments(per_layer_moments), args.families
    )
    n_calib = calib_info["n_tokens"]
    print(f"calibration moments: {n_calib} tokens, {len(layers)} layers, {calib_s:.1f} s")
    overlap = overlapping_text(calib_info["sequences"], eval_meta, max(args.contexts))
    calibrated_novels = {q.get("novel") for q in calib_info["sequences"]}
    if overlap and not args.synthetic:  # (synthetic captures all share one "novel")
        print(f"WARNING: the evaluated text is also calibration text: {'; '.join(overlap)}")
    elif eval_meta.get("novel") in calibrated_novels and not args.synthetic:
        print(f"note: the held-out novel {eval_meta.get('novel')!r} is calibrated on elsewhere")

    from tqdm.auto import tqdm

    records, diagnostics = [], []
    t0 = time.perf_counter()
    for layer, moments in tqdm(
        list(zip(layers, per_layer_moments, strict=True)), desc="layers", disable=args.no_progress
    ):
        params = {
            m.label: m.selector.calibrate_from_moments(moments)
            for m in methods
            if m.selector.calibrated
        }
        diag = protocol.layer_diagnostics(moments, methods, params)
        diagnostics.append({"layer": layer, **diag})
        q, k, v = read_layer(args.eval, layer, max(args.contexts))
        for rec in protocol.evaluate_layer(
            methods,
            params,
            q,
            k,
            v,
            contexts=args.contexts,
            budgets=args.budgets,
            n_queries=args.queries,
            query_chunk=args.query_chunk,
        ):
            records.append({"layer": layer, **rec})
    eval_s = time.perf_counter() - t0

    summary = protocol.summarize(records)
    labels = [m.label for m in methods]
    for metric in protocol.METRICS:
        for context in args.contexts:
            print()
            print(protocol.markdown_table(summary, metric, context, labels, args.budgets))
    mean_obj: dict = {}
    for d in diagnostics:
        for label, value in d["objective"].items():
            mean_obj.setdefault(label, []).append(value)
    print("\nexact objective E[(q̄ᵀ(I-AᵀB)k)²] on unit-trace moments, mean over layers:")
    for label, values in mean_obj.items():
        print(f"  {label:24s} {np.mean(values):.6f}")
    ratios = [d["trace_ratio_q_over_k"] for d in diagnostics]
    lo, mid, hi = np.min(ratios), np.mean(ratios), np.max(ratios)
    print(f"tr(G_Q̄)/tr(G_K): mean {mid:.3f}, min {lo:.3f}, max {hi:.3f}")
    print(f"evaluation: {eval_s:.1f} s for {len(layers)} layers")

    if args.json:
        out = {
            "environment": env,
            "config": {
                "calib": args.calib,
                "eval": args.eval,
                "eval_meta": eval_meta,
                "contexts": args.contexts,
                "queries": args.queries,  # per window, at most its length:
                "queries_per_context": {c: min(args.queries, c) for c in args.contexts},
                "ranks": args.ranks,
                "budgets": args.budgets,
                "layers": layers,
                "methods": {m.label: m.selector.describe() for m in methods},
                "bytes_per_token": {m.label: m.bytes_per_token(head_dim) for m in methods},
                "synthetic": args.synthetic,
                "calibration_overlap": overlap,
            },
            "calibration": calib_info,
            "timings": {"calibration_s": calib_s, "evaluation_s": eval_s},
            "diagnostics": diagnostics,
            "records": records,
            "summary": [
                {"context": c, "method": m, "budget": b, **vals}
                for (c, m, b), vals in summary.items()
            ],
        }
        Path(args.json).write_text(json.dumps(out, indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    if args.plot:
        header = (
            f"{eval_meta.get('model')} held-out {eval_meta.get('novel')}, {len(layers)} layers, "
            f"{args.queries} queries/window; {env.get('commit', env.get('git_commit'))}"
            + (" — SYNTHETIC, not a result" if args.synthetic else "")
        )
        plot(summary, args.contexts, args.budgets, args.ranks, args.plot, header)
        print(f"wrote {args.plot}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
