"""Benchmark of indexed decode attention (``--op attention``).

One decode query per sequence over the ``budget`` cache rows each KV head's list names
(GQA, the model's [B, S, Hkv, D] cache). Methods:

* ``base``: :func:`jsparse.indexed_attention`, the rows read in place by the kernel;
* ``xla``: the same sparse attention as plain XLA: gather the rows, then attend;
* ``dense``: full attention over the whole cache (``jax.nn.dot_product_attention``,
  cuDNN where it runs, always a BF16 cache): what selection is meant to beat.

Lists are distinct random positions (no locality: the gather's worst case). The floor
is the bytes the sparse job must move (the listed K/V rows, q, the lists, the output)
at the copy bandwidth; ``dense`` reports its own rate over the whole cache.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jsparse
from jsparse.ops.attention.reference import indexed_attention_reference, listed_locations
from jsparse.selectors.base import quantize_cache

from . import common

DEFAULT_METHODS = ["xla", "dense", "base"]
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}


def add_arguments(parser):
    parser.add_argument(
        "--device-time", action="store_true",
        help="also the GPU busy time per call from a profiler trace (kernels only), by kernel",
    )  # fmt: skip


def make_cache(case: dict, seed: int):
    b, s, hkv, d = case["b"], case["s"], case["hkv"], case["d"]
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    return serving_cache(k, v, case["dtype"], case.get("page"), seed)


def serving_cache(k, v, dtype: str, page: int | None, seed: int = 0) -> dict:
    """K/V [B, S, Hkv, D] as a serving cache holds them: ``dtype`` "fp8" stores e4m3 with
    one scale per (sequence, KV head), amax / 448; ``page`` > 0 moves the rows into a
    shuffled pool of pages with a table. Keys: k, v, k_scale, v_scale, page_table."""
    cache = dict(k=k, v=v, k_scale=None, v_scale=None, page_table=None)
    if dtype == "fp8":
        for name, x in (("k", k), ("v", v)):
            fp8 = _fp8_cache(x)
            cache[name], cache[f"{name}_scale"] = fp8.values, fp8.scale
    if page:  # the same rows in a shuffled page pool
        (cache["k"], cache["v"]), cache["page_table"] = common.shuffled_pages(
            [cache["k"], cache["v"]], page, seed
        )
    return cache


@jax.jit
def _fp8_cache(x):
    """The library's amax / 448 scale and rounding, as a model's cache holds them; in one
    program, so that the f32 widening is fused (eagerly it took 16 GiB at 32 x 128K)."""
    return quantize_cache(x.astype(jnp.float32), "float8_e4m3fn")


def make_query(case: dict, seed: int):
    """q [B, H, D] and distinct random lists [B, Hkv, budget]."""
    b, s, h, hkv, d, n = (case[x] for x in ("b", "s", "h", "hkv", "d", "budget"))
    kq, ki = jax.random.split(jax.random.PRNGKey(1000 + seed))
    q = jax.random.normal(kq, (b, h, d), jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.uniform(ki, (b, hkv, s)), n)[1].astype(jnp.int32)
    return q, idx


def xla_gather_attention(q, k, v, idx, k_scale, v_scale, scale, page_table=None):
    """The sparse job in plain XLA: gather the listed rows, then attend (bf16 math)."""
    b, h, d = q.shape
    hkv = k.shape[2]
    _, i0, i1 = listed_locations(idx, k, page_table)  # the bench's lists are all valid

    def rows(cache, s):
        r = cache[i0, i1, jnp.arange(hkv)[None, :, None]].astype(jnp.bfloat16)
        return r if s is None else r * s[:, :, None, None].astype(jnp.bfloat16)

    kr, vr = rows(k, k_scale), rows(v, v_scale)
    qg = q.reshape(b, hkv, h // hkv, d)
    logits = jnp.einsum("bkgd,bknd->bkgn", qg, kr, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bkgn,bknd->bkgd", p, vr, preferred_element_type=jnp.float32)
    return out.reshape(b, h, -1).astype(q.dtype)


def dense_attention(q, k, v, scale, *, cudnn: bool):
    out = jax.nn.dot_product_attention(
        q[:, None], k, v, scale=scale, implementation="cudnn" if cudnn else None
    )
    return out[:, 0]


def cudnn_runs(cache, heads: int) -> bool:
    """Whether cuDNN's fused attention compiles for this cache (else XLA's, reported)."""
    b, _, _, d = cache["k"].shape
    q = jax.ShapeDtypeStruct((b, heads, d), jnp.bfloat16)
    try:
        fn = functools.partial(dense_attention, scale=1.0, cudnn=True)
        jax.jit(fn).lower(q, cache["k"], cache["v"]).compile()
        return True
    except Exception as err:  # any refusal of cuDNN's
        print(f"  (dense: cuDNN attention does not run here, XLA's instead: {type(err).__name__})")
        return False


def method_fn(method, impl, scale, *, heads: int, on_gpu: bool, dense_cache=None):
    """(q, idx, k, v, k_scale, v_scale, page_table) -> out [B, H, Dv]; the cache goes in
    as arguments (closed over, jit would embed it in the program as constants).
    ``dense`` reads its dense BF16 cache from k, v and ignores the rest."""
    if method == "base":

        def base(q, idx, k, v, k_scale, v_scale, table):
            return jsparse.indexed_attention(
                q, k, v, idx, scale=scale, k_scale=k_scale, v_scale=v_scale, page_table=table,
                implementation=impl,
            )  # fmt: skip

        return base
    if method == "xla":
        return lambda q, idx, k, v, ks, vs, table: xla_gather_attention(
            q, k, v, idx, ks, vs, scale, table
        )
    if method == "dense":
        cudnn = on_gpu and cudnn_runs(dense_cache, heads)
        fn = functools.partial(dense_attention, scale=scale, cudnn=cudnn)
        return lambda q, idx, k, v, ks, vs, table: fn(q, k, v)
    raise SystemExit(f"--op attention has methods base, xla and dense, not {method!r}")


_reference = jax.jit(indexed_attention_reference, static_argnames="scale")


def attention_reference(q, k, v, lists, *, scale, k_scale, v_scale, page_table):
    """The f32 output of the op's own reference (not the public API the methods call)."""
    return _reference(q, k, v, lists, scale=scale, k_scale=k_scale, v_scale=v_scale,
                      page_table=page_table)[0]  # fmt: skip


def check(method, got, *, q, idx, cache, dense_cache, scale) -> list[str]:
    """Every sequence against the f32 reference (``dense``: over every row)."""
    problems = []
    for i in range(q.shape[0]):
        src = dense_cache if method == "dense" else cache
        one = {n: None if src[n] is None else src[n][i : i + 1]
               for n in ("k_scale", "v_scale", "page_table")}  # fmt: skip
        lists = idx[i : i + 1]
        k, v = src["k"], src["v"]  # a page pool is shared: the table picks the sequence
        if src["page_table"] is None:
            k, v = k[i : i + 1], v[i : i + 1]
        if method == "dense":
            s, hkv = src["k"].shape[1], src["k"].shape[2]
            lists = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, hkv, s))
        want = attention_reference(q[i : i + 1], k, v, lists, scale=scale, **one)
        problems += output_mismatch(i, got[i], want[0])
    return problems


# BF16 arithmetic puts a correct output within 2^-5 of the reference's largest magnitude
# and 2^-6 of its RMS: the kernels (f32 logits) stay within 6.1e-3 and 2.4e-3 (CPU), XLA's
# gather-then-attend baseline, whose logits are rounded to BF16, within 1.6e-2 and 8.8e-3
# (MLA on an H100, run 271). Dropping one attended row of 512, or adding 2e-2 to every
# output, moves the RMS by 2.5e-2 or more.
MAX_ERROR = 2.0**-5  # of the reference's largest magnitude
RMS_ERROR = 2.0**-6  # of the reference's root mean square


def output_mismatch(i: int, got, want) -> list[str]:
    """A problem when sequence i's output is off its f32 reference by more than BF16
    arithmetic allows: :data:`MAX_ERROR` of the largest magnitude at any entry, or
    :data:`RMS_ERROR` of the RMS over the sequence."""
    want = np.asarray(want, np.float64)
    err = np.asarray(got, np.float64) - want
    if not np.all(np.isfinite(err)):
        return [f"sequence {i}: non-finite output where the reference is finite"]
    tiny = np.finfo(np.float32).tiny
    largest, rms = np.max(np.abs(want), initial=tiny), np.sqrt(np.mean(want**2)) + tiny
    worst, rms_err = np.max(np.abs(err), initial=0.0), np.sqrt(np.mean(err**2))
    if worst > MAX_ERROR * largest:
        return [
            f"sequence {i}: max |error| {worst:.3g} > {MAX_ERROR} × max |reference| {largest:.3g}"
        ]
    if rms_err > RMS_ERROR * rms:
        return [f"sequence {i}: RMS error {rms_err:.3g} > {RMS_ERROR} × RMS {rms:.3g}"]
    return []


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    from jsparse import backend

    on_gpu = backend.has_nvidia_gpu()
    cases = common.expand_cases(common.load_presets("attention")[args.preset])
    rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="attention", disable=args.quiet)
    for case in cases:
        b, s, h, hkv, d, n = (case[x] for x in ("b", "s", "h", "hkv", "d", "budget"))
        paged = f" paged {case['page']}" if case.get("page") else ""
        label = f"B{b} S{s} H{h}/{hkv} D{d} N{n} {case['dtype']}{paged}"
        cache = make_cache(case, seed=0)
        plain = case["dtype"] == "bf16" and not case.get("page")
        dense_cache = cache if plain else make_cache({**case, "dtype": "bf16", "page": 0}, 0)
        scale = 1.0 / math.sqrt(d)
        itemsize = jnp.dtype(DTYPES[case["dtype"]]).itemsize
        sparse_bytes = b * hkv * n * (2 * d * itemsize + 4) + b * h * 2 * d * 2
        dense_bytes = b * s * hkv * 2 * d * 2 + b * h * 2 * d * 2
        floor_s = sparse_bytes / floors.copy_bytes_per_s
        # Rotate queries and lists (the cache is one): a set's listed rows leave the L2.
        sets = [make_query(case, i) for i in range(common.rotation_sets(sparse_bytes))]
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            nbytes = dense_bytes if method == "dense" else sparse_bytes
            row = dict(case=label, method=method, b=b, s=s, budget=n, dtype=case["dtype"])
            row.update(bytes=nbytes, floor_ms=1e3 * floor_s)
            src = dense_cache if method == "dense" else cache
            fn = jax.jit(
                method_fn(method, impl, scale, heads=h, on_gpu=on_gpu, dense_cache=dense_cache)
            )
            kv = (src["k"], src["v"], src["k_scale"], src["v_scale"], src["page_table"])
            call = lambda a, fn=fn, kv=kv: fn(*a, *kv)  # noqa: E731
            q0, idx0 = sets[0]
            common.check_then_time(
                row, call, sets,
                functools.partial(check, method, q=q0, idx=idx0, cache=cache,
                                  dense_cache=dense_cache, scale=scale),
                budget_s=args.budget, device_time=args.device_time, nbytes=nbytes,
                floor_s=floor_s,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla", "dense"))
        rows.extend(case_rows)
        del sets, cache, dense_cache
    progress.close()
    return rows


COLUMNS = [
    ("case", "case"),
    ("method", "method"),
    ("ms", "median ms"),
    ("spread_ms", "p10-p90 ms"),
    ("tbps", "TB/s"),
    ("pct_floor", "% floor"),
    ("vs_xla", "× xla"),
    ("vs_dense", "× dense"),
    ("device_ms", "GPU busy ms"),
    ("device_vs_xla", "busy × xla"),
    ("device_vs_dense", "busy × dense"),
    ("status", "status"),
]
