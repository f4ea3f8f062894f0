"""GPyTorch kernels of gpattn and the factory behind every ``kernel=`` option."""

from gpattn.kernels._factory import KERNEL_NAMES, evaluate_kernel, make_kernel
from gpattn.kernels.exponential import ExponentialKernel

__all__ = [
    "ExponentialKernel",
    "KERNEL_NAMES",
    "evaluate_kernel",
    "make_kernel",
]
