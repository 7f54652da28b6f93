"""Benchmark of one attention layer's decode step (``--op decode-step``).

One new token per sequence. As in a model, its key and value are already in the
[B, S, Hkv, D] BF16 cache (slot S - 1, every slot visible) when the core runs. Methods:

* ``dense``: attention over the whole cache (``jax.nn.dot_product_attention``, cuDNN
  where it runs): the full-KV step that sparse decoding must beat.
* ``jssa``: :class:`jsparse.SparseAttention`'s decode step with its kept FP8 projected
  cache, as a model runs it. It projects the new key into the cache. It scores the cache
  with the projected mean query (the ``projected_scores`` kernel), and selects the top
  ``budget`` per KV head with the Top-K kernels. :func:`jsparse.indexed_attention` then
  reads those rows in place.
* ``xla``: the same sparse step in plain JAX: scores (an einsum), ``lax.top_k``,
  gather, attend.

Data are random (the step's cost does not depend on which tokens win; accuracy is
measured on the real model, ``--op model sparse-decode``). Each method is checked first:
``dense`` against the f32 reference over every row, the sparse steps against the
reference attention over the rows ``lax.top_k`` picks from the same scores. The floor
is what the sparse step must read: the projected cache and the selected K/V rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from tqdm import tqdm

import jsparse
from jsparse.nn.attention import CacheView, prefill_projection
from jsparse.ops.projected import projected_scores

from . import common
from .attention import (
    COLUMNS,
    add_arguments,
    cudnn_runs,
    dense_attention,
    serving_cache,
    xla_gather_attention,
)
from .attention import check as attention_check

__all__ = [
    "COLUMNS", "DEFAULT_METHODS", "add_arguments", "check", "run", "step_fn", "time_step",
]  # fmt: skip

DEFAULT_METHODS = ["xla", "dense", "jssa"]


def make_layer(case: dict, seed: int = 0):
    """The dense BF16 K/V cache; the same rows as the case's serving cache (``kv`` "fp8":
    e4m3 with scales; ``page``: a shuffled page pool; see
    :func:`bench.attention.serving_cache`); a JSSA selector calibrated on random
    activations; and its FP8 projected cache of the first S - 1 tokens (the prefill and
    earlier steps), projected from the serving cache as a model's prefill would."""
    b, s, h, hkv, d, rank = (case[x] for x in ("b", "s", "h", "hkv", "d", "rank"))
    kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 3)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    cache = serving_cache(k, v, case.get("kv", "bf16"), case.get("page"), seed)
    sel = jsparse.make_selector("jssa", rank=rank)
    kq, kk2 = jax.random.split(kc)
    params = sel.calibrate(
        jax.random.normal(kq, (4096, h, d), jnp.float32),
        jax.random.normal(kk2, (4096, hkv, d), jnp.float32),
    )
    slots = jnp.arange(s, dtype=jnp.int32)
    earlier = jnp.broadcast_to(jnp.where(slots < s - 1, slots, -1), (b, s))  # slot S-1 empty
    state = prefill_projection(sel, params, key_view(cache).dense(), earlier, headroom=2.0)
    return (k, v), cache, sel, params, state


def key_view(cache: dict) -> CacheView:
    return CacheView(cache["k"], cache["page_table"], cache["k_scale"])


def extras(cache: dict) -> dict:
    """The serving arguments of a cache (None where it is plain)."""
    return {n: cache[n] for n in ("k_scale", "v_scale", "page_table")}


def step_fn(method: str, impl: str, case: dict, sel, params, *, on_gpu: bool, dense=None):
    """``(q, k, v, extra, state) -> (out [B, H, D], state)``: ``extra`` the serving
    arguments (:func:`extras`; ``dense`` reads the dense BF16 ``dense`` cache and
    ignores them). The cache and state go in as arguments (closed over, jit would embed
    them in the program as constants); the caller donates the state, so that the step
    updates it in place as a decode loop does (the sparse steps write one projected key
    into it; ``dense`` passes it through)."""
    b, s, d, n = case["b"], case["s"], case["d"], case["budget"]
    scale = 1.0 / math.sqrt(d)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_positions = jnp.full((b, 1), s - 1, jnp.int32)
    if method == "jssa":
        core = jsparse.SparseAttention(sel, params, n, implementation=impl)

        def jssa(q, k, v, extra, state):
            out, state = core(
                q[:, None], k, v, q_positions=q_positions, k_positions=positions,
                core_state=state, **extra,
            )  # fmt: skip
            return out[:, 0], state

        return jssa
    if method == "xla":

        def xla(q, k, v, extra, state):
            keys = CacheView(k, extra["page_table"], extra["k_scale"])
            lists, state = reference_lists(sel, params, q, keys, state, n)
            out = xla_gather_attention(q, k, v, lists, extra["k_scale"], extra["v_scale"],
                                       scale, extra["page_table"])  # fmt: skip
            return out, state

        return xla
    if method == "dense":
        cudnn = on_gpu and cudnn_runs({"k": dense[0], "v": dense[1]}, case["h"])
        return lambda q, k, v, extra, state: (dense_attention(q, k, v, scale, cudnn=cudnn), state)
    raise SystemExit(f"--op decode-step has methods xla, dense and jssa, not {method!r}")


def reference_lists(sel, params, q, keys: CacheView, state, budget):
    """The sparse step's lists by plain JAX: append the new key (slot S - 1 of the
    ``keys`` cache, widened), score, ``lax.top_k``; and the updated state."""
    b, s = q.shape[0], keys.tokens
    last = jnp.full((b,), s - 1, jnp.int32)
    state = sel.append_keys(params, state, keys.rows(last), last)
    qp = sel.project_queries(params, q) * state.scale[:, :, None]
    scores = projected_scores(qp, state.values, implementation="reference")  # XLA's einsum
    return jax.lax.top_k(scores, min(budget, s))[1].astype(jnp.int32), state


def check(method, got, *, q, cache, dense, want_lists, scale) -> list[str]:
    """Every sequence against the f32 reference attention over the rows
    ``lax.top_k`` picks from the serving cache (every row of the dense BF16 cache for
    ``dense``): the attention bench's check of those lists."""
    plain = dict(k=dense[0], v=dense[1], k_scale=None, v_scale=None, page_table=None)
    return attention_check(method, got, q=q, idx=want_lists, cache=cache, dense_cache=plain,
                           scale=scale)  # fmt: skip


def time_step(row, step, operands, held, sets, args, check_fn, **rates):
    """Check, then time ``step(q, *operands, state) -> (out, state)`` over the query
    ``sets``, the state donated: ``held[0]`` is swapped for the step's new state at each
    call, as a decode loop does. ``rates``: ``nbytes``, ``floor_s`` (and ``flops``)."""
    fn = jax.jit(step, donate_argnums=len(operands) + 1)

    def call(q):
        out, held[0] = fn(q, *operands, held[0])
        return out

    common.check_then_time(
        row, call, sets, check_fn, budget_s=args.budget, device_time=args.device_time, **rates
    )


def run(args, floors: common.Floors, impl: str) -> list[dict]:
    from jsparse import backend

    on_gpu = backend.has_nvidia_gpu()
    cases = common.expand_cases(common.load_presets("decode-step")[args.preset])
    rows = []
    progress = tqdm(total=len(cases) * len(args.method), desc="decode-step", disable=args.quiet)
    for case in cases:
        b, s, h, hkv, d, n, r = (case[x] for x in ("b", "s", "h", "hkv", "d", "budget", "rank"))
        kv_dtype = case.get("kv", "bf16")
        paged = f" paged {case['page']}" if case.get("page") else ""
        label = f"B{b} S{s} H{h}/{hkv} D{d} N{n} r{r} {kv_dtype}{paged}"
        try:
            dense, cache, sel, params, state = make_layer(case)
        except Exception as err:  # the 32 x 128K cases need more than an 80 GB card
            if not common.out_of_memory(err):
                raise
            rows.extend(common.unfit_rows(label, args.method, err, b=b, s=s, budget=n, rank=r,
                                          kv=kv_dtype))  # fmt: skip
            progress.update(len(args.method))
            continue
        scale = 1.0 / math.sqrt(d)
        n_eff = min(n, s)
        row_bytes = 2 * d * jnp.dtype(cache["k"].dtype).itemsize  # one K and one V row
        sparse_bytes = b * s * hkv * r + b * hkv * n_eff * row_bytes + b * h * 2 * d * 2
        dense_bytes = b * s * hkv * 2 * d * 2 + b * h * 2 * d * 2
        floor_s = sparse_bytes / floors.copy_bytes_per_s
        sets = [
            jax.random.normal(jax.random.PRNGKey(1000 + i), (b, h, d), jnp.bfloat16)
            for i in range(common.rotation_sets(sparse_bytes))
        ]
        want_lists, _ = jax.jit(functools.partial(reference_lists, sel, budget=n))(
            params, sets[0], key_view(cache), state
        )
        # Each call appends the same key at the same slot: chaining the donated state
        # through every call and method leaves it the same.
        held = [state]
        del state
        case_rows = []
        for method in args.method:
            progress.set_postfix_str(f"{label} {method}")
            nbytes = dense_bytes if method == "dense" else sparse_bytes
            row = dict(case=label, method=method, b=b, s=s, budget=n, rank=r, kv=kv_dtype)
            row.update(bytes=nbytes, floor_ms=1e3 * floor_s)
            step = step_fn(method, impl, case, sel, params, on_gpu=on_gpu, dense=dense)
            operands = (*dense, {}) if method == "dense" else (cache["k"], cache["v"],
                                                               extras(cache))  # fmt: skip
            time_step(
                row, step, operands, held, sets, args,
                functools.partial(check, method, q=sets[0], cache=cache, dense=dense,
                                  want_lists=want_lists, scale=scale),
                nbytes=nbytes, floor_s=floor_s,
            )  # fmt: skip
            case_rows.append(row)
            progress.update()
        common.add_speedups(case_rows, ("xla", "dense"))
        rows.extend(case_rows)
        del sets, dense, cache, held
    progress.close()
    return rows
