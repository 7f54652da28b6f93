"""JSSA-MLA: the block-diagonal map, its scores, calibration on the latent part only,
and selection feeding the MLA attention kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse.selectors.jssa_mla import embed_latent_basis

H, DC, DR = 8, 24, 8
D = DC + DR


def mla_activations(n, seed=0, planted=None):
    """Absorbed queries [n, H, D] and cache rows [n, 1, D]. With ``planted`` the latent
    parts of both lie in one ``planted``-dimensional subspace."""
    rng = np.random.default_rng(seed)
    if planted is None:
        q = rng.standard_normal((n, H, D)) * np.linspace(2.0, 0.2, D)
        k = rng.standard_normal((n, 1, D)) * np.linspace(1.5, 0.1, D)
    else:
        fixed = np.random.default_rng(99)  # one subspace for every seed
        basis = np.linalg.qr(fixed.standard_normal((DC, planted)))[0].T  # [p, DC]
        q = np.concatenate([rng.standard_normal((n, H, planted)) @ basis,
                            rng.standard_normal((n, H, DR))], axis=-1)  # fmt: skip
        k = np.concatenate([rng.standard_normal((n, 1, planted)) @ basis,
                            rng.standard_normal((n, 1, DR))], axis=-1)  # fmt: skip
    return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)


def test_map_is_latent_basis_then_identity_on_rope():
    sel = jsparse.make_selector("jssa_mla", rank=6, latent_dim=DC)
    q, k = mla_activations(400)
    e = np.asarray(sel.calibrate(q, k)["basis"])
    assert e.shape == (1, 6 + DR, D)
    np.testing.assert_allclose(e[0] @ e[0].T, np.eye(6 + DR), atol=1e-5)  # row-orthonormal
    assert not e[0, :6, DC:].any() and not e[0, 6:, :DC].any()
    np.testing.assert_array_equal(e[0, 6:, DC:], np.eye(DR))
    # the latent block is JSSA's basis of the latent moments
    want = jsparse.make_selector("jssa", rank=6).calibrate(q[..., :DC], k[..., :DC])["basis"]
    # (on a GPU, the moments of the two widths come from differently shaped f32 dots:
    # 3.5e-6 apart measured, H200; a wrong block is ~0.1 off)
    np.testing.assert_allclose(e[:, :6, :DC], want, atol=2e-5)
    assert sel.bytes_per_token(D) == 6 + DR


def test_scores_are_projected_latent_plus_rope():
    sel = jsparse.make_selector("jssa_mla", rank=6, latent_dim=DC, cache_dtype="float32")
    q, k = mla_activations(400, seed=1)
    params = sel.calibrate(q, k)
    m = np.asarray(params["basis"])[0, :6, :DC]
    qe, ke = mla_activations(50, seed=2)
    qb, kb = qe[:2], jnp.stack([ke[:25], ke[25:]])  # q [2, H, D], k [2, 25, 1, D]
    got = sel.scores(params, qb, kb, jnp.array([25, 25]))  # [2, 1, 25]
    qm = np.asarray(qb, np.float64).mean(axis=1)  # q̄ over every head
    kn = np.asarray(kb, np.float64)[:, :, 0]
    want = np.einsum("br,bsr->bs", qm[:, :DC] @ m.T, kn[..., :DC] @ m.T)
    want += np.einsum("bd,bsd->bs", qm[:, DC:], kn[..., DC:])
    np.testing.assert_allclose(np.asarray(got)[:, 0], want, rtol=1e-5, atol=1e-5)


def test_a_planted_latent_subspace_gives_the_oracles_selection():
    """Latents in a 5-dim subspace: rank 5 recovers it, so the scores are q̄·k exactly."""
    sel = jsparse.make_selector("jssa_mla", rank=5, latent_dim=DC, cache_dtype="float32")
    q, k = mla_activations(600, seed=3, planted=5)
    params = sel.calibrate(q, k)
    qe, ke = mla_activations(160, seed=4, planted=5)
    qb, kb, lengths = qe[:2], jnp.stack([ke[:80], ke[80:]]), jnp.array([80, 61])
    oracle = jsparse.make_selector("oracle")
    np.testing.assert_array_equal(
        sel.select(params, qb, kb, lengths, 16), oracle.select({}, qb, kb, lengths, 16)
    )


def test_refinement_keeps_the_block_structure():
    sel = jsparse.make_selector("jssa_mla", rank=4, latent_dim=DC, refine_steps=20)
    q, k = mla_activations(300, seed=5)
    e = np.asarray(sel.calibrate(q, k)["basis"])
    np.testing.assert_allclose(e[0] @ e[0].T, np.eye(4 + DR), atol=1e-5)
    assert not e[0, :4, DC:].any()
    np.testing.assert_array_equal(e[0, 4:, DC:], np.eye(DR))


def test_embed_has_leading_axes():
    m = jnp.asarray(np.linalg.qr(np.random.default_rng(0).standard_normal((10, 3)))[0].T)
    e = embed_latent_basis(jnp.broadcast_to(m, (2, 1, 3, 10)), 14)
    assert e.shape == (2, 1, 7, 14)
    np.testing.assert_array_equal(e[1, 0, 3:, 10:], np.eye(4))


def test_bad_configuration_and_moments():
    for bad in (4, True, 16.0, "16"):
        with pytest.raises(ValueError, match=r"latent_dim: expected an int >= 8"):
            jsparse.make_selector("jssa_mla", rank=8, latent_dim=bad)
    assert jsparse.make_selector("jssa_mla", rank=8, latent_dim=np.int64(16)).latent_dim == 16
    q, k = mla_activations(100)
    sel = jsparse.make_selector("jssa_mla", rank=4, latent_dim=DC)
    with pytest.raises(ValueError, match="jssa_mla: moments of 2 KV heads"):
        sel.calibrate(jnp.concatenate([q, q], axis=1), jnp.concatenate([k, k], axis=1))
    with pytest.raises(ValueError, match=r"latent_dim 40 exceeds the row width D = 32"):
        jsparse.make_selector("jssa_mla", rank=4, latent_dim=40).calibrate(q, k)


def test_decode_from_the_projected_cache_into_mla_attention(kernel_impl):
    """The selector's one list per sequence drives indexed MLA attention; with a budget
    of every visible token the result is dense MLA attention over those tokens."""
    sel = jsparse.make_selector("jssa_mla", rank=6, latent_dim=DC)
    q, k = mla_activations(300, seed=6)
    params = sel.calibrate(q, k)
    qe, ke = mla_activations(96, seed=7)
    qb, cache = qe[:2], jnp.stack([ke[:48, 0], ke[48:, 0]])  # q [2, H, D], cache [2, 48, D]
    lengths = jnp.array([48, 30], jnp.int32)
    projected = sel.project_keys(params, cache[:, :, None], headroom=2.0)

    @jax.jit
    def step(qb, cache, projected, lengths):
        idx = sel.select_projected(params, qb, projected, lengths, 48)[:, 0]
        return jsparse.indexed_mla_attention(qb, cache, idx, scale=0.2, latent_dim=DC,
                                             implementation=kernel_impl)  # fmt: skip

    got = step(qb, cache, projected, lengths)
    logits = jnp.einsum("bhd,bsd->bhs", qb, cache, precision="highest") * 0.2
    visible = jnp.arange(48)[None, None, :] < lengths[:, None, None]
    p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    want = jnp.einsum("bhs,bsc->bhc", p, cache[..., :DC], precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
