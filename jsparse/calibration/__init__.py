"""JSSA calibration: streaming second moments, the closed-form basis, Stiefel refinement.

    state = init_moments(n_kv_heads, head_dim)             # or batch_shape=(n_layers,)
    for q, k in chunks:                                    # post-RoPE [N, H, D], [N, Hkv, D]
        state = update_moments(state, q, k)
    moments = finalize_moments(state)                      # G_Q, G_K, means, token count
    basis = jssa_basis(moments, rank)                      # [Hkv, R, D], rows orthonormal
    refined = refine_basis(basis, normalize_trace(moments.gram_q),
                           normalize_trace(moments.gram_k), steps=1600)

The selectors (:mod:`jsparse.selectors`) calibrate from the same :class:`Moments`.
"""

from jsparse.calibration.eigenbasis import jssa_basis, top_eigenvectors
from jsparse.calibration.moments import (
    Moments,
    MomentState,
    compute_moments,
    finalize_moments,
    group_mean_queries,
    init_moments,
    normalize_trace,
    update_moments,
)
from jsparse.calibration.stiefel import (
    RefineResult,
    qr_retraction,
    refine_basis,
    selection_objective,
    subspace_overlap,
)

__all__ = [
    "MomentState",
    "Moments",
    "RefineResult",
    "compute_moments",
    "finalize_moments",
    "group_mean_queries",
    "init_moments",
    "jssa_basis",
    "normalize_trace",
    "qr_retraction",
    "refine_basis",
    "selection_objective",
    "subspace_overlap",
    "top_eigenvectors",
    "update_moments",
]
