"""Benchmark plumbing shared by every op: environment, floors, timing, tables."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import math
import statistics
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jsparse._cli import check_writable, positive_int  # noqa: F401  (the bench's flags use them)
from jsparse._environment import environment  # noqa: F401  (bench modules call common.environment)

ROOT = Path(__file__).resolve().parents[1]
L2_BYTES = 60 * 2**20  # H200; rotating inputs only matters when a set fits in L2
MAX_INPUT_SETS = 16


def refuse_unknown_methods(op: str, methods: Sequence[str], known: Sequence[str]) -> None:
    """Stops the run, before any input is built, when ``--method`` names one ``op`` lacks."""
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise SystemExit(f"--op {op} has methods {', '.join(known)}, not {unknown}")


def rotation_sets(bytes_per_set: int) -> int:
    """How many input sets a timing loop rotates over so that a set's bytes have left the
    L2 before the set comes round again: the others span ≥ 2× the L2 (at most
    MAX_INPUT_SETS). Three sets of a 16 MiB one-query key cache were 48 MiB, less than
    the L2, so part of each call's keys was still there from its last turn."""
    if bytes_per_set >= 2 * L2_BYTES:
        return 1
    return min(MAX_INPUT_SETS, 1 + -(-2 * L2_BYTES // max(bytes_per_set, 1)))


BACKENDS = {"pallas-gpu": "triton", "interpret": "triton", "xla": "reference"}


# Preset fields that mean the same in every configs/<op>.toml, checked when the presets
# are read: a bad value used to surface as a KeyError or a shape error deep in a case.
POSITIVE_FIELDS = ("t", "s", "b", "h", "hkv", "d", "dc", "dr", "hi", "di", "rank", "budget",
                   "top_k")  # fmt: skip
PAGE_FIELDS = ("page", "page_size")  # 0: a dense cache
DTYPE_FIELDS = ("dtype", "index_dtype", "kv")
DTYPE_NAMES = ("bf16", "fp8", "f32")  # the names measure_floors knows
RANGES = ("all", "causal", "batch")


def load_presets(op: str) -> dict:
    """configs/<op>.toml, every preset checked by :func:`check_preset`."""
    with open(ROOT / "configs" / f"{op}.toml", "rb") as f:
        presets = tomllib.load(f)
    for name, preset in presets.items():
        check_preset(op, name, preset)
    return presets


def check_preset(op: str, name: str, preset, dtypes: Sequence[str] = DTYPE_NAMES) -> None:
    """Stops with ``preset NAME: field=value: expected ...`` when a case of the preset has
    a field no op can run: a non-positive size, an unknown dtype name (``dtype``: one of
    ``dtypes``, the op's own where it has a list), an unknown ``ranges``, a causal chunk
    longer than its context, a budget beyond the context, query heads not a multiple of
    the KV heads, a page not dividing the context, a rank beyond the head dim."""
    where = f"configs/{op}.toml: preset {name}"
    cases = preset.get("cases") if isinstance(preset, dict) else None
    if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
        raise SystemExit(f"{where}: expected a non-empty `cases` list of tables")

    def refuse(case, field, expected):
        raise SystemExit(f"{where}: {field}={case[field]!r}: expected {expected}")

    def is_int(value):
        return isinstance(value, int) and not isinstance(value, bool)

    for case in expand_cases(preset):
        for field in POSITIVE_FIELDS:
            if field in case and not (is_int(case[field]) and case[field] >= 1):
                refuse(case, field, "a positive int")
        for field in PAGE_FIELDS:
            if field in case and not (is_int(case[field]) and case[field] >= 0):
                refuse(case, field, "an int >= 0 (0: dense)")
        for field in DTYPE_FIELDS:
            known = dtypes if field == "dtype" else DTYPE_NAMES
            if field in case and case[field] not in known:
                refuse(case, field, f"one of {', '.join(known)}")
        if "ranges" in case and case["ranges"] not in RANGES:
            refuse(case, "ranges", f"one of {', '.join(RANGES)}")
        s = case.get("s")
        if s is not None:
            if case.get("ranges") == "causal" and case.get("t", 0) > s:
                refuse(case, "t", f"at most s={s} (a causal chunk is the last t of s positions)")
            if case.get("budget", 0) > s:
                refuse(case, "budget", f"at most s={s} tokens")
            if case.get("page") and s % case["page"]:
                refuse(case, "page", f"a divisor of s={s}")
        if "hkv" in case and case.get("h", 0) % case["hkv"]:
            refuse(case, "h", f"a multiple of hkv={case['hkv']}")
        if "rank" in case and "d" in case and case["rank"] > case["d"]:
            refuse(case, "rank", f"at most d={case['d']}")


def expand_cases(preset: dict) -> list[dict]:
    """Cases of a preset; a list-valued field expands into one case per value."""
    out = []
    for case in preset["cases"]:
        lists = {k: v for k, v in case.items() if isinstance(v, list)}
        if not lists:
            out.append(dict(case))
            continue
        keys = list(lists)
        for combo in np.ndindex(*(len(lists[k]) for k in keys)):
            c = dict(case)
            c.update({k: lists[k][i] for k, i in zip(keys, combo, strict=True)})
            out.append(c)
    return out


def shuffled_pages(caches: Sequence, page: int, seed: int = 0):
    """(pools, page_table [B, S / page]): dense caches [B, S, ...] cut into pages of
    ``page`` tokens, stored in one random order in pools [B·S / page, page, ...] (the
    same order for every cache: one table serves them all), as a paged serving cache
    holds them."""
    b, s = caches[0].shape[:2]
    if s % page:
        raise SystemExit(f"page {page} does not divide the context {s}")
    m = s // page
    order = jax.random.permutation(jax.random.PRNGKey(seed), b * m).astype(jnp.int32)
    pools = [
        jnp.zeros((b * m, page, *x.shape[2:]), x.dtype).at[order].set(
            x.reshape(b * m, page, *x.shape[2:])
        )
        for x in caches
    ]  # fmt: skip
    return pools, order.reshape(b, m)


def widen_threshold(text: str) -> int | str:
    """``--widen-fp8-from``'s value: a query count, or ``never`` (FP8 stays in registers)."""
    if text == "never":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a query count or 'never', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a query count ≥ 1 or 'never', got {value}")
    return value


def widen_setting(value: int | str) -> int | None:
    """``WIDEN_FP8_IN_MEMORY_FROM`` for a parsed ``--widen-fp8-from``."""
    return None if value == "never" else value


def add_widen_argument(parser):
    """``--widen-fp8-from``, shared by the indexer benchmark and the tile sweep."""
    parser.add_argument(
        "--widen-fp8-from", type=widen_threshold, default=None, metavar="T|never",
        help="widen FP8 inputs to f16 in memory before the Triton scorer for launches of "
        "at least T queries; never: always in registers (default: the library's "
        "WIDEN_FP8_IN_MEMORY_FROM)",
    )  # fmt: skip


def apply_widen_argument(args):
    """Sets the scorer's ``WIDEN_FP8_IN_MEMORY_FROM`` from ``--widen-fp8-from``, if given."""
    if args.widen_fp8_from is not None:
        from jsparse.ops.indexer import triton as scorer

        scorer.WIDEN_FP8_IN_MEMORY_FROM = widen_setting(args.widen_fp8_from)


def block(x):
    return jax.block_until_ready(x)


@dataclasses.dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    calls: int

    def spread(self) -> str:
        return f"{1e3 * self.p10_s:.3f}-{1e3 * self.p90_s:.3f}"


def time_fn(fn: Callable, input_sets: Sequence[tuple], *, budget_s: float = 1.0) -> Timing:
    """Median time per call: warm-up, then repeats of back-to-back calls.

    Calls are issued without waiting (so Python dispatch overlaps device work) and
    rotate over ``input_sets``; each repeat ends with one block_until_ready.
    """
    block(fn(*input_sets[0]))  # compile + warm-up
    t0 = time.perf_counter()
    block(fn(*input_sets[-1]))
    once = max(time.perf_counter() - t0, 1e-6)
    per_repeat = max(1, min(200, int(0.1 / once)))
    repeats = int(max(3, min(15, budget_s / (once * per_repeat))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for i in range(per_repeat):
            out = fn(*input_sets[i % len(input_sets)])
        block(out)
        samples.append((time.perf_counter() - t0) / per_repeat)
    q = statistics.quantiles(samples, n=10) if len(samples) >= 2 else samples * 9
    return Timing(statistics.median(samples), q[0], q[-1], repeats * per_repeat)


def device_busy_by_kernel(fn: Callable, input_sets: Sequence[tuple], *,
                         calls: int = 30) -> dict[str, float] | None:  # fmt: skip
    """GPU busy seconds per call of each kernel (and memset), by name, over ``calls``
    back-to-back calls, from a profiler trace: where a call's device time goes.

    Launch gaps and host dispatch are excluded, so at small shapes this is what a
    model's own jitted step would pay; ``time_fn`` measures what a Python caller pays.
    None where the trace has no GPU activity (a CPU run).
    """
    for args in input_sets:
        block(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            out = None
            for i in range(calls):
                out = fn(*input_sets[i % len(input_sets)])
            block(out)
        (path,) = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    return kernels_from_trace(events, calls)


def _stream_kernels(events: list[dict]) -> list[dict]:
    """The kernel and memset events of a perfetto trace's GPU stream lines."""
    meta = [e for e in events if e.get("ph") == "M"]
    gpus = {e["pid"] for e in meta if e.get("name") == "process_name"
            and "GPU" in e["args"].get("name", "")}  # fmt: skip
    # annotation lines (XLA ops / modules) nest the kernels: only stream lines count
    lines = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in meta
             if e.get("name") == "thread_name" and e["pid"] in gpus}  # fmt: skip
    annotation = {key for key, name in lines.items() if name.startswith(("XLA", "Steps"))}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpus
            and (e["pid"], e.get("tid")) not in annotation]  # fmt: skip


def kernels_from_trace(events: list[dict], calls: int) -> dict[str, float] | None:
    """Seconds per call of each GPU kernel name in perfetto trace events, largest first."""
    by_name: dict[str, float] = {}
    for e in _stream_kernels(events):
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + 1e-6 * e["dur"] / calls
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1])) or None


CHECK_EVERY_ROW_UP_TO = 64
OUT_OF_MEMORY = "out of memory"
# A case whose inputs cannot be built in this device's memory (a preset sized for a
# larger card): no method ran, and none is at fault.
DOES_NOT_FIT = "does not fit this device"


def out_of_memory(err: Exception) -> bool:
    """Whether ``err`` is XLA's (or the allocator's) out-of-memory error."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def unfit_rows(label: str, methods: Sequence[str], err: Exception, **fields) -> list[dict]:
    """One row per method of a case that :data:`DOES_NOT_FIT` (``err`` raised while
    building it), saying so instead of stopping the run with a traceback."""
    first = str(err).splitlines()[0][:80]
    status = f"{DOES_NOT_FIT}: {type(err).__name__}: {first}"
    return [dict(case=label, method=m, status=status, **fields) for m in methods]


def rows_to_check(n: int, rows: int) -> np.ndarray:
    """Which of ``n`` rows (queries, sequences) a correctness check compares: all of
    them up to :data:`CHECK_EVERY_ROW_UP_TO` (every decode shape), else ``rows`` spread
    evenly from the first to the last (a reference over 8192 long rows costs more than
    timing them)."""
    if n <= max(rows, CHECK_EVERY_ROW_UP_TO):
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, rows).astype(int))


def check_then_time(row: dict, fn: Callable, sets: Sequence, check: Callable, *,
                    budget_s: float, device_time: bool, nbytes: float, floor_s: float,
                    flops: float | None = None):  # fmt: skip
    """One benchmark row: run ``fn`` on ``sets[0]``, check the result, and only then time
    it over ``sets`` (rotating). ``check(result)`` returns a list of problems. Fills
    ``row`` (status, times, rates; with ``device_time`` also the GPU busy time, in all
    and by kernel) and returns the result (None when it did not run)."""
    try:
        result = block(fn(sets[0]))
    except Exception as err:
        # A naive baseline may not fit in memory (the indexer's `xla` at causal 64K):
        # reported as such, so that the run can tell it from a failure (bench/run.py).
        kind = OUT_OF_MEMORY if out_of_memory(err) else "error"
        row["status"] = f"{kind}: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
        return None
    problems = check(result)
    if problems:
        row["status"] = "CHECK FAILED: " + problems[0]
        print(f"\n{row['case']} {row['method']}: " + "\n  ".join(problems[:5]))
        return result
    args = [(x,) for x in sets]
    timing = time_fn(fn, args, budget_s=budget_s)
    row.update(
        status="ok",
        ms=1e3 * timing.median_s,
        spread_ms=timing.spread(),
        tbps=nbytes / timing.median_s / 1e12,
        pct_floor=100 * floor_s / timing.median_s,
    )
    if flops is not None:
        row["tflops"] = flops / timing.median_s / 1e12
    if device_time:
        kernels = device_busy_by_kernel(fn, args)
        row["device_ms"] = None if kernels is None else 1e3 * sum(kernels.values())
        row["kernels_us"] = {k: 1e6 * v for k, v in (kernels or {}).items()}
    return result


def add_speedups(case_rows: list[dict], refs: Sequence[str]):
    """× ref (and busy × ref) columns for every timed row of one case."""
    ok = {r["method"]: r for r in case_rows if r.get("status") == "ok"}
    for r in case_rows:
        for ref in refs:
            if r.get("status") == "ok" and ref in ok:
                r[f"vs_{ref}"] = ok[ref]["ms"] / r["ms"]
                if r.get("device_ms") and ok[ref].get("device_ms"):
                    r[f"device_vs_{ref}"] = ok[ref]["device_ms"] / r["device_ms"]


@dataclasses.dataclass
class Floors:
    """Ceilings measured once per run on this device (what 100% of the floor means)."""

    copy_bytes_per_s: float
    matmul_flops_per_s: dict  # input dtype name -> FLOP/s of a large XLA matmul

    def as_dict(self):
        return dataclasses.asdict(self)

    def describe(self) -> str:
        rates = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in self.matmul_flops_per_s.items())
        copy = f"floors: copy {self.copy_bytes_per_s / 1e9:.4g} GB/s (read+write)"
        # ops bound by bytes alone (selection, decode steps) measure no matmul rate
        return f"{copy} | XLA matmul {rates}" if rates else copy


def measure_floors(dtypes: Sequence[str], *, on_gpu: bool) -> Floors:
    """Copy bandwidth (read + write) and XLA matmul rates for the dtypes in use."""
    n_copy = (2 << 30) // 4 if on_gpu else (64 << 20) // 4
    x = jnp.arange(n_copy, dtype=jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    t = time_fn(copy, [(x,)], budget_s=0.5)
    bandwidth = 2 * 4 * n_copy / t.median_s
    del x
    rates = {}
    m = 8192 if on_gpu else 512
    rng = np.random.default_rng(0)
    for name in dtypes:
        dt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32}[name]
        a = jnp.asarray(rng.standard_normal((m, m), np.float32), dt)
        b = jnp.asarray(rng.standard_normal((m, m), np.float32), dt)
        mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        try:
            t = time_fn(mm, [(a, b)], budget_s=0.5)
            rates[name] = 2 * m**3 / t.median_s
        except Exception as err:  # an XLA without an fp8 GEMM on this device
            rates[name] = float("nan")
            print(f"  (no {name} matmul rate on this device: {type(err).__name__})")
    return Floors(bandwidth, rates)


def fmt(x, digits=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:.0f}"


def print_table(rows: list[dict], columns: list[tuple[str, str]]):
    def cell(row, key):
        value = row.get(key, "")
        return value if isinstance(value, str) else fmt(value)

    # a column no row has (e.g. GPU busy time without --device-time) is left out
    columns = [(k, t) for k, t in columns if any(k in r for r in rows)]
    header = [title for _, title in columns]
    body = [[cell(r, key) for key, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for b in body:
        print("  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)))


def print_kernels(rows: list[dict], *, top: int = 8):
    """Each timed row's largest kernels by GPU busy µs per call (``--device-time``):
    where a case's time goes."""
    rows = [r for r in rows if r.get("kernels_us")]
    if not rows:
        return
    print("GPU busy by kernel, µs per call (largest first):")
    for r in rows:
        kernels = list(r["kernels_us"].items())
        shown = ", ".join(f"{name} {us:.1f}" for name, us in kernels[:top])
        rest = sum(us for _, us in kernels[top:])
        more = f", {len(kernels) - top} more {rest:.1f}" if len(kernels) > top else ""
        print(f"  {r['case']} {r['method']}: {shown}{more}")


def checked_by(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type that runs ``parse`` on the flag's text when it is parsed, before
    the run, and keeps the text (the run parses it again): ``parse``'s ValueError becomes
    the parser's message naming the flag."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    return check


def config_from_ints(spec: str, cls, fields: Sequence[str]):
    """``"a,b,..."`` as ``cls(**{field: int})`` (a tile config from the command line); a
    ValueError naming the expected form, or the config's own complaint."""
    try:
        values = [int(v) for v in spec.split(",")]
    except ValueError:
        values = []
    if len(values) != len(fields):
        raise ValueError(f"got {spec!r}; expected {len(fields)} integers {','.join(fields)}")
    try:
        return cls(**dict(zip(fields, values, strict=True)))
    except ValueError as err:
        raise ValueError(f"got {spec!r}: {err}") from None


def write_json(path: str | None, payload: dict):
    """``payload`` as strict JSON at ``path`` (arrays as lists; other objects, such as
    paths among the arguments, as their text)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(strict_json(payload), f, indent=1, allow_nan=False, default=str)
        print(f"wrote {path}")


def strict_json(x):
    """``x`` with NaN and ±inf as null and numpy numbers as Python ones: JSON that every
    parser reads (a floor the device could not measure is NaN, a survival over no
    screened query too)."""
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict_json(v) for v in x]
    if isinstance(x, np.generic | np.ndarray | jax.Array):
        return strict_json(np.asarray(x).tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return x
