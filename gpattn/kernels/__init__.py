"""GPyTorch kernels of gpattn and the factory behind every ``kernel=`` option."""

from gpattn.kernels._factory import KERNEL_NAMES, evaluate_kernel, make_kernel
from gpattn.kernels.cross_covariance import CanonicalRBFKernel, CrossCovarianceKernel
from gpattn.kernels.exponential import ExponentialKernel

__all__ = [
    "CanonicalRBFKernel",
    "CrossCovarianceKernel",
    "ExponentialKernel",
    "KERNEL_NAMES",
    "evaluate_kernel",
    "make_kernel",
]
