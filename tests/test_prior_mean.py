"""The attention prior mean of the SGPA variants (docs/derivations.md §5c): the default forms against dense
float64 references (gpattn.testing.references, written from the formulas), through the shipped
GPAttentionTestCase mixin, plus masks, the KL, the softmax limit and the defaults. The papers' forms
(``prior_mean="zero"``) keep their own tests in test_sgpa.py / test_sgpa_decoupled.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from gpytorch.kernels import RBFKernel, ScaleKernel

import gpattn
from gpattn.kernels import ExponentialKernel
from gpattn.testing import GPAttentionTestCase, layer_loss_terms
from gpattn.testing.references import (
    sgpa_attention_dense_posterior,
    sgpa_attention_masked_dense_moments,
    sgpa_decoupled_attention_dense_posterior,
    sgpa_decoupled_global_keys,
    sgpa_heads,
    sgpa_masked_dense_moments,
)
from gpattn.variational.means import AmortisedValueMean, AttentionMean, CentredVariationalMean, ZeroMean

F64 = torch.float64
D, H = 8, 2
DH = D // H


def perturb(layer):
    """Random amortisation weights (standard SGPA), global variational parameters (decoupled) and kernel
    hyper-parameters, in place."""
    q_u = layer.strategy.variational_distribution
    if hasattr(q_u, "weight"):
        q_u.weight.normal_(0, 0.4)
        q_u.bias.normal_(0, 0.5)
    else:
        q_u.inducing_values.normal_(0, 0.5)
        q_u.chol_variational_covar.copy_(torch.eye(q_u.chol_variational_covar.shape[-1]) * 0.7)
    kernel = layer.kernel
    if isinstance(kernel, ExponentialKernel):
        kernel.lengthscale = 1.5 + torch.rand(H, 1, DH, dtype=F64)
        kernel.outputscale = 0.5 + torch.rand(H, dtype=F64)
    else:
        kernel.base_kernel.lengthscale = 0.8 + torch.rand(H, 1, DH, dtype=F64)
        kernel.outputscale = 0.5 + torch.rand(H, dtype=F64)


class TestSGPAAttentionMean(GPAttentionTestCase):
    """sgpa at its defaults: the attention prior mean with the ARD-RBF kernel."""

    attention = "sgpa"
    invariants = ()  # at the default options: tests/test_attention_invariants.py
    float64_options = {"jitter": 0.0}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-10, "atol": 1e-10}

    def perturb(self, layer):
        perturb(layer)

    def dense_reference(self, layer, x, mask):
        return sgpa_attention_dense_posterior(layer, x, mask)


class TestSGPAAttentionMeanDiag(TestSGPAAttentionMean):
    options = {"covariance": "diag"}
    independent_tokens = True
    exact_options = long_padding = None  # the full mode's


class TestSGPAAttentionMeanExponential(TestSGPAAttentionMean):
    """The attention prior mean with Chen & Li's exponential kernel."""

    options = {"kernel": "exponential"}
    exact_options = long_padding = None


class TestDecoupledAttentionMean(GPAttentionTestCase):
    attention = "sgpa-decoupled"
    invariants = ()
    options = {"covariance": "full"}
    float64_options = {"jitter": 0.0, "num_global": 3}
    reference_padding = {1: (0, 4)}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-9, "atol": 1e-10}
    exact_options = {"num_global": 8, "covariance": "full"}

    def perturb(self, layer):
        perturb(layer)

    def dense_reference(self, layer, x, mask):
        return sgpa_decoupled_attention_dense_posterior(layer, x, mask)


class TestDecoupledAttentionMeanDiag(TestDecoupledAttentionMean):
    options = {"covariance": "diag"}
    independent_tokens = True
    exact_options = long_padding = None

    def dense_reference(self, layer, x, mask):
        ref = super().dense_reference(layer, x, mask)
        return ref._replace(covariance=torch.diag_embed(ref.covariance.diagonal(dim1=-2, dim2=-1)))


def _layer(name, seed=0, **options):
    torch.manual_seed(seed)
    layer = gpattn.build_attention(name, D, H, **{"jitter": 0.0, **options}).double()
    with torch.no_grad():
        perturb(layer)
    return layer


def _x(B=2, T=6, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _masks(B, T):
    causal = torch.ones(T, T, dtype=torch.bool).triu(1).expand(B, H, T, T)
    g = torch.Generator().manual_seed(5)
    general = torch.rand(B, H, T, T, generator=g) < 0.4
    general[0, 0, 2] = True  # a query with no allowed key
    return {"causal": causal, "general": general}


@pytest.mark.parametrize("which", ["causal", "general"])
def test_sgpa_attention_mean_per_query_masks(which):
    """Under a per-query mask query i's mean is the attention mean over A_i and KL_i keeps only the
    covariance part; the variance is §11a's (the zero-mean form's), since the mean does not enter it."""
    layer = _layer("sgpa", kernel="exponential")
    x = _x()
    excluded = _masks(*x.shape[:2])[which]
    ref = sgpa_attention_masked_dense_moments(layer, x, excluded)
    with torch.no_grad():
        cond = layer._condition(x, excluded)
        torch.testing.assert_close(cond.mean, ref["mean"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(cond.query_kl_divergence(), ref["query_kl"], rtol=1e-10, atol=1e-12)
        layer(x, attn_mask=excluded)
    torch.testing.assert_close(layer_loss_terms(layer)["kl_seq"], ref["kl_seq"], rtol=1e-10, atol=1e-12)
    variance = sgpa_masked_dense_moments(layer, x, excluded)["variance"]
    torch.testing.assert_close(cond.variance(), variance, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", ["causal", "general"])
def test_decoupled_attention_mean_per_query_masks(which):
    """Decoupled with the attention mean under a per-query mask: mean_i = m over A_i + K_ig v_g, no
    per-sequence term, the unmasked covariance."""
    layer = _layer("sgpa-decoupled", num_global=3, covariance="full")
    x = _x()
    excluded = _masks(*x.shape[:2])[which]
    qk, v = sgpa_heads(layer, x)
    from gpattn.testing.references import attention_mean_dense, gram_dense

    K = gram_dense(layer.kernel, qk, qk)
    Kqg = gram_dense(layer.kernel, qk, sgpa_decoupled_global_keys(layer))
    mean = attention_mean_dense(K, v, excluded) + Kqg @ layer.strategy.variational_distribution.inducing_values
    with torch.no_grad():
        cond = layer._condition(x, excluded)
        torch.testing.assert_close(cond.mean, mean, rtol=1e-10, atol=1e-12)
        full = layer.posterior(x).covariance_matrix
        torch.testing.assert_close(cond.posterior().covariance_matrix, full, rtol=1e-10, atol=1e-12)
        layer(x, attn_mask=excluded)
    assert set(layer_loss_terms(layer)) == {"kl_global"}


def test_kl_is_torch_distributions_kl():
    """KL(q(ũ) ‖ p(ũ)) with q(ũ) = N(0, diag s²), p = N(0, I), against torch.distributions, per (b, h, d)."""
    layer = _layer("sgpa")
    x = _x()
    with torch.no_grad():
        cond = layer._condition(x, None)
        q = cond.variational_distribution
        assert q.mean.abs().max() == 0
        s = cond.std.transpose(-1, -2)  # shape: (B, H, Dv, T)
        ref = torch.distributions.kl_divergence(
            torch.distributions.Normal(torch.zeros_like(s), s), torch.distributions.Normal(0.0, torch.ones_like(s))
        ).sum(-1)
        torch.testing.assert_close(cond.kl_divergence(), ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            cond.kl_divergence(), torch.distributions.kl_divergence(q, cond.prior_distribution), rtol=1e-10, atol=1e-12
        )


def test_exponential_attention_mean_is_softmax_attention():
    """The limit that motivates the Choice: with the exponential kernel the attention mean is softmax
    attention with temperature 1/ℓ², whatever the outputscale (the variance does not enter the mean)."""
    layer = _layer("sgpa-decoupled", kernel="exponential", num_global=2)
    with torch.no_grad():
        layer.strategy.variational_distribution.inducing_values.zero_()  # no global part
        layer.kernel.outputscale = torch.full((H,), 123.0, dtype=F64)
        x = _x(T=7)
        mask = torch.zeros(2, 7, dtype=torch.bool)
        mask[1, 5:] = True
        qk, v = sgpa_heads(layer, x)
        q = qk / layer.kernel.lengthscale
        ref = F.scaled_dot_product_attention(q, q, v, attn_mask=~mask[:, None, None, :], scale=1.0)
        torch.testing.assert_close(layer._condition(x, mask).mean, ref, rtol=1e-10, atol=1e-12)


def test_defaults_and_options():
    """The default kernel follows the prior mean (its ``default_kernel``), with ℓ = Dh^¼ for the attention mean
    (softmax's temperature) and ℓ = √Dh for the paper's form; a bad prior_mean names the choices."""
    layer = gpattn.build_attention("sgpa", 16, 2)
    assert isinstance(layer.strategy.mean_module, AttentionMean)
    assert isinstance(layer.strategy.variational_mean, CentredVariationalMean)  # q(ũ) centred at the prior mean
    assert isinstance(layer.kernel, ScaleKernel) and isinstance(layer.kernel.base_kernel, RBFKernel)
    torch.testing.assert_close(layer.kernel.base_kernel.lengthscale, torch.full((2, 1, 8), 8**0.25))
    paper = gpattn.build_attention("sgpa-decoupled", 16, 2, prior_mean="zero")
    assert isinstance(paper.strategy.mean_module, ZeroMean) and isinstance(paper.kernel, ExponentialKernel)
    assert isinstance(paper.strategy.variational_mean, AmortisedValueMean)  # the paper's q(ũ) = N(Lᵀv, ·)
    torch.testing.assert_close(paper.kernel.lengthscale, torch.full((2, 1, 8), math.sqrt(8)))
    for name in ("sgpa", "sgpa-decoupled"):
        with pytest.raises(ValueError, match="prior_mean must be one of"):
            gpattn.build_attention(name, 16, 2, prior_mean="soft-max")


def test_negative_kernel_is_refused_under_validation():
    mean = AttentionMean()
    gram = torch.tensor([[[[1.0, -0.5], [-0.5, 1.0]]]])
    with gpattn.validation(), pytest.raises(ValueError, match="prior_mean='zero'"):
        mean(None, None, torch.ones(1, 1, 2, 1), gram=gram)


def test_no_kl_on_the_mean():
    """The point of §5c: the per-sequence term does not grow with the attention output. Scaling the values
    (the mean) by 10 changes the paper's kl_seq and leaves the attention-mean form's unchanged."""
    x = _x()
    for prior_mean, changes in (("zero", True), ("attention", False)):
        layer = _layer("sgpa", prior_mean=prior_mean, kernel="exponential")
        terms = []
        for scale in (1.0, 10.0):
            with torch.no_grad():
                layer.in_proj.weight[D:] *= scale
                layer(x)
            terms.append(layer_loss_terms(layer)["kl_seq"])
        assert (not torch.allclose(*terms)) == changes
