"""Benchmark of indexed MLA decode attention (``--op mla``).

One absorbed decode query per sequence, every head over the ``budget`` cache rows that
its sequence's list names (rows ``[latent ; RoPE key]``, DeepSeek-V3's 512 + 64).
Methods:

* ``base``: :func:`jsparse.indexed_mla_attention`, the rows read in place by the kernel;
* ``xla``: the same sparse attention in plain XLA: gather the rows, then attend;
* ``dense``: absorbed MLA over the whole cache in XLA (BF16): what selection is meant
  to beat.

Lists are distinct random positions. The floor is the larger of the sparse job's bytes
(the listed rows, q, the lists, the output) at the copy bandwidth and its FLOPs
(2·(D + Dc) per head and row) at the XLA matmul rate; ``dense`` reports its own rate
over the whole cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tqdm import tqdm

import jsparse
from jsparse.ops.attention.reference import listed_locations
from jsparse.ops.mla.reference import indexed_mla_attention_reference
from jsparse.selectors.base import quantize_cache

from . import attention, common
from .attention import output_mismatch

DEFAULT_METHODS = ["xla", "dense", "base"]
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
SCALE = 192**-0.5  # DeepSeek-V3: 1/sqrt(128 nope + 64 RoPE dims of a head)


add_arguments = attention.add_arguments  # --device-time


def make_cache(case: dict, seed: int):
    """The cache as the sparse methods read it (:func:`serving_rows`), and the dense BF16
    cache [B, S, Dc + Dr]."""
    b, s, d = case["b"], case["s"], case["dc"] + case["dr"]
    cache = jax.random.normal(jax.random.PRNGKey(seed), (b, s, d), jnp.bfloat16)
    return serving_rows(cache, case["dtype"], case.get("page"), seed), cache


def serving_rows(rows, dtype: str, page: int | None, seed: int = 0) -> dict:
    """MLA rows [B, S, D] as a serving cache holds them: ``dtype`` "fp8" stores e4m3
    with one scale per sequence (amax / 448); ``page`` > 0 moves them into a shuffled
    pool of pages with a table. Keys: cache, cache_scale, page_table."""
    src = dict(cache=rows, cache_scale=None, page_table=None)
    if dtype == "fp8":
        # the library's scale and rounding, the rows as one KV head [B, S, 1, D]
        fp8 = quantize_cache(rows[:, :, None].astype(jnp.float32), "float8_e4m3fn")
        src.update(cache=fp8.values[:, :, 0], cache_scale=fp8.scale[:, 0])
    if page:
        (src["cache"],), src["page_table"] = common.shuffled_pages([src["cache"]], page, seed)
    return src


def make_query(case: dict, seed: int):
    """q [B, H, D] (bf16) and distinct random lists [B, budget]."""
    b, s, h, n, d = case["b"], case["s"], case["h"], case["budget"], case["dc"] + case["dr"]
    kq, ki = jax.random.split(jax.random.PRNGKey(1000 + seed))
    q = jax.random.normal(kq, (b, h, d), jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.uniform(ki, (b, s)), n)[1].astype(jnp.int32)
    return q, idx


def attend(q, rows, dc):
    """Absorbed MLA of q [B, H, D] over bf16 rows [B, N, D] in plain XLA (bf16 math)."""
    logits = jnp.einsum("bhd,bnd->bhn", q, rows, preferred_element_type=jnp.float32) * SCALE
    p = jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bhn,bnc->bhc", p, rows[..., :dc], preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def xla_gather_attention(q, cache, idx, cache_scale, dc, page_table=None):
    """The sparse job in plain XLA: gather the listed rows, then attend."""
    _, i0, i1 = listed_locations(idx, cache, page_table)  # the bench's lists are all valid
    rows = cache[i0, i1].astype(jnp.bfloat16)
    if cache_scale is not None:
        rows = rows * cache_scale[:, None, None].astype(jnp.bfloat16)
    return attend(q, rows, dc)


def method_fn(method, impl, dc):
    """(q, idx, cache, cache_scale, page_table) -> out [B, H, Dc]; ``dense`` gets the
    dense BF16 cache."""
    if method == "base":
        return lambda q, idx, c, cs, table: jsparse.indexed_mla_attention(
            q, c, idx, scale=SCALE, latent_dim=dc, cache_scale=cs, page_table=table,
            implementation=impl,
        )  # fmt: skip
    if method == "xla":
        return lambda q, idx, c, cs, table: xla_gather_attention(q, c, idx, cs, dc, table)
    if method == "dense":
        return lambda q, idx, c, cs, table: attend(q, c, dc)  # every row of the BF16 cache
    raise SystemExit(f"--op mla has methods base, xla and dense, not {method!r}")


_reference = jax.jit(indexed_mla_attention_reference, static_argnames=("latent_dim", "scale"))


def check(method, got, *, q, idx, src, dc) -> list[str]:
    """Every sequence against the op's own f32 reference (``dense``: every row listed)."""
    b, s = q.shape[0], src["cache"].shape[1]
    problems = []
    for i in range(b):
        lists = idx[i : i + 1]
        if method == "dense":
            lists = jnp.arange(s, dtype=jnp.int32)[None]
        one = {n: None if src[n] is None else src[n][i : i + 1]
               for n in ("cache_scale", "page_table")}  # fmt: skip
        cache = src["cache"]  # a page pool is shared: the table picks the sequence
        if src["page_table"] is None:
            cache = cache[i : i + 1]
        want, _ = _reference(q[i : i + 1], cache, lists, latent_dim=dc, scale=SCALE, **one)
        problems += output_mismatch(i, got[i], want[0])
    return problems


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    cases = common.expand_cases(common.load_presets("mla")[args.preset])
    rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="mla", disable=args.quiet)
    for case in cases:
        b, s, h, dc, dr, n = (case[x] for x in ("b", "s", "h", "dc", "dr", "budget"))
        d = dc + dr
        paged = f" paged {case['page']}" if case.get("page") else ""
        label = f"B{b} S{s} H{h} D{dc}+{dr} N{n} {case['dtype']}{paged}"
        cache, bf16_cache = make_cache(case, seed=0)
        dense_src = dict(cache=bf16_cache, cache_scale=None, page_table=None)
        itemsize = jnp.dtype(DTYPES[case["dtype"]]).itemsize
        sparse_bytes = b * n * (d * itemsize + 4) + b * h * (d + dc) * 2
        dense_bytes = b * s * d * 2 + b * h * (d + dc) * 2
        flops = 2 * b * h * n * (d + dc)
        dense_flops = 2 * b * h * s * (d + dc)
        rate = floors.matmul_flops_per_s.get("bf16", float("nan"))
        floor_s = max(sparse_bytes / floors.copy_bytes_per_s, flops / rate)
        # Rotate queries and lists (the cache is one): a set's listed rows leave the L2.
        sets = [make_query(case, i) for i in range(common.rotation_sets(sparse_bytes))]
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            dense = method == "dense"
            nbytes = dense_bytes if dense else sparse_bytes
            row = dict(case=label, method=method, b=b, s=s, h=h, budget=n, dtype=case["dtype"])
            row.update(bytes=nbytes, floor_ms=1e3 * floor_s)
            src = dense_src if dense else cache
            fn = jax.jit(method_fn(method, impl, dc))
            call = lambda a, fn=fn, src=src: fn(  # noqa: E731
                *a, src["cache"], src["cache_scale"], src["page_table"]
            )
            q0, idx0 = sets[0]
            common.check_then_time(
                row, call, sets,
                functools.partial(check, method, q=q0, idx=idx0, src=src, dc=dc),
                budget_s=args.budget, device_time=args.device_time, nbytes=nbytes,
                floor_s=floor_s, flops=dense_flops if dense else flops,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla", "dense"))
        rows.extend(case_rows)
        del sets, cache, bf16_cache, dense_src
    progress.close()
    return rows


# the attention bench's columns, with the achieved TFLOP/s after the TB/s
COLUMNS = [
    *attention.COLUMNS[:5],
    ("tflops", "TFLOP/s"),
    *attention.COLUMNS[5:],
]
