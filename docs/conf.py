"""Sphinx configuration of gpattn's documentation site: ``make docs`` (the README says how).

The source folder is the repository root, so that the README, GLOSSARY.md, docs/*.md and notebooks/*.py
are the site's pages as they are and their relative links work on the repository and on the site
alike; this folder holds the configuration only. Built with warnings as errors (``-W -n``): a broken
cross-reference, a link to a page that does not exist or a public name without a docstring fails it.
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "_ext"))

import gpattn_sphinx  # noqa: E402

import gpattn  # noqa: E402

project = "gpattn"
author = "the gpattn developers"
copyright = "2026, the gpattn developers"
release = gpattn.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
    "gpattn_sphinx",
]

root_doc = "README"
# the pages; everything else in the repository is not part of the site (the build folder, .venv, runs/
# and the sources are pruned from the walk as well)
include_patterns = ["README.md", "GLOSSARY.md", "CHANGELOG.md", "docs/*.md", "docs/api/*.rst", "notebooks/*.py"]
exclude_patterns = [".venv", "build", "dist", "runs", ".git", "**/__pycache__", "*.egg-info", ".pytest_cache"]

# ---------------------------------------------------------------------------- Markdown (MyST)
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 4  # the README's "#pretrained-encoders-hugging-face" links resolve

# ---------------------------------------------------------------------------- notebooks (myst-nb)
# the notebooks are jupytext percent scripts: read as notebooks, executed at CI size on every build
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
# GPATTN_DOCS_EXECUTE=cache reuses the outputs of an unchanged notebook (build/docs/.jupyter_cache); the
# default executes every notebook on every build, so the pages never show outputs of older code
nb_execution_mode = os.environ.get("GPATTN_DOCS_EXECUTE", "force")
nb_execution_cache_path = str(ROOT / "build" / "docs" / ".jupyter_cache")
nb_execution_timeout = 900  # per cell
nb_execution_raise_on_error = True  # a failing assert cell fails the build
nb_execution_show_tb = True
nb_merge_streams = True
os.environ.setdefault("GPATTN_NOTEBOOK_SIZE", "ci")  # GPATTN_NOTEBOOK_SIZE=full make docs: the full size
os.environ.setdefault("GPATTN_NOTEBOOK_OUT", str(ROOT / "build" / "docs" / "notebook-runs"))
os.environ.setdefault("MPLBACKEND", "Agg")
_ipython = ROOT / "build" / "docs" / "ipython"
gpattn_sphinx.write_figure_startup(_ipython)
os.environ["IPYTHONDIR"] = str(_ipython)

# ---------------------------------------------------------------------------- API reference (autodoc)
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # torch's and gpytorch's docstrings are not ours to check
autodoc_default_options = {"exclude-members": "__init__, __new__"}
add_module_names = False
python_use_unqualified_type_names = True

# Cross-references are checked (-n): every reference to gpattn must resolve. The libraries below have no
# inventory offline (intersphinx would download one), so references into them are not checked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|gpytorch|linear_operator|numpy|np|nn|matplotlib|transformers|sklearn|scipy|tqdm)(\..*)?"),
    (r"py:.*", r"(Tensor|Module|Parameter|MultivariateNormal|LinearOperator|Kernel|ndarray|Figure|Axes)"),
    (r"py:.*", r"(Path|PathLike|Callable|Iterable|Iterator|Mapping|Sequence|FigureCanvasAgg)"),
    # the standard library (no inventory offline either)
    (r"py:.*", rf"({'|'.join(sorted(sys.stdlib_module_names))})(\..*)?"),
]

# ---------------------------------------------------------------------------- HTML
html_theme = "furo"
html_title = f"gpattn {release}"
html_static_path = []
html_extra_path = ["../LICENSE"]  # the licence beside the pages
html_show_sourcelink = False

# Files whose warnings (docstrings, pages) a build lists at its end without counting them: for a change that
# rewrites them while the site is built elsewhere. Empty: every warning counts (-W fails the build).
gpattn_not_yet = ()
