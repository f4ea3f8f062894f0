"""The experiment application: data sets, training, compare, presets, Laplace, metrics, plots and the
``gpattn`` command, built on the library core (``gpattn.attention``, ``kernels``, ``variational``,
``models``, ``objectives``), which never imports it.

Its own dependencies (scikit-learn, scipy, tqdm, matplotlib) come with the extra:
``pip install 'gpattn[experiments]'``. Submodules (``cli``, ``compare``, ``data``, ``diagnostics``,
``inference``, ``laplace``, ``metrics``, ``plots``, ``presets``, ``training``) are imported on first use,
so ``import gpattn.experiments`` itself needs none of them.
"""

from gpattn import _lazy_submodules

_SUBMODULES = (
    "cli",
    "compare",
    "data",
    "diagnostics",
    "inference",
    "laplace",
    "metrics",
    "plots",
    "presets",
    "training",
)

__all__ = list(_SUBMODULES)

__getattr__, __dir__ = _lazy_submodules(__name__, _SUBMODULES, __all__)
