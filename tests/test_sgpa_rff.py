"""sgpa-rff (docs/derivations.md §5f): the attention prior mean plus a random-feature GP on the queries whose
covariance is conditioned on the training queries. Dense float64 references, the random-feature kernel, the
running second moment, the distance-aware variance, and the shipped GP mixin."""

import functools
import math

import pytest
import torch

import gpattn
from gpattn.testing import GPAttentionTestCase
from gpattn.testing.assertions import assert_samples_match_moments
from gpattn.testing.references import DenseReference, prior_mean_dense, sgpa_heads
from gpattn.variational._linalg import standard_normal
from gpattn.variational.covariances import TrainingQueryCovariance, TrainingSequenceCovariance

F64 = torch.float64


def _features_dense(cov, q):
    """ψ(q) = √(2/R) cos(Ω q/ℓ + b) by its formula, per head.  # shape: q (B, H, T, Dh) -> (B, H, T, R)"""
    R = cov.frequencies.shape[1]
    out = torch.empty(*q.shape[:-1], R, dtype=F64)
    for h in range(q.shape[1]):
        omega = cov.frequencies[h].double() / float(cov.lengthscale[h])
        out[:, h] = math.sqrt(2.0 / R) * torch.cos(q[:, h].double() @ omega.T + cov.phases[h].double())
    return out


def rff_dense_posterior(layer, x, mask):
    """mean m(q) + σΨμ, covariance σ²Ψ(I + wM)⁻¹Ψᵀ by an explicit inverse, KL by torch.distributions."""
    strategy, cov = layer.strategy, layer.strategy.covariance
    qk, v = sgpa_heads(layer, x)
    excluded = None if mask is None else mask[:, None, None, :].expand(-1, qk.shape[1], qk.shape[2], -1)
    m = prior_mean_dense(layer, qk, qk, v, excluded)
    psi = _features_dense(cov, qk)
    s2 = cov.outputscale.double()[:, None, None]
    mu = strategy.variational_mean.detach().double()
    mean = m + s2.sqrt() * (psi @ mu)
    R = psi.shape[-1]
    if layer.training:  # the batch's own second moment over its real queries
        real = torch.ones(psi.shape[0], psi.shape[2], dtype=torch.bool) if mask is None else ~mask
        rows = psi.permute(1, 0, 2, 3)[:, real]  # (H, n, R)
        moment = rows.mT @ rows / real.sum()
    else:
        moment = cov.second_moment.double()
    sigma = torch.linalg.inv(torch.eye(R, dtype=F64) + cov.data_weight * moment)  # (H, R, R)
    covariance = s2 * psi @ sigma @ psi.mT  # (B, H, T, T)
    Dv = v.shape[-1]
    covariance = covariance[:, :, None].expand(-1, -1, Dv, -1, -1) + strategy.jitter * torch.eye(qk.shape[2])
    q_beta = torch.distributions.MultivariateNormal(mu.mT, sigma[:, None].expand(-1, Dv, -1, -1))
    p_beta = torch.distributions.MultivariateNormal(torch.zeros_like(mu.mT), torch.eye(R, dtype=F64))
    kl = torch.distributions.kl_divergence(q_beta, p_beta).sum()
    return DenseReference(mean.transpose(-1, -2), covariance, {"kl_global": kl})


def _trained(layer, x, batches=3, seed=5):
    """A layer whose running second moment has seen ``batches`` training batches of ``x``'s distribution."""
    g = torch.Generator().manual_seed(seed)
    layer.train()
    for _ in range(batches):
        layer(x + 0.1 * torch.randn(x.shape, generator=g, dtype=x.dtype))
    return layer.eval()


class TestSGPARFF(GPAttentionTestCase):
    attention = "sgpa-rff"
    options = {"num_features": 16}
    reference_seeds = (0, 1)
    reference_padding = {1: (1, 5)}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-8, "atol": 1e-8}
    float64_options = {"jitter": 1e-9}
    exact_options = {"num_features": 8}

    def perturb(self, layer):
        """A non-zero μ and a tracked second moment (the posterior away from the prior)."""
        g = torch.Generator().manual_seed(3)
        layer.strategy.variational_mean.copy_(0.3 * torch.randn(layer.strategy.variational_mean.shape, generator=g))
        psi = torch.randn(2, layer.num_heads, 9, layer.strategy.covariance.num_features, generator=g, dtype=F64)
        layer.strategy.covariance.track(layer.strategy.covariance.batch_moment(psi / 4, None))
        layer.eval()  # the reference reads the running second moment (training forwards use the batch's)

    def dense_reference(self, layer, x, mask):
        return rff_dense_posterior(layer, x, mask)


def test_random_features_approximate_the_rbf_kernel():
    """ψ(q)ᵀψ(q') → exp(−‖q − q'‖²/2ℓ²) as R grows (Monte-Carlo error ~ 1/√R); ψ is the dense formula."""
    torch.manual_seed(0)
    cov = TrainingQueryCovariance(1, 8, num_features=4000, lengthscale=1.3, prior_variance=1.0, data_weight=1.0,
                                  momentum=0.1).double()
    q = torch.randn(1, 1, 6, 8, dtype=F64) * 0.5
    psi = cov.unit_features(q)
    torch.testing.assert_close(psi, _features_dense(cov, q), rtol=1e-12, atol=1e-12)
    exact = torch.exp(-torch.cdist(q[0, 0], q[0, 0]).square() / (2 * 1.3**2))
    error = (psi[0, 0] @ psi[0, 0].T - exact).abs()
    assert error.mean() < 0.03 and error.max() < 0.1, error


def test_second_moment_is_the_mean_over_real_tokens_then_a_running_average():
    torch.manual_seed(0)
    covariance = functools.partial(TrainingQueryCovariance, momentum=0.5)  # a setting of g's covariance object
    layer = gpattn.build_attention("sgpa-rff", 8, 2, num_features=5, covariance=covariance).double()
    cov = layer.strategy.covariance
    a, b, c = (torch.randn(3, 2, 4, 5, dtype=F64) for _ in range(3))
    real = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    cov.track(cov.batch_moment(a, real))
    first = torch.einsum("bhtr,bhts->hrs", a * real[:, None, :, None], a * real[:, None, :, None]) / real.sum()
    torch.testing.assert_close(cov.second_moment, first)
    cov.track(cov.batch_moment(b, None))  # the second batch: equal weights (1/2 = momentum)
    second = torch.einsum("bhtr,bhts->hrs", b, b) / 12
    torch.testing.assert_close(cov.second_moment, (first + second) / 2)
    cov.track(cov.batch_moment(c, None))  # then the running average with weight momentum
    third = torch.einsum("bhtr,bhts->hrs", c, c) / 12
    torch.testing.assert_close(cov.second_moment, 0.5 * (first + second) / 2 + 0.5 * third)
    assert int(cov.num_batches_tracked) == 3


def test_tracking_happens_only_in_training_with_gradients():
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa-rff", 8, 2, num_features=5)
    x = torch.randn(2, 4, 8)
    layer.eval()(x)
    with torch.no_grad():
        layer.train()(x)
    assert int(layer.strategy.covariance.num_batches_tracked) == 0
    layer.train()(x)
    assert int(layer.strategy.covariance.num_batches_tracked) == 1


def test_variance_is_the_prior_away_from_the_training_queries_and_shrinks_on_them():
    """The distance-aware property: after training batches from one region, the predictive variance there is a
    small fraction of σ², and at inputs far from it close to σ² (the prior)."""
    torch.manual_seed(0)
    D = 16
    layer = gpattn.build_attention("sgpa-rff", D, 2, num_features=256).double()
    centre = torch.randn(1, 1, D, dtype=F64)
    x_in = centre + 0.3 * torch.randn(8, 10, D, dtype=F64)
    _trained(layer, x_in, batches=5)
    x_far = -3 * centre + 0.3 * torch.randn(8, 10, D, dtype=F64)
    with torch.no_grad():
        var_in = layer.posterior(x_in).variance.mean()
        var_far = layer.posterior(x_far).variance.mean()
    prior = layer.strategy.covariance.outputscale.mean()
    assert var_in < 0.05 * prior, (var_in, prior)
    assert var_far > 0.5 * prior, (var_far, prior)


def test_untrained_layer_has_the_prior_variance_everywhere():
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa-rff", 16, 2, num_features=512, prior_variance=0.7).double().eval()
    with torch.no_grad():
        var = layer.posterior(torch.randn(3, 5, 16, dtype=F64)).variance
    torch.testing.assert_close(var.mean(), torch.tensor(0.7, dtype=F64), rtol=0.1, atol=0)


def test_no_gradient_reaches_the_query_map_through_the_noise():
    """The covariance conditions on detached queries: with μ = 0 the sample's gradient w.r.t. W_qk is the mean's
    alone (the draw's noise adds nothing)."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa-rff", 8, 2, num_features=8).double().train()
    x = torch.randn(2, 5, 8, dtype=F64)
    cond = layer._condition(x, None)
    g = torch.Generator().manual_seed(1)
    sample = cond.rsample(generator=g)
    grad_sample = torch.autograd.grad(sample.sum(), layer.in_proj.weight)[0]
    cond = layer._condition(x, None)
    grad_mean = torch.autograd.grad(cond.mean.sum(), layer.in_proj.weight)[0]
    torch.testing.assert_close(grad_sample, grad_mean)


def test_scale_prior_and_rescale_inputs_act_on_sigma_and_the_lengthscale():
    layer = gpattn.build_attention("sgpa-rff", 12, 3, num_features=4, lengthscale=2.0, prior_variance=0.5)
    layer.scale_prior(4.0)
    layer.rescale_inputs(2.0)
    cov = layer.strategy.covariance
    torch.testing.assert_close(cov.outputscale, torch.full((3,), 2.0))
    torch.testing.assert_close(cov.lengthscale, torch.full((3,), 1.0))


@pytest.mark.parametrize("name, value", [("num_features", 0), ("num_features", 2.5), ("data_weight", -1.0),
                                         ("momentum", 1.5), ("prior_variance", float("nan")), ("lengthscale", 0.0)])
def test_bad_options_name_the_argument(name, value):
    """A bad option of the layer, or a bad setting of g's covariance object (data_weight, momentum), names itself."""
    layer_option = name in gpattn.attention_options("sgpa-rff")
    with pytest.raises(ValueError, match=name):
        if layer_option:
            gpattn.build_attention("sgpa-rff", 8, 2, **{name: value})
        else:
            covariance = functools.partial(TrainingQueryCovariance, **{name: value})
            gpattn.build_attention("sgpa-rff", 8, 2, covariance=covariance)


def test_the_research_knobs_left_the_options_and_their_error_names_what_owns_them():
    """g's input, w and the momentum are no options of the layer: the sequence form is the out-of-scope
    recipe's, w and the momentum are settings of g's covariance object."""
    for option, owner in (("gp_input", "recipe='out-of-scope'"), ("data_weight", "TrainingQueryCovariance"),
                          ("momentum", "TrainingQueryCovariance")):
        assert option not in gpattn.attention_options("sgpa-rff")
        with pytest.raises(ValueError, match=rf"unknown option\(s\) \['{option}'\] .*{owner}"):
            gpattn.build_attention("sgpa-rff", 8, 2, **{option: 1})


def test_the_zero_prior_mean_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="prior_mean must be one of"):
        gpattn.build_attention("sgpa-rff", 8, 2, prior_mean="zero")


def test_encoder_swap_starts_at_the_pretrained_attention_and_sets_the_lengthscale_by_the_median():
    transformers = pytest.importorskip("transformers")
    from gpattn.integrations.huggingface import HFClassifier

    def encoder():
        config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=24)
        torch.manual_seed(0)
        return transformers.BertModel(config, add_pooling_layer=False).eval()

    ids = torch.tensor([[2, 5, 7, 9, 3], [2, 8, 3, 0, 0]])
    pad = ids == 0
    with torch.no_grad():
        ref = HFClassifier(encoder(), 3, "softmax", "last").eval()
        model = HFClassifier(encoder(), 3, "sgpa-rff", "last").eval()
        model.head.load_state_dict(ref.head.state_dict())
        with gpattn.deterministic():
            torch.testing.assert_close(model(ids, pad), ref(ids, pad), rtol=1e-5, atol=1e-6)
        layer = model.adapters[1].attention
        (row,) = model.match_prior_to_stream(ids, pad)
    assert row["input_factor"] > 0  # the recipe's ℓ = 1 then the median heuristic: κ = e⁻¹ at the median pair
    torch.testing.assert_close(layer.strategy.covariance.lengthscale,
                               torch.full((2,), (row["key_distance"] / 2) ** 0.5), rtol=1e-5, atol=0)


# ---- the sequence as g's input (gp_input="sequence", docs/derivations.md §5f) ----


def _sequence_features_dense(cov, qk, real):
    """ψ̂ of each sequence's unit mean query over its real tokens and all heads, by the formula.
    # shape: qk (B, H, T, Dh), real (B, T) -> (B, R)"""
    B, H, T, Dh = qk.shape
    rows = []
    for b in range(B):
        joint = torch.cat([qk[b, h] for h in range(H)], dim=-1)[real[b]]  # (n_b, H·Dh), heads side by side
        pooled = joint.mean(0)
        rows.append(pooled / pooled.norm())
    unit = torch.stack(rows).double()
    R = cov.frequencies.shape[1]
    omega = cov.frequencies[0].double() / float(cov.lengthscale[0])
    return math.sqrt(2.0 / R) * torch.cos(unit @ omega.T + cov.phases[0].double())


def rff_sequence_dense_posterior(layer, x, mask):
    """mean m(q) + σψ̂ᵀμ at every token, covariance σ²ψ̂ᵀ(I + wM)⁻¹ψ̂ 11ᵀ (one value per sequence), explicit inverse,
    KL by torch.distributions."""
    strategy, cov = layer.strategy, layer.strategy.covariance
    qk, v = sgpa_heads(layer, x)
    B, H, T, _ = qk.shape
    excluded = None if mask is None else mask[:, None, None, :].expand(-1, H, T, -1)
    m = prior_mean_dense(layer, qk, qk, v, excluded)
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else ~mask
    psi = _sequence_features_dense(cov, qk, real)  # (B, R)
    s2 = cov.outputscale.double()  # (H,)
    mu = strategy.variational_mean.detach().double()  # (H, R, Dv)
    mean = m + (s2.sqrt()[None, :, None] * torch.einsum("br,hrd->bhd", psi, mu))[:, :, None, :]
    R = psi.shape[-1]
    moment = psi.T @ psi / B if layer.training else cov.second_moment[0].double()
    sigma = torch.linalg.inv(torch.eye(R, dtype=F64) + cov.data_weight * moment)
    var = s2[None, :] * torch.einsum("br,rs,bs->b", psi, sigma, psi)[:, None]  # (B, H)
    Dv = v.shape[-1]
    covariance = var[:, :, None, None, None] * torch.ones(B, H, Dv, T, T, dtype=F64) + strategy.jitter * torch.eye(T)
    q_beta = torch.distributions.MultivariateNormal(mu.mT, sigma.expand(H, Dv, R, R))
    p_beta = torch.distributions.MultivariateNormal(torch.zeros_like(mu.mT), torch.eye(R, dtype=F64))
    kl = torch.distributions.kl_divergence(q_beta, p_beta).sum()
    return DenseReference(mean.transpose(-1, -2), covariance, {"kl_global": kl})


class TestSGPARFFSequence(GPAttentionTestCase):
    attention = "sgpa-rff"
    options = {"num_features": 16, "covariance": TrainingSequenceCovariance}
    reference_seeds = (0, 1)
    reference_padding = {1: (1, 5)}
    mean_tolerance = covariance_tolerance = {"rtol": 1e-8, "atol": 1e-8}
    float64_options = {"jitter": 1e-9}
    exact_options = {"num_features": 8, "covariance": TrainingSequenceCovariance}

    def perturb(self, layer):
        """A non-zero μ and a tracked second moment (the posterior away from the prior)."""
        g = torch.Generator().manual_seed(3)
        layer.strategy.variational_mean.copy_(0.3 * torch.randn(layer.strategy.variational_mean.shape, generator=g))
        psi = torch.randn(6, 1, 1, layer.strategy.covariance.num_features, generator=g, dtype=F64)
        layer.strategy.covariance.track(layer.strategy.covariance.batch_moment(psi / 4, None))
        layer.eval()

    def dense_reference(self, layer, x, mask):
        return rff_sequence_dense_posterior(layer, x, mask)


def _sequence_layer(D=16, H=2, R=256, **options):
    return gpattn.build_attention(
        "sgpa-rff", D, H, num_features=R, covariance=TrainingSequenceCovariance, **options
    ).double()


def test_a_sequence_level_sample_is_one_value_per_sequence_with_the_analytic_variance():
    """Every token of a sequence gets the same draw of g; the Monte-Carlo variance of the draws is σ²ψ̂ᵀΣψ̂."""
    torch.manual_seed(0)
    layer = _sequence_layer(R=32)
    x = torch.randn(3, 6, 16, dtype=F64)
    _trained(layer, x, batches=2)
    with torch.no_grad():
        cond = layer._condition(x, None)
        draws = cond.rsample(40000) - cond.mean  # shape: (P, B, H, T, Dv)
    torch.testing.assert_close(draws, draws[..., :1, :].expand_as(draws), rtol=0, atol=1e-12)  # one value per token
    torch.testing.assert_close(draws.var(0), cond.variance().expand_as(draws[0]), rtol=0.05, atol=1e-6)


def test_sequence_variance_shrinks_on_training_sequences_and_is_the_prior_far_away():
    """The distance-aware property at the sequence level: sequences whose mean query points where training
    sequences' did get a small fraction of σ², sequences pointing elsewhere nearly σ²; the scale of the queries does
    not enter (a unit direction)."""
    torch.manual_seed(0)
    D = 16
    layer = _sequence_layer(D, lengthscale=0.4)
    centre = torch.randn(1, 1, D, dtype=F64)
    x_in = centre + 0.2 * torch.randn(32, 10, D, dtype=F64)
    _trained(layer, x_in, batches=5)
    x_far = torch.randn(1, 1, D, dtype=F64) + 0.2 * torch.randn(32, 10, D, dtype=F64)
    with torch.no_grad():
        var_in = layer.posterior(x_in).variance.mean()
        var_far = layer.posterior(x_far).variance.mean()
        if layer.in_proj.bias is not None:
            layer.in_proj.bias.zero_()  # then inputs scaled by 3 scale every query by 3: the same directions
        cond, scaled = layer._condition(x_in, None), layer._condition(x_in * 3.0, None)
    prior = layer.strategy.covariance.outputscale.mean()
    assert var_in < 0.05 * prior, (var_in, prior)
    assert var_far > 0.5 * prior, (var_far, prior)
    torch.testing.assert_close(cond.variance(), scaled.variance())
    assert not torch.allclose(cond.variance(), layer._condition(x_far, None).variance())


def test_sequence_input_ignores_padded_tokens_and_refuses_per_query_masks():
    torch.manual_seed(0)
    layer = _sequence_layer(R=16).eval()
    x = torch.randn(2, 6, 16, dtype=F64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    other = x.clone()
    other[1, 4:] = 100.0  # what padded tokens hold does not move the sequence's input
    with torch.no_grad():
        torch.testing.assert_close(layer._condition(x, pad).root, layer._condition(other, pad).root)
    causal = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="attn_mask: attention 'sgpa-rff' takes only masks that pad"):
        layer(x, attn_mask=causal)
    with pytest.raises(ValueError, match="covariance must be one of \\['query'\\]"):
        gpattn.build_attention("sgpa-rff", 16, 2, covariance="tokens")


# ---- the training step's cost (docs/derivations.md §5f, "Cost"): the same distribution, computed the cheaper way ----


def _perturbed_layer(D=4, H=2, R=6, seed=0):
    """A float64 layer with a non-zero μ and a tracked second moment; its Dv = D/H."""
    torch.manual_seed(seed)
    layer = gpattn.build_attention("sgpa-rff", D, H, num_features=R, jitter=1e-9).double()
    with torch.no_grad():
        TestSGPARFF.perturb(None, layer)
    return layer


def _dense_root(layer, x):
    """σ Ψ L⁻ᵀ by its formula, L = chol(I + w·M) of the running moment M (eval), densely per head.
    # shape: x (B, T, D) -> (B, H, T, R)"""
    cov = layer.strategy.covariance
    qk, _ = sgpa_heads(layer, x)
    psi = _features_dense(cov, qk)
    R = psi.shape[-1]
    L = torch.linalg.cholesky(torch.eye(R, dtype=F64) + cov.data_weight * cov.second_moment.double())
    sigma = cov.outputscale.double().sqrt()[:, None, None]
    return sigma * psi @ torch.linalg.inv(L).mT


@pytest.mark.parametrize("num_samples", [None, 2, 9])
def test_a_draw_is_the_dense_root_times_its_normals_whichever_way_it_is_associated(num_samples):
    """f = mean + (σΨL⁻ᵀ) ε with ε the conditional's own normals: the draw of P·Dv ≤ T columns (L⁻ᵀ ε first, no root
    formed) and of P·Dv > T (the root first) are the dense root times the same ε, to float64 rounding."""
    layer = _perturbed_layer()  # Dv = 2, T = 8: P = None, 2 draw through L⁻ᵀ ε, P = 9 through the root
    x = torch.randn(3, 8, 4, dtype=F64)
    with torch.no_grad():
        cond = layer._condition(x, None)
        f = cond.rsample(num_samples, generator=torch.Generator().manual_seed(7))
    eps_shape = (3, 2, 6, 2)
    eps = standard_normal(eps_shape, f, num_samples, torch.Generator().manual_seed(7))
    root = _dense_root(layer, x)
    expected = cond.mean + root @ eps  # ε's sample axis P broadcasts
    torch.testing.assert_close(f, expected, rtol=1e-10, atol=1e-10)


def test_draws_through_the_normals_first_have_the_analytic_moments():
    """Monte Carlo in float64 on the path a training step takes (one draw, P·Dv ≤ T): the draws' mean and token
    covariance are σΨμ + m and σ²ΨΣΨᵀ (the dense reference's)."""
    layer = _perturbed_layer(R=8)
    x = torch.randn(1, 8, 4, dtype=F64)
    ref = rff_dense_posterior(layer, x, None)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        cond = layer._condition(x, None)
        f = torch.stack([cond.rsample(4, generator=g) for _ in range(2500)]).flatten(0, 1)  # P·Dv = 8 = T each
    assert_samples_match_moments(f.transpose(-1, -2), ref.mean, ref.covariance)


def test_a_training_forward_conditions_on_its_own_batch_under_padding():
    """Training mode: the precision is I + w·E_batch[ψψᵀ] over the batch's real queries (the features laid out per
    head, the mask as weights), the dense reference's, and no gradient or statistic is tracked under no_grad."""
    layer = _perturbed_layer(D=8, H=2, R=10).train()
    x = torch.randn(3, 6, 8, dtype=F64)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 1:] = True
    ref = rff_dense_posterior(layer, x, pad)
    with torch.no_grad():
        cond = layer._condition(x, pad)
    torch.testing.assert_close(cond.mean.transpose(-1, -2), ref.mean, rtol=1e-10, atol=1e-10)
    root = cond.root
    expected = ref.covariance - 1e-9 * torch.eye(6, dtype=F64)  # the reference's jitter off: σ²ΨΣΨᵀ per output dim
    torch.testing.assert_close((root @ root.mT)[:, :, None].expand_as(expected), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cond.kl_divergence().sum(), ref.loss_terms["kl_global"], rtol=1e-10, atol=1e-10)


def test_the_training_mean_has_its_gradient_by_gradcheck():
    """The differentiable path (the features as a shifted sine, their constant on μ's product, the batch's own
    precision under padding): the mean's analytic gradients w.r.t. the input and μ, and the draw's w.r.t. μ, match
    finite differences in float64 (the draw's noise reads the queries detached: its gradient w.r.t. the input is the
    mean's, test_no_gradient_reaches_the_query_map_through_the_noise)."""
    layer = _perturbed_layer(R=5).train()
    strategy = layer.strategy
    mu = strategy._parameters.pop("variational_mean").detach().clone().requires_grad_(True)  # μ as an input
    x = torch.randn(2, 4, 4, dtype=F64, requires_grad=True)
    pad = torch.tensor([[False] * 4, [False, False, True, True]])

    def condition(x, mu):
        strategy.variational_mean = mu
        return layer._condition(x, pad)

    assert torch.autograd.gradcheck(lambda x, mu: condition(x, mu).mean, (x, mu), eps=1e-6, atol=1e-7)
    draw = lambda mu: condition(x.detach(), mu).rsample(generator=torch.Generator().manual_seed(2))  # noqa: E731
    assert torch.autograd.gradcheck(draw, (mu,), eps=1e-6, atol=1e-7)
