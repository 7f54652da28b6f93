"""The DoSA screening plan: per query, everything the certificate needs (MATH.md §1.2-§1.7).

For one query with heads ``q_h``, weights ``w_h`` and seed threshold τ, the plan holds
screening rows and scalars such that for every key ``k`` (payload units, scale α > 0)

    U^num(k) = α · ( Σ_j ω_j [q̃_j·k]_+  −  [(hi + lo)·k]_+  +  (E_P + C)·‖k‖↑  +  c_abs )

is at least the score the library's scorer computes for that key (MATH.md §1.6-§1.7):

* ``q̃_j``: the retained heads R (§1.3), rounded to the screening dtype;
* ``ω_j``: folded weights, w_j plus the projections of the omitted positive heads (§1.4);
* ``hi + lo``: the negative aggregate v_A of the omitted negative heads (§1.5), split in two
  rows of the screening dtype so their sum is ~16 bits accurate;
* ``E_P``: the residual allowance of the omitted positive heads, per group of heads the
  better of the triangle and the joint (Gram) form (§1.4);
* ``C``: the numerical guard (§1.7) from the actual dtypes and the two arithmetics (the
  screening kernel's and the scorer's); ``c_abs``: an absolute allowance for underflow;
* ``‖k‖↑``: the key norm rounded upwards (:func:`key_norms`).

A query is screened only when ``prune`` is True: enough seeds (τ exists), finite inputs,
finite guard, no overflow possible, and (``policy="auto"``) a screening cost estimated
on a sample of the seed keys below the cost of scoring every key. Otherwise it is scored
in full (the ``full`` method). Correctness never depends on the heuristics: R, the
anchors, A and r only change how tight the bound is.

Widths. The screening kernel multiplies a key tile by ``W`` rows per query, with W a
power of two (Triton block shapes): two auxiliary rows (hi, lo) and ``r ≤ W − 2``
retained heads. ``r="auto"`` picks per query the width of :data:`AUTO_WIDTHS` with the
lowest estimated cost (screening ∝ W, refinement ∝ the estimated survival); queries with
the same width are screened together (§1.9).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jsparse._rounding import round_to
from jsparse.ops.topk.codes import EMPTY_CODE, code_to_score, score_code

VARIANTS = ("dosa", "neg_all", "no_neg", "strength_only", "no_proj")
"""Certificate variants (the paper's ablation, Figure 9):

* ``dosa``: the default: A = omitted negative heads active on ≥ half the sampled seeds;
  retained negatives by |w|·‖q‖·min(p, 1−p); anchor projection for omitted positives.
* ``neg_all``: A = every omitted negative head.
* ``no_neg``: A = ∅ (no negative aggregate row).
* ``strength_only``: retained negative heads by |w|·‖q‖ only.
* ``no_proj``: β = 0 (no anchor projection): E_P = Σ_P w_h ‖q_h‖.
"""

AUX_ROWS = 2  # hi and lo rows of the negative aggregate, rows 0 and 1 of every query
WIDTHS = (8, 16, 32, 64, 128)
AUTO_WIDTHS = (8, 16, 32)
JOINT_GROUP = 8  # heads per group of the joint allowance (2^8 subsets per group)
SAMPLE_KEYS = 128  # seed keys per query (group) used for p_h and the survival estimate

# Bit flags of Plan.reason: why a query is not screened.
REASON_FEW_SEEDS = 1  # fewer than K seeds: no threshold
REASON_NONFINITE = 2  # non-finite query, weights, threshold or guard
REASON_RANGE = 4  # an overflow could break the guard's arithmetic
REASON_USELESS = 8  # estimated screening cost ≥ scoring everything (policy "auto")
REASON_CAPACITY = 16  # estimated survivors would not fit the survivor buffer

_U32 = 2.0**-23  # f32 unit roundoff, doubled to cover truncating (tensor-core) adders
_TINY = 2.0**-126  # absolute error of one f32 operation that underflows (flush to zero)
_RANGE_LIMIT = 2.0**100  # bound magnitudes below this cannot overflow in the kernels
_SAFETY = 2.0  # the guard is doubled for rounding behaviour the model does not capture


def gamma(n: int, unit: float = _U32) -> float:
    """γ_n = n·u / (1 − n·u): relative error of n floating-point operations (MATH.md §1.7)."""
    return n * unit / (1.0 - n * unit)


@dataclasses.dataclass(frozen=True)
class Numerics:
    """Relative error bounds of the two arithmetics the guard must cover (static).

    ``scorer_rel`` bounds ``|fl(q·k) − q·k| ≤ scorer_rel · ‖q‖ ‖k‖`` for one head dot of
    the scorer; ``screen_rel`` the same for one screening dot. ``screen_dtype`` is the
    dtype of the screening rows.
    """

    scorer_rel: float
    screen_rel: float
    screen_dtype: str


def numerics_for(
    implementation: str, q_dtype, k_dtype, dim: int, fp8_dot: bool = False
) -> Numerics:
    """The error model of an implementation's scorer and screening for these dtypes.

    * reference scorer: elementwise f32, two roundings per step over D: γ_2D;
    * triton scorer with f32 compute (IEEE dot, Precision.HIGHEST), or bf16 / f16
      compute (FP8 keys widen to f16 or bf16 exactly: products exact, f32 tensor-core
      accumulation, possibly truncating): γ_2D with u = 2^-23;
    * triton scorer on the FP8 tensor cores (``ScorerConfig.fp8_dot``): Hopper
      accumulates FP8 MMA products with about 14 bits (DeepSeek-V3 report, §3.3.2);
      Triton promotes the partial sums to f32 after every MMA of 32 products, so one
      dot errs by at most 32·2^-13 = 2^-8 of Σ|q_d k_d| ≤ ‖q‖‖k‖ (taken as 2^-7, a 2×
      margin) plus the f32 adds;
    * screening: bf16 rows (f32 when the keys are f32) on the tensor cores, γ_2D;
    * the Triton kernels' f32 dots in :mod:`jsparse.ops.f32_dots`'s "tf32x3" mode (the
      scorer's and the screen's, f32 keys only): three products a term, so γ over 3D
      terms, plus their bound :func:`~jsparse.ops.f32_dots.extra_relative_error`.
    """
    from jsparse.ops import f32_dots
    from jsparse.ops.indexer.triton import compute_dtype

    q_dtype, k_dtype = jnp.dtype(q_dtype), jnp.dtype(k_dtype)
    f32_dot = gamma(2 * dim + 2)
    screen = "float32" if k_dtype == jnp.float32 else "bfloat16"
    if implementation == "reference":
        return Numerics(scorer_rel=f32_dot, screen_rel=f32_dot, screen_dtype=screen)
    kernel_f32_dot = (
        gamma(2 * f32_dots.accumulated_terms(dim) + 2) + f32_dots.extra_relative_error()
    )
    compute = compute_dtype(q_dtype, k_dtype, fp8_dot)
    if compute == jnp.float32:
        scorer = kernel_f32_dot
    else:
        scorer = f32_dot if compute != jnp.float8_e4m3fn else 2.0**-7 + f32_dot
    screen_rel = kernel_f32_dot if screen == "float32" else f32_dot
    return Numerics(scorer_rel=scorer, screen_rel=screen_rel, screen_dtype=screen)


@struct.dataclass
class Plan:
    """Screening plan of a batch of queries (MATH.md §1.8 step 1). A pytree.

    Row layout per query (``Wmax`` = the widest width of the call): row 0 = hi and row
    1 = lo of the negative aggregate, rows 2 .. 2+r−1 = the retained heads, then zeros.

    Attributes:
      tau_code: Int32[T] score code of the seed threshold τ (EMPTY_CODE: none).
      prune: Bool[T] screen this query (else it is scored in full).
      reason: Int32[T] REASON_* bit flags explaining ``prune == False`` (0 when pruned).
      width: Int32[T] screening row width W of the query.
      r: Int32[T] number of retained heads.
      heads: Int32[T, Wmax] head id of each row (-1: auxiliary or empty row).
      rows: [T, Wmax, D] screening rows (bfloat16, or float32 for f32 keys).
      row_weights: Float32[T, Wmax] folded weights ω (0 on auxiliary and empty rows).
      e_pos: Float32[T] E_P, the omitted positive heads' residual allowance.
      guard: Float32[T] C, the numerical guard (§1.7).
      e_coef: Float32[T] E_P + C rounded up: the coefficient of ‖k‖.
      c_abs: Float32[T] absolute allowance for underflow (payload units).
      p_active: Float32[T, H] activation frequency p_h on the sampled seed keys.
      neg_set: Bool[T, H] heads of the negative aggregate A.
      omitted_pos: Bool[T, H] P, omitted positive heads.
      est_survival: Float32[T] fraction of sampled seed keys the bound keeps.
      sample_count: Int32[T] sampled seed keys behind p_h and est_survival.
      variant, widths: static (the variant's name is informative; the certificate's
        behaviour comes from traced flags, see :func:`variant_flags`).
    """

    tau_code: Int[Array, " T"]
    prune: Bool[Array, " T"]
    reason: Int[Array, " T"]
    width: Int[Array, " T"]
    r: Int[Array, " T"]
    heads: Int[Array, "T W"]
    rows: Array
    row_weights: Float[Array, "T W"]
    e_pos: Float[Array, " T"]
    guard: Float[Array, " T"]
    e_coef: Float[Array, " T"]
    c_abs: Float[Array, " T"]
    p_active: Float[Array, "T H"]
    neg_set: Bool[Array, "T H"]
    omitted_pos: Bool[Array, "T H"]
    est_survival: Float[Array, " T"]
    sample_count: Int[Array, " T"]
    variant: str = struct.field(pytree_node=False, default="dosa")
    widths: tuple[int, ...] = struct.field(pytree_node=False, default=AUTO_WIDTHS)

    @property
    def threshold(self) -> Float[Array, " T"]:
        return code_to_score(self.tau_code)


# ---------------------------------------------------------------------------------------
# Upward rounding helpers. Every quantity that enters the bound additively is enclosed
# from above: a value computed with n roundings is multiplied by (1 + γ_n) and then moved
# one ulp up (the multiplication itself rounds).
#
# Underflow: an f32 operation errs by at most u·|result| + TINY (TINY = 2^-126, a result
# flushed to zero). The relative factors above do not cover the absolute part, so each
# enclosure below adds TINY once per operation that could lose it, times whatever
# multiplies that operation's result afterwards. Only squares make this matter at
# ordinary magnitudes: ‖q‖ < 2^-63 has q_d² < TINY, and without these terms the bound
# fell below the scorer's score (tests/certified: extreme magnitudes).


def _up(x, n: int):
    x = x * jnp.float32(1.0 + gamma(n + 1))
    return jnp.nextafter(x, jnp.float32(jnp.inf))


def _norm_up(x, axis=-1):
    """‖x‖ along ``axis`` (f32), rounded so that it is ≥ the exact norm of x.

    The n squares and n − 1 adds each lose at most TINY to underflow, so Σx² ≤
    (computed + 2n·TINY)(1 + γ_n); the floor this puts under every norm,
    sqrt(2n·TINY) ≈ 2^-59 at n = 128, is what keeps tiny queries and keys exact. It
    also makes the relative error terms (γ‖q‖‖k‖) cover subnormal inputs that a dot
    reads as zero: such a component moves a dot by < 2^-126 times the other norm."""
    n = x.shape[axis]
    return _up(jnp.sqrt(jnp.sum(x * x, axis=axis) + jnp.float32(2 * n * _TINY)), n + 3)


def key_norms(
    k: Float[Array, "S D"], k_scale: Float[Array, " S"] | None
) -> tuple[Float[Array, " S"], Float[Array, ""], Float[Array, ""]]:
    """Upward-rounded payload norms ‖k_i‖↑, +inf for keys that must never be rejected.

    A key with a non-finite component or an invalid scale (≤ 0 or non-finite) gets
    +inf: the screening kernel never rejects it, so it is always scored in full.
    Also returns the largest finite norm and the largest valid scale (range checks).
    """
    kf = k.astype(jnp.float32)
    norm = _norm_up(kf)
    ok = jnp.isfinite(norm)
    if k_scale is not None:
        ok &= jnp.isfinite(k_scale) & (k_scale > 0)
        smax = jnp.max(jnp.where(ok, k_scale, 0.0), initial=0.0)
    else:
        smax = jnp.float32(1.0)
    kmax = jnp.max(jnp.where(ok, norm, 0.0), initial=0.0)
    return jnp.where(ok, norm, jnp.inf), kmax, smax


# ---------------------------------------------------------------------------------------
# The certificate for one static width, vectorised over queries.


@dataclasses.dataclass(frozen=True)
class _Static:
    width: int
    wmax: int
    numerics: Numerics


def _retained(w, qn, p, r, strength_only):
    """Retained set R per query (§1.3): Bool[T, H]."""
    t, h = w.shape
    pos = w > 0
    neg = w < 0
    strength = jnp.abs(w) * qn
    neg_priority = jnp.where(strength_only, strength, strength * jnp.minimum(p, 1 - p))
    group = jnp.where(pos, 0, jnp.where(neg, 1, 2)).astype(jnp.int32)
    key = jnp.where(pos, -strength, -neg_priority)
    heads = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32), (t, h))
    # Positives first (strongest first), then negatives by priority; zero weights last.
    _, _, order = jax.lax.sort((group, key, heads), dimension=1, num_keys=2)
    rank = jnp.argsort(order, axis=1)  # position of each head in the priority order
    return (rank < r[:, None]) & (group < 2), order


def _certificate(q32, w, qn_up, gram, p, r, flags, st: _Static):
    """Rows, folded weights, allowances and guard of one width for every query."""
    t, h, d = q32.shape
    num = st.numerics
    screen_dtype = jnp.dtype(st.numerics.screen_dtype)
    n_ret = min(st.width - AUX_ROWS, h)
    neg_mode, strength_only, no_proj = flags[0], flags[1] != 0, flags[2] != 0
    retained, order = _retained(w, qn_up, p, r, strength_only)
    pos, neg = w > 0, w < 0
    omitted_pos = pos & ~retained
    omitted_neg = neg & ~retained

    # §1.4 anchors: for h ∈ P the retained j minimising ‖q_h − β q_j‖, β = [q_h·q_j]_+/‖q_j‖².
    qn2 = jnp.diagonal(gram, axis1=1, axis2=2)  # [T, H]
    g_pos = jnp.maximum(gram, 0.0)  # [T, h, j]
    beta_all = jnp.where(qn2[:, None, :] > 0, g_pos / jnp.where(qn2 > 0, qn2, 1.0)[:, None, :], 0)
    res2 = qn2[:, :, None] - beta_all * g_pos
    res2 = jnp.where(retained[:, None, :], res2, jnp.inf)
    anchor = jnp.argmin(res2, axis=2).astype(jnp.int32)  # [T, H]
    beta = jnp.take_along_axis(beta_all, anchor[:, :, None], axis=2)[:, :, 0]
    use_proj = omitted_pos & jnp.any(retained, axis=1, keepdims=True)
    use_proj = use_proj & ~no_proj
    beta = jnp.where(use_proj, beta, 0.0)
    q_anchor = jnp.take_along_axis(q32, anchor[:, :, None], axis=1)  # [T, H, D]
    d_vec = q32 - beta[:, :, None] * q_anchor
    # ‖q_h‖ + β‖q_a‖ ≥ ‖d_h‖: the scale of d's rounding here and of E_P's Gram entries
    # (+ 2 TINY: its product and add may underflow).
    reach = qn_up + beta * jnp.take_along_axis(qn_up, anchor, axis=1) + jnp.float32(2 * _TINY)
    # ‖d_exact‖ ≤ ‖d_computed‖ + 2.01u(‖q_h‖ + β‖q_a‖) + 2√D·TINY: two roundings per
    # coordinate, each of which may underflow.
    d_err = jnp.float32(2.01 * _U32) * reach + jnp.float32(2 * np.sqrt(d) * _TINY)
    dn_up = _up(_norm_up(d_vec) + d_err, 2)
    w_pos = jnp.where(omitted_pos, w, 0.0)

    # Folded weights ω_j = w_j + Σ_{a(h)=j} w_h β_h, and |w_j| + Σ|w_h β_h| for their error.
    fold = w_pos * beta  # [T, H] (by omitted head)
    onehot = (anchor[:, :, None] == jnp.arange(h)[None, None, :]) & use_proj[:, :, None]
    omega_by_head = w + jnp.sum(jnp.where(onehot, fold[:, :, None], 0.0), axis=1)
    omega_mag = jnp.abs(w) + jnp.sum(jnp.where(onehot, jnp.abs(fold)[:, :, None], 0.0), axis=1)
    omega_by_head = jnp.where(retained, omega_by_head, 0.0)

    # E_P: groups of JOINT_GROUP omitted positive heads, min(triangle, joint) per group.
    e_pos = _positive_allowance(w_pos, dn_up, gram, reach, anchor, beta, omitted_pos, d)

    # §1.5 negative aggregate A and v_A = Σ_A |w_h| q_h.
    majority = omitted_neg & (p >= 0.5)
    neg_set = jnp.where(neg_mode == 1, omitted_neg, majority) & (neg_mode != 2)
    a_w = jnp.where(neg_set, jnp.abs(w), 0.0)
    v = jnp.einsum("th,thd->td", a_w, q32, precision=jax.lax.Precision.HIGHEST)
    # H products and H - 1 adds a coordinate, each of which may underflow.
    v_err = jnp.float32(gamma(h + 1)) * jnp.sum(a_w * qn_up, axis=1) + jnp.float32(
        2 * h * np.sqrt(d) * _TINY
    )
    # round_to: the error terms below are exact only if the rounding really happens.
    hi = round_to(v, screen_dtype)
    if screen_dtype == jnp.float32:
        lo = jnp.zeros_like(hi)
    else:
        lo = round_to(v - hi.astype(jnp.float32), screen_dtype)
    rest = (v - hi.astype(jnp.float32)) - lo.astype(jnp.float32)
    # rest is exact in f32 (a float minus its rounding); the u‖v‖ term covers the rare
    # inexact case (subnormal conversions).
    aux_err = _up(_norm_up(rest) + v_err + jnp.float32(_U32) * _norm_up(v), 2)
    aux_norm = _up(_norm_up(hi.astype(jnp.float32)) + _norm_up(lo.astype(jnp.float32)), 1)

    # Rows: [hi, lo, retained heads in priority order, zeros] and their weights.
    slot_heads = order[:, :n_ret]  # the first n_ret heads of the priority order
    slot_ok = jnp.take_along_axis(retained, slot_heads, axis=1)
    q_slots = jnp.take_along_axis(q32, slot_heads[:, :, None], axis=1)
    q_tilde = round_to(jnp.where(slot_ok[:, :, None], q_slots, 0.0), screen_dtype)
    omega = jnp.where(slot_ok, jnp.take_along_axis(omega_by_head, slot_heads, axis=1), 0.0)
    omega_mag_s = jnp.where(slot_ok, jnp.take_along_axis(omega_mag, slot_heads, axis=1), 0.0)
    qn_s = jnp.where(slot_ok, jnp.take_along_axis(qn_up, slot_heads, axis=1), 0.0)
    q_tilde32 = q_tilde.astype(jnp.float32)
    qtn_s = _norm_up(q_tilde32)
    rep_err = _norm_up(jnp.where(slot_ok[:, :, None], q_slots, 0.0) - q_tilde32)

    pad = st.wmax - AUX_ROWS - n_ret
    rows = jnp.concatenate(
        [hi[:, None, :], lo[:, None, :], q_tilde, jnp.zeros((t, pad, d), screen_dtype)], axis=1
    )
    row_weights = jnp.pad(omega, ((0, 0), (AUX_ROWS, pad)))
    heads = jnp.pad(
        jnp.where(slot_ok, slot_heads, -1), ((0, 0), (AUX_ROWS, pad)), constant_values=-1
    )

    # §1.7 guard C (payload units): every term bounds an error as a multiple of ‖k‖.
    abs_omega = jnp.abs(omega)
    b_scorer = _up(jnp.sum(jnp.abs(w) * qn_up, axis=1), h)  # Σ_h |w_h| ‖q_h‖ ≥ |s|/‖k‖
    b_rows = _up(jnp.sum(abs_omega * qtn_s, axis=1), n_ret)  # Σ_j |ω_j| ‖q̃_j‖
    terms = (
        # the scorer's H dots, its weight products and its head sum
        (num.scorer_rel + gamma(h + 2) * (1 + num.scorer_rel)) * b_scorer
        # the screening dots (retained rows and the two auxiliary rows)
        + num.screen_rel * (b_rows + aux_norm)
        # rows rounded to the screening dtype (ReLU is 1-Lipschitz), aux reconstruction
        + jnp.sum(abs_omega * rep_err, axis=1)
        + aux_err
        # folded weights formed in f32: |ω_j − w̃_j| ≤ γ_{H+1}(|w_j| + Σ|w_h β_h|) + 2H·TINY
        + gamma(h + 1) * jnp.sum(omega_mag_s * qn_s, axis=1)
        + jnp.float32(2 * h * _TINY) * jnp.sum(qn_s, axis=1)
    )
    # The kernel's epilogue: W products and sums, the aux add, (E_P + C)·‖k‖, c_abs.
    epi = gamma(st.wmax + 6)
    terms = terms + epi * (1 + num.screen_rel) * (b_rows + aux_norm) + epi * e_pos
    # Underflow in forming the terms: fewer than 4H + 6W + 32 operations, each losing at
    # most TINY, scaled by at most the doubling below.
    lost = jnp.float32(2.01 * (4 * h + 6 * st.wmax + 32) * _TINY)
    guard = _up(jnp.float32(_SAFETY) * terms / jnp.float32(1 - 2 * _SAFETY * epi) + lost, 9)
    e_coef = _up(e_pos + guard, 1)
    sum_w = jnp.sum(jnp.abs(w), axis=1) + jnp.sum(abs_omega, axis=1) + 2.0
    c_abs = jnp.float32(_SAFETY * _TINY) * ((d + 2) * sum_w + 4 * (h + st.wmax) + 16)
    # Largest bound, score or single dot per unit key norm: below 2^100 / (‖k‖·α) no
    # intermediate of either arithmetic can overflow.
    magnitude = (
        b_scorer + b_rows + aux_norm + e_coef + c_abs
        + jnp.max(qn_up, axis=1) + jnp.max(qtn_s, axis=1, initial=0.0)
    )  # fmt: skip

    return dict(
        rows=rows,
        row_weights=row_weights,
        heads=heads,
        omega_by_head=omega_by_head,
        a_w=a_w,
        e_pos=e_pos,
        guard=guard,
        e_coef=e_coef,
        c_abs=c_abs,
        neg_set=neg_set,
        omitted_pos=omitted_pos,
        r=jnp.sum(retained, axis=1).astype(jnp.int32),
        magnitude=magnitude,
        finite=(
            jnp.isfinite(e_coef)
            & jnp.all(jnp.isfinite(row_weights), axis=1)
            & jnp.all(jnp.isfinite(rows.astype(jnp.float32)), axis=(1, 2))
            & jnp.isfinite(magnitude)
        ),
    )


def _positive_allowance(w_pos, dn_up, gram, reach, anchor, beta, omitted_pos, dim):
    """E_P = Σ_g min(triangle_g, joint_g) over groups of JOINT_GROUP omitted heads (§1.4).

    joint_g = max_{T ⊆ g} ‖Σ_{h∈T} u_h‖ with the exact u_h = w_h (q_h − β_h q_a(h)). Its
    Gram matrix comes from the queries' Gram matrix ``gram`` (f32, G_ij = q_i·q_j):

        u_a·u_b = w_a w_b (G_hh' − β_b G_hc' − β_a G_ch' + β_a β_b G_cc')

    for heads h, h' with anchors c, c'. No [T, H, D] product or D-long dot is formed
    (the per-group Gram of the computed u was a SIMT GEMM of 0.26 ms at 8192 queries,
    WORKSPACE.md run 214). Enclosure: |G − G*| ≤ γ ‖q_i‖‖q_j‖ per entry (γ = γ_{2D+2},
    the library's f32 dot), so with m_a = w_a·``reach`` = w_a (‖q_h‖↑ + β_a ‖q_c‖↑) every
    entry errs by at most (γ + γ_8(1 + γ)) m_a m_b (γ_8: no term of the four-term form
    passes more than eight roundings, six in the order written), and a subset's
    quadratic form by that times (Σ m)², plus its own γ_{g²+2} (Σ m)². Underflow adds an
    absolute part: 2D·TINY a G entry and TINY for each of the nine operations forming a
    u entry, scaled by at most W_a W_b (W = w(1 + β)), and g² + 4 TINY for the form's adds
    and the slack's own products; bounded by (2D + 9)·TINY·(Σ W + g)² + (g² + 4)·TINY.
    """
    t, h = w_pos.shape
    g = JOINT_GROUP
    n_groups = -(-h // g)
    tri = w_pos * dn_up  # [T, H]
    # Slot s of a query holds its s-th omitted positive head (by head id).
    slot = jnp.cumsum(omitted_pos, axis=1) - 1
    key = jnp.where(omitted_pos, slot, h + jnp.arange(h)[None, :])
    head_of_slot = jnp.argsort(key, axis=1).astype(jnp.int32)
    n_p = jnp.sum(omitted_pos, axis=1)
    pad = n_groups * g - h
    head_of_slot = jnp.pad(head_of_slot, ((0, 0), (0, pad)))
    slot_ok = jnp.arange(n_groups * g)[None, :] < n_p[:, None]

    def by_slot(x):
        return jnp.where(slot_ok, jnp.take_along_axis(x, head_of_slot, axis=1), 0.0)

    tri_s = by_slot(tri).reshape(t, n_groups, g)
    w_s = by_slot(w_pos).reshape(t, n_groups, g)
    b_s = by_slot(beta).reshape(t, n_groups, g)
    heads = head_of_slot.reshape(t, n_groups, g)
    anchors = jnp.take_along_axis(anchor, head_of_slot, axis=1).reshape(t, n_groups, g)
    rows = jnp.arange(t)[:, None, None, None]

    def entries(a, b):  # G[a_i, b_j] within each group: [T, n_groups, g, g]
        return gram[rows, a[:, :, :, None], b[:, :, None, :]]

    bi, bj = b_s[:, :, :, None], b_s[:, :, None, :]
    wi, wj = w_s[:, :, :, None], w_s[:, :, None, :]
    # Ordered so that an operation's underflow is scaled by at most W_a·W_b afterwards
    # (W = w(1 + β)): the slack's absolute part below.
    u_gram = wi * (wj * (
        entries(heads, heads) - bj * entries(heads, anchors) - bi * entries(anchors, heads)
        + bi * (bj * entries(anchors, anchors))
    ))  # fmt: skip
    m_s = by_slot(_up(w_pos * reach + jnp.float32(_TINY), 5)).reshape(t, n_groups, g)
    big_w = by_slot(_up(w_pos * (1.0 + beta), 2)).reshape(t, n_groups, g)
    subsets = jnp.asarray(
        ((np.arange(2**g)[:, None] >> np.arange(g)[None, :]) & 1).astype(np.float32)
    )  # [2^g, g]
    hp = jax.lax.Precision.HIGHEST
    quad = jnp.einsum("ma,tgab,mb->tgm", subsets, u_gram, subsets, precision=hp)
    dot_err = gamma(2 * dim + 2)
    entry_err = dot_err + gamma(8) * (1 + dot_err)
    sum_m = _up(jnp.sum(m_s, axis=2) + jnp.float32(g * _TINY), g + 1)
    slack = jnp.float32(entry_err + gamma(g * g + 2)) * sum_m**2
    # Underflow: a G entry may lose 2D·TINY, an entry of u's Gram 9 more operations'
    # (each scaled by ≤ W_a W_b, W_a or 1), the quadratic form ≤ g² adds, the slack 2.
    sum_w = _up(jnp.sum(big_w, axis=2) + g, g + 1)  # ≥ g: the square cannot underflow
    slack_abs = jnp.float32((2 * dim + 9) * _TINY) * sum_w**2 + jnp.float32((g * g + 4) * _TINY)
    joint_sq = jnp.max(quad, axis=2) + slack + slack_abs
    joint = _up(jnp.sqrt(joint_sq) * jnp.float32(1 + 5 * _U32), 2)
    tri_g = _up(jnp.sum(tri_s, axis=2) + jnp.float32(2 * g * _TINY), g + 1)
    per_group = jnp.where(jnp.sum(tri_s, axis=2) > 0, jnp.minimum(tri_g, joint), 0.0)
    return _up(jnp.sum(per_group, axis=1) + jnp.float32(n_groups * _TINY), n_groups + 1)


# ---------------------------------------------------------------------------------------
# Seed sample, activation frequencies, survival estimate, cost model.


def sample_seed_columns(n_seeds: int, skip: int, n_sample: int = SAMPLE_KEYS) -> np.ndarray:
    """Columns of a seed list to sample: a strided subset of columns ``skip..n_seeds-1``.

    Default seed lists put the most recent keys first (they score high on causal text);
    skipping them keeps p_h and the survival estimate close to the visible range's
    statistics.
    """
    skip = min(skip, max(n_seeds - 1, 0))
    n = max(1, min(n_sample, n_seeds - skip))
    return (skip + (np.arange(n) * (n_seeds - skip)) // n).astype(np.int32)


def _query_gram(q: Float[Array, "T H D"]) -> Float[Array, "T H H"]:
    """G[t, h, j] = q_h·q_j in f32, within γ_{2D+2}‖q_h‖‖q_j‖ (+ underflow) of exact.

    BF16 and FP8 queries widen exactly to bf16, whose products are exact in f32: bf16
    operands with f32 accumulation, i.e. the tensor cores on a GPU, whose possibly
    truncating adds the doubled u = 2^-23 covers as it does for the scorer. As an f32
    product (HIGHEST) it was, by its HLO name, run 217's 0.44 ms GEMM at 8192 queries
    (8.6 GFLOP on the f32 FMA units; WORKSPACE.md, session 40). f32 queries: IEEE f32."""
    if q.dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        qb = q.astype(jnp.bfloat16)
        return jnp.einsum("thd,tjd->thj", qb, qb, preferred_element_type=jnp.float32)
    q32 = q.astype(jnp.float32)
    return jnp.einsum("thd,tjd->thj", q32, q32, precision=jax.lax.Precision.HIGHEST)


def _sample_bound_sums(omega_by_head, a_w, x, relu_x):
    """Σ_h ω_h [x_h]_+ and Σ_h a_h x_h over the sampled keys' dots x [T, H, n] and
    their ReLU (formed once for every width); an estimate: survival, not the certificate."""
    ret = jnp.einsum("th,thn->tn", omega_by_head, relu_x)
    agg = jnp.einsum("th,thn->tn", a_w, x)
    return ret, agg


def _sample_dots(q, k, sample_ids, group):
    """Dots [T, H, n] of each query with its group's sampled keys (-1: none): bf16, or
    f32 when a side is f32."""
    t, h, d = q.shape
    n_g, n = sample_ids.shape
    safe = jnp.clip(sample_ids, 0, k.shape[0] - 1)
    ks = k[safe]  # [n_g, n, D]
    pad = n_g * group - t
    qg = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(n_g, group, h, d)
    # An estimate only: bf16 unless a side is f32 (XLA has no generic fp8 einsum), and
    # kept in that dtype: [T, H, n] is read three times after the dots (p, and the
    # bound of the sampled keys for the survival estimate).
    ct = jnp.float32 if jnp.float32 in (q.dtype, k.dtype) else jnp.bfloat16
    x = jnp.einsum("bghd,bnd->bghn", qg.astype(ct), ks.astype(ct), preferred_element_type=ct)
    return x.reshape(n_g * group, h, n)[:t]


def _screen_cost(width, heads):
    # Per (query, key), relative to scoring all H heads: W rows instead of H, plus a
    # heavier epilogue (bound, compare, compaction). A design-time estimate: the H200
    # measured ~2.5·W/H at H = 64 (certified.triton's probe prices with that); this rule
    # and the width choice keep 1.25 until they are re-measured together.
    return 1.25 * width / max(heads, 16)


def _refine_cost(survival):
    # Survivors are scored for the whole query block (union of BT queries) by gather.
    return 1.2 * jnp.minimum(1.0, 1.5 * survival)


@functools.partial(
    jax.jit,
    static_argnames=(
        "top_k", "group", "widths", "numerics", "policy", "list_capacity", "recent_keys",
    ),
)  # fmt: skip
def plan_from_threshold(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    k_scale: Float[Array, " S"] | None,
    start: Int[Array, " T"],
    end: Int[Array, " T"],
    tau_code: Int[Array, " T"],
    sample_ids: Int[Array, "G N"],
    r: Int[Array, " T"] | None,
    knorm: Float[Array, " S"],
    kmax: Float[Array, ""],
    smax: Float[Array, ""],
    flags: Int[Array, " 3"],
    *,
    top_k: int,
    group: int,
    widths: tuple[int, ...],
    numerics: Numerics,
    policy: str = "auto",
    list_capacity: int | None = None,
    recent_keys: int = 0,
) -> Plan:
    """The plan, given τ (from the implementation's scorer) and a key sample per group.

    ``r`` None: per query, the width of ``widths`` with the lowest estimated cost
    (r = W − 2, at most H); else Int32[T] retained heads per query, each query using the
    smallest width of ``widths`` with W − 2 ≥ r.

    ``recent_keys``: the most recent keys of each range that the sample leaves out (the
    recent half of default seed lists, :func:`sample_seed_columns`). The survival
    estimate counts them as kept: on causal text they score high, and leaving them out
    made the estimate 2-3.5× low on the GPU benchmarks (WORKSPACE.md, 2026-11-30).
    """
    del top_k
    t, h, _ = q.shape
    q32 = q.astype(jnp.float32)
    w = weights.astype(jnp.float32)
    qn_up = _norm_up(q32)  # [T, H]
    gram = _query_gram(q)
    wmax = max(widths)

    # p_h and the survival estimate from the sampled seed keys visible to each query.
    x = _sample_dots(q, k, sample_ids, group)  # [T, H, n]
    sid = jnp.repeat(sample_ids, group, axis=0)[:t]
    valid = (sid >= start[:, None]) & (sid < end[:, None]) & (sid >= 0)
    safe = jnp.clip(sid, 0, k.shape[0] - 1)
    s_norm = knorm[safe]
    s_scale = jnp.ones_like(s_norm) if k_scale is None else k_scale[safe]
    valid &= jnp.isfinite(s_norm)
    n_valid = jnp.sum(valid, axis=1)
    active = jnp.sum(jnp.where(valid[:, None, :], x > 0, False), axis=2)
    p = jnp.where(n_valid[:, None] > 0, active / jnp.maximum(n_valid, 1)[:, None], 0.5)
    relu_x = jnp.where(x < 0, 0.0, x)

    visible = (end - start).astype(jnp.float32)
    recent = jnp.minimum(jnp.float32(recent_keys), visible) / jnp.maximum(visible, 1.0)

    def sample_survival(c):
        # The bound of the sampled seed keys, as the kernel forms it (in f32).
        ret, agg = _sample_bound_sums(c["omega_by_head"], c["a_w"], x, relu_x)
        u_est = (ret - jnp.where(agg < 0, 0.0, agg) + c["e_coef"][:, None] * s_norm) * s_scale
        keep = valid & (score_code(u_est) >= tau_code[:, None])
        sampled = jnp.sum(keep, axis=1) / jnp.maximum(n_valid, 1)
        return recent + (1.0 - recent) * sampled

    if r is None:
        # Per query, the width whose certificate is estimated cheapest: one certificate
        # per width.
        certs, costs, survs = [], [], []
        for width in widths:
            r_w = jnp.full((t,), min(width - AUX_ROWS, h), jnp.int32)
            st = _Static(width=width, wmax=wmax, numerics=numerics)
            c = _certificate(q32, w, qn_up, gram, p, r_w, flags, st)
            surv = sample_survival(c)
            certs.append(c)
            survs.append(surv)
            costs.append(_screen_cost(width, h) + _refine_cost(surv))
        cost = jnp.stack(costs, axis=0)  # [n_widths, T]
        choice = jnp.argmin(cost, axis=0)
        width_arr = jnp.asarray(widths, jnp.int32)[choice]

        def pick(name):
            stacked = jnp.stack([c[name] for c in certs], axis=0)
            idx = choice.reshape((1, t) + (1,) * (stacked.ndim - 2))
            return jnp.take_along_axis(stacked, idx, axis=0)[0]

        surv = jnp.take_along_axis(jnp.stack(survs), choice[None], axis=0)[0]
        best = jnp.take_along_axis(cost, choice[None], axis=0)[0]
    else:
        need = jnp.asarray([wd - AUX_ROWS for wd in widths], jnp.int32)
        choice = jnp.argmax(need[:, None] >= jnp.minimum(r, h)[None, :], axis=0)
        width_arr = jnp.asarray(widths, jnp.int32)[choice]
        # r is given: one certificate laid out for the widest width serves every query.
        # Each query keeps its own r (its rows past r are zero) and is screened at its
        # own width; the rounding allowances for Wmax rows cover fewer. Once instead of
        # once per width: the plan moves [T, H, D] f32 tensors and is memory-bound.
        st = _Static(width=wmax, wmax=wmax, numerics=numerics)
        c = _certificate(q32, w, qn_up, gram, p, jnp.minimum(r, width_arr - AUX_ROWS), flags, st)
        surv = sample_survival(c)
        best = _screen_cost(width_arr, h) + _refine_cost(surv)

        def pick(name):
            return c[name]

    finite_in = jnp.all(jnp.isfinite(q32), axis=(1, 2)) & jnp.all(jnp.isfinite(w), axis=1)
    tau_finite = (tau_code > score_code(jnp.float32(-jnp.inf))) & (
        tau_code < score_code(jnp.float32(jnp.inf))
    )
    few = tau_code == EMPTY_CODE
    nonfinite = ~finite_in | ~pick("finite") | (~tau_finite & ~few)
    too_big = ~(pick("magnitude") * kmax * jnp.maximum(smax, 1.0) < _RANGE_LIMIT)
    reason = jnp.where(few, REASON_FEW_SEEDS, 0) | jnp.where(nonfinite, REASON_NONFINITE, 0)
    reason |= jnp.where(too_big & ~nonfinite, REASON_RANGE, 0)
    if policy == "auto":
        reason |= jnp.where((best >= 0.9) | (n_valid < 16), REASON_USELESS, 0)
    if list_capacity is not None and policy == "auto":
        expected = 1.5 * surv * (end - start).astype(jnp.float32)
        reason |= jnp.where(expected > 0.5 * list_capacity, REASON_CAPACITY, 0)
    prune = reason == 0
    return Plan(
        tau_code=tau_code,
        prune=prune,
        reason=reason.astype(jnp.int32),
        width=width_arr,
        r=pick("r"),
        heads=pick("heads"),
        rows=pick("rows"),
        row_weights=pick("row_weights"),
        e_pos=pick("e_pos"),
        guard=pick("guard"),
        e_coef=pick("e_coef"),
        c_abs=pick("c_abs"),
        p_active=p.astype(jnp.float32),
        neg_set=pick("neg_set"),
        omitted_pos=pick("omitted_pos"),
        est_survival=surv.astype(jnp.float32),
        sample_count=n_valid.astype(jnp.int32),
        widths=widths,
    )


def resolve_r(r, num_queries: int, heads: int) -> tuple[tuple[int, ...], jax.Array | None]:
    """Static widths and per-query r for ``r`` = "auto", an int, or Int32[T] (concrete)."""
    if isinstance(r, str):
        if r != "auto":
            raise ValueError(f"r: expected 'auto', a positive int or [T] ints, got {r!r}")
        needed = sorted({min(wd, _next_width(heads + AUX_ROWS)) for wd in AUTO_WIDTHS})
        return tuple(needed), None
    if isinstance(r, int | np.integer) and not isinstance(r, bool):
        values = np.full((num_queries,), int(r))
    else:
        values = np.asarray(r)
        if values.shape != (num_queries,) or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(
                f"r: expected 'auto', an int, or concrete integer [T] = ({num_queries},) "
                f"values, got shape {values.shape} dtype {values.dtype}"
            )
    if values.size and values.min() < 1:
        raise ValueError(f"r: every retained-head count must be ≥ 1, got min {values.min()}")
    values = np.minimum(values, heads)
    widths = tuple(sorted({_next_width(int(v) + AUX_ROWS) for v in np.unique(values)}))
    return widths, jnp.asarray(values, jnp.int32)


def _next_width(rows: int) -> int:
    for wd in WIDTHS:
        if wd >= rows:
            return wd
    raise ValueError(f"r: {rows - AUX_ROWS} retained heads exceed the widest screening tile")


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant: got {variant!r}; expected one of {VARIANTS}")
    return variant


def variant_flags(variant: str) -> jax.Array:
    """The variant as traced data (negative-set mode, strength-only, no projection).

    Traced rather than static so that every variant shares one compiled pipeline.
    Negative-set mode: 0 majority-active omitted negatives, 1 all, 2 none.
    """
    check_variant(variant)
    neg_mode = {"neg_all": 1, "no_neg": 2}.get(variant, 0)
    return jnp.asarray(
        [neg_mode, variant == "strength_only", variant == "no_proj"], dtype=jnp.int32
    )


def make_plan(
    q: Float[Array, "T H D"],
    weights: Float[Array, "T H"],
    k: Float[Array, "S D"],
    k_scale: Float[Array, " S"] | None,
    start: Int[Array, " T"],
    end: Int[Array, " T"],
    seed_ids: Int[Array, "T N"],
    top_k: int,
    *,
    r: str | int | Sequence[int] = "auto",
    variant: str = "dosa",
    policy: str = "auto",
    sample_skip: int | None = None,
) -> Plan:
    """The screening plan of every query with the reference scorer's τ.

    ``seed_ids`` [T, N]: distinct visible seed keys per query (-1 unused; others are
    dropped, :func:`jsparse.ops.indexer.methods.usable_seed_ids`), for example
    :func:`jsparse.ops.indexer.api.default_seed_ids`. τ is their K-th score under
    :func:`jsparse.ops.indexer.reference.score_keys_reference`. The Triton methods build
    their plan the same way from their own scorer (:mod:`jsparse.certified.triton`).

    ``policy``: "auto" screens a query only when the estimated cost is below scoring
    everything; "always" screens every query whose certificate is valid.
    """
    from jsparse.ops.indexer.api import seed_threshold_code
    from jsparse.ops.indexer.methods import usable_seed_ids
    from jsparse.ops.indexer.reference import score_keys_reference

    check_variant(variant)
    if policy not in ("auto", "always"):
        raise ValueError(f"policy: got {policy!r}; expected 'auto' or 'always'")
    t, h, d = q.shape
    widths, r_arr = resolve_r(r, t, h)
    seed_ids = usable_seed_ids(seed_ids, start, end)
    seed_scores = score_keys_reference(q, weights, k, seed_ids, k_scale)
    tau = seed_threshold_code(seed_scores, seed_ids, top_k)
    n = seed_ids.shape[1]
    skip = n // 2 if sample_skip is None else sample_skip
    cols = sample_seed_columns(n, skip)
    knorm, kmax, smax = key_norms(k, k_scale)
    numerics = numerics_for("reference", q.dtype, k.dtype, d)
    plan = plan_from_threshold(
        q, weights, k, k_scale, start, end, tau, seed_ids[:, cols], r_arr, knorm, kmax, smax,
        variant_flags(variant), top_k=top_k, group=1, widths=widths, numerics=numerics,
        policy=policy, recent_keys=skip,
    )  # fmt: skip
    return plan.replace(variant=variant)
