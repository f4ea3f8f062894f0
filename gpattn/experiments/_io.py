"""Safe loading of the files gpattn writes (checkpoints, cached predictions).

Every ``torch.load`` in gpattn goes through :func:`load_file`, which uses ``weights_only=True``: a
file that asks the unpickler for anything but plain data (dicts, lists, tuples, str, numbers, bool,
None, tensors) is refused before any of its code runs. What gpattn writes is plain data only, so no
type is allowlisted. A checkpoint whose pickle names a function or class (a ``__reduce__`` payload)
fails with a ``ValueError`` naming the file instead of executing it.

The same policy holds for any file format added later: tokenizers and pretrained weights are read as
data (JSON, safetensors, ``weights_only=True``), never through full unpickling.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

__all__ = ["load_file"]

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
