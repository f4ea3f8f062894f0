"""Dense evaluation of a gpytorch kernel block (the GP layers' entry point into a kernel)."""

from __future__ import annotations

import functools
import operator

import torch
from gpytorch.kernels import AdditiveKernel, Kernel, ProductKernel, RBFKernel, ScaleKernel
from gpytorch.kernels.kernel import sq_dist
from linear_operator import to_dense

from gpattn.kernels.exponential import ExponentialKernel

__all__ = ["evaluate_kernel", "log_linear_form", "temperature_lengthscale"]


def evaluate_kernel(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
    """Dense kernel block κ(x1, x2) evaluated now (no lazy tensor, so nothing assumes symmetry).

    A plain (ARD) RBF kernel, scaled or not, is evaluated here without gpytorch's host read (:func:`_rbf`), and so
    are gpytorch's sums, products and scalings of kernels (:func:`_composition`: their blocks combined as gpytorch
    combines them, without ``ProductKernel``'s ``torch.equal``), so that an RBF inside one reads nothing back
    either (a Matérn kernel still does: gpytorch's ``covar_dist`` asks ``torch.equal(x1, x2)``).
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
        if not params and type(kernel) in (ScaleKernel, AdditiveKernel, ProductKernel):
            return _composition(kernel, x1, x2, diag)
        return to_dense(kernel.forward(x1, x2, diag=diag, **params))
    return to_dense(kernel(x1, x2, diag=diag, **params))


def _composition(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor, diag: bool) -> torch.Tensor:
    """gpytorch's ``ScaleKernel`` (σ² per batch entry times its base), ``AdditiveKernel`` (the sum of its kernels,
    in order) or ``ProductKernel`` (their product, in order), each part evaluated by :func:`evaluate_kernel`.
    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True"""
    if type(kernel) is ScaleKernel:
        scale = kernel.outputscale[..., None] if diag else kernel.outputscale[..., None, None]
        return evaluate_kernel(kernel.base_kernel, x1, x2, diag) * scale
    blocks = [evaluate_kernel(k, x1, x2, diag) for k in kernel.kernels]
    return functools.reduce(operator.add if type(kernel) is AdditiveKernel else operator.mul, blocks)


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
    ell = rbf.lengthscale  # a constraint's transform per read: read once
    a, b = x1.div(ell), x2.div(ell)
    d2 = (a - b).square().sum(-1) if diag else sq_dist(a, b, x1_eq_x2=False)
    out = d2.div(-2.0).exp()
    if kernel is not rbf:  # ScaleKernel: σ² per batch entry (heads)
        scale = kernel.outputscale
        out = out * (scale[..., None] if diag else scale[..., None, None])
    return out


def log_linear_form(kernel: Kernel, x1: torch.Tensor, x2: torch.Tensor):
    r"""``(a, b, f, c)`` with :math:`\kappa(x_{1,i}, x_{2,j}) = \exp(f_i + a_i \cdot b_j + c_j)` for the kernels that
    have this form, else None (docs/derivations.md §12: such a kernel's attention runs in fused attention).

    * :class:`~gpattn.kernels.ExponentialKernel`: :math:`a = x_1/\ell`, :math:`b = x_2/\ell`,
      :math:`f = \log\sigma^2`, :math:`c = 0` (returned as None);
    * the (ARD) RBF kernel: :math:`a = x_1/\ell - m`, :math:`b = x_2/\ell - m`, :math:`f = -\tfrac12\|a\|^2`,
      :math:`c = -\tfrac12\|b\|^2`, with :math:`m` the mean of the :math:`x_2/\ell` (the kernel is stationary; the
      shift keeps :math:`a \cdot b` from cancelling digits far from the origin, as gpytorch's ``sq_dist`` does);
    * gpytorch's ``ScaleKernel`` of one of these (at any depth): :math:`f + \log\sigma^2`.

    # shape: x1 (..., n, d), x2 (..., m, d) -> a (..., n, d), b (..., m, d), f (..., n), c (..., m) or None
    """
    if kernel.active_dims is not None:
        return None
    if type(kernel) is ScaleKernel:  # σ² per batch entry (heads) times a kernel of the form
        form = log_linear_form(kernel.base_kernel, x1, x2)
        return None if form is None else (*form[:2], form[2] + kernel.outputscale.log()[..., None], form[3])
    if type(kernel) is ExponentialKernel:
        ell = kernel.lengthscale  # a constraint's transform per read: read once
        a, b = x1 / ell, x2 / ell
        return a, b, kernel.outputscale.log()[..., None].expand(a.shape[:-1]), None
    if type(kernel) is not RBFKernel:
        return None
    ell = kernel.lengthscale
    a, b = x1 / ell, x2 / ell
    shift = b.detach().mean(-2, keepdim=True)  # stationary: centred, a·b loses no digits far from 0 (as sq_dist)
    a, b = a - shift, b - shift
    return a, b, a.square().sum(-1).mul(-0.5), b.square().sum(-1).mul(-0.5)


def temperature_lengthscale(kernel: Kernel) -> torch.Tensor | None:
    """The (ARD) lengthscale ℓ of a kernel with one, inside gpytorch ``ScaleKernel`` s at any depth, else None:
    the temperature of the softmax prior mean softmax((q/ℓ)(k/ℓ)ᵀ) (docs/derivations.md §5e).
    # shape: -> the kernel's lengthscale, e.g. (H, 1, Dh)"""
    while type(kernel) is ScaleKernel:
        kernel = kernel.base_kernel
    if kernel.active_dims is not None or not getattr(kernel, "has_lengthscale", False):
        return None
    return kernel.lengthscale
