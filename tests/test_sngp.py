"""SNGP (Liu et al. 2020; gpattn.experiments.sngp, docs/derivations.md §14): the Laplace covariance against a dense
float64 computation, the mean-field logits against their formula, their limits and Monte-Carlo, the spectral bound,
the random features against the RBF kernel, distance awareness on a toy problem, and ``softmax+sngp`` in compare."""

import json
import math

import gpytorch
import pytest
import torch
import torch.nn as nn

from gpattn.experiments import compare as C
from gpattn.experiments import sngp as S
from gpattn.experiments.training import TrainConfig, load_run_with_data, predict, train
from gpattn.models import ViTClassifier
from gpattn.objectives import DeepGPELBO


def _head(D=6, C=3, DL=40, seed=0, **kw):
    torch.manual_seed(seed)
    head = S.RandomFeatureGP(D, C, num_features=DL, **kw)
    with torch.no_grad():  # a trained-looking β: probabilities away from 1/C, so the weights p(1-p) differ
        head.output.weight.normal_(0.0, 3.0)
        head.output.bias.normal_(0.0, 1.0)
    return head


# ----------------------------------------------------------------------------- the Laplace covariance
def test_precision_accumulated_in_batches_is_the_dense_laplace_precision():
    head = _head(ridge=2.5).double()  # float64 throughout: the features of a batch equal those of the whole
    h = torch.randn(50, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    head.fit(h.split(7))  # batches of 7: the accumulation over batches
    assert int(head.num_fitted) == 50
    # dense float64: Σ⁻¹ = s I + Σ_i p_i(1 − p_i) φ_i φ_iᵀ, p_i the predicted class's probability
    phi = head.features(h).double()
    W, b = head.output.weight.double(), head.output.bias.double()
    p = torch.softmax(phi @ W.T + b, -1).max(-1).values
    precision = 2.5 * torch.eye(40, dtype=torch.float64) + phi.T @ torch.diag(p * (1 - p)) @ phi
    assert isinstance(head.posterior, S.CholeskyPosterior)  # N = 50 ≥ D_L/2: the dense form
    L = head.posterior.factor
    torch.testing.assert_close(L @ L.T, precision, rtol=1e-12, atol=1e-12)
    # the head's variance (triangular solve with the factor) against the explicit inverse and a direct solve
    query = head.features(torch.randn(9, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    by_inverse = ((query @ torch.linalg.inv(precision)) * query).sum(-1)
    by_solve = (query * torch.linalg.solve(precision, query.T).T).sum(-1)
    torch.testing.assert_close(head.variance(query), by_inverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(head.variance(query), by_solve, rtol=1e-10, atol=1e-12)
    # a refit starts from the prior (it does not add to the previous precision)
    head.fit(h)
    torch.testing.assert_close(head.posterior.factor @ head.posterior.factor.T, precision, rtol=1e-12, atol=1e-12)


def test_unfitted_head_uses_the_prior_covariance_and_fitting_shrinks_the_variance():
    head = _head(ridge=4.0).eval()
    phi = head.features(torch.randn(5, 6)).double()
    torch.testing.assert_close(head.variance(phi), (phi * phi).sum(-1) / 4.0)  # Σ = I/s before any data
    before = head.variance(phi)
    head.fit(torch.randn(200, 6))
    assert bool((head.variance(phi) < before).all())


def test_laplace_weights_are_the_binary_logistic_curvature_for_two_classes():
    logits = torch.tensor([[0.3, -1.2], [2.0, 2.0], [-4.0, 1.0]], dtype=torch.float64)
    d = logits[:, 0] - logits[:, 1]  # two classes: softmax = sigmoid of the difference, curvature σ(d)(1 − σ(d))
    torch.testing.assert_close(S.laplace_weights(logits), torch.sigmoid(d) * torch.sigmoid(-d))


# ----------------------------------------------------------------------------- the mean-field logits
def test_mean_field_logits_formula_and_the_zero_variance_limit():
    g = torch.Generator().manual_seed(0)
    logits, var = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.rand(7, generator=g, dtype=torch.float64)
    expected = logits / torch.sqrt(1 + math.pi / 8 * var)[:, None]
    torch.testing.assert_close(S.mean_field_logits(logits, var), expected)
    torch.testing.assert_close(S.mean_field_logits(logits, torch.zeros(7, dtype=torch.float64)), logits)
    assert S.MEAN_FIELD_FACTOR == math.pi / 8
    # the head in eval mode: its MAP logits adjusted by its own variance; in train mode the MAP logits
    head = _head()
    h = torch.randn(5, 6)
    head.fit(torch.randn(30, 6))
    map_logits = head.train()(h)
    phi = head.features(h)
    torch.testing.assert_close(head.eval()(h), S.mean_field_logits(map_logits, head.variance(phi).float()))
    assert not torch.allclose(head(h), map_logits)
    head.mean_field_factor = 0.0  # λ = 0: the MAP logits in eval mode too
    torch.testing.assert_close(head(h), map_logits)


@pytest.mark.parametrize("mean,var", [(-3.0, 0.5), (-1.0, 2.0), (0.5, 1.0), (2.0, 4.0), (3.0, 0.1)])
def test_mean_field_matches_monte_carlo_for_one_gaussian_logit(mean, var):
    """Where the probit approximation holds (one Gaussian logit f ~ N(m, v) against a fixed 0: the binary
    logistic), softmax of the mean-field logits is E[sigmoid(f)] to within 0.02 (Monte-Carlo error ~1e-3)."""
    g = torch.Generator().manual_seed(0)
    f = mean + math.sqrt(var) * torch.randn(400_000, generator=g, dtype=torch.float64)
    mc = torch.sigmoid(f).mean()
    logits = torch.tensor([[mean, 0.0]], dtype=torch.float64)
    approx = torch.softmax(S.mean_field_logits(logits, torch.tensor([var], dtype=torch.float64)), -1)[0, 0]
    assert abs(float(approx - mc)) < 0.02
    plain = torch.sigmoid(torch.tensor(mean, dtype=torch.float64))
    assert abs(float(approx - mc)) < abs(float(plain - mc)) or abs(mean) < 1  # better than ignoring the variance


# ----------------------------------------------------------------------------- spectral normalisation
def test_spectral_bound_after_power_iterations_and_small_weights_untouched():
    torch.manual_seed(0)
    big = nn.Linear(12, 20)
    with torch.no_grad():
        big.weight.mul_(10.0)
    S.spectral_normalise(big, bound=0.7)
    for _ in range(20):  # training-mode forwards: one power iteration each
        big(torch.randn(3, 12))
    sigma = torch.linalg.matrix_norm(big.weight.detach(), 2)
    assert float(sigma) <= 0.7 * (1 + 1e-4)
    assert float(sigma) >= 0.7 * (1 - 1e-3)  # the bound is reached: W·c/σ̂ with σ̂ converged
    small = nn.Linear(12, 20)
    with torch.no_grad():
        small.weight.mul_(0.01)
    before = small.weight.detach().clone()
    S.spectral_normalise(small, bound=0.7)
    torch.testing.assert_close(small.weight.detach(), before)  # σ < c: W · min(1, c/σ̂) = W
    small(torch.randn(2, 12)).sum().backward()
    assert small.parametrizations.weight.original.grad is not None
    with pytest.raises(ValueError, match="parametrised already"):
        S.spectral_normalise(small)
    with pytest.raises(ValueError, match="bound"):
        S.spectral_normalise(nn.Linear(2, 2), bound=0.0)


def test_apply_sngp_normalises_every_block_linear_and_swaps_the_head():
    torch.manual_seed(0)
    model = ViTClassifier(3, image_shape=(1, 8, 8), patch_size=4, embed_dim=16, num_heads=2, num_layers=2,
                          pooling="cls")
    S.apply_sngp(model, spectral_bound=0.5, num_features=32)
    block_linears = [m for m in model.encoder.blocks.modules() if isinstance(m, nn.Linear)]
    assert len(block_linears) == 2 * 4  # per block: attention in/out projections, FFN's two layers
    assert all(torch.nn.utils.parametrize.is_parametrized(m, "weight") for m in block_linears)
    others = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith("encoder.blocks")]
    assert not any(torch.nn.utils.parametrize.is_parametrized(m, "weight") for m in others)
    assert isinstance(model.head, S.RandomFeatureGP) and model.head.output.out_features == 3
    x = torch.randn(4, 1, 8, 8)
    for _ in range(60):  # σ̂ (power iteration) is a lower bound of σ_max, tight once the iteration has converged
        model.train()(x)
    assert max(float(torch.linalg.matrix_norm(m.weight.detach(), 2)) for m in block_linears) <= 0.5 * (1 + 1e-3)
    assert model.eval()(x, num_samples=3).shape == (4, 3, 3)
    with pytest.raises(ValueError, match="gpattn classifier"):
        S.apply_sngp(nn.Linear(2, 2))


def test_the_beta_prior_is_in_the_training_objective():
    """The MAP objective the Laplace step expands: mean cross-entropy + s‖β‖²/(2N) (the prior N(0, s⁻¹ I))."""
    head = _head(ridge=3.0)
    model = nn.Sequential(head)
    logits = model(torch.randn(4, 6)).unsqueeze(1)
    labels = torch.tensor([0, 1, 2, 0])
    parts = DeepGPELBO(model, 10, combine_terms=False)(logits, labels)
    beta = head.output.weight
    normal = torch.distributions.Normal(0.0, 1 / math.sqrt(3.0))
    torch.testing.assert_close(parts["log_prior"], normal.log_prob(beta).sum())
    (grad,) = torch.autograd.grad(parts["loss"] - parts["nll"], beta)
    torch.testing.assert_close(grad, 3.0 * beta.detach() / 10)  # d/dβ of s‖β‖²/(2N)


# ----------------------------------------------------------------------------- the random features
def test_random_features_approximate_the_rbf_kernel():
    torch.manual_seed(0)
    head = S.RandomFeatureGP(3, 2, num_features=2000, lengthscale=1.7, input_norm=False)  # Monte-Carlo sd ≈ 0.016
    x = torch.randn(6, 3, dtype=torch.float64)
    phi = head.features(x.float()).double()
    rbf = gpytorch.kernels.RBFKernel()
    rbf.lengthscale = 1.7
    with torch.no_grad():
        exact = rbf(x).to_dense()
    torch.testing.assert_close(phi @ phi.T, exact, atol=0.06, rtol=0)


# ----------------------------------------------------------------------------- distance awareness
class _ResNet(nn.Module):
    """A residual MLP on 2-D inputs: SNGP's toy body (spectral-normalised residual branches) or a plain one."""

    def __init__(self, sngp: bool, width: int = 64):
        super().__init__()
        self.inp = nn.Linear(2, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)) for _ in range(2)
        )
        if sngp:
            for m in self.blocks.modules():
                if isinstance(m, nn.Linear):
                    S.spectral_normalise(m, 0.95)
        self.head = (
            S.RandomFeatureGP(width, 2, num_features=512, lengthscale=1.0, input_norm=False)
            if sngp else nn.Linear(width, 2)
        )

    def hidden(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return h

    def forward(self, x):
        return self.head(self.hidden(x))


def _clusters(g, n):
    y = torch.arange(n) % 2
    x = torch.randn(n, 2, generator=g) * 0.5
    x[:, 0] += torch.where(y == 1, 2.0, -2.0)
    return x, y


def _trained(sngp: bool, x, y):
    torch.manual_seed(0)
    net = _ResNet(sngp)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    objective = DeepGPELBO(net, len(y))  # cross-entropy, plus the β prior of the GP head
    for _ in range(300):
        opt.zero_grad()
        objective(net(x).unsqueeze(1), y).backward()
        opt.step()
    return net.eval()


def _entropy(logits):
    p = torch.softmax(logits, -1)
    return -(p * p.clamp_min(1e-12).log()).sum(-1)


def test_distance_awareness_on_two_clusters():
    """Trained on two clusters at (±2, 0): far from them (a circle of radius 8) SNGP's predictive is near uniform
    and its variance near the prior's, while a plain softmax head on the same body stays confident."""
    g = torch.Generator().manual_seed(0)
    x, y = _clusters(g, 200)
    x_test, y_test = _clusters(g, 100)
    angle = torch.linspace(0, 2 * math.pi, 33)[:-1]
    far = 8 * torch.stack([angle.cos(), angle.sin()], 1)
    sngp = _trained(True, x, y)
    with torch.no_grad():
        sngp.head.fit(sngp.hidden(x))
        assert float((sngp(x_test).argmax(-1) == y_test).float().mean()) > 0.95
        entropy_in, entropy_far = _entropy(sngp(x_test)).mean(), _entropy(sngp(far)).mean()
        var_in = sngp.head.variance(sngp.head.features(sngp.hidden(x_test))).mean()
        var_far = sngp.head.variance(sngp.head.features(sngp.hidden(far))).mean()
    assert float(entropy_far) > 0.6 > 0.3 > float(entropy_in)  # log 2 = 0.69: uniform
    assert float(var_far) > float(var_in) + 0.2
    plain = _trained(False, x, y)
    with torch.no_grad():
        assert float((plain(x_test).argmax(-1) == y_test).float().mean()) > 0.95
        assert float(_entropy(plain(far)).mean()) < 0.05  # the softmax head: confident far from the data


# ----------------------------------------------------------------------------- the harness
TINY = dict(embed_dim=16, num_heads=2, num_layers=1, epochs=1, batch_size=32, lr=5e-3, pooling="mean",
            patch_size=4, num_samples=2, progress=False)


def test_specs_options_and_config_checks():
    spec = C.parse_variant("softmax+sngp+ts")
    assert spec.sngp and spec.ts and spec.run_name == "softmax+sngp"
    assert not C.parse_variant("softmax+ts").sngp
    assert "softmax+sngp" in C.BASELINES
    assert "softmax+sngp" in [s.spec for s in C.expand_variants("all+baselines")]
    with pytest.raises(ValueError, match="choose one"):
        C.parse_variant("softmax+sngp+laplace")
    with pytest.raises(ValueError, match=r"\+sngp"):
        C.parse_variant("softmax+sngpp")
    with pytest.raises(ValueError, match="unknown sngp options"):
        TrainConfig(sngp={"num_feature": 8})
    with pytest.raises(ValueError, match="ridge"):
        TrainConfig(sngp={"ridge": -1.0})
    assert TrainConfig(sngp={}, encoder="minilm").sngp == {}  # an encoder takes SNGP too (tests/test_sngp_encoder.py)
    with pytest.raises(ValueError, match="spectral_norm must be one of"):
        TrainConfig(sngp={"spectral_norm": "every"})
    assert S.check_sngp_options({"num_features": 8})["spectral_bound"] == S.SNGP_DEFAULTS["spectral_bound"]


def test_compare_softmax_and_sngp_end_to_end(tmp_path):
    base = TrainConfig(dataset="digits", **TINY)
    results = C.compare("softmax,softmax+sngp", [0], tmp_path, base, progress=False, log=lambda s: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved) == set(results) == {"softmax", "softmax+sngp"}
    for split in ("in_domain", "shift", "ood"):
        assert math.isfinite(saved["softmax+sngp"]["0"][split]["nll"] if split != "ood" else
                             saved["softmax+sngp"]["0"][split]["ood_auroc"])
    report = (tmp_path / "report.md").read_text()
    assert "| softmax+sngp |" in report and "`+sngp` = SNGP" in report
    folder = tmp_path / "runs" / "softmax+sngp" / "seed0"
    assert json.loads((folder / "config.json").read_text())["sngp"] == S.SNGP_DEFAULTS
    # the checkpoint holds the fitted covariance: a reloaded model predicts what the run evaluated
    cfg, model, bundle, _ = load_run_with_data(folder)
    assert isinstance(model.head, S.RandomFeatureGP)
    assert int(model.head.num_fitted) == len(bundle.splits["train"])
    saved_preds = torch.load(folder / "predictions.pt", weights_only=True)
    key = bundle.eval_splits["in_domain"]
    torch.testing.assert_close(predict(model, bundle.splits[key], cfg.num_samples), saved_preds[key]["logits"])
    # the same covariance from the public pass over the training data (in other batches)
    query = model.head.features(torch.randn(7, model.head.in_features, generator=torch.Generator().manual_seed(3)))
    before = model.head.variance(query)
    train = bundle.splits["train"]
    S.fit_covariance(model.train(), [(train.inputs[i : i + 100], None) for i in range(0, len(train), 100)])
    assert model.training  # its mode restored
    torch.testing.assert_close(model.head.variance(query), before, rtol=1e-6, atol=1e-8)


@pytest.mark.filterwarnings("ignore::gpattn.experiments.diagnostics.GPCollapseWarning")  # one tiny epoch
def test_interrupted_sngp_run_resumes_to_the_uninterrupted_result(tmp_path):
    """The spectral norm's power-iteration vectors and the GP head are in the checkpoint: a run stopped mid-epoch and
    resumed ends with the predictions (and covariance) of an uninterrupted one."""
    cfg = TrainConfig(dataset="digits", embed_dim=8, num_heads=2, num_layers=1, epochs=1, batch_size=64,
                      num_samples=1, pooling="cls", patch_size=4, progress=False,
                      sngp={**S.SNGP_DEFAULTS, "num_features": 64})
    full = train(cfg, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "cut", stop_after_steps=5)
    resumed = train(cfg, tmp_path / "cut", resume=True)
    assert resumed == full
    a, b = (torch.load(tmp_path / d / "predictions.pt", weights_only=True) for d in ("full", "cut"))
    torch.testing.assert_close(a["test"]["logits"], b["test"]["logits"], rtol=0, atol=0)
