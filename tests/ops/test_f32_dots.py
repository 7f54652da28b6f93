"""The Triton kernels' f32 dots (``jsparse.ops.f32_dots``): the mode reaches every kernel
that multiplies f32 operands and lowers for CUDA either way; in ``"tf32x3"`` each kernel
takes tiles that fit shared memory (runs 244-245), and a shape none fits is refused by
name; on a GPU, the f32 scorer errs within the certificate's model in both modes, DoSA
equals full scoring, and tf32x3 gradients come from the kernels. (Pallas interpret mode
has no TF32 and runs both modes as IEEE dots.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import backend
from jsparse.certified import planner
from jsparse.certified import triton as certified_triton
from jsparse.ops import f32_dots
from jsparse.ops.attention import triton as attention_triton
from jsparse.ops.indexer import backward
from jsparse.ops.indexer import triton as indexer_triton
from jsparse.ops.mla import triton as mla_triton
from jsparse.testing import lower_for_h200
from tests.implementations import running

F32, I32 = jnp.float32, jnp.int32
SDS = jax.ShapeDtypeStruct


# jax.default_matmul_precision values that ask for each mode
ASKS = {"ieee": "highest", "tf32x3": "TF32_TF32_F32_X3"}


def test_the_mode_follows_jax_default_matmul_precision(monkeypatch):
    assert f32_dots.mode() == f32_dots.DEFAULT
    for mode, asked in ASKS.items():
        with jax.default_matmul_precision(asked):
            assert f32_dots.mode() == mode
    with jax.default_matmul_precision("bfloat16"):  # below f32: the kernels' default
        assert f32_dots.mode() == f32_dots.DEFAULT
    assert f32_dots.DEFAULT == "tf32x3"  # the default where JAX asks for neither
    monkeypatch.setattr(f32_dots, "DEFAULT", "ieee")
    with jax.default_matmul_precision("tensorfloat32"):
        assert f32_dots.mode() == "ieee"
    with jax.default_matmul_precision(ASKS["tf32x3"]):
        assert f32_dots.mode() == "tf32x3"


def test_every_benchmark_header_names_the_mode():
    from jsparse._environment import environment

    for mode, asked in ASKS.items():
        with jax.default_matmul_precision(asked):
            assert environment()["f32 dots"] == mode


def test_an_unknown_default_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(f32_dots, "DEFAULT", "tf32")
    q, w, k = jnp.ones((3, 4, 16)), jnp.ones((3, 4)), jnp.ones((11, 16))  # shapes of no trace
    with running("triton") as name, pytest.raises(ValueError, match=r"f32_dots\.DEFAULT is 'tf32'"):
        jsparse.indexer_scores(q, w, k, implementation=name)


T, H, D, S, K = 64, 8, 64, 2048, 128
INDEXER = (SDS((T, H, D), F32), SDS((T, H), F32), SDS((S, D), F32), SDS((S,), F32),
           SDS((T,), I32), SDS((T,), I32))  # fmt: skip
ATTENTION = (SDS((2, 8, 64), F32), SDS((2, 512, 2, 64), F32), SDS((2, 512, 2, 64), F32),
             SDS((2, 2, 128), I32))  # fmt: skip
MLA = (SDS((2, 16, 72), F32), SDS((2, 512, 72), F32), SDS((2, 128), I32))
KERNELS = {
    "scores": (indexer_triton.indexer_scores_triton, INDEXER),
    "scores_backward": (
        lambda *x: backward.indexer_scores_vjp_triton(indexer_triton.indexer_scores_triton(*x), *x),
        INDEXER,
    ),
    # the screen's f32 rows and the survivors' scorer
    "dosa": (
        lambda *x: certified_triton.certified_topk_triton(*x[:3], K, *x[3:], None)[0].indices,
        INDEXER,
    ),
    "indexed_attention": (
        lambda q, k, v, i: attention_triton.indexed_attention_triton(
            q, k, v, i, None, None, scale=0.1
        ),
        ATTENTION,
    ),
}


def _mla(q, c, i):
    return mla_triton.indexed_mla_attention_triton(q, c, i, None, latent_dim=64, scale=0.1)


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_f32_kernel_lowers_in_both_modes_and_the_mode_reaches_it(name):
    fn, structs = KERNELS[name]
    texts = {}
    for mode, asked in ASKS.items():
        with jax.default_matmul_precision(asked):
            texts[mode] = lower_for_h200(fn, *structs).as_text()
    assert texts["ieee"] != texts["tf32x3"]  # the dots' input precision differs


def test_mla_multiplies_f32_as_ieee_in_either_mode():
    texts = {}
    for mode, asked in ASKS.items():
        with jax.default_matmul_precision(asked):
            texts[mode] = lower_for_h200(_mla, *MLA).as_text()
            assert mla_triton._default_config(*(jnp.zeros(x.shape, x.dtype) for x in MLA[:2])) == (
                mla_triton.f32_config(16)
            )
    assert texts["ieee"] == texts["tf32x3"]


def test_the_certificate_budgets_for_tf32x3():
    numerics = {}
    for mode, asked in ASKS.items():
        with jax.default_matmul_precision(asked):
            numerics[mode] = {
                (impl, dt): planner.numerics_for(impl, dt, dt, 128)
                for impl in ("triton", "reference")
                for dt in (F32, jnp.bfloat16)
            }
    ieee, tf32x3 = numerics["ieee"][("triton", F32)], numerics["tf32x3"][("triton", F32)]
    assert tf32x3.scorer_rel >= ieee.scorer_rel + 2.0**-20
    assert tf32x3.screen_rel >= ieee.screen_rel + 2.0**-20
    for key in [("triton", jnp.bfloat16), ("reference", F32), ("reference", jnp.bfloat16)]:
        assert numerics["ieee"][key] == numerics["tf32x3"][key]


def test_the_scorer_tile_model_gives_the_compilers_bytes_and_its_fits():
    # what the compiler asked for the bf16 tiles with tf32x3 dots (runs 244-245, H 64, D 128)
    assert (
        indexer_triton.f32_tensor_core_bytes(indexer_triton.ScorerConfig(2, 128, 8, 2), 64, 128)
        == 262_144
    )
    assert (
        indexer_triton.f32_tensor_core_bytes(indexer_triton.ScorerConfig(4, 64, 4, 3), 64, 128)
        == 360_448
    )
    fit = indexer_triton.fit_f32_tensor_cores
    fitted = {t: fit(indexer_triton.default_config(t, 64), 64, 128) for t in (1, 8, 1024)}
    # the fastest fits run 245 timed at 8 × 64K and 1024 × 32K; one query fits as it is
    assert fitted[8] == indexer_triton.ScorerConfig(2, 64, 4, 3)
    assert fitted[1024] == indexer_triton.ScorerConfig(2, 128, 8, 1)
    assert fitted[1] == indexer_triton.default_config(1, 64)
    for cfg in fitted.values():
        assert indexer_triton.f32_tensor_core_bytes(cfg, 64, 128) <= f32_dots.SHARED_MEMORY
    # wider rows shrink further, and still fit
    wide = fit(indexer_triton.default_config(1024, 64), 64, 256)
    assert wide == indexer_triton.ScorerConfig(1, 64, 8, 1)
    assert indexer_triton.f32_tensor_core_bytes(wide, 64, 256) <= f32_dots.SHARED_MEMORY


# shared memory the compiler refused for indexed attention's f32 tiles (run 260, H100,
# 4 heads a KV head): (D, BN, stages) → bytes
ATTENTION_REFUSED = {
    (256, 64, 2): 237_824, (256, 128, 2): 442_368, (512, 32, 2): 266_368,
    (512, 64, 2): 467_200, (512, 128, 2): 868_352, (512, 128, 1): 327_680,
}  # fmt: skip
ATTENTION_COMPILED = [(128, 32, 1), (128, 32, 2), (128, 64, 1), (128, 64, 2), (128, 128, 1),
                      (128, 128, 2), (256, 32, 1), (256, 32, 2), (256, 64, 1), (256, 128, 1),
                      (512, 32, 1), (512, 64, 1)]  # fmt: skip


def test_the_attention_tile_model_covers_the_compilers_bytes_and_picks_the_fastest_fit():
    model = attention_triton.f32_tensor_core_bytes
    for (d, block_n, stages), asked in ATTENTION_REFUSED.items():
        need = model(attention_triton.AttentionConfig(block_n, 4, stages), d, d, 4)
        assert asked <= need <= asked + 1024
    for d, block_n, stages in ATTENTION_COMPILED:
        cfg = attention_triton.AttentionConfig(block_n, 4, stages)
        assert model(cfg, d, d, 4) <= f32_dots.SHARED_MEMORY
    # run 261's fastest tile (GPU busy) at D 128, 256 and 512; D 1024 halves it
    picked = {d: attention_triton.f32_tensor_core_config(d, d, 4) for d in (128, 256, 512, 1024)}
    tiles = {d: (c.block_n, c.num_stages) for d, c in picked.items()}
    assert tiles == {128: (32, 1), 256: (32, 1), 512: (32, 1), 1024: (16, 1)}
    # a given tile that cannot fit is refused by name, not handed to the compiler
    q, cache = jnp.zeros((1, 8, 512), F32), jnp.zeros((1, 64, 2, 512), F32)
    idx = jnp.zeros((1, 2, 64), I32)
    with (
        jax.default_matmul_precision(ASKS["tf32x3"]),
        pytest.raises(NotImplementedError, match=r"indexed_attention.*need 467456 bytes"),
    ):
        attention_triton.indexed_attention_triton(
            q, cache, cache, idx, None, None, scale=0.1,
            cfg=attention_triton.AttentionConfig(64, 4, 2),
        )  # fmt: skip


def test_each_kernel_takes_its_f32_tiles_in_tf32x3_mode_only():
    q, k = jnp.zeros((1024, 64, 128), F32), jnp.zeros((40, 128), F32)
    bf16 = (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16))
    with jax.default_matmul_precision(ASKS["tf32x3"]):
        assert indexer_triton.config_for(q, k) == indexer_triton.ScorerConfig(2, 128, 8, 1)
        assert indexer_triton.config_for(*bf16) == indexer_triton.default_config(1024, 64)
        assert backward.kernels_take(F32, F32, 128) and not backward.kernels_take(F32, F32, 129)
        assert backward.kernels_take(jnp.bfloat16, jnp.bfloat16, 512)
        cache = jnp.zeros((2, 9, 8, 128), F32)
        assert (
            attention_triton._config(jnp.zeros((2, 32, 128), F32), cache, cache, None).num_stages
            == 1
        )
        # the screen at the scorer's blocks of 2: 128 rows of D 128 at 3 stages fit the model
        screen = certified_triton.ScreenConfig()
        assert (
            certified_triton.screen_f32_tensor_core_bytes(screen, 128, 2, 4)
            <= f32_dots.SHARED_MEMORY
        )
        assert certified_triton._fit_screen_f32(screen, 256, 2, 4).tile_rows == 64
        wide = jnp.zeros((8, 64, 256), F32), jnp.zeros((40, 256), F32)  # a decode batch
        fitted = indexer_triton.batch_config_for(*wide)
        assert fitted.block_t == 1 and fitted != indexer_triton.batch_config(64)
        assert indexer_triton.f32_tensor_core_bytes(fitted, 64, 256) <= f32_dots.SHARED_MEMORY
    with jax.default_matmul_precision(ASKS["ieee"]):  # small tiles for the FMA dots
        assert indexer_triton.config_for(q, k) == indexer_triton.IEEE_F32_CONFIG
        # one query a block wherever the bf16 tiles have one: a batch's sequences and a
        # lone decode query take the same tiles, so they score alike
        one = indexer_triton.IEEE_F32_ONE_QUERY_CONFIG
        assert one.block_t == 1
        assert indexer_triton.batch_config_for(q[:8], k) == one
        assert indexer_triton.config_for(q[:1], k) == one
        assert indexer_triton.config_for(*bf16) == indexer_triton.default_config(1024, 64)
        assert not backward.kernels_take(F32, F32, 128)


@pytest.mark.parametrize("d", [40, 128])  # four and eight slices of 16
def test_a_split_contraction_scores_as_one_dot(d):
    # IEEE tiles multiply D in slices of 16 into one accumulator (run 253): the same scores
    # as one dot within f32 rounding, and still one scorer, so base and full agree id for id
    rng = np.random.default_rng(d)
    t, h, s = 5, 8, 300
    q = jnp.asarray(rng.standard_normal((t, h, d)), F32)
    w = jnp.asarray(rng.standard_normal((t, h)), F32)
    k = jnp.asarray(rng.standard_normal((s, d)), F32)
    start, end = jnp.asarray([0, 0, 7, 100, 0], I32), jnp.asarray([300, 1, 300, 233, 0], I32)
    split = indexer_triton.IEEE_F32_CONFIG
    assert split.dim_chunk == 16
    whole = dataclasses.replace(split, dim_chunk=0)
    with running("triton"), jax.default_matmul_precision(ASKS["ieee"]):
        got = {
            c.dim_chunk: np.asarray(
                indexer_triton.indexer_scores_triton(q, w, k, None, start, end, cfg=c)
            )
            for c in (split, whole)
        }
        base, full = (
            jsparse.indexer_topk(q, w, k, kv_start=start, kv_end=end, top_k=64, method=m,
                                 implementation="triton")
            for m in ("base", "full")
        )  # fmt: skip
    np.testing.assert_array_equal(np.isfinite(got[16]), np.isfinite(got[0]))
    seen = np.isfinite(got[0])
    bound = np.abs(np.asarray(w)).sum(1)[:, None] * np.linalg.norm(q, axis=2).max(1)[:, None]
    bound = bound * np.linalg.norm(k, axis=1)[None, :]
    gap = np.where(seen, got[16], 0) - np.where(seen, got[0], 0)  # no -inf - -inf
    assert np.all(np.abs(gap) <= 2 * planner.gamma(d + 2) * bound)
    np.testing.assert_array_equal(np.asarray(full.indices), np.asarray(base.indices))
    np.testing.assert_array_equal(np.asarray(full.scores), np.asarray(base.scores))


def test_dosa_screens_ieee_f32_on_a_split_contraction():
    from jsparse.certified import dosa_topk, workloads

    data = workloads.make("low_survival", num_queries=24, num_keys=1500, causal=True, seed=3)
    x = dict(
        q=data.q.astype(F32), weights=data.weights, k=data.k.astype(F32), k_scale=data.k_scale,
        kv_start=data.kv_start, kv_end=data.kv_end,
    )  # fmt: skip
    assert certified_triton.IEEE_F32_SCREEN_CONFIG.dim_chunk == 16
    with running("triton"), jax.default_matmul_precision(ASKS["ieee"]):
        base = jsparse.indexer_topk(**x, top_k=100, method="base", implementation="triton")
        dosa, info = dosa_topk(
            **x, top_k=100, policy="always", implementation="triton", return_info=True
        )
    np.testing.assert_array_equal(np.asarray(dosa.indices), np.asarray(base.indices))
    assert np.all(np.asarray(info.screened)) and not np.any(np.asarray(dosa.fallback))
    assert np.mean(np.asarray(info.list_length)) < 0.5 * 1500  # the bound pruned


@pytest.mark.parametrize("chunk", [8, 24])
def test_a_bad_contraction_slice_is_refused_by_name(chunk):
    message = f"dim_chunk must be 0 or a power of two ≥ 16, got {chunk}"
    with pytest.raises(ValueError, match=f"ScorerConfig.{message}"):
        indexer_triton.ScorerConfig(dim_chunk=chunk)
    with pytest.raises(ValueError, match=f"ScreenConfig.{message}"):
        certified_triton.ScreenConfig(dim_chunk=chunk)


def test_a_shape_no_tile_fits_is_refused_by_name():
    # 256 heads of D 512: the queries' hi and lo parts alone are 1 MiB at one query a block
    structs = (SDS((5, 256, 512), F32), SDS((5, 256), F32), SDS((300, 512), F32), SDS((300,), F32),
               SDS((5,), I32), SDS((5,), I32))  # fmt: skip
    with (
        jax.default_matmul_precision(ASKS["tf32x3"]),
        pytest.raises(NotImplementedError, match=r"indexer scorer.*TF32_TF32_F32_X3.*'highest'"),
    ):
        lower_for_h200(indexer_triton.indexer_scores_triton, *structs)
    with jax.default_matmul_precision(ASKS["ieee"]):  # IEEE dots keep their operands in registers
        lower_for_h200(indexer_triton.indexer_scores_triton, *structs)
    # a given config is checked too, not handed to the compiler
    q, w, k = jnp.zeros((4, 64, 128), F32), jnp.zeros((4, 64), F32), jnp.zeros((64, 128), F32)
    ends = jnp.full((4,), 64, I32)
    with (
        jax.default_matmul_precision(ASKS["tf32x3"]),
        pytest.raises(NotImplementedError, match="need 262144 bytes"),
    ):
        indexer_triton.indexer_scores_triton(
            q, w, k, None, ends * 0, ends, cfg=indexer_triton.ScorerConfig(2, 128, 8, 2)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(ASKS))
def test_gpu_f32_scorer_and_dosa(mode):
    from jsparse.certified import dosa_topk, workloads

    # screening prunes this workload (the i.i.d. and deepseek-like ones keep too many
    # keys at this size: their survivor lists overflow and fall back, as reported)
    data = workloads.make("low_survival", num_queries=128, num_keys=8192, causal=True, seed=0)
    x = dict(
        q=data.q.astype(F32), weights=data.weights, k=data.k.astype(F32), k_scale=data.k_scale,
        kv_start=data.kv_start, kv_end=data.kv_end,
    )  # fmt: skip
    with backend.interpret_mode(False), jax.default_matmul_precision(ASKS[mode]):
        numerics = planner.numerics_for("triton", F32, F32, 128)
        got = np.asarray(jsparse.indexer_scores(**x, implementation="triton"), np.float64)
        base = jsparse.indexer_topk(**x, top_k=512, method="base", implementation="triton")
        full = jsparse.indexer_topk(**x, top_k=512, method="full", implementation="triton")
        dosa, info = dosa_topk(
            **x, top_k=512, policy="always", implementation="triton", return_info=True
        )
    # the scorer's error within the certificate's model of it (MATH.md §1.7)
    q, w, k = (np.asarray(x[n], np.float64) for n in ("q", "weights", "k"))
    scale = np.asarray(x["k_scale"], np.float64)
    logits = (q.reshape(-1, q.shape[2]) @ k.T).reshape(q.shape[0], q.shape[1], -1)
    exact = np.einsum("th,ths->ts", w, np.maximum(logits, 0)) * scale
    seen = np.isfinite(got)
    err = np.where(seen, np.abs(got - exact), 0.0)
    bound = (
        np.sum(np.abs(w) * np.linalg.norm(q, axis=2), 1)[:, None]
        * (np.linalg.norm(k, axis=1) * scale)[None, :]
    )
    allowed = (numerics.scorer_rel + planner.gamma(64 + 2)) * bound
    assert np.all(err <= allowed), float((err / allowed).max())
    # one scorer: every method's ids and scores are identical, id for id
    for res in (full, dosa):
        np.testing.assert_array_equal(np.asarray(res.indices), np.asarray(base.indices))
        np.testing.assert_array_equal(np.asarray(res.scores), np.asarray(base.scores))
    assert not np.any(np.asarray(dosa.fallback))
    assert np.all(np.asarray(info.screened))  # the f32 screen ran


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(ASKS))
def test_gpu_f32_mla_matches_the_reference(mode):
    rng = np.random.default_rng(6)
    b, h, s, n = 4, 128, 4096, 1024
    q = jnp.asarray(rng.standard_normal((b, h, 576)), F32)
    c = jnp.asarray(rng.standard_normal((b, s, 576)), F32)
    idx = jnp.asarray(rng.integers(-1, s, (b, n)), I32)
    with jax.default_matmul_precision("highest"):  # XLA's GPU default is one TF32 product
        want = jsparse.indexed_mla_attention(q, c, idx, scale=192**-0.5, implementation="reference")
    with jax.default_matmul_precision(ASKS[mode]), backend.interpret_mode(False):
        got = jsparse.indexed_mla_attention(q, c, idx, scale=192**-0.5, implementation="triton")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_tf32x3_hands_over_to_the_reference_where_no_tile_fits():
    rng = np.random.default_rng(4)
    shapes = [(7, 256, 512), (7, 256), (333, 512)]  # 1 MiB of query hi and lo parts
    q, w, k = (jnp.asarray(rng.standard_normal(s), F32) for s in shapes)
    want = jsparse.indexer_scores(q, w, k, implementation="reference")
    with jax.default_matmul_precision(ASKS["tf32x3"]), backend.interpret_mode(False):
        got = jsparse.indexer_scores(q, w, k)  # None: the kernel refuses, the reference runs
        with pytest.raises(NotImplementedError, match="TF32_TF32_F32_X3"):
            jsparse.indexer_scores(q, w, k, implementation="triton")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_gpu_tf32x3_gradients_come_from_the_kernels(monkeypatch):
    from jsparse.ops.indexer import api

    rng = np.random.default_rng(5)
    t, h, d = 384, 64, 128
    q, w, k = (jnp.asarray(rng.standard_normal(s), F32) for s in [(t, h, d), (t, h), (t, d)])
    ends = jnp.arange(1, t + 1, dtype=I32)
    target = jnp.asarray(rng.standard_normal((t, t)), F32)

    def loss(q, w, k, implementation):
        s = jsparse.indexer_scores(q, w, k, kv_end=ends, implementation=implementation)
        return jnp.sum(jnp.where(jnp.isfinite(s), jnp.sin(s) * target, 0.0))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    with jax.default_matmul_precision(ASKS["ieee"]):
        want = grad(q, w, k, "reference")
    called = []
    real = api._score_backward

    def counting():
        return {n: (lambda *a, n=n, f=f: called.append(n) or f(*a)) for n, f in real().items()}

    monkeypatch.setattr(api, "_score_backward", counting)
    with jax.default_matmul_precision(ASKS["tf32x3"]), backend.interpret_mode(False):
        got = grad(q, w, k, "triton")
    assert called == ["triton"]
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # by norm: a ReLU gate at a logit within rounding of 0 may flip (backward.py)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)
