"""An independent, deliberately plain numpy Llama forward pass (float64), the tests' oracle.

It shares no code with ``jsparse.models``: weights come as a dict of GGUF tensor names
in the Hugging Face layout ([d_out, d_in] projections, rotate-half q / k rows), and
everything is written out loop by loop (one head at a time, explicit causal mask).
"""

from __future__ import annotations

import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    """x [T, heads, D]; dimension i is rotated together with i + D/2."""
    d = x.shape[-1]
    half = d // 2
    freqs = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    angle = positions[:, None].astype(np.float64) * freqs[None, :]  # [T, D/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(w, cfg, tokens, n_layers=None):
    """Returns ``{"logits": [T, V], "q": [...], "k": [...], "v": [...]}`` (per-layer lists).

    ``cfg``: dict with d_model, n_heads, n_kv_heads, head_dim, rope_theta, norm_eps,
    n_layers. ``n_layers`` stops early (no logits then).
    """
    tokens = np.asarray(tokens)
    t = len(tokens)
    h_q, h_kv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    group = h_q // h_kv
    eps = cfg["norm_eps"]
    positions = np.arange(t)
    f64 = {k: np.asarray(v, np.float64) for k, v in w.items()}
    x = f64["token_embd.weight"][tokens]
    xs, qs, ks, vs = [], [], [], []
    layers = cfg["n_layers"] if n_layers is None else n_layers
    causal = np.tril(np.ones((t, t), bool))
    for i in range(layers):
        p = f"blk.{i}."
        h = rms_norm(x, f64[p + "attn_norm.weight"], eps)
        xs.append(h)
        q = (h @ f64[p + "attn_q.weight"].T).reshape(t, h_q, d)
        k = (h @ f64[p + "attn_k.weight"].T).reshape(t, h_kv, d)
        v = (h @ f64[p + "attn_v.weight"].T).reshape(t, h_kv, d)
        q, k = rope(q, positions, cfg["rope_theta"]), rope(k, positions, cfg["rope_theta"])
        qs.append(q)
        ks.append(k)
        vs.append(v)
        out = np.zeros((t, h_q, d))
        for head in range(h_q):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out[:, head] = probs @ v[:, kv]
        x = x + out.reshape(t, h_q * d) @ f64[p + "attn_output.weight"].T
        h = rms_norm(x, f64[p + "ffn_norm.weight"], eps)
        gate = silu(h @ f64[p + "ffn_gate.weight"].T)
        x = x + (gate * (h @ f64[p + "ffn_up.weight"].T)) @ f64[p + "ffn_down.weight"].T
    result = {"x": xs, "q": qs, "k": ks, "v": vs}
    if layers == cfg["n_layers"]:
        x = rms_norm(x, f64["output_norm.weight"], eps)
        head = f64.get("output.weight", f64["token_embd.weight"])
        result["logits"] = x @ head.T
    return result


def token_nll(logits, tokens):
    """NLL of tokens[1:] from logits[:-1] (float64)."""
    logits = np.asarray(logits, np.float64)[:-1]
    m = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=-1)) + m[:, 0]
    return lse - logits[np.arange(len(logits)), np.asarray(tokens)[1:]]
