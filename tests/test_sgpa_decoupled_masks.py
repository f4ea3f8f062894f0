"""``sgpa-decoupled`` under a per-query ``attn_mask`` (docs/derivations.md §11b): query i's mean basis is the
keys it may attend to; the global basis, the covariance and the joint samples are the unmasked layer's.
The dense float64 reference loops over the queries with explicit solves
(:func:`gpattn.testing.references.sgpa_decoupled_masked_dense_moments`)."""

from __future__ import annotations

import pytest
import torch
from _mask_helpers import F64, D, H, T, assert_decoder_does_not_see_the_future
from _mask_helpers import cases as _cases
from _mask_helpers import causal as _causal
from _mask_helpers import joined as _joined
from _mask_helpers import real_queries as _real

import gpattn
from gpattn.testing import make_inputs
from gpattn.testing.references import sgpa_decoupled_masked_dense_moments
from gpattn.variational.sgpa_decoupled import DecoupledSGPAConditional, MaskedDecoupledSGPAConditional

M = 4
COVARIANCES = ("full", "diag")


def _layer(covariance="full", jitter=1e-3, dtype=F64):
    torch.manual_seed(0)
    layer = gpattn.build_attention(
        "sgpa-decoupled", D, H, covariance=covariance, jitter=jitter, num_global=M, prior_mean="zero"
    )
    with torch.no_grad():  # global coefficients and S̃ away from their initial values, so that β and A ũ count
        q_u = layer.strategy.variational_distribution
        q_u.variational_mean.normal_(0, 0.5)
        q_u.chol_variational_covar.copy_(0.5 * torch.eye(M) + 0.1 * torch.randn(H, layer.value_dim, M, M).tril())
    return layer.to(dtype)


@pytest.mark.parametrize("covariance", COVARIANCES)
@pytest.mark.parametrize("case", sorted(_cases()))
def test_matches_dense_per_query_reference(case, covariance):
    """Mean, per-query γ, ``kl_seq``, ``kl_global``, the deterministic output and the joint posterior (the
    unmasked covariance, not a diagonal) against the brute-force reference."""
    x, pad, attn_mask = _cases()[case]
    layer = _layer(covariance)
    excluded = _joined(attn_mask, pad)
    ref = sgpa_decoupled_masked_dense_moments(layer, x, excluded)
    cond = layer._condition(x, excluded)
    assert isinstance(cond, MaskedDecoupledSGPAConditional)
    real = _real(attn_mask, pad)[..., None]
    torch.testing.assert_close(cond.mean * real, ref["mean"] * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cond.query_kl_divergence() * real, ref["query_gamma"] * real, rtol=1e-10, atol=1e-12)
    unmasked = layer._condition(x, pad)
    with gpattn.deterministic():
        y = layer(x, pad, attn_mask=attn_mask)
        layer(x, pad)
        global_kl = layer.loss_terms()["kl_global"]
        layer(x, pad, attn_mask=attn_mask)
    terms = layer.loss_terms()
    torch.testing.assert_close(terms["kl_seq"], ref["kl_seq"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(terms["kl_global"], global_kl, rtol=0, atol=0)  # β is global: the mask leaves it
    heads = (ref["mean"] * real).transpose(1, 2).reshape(2, T, -1)
    tokens = real.any(1)
    torch.testing.assert_close(y * tokens, layer.out_proj(heads) * tokens, rtol=1e-10, atol=1e-12)
    post = layer.posterior(x, pad, attn_mask=attn_mask)
    want = ref["covariance"]
    if covariance == "diag":
        want = torch.diag_embed(want.diagonal(dim1=-2, dim2=-1))
    torch.testing.assert_close(post.covariance_matrix, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post.mean.mT * real, ref["mean"] * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cond.variance(), unmasked.variance(), rtol=0, atol=0)


def test_causal_fast_path_is_the_general_path():
    """The causal mask's prefix sums agree with the general per-query path (forced)."""
    x, pad = make_inputs(B=2, T=T, D=D, pad=(0, 2), dtype=F64)
    layer = _layer()
    excluded = _joined(_causal(), pad)
    fast = layer._condition(x, excluded)
    blocked = excluded.clone()
    blocked[..., 0, 0] |= True  # no longer causal: query 0 loses its own key, the general path
    general = layer._condition(x, blocked)
    real = ~pad[:, None, :, None]
    real[:, :, 0] = False
    torch.testing.assert_close(fast.mean * real, general.mean * real, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        fast.query_kl_divergence() * real, general.query_kl_divergence() * real, rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("covariance", COVARIANCES)
def test_causal_is_the_unmasked_prefix(covariance):
    """Query t's mean, marginal variance and γ are those of the unmasked layer on the prefix 1..t."""
    x, _ = make_inputs(B=2, T=T, D=D, dtype=F64)
    layer = _layer(covariance)
    cond = layer._condition(x, _causal()[None, None])
    for t in range(T):
        prefix = layer._condition(x[:, : t + 1], None)
        torch.testing.assert_close(cond.mean[:, :, t], prefix.mean[:, :, t], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(cond.variance()[:, :, t], prefix.variance()[:, :, t], rtol=1e-10, atol=1e-12)
        gamma, _ = prefix.kl_divergence_parts()
        torch.testing.assert_close(cond.query_kl_divergence()[:, :, t], gamma, rtol=1e-10, atol=1e-12)


def test_same_set_for_every_query_is_the_unmasked_conditional():
    """The normalisation (the mean of the queries' γ): a per-query mask whose rows all allow the real keys
    gives the unmasked conditional's mean and KL parts."""
    x, pad = make_inputs(B=2, T=T, D=D, pad=(0, 2), dtype=F64)
    layer = _layer()
    one = layer._condition(x, pad)
    assert type(one) is DecoupledSGPAConditional
    excluded = _joined(torch.zeros(T, T, dtype=torch.bool), pad).clone()
    excluded[0, :, 0, 0] = excluded[0, :, 0, 1] = True  # query 0 of sequence 0 is not real in the KL ...
    excluded[0, :, 0, 2:] = True  # ... (no key), so the general path runs and the others' sets agree
    per_query = layer._condition(x, excluded)
    for a, b in zip(per_query.kl_divergence_parts(), one.kl_divergence_parts()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    real = _real(excluded, pad)[..., None]
    torch.testing.assert_close(per_query.mean * real, one.mean * real, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("covariance", COVARIANCES)
def test_draws_are_the_unmasked_draws_shifted(covariance):
    """The mask moves the mean only: with the same random numbers (and jitter 0: the per-query residual's
    jitter is per token), masked draw − masked mean = unmasked draw − unmasked mean, jointly."""
    x, pad, attn_mask = _cases()["causal+left-padding"]
    layer = _layer(covariance, jitter=0.0)
    masked, plain = layer._condition(x, _joined(attn_mask, pad)), layer._condition(x, pad)
    a = masked.rsample(3, generator=torch.Generator().manual_seed(4)) - masked.mean
    b = plain.rsample(3, generator=torch.Generator().manual_seed(4)) - plain.mean
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert a.abs().sum() > 0


@pytest.mark.parametrize("covariance", COVARIANCES)
@pytest.mark.parametrize("sampling", [False, True])
def test_decoder_layer_does_not_see_the_future(covariance, sampling):
    """As a decoder's ``self_attn`` under the causal mask: nothing at t depends on the tokens after t, the
    joint ``"full"`` draws included (the residual's jitter is per token)."""
    assert_decoder_does_not_see_the_future(_layer(covariance), sampling)


@pytest.mark.parametrize("case", ["causal+padding", "general"])
def test_gradcheck(case):
    """Gradients of the masked mean and the per-sequence γ with respect to the inputs (float64 gradcheck)."""
    layer = _layer("diag")
    x, pad, attn_mask = _cases()[case]
    excluded = _joined(attn_mask, pad)
    global_keys = layer.global_keys().detach()

    def fn(queries, values):
        cond = layer.strategy.condition(queries, values, global_keys, excluded)
        return cond.mean * cond.real[..., None], cond.kl_divergence_parts()[0]

    inputs = tuple(t.detach().requires_grad_() for t in layer.strategy_inputs(x)[:2])
    assert torch.autograd.gradcheck(fn, inputs)


def test_layer_trains_under_a_causal_mask():
    x, pad = make_inputs(B=2, T=T, D=D)
    layer = _layer(dtype=torch.float32).train()
    y = layer(x, pad, attn_mask=_causal())
    terms = layer.loss_terms()
    (y.square().sum() + terms["kl_seq"] + terms["kl_global"]).backward()
    q_u = layer.strategy.variational_distribution
    for p in (layer.in_proj.weight, layer.strategy.inducing_inputs, q_u.variational_mean, layer.out_proj.weight):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
