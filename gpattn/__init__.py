"""gpattn — Gaussian-process attention for transformers (PyTorch, GPyTorch, LinearOperator).

Public API: :func:`build_attention`, :func:`list_attention`, :func:`attention_options`,
:class:`deterministic`, :class:`validation` / :func:`set_validation` (opt-in value checks),
:func:`load_run` (score new inputs with a saved run,
:mod:`gpattn.inference`), and the subpackages (``kernels``, ``variational``, ``attention``, ``models``,
``objectives``, ``metrics``, ``data``, ``training``, ``plots``, ``testing``), imported on first use.
Importing gpattn changes no gpytorch / linear_operator / matplotlib global setting.
"""

import importlib

from gpattn._settings import deterministic, is_deterministic, is_validating, set_validation, validation
from gpattn.attention import attention_options, build_attention, list_attention

__version__ = "0.1.0"

_SUBMODULES = (
    "attention",
    "cli",
    "compare",
    "data",
    "inference",
    "kernels",
    "laplace",
    "metrics",
    "models",
    "objectives",
    "plots",
    "presets",
    "testing",
    "training",
    "variational",
)

__all__ = [
    "__version__",
    "attention",
    "attention_options",
    "build_attention",
    "cli",
    "compare",
    "data",
    "deterministic",
    "inference",
    "is_deterministic",
    "is_validating",
    "kernels",
    "list_attention",
    "load_run",
    "metrics",
    "models",
    "objectives",
    "plots",
    "presets",
    "set_validation",
    "testing",
    "training",
    "validation",
    "variational",
]


def load_run(path, device=None):
    """A saved run ready to score new inputs: ``gpattn.load_run(run_dir).predict(["a sentence"], num_samples=10)``
    (see :mod:`gpattn.inference`; needs no data file)."""
    from gpattn.inference import load_run as _load_run

    return _load_run(path, device)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"gpattn.{name}")
    raise AttributeError(f"module 'gpattn' has no attribute {name!r}")


def __dir__():
    return __all__
