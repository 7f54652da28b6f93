"""Benchmark of the DSA indexer Top-K methods (``--op indexer``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jsparse
from jsparse.ops.indexer import triton as indexer_triton
from jsparse.ops.indexer.api import METHODS  # noqa: F401  (bench.run checks --method against it)
from jsparse.testing import order_mismatches, topk_mismatches

from . import common

DEFAULT_METHODS = ["xla", "base", "full"]
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32}
FP8_MAX = 448.0
# Check tolerance relative to a row's largest |score|: bf16/fp8 products are exact in
# f32; the rest is f32 accumulation (fp8 tensor cores accumulate with fewer bits).
CHECK_RTOL = {"bf16": 2e-5, "fp8": 1e-3, "f32": 2e-5}


def add_arguments(parser):
    parser.add_argument(
        "--check-rows", type=common.positive_int, default=8,
        help="rows of a long shape checked against the reference (decode shapes: every row)",
    )  # fmt: skip
    parser.add_argument(
        "--unsorted", action="store_true",
        help="sorted=False: the exact Top-K set without the final sort by score",
    )  # fmt: skip
    parser.add_argument(
        "--scorer-config", type=common.checked_by(_scorer_config), default=None,
        help="block_t,block_s,num_warps,num_stages for the Triton scorer (default: heuristic)",
    )  # fmt: skip
    parser.add_argument(
        "--device-time", action="store_true",
        help="also the GPU busy time per call from a profiler trace (kernels only: no "
        "host dispatch or launch gaps), speedups on it, and its largest kernels",
    )  # fmt: skip
    common.add_widen_argument(parser)
    parser.add_argument(
        "--implementation", choices=["triton", "mosaic", "reference"], default=None,
        help="the implementation name for base/full instead of the backend's (e.g. mosaic "
        "with --backend pallas-gpu to time the Mosaic GPU scorer; it has base only)",
    )  # fmt: skip


def is_batch(case: dict) -> bool:
    """A batch of sequences: query t over keys of its own (``indexer_topk_batch``)."""
    return case["ranges"] == "batch"


def make_inputs(case: dict, seed: int):
    """i.i.d. Gaussian indexer inputs; FP8 keys carry a per-key scale as DeepSeek stores
    them. A batch case gives each of its T queries a cache of S keys of its own."""
    t, s, h, d = case["t"], case["s"], case["h"], case["d"]
    dtype = DTYPES[case["dtype"]]
    key = jax.random.PRNGKey(seed)
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (t, h, d), jnp.float32)
    k = jax.random.normal(kk, (t, s, d) if is_batch(case) else (s, d), jnp.float32)
    w = jax.random.normal(kw, (t, h), jnp.float32) / np.sqrt(h * d)
    k_scale = None
    if case["dtype"] == "fp8":
        k_scale = jnp.max(jnp.abs(k), axis=-1) / FP8_MAX
        k = k / k_scale[..., None]
        q = q * (FP8_MAX / 4.0) / jnp.max(jnp.abs(q))
    if is_batch(case):
        lengths = jnp.full((t,), s, jnp.int32)
        inputs = dict(q=q.astype(dtype), weights=w, k_cache=k.astype(dtype), k_scale=k_scale,
                      lengths=lengths)  # fmt: skip
        return _paged(inputs, case["page_size"], seed) if case.get("page_size") else inputs
    if case["ranges"] == "causal":
        end = jnp.arange(s - t + 1, s + 1, dtype=jnp.int32)
    else:
        end = jnp.full((t,), s, jnp.int32)
    start = jnp.zeros((t,), jnp.int32)
    return dict(
        q=q.astype(dtype), weights=w, k=k.astype(dtype), k_scale=k_scale, kv_start=start, kv_end=end
    )


def _paged(inputs, page_size: int, seed: int):
    """A batch's caches as pages of ``page_size`` keys shuffled in one pool, with the page
    table (as a serving engine's paged cache)."""
    from jsparse.certified import workloads

    pool, scale, table = workloads.page_cache(
        inputs["k_cache"], inputs["k_scale"], page_size, seed=seed
    )
    return dict(inputs, k_cache=pool, k_scale=scale, page_table=table)


def _batch_oracle_row(inputs, r):
    """Reference scores [S] of batch sequence r's query over its own keys (dense or paged)."""
    from jsparse.ops.indexer.batch import dense_view

    keys, scale, table = inputs["k_cache"], inputs["k_scale"], inputs.get("page_table")
    if table is None:  # a dense cache: sequence r's own rows
        keys, scale = keys[r : r + 1], None if scale is None else scale[r : r + 1]
    else:
        table = table[r : r + 1]
    keys, scale, _ = dense_view(keys, scale, table)  # [1, S, D]; pages below the length exist
    scale = None if scale is None else scale[0]
    scores = jsparse.indexer_scores(
        inputs["q"][r : r + 1], inputs["weights"][r : r + 1], keys[0], k_scale=scale,
        kv_end=inputs["lengths"][r : r + 1], implementation="reference",
    )  # fmt: skip
    return np.asarray(scores, np.float64)[0]


def visible_pairs(inputs) -> float:
    """Visible (query, key) pairs, summed in int64 (a 64K causal prefill has 2^31)."""
    if "lengths" in inputs:
        return float(np.asarray(inputs["lengths"], np.int64).sum())
    lengths = np.asarray(inputs["kv_end"], np.int64) - np.asarray(inputs["kv_start"], np.int64)
    return float(lengths.sum())


def counts(case, inputs):
    """Useful FLOPs (visible pairs × 2HD) and the fewest bytes any method must move."""
    h, d, top_k = case["h"], case["d"], case["top_k"]
    pairs = visible_pairs(inputs)
    flops = pairs * 2 * h * d
    keys = inputs["k_cache"] if "k_cache" in inputs else inputs["k"]
    nbytes = inputs["q"].nbytes + keys.nbytes + inputs["weights"].nbytes
    nbytes += 0 if inputs["k_scale"] is None else inputs["k_scale"].nbytes
    nbytes += case["t"] * top_k * 8  # the answer: ids and scores
    return flops, nbytes


def check(case, inputs, result, rows: int, *, in_order: bool = True) -> list[str]:
    """The result against the jnp reference scorer on every row of a decode shape (a
    spread of ``rows`` of longer ones): the Top-K by the reference's scores, and with
    ``in_order`` the contract's order (score descending, then id) as returned."""
    from jsparse.ops.indexer.reference import indexer_scores_reference

    pick = common.rows_to_check(case["t"], rows)
    if is_batch(case):  # each picked query over its own cache
        oracle = np.stack([_batch_oracle_row(inputs, r) for r in pick])
    else:
        scores = indexer_scores_reference(
            inputs["q"][pick], inputs["weights"][pick], inputs["k"], inputs["k_scale"],
            inputs["kv_start"][pick], inputs["kv_end"][pick],
        )  # fmt: skip
        oracle = np.asarray(scores, np.float64)
    scale = np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0.0) + 1e-12
    atol = CHECK_RTOL[case["dtype"]] * scale
    indices, scores = np.asarray(result.indices)[pick], np.asarray(result.scores)[pick]
    problems = []
    for i, r in enumerate(pick):
        ids, vals = indices[i : i + 1], scores[i : i + 1]
        if in_order:
            found = order_mismatches(ids, vals)
        else:  # an unsorted result: its set is what is checked, so sort it first
            order = np.lexsort((ids[0], -np.nan_to_num(vals[0], nan=np.inf, neginf=-3e38)))
            order = order[np.argsort(ids[0][order] < 0, kind="stable")]  # padding last
            ids, vals, found = ids[:, order], vals[:, order], []
        found += topk_mismatches(ids, vals, oracle[i : i + 1], case["top_k"], atol)
        problems += [p.replace("row 0:", f"row {r}:", 1) for p in found]
    return problems


SCORER_FIELDS = ("block_t", "block_s", "num_warps", "num_stages")


def _scorer_config(text):
    """``--scorer-config`` as a ScorerConfig (None: the heuristic)."""
    if not text:
        return None
    return common.config_from_ints(text, indexer_triton.ScorerConfig, SCORER_FIELDS)


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    presets = common.load_presets("indexer")
    cases = common.expand_cases(presets[args.preset])
    cfg = _scorer_config(args.scorer_config)
    common.apply_widen_argument(args)
    if args.implementation is not None:
        if cfg is not None and args.implementation != "triton":
            raise SystemExit("--scorer-config configures the Triton scorer; drop --implementation")
        impl = args.implementation
    rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="indexer", disable=args.quiet)
    for case in cases:
        paged = f" P{case['page_size']}" if case.get("page_size") else ""
        label = f"T{case['t']} S{case['s']} {case['ranges']}{paged} {case['dtype']}"
        inputs = make_inputs(case, seed=0)
        bytes_per_set = sum(v.nbytes for v in inputs.values() if v is not None)
        n_sets = common.rotation_sets(bytes_per_set)
        sets = [inputs] + [make_inputs(case, seed=i) for i in range(1, n_sets)]
        flops, nbytes = counts(case, inputs)
        rate = floors.matmul_flops_per_s.get(case["dtype"], float("nan"))
        floor_s = max(flops / rate, nbytes / floors.copy_bytes_per_s)
        results = {}
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            row = dict(
                case=label, method=method, **{k: case[k] for k in ("t", "s", "h", "d", "top_k")}
            )
            row.update(dtype=case["dtype"], flops=flops, bytes=nbytes, floor_ms=1e3 * floor_s)
            kwargs = dict(top_k=case["top_k"], method=method, implementation=impl)
            if args.unsorted and method != "xla":
                kwargs["sorted"] = False
            if is_batch(case):
                if cfg is not None:
                    raise SystemExit("--scorer-config: batch cases run the batch tiles")
                fn = functools.partial(jsparse.indexer_topk_batch, **kwargs)
            elif cfg is not None and method in ("base", "full"):
                kwargs.pop("implementation")
                fn = functools.partial(_with_config, cfg=cfg, **kwargs)
            else:
                fn = functools.partial(jsparse.indexer_topk, **kwargs)
            fn = jax.jit(lambda a, fn=fn: fn(**a))

            checked = functools.partial(
                _check_row, case=case, inputs=inputs, rows=args.check_rows, method=method,
                row=row, results=results, in_order=kwargs.get("sorted", True),
            )  # fmt: skip
            common.check_then_time(
                row, fn, sets, checked, budget_s=args.budget, device_time=args.device_time,
                nbytes=nbytes, floor_s=floor_s, flops=flops,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla", "base"))
        rows.extend(case_rows)
        del sets, inputs, results
    progress.close()
    return rows


def _check_row(result, *, case, inputs, rows, method, row, results, in_order):
    """Problems of one method's result: the reference on sampled rows, and id-for-id
    equality with ``base`` (one scorer). Records the result and its report in ``row``."""
    problems = check(case, inputs, result, rows, in_order=in_order)
    base = results.get("base")
    shares_the_scorer = method not in ("base", "xla") and base is not None
    if shares_the_scorer and not (
        np.array_equal(np.asarray(result.indices), np.asarray(base.indices))
        and np.array_equal(np.asarray(result.scores), np.asarray(base.scores), equal_nan=True)
    ):
        problems.append(f"{method} differs from base (same scorer: ids and scores must be equal)")
    results[method] = result
    row["candidates"] = float(np.mean(np.asarray(result.candidates)))
    row["fallbacks"] = int(np.sum(np.asarray(result.fallback)))
    return problems


def _with_config(top_k, method, cfg, sorted=True, **inputs):
    from jsparse.ops.indexer import methods

    inputs["start"] = inputs.pop("kv_start")
    inputs["end"] = inputs.pop("kv_end")
    fn = methods.topk_base if method == "base" else methods.topk_full
    return fn(
        inputs["q"], inputs["weights"], inputs["k"], top_k, inputs["k_scale"],
        inputs["start"], inputs["end"], cfg=cfg, sort=sorted,
    )  # fmt: skip


COLUMNS = [
    ("case", "case"),
    ("method", "method"),
    ("ms", "median ms"),
    ("spread_ms", "p10-p90 ms"),
    ("tflops", "TFLOP/s"),
    ("pct_floor", "% floor"),
    ("vs_xla", "× xla"),
    ("vs_base", "× base"),
    ("device_ms", "GPU busy ms"),
    ("device_vs_xla", "busy × xla"),
    ("candidates", "cand/query"),
    ("fallbacks", "fallbacks"),
    ("status", "status"),
]
