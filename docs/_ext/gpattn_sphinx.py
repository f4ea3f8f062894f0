"""Sphinx extension of gpattn's documentation site: the API reference written from the package's
``__all__`` lists, the site's navigation on the README, and the notebooks' figures on their pages.

- **API reference.** Every public module (a dotted name with no part starting with ``_``) gets a page
  under ``docs/api/`` (generated at each build, not committed): its docstring and every name in its
  ``__all__``. A function or class is described once, on the page of the module that defines it when
  that module is public (``gpattn.attention.registry.build_attention``), else of the shallowest public
  module that exports it (``gpattn.attention.GPAttention``, defined in ``gpattn.attention._gp``); the
  other modules that export it link there, and a reference by any of its names (``gpattn.build_attention``)
  resolves to that description. A public name without a docstring (classes and functions: their own
  ``__doc__``; constants: a ``#:`` comment above them), a name in ``__all__`` that the module lacks, and a
  public module without ``__all__`` are build warnings, so ``-W`` fails on them. The private modules get
  pages too (internals: what they define that no public module exports), so that references into the
  strategy protocol and the numerics resolve.
- **References.** A Python reference that Sphinx cannot resolve by name is resolved by the object it
  reaches in the code; one that reaches nothing stays a warning (an error under ``-W``); one that reaches
  a private name that is not described is shown as code.
- **Navigation.** The README is the home page, as it is on the repository; its toctrees are added to
  it when it is read, so the file stays the plain Markdown a repository shows.
- **Notebook figures.** The notebooks are scripts that save their figures (``fig.savefig``) and close
  them. Executed for the site, every PNG a notebook saves is shown below the cell that saved it: an
  IPython start-up file, used only by the kernels of the build, displays each saved file after saving.
"""

from __future__ import annotations

import importlib
import inspect
import logging as std_logging
import pkgutil
import re
import shutil
import types
from pathlib import Path

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.logging import get_node_location

logger = logging.getLogger(__name__)

PACKAGE = "gpattn"
#: the generated API pages (relative to the source folder, the repository root)
API_DIR = Path("docs") / "api"

#: the site's navigation, added to the README (home page) when it is read: (caption, documents)
NAVIGATION = (
    (
        "Guides",
        (
            "docs/variants",
            "GLOSSARY",
            "docs/cli",
            "docs/kernels",
            "docs/new_variant",
            "docs/huggingface",
            "docs/uncertainty",
            "docs/development",
        ),
    ),
    ("Mathematics", ("docs/derivations",)),
    ("Measurements", ("docs/results", "docs/benchmarks")),
    (
        "Verification notebooks",
        (
            "notebooks/sgpa_posterior",
            "notebooks/kep_svgp_eigenfeatures",
            "notebooks/cgp_correlated",
            "notebooks/gumbel_attention",
            "notebooks/elbo_deep_gp",
        ),
    ),
    ("Reference", ("docs/api/index", "CHANGELOG")),
)

#: run in every kernel the build starts (IPYTHONDIR points at it): show each PNG a notebook saves
FIGURE_STARTUP = '''\
"""Documentation build only: every PNG a notebook saves is shown below the cell that saved it."""
import os

import matplotlib.figure
from IPython.display import Image, display

_savefig = matplotlib.figure.Figure.savefig


def _savefig_and_show(self, fname, *args, **kwargs):
    result = _savefig(self, fname, *args, **kwargs)
    if isinstance(fname, (str, os.PathLike)) and os.fspath(fname).endswith(".png"):
        display(Image(filename=os.fspath(fname)))
    return result


matplotlib.figure.Figure.savefig = _savefig_and_show
'''


# ----------------------------------------------------------------------------- modules and names
def _is_private(modname: str) -> bool:
    return any(part.startswith("_") for part in modname.split("."))


def package_modules(package: str = PACKAGE) -> tuple[list[str], list[str]]:
    """``(public, private)`` modules of ``package``, sorted. A module is public when no part of its
    dotted name starts with ``_``; ``__main__`` (which runs the command line) is neither."""
    root = importlib.import_module(package)
    public, private = [package], []
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if info.name.endswith(".__main__"):
            continue
        (private if _is_private(info.name) else public).append(info.name)
    return sorted(public), sorted(private)


def _is_described(obj) -> bool:
    """Functions and classes are described once (where they are canonical); anything else in place."""
    return inspect.isclass(obj) or inspect.isfunction(obj)


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    if isinstance(obj, types.ModuleType):
        return "module"
    return "data"


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == PACKAGE


class Reference:
    """What the API reference describes where: each public module's ``__all__`` (``exports``), the
    canonical ``module.name`` of every gpattn function and class (``canonical``: its defining module when
    that module is public and exports it, else the shallowest public module exporting it, else, for the
    internals, its defining private module), and the problems met (``problems``, messages)."""

    def __init__(self, package: str = PACKAGE):
        self.public, self.private = package_modules(package)
        self.exports: dict[str, list] = {}
        self.problems: list[str] = []
        for modname in self.public:
            module = importlib.import_module(modname)
            names = getattr(module, "__all__", None)
            if names is None:
                if not hasattr(module, "__path__"):  # a package without __all__ lists its submodules only
                    self.problems.append(f"public module {modname} has no __all__: list its public names in one")
                names = []
            pairs = []
            for name in names:
                if not hasattr(module, name):
                    self.problems.append(f"{modname}.__all__ names {name!r}, which {modname} does not define")
                    continue
                pairs.append((name, getattr(module, name)))
            self.exports[modname] = pairs
        self.canonical: dict[int, str] = {}
        for modname in self.public:  # defined and exported in a public module: described there
            for name, obj in self.exports[modname]:
                if _is_described(obj) and _ours(obj) and obj.__module__ == modname:
                    self.canonical.setdefault(id(obj), f"{modname}.{name}")
        for modname in sorted(self.public, key=lambda m: (m.count("."), m)):  # re-exported from elsewhere
            for name, obj in self.exports[modname]:
                if _is_described(obj) and _ours(obj):
                    self.canonical.setdefault(id(obj), f"{modname}.{name}")
        # a constant is described where it is assigned under a ``#:`` comment: (name, id) -> module
        self.data_home: dict[tuple[str, int], str] = {}
        for modname in self.public + self.private:
            module = importlib.import_module(modname)
            exported = {n for n, _ in self.exports.get(modname, [])}
            for (cls, name), _doc in _attr_docs(modname).items():
                if not cls and hasattr(module, name) and (modname in self.private or name in exported):
                    self.data_home.setdefault((name, id(getattr(module, name))), modname)
        self.internals: dict[str, list] = {}
        for modname in self.private:  # what the private modules define and no public module exports
            module = importlib.import_module(modname)
            own = [(n, o) for n, o in vars(module).items()
                   if (_is_described(o) and getattr(o, "__module__", None) == modname)
                   or (not _is_described(o) and self.data_home.get((n, id(o))) == modname)]  # fmt: skip
            self.internals[modname] = [(n, o) for n, o in own if id(o) not in self.canonical]
            for name, obj in self.internals[modname]:
                if _is_described(obj):
                    self.canonical.setdefault(id(obj), f"{modname}.{name}")

    def documented(self, obj) -> bool:
        return id(obj) in self.canonical

    def home(self, modname: str, name: str, obj) -> str:
        """Where ``modname.name`` is described: ``module.name``."""
        if _is_described(obj):
            return self.canonical.get(id(obj), f"{modname}.{name}") if _ours(obj) else f"{modname}.{name}"
        return f"{self.data_home.get((name, id(obj)), modname)}.{name}"

    def is_canonical(self, modname: str, name: str, obj) -> bool:
        return self.home(modname, name, obj) == f"{modname}.{name}"


def missing_docstring(name: str, obj, attr_docs) -> bool:
    """True when a public name has no docstring of its own: a class or function without ``__doc__``
    (not inherited), a constant without a ``#:`` comment (submodules have their own pages)."""
    kind = _kind(obj)
    if kind == "module":
        return False
    if kind == "data":
        return ("", name) not in attr_docs
    return not (obj.__doc__ or "").strip()


def _attr_docs(modname: str) -> dict:
    try:
        return ModuleAnalyzer.for_module(modname).find_attr_docs()
    except Exception:  # noqa: BLE001 - a module without source (none in gpattn) has no comments
        return {}


# ----------------------------------------------------------------------------- pages
def _title(text: str) -> str:
    return f"{text}\n{'=' * len(text)}\n"


def _describe(name: str, obj, members: str) -> list[str]:
    kind = _kind(obj)
    if kind in ("class", "exception"):
        return [f".. auto{kind}:: {name}", f"   {members}", "   :show-inheritance:", ""]
    if kind == "function":
        return [f".. autofunction:: {name}", ""]
    simple = isinstance(obj, (bool, int, float, str)) and len(repr(obj)) <= 60
    return [f".. autodata:: {name}"] + ([] if simple else ["   :no-value:"]) + [""]


def _role(obj) -> str:
    return {"function": "func", "class": "class", "exception": "exc"}.get(_kind(obj), "data")


def module_page(modname: str, ref: Reference) -> str:
    """The reStructuredText of one public module's API page."""
    lines = [_title(f"``{modname}``"), f".. automodule:: {modname}", "   :no-members:", ""]
    depth = modname.count(".") + 1
    submodules = [m for m in ref.public if m.startswith(f"{modname}.") and m.count(".") == depth]
    if submodules:
        lines += ["**Submodules:** " + ", ".join(f":mod:`{m}`" for m in submodules), ""]
    names = [(n, o) for n, o in ref.exports[modname] if _kind(o) != "module"]
    if not names:
        return "\n".join(lines)
    lines += [f".. currentmodule:: {modname}", ""]
    elsewhere = []
    for name, obj in names:
        if _is_described(obj) and not _ours(obj):
            elsewhere.append(f"- ``{name}``: ``{obj.__module__}.{obj.__qualname__}``, re-exported")
        elif ref.is_canonical(modname, name, obj):
            lines += _describe(name, obj, ":members:")
        else:
            elsewhere.append(f"- ``{name}``: :py:{_role(obj)}:`{ref.home(modname, name, obj)}`")
    if elsewhere:
        lines += ["Also exported here (described where they are defined):", "", *elsewhere, ""]
    return "\n".join(lines)


def internals_page(modname: str, ref: Reference) -> str:
    """A private module's page: what it defines that no public module exports (for extending gpattn;
    no promise of stability)."""
    lines = [_title(f"``{modname}``"), f".. automodule:: {modname}", "   :no-members:", ""]
    if ref.internals[modname]:
        lines += [f".. currentmodule:: {modname}", ""]
        for name, obj in ref.internals[modname]:
            lines += _describe(name, obj, ":members:\n   :private-members:")
    return "\n".join(lines)


def index_page(ref: Reference) -> str:
    lines = [
        _title("API reference"),
        "Every public module of gpattn and every name in its ``__all__``, from the docstrings: a function",
        "or class is described on the page of the module that defines it (or, defined in a private module,",
        "of the shallowest public module that exports it), and linked from the others. The library core",
        "needs torch, gpytorch, linear_operator and numpy; :mod:`gpattn.experiments` is the experiment",
        "application (``pip install 'gpattn[experiments]'``) and :mod:`gpattn.integrations.huggingface`",
        "needs ``transformers`` (``pip install 'gpattn[huggingface]'``).",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "   :caption: Public modules",
        "",
        *[f"   {m}" for m in ref.public],
        "",
        "Internals: the private modules, for extending gpattn (a new GP variant subclasses the strategy",
        "protocol of ``gpattn.variational._strategy``, see :doc:`/docs/new_variant`) and for reading the",
        "numerics; they may change in any release.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "   :caption: Internals",
        "",
        *[f"   {m}" for m in ref.private],
    ]
    return "\n".join(lines) + "\n"


def write_api(app) -> None:
    """builder-inited: write ``docs/api/*.rst`` afresh and warn about every public name without a docstring."""
    out = Path(app.srcdir) / API_DIR
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ref = Reference()
    app.gpattn_reference = ref
    for problem in ref.problems:
        logger.warning("API reference: %s", problem)
    for modname in ref.public:
        docs = _attr_docs(modname)
        for name, obj in ref.exports[modname]:
            if ref.is_canonical(modname, name, obj) and _ours_or_data(obj) and missing_docstring(name, obj, docs):
                how = "a '#:' comment above it" if _kind(obj) == "data" else "a docstring"
                source = getattr(obj, "__module__", modname) if _kind(obj) != "data" else modname
                logger.warning(
                    "API reference: %s.%s (in __all__) has no docstring: add %s in %s",
                    modname,
                    name,
                    how,
                    _module_file(source, app.srcdir),
                )
        (out / f"{modname}.rst").write_text(module_page(modname, ref), encoding="utf-8")
    for modname in ref.private:
        (out / f"{modname}.rst").write_text(internals_page(modname, ref), encoding="utf-8")
    (out / "index.rst").write_text(index_page(ref), encoding="utf-8")


def no_type_docstring(app, what, name, obj, options, lines) -> None:
    """autodoc-process-docstring: a constant without a ``#:`` comment would show its type's docstring
    (``dict``'s, ``str``'s); it shows nothing instead (and the reference warns if it is public)."""
    if what in ("data", "attribute") and lines:
        doc = type(obj).__doc__
        own = inspect.cleandoc(doc).splitlines() if isinstance(doc, str) else []
        if own and [line.strip() for line in lines if line.strip()][:1] == [own[0].strip()]:
            lines.clear()


def _ours_or_data(obj) -> bool:
    return _ours(obj) or not _is_described(obj)


def _module_file(modname: str, root) -> str:
    """The module's file relative to the repository root (the site's source folder)."""
    path = Path(inspect.getfile(importlib.import_module(modname))).resolve()
    try:
        return path.relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


def public_bases(app, name, obj, options, bases) -> None:
    """autodoc-process-bases: a base class that the reference does not describe (a private class such as
    ``_SequenceClassifier``) is shown as its own bases, so every base shown links somewhere."""
    ref = getattr(app, "gpattn_reference", None)
    if ref is None:
        return
    shown, todo = [], list(bases)
    while todo:
        base = todo.pop(0)
        if inspect.isclass(base) and _ours(base) and not ref.documented(base):
            todo = [b for b in base.__bases__ if b is not object] + todo
        elif base not in shown:
            shown.append(base)
    bases[:] = shown or [object]


# ----------------------------------------------------------------------------- cross-references by object
def _locate(dotted: str):
    """The object a dotted name reaches (import the longest module prefix, then attributes), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # noqa: BLE001 - a name that is no module may fail to import in other ways
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj, parts[:cut], parts[cut:]
    return None


def documented_name(ref: Reference, dotted: str) -> str | None:
    """The name under which the reference describes what ``dotted`` reaches in the code: a module, a
    function or class (its canonical name), a member of one (``Class.member`` under the class's
    canonical name), or a constant some public module exports. ``""`` when the object exists but is not
    described (a private name: shown as code, not linked); None when the code has no such object."""
    found = _locate(dotted)
    if found is None:
        return None
    obj, modparts, attrs = found
    if not attrs:
        name = ".".join(modparts)
        return name if name in ref.public or name in ref.private else ""
    if id(obj) in ref.canonical:
        return ref.canonical[id(obj)]
    owner = importlib.import_module(".".join(modparts))
    for i in range(len(attrs) - 1, 0, -1):  # the deepest described class on the way: Class.member
        container = owner
        for attr in attrs[:i]:
            container = getattr(container, attr)
        if id(container) in ref.canonical and inspect.isclass(container):
            return ".".join([ref.canonical[id(container)], *attrs[i:]])
    home = ref.data_home.get((attrs[-1], id(obj)))  # a constant: where it is described
    if home is not None and len(attrs) == 1:
        return f"{home}.{attrs[-1]}"
    for modname, pairs in ref.exports.items():  # or where a public module exports it
        for name, value in pairs:
            if name == attrs[-1] and value is obj and not _is_described(obj):
                return f"{modname}.{name}"
    return ""


def _defining_scopes(node, target: str) -> list[str]:
    """``target`` read in the scope where the docstring holding the reference was written: a docstring
    of ``gpattn.kernels._factory.make_kernel`` shown as ``gpattn.kernels.make_kernel`` still means the
    names of ``gpattn.kernels._factory`` (its module) and of its class, for a method."""
    match = re.search(r"docstring of ([\w.]+)", node.source or "")
    found = _locate(match.group(1)) if match else None
    if found is None:
        return []
    obj = found[0]
    module = getattr(obj, "__module__", None) or (obj.__name__ if isinstance(obj, types.ModuleType) else None)
    if not module:
        return []
    scopes = [f"{module}.{target}"]
    qualname = getattr(obj, "__qualname__", "")
    if "." in qualname:
        scopes.insert(0, f"{module}.{qualname.rsplit('.', 1)[0]}.{target}")
    return scopes


def resolve_by_object(app, env, node, contnode):
    """missing-reference: a Python reference that Sphinx could not resolve by name is resolved by the
    object it names: ``gpattn.models.TransformerClassifier`` and ``TransformerClassifier`` written inside
    ``gpattn.models.classifiers`` both reach the one description. A name that exists but is private is
    shown as code without a link; a name the code lacks stays a broken reference (a warning)."""
    ref = getattr(app, "gpattn_reference", None)
    if ref is None or node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    modname, clsname = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if modname and clsname:
        candidates.append(f"{modname}.{clsname}.{target}")
    if modname:
        candidates.append(f"{modname}.{target}")
    candidates += _defining_scopes(node, target)
    domain = env.get_domain("py")
    for candidate in candidates:
        if candidate.split(".")[0] != PACKAGE:
            continue
        name = documented_name(ref, candidate)
        if name is None:
            continue
        if name == "":
            return contnode
        for role in (node["reftype"], "obj"):
            resolved = domain.resolve_xref(env, node["refdoc"], app.builder, role, name, node, contnode)
            if resolved is not None:
                return resolved
    return None


# ----------------------------------------------------------------------------- README as home page
def add_navigation(app, docname: str, source: list[str]) -> None:
    """source-read: the root document (the README) gets the site's toctrees, hidden (the sidebar shows them)."""
    if docname != app.config.root_doc:
        return
    blocks = []
    for caption, documents in NAVIGATION:
        entries = "\n".join(f"/{d}" for d in documents)
        blocks.append(f"\n\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{entries}\n```\n")
    source[0] += "".join(blocks)


_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^()\s]+)\)")  # [text](target), not an image


def link_files(app, docname: str, source: list[str]) -> None:
    """source-read: a Markdown link to a repository file that is no page of the site (a test, a
    script) becomes a download of that file on the site; on the repository it stays a plain link."""
    if not str(app.env.doc2path(docname)).endswith(".md"):
        return
    here = Path(app.env.doc2path(docname)).parent

    def rewrite(match):
        target = match.group(2)
        if ":" in target or target.startswith("#"):
            return match.group(0)
        path = (here / target.split("#")[0]).resolve()
        try:
            rel = path.relative_to(Path(app.srcdir).resolve())
        except ValueError:
            return match.group(0)
        page = rel.with_suffix("").as_posix() in app.env.found_docs
        return match.group(0) if page or not path.is_file() else f"[{match.group(1)}](path:{target})"

    source[0] = _LINK.sub(rewrite, source[0])


def write_redirect(app, exception) -> None:
    """build-finished: ``index.html`` opens the home page (the README's page)."""
    if exception is not None or app.builder.format != "html":
        return
    target = f"{app.config.root_doc}.html"
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="0; url={target}"><link rel="canonical" href="{target}">'
        f'<title>gpattn</title></head><body><a href="{target}">gpattn documentation</a></body></html>\n'
    )
    Path(app.outdir, "index.html").write_text(page, encoding="utf-8")


def write_figure_startup(ipython_dir: Path) -> None:
    """The IPython profile the build's kernels start with (conf.py points IPYTHONDIR at it)."""
    startup = Path(ipython_dir) / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-show-saved-figures.py").write_text(FIGURE_STARTUP, encoding="utf-8")


# ----------------------------------------------------------------------------- files not yet held to -W
class NotYetFilter(std_logging.Filter):
    """Warnings located in a file of the ``gpattn_not_yet`` setting (paths relative to the repository
    root: files that another change is rewriting at the time of writing) are not counted; they are listed
    at the end of the build instead, so they stay visible until that list is emptied."""

    def __init__(self, app):
        super().__init__()
        self.app, self.held = app, []

    def filter(self, record) -> bool:
        prefixes = getattr(self.app.config, "gpattn_not_yet", ())
        if not prefixes or record.levelno < std_logging.WARNING:
            return True
        where = _location_text(self.app, getattr(record, "location", None))
        root = str(Path(self.app.srcdir)) + "/"
        rel = where[len(root) :] if where.startswith(root) else where
        message = record.getMessage()
        named = message.startswith("API reference:") and any(f" in {p}" in message for p in prefixes)
        if rel.startswith(tuple(prefixes)) or named:
            self.held.append(f"{rel}: {message}" if rel else message)
            return False
        return True


def _location_text(app, location) -> str:
    if location is None:
        return ""
    if isinstance(location, str):
        return location
    if isinstance(location, tuple):
        docname = location[0]
        return str(app.env.doc2path(docname)) if docname else ""
    return get_node_location(location) or ""


def report_not_yet(app, exception) -> None:
    """build-finished: the warnings held back by ``gpattn_not_yet``, listed (not counted)."""
    held = app.gpattn_not_yet_filter.held
    if held:
        logger.info("%d warnings in files listed in gpattn_not_yet (not counted, to fix there):", len(held))
        for line in held:
            logger.info("  %s", line)


def setup(app):
    app.add_config_value("gpattn_not_yet", (), "env")
    app.gpattn_not_yet_filter = NotYetFilter(app)
    for handler in std_logging.getLogger("sphinx").handlers:  # before the handler counts the warning
        if handler.level >= std_logging.WARNING:
            handler.filters.insert(0, app.gpattn_not_yet_filter)
    app.connect("build-finished", report_not_yet)
    app.connect("builder-inited", write_api)
    app.connect("autodoc-process-bases", public_bases)
    app.connect("autodoc-process-docstring", no_type_docstring)
    app.connect("missing-reference", resolve_by_object)
    app.connect("source-read", add_navigation)
    app.connect("source-read", link_files)
    app.connect("build-finished", write_redirect)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
