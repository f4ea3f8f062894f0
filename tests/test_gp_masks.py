"""``sgpa`` under a per-query ``attn_mask`` (docs/derivations.md §11): query i is its own sparse GP whose
inducing inputs are the keys it may attend to. Dense float64 references loop over the queries
(:func:`gpattn.testing.references.sgpa_masked_dense_moments`)."""

from __future__ import annotations

import pytest
import torch
from _mask_helpers import F64, D, H, T, assert_decoder_does_not_see_the_future
from _mask_helpers import cases as _cases
from _mask_helpers import causal as _causal
from _mask_helpers import joined as _joined
from gpytorch.distributions import MultivariateNormal

import gpattn
from gpattn.testing import make_inputs
from gpattn.testing.references import sgpa_masked_dense_moments
from gpattn.variational.sgpa import MaskedSGPAConditional, SGPAConditional

COVARIANCES = ("full", "diag")


def _layer(covariance="full", jitter=1e-3, dtype=F64, **options):
    torch.manual_seed(0)
    options = {"prior_mean": "zero", **options}  # the paper's form (§11a); the attention mean: test_prior_mean.py
    layer = gpattn.build_attention("sgpa", D, H, covariance=covariance, jitter=jitter, **options).to(dtype)
    with torch.no_grad():  # amortised scales away from 1, so that the KL's trace terms are not 0
        layer.strategy.variational_distribution.weight.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("covariance", COVARIANCES)
@pytest.mark.parametrize("case", sorted(_cases()))
def test_matches_dense_per_query_reference(case, covariance):
    """Mean, marginal variance, per-query KL, ``kl_seq`` and the deterministic output against the
    brute-force reference (jitter 1e-3: each key's own relative jitter, in every query's K_SS)."""
    x, pad, attn_mask = _cases()[case]
    layer = _layer(covariance)
    ref = sgpa_masked_dense_moments(layer, x, _joined(attn_mask, pad))
    cond = layer._condition(x, _joined(attn_mask, pad))
    assert isinstance(cond, MaskedSGPAConditional)
    real = ~_joined(attn_mask, pad).all(-1)
    if pad is not None:
        real &= ~pad[:, None, :]
    real = real[..., None]  # outputs at padded or keyless queries are placeholders
    for got, want in ((cond.mean, ref["mean"]), (cond.variance(), ref["variance"])):
        torch.testing.assert_close(got * real, want * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cond.query_kl_divergence() * real, ref["query_kl"] * real, rtol=1e-10, atol=1e-12)
    with gpattn.deterministic():
        y = layer(x, pad, attn_mask=attn_mask)
    torch.testing.assert_close(layer.loss_terms()["kl_seq"], ref["kl_seq"], rtol=1e-10, atol=1e-12)
    heads = (ref["mean"] * real).transpose(1, 2).reshape(2, T, -1)
    tokens = real.any(1)  # shape: (B, T, 1): a query that is real in some head
    torch.testing.assert_close(y * tokens, layer.out_proj(heads) * tokens, rtol=1e-10, atol=1e-12)
    post = layer.posterior(x, pad, attn_mask=attn_mask)  # per-query marginals: diagonal for both settings
    assert isinstance(post, MultivariateNormal)
    torch.testing.assert_close(post.covariance_matrix, torch.diag_embed(post.variance), rtol=0, atol=0)
    torch.testing.assert_close(post.variance.mT * real, ref["variance"] * real, rtol=1e-10, atol=1e-12)


def test_causal_fast_path_is_the_general_path():
    """The causal mask's prefix sums agree with one factorisation per query (the general path, forced)."""
    x, pad = make_inputs(B=2, T=T, D=D, pad=(0, 2), dtype=F64)
    layer = _layer()
    keys, values = layer.strategy_inputs(x)
    excluded = _joined(_causal(), pad)
    fast = layer.strategy.condition(keys, values, excluded)
    general = layer.strategy._condition_general(keys, values, excluded, pad)
    real = ~pad[:, None, :, None]
    for a, b in ((fast.mean, general.mean), (fast.variance(), general.variance())):
        torch.testing.assert_close(a * real, b * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast.kl_divergence(), general.kl_divergence(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("covariance", COVARIANCES)
def test_causal_is_the_unmasked_prefix(covariance):
    """With jitter 0 (the only difference being the sequence's jitter against the prefix's), query t's
    posterior marginal and KL are those of the unmasked layer on the prefix 1..t."""
    x, _ = make_inputs(B=2, T=T, D=D, dtype=F64)
    layer = _layer(covariance, jitter=0.0)
    post = layer.posterior(x, attn_mask=_causal())
    cond = layer._condition(x, _causal()[None, None])
    for t in range(T):
        prefix = layer._condition(x[:, : t + 1], None)
        torch.testing.assert_close(post.mean[..., t], prefix.mean[:, :, t], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(post.variance[..., t], prefix.variance()[:, :, t], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(cond.query_kl_divergence()[:, :, t], prefix.kl_divergence(), rtol=1e-10, atol=1e-12)


def test_same_set_for_every_query_is_the_unmasked_kl():
    """The normalisation (the mean of the queries' KLs): a per-query mask whose rows are all the same set,
    run through the general per-query path, gives the one-GP KL and posterior of key padding (jitter 0:
    the per-query path's jitter is per key, the unmasked one's relative to the mean diagonal)."""
    x, pad = make_inputs(B=2, T=T, D=D, pad=(0, 2), dtype=F64)
    layer = _layer(jitter=0.0)
    keys, values = layer.strategy_inputs(x)
    one = layer.strategy.condition(keys, values, pad)
    assert isinstance(one, SGPAConditional)
    per_query = layer.strategy._condition_general(keys, values, _joined(torch.zeros(T, T, dtype=torch.bool), pad), pad)
    torch.testing.assert_close(per_query.kl_divergence(), one.kl_divergence(), rtol=1e-10, atol=1e-12)
    real = ~pad[:, None, :, None]
    torch.testing.assert_close(per_query.mean * real, one.mean * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(per_query.variance() * real, one.variance() * real, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("covariance", COVARIANCES)
def test_padding_attn_mask_is_key_padding_when_sampling(covariance):
    """A mask that pads is key padding, exactly: the same draws (joint for ``full``) and the same KL."""
    x, pad = make_inputs(B=3, T=T, D=D, pad=(0, 2, T))
    layer = _layer(covariance, dtype=torch.float32)
    torch.manual_seed(5)
    ref = layer(x, pad, num_samples=3)
    ref_terms = layer.loss_terms()
    torch.manual_seed(5)
    y = layer(x, attn_mask=pad[:, None, None, :].expand(3, H, T, T), num_samples=3)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    torch.testing.assert_close(layer.loss_terms(), ref_terms, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["causal+padding", "general"])
def test_draws_are_per_query_marginals(case):
    """``rsample`` draws each query from its own marginal, independently across tokens (full covariance
    too): mean + sqrt(variance) ⊙ ε with the generator's ε, and the layer's P draws are those."""
    x, pad, attn_mask = _cases()[case]
    layer = _layer("full")
    cond = layer._condition(x, _joined(attn_mask, pad))
    g = torch.Generator().manual_seed(7)
    draws = cond.rsample(4, generator=g)
    eps = torch.randn(2, 4, H, T, layer.value_dim, generator=torch.Generator().manual_seed(7), dtype=F64)
    torch.testing.assert_close(draws, cond.mean + cond.variance().sqrt() * eps.transpose(0, 1))
    torch.manual_seed(8)
    y = layer(x, pad, num_samples=4, attn_mask=attn_mask)
    torch.manual_seed(8)
    eps = torch.randn(2, 4, H, T, layer.value_dim, dtype=F64)
    heads = (cond.mean[:, None] + cond.variance().sqrt()[:, None] * eps).reshape(8, H, T, -1)
    keep = (~_joined(attn_mask, pad).all(-1)).repeat_interleave(4, 0)[..., None]
    want = layer.out_proj((heads * keep).transpose(1, 2).reshape(8, T, -1)).masked_fill(~keep.any(1), 0)
    assert y.shape == (4, 2, T, D)  # (P, B, T, D)
    torch.testing.assert_close(y.transpose(0, 1).reshape(8, T, -1), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("covariance", COVARIANCES)
@pytest.mark.parametrize("sampling", [False, True])
def test_decoder_layer_does_not_see_the_future(covariance, sampling):
    """``sgpa`` as a decoder's ``self_attn`` under the causal mask: nothing at t depends on the tokens after t."""
    assert_decoder_does_not_see_the_future(_layer(covariance), sampling)


@pytest.mark.parametrize("case", ["causal+padding", "general"])
def test_gradcheck(case):
    """Gradients of the masked mean, variance and KL with respect to the inputs (float64 gradcheck; jitter
    0, since the jitter is detached from the graph by design)."""
    layer = _layer("diag", jitter=0.0)
    x, pad, attn_mask = _cases()[case]
    excluded = _joined(attn_mask, pad)

    def fn(keys, values):
        cond = layer.strategy.condition(keys, values, excluded)
        real = cond.real[..., None]
        return cond.mean * real, cond.variance() * real, cond.kl_divergence()

    keys, values = (t.detach().requires_grad_() for t in layer.strategy_inputs(x))
    assert torch.autograd.gradcheck(fn, (keys, values))


def test_layer_backpropagates_under_a_causal_mask():
    x, pad = make_inputs(B=2, T=T, D=D)
    layer = _layer(dtype=torch.float32).train()
    y = layer(x, pad, attn_mask=_causal())
    (y.square().sum() + layer.loss_terms()["kl_seq"]).backward()
    for p in (layer.in_proj.weight, layer.strategy.variational_distribution.weight, layer.out_proj.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_one_q_per_query_and_mask_errors():
    x, _ = make_inputs(B=2, T=T, D=D, dtype=F64)
    layer = _layer()
    cond = layer._condition(x, _causal()[None, None])
    with pytest.raises(NotImplementedError, match="every query has its own q"):
        _ = cond.variational_distribution
    keys, values = layer.strategy_inputs(x)
    with pytest.raises(ValueError, match=r"per-query mask must be a bool tensor of shape \(B or 1, H or 1, T, T\)"):
        layer.strategy.condition(keys, values, torch.zeros(2, 3, T, T, dtype=torch.bool))
