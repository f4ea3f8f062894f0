"""gpattn 0.2.0's own code, taken from the repository's history, writing run folders as that release did and
predicting with them: shared by tests/test_release_compat.py and tests/fixtures/make_release_run.py (which wrote
the committed fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the release whose run folders this gpattn migrates (gpattn.experiments._io.MIGRATED_RELEASES) and its commit
RELEASE, COMMIT = "0.2.0", "b0ae31ae0d6a48cfe9a140b7566dfcfb520c673a"

#: the committed run folder that 0.2.0 wrote (tests/fixtures/make_release_run.py says how)
FIXTURE = ROOT / "tests" / "fixtures" / f"gpattn-{RELEASE}" / "kep-svgp"

#: ``gpattn train`` options of the tiny digits runs (one ViT layer of width 8)
TINY = ("--dataset", "digits", "--batch-size", "64", "--embed-dim", "8", "--num-heads", "2", "--num-layers", "1",
        "--epochs", "1", "--seed", "0", "--no-progress")  # fmt: skip

#: the inputs the probabilities are compared on, as Python source (run by both versions)
DIGITS = "torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 16"
TEXTS = '["the cat sat on a mat", "a big red house by the river", "dog ran far away"]'

#: run by the release: trains each run (``gpattn train ARGV``) and prints the probabilities of its inputs
_TRAIN = """
import json, sys, warnings, torch, gpattn
from gpattn.experiments.cli import main
from gpattn.experiments.inference import load_run
warnings.simplefilter("ignore")
out = {}
for name, argv, inputs in json.loads(sys.argv[1]):
    if main(["train", *argv]):
        out[name] = None
        continue
    with gpattn.deterministic():
        out[name] = load_run(argv[argv.index("--out") + 1]).predict(eval(inputs), num_samples=1).probs.tolist()
print("PROBS", json.dumps(out))
"""


def release_source(dest: Path) -> Path | None:
    """The release's source tree (``git archive`` of :data:`COMMIT`) unpacked into ``dest``; None when this
    checkout has no such commit (an sdist, a shallow clone)."""
    if not (dest / "gpattn" / "__init__.py").is_file():
        try:
            archive = subprocess.run(["git", "archive", COMMIT], cwd=ROOT, capture_output=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
        dest.mkdir(parents=True, exist_ok=True)
        tar = dest / "source.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as t:  # our own commit's files; the "data" filter where Python has it
            t.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        tar.unlink()
    return dest


def release_runs(source: Path, specs: list[tuple[str, list[str], str]], timeout: int = 1200) -> dict:
    """Train every ``(name, gpattn train ARGV, inputs)`` with the release's code (one process, one thread) and
    return ``{name: its probabilities on inputs under gpattn.deterministic()}`` (None for a run that failed)."""
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _TRAIN, json.dumps(specs)]
    proc = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBS ")]
    if proc.returncode or not lines:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    return json.loads(lines[-1][len("PROBS "):])
