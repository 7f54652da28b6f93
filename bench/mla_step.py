"""Benchmark of one MLA layer's decode step (``--op mla-step``).

One new token per sequence over a BF16 cache of MLA rows ``[latent ; RoPE key]``
(DeepSeek-V3: 512 + 64), its row already written at slot S - 1 when the core runs; q is
the absorbed query of every head. Methods:

* ``dense``: absorbed attention over the whole cache in XLA (``bench.mla.attend``):
  the full-KV step that sparse decoding must beat.
* ``jssa``: :class:`jsparse.nn.SparseMLA`'s decode step as the layer runs it: the new
  row's projection goes into the kept FP8 cache of ``[M c ; k_r]`` (``jssa_mla``, r +
  Dr values a token), the ``projected_scores`` kernel scores every token with the
  heads' mean query, the Top-K kernels pick ``budget`` tokens (one list for all heads),
  and :func:`jsparse.indexed_mla_attention` reads those rows in place.
* ``xla``: the same sparse step in plain JAX: scores (an einsum), ``lax.top_k``,
  gather, attend.

Data are random (the step's cost does not depend on which tokens win). Each method is
checked first: ``dense`` against the f32 reference over every row, the sparse steps
against it over the rows ``lax.top_k`` picks from the same scores. The floor is what
the sparse step must read (the projected cache and the listed rows) or compute (the
attention's FLOPs), whichever takes longer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tqdm import tqdm

import jsparse
from jsparse.nn import SparseMLA
from jsparse.nn.attention import CacheView, prefill_projection

from . import common, decode_step, mla

__all__ = ["COLUMNS", "DEFAULT_METHODS", "add_arguments", "check", "run", "step_fn"]

DEFAULT_METHODS = ["xla", "dense", "jssa"]
COLUMNS = mla.COLUMNS
add_arguments = mla.add_arguments  # --device-time


def make_layer(case: dict, seed: int = 0):
    """The dense BF16 rows; the same rows as the case's serving cache (``dtype`` "fp8":
    e4m3 with a scale per sequence; ``page``: a shuffled page pool; see
    :func:`bench.mla.serving_rows`); a ``jssa_mla`` selector calibrated on random
    activations; and its projected cache of the first S - 1 rows (the prefill and
    earlier steps), projected from the serving cache as the layer's prefill would."""
    b, s, h, dc, dr, rank = (case[x] for x in ("b", "s", "h", "dc", "dr", "rank"))
    d = dc + dr
    kr, kq, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
    rows = jax.random.normal(kr, (b, s, d), jnp.bfloat16)
    src = mla.serving_rows(rows, case.get("dtype", "bf16"), case.get("page"), seed)
    sel = jsparse.make_selector("jssa_mla", rank=rank, latent_dim=dc)
    params = sel.calibrate(
        jax.random.normal(kq, (4096, h, d), jnp.float32),
        jax.random.normal(kk, (4096, 1, d), jnp.float32),
    )
    slots = jnp.arange(s, dtype=jnp.int32)
    earlier = jnp.broadcast_to(jnp.where(slots < s - 1, slots, -1), (b, s))  # slot S-1 empty
    state = prefill_projection(sel, params, row_view(src).dense(), earlier, headroom=2.0)
    return rows, src, sel, params, state


def row_view(src: dict) -> CacheView:
    """The serving rows as the selector's one KV head ([B, S, 1, D] or a pool)."""
    scale = src["cache_scale"]
    return CacheView(src["cache"][..., None, :], src["page_table"],
                     None if scale is None else scale[:, None])  # fmt: skip


def extras(src: dict) -> dict:
    """The serving arguments of a cache (None where it is plain)."""
    return {n: src[n] for n in ("cache_scale", "page_table")}


def step_fn(method: str, impl: str, case: dict, sel, params):
    """``(q, rows, extra, state) -> (out [B, H, Dc], state)``: ``extra`` the serving
    arguments (:func:`extras`; ``dense`` gets the dense BF16 rows and ignores them). The
    caller donates the state (the sparse steps write one projected row into it;
    ``dense`` passes it through)."""
    b, s, dc, n = case["b"], case["s"], case["dc"], case["budget"]
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_positions = jnp.full((b, 1), s - 1, jnp.int32)
    if method == "jssa":
        core = SparseMLA(sel, params, n, implementation=impl)

        def jssa(q, rows, extra, state):
            out, state = core(
                q[:, None], rows, q_positions=q_positions, k_positions=positions,
                scale=mla.SCALE, latent_dim=dc, core_state=state, **extra,
            )  # fmt: skip
            return out[:, 0], state

        return jssa
    if method == "xla":

        def xla(q, rows, extra, state):
            src = dict(cache=rows, **extra)
            lists, state = reference_lists(sel, params, q, row_view(src), state, n)
            out = mla.xla_gather_attention(q, rows, lists, extra["cache_scale"], dc,
                                           extra["page_table"])  # fmt: skip
            return out, state

        return xla
    if method == "dense":
        return lambda q, rows, extra, state: (mla.attend(q, rows, dc), state)
    raise SystemExit(f"--op mla-step has methods xla, dense and jssa, not {method!r}")


def reference_lists(sel, params, q, keys: CacheView, state, budget):
    """The sparse step's lists [B, budget] by plain JAX (the GQA step's, for MLA's one KV
    head): append the new row, score, ``lax.top_k``; and the updated state."""
    lists, state = decode_step.reference_lists(sel, params, q, keys, state, budget)
    return lists[:, 0], state


def check(method, got, *, q, src, rows, want_lists, dc) -> list[str]:
    """Every sequence against the f32 reference over the rows ``lax.top_k``
    picks from the serving cache ``src`` (every row of the dense BF16 ``rows`` for
    ``dense``): the MLA bench's check of those lists."""
    if method == "dense":
        src = dict(cache=rows, cache_scale=None, page_table=None)
    return mla.check(method, got, q=q, idx=want_lists, src=src, dc=dc)


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    cases = common.expand_cases(common.load_presets("mla-step")[args.preset])
    out_rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="mla-step", disable=args.quiet)
    for case in cases:
        b, s, h, dc, dr, n, r = (case[x] for x in ("b", "s", "h", "dc", "dr", "budget", "rank"))
        d = dc + dr
        dtype = case.get("dtype", "bf16")
        paged = f" paged {case['page']}" if case.get("page") else ""
        label = f"B{b} S{s} H{h} D{dc}+{dr} N{n} r{r} {dtype}{paged}"
        rows, src, sel, params, state = make_layer(case)
        n_eff = min(n, s)
        io = b * h * (d + dc) * 2  # q in, out back
        row_bytes = d * jnp.dtype(src["cache"].dtype).itemsize
        sparse_bytes = b * s * (r + dr) + b * n_eff * row_bytes + io
        dense_bytes = b * s * d * 2 + io
        flops = 2 * b * h * n_eff * (d + dc)
        dense_flops = 2 * b * h * s * (d + dc)
        rate = floors.matmul_flops_per_s.get("bf16", float("nan"))
        floor_s = max(sparse_bytes / floors.copy_bytes_per_s, flops / rate)
        sets = [
            jax.random.normal(jax.random.PRNGKey(1000 + i), (b, h, d), jnp.bfloat16)
            for i in range(common.rotation_sets(sparse_bytes))
        ]
        want_lists, _ = jax.jit(functools.partial(reference_lists, sel, budget=n))(
            params, sets[0], row_view(src), state
        )
        held = [state]  # each call appends the same row at the same slot
        del state
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            dense = method == "dense"
            nbytes = dense_bytes if dense else sparse_bytes
            row = dict(case=label, method=method, b=b, s=s, h=h, budget=n, rank=r, dtype=dtype)
            row.update(bytes=nbytes, floor_ms=1e3 * floor_s)
            operands = (rows, {}) if dense else (src["cache"], extras(src))
            decode_step.time_step(
                row, step_fn(method, impl, case, sel, params), operands, held, sets, args,
                functools.partial(check, method, q=sets[0], src=src, rows=rows,
                                  want_lists=want_lists, dc=dc),
                nbytes=nbytes, floor_s=floor_s, flops=dense_flops if dense else flops,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla", "dense"))
        out_rows.extend(case_rows)
        del sets, rows, src, held
    progress.close()
    return out_rows
