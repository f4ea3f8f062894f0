"""KEP-SVGP (MATH.md §6, seed 002): posterior, KL, sampling, KSVD objective, shapes, cost.

Every reference here is written independently of gpattn.variational.kep_svgp: dense float64 matrices,
explicit loops over heads/outputs, ``torch.linalg.solve`` for Λ⁻¹, ``torch.distributions`` for the KL,
a numerical SVD for the KSVD stationary point.
"""

import math

import pytest
import torch
from torch.distributions import MultivariateNormal as TorchMVN
from torch.distributions import kl_divergence
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import gpattn
from gpattn.testing import run_attention_invariant
from gpattn.variational.kep_svgp import (
    kep_kl_divergence,
    kep_posterior,
    kep_sample,
    ksvd_objective,
    landmark_indices,
)

DT = torch.float64


def _random_params(H=2, r=3, Dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    lam = torch.rand(H, r, generator=g, dtype=DT) + 0.3
    m = torch.randn(H, r, r, generator=g, dtype=DT)
    L = torch.randn(H, r, r, r, generator=g, dtype=DT).tril(-1) + torch.diag_embed(
        torch.rand(H, r, r, generator=g, dtype=DT) + 0.2
    )
    W = torch.randn(H, r, Dv, generator=g, dtype=DT)
    b = torch.randn(H, Dv, generator=g, dtype=DT)
    return lam, m, L, W, b


def _dense_moments(G, lam, m, L, W, b, extra=None):
    """Brute force: stack every u_c of a head into one vector u (r·r), write the head output y (T·Dv)
    as an explicit matrix J times u plus b, then mean = J μ_u + b, cov = J S_u Jᵀ.  Returns mean
    (B, H, Dv, T) and the per-column covariances (B, H, Dv, T, T).  ``extra`` (B, H, T, T): a covariance
    added to every output GP f_c independently (the residual term)."""
    B, H, T, r = G.shape
    Dv = W.shape[-1]
    mean = torch.zeros(B, H, Dv, T, dtype=DT)
    cov = torch.zeros(B, H, Dv, T, T, dtype=DT)
    for bb in range(B):
        for h in range(H):
            feat = torch.linalg.solve(torch.diag(lam[h]), G[bb, h].T).T  # G Λ⁻¹, T × r
            J = torch.zeros(T * Dv, r * r, dtype=DT)  # y[t, d] = Σ_c W[c, d] feat[t] · u_c
            for t in range(T):
                for d in range(Dv):
                    for c in range(r):
                        J[t * Dv + d, c * r : (c + 1) * r] = W[h, c, d] * feat[t]
            mu_u = m[h].reshape(-1)
            S_u = torch.block_diag(*[L[h, c] @ L[h, c].T for c in range(r)])
            y_mean = (J @ mu_u).view(T, Dv) + b[h]
            y_cov = (J @ S_u @ J.T).view(T, Dv, T, Dv)
            for d in range(Dv):
                mean[bb, h, d] = y_mean[:, d]
                cov[bb, h, d] = y_cov[:, d, :, d]
                if extra is not None:
                    cov[bb, h, d] += (W[h, :, d] ** 2).sum() * extra[bb, h]
    return mean, cov


# ------------------------------------------------------------------------ posterior and KL (math)
def test_posterior_mean_and_covariance_match_dense_brute_force():
    torch.manual_seed(0)
    lam, m, L, W, b = _random_params()
    e, r = torch.randn(2, 2, 5, 3, dtype=DT), torch.randn(2, 2, 5, 3, dtype=DT)
    G = e + r
    post = kep_posterior(G / lam[:, None, :], m, L, W, b)
    mean_ref, cov_ref = _dense_moments(G, lam, m, L, W, b)
    assert post.batch_shape == (2, 2, 4) and post.event_shape == (5,)
    torch.testing.assert_close(post.mean, mean_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(post.covariance_matrix, cov_ref, rtol=1e-10, atol=1e-10)
    # the low-rank root has r columns per output column: no T×T tensor in the operator
    assert post.lazy_covariance_matrix.root.shape == (2, 2, 4, 5, 3)


def test_posterior_jitter_and_log_prob_match_torch_dense():
    torch.manual_seed(1)
    lam, m, L, W, b = _random_params(H=1, r=2, Dv=2, seed=1)
    a = torch.randn(1, 1, 6, 2, dtype=DT)
    post = kep_posterior(a, m, L, W, b, jitter=1e-3)
    _, cov_ref = _dense_moments(a * lam[:, None, :], lam, m, L, W, b)
    cov_ref = cov_ref + 1e-3 * torch.eye(6, dtype=DT)
    torch.testing.assert_close(post.covariance_matrix, cov_ref)
    y = torch.randn(1, 1, 2, 6, dtype=DT)
    ref = TorchMVN(post.mean, covariance_matrix=cov_ref).log_prob(y)
    torch.testing.assert_close(post.log_prob(y), ref, rtol=1e-8, atol=1e-8)


def test_kl_matches_torch_distributions():
    lam, m, L, _, _ = _random_params(H=3, r=4, seed=2)
    ref = torch.zeros((), dtype=DT)
    for h in range(3):
        prior = TorchMVN(torch.zeros(4, dtype=DT), covariance_matrix=torch.diag(lam[h] ** 2))
        for c in range(4):
            ref = ref + kl_divergence(TorchMVN(m[h, c], scale_tril=L[h, c]), prior)
    torch.testing.assert_close(kep_kl_divergence(lam, m, L), ref, rtol=1e-12, atol=1e-12)
    # a sign flip on the diagonal of L leaves S_c and the KL unchanged
    L2 = L.clone()
    L2[0, 0, 1, 1] *= -1
    L2[0, 0, 2:, 1] *= -1
    torch.testing.assert_close(kep_kl_divergence(lam, m, L2), ref, rtol=1e-12, atol=1e-12)


def test_layer_kl_global_is_the_summed_kl_of_its_parameters():
    layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3).double()
    x = torch.randn(2, 5, 8, dtype=DT)
    layer(x)
    v, ksvd = layer.kep.variational, layer.kep.ksvd
    lam = ksvd.log_lambda.exp()
    ref = sum(
        kl_divergence(
            TorchMVN(v.variational_mean[h, c], scale_tril=v.chol[h, c]),
            TorchMVN(torch.zeros(3, dtype=DT), covariance_matrix=torch.diag(lam[h] ** 2)),
        )
        for h in range(2)
        for c in range(3)
    )
    torch.testing.assert_close(layer.loss_terms()["kl_global"], ref)


# --------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("token_independent", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_sampling_moments_match_analytic(token_independent, with_residual):
    """P = 40000 seeded samples; every entry of the empirical mean and covariance lies within 5
    standard errors of the analytic value (se of a mean: √(Σ_tt/P); of a covariance entry:
    √((Σ_ss Σ_tt + Σ_st²)/P)).  Token-independent samples keep the exact per-token marginals and have
    zero cross-token covariance; exact samples have the full low-rank covariance."""
    P, T, r, Dv = 40000, 4, 2, 2
    lam, m, L, W, b = _random_params(H=1, r=r, Dv=Dv, seed=3)
    g = torch.Generator().manual_seed(4)
    a = torch.randn(1, 1, T, r, generator=g, dtype=DT)
    res = torch.randn(1, 1, T, 3, generator=g, dtype=DT) * 0.7 if with_residual else None
    post = kep_posterior(a, m, L, W, b, residual=res)
    mu, cov = post.mean[0, 0], post.covariance_matrix[0, 0]  # (Dv, T), (Dv, T, T)
    ys = kep_sample(
        a.expand(P, 1, T, r),
        m,
        L,
        W,
        b,
        token_independent=token_independent,
        residual=None if res is None else res.expand(P, 1, T, 3),
        generator=g,
    )[:, 0].transpose(-1, -2)  # (P, Dv, T)
    emp_mean = ys.mean(0)
    centred = ys - emp_mean
    emp_cov = torch.einsum("pds,pdt->dst", centred, centred) / (P - 1)
    var = torch.diagonal(cov, dim1=-2, dim2=-1)
    assert ((emp_mean - mu).abs() <= 5 * (var / P).sqrt()).all()
    target = cov if not token_independent else torch.diag_embed(var)
    se = ((var[..., :, None] * var[..., None, :] + target**2) / P).sqrt()
    assert ((emp_cov - target).abs() <= 5 * se).all(), (emp_cov - target).abs().max()
    off = ~torch.eye(T, dtype=torch.bool)
    if not token_independent:  # the analytic covariance really is correlated across tokens
        assert (cov[:, off].abs() > 10 * se[:, off]).any()


def test_token_independent_marginals_equal_exact_modes_posterior():
    """The two samplers share one posterior: at the same inputs, the layer's deterministic output and
    posterior are identical whatever ``token_independent`` is; only joint draws differ."""
    torch.manual_seed(5)
    a_layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3).double()
    b_layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3, token_independent=True).double()
    b_layer.load_state_dict(a_layer.state_dict())
    x = torch.randn(2, 6, 8, dtype=DT)
    pa, pb = a_layer.posterior(x), b_layer.posterior(x)
    torch.testing.assert_close(pa.mean, pb.mean)
    torch.testing.assert_close(pa.variance, pb.variance)
    with gpattn.deterministic():
        torch.testing.assert_close(a_layer(x), b_layer(x))
    torch.manual_seed(0)
    ya = a_layer(x)
    torch.manual_seed(0)
    yb = b_layer(x)
    assert not torch.allclose(ya, yb)


# ------------------------------------------------------------------------ the layer, end to end
def _reference_layer_moments(layer, x, mask=None):
    """Dense float64 recomputation of the layer's head posterior from its parameters."""
    B, T, D = x.shape
    H, Dh = layer.num_heads, layer.head_dim
    kep = layer.kep
    s = kep.ksvd.num_landmarks
    w, bias = layer.in_proj.weight, layer.in_proj.bias
    q = (x @ w[:D].T + bias[:D]).view(B, T, H, Dh)
    k = (x @ w[D:].T + bias[D:]).view(B, T, H, Dh)
    lam = kep.ksvd.log_lambda.exp()
    G = torch.zeros(B, H, T, kep.rank, dtype=DT)
    E = torch.zeros_like(G)
    R = torch.zeros_like(G)
    for bb in range(B):
        real = [t for t in range(T) if mask is None or not bool(mask[bb, t])]
        n = len(real)
        lm = [real[(j * (n - 1)) // max(s - 1, 1)] for j in range(s)]
        for h in range(H):
            Xt = x[bb, lm, h * Dh : (h + 1) * Dh].T  # Dh × s
            phq = q[bb, :, h] / q[bb, :, h].norm(dim=-1, keepdim=True)
            phk = k[bb, :, h] / k[bb, :, h].norm(dim=-1, keepdim=True)
            E[bb, h] = phq @ (Xt @ kep.ksvd.omega_e[h])
            R[bb, h] = phk @ (Xt @ kep.ksvd.omega_r[h])
            if kep.merge == "add":
                G[bb, h] = E[bb, h] + R[bb, h]
            else:
                keep = torch.tensor([t in real for t in range(T)], dtype=DT)[:, None]
                A = kep.token_weight
                G[bb, h] = A[:, :T] @ (E[bb, h] * keep) + A[:, T:] @ (R[bb, h] * keep)
    v = kep.variational
    mean, cov = _dense_moments(G, lam, v.variational_mean, v.chol, kep.out_weight, kep.out_bias)
    return mean, cov + layer.jitter * torch.eye(T, dtype=DT), E, R


@pytest.mark.parametrize("merge", ["add", "concat"])
def test_layer_posterior_matches_dense_reference(merge):
    torch.manual_seed(6)
    opts = {"seq_len": 7} if merge == "concat" else {}
    layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3, num_landmarks=4, merge=merge, **opts).double()
    x = torch.randn(2, 7, 8, dtype=DT)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, [0, 3, 6]] = True  # padding anywhere, not only at the end
    with torch.no_grad():
        mean_ref, cov_ref, _, _ = _reference_layer_moments(layer, x, mask)
        post = layer.posterior(x, mask)
        torch.testing.assert_close(post.mean, mean_ref)
        torch.testing.assert_close(post.covariance_matrix, cov_ref)
        # under deterministic() the head output is the posterior mean (checked through W_o)
        with gpattn.deterministic():
            y = layer(x, mask)
        y_ref = layer.out_proj(mean_ref.permute(0, 3, 1, 2).reshape(2, 7, 8))
        torch.testing.assert_close(y, y_ref)


def test_include_residual_matches_dense_kff_minus_qff():
    """include_residual=True adds K_ff − Q_ff per branch: κ_e = κκᵀ, κ_r = κᵀκ over the sequence,
    Q_ff = e eᵀ (resp. r rᵀ).  With small ω the middle matrices are PSD, so nothing is clamped."""
    torch.manual_seed(7)
    layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3, num_landmarks=4, include_residual=True).double()
    with torch.no_grad():
        layer.kep.ksvd.omega_e.mul_(0.05)
        layer.kep.ksvd.omega_r.mul_(0.05)
    x = torch.randn(2, 9, 8, dtype=DT)
    with torch.no_grad():
        mean_ref, cov_ref, E, R = _reference_layer_moments(layer, x)
        D, Dh = 8, 4
        w, bias = layer.in_proj.weight, layer.in_proj.bias
        q = (x @ w[:D].T + bias[:D]).view(2, 9, 2, Dh).transpose(1, 2)
        k = (x @ w[D:].T + bias[D:]).view(2, 9, 2, Dh).transpose(1, 2)
        K = (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).mT  # attention kernel
        extra = K @ K.mT - E @ E.mT + K.mT @ K - R @ R.mT
        v, kep = layer.kep.variational, layer.kep
        G = E + R
        lam = kep.ksvd.log_lambda.exp()
        _, cov_ref = _dense_moments(G, lam, v.variational_mean, v.chol, kep.out_weight, kep.out_bias, extra)
        cov_ref = cov_ref + layer.jitter * torch.eye(9, dtype=DT)
        post = layer.posterior(x)
    torch.testing.assert_close(post.mean, mean_ref)
    torch.testing.assert_close(post.covariance_matrix, cov_ref)
    assert torch.linalg.eigvalsh(extra).min() > -1e-10  # the PSD premise of this test


def test_layer_gradcheck_float64():
    torch.manual_seed(8)
    layer = gpattn.build_attention("kep-svgp", 4, 2, rank=2, num_landmarks=3).double()
    x = torch.randn(1, 4, 4, dtype=DT, requires_grad=True)
    mask = torch.tensor([[False, False, False, True]])

    def f(x):
        with gpattn.deterministic():
            y = layer(x, mask)
        return y, layer.loss_terms()["ksvd"]

    assert torch.autograd.gradcheck(f, (x,))


# ----------------------------------------------------------------------------------- landmarks
def test_landmark_indices_are_evenly_spaced_real_tokens():
    mask = torch.tensor([[False] * 10, [True, False, False, True, False, False, False, True, False, True]])
    idx = landmark_indices(10, 4, mask)
    real1 = [1, 2, 4, 5, 6, 8]
    assert idx[0].tolist() == [0, 3, 6, 9]  # j·(n−1)//(s−1) with n = 10
    assert idx[1].tolist() == [real1[(j * 5) // 3] for j in range(4)] == [1, 2, 5, 8]
    assert not mask[1, idx[1]].any()  # padded tokens are never landmarks
    # fewer real tokens than landmarks: real tokens repeat, in order; s = 1 takes the first real token
    assert landmark_indices(3, 5).tolist() == [[0, 0, 1, 1, 2]]
    assert landmark_indices(1, 4).tolist() == [[0, 0, 0, 0]]
    assert landmark_indices(6, 1, mask[:, :6]).tolist() == [[0], [1]]


def test_padding_changes_nothing_relative_to_the_unpadded_sequence():
    """Trailing padding: real outputs, their posterior and the KSVD loss (mean over real tokens only)
    equal those of the truncated, unpadded sequence."""
    torch.manual_seed(9)
    layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3, num_landmarks=5).double()
    x = torch.randn(1, 9, 8, dtype=DT)
    mask = torch.zeros(1, 9, dtype=torch.bool)
    mask[0, 6:] = True
    x[0, 6:] = 1e3 * torch.randn(3, 8, dtype=DT)  # loud padding
    with gpattn.deterministic():
        y_pad = layer(x, mask)
        ksvd_pad = layer.loss_terms()["ksvd"]
        y_cut = layer(x[:, :6])
        ksvd_cut = layer.loss_terms()["ksvd"]
    torch.testing.assert_close(y_pad[:, :6], y_cut)
    torch.testing.assert_close(ksvd_pad, ksvd_cut)
    p_pad, p_cut = layer.posterior(x, mask), layer.posterior(x[:, :6])
    torch.testing.assert_close(p_pad.covariance_matrix[..., :6, :6], p_cut.covariance_matrix)


# ------------------------------------------------------------------------------ KSVD objective
def _stationary_layer(pad: int, seed: int = 10):
    """A one-head layer (Dh = s = 4, r = 2) set at an exact KSVD stationary point of its input.

    Algebra (see ``ksvd_objective``): with n real tokens, Φ_q, Φ_k (n × Dh) their cosine features and
    K = Φ_q Φ_kᵀ = U Σ Vᵀ (numerical SVD, top r), the primal stationary point is W_e = Φ_kᵀ V,
    W_r = Φ_qᵀ U, Λ = Σ (so e = UΣ, r = VΣ).  The layer builds W = X̃ ω from landmarks X̃ (Dh × s);
    choosing the landmark tokens as √n · Q (Q orthogonal, so X̃ᵀX̃ = n I) and ω_e = X̃ᵀ Φ_kᵀ V / n,
    ω_r = X̃ᵀ Φ_qᵀ U / n gives X̃ ω_e = Φ_kᵀ V exactly and tr(ω_eᵀ ω_r) = tr(Vᵀ Kᵀ U)/n = tr Σ / n,
    while each mean of ½‖·Λ^{-1/2}‖² is ½ tr Σ / n: J = 0.
    """
    g = torch.Generator().manual_seed(seed)
    T, n, Dh, r = 12, 12 - pad, 4, 2
    layer = gpattn.build_attention("kep-svgp", Dh, 1, rank=r, num_landmarks=Dh).double()
    x = torch.randn(1, T, Dh, generator=g, dtype=DT)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, n:] = True
    lm = [(j * (n - 1)) // (Dh - 1) for j in range(Dh)]
    Q, _ = torch.linalg.qr(torch.randn(Dh, Dh, generator=g, dtype=DT))
    x[0, lm] = math.sqrt(n) * Q.T  # rows = landmark tokens; X̃ = x[lm]ᵀ = √n Q
    with torch.no_grad():
        w, b = layer.in_proj.weight, layer.in_proj.bias
        qq, kk = x[0, :n] @ w[:Dh].T + b[:Dh], x[0, :n] @ w[Dh:].T + b[Dh:]
        Pq, Pk = qq / qq.norm(dim=-1, keepdim=True), kk / kk.norm(dim=-1, keepdim=True)
        U, S, Vh = torch.linalg.svd(Pq @ Pk.T)
        U, S, V = U[:, :r], S[:r], Vh[:r].T
        Xt = x[0, lm].T
        layer.kep.ksvd.omega_e.copy_((Xt.T @ Pk.T @ V / n)[None])
        layer.kep.ksvd.omega_r.copy_((Xt.T @ Pq.T @ U / n)[None])
        layer.kep.ksvd.log_lambda.copy_(S.log()[None])
    return layer, x, (mask if pad else None), U, S, V, n


@pytest.mark.parametrize("pad", [0, 3])
def test_ksvd_objective_is_zero_at_an_exact_svd_stationary_point(pad):
    layer, x, mask, U, S, V, n = _stationary_layer(pad)
    with torch.no_grad():
        p = layer.project(x)
        e, r, _, _ = layer.kep.ksvd(x, p["q"], p["k"], mask)
        layer(x, mask)
    # the features really are the singular pairs: e = UΣ, r = VΣ on the real tokens
    torch.testing.assert_close(e[0, 0, :n], U * S)
    torch.testing.assert_close(r[0, 0, :n], V * S)
    assert layer.loss_terms()["ksvd"] < 1e-24
    # away from it: Λ → αΛ gives J = (1/α − 1) tr Σ / n exactly, and perturbing ω moves J off 0
    alpha = 2.0
    with torch.no_grad():
        layer.kep.ksvd.log_lambda.add_(math.log(alpha))
        layer(x, mask)
    expected = ((1 / alpha - 1) * S.sum() / n) ** 2
    torch.testing.assert_close(layer.loss_terms()["ksvd"], expected)
    assert expected > 1e-3
    with torch.no_grad():
        layer.kep.ksvd.log_lambda.sub_(math.log(alpha))
        layer.kep.ksvd.omega_r.add_(0.1 * torch.randn_like(layer.kep.ksvd.omega_r))
        layer(x, mask)
    assert layer.loss_terms()["ksvd"] > 1e-6


def test_ksvd_objective_formula_with_padding():
    g = torch.Generator().manual_seed(11)
    e, r = torch.randn(2, 3, 5, 4, generator=g, dtype=DT), torch.randn(2, 3, 5, 4, generator=g, dtype=DT)
    lam = torch.rand(3, 4, generator=g, dtype=DT) + 0.5
    oe, orr = torch.randn(3, 6, 4, generator=g, dtype=DT), torch.randn(3, 6, 4, generator=g, dtype=DT)
    mask = torch.tensor([[False] * 5, [False, False, True, True, False]])
    terms = []
    for b in range(2):
        for h in range(3):
            for t in range(5):
                if not mask[b, t]:
                    terms.append(0.5 * (e[b, h, t] ** 2 / lam[h]).sum() + 0.5 * (r[b, h, t] ** 2 / lam[h]).sum())
    ref = torch.stack(terms).mean() - torch.stack([torch.trace(oe[h].T @ orr[h]) for h in range(3)]).mean()
    torch.testing.assert_close(ksvd_objective(e, r, lam, oe, orr, mask), ref)


# -------------------------------------------------------------------------------- shapes & options
@pytest.mark.parametrize("opts", [{}, {"token_independent": True}, {"include_residual": True}])
def test_batch_one_head_one_token_one(opts):
    """B = H = T = 1 (the released `.squeeze()` bug): samples, mean, posterior and loss terms."""
    torch.manual_seed(12)
    layer = gpattn.build_attention("kep-svgp", 4, 1, **opts)
    x = torch.randn(1, 1, 4)
    y = layer(x)
    assert y.shape == (1, 1, 4) and torch.isfinite(y).all()
    assert all(torch.isfinite(v) and v.dim() == 0 for v in layer.loss_terms().values())
    post = layer.posterior(x)
    assert post.batch_shape == (1, 1, 4) and post.event_shape == (1,)
    p = layer.project(x)
    heads, _ = layer.kep(x, p["q"], p["k"], sample=False)  # (1, 1, 1, Dv)
    torch.testing.assert_close(heads[0, 0, 0], post.mean[0, 0, :, 0])
    concat = gpattn.build_attention("kep-svgp", 4, 1, merge="concat", seq_len=1, **opts)
    assert concat(x).shape == (1, 1, 4)


def test_concat_rejects_a_different_sequence_length():
    layer = gpattn.build_attention("kep-svgp", 8, 2, merge="concat", seq_len=6)
    assert layer(torch.randn(2, 6, 8)).shape == (2, 6, 8)
    for T in (5, 7):
        with pytest.raises(ValueError, match=rf"seq_len=6.*T=6.*got T={T}"):
            layer(torch.randn(2, T, 8))
        with pytest.raises(ValueError, match=rf"got T={T}"):
            layer.posterior(torch.randn(2, T, 8))


@pytest.mark.parametrize(
    "opts, words",
    [
        ({"merge": "concat"}, ["seq_len", "None"]),
        ({"seq_len": 6}, ["seq_len", "concat"]),
        ({"merge": "mean"}, ["merge", "mean"]),
        ({"rank": 0}, ["rank", "0"]),
        ({"num_landmarks": 2.5}, ["num_landmarks"]),
        ({"token_independent": 1}, ["token_independent"]),
        ({"jitter": -1.0}, ["jitter"]),
    ],
)
def test_option_errors(opts, words):
    with pytest.raises(ValueError) as err:
        gpattn.build_attention("kep-svgp", 8, 2, **opts)
    assert all(w in str(err.value) for w in words)


@pytest.mark.parametrize(
    "check", ["shape", "padding", "all_padding_row", "float64", "pickle", "deterministic", "posterior", "errors"]
)
def test_concat_passes_the_invariants_at_its_length(check):
    run_attention_invariant(check, "kep-svgp", merge="concat", seq_len=6)


@pytest.mark.parametrize("check", ["gradients", "small_shapes", "padding"])
def test_other_modes_pass_the_invariants(check):
    run_attention_invariant(check, "kep-svgp", token_independent=True)
    run_attention_invariant(check, "kep-svgp", include_residual=True, rank=2)


# -------------------------------------------------------------------------------- cost in T
class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def _record(name, T, **opts):
    torch.manual_seed(13)
    layer = gpattn.build_attention(name, 8, 2, **opts)
    x = torch.randn(1, T, 8, requires_grad=True)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, -5:] = True
    with _ShapeRecorder() as rec:
        y = layer(x, mask)
        (y.sum() + sum(layer.loss_terms().values(), torch.zeros(()))).backward()
        if layer.is_gp:
            post = layer.posterior(x, mask)
            (post.mean.sum() + post.variance.sum()).backward()
    return [(f, s) for f, s in rec.shapes if sum(d >= T for d in s) >= 2]


@pytest.mark.parametrize("opts", [{}, {"token_independent": True}, {"include_residual": True}])
def test_nothing_t_by_t_is_allocated(opts):
    """At T = 512 no intermediate (forward, backward, posterior) has two axes of size ≥ T; the same
    recorder does see the T×T Gram matrix of kernel attention and the 2T→T map of merge='concat'."""
    T = 512
    assert _record("kep-svgp", T, rank=3, num_landmarks=6, **opts) == []
    assert _record("kernel", T)
    assert _record("kep-svgp", T, rank=3, merge="concat", seq_len=T)


def test_flops_grow_linearly_in_t():
    """Matmul FLOPs of forward + backward are affine in T (zero second difference), unlike concat's
    O(T²) token map."""

    def flops(T, **opts):
        torch.manual_seed(14)
        layer = gpattn.build_attention("kep-svgp", 8, 2, rank=3, num_landmarks=6, **opts)
        x = torch.randn(2, T, 8, requires_grad=True)
        with FlopCounterMode(display=False) as fc:
            y = layer(x)
            (y.sum() + sum(layer.loss_terms().values(), torch.zeros(()))).backward()
        return fc.get_total_flops()

    f = [flops(T) for T in (64, 128, 192)]
    assert f[0] > 0 and f[2] - 2 * f[1] + f[0] == 0
    fc = [flops(T, merge="concat", seq_len=T) for T in (64, 128, 192)]
    assert fc[2] - 2 * fc[1] + fc[0] > 0
