"""Benchmark of exact Top-K selection over dense score rows (``--op topk``).

The selection half of ``base`` on its own: given f32 scores [T, S] and per-row visible
ranges, the K best ids (score descending, then id ascending). ``xla`` is
``lax.top_k`` over the masked rows; ``base`` is :func:`jsparse.topk`, the library's
compaction + select (+ order unless ``--unsorted``). The floor is reading the visible
scores once and writing the answer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jsparse
from jsparse.ops.topk.reference import visible_key_ids

from . import common

DEFAULT_METHODS = ["xla", "base"]


def add_arguments(parser):
    parser.add_argument(
        "--check-rows",
        type=common.positive_int,
        default=16,
        help="rows of a long shape checked against the oracle (decode shapes: every row)",
    )
    parser.add_argument(
        "--unsorted", action="store_true",
        help="base returns the exact Top-K set without the final sort by score",
    )  # fmt: skip
    parser.add_argument(
        "--device-time", action="store_true",
        help="also the GPU busy time per call from a profiler trace (kernels only), by kernel",
    )  # fmt: skip


def make_inputs(case: dict, seed: int):
    """i.i.d. Gaussian score rows; "causal" rows see keys up to their position."""
    t, s = case["t"], case["s"]
    scores = jax.random.normal(jax.random.PRNGKey(seed), (t, s), jnp.float32)
    if case["ranges"] == "causal":
        end = jnp.arange(s - t + 1, s + 1, dtype=jnp.int32)
    else:
        end = jnp.full((t,), s, jnp.int32)
    return dict(scores=scores, start=jnp.zeros((t,), jnp.int32), end=end)


def select_fn(method: str, top_k: int, *, sort: bool, impl: str):
    """(scores, start, end) -> (ids, scores) [T, K], -1 / -inf padded."""
    if method == "xla":

        def xla(scores, start, end):
            ids = visible_key_ids(start, end, scores.shape[1])
            values, at = jax.lax.top_k(jnp.where(ids >= 0, scores, -jnp.inf), top_k)
            picked = jnp.take_along_axis(ids, at, axis=1)
            return picked, jnp.where(picked >= 0, values, -jnp.inf)

        return xla
    if method != "base":
        raise SystemExit(f"--op topk has methods xla and base, not {method!r}")
    return lambda scores, start, end: jsparse.topk(
        scores, top_k, kv_start=start, kv_end=end, sorted=sort, implementation=impl
    )


def check(inputs, got, *, top_k: int, rows: int, in_order: bool) -> list[str]:
    """Rows (every row of a decode shape, a spread of ``rows`` of longer ones) against a
    numpy oracle, exactly: the same ids (in the contract's order when ``in_order``, else
    as a set) and each id's own input score as its value; -1 / -inf past the visible."""
    scores = np.asarray(inputs["scores"])
    start, end = np.asarray(inputs["start"]), np.asarray(inputs["end"])
    got_ids, got_values = np.asarray(got[0]), np.asarray(got[1])
    problems = []
    for r in common.rows_to_check(scores.shape[0], rows):
        visible = np.arange(start[r], end[r])
        best = visible[np.lexsort((visible, -scores[r, visible]))][:top_k]
        want = np.full(top_k, -1, np.int64)
        want[: best.size] = best
        ids, values = got_ids[r].astype(np.int64), got_values[r]
        if not in_order:  # the set is the contract: compare it in the oracle's order
            order = np.argsort(-ids)
            ids, values, want = ids[order], values[order], np.sort(want)[::-1]
        if not np.array_equal(ids, want):
            problems.append(f"row {r}: {int(np.sum(ids != want))} of {top_k} ids differ")
            continue
        listed = ids >= 0
        expected = np.where(listed, scores[r, np.maximum(ids, 0)], -np.inf)
        if not np.array_equal(values, expected):
            bad = int(np.sum(values != expected))
            problems.append(f"row {r}: {bad} of {top_k} values are not their ids' scores")
    return problems


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    cases = common.expand_cases(common.load_presets("topk")[args.preset])
    rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="topk", disable=args.quiet)
    for case in cases:
        t, s, top_k = case["t"], case["s"], case["top_k"]
        label = f"T{t} S{s} K{top_k} {case['ranges']}"
        inputs = make_inputs(case, seed=0)
        # Cold scores, as the indexer bench's keys: inside `base` the scores come warm from
        # the scorer, so this times the selection at its slower, standalone case.
        n_sets = common.rotation_sets(inputs["scores"].nbytes)
        sets = [inputs] + [make_inputs(case, seed=i) for i in range(1, n_sets)]
        visible = float(np.sum(np.asarray(inputs["end"] - inputs["start"], np.int64)))
        nbytes = 4 * visible + 8 * t * top_k
        floor_s = nbytes / (floors.copy_bytes_per_s / 2)  # reads at the copy's rate
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            sort = method == "xla" or not args.unsorted
            row = dict(
                case=label, method=method, t=t, s=s, top_k=top_k, sorted="yes" if sort else "no"
            )
            row.update(bytes=nbytes, floor_ms=1e3 * floor_s)
            fn = jax.jit(select_fn(method, top_k, sort=sort, impl=impl))
            call = lambda a, fn=fn: fn(a["scores"], a["start"], a["end"])  # noqa: E731
            common.check_then_time(
                row, call, sets,
                functools.partial(check, inputs, top_k=top_k, rows=args.check_rows, in_order=sort),
                budget_s=args.budget, device_time=args.device_time, nbytes=nbytes,
                floor_s=floor_s,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla",))
        rows.extend(case_rows)
        del sets, inputs
    progress.close()
    return rows


COLUMNS = [
    ("case", "case"),
    ("method", "method"),
    ("sorted", "sorted"),
    ("ms", "median ms"),
    ("spread_ms", "p10-p90 ms"),
    ("tbps", "TB/s"),
    ("pct_floor", "% floor"),
    ("vs_xla", "× xla"),
    ("device_ms", "GPU busy ms"),
    ("device_vs_xla", "busy × xla"),
    ("status", "status"),
]
