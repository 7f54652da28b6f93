"""Benchmark of the indexer scores' derivative (``--op indexer-grad``): the indexer's
training step without the rest of the model.

Times the pullback of :func:`jsparse.indexer_scores` for a cotangent of the scores, under
``jit`` (the forward's scores are not used, so XLA drops them; what is left is what
``jax.grad`` adds to a step). ``xla`` is the reference's derivative (f32 einsums over
every query's [H, S] logits, what a jnp indexer differentiates to); ``base`` is the
backward kernels (:mod:`jsparse.ops.indexer.backward`).

The check compares each cotangent with the analytic derivative (the formulas of
``backward.py``'s docstring as f32 einsums, computed apart from both methods) by
relative Frobenius error: a ReLU gate at a logit within rounding of 0 can flip between
two arithmetics, so entries may differ where norms agree. TFLOP/s counts the kernels'
four dots a (query, key, head); the floor counts three (the logits once, dq, dk) at the
XLA matmul rate of the input dtype, or the bytes at the copy rate.

FP8 inputs are not a case here: JAX rounds a float8 primal's cotangent to E4M3, so
training carries FP8 values in bfloat16 (``jsparse.nn.Indexer.scores``), and the bf16
case is that step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jsparse
from jsparse.ops import f32_dots

from . import common

DEFAULT_METHODS = ["xla", "base"]
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
# Relative Frobenius error allowed against the analytic f32 derivative: bf16 rounds the
# gated cotangent for each pair's second dot (measured 1.7e-3 at 4096 tokens, run 235);
# f32 sums the same products in another order.
CHECK_RTOL = {"bf16": 4e-3, "f32": 1e-5}
# f32 with tf32x3 products (jsparse.ops.f32_dots): more ReLU gates of logits within
# rounding of 0 differ from the float64 oracle's, each a whole term (run 246: 2.3e-4)
CHECK_RTOL_TF32X3 = 1e-3
HIGHEST = jax.lax.Precision.HIGHEST
NAMES = ("dq", "dweights", "dk", "dk_scale")
CONFIG_FIELDS = ("block_t", "block_s", "head_groups", "num_warps", "num_stages", "dq_heads")


def add_arguments(parser):
    parser.add_argument(
        "--device-time", action="store_true",
        help="also the GPU busy time per call from a profiler trace (kernels only), by kernel",
    )  # fmt: skip
    parser.add_argument(
        "--backward-config", type=common.checked_by(_parse_backward_configs), default=None,
        help="block_t,block_s,head_groups,num_warps,num_stages,dq_heads of the backward "
        "kernels for base (default: BackwardConfig()); several, separated by ';', each a row",
    )  # fmt: skip


def backward_configs(text: str | None) -> list:
    """``--backward-config`` as BackwardConfigs ([None]: the default)."""
    try:
        return _parse_backward_configs(text)
    except ValueError as err:
        raise SystemExit(f"--backward-config: {err}") from None


def _parse_backward_configs(text: str | None) -> list:
    """:func:`backward_configs`, with a ValueError naming the expected form for a spec
    that is not six integers (an int() error before) or not a valid BackwardConfig."""
    from jsparse.ops.indexer.backward import BackwardConfig

    if not text:
        return [None]
    return [
        common.config_from_ints(spec, BackwardConfig, CONFIG_FIELDS) for spec in text.split(";")
    ]


def kernels_fn(cfg):
    """inputs -> the backward kernels' cotangents (f32) at tiles ``cfg``."""
    from jsparse.ops.indexer.backward import indexer_scores_vjp_triton

    def pullback(a):
        return indexer_scores_vjp_triton(
            a["cotangent"], a["q"], a["weights"], a["k"], a["k_scale"], a["kv_start"],
            a["kv_end"], cfg=cfg,
        )  # fmt: skip

    return pullback


def make_inputs(case: dict, seed: int) -> dict:
    """Gaussian q, k and weights, per-key scales in [0.5, 2], a Gaussian cotangent; causal
    ranges are the last T of S positions."""
    t, s, h, d = case["t"], case["s"], case["h"], case["d"]
    if case["dtype"] not in DTYPES:
        raise SystemExit(
            f"--op indexer-grad: dtype {case['dtype']!r}; expected one of {sorted(DTYPES)} "
            "(FP8 training carries its values in bf16: the bf16 case)"
        )
    dtype = DTYPES[case["dtype"]]
    kq, kk, kw, kc, kg = jax.random.split(jax.random.PRNGKey(seed), 5)
    if case["ranges"] == "causal":
        end = jnp.arange(s - t + 1, s + 1, dtype=jnp.int32)
    else:
        end = jnp.full((t,), s, jnp.int32)
    return dict(
        q=jax.random.normal(kq, (t, h, d)).astype(dtype),
        weights=jax.random.normal(kw, (t, h)) / np.sqrt(h),
        k=jax.random.normal(kk, (s, d)).astype(dtype),
        k_scale=jax.random.uniform(kc, (s,), minval=0.5, maxval=2.0),
        kv_start=jnp.zeros((t,), jnp.int32),
        kv_end=end,
        cotangent=jax.random.normal(kg, (t, s)),
    )


def pullback_fn(implementation: str):
    """inputs -> (dq, dweights, dk, dk_scale) of ``indexer_scores`` for the cotangent."""

    def pullback(a):
        def scores(q, weights, k, k_scale):
            return jsparse.indexer_scores(
                q, weights, k, k_scale=k_scale, kv_start=a["kv_start"], kv_end=a["kv_end"],
                implementation=implementation,
            )  # fmt: skip

        _, vjp = jax.vjp(scores, a["q"], a["weights"], a["k"], a["k_scale"])
        return vjp(a["cotangent"])

    return pullback


@functools.partial(jax.jit, static_argnames=("chunk",))
def analytic_vjp(q, weights, k, k_scale, kv_start, kv_end, cotangent, *, chunk: int):
    """The derivative from its formulas (``backward.py``), f32 at full precision, ``chunk``
    queries at a time: with a = g·c where visible and the gate m = [q·k ≥ 0],
    dq = w·Σ a·m·k, dw = Σ a·relu(q·k), dk = Σ a·w·m·q, dc = Σ g·Σ_h w·relu(q·k)."""
    t, h, d = q.shape
    s = k.shape[0]
    pad = -t % chunk
    q, weights, kv_start, kv_end, cotangent = (
        jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        for x in (q.astype(jnp.float32), weights, kv_start, kv_end, cotangent)
    )
    k = k.astype(jnp.float32)
    ids = jnp.arange(s)

    def one_chunk(dk_dc, x):
        qc, wc, start, end, g = x
        visible = (ids[None, :] >= start[:, None]) & (ids[None, :] < end[:, None])
        g = jnp.where(visible, g, 0.0)
        a = g * k_scale[None, :]
        logits = jnp.einsum("chd,sd->chs", qc, k, precision=HIGHEST)
        gated = jnp.where(logits < 0, 0.0, a[:, None, :])
        relu = jnp.where(logits < 0, 0.0, logits)
        dq = wc[:, :, None] * jnp.einsum("chs,sd->chd", gated, k, precision=HIGHEST)
        dw = jnp.sum(gated * logits, axis=2)
        dk = jnp.einsum("chs,chd->sd", gated * wc[:, :, None], qc, precision=HIGHEST)
        dc = jnp.sum(g * jnp.einsum("ch,chs->cs", wc, relu, precision=HIGHEST), axis=0)
        return (dk_dc[0] + dk, dk_dc[1] + dc), (dq, dw)

    chunks = tuple(
        x.reshape(-1, chunk, *x.shape[1:]) for x in (q, weights, kv_start, kv_end, cotangent)
    )
    zeros = (jnp.zeros((s, d), jnp.float32), jnp.zeros((s,), jnp.float32))
    (dk, dc), (dq, dw) = jax.lax.scan(one_chunk, zeros, chunks)
    return dq.reshape(-1, h, d)[:t], dw.reshape(-1, h)[:t], dk, dc


def oracle(inputs) -> tuple:
    t, h, _ = inputs["q"].shape
    s = inputs["k"].shape[0]
    chunk = int(max(1, min(t, (1 << 27) // max(1, h * s))))  # ≤ 512 MiB of f32 logits
    return tuple(np.asarray(x, np.float64) for x in analytic_vjp(**inputs, chunk=chunk))


def check(want, got, tol: float) -> list[str]:
    """Cotangents whose relative Frobenius error exceeds ``tol`` (or are not finite)."""
    problems = []
    for name, a, b in zip(NAMES, got, want, strict=True):
        a = np.asarray(a, np.float64)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape}, expected {b.shape}")
            continue
        error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        if not np.isfinite(error) or error > tol:
            problems.append(f"{name}: relative error {error:.2e} > {tol:.0e}")
    return problems


def counts(case, inputs):
    """(the kernels' FLOPs: four dots a visible pair and head; the floor's: three; the
    fewest bytes: inputs, the visible cotangent, the four cotangents)."""
    h, d = case["h"], case["d"]
    pairs = float(np.sum(np.asarray(inputs["kv_end"] - inputs["kv_start"], np.int64)))
    dot = 2 * pairs * h * d
    sizes = {k: v.nbytes for k, v in inputs.items() if k != "cotangent"}
    nbytes = 2 * sum(sizes[k] for k in ("q", "weights", "k", "k_scale")) + 4 * pairs
    return 4 * dot, 3 * dot, nbytes + sizes["kv_start"] + sizes["kv_end"]


def check_rtol(dtype: str) -> float:
    tf32x3 = dtype == "f32" and f32_dots.mode() == "tf32x3"
    return CHECK_RTOL_TF32X3 if tf32x3 else CHECK_RTOL[dtype]


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    cases = common.expand_cases(common.load_presets("indexer-grad")[args.preset])
    configs = backward_configs(args.backward_config)
    if configs != [None] and impl != "triton":
        raise SystemExit("--backward-config: the Triton kernels' tiles; not with --backend xla")
    variants = [(m, cfg) for m in args.method for cfg in (configs if m == "base" else [None])]
    rows = []
    progress = tqdm(total=len(cases) * len(variants), desc="indexer-grad", disable=args.quiet)
    for case in cases:
        label = f"T{case['t']} S{case['s']} H{case['h']} {case['ranges']} {case['dtype']}"
        inputs = make_inputs(case, seed=0)
        n_sets = common.rotation_sets(sum(v.nbytes for v in inputs.values()))
        sets = [inputs] + [make_inputs(case, seed=i) for i in range(1, n_sets)]
        flops, floor_flops, nbytes = counts(case, inputs)
        rate = floors.matmul_flops_per_s.get(case["dtype"], float("nan"))
        floor_s = max(floor_flops / rate, nbytes / floors.copy_bytes_per_s)
        want = oracle(inputs)
        case_rows = []
        for method, cfg in variants:
            progress.set_postfix_str(f"{label} {method}")
            row = dict(case=label, method=method, dtype=case["dtype"], flops=flops, bytes=nbytes)
            row.update(floor_ms=1e3 * floor_s, config="" if cfg is None else _short(cfg))
            if cfg is not None:
                fn = jax.jit(kernels_fn(cfg))
            else:
                fn = jax.jit(pullback_fn("reference" if method == "xla" else impl))
            common.check_then_time(
                row, fn, sets, functools.partial(check, want, tol=check_rtol(case["dtype"])),
                budget_s=args.budget, device_time=args.device_time, nbytes=nbytes,
                floor_s=floor_s, flops=flops,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla",))
        rows.extend(case_rows)
        del sets, inputs, want
    progress.close()
    return rows


def _short(cfg) -> str:
    return ",".join(str(getattr(cfg, name)) for name in CONFIG_FIELDS)


COLUMNS = [
    ("case", "case"),
    ("method", "method"),
    ("config", "backward config"),
    ("ms", "median ms"),
    ("spread_ms", "p10-p90 ms"),
    ("tflops", "TFLOP/s"),
    ("pct_floor", "% floor"),
    ("vs_xla", "× xla"),
    ("device_ms", "GPU busy ms"),
    ("device_vs_xla", "busy × xla"),
    ("status", "status"),
]
