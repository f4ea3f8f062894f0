"""The experiment application: data sets, training, compare, presets, Laplace, metrics, plots and the
``gpattn`` command, built on the library core (``gpattn.attention``, ``kernels``, ``variational``,
``models``, ``objectives``), which never imports it.

:func:`load_run` scores new inputs with a saved run, without its data files:
``gpattn.experiments.load_run(run_dir).predict(["a sentence"], num_samples=10)`` (it is
:func:`gpattn.experiments.inference.load_run`; :func:`gpattn.experiments.training.load_run_with_data`
reloads the data set instead).

Its own dependencies (scikit-learn, scipy, tqdm, matplotlib) come with the extra:
``pip install 'gpattn[experiments]'``. Submodules (``cli``, ``compare``, ``data``, ``diagnostics``,
``inference``, ``laplace``, ``metrics``, ``plots``, ``presets``, ``readout``, ``sngp``, ``training``) and
``load_run`` are imported on first use, so ``import gpattn.experiments`` itself needs none of them.
"""

from gpattn._shadow import check_not_shadowed

check_not_shadowed()  # a folder named gpattn (a clone) shadowing the package: an ImportError that says so

from gpattn import _lazy_submodules  # noqa: E402

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
    "readout",
    "sngp",
    "training",
)

__all__ = sorted([*_SUBMODULES, "load_run"])

_submodule, __dir__ = _lazy_submodules(__name__, _SUBMODULES, __all__)


def __getattr__(name):
    if name == "load_run":
        from gpattn.experiments.inference import load_run

        return load_run
    return _submodule(name)
