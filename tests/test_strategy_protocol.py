"""The GP variant protocol (gpattn.variational._strategy): every GP
variant is a GPAttention declaration over a gpytorch.Module strategy whose condition() returns an
AmortisedConditional; the layer's loss terms are the conditional's, reduced once (sequence_mean)."""

import gpytorch
import pytest
import torch
from gpytorch.distributions import MultivariateNormal

import gpattn
from gpattn.attention import GPAttention
from gpattn.testing import layer_loss_terms
from gpattn.variational._linalg import add_jitter
from gpattn.variational._strategy import AmortisedConditional, AmortisedVariationalStrategy, sequence_mean

F64 = torch.float64
B, T, D, H = 3, 5, 8, 2
#: every GP variant, with its test options
GP = {
    "sgpa": {},
    "sgpa-decoupled": {"num_global": 4},
    "kep-svgp": {"rank": 3},
    "cgp": {},
    "scgp": {},
    "sgpa-rff": {"num_features": 6},
}
#: strategy settings that make every loss term deterministic (CGP: the exact expectation instead of prior samples)
EXACT_TERMS = {"cgp": {"prior_samples": None}}
VARIATIONAL = ("sgpa", "sgpa-decoupled", "kep-svgp", "sgpa-rff")


def test_every_registered_gp_variant_is_listed_here():
    gp = {n for n in gpattn.list_attention() if gpattn.attention.attention_class(n).is_gp}
    assert gp == set(GP)


def make(name, seed=0):
    torch.manual_seed(seed)
    layer = gpattn.build_attention(name, D, H, **GP[name]).double()
    for setting, value in EXACT_TERMS.get(name, {}).items():
        setattr(layer.strategy, setting, value)
    x = torch.randn(B, T, D, dtype=F64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 3:] = True  # a padded sequence
    mask[2] = True  # an all-padding sequence: left out of every mean
    return layer, x, mask


@pytest.mark.parametrize("name", GP)
def test_strategy_and_conditional(name):
    layer, x, mask = make(name)
    assert isinstance(layer, GPAttention)
    assert isinstance(layer.strategy, AmortisedVariationalStrategy) and isinstance(layer.strategy, gpytorch.Module)
    effective = mask & ~mask.all(-1, keepdim=True)
    cond = layer._condition(x, effective)
    assert isinstance(cond, AmortisedConditional)
    Dv = layer.value_dim
    assert cond.mean.shape == (B, H, T, Dv)
    assert cond.rsample().shape == (B, H, T, Dv) and cond.rsample(4).shape == (4, B, H, T, Dv)
    post = cond.posterior()
    assert isinstance(post, MultivariateNormal) and post.batch_shape == (B, H, Dv) and post.event_shape == (T,)
    # calling the strategy is gpytorch's idiom: q(f) at the queries
    args, kwargs = layer.strategy_call(x)
    called = layer.strategy(*args, mask=effective, **kwargs)
    torch.testing.assert_close(called.mean, post.mean)
    torch.testing.assert_close(called.covariance_matrix, post.covariance_matrix)


@pytest.mark.parametrize("name", GP)
def test_layer_loss_terms_are_the_conditionals(name):
    """The layer registers exactly its conditional's terms, reduced with the caller's mask (the
    all-padding row left out)."""
    layer, x, mask = make(name)
    layer(x, mask)
    got = layer_loss_terms(layer)
    effective = mask & ~mask.all(-1, keepdim=True)  # what the variant sees: the all-padding row unpadded
    terms = layer._condition(x, effective).added_loss_terms(mask)
    want = {t.name: t.loss() for t in terms}
    assert set(got) == set(want) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-10, atol=1e-12)


def test_sequence_mean_sums_heads_and_columns_and_leaves_all_padding_rows_out():
    per = torch.arange(12, dtype=F64).view(3, 2, 2)  # (B, H, Dv)
    mask = torch.tensor([[False, True], [True, True], [False, False]])
    torch.testing.assert_close(sequence_mean(per, mask), (per[0].sum() + per[2].sum()) / 2)
    torch.testing.assert_close(sequence_mean(per), per.sum() / 3)
    torch.testing.assert_close(sequence_mean(per, torch.ones(3, 2, dtype=torch.bool)), torch.zeros((), dtype=F64))


@pytest.mark.parametrize("name", VARIATIONAL)
def test_kl_is_kl_of_variational_against_prior_distribution(name):
    """kl_divergence() (decoupled: its global β-part) is gpytorch's KL between the conditional's
    variational_distribution and prior_distribution, off the initialisation (Λ ≠ I for KEP-SVGP)."""
    layer, x, _ = make(name)
    with torch.no_grad():
        for p in layer.strategy.parameters():
            p.add_(0.2 * torch.randn_like(p))
    cond = layer._condition(x, None)
    kl = torch.distributions.kl_divergence(cond.variational_distribution, cond.prior_distribution)
    if name == "sgpa":
        want = cond.kl_divergence()  # shape: (B, H, Dv)
    elif name == "sgpa-decoupled":
        want = cond.kl_divergence_parts()[1]  # shape: (H, Dv)
    elif name == "sgpa-rff":
        want = cond.kl_divergence()  # shape: (H, Dv), global
    else:
        want, kl = cond.kl_divergence(), kl.sum()  # Σ_{h,c}
    torch.testing.assert_close(kl, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_exact_correlated_gp_has_no_q_u(name):
    layer, x, _ = make(name)
    cond = layer._condition(x, None)
    for member in ("prior_distribution", "variational_distribution"):
        with pytest.raises(NotImplementedError, match="defines no q\\(u\\)"):
            getattr(cond, member)
    with pytest.raises(NotImplementedError, match="added_loss_terms"):
        cond.kl_divergence()
    assert [t.name for t in cond.added_loss_terms()] == ["cgp"]


@pytest.mark.parametrize("name", ["sgpa-decoupled", "kep-svgp"])
def test_variational_parameters_are_the_q_u_parameters(name):
    """Natural-gradient users find the global q(u) through gpytorch's variational_parameters(); the
    kernel and the other parameters are hyperparameters. (Standard SGPA's q(ũ) is amortised: its
    parameters are the weights of a map from the keys, not the parameters of one Gaussian.)"""
    layer, _, _ = make(name)
    q_u = {id(p) for p in layer.strategy.variational_distribution.parameters()}
    assert {id(p) for p in layer.strategy.variational_parameters()} == q_u
    assert not q_u & {id(p) for _, p in layer.strategy.named_hyperparameters()}


@pytest.mark.parametrize("name", ["sgpa-decoupled", "kep-svgp"])
def test_q_u_is_gpytorchs_cholesky_variational_distribution(name):
    layer, _, _ = make(name)
    q_u = layer.strategy.variational_distribution
    assert isinstance(q_u, gpytorch.variational.CholeskyVariationalDistribution)
    assert isinstance(q_u(), MultivariateNormal)


def test_add_jitter_per_head_broadcasts_and_differentiates():
    """The one A + cI: a per-head c of shape (H,) against (B, H, n, n), a c whose batch is larger than
    A's, and the gradient reaching c (a learned σ²)."""
    A = torch.randn(2, 3, 4, 4, dtype=F64)
    c = torch.tensor([0.5, 1.0, 2.0], dtype=F64, requires_grad=True)
    out = add_jitter(A, c)
    torch.testing.assert_close(out, A + c[:, None, None] * torch.eye(4, dtype=F64))
    out.sum().backward()
    torch.testing.assert_close(c.grad, torch.full((3,), 2 * 4.0, dtype=F64))
    wide = add_jitter(A[0], torch.ones(2, 3, dtype=F64))  # A (3, n, n), c (2, 3) -> (2, 3, n, n)
    torch.testing.assert_close(wide, A[0] + torch.eye(4, dtype=F64).expand(2, 3, 4, 4))
