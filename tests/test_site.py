"""The documentation site builds from nothing with warnings as errors (``make docs``'s command) and holds
what it promises: the README as home page with the variants table, the derivations, the results pages
with their figures, the five notebooks executed with their plots, and an API reference in which every
name of every public module's ``__all__`` is described or linked."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.py"))
FIGURES = sorted(p.name for p in (ROOT / "docs").glob("*.png"))

pytest.importorskip("sphinx", reason="the docs extra: pip install -e '.[docs]' (make install does)")
pytest.importorskip("myst_nb", reason="the docs extra: pip install -e '.[docs]' (make install does)")


def _extension():
    spec = importlib.util.spec_from_file_location("gpattn_sphinx", ROOT / "docs" / "_ext" / "gpattn_sphinx.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``make docs``'s build into a fresh folder: (html folder, the build's output)."""
    tmp = tmp_path_factory.mktemp("site")
    env = {**os.environ, "GPATTN_NOTEBOOK_SIZE": "ci", "GPATTN_NOTEBOOK_OUT": str(tmp / "notebook-runs")}
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-n", "-W", "--keep-going", "-c", "docs", "."]
    cmd.append(str(tmp / "html"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    return tmp / "html", proc


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_the_site_builds_with_warnings_as_errors(site):
    html, proc = site
    warnings = [line for line in proc.stderr.splitlines() if re.search(r"(WARNING|ERROR): ", line)]
    log = "\n".join(warnings) or proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    # Sphinx's warnings ("file:line: WARNING: ..."); the kernels' own log lines ("[IPKernelApp] WARNING |") are not
    assert "build succeeded" in proc.stdout and not re.search(r"(WARNING|ERROR): ", proc.stderr), log
    home = (html / "index.html").read_text()
    assert 'content="0; url=README.html"' in home
    readme = (html / "README.html").read_text()
    assert "<table" in readme and "sgpa-decoupled" in readme and "Verification notebooks" in readme
    assert (html / "LICENSE").is_file() and (html / "CHANGELOG.html").is_file()


@pytest.mark.slow
def test_derivations_and_results_pages_with_their_figures(site):
    html, _ = site
    derivations = (html / "docs" / "derivations.html").read_text()
    assert "5a." in derivations and "11c." in derivations  # the pinned section numbering (test_docs.py)
    results = (html / "docs" / "results.html").read_text() + (html / "docs" / "benchmarks.html").read_text()
    shown = set(re.findall(r'<img[^>]+src="[^"]*/([^"/]+\.png)"', results))
    assert set(FIGURES) <= shown, set(FIGURES) - shown
    assert all((html / "_images" / name).is_file() for name in FIGURES)


_HREF = re.compile(r'<a\s[^>]*href="([^"]*)"')
_ID = re.compile(r'\bid="([^"]*)"')


def broken_links(html: Path) -> list[str]:
    """Every internal link of the built site (an href to a local page, file or #anchor) whose file or anchor does
    not exist, as "page: href". The anchors of the highlighted sources' "[docs]" links (``_modules/``, written by
    sphinx.ext.viewcode) are not checked: viewcode names an object by the module that defines it, and the
    reference describes a private module's names on the public module that exports them (their files are checked)."""
    ids, broken = {}, []
    pages = sorted(html.rglob("*.html"))
    for page in pages:
        sources = page.relative_to(html).parts[0] == "_modules"
        for href in _HREF.findall(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", href) or href.startswith("//"):  # http:, mailto:, javascript:
                continue
            path, _, anchor = href.partition("#")
            target = (page.parent / path.split("?")[0]).resolve() if path else page.resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(html)}: {href}")
            elif anchor and target.suffix == ".html" and not sources:
                if target not in ids:
                    ids[target] = set(_ID.findall(target.read_text()))
                if anchor not in ids[target]:
                    broken.append(f"{page.relative_to(html)}: {href}")
    return broken


def test_the_link_check_finds_missing_pages_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "a.html").write_text(
        '<h1 id="top">a</h1><a href="docs/b.html#here">b</a><a class="x" href="#top">top</a>'
        '<a href="https://example.org/x.html">out</a><a href="docs/c.html">gone</a><a href="docs/b.html#nowhere">x</a>'
    )
    (tmp_path / "docs" / "b.html").write_text('<p id="here"></p><a href="../a.html#top">back</a>')
    (tmp_path / "_modules").mkdir()
    (tmp_path / "_modules" / "m.html").write_text('<a href="../docs/b.html#gone">[docs]</a><a href="../d.html">x</a>')
    expected = ["_modules/m.html: ../d.html", "a.html: docs/c.html", "a.html: docs/b.html#nowhere"]
    assert broken_links(tmp_path) == expected


@pytest.mark.slow
def test_the_variants_page_and_every_internal_link(site):
    html, _ = site
    variants = (html / "docs" / "variants.html").read_text()
    assert variants.count("<table") >= 4 and "Which variant for what" in variants
    for name in __import__("gpattn").list_attention():
        assert f'<span class="pre">{name}</span>' in variants, name
    readme = (html / "README.html").read_text()
    assert 'href="docs/variants.html"' in readme  # in the navigation of every page
    broken = broken_links(html)
    assert not broken, "\n".join(broken[:50])


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_pages_show_their_executed_plots(site, name):
    page = (site[0] / "notebooks" / f"{name}.html").read_text()
    images = re.findall(r'<img[^>]+src="([^"]+\.png)"', page)
    assert images, f"{name}: no plot on the page"
    assert "SIZE=ci" in page or "ci" in page
    assert 'class="output' in page and "Traceback" not in page


@pytest.mark.slow
def test_the_api_reference_describes_every_public_name(site):
    html, _ = site
    ext = _extension()
    ref = ext.Reference()
    assert len(ref.public) >= 40
    pages = {m: (html / "docs" / "api" / f"{m}.html") for m in ref.public + ref.private}
    missing = [m for m, p in pages.items() if not p.is_file()]
    assert not missing, missing
    text = {m: p.read_text() for m, p in pages.items()}
    absent = []
    for modname in ref.public:
        for name, obj in ref.exports[modname]:
            if ext._kind(obj) == "module":
                ok = pages.get(f"{modname}.{name}", Path("-")).is_file()
            elif ext._is_described(obj) and not ext._ours(obj):  # re-exported from another library
                ok = f'<code class="docutils literal notranslate"><span class="pre">{name}</span>' in text[modname]
            else:
                home = ref.home(modname, name, obj)
                page = text[home.rsplit(".", 1)[0]]
                link = f'href="{home.rsplit(".", 1)[0]}.html#{home}"'
                ok = f'id="{home}"' in page and (home == f"{modname}.{name}" or link in text[modname])
            if not ok:
                absent.append(f"{modname}.{name}")
    assert not absent, absent
    # equations in docstrings are rendered (MathJax), e.g. the exponential kernel's
    kernel = text["gpattn.kernels.exponential"]
    assert 'class="math' in kernel and "mathjax" in kernel.lower()


def test_public_names_without_docstrings_are_found():
    """The reference's own check (which the build turns into an error) sees what it must."""
    ext = _extension()

    def undocumented():
        pass

    def documented():
        """Here."""

    assert ext.missing_docstring("undocumented", undocumented, {})
    assert not ext.missing_docstring("documented", documented, {})
    assert ext.missing_docstring("LIMIT", 3, {}) and not ext.missing_docstring("LIMIT", 3, {("", "LIMIT"): ["x"]})
    ref = ext.Reference()
    assert not ref.problems, ref.problems
    assert "gpattn.__main__" not in ref.public + ref.private
    assert ref.home("gpattn", "build_attention", __import__("gpattn").build_attention) == (
        "gpattn.attention.registry.build_attention"
    )
