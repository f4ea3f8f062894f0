"""Data sets as :class:`DatasetBundle` objects: ``load_dataset(name, data_dir=None, download=False,
seed=0, **options)``.

Nothing is downloaded unless ``download=True``; every download is checked against its SHA-256. Files
live in ``data_dir``, else ``$GPATTN_DATA_DIR``, else ``~/.cache/gpattn``. A loader joins the registry
with ``@register_dataset("name")`` (``gpattn.experiments.data._bundle``); every public module of this package is
imported here, so a new data set needs no edit elsewhere. ``gpattn.experiments.data.fixtures`` writes synthetic
files in the official formats for tests.
"""

import importlib
import pkgutil

from gpattn._warnings import DataWarning
from gpattn.experiments.data._bundle import (
    DataNotFoundError,
    DatasetBundle,
    Split,
    dataset_options,
    list_datasets,
    load_dataset,
)

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
del _module

__all__ = [
    "DataNotFoundError",
    "DataWarning",
    "DatasetBundle",
    "Split",
    "dataset_options",
    "list_datasets",
    "load_dataset",
]
