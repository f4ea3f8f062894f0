"""What the training loop and the readers of a run share: the checkpoint's file name, reading a run's
checkpoint safely, the ``--device`` specification, the data metadata a checkpoint carries, and the memory bound of
every evaluation (:func:`predict_rows`).

:mod:`gpattn.experiments.training` writes runs and :mod:`gpattn.experiments.inference` reads them; both
import this module and neither imports the other's private names (inference imports training's public
``TrainConfig`` and ``build_model``; training imports nothing of inference).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from gpattn._warnings import DataWarning, warn
from gpattn.experiments._io import check_checkpoint_format, load_file

__all__ = [
    "CHECKPOINT",
    "POSITION_SPLITS",
    "PREDICT_PAIR_BUDGET",
    "PREDICT_TOKEN_BUDGET",
    "as_device",
    "bundle_meta",
    "fit_to_positions",
    "load_checkpoint",
    "model_positions",
    "predict_rows",
    "resolve_device",
    "run_checkpoint",
    "tokens_per_row",
    "valid_device",
]

#: a run folder's checkpoint file
CHECKPOINT = "checkpoint.pt"


# ----------------------------------------------------------------------------- devices
def valid_device(spec) -> bool:
    """Whether ``spec`` is an ``auto``/``cpu``/``cuda``/``cuda:N`` string (:func:`resolve_device`)."""
    if not isinstance(spec, str):
        return False
    if spec in ("auto", "cpu", "cuda"):
        return True
    kind, _, index = spec.partition(":")
    return kind == "cuda" and index.isdigit()


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N`` -> a ``torch.device``.

    Under torchrun, ``auto`` and ``cuda`` mean this process's GPU (``cuda:LOCAL_RANK``). Asking for CUDA
    where there is none is a ``ValueError`` naming ``--device``."""
    if not valid_device(spec):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available here (torch.cuda.is_available() is False)")
    if spec in ("auto", "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    device = torch.device(spec)
    if device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: there are {torch.cuda.device_count()} CUDA devices")
    return device


def as_device(device) -> torch.device:
    """A ``torch.device`` from one, from ``auto``/``cpu``/``cuda[:N]`` (checked, :func:`resolve_device`), or
    from any other name torch knows (``mps``, ...)."""
    if isinstance(device, torch.device):
        return device
    return resolve_device(device) if valid_device(device) else torch.device(device)


# ----------------------------------------------------------------------------- checkpoints
def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """A checkpoint written by :func:`gpattn.experiments.training.train`, or a ``ValueError`` naming the
    file: a truncated or foreign file otherwise fails deep inside unpickling with a message about neither,
    and a file that is not plain data is refused unread (:func:`gpattn.experiments._io.load_file`,
    ``weights_only=True``)."""
    ckpt = load_file(path, map_location=map_location, what="checkpoint")
    if not isinstance(ckpt, dict) or not {"config", "model"} <= set(ckpt):
        got = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path} is not a gpattn checkpoint: expected a dict with 'config' and 'model', got {got}")
    check_checkpoint_format(ckpt, path)  # another format: an error naming both, before anything is read
    return ckpt


def run_checkpoint(path, map_location="cpu") -> tuple[Path, dict]:
    """A checkpoint file or a run folder -> (checkpoint path, its contents, loaded safely)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}{_run_folder_hint(path.parent)}")
    return path, load_checkpoint(path, map_location=map_location)


def _run_folder_hint(folder: Path) -> str:
    """Where the runs are when ``folder`` is a ``gpattn compare`` output (``runs/<variant>/seed<N>``)."""
    found = sorted(p.parent for p in folder.glob(f"runs/*/seed*/{CHECKPOINT}"))
    if not found:
        runs = sorted(p.parent for p in folder.glob(f"*/{CHECKPOINT}"))  # a folder of run folders
        shown = ", ".join(str(p) for p in runs[:6]) + (f" and {len(runs) - 6} more" if len(runs) > 6 else "")
        return f": {folder} holds run folders, pass one of those: {shown}" if runs else ""
    shown = ", ".join(str(p) for p in found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    return (f": {folder} is a `gpattn compare` folder, which holds one run per variant and seed under "
            f"{folder / 'runs' / '<variant>' / 'seed<N>'} — pass one of those: {shown}")


# ----------------------------------------------------------------------------- the data a checkpoint carries
def bundle_meta(bundle) -> dict:
    """Plain data (str, int, list, dict) of what rebuilding a model and encoding new inputs needs: written
    into every checkpoint (``checkpoint["data"]``) and read by :func:`gpattn.experiments.inference.load_run`."""
    meta = {
        "dataset": bundle.name,
        "kind": bundle.kind,
        "num_classes": int(bundle.num_classes),
        "class_names": [str(c) for c in bundle.info.get("class_names") or range(bundle.num_classes)],
    }
    if bundle.kind == "text":
        meta["vocab"] = list(bundle.vocab)
        meta["model_max_len"] = model_positions(bundle)
        max_len = bundle.info.get("max_len")
        meta["max_len"] = int(max_len) if max_len is not None else None
        meta["tokenizer"] = "gpattn.experiments.data._text.tokenize (lowercased words and punctuation)"
    else:
        meta["image_shape"] = [int(v) for v in bundle.image_shape]
    if bundle.info.get("encoder") is not None:  # a pretrained encoder: its config and tokenizer files
        from gpattn.experiments.encoders import encoder_meta

        meta.update(encoder_meta(bundle))
    return meta


# ----------------------------------------------------------------------------- the text model's positions
#: the splits whose longest sequence sizes a text model's positional embedding: what the model learns from,
#: so that an evaluation file (``shift_file``, ``ood_file``) never changes the trained model
POSITION_SPLITS = ("train", "val")


def model_positions(bundle) -> int:
    """The longest sequence (padded width) of :data:`POSITION_SPLITS`: a text model's positional embedding size."""
    return max(int(bundle.splits[k].inputs.shape[1]) for k in POSITION_SPLITS if k in bundle.splits)


def fit_to_positions(bundle, width: int):
    """``bundle`` with each split wider than ``width`` tokens cut to its first ``width`` (as ``Run.predict`` cuts
    new texts), a warning per cut split naming it and the rows cut -> (bundle, ``{split: rows cut}``)."""
    splits, cut = dict(bundle.splits), {}
    for key, split in bundle.splits.items():
        if split.mask is None or split.inputs.dim() != 2 or split.inputs.shape[1] <= width:
            continue
        cut[key] = int((~split.mask).sum(1).gt(width).sum())
        splits[key] = dataclasses.replace(split, inputs=split.inputs[:, :width], mask=split.mask[:, :width])
        warn(
            f"{bundle.name}: {cut[key]} of {len(split)} rows of split {key!r} are longer than the {width} tokens of "
            f"the longest training sequence (train/val), which sizes the model's positional embedding; they keep "
            f"their first {width} tokens (data.json's \"cut_to_model\" counts them). To cut every split alike, pass "
            f"the data set's max_len option (at most {width}); or put longer texts in the training file.",
            DataWarning,
        )
    return (dataclasses.replace(bundle, splits=splits) if cut else bundle), cut


# ----------------------------------------------------------------------------- batches
def _batch(split, idx, device=None):
    """Inputs, mask and labels of rows ``idx`` on ``device`` (host tensors when None); text batches are
    cut to their longest real sequence (read on the host, before the copy: no device synchronisation)."""
    x = split.inputs[idx]
    mask = None if split.mask is None else split.mask[idx]
    if mask is not None:
        longest = int((~mask).sum(1).numpy().max()) if len(idx) else 1
        # contiguous: a compiled model (--compile) guards on strides, and a cut of the full width has the width's
        x, mask = x[:, : max(longest, 1)].contiguous(), mask[:, : max(longest, 1)].contiguous()
    y = split.labels[idx]
    if device is not None and torch.device(device).type != "cpu":  # pinned host memory: an asynchronous copy
        x, y = (t.pin_memory().to(device, non_blocking=True) for t in (x, y))
        mask = None if mask is None else mask.pin_memory().to(device, non_blocking=True)
    return x, mask, y


# ----------------------------------------------------------------------------- evaluation memory
#: every evaluation's memory bound (``gpattn.experiments.training.predict``: a run's own, ``gpattn evaluate``,
#: ``Run.predict``): rows per forward pass such that rows × samples × tokens and rows × samples ×
#: tokens² stay below these (a GP layer holds a T × T covariance per head and sample; 300 texts at
#: num_samples=50 and batch_size=256 once took about 20 GB with cgp)
PREDICT_TOKEN_BUDGET, PREDICT_PAIR_BUDGET = 2**16, 2**21


def predict_rows(batch_size: int, num_samples: int, tokens: int) -> int:
    """At most ``batch_size`` rows, fewer where :data:`PREDICT_TOKEN_BUDGET` / :data:`PREDICT_PAIR_BUDGET` bound
    them; at least 1."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    per_row = num_samples * max(tokens, 1)
    return max(1, min(batch_size, PREDICT_TOKEN_BUDGET // per_row, PREDICT_PAIR_BUDGET // (per_row * max(tokens, 1))))


def tokens_per_row(model, inputs: torch.Tensor, mask: torch.Tensor | None) -> int:
    """The tokens each row of ``inputs`` becomes in ``model``, for :func:`predict_rows`: a padded sequence's width
    (ids, or a frozen trunk's states), else the model's own count (a ViT's patches, ``max_tokens``), else 1."""
    if mask is not None:
        return int(inputs.shape[1])
    return int(getattr(model, "max_tokens", None) or 1)
