"""Standard SGPA (MATH.md §5a): the posterior, KL and sampler against dense float64 references written
here independently of gpattn.variational.sgpa."""

import gpytorch
import linear_operator
import pytest
import torch
import torch.nn.functional as F
from _sgpa_helpers import assert_samples_match_moments, spy_iterative_solvers

import gpattn
from gpattn.testing import ATTENTION_INVARIANTS, run_attention_invariant

D, H = 8, 2
DH = D // H


# ------------------------------------------------------------------ independent dense references
def heads(layer, x):
    """qk and v per head straight from the fused weight.  # shape: -> (B, H, T, Dh), (B, H, T, Dv)"""
    W, b = layer.in_proj.weight, layer.in_proj.bias
    B, T, _ = x.shape
    Dv = layer.value_dim
    qk = (x @ W[:D].T + b[:D]).view(B, T, H, DH).transpose(1, 2)
    v = (x @ W[D : D + H * Dv].T + b[D : D + H * Dv]).view(B, T, H, Dv).transpose(1, 2)
    return qk, v


def exp_gram(layer, a, b):
    """σ² exp(Σ_i a_i b_i / ℓ_i²) per head.  # shape: (B, H, n, Dh), (B, H, m, Dh) -> (B, H, n, m)"""
    ell = layer.kernel.lengthscale.detach()  # shape: (H, 1, Dh)
    s2 = layer.kernel.outputscale.detach()  # shape: (H,)
    return s2[:, None, None] * torch.exp((a / ell) @ (b / ell).mT)


def amortised_std(layer, k):
    q_u = layer.strategy.variational_distribution
    return F.softplus(torch.einsum("bhtk,hkd->bhtd", k, q_u.weight) + q_u.bias[:, None, :])


def make_layer(seed=0, **options):
    """float64 layer away from its initialisation (random scales and kernel hyper-parameters)."""
    torch.manual_seed(seed)
    options.setdefault("jitter", 0.0)
    layer = gpattn.build_attention("sgpa", D, H, **options).double()
    with torch.no_grad():
        q_u = layer.strategy.variational_distribution
        q_u.weight.normal_(0, 0.4)
        q_u.bias.normal_(0, 0.5)
        if isinstance(layer.kernel, gpattn.kernels.ExponentialKernel):
            layer.kernel.lengthscale = 1.5 + torch.rand(H, 1, DH, dtype=torch.float64)
            layer.kernel.outputscale = 0.5 + torch.rand(H, dtype=torch.float64)
    return layer


def inputs(B=2, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------ posterior
@pytest.mark.parametrize("seed", [0, 1])
def test_posterior_matches_dense_svgp_formula(seed):
    """mean = K_qk K_kk⁻¹ m, Σ = K_qq − K_qk K_kk⁻¹ K_kq + K_qk K_kk⁻¹ S K_kk⁻¹ K_kq with m = K v,
    S = L diag(s²) Lᵀ (the generic SVGP formula, MATH §5a) to 1e-8 in float64."""
    layer, x = make_layer(seed), inputs(seed=seed)
    post = layer.posterior(x)
    qk, v = heads(layer, x)
    K = exp_gram(layer, qk, qk)
    L = torch.linalg.cholesky(K)
    s2 = amortised_std(layer, qk).square()  # shape: (B, H, T, Dv)
    m = K @ v
    mean = (K @ torch.linalg.solve(K, m)).transpose(-1, -2)
    S = L[:, :, None] @ torch.diag_embed(s2.transpose(-1, -2)) @ L[:, :, None].mT  # shape: (B, H, Dv, T, T)
    P = torch.linalg.solve(K, K)[:, :, None]  # K_kk⁻¹ K_kq
    cov = (K - K @ torch.linalg.solve(K, K))[:, :, None] + P.mT @ S @ P
    torch.testing.assert_close(post.mean, mean, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(post.covariance_matrix, cov, rtol=1e-8, atol=1e-8)


def test_mean_is_kernel_attention():
    """Under deterministic() the layer equals the `kernel` baseline with the same weights: K_qk v, also
    with key padding (on the real tokens)."""
    layer = make_layer()
    base = gpattn.build_attention("kernel", D, H).double()
    base.load_state_dict(
        {k.removeprefix("strategy."): v for k, v in layer.state_dict().items() if "variational" not in k}
    )
    x = inputs(T=7)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, [0, 4]] = True
    with gpattn.deterministic():
        torch.testing.assert_close(layer(x), base(x), rtol=1e-10, atol=1e-10)
        real = ~mask
        torch.testing.assert_close(layer(x, mask)[real], base(x, mask)[real], rtol=1e-10, atol=1e-10)


def test_self_attention_covariance_is_whitened_root():
    """q = k, so Σ_d = S_d = L Σ̃_d Lᵀ; the diagonal of the full covariance equals the diag mode."""
    layer, x = make_layer(), inputs()
    qk, _ = heads(layer, x)
    L = torch.linalg.cholesky(exp_gram(layer, qk, qk))
    s = amortised_std(layer, qk).transpose(-1, -2)  # shape: (B, H, Dv, T)
    root = L[:, :, None] * s[..., None, :]
    full = layer.posterior(x)
    torch.testing.assert_close(full.covariance_matrix, root @ root.mT, rtol=1e-10, atol=1e-10)
    layer.strategy.covariance = "diag"
    diag = layer.posterior(x)
    torch.testing.assert_close(diag.mean, full.mean)
    torch.testing.assert_close(diag.covariance_matrix, torch.diag_embed(full.variance), rtol=1e-10, atol=1e-12)


def test_any_gpytorch_kernel():
    """`kernel=` accepts ARD-RBF by name and any gpytorch Kernel instance; mean = K v with that kernel."""
    x = inputs()
    for kernel in ("rbf", gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=DH, batch_shape=torch.Size([H]))):
        layer = make_layer(kernel=kernel)
        qk, v = heads(layer, x)
        if kernel == "rbf":
            ell = layer.kernel.base_kernel.lengthscale.detach()
            d2 = ((qk[..., :, None, :] - qk[..., None, :, :]) / ell[:, None]).square().sum(-1)
            K = layer.kernel.outputscale.detach()[:, None, None] * torch.exp(-0.5 * d2)
        else:
            K = layer.kernel(qk, qk).to_dense().detach()
        torch.testing.assert_close(layer.posterior(x).mean, (K @ v).transpose(-1, -2), rtol=1e-8, atol=1e-8)


# ------------------------------------------------------------------ KL
@pytest.mark.parametrize("jitter", [0.0, 0.1])
def test_kl_matches_torch_distributions(jitter):
    """Whitened u-space KL(N(Lᵀv, diag s²) ‖ N(0, I)) and the unwhitened KL(N((K + jI) v, L Σ̃ Lᵀ) ‖
    N(0, K + jI)), L = chol(K + jI) with the relative jitter j = jitter · mean diag K (a large one here,
    so that its term is visible), both equal the strategy's closed form; the layer reports its batch
    mean as kl_seq (MATH §9)."""
    layer, x = make_layer(jitter=jitter), inputs()
    qk, v = heads(layer, x)
    cond = layer.strategy.condition(qk, v)
    kl = cond.kl_divergence()  # shape: (B, H, Dv)
    K = exp_gram(layer, qk, qk)[:, :, None]  # shape: (B, H, 1, T, T)
    K = K + jitter * K.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(6, dtype=torch.float64)
    L = torch.linalg.cholesky(K)
    s = amortised_std(layer, qk).transpose(-1, -2)  # shape: (B, H, Dv, T)
    vd = v.transpose(-1, -2)[..., None]  # shape: (B, H, Dv, T, 1)
    q_w = torch.distributions.MultivariateNormal((L.mT @ vd)[..., 0], scale_tril=torch.diag_embed(s))
    p_w = torch.distributions.MultivariateNormal(torch.zeros_like(s), scale_tril=torch.diag_embed(torch.ones_like(s)))
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(q_w, p_w), rtol=1e-9, atol=1e-9)
    q_u = torch.distributions.MultivariateNormal((K @ vd)[..., 0], scale_tril=L * s[..., None, :])
    p_u = torch.distributions.MultivariateNormal(torch.zeros_like(s), scale_tril=L.expand_as(q_u.scale_tril))
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(q_u, p_u), rtol=1e-7, atol=1e-7)
    layer(x)
    terms = layer.loss_terms()
    assert set(terms) == {"kl_seq"}
    torch.testing.assert_close(terms["kl_seq"], kl.sum((1, 2)).mean(0))


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_sample_moments(covariance):
    """4000 seeded draws: every mean entry within 5 standard errors (sqrt(Σ_tt / P)) and every
    covariance entry within 5 standard errors (sqrt((Σ_ii Σ_jj + Σ_ij²) / P)) of the analytic values."""
    layer, x = make_layer(covariance=covariance), inputs(B=1, T=5)
    post = layer.posterior(x)
    qk, v = heads(layer, x)
    torch.manual_seed(3)
    P = 4000
    f = layer.strategy.condition(qk, v).rsample(num_samples=P).transpose(-1, -2)  # shape: (P, B, H, Dv, T)
    mean, cov = post.mean, post.covariance_matrix
    emp, se = assert_samples_match_moments(f, mean, cov)
    if covariance == "diag":
        off = ~torch.eye(5, dtype=torch.bool)
        assert (emp[..., off].abs() / se[..., off]).max() < 5  # independent tokens


def test_deterministic_is_posterior_mean_and_mc_average_converges():
    layer, x = make_layer(), inputs()
    with gpattn.deterministic():
        y0 = layer(x)
    heads_mean = layer.posterior(x).mean.permute(0, 3, 1, 2).reshape(2, 6, -1)  # shape: (B, T, H·Dv)
    torch.testing.assert_close(y0, layer.out_proj(heads_mean), rtol=1e-10, atol=1e-10)
    torch.manual_seed(0)
    N = 2000
    ys = layer(x.repeat(N, 1, 1)).view(N, *x.shape)  # N stochastic passes at once
    assert not torch.allclose(ys[0], ys[1])
    se = ys.std(0) / N**0.5
    assert ((ys.mean(0) - y0).abs() / se).max() < 5


# ------------------------------------------------------------------ padding
@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_padding_equals_truncated_sequence(covariance):
    """Padded keys leave the basis: real tokens' mean, covariance, KL and Cholesky rows equal a run
    on the sequence without them (padding at the start and in the middle)."""
    layer, x = make_layer(covariance=covariance), inputs(T=7)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, [0, 3, 4]] = True
    real = (~mask[1]).nonzero()[:, 0]
    xt = x[1:, real]
    post, post_t = layer.posterior(x, mask), layer.posterior(xt)
    torch.testing.assert_close(post.mean[1][..., real], post_t.mean[0], rtol=1e-10, atol=1e-10)
    cov = post.covariance_matrix[1][..., real, :][..., real]
    torch.testing.assert_close(cov, post_t.covariance_matrix[0], rtol=1e-10, atol=1e-10)
    qk, v = heads(layer, x)
    cond = layer.strategy.condition(qk, v, mask)
    cond_t = layer.strategy.condition(*heads(layer, xt))
    torch.testing.assert_close(cond.kl_divergence()[1], cond_t.kl_divergence()[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cond.chol[1][..., real, :][..., real], cond_t.chol[0], rtol=1e-10, atol=1e-10)
    assert cond.chol[1][..., real, :][..., mask[1]].abs().max() == 0  # padded columns out of real rows
    # padded positions: placeholder N(0, 1), zero covariance with real tokens
    assert post.mean[1][..., mask[1]].abs().max() == 0
    torch.testing.assert_close(post.variance[1][..., mask[1]], torch.ones(H, DH, 3, dtype=torch.float64))


# ------------------------------------------------------------------ scale
def test_float32_forward_backward_at_T1024():
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 16, 2)
    x = torch.randn(1, 1024, 16, requires_grad=True)
    mask = torch.zeros(1, 1024, dtype=torch.bool)
    mask[0, -100:] = True
    y = layer(x, mask)
    kl = layer.loss_terms()["kl_seq"]
    assert torch.isfinite(y).all() and torch.isfinite(kl)
    (y.square().mean() + kl).backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.fixture
def no_iterative_solvers(monkeypatch):
    """CG/Lanczos calls recorded by spies (see _sgpa_helpers.spy_iterative_solvers)."""
    return spy_iterative_solvers(monkeypatch)


def test_exact_algebra_above_800_tokens(no_iterative_solvers):
    """T = 900 > gpytorch's 800-point CG/Lanczos switch: no iterative solver runs (spied), and the
    marginal variances and KL match a float64 dense reference to 1e-6."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 4, 1).double()  # default relative jitter 1e-6
    x = torch.randn(1, 900, 4, dtype=torch.float64)
    with gpytorch.settings.max_cholesky_size(800), linear_operator.settings.max_cholesky_size(800):
        post = layer.posterior(x)
        var = post.variance
        layer(x)
        kl = layer.loss_terms()["kl_seq"]
    assert no_iterative_solvers == []
    ell, s2 = layer.kernel.lengthscale.detach(), layer.kernel.outputscale.detach()
    W, b = layer.in_proj.weight.detach(), layer.in_proj.bias.detach()
    qk, v = x @ W[:4].T + b[:4], x @ W[4:].T + b[4:]  # shape: (1, T, 4)
    K = s2 * torch.exp((qk / ell[0]) @ (qk / ell[0]).mT)[0]  # shape: (T, T)
    Kj = K + 1e-6 * K.diagonal().mean() * torch.eye(900, dtype=torch.float64)
    L = torch.linalg.cholesky(Kj)
    s = amortised_std(layer, qk[:, None])[0, 0]  # shape: (T, Dv)
    var_ref = (L.square() @ s.square()).T
    kl_ref = 0.5 * ((s.square() - 1 - s.square().log()).sum() + (v[0] * (Kj @ v[0])).sum())
    torch.testing.assert_close(var[0, 0], var_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ contract with options, errors
@pytest.mark.parametrize("check", sorted(ATTENTION_INVARIANTS))
def test_invariants_diag_mode(check):
    run_attention_invariant(check, "sgpa", covariance="diag")


def test_option_errors():
    with pytest.raises(ValueError, match="covariance"):
        gpattn.build_attention("sgpa", D, H, covariance="low-rank")
    with pytest.raises(ValueError, match="jitter"):
        gpattn.build_attention("sgpa", D, H, jitter=-1.0)
    layer = gpattn.build_attention("sgpa", D, H)
    qk = torch.randn(2, H, 6, DH)
    with pytest.raises(ValueError, match="keys and values"):
        layer.strategy.condition(qk, torch.randn(2, H, 5, DH))
    with pytest.raises(ValueError, match="mask"):
        layer.strategy.condition(qk, qk, torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_samples"):
        layer.strategy.condition(qk, qk).rsample(num_samples=0)
