"""The decode cores over serving caches: an FP8 cache with its scales, a bf16 / f16 cache
under f32 activations, a paged cache (a shuffled page pool and a page table), and FP8
paged, decode like the dense f32 cache they hold, through prefill and several decode
steps with the kept projected cache."""

import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.nn import SparseAttention, SparseMLA

F8 = jnp.float8_e4m3fn
HALF = {"bf16": jnp.bfloat16, "f16": jnp.float16}  # caches narrower than the f32 activations
B, S, H, PAGE = 2, 48, 6, 8
PREFILL, STEPS = 20, 4  # tokens 24..47 are never visible: their pages stay unallocated


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _fp8(x, per):
    """(x in FP8, scale) with one scale per ``per`` index (x ≈ stored · scale)."""
    axes = tuple(i for i in range(x.ndim) if i not in per)
    scale = np.abs(x).max(axis=axes) / 448.0
    shape = [x.shape[i] if i in per else 1 for i in range(x.ndim)]
    stored = jnp.asarray(x / scale.reshape(shape), F8)
    return stored, jnp.asarray(scale, jnp.float32)


def _paged(x, seed=0):
    """(pool [B·M + 3, P, ...], table [B, M]): x's pages shuffled among 3 spare pages of
    noise; pages holding no token below PREFILL + STEPS left unallocated (-1)."""
    rng = np.random.default_rng(seed)
    m = S // PAGE
    n_pages = B * m + 3
    noise = rng.standard_normal((n_pages, PAGE, *x.shape[2:])) * 100  # (FP8: saturates)
    pool = np.array(jnp.asarray(noise, x.dtype))  # a writable copy
    where = rng.permutation(n_pages)[: B * m].reshape(B, m)
    table = np.full((B, m), -1, np.int32)
    dense = np.asarray(x).reshape(B, m, PAGE, *x.shape[2:])
    for b in range(B):
        for i in range(m):
            pool[where[b, i]] = dense[b, i]
            if i * PAGE < PREFILL + STEPS:
                table[b, i] = where[b, i]
    return jnp.asarray(pool), jnp.asarray(table)


def _decode(core, q_all, caches, init_state, **extra):
    """Prefill PREFILL tokens, then STEPS decode steps; every output concatenated."""
    slots = np.arange(S)
    outs, state = [], init_state

    def call(q, upto, **kw):
        pos = jnp.asarray(np.broadcast_to(np.where(slots < upto, slots, -1), (B, S)), jnp.int32)
        qpos = jnp.asarray(np.broadcast_to(np.arange(upto - q.shape[1], upto), (B, q.shape[1])),
                           jnp.int32)  # fmt: skip
        return core(q, *caches, q_positions=qpos, k_positions=pos, core_state=state, **kw, **extra)

    out, state = call(q_all[:, :PREFILL], PREFILL)
    outs.append(np.asarray(out, np.float32))
    for t in range(PREFILL, PREFILL + STEPS):
        out, state = call(q_all[:, t : t + 1], t + 1)
        outs.append(np.asarray(out, np.float32))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("cache", ["fp8", "bf16", "f16", "paged", "paged-fp8"])
def test_sparse_attention_over_a_serving_cache_decodes_like_the_dense_one(kernel_impl, cache):
    hkv, d = 2, 16
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((B, S, hkv, d)).astype(np.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, PREFILL + STEPS, H, d)), jnp.float32)
    sel = jsparse.make_selector("jssa", rank=4)
    params = sel.calibrate(_normal(rng, 256, H, d), _normal(rng, 256, hkv, d))
    core = SparseAttention(sel, params, 8, implementation=kernel_impl)
    extra = {}
    if "fp8" in cache:
        (k, extra["k_scale"]), (v, extra["v_scale"]) = _fp8(k, (0, 2)), _fp8(v, (0, 2))
        want_k = np.asarray(k, np.float32) * np.asarray(extra["k_scale"])[:, None, :, None]
        want_v = np.asarray(v, np.float32) * np.asarray(extra["v_scale"])[:, None, :, None]
    elif cache in HALF:
        k, v = jnp.asarray(k, HALF[cache]), jnp.asarray(v, HALF[cache])
        want_k, want_v = np.asarray(k, np.float32), np.asarray(v, np.float32)
    else:
        k, v, want_k, want_v = jnp.asarray(k), jnp.asarray(v), k, v
    if "paged" in cache:
        (k, extra["page_table"]), (v, _) = _paged(k), _paged(v)
    state = core.init_core_state(B, S, hkv, d)
    want = _decode(core, q, (jnp.asarray(want_k), jnp.asarray(want_v)), state)
    got = _decode(core, q, (k, v), state, **extra)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["fp8", "bf16", "paged", "paged-fp8"])
def test_sparse_mla_over_a_serving_cache_decodes_like_the_dense_one(kernel_impl, cache):
    dc, dr = 24, 8
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((B, S, dc + dr)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((B, PREFILL + STEPS, H, dc + dr)), jnp.float32)
    sel = jsparse.make_selector("jssa_mla", rank=8, latent_dim=dc)
    params = sel.calibrate(_normal(rng, 256, H, dc + dr), _normal(rng, 256, 1, dc + dr))
    core = SparseMLA(sel, params, 8, implementation=kernel_impl)
    extra = {}
    if "fp8" in cache:
        rows, extra["cache_scale"] = _fp8(rows, (0,))
        want = np.asarray(rows, np.float32) * np.asarray(extra["cache_scale"])[:, None, None]
    elif cache in HALF:
        rows = jnp.asarray(rows, HALF[cache])
        want = np.asarray(rows, np.float32)
    else:
        rows, want = jnp.asarray(rows), rows
    if "paged" in cache:
        rows, extra["page_table"] = _paged(rows)
    state = core.init_core_state(B, S, dc + dr)
    mla = dict(scale=0.2, latent_dim=dc)
    expect = _decode(core, q, (jnp.asarray(want),), state, **mla)
    got = _decode(core, q, (rows,), state, **mla, **extra)
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)


def test_bad_serving_arguments_are_named():
    hkv, d = 2, 16
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((B, S, hkv, d)), jnp.float32)
    q = _normal(rng, B, 1, H, d)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    core = SparseAttention("oracle", {}, 8)
    run = lambda **kw: core(  # noqa: E731
        q, kw.pop("k", k), kw.pop("v", k), q_positions=jnp.full((B, 1), S - 1, jnp.int32),
        k_positions=kw.pop("k_positions", pos), **kw,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"k_scale: shape \(2, 3\); expected \[B, Hkv\]"):
        run(k_scale=jnp.ones((B, 3), jnp.float32))
    with pytest.raises(ValueError, match="v_scale"):
        run(v_scale=-jnp.ones((B, hkv), jnp.float32))
    with pytest.raises(ValueError, match="page_table"):
        run(page_table=jnp.zeros((B,), jnp.int32))
    pool, table = _paged(k)
    with pytest.raises(ValueError, match="k_positions"):  # 48 slots against M·P = 48 + 8
        run(k=pool, v=pool, page_table=jnp.pad(table, ((0, 0), (0, 1)), constant_values=-1))
    rows = _normal(rng, B, S, 24)
    mla = SparseMLA("oracle", {}, 8)
    with pytest.raises(ValueError, match="cache_scale"):
        mla(_normal(rng, B, 1, H, 24), rows, q_positions=jnp.full((B, 1), S - 1, jnp.int32),
            k_positions=pos, scale=0.2, latent_dim=16, cache_scale=jnp.ones((B, 1)))  # fmt: skip


def test_a_prefill_checks_v_and_the_batch_of_its_serving_arguments():
    """A prefill (T > 1) never checked v (a rank-3 v failed in jnp.pad, another Hkv or B
    in a reshape), and SparseMLA's prefill gathered a page table or scale of another
    batch by owner, which clamps: sequence 1 read sequence 0's pages and scale."""
    hkv, d = 2, 16
    rng = np.random.default_rng(4)
    k = _normal(rng, B, S, hkv, d)
    q = _normal(rng, B, 2, H, d)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    q_pos = jnp.full((B, 2), S - 1, jnp.int32).at[:, 0].add(-1)
    core = SparseAttention("oracle", {}, 8)
    bad_v = [(k[..., 0], "v: expected rank 4"), (k[:, :, :1], r"v: shape \(2, 48, 1, 16\)"),
             (k[:1], r"v: shape \(1, 48, 2, 16\)")]  # fmt: skip
    for v, message in bad_v:
        with pytest.raises(ValueError, match=message):
            core(q, k, v, q_positions=q_pos, k_positions=pos)
    with pytest.raises(ValueError, match=r"k: axis 0 of shape \(1, 48, 2, 16\) is 1; expected 2"):
        core(q, k[:1], k[:1], q_positions=q_pos, k_positions=pos)

    pool, table = _paged(_normal(rng, B, S, 24))
    rows8, scale = _fp8(np.asarray(_normal(rng, B, S, 24)), per=(0,))
    mla = SparseMLA("oracle", {}, 8)
    run = lambda rows, **kw: mla(  # noqa: E731
        _normal(rng, B, 2, H, 24), rows, q_positions=q_pos, k_positions=pos, scale=0.2,
        latent_dim=16, **kw,
    )  # fmt: skip
    run(pool, page_table=table)  # the right batch runs
    with pytest.raises(ValueError, match=r"page_table: axis 0 of shape \(1, 6\) is 1; expected 2"):
        run(pool, page_table=table[:1])
    with pytest.raises(ValueError, match=r"cache_scale: axis 0 of shape \(3,\) is 3; expected 2"):
        run(rows8, cache_scale=jnp.concatenate([scale, scale[:1]]))


def test_a_pool_of_no_pages_decodes_to_zeros(kernel_impl):
    """S is M·P for a pool of no pages too (it was 0: the k_positions of M·P slots that
    the docstrings ask for were refused, and an id on a missing page was reported as
    outside [0, 0))."""
    hkv, d, m = 2, 16, 3
    pool = jnp.zeros((0, PAGE, hkv, d), jnp.float32)
    table = jnp.full((B, m), -1, jnp.int32)
    q = jnp.ones((B, 1, H, d), jnp.float32)
    core = SparseAttention("oracle", {}, 4, implementation=kernel_impl)
    out = core(q, pool, pool, q_positions=jnp.zeros((B, 1), jnp.int32),
               k_positions=jnp.full((B, m * PAGE), -1, jnp.int32), page_table=table)  # fmt: skip
    assert out.shape == (B, 1, H, d) and not np.asarray(out).any()
    with pytest.raises(ValueError, match="lies on page 0 of sequence 0, which page_table leaves"):
        jsparse.indexed_attention(q[:, 0], pool, pool, jnp.zeros((B, hkv, 2), jnp.int32),
                                  page_table=table)  # fmt: skip


def test_a_bf16_query_gets_bf16_answers_at_prefill_and_at_decode():
    """Prefill (dense) and decode (the kernels) answer in q's dtype, as one layer should."""
    hkv, d, dc = 2, 16, 24
    rng = np.random.default_rng(4)
    bf = jnp.bfloat16
    q = _normal(rng, B, PREFILL + 1, H, d).astype(bf)
    k, v = (_normal(rng, B, S, hkv, d).astype(bf) for _ in range(2))
    rows, q_mla = _normal(rng, B, S, dc + 8).astype(bf), _normal(rng, B, PREFILL + 1, H, dc + 8)
    slots = np.arange(S)
    for t, n in ((PREFILL, PREFILL), (1, PREFILL + 1)):  # a prefill, then one decode step
        k_pos = jnp.asarray(np.broadcast_to(np.where(slots < n, slots, -1), (B, S)), jnp.int32)
        q_pos = jnp.asarray(np.broadcast_to(np.arange(n - t, n), (B, t)), jnp.int32)
        at = slice(n - t, n)
        out = SparseAttention("oracle", {}, 8)(q[:, at], k, v, q_positions=q_pos, k_positions=k_pos)
        mla = SparseMLA("oracle", {}, 8)(
            q_mla[:, at].astype(bf), rows, q_positions=q_pos, k_positions=k_pos, scale=0.2,
            latent_dim=dc,
        )  # fmt: skip
        assert (out.dtype, out.shape) == (bf, (B, t, H, d))
        assert (mla.dtype, mla.shape) == (bf, (B, t, H, dc))
