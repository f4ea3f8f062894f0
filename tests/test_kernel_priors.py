"""Kernel specs carry gpytorch priors on their hyper-parameters, through TrainConfig, config.json and the CLI;
their log density enters the objective. A layer that needs a stationary kernel refuses a non-stationary
kernel instance as it refuses a non-stationary spec."""

import json
import re

import pytest
import torch
from gpytorch.kernels import RBFKernel, ScaleKernel
from gpytorch.priors import GammaPrior, HalfCauchyPrior, LogNormalPrior, NormalPrior

from gpattn import build_attention
from gpattn.kernels import ExponentialKernel, kernel_spec, make_kernel
from gpattn.models import TransformerClassifier
from gpattn.objectives import DeepGPELBO

SPEC = {
    "name": "ard-rbf",
    "lengthscale_prior": {"name": "gamma", "concentration": 3.0, "rate": 6.0},
    "outputscale_prior": {"name": "lognormal", "loc": -4.0, "scale": 1.0},
}


def test_a_spec_builds_its_priors_where_gpytorch_keeps_them():
    kernel = make_kernel(SPEC, 2, 4)
    priors = {name: prior for name, _module, prior, *_ in kernel.named_priors()}
    assert set(priors) == {"outputscale_prior", "base_kernel.lengthscale_prior"}
    gamma, lognormal = priors["base_kernel.lengthscale_prior"], priors["outputscale_prior"]
    assert isinstance(gamma, GammaPrior) and float(gamma.concentration) == 3.0 and float(gamma.rate) == 6.0
    assert isinstance(lognormal, LogNormalPrior) and float(lognormal.loc) == -4.0 and float(lognormal.scale) == 1.0
    exp = make_kernel({"name": "exponential", "outputscale_prior": {"name": "halfcauchy", "scale": 2.0},
                       "lengthscale_prior": {"name": "normal", "loc": 1.0, "scale": 0.5}}, 2, 4)
    kinds = {name: type(p) for name, _module, p, *_ in exp.named_priors()}
    assert kinds == {"lengthscale_prior": NormalPrior, "outputscale_prior": HalfCauchyPrior}
    # the spec of a built kernel names its priors again (config.json and checkpoints store specs)
    again = kernel_spec(kernel)
    for key in ("lengthscale_prior", "outputscale_prior"):
        assert again[key] == SPEC[key]
    assert json.loads(json.dumps(again)) == again


def test_the_log_prior_enters_the_objective():
    """DeepGPELBO's ``log_prior`` is the priors' log density at the current hyper-parameters (recomputed
    here from the kernel's own values), and the loss subtracts it divided by N; its gradient reaches ℓ."""
    torch.manual_seed(0)
    model = TransformerClassifier(2, vocab_size=20, embed_dim=8, num_heads=2, num_layers=1, attention="sgpa",
                                  attention_options={"kernel": SPEC}, dropout=0.0)
    kernel = model.encoder.blocks[0].attn.kernel
    ids, y = torch.randint(1, 20, (4, 5)), torch.tensor([0, 1, 1, 0])
    logits = model(ids)
    objective = DeepGPELBO(model, 100, combine_terms=False)
    parts = objective(logits, y)
    ell, s2 = kernel.base_kernel.lengthscale, kernel.outputscale
    expected = (
        torch.distributions.Gamma(3.0, 6.0).log_prob(ell).sum()
        + torch.distributions.LogNormal(-4.0, 1.0).log_prob(s2).sum()
    )
    torch.testing.assert_close(parts["log_prior"], expected)
    kernel._priors.clear()  # the same forward's parts without the priors
    kernel.base_kernel._priors.clear()
    rest = objective(logits, y)
    assert "log_prior" not in rest
    torch.testing.assert_close(parts["loss"], rest["loss"] - parts["log_prior"] / 100)
    parts["log_prior"].backward()
    grad = kernel.base_kernel.raw_lengthscale.grad
    assert grad is not None and bool(grad.ne(0).any())


@pytest.mark.filterwarnings("ignore::gpattn.experiments.diagnostics.GPCollapseWarning")  # one epoch
def test_priors_reach_train_and_config_json_from_the_command_line(tmp_path):
    from gpattn.experiments.cli import main

    spec = json.dumps(SPEC).replace('"', "'")
    code = main(["train", "--dataset", "digits", "--attention", "sgpa", "--epochs", "1", "--embed-dim", "16",
                 "--num-heads", "2", "--num-layers", "1", "--no-progress", "--attention-option", f"kernel={spec}",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["attention_options"]["kernel"] == SPEC
    history = json.loads((tmp_path / "history.json").read_text())
    assert "log_prior" in history[-1]["train"], history[-1]["train"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"name": "ard-rbf", "lengthscale_prior": {"name": "beta", "a": 1}},
         "lengthscale_prior'] must be a prior spec"),
        ({"name": "ard-rbf", "lengthscale_prior": {"name": "gamma", "rate": 1.0}},
         "takes exactly ['concentration', 'rate']"),
        ({"name": "ard-rbf", "lengthscale_prior": {"name": "gamma", "concentration": -1.0, "rate": 1.0}}, "number > 0"),
        ({"name": "exponential", "outputscale_prior": {"name": "normal", "loc": "x", "scale": 1.0}}, "finite number"),
        ({"name": "canonical-rbf", "lengthscale_prior": {"name": "gamma", "concentration": 1.0, "rate": 1.0}},
         "unknown option(s) ['lengthscale_prior']"),
        ({"name": "sum", "kernels": ["ard-rbf", {"name": "matern", "lengthscale_prior": 2.0}]},
         "kernel['kernels'][1]['lengthscale_prior'] must be a prior spec"),
    ],
)
def test_bad_prior_specs_name_the_place(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        make_kernel(spec, 2, 4)


def test_a_stationary_layer_refuses_a_non_stationary_kernel_instance():
    """cgp / scgp check a kernel instance as they check a spec: κ(x, x) must be constant."""
    for name in ("cgp", "scgp"):
        with pytest.raises(ValueError, match="ExponentialKernel is not stationary"):
            build_attention(name, 8, 2, kernel=ExponentialKernel(ard_num_dims=4, batch_shape=torch.Size([2])))
        ok = ScaleKernel(RBFKernel(ard_num_dims=4, batch_shape=torch.Size([2])), batch_shape=torch.Size([2]))
        build_attention(name, 8, 2, kernel=ok)
    assert not ExponentialKernel(ard_num_dims=4).is_stationary
