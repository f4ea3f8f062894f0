"""kep-svgp's softmax prior mean and its noise on another stream (docs/derivations.md §6): the mean path of an
encoder swap, ``scale_prior`` of its parameterisation, and what ``match_prior_to_stream`` does with it.

The references are written independently of gpattn.variational.kep_svgp: a dense float64 masked softmax with
explicit exponentials, the paper's form (``prior_mean="zero"``) as the twin that the new form must equal up to
that mean, and transformers' own BERT / DistilBERT layers (tiny, random, no download).
"""

import math
import warnings

import pytest
import torch
from _knobs import KEPSVGPProbe
from test_prior_scale import MEAN_BAND, SPREAD_BAND, _scale

import gpattn
from gpattn import OldVersionWarning
from gpattn._migrate import migrate_config
from gpattn.attention import attention_options, recipe_options
from gpattn.testing import layer_loss_terms

transformers = pytest.importorskip("transformers")

from gpattn.integrations.huggingface import HFClassifier, swap_attention  # noqa: E402

DT = torch.float64


# ------------------------------------------------------------------------ the softmax mean, dense float64
def _dense_softmax_mean(q, k, u, pad):
    """Σ_j softmax_j(q_i·k_j/√Dh) u_j over the real keys, with explicit exponentials.
    # shape: q, k (B, H, T, Dh), u (B, H, T, Dv), pad (B, T) -> (B, H, T, Dv)"""
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    weights = torch.exp(logits - logits.amax(-1, keepdim=True)) * (~pad)[:, None, None, :]
    return torch.einsum("bhij,bhjv->bhiv", weights / weights.sum(-1, keepdim=True), u)


def _twins(seed=0, D=16, H=2):
    """A float64 kep-svgp layer with the softmax mean and its paper-form twin with the same parameters (q, k rows,
    strategy, out_proj), q(u_c)'s mean and the output bias made non-zero so that the GP's mean is not 0."""
    torch.manual_seed(seed)
    soft = gpattn.build_attention("kep-svgp", D, H, prior_mean="softmax", rank=3).double()
    zero = gpattn.build_attention("kep-svgp", D, H, prior_mean="zero", rank=3).double()
    with torch.no_grad():
        soft.strategy.variational_distribution.variational_mean.normal_(0, 0.3)
        soft.strategy.out_bias.normal_(0, 0.3)
        zero.strategy.load_state_dict(soft.strategy.state_dict())
        zero.out_proj.load_state_dict(soft.out_proj.state_dict())
        for name, rows in zero.projection_rows().items():
            zero.in_proj.weight[rows] = soft.in_proj.weight[soft.projection_rows()[name]]
            zero.in_proj.bias[rows] = soft.in_proj.bias[soft.projection_rows()[name]]
    return soft, zero


def test_the_softmax_mean_is_the_papers_form_plus_a_dense_softmax_attention():
    """posterior(): the mean is the paper form's plus softmax(q kᵀ/√Dh) u over the real keys, the covariance the
    paper form's; samples with the same random numbers differ by the same mean; the loss terms are equal."""
    soft, zero = _twins()
    B, T, D = 3, 6, 16
    x = torch.randn(B, T, D, dtype=DT)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 1:] = True
    p = soft.project(x)
    m = _dense_softmax_mean(p["q"], p["k"], p["v_mean"], pad)  # shape: (B, H, T, Dv)
    post_soft, post_zero = soft.posterior(x, pad), zero.posterior(x, pad)
    torch.testing.assert_close(post_soft.mean - post_zero.mean, m.mT, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post_soft.covariance_matrix, post_zero.covariance_matrix, rtol=1e-12, atol=1e-14)
    outs = {}
    for name, layer in (("soft", soft), ("zero", zero)):
        torch.manual_seed(7)
        outs[name] = layer(x, pad, num_samples=2)  # shape: (2, B, T, D)
        outs[name + " terms"] = layer_loss_terms(layer)
        with gpattn.deterministic():
            outs[name + " mean"] = layer(x, pad)
    merged = m.transpose(1, 2).reshape(B, T, D) @ soft.out_proj.weight.mT  # W_o m(x), no bias (it is in both)
    repeated = merged.expand(2, *merged.shape)  # the sample axis leads: (P, B, T, D)
    torch.testing.assert_close(outs["soft"] - outs["zero"], repeated, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs["soft mean"] - outs["zero mean"], merged, rtol=1e-10, atol=1e-12)
    assert outs["soft terms"].keys() == outs["zero terms"].keys() == {"kl_global", "ksvd"}
    for key in ("kl_global", "ksvd"):
        torch.testing.assert_close(outs["soft terms"][key], outs["zero terms"][key], rtol=1e-12, atol=0)


def test_the_separate_softmax_mean_reads_its_own_queries_and_keys_and_the_gp_is_the_papers():
    """prior_mean="softmax-separate" (docs/derivations.md §6, "The mean's own queries and keys"): the posterior mean is
    the paper form's (same q, k rows, strategy, out_proj) plus the dense softmax attention of the q_mean, k_mean and
    v_mean rows over the real keys, the covariance and loss terms the paper form's; the mean's rows get no gradient
    from the GP (with the mean's output path cut, only q, k learn) and the GP's q, k rows none from the mean."""
    torch.manual_seed(0)
    sep = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="softmax-separate", rank=3).double()
    zero = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="zero", rank=3).double()
    assert sep.projections == ("q", "k", "q_mean", "k_mean", "v_mean") and "softmax-separate" in repr(sep)
    with torch.no_grad():
        sep.strategy.variational_distribution.variational_mean.normal_(0, 0.3)
        zero.strategy.load_state_dict(sep.strategy.state_dict())
        zero.out_proj.load_state_dict(sep.out_proj.state_dict())
        for name, rows in zero.projection_rows().items():
            zero.in_proj.weight[rows] = sep.in_proj.weight[sep.projection_rows()[name]]
            zero.in_proj.bias[rows] = sep.in_proj.bias[sep.projection_rows()[name]]
    x = torch.randn(3, 6, 16, dtype=DT)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    p = sep.project(x)
    m = _dense_softmax_mean(p["q_mean"], p["k_mean"], p["v_mean"], pad)
    assert (m - _dense_softmax_mean(p["q"], p["k"], p["v_mean"], pad)).abs().max() > 1e-2  # not the features' q, k
    post_sep, post_zero = sep.posterior(x, pad), zero.posterior(x, pad)
    torch.testing.assert_close(post_sep.mean - post_zero.mean, m.mT, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post_sep.covariance_matrix, post_zero.covariance_matrix, rtol=1e-12, atol=1e-14)
    for key, term in layer_loss_terms(sep).items():
        torch.testing.assert_close(term, layer_loss_terms(zero)[key], rtol=1e-12, atol=0)
    rows = sep.projection_rows()
    with torch.no_grad():  # the GP's output map at 0: the output is the mean's alone, J² the GP's alone
        sep.strategy.out_weight.zero_()
    sep.zero_grad()
    with gpattn.deterministic():
        sep(x, pad).square().sum().backward()
    grad = sep.in_proj.weight.grad
    assert grad[rows["q"]].abs().max() == 0 and grad[rows["k"]].abs().max() == 0
    assert grad[rows["q_mean"]].abs().max() > 0 and grad[rows["k_mean"]].abs().max() > 0
    sep.zero_grad()
    sep(x, pad)
    layer_loss_terms(sep)["ksvd"].backward()
    grad = sep.in_proj.weight.grad
    assert grad[rows["q"]].abs().max() > 0
    assert all(grad[rows[n]].abs().max() == 0 for n in ("q_mean", "k_mean", "v_mean"))
    strategy, q = sep.strategy, p["q"]
    own = r"reads queries, keys and values of its own .* a tuple of 3 tensors, .* got Tensor"
    with pytest.raises(ValueError, match=own):
        strategy.condition(x, q, q, mean_values=p["v_mean"])
    with pytest.raises(ValueError, match=r"its queries and keys of one shape \(B, H, T, Dh\)"):
        strategy.condition(x, q, q, mean_values=(q[:, :1], q, p["v_mean"]))


def test_the_gp_mean_starts_at_zero_under_the_softmax_mean_and_the_papers_form_is_unchanged():
    """With the softmax mean (the default: the same draws) q(u_c)'s mean and the output bias start at 0 (the layer's
    mean is W_o m(x) + b_o); the paper's form keeps its random q(u_c) mean and its two-map in_proj."""
    torch.manual_seed(0)
    soft = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="softmax")
    assert not soft.strategy.variational_distribution.variational_mean.any() and not soft.strategy.out_bias.any()
    assert soft.projections == ("q", "k", "v_mean") and soft.in_proj.weight.shape == (48, 16)
    torch.manual_seed(0)
    paper = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="zero")
    torch.manual_seed(0)
    default = gpattn.build_attention("kep-svgp", 16, 2)
    assert paper.projections == ("q", "k") and paper.strategy.variational_distribution.variational_mean.any()
    for (name, a), b in zip(soft.state_dict().items(), default.state_dict().values()):
        assert torch.equal(a, b), name


def _grads(layer, x):
    """The gradients of the layer's deterministic output and loss terms, by parameter name."""
    layer.zero_grad()
    with gpattn.deterministic():
        out = layer(x)
    (out.square().sum() + sum(layer_loss_terms(layer).values())).backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prior_mean", ["zero", "softmax"])
def test_features_without_gradient_compute_the_same_and_leave_the_maps_to_the_mean(prior_mean):
    """feature_gradient=False (docs/derivations.md §6, "The features' gradient"; a research knob of research/knobs.py's
    probe): the same outputs and loss terms as
    Chen et al.'s form; the q and k rows of in_proj get the prior mean's gradient alone (none under the zero mean, the
    softmax mean's under the softmax mean), while the KSVD pairs and the output map still learn."""
    torch.manual_seed(0)
    given = gpattn.build_attention("kep-svgp", 16, 2, prior_mean=prior_mean, rank=3).double()
    torch.manual_seed(0)
    free = gpattn.build_attention(KEPSVGPProbe, 16, 2, prior_mean=prior_mean, rank=3, feature_gradient=False).double()
    assert "feature_gradient=False" in repr(free)
    x = torch.randn(2, 5, 16, dtype=DT)
    with gpattn.deterministic():
        assert torch.equal(given(x), free(x))
    assert all(torch.equal(a, b) for a, b in zip(layer_loss_terms(given).values(), layer_loss_terms(free).values()))
    g_given, g_free = _grads(given, x), _grads(free, x)
    qk = torch.arange(16 * 2)  # the q and k rows lead in_proj (projections ("q", "k", ...))
    # the KSVD pairs learn through J (and, with q(u_c)'s mean non-zero, the GP's mean) either way
    assert g_free["strategy.ksvd.omega_e"].abs().sum() > 0 and g_free["strategy.ksvd.log_lambda"].abs().sum() > 0
    assert g_given["in_proj.weight"][qk].abs().sum() > 0
    if prior_mean == "zero":  # nothing else reads q and k: in_proj gets no gradient at all
        assert "in_proj.weight" not in g_free and g_free["strategy.out_weight"].abs().sum() > 0
    else:  # the softmax mean's gradient alone: the twin's with the GP's output map and J's weight at zero
        torch.manual_seed(0)
        mean_only = gpattn.build_attention("kep-svgp", 16, 2, prior_mean=prior_mean, rank=3).double()
        with torch.no_grad():
            mean_only.strategy.out_weight.zero_()
        with gpattn.deterministic():
            out = mean_only(x)
        out.square().sum().backward()
        torch.testing.assert_close(g_free["in_proj.weight"][qk], mean_only.in_proj.weight.grad[qk])


def test_prior_mean_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"prior_mean must be one of \['softmax', 'softmax-separate', 'zero'\]"):
        gpattn.build_attention("kep-svgp", 16, 2, prior_mean="attention")
    x, q = torch.randn(1, 4, 16), torch.randn(1, 2, 4, 8)
    zero = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="zero").strategy
    refused = "mean_values: only a prior mean with values of its own reads them, not 'zero'"
    with pytest.raises(ValueError, match=refused):
        zero.condition(x, q, q, mean_values=q)
    soft = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="softmax").strategy
    own = r"mean_values: prior_mean='softmax' reads values of its own .* shape \(1, 2, 4, 8\), got NoneType"
    with pytest.raises(ValueError, match=own):
        soft.condition(x, q, q)


# --------------------------------------------------------------------------- scale_prior of kep-svgp
def test_scale_prior_scales_the_gp_output_by_its_root_and_keeps_the_kl():
    """scale_prior(c): σ² × c and q(u_c) × √c (m_c, L_c), so the GP's output f = a u is √c times the old in
    distribution (the mean less the output bias, and a sample's deviation with the same random numbers, float64)
    and KL(q ‖ p) is unchanged."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("kep-svgp", 16, 2, prior_mean="zero").double()  # the GP's output alone
    x = torch.randn(2, 5, 16, dtype=DT)

    def moments():
        cond = layer._condition(x, None)
        torch.manual_seed(3)
        return cond.mean - layer.strategy.out_bias[:, None, :], cond.rsample() - cond.mean, cond.kl_divergence()

    before, sigma2 = moments(), float(layer.strategy.prior_variance)
    with torch.no_grad():
        layer.scale_prior(0.3)
    after = moments()
    assert float(layer.strategy.prior_variance) == pytest.approx(0.3 * sigma2, rel=1e-12)
    for b, a in zip(before[:2], after[:2]):
        torch.testing.assert_close(a, 0.3**0.5 * b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(after[2], before[2], rtol=1e-10, atol=0)


def test_match_singular_values_starts_the_ksvd_term_at_zero_and_keeps_the_function():
    """match_singular_values on a stream of another scale (float64, one padded sequence): J goes to 0 (the layer's
    own ``ksvd`` loss term), Λ' is (r / tr(ω_eᵀω_r)) · ½ mean(e² + r²) over the real tokens (written here from the
    features), and the mean, a sample with the same random numbers, the posterior covariance and the KL are
    unchanged."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("kep-svgp", 16, 2, rank=3).double()
    with torch.no_grad():
        layer.strategy.variational_distribution.variational_mean.normal_(0, 0.3)
    x = 3.0 * torch.randn(3, 6, 16, dtype=DT)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True

    def state():
        cond = layer._condition(x, pad)
        torch.manual_seed(3)
        sample = cond.rsample()
        (ksvd,) = [t for t in cond.added_loss_terms() if type(t).__name__ == "KSVDLoss"]
        covar = cond.posterior().covariance_matrix
        return cond.mean, sample, covar, cond.kl_divergence(), float(ksvd.loss().detach())

    before = state()
    feats = layer.strategy.features(*layer.strategy_inputs(x), pad)
    real = (~pad)[:, None, :, None].to(DT)
    half = 0.5 * ((feats["e"] ** 2 + feats["r"] ** 2) * real).sum((0, 2)) / real.sum((0, 2))
    with torch.no_grad():
        j_before, j_after = layer.match_singular_values(x, pad)
    after = state()
    assert before[4] == pytest.approx(j_before**2, rel=1e-10) and abs(j_before) > 1.0  # off its stationary value
    assert abs(j_after) < 1e-10 and after[4] < 1e-20
    ksvd = layer.strategy.ksvd
    trace = torch.einsum("hsr,hsr->h", ksvd.omega_e, ksvd.omega_r)  # = r to float32 round-off (ω_r = ω_e orthogonal)
    torch.testing.assert_close(ksvd.lam, half * 3 / trace[:, None], rtol=1e-12, atol=0)
    for b, a in zip(before[:4], after[:4]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------- the encoder swap
def _config(kind):
    if kind == "distilbert":
        return transformers.DistilBertModel(
            transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
        )
    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    config = transformers.BertConfig(**sizes, max_position_embeddings=32, attn_implementation=kind)
    return transformers.BertModel(config)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return ids, mask


def _attention_of(model):
    layer = model.transformer.layer[1] if hasattr(model, "transformer") else model.encoder.layer[1]
    return getattr(layer.attention, "self", layer.attention)


@pytest.mark.parametrize("kind", ["sdpa", "eager", "distilbert"])
def test_the_swapped_layer_mean_is_the_pretrained_layer(kind):
    """swap_attention(..., "kep-svgp") (the encoder-swap recipe: prior_mean="softmax"): q, k and the mean's values
    are the pretrained maps and the GP's mean is 0, so under deterministic() the swapped encoder is the original
    one (real tokens, to round-off); the paper's form starts without the attention branch and differs."""
    ids, mask = _batch()
    real = mask.bool()
    outs = {}
    for options in ({}, {"prior_mean": "softmax-separate"}, {"prior_mean": "zero"}):
        torch.manual_seed(0)
        model = _config(kind).eval()
        old = _attention_of(model)
        with torch.no_grad(), gpattn.deterministic():
            for name in ("query", "key", "value", "q_lin", "k_lin", "v_lin"):  # a trained layer's scale
                if hasattr(old, name):
                    getattr(old, name).weight.normal_(0, 0.3)
                    getattr(old, name).bias.normal_(0, 0.5)
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            swap_attention(model, "kep-svgp", "last", **options)
            outs[str(options)] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(outs["{}"][real], ref[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[str({"prior_mean": "softmax-separate"})][real], ref[real], atol=1e-5, rtol=1e-5)
    assert (outs[str({"prior_mean": "zero"})][real] - ref[real]).abs().max() > 1e-2


def test_match_prior_to_stream_puts_the_swapped_noise_in_the_band():
    """In a tiny BERT the swapped kep-svgp layer's noise is proportional to its input's amplitude (the KSVD features
    read the landmark tokens), so match_prior_to_stream multiplies σ² (and q(u_c)) by (1/3) / g_o alone, the output
    map's gain: the spread then scales by √c with the same random numbers, its ratio to the input lies in the band of
    tests/test_prior_scale.py, the mean is unchanged (the pretrained attention's, in the mean band)."""
    torch.manual_seed(0)
    encoder = _config("sdpa")
    with torch.no_grad():  # LayerNorm gains other than 1, so that the stream's mean square v_s is not 1
        for module in encoder.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.2, 0.8)
    model = HFClassifier(encoder, 2, "kep-svgp", "last")
    ids, mask = _batch()
    pad = ~mask.bool()
    (i,) = model.adapters
    layer = model.adapters[i].attention
    with torch.no_grad(), gpattn.deterministic():
        (x,) = model._layer_inputs([i], lambda: model(ids, pad)).values()
    torch.manual_seed(1)
    mean_before, spread_before, *_ = _scale(layer, x, pad)
    (row,) = model.match_prior_to_stream(ids, pad)
    assert row["out_gain"] == 1.0 and row["factor"] == pytest.approx(1 / 3)  # v_s does not enter
    assert row["stream_variance"] == pytest.approx(float(x[~pad].double().pow(2).mean()))
    assert not 0.9 < row["stream_variance"] < 1.1  # a stream whose v_s would change the factor
    assert abs(row["ksvd_before"]) > 0.1 and abs(row["ksvd_after"]) < 1e-5  # the KSVD term starts at 0 (float32)
    torch.manual_seed(1)
    mean_after, spread_after, *_ = _scale(layer, x, pad)
    assert mean_after == pytest.approx(mean_before, rel=1e-6) and MEAN_BAND[0] <= mean_after <= MEAN_BAND[1]
    assert spread_after == pytest.approx(spread_before / 3**0.5, rel=1e-4)
    assert SPREAD_BAND[0] <= spread_after <= SPREAD_BAND[1], spread_after
    print(f"kep-svgp swap: mean {mean_after:.3f}, spread {spread_before:.3f} -> {spread_after:.3f} of the input")


def test_the_encoder_swap_recipe_and_configs_written_before_it():
    """The registry's recipe (not a branch in the swap), the default recorded in every run's config, and kep-svgp
    configs saved before either: an encoder run before the recipe and a scratch run before the default changed
    trained the paper's form, which the migration fills in; a config that records the mean is left as it is."""
    assert attention_options("kep-svgp")["prior_mean"] == "softmax"
    assert recipe_options("kep-svgp", "encoder-swap") == {"recipe": "encoder-swap", "prior_mean": "softmax"}
    assert recipe_options("kep-svgp") == {"prior_mean": "softmax"}
    for encoder in ("minilm", None):
        old = {"attention": "kep-svgp", "encoder": encoder, "attention_options": {"rank": 5}}
        with pytest.warns(OldVersionWarning, match="prior_mean='zero'"):
            assert migrate_config(old)["attention_options"] == {"prior_mean": "zero", "rank": 5}
    recorded = {"attention": "kep-svgp", "encoder": None, "attention_options": {"prior_mean": "softmax"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert migrate_config(recorded) is recorded
