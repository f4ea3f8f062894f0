"""``make dist``'s wheel and sdist: they build, pass ``twine check``, the sdist carries the tests and the
docs, and the wheel installed into a fresh virtual environment (the CPU torch first) runs the README's
contract snippet and ``gpattn --help`` and reports its licence, project URLs and extras."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import gpattn

ROOT = Path(__file__).resolve().parents[1]
#: installed into the fresh environment before the wheel (an unpinned torch would pull a CUDA build)
TORCH = "torch==2.13.0"

pytest.importorskip("build", reason="the dist extra: pip install -e '.[dist]' (make install does)")
pytest.importorskip("twine", reason="the dist extra: pip install -e '.[dist]' (make install does)")


#: the fresh environment sees nothing of this one (a PYTHONPATH would import the checkout, not the wheel)
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, **kwargs)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def readme_contract() -> str:
    """The README's quick-start snippet: the first Python block under "## The contract"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## The contract", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


#: what a fresh clone does not have: environments, build outputs and setuptools' egg-info (whose stale
#: SOURCES.txt an sdist build would add to what MANIFEST.in lists)
NOT_IN_A_CLONE = (".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache")


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """``make dist``'s commands, on a copy of the checkout as a fresh clone has it: (wheel, sdist)."""
    out = tmp_path_factory.mktemp("dist")
    tree = out / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*NOT_IN_A_CLONE))
    shutil.rmtree(tree / "docs" / "api", ignore_errors=True)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(tree)])
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == len(sdists) == 1, sorted(out.iterdir())
    _run([sys.executable, "-m", "twine", "check", "--strict", str(wheels[0]), str(sdists[0])])
    return wheels[0], sdists[0]


@pytest.mark.slow
def test_wheel_and_sdist_carry_what_they_must(dist):
    wheel, sdist = dist
    assert wheel.name == f"gpattn-{gpattn.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(f"gpattn-{gpattn.__version__}.dist-info/METADATA").decode()
    assert "gpattn/experiments/training.py" in names and not any(n.startswith("tests/") for n in names)
    assert any(n.endswith("dist-info/licenses/LICENSE") for n in names), names
    with tarfile.open(sdist) as tf:
        members = {m.split("/", 1)[1] for m in tf.getnames() if "/" in m}
    carried = ("LICENSE", "CHANGELOG.md", "tests/test_site.py", "tests/_cli_helpers.py", "docs/conf.py",
               "docs/_ext/gpattn_sphinx.py", "docs/derivations.md", "docs/results_digits_ood.png",
               "docs/constraints.txt", "notebooks/sgpa_posterior.py", "benchmarks/attention_scaling.py",
               "research/README.md", "Makefile")  # fmt: skip
    assert set(carried) <= members, set(carried) - members
    assert not any(m.startswith("docs/api/") for m in members)
    assert "License: MIT" in meta and "Project-URL: Documentation, " in meta and "Project-URL: Source, " in meta
    assert {"experiments", "huggingface", "laplace", "docs", "dist", "test"} <= set(
        re.findall(r"^Provides-Extra: (\S+)$", meta, re.MULTILINE)
    )


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_wheel_installs_into_a_fresh_environment_and_runs(dist, tmp_path):
    wheel, _ = dist
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=CLEAN_ENV)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--quiet", TORCH], env=CLEAN_ENV)
    _run([python, "-m", "pip", "install", "--quiet", f"{wheel}[experiments]"], env=CLEAN_ENV)
    elsewhere = tmp_path / "elsewhere"  # not the repository: the installed gpattn is imported
    elsewhere.mkdir()
    check = (
        "import importlib.metadata, gpattn\n"
        "assert gpattn.__file__.startswith(" + repr(str(venv)) + "), gpattn.__file__\n"
        "assert importlib.metadata.version('gpattn') == gpattn.__version__ == "
        + repr(gpattn.__version__)
        + "\n"
        + readme_contract()
    )
    _run([python, "-c", check], cwd=elsewhere, env=CLEAN_ENV)
    helped = _run([venv / "bin" / "gpattn", "--help"], cwd=elsewhere, env=CLEAN_ENV)
    assert "train" in helped.stdout and "compare" in helped.stdout, helped.stdout
    shown = _run([python, "-m", "pip", "show", "gpattn"], cwd=elsewhere, env=CLEAN_ENV).stdout
    assert re.search(r"^License(-Expression)?: MIT$", shown, re.MULTILINE), shown
    assert f"Version: {gpattn.__version__}" in shown
    verbose = _run([python, "-m", "pip", "show", "--verbose", "gpattn"], cwd=elsewhere, env=CLEAN_ENV).stdout
    assert "Project-URLs:" in verbose and "Documentation, https://" in verbose, verbose
    assert "Source, https://" in verbose, verbose
    # pip show prints no extras (no pip version does); the installed metadata lists them
    extras = "import importlib.metadata as m; print(' '.join(m.metadata('gpattn').get_all('Provides-Extra')))"
    listed = set(_run([python, "-c", extras], cwd=elsewhere, env=CLEAN_ENV).stdout.split())
    assert {"experiments", "huggingface", "laplace", "notebooks", "test", "docs", "dist"} <= listed, listed


def test_the_readme_snippet_is_found_and_runs_here():
    """The snippet the wheel test runs is the README's (and it runs on the checkout as well)."""
    code = readme_contract()
    assert "gpattn.build_attention" in code and ".posterior(" in code
    exec(compile(code, "README.md", "exec"), {})
