"""gpattn's own warning classes, filtered by class (``warnings.simplefilter("ignore", gpattn.OldVersionWarning)``),
and :func:`warn`, which shows a warning at the user's line instead of a line inside gpattn."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

__all__ = ["DataWarning", "OldVersionWarning", "warn"]

#: the package folder: frames whose file lies inside it are gpattn's own
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class OldVersionWarning(UserWarning):
    """A run, config or state dict written by an older gpattn was migrated on load; the message names what was
    migrated (gpattn._migrate holds every migration; docs/new_variant.md the rule)."""


class DataWarning(UserWarning):
    """A data set loaded with something its user should know: rows cut to ``max_len`` or to the model's width, an
    evaluation split too small to say much, a run's data that could not be checked."""


def _library_prefixes() -> tuple[str, ...]:
    """Folders whose frames are never the user's line: gpattn, and the wrappers between a user and gpattn's code
    (torch's ``no_grad`` decorator and module call, contextlib, functools)."""
    found = [_PACKAGE, os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py",
             os.path.dirname(functools.__file__) + os.sep + "functools.py"]
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        found.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    return tuple(found)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside gpattn and the wrappers around
    its calls (the user's script or notebook line), as Python 3.12's ``skip_file_prefixes`` does: a fixed
    ``stacklevel`` pointed into gpattn wherever a wrapper (a lock, a loader registry, ``torch.no_grad``) sat
    between the user and the check."""
    skip = _library_prefixes()
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
