"""Safe loading of the files gpattn writes (checkpoints, cached predictions).

Every ``torch.load`` in gpattn goes through :func:`load_file`, which uses ``weights_only=True``: a
file that asks the unpickler for anything but plain data (dicts, lists, tuples, str, numbers, bool,
None, tensors) is refused before any of its code runs. What gpattn writes is plain data only, so no
type is allowlisted. A checkpoint whose pickle names a function or class (a ``__reduce__`` payload)
fails with a ``ValueError`` naming the file instead of executing it.

The same policy holds for any file format added later: tokenizers and pretrained weights are read as
data (JSON, safetensors, ``weights_only=True``), never through full unpickling.

A checkpoint carries the number of its format (``format_version``, :data:`CHECKPOINT_FORMAT`) and the
gpattn version that wrote it (``gpattn_version``); :func:`check_checkpoint_format` refuses one of another
format with an error naming both formats, before any of it is used.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from pathlib import Path

import torch

from gpattn import __version__

__all__ = ["CHECKPOINT_FORMAT", "check_checkpoint_format", "checkpoint_format", "file_sha256", "load_file"]

#: the checkpoint format this gpattn writes and reads. 1: before the GP strategy protocol (gpattn 0.1.0 up
#: to 2026-11-25; KEP-SVGP's parameters under ``kep.``, CGP's and SCGP's under ``gp.``, decoupled SGPA's
#: global q(u) as ``inducing_values`` / ``raw_scale_tril``); 2: every GP variant's parameters under
#: ``strategy.``, q(u) as gpytorch's ``variational_mean`` / ``chol_variational_covar``; 3 (gpattn 0.2.0): the
#: SGPA variants' default model is the attention prior mean (docs/derivations.md §5c), so a checkpoint and
#: config of format ≤ 2 would be read as another model. When a change takes the next number rather than a migration
#: (gpattn._migrate): the one rule, docs/new_variant.md ("The one rule for a breaking change").
CHECKPOINT_FORMAT = 3

#: state-dict keys that only format 1 has (read when a checkpoint predates the ``format_version`` field)
_FORMAT_1_KEY = re.compile(r"(^|\.)(kep|gp)\.|(^|\.)(inducing_values|raw_scale_tril)$")

_MARKER = "WeightsUnpickler error:"


def _short_reason(err: pickle.UnpicklingError) -> str:
    """The weights-only unpickler's own complaint, without PyTorch's advice to turn the check off."""
    text = str(err)
    text = text.split(_MARKER, 1)[1] if _MARKER in text else text
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return first.split(". ", 1)[0].rstrip(".")


def load_file(path, *, map_location="cpu", what: str = "checkpoint"):
    """``torch.load(path, weights_only=True)`` onto ``map_location``; a ``ValueError`` naming the
    file (and ``what`` it should have been) when it is unreadable or holds anything but plain data."""
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # the weights-only unpickler met something it will not build
        raise ValueError(
            f"{path} is not a readable gpattn {what}, or was written by an unsafe tool: refusing to unpickle it "
            f"(torch.load weights_only=True rejected: {_short_reason(err)})"
        ) from None
    except Exception as err:  # truncated, empty or foreign files fail with EOFError, RuntimeError, ...
        raise ValueError(f"{path} is not a readable gpattn {what} ({type(err).__name__}: {err})") from err


def file_sha256(path) -> str:
    """The SHA-256 of a file's content, read in 1 MiB chunks (data files, checkpoints an evaluation names)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_format(ckpt: dict) -> object:
    """The format of a loaded checkpoint: its ``format_version``, or, for a checkpoint written before
    that field (gpattn 0.1.0), 1 or 2 read off its model's state-dict keys (:data:`CHECKPOINT_FORMAT`)."""
    if "format_version" in ckpt:
        return ckpt["format_version"]
    model = ckpt.get("model")
    keys = model.keys() if isinstance(model, dict) else ()
    return 1 if any(_FORMAT_1_KEY.search(str(k)) for k in keys) else 2


def check_checkpoint_format(ckpt: dict, path) -> None:
    """A ``ValueError`` naming the file, the checkpoint's format and the format this gpattn reads, with
    what to do, unless the checkpoint is of :data:`CHECKPOINT_FORMAT`."""
    found = checkpoint_format(ckpt)
    if found == CHECKPOINT_FORMAT and type(found) is int:
        return
    if type(found) is not int:
        raise ValueError(
            f"{path}: its format_version is {found!r}, not a format number; this gpattn ({__version__}) reads "
            f"checkpoint format {CHECKPOINT_FORMAT}: the file was not written by gpattn or was altered"
        )
    writer = ckpt.get("gpattn_version")
    writer = f"written by gpattn {writer}" if writer else "written before checkpoints named their gpattn version"
    if found < CHECKPOINT_FORMAT:
        raise ValueError(
            f"{path} is a checkpoint of format {found} ({writer}); this gpattn ({__version__}) reads checkpoint "
            f"format {CHECKPOINT_FORMAT} only: train the run again with this version, or load it with the gpattn "
            f"that wrote it (CHANGELOG.md says what changed between the formats)"
        )
    raise ValueError(
        f"{path} is a checkpoint of format {found} ({writer}), newer than this gpattn ({__version__}) reads "
        f"(checkpoint format {CHECKPOINT_FORMAT}): upgrade gpattn to load it (pip install --upgrade gpattn)"
    )
