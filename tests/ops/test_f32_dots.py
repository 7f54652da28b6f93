"""The Triton kernels' f32 dots (``jsparse.ops.f32_dots``): the mode reaches every kernel
that multiplies f32 operands and lowers for CUDA either way; ``"tf32x3"`` is refused by
the compiled kernels until their tiles fit (run 244); on a GPU, the f32 scorer errs
within the certificate's model and DoSA equals full scoring. (Pallas interpret mode has
no TF32 and runs both modes as IEEE dots.)"""

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
from tests.implementations import running
from tests.lowering import lower_for_h200

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
    monkeypatch.setattr(f32_dots, "DEFAULT", "tf32x3")
    with jax.default_matmul_precision("tensorfloat32"):
        assert f32_dots.mode() == "tf32x3"
    with jax.default_matmul_precision("float32"):
        assert f32_dots.mode() == "ieee"


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
    "indexed_mla_attention": (
        lambda q, c, i: mla_triton.indexed_mla_attention_triton(
            q, c, i, None, latent_dim=64, scale=0.1
        ),
        MLA,
    ),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_f32_kernel_lowers_in_both_modes_and_the_mode_reaches_it(name, monkeypatch):
    monkeypatch.setattr(f32_dots, "TF32X3_KERNELS", True)
    fn, structs = KERNELS[name]
    texts = {}
    for mode, asked in ASKS.items():
        with jax.default_matmul_precision(asked):
            texts[mode] = lower_for_h200(fn, *structs).as_text()
    assert texts["ieee"] != texts["tf32x3"]  # the dots' input precision differs


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


def test_tf32x3_kernels_refuse_until_their_tiles_fit():
    # run 244: every f32 kernel's tiles overflowed shared memory in this mode on an H100.
    # Shapes no other test traces: a cached trace with the kernels enabled would hide it.
    structs = (SDS((5, 8, 64), F32), SDS((5, 8), F32), SDS((300, 64), F32), SDS((300,), F32),
               SDS((5,), I32), SDS((5,), I32))  # fmt: skip
    with (
        jax.default_matmul_precision(ASKS["tf32x3"]),
        pytest.raises(NotImplementedError, match=r"TF32_TF32_F32_X3.*'highest'"),
    ):
        lower_for_h200(indexer_triton.indexer_scores_triton, *structs)


@pytest.mark.gpu
def test_gpu_f32_scorer_and_dosa():
    from jsparse.certified import dosa_topk, workloads

    # screening prunes this workload (the i.i.d. and deepseek-like ones keep too many
    # keys at this size: their survivor lists overflow and fall back, as reported)
    data = workloads.make("low_survival", num_queries=128, num_keys=8192, causal=True, seed=0)
    x = dict(
        q=data.q.astype(F32), weights=data.weights, k=data.k.astype(F32), k_scale=data.k_scale,
        kv_start=data.kv_start, kv_end=data.kv_end,
    )  # fmt: skip
    with backend.interpret_mode(False):
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
    numerics = planner.numerics_for("triton", F32, F32, 128)
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
def test_gpu_tf32x3_hands_over_to_the_reference():
    rng = np.random.default_rng(4)
    q, w, k = (jnp.asarray(rng.standard_normal(s), F32) for s in [(7, 8, 64), (7, 8), (333, 64)])
    want = jsparse.indexer_scores(q, w, k, implementation="reference")
    with jax.default_matmul_precision(ASKS["tf32x3"]), backend.interpret_mode(False):
        got = jsparse.indexer_scores(q, w, k)  # None: the kernel refuses, the reference runs
        with pytest.raises(NotImplementedError, match="TF32_TF32_F32_X3"):
            jsparse.indexer_scores(q, w, k, implementation="triton")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
