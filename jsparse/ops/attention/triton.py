"""Indexed decode attention as a Pallas Triton kernel: the listed K/V rows, read in place.

One program owns one (sequence, KV head) and a contiguous share of its index list
(split-K: at small batch the lists alone would not fill the GPU). Per step of
``block_n`` list entries:

    ids     [BN]         the list's entries (-1 = empty)
    keys    [BN, D]      gathered straight from the cache, row (b·S + id)·Hkv + h
    logits  [Gp, BN]     the KV head's G query heads (padded to Gp ≥ 16) at once: one
                         tensor-core dot, f32 accumulation
    values  [BN, Dv]     gathered the same way; acc += softmax weights · values

so each listed row is read once per KV head, not once per query head, and nothing is
copied out of the cache first. Each program writes its running max, normaliser and
unnormalised output, and a small second launch merges the splits (log-sum-exp
weights); a list that one program walks alone is normalised in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jsparse import backend
from jsparse._pallas import pallas_call
from jsparse.ops import f32_dots
from jsparse.ops.attention.reference import listed_locations
from jsparse.ops.indexer.triton import next_pow2

# tl.dot needs M ≥ 16: the G query heads of a KV head are padded to this many rows.
MIN_GROUP_ROWS = 16
# Programs a launch aims at, in units of the SM count, when the lists alone give fewer.
PROGRAMS_PER_SM = 2
# FP8 K/V caches (even D and Dv) read as 16-bit words, two values each, with f16 dots
# against a q rescaled per head; False: byte by byte, dots in q's dtype. Words are
# 1.2-1.3× faster from 8 sequences on (run 174: 32 × 32K 53.0 µs, bytes 70.5 in run
# 171), tie at one, and address caches of 2-4 GiB, which byte reads refuse (run 173).
FP8_AS_WORDS = True
# Paged caches: every listed token's page is looked up before the launch (one XLA gather
# over the lists, `pool_slots`), so that the kernel's row loads wait on one load (the
# list) instead of two (the list, then the page table). False: the kernel looks pages
# up itself. GQA bf16 paged against dense: +1-5% in the kernel (run 172), +7-13% before
# (run 174: the kernel matches dense, the gather and select add ~4 µs). FP8 read as
# bytes lost 47% in the kernel at 32 × 32K (run 172); FP8 words lose 4-8% there, 9-13%
# with pages first (run 175). The MLA kernel's switch of the same name is on (1.8× at
# 128 heads).
PAGES_BEFORE_LAUNCH = False
# Output values a merge program weights (a power of two ≥ 16) when the merge has no more
# (pair, head) programs than SMs; else, and with None, a head's whole row. MLA's rows are
# 512 values: at one sequence × 128 heads (32 splits) a program holding its [32, 512]
# partials merged in 5.2 µs against the kernel's 8.2 (run 176); blocks of 128 (4× the
# programs at a quarter of the registers each) take the step from 33.7 to 32.0 µs at
# 1 × 32K and 37.8 to 36.0 at 1 × 128K, but cost 2.7-9 µs from 8 sequences on, where
# 1024+ whole-row programs already fill the GPU (run 185). GQA rows (128) are one block.
MERGE_VDIM_BLOCK: int | None = 128


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the kernel: list entries per step, warps, software-pipeline stages."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        n, w = self.block_n, self.num_warps
        if n < 16 or n & (n - 1):
            raise ValueError(f"AttentionConfig.block_n must be a power of two ≥ 16, got {n}")
        if w < 1 or w & (w - 1):
            raise ValueError(f"AttentionConfig.num_warps must be a power of two, got {w}")
        if self.num_stages < 1:
            raise ValueError(f"AttentionConfig.num_stages must be ≥ 1, got {self.num_stages}")


@dataclasses.dataclass(frozen=True)
class _Plan:
    seq: int  # S, cache rows per (sequence, KV head) (virtual: max_pages · P when paged)
    page_size: int  # P of a paged cache, 0 for a dense [B, S, Hkv, D] one
    pooled: bool  # the lists hold slots of the whole cache (pages looked up before)
    n_pages: int  # pages in the pool read through a table (0: none)
    kv_heads: int
    group: int  # G, query heads per KV head
    group_rows: int  # G padded to a power of two ≥ MIN_GROUP_ROWS
    vdim: int  # Dv: the output's width
    vdim_pad: int  # Dv padded to a power of two (masked loads: the cache is not copied)
    planes: int  # 1, or 2 for FP8 caches read as words (low and high bytes)
    plane_dim: int  # q and key values per plane (D / planes)
    plane_dim_pad: int
    plane_vdim: int  # value dims per plane (Dv / planes)
    plane_vdim_pad: int
    list_len: int  # N
    steps_per_split: int  # list steps of block_n entries a program walks
    steps: int  # list steps in all
    splits: int
    scale: float
    compute: np.dtype
    q_rescaled: bool  # the kernel rescales q per head for f16 dots (FP8 words, bf16 q)
    terms: int  # 1, or 3: an f32 q (and the weights) as bf16 terms against a bf16 cache
    has_k_scale: bool
    has_v_scale: bool
    cfg: AttentionConfig
    interpret: bool


# f32 tiles of more values than this (BN · max(D, Dv)) ran 9-20× slower than BN 32 at
# D 256 BN 128 and D 512 BN 64 (run 261, H100, GPU busy, one stage): spills, not profiled.
F32_TILE_VALUES = 16384


def f32_tensor_core_bytes(cfg: AttentionConfig, dim: int, vdim: int, group: int) -> int:
    """Shared memory of a program whose f32 dots run on the tensor cores (``"tf32x3"``):
    2·BN·(D + Dv) bytes at one stage, BN·(4·(D + Dv) + 136) more a further stage, and the
    group's TF32 q halves, 8·Gp·D (Gp: the ``group`` query heads of a KV head, padded as
    the kernel pads them). Fitted to the six counts the compiler refused in run 260
    (H100, D 256-512, BN 32-128, Gp 16): exact at the one-stage count, at most 1,024
    bytes over the two-stage ones; every tile that compiled there fits it."""
    width = next_pow2(dim, 16) + next_pow2(vdim, 16)
    per_stage = cfg.block_n * (4 * width + 136)
    return (
        2 * cfg.block_n * width
        + (cfg.num_stages - 1) * per_stage
        + 8 * next_pow2(group, MIN_GROUP_ROWS) * next_pow2(dim, 16)
    )


def f32_tensor_core_config(dim: int, vdim: int, group: int) -> AttentionConfig:
    """Tiles for f32 dots on the tensor cores (the ``"tf32x3"`` mode of
    :mod:`jsparse.ops.f32_dots`): 32 list entries a step (at most
    :data:`F32_TILE_VALUES` a row tile), one stage, shrunk until
    :func:`f32_tensor_core_bytes` fits shared memory. Run 261 (H100, 8 sequences × 16K,
    8 KV heads of 4 and 8 query heads, 2048 entries, one stage, GPU busy µs): BN 32 was
    the fastest at D 128 (69 against 77 at BN 64), 256 (191 against 238) and 512 (790
    against 1043 at BN 16); run 245 found one stage faster than two (D 128, BN 64)."""
    widest = max(next_pow2(dim, 16), next_pow2(vdim, 16))
    block_n = max(16, min(32, F32_TILE_VALUES // widest))
    return f32_dots.shrink_to_fit(
        AttentionConfig(block_n=block_n, num_warps=4, num_stages=1),
        lambda c: f32_tensor_core_bytes(c, dim, vdim, group),
        lambda c: "block_n" if c.block_n > 16 else None,
        "indexed_attention",
        f"D {dim}, Dv {vdim}, {group} heads a KV head",
    )


def default_splits(pairs: int, steps: int) -> int:
    """Splits of each list: enough programs for PROGRAMS_PER_SM a SM, at most one a step."""
    want = -(-PROGRAMS_PER_SM * backend.sm_count() // max(pairs, 1))
    return max(1, min(want, steps))


def split_list(pairs: int, list_len: int, block_n: int, splits: int | None = None):
    """(steps, steps per split, splits) of lists of ``list_len`` entries walked
    ``block_n`` a step by ``pairs`` programs a split (``splits`` None: the default)."""
    steps = max(1, -(-list_len // block_n))
    splits = splits or default_splits(pairs, steps)
    per_split = -(-steps // splits)
    return steps, per_split, -(-steps // per_split)  # no program without a step


def cache_geometry(cache, page_table):
    """(slots, P, S) of a cache whose first two axes are [B, S] (dense, P = 0) or
    [n_pages, P] (a page pool; S = max_pages · P, the virtual length a list indexes)."""
    slots = cache.shape[0] * cache.shape[1]
    if page_table is None:
        return slots, 0, cache.shape[1]
    return slots, cache.shape[1], page_table.shape[1] * cache.shape[1]


def _kernel(q_ref, ids_ref, k_ref, v_ref, *refs, p: _Plan):
    """q is [B·Hkv, G, D] in its own order; a K/V row is plane_dim (plane_vdim) cache
    elements: values, or 16-bit words of two FP8 values (then q's even and odd dims are
    the two planes, and the output's planes are stored interleaved)."""
    table_ref, refs = (refs[0], refs[1:]) if p.page_size else (None, refs)
    n_scales = p.has_k_scale + p.has_v_scale
    scale_refs, outs = refs[:n_scales], refs[n_scales:]
    bn = p.cfg.block_n
    pair = pl.program_id(0)  # b·Hkv + h
    split = pl.program_id(1)
    b, h = pair // p.kv_heads, pair % p.kv_heads
    dims = jnp.arange(p.plane_dim_pad)
    vdims = jnp.arange(p.plane_vdim_pad)
    heads = jnp.arange(p.group_rows)
    # typed `other`s: Triton cannot cast an i32 0 to fp8
    k_zero, v_zero = jnp.zeros((), k_ref.dtype), jnp.zeros((), v_ref.dtype)
    # q is [B·Hkv, G, D] as given: the padded head rows and dims load as zeros.
    q = q_planes(q_ref, (pair,), heads, heads < p.group, 0, dims, p.plane_dim, p.planes)
    scale = p.scale
    if p.has_k_scale:
        scale = scale * plt.load(scale_refs[0].at[pair])
    if p.q_rescaled:
        q, unshift = rescaled_f16(q)
        scale = scale * unshift[:, None]
    q = bf16_terms(q[0], p.terms) if p.terms > 1 else [qi.astype(p.compute) for qi in q]
    precision = f32_dots.precision(p.compute)

    def step(j, carry):
        m, l, accs = carry
        at = j * bn + jnp.arange(bn)
        ids = plt.load(ids_ref.at[pair, at], mask=at < p.list_len, other=-1)
        ok, slots = listed_slots(
            ids, 0 if p.pooled else b, table_ref, p.seq, p.page_size, p.n_pages
        )
        rows = slots * p.kv_heads + h
        k_mask = ok[:, None] & (dims[None, :] < p.plane_dim)
        kt = plt.load(k_ref.at[rows[:, None], dims[None, :]], mask=k_mask, other=k_zero)
        k_planes = fp8_planes(kt, p.planes, p.compute)
        if p.terms > 1:  # every term meets the one plane of the bf16 tile
            k_planes = k_planes * p.terms
        logits = sum(
            jax.lax.dot_general(
                qi, ki, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                precision=precision,
            )
            for qi, ki in zip(q, k_planes, strict=True)
        )  # fmt: skip
        logits = jnp.where(ok[None, :], logits * scale, -jnp.inf)  # [Gp, BN]
        m_new, weights, alpha = softmax_weights(m, logits)
        v_mask = ok[:, None] & (vdims[None, :] < p.plane_vdim)
        vt = plt.load(v_ref.at[rows[:, None], vdims[None, :]], mask=v_mask, other=v_zero)
        vt = fp8_planes(vt, p.planes, p.compute)
        return m_new, *accumulated(l, accs, weights, alpha, vt, p.compute, precision, p.terms)

    gp = p.group_rows
    init = (
        jnp.full((gp,), -jnp.inf, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        tuple(jnp.zeros((gp, p.plane_vdim_pad), jnp.float32) for _ in range(p.planes)),
    )
    first = split * p.steps_per_split
    last = jnp.minimum(first + p.steps_per_split, p.steps)
    m, l, accs = jax.lax.fori_loop(first, last, step, init)
    real = heads < p.group
    if p.splits == 1:  # the whole list in one program: normalise here, no merge launch
        v_scale = plt.load(scale_refs[-1].at[pair]) if p.has_v_scale else None
        store_normalized(outs, pair, m, l, accs, v_scale, real, p.plane_vdim)
        return
    acc_ref, m_ref, l_ref = outs
    store_planes(acc_ref, (pair, split), accs, real, p.plane_vdim)
    plt.store(m_ref.at[pair, split], m)
    plt.store(l_ref.at[pair, split], l)


def softmax_weights(m, logits):
    """One online-softmax step over a tile of logits [rows, BN] (-inf where nothing is
    listed): (the running max m_new, the tile's weights, the factor alpha that rescales
    what was accumulated under m)."""
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    # Subtract a finite max: a row that has seen only empty entries stays at 0 weight.
    base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    return m_new, jnp.exp(logits - base[:, None]), jnp.exp(m - base)


def accumulated(l, accs, weights, alpha, value_planes, compute, precision, terms: int = 1):
    """(l, accs) after a tile: the old sums rescaled by alpha plus the tile's weights
    and weights · values, one accumulator a value plane (the weights as ``terms`` bf16
    terms when there are more than one)."""
    ws = bf16_terms(weights, terms) if terms > 1 else [weights.astype(compute)]

    def weighted(v):
        return sum(
            jax.lax.dot_general(
                w, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                precision=precision,
            )
            for w in ws
        )  # fmt: skip

    accs = tuple(
        acc * alpha[:, None] + weighted(v) for acc, v in zip(accs, value_planes, strict=True)
    )
    return l * alpha + jnp.sum(weights, axis=1), accs


def bf16_terms(x, terms: int):
    """``x`` (f32) as ``terms`` bf16 values, each the bf16 rounding of what the previous
    ones left, so that the sum misses ``x`` by at most 2^-8n of it: three reach f32's
    2^-24. Three bf16 dots against an exact bf16 operand thus give f32-level products,
    at twice TF32's tensor-core rate and with the operand unsplit."""
    out, rest = [], x
    for _ in range(terms):
        term = rest.astype(jnp.bfloat16)
        out.append(term)
        rest = rest - term.astype(jnp.float32)
    return out


def listed_slots(ids, b, table_ref, seq: int, page_size: int, n_pages: int):
    """(ok, slot) of each listed id of sequence ``b``: ok for ids in [0, seq) (on a page
    of the pool), slot ``b·seq + id`` of a dense cache, or ``table[b, id // P]·P + id %
    P`` of a pool of ``n_pages`` pages (``page_size`` P > 0); the slot of an id not ok is
    0. A table entry outside [0, n_pages) is no page: a traced table is not checked, and
    masking it here costs no launch (in XLA it did: 1 µs a step)."""
    ok = (ids >= 0) & (ids < seq)
    ids = jnp.where(ok, ids, 0)
    if not page_size:
        return ok, b * seq + ids
    page = plt.load(table_ref.at[b, ids // page_size], mask=ok, other=-1)
    ok = ok & (page >= 0) & (page < n_pages)
    return ok, jnp.where(ok, page, 0) * page_size + ids % page_size


def pool_slots(indices, cache, page_table):
    """The lists of a paged cache as slots of its page pool (page·P + offset; -1 for an
    entry out of range or on a missing page): the page lookups done once, before a
    launch, with the references' lookup."""
    valid, page, at = listed_locations(indices, cache, page_table)
    return jnp.where(valid, page * cache.shape[1] + at, -1)


def looked_up_first(indices, cache, page_table, pages_first: bool):
    """(lists, page table, S the lists index, pooled) for a kernel: a paged cache's
    lists as pool slots with no table when ``pages_first``, else as given."""
    slots, _, s = cache_geometry(cache, page_table)
    if page_table is None or not pages_first:
        return indices, page_table, s, False
    return pool_slots(indices, cache, page_table), None, slots, True


def store_normalized(outs, pair, m, l, planes, v_scale, real, width: int):
    """out = acc / l (0 where nothing was attended) in the output dtype and lse = m +
    log l, for the ``real`` head rows: the output's ``planes`` (``width`` real dims each,
    stored interleaved by :func:`store_planes`; the MLA kernel's too)."""
    out_ref, lse_ref = outs
    some = l != 0  # l is 0 only where nothing was attended; a NaN l stays NaN
    safe = jnp.where(some, l, 1.0)
    factor = jnp.where(some, 1.0 / safe, 0.0)
    if v_scale is not None:
        factor = factor * v_scale
    store_planes(out_ref, (pair,), [acc * factor[:, None] for acc in planes], real, width)
    heads = jnp.arange(real.shape[0])
    plt.store(lse_ref.at[pair, heads], jnp.where(some, m + jnp.log(safe), -jnp.inf), mask=real)


def store_planes(ref, prefix, planes, real, width: int):
    """Plane i's ``width`` real dims at columns i, i + n, i + 2n, … (n planes: the
    cache's order, words' low and high bytes interleaved back) of each ``real`` head row
    of ``ref[*prefix]``."""
    heads, dims = jnp.arange(real.shape[0]), jnp.arange(planes[0].shape[1])
    mask = real[:, None] & (dims[None, :] < width)
    for i, plane in enumerate(planes):
        at = ref.at[(*prefix, heads[:, None], dims[None, :] * len(planes) + i)]
        plt.store(at, plane.astype(ref.dtype), mask=mask)


def q_planes(ref, prefix, rows, real, start: int, dims, width: int, planes: int):
    """Rows ``rows`` of ``ref[*prefix]`` ([H, D]) in f32, as ``planes`` planes of
    ``width`` values from column ``start``: plane i holds columns start + i, start + i +
    n, … (the values that meet the low and high bytes of cache words). Rows not
    ``real`` and padded dims are 0."""
    mask = real[:, None] & (dims[None, :] < width)
    return [
        plt.load(ref.at[(*prefix, rows[:, None], start + dims[None, :] * planes + i)], mask=mask,
                 other=0.0).astype(jnp.float32)
        for i in range(planes)
    ]  # fmt: skip


def fp8_planes(tile, planes: int, compute):
    """The planes of a loaded cache tile in the dots' dtype: the tile itself, or the low
    and high FP8 bytes of each 16-bit word (an FP8 cache read as words)."""
    if planes == 1:
        return [tile.astype(compute)]
    fp8 = jnp.float8_e4m3fn
    lo = jax.lax.bitcast_convert_type((tile & 0xFF).astype(jnp.uint8), fp8)
    hi = jax.lax.bitcast_convert_type((tile >> 8).astype(jnp.uint8), fp8)
    return [lo.astype(compute), hi.astype(compute)]


def fp8_words(cache, width: int):
    """An FP8 cache ``[..., width]`` (even) as 16-bit words ``[..., width / 2]``: a free
    bitcast. Words also address 1-byte caches of 2-4 GiB, which Pallas Triton would
    address with wrapping 32-bit offsets (run 163)."""
    pairs = cache.reshape(*cache.shape[:-1], width // 2, 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.uint16)


def rescaled_f16(q):
    """(planes of q rows in float16, each row times 2**shift, and 2**-shift [rows] f32):
    the power of two that puts a row's max |q| over all planes in [2**13, 2**14), so
    that f16 neither overflows nor flushes what bf16 or f32 held; exact, undone on the
    logits. In-kernel: a row's exponent is read from its f32 bits (frexp's, for normal
    magnitudes), and 2**±shift is built from bits."""
    mag = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=1) for x in q])
    exponent = ((jax.lax.bitcast_convert_type(mag, jnp.int32) >> 23) & 0xFF) - 126
    shift = jnp.clip(14 - exponent, -120, 120)  # f32's exponent range bounds the undo
    up = jax.lax.bitcast_convert_type((shift + 127) << 23, jnp.float32)
    down = jax.lax.bitcast_convert_type((127 - shift) << 23, jnp.float32)
    return [(x * up[:, None]).astype(jnp.float16) for x in q], down


def _merge_kernel(acc_ref, m_ref, l_ref, *refs, p, vdim_block):
    """One program per (pair, query head, block of ``vdim_block`` output values): that
    head's partial softmaxes from every split, loaded at once and weighted by
    exp(m_split - max m). (A loop over the splits waited ~0.6 µs on each split's loads:
    19 µs at 32 splits, run 154; as XLA ops the merge was three to four fusions, ~4 µs,
    run 153.)"""
    v_scale_ref, (out_ref, lse_ref) = (refs[0], refs[1:]) if p.has_v_scale else (None, refs)
    pair, g = pl.program_id(0), pl.program_id(1)
    whole = vdim_block == p.vdim_pad  # a 2-D grid: the launch as it was before blocks
    split = jnp.arange(next_pow2(p.splits))
    real = split < p.splits
    vdims = jnp.arange(vdim_block)
    if not whole:
        block = pl.program_id(2)
        vdims = block * vdim_block + vdims
    m = plt.load(m_ref.at[pair, split, g], mask=real, other=-jnp.inf)
    l = plt.load(l_ref.at[pair, split, g], mask=real, other=0.0)
    acc = plt.load(
        acc_ref.at[pair, split[:, None], g, vdims[None, :]], mask=real[:, None], other=0.0
    )
    top = jnp.max(m)
    base = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(m - base)  # 0 for a split that saw nothing, and for the padding
    total = jnp.sum(w * l)
    out = jnp.sum(w[:, None] * acc, axis=0)  # [Dvp]
    some = total != 0  # as in store_normalized
    safe = jnp.where(some, total, 1.0)
    out = jnp.where(some, out / safe, 0.0)
    if p.has_v_scale:
        out = out * plt.load(v_scale_ref.at[pair])
    plt.store(out_ref.at[pair, g, vdims], out.astype(out_ref.dtype), mask=vdims < p.vdim)

    def store_lse():
        plt.store(lse_ref.at[pair, g], jnp.where(some, base + jnp.log(safe), -jnp.inf))

    if whole:
        store_lse()
    else:
        pl.when(block == 0)(store_lse)


def indexed_attention_triton(
    q, k, v, indices, k_scale, v_scale, *, scale, page_table=None, cfg=None, splits=None
):
    """(out [B, H, Dv] in q's dtype, lse [B, H] float32); see
    :func:`jsparse.indexed_attention`. ``FP8_AS_WORDS`` is read here, at call time, so
    that a changed setting is never hidden by a cached trace (``PAGES_BEFORE_LAUNCH``
    and ``MERGE_VDIM_BLOCK`` too)."""
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    words = (
        FP8_AS_WORDS and jnp.dtype(k.dtype) == fp8 and jnp.dtype(v.dtype) == fp8
        and k.shape[-1] % 2 == 0 and v.shape[-1] % 2 == 0
    )  # fmt: skip
    return _indexed_attention(
        q, k, v, indices, k_scale, v_scale, page_table, scale=scale,
        cfg=_config(q, k, v, cfg), splits=splits, words=bool(words),
        pages_first=PAGES_BEFORE_LAUNCH, merge_block=merge_vdim_block(),
    )  # fmt: skip


def bf16_term_count(q, cache) -> int:
    """3 where an f32 q meets a bf16 cache in ``"tf32x3"`` mode: q and the softmax weights
    then enter bf16 dots as three bf16 terms each (:func:`bf16_terms`), which the exact
    bf16 cache needs no split for; else 1 (the dots in q's dtype)."""
    mixed = jnp.dtype(q.dtype) == jnp.float32 and jnp.dtype(cache.dtype) == jnp.bfloat16
    return 3 if mixed and f32_dots.mode() == "tf32x3" else 1


def _config(q, k, v, cfg: AttentionConfig | None) -> AttentionConfig:
    """``cfg``, or the default tiles; f32 tensor-core tiles must fit shared memory either
    way (a given one is refused by name rather than handed to the compiler)."""
    if not f32_dots.tensor_cores(q.dtype) or bf16_term_count(q, k) > 1:
        return cfg or AttentionConfig()
    dim, vdim, group = k.shape[-1], v.shape[-1], q.shape[1] // k.shape[2]
    if cfg is None:
        return f32_tensor_core_config(dim, vdim, group)
    need = f32_tensor_core_bytes(cfg, dim, vdim, group)
    f32_dots.fits("indexed_attention", need, f"D {dim}, Dv {vdim}, {group} heads a KV head, {cfg}")
    return cfg


@backend.jit_per_mode(
    static_argnames=("scale", "cfg", "splits", "words", "pages_first", "merge_block")
)
def _indexed_attention(q, k, v, indices, k_scale, v_scale, page_table, *, scale, cfg, splits,
                       words, pages_first, merge_block):  # fmt: skip
    b, h, d = q.shape
    out_dtype = q.dtype
    hkv, dv = k.shape[2], v.shape[3]
    indices, page_table, s, pooled = looked_up_first(indices, k, page_table, pages_first)
    slots, page_size, _ = cache_geometry(k, page_table)
    g = h // hkv
    n = indices.shape[2]
    pairs = b * hkv
    steps, per_split, splits = split_list(pairs, n, cfg.block_n, splits)
    compute = jnp.dtype(q.dtype)  # a narrower cache (FP8, or 16-bit under f32) widens to it
    terms = bf16_term_count(q, k)
    compute = jnp.dtype(jnp.bfloat16) if terms > 1 else compute
    gp = next_pow2(g, MIN_GROUP_ROWS)
    planes = 2 if words else 1
    # FP8 words widen to f16 in one conversion, against q rescaled in the kernel; an f32
    # q keeps f32 dots.
    q_rescaled = words and compute == jnp.dtype(jnp.bfloat16)
    compute = jnp.dtype(jnp.float16) if q_rescaled else compute
    if words:
        k, v = fp8_words(k, d), fp8_words(v, dv)
    else:
        backend.check_triton_offsets("indexed_attention", k=k, v=v)
    kw, vw = d // planes, dv // planes
    p = _Plan(
        seq=s, page_size=page_size, pooled=pooled, n_pages=slots // page_size if page_size else 0,
        kv_heads=hkv, group=g, group_rows=gp, vdim=dv,
        vdim_pad=next_pow2(dv, 16), planes=planes, plane_dim=kw, plane_dim_pad=next_pow2(kw, 16),
        plane_vdim=vw, plane_vdim_pad=next_pow2(vw, 16), list_len=n, steps_per_split=per_split,
        steps=steps, splits=splits, scale=float(scale), compute=compute,
        q_rescaled=q_rescaled, terms=terms, has_k_scale=k_scale is not None,
        has_v_scale=v_scale is not None, cfg=cfg, interpret=backend.is_interpret(),
    )  # fmt: skip
    # Reshapes only (free): the kernel masks the padded head rows, dims and list tail.
    inputs = [q.reshape(pairs, g, d), indices.reshape(pairs, n),
              k.reshape(slots * hkv, kw), v.reshape(slots * hkv, vw)]  # fmt: skip
    inputs += [] if page_table is None else [page_table]
    scales = [x.reshape(pairs).astype(jnp.float32) for x in (k_scale, v_scale) if x is not None]
    out, lse = launch_split_k(
        functools.partial(_kernel, p=p), p, [*inputs, *scales],
        scales[p.has_k_scale :], pairs=pairs, dtype=out_dtype, name="jsparse_indexed_attention",
        merge_block=merge_block,
    )  # fmt: skip
    return out.reshape(b, h, dv), lse.reshape(b, h)


def merge_vdim_block() -> int | None:
    """``MERGE_VDIM_BLOCK``, checked; the wrappers read it at call time and pass it to
    their jitted functions as a static argument (a cached trace never hides a change)."""
    block = MERGE_VDIM_BLOCK
    if block is not None and (not isinstance(block, int) or block < 16 or block & (block - 1)):
        raise ValueError(f"MERGE_VDIM_BLOCK: got {block!r}; expected None or a power of two >= 16")
    return block


def launch_split_k(kernel, p, operands, v_scales, *, pairs: int, dtype, name: str,
                   merge_block: int | None = None):  # fmt: skip
    """(out [pairs, group, vdim] in ``dtype``, lse [pairs, group] float32) of a split-K
    decode kernel on the grid (pairs, p.splits): one launch when each list has one
    program (the kernel normalises in place), else the kernel's partial softmaxes
    ``(acc [pairs, splits, group_rows, vdim_pad], m, l [pairs, splits, group_rows])``
    and a merge launch that weights them (``v_scales``: ``[pairs]`` float32 when
    ``p.has_v_scale``). ``p`` needs ``splits``, ``group``, ``group_rows``, ``vdim``,
    ``vdim_pad``, ``has_v_scale``, ``interpret`` and ``cfg`` (warps, stages).
    ``merge_block``: output values a merge program weights when pairs × group ≤ SMs
    (None, or more programs: the whole row)."""
    sds = jax.ShapeDtypeStruct
    final = sds((pairs, p.group, p.vdim), dtype), sds((pairs, p.group), jnp.float32)
    rows = (pairs, p.splits, p.group_rows)
    partial = sds((*rows, p.vdim_pad), jnp.float32), sds(rows, jnp.float32), sds(rows, jnp.float32)
    outs = pallas_call(
        kernel,
        grid=(pairs, p.splits),
        out_shape=final if p.splits == 1 else partial,
        compiler_params=plt.CompilerParams(num_warps=p.cfg.num_warps, num_stages=p.cfg.num_stages),
        interpret=p.interpret,
        name=name,
    )(*operands)
    if p.splits == 1:
        return outs
    few = pairs * p.group <= backend.sm_count()  # value blocks only within one wave
    vdim_block = min(merge_block or p.vdim_pad, p.vdim_pad) if few else p.vdim_pad
    return pallas_call(
        functools.partial(_merge_kernel, p=p, vdim_block=vdim_block),
        grid=(pairs, p.group) + ((p.vdim_pad // vdim_block,) if vdim_block < p.vdim_pad else ()),
        out_shape=final,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=p.interpret,
        name=f"{name}_merge",
    )(*outs, *v_scales)
