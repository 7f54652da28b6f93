"""Benchmark of one DeepSeek sparse attention (DSA) decode step (``--op dsa-step``).

One new token per sequence. Its indexer selects ``top_k`` of the S cached tokens, and
its MLA heads attend those rows. The indexer has 64 heads of 128 with FP8 queries and
keys (one scale per key), as in DeepSeek-V3.2. The MLA rows are BF16
``[latent ; RoPE key]`` (512 + 64). The new token's key and row are already written
at slot S - 1. This is what :class:`jsparse.nn.Indexer` and
:class:`jsparse.nn.SelectedMLA` do at T = 1. Methods:

* ``dense``: absorbed attention over every row in XLA (``bench.mla.attend``), the
  full-KV step that DSA must beat.
* ``dsa``: the exact Top-K of the indexer (``indexer_topk_batch``, ``base``: the fused
  scorer and the selection kernels), then ``SelectedMLA``'s
  :func:`jsparse.indexed_mla_attention`, which reads the selected rows in place.
* ``xla``: the same step in plain JAX: the indexer's scores (einsum), ``lax.top_k``,
  a gather of the rows, attention.

Data are random: ``base``'s cost does not depend on which tokens win. Each method is
checked first against the f32 reference attention: ``xla`` over the rows its exact Top-K
selects, ``dense`` over every row, and ``dsa`` over the rows it selected itself, after
its selection is checked to be an exact Top-K of the reference scores up to the FP8
tensor cores' rounding (the indexer bench's check). Random keys at 128K leave
near-ties at the K-th score closer than that rounding, so a kernel and the reference
may pick different rows there, both exact for their own arithmetic (WORKSPACE.md, run
222). The floor is the larger of two times: the bytes read (the indexer's keys and
scales, the selected rows, q and the output) at the copy bandwidth, or the FLOPs (the
indexer's at the FP8 rate, the attention's at the BF16 rate).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tqdm import tqdm

import jsparse
from jsparse.nn import SelectedMLA
from jsparse.ops.indexer.prepare import quantize_fp8

from . import common, indexer, mla

__all__ = ["COLUMNS", "DEFAULT_METHODS", "add_arguments", "check", "run", "step_fn"]

DEFAULT_METHODS = ["xla", "dense", "dsa"]
COLUMNS = mla.COLUMNS
add_arguments = mla.add_arguments  # --device-time


def make_step_inputs(case: dict, seed: int = 0):
    """(rows [B, S, D] bf16, indexer keys [B, S, Di] fp8, their scales [B, S], lengths
    [B] = S): the cache a step reads."""
    b, s, d, di = case["b"], case["s"], case["dc"] + case["dr"], case["di"]
    kr, kk = jax.random.split(jax.random.PRNGKey(seed))
    rows = jax.random.normal(kr, (b, s, d), jnp.bfloat16)
    keys, k_scale = quantize_fp8(jax.random.normal(kk, (b, s, di), jnp.float32))
    return rows, keys, k_scale, jnp.full((b,), s, jnp.int32)


def make_queries(case: dict, seed: int):
    """(absorbed MLA queries [B, H, D] bf16, indexer queries [B, Hi, Di] fp8, head
    weights [B, Hi] f32 with the queries' FP8 scales folded in)."""
    b, h, d, hi, di = case["b"], case["h"], case["dc"] + case["dr"], case["hi"], case["di"]
    kq, ki, kw = jax.random.split(jax.random.PRNGKey(1000 + seed), 3)
    q_idx, q_scale = quantize_fp8(jax.random.normal(ki, (b, hi, di), jnp.float32))
    weights = jax.random.normal(kw, (b, hi), jnp.float32) * (hi * di) ** -0.5 * q_scale
    return jax.random.normal(kq, (b, h, d), jnp.bfloat16), q_idx, weights


def step_fn(method: str, impl: str, case: dict):
    """``(queries, rows, keys, k_scale, lengths) -> out [B, H, Dc]`` (``dsa``: and its
    selection, :class:`jsparse.IndexerTopK`, for the check)."""
    b, s, dc, top_k = case["b"], case["s"], case["dc"], case["top_k"]
    if method == "dsa":
        core = SelectedMLA(implementation=impl)
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))

        def dsa(queries, rows, keys, k_scale, lengths):
            q, q_idx, weights = queries
            top = jsparse.indexer_topk_batch(
                q_idx, weights, keys, top_k, lengths=lengths, k_scale=k_scale,
                implementation=impl,
            )  # fmt: skip
            out = core(
                q[:, None], rows, indices=top.indices[:, None], q_positions=lengths[:, None] - 1,
                k_positions=positions, scale=mla.SCALE, latent_dim=dc,
            )  # fmt: skip
            return out[:, 0], top

        return dsa
    if method == "xla":

        def xla(queries, rows, keys, k_scale, lengths):
            lists = selected_rows(queries, keys, k_scale, lengths, top_k)
            return mla.xla_gather_attention(queries[0], rows, lists, None, dc)

        return xla
    if method == "dense":
        return lambda queries, rows, keys, k_scale, lengths: mla.attend(queries[0], rows, dc)
    raise SystemExit(f"--op dsa-step has methods xla, dense and dsa, not {method!r}")


def selected_rows(queries, keys, k_scale, lengths, top_k: int):
    """[B, top_k] the exact Top-K by plain XLA: the rows every sparse method must attend."""
    _, q_idx, weights = queries
    return jsparse.indexer_topk_batch(
        q_idx, weights, keys, top_k, lengths=lengths, k_scale=k_scale, method="xla"
    ).indices  # fmt: skip


def check(method, got, *, queries, rows, keys, k_scale, lengths, want_lists, dc) -> list[str]:
    """Every sequence against the f32 reference attention: over
    ``want_lists`` (``dense``: every row), or for ``dsa`` over its own selection once
    that passes as an exact Top-K of the reference scores."""
    src = dict(cache=rows, cache_scale=None, page_table=None)
    if method != "dsa":
        return mla.check(method, got, q=queries[0], idx=want_lists, src=src, dc=dc)
    out, top = got
    _, q_idx, weights = queries
    problems = []
    for i in range(out.shape[0]):  # the indexer bench's check, each sequence
        one = dict(q=q_idx, weights=weights, k_cache=keys, k_scale=k_scale, lengths=lengths)
        one = {name: a[i : i + 1] for name, a in one.items()}
        case = dict(t=1, top_k=top.indices.shape[1], dtype="fp8", ranges="batch")
        mine = top.replace(indices=top.indices[i : i + 1], scores=top.scores[i : i + 1])
        problems += [f"sequence {i}: {p}" for p in indexer.check(case, one, mine, rows=1)]
    if problems:
        return problems
    return mla.check(method, out, q=queries[0], idx=top.indices, src=src, dc=dc)


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    cases = common.expand_cases(common.load_presets("dsa-step")[args.preset])
    out_rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="dsa-step", disable=args.quiet)
    for case in cases:
        b, s, h, dc, dr = (case[x] for x in ("b", "s", "h", "dc", "dr"))
        hi, di, top_k = case["hi"], case["di"], case["top_k"]
        if top_k > s:
            raise SystemExit(f"dsa-step case {case}: top_k > s leaves empty slots")
        d = dc + dr
        label = f"B{b} S{s} H{h} D{dc}+{dr} indexer {hi}x{di} K{top_k}"
        cache = make_step_inputs(case)  # rows, keys, k_scale, lengths
        io = b * h * (d + dc) * 2 + b * hi * (di + 4)  # queries in, out back
        sparse_bytes = b * s * (di + 4) + b * top_k * d * 2 + io
        dense_bytes = b * s * d * 2 + b * h * (d + dc) * 2
        index_flops = 2 * b * hi * di * s
        attn_flops = 2 * b * h * top_k * (d + dc)
        dense_flops = 2 * b * h * s * (d + dc)
        rate = floors.matmul_flops_per_s
        compute_s = index_flops / rate.get("fp8", float("nan")) + attn_flops / rate.get(
            "bf16", float("nan")
        )
        floor_s = max(sparse_bytes / floors.copy_bytes_per_s, compute_s)
        sets = [make_queries(case, i) for i in range(common.rotation_sets(sparse_bytes))]
        want_lists = jax.jit(functools.partial(selected_rows, top_k=top_k))(sets[0], *cache[1:])
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            dense = method == "dense"
            row = dict(case=label, method=method, b=b, s=s, h=h, top_k=top_k)
            row.update(bytes=dense_bytes if dense else sparse_bytes, floor_ms=1e3 * floor_s)
            step = jax.jit(step_fn(method, impl, case))
            common.check_then_time(
                row, functools.partial(lambda queries, step, cache: step(queries, *cache),
                                       step=step, cache=cache),
                sets, functools.partial(check, method, queries=sets[0], rows=cache[0],
                                        keys=cache[1], k_scale=cache[2], lengths=cache[3],
                                        want_lists=want_lists, dc=dc),
                budget_s=args.budget, device_time=args.device_time, nbytes=row["bytes"],
                floor_s=floor_s, flops=dense_flops if dense else index_flops + attn_flops,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla", "dense"))
        out_rows.extend(case_rows)
        del sets, cache
    progress.close()
    return out_rows
