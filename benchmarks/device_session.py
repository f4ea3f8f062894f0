"""The measurements to take when a session is lent a GPU, as one command that fits one device call.

    PYTHONPATH=. python3 benchmarks/device_session.py --out "$OUT"             # on the lent machine (~9 minutes)
    python3 benchmarks/device_session.py --out /tmp/ds --dry-run                # print the commands, run nothing

Four steps, each a child process under its own time limit (a hang or a crash in one is recorded in
``session.log`` and the next still runs), in the order of what the open GPU bars need first:

``gpu_check``   ``benchmarks/gpu_check.py``: every CUDA path against the CPU (numerics, placement, training,
    Hugging Face, timing).
``scaling``     ``attention_scaling.py`` at T in {1024, 4096, 16384, 65536}, B = 2, H = 8, Dh = 64, fwd + bwd: the
    long-context bars (sgpa-decoupled's memory at 64k, sto and h-sto's time).
``step_eager``  ``train_step.py`` eager at T in {16, 1024}: the whole-model step, every variant against softmax.
``step_graphs`` ``train_step.py`` compiled with CUDA graphs (``mode="reduce-overhead"``) at T = 1024 for the
    layers the GPU bar names (the non-cubic ones).

What comes back is at most eight files two folders down (the device tool's limit): ``session.log`` (each
step's command, exit status, wall time and output tail), ``gpu_check.md`` / ``.json``, ``scaling.json``,
``step_eager.json`` / ``step_graphs.json`` and ``logs.tar.gz`` (every step's whole output and gpu_check's
per-check logs). A step that runs out of time keeps what it printed: the step benchmark prints each row as
its (T, mode) block finishes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

#: the layers of the GPU step bar ("every non-cubic GP layer"): cgp and sgpa factorise T × T matrices
NON_CUBIC = "kernel,kernel-asym,sto,h-sto,kep-svgp,sgpa-decoupled,sgpa-rff,scgp"


#: what both step-benchmark runs share: five timed steps after two untimed ones on the GPU, no FLOPs count
STEP = "train_step.py --device cuda --steps 5 --warmup 2 --no-flops"
SCALING = (
    "attention_scaling.py --device cuda --quick --ts 1024,4096,16384,65536 --batch 2 --heads 8 --head-dim 64 "
    "--variants kernel,kernel-asym,sgpa-decoupled,sto,h-sto --modes fwd+bwd --timeout 40 --mem-limit-mb 70000"
)


def steps(out: Path) -> list[tuple[str, float, list[str]]]:
    """(name, time limit in seconds, argv after the interpreter) of each step, in the order they run."""
    return [
        ("gpu_check", 150, ["gpu_check.py", "--out", str(out / "gpu_check")]),
        ("scaling", 170, [*SCALING.split(), "--json", str(out / "scaling.json")]),
        (
            "step_eager",
            80,
            [*STEP.split(), "--modes", "eager", "--ts", "16,1024", "--json", str(out / "step_eager.json")],
        ),
        (
            "step_graphs",
            140,
            [
                *STEP.split(),
                "--modes",
                "compiled",
                "--compile-mode",
                "reduce-overhead",
                "--ts",
                "1024",
                "--variants",
                NON_CUBIC,
                "--json",
                str(out / "step_graphs.json"),
            ],
        ),
    ]


def run_step(name: str, limit: float, argv: list[str], logs: Path, log) -> int | None:
    """One step in a child process of its own session (killed whole at its limit); its output to ``logs/NAME.log``.
    Returns the exit status, None on timeout."""
    path = logs / f"{name}.log"
    start = time.monotonic()
    with open(path, "w") as fh:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=BENCH, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    tail = path.read_text(errors="replace").splitlines()[-8:]
    status = "timed out" if rc is None else f"exit {rc}"
    log.write(f"== {name}: {status} after {time.monotonic() - start:.0f} s (limit {limit:.0f} s)\n")
    log.write("   python3 " + " ".join(argv) + "\n" + "".join(f"   | {line}\n" for line in tail))
    log.flush()
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for what comes back (the device tool's $OUT)")
    p.add_argument("--only", default=None, help="comma list of steps to run (default all)")
    p.add_argument("--dry-run", action="store_true", help="print the steps' commands and limits, run nothing")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    chosen = steps(out)
    if args.only:
        names = [s.strip() for s in args.only.split(",")]
        unknown = sorted(set(names) - {name for name, _, _ in chosen})
        if unknown:
            p.error(f"--only: unknown step(s) {unknown}; the steps are {[name for name, _, _ in chosen]}")
        chosen = [s for s in chosen if s[0] in names]
    if args.dry_run:
        for name, limit, step_argv in chosen:
            print(f"{name} ({limit:.0f} s): python3 " + " ".join(step_argv))
        return 0
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed = 0
    with open(out / "session.log", "w") as log:
        for name, limit, step_argv in chosen:
            failed += run_step(name, limit, step_argv, logs, log) != 0
    check = out / "gpu_check"
    for kept in ("gpu_check.md", "gpu_check.json"):
        if (check / kept).exists():
            shutil.copy(check / kept, out / kept)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for folder in (logs, check):
            if folder.exists():
                tar.add(folder, arcname=folder.name)
    shutil.rmtree(logs)
    shutil.rmtree(check, ignore_errors=True)
    print((out / "session.log").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
