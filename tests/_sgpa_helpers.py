"""Helpers shared by test_sgpa.py and test_sgpa_decoupled.py (not a test module: no ``test_`` prefix)."""

import importlib
import sys

import torch


def spy_iterative_solvers(monkeypatch):
    """Replace linear_operator's CG and Lanczos entry points, wherever they were imported, by spies.

    Returns the list the spies append the name of each called solver to (still calling the original), so a
    test can assert it stays empty: the exact (Cholesky) algebra ran throughout."""
    cg = importlib.import_module("linear_operator.utils.linear_cg")
    lanczos = importlib.import_module("linear_operator.utils.lanczos")
    calls = []
    originals = {"linear_cg": cg.linear_cg, "lanczos_tridiag": lanczos.lanczos_tridiag}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if not name.startswith(("linear_operator", "gpytorch")):
            continue
        for attr, fn in originals.items():
            if vars(module).get(attr) is fn:

                def spy(*args, _fn=fn, _attr=attr, **kwargs):
                    calls.append(_attr)
                    return _fn(*args, **kwargs)

                monkeypatch.setattr(module, attr, spy)
    return calls


def assert_samples_match_moments(f, mean, cov):
    """``P`` posterior draws ``f`` against the analytic ``mean`` and ``cov``: the sample mean within 5
    standard errors sqrt(Σ_ii / P) of the mean, and every entry of the sample covariance within 5
    standard errors sqrt((Σ_ii Σ_jj + Σ_ij²) / P) of the covariance. Returns (sample covariance,
    its standard errors) for further checks.  # shape: f (P, ..., T), mean (..., T), cov (..., T, T)"""
    P = f.shape[0]
    var = cov.diagonal(dim1=-2, dim2=-1)
    assert ((f.mean(0) - mean).abs() / (var / P).sqrt()).max() < 5
    c = f - f.mean(0)
    emp = torch.einsum("p...i,p...j->...ij", c, c) / (P - 1)
    se = ((var[..., :, None] * var[..., None, :] + cov.square()) / P).sqrt()
    assert ((emp - cov).abs() / se).max() < 5
    return emp, se
