"""The indexer over a batch of sequences (one query each, over its own keys) against an
independent numpy oracle: dense and paged caches, every dtype, empty and short
sequences, ties, negative weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.ops.indexer import triton as scorer
from jsparse.testing import lower_for_h200, topk_mismatches
from tests.paging import shuffled_pages

FP8 = jnp.float8_e4m3fn
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp8": FP8}
# Four sequences: Gaussian and whole, empty, shorter than K, and one whose keys take
# only five values (scores tie in groups) under negative weights only (every score ≤ 0,
# most of them exactly 0: the order among them is by id).
B, S_MAX, H, D, K, P = 4, 300, 4, 16, 17, 20
LENGTHS = np.array([300, 0, 5, 223], np.int32)


def make_batch(dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    w = rng.standard_normal((B, H)).astype(np.float32)
    k = rng.standard_normal((B, S_MAX, D)).astype(np.float32)
    k[3] = k[3][rng.integers(0, 5, S_MAX)]
    w[3] = -np.abs(w[3])
    scale = rng.uniform(0.25, 4.0, (B, S_MAX)).astype(np.float32)
    return dict(
        q=jnp.asarray(q, dtype),
        weights=jnp.asarray(w),
        k_cache=jnp.asarray(k, dtype),
        k_scale=jnp.asarray(scale),
        lengths=jnp.asarray(LENGTHS),
    )


# Page sizes of the paged tests against the decode tile of 64 keys: pages that do not
# divide it (one page-table entry a key), half-tile pages (the tile's two entries as
# scalars) and pages of two whole tiles (one entry a tile, at an offset in its page).
PAGE_SIZES = [P, 32, 128]
PAGE_IDS = [f"P{page}" for page in PAGE_SIZES]


def paged(batch, seed=0, page=P):
    """The same keys in a shuffled page pool of ``page`` keys a page, with spare pages of
    noise; pages past each sequence's length unallocated (-1)."""
    pool, pool_scale, table = shuffled_pages(
        batch["k_cache"], batch["k_scale"], LENGTHS, page, spare_pages=3, seed=seed
    )
    return dict(batch, k_cache=pool, k_scale=pool_scale, page_table=table)


def oracle_scores(batch):
    """float64 scores [B, S_MAX], -inf past each length (inputs rounded to their dtype)."""
    q = np.asarray(batch["q"].astype(jnp.float32), np.float64)
    k = np.asarray(batch["k_cache"].astype(jnp.float32), np.float64)
    w = np.asarray(batch["weights"], np.float64)
    s = np.einsum("bh,bhs->bs", w, np.maximum(np.einsum("bhd,bsd->bhs", q, k), 0.0))
    s = s * np.asarray(batch["k_scale"], np.float64)
    return np.where(np.arange(S_MAX)[None, :] < LENGTHS[:, None], s, -np.inf)


def assert_matches_oracle(result, batch, rtol=1e-5):
    oracle = oracle_scores(batch)
    atol = rtol * np.max(np.abs(oracle[np.isfinite(oracle)]))
    problems = topk_mismatches(result.indices, result.scores, oracle, K, atol)
    assert not problems, "\n".join(problems)
    np.testing.assert_array_equal(np.asarray(result.visible), LENGTHS)
    assert not np.asarray(result.fallback).any()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reference_and_xla_match_the_oracle(dtype):
    batch = make_batch(DTYPES[dtype])
    ref = jsparse.indexer_topk_batch(top_k=K, implementation="reference", **batch)
    assert_matches_oracle(ref, batch)
    # Ties broken by id: sequence 3's zero scores come in ascending id order.
    row = np.asarray(ref.indices[3])
    zeros = row[np.asarray(ref.scores[3]) == 0]
    assert zeros.size > 1 and np.all(np.diff(zeros) > 0)
    # XLA's f32 dot is TF32 on the GPU (what a user writing the einsum gets).
    xla = jsparse.indexer_topk_batch(top_k=K, method="xla", **batch)
    assert_matches_oracle(xla, batch, rtol=5e-3 if dtype == "f32" else 1e-5)


@pytest.mark.parametrize(("q_dtype", "k_dtype"), [("f32", "fp8"), ("fp8", "bf16")])
def test_xla_takes_fp8_beside_another_dtype(q_dtype, k_dtype):
    batch = make_batch(jnp.float32)
    batch = dict(batch, q=batch["q"].astype(DTYPES[q_dtype]))
    batch = dict(batch, k_cache=batch["k_cache"].astype(DTYPES[k_dtype]))
    xla = jsparse.indexer_topk_batch(top_k=K, method="xla", **batch)
    assert_matches_oracle(xla, batch, rtol=5e-3 if "f32" in (q_dtype, k_dtype) else 1e-5)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_base_kernels_match_the_oracle(dtype, kernel_impl):
    batch = make_batch(DTYPES[dtype], seed=1)
    result = jsparse.indexer_topk_batch(top_k=K, implementation=kernel_impl, **batch)
    assert_matches_oracle(result, batch)
    unsorted = jsparse.indexer_topk_batch(
        top_k=K, implementation=kernel_impl, sorted=False, **batch
    )
    for b in range(B):  # the same set
        assert set(np.asarray(unsorted.indices[b]).tolist()) == set(
            np.asarray(result.indices[b]).tolist()
        )


@pytest.mark.parametrize("page", PAGE_SIZES, ids=PAGE_IDS)
def test_paged_base_equals_dense_base(page, kernel_impl):
    # The scorer reads each key in its page: every id and score equals the dense cache's.
    batch = make_batch(jnp.bfloat16, seed=2)
    pages = paged(batch, page=page)
    dense = jsparse.indexer_topk_batch(top_k=K, implementation=kernel_impl, **batch)
    from_pages = jsparse.indexer_topk_batch(top_k=K, implementation=kernel_impl, **pages)
    np.testing.assert_array_equal(np.asarray(from_pages.indices), np.asarray(dense.indices))
    np.testing.assert_array_equal(np.asarray(from_pages.scores), np.asarray(dense.scores))
    assert_matches_oracle(dense, batch)
    ref = jsparse.indexer_topk_batch(top_k=K, implementation="reference", **pages)
    assert_matches_oracle(ref, batch)


@pytest.mark.parametrize("page", PAGE_SIZES, ids=PAGE_IDS)
@pytest.mark.parametrize("splits", [1, 2])
def test_paged_base_walks_several_tiles_a_program(splits, page, kernel_impl, monkeypatch):
    # A program loads each tile's pages one tile ahead (scalar entries before the tile's
    # own loads, per-key ones after): with every sequence's 5 tiles in one or two
    # programs, a wrong prefetch would read another tile's keys.
    monkeypatch.setattr(scorer, "batch_splits", lambda *args: splits)
    batch = make_batch(jnp.bfloat16, seed=5)
    dense = jsparse.indexer_topk_batch(top_k=K, implementation=kernel_impl, **batch)
    from_pages = jsparse.indexer_topk_batch(
        top_k=K, implementation=kernel_impl, **paged(batch, page=page)
    )
    np.testing.assert_array_equal(np.asarray(from_pages.indices), np.asarray(dense.indices))
    np.testing.assert_array_equal(np.asarray(from_pages.scores), np.asarray(dense.scores))
    assert_matches_oracle(dense, batch)


@pytest.mark.parametrize("page", [0, *PAGE_SIZES], ids=["dense", *PAGE_IDS])
def test_scales_loaded_a_tile_ahead_change_nothing(page, kernel_impl, monkeypatch):
    # SCALE_PREFETCH carries each tile's k_scale from the tile before (dense caches and
    # pages read a tile ahead as scalars; P 20 keeps loading them in the tile). One
    # program walks each sequence's 5 tiles, so a scale from the wrong tile would show.
    monkeypatch.setattr(scorer, "batch_splits", lambda *args: 1)
    batch = make_batch(FP8, seed=6)
    cache = paged(batch, page=page) if page else batch
    results = []
    for ahead in (False, True):
        monkeypatch.setattr(scorer, "SCALE_PREFETCH", ahead)
        jax.clear_caches()  # the switch is read when the launch is traced
        results.append(jsparse.indexer_topk_batch(top_k=K, implementation=kernel_impl, **cache))
    for field in ("indices", "scores"):
        np.testing.assert_array_equal(*(np.asarray(getattr(r, field)) for r in results))
    assert_matches_oracle(results[1], batch)


def _assert_batch_equals_one_sequence_calls(q, w, cache, k, scale, lengths, implementation):
    """Each sequence of a batch call selects, id for id and score for score (bitwise),
    what a call on that sequence alone selects: the two share the one-query scorer."""
    batch = jsparse.indexer_topk_batch(
        q, w, cache, k, k_scale=scale, lengths=jnp.asarray(lengths), implementation=implementation
    )
    for b, n in enumerate(lengths):
        alone = jsparse.indexer_topk(
            q[b : b + 1], w[b : b + 1], cache[b, :n], k, k_scale=scale[b, :n],
            implementation=implementation,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(batch.indices[b]), np.asarray(alone.indices[0]))
        np.testing.assert_array_equal(np.asarray(batch.scores[b]), np.asarray(alone.scores[0]))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_batch_selects_what_each_sequence_alone_selects(dtype, kernel_impl):
    batch = make_batch(DTYPES[dtype], seed=6)
    args = (batch["q"], batch["weights"], batch["k_cache"], K, batch["k_scale"], LENGTHS)
    _assert_batch_equals_one_sequence_calls(*args, kernel_impl)


def test_ieee_f32_batch_selects_what_each_sequence_alone_selects(kernel_impl):
    # under "highest" the f32 tiles are IEEE_F32_ONE_QUERY_CONFIG's in both calls
    batch = make_batch(jnp.float32, seed=7)
    args = (batch["q"], batch["weights"], batch["k_cache"], K, batch["k_scale"], LENGTHS)
    with jax.default_matmul_precision("highest"):
        _assert_batch_equals_one_sequence_calls(*args, kernel_impl)


@pytest.mark.gpu
def test_gpu_batch_selects_what_each_sequence_alone_selects():
    # V3.2's indexer, 8 sequences of 64K FP8 keys (run 234 found them bitwise equal)
    b, s_max, h, d, k = 8, 65536, 64, 128, 2048
    cache = jax.random.normal(jax.random.PRNGKey(2), (b, s_max, d)).astype(FP8)
    q = jax.random.normal(jax.random.PRNGKey(0), (b, h, d)).astype(FP8)
    w = jax.random.normal(jax.random.PRNGKey(1), (b, h)) / np.sqrt(h * d)
    scale = jnp.asarray(np.random.default_rng(4).uniform(0.5, 2.0, (b, s_max)), jnp.float32)
    lengths = np.array([s_max, 40000, 2049, 2048, 100, 1, 65000, s_max], np.int32)
    _assert_batch_equals_one_sequence_calls(q, w, cache, k, scale, lengths, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
def test_gpu_batch_base_at_decode_size(implementation):
    # 64 sequences of up to 64K keys, FP8 with scales, compiled.
    rng = np.random.default_rng(3)
    b, s_max, h, d, k = 64, 65536, 64, 128, 2048
    lengths = rng.integers(1, s_max + 1, b).astype(np.int32)
    lengths[:3] = [s_max, 1000, 0]
    cache = jax.random.normal(jax.random.PRNGKey(0), (b, s_max, d)).astype(FP8)
    q = jax.random.normal(jax.random.PRNGKey(1), (b, h, d)).astype(FP8)
    w = jax.random.normal(jax.random.PRNGKey(2), (b, h)) / np.sqrt(h * d)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (b, s_max)).astype(np.float32))
    args = dict(k_scale=scale, lengths=jnp.asarray(lengths))
    result = jsparse.indexer_topk_batch(q, w, cache, k, implementation=implementation, **args)
    pick = [0, 1, 2, 5, 63]
    oracle = np.full((len(pick), s_max), -np.inf)
    for r, seq in enumerate(pick):  # float64 numpy, per sequence
        n = lengths[seq]
        qs = np.asarray(q[seq].astype(jnp.float32), np.float64)
        ks = np.asarray(cache[seq, :n].astype(jnp.float32), np.float64)
        logits = np.maximum(qs @ ks.T, 0.0)
        oracle[r, :n] = (np.asarray(w[seq], np.float64) @ logits) * np.asarray(scale[seq, :n])
    atol = 1e-3 * np.max(np.abs(oracle[np.isfinite(oracle)]))
    indices, scores = np.asarray(result.indices)[pick], np.asarray(result.scores)[pick]
    problems = topk_mismatches(indices, scores, oracle, k, atol)
    assert not problems, "\n".join(problems)


def test_fp8_cache_is_never_widened_in_memory(interpret, fp8_widening):
    # Each key is its own query's: widening would copy the whole cache every step.
    fp8_widening.set_threshold(1)
    batch = make_batch(FP8, seed=4)
    result = jsparse.indexer_topk_batch(top_k=K, implementation="triton", **batch)
    assert fp8_widening.decisions and not any(fp8_widening.decisions)
    assert_matches_oracle(result, batch)


def test_bad_input_raises_value_errors():
    batch = make_batch(jnp.bfloat16)
    cases = [
        (dict(top_k=0), "top_k"),
        (dict(top_k=K, method="full"), "method"),
        (dict(top_k=K, lengths=jnp.asarray([1, 2, 3, S_MAX + 1], jnp.int32)), "lengths"),
        (dict(top_k=K, lengths=jnp.asarray(LENGTHS[:3])), "lengths: shape"),
        (dict(top_k=K, k_cache=batch["k_cache"][:3]), "k_cache: shape"),
        (dict(top_k=K, k_scale=batch["k_scale"].at[2, 7].set(0.0)), r"k_scale\[\(2, 7\)\]"),
        (dict(top_k=K, weights=batch["weights"].astype(jnp.bfloat16)), "weights: dtype"),
        (dict(top_k=K, q=batch["q"][:, :, :8]), "k_cache: shape"),
        (dict(top_k=K, k_scale=[1.0] * 4), r"k_scale: got a list; expected an array of rank 2"),
        (dict(top_k=K, sorted="no"), "sorted: expected True or False, got 'no'"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match=message):
            jsparse.indexer_topk_batch(**dict(batch, **override))
    pages = paged(batch)
    holed = pages["page_table"].at[3, 1].set(-1)
    with pytest.raises(ValueError, match="page_table: sequence 3 has length 223"):
        jsparse.indexer_topk_batch(top_k=K, **dict(pages, page_table=holed))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("p", [0, 20, 32, 128], ids=lambda p: f"paged{p}" if p else "dense")
@pytest.mark.parametrize("scale_ahead", [False, True], ids=["scales-in-tile", "scales-ahead"])
def test_batch_base_lowers_to_cuda(dtype, p, scale_ahead, monkeypatch):
    from jsparse.ops.indexer import batch as batch_lib

    monkeypatch.setattr(scorer, "SCALE_PREFETCH", scale_ahead)

    b, s_max, h, d = 8, 8192, 64, 128
    paged_cache = p > 0
    f32, i32 = jnp.float32, jnp.int32
    pages_a_row = -(-s_max // p) if paged_cache else 0
    shape = (b * pages_a_row, p, d) if paged_cache else (b, s_max, d)
    args = [
        jax.ShapeDtypeStruct((b, h, d), dtype),
        jax.ShapeDtypeStruct((b, h), f32),
        jax.ShapeDtypeStruct(shape, dtype),
        jax.ShapeDtypeStruct(shape[:2], f32),
        jax.ShapeDtypeStruct((b,), i32),
        jax.ShapeDtypeStruct((b, pages_a_row), i32) if paged_cache else None,
    ]

    def fn(q, w, kc, ks, n, table=None):
        return batch_lib._base_triton(q, w, kc, 2048, ks, n, table)

    lower_for_h200(fn, *[a for a in args if a is not None])


def test_a_batch_past_the_int32_limit_runs_in_chunks_of_sequences(monkeypatch):
    # Virtual key ids are int32: B·S_max past the limit splits the batch (here a limit
    # of 2048 rows makes 300 sequences of 8 keys run as 256 + 44), the same answer.
    from jsparse import _chunking

    rng = np.random.default_rng(6)
    b, s_max = 300, 8
    args = dict(
        q=jnp.asarray(rng.standard_normal((b, 2, 4)), jnp.float32),
        weights=jnp.asarray(rng.standard_normal((b, 2)), jnp.float32),
        k_cache=jnp.asarray(rng.standard_normal((b, s_max, 4)), jnp.float32),
        top_k=3,
        lengths=jnp.asarray(rng.integers(0, s_max + 1, b), jnp.int32),
        implementation="reference",
    )
    whole = jsparse.indexer_topk_batch(**args)
    calls = []
    real = _chunking.over_query_chunks

    def counting(fn, chunk, *per_query):
        calls.append(chunk)
        return real(fn, chunk, *per_query)

    monkeypatch.setattr(_chunking, "INDEX_LIMIT", 2048)
    monkeypatch.setattr(_chunking, "over_query_chunks", counting)
    chunked = jsparse.indexer_topk_batch(**args)
    assert calls == [256]
    np.testing.assert_array_equal(np.asarray(chunked.indices), np.asarray(whole.indices))
    np.testing.assert_array_equal(np.asarray(chunked.scores), np.asarray(whole.scores))
    # xla over 300 sequences: einsums of 6 (the largest chunk dividing B, no padding);
    # f32 on a GPU is TF32, hence the tolerance.
    xla = jsparse.indexer_topk_batch(**dict(args, method="xla"))
    np.testing.assert_array_equal(np.asarray(xla.indices) < 0, np.asarray(whole.indices) < 0)
    np.testing.assert_allclose(np.asarray(xla.scores), np.asarray(whole.scores), rtol=5e-3)


def test_traced_lengths_past_s_max_are_clamped(kernel_impl):
    # Inside jit a length cannot be checked; past S_max it is clamped, so no sequence
    # reads the next one's keys (the kernels address all sequences as one flat range).
    batch = make_batch(jnp.bfloat16, seed=7)
    over = jnp.asarray([S_MAX + 50, 0, 5, 223], jnp.int32)

    @jax.jit
    def run(lengths):
        return jsparse.indexer_topk_batch(
            top_k=K, implementation=kernel_impl, **dict(batch, lengths=lengths)
        )

    np.testing.assert_array_equal(
        np.asarray(run(over).indices), np.asarray(run(jnp.asarray(LENGTHS)).indices)
    )
    assert int(run(over).visible[0]) == S_MAX


@pytest.mark.parametrize("page", PAGE_SIZES, ids=PAGE_IDS)
def test_traced_pages_outside_the_pool_or_missing_are_never_read(page, kernel_impl):
    """Under jit a page table cannot be checked: an entry outside [-1, n_pages) is no
    page, and a key on no page (even below its sequence's length) is never read: it
    scores -inf, in the kernels and the references alike."""
    batch = paged(make_batch(jnp.bfloat16, seed=3), page=page)
    table, n_pages = batch["page_table"], batch["k_cache"].shape[0]
    bad = table.at[0, 2].set(n_pages + 7).at[3, 0].set(-4).at[2, 0].set(-1)
    run = {
        (impl, method): jax.jit(lambda t, impl=impl, method=method: jsparse.indexer_topk_batch(
            top_k=K, method=method, implementation=impl, **dict(batch, page_table=t)))
        for impl, method in [(kernel_impl, "base"), ("reference", "base"), ("reference", "xla")]
    }  # fmt: skip
    results = {key: f(bad) for key, f in run.items()}
    first = results[(kernel_impl, "base")]
    for key, r in results.items():
        np.testing.assert_array_equal(np.asarray(r.indices), np.asarray(first.indices), str(key))
    ids, scores = np.asarray(first.indices), np.asarray(first.scores)
    on_no_page = np.zeros(ids.shape, bool)
    on_no_page[0] = (ids[0] >= 2 * page) & (ids[0] < 3 * page)
    on_no_page[2:] = (ids[2:] >= 0) & (ids[2:] < page)
    assert np.all(scores[on_no_page] == -np.inf) and on_no_page[2, :5].all()  # length 5
    assert np.isfinite(scores[0]).all()  # sequence 0 has K keys on its other pages


@pytest.mark.parametrize("cache", ["dense", "no-pages", "empty-pool"])
def test_caches_without_keys_select_nothing(cache, kernel_impl):
    """S_max = 0, a table of no pages, or a pool of no pages: rows of -1 / -inf on every
    path, the witness decode included (the kernels crashed on an empty key set)."""
    q, w = jnp.ones((2, H, D), jnp.bfloat16), jnp.ones((2, H), jnp.float32)
    lengths = jnp.zeros((2,), jnp.int32)
    k_cache, table = {
        "dense": (jnp.ones((2, 0, D), jnp.bfloat16), None),
        "no-pages": (jnp.ones((3, P, D), jnp.bfloat16), jnp.zeros((2, 0), jnp.int32)),
        "empty-pool": (jnp.ones((0, P, D), jnp.bfloat16), jnp.full((2, 2), -1, jnp.int32)),
    }[cache]
    for impl, method in [(kernel_impl, "base"), ("reference", "base"), ("reference", "xla")]:
        r = jsparse.indexer_topk_batch(q, w, k_cache, K, lengths=lengths, page_table=table,
                                       method=method, implementation=impl)  # fmt: skip
        assert r.indices.shape == (2, K) and np.all(np.asarray(r.indices) == -1)
    for impl in (kernel_impl, "reference"):
        r, wit = jsparse.indexer_topk_decode(q, w, k_cache, K, lengths=lengths, page_table=table,
                                             implementation=impl)  # fmt: skip
        assert np.all(np.asarray(r.indices) == -1) and np.all(np.asarray(wit) == -1)


def test_batch_splits_follow_the_measured_rule(monkeypatch):
    monkeypatch.setattr(backend, "sm_count", lambda: 132)
    cfg = scorer.batch_config(64)
    # bf16: 8 programs an SM; FP8 16 where each keeps ≥ 16 tiles (64 sequences), not at 8
    assert 64 * scorer.batch_splits(64, 65536, cfg) == 64 * 17
    assert 64 * scorer.batch_splits(64, 65536, cfg, fp8_keys=True) == 2112
    assert 8 * scorer.batch_splits(8, 131072, cfg, fp8_keys=True) == 1056
    # a few sequences split as one-query decode does, whatever the dtype
    assert scorer.batch_splits(1, 65536, cfg, fp8_keys=True) == scorer.batch_splits(1, 65536, cfg)
    # the unit is the device's SM count
    monkeypatch.setattr(backend, "sm_count", lambda: 66)
    assert 64 * scorer.batch_splits(64, 65536, cfg, fp8_keys=True) == 1088


def test_sm_count_is_the_devices():
    if backend.has_nvidia_gpu():
        assert backend.sm_count() == jax.devices()[0].core_count
    else:
        assert backend.sm_count() == backend.DEFAULT_SM_COUNT


def test_fp8_caches_of_2_to_4_gib_are_refused_not_misread():
    """(WORKSPACE.md run 163.) 160 × 128K FP8 keys of 128 dims are 2.7 GB: the Triton
    scorer refuses them rather than address them with wrapping 32-bit offsets."""
    sds = jax.ShapeDtypeStruct
    b, s, d = 160, 131072, 128
    args = (sds((b, 64, d), jnp.bfloat16), sds((b, 64), jnp.float32),
            sds((b, s, d), jnp.float8_e4m3fn))  # fmt: skip
    lengths = sds((b,), jnp.int32)
    with backend.interpret_mode(True), pytest.raises(NotImplementedError, match=r"scorer: k \("):
        jax.eval_shape(
            lambda q, w, k, n: jsparse.indexer_topk_batch(
                q, w, k, 2048, lengths=n, implementation="triton"
            ).indices,
            *args, lengths,
        )  # fmt: skip
