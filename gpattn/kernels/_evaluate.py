"""Dense evaluation of a gpytorch kernel block (the GP layers' entry point into a kernel)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from linear_operator import to_dense

__all__ = ["evaluate_kernel"]


def evaluate_kernel(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
    """Dense kernel block κ(x1, x2) evaluated now (no lazy tensor, so nothing assumes symmetry).

    Calls ``kernel.forward`` directly when the kernel has no ``active_dims`` (skipping the lazy
    kernel-tensor machinery of ``Kernel.__call__`` halves the cost of small blocks); otherwise
    ``kernel(x1, x2)``. Both give the same values (tested). ``params`` go to the kernel as in gpytorch
    (e.g. ``roles=("q", "k")`` of :class:`~gpattn.kernels.CrossCovarianceKernel`).
    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True
    """
    if kernel.active_dims is None:
        return to_dense(kernel.forward(x1, x2, diag=diag, **params))
    return to_dense(kernel(x1, x2, diag=diag, **params))
