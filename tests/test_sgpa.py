"""Standard SGPA (docs/derivations.md §5a): the posterior, KL and sampler against dense float64 references
(gpattn.testing.references, written independently of gpattn.variational.sgpa). The shapes every GP
variant shares (dense reference, padding = truncation, moments, E[layer], T > 800, float32 at T = 1024,
the invariants in diag mode) come from gpattn.testing.GPAttentionTestCase; this file keeps SGPA's own
equivalences."""

import gpytorch
import pytest
import torch

import gpattn
from gpattn.testing import GPAttentionTestCase, layer_loss_terms
from gpattn.testing.references import exponential_gram, sgpa_amortised_std, sgpa_dense_posterior, sgpa_heads

D, H = 8, 2
DH = D // H


def perturb(layer):
    """Random amortisation weights and kernel hyper-parameters (in place, no grad)."""
    q_u = layer.strategy.variational_distribution
    q_u.weight.normal_(0, 0.4)
    q_u.bias.normal_(0, 0.5)
    if isinstance(layer.kernel, gpattn.kernels.ExponentialKernel):
        layer.kernel.lengthscale = 1.5 + torch.rand(H, 1, DH, dtype=torch.float64)
        layer.kernel.outputscale = 0.5 + torch.rand(H, dtype=torch.float64)


class TestSGPA(GPAttentionTestCase):
    attention = "sgpa"
    invariants = ()  # at the default options: tests/test_attention_invariants.py
    options = {"prior_mean": "zero"}  # the paper's form (§5a); the attention prior mean: test_prior_mean.py
    float64_options = {"jitter": 0.0}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-10, "atol": 1e-10}

    def perturb(self, layer):
        perturb(layer)

    def dense_reference(self, layer, x, mask):
        return sgpa_dense_posterior(layer, x, mask)

    def check_truncation_extras(self, layer, x, mask, real):
        """KL and Cholesky rows of the real tokens equal the truncated run's; padded positions are
        placeholders N(0, 1) with zero covariance with real tokens."""
        cond, cond_t = layer._condition(x, mask), layer._condition(x[1:, real], None)
        torch.testing.assert_close(cond.kl_divergence()[1], cond_t.kl_divergence()[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(cond.chol[1][..., real, :][..., real], cond_t.chol[0], rtol=1e-10, atol=1e-10)
        assert cond.chol[1][..., real, :][..., mask[1]].abs().max() == 0  # padded columns out of real rows
        post = layer.posterior(x, mask)
        assert post.mean[1][..., mask[1]].abs().max() == 0
        n_pad = int(mask[1].sum())
        torch.testing.assert_close(post.variance[1][..., mask[1]], torch.ones(H, DH, n_pad, dtype=torch.float64))


class TestSGPADiag(TestSGPA):
    """covariance="diag": the reference is the diagonal of the full one (independent tokens); every
    invariant runs in this mode."""

    options = {"covariance": "diag", "prior_mean": "zero"}
    invariants = None
    covariance_tolerance = {"rtol": 1e-10, "atol": 1e-12}
    independent_tokens = True
    exact_options = long_padding = None  # the full mode's


CASE = TestSGPA()
make_layer, inputs = CASE.make_layer, CASE.make_inputs  # float64, jitter 0, perturbed; (B, T, D) float64


# ------------------------------------------------------------------ posterior
@pytest.mark.parametrize("seed", [0, 1])
def test_posterior_matches_dense_svgp_formula(seed):
    """mean = K_qk K_kk⁻¹ m, Σ = K_qq − K_qk K_kk⁻¹ K_kq + K_qk K_kk⁻¹ S K_kk⁻¹ K_kq with m = K v,
    S = L diag(s²) Lᵀ (the generic SVGP formula, docs/derivations.md §5a) to 1e-8 in float64."""
    layer, x = make_layer(seed), inputs(seed=seed)
    post = layer.posterior(x)
    qk, v = sgpa_heads(layer, x)
    K = exponential_gram(layer.kernel, qk, qk)
    L = torch.linalg.cholesky(K)
    s2 = sgpa_amortised_std(layer, qk).square()  # shape: (B, H, T, Dv)
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


def test_any_gpytorch_kernel():
    """`kernel=` accepts ARD-RBF by name and any gpytorch Kernel instance; mean = K v with that kernel."""
    x = inputs()
    for kernel in ("ard-rbf", gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=DH, batch_shape=torch.Size([H]))):
        layer = make_layer(kernel=kernel)
        qk, v = sgpa_heads(layer, x)
        if kernel == "ard-rbf":
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
    mean as kl_seq (docs/derivations.md §9)."""
    layer, x = make_layer(jitter=jitter), inputs()
    qk, v = sgpa_heads(layer, x)
    cond = layer.strategy.condition(qk, v)
    kl = cond.kl_divergence()  # shape: (B, H, Dv)
    K = exponential_gram(layer.kernel, qk, qk)[:, :, None]  # shape: (B, H, 1, T, T)
    K = K + jitter * K.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(6, dtype=torch.float64)
    L = torch.linalg.cholesky(K)
    s = sgpa_amortised_std(layer, qk).transpose(-1, -2)  # shape: (B, H, Dv, T)
    vd = v.transpose(-1, -2)[..., None]  # shape: (B, H, Dv, T, 1)
    q_w = torch.distributions.MultivariateNormal((L.mT @ vd)[..., 0], scale_tril=torch.diag_embed(s))
    p_w = torch.distributions.MultivariateNormal(torch.zeros_like(s), scale_tril=torch.diag_embed(torch.ones_like(s)))
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(q_w, p_w), rtol=1e-9, atol=1e-9)
    q_u = torch.distributions.MultivariateNormal((K @ vd)[..., 0], scale_tril=L * s[..., None, :])
    p_u = torch.distributions.MultivariateNormal(torch.zeros_like(s), scale_tril=L.expand_as(q_u.scale_tril))
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(q_u, p_u), rtol=1e-7, atol=1e-7)
    layer(x)
    terms = layer_loss_terms(layer)
    assert set(terms) == {"kl_seq"}
    torch.testing.assert_close(terms["kl_seq"], kl.sum((1, 2)).mean(0))


# ------------------------------------------------------------------ contract with options, errors
def test_option_errors():
    with pytest.raises(ValueError, match="covariance"):
        gpattn.build_attention("sgpa", D, H, covariance="low-rank")
    with pytest.raises(ValueError, match="jitter"):
        gpattn.build_attention("sgpa", D, H, jitter=-1.0)
    layer = gpattn.build_attention("sgpa", D, H, prior_mean="zero")
    qk = torch.randn(2, H, 6, DH)
    with pytest.raises(ValueError, match="keys and values"):
        layer.strategy.condition(qk, torch.randn(2, H, 5, DH))
    with pytest.raises(ValueError, match="mask"):
        layer.strategy.condition(qk, qk, torch.zeros(2, 5, dtype=torch.bool))
    # P is checked by the layer and the model (once each), not again by a conditional's rsample
