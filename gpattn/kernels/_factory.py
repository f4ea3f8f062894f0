"""Turn the ``kernel=`` option of a GP attention variant into a per-head gpytorch kernel."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel, RBFKernel, ScaleKernel
from linear_operator import to_dense

from gpattn.kernels.exponential import ExponentialKernel
from gpattn.variational._scale import exponential_lengthscale

__all__ = ["KERNEL_NAMES", "evaluate_kernel", "make_kernel"]

KERNEL_NAMES = ("exponential", "rbf")


def make_kernel(kernel: str | Kernel, num_heads: int, head_dim: int, *, prior_variance: float | None = None) -> Kernel:
    """``"exponential"`` (text default), ``"rbf"`` (ARD-RBF with outputscale, images) or any gpytorch
    ``Kernel`` instance (used as given: its batch_shape must broadcast against ``(B, H)``).

    ``prior_variance`` (GP variants): initialise a kernel built from its name on the scale of the
    residual stream (:mod:`gpattn.variational._scale`): outputscale = ``prior_variance`` and, for the
    exponential kernel, ℓ = √Dh. ``None`` keeps the kernel's own defaults (the kernel-attention
    baselines)."""
    if isinstance(kernel, Kernel):
        return kernel
    batch = torch.Size([num_heads])
    if kernel == "exponential":
        k = ExponentialKernel(ard_num_dims=head_dim, batch_shape=batch)
        if prior_variance is not None:
            k.lengthscale = exponential_lengthscale(head_dim)
            k.outputscale = prior_variance
        return k
    if kernel == "rbf":
        base = RBFKernel(ard_num_dims=head_dim, batch_shape=batch)
        base.lengthscale = float(head_dim) ** 0.5
        k = ScaleKernel(base, batch_shape=batch)
        if prior_variance is not None:
            k.outputscale = prior_variance
        return k
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
