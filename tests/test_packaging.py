"""Library vs application: the core imports without ``gpattn.experiments`` or its dependencies, setup.cfg
declares what each part imports, and the ``gpattn`` command without the ``experiments`` extra says how to
install it instead of printing a traceback."""

import ast
import configparser
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpattn"
APP = PACKAGE / "experiments"
#: optional integrations with other libraries, each behind its own extra (module -> extra)
INTEGRATIONS = PACKAGE / "integrations"

CORE_MODULES = ("gpattn", "gpattn.attention", "gpattn.kernels", "gpattn.variational", "gpattn.models",
                "gpattn.objectives", "gpattn.testing")  # fmt: skip
#: what the application imports and the core must not (the ``experiments`` extra)
APP_ONLY = ("matplotlib", "sklearn", "tqdm", "scipy")
#: import name -> distribution name, where they differ
DISTRIBUTIONS = {"linear_operator": "linear-operator", "sklearn": "scikit-learn"}
#: imported by gpattn.experiments.laplace only when installed (laplace-torch, put in by the Makefile); transformers
#: by gpattn.experiments.encoders for --encoder runs (the huggingface extra declares it; absent: an ImportError)
OPTIONAL = {"laplace", "transformers"}

_CORE_CHECK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` now fails as if the package were not installed
import torch
{imports}
for variant in gpattn.list_attention():
    gpattn.build_attention(variant, embed_dim=8, num_heads=2)(torch.randn(2, 5, 8))
loaded = sorted(m for m in sys.modules if m.startswith("gpattn.experiments"))
assert not loaded, f"the core imported the application: {{loaded}}"
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_core_imports_and_runs_without_the_application_or_its_dependencies():
    imports = "\n".join(f"import {m}" for m in CORE_MODULES)
    proc = _run(_CORE_CHECK.format(blocked=APP_ONLY, imports=imports))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_core_check_sees_an_application_import():
    """The check above can fail: importing one application module beside the core trips it."""
    imports = "\n".join(f"import {m}" for m in (*CORE_MODULES, "gpattn.experiments.presets"))
    proc = _run(_CORE_CHECK.format(blocked=(), imports=imports))
    assert proc.returncode != 0 and "the core imported the application" in proc.stderr, proc.stderr[-3000:]


def _third_party(files) -> set[str]:
    """Top-level names of the non-stdlib, non-gpattn modules ``files`` import (lazy imports included)."""
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.partition(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("gpattn", "__future__")}


def _requirements(text: str) -> set[str]:
    return {re.split(r"[<>=!~\s\[]", line.strip(), maxsplit=1)[0] for line in text.splitlines() if line.strip()}


def _declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    return (
        _requirements(cfg["options"]["install_requires"]),
        _requirements(extras["experiments"]),
        _requirements(extras["huggingface"]),
    )


def test_dependencies_are_declared_as_used():
    core_files = [f for f in PACKAGE.rglob("*.py") if APP not in f.parents and INTEGRATIONS not in f.parents]
    core = {DISTRIBUTIONS.get(n, n) for n in _third_party(core_files)}
    app = {DISTRIBUTIONS.get(n, n) for n in _third_party(APP.rglob("*.py")) - OPTIONAL}
    hf = {DISTRIBUTIONS.get(n, n) for n in _third_party(INTEGRATIONS.rglob("*.py"))}
    install_requires, experiments, huggingface = _declared()
    assert install_requires == core, "install_requires must be exactly what the core imports"
    assert experiments == app - core, "the experiments extra must be what the application adds to the core"
    # transformers is declared whether or not the integration imports it (HFClassifier.from_pretrained does)
    assert "transformers" in huggingface
    assert huggingface - {"transformers"} == hf - core - {"transformers"}, (
        "the huggingface extra must be what the integration adds"
    )


def test_huggingface_integration_imports_without_transformers():
    """``transformers`` is needed to build the models, not to import the integration (nor gpattn)."""
    proc = _run(
        "import sys; sys.modules['transformers'] = sys.modules['safetensors'] = None\n"
        "import gpattn, gpattn.integrations.huggingface as hf\nassert hf.supported_architectures()"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


_MISSING = """
import runpy, sys
sys.modules[{module!r}] = None
sys.argv = ["gpattn", *{argv!r}]
runpy.run_module("gpattn", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("tqdm", ["evaluate", "--checkpoint", "no-such-run/checkpoint.pt"]),  # gpattn.experiments.training
        ("scipy", ["evaluate", "--checkpoint", "no-such-run/checkpoint.pt", "--ood-score", "msp"]),  # metrics
        # a submodule (the package is named by its top level), met when the digits data load
        ("sklearn.datasets", ["train", "--dataset", "digits", "--epochs", "1", "--no-progress", "--out"]),
    ],
)
def test_cli_without_the_extra_names_it(module, argv, tmp_path):
    argv = [*argv, str(tmp_path / "run")] if argv[-1] == "--out" else argv
    proc = _run(_MISSING.format(module=module, argv=argv))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "pip install 'gpattn[experiments]'" in proc.stderr
    assert repr(module.partition(".")[0]) in proc.stderr


def test_cli_reraises_a_missing_module_outside_the_extra():
    """A missing module of gpattn's own is a bug, not a missing extra: the traceback stays."""
    argv = ["evaluate", "--checkpoint", "no-such-run/checkpoint.pt"]
    proc = _run(_MISSING.format(module="gpattn.experiments.training", argv=argv))
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, proc.stderr[-3000:]
    assert "gpattn[experiments]" not in proc.stderr
