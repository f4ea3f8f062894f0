"""Each check in its own child process with its own time limit; the summary and the report files."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from . import ROOT, SCRIPT
from .record import Recorder, now, tail, write_json
from .report import device_info, markdown, versions

CHECKS = ("layers", "train", "hf", "timing")
#: wall-clock limit per check in seconds on a GPU; on the CPU these are multiplied by ``CPU_SLOWDOWN``
LIMITS = {"layers": 75, "train": 110, "hf": 60, "timing": 80}
CPU_SLOWDOWN = 3.0
#: the whole run's budget on a GPU (seconds): a check never gets more than what is left of it
TOTAL_BUDGET = 290


def child_main(args) -> int:
    """Run the check ``args.child`` in this process (a child of :func:`parent_main`), into ``OUT/<check>.json``."""
    rec = Recorder(Path(args.out), args.child, args.device, args.limit)
    try:
        import torch

        from .compare import cuda_index

        if args.device.startswith("cuda"):
            torch.cuda.set_device(cuda_index(args.device))
        torch.manual_seed(0)
        module = importlib.import_module(f"{__package__}.{args.child}")  # only this check's imports
        getattr(module, f"check_{args.child}")(rec, args.device, args)
    except Exception as exc:  # noqa: BLE001 - setup failures of the whole check
        rec.data["setup_error"] = f"{type(exc).__name__}: {exc}"
        rec.data["traceback"] = tail(traceback.format_exc(), 25)
        print(rec.data["traceback"], flush=True)
    rec.finish()
    return 0


def status_of(data: dict | None, rc, timed_out: bool) -> tuple[str, str]:
    """A check's status from its items: fail > error > timeout > warn > pass; skip if nothing ran."""
    if data is None:
        return ("timeout" if timed_out else "error"), (
            "no result file" + (" (timed out)" if timed_out else f", exit {rc}")
        )
    items = data.get("items", [])
    counts = {}
    for it in items:
        counts[it["status"]] = counts.get(it["status"], 0) + 1
    text = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no item finished"
    if data.get("setup_error"):
        return "error", f"setup: {data['setup_error'][:200]}"
    if counts.get("fail"):
        return "fail", text
    if counts.get("error"):
        return "error", text
    if timed_out or not data.get("done"):
        return "timeout" if timed_out else "error", text + ("; timed out" if timed_out else f"; child exit {rc}")
    if counts.get("warn"):
        return "warn", text
    if items and all(it["status"] == "skip" for it in items):
        return "skip", text
    return "pass", text


def _child_command(check: str, args, limit: float) -> list[str]:
    cmd = [sys.executable, str(SCRIPT), "--child", check, "--device", args.device, "--out", str(Path(args.out)),
           "--limit", str(limit)]  # fmt: skip
    for flag in ("variants", "timing_ts", "timing_batch"):
        v = getattr(args, flag)
        if v:
            cmd += [f"--{flag.replace('_', '-')}", str(v)]
    return cmd


def _wait(cmd: list, log: Path, limit: float) -> tuple[int, bool]:
    """Run ``cmd`` (output to ``log``) in its own process group, killed at ``limit`` s: (exit code, timed out)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group
            return proc.wait(), True


def run_child(check: str, args, limit: float) -> dict:
    """``check`` in a child process: its status, counts, data (``OUT/<check>.json``) and, if it failed to
    finish, its log's tail."""
    out = Path(args.out)
    log = out / "logs" / f"{check}.log"
    t0 = now()
    rc, timed_out = _wait(_child_command(check, args, limit), log, limit)
    wall = now() - t0
    try:
        data = json.loads((out / f"{check}.json").read_text())
    except (OSError, json.JSONDecodeError):
        data = None
    status, text = status_of(data, rc, timed_out)
    log_tail = ""
    if status in ("error", "timeout"):
        with contextlib.suppress(OSError):
            log_tail = tail(log.read_text(errors="replace"), 15)
    return {"check": check, "status": status, "counts": text, "rc": rc, "timed_out": timed_out,
            "wall_s": round(wall, 1), "limit_s": round(limit, 1), "data": data, "log": str(log),
            "log_tail": log_tail}  # fmt: skip


def _resolve_device(args) -> bool:
    """``--device auto`` made concrete; False (with a message) when CUDA is asked for and absent."""
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu":
            print("gpu_check: no CUDA device here: running every check on the CPU (CPU vs CPU)", flush=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device} but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})",
            file=sys.stderr,
        )
        return False
    return True


def _print_result(res: dict) -> None:
    print(f"  {res['check']:<7} {res['status'].upper():7} {res['wall_s']:6.1f} s  {res['counts']}", flush=True)
    for it in (res.get("data") or {}).get("items", []):
        if it["status"] in ("fail", "error"):
            print(f"      {it['status'].upper()} {it['name']}: {(it.get('summary') or it.get('reason') or '')[:300]}")
    if res.get("log_tail") and res["status"] in ("error", "timeout"):
        print("      log tail: " + res["log_tail"].replace("\n", "\n                "))


def _run_checks(checks: list, args, report: dict, t_start: float, slow: float) -> None:
    """Each check in turn, within what is left of the budget; ``gpu_check.json`` rewritten after each."""
    out = Path(args.out)
    for check in checks:
        limit = min(LIMITS[check] * slow * args.time_scale, report["budget_s"] - (now() - t_start))
        if limit < 15:
            report["checks"].append({"check": check, "status": "skip", "counts": "overall budget spent",
                                     "wall_s": 0, "limit_s": round(limit, 1), "data": None})  # fmt: skip
            print(f"  {check:<7} SKIP (overall budget spent)", flush=True)
            continue
        print(f"  {check:<7} running (limit {limit:.0f} s; log {out / 'logs' / (check + '.log')})", flush=True)
        res = run_child(check, args, limit)
        report["checks"].append(res)
        _print_result(res)
        write_json(out / "gpu_check.json", {**report, "wall_s": now() - t_start, "overall": "running"})


def parent_main(args) -> int:
    """Every check asked for, each in a child; ``OUT/gpu_check.json`` and ``.md``; 1 if one failed."""
    t_start = now()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not _resolve_device(args):
        return 2
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        print(f"gpu_check: unknown check(s) {unknown}; valid: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    slow = 1.0 if args.device.startswith("cuda") else CPU_SLOWDOWN
    budget = args.budget if args.budget else TOTAL_BUDGET * slow
    report = {"device": args.device, "versions": versions(), "device_info": device_info(args.device),
              "argv": sys.argv[1:], "budget_s": budget, "checks": []}  # fmt: skip
    env, dev = report["versions"], report["device_info"]
    print(f"gpu_check on {args.device} {dev.get('name', '')}: torch {env['torch']}, gpytorch {env['gpytorch']}, "
          f"checks {', '.join(checks)}, budget {budget:.0f} s", flush=True)  # fmt: skip
    _run_checks(checks, args, report, t_start, slow)
    statuses = [c["status"] for c in report["checks"]]
    failed = any(s in ("fail", "error", "timeout") for s in statuses)
    report["overall"] = "FAIL" if failed else "WARN" if "warn" in statuses else "PASS"
    report["wall_s"] = now() - t_start
    write_json(out / "gpu_check.json", report)
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"gpu_check: {report['overall']} in {report['wall_s']:.0f} s; {out / 'gpu_check.md'}, "
          f"{out / 'gpu_check.json'}", flush=True)  # fmt: skip
    return 1 if failed else 0
