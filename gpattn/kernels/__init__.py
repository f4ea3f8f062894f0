"""GPyTorch kernels of gpattn, the kernel specs of every ``kernel=`` option and their factory."""

from gpattn.kernels._evaluate import evaluate_kernel
from gpattn.kernels._factory import (
    KERNEL_NAMES,
    KERNEL_OPTIONS,
    check_kernel,
    kernel_spec,
    make_kernel,
    require_kernel_spec,
    scale_prior_variance,
)
from gpattn.kernels.cross_covariance import CanonicalRBFKernel, CrossCovarianceKernel
from gpattn.kernels.exponential import ExponentialKernel

__all__ = [
    "CanonicalRBFKernel",
    "CrossCovarianceKernel",
    "ExponentialKernel",
    "KERNEL_NAMES",
    "KERNEL_OPTIONS",
    "check_kernel",
    "evaluate_kernel",
    "kernel_spec",
    "make_kernel",
    "require_kernel_spec",
    "scale_prior_variance",
]
