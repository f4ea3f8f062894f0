"""The check that ``gpattn`` is this package, not a folder of the same name that shadows it.

A clone of the repository (``git clone ... gpattn``) is a folder ``gpattn/`` without ``__init__.py``; a script run
from the folder that holds it imports that folder as a namespace package (Python searches the script's folder
first), and the first ``from gpattn import ...`` of an editable install then failed with "cannot import name
'_lazy_submodules' from 'gpattn' (unknown location)". The subpackages that import from the top package call
:func:`check_not_shadowed` first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def check_not_shadowed() -> None:
    """An ``ImportError`` saying what happened and what to do when ``sys.modules["gpattn"]`` is a namespace package
    (a folder named gpattn) instead of this package."""
    top = sys.modules.get("gpattn")
    if top is None or getattr(top, "__file__", None) is not None:
        return
    found = [os.path.abspath(p) for p in getattr(top, "__path__", [])]
    folder = found[0] if found else "a folder named gpattn"
    raise ImportError(
        f"`import gpattn` found the folder {folder}, which has no __init__.py (a clone of the gpattn repository, "
        f"say), instead of the installed package in {Path(__file__).resolve().parent}: Python looks in the script's "
        f"folder (or the working directory) first, and there that folder shadows the package. Run the script from "
        f"another folder (e.g. cd {folder}, where ./gpattn is the package itself), or give the clone another name "
        f"(git clone URL gpattn-src)."
    )
