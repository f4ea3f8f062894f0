"""Decoupled SGPA (docs/derivations.md §5b): posterior, KL, sampler and global keys against dense float64
references (gpattn.testing.references, written independently of gpattn.variational.sgpa_decoupled),
the limiting case "global keys at the sequence's keys" → standard SGPA, and the relation to GPyTorch's
OrthogonallyDecoupledVariationalStrategy. The shapes every GP variant shares come from
gpattn.testing.GPAttentionTestCase (both covariance modes)."""


import gpytorch
import pytest
import torch

import gpattn
from gpattn.testing import GPAttentionTestCase
from gpattn.testing.references import (
    exponential_gram,
    sgpa_decoupled_dense_posterior,
    sgpa_decoupled_global_keys,
    sgpa_decoupled_kl_parts,
    sgpa_heads,
)
from gpattn.variational.covariances import DiagonalCovariance, FullCovariance
from gpattn.variational.means import AmortisedValueMean, ZeroMean
from gpattn.variational.sgpa_decoupled import (
    DecoupledSGPAVariationalStrategy,
    WhitenedGlobalVariationalDistribution,
)

D, H, M = 8, 2, 5
DH = D // H


class TestSGPADecoupled(GPAttentionTestCase):
    """covariance="full" (exact joint samples); every invariant runs in this mode."""

    attention = "sgpa-decoupled"
    options = {"covariance": "full", "prior_mean": "zero"}  # the paper's form (§5b)
    float64_options = {"jitter": 0.0, "num_global": M}
    reference_seeds = (0, 1)
    reference_padding = {1: (1, 5)}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-8, "atol": 1e-8}
    moment_padding = (0, 3)  # padding at the start: the full mode's real-first Cholesky
    long_padding = slice(0, 100)
    exact_options = {"num_global": 8, "covariance": "full", "prior_mean": "zero"}

    def perturb(self, layer):
        q_u = layer.strategy.variational_distribution
        q_u.inducing_values.normal_(0, 0.5)
        q_u.chol_variational_covar.add_(0.3 * torch.randn_like(q_u.chol_variational_covar))
        layer.kernel.lengthscale = 1.5 + torch.rand(H, 1, DH, dtype=torch.float64)
        layer.kernel.outputscale = 0.5 + torch.rand(H, dtype=torch.float64)

    def dense_reference(self, layer, x, mask):
        return sgpa_decoupled_dense_posterior(layer, x, mask)

    def check_truncation_extras(self, layer, x, mask, real):
        g, b = condition(layer, x, mask).kl_divergence_parts()
        g_t, b_t = condition(layer, x[1:, real]).kl_divergence_parts()
        torch.testing.assert_close(g[1], g_t[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b, b_t)


class TestSGPADecoupledDiag(TestSGPADecoupled):
    """covariance="diag", the registered default (its invariants: tests/test_attention_invariants.py)."""

    options = {"covariance": "diag", "prior_mean": "zero"}
    invariants = ()
    independent_tokens = True
    exact_options = None  # the full mode's

    def dense_reference(self, layer, x, mask):
        ref = sgpa_decoupled_dense_posterior(layer, x, mask)
        return ref._replace(covariance=torch.diag_embed(ref.covariance.diagonal(dim1=-2, dim2=-1)))


CASE = TestSGPADecoupled()
make_layer, inputs = CASE.make_layer, CASE.make_inputs  # float64, jitter 0, M = 5, full, perturbed


def gram(layer, a, b):
    return exponential_gram(layer.kernel, a, b)


def condition(layer, x, mask=None):
    p = layer.project(x)
    return layer.strategy.condition(p["qk"], p["v"], layer.global_keys(), mask)


# ------------------------------------------------------------------ posterior and KL
@pytest.mark.parametrize("seed", [0, 1])
def test_kl_parts_match_dense_formulas(seed):
    """γ (input-dependent) and β (global) of the closed-form KL against docs/derivations.md §5b densely (the posterior
    and the loss terms: TestSGPADecoupled.test_posterior_matches_dense_reference)."""
    layer, x = make_layer(seed), inputs(seed=seed)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, [1, 5]] = True
    gamma, beta = sgpa_decoupled_kl_parts(layer, x, mask)
    g, b = condition(layer, x, mask).kl_divergence_parts()
    torch.testing.assert_close(g, gamma, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(b, beta, rtol=1e-8, atol=1e-8)


def test_kl_is_the_process_kl_in_u_space():
    """With Z = a ∪ g the posterior is p(f | f_Z) q(f_Z), so the process KL equals
    KL(q(f_Z) ‖ p(f_Z)) (torch.distributions), and the β-part is the whitened KL of q(ũ_g)."""
    layer, x = make_layer(), inputs()
    cond = condition(layer, x)
    qk, v = sgpa_heads(layer, x)
    kg = sgpa_decoupled_global_keys(layer).expand(2, H, M, DH)
    Zin = torch.cat([qk, kg], dim=-2)  # shape: (B, H, T + M, Dh)
    KZZ, KZa, KZg = gram(layer, Zin, Zin), gram(layer, Zin, qk), gram(layer, Zin, kg)
    Kgg = gram(layer, kg, kg)
    vg = layer.strategy.variational_distribution.inducing_values.detach()
    Lg = torch.linalg.cholesky(Kgg)
    Ls = layer.strategy.variational_distribution.chol_variational_covar.detach().tril()
    mZ = KZa @ v - KZg @ torch.linalg.solve(Kgg, KZa[..., 6:, :] @ v) + KZg @ vg  # K_ga = rows g of K_Za
    P = torch.linalg.solve(Kgg, KZg.mT)[:, :, None]
    SZ = (KZZ - KZg @ torch.linalg.solve(Kgg, KZg.mT))[:, :, None] + P.mT @ (Lg[:, :, None] @ Ls) @ (
        Lg[:, :, None] @ Ls
    ).mT @ P
    q = torch.distributions.MultivariateNormal(mZ.transpose(-1, -2), covariance_matrix=SZ)
    p = torch.distributions.MultivariateNormal(torch.zeros_like(mZ.transpose(-1, -2)), KZZ[:, :, None])
    torch.testing.assert_close(cond.kl_divergence(), torch.distributions.kl_divergence(q, p), rtol=1e-6, atol=1e-6)
    q_w = torch.distributions.MultivariateNormal((Lg[0].mT @ vg).transpose(-1, -2), scale_tril=Ls)
    p_w = torch.distributions.MultivariateNormal(torch.zeros(H, 4, M, dtype=torch.float64), torch.eye(M).double())
    torch.testing.assert_close(cond.kl_divergence_parts()[1], torch.distributions.kl_divergence(q_w, p_w))


def test_global_keys_at_sequence_keys_reduce_to_standard_sgpa():
    """Limiting case: global keys = the sequence's keys, v_g = v_a, S̃_d = diag(s_d²) gives exactly the
    standard SGPA posterior (mean K v, covariance L Σ̃_d Lᵀ)."""
    torch.manual_seed(0)
    std = gpattn.build_attention("sgpa", D, H, jitter=0.0, prior_mean="zero").double()
    with torch.no_grad():
        std.strategy.variational_distribution.weight.normal_(0, 0.4)
    x = inputs(B=1)
    p = std.project(x)
    ref = std.strategy.condition(p["qk"], p["v"])
    T = x.shape[1]
    q_u = WhitenedGlobalVariationalDistribution(H, T, DH).double()
    s = ref.std[0]  # shape: (H, T, Dv)
    with torch.no_grad():
        q_u.inducing_values.copy_(p["v"][0])
        q_u.chol_variational_covar.copy_(torch.diag_embed(s.transpose(-1, -2)))
    dec = DecoupledSGPAVariationalStrategy(
        std.kernel, q_u, torch.zeros(H, T, D), jitter=0.0, covariance=FullCovariance(), mean_module=ZeroMean(),
        variational_mean=AmortisedValueMean(),
    )
    post = dec(p["qk"], p["v"], p["qk"][0])
    ref_post = ref.posterior()
    torch.testing.assert_close(post.mean, ref_post.mean, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(post.covariance_matrix, ref_post.covariance_matrix, rtol=1e-7, atol=1e-8)


def test_diag_is_diagonal_of_full():
    layer, x = make_layer(), inputs()
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :2] = True
    full = layer.posterior(x, mask)
    layer.strategy.covariance = DiagonalCovariance()
    diag = layer.posterior(x, mask)
    torch.testing.assert_close(diag.mean, full.mean)
    torch.testing.assert_close(diag.variance, full.variance, rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(diag.covariance_matrix - torch.diag_embed(diag.variance)) == 0


# ------------------------------------------------------------------ global keys (released-code bug)
def test_each_head_global_keys_use_that_heads_W_qk():
    """Perturbing head h's rows of W_qk changes head h's global keys only; each head's keys equal
    Z_g[h] projected like a token and sliced at head h (docs/derivations.md §5b Released code differs (i))."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa-decoupled", 12, 3, num_global=4, prior_mean="zero")
    Z = layer.strategy.inducing_inputs.detach()
    kg = layer.global_keys().detach()
    for h in range(3):
        torch.testing.assert_close(kg[h], layer.project(Z[h][None])["qk"][0, h])
    for h in range(3):
        with torch.no_grad():
            layer.in_proj.weight[h * 4 : (h + 1) * 4] += 0.5
            layer.in_proj.bias[12 + h] += 1.0  # a v row: must not matter
        new = layer.global_keys().detach()
        others = [g for g in range(3) if g != h]
        assert not torch.allclose(new[h], kg[h])
        torch.testing.assert_close(new[others], kg[others], rtol=0, atol=0)
        kg = new


def test_full_samples_of_real_tokens_ignore_padded_tokens():
    """Left and middle padding: changing the padded tokens leaves real tokens' full-mode samples
    (same seed) unchanged — the shared residual is factorised with the real tokens first."""
    layer = make_layer(covariance="full", jitter=1e-6).float()
    x = inputs(T=8).float()
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [0, 1]] = True
    mask[1, [2, 5]] = True
    x2 = x.clone()
    x2[mask] = 3 * torch.randn(int(mask.sum()), D)
    torch.manual_seed(5)
    a = layer(x, mask)
    torch.manual_seed(5)
    b = layer(x2, mask)
    torch.testing.assert_close(a[~mask], b[~mask], rtol=1e-5, atol=1e-5)


class _GPyTorchODVGP(gpytorch.models.ApproximateGP):
    """A one-output GPyTorch model: OrthogonallyDecoupledVariationalStrategy with mean inducing points at
    the sequence's keys (δ-distribution γ = v_a,d) wrapping a whitened VariationalStrategy at the global
    keys (q(ũ) = N(L_gᵀ v_g,d, L_s,d L_s,dᵀ))."""

    def __init__(self, kernel, keys, global_keys, gamma, u_tilde, L_s):
        T, Mg = keys.shape[0], global_keys.shape[0]
        q_g = gpytorch.variational.CholeskyVariationalDistribution(Mg)
        covar_strategy = gpytorch.variational.VariationalStrategy(
            self, global_keys, q_g, learn_inducing_locations=False, jitter_val=0.0
        )
        q_a = gpytorch.variational.DeltaVariationalDistribution(T)
        strategy = gpytorch.variational.OrthogonallyDecoupledVariationalStrategy(
            covar_strategy, keys, q_a, jitter_val=0.0
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = kernel
        self.double()
        for s in (strategy, covar_strategy):  # keep our values: no initialisation from the prior
            s.variational_params_initialized.fill_(1)
        with torch.no_grad():
            q_a.variational_mean.copy_(gamma)
            q_g.variational_mean.copy_(u_tilde)
            q_g.chol_variational_covar.copy_(L_s)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


# GPyTorch 1.15 / linear_operator 0.6 internals warn under torch 2.13 when slicing the joint covariance
gpytorch_internal_warnings = pytest.mark.filterwarnings(
    "ignore:TypedStorage is deprecated:UserWarning",
    "ignore:torch.sparse.SparseTensor:UserWarning",
    "ignore:Sparse invariant checks:UserWarning",
)


def _gpytorch_vs_ours(diag_scale=None):
    """(ours mean, GPyTorch mean, extra-term prediction, ours KL, GPyTorch KL, KL-extra prediction) for
    one (b, h, d), float64, T = 12, M = 5."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(
        "sgpa-decoupled", 4, 1, num_global=5, jitter=0.0, covariance="full", prior_mean="zero"
    ).double()
    q_u = layer.strategy.variational_distribution
    with torch.no_grad():
        q_u.inducing_values.normal_(0, 0.5)
        if diag_scale is not None:  # S̃ = diag_scale² I
            q_u.chol_variational_covar.copy_(diag_scale * torch.eye(5).expand_as(q_u.chol_variational_covar))
    x = torch.randn(1, 12, 4, dtype=torch.float64)
    cond = condition(layer, x)
    qk = layer.project(x)["qk"][0, 0].detach()
    kg = layer.global_keys()[0].detach()
    d = 1
    kernel = layer.kernel  # batch_shape (1,) = (H,): GPyTorch's outputs get a leading batch axis of 1
    L_s = cond.scale_tril[0, d].detach()
    gamma = cond.inducing_values[0, 0, :, d].detach()
    model = _GPyTorchODVGP(kernel, qk, kg, gamma, cond.whitened_values[0, :, d].detach(), L_s).eval()
    with torch.no_grad():
        gp_mean = model(qk).mean[0]
        gp_kl = model.variational_strategy.kl_divergence()[0]
    ours_mean = cond.mean[0, 0, :, d].detach()
    c = cond.proj_values[0, 0, :, d].detach()  # L_g⁻¹ K_ga γ
    S = L_s @ L_s.T
    extra_mean = cond.interp[0, 0].detach() @ (S @ c)  # K_qg L_g⁻ᵀ S̃ L_g⁻¹ K_ga γ
    ours_kl = cond.kl_divergence()[0, 0, d].detach()
    extra_kl = 0.5 * c @ S @ c
    return ours_mean, gp_mean, extra_mean, ours_kl, gp_kl, extra_kl


@gpytorch_internal_warnings
def test_gpytorch_orthogonally_decoupled_differs_by_the_S_term():
    """GPyTorch's mean = ours + K_qg L_g⁻ᵀ S̃ L_g⁻¹ K_ga γ and its KL = ours + ½ γᵀK_ag L_g⁻ᵀ S̃ L_g⁻¹K_ga γ,
    to 1e-8; at the initialisation S̃ = I the difference is large (measured here: relative mean
    difference 5.4, KL 40.4 vs our 5.8 — the module docstring of sgpa_decoupled)."""
    ours, gp, extra, kl, gp_kl, extra_kl = _gpytorch_vs_ours(diag_scale=1.0)
    torch.testing.assert_close(gp - ours, extra, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(gp_kl - kl, extra_kl, rtol=1e-8, atol=1e-8)
    assert (gp - ours).norm() / ours.norm() > 1
    assert (gp_kl - kl) / kl > 1


@gpytorch_internal_warnings
def test_gpytorch_orthogonally_decoupled_agrees_as_S_vanishes():
    """The equivalence that holds (docs/derivations.md §5b): the mean difference is linear in S̃ and vanishes with it
    (S̃ = 10⁻⁴ I → 10⁻⁸ I shrinks it 10⁴-fold, to below 10⁻⁶ relative)."""
    rel = []
    for scale in (1e-2, 1e-4):
        ours, gp, *_ = _gpytorch_vs_ours(diag_scale=scale)
        rel.append(float((gp - ours).norm() / ours.norm()))
    assert rel[1] < 1e-6
    assert abs(rel[0] / rel[1] / 1e4 - 1) < 1e-3


def test_option_errors():
    with pytest.raises(ValueError, match="num_global"):
        gpattn.build_attention("sgpa-decoupled", D, H, num_global=0)
    with pytest.raises(ValueError, match="covariance"):
        gpattn.build_attention("sgpa-decoupled", D, H, covariance="low-rank")
    with pytest.raises(ValueError, match="jitter"):
        gpattn.build_attention("sgpa-decoupled", D, H, jitter=float("nan"))
    layer = gpattn.build_attention("sgpa-decoupled", D, H, num_global=M, prior_mean="zero")
    p = layer.project(torch.randn(2, 6, D))
    with pytest.raises(ValueError, match="global_keys"):
        layer.strategy.condition(p["qk"], p["v"], torch.randn(H, M, DH + 1))
    with pytest.raises(ValueError, match="inducing_inputs"):
        DecoupledSGPAVariationalStrategy(
            layer.kernel, layer.strategy.variational_distribution, torch.randn(H, 3, D), jitter=1e-6,
            covariance=DiagonalCovariance(), mean_module=ZeroMean(), variational_mean=AmortisedValueMean(),
        )


def test_row_quadratic_backward_is_autograds():
    """The diagonal variance's a_t S_d a_tᵀ (one matmul of outer products, its backward written out) against the same
    product through autograd, float64: values and both gradients to round-off, a non-symmetric S, and gradcheck."""
    from gpattn.variational.sgpa_decoupled import _RowQuadratic

    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(3, 7, 4, dtype=torch.float64, generator=gen, requires_grad=True)  # (H, N, M)
    S = torch.randn(3, 5, 4, 4, dtype=torch.float64, generator=gen, requires_grad=True)  # (H, Dv, M, M)
    weight = torch.randn(3, 7, 5, dtype=torch.float64, generator=gen)
    ref = torch.einsum("hni,hdij,hnj->hnd", rows, S, rows)
    got = _RowQuadratic.apply(rows, S)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for g_got, g_ref in zip(
        torch.autograd.grad((got * weight).sum(), (rows, S)), torch.autograd.grad((ref * weight).sum(), (rows, S))
    ):
        torch.testing.assert_close(g_got, g_ref, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(_RowQuadratic.apply, (rows, S))
