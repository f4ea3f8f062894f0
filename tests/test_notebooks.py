"""Execute every verification notebook (jupytext percent scripts) at CI size."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))
SIZE = os.environ.get("GPATTN_NOTEBOOK_SIZE", "ci")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    env = {**os.environ, "GPATTN_NOTEBOOK_SIZE": SIZE, "GPATTN_NOTEBOOK_OUT": str(tmp_path), "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert any(tmp_path.rglob("*.png")), f"{path.name} saved no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_percent_format_with_asserts(path):
    import jupytext

    nb = jupytext.read(path)
    assert len(nb.cells) >= 4
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert code.count("assert ") >= 3, f"{path.name} needs at least three numerical asserts"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
