"""SmolLM2-135M-Instruct from its GGUF on real text (needs ``python -m jsparse.assets fetch``).

The oracle is the numpy pass of ``numpy_llama`` on weights read here independently
(``gguf`` dequantisation + the tests' own row de-interleaving), in float64.
"""

from __future__ import annotations

import numpy as np
import numpy_llama
import pytest
import tiny_gguf
from test_llama import decode_vs_forward

from jsparse.models.capture import capture_qkv, capture_text, load_capture
from jsparse.models.perplexity import perplexity, token_nll

pytestmark = pytest.mark.assets

N_TOKENS = 160
OFFSET = 20_000  # mid-novel in Persuasion, the held-out evaluation text
QK_LAYERS = (0, 1, 14, 29)


@pytest.fixture(scope="module")
def numpy_weights(real_assets):
    gguf = pytest.importorskip("gguf")

    reader = gguf.GGUFReader(real_assets.model_path())
    cfg = {
        "n_heads": 9,
        "n_kv_heads": 3,
        "head_dim": 64,
        "rope_theta": 1e5,
        "norm_eps": 1e-5,
        "n_layers": 30,
    }
    weights = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = tiny_gguf.deinterleave_rows(w, cfg["n_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = tiny_gguf.deinterleave_rows(w, cfg["n_kv_heads"])
        weights[t.name] = w
    return weights, cfg


@pytest.fixture(scope="module")
def numpy_pass(real_assets, numpy_weights):
    weights, cfg = numpy_weights
    ids = real_assets.novel_token_ids("persuasion", OFFSET, N_TOKENS)
    return ids, numpy_llama.forward(weights, cfg, ids)


def test_config_is_smollm2(real_model):
    c = real_model.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (
        30,
        576,
        9,
        3,
        64,
        1536,
    )
    assert (c.vocab_size, c.rope_theta, c.norm_eps, c.tie_embeddings) == (49152, 1e5, 1e-5, True)


@pytest.mark.slow
def test_nll_matches_numpy(real_model, numpy_pass):
    ids, ref = numpy_pass
    got = token_nll(real_model, ids, context_len=N_TOKENS)
    expected = numpy_llama.token_nll(ref["logits"], ids)
    # f32 through 30 layers against f64: measured max |ΔNLL| = 2.8e-5 on this window.
    np.testing.assert_allclose(got, expected, rtol=0, atol=3e-4)
    assert abs(got.mean() - expected.mean()) < 1e-4


def test_post_rope_qk_match_numpy(real_model, numpy_pass):
    ids, ref = numpy_pass
    for layer, arrays in capture_qkv(real_model, ids, layers=QK_LAYERS):
        for name in ("q", "k", "v"):
            expected = ref[name][layer]
            err = np.abs(arrays[name] - expected).max() / np.abs(expected).max()
            # measured ≤ 4.4e-6 over all 30 layers on this window
            assert err < 5e-5, f"layer {layer} {name}: relative error {err:.2e}"


def test_perplexity_pride_and_prejudice_first_512(real_assets, real_model):
    """Hugging Face transformers on the same GGUF: ≈ 16.1 (no BOS, one window)."""
    ids = real_assets.novel_token_ids("prideprejudice", 0, 512)
    result = perplexity(real_model, ids, context_len=512)
    assert result.n_scored == 511
    assert result.perplexity == pytest.approx(16.1, abs=0.1)


@pytest.mark.slow
def test_decode_matches_forward(real_assets, real_model):
    ids = real_assets.novel_token_ids("persuasion", 5000, 40)[None]
    steps, full = decode_vs_forward(real_model, ids, prefill=33, max_len=64)
    np.testing.assert_allclose(steps, full, rtol=0, atol=1e-5 * np.abs(full).max())


def test_capture_text(real_model, tmp_path):
    out = capture_text("persuasion", OFFSET, 24, tmp_path / "cap", layers=[0, 29], model=real_model)
    capture = load_capture(out)
    assert capture.meta["novel"] == "persuasion" and capture.meta["offset"] == OFFSET
    assert capture.meta["layers"] == [0, 29]
    assert capture.layers[29]["q"].shape == (24, 9, 64)
    assert capture.layers[0]["k"].shape == (24, 3, 64)


def test_sparse_decode_bench_runs_on_the_real_model(real_assets, tmp_path):
    """`bench/model.py sparse-decode` end to end at a tiny size: a budget covering the
    context matches the dense decode; a small one is a different, finite NLL."""
    import json

    from bench.model import main

    out = tmp_path / "sparse.json"
    argv = ["--json", str(out), "sparse-decode", "--prefill", "48", "--steps", "3",
            "--budgets", "8", "64", "--selectors", "oracle", "--calib-tokens", "64"]  # fmt: skip
    assert main(argv) == 0
    rows = {(r["core"], r["budget"]): r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows[("oracle", 64)]["delta_nll"]) < 1e-4  # 64 ≥ the 50 tokens seen
    assert np.isfinite(rows[("oracle", 8)]["mean_nll"])
    assert rows[("oracle", 8)]["delta_nll"] != 0.0


def _example(name: str):
    """The module ``examples/<name>.py`` (examples are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_indexer_training_example_learns_the_attention(real_model):
    """`examples/train_indexer.py` at a toy size (layer 3, 4 windows of 64 tokens, 30
    steps): the held-out KL falls and the selection captures more of the attention."""
    example = _example("train_indexer")
    argv = ["--layer", "3", "--steps", "30", "--window", "64", "--train-tokens", "256",
            "--eval-tokens", "128", "--heads", "4", "--lr", "3e-3", "--top-k", "8"]  # fmt: skip
    out = example.main(argv, model=real_model)
    before, after = out["before"], out["after"]
    assert after["KL"] < 0.7 * before["KL"]
    assert after["recall@8"] > before["recall@8"]
    assert after["recall@8"] <= out["references"]["recall@8"] + 1e-6  # the best set bounds it


def test_the_indexer_and_jssa_comparison_runs_and_is_bounded(real_model):
    """`examples/indexer_vs_selectors.py` at a toy size (layer 3, windows of 128 tokens):
    the indexer trains, and no single set for all heads beats the best one on mass."""
    example = _example("indexer_vs_selectors")
    argv = ["--layers", "3", "--window", "128", "--train-windows", "2", "--eval-windows", "1",
            "--queries", "32", "--budgets", "8", "16", "--head-dims", "32", "--heads", "4",
            "--steps", "20", "--lr", "3e-3"]  # fmt: skip
    out = example.main(argv, model=real_model)
    first, last, _ = out["training"][(3, 32)]
    assert last < first
    summary = out["summary"]
    for budget in (8, 16):
        assert summary[f"oracle (per KV head, full keys) @{budget}"]["oracle_recall"] == 1.0
        best = summary[f"best shared set @{budget}"]["mass_recall"]
        for label in ("indexer D32 fp8", "indexer D32 f32", "sinks + recent"):
            assert summary[f"{label} @{budget}"]["mass_recall"] <= best + 1e-6
        rd = [key for key in summary if key.startswith("jssa_rd") and key.endswith(f"@{budget}")]
        assert len(rd) == 1 and 0 < summary[rd[0]]["mass_recall"] <= 1
