"""Dense evaluation of a gpytorch kernel block (the GP layers' entry point into a kernel)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel, RBFKernel, ScaleKernel
from gpytorch.kernels.kernel import sq_dist
from linear_operator import to_dense

__all__ = ["evaluate_kernel"]


def evaluate_kernel(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
    """Dense kernel block κ(x1, x2) evaluated now (no lazy tensor, so nothing assumes symmetry).

    A plain (ARD) RBF kernel, scaled or not, is evaluated here without gpytorch's host read (:func:`_rbf`).
    Otherwise calls ``kernel.forward`` directly when the kernel has no ``active_dims`` (skipping the lazy
    kernel-tensor machinery of ``Kernel.__call__`` halves the cost of small blocks); otherwise
    ``kernel(x1, x2)``. Both give the same values (tested). ``params`` go to the kernel as in gpytorch
    (e.g. ``roles=("q", "k")`` of :class:`~gpattn.kernels.CrossCovarianceKernel`).
    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True
    """
    rbf = _plain_rbf(kernel)
    if rbf is not None and not params:
        return _rbf(kernel, rbf, x1, x2, diag)
    if kernel.active_dims is None:
        return to_dense(kernel.forward(x1, x2, diag=diag, **params))
    return to_dense(kernel(x1, x2, diag=diag, **params))


def _plain_rbf(kernel: Kernel) -> RBFKernel | None:
    """The RBF kernel of a plain ``RBFKernel`` or ``ScaleKernel(RBFKernel)`` without active dims, else None."""
    base = kernel.base_kernel if type(kernel) is ScaleKernel else kernel
    if type(base) is RBFKernel and kernel.active_dims is None and base.active_dims is None:
        return base
    return None


def _rbf(kernel: Kernel, rbf: RBFKernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool) -> torch.Tensor:
    """gpytorch's (ARD) RBF, σ² exp(−½ ‖(x1 − x2)/ℓ‖²), without its ``covar_dist``: that asks
    ``torch.equal(x1, x2)``, a host read that synchronises a CUDA stream and breaks a ``torch.compile`` graph
    in every forward. The same squared distances (gpytorch's ``sq_dist``), told that x1 is not x2.
    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True"""
    a, b = x1.div(rbf.lengthscale), x2.div(rbf.lengthscale)
    d2 = (a - b).square().sum(-1) if diag else sq_dist(a, b, x1_eq_x2=False)
    out = d2.div(-2.0).exp()
    if kernel is not rbf:  # ScaleKernel: σ² per batch entry (heads)
        scale = kernel.outputscale
        out = out * (scale[..., None] if diag else scale[..., None, None])
    return out
