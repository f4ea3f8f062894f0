"""SGPA and decoupled SGPA with separate query and key maps (the encoder-swap recipe's form, docs/derivations.md §5d).

The GP is evaluated at the queries W_q x and its inducing inputs are the keys W_k x of the same tokens: the
cross-attention conditional (§13) with x on both sides. The dense float64 references are the cross-attention
references of gpattn.testing (written independently of gpattn.variational), tied to this form by a shared-map
twin: a layer with the shared map W_qk = W_k attending from x' = (W_q x + b_q − b_k) W_k⁻ᵀ (so that its queries
are W_q x + b_q) to the context x. The shipped mixins (gpattn.testing.GPAttentionTestCase: the invariants, padding
= truncation, moments, E[layer], T > 800, float32 at T = 1024) run on the form in each mode."""

import pytest
import torch
from test_sgpa import perturb as perturb_sgpa

import gpattn
from gpattn.testing import GPAttentionTestCase, layer_loss_terms
from gpattn.testing.references import sgpa_cross_dense_posterior, sgpa_decoupled_cross_dense_posterior

F64 = torch.float64


def shared_twin(layer):
    """The shared-map layer with W_qk = the separate layer's W_k and every other parameter the same."""
    options = {"jitter": layer.strategy.jitter, "covariance": layer.strategy.covariance,
               "prior_mean": layer.strategy.mean_module, "kernel": layer.kernel}
    if layer.name == "sgpa-decoupled":
        options["num_global"] = layer.strategy.variational_distribution.num_global
    twin = gpattn.build_attention(layer.name, layer.embed_dim, layer.num_heads, **options).to(F64)
    D = layer.embed_dim
    state = {k: (v[D:] if k.startswith("in_proj.") else v) for k, v in layer.state_dict().items()}
    twin.load_state_dict(state)
    return twin


def twin_queries(layer, x):
    """x' with W_k x' + b_k = W_q x + b_q (W_k is square and, drawn at random, invertible).
    # shape: x (B, T, D) -> (B, T, D)"""
    D = layer.embed_dim
    W, b = layer.in_proj.weight.detach(), layer.in_proj.bias.detach()
    q = x @ W[:D].T + b[:D]
    return torch.linalg.solve(W[D : 2 * D], (q - b[D : 2 * D]).mT).mT


def separate_dense_reference(layer, x, mask, reference):
    """The cross reference of the twin, queries W_q x, keys and values of x (no padding: the mixin's padding
    test compares the truncated sequence)."""
    assert mask is None
    ref = reference(shared_twin(layer), twin_queries(layer, x), x)
    if layer.strategy.covariance.name == "diag":  # independent tokens: the reference's marginals
        ref = ref._replace(covariance=torch.diag_embed(ref.covariance.diagonal(dim1=-2, dim2=-1)))
    return ref


def perturb(layer):
    """Random amortisation / global parameters and W_q far from W_k (in place, no grad)."""
    if layer.name == "sgpa":
        perturb_sgpa(layer)
    else:
        q_u = layer.strategy.variational_distribution
        q_u.variational_mean.normal_(0, 0.5)
        q_u.chol_variational_covar.copy_(torch.eye(q_u.num_global) + 0.2 * torch.randn_like(q_u.chol_variational_covar))
    layer.in_proj.weight[: layer.embed_dim].normal_(0, 0.5)


class TestSGPASeparate(GPAttentionTestCase):
    """sgpa with separate maps, the paper's zero prior mean, full covariance."""

    attention = "sgpa"
    options = {"recipe": "encoder-swap", "prior_mean": "zero"}
    float64_options = {"jitter": 0.0}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-9, "atol": 1e-10}
    reference = staticmethod(sgpa_cross_dense_posterior)

    def perturb(self, layer):
        perturb(layer)

    def dense_reference(self, layer, x, mask):
        return separate_dense_reference(layer, x, mask, self.reference)


class TestSGPASeparateAttentionMean(TestSGPASeparate):
    """The library's default prior mean (§5c) with separate maps."""

    options = {"recipe": "encoder-swap", "prior_mean": "attention"}


class TestSGPASeparateDiag(TestSGPASeparate):
    options = {"recipe": "encoder-swap", "prior_mean": "attention", "covariance": "diag"}
    independent_tokens = True
    exact_options = long_padding = None  # the full mode's
    invariants = ("shape", "padding", "gradients", "posterior", "cross_attention")


class TestDecoupledSeparate(TestSGPASeparate):
    """sgpa-decoupled with separate maps, the paper's zero prior mean, full covariance (global keys through W_k)."""

    attention = "sgpa-decoupled"
    options = {"recipe": "encoder-swap", "prior_mean": "zero", "covariance": "full", "num_global": 3}
    reference = staticmethod(sgpa_decoupled_cross_dense_posterior)


class TestDecoupledSeparateAttentionMean(TestDecoupledSeparate):
    """The default: attention prior mean, diagonal covariance."""

    options = {"recipe": "encoder-swap", "prior_mean": "attention", "num_global": 3}
    independent_tokens = True
    exact_options = long_padding = None
    invariants = ("shape", "padding", "gradients", "posterior", "cross_attention")


# ------------------------------------------------------------------ the shared form as a limiting case
def _tie(layer):
    """W_q = W_k in place: the separate layer then is the shared form."""
    D = layer.embed_dim
    with torch.no_grad():
        layer.in_proj.weight[:D] = layer.in_proj.weight[D : 2 * D]
        layer.in_proj.bias[:D] = layer.in_proj.bias[D : 2 * D]


CASES = [
    ("sgpa", {"prior_mean": "zero"}), ("sgpa", {"prior_mean": "attention"}),
    ("sgpa", {"prior_mean": "attention", "covariance": "diag"}), ("sgpa", {}),  # {}: the recipe's softmax mean
    ("sgpa-decoupled", {"prior_mean": "zero", "covariance": "full", "num_global": 3}),
    ("sgpa-decoupled", {"prior_mean": "attention", "num_global": 3}),
]


@pytest.mark.parametrize("name,options", CASES)
def test_tied_maps_reproduce_the_shared_form(name, options):
    """W_q = W_k: mean and loss terms of the shared form; the covariance too, since the residual
    K_qq − K_qk K_kk⁻¹ K_kq is 0 (float64, jitter 0; with the default jitter it is O(jitter))."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 8, 2, recipe="encoder-swap", jitter=0.0, **options).to(F64)
    with torch.no_grad():
        perturb(layer)
    _tie(layer)
    twin = shared_twin(layer)
    x = torch.randn(2, 6, 8, dtype=F64)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 4:] = True
    with torch.no_grad():
        a, b = layer.posterior(x, mask), twin.posterior(x, mask)
        keep = ~mask[:, None, None, :]  # padded positions are placeholders (the shared form's 0, here a query)
        torch.testing.assert_close(a.mean * keep, b.mean * keep, rtol=1e-12, atol=1e-13)
        real = ~mask[:, None, None, :, None] & ~mask[:, None, None, None, :]
        torch.testing.assert_close(a.covariance_matrix * real, b.covariance_matrix * real, rtol=1e-9, atol=1e-11)
        layer(x, mask), twin(x, mask)
    for key, value in layer_loss_terms(twin).items():
        torch.testing.assert_close(layer_loss_terms(layer)[key], value, rtol=1e-12, atol=1e-14)


def test_untied_maps_differ_from_the_shared_form():
    """With W_q ≠ W_k the covariance gains the residual K_qq − A Aᵀ ≥ 0 (a non-trivial limiting case above)."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 8, 2, recipe="encoder-swap", jitter=0.0).to(F64)
    with torch.no_grad():
        perturb(layer)
    x = torch.randn(2, 6, 8, dtype=F64)
    with torch.no_grad():
        cond = layer._condition(x, None)
        residual = cond.residual().diagonal(dim1=-2, dim2=-1)
        _tie(layer)
        tied = layer._condition(x, None).residual().diagonal(dim1=-2, dim2=-1)
    assert residual.min() >= -1e-12 and residual.max() > 1e-3
    assert tied.abs().max() < 1e-10


def test_both_maps_learn():
    """W_q's rows and W_k's rows of in_proj both receive gradient (the mean through K_qk, the KL through the keys)."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 8, 2, recipe="encoder-swap")
    assert layer.projections == ("q", "k", "v")
    x = torch.randn(2, 6, 8)
    y = layer(x)
    (y.square().sum() + sum(layer_loss_terms(layer).values())).backward()
    g = layer.in_proj.weight.grad
    assert g[:8].abs().max() > 0 and g[8:16].abs().max() > 0
    assert layer.in_proj.weight.shape == (24, 8)


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled"])
def test_per_query_masks_are_refused_and_padding_masks_taken(name):
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 8, 2, recipe="encoder-swap")
    x = torch.randn(2, 5, 8)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for call in (lambda: layer(x, attn_mask=causal), lambda: layer.posterior(x, attn_mask=causal)):
        with pytest.raises(ValueError, match="with separate query and key maps .* takes only masks that pad"):
            call()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    with torch.no_grad(), gpattn.deterministic():
        by_mask = layer(x, attn_mask=pad[:, None, None, :].expand(2, 1, 5, 5))
        torch.testing.assert_close(by_mask, layer(x, pad))


def test_qk_is_no_option_and_its_error_names_the_recipe():
    """The maps are a form, not an option: ``qk`` is refused, naming the recipe that owns the separate maps;
    the layers' own form is the paper's shared map."""
    for value in ("separate", "shared"):
        with pytest.raises(ValueError, match=r"unknown option\(s\) \['qk'\].*recipe='encoder-swap'"):
            gpattn.build_attention("sgpa", 8, 2, qk=value)
    assert gpattn.build_attention("sgpa-decoupled", 8, 2).projections == ("qk", "v")  # the paper's
