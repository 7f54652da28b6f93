"""Input validation shared by the public ops: precise ``ValueError``s on bad input."""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

FLOAT8 = jnp.float8_e4m3fn
INPUT_FLOATS = (jnp.float32, jnp.bfloat16, FLOAT8)


INT32_MAX = 2**31 - 1


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise ValueError(
            f"{name}: got a {type(x).__name__}; expected an array of rank {rank} {layout}"
        )
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_dtype(name: str, x, allowed: Iterable) -> None:
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise ValueError(f"{name}: dtype {dtype_name(x.dtype)} is not supported; expected {names}")


def check_floating(name: str, x) -> None:
    """A real floating dtype (FP8, bf16, f16, f32, f64); an integer, bool or complex
    array would be converted silently, or give complex scores."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: dtype {dtype_name(x.dtype)}; expected a floating-point array")


def check_dim(name: str, x, axis: int, expected: int, what: str) -> None:
    if x.shape[axis] != expected:
        raise ValueError(
            f"{name}: axis {axis} of shape {tuple(x.shape)} is {x.shape[axis]}; "
            f"expected {expected} ({what})"
        )


# jax.core re-exports Tracer (0.10.x); jax has been moving jax.core's names out since
# 0.8, so the private home is the fallback rather than an AttributeError on a newer jax.
_TRACER = getattr(jax.core, "Tracer", None)
if _TRACER is None:
    from jax._src.core import Tracer as _TRACER


def is_traced(x) -> bool:
    """``x`` is a tracer (under ``jit``, ``grad``, ``vmap``), its value unknown here."""
    return isinstance(x, _TRACER)


def concrete(x):
    """A numpy copy of ``x`` when it is concrete, else None (inside jit: skip value checks)."""
    try:
        return np.asarray(x)
    except Exception:  # jax.errors.TracerArrayConversionError and friends
        return None


def check_cache_room(lengths, t: int, max_len: int) -> None:
    """A cache of ``max_len`` rows holding ``lengths`` tokens (one per sequence, or one
    for all) has room for ``t`` more: under ``jit`` XLA would clamp the write silently,
    so this checks whenever the lengths are concrete (``t > max_len`` always)."""
    seen = concrete(lengths)
    if t > max_len or (seen is not None and (seen + t > max_len).any()):
        shown = "?" if seen is None else seen.tolist()
        raise ValueError(
            f"cache: lengths {shown} + T = {t} new tokens exceed max_len = {max_len}; "
            "make it larger with init_cache(batch, max_len)"
        )


def check_ranges(kv_start, kv_end, t: int, s: int, rows: str):
    """Validated [T] int32 visible ranges kv_start ≤ i < kv_end within [0, S] (defaults:
    every key); ``rows`` names what fixes T in the messages (e.g. "q (8, 64, 128)").
    Traced ranges (under ``jit``) cannot be checked and are returned as given: every
    implementation clamps them as :func:`clamp_ranges` does, the Triton kernels where
    they load them (an XLA clamp here was a launch of its own, 1 µs of a 20 µs decode
    step, run 218c)."""
    ranges = []
    for name, value, default in (("kv_start", kv_start, 0), ("kv_end", kv_end, s)):
        if value is None:
            # numpy: under jit a constant, where jnp.full is a broadcast launched before
            # the first kernel (as topk's one-entry ranges, run 184)
            ranges.append(np.full((t,), default, np.int32))
            continue
        check_rank(name, value, 1, "[T]")
        check_dtype(name, value, (jnp.int32,))
        if value.shape[0] != t:
            raise ValueError(
                f"{name}: shape {tuple(value.shape)}; expected [T] = ({t},) to match {rows}"
            )
        ranges.append(value)
    start, end = ranges
    start_np, end_np = concrete(start), concrete(end)
    if start_np is None or end_np is None:
        return start, end
    for name, v in (("kv_start", start_np), ("kv_end", end_np)):
        bad = (v < 0) | (v > s)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}: {name}[{i}] = {v[i]} is outside [0, S] = [0, {s}]")
    bad = start_np > end_np
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"kv_start > kv_end at query {i}: kv_start[{i}] = {start_np[i]}, "
            f"kv_end[{i}] = {end_np[i]}; a query's visible range must be "
            "[kv_start, kv_end) with kv_start ≤ kv_end"
        )
    return start, end


def clamp_ranges(start, end, s: int):
    """Ranges as every implementation reads them: kv_start clamped to [0, S] and kv_end
    to [kv_start, S] (an end below its start is an empty range), so that no traced range
    reads outside the keys or yields an id outside [start, end). Concrete ranges were
    checked by :func:`check_ranges` and pass unchanged, with no work."""
    if not is_traced(start) and not is_traced(end):
        return start, end
    start = jnp.clip(start, 0, s)
    return start, jnp.clip(end, start, s)


def check_top_k(top_k) -> int:
    if not is_int(top_k):
        raise ValueError(f"top_k: expected a positive Python int, got {top_k!r}")
    if top_k <= 0:
        raise ValueError(f"top_k: expected top_k ≥ 1, got {top_k}")
    if top_k > INT32_MAX:
        raise ValueError(f"top_k: got {top_k}; expected at most 2^31 - 1 (ids are int32)")
    return int(top_k)


def is_int(x) -> bool:
    """A Python or numpy int; a bool is not one (True would count as 1)."""
    return not isinstance(x, bool) and isinstance(x, int | np.integer)


def is_positive_finite(x) -> bool:
    """A Python or numpy real number (not a bool) that is finite and > 0."""
    value = finite_real(x)
    return value is not None and value > 0


def check_int(name: str, x, minimum: int) -> int:
    """A Python or numpy int ≥ ``minimum`` (not a bool), returned as an int."""
    if not is_int(x) or x < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {x!r}")
    return int(x)


def check_bool(name: str, x) -> None:
    """A Python or numpy bool: a string or a number would be taken by its truth value."""
    if not isinstance(x, bool | np.bool_):
        raise ValueError(f"{name}: expected True or False, got {x!r}")


def first_repeating_row(ids: np.ndarray) -> int | None:
    """The first row of concrete ids ``[..., N]`` (rows flattened over the leading axes)
    that lists a non-negative id more than once (-1 is an empty slot), else None."""
    if ids.shape[-1] < 2 or ids.size == 0:
        return None
    rows = np.sort(ids.reshape(-1, ids.shape[-1]), axis=1)
    repeated = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)
    hits = np.flatnonzero(repeated.any(axis=1))
    return int(hits[0]) if hits.size else None


def check_positive_finite(name: str, x) -> None:
    """Every value of ``x`` finite and > 0 (checked when concrete)."""
    values = concrete(x)
    if values is None:
        return
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: {name}{list(at)} = {values[at]}; expected finite and > 0")


def finite_real(x) -> float | None:
    """``x`` as a float if it is a finite real Python or numpy number (not a bool), else
    None: the caller names the argument and what else it needs."""
    real = isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
    return float(x) if real and math.isfinite(x) else None


def check_logit_scale(scale) -> float:
    """A finite real (Python or numpy) number: the static logit scale of an attention op."""
    value = finite_real(scale)
    if value is None:
        raise ValueError(f"scale: got {scale!r}; expected a finite real number")
    return value


def usable_pages(page_table, n_pages: int):
    """A page table as the kernels read it. A concrete table is checked by the caller
    (entries in [-1, n_pages)); under ``jit`` an entry outside that range becomes -1, no
    page, so that nothing is read outside the pool: a token on no page is never read."""
    if page_table is None or concrete(page_table) is not None:
        return page_table
    return jnp.where((page_table >= 0) & (page_table < n_pages), page_table, -1)
