"""Safe loading of the files gpattn writes (checkpoints, cached predictions).

Every ``torch.load`` in gpattn goes through :func:`load_file`, which uses ``weights_only=True``: a
file that asks the unpickler for anything but plain data (dicts, lists, tuples, str, numbers, bool,
None, tensors) is refused before any of its code runs. What gpattn writes is plain data only, so no
type is allowlisted. A checkpoint whose pickle names a function or class (a ``__reduce__`` payload)
fails with a ``ValueError`` naming the file instead of executing it.

The same policy holds for any file format added later: tokenizers and pretrained weights are read as
data (JSON, safetensors, ``weights_only=True``), never through full unpickling.

A checkpoint carries the number of its format (``format_version``, :data:`CHECKPOINT_FORMAT`) and the
gpattn version that wrote it (``gpattn_version``); :func:`check_checkpoint_format` lets through this format and
the formats of the releases in :data:`MIGRATED_RELEASES` (read as today's by gpattn._migrate, the one load hook),
and refuses any other with an error naming the version that wrote it, both formats and what to do, before any of
it is used.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from pathlib import Path

import torch

from gpattn import __version__

__all__ = [
    "CHECKPOINT_FORMAT",
    "MIGRATED_RELEASES",
    "check_checkpoint_format",
    "check_resumable",
    "checkpoint_format",
    "file_sha256",
    "load_file",
]

#: the checkpoint format this gpattn writes and reads. 1: before the GP strategy protocol (the 0.1.0 development
#: series up to 2026-11-25; KEP-SVGP's parameters under ``kep.``, CGP's and SCGP's under ``gp.``, decoupled SGPA's
#: global q(u) as ``inducing_values`` / ``raw_scale_tril``); 2: every GP variant's parameters under ``strategy.``,
#: q(u) as gpytorch's ``variational_mean`` / ``chol_variational_covar`` (the 0.1.0 series after that, unversioned,
#: with the SGPA variants' papers' zero mean; and gpattn 0.2.0, which names its version); 3 (after 0.2.0): the
#: number that kept the 0.1.0 series' SGPA runs from being read as the attention-mean model of the same
#: configuration. When a change takes the next number rather than a migration (gpattn._migrate): the one rule,
#: docs/new_variant.md ("The one rule for a breaking change").
CHECKPOINT_FORMAT = 3

#: the releases whose checkpoints this gpattn reads, and the format each wrote: their runs load through
#: gpattn._migrate (configs filled in, state dicts by the one load hook), each migration named by an
#: ``OldVersionWarning`` (docs/development.md, "Versions and compatibility")
MIGRATED_RELEASES = {"0.2.0": 2}

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
    """A ``ValueError`` naming the file, the version that wrote the checkpoint, its format and the formats this
    gpattn reads, with what to do, unless the checkpoint is of :data:`CHECKPOINT_FORMAT` or a release's of
    :data:`MIGRATED_RELEASES` (whose config and state dict the loaders migrate)."""
    found, writer = checkpoint_format(ckpt), ckpt.get("gpattn_version")
    if type(found) is not int:
        raise ValueError(
            f"{path}: its format_version is {found!r}, not a format number; this gpattn ({__version__}) reads "
            f"checkpoint format {CHECKPOINT_FORMAT}: the file was not written by gpattn or was altered"
        )
    if found == CHECKPOINT_FORMAT or MIGRATED_RELEASES.get(writer) == found:
        return
    by = f"written by gpattn {writer}" if writer else "written before checkpoints named their gpattn version"
    reads = f"this gpattn ({__version__}) reads checkpoint format {CHECKPOINT_FORMAT}" + "".join(
        f" and the runs of gpattn {release} (format {fmt})" for release, fmt in MIGRATED_RELEASES.items()
    )
    if found > CHECKPOINT_FORMAT:
        raise ValueError(
            f"{path} is a checkpoint of format {found} ({by}), newer than {reads}: upgrade gpattn to load it "
            f"(pip install --upgrade gpattn)"
        )
    raise ValueError(
        f"{path} is a checkpoint of format {found} ({by}); {reads}. A development version wrote it, and no "
        f"migration reads it as the model it trained: train the run again with this version (its config.json lists "
        f"the settings), or load it at the commit that wrote it"
    )


def check_resumable(ckpt: dict, path) -> None:
    """``--resume`` continues a checkpoint of :data:`CHECKPOINT_FORMAT` only: a release's run, which loads through
    a migration, is finished by the gpattn that started it (its optimizer and random states continue that
    version's steps); a ``ValueError`` naming the version and the two ways on."""
    found = checkpoint_format(ckpt)
    if found != CHECKPOINT_FORMAT:
        writer = ckpt.get("gpattn_version")
        raise ValueError(
            f"--resume: {path} was written by gpattn {writer} (checkpoint format {found}); a run resumes with the "
            f"gpattn that started it: finish it with that version (pip install 'gpattn[experiments]=={writer}'), or "
            f"train it again with this one ({__version__}): the same command with --overwrite in place of --resume"
        )
