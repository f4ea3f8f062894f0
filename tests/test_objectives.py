"""The ELBO objective (MATH §9): term weighting, N scaling, annealing, MC likelihoods."""

import math

import pytest
import torch

import gpattn
from gpattn.objectives import ELBOObjective, expected_nll


def _logits(B=4, P=3, C=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, P, C, generator=g, dtype=torch.float64), torch.randint(0, C, (B,), generator=g)


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
    obj = ELBOObjective(100, beta=0.5, eta=0.1, alpha=0.7)
    loss, parts = obj(logits, y, terms)
    nll = expected_nll(logits, y)
    expected = nll + 0.5 * (2.0 + 300.0 / 100) + 0.1 * 0.5 + 0.7 * 4.0
    torch.testing.assert_close(loss, expected)
    assert set(parts) == {"nll", "kl_seq", "kl_global", "ksvd", "cgp", "beta", "alpha", "loss"}
    # the peer scaling adds every KL undivided
    loss_peer, _ = ELBOObjective(100, beta=0.5, eta=0.1, alpha=0.7, kl_scaling="peer")(logits, y, terms)
    torch.testing.assert_close(loss_peer - loss, torch.tensor(0.5 * 300.0 * (1 - 1 / 100), dtype=torch.float64))


def test_baselines_have_zero_extra_terms():
    logits, y = _logits()
    loss, parts = ELBOObjective(10)(logits, y, {})
    torch.testing.assert_close(loss, parts["nll"])
    assert all(float(parts[k]) == 0 for k in ("kl_seq", "kl_global", "ksvd", "cgp"))


def test_annealing_ramps_linearly():
    logits, y = _logits()
    obj = ELBOObjective(1, beta=2.0, beta_anneal_steps=10, alpha=1.0, alpha_anneal_steps=4)
    terms = {"kl_seq": torch.tensor(1.0, dtype=torch.float64), "cgp": torch.tensor(1.0, dtype=torch.float64)}
    nll = expected_nll(logits, y)
    for step, beta, alpha in ((0, 0.0, 0.0), (5, 1.0, 1.0), (2, 0.4, 0.5), (20, 2.0, 1.0)):
        loss, parts = obj(logits, y, terms, step=step)
        assert math.isclose(float(parts["beta"]), beta) and math.isclose(float(parts["alpha"]), alpha)
        torch.testing.assert_close(loss, nll + beta + alpha)


def test_gradient_reaches_terms():
    logits, y = _logits()
    kl = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    loss, _ = ELBOObjective(50, beta=1.0)(logits, y, {"kl_global": kl})
    loss.backward()
    assert math.isclose(float(kl.grad), 1 / 50)


def test_errors():
    logits, y = _logits()
    with pytest.raises(ValueError, match="num_data"):
        ELBOObjective(0)
    with pytest.raises(ValueError, match="kl_scaling"):
        ELBOObjective(5, kl_scaling="sum")
    with pytest.raises(ValueError, match="likelihood"):
        ELBOObjective(5, likelihood="mode")
    with pytest.raises(ValueError, match="unknown loss terms"):
        ELBOObjective(5)(logits, y, {"kl": torch.tensor(1.0)})
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
