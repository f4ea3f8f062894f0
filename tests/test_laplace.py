"""Last-layer Laplace (gpattn.experiments.laplace): the dense float64 back end against brute-force autograd
Hessians, Jacobians and the evidence formula written here; Monte-Carlo logits against their
analytic moments; the calibration effect far from the data; laplace-torch (the optional extra)
pinned to the dense reference. laplace-torch tests are skipped when it is not installed."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import gpattn.experiments.laplace as gl
from gpattn.experiments.data import Split
from gpattn.experiments.laplace import dense_ggn, extract_features, fit_last_layer_laplace
from gpattn.experiments.metrics import average_samples
from gpattn.models import TransformerClassifier, ViTClassifier

HAS_LAPLACE = importlib.util.find_spec("laplace") is not None
needs_laplace = pytest.mark.skipif(not HAS_LAPLACE, reason="laplace-torch (gpattn[laplace]) is not installed")


class FeatureModel(nn.Module):
    """The smallest gpattn-style classifier: inputs are the features, ``head`` is the last layer."""

    def __init__(self, D: int, C: int, dtype=torch.float64):
        super().__init__()
        self.head = nn.Linear(D, C, dtype=dtype)

    def forward(self, x, key_padding_mask=None, num_samples: int = 1):
        return self.head(x).unsqueeze(1).expand(-1, num_samples, -1)


def trained_toy(N=120, D=3, C=3, seed=0, steps=400, weight_decay=1e-3):
    """Gaussian blobs in D dims, a MAP head (cross-entropy + small weight decay, float64)."""
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(C, D, generator=g, dtype=torch.float64)
    y = torch.arange(N) % C
    X = centres[y] + torch.randn(N, D, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    model = FeatureModel(D, C)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model.head(X), y) + weight_decay * sum(
            (p**2).sum() for p in model.parameters()
        )
        loss.backward()
        return loss

    opt.step(closure)
    return model, Split(X, y, None)


def theta_of(model) -> torch.Tensor:
    return torch.cat([model.head.weight.detach().reshape(-1), model.head.bias.detach()]).double()


def logits_at(theta, X, C, D):
    W, b = theta[: C * D].reshape(C, D), theta[C * D :]
    return X.double() @ W.T + b


def brute_hessian(model, split) -> torch.Tensor:
    C, D = model.head.weight.shape
    loss = lambda t: nn.functional.cross_entropy(logits_at(t, split.inputs, C, D), split.labels, reduction="sum")  # noqa: E731
    return torch.autograd.functional.hessian(loss, theta_of(model))


def brute_evidence(model, split, lam: float) -> float:
    """log p(D|θ*) − λ/2 ||θ*||² + P/2 log λ − 1/2 log det(H + λI), with the autograd Hessian."""
    theta = theta_of(model)
    C, D = model.head.weight.shape
    loglik = -float(nn.functional.cross_entropy(logits_at(theta, split.inputs, C, D), split.labels, reduction="sum"))
    A = brute_hessian(model, split) + lam * torch.eye(len(theta), dtype=torch.float64)
    sign, logdet = torch.linalg.slogdet(A)
    assert sign > 0
    return loglik - 0.5 * lam * float(theta @ theta) + 0.5 * len(theta) * math.log(lam) - 0.5 * float(logdet)


def brute_moments(model, split, lam: float, X) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean f(θ*) and J Σ J^T with J from autograd and Σ applied by a linear solve."""
    theta = theta_of(model)
    C, D = model.head.weight.shape
    A = brute_hessian(model, split) + lam * torch.eye(len(theta), dtype=torch.float64)
    means, covs = [], []
    for x in X:
        J = torch.autograd.functional.jacobian(lambda t, x=x: logits_at(t, x.unsqueeze(0), C, D)[0], theta)  # (C, P)
        means.append(logits_at(theta, x.unsqueeze(0), C, D)[0])
        covs.append(J @ torch.linalg.solve(A, J.T))
    return torch.stack(means), torch.stack(covs)


# ----------------------------------------------------------------------------- dense back end
def test_dense_ggn_is_the_exact_hessian_of_the_last_layer():
    g = torch.Generator().manual_seed(1)
    model = FeatureModel(4, 3)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(3, 4, generator=g, dtype=torch.float64))
        model.head.bias.copy_(torch.randn(3, generator=g, dtype=torch.float64))
    split = Split(torch.randn(25, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (25,), generator=g), None)
    G = dense_ggn(split.inputs, model.head.weight.detach(), model.head.bias.detach())
    H = brute_hessian(model, split)
    torch.testing.assert_close(G, H, rtol=0, atol=1e-12)
    assert torch.equal(G, G.T)


def test_dense_posterior_moments_and_evidence_match_brute_force():
    model, split = trained_toy(N=60, D=3, C=3, seed=2)
    lam = 0.7
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=lam)
    assert la.prior_precision == lam and la.backend == "dense" and la.num_train == 60
    X = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 4
    mean, cov = la.predictive_moments(X)
    want_mean, want_cov = brute_moments(model, split, lam, X)
    torch.testing.assert_close(mean, want_mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cov, want_cov, rtol=1e-9, atol=1e-10)
    assert la.log_marginal_likelihood == pytest.approx(brute_evidence(model, split, lam), rel=1e-10)
    # a Split goes through the body (here the identity) and gives the same moments
    m2, c2 = la.predictive_moments(Split(X, torch.zeros(7, dtype=torch.int64), None))
    torch.testing.assert_close(c2, cov, rtol=0, atol=0)


def test_dense_marglik_maximises_the_evidence():
    model, split = trained_toy(N=90, D=2, C=3, seed=4)
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision="marglik")
    lam = la.prior_precision
    assert 1e-4 < lam < 1e4
    best = brute_evidence(model, split, lam)
    assert la.log_marginal_likelihood == pytest.approx(best, rel=1e-10)
    for factor in (0.3, 0.8, 0.98, 1.02, 1.25, 3.0):
        assert brute_evidence(model, split, lam * factor) <= best + 1e-9
    # stationary in log lambda: central difference of the evidence is ~0
    h = 1e-3
    slope = (brute_evidence(model, split, lam * math.exp(h)) - brute_evidence(model, split, lam * math.exp(-h))) / (
        2 * h
    )
    assert abs(slope) < 1e-4


def test_predict_logits_monte_carlo_moments():
    model, split = trained_toy(N=60, D=3, C=3, seed=5)
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=0.05)
    X = torch.tensor([[0.0, 0.0, 0.0], [4.0, -3.0, 1.0], [10.0, 10.0, -10.0]], dtype=torch.float64)
    P = 40000
    samples = la.predict_logits(X, num_samples=P, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (3, P, 3) and samples.dtype == torch.float32
    mean, cov = la.predictive_moments(X)
    s = samples.double()
    sd = cov.diagonal(dim1=1, dim2=2).sqrt()  # shape: (3, C)
    assert torch.all((s.mean(1) - mean).abs() <= 4.5 * sd / math.sqrt(P) + 1e-5)
    centred = s - s.mean(1, keepdim=True)
    emp = torch.einsum("npc,npk->nck", centred, centred) / (P - 1)
    scale = sd.unsqueeze(2) * sd.unsqueeze(1)  # |cov_ck| <= sd_c sd_k; the std of its estimate <= sqrt(2/P) of that
    assert torch.all((emp - cov).abs() <= 4.5 * math.sqrt(2.0 / P) * scale + 1e-5)
    again = la.predict_logits(X, num_samples=P, generator=torch.Generator().manual_seed(0))
    assert torch.equal(samples, again)
    probs = average_samples(samples[:, :100], average="probs")
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-6)
    assert (probs >= 0).all()


def test_predict_logits_continuous_in_the_covariance(monkeypatch):
    """The same generator gives nearby draws for nearby covariances: the factor must be a continuous
    function of the covariance. Binary heads give covariances [[a, b], [b, a]] whose eigenvectors are
    (1, ±1)/sqrt(2) with a sign LAPACK picks from rounding, so an eigenbasis flipped the draws of the
    same fitted model between 1 and 2 threads (measured on CoLA); a Cholesky factor does not."""
    model, split = trained_toy(N=60, D=3, C=2, seed=6)
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=1.0)
    g = torch.Generator().manual_seed(3)
    n = 256
    a = 0.1 + torch.rand(n, dtype=torch.float64, generator=g)
    b = a * (2 * torch.rand(n, dtype=torch.float64, generator=g) - 1) * 0.95
    cov = torch.stack([torch.stack([a, b], -1), torch.stack([b, a], -1)], -2)  # shape: (n, 2, 2)
    ulp = 1 + 4e-16 * (2 * torch.rand(n, 2, 2, dtype=torch.float64, generator=g) - 1)
    nudged = cov * 0.5 * (ulp + ulp.transpose(1, 2))
    mean = torch.zeros(n, 2, dtype=torch.float64)
    draws = []
    for c in (cov, nudged):
        monkeypatch.setattr(la, "predictive_moments", lambda inputs, c=c: (mean, c))
        draws.append(la.predict_logits(None, num_samples=4, generator=torch.Generator().manual_seed(0)).double())
    assert (draws[0] - draws[1]).abs().max() < 1e-5


def test_prior_precision_limits():
    model, split = trained_toy(N=60, D=3, C=3, seed=6)
    X = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    traces = []
    for lam in (1e-2, 1.0, 1e2):
        la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=lam)
        traces.append(la.predictive_moments(X)[1].diagonal(dim1=1, dim2=2).sum(1))
    assert torch.all(traces[0] > traces[1]) and torch.all(traces[1] > traces[2])
    # lambda -> infinity: Sigma -> I / lambda, so J Sigma J^T -> (|phi|^2 + 1) I / lambda; the mean is the MAP logits
    big = 1e9
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=big)
    mean, cov = la.predictive_moments(X)
    want = (X.pow(2).sum(1) + 1).view(-1, 1, 1) * torch.eye(3, dtype=torch.float64) / big
    torch.testing.assert_close(cov, want, rtol=1e-6, atol=1e-15)
    torch.testing.assert_close(mean, model.head(X).detach(), rtol=0, atol=1e-12)


def _far_from_data_check(la, model, split):
    direction = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    near = split.inputs[:40]
    far = torch.stack([a * direction for a in (10.0, 100.0, 1000.0)])
    gen = torch.Generator().manual_seed(11)
    p_map_far = torch.softmax(model.head(far).detach(), -1).max(-1).values
    p_la_far = torch.as_tensor(average_samples(la.predict_logits(far, 4000, generator=gen), "probs")).max(-1).values
    assert float(p_map_far[-1]) > 0.999999  # the MAP head is certain far away
    assert torch.all(p_la_far < p_map_far) and float(p_la_far[-1]) < 0.98
    var = la.predictive_moments(far)[1].diagonal(dim1=1, dim2=2).sum(1)
    assert var[1] > 50 * var[0] and var[2] > 50 * var[1]  # grows like |phi|^2
    var_near = la.predictive_moments(near)[1].diagonal(dim1=1, dim2=2).sum(1)
    assert float(var_near.max()) < float(var[0])
    # near the data the predictions keep the MAP decisions
    p_la_near = average_samples(la.predict_logits(near, 400, generator=gen), "probs")
    agree = (p_la_near.argmax(1) == model.head(near).detach().argmax(1).numpy()).mean()
    assert agree >= 0.95


def test_dense_uncertainty_grows_far_from_the_data():
    model, split = trained_toy(N=150, D=3, C=3, seed=8)
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full")
    _far_from_data_check(la, model, split)


# ----------------------------------------------------------------------------- features of gpattn models
@pytest.mark.parametrize("kind", ["text", "image"])
def test_extract_features_feed_the_head_of_gpattn_classifiers(kind):
    torch.manual_seed(0)
    if kind == "text":
        model = TransformerClassifier(3, vocab_size=30, max_len=12, embed_dim=16, num_heads=2, num_layers=2)
        lengths = torch.tensor([3, 12, 1, 7, 5, 9, 2])
        mask = torch.arange(12).unsqueeze(0) >= lengths.unsqueeze(1)
        ids = torch.randint(3, 30, (7, 12)).masked_fill(mask, 0)
        split = Split(ids, torch.randint(0, 3, (7,)), mask)
    else:
        model = ViTClassifier(3, image_shape=(1, 8, 8), patch_size=4, embed_dim=16, num_heads=2, num_layers=1)
        split = Split(torch.rand(7, 1, 8, 8), torch.randint(0, 3, (7,)), None)
    model.train()
    phi = extract_features(model, split, batch_size=3)  # batches of 3, 3, 1
    assert phi.shape == (7, 16) and model.training  # mode restored
    model.eval()
    with torch.no_grad():
        want = torch.cat(
            [
                model(split.inputs[i : i + 1], None if split.mask is None else split.mask[i : i + 1])[:, 0]
                for i in range(7)
            ]
        )
        torch.testing.assert_close(model.head(phi), want, rtol=1e-5, atol=1e-5)
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=1.0)
    logits = la.predict_logits(split, num_samples=4)
    assert logits.shape == (7, 4, 3) and torch.isfinite(logits).all()


def test_errors_name_the_argument():
    model, split = trained_toy(N=30, D=3, C=3, seed=9)
    with pytest.raises(ValueError, match="'head'"):
        fit_last_layer_laplace(nn.Sequential(nn.Linear(3, 3)), split, backend="dense", hessian_structure="full")
    for bad in (-1.0, 0.0, float("nan"), "mle", True):
        with pytest.raises(ValueError, match="prior_precision"):
            fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=bad)
    with pytest.raises(ValueError, match="hessian_structure"):
        fit_last_layer_laplace(model, split, hessian_structure="block")
    with pytest.raises(ValueError, match="hessian_structure='full'"):
        fit_last_layer_laplace(model, split, backend="dense", hessian_structure="kron")
    with pytest.raises(ValueError, match="backend"):
        fit_last_layer_laplace(model, split, backend="pytorch-laplace")
    with pytest.raises(ValueError, match="labels must lie in 0..2"):
        fit_last_layer_laplace(
            model, Split(split.inputs, split.labels + 1, None), backend="dense", hessian_structure="full"
        )
    with pytest.raises(ValueError, match="train_split"):
        fit_last_layer_laplace(model, split.inputs, backend="dense", hessian_structure="full")
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=1.0)
    with pytest.raises(ValueError, match="num_samples"):
        la.predict_logits(split, num_samples=0)
    with pytest.raises(ValueError, match=r"\(N, D=3\)"):
        la.predictive_moments(torch.zeros(4, 5, dtype=torch.float64))


def test_missing_laplace_torch_names_the_extra(monkeypatch):
    model, split = trained_toy(N=30, D=3, C=3, seed=10)

    def absent():
        raise ImportError("No module named 'laplace'")

    monkeypatch.setattr(gl, "_import_laplace", absent)
    assert not gl.laplace_torch_available()
    with pytest.raises(ImportError, match=r"gpattn\[laplace\].*pip install --no-deps laplace-torch==0\.3"):
        fit_last_layer_laplace(model, split)
    la = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full")  # needs nothing extra
    assert la.prior_precision > 0


# ----------------------------------------------------------------------------- laplace-torch
@needs_laplace
def test_laplace_torch_full_agrees_with_dense_reference():
    model, split = trained_toy(N=80, D=3, C=3, seed=12)
    X = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(13)) * 3
    for prior in (0.5, "marglik"):
        ref = fit_last_layer_laplace(model, split, backend="dense", hessian_structure="full", prior_precision=prior)
        lt = fit_last_layer_laplace(
            model, split, backend="laplace-torch", hessian_structure="full", prior_precision=prior
        )
        # laplace-torch 0.3 builds the full GGN as `linop @ torch.eye(P)` with a float32 identity: ~1e-8 relative
        G = dense_ggn(split.inputs, model.head.weight.detach(), model.head.bias.detach())
        torch.testing.assert_close(lt.posterior.H.double(), G, rtol=0, atol=1e-6 * float(G.abs().max()))
        assert lt.prior_precision == pytest.approx(ref.prior_precision, rel=1e-4)
        assert lt.log_marginal_likelihood == pytest.approx(ref.log_marginal_likelihood, rel=1e-6)
        m_ref, c_ref = ref.predictive_moments(X)
        m_lt, c_lt = lt.predictive_moments(X)
        torch.testing.assert_close(m_lt, m_ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(c_lt, c_ref, rtol=1e-4, atol=1e-6 * float(c_ref.abs().max()))
    assert "torchvision" not in sys.modules


@needs_laplace
def test_laplace_torch_kron_is_exact_for_a_single_example():
    """K-FAC of one example is exact on the weight block and on the bias block; laplace-torch keeps
    the two blocks apart, so its Kronecker GGN is the dense GGN with the W-b cross terms removed."""
    g = torch.Generator().manual_seed(14)
    model = FeatureModel(3, 4)
    split = Split(torch.randn(1, 3, generator=g, dtype=torch.float64), torch.tensor([2]), None)
    lt = fit_last_layer_laplace(model, split, hessian_structure="kron", prior_precision=1.0)
    G = dense_ggn(split.inputs, model.head.weight.detach(), model.head.bias.detach())
    P_w = 12
    G[:P_w, P_w:] = 0
    G[P_w:, :P_w] = 0
    torch.testing.assert_close(lt.posterior.H.to_matrix().double(), G, rtol=0, atol=1e-12)


@needs_laplace
def test_laplace_torch_kron_uncertainty_grows_far_from_the_data():
    model, split = trained_toy(N=150, D=3, C=3, seed=8)
    la = fit_last_layer_laplace(model, split)  # the defaults: laplace-torch, kron, marglik
    assert la.backend == "laplace-torch" and la.hessian_structure == "kron" and la.prior_precision > 0
    _far_from_data_check(la, model, split)
    mean, cov = la.predictive_moments(split.inputs[:20])
    torch.testing.assert_close(cov, cov.transpose(1, 2), rtol=0, atol=1e-12)
    assert float(torch.linalg.eigvalsh(cov).min()) > 0


@needs_laplace
def test_laplace_torch_on_a_text_classifier_with_padding():
    torch.manual_seed(15)
    model = TransformerClassifier(2, vocab_size=25, max_len=10, embed_dim=8, num_heads=2, num_layers=1)
    lengths = torch.randint(1, 11, (40,))
    mask = torch.arange(10).unsqueeze(0) >= lengths.unsqueeze(1)
    split = Split(torch.randint(3, 25, (40, 10)).masked_fill(mask, 0), torch.randint(0, 2, (40,)), mask)
    for structure in ("kron", "diag", "full"):
        la = fit_last_layer_laplace(model, split, hessian_structure=structure, batch_size=16)
        logits = la.predict_logits(split, num_samples=5, generator=torch.Generator().manual_seed(0))
        assert logits.shape == (40, 5, 2) and torch.isfinite(logits).all()
        probs = average_samples(logits, "probs")
        np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-6)
        # the sample mean is centred on the MAP logits of the frozen network
        model.eval()
        with torch.no_grad():
            map_logits = model(split.inputs, split.mask)[:, 0].double()
        mean, _ = la.predictive_moments(split)
        torch.testing.assert_close(mean, map_logits, rtol=1e-5, atol=1e-5)
    assert "torchvision" not in sys.modules


@needs_laplace
def test_laplace_torch_import_in_a_fresh_interpreter_pulls_no_torchvision_and_no_log_handler():
    code = (
        "import logging, sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated', category=DeprecationWarning)\n"
        "import torch\n"
        "import gpattn.experiments.laplace as gl\n"
        "assert gl.laplace_torch_available()\n"
        "assert 'laplace' in sys.modules and 'curvlinops' in sys.modules\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torchvision'], 'torchvision was imported'\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
        "print(torch.__version__)\n"
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == torch.__version__
