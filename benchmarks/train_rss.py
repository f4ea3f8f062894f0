"""Peak memory of a one-epoch ``gpattn train`` run per variant (evaluation included), as a ratio to softmax's in the
same run (issue #58's floor: ≤ 3× softmax at T = 128 and the text defaults), and the run's own time estimate
against the time it then took.

A synthetic review table (``--rows`` rows of T to T + 40 words, two classes told apart by a few marker words, and
an OOD file of other words) is written to a temporary folder; each variant trains on it for one epoch in a fresh
process, ``python -m gpattn train --dataset text_table --dataset-option max_len=T --no-progress`` at the text
defaults (width 64, 4 heads, 2 layers, batch 32, P = 10, ``eval_batch_size`` 256). ``peak_rss_mb`` is that
process's ``ru_maxrss`` (``os.wait4``: the interpreter, torch, the data, training and evaluation together).
``estimate_s`` is the total of the line ``[train] ... estimated ~X`` the run prints after its first steps
(:mod:`gpattn.experiments._estimate`, rounded as printed) and ``after_estimate_s`` the wall time from that line to
the process's exit: what the estimate estimates.

    python benchmarks/train_rss.py --variants softmax,sgpa,cgp --rows 600 --json train_rss.json --markdown train_rss.md
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import finish, reference_first


def write_table(folder: Path, rows: int, T: int, seed: int = 0) -> tuple[Path, Path]:
    """(reviews.tsv, ood.tsv): labelled rows of T to T + 40 words, and unlabelled rows of words training never saw."""
    r = random.Random(seed)
    words = [f"w{i}" for i in range(500)]
    markers = {"pos": words[:40], "neg": words[40:80]}
    lines = ["text\tlabel"]
    for i in range(rows):
        label = ("neg", "pos")[i % 2]
        tokens = [r.choice(words[80:]) for _ in range(r.randint(T, T + 40))]
        for _ in range(10):
            tokens[r.randrange(len(tokens))] = r.choice(markers[label])
        lines.append(" ".join(tokens) + f"\t{label}")
    table = folder / "reviews.tsv"
    table.write_text("\n".join(lines) + "\n")
    ood = folder / "ood.tsv"
    ood.write_text("text\n" + "\n".join(" ".join(f"x{r.randrange(500)}" for _ in range(T + 10))
                                        for _ in range(max(rows // 5, 1))) + "\n")
    return table, ood


def _seconds(text: str) -> float:
    """``~4.2 min`` -> 252.0 (gpattn.experiments._estimate.duration's forms)."""
    value, unit = re.match(r"~([\d.]+) (s|min|h)", text).groups()
    return float(value) * {"s": 1, "min": 60, "h": 3600}[unit]


def measure(variant: str, T: int, table: Path, ood: Path, folder: Path, cfg) -> dict:
    """One fresh ``gpattn train`` process: its peak RSS, wall time, printed estimate and the time after it."""
    args = [sys.executable, "-m", "gpattn", "train", "--attention", variant, "--dataset", "text_table",
            "--dataset-option", f"path={table}", "--dataset-option", f"ood_file={ood}", "--dataset-option",
            f"max_len={T}", "--epochs", str(cfg.epochs), "--no-progress", "--out", str(folder / f"{variant}-T{T}")]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads)}
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])  # this checkout's gpattn
    estimate = estimated_at = None
    tail = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-5:]
        if estimate is None and (m := re.search(r": estimated (~[\d.]+ (?:s|min|h))", line)):
            estimate, estimated_at = _seconds(m.group(1)), time.perf_counter()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    end = time.perf_counter()
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    row = {"variant": variant, "T": T, "wall_s": end - start}
    if proc.returncode != 0:
        return {**row, "status": "error", "reason": " | ".join(tail)[-300:]}
    row.update(status="ok", peak_rss_mb=usage.ru_maxrss / 1024, estimate_s=estimate,
               after_estimate_s=None if estimated_at is None else end - estimated_at)
    if estimate is not None:
        row["estimate_error"] = estimate / row["after_estimate_s"] - 1
    return row


def run(cfg) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="train_rss_") as tmp:
        for T in cfg.ts:
            table, ood = write_table(Path(tmp), cfg.rows, T)
            for name in cfg.variants:
                rows.append(measure(name, T, table, ood, Path(tmp), cfg))
                print(f"[train_rss] {rows[-1]}", flush=True)
    soft = {r["T"]: r for r in rows if r["variant"] == "softmax" and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["T"] in soft:
            r["rss_ratio_to_softmax"] = r["peak_rss_mb"] / soft[r["T"]]["peak_rss_mb"]
    return rows


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"One-epoch `gpattn train` on {meta['rows']} synthetic rows, {meta['threads']} thread(s); {meta['cpu']} "
        f"(load {meta['loadavg_1_5_15']})",
        "",
        "| variant | T | peak RSS (MB) | × softmax | wall (s) | estimate (s) | after the estimate (s) | "
        "estimate error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['T']} | {r['status']}: {r['reason']} | | | | | |")
            continue
        est = "–" if r["estimate_s"] is None else f"{r['estimate_s']:.0f}"
        after = "–" if r["after_estimate_s"] is None else f"{r['after_estimate_s']:.0f}"
        err = f"{r['estimate_error']:+.0%}" if "estimate_error" in r else "–"
        lines.append(f"| {r['variant']} | {r['T']} | {r['peak_rss_mb']:.0f} | {r.get('rss_ratio_to_softmax', 0):.2f} | "
                     f"{r['wall_s']:.0f} | {est} | {after} | {err} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ts", default="128", help="comma-separated max_len values")
    p.add_argument("--variants", default=None, help="comma-separated registry names (default: all)")
    p.add_argument("--rows", type=int, default=1500, help="rows of the synthetic table (70 %% train)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 200 rows (5 steps), T=8")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    cfg = p.parse_args(argv)
    if cfg.quick:
        cfg.rows, cfg.ts = 200, "8"
    cfg.ts = [int(t) for t in cfg.ts.split(",")]
    cfg.variants = reference_first(cfg.variants)
    return cfg


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    return finish(run(cfg), cfg, ("ts", "variants", "rows", "epochs", "threads"), to_markdown)


if __name__ == "__main__":
    main()
