"""Input builders shared by the DoSA tests: small static configs, random and adversarial data.

Static configs are few on purpose: each one compiles the pipeline once (seconds on a
2-core CPU) and every hypothesis example of that config reuses the compiled code.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0

# The property test's examples: 30 fixed ones in CI; JSPARSE_PROPERTY_EXAMPLES=N draws N
# fresh random ones instead, for a long exactness campaign (e.g. 5000, a few minutes
# once compiled). A failure prints the example to reproduce.
_CAMPAIGN = int(os.environ.get("JSPARSE_PROPERTY_EXAMPLES", "0"))
PROPERTY_SETTINGS = (
    dict(max_examples=_CAMPAIGN, derandomize=False, database=None, deadline=None)
    if _CAMPAIGN > 0
    else dict(max_examples=30, derandomize=True, deadline=None)
)


@dataclasses.dataclass(frozen=True)
class Config:
    """Shapes and dtypes (static: one compile each). Method, variant and r vary freely."""

    t: int
    h: int
    d: int
    s: int
    top_k: int
    q_dtype: str = "float32"
    k_dtype: str = "float32"
    scaled: bool = False
    n_seeds: int = 0  # 0: default seeds; > 0: explicit [T, n_seeds] seed ids

    @property
    def id(self):
        return (
            f"T{self.t}H{self.h}D{self.d}S{self.s}K{self.top_k}-{self.q_dtype}x{self.k_dtype}"
            + ("-scaled" if self.scaled else "")
            + (f"-seeds{self.n_seeds}" if self.n_seeds else "")
        )


CONFIGS = (
    Config(6, 6, 16, 80, 8),
    Config(5, 8, 16, 96, 6, "bfloat16", "float8_e4m3fn", scaled=True),
    Config(4, 8, 8, 64, 5, "float8_e4m3fn", "float8_e4m3fn", scaled=True, n_seeds=24),
    Config(4, 1, 16, 64, 6, "float32", "bfloat16"),
)
METHODS = ("dosa", "dense")
R_CHOICES = ("auto", 1, 3, 6)

ADVERSARIAL = (
    "none",
    "ties",
    "equal_scores",
    "zero_keys",
    "all_negative",
    "all_positive",
    "short_ranges",
    "norm_spread",
    "fp8_extremes",
    "nonfinite",
    "extreme_magnitudes",
)


def times_pow2(x, exponents):
    """``x`` times 2^exponents (broadcast), computed in f32 and cast back to x's dtype."""
    return (x.astype(jnp.float32) * jnp.asarray(2.0**exponents, jnp.float32)).astype(x.dtype)


def _cast(x, dtype):
    if dtype == "float8_e4m3fn":
        x = np.clip(x, -FP8_MAX, FP8_MAX)
    return jnp.asarray(x, jnp.float32).astype(dtype)


def make_inputs(cfg: Config, seed: int, adversarial: str = "none"):
    """(q, weights, k, k_scale, kv_start, kv_end, seeds) for ``cfg``; numpy RNG ``seed``."""
    rng = np.random.default_rng(seed)
    t, h, d, s = cfg.t, cfg.h, cfg.d, cfg.s
    # Keys with a shared component and queries partly aligned with keys: scores with
    # structure (some keys clearly high), as in a trained indexer.
    mean = rng.standard_normal(d)
    k = 0.7 * rng.standard_normal((s, d)) + 0.5 * mean
    q = rng.standard_normal((t, h, d))
    q[:, : max(1, h // 2)] += 0.8 * mean
    w = rng.standard_normal((t, h)) / np.sqrt(h * d)
    scale = np.exp(rng.uniform(-1, 1, s)) if cfg.scaled else None
    end = rng.integers(cfg.top_k, s + 1, t)
    start = np.where(rng.random(t) < 0.3, rng.integers(0, np.maximum(end - cfg.top_k, 1)), 0)
    if adversarial == "ties":
        k = rng.standard_normal((3, d))[rng.integers(0, 3, s)]
    elif adversarial == "equal_scores":
        k = np.tile(rng.standard_normal(d), (s, 1))
    elif adversarial == "zero_keys":
        k[rng.random(s) < 0.5] = 0.0
        if rng.random() < 0.3:
            k[:] = 0.0
    elif adversarial == "all_negative":
        w = -np.abs(w)
    elif adversarial == "all_positive":
        w = np.abs(w)
    elif adversarial == "short_ranges":
        length = rng.integers(0, cfg.top_k + 2, t)
        start = rng.integers(0, s - cfg.top_k - 1, t)
        end = start + length
    elif adversarial == "norm_spread":
        k *= 10.0 ** rng.uniform(-4, 4, (s, 1))
    elif adversarial == "fp8_extremes":
        k = rng.choice([FP8_MAX, -FP8_MAX, 2.0**-9, -(2.0**-9), 0.0, 1.0], (s, d))
        q = rng.choice([FP8_MAX, -FP8_MAX, 2.0**-9, 0.5, -1.0], (t, h, d)) * 0.01
        if scale is not None:
            scale = 10.0 ** rng.uniform(-30, 10, s)
    elif adversarial == "nonfinite":
        which = rng.integers(0, 3)
        if which == 0:
            k[rng.integers(0, s), rng.integers(0, d)] = np.nan
        elif which == 1:
            k[rng.integers(0, s), rng.integers(0, d)] = np.inf
        else:
            q[rng.integers(0, t), rng.integers(0, h), rng.integers(0, d)] = np.nan
    elif adversarial == "extreme_magnitudes":
        # Squares of these underflow f32 (|x| < 2^-63): norms, Gram entries and folded
        # weights must still enclose. FP8 payloads cannot be that small: such draws fall
        # through to the weights or to the last branch, which is large (squares and
        # bounds overflow, and the query falls back).
        which = rng.integers(0, 5)
        e = int(rng.integers(64, 111))
        if which == 0 and cfg.q_dtype != "float8_e4m3fn":
            q *= 2.0**-e
        elif which == 1 and cfg.k_dtype != "float8_e4m3fn":
            k *= 2.0**-e
        elif which == 2 and cfg.q_dtype != "float8_e4m3fn":
            # heads of very different scale, each head's share of the score kept
            e_h = rng.integers(0, 81, h)
            q *= 2.0 ** -e_h[None, :, None]
            w *= 2.0 ** e_h[None, :]
        elif which == 3:
            w *= 2.0 ** -rng.integers(60, 121)
        elif cfg.q_dtype != "float8_e4m3fn" and rng.random() < 0.5:
            q *= 2.0 ** rng.integers(40, 71)
        else:
            w *= 2.0 ** rng.integers(60, 127)
    seeds = None
    if cfg.n_seeds:
        seeds = np.full((t, cfg.n_seeds), -1, np.int32)
        for i in range(t):
            n = min(cfg.n_seeds, end[i] - start[i])
            seeds[i, :n] = rng.choice(np.arange(start[i], end[i]), n, replace=False)
        seeds = jnp.asarray(seeds)
    return (
        _cast(q, cfg.q_dtype),
        jnp.asarray(w, jnp.float32),
        _cast(k, cfg.k_dtype),
        None if scale is None else jnp.asarray(scale, jnp.float32),
        jnp.asarray(start, jnp.int32),
        jnp.asarray(end, jnp.int32),
        seeds,
    )
