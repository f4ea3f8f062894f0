"""Turn the ``kernel=`` option of a GP attention variant into a per-head gpytorch kernel."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel, RBFKernel, ScaleKernel
from linear_operator import to_dense

from gpattn.kernels.exponential import ExponentialKernel

__all__ = ["KERNEL_NAMES", "evaluate_kernel", "make_kernel"]

KERNEL_NAMES = ("exponential", "rbf")


def make_kernel(kernel: str | Kernel, num_heads: int, head_dim: int) -> Kernel:
    """``"exponential"`` (text default), ``"rbf"`` (ARD-RBF with outputscale, images) or any gpytorch
    ``Kernel`` instance (used as given: its batch_shape must broadcast against ``(B, H)``)."""
    if isinstance(kernel, Kernel):
        return kernel
    batch = torch.Size([num_heads])
    if kernel == "exponential":
        return ExponentialKernel(ard_num_dims=head_dim, batch_shape=batch)
    if kernel == "rbf":
        base = RBFKernel(ard_num_dims=head_dim, batch_shape=batch)
        base.lengthscale = float(head_dim) ** 0.5
        return ScaleKernel(base, batch_shape=batch)
    raise ValueError(
        f"kernel must be one of {list(KERNEL_NAMES)} or a gpytorch.kernels.Kernel instance, got {kernel!r}"
    )


def evaluate_kernel(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False) -> torch.Tensor:
    """Dense kernel block κ(x1, x2) evaluated now (no lazy tensor, so nothing assumes symmetry).

    Calls ``kernel.forward`` directly when the kernel has no ``active_dims`` (skipping the lazy
    kernel-tensor machinery of ``Kernel.__call__`` halves the cost of small blocks); otherwise
    ``kernel(x1, x2)``. Both give the same values (tested).
    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True
    """
    if kernel.active_dims is None:
        return to_dense(kernel.forward(x1, x2, diag=diag))
    return to_dense(kernel(x1, x2, diag=diag))
