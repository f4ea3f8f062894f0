"""Assertions and test utilities shared by the mixins, our own tests and the notebooks (no pytest).

``layer_loss_terms`` is the one place that reads a layer's loss terms, so that the loss-term API can
change in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from unittest import mock

import torch

__all__ = [
    "assert_samples_match_moments",
    "layer_loss_terms",
    "registered_attention",
    "spy_iterative_solvers",
]


def layer_loss_terms(layer) -> dict[str, torch.Tensor]:
    """The scalar loss terms of ``layer``'s last forward, by name."""
    return layer.loss_terms()


def assert_samples_match_moments(f: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor, n_se: float = 5.0):
    """``P`` draws ``f`` against the analytic ``mean`` and ``cov``: the sample mean within ``n_se``
    standard errors sqrt(Σ_ii / P) of the mean, and every entry of the sample covariance within
    ``n_se`` standard errors sqrt((Σ_ii Σ_jj + Σ_ij²) / P) of the covariance. Returns (sample covariance,
    its standard errors) for further checks.

    # shape: f (P, ..., T), mean (..., T), cov (..., T, T) -> (..., T, T), (..., T, T)
    """
    P = f.shape[0]
    var = cov.diagonal(dim1=-2, dim2=-1)
    z_mean = ((f.mean(0) - mean).abs() / (var / P).sqrt()).max()
    assert z_mean < n_se, f"sample mean {z_mean:.2f} standard errors off (P = {P})"
    c = f - f.mean(0)
    emp = torch.einsum("p...i,p...j->...ij", c, c) / (P - 1)
    se = ((var[..., :, None] * var[..., None, :] + cov.square()) / P).sqrt()
    z_cov = ((emp - cov).abs() / se).max()
    assert z_cov < n_se, f"sample covariance {z_cov:.2f} standard errors off (P = {P})"
    return emp, se


@contextlib.contextmanager
def spy_iterative_solvers():
    """Within the block, linear_operator's CG and Lanczos entry points (wherever gpytorch or
    linear_operator imported them) are wrapped by spies; yields the list they append the name of each
    called solver to (the original still runs). An empty list afterwards: exact (Cholesky) algebra ran
    throughout."""
    originals = {
        "linear_cg": importlib.import_module("linear_operator.utils.linear_cg").linear_cg,
        "lanczos_tridiag": importlib.import_module("linear_operator.utils.lanczos").lanczos_tridiag,
    }
    calls: list[str] = []

    def spy_of(attr, fn):
        def spy(*args, **kwargs):
            calls.append(attr)
            return fn(*args, **kwargs)

        return spy

    with contextlib.ExitStack() as stack:
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "") or ""
            if not name.startswith(("linear_operator", "gpytorch")):
                continue
            for attr, fn in originals.items():
                if vars(module).get(attr) is fn:
                    stack.enter_context(mock.patch.object(module, attr, spy_of(attr, fn)))
        yield calls


@contextlib.contextmanager
def registered_attention(name: str, cls):
    """Register the attention class ``cls`` as ``name`` for the duration of the block only, so that a
    test-only variant never shows in ``gpattn.list_attention()`` outside it."""
    from gpattn.attention import registry

    if name in registry._REGISTRY:
        raise ValueError(f"registered_attention: {name!r} is already registered; choose a test-only name")
    registry.register(name)(cls)
    try:
        yield cls
    finally:
        registry._REGISTRY.pop(name, None)
