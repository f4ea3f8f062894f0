"""gpattn — Gaussian-process attention for transformers (PyTorch, GPyTorch, LinearOperator).

Public API: :func:`build_attention`, :func:`list_attention`, :func:`attention_options`,
:class:`deterministic`, :class:`validation` / :func:`set_validation` (opt-in value checks), and the
subpackages (``kernels``, ``variational``, ``attention``, ``models``, ``objectives``, ``testing``),
imported on first use, and :class:`OldVersionWarning` (something an older gpattn wrote was migrated on load).
The library core needs torch, gpytorch, linear_operator and numpy only.

``experiments`` is the experiment application (data sets, training, compare, presets, Laplace,
metrics, plots, the ``gpattn`` command, and ``gpattn.experiments.load_run``, which scores new inputs
with a saved run): ``pip install 'gpattn[experiments]'``. The core never imports it. Importing gpattn
changes no gpytorch / linear_operator / matplotlib global setting.
"""

import importlib

from gpattn._settings import deterministic, is_deterministic, is_validating, set_validation, validation
from gpattn._warnings import OldVersionWarning
from gpattn.attention import attention_options, build_attention, list_attention

#: gpattn's version (the package metadata reads it from here; CHANGELOG.md lists every version)
__version__ = "0.3.0.dev0"

_SUBMODULES = (
    "attention",
    "experiments",
    "kernels",
    "models",
    "objectives",
    "testing",
    "variational",
)

__all__ = [
    "OldVersionWarning",
    "__version__",
    "attention",
    "attention_options",
    "build_attention",
    "deterministic",
    "experiments",
    "is_deterministic",
    "is_validating",
    "kernels",
    "list_attention",
    "models",
    "objectives",
    "set_validation",
    "testing",
    "validation",
    "variational",
]


def _lazy_submodules(package: str, submodules, exported):
    """A package's ``(__getattr__, __dir__)`` that import ``submodules`` on first attribute access; a name that
    left the package raises the ``AttributeError`` of its :data:`gpattn._migrate.MOVED_NAMES` row."""

    def __getattr__(name):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        from gpattn._migrate import MOVED_NAMES

        raise AttributeError(MOVED_NAMES.get((package, name), f"module {package!r} has no attribute {name!r}"))

    def __dir__():
        return exported

    return __getattr__, __dir__


__getattr__, __dir__ = _lazy_submodules(__name__, _SUBMODULES, __all__)
