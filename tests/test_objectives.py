"""The ELBO objective (docs/derivations.md §9): term weighting, N scaling, annealing, MC likelihoods; the layers' terms
as GPyTorch added loss terms, the objective in GPyTorch's MLL idiom (DeepGPELBO), priors, and a new
regulariser declared in one place (a toy term defined here only)."""

import copy
import json
import math
import warnings

import gpytorch
import pytest
import torch
from gpytorch.mlls import AddedLossTerm

import gpattn
from gpattn.attention.softmax import SoftmaxAttention
from gpattn.experiments.diagnostics import GPCollapseWarning
from gpattn.models import TransformerClassifier
from gpattn.objectives import (
    CGPRegulariser,
    DeepGPELBO,
    GlobalKL,
    GPLossTerm,
    KSVDLoss,
    SequenceKL,
    TermWeight,
    expected_nll,
    term_weights,
)


def _logits(B=4, P=3, C=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, P, C, generator=g, dtype=torch.float64), torch.randint(0, C, (B,), generator=g)


class _Terms(gpytorch.Module):
    """A module whose last forward recorded ``terms`` (name -> value, each built as its kind), as a layer does."""

    def __init__(self, terms):
        super().__init__()
        for name, value in terms.items():
            self.register_added_loss_term(name)
            self.update_added_loss_term(name, GPLossTerm.kind(name)(value))


def test_expected_nll_is_mean_cross_entropy_over_samples():
    logits, y = _logits()
    manual = -torch.stack([torch.log_softmax(logits[b, p], -1)[y[b]] for b in range(4) for p in range(3)]).mean()
    torch.testing.assert_close(expected_nll(logits, y), manual)


def test_predictive_nll_is_log_of_mean_probability():
    logits, y = _logits()
    probs = torch.softmax(logits, -1).mean(1)
    manual = -torch.log(probs[torch.arange(4), y]).mean()
    torch.testing.assert_close(expected_nll(logits, y, "predictive"), manual)
    # Jensen: predictive NLL <= expected NLL
    assert expected_nll(logits, y, "predictive") <= expected_nll(logits, y) + 1e-12


def test_terms_weighted_as_math_9():
    logits, y = _logits()
    terms = {
        k: torch.tensor(v, dtype=torch.float64) for k, v in dict(kl_seq=2.0, kl_global=300.0, ksvd=0.5, cgp=4.0).items()
    }
    obj = DeepGPELBO(_Terms(terms), 100, beta=0.5, eta=0.1, alpha=0.7, combine_terms=False)
    parts = obj(logits, y)
    loss = parts["loss"]
    nll = expected_nll(logits, y)
    expected = nll + 0.5 * (2.0 + 300.0 / 100) + 0.1 * 0.5 + 0.7 * 4.0
    torch.testing.assert_close(loss, expected)
    assert set(parts) == {"nll", "kl_seq", "kl_global", "ksvd", "cgp", "beta", "alpha", "loss"}
    # the peer scaling adds every KL undivided
    loss_peer = DeepGPELBO(_Terms(terms), 100, beta=0.5, eta=0.1, alpha=0.7, kl_scaling="peer")(logits, y)
    torch.testing.assert_close(loss_peer - loss, torch.tensor(0.5 * 300.0 * (1 - 1 / 100), dtype=torch.float64))


def test_baselines_have_zero_extra_terms():
    logits, y = _logits()
    parts = DeepGPELBO(_Terms({}), 10, combine_terms=False)(logits, y)
    torch.testing.assert_close(parts["loss"], parts["nll"])
    assert not {"kl_seq", "kl_global", "ksvd", "cgp"} & set(parts)  # absent, not reported as 0


def test_annealing_ramps_linearly():
    logits, y = _logits()
    terms = {"kl_seq": torch.tensor(1.0, dtype=torch.float64), "cgp": torch.tensor(1.0, dtype=torch.float64)}
    ramps = dict(beta=2.0, beta_anneal_steps=10, alpha=1.0, alpha_anneal_steps=4)
    obj = DeepGPELBO(_Terms(terms), 1, combine_terms=False, **ramps)
    nll = expected_nll(logits, y)
    for step, beta, alpha in ((0, 0.0, 0.0), (5, 1.0, 1.0), (2, 0.4, 0.5), (20, 2.0, 1.0)):
        parts = obj(logits, y, step=step)
        loss = parts["loss"]
        assert math.isclose(float(parts["beta"]), beta) and math.isclose(float(parts["alpha"]), alpha)
        torch.testing.assert_close(loss, nll + beta + alpha)


def test_gradient_reaches_terms():
    logits, y = _logits()
    kl = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    loss = DeepGPELBO(_Terms({"kl_global": kl}), 50, beta=1.0)(logits, y)
    loss.backward()
    assert math.isclose(float(kl.grad), 1 / 50)


def test_errors():
    logits, y = _logits()
    with pytest.raises(ValueError, match="num_data"):
        DeepGPELBO(_Terms({}), 0)
    with pytest.raises(ValueError, match="kl_scaling"):
        DeepGPELBO(_Terms({}), 5, kl_scaling="sum")
    with pytest.raises(ValueError, match="likelihood"):
        DeepGPELBO(_Terms({}), 5, likelihood="mode")
    with pytest.raises(ValueError, match="unknown loss terms"):
        DeepGPELBO(_Terms({"kl": torch.tensor(1.0)}), 5)(logits, y)
    with pytest.raises(ValueError, match=r"\(B, P, C\)"):
        expected_nll(logits[:, 0], y)
    C = logits.shape[-1]
    for bad in (torch.full_like(y, C), torch.full_like(y, -1)):  # torch said only "Target 5 is out of bounds"
        for likelihood in ("expected", "predictive"):
            # a value check (it reads the device): with validation on
            with gpattn.validation(), pytest.raises(ValueError, match=rf"labels must lie in \[0, C={C}\)"):
                expected_nll(logits, bad, likelihood)
    with pytest.raises(ValueError, match="integer dtype"):
        expected_nll(logits, y.float())
    torch.testing.assert_close(expected_nll(logits, y.int()), expected_nll(logits, y))


# ----------------------------------------------------------------------------- the MLL idiom on a model
def _mixed_model(seed=0):
    """Three GP layers whose terms cover every library kind: sgpa-decoupled in the paper's form (kl_seq,
    kl_global; the attention prior mean has no kl_seq), kep-svgp (kl_global, ksvd), cgp (cgp); float64,
    after one forward."""
    torch.manual_seed(seed)
    model = TransformerClassifier(
        3, vocab_size=30, embed_dim=16, num_heads=2, num_layers=3, attention="sgpa-decoupled", dropout=0.0,
        attention_options={"prior_mean": "zero"},
    )  # fmt: skip
    model.encoder.blocks[1].attn = gpattn.build_attention("kep-svgp", 16, 2, rank=3, num_landmarks=5)
    model.encoder.blocks[2].attn = gpattn.build_attention("cgp", 16, 2)
    model = model.double()
    ids = torch.randint(1, 30, (4, 7))
    mask = torch.zeros(4, 7, dtype=torch.bool)
    mask[0, 5:] = True
    logits = model(ids, mask, num_samples=2)
    return model, logits, torch.tensor([0, 1, 2, 0])


def test_layers_register_their_terms_as_gpytorch_added_loss_terms():
    model, _, _ = _mixed_model()
    named = dict(model.named_added_loss_terms())
    kinds = {path: type(term) for path, term in named.items()}
    assert kinds == {
        "encoder.blocks.0.attn.kl_seq": SequenceKL,
        "encoder.blocks.0.attn.kl_global": GlobalKL,
        "encoder.blocks.1.attn.kl_global": GlobalKL,
        "encoder.blocks.1.attn.ksvd": KSVDLoss,
        "encoder.blocks.2.attn.cgp": CGPRegulariser,
    }
    assert all(isinstance(t, AddedLossTerm) for t in model.added_loss_terms())
    # the dict view (layer.loss_terms(), model.loss_terms()) is the same terms, by name
    for layer in model.encoder.attention_modules():
        own = {t.name: t.loss() for t in layer.added_loss_terms()}
        assert layer.loss_terms().keys() == own.keys()
        for key in own:
            assert layer.loss_terms()[key] is own[key]
    # every forward starts from no terms (a fresh registry, so a compiled forward reads none of the last one's):
    # an empty batch reports none and walkers find none on the layer
    cgp = model.encoder.blocks[2].attn
    cgp(torch.zeros(0, 4, 16, dtype=torch.float64))
    assert cgp.loss_terms() == {} and list(cgp.added_loss_terms()) == []
    model(torch.randint(1, 30, (2, 7)))
    # a copy (deepcopy / pickle: checkpoints of a model after a forward) keeps the registrations, not the graphs
    twin = copy.deepcopy(model)
    assert list(twin.added_loss_terms()) == [] and twin.loss_terms() == {}
    assert list(twin.encoder.blocks[2].attn._added_loss_terms) == ["cgp"]


def test_mll_objective_is_math_9_on_the_models_terms():
    model, logits, y = _mixed_model()
    t = model.loss_terms()
    assert set(t) == {"kl_seq", "kl_global", "ksvd", "cgp"}
    N, beta, eta, alpha = 100, 0.5, 0.1, 0.7
    nll = expected_nll(logits, y)
    expected = nll + beta * (t["kl_seq"] + t["kl_global"] / N) + eta * t["ksvd"] + alpha * t["cgp"]
    loss = DeepGPELBO(model, N, beta=beta, eta=eta, alpha=alpha)(logits, y)
    torch.testing.assert_close(loss, expected)
    parts = DeepGPELBO(model, N, beta=beta, eta=eta, alpha=alpha, combine_terms=False)(logits, y)
    assert list(parts) == ["nll", "kl_seq", "kl_global", "ksvd", "cgp", "beta", "alpha", "loss"]
    for key in t:  # each term separately, unweighted, summed over layers
        torch.testing.assert_close(parts[key], t[key])
    torch.testing.assert_close(parts["loss"], expected)
    # peer scaling, annealing and the default alpha go through the same weights
    peer = DeepGPELBO(model, N, beta=beta, eta=eta, alpha=alpha, kl_scaling="peer")(logits, y)
    torch.testing.assert_close(peer - loss, beta * t["kl_global"] * (1 - 1 / N))
    ramp = DeepGPELBO(model, N, beta=beta, beta_anneal_steps=4, alpha=alpha, alpha_anneal_steps=2, eta=eta)
    torch.testing.assert_close(ramp(logits, y, step=0), nll + eta * t["ksvd"])
    assert DeepGPELBO(model, N).alpha == gpattn.objectives.DEFAULT_ALPHA


def test_registered_prior_changes_the_loss_by_exactly_its_log_density():
    """A user's kernel prior (gpytorch ``register_prior``) enters as −log p(θ) / N, as GPyTorch's MLLs
    divide it: with N = 1 the loss moves by exactly −log p(θ)."""
    model, logits, y = _mixed_model()
    kernel = model.encoder.blocks[0].attn.kernel
    for N in (1, 250):
        objective = DeepGPELBO(model, N, combine_terms=False)
        before = objective(logits, y)
        assert "log_prior" not in before
        prior = gpytorch.priors.GammaPrior(3.0, 6.0).double()
        kernel.register_prior("lengthscale_prior", prior, lambda m: m.lengthscale)
        after = objective(logits, y)
        log_density = prior.log_prob(kernel.lengthscale).sum()
        torch.testing.assert_close(after["log_prior"], log_density)
        torch.testing.assert_close(after["loss"] - before["loss"], -log_density / N, rtol=0, atol=1e-12)
        assert log_density.abs() > 1  # not a vacuous check
        del kernel._priors["lengthscale_prior"]


class _GPyTorchTerm(AddedLossTerm):
    """An added loss term of GPyTorch's own kind (no gpattn weight rule)."""

    def __init__(self, value):
        self.value = value

    def loss(self):
        return self.value


class _Noise(gpytorch.Module):
    def __init__(self):
        super().__init__()
        self.register_added_loss_term("noise_penalty")

    def forward(self, x):
        self.update_added_loss_term("noise_penalty", _GPyTorchTerm(x.square().mean()))
        return x


def test_gpytorch_added_loss_terms_anywhere_in_the_model_are_summed_with_weight_one():
    model, logits, y = _mixed_model()
    model.extra = _Noise()
    model.extra(torch.full((3,), 2.0, dtype=torch.float64))
    base = DeepGPELBO(model, 100)
    parts = DeepGPELBO(model, 100, combine_terms=False)(logits, y)
    torch.testing.assert_close(parts["noise_penalty"], torch.tensor(4.0, dtype=torch.float64))
    del model.extra
    torch.testing.assert_close(parts["loss"] - base(logits, y), torch.tensor(4.0, dtype=torch.float64))


# ----------------------------------------------------------------------------- a new regulariser: one class
class ToySmoothness(GPLossTerm):
    """A regulariser declared the way a layer's file declares one: a name and a weight rule (here its
    own weight γ, e.g. a layer option), nothing else anywhere."""

    name = "toy_smoothness"

    def __init__(self, value, gamma=0.25):
        super().__init__(value)
        self.gamma = gamma

    def weight(self, weights):
        return self.gamma


class _ToyAttention(SoftmaxAttention):
    def _attend(self, call):
        heads = super()._attend(call)
        self.set_loss_terms(ToySmoothness(call.batch_mean(heads.square().mean((1, 2, 3))), gamma=0.25))
        return heads


def _with_toy_layer(model):
    block = model.encoder.blocks[0]
    block.attn = _ToyAttention(block.attn.embed_dim, block.attn.num_heads)
    return model


def test_a_new_regulariser_reaches_the_loss_parts():
    torch.manual_seed(0)
    model = _with_toy_layer(TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, num_layers=2))
    logits = model(torch.randint(1, 30, (3, 5)))
    y = torch.tensor([0, 1, 1])
    parts = DeepGPELBO(model, 10, combine_terms=False)(logits, y)
    toy = model.encoder.blocks[0].attn.loss_terms()["toy_smoothness"]
    assert set(parts) == {"nll", "toy_smoothness", "beta", "alpha", "loss"} and float(toy.detach()) > 0
    torch.testing.assert_close(parts["toy_smoothness"], toy)
    torch.testing.assert_close(parts["loss"], parts["nll"] + 0.25 * toy)
    # a module holding the term by name gives the same loss
    torch.testing.assert_close(DeepGPELBO(_Terms({"toy_smoothness": toy}), 10)(logits, y), parts["loss"])


def test_a_new_regulariser_reaches_the_trainers_history_and_the_cli(tmp_path, monkeypatch, capsys):
    from gpattn.experiments import training
    from gpattn.experiments.cli import _print_loss_parts

    build = training.build_model
    monkeypatch.setattr(training, "build_model", lambda cfg, bundle: _with_toy_layer(build(cfg, bundle)))
    cfg = training.TrainConfig(
        dataset="digits", attention="softmax", epochs=1, embed_dim=16, num_heads=2, num_layers=1, batch_size=256,
        patch_size=4, num_samples=1, progress=False,
    )  # fmt: skip
    with warnings.catch_warnings():  # one epoch of a tiny model may sit at the base rate: not the point here
        warnings.simplefilter("ignore", GPCollapseWarning)
        training.train(cfg, tmp_path)
    last = json.loads((tmp_path / "history.json").read_text())[-1]
    assert last["train"]["toy_smoothness"] > 0 and last["toy_smoothness"] > 0
    assert set(last["train"]) == {"nll", "toy_smoothness", "beta", "alpha", "loss"}
    _print_loss_parts(tmp_path)
    assert f"toy_smoothness {last['train']['toy_smoothness']:.4g}" in capsys.readouterr().out


def test_term_kinds_and_objective_errors():
    with pytest.raises(TypeError, match="is taken by"):
        type("AnotherKL", (GPLossTerm,), {"name": "kl_seq", "weight": lambda self, w: 1.0})
    with pytest.raises(TypeError, match="must be an identifier other than"):
        type("Bad", (GPLossTerm,), {"name": "loss", "weight": lambda self, w: 1.0})
    with pytest.raises(ValueError, match=r"value must be a 0-dim tensor .* got shape \(2,\)"):
        SequenceKL(torch.ones(2))
    layer = gpattn.build_attention("softmax", 8, 2)
    with pytest.raises(ValueError, match="set_loss_terms takes gpattn.objectives.GPLossTerm"):
        layer.set_loss_terms(_GPyTorchTerm(torch.zeros(())))
    with pytest.raises(ValueError, match="unknown loss terms"):
        layer.set_loss_terms(kl=torch.zeros(()))
    with pytest.raises(ValueError, match="model must be the torch.nn.Module"):
        DeepGPELBO({"kl_seq": 1.0}, 10)
    with pytest.raises(ValueError, match="combine_terms must be True"):
        DeepGPELBO(layer, 10, combine_terms="no")
    with pytest.raises(ValueError, match="num_data"):
        DeepGPELBO(layer, 0)


# ----------------------------------------------------------------------------- a new weight: by name, no edit elsewhere
@pytest.fixture
def toy_weighted():
    """A term with its own annealed weight ``toy_gamma`` (default 0.5), declared here only; unregistered after
    the test (an annealed weight is reported in every objective's parts while it is registered)."""
    gamma = TermWeight("toy_gamma", 0.5, anneals=True)
    kind = type("ToyWeighted", (GPLossTerm,), {"name": "toy_weighted", "weight_of": gamma, "__module__": __name__})
    yield kind
    del GPLossTerm._kinds["toy_weighted"], GPLossTerm._weights["toy_gamma"]


def test_the_library_weights_are_declared_by_their_terms():
    assert {name: (w.default, w.anneals) for name, w in term_weights().items()} == {
        "beta": (1.0, True), "eta": (0.1, False), "alpha": (gpattn.objectives.DEFAULT_ALPHA, True),
    }  # fmt: skip
    weights = DeepGPELBO(torch.nn.Linear(1, 1), 10, beta=0.5).weights(step=None)
    assert dict(weights) == {"beta": 0.5, "eta": 0.1, "alpha": gpattn.objectives.DEFAULT_ALPHA}
    assert weights.beta == weights["beta"] == 0.5 and weights.kl_divisor == 10


def test_a_new_weight_is_taken_by_name(toy_weighted):
    logits, y = _logits()
    module = _Terms({"toy_weighted": torch.tensor(2.0, dtype=torch.float64)})
    nll = expected_nll(logits, y)
    parts = DeepGPELBO(module, 10, combine_terms=False)(logits, y)
    assert list(parts) == ["nll", "toy_weighted", "beta", "alpha", "toy_gamma", "loss"]
    torch.testing.assert_close(parts["loss"], nll + 0.5 * 2.0)  # its default
    objective = DeepGPELBO(module, 10, toy_gamma=3.0, toy_gamma_anneal_steps=4)
    assert objective.toy_gamma == 3.0 and objective.toy_gamma_anneal_steps == 4
    torch.testing.assert_close(objective(logits, y, step=2), nll + 1.5 * 2.0)  # annealed like beta and alpha
    torch.testing.assert_close(objective(logits, y), nll + 3.0 * 2.0)
    with pytest.raises(TypeError, match=r"unknown settings \['gama'\].*toy_gamma"):
        DeepGPELBO(module, 10, gama=1.0)
    with pytest.raises(ValueError, match="toy_gamma must be >= 0"):
        DeepGPELBO(module, 10, toy_gamma=-1.0)
    with pytest.raises(TypeError, match="'toy_gamma' is declared as"):  # one declaration per weight name
        type("Other", (GPLossTerm,), {"name": "toy_other", "weight_of": TermWeight("toy_gamma", 1.0)})
    with pytest.raises(TypeError, match="needs a weight"):
        type("Unweighted", (GPLossTerm,), {"name": "toy_unweighted"})
    with pytest.raises(TypeError, match="must be an identifier other than"):  # a term may not take a weight's name
        type("Clash", (GPLossTerm,), {"name": "toy_gamma", "weight_of": TermWeight("toy_gamma", 0.5, anneals=True)})


def test_a_new_weight_reaches_the_config_and_the_cli(toy_weighted, tmp_path, monkeypatch):
    from gpattn.experiments import training
    from gpattn.experiments.cli import main

    class _Weighted(SoftmaxAttention):
        def _attend(self, call):
            heads = super()._attend(call)
            self.set_loss_terms(toy_weighted(call.batch_mean(heads.square().mean((1, 2, 3)))))
            return heads

    def build(cfg, bundle, _build=training.build_model):
        model = _build(cfg, bundle)
        block = model.encoder.blocks[0]
        block.attn = _Weighted(block.attn.embed_dim, block.attn.num_heads)
        return model

    monkeypatch.setattr(training, "build_model", build)
    argv = ["train", "--dataset", "digits", "--attention", "softmax", "--epochs", "1", "--embed-dim", "16",
            "--num-heads", "2", "--num-layers", "1", "--batch-size", "256", "--num-samples", "1", "--no-progress",
            "--loss-weight", "toy_gamma=0.25", "--out", str(tmp_path)]  # fmt: skip
    with warnings.catch_warnings():  # one epoch of a tiny model may sit at the base rate: not the point here
        warnings.simplefilter("ignore", GPCollapseWarning)
        assert main(argv) == 0
    assert json.loads((tmp_path / "config.json").read_text())["loss_weights"] == {"toy_gamma": 0.25}
    last = json.loads((tmp_path / "history.json").read_text())[-1]["train"]
    assert last["toy_gamma"] == 0.25 and last["toy_weighted"] > 0
    assert math.isclose(last["loss"], last["nll"] + 0.25 * last["toy_weighted"], rel_tol=1e-5)
    with pytest.raises(ValueError, match="free of beta, which have their own settings"):
        training.TrainConfig(loss_weights={"beta": 2.0})
    with pytest.raises(ValueError, match=r"loss_weights\['toy_gamma'\] \(--loss-weight\) must be a finite number"):
        training.TrainConfig(loss_weights={"toy_gamma": -1.0})

