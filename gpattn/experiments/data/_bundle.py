"""The containers every loader returns, the data-directory rule, and the dataset registry.

A loader joins with one decorator, ``@register_dataset("name")``, on a function whose signature is
``loader(*, data_dir: Path, download: bool, seed: int, **options) -> DatasetBundle``; its options
are its other keyword-only parameters, with their defaults. ``load_dataset`` checks options against
that signature, so an unknown (or missing required) option is a ``ValueError`` listing the valid ones.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "DataNotFoundError",
    "DatasetBundle",
    "Split",
    "dataset_options",
    "list_datasets",
    "load_dataset",
    "register_dataset",
    "resolve_data_dir",
]

ENV_DATA_DIR = "GPATTN_DATA_DIR"
DEFAULT_DATA_DIR = Path("~/.cache/gpattn")
_COMMON_ARGS = ("data_dir", "download", "seed")


class DataNotFoundError(FileNotFoundError):
    """A data file is absent and downloading was not asked for (or failed).

    The message names the expected path and the download URL, and says how to fix it.
    """


def missing_file_message(path: Path, url: str | None, what: str = "data file") -> str:
    """The standard offline message: expected path, URL, and the three ways out."""
    where = f"Download it from {url} by passing download=True (Python) or --download (CLI), or " if url else ""
    return (
        f"{what} not found: expected {path}. {where}"
        f"point to the directory that holds it with data_dir=... (Python), --data-dir (CLI) or the "
        f"{ENV_DATA_DIR} environment variable."
    )


def _describe(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


@dataclass(repr=False)
class Split:
    """One split of a data set: N examples.

    :ivar inputs: text ``(N, T)`` int64 token ids (0 = ``<pad>``); images ``(N, C, Hpx, Wpx)`` float32 in
        [0, 1].
    :ivar labels: ``(N,)`` int64; -1 marks an unknown label (OOD examples of held-out classes).
    :ivar mask: text ``(N, T)`` bool, True = padding (``key_padding_mask`` convention); images None. (A
        frozen trunk's outputs, gpattn.experiments.encoders.trunk_bundle, are ``(N, T, D)`` float32
        inputs with an ``(N, T)`` mask.)
    :ivar groups: optional ``(N,)`` int64, e.g. corruption severity 1..5 of a shift split.
    """

    inputs: torch.Tensor  # shape: (N, T) or (N, C, Hpx, Wpx)
    labels: torch.Tensor  # shape: (N,)
    mask: torch.Tensor | None  # shape: (N, T) or None
    groups: torch.Tensor | None = None  # shape: (N,) or None

    def __post_init__(self):
        if self.labels.dim() != 1 or self.labels.dtype != torch.int64:
            raise ValueError(f"labels must be a (N,) int64 tensor, got {_describe(self.labels)}")
        n = self.labels.shape[0]
        if self.inputs.dim() < 2 or self.inputs.shape[0] != n:
            raise ValueError(f"inputs must have N={n} rows and at least 2 dims, got {_describe(self.inputs)}")
        if self.mask is not None and (self.mask.shape != self.inputs.shape[:2] or self.mask.dtype != torch.bool):
            raise ValueError(
                f"mask must be a bool tensor shaped like inputs' first two dims {tuple(self.inputs.shape[:2])}, "
                f"got {_describe(self.mask)}"
            )
        if self.groups is not None and tuple(self.groups.shape) != (n,):
            raise ValueError(f"groups must have shape ({n},), got {_describe(self.groups)}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, index) -> Split:
        """The examples at ``index`` (a slice, an int64 index tensor or a bool mask over N)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Split(self.inputs[index], self.labels[index], pick(self.mask), pick(self.groups))

    def __repr__(self) -> str:
        return (
            f"Split(N={len(self)}, inputs={_describe(self.inputs)}, labels={_describe(self.labels)}, "
            f"mask={_describe(self.mask)}, groups={_describe(self.groups)})"
        )


@dataclass(repr=False)
class DatasetBundle:
    """Every split of a data set plus what a model and a report need to use it.

    ``splits`` always holds "train", "val" and "test", plus evaluation-only splits ("shift", "ood").
    ``eval_splits`` maps report names to split keys; ``ood_splits`` lists the report names that are
    out-of-distribution (OOD-detection metrics are computed against "in_domain").
    """

    name: str
    kind: str
    splits: dict[str, Split]
    num_classes: int
    eval_splits: dict[str, str]
    ood_splits: tuple[str, ...]
    vocab: list[str] | None = None
    image_shape: tuple[int, int, int] | None = None
    info: dict = field(default_factory=dict)
    #: text bundles: each split's raw texts, row for row (what a pretrained encoder's tokenizer reads)
    texts: dict[str, list[str]] | None = None

    def __post_init__(self):
        if self.kind not in ("text", "image"):
            raise ValueError(f"kind must be 'text' or 'image', got {self.kind!r}")
        missing = [k for k in ("train", "val", "test") if k not in self.splits]
        if missing:
            raise ValueError(f"splits must include train, val and test; missing {missing}")
        bad = {r: s for r, s in self.eval_splits.items() if s not in self.splits}
        if bad:
            raise ValueError(f"eval_splits point to absent splits {bad}; splits are {sorted(self.splits)}")
        if not set(self.ood_splits) <= set(self.eval_splits):
            raise ValueError(f"ood_splits {self.ood_splits} must be report names of eval_splits {self.eval_splits}")
        if self.kind == "text" and self.vocab is None:
            raise ValueError("a text bundle needs its vocab")
        if self.kind == "image" and self.image_shape is None:
            raise ValueError("an image bundle needs its image_shape (C, Hpx, Wpx)")

    @property
    def vocab_size(self) -> int | None:
        return None if self.vocab is None else len(self.vocab)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={len(v)}" for k, v in self.splits.items())
        extra = f"vocab_size={self.vocab_size}" if self.kind == "text" else f"image_shape={self.image_shape}"
        return (
            f"DatasetBundle(name={self.name!r}, kind={self.kind!r}, num_classes={self.num_classes}, "
            f"{extra}, splits({sizes}), eval_splits={self.eval_splits}, ood_splits={self.ood_splits})"
        )


_LOADERS: dict[str, Callable[..., DatasetBundle]] = {}


def register_dataset(name: str):
    """Function decorator: make ``loader`` loadable as ``load_dataset(name, ...)``."""

    def decorate(loader):
        params = inspect.signature(loader).parameters
        for arg in _COMMON_ARGS:
            if arg not in params or params[arg].kind is not inspect.Parameter.KEYWORD_ONLY:
                raise TypeError(f"dataset loader {loader.__name__} must take keyword-only argument {arg!r}")
        if name in _LOADERS and _LOADERS[name] is not loader:
            raise ValueError(f"dataset {name!r} is registered twice ({_LOADERS[name]} and {loader})")
        _LOADERS[name] = loader
        return loader

    return decorate


def list_datasets() -> list[str]:
    """Sorted names of every registered data set."""
    return sorted(_LOADERS)


def _loader(name: str) -> Callable[..., DatasetBundle]:
    key = name.lower().replace("-", "_") if isinstance(name, str) else name
    if key not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(list_datasets())}")
    return _LOADERS[key]


def dataset_options(name: str) -> dict[str, object]:
    """The options of data set ``name`` and their defaults (``inspect.Parameter.empty`` = required)."""
    params = inspect.signature(_loader(name)).parameters
    return {
        p.name: p.default
        for p in params.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _COMMON_ARGS
    }


def resolve_data_dir(data_dir=None) -> Path:
    """Explicit ``data_dir`` > environment ``GPATTN_DATA_DIR`` > ``~/.cache/gpattn``."""
    if data_dir is None:
        data_dir = os.environ.get(ENV_DATA_DIR) or DEFAULT_DATA_DIR
    return Path(data_dir).expanduser()


def load_dataset(name: str, data_dir=None, download: bool = False, seed: int = 0, **options) -> DatasetBundle:
    """Load data set ``name`` (see :func:`list_datasets`) as a :class:`DatasetBundle`.

    Files are looked up in ``data_dir`` (else ``$GPATTN_DATA_DIR``, else ``~/.cache/gpattn``) and are
    downloaded (checksummed) only when ``download=True``. ``seed`` fixes every random split and
    corruption. Other keyword arguments are the data set's options (:func:`dataset_options`).
    """
    loader = _loader(name)
    valid = dataset_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for dataset {name!r}; valid options: {', '.join(sorted(valid))}")
    required = sorted(k for k, v in valid.items() if v is inspect.Parameter.empty and k not in options)
    if required:
        raise ValueError(f"dataset {name!r} requires option(s) {required}; valid options: {', '.join(sorted(valid))}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(download, bool):
        raise ValueError(f"download must be a bool, got {download!r}")
    return loader(data_dir=resolve_data_dir(data_dir), download=download, seed=seed, **options)
