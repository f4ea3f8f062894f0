"""KEP-SVGP (docs/derivations.md §6, Chen et al. (2024)): posterior, KL, sampling, KSVD objective, shapes, cost.

Every reference here is written independently of gpattn.variational.kep_svgp: dense float64 matrices,
explicit loops over heads/outputs, ``torch.linalg.solve`` for Λ⁻¹, ``torch.distributions`` for the KL,
a numerical SVD for the KSVD stationary point.
"""

import math

import pytest
import torch
from _knobs import KEPSVGPProbe
from torch.distributions import MultivariateNormal as TorchMVN
from torch.distributions import kl_divergence
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import gpattn
from gpattn.testing import GPAttentionTestCase, assert_samples_match_moments, layer_loss_terms
from gpattn.testing.references import kep_svgp_dense_features, kep_svgp_dense_moments, kep_svgp_dense_posterior
from gpattn.variational.kep_svgp import (
    kep_kl_divergence,
    kep_posterior,
    kep_sample,
    ksvd_objective,
    landmark_indices,
)

DT = torch.float64


#: the strategy's research settings, options of research/knobs.py's probe only
_KNOBS = {"token_independent", "include_residual", "feature_gradient"}


def paper_layer(embed_dim, num_heads, **options):
    """A kep-svgp layer in Chen et al.'s form (the zero prior mean; the library's default is the softmax mean,
    tested in tests/test_kep_swap.py); with a research setting of its strategy, the probe of research/knobs.py."""
    name = KEPSVGPProbe if _KNOBS & set(options) else "kep-svgp"
    return gpattn.build_attention(name, embed_dim, num_heads, **{"prior_mean": "zero", **options})


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


# ------------------------------------------------------------------------ posterior and KL (math)
def test_posterior_mean_and_covariance_match_dense_brute_force():
    torch.manual_seed(0)
    lam, m, L, W, b = _random_params()
    e, r = torch.randn(2, 2, 5, 3, dtype=DT), torch.randn(2, 2, 5, 3, dtype=DT)
    G = e + r
    post = kep_posterior(G / lam[:, None, :], m, L, W, b)
    mean_ref, cov_ref = kep_svgp_dense_moments(G, lam, m, L, W, b)
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
    _, cov_ref = kep_svgp_dense_moments(a * lam[:, None, :], lam, m, L, W, b)
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


@pytest.mark.parametrize("prior_variance", [1.0, 0.05])
def test_layer_kl_global_is_the_summed_kl_of_its_parameters(prior_variance):
    """kl_global = Σ_{h,c} KL(q(u_c) ‖ N(0, σ²Λ²)); σ² = 1 is Chen et al.'s prior N(0, Λ²)."""
    torch.manual_seed(0)
    layer = paper_layer(8, 2, rank=3, prior_variance=prior_variance).double()
    with torch.no_grad():
        layer.strategy.ksvd.log_lambda.normal_(0.0, 0.3)  # Λ ≠ I, so that σ² and Λ² are told apart
    x = torch.randn(2, 5, 8, dtype=DT)
    layer(x)
    v, ksvd = layer.strategy.variational_distribution, layer.strategy.ksvd
    lam = ksvd.log_lambda.exp()
    prior = [
        TorchMVN(torch.zeros(3, dtype=DT), covariance_matrix=torch.diag(prior_variance * lam[h] ** 2)) for h in (0, 1)
    ]
    ref = sum(
        kl_divergence(TorchMVN(v.variational_mean[h, c], scale_tril=v.chol[h, c]), prior[h])
        for h in range(2)
        for c in range(3)
    )
    torch.testing.assert_close(layer_loss_terms(layer)["kl_global"], ref)


def test_prior_variance_scales_the_prior_and_nothing_else():
    """σ² is the attention kernel's outputscale: p(u_c) = N(0, σ²Λ²) and K_fu K_uu⁻¹ = GΛ⁻¹ unchanged, so the
    posterior (mean and covariance of the head outputs) does not depend on it. (``scale_prior``, which moves
    q(u_c) with σ², is tested in tests/test_kep_swap.py.)"""
    torch.manual_seed(3)
    paper = paper_layer(8, 2, rank=3, prior_variance=1.0).double()
    scaled = paper_layer(8, 2, rank=3, prior_variance=0.2).double()
    scaled.load_state_dict({**paper.state_dict(), "strategy.prior_variance": scaled.strategy.prior_variance})
    assert float(scaled.strategy.prior_variance) == pytest.approx(0.2, rel=1e-7)  # a float32 buffer, made float64
    x = torch.randn(2, 5, 8, dtype=DT)
    cond_p, cond_s = (layer.strategy.condition(x, *layer.strategy_inputs(x)[1:]) for layer in (paper, scaled))
    torch.testing.assert_close(cond_s.posterior().mean, cond_p.posterior().mean, rtol=0, atol=0)
    torch.testing.assert_close(
        cond_s.posterior().covariance_matrix, cond_p.posterior().covariance_matrix, rtol=0, atol=0
    )
    torch.testing.assert_close(
        cond_s.prior_distribution.covariance_matrix,
        float(scaled.strategy.prior_variance) * cond_p.prior_distribution.covariance_matrix,
        rtol=1e-12,
        atol=0,
    )
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="prior_variance must be a float > 0"):
            paper_layer(8, 2, prior_variance=bad)


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
    target = cov if not token_independent else torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    _, se = assert_samples_match_moments(ys, mu, target)
    off = ~torch.eye(T, dtype=torch.bool)
    if not token_independent:  # the analytic covariance really is correlated across tokens
        assert (cov[:, off].abs() > 10 * se[:, off]).any()


def test_token_independent_marginals_equal_exact_modes_posterior():
    """The two samplers share one posterior: at the same inputs, the layer's deterministic output and
    posterior are identical whatever ``token_independent`` is; only joint draws differ."""
    torch.manual_seed(5)
    a_layer = paper_layer(8, 2, rank=3).double()
    b_layer = paper_layer(8, 2, rank=3, token_independent=True).double()
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
class TestKEPSVGP(GPAttentionTestCase):
    """merge="add": the layer against the dense brute force (padding anywhere, not only at the end)."""

    attention = "kep-svgp"
    options = {"prior_mean": "zero"}  # Chen et al.'s form (the dense reference has no prior mean)
    invariants = ()  # at the default options: tests/test_attention_invariants.py
    float64_options = {"rank": 3, "num_landmarks": 4, "prior_mean": "zero"}
    reference_padding = {1: (0, 3, 5)}
    truncation_garbage = 1e3  # loud padding
    truncation_tolerance = {}
    exact_options = {"rank": 3, "num_landmarks": 4, "prior_mean": "zero"}

    def dense_reference(self, layer, x, mask):
        return kep_svgp_dense_posterior(layer, x, mask)

    def check_truncation_extras(self, layer, x, mask, real):
        """The KSVD loss is a mean over real tokens only: the padded sequence's equals the truncated one's."""
        with gpattn.deterministic():
            layer(x[1:], mask[1:])
            padded = layer_loss_terms(layer)["ksvd"]
            layer(x[1:, real])
            torch.testing.assert_close(padded, layer_loss_terms(layer)["ksvd"])


class TestKEPSVGPConcat(TestKEPSVGP):
    """merge="concat" at its fixed length T = 6 (the shapes that need another T are left out)."""

    options = {"merge": "concat", "seq_len": 6, "prior_mean": "zero"}
    invariants = ("shape", "padding", "all_padding_row", "float64", "pickle", "deterministic", "posterior", "errors")
    truncation_padding = moment_samples = long_padding = exact_options = None


class TestKEPSVGPTokenIndependent(TestKEPSVGP):
    """The released code's sampler (one ε per token), through research/knobs.py's probe."""

    attention = KEPSVGPProbe
    options = {"token_independent": True, "prior_mean": "zero"}
    invariants = ("gradients", "small_shapes", "padding")
    independent_tokens = True
    exact_options = None  # the same posterior as TestKEPSVGP's


class TestKEPSVGPResidual(TestKEPSVGP):
    """include_residual=True (its dense reference: test_include_residual_matches_dense_kff_minus_qff), through
    research/knobs.py's probe."""

    attention = KEPSVGPProbe
    options = {"include_residual": True, "rank": 2, "prior_mean": "zero"}
    invariants = ("gradients", "small_shapes", "padding")
    reference_seeds = ()
    exact_options = None


def test_include_residual_matches_dense_kff_minus_qff():
    """include_residual=True adds K_ff − Q_ff per branch: κ_e = κκᵀ, κ_r = κᵀκ over the sequence,
    Q_ff = e eᵀ (resp. r rᵀ).  With small ω the middle matrices are PSD, so nothing is clamped."""
    torch.manual_seed(7)
    layer = paper_layer(8, 2, rank=3, num_landmarks=4, include_residual=True).double()
    with torch.no_grad():
        layer.strategy.ksvd.omega_e.mul_(0.05)
        layer.strategy.ksvd.omega_r.mul_(0.05)
    x = torch.randn(2, 9, 8, dtype=DT)
    with torch.no_grad():
        mean_ref = kep_svgp_dense_posterior(layer, x).mean
        _, E, R = kep_svgp_dense_features(layer, x)
        D, Dh = 8, 4
        w, bias = layer.in_proj.weight, layer.in_proj.bias
        q = (x @ w[:D].T + bias[:D]).view(2, 9, 2, Dh).transpose(1, 2)
        k = (x @ w[D:].T + bias[D:]).view(2, 9, 2, Dh).transpose(1, 2)
        K = (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).mT  # attention kernel
        extra = K @ K.mT - E @ E.mT + K.mT @ K - R @ R.mT
        v, kep = layer.strategy.variational_distribution, layer.strategy
        G = E + R
        lam = kep.ksvd.log_lambda.exp()
        _, cov_ref = kep_svgp_dense_moments(G, lam, v.variational_mean, v.chol, kep.out_weight, kep.out_bias, extra)
        cov_ref = cov_ref + layer.jitter * torch.eye(9, dtype=DT)
        post = layer.posterior(x)
    torch.testing.assert_close(post.mean, mean_ref)
    torch.testing.assert_close(post.covariance_matrix, cov_ref)
    assert torch.linalg.eigvalsh(extra).min() > -1e-10  # the PSD premise of this test


def test_layer_gradcheck_float64():
    torch.manual_seed(8)
    layer = paper_layer(4, 2, rank=2, num_landmarks=3).double()
    x = torch.randn(1, 4, 4, dtype=DT, requires_grad=True)
    mask = torch.tensor([[False, False, False, True]])

    def f(x):
        with gpattn.deterministic():
            y = layer(x, mask)
        return y, layer_loss_terms(layer)["ksvd"]

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
    layer = paper_layer(Dh, 1, rank=r, num_landmarks=Dh).double()
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
        layer.strategy.ksvd.omega_e.copy_((Xt.T @ Pk.T @ V / n)[None])
        layer.strategy.ksvd.omega_r.copy_((Xt.T @ Pq.T @ U / n)[None])
        layer.strategy.ksvd.log_lambda.copy_(S.log()[None])
    return layer, x, (mask if pad else None), U, S, V, n


@pytest.mark.parametrize("pad", [0, 3])
def test_ksvd_objective_is_zero_at_an_exact_svd_stationary_point(pad):
    layer, x, mask, U, S, V, n = _stationary_layer(pad)
    with torch.no_grad():
        p = layer.project(x)
        e, r, _, _ = layer.strategy.ksvd(x, p["q"], p["k"], mask)
        layer(x, mask)
    # the features really are the singular pairs: e = UΣ, r = VΣ on the real tokens
    torch.testing.assert_close(e[0, 0, :n], U * S)
    torch.testing.assert_close(r[0, 0, :n], V * S)
    assert layer_loss_terms(layer)["ksvd"] < 1e-24
    # away from it: Λ → αΛ gives J = (1/α − 1) tr Σ / n exactly, and perturbing ω moves J off 0
    alpha = 2.0
    with torch.no_grad():
        layer.strategy.ksvd.log_lambda.add_(math.log(alpha))
        layer(x, mask)
    expected = ((1 / alpha - 1) * S.sum() / n) ** 2
    torch.testing.assert_close(layer_loss_terms(layer)["ksvd"], expected)
    assert expected > 1e-3
    with torch.no_grad():
        layer.strategy.ksvd.log_lambda.sub_(math.log(alpha))
        layer.strategy.ksvd.omega_r.add_(0.1 * torch.randn_like(layer.strategy.ksvd.omega_r))
        layer(x, mask)
    assert layer_loss_terms(layer)["ksvd"] > 1e-6


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
    layer = paper_layer(4, 1, **opts)
    x = torch.randn(1, 1, 4)
    y = layer(x)
    assert y.shape == (1, 1, 4) and torch.isfinite(y).all()
    assert all(torch.isfinite(v) and v.dim() == 0 for v in layer_loss_terms(layer).values())
    post = layer.posterior(x)
    assert post.batch_shape == (1, 1, 4) and post.event_shape == (1,)
    p = layer.project(x)
    heads = layer.strategy.condition(x, p["q"], p["k"]).mean  # (1, 1, 1, Dv)
    torch.testing.assert_close(heads[0, 0, 0], post.mean[0, 0, :, 0])
    concat = paper_layer(4, 1, merge="concat", seq_len=1, **opts)
    assert concat(x).shape == (1, 1, 4)


def test_concat_rejects_a_different_sequence_length():
    layer = paper_layer(8, 2, merge="concat", seq_len=6)
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
        paper_layer(8, 2, **opts)
    assert all(w in str(err.value) for w in words)


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
        (y.sum() + sum(layer_loss_terms(layer).values(), torch.zeros(()))).backward()
        if layer.is_gp:
            post = layer.posterior(x, mask)
            (post.mean.sum() + post.variance.sum()).backward()
    return [(f, s) for f, s in rec.shapes if sum(d >= T for d in s) >= 2]


@pytest.mark.parametrize("opts", [{}, {"token_independent": True}, {"include_residual": True}])
def test_nothing_t_by_t_is_allocated(opts):
    """At T = 512 no intermediate (forward, backward, posterior) has two axes of size ≥ T; the same
    recorder does see the T×T Gram matrix of kernel attention with a Matérn kernel (the exponential and RBF
    kernels take the fused path, which forms none) and the 2T→T map of merge='concat'."""
    T = 512
    assert _record(KEPSVGPProbe if opts else "kep-svgp", T, rank=3, num_landmarks=6, **opts) == []
    assert _record("kernel", T, kernel="matern")
    assert _record("kernel", T) == []
    assert _record("kep-svgp", T, rank=3, merge="concat", seq_len=T)


def test_flops_grow_linearly_in_t():
    """Matmul FLOPs of forward + backward are affine in T (zero second difference), unlike concat's
    O(T²) token map."""

    def flops(T, **opts):
        torch.manual_seed(14)
        layer = paper_layer(8, 2, rank=3, num_landmarks=6, **opts)
        x = torch.randn(2, T, 8, requires_grad=True)
        with FlopCounterMode(display=False) as fc:
            y = layer(x)
            (y.sum() + sum(layer_loss_terms(layer).values(), torch.zeros(()))).backward()
        return fc.get_total_flops()

    f = [flops(T) for T in (64, 128, 192)]
    assert f[0] > 0 and f[2] - 2 * f[1] + f[0] == 0
    fc = [flops(T, merge="concat", seq_len=T) for T in (64, 128, 192)]
    assert fc[2] - 2 * fc[1] + fc[0] > 0


def test_a_state_dict_from_before_the_outputscale_loads_with_the_papers_prior():
    """The one load hook (gpattn._migrate): a state dict without ``prior_variance`` (saved before it existed) loads
    with σ² = 1, with a warning; everything else loads as saved."""
    layer = paper_layer(8, 2, rank=3)
    old = {k: v for k, v in layer.state_dict().items() if not k.endswith("prior_variance")}
    fresh = paper_layer(8, 2, rank=3)
    with pytest.warns(gpattn.OldVersionWarning, match="prior_variance=1.0"):
        fresh.load_state_dict(old)
    assert float(fresh.strategy.prior_variance) == 1.0
    torch.testing.assert_close(fresh.strategy.out_weight, layer.strategy.out_weight, rtol=0, atol=0)
