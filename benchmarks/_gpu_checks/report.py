"""What a run is made on (package versions, the device) and its report as markdown (``OUT/gpu_check.md``)."""

from __future__ import annotations

import importlib
import platform
import subprocess
import warnings

from . import ROOT

#: the packages whose versions the report names (a missing one is reported, not fatal)
PACKAGES = ("torch", "gpytorch", "linear_operator", "numpy", "transformers", "tokenizers", "safetensors", "sklearn",
            "scipy", "tqdm", "matplotlib")  # fmt: skip


def _git(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=5)


def versions() -> dict:
    """Python, the platform, each of :data:`PACKAGES`, the git commit and how many files differ from it."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for mod in PACKAGES:
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - anything an import may raise is a "missing"
            out[mod] = f"missing ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    try:
        out["git"] = _git("rev-parse", "--short", "HEAD").stdout.strip() or None
        dirty = _git("status", "--porcelain")
        out["git_dirty_files"] = len(dirty.stdout.splitlines()) if dirty.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no git on the machine, or no .git in the copy
        out["git"] = None
    return out


def device_info(device: str) -> dict:
    """The device's name, capability and memory (CUDA), torch's TF32 settings and thread count."""
    import torch

    info = {"device": device, "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
            info["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
            info["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
        except Exception as exc:  # noqa: BLE001
            info["tf32_flags"] = f"unreadable: {exc}"
    if torch.cuda.is_available() and device.startswith("cuda"):
        from .compare import cuda_index

        props = torch.cuda.get_device_properties(cuda_index(device))
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            device_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    info["threads"] = torch.get_num_threads()
    return info


def _header(report: dict) -> list[str]:
    env, dev = report["versions"], report["device_info"]
    lines = [
        "# gpattn CUDA check",
        "",
        f"- device: `{report['device']}` {dev.get('name', '')} (capability {dev.get('capability', '-')}, "
        f"{dev.get('memory_gib', '-')} GiB); torch {env.get('torch')} (CUDA {dev.get('torch_cuda')}), "
        f"gpytorch {env.get('gpytorch')}, linear_operator {env.get('linear_operator')}, "
        f"transformers {env.get('transformers')}, python {env.get('python')}",
        f"- git {env.get('git')} ({env.get('git_dirty_files')} changed files); float32 matmul precision "
        f"{dev.get('float32_matmul_precision')}, TF32 matmul {dev.get('matmul_allow_tf32')}",
        f"- total wall {report['wall_s']:.0f} s; overall: **{report['overall']}**",
        "",
        "| check | status | items | wall s | limit s |",
        "|---|---|---|---:|---:|",
    ]
    for c in report["checks"]:
        lines.append(f"| {c['check']} | {c['status']} | {c['counts']} | {c['wall_s']} | {c['limit_s']} |")
    return lines + [""]


def _items(items: list) -> list[str]:
    """The items' table, then the tracebacks of those that raised."""
    lines = []
    if items:
        lines += ["| item | status | s | summary |", "|---|---|---:|---|"]
        for it in items:
            text = (it.get("summary") or it.get("reason") or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {it['name']} | {it['status']} | {it.get('wall_s', '')} | {text[:400]} |")
        lines.append("")
    for it in items:
        if it["status"] in ("error",) and it.get("traceback"):
            lines += [f"<details><summary>{it['name']}: traceback</summary>", "", "```", it["traceback"], "```", "",
                      "</details>", ""]  # fmt: skip
    return lines


def _syncs(items: list) -> list[str]:
    """Every host-device synchronisation record of the items that counted some."""
    syncs = {}
    for it in items:
        for k, v in it.items():
            if isinstance(v, dict) and v.get("checked") and v.get("count"):
                syncs[it["name"] if k == "sync" else f"{it['name']} / {k}"] = v
    if not syncs:
        return []
    lines = ["Host-device synchronisations (last gpattn line: count; the synchronising call: count):", ""]
    for name, v in syncs.items():
        text = f"- {name}: " + ", ".join(f"`{loc}` ×{n}" for loc, n in v["by_location"].items())
        text += "; calls: " + ", ".join(f"`{op}` ×{n}" for op, n in v.get("by_op", {}).items())
        if v.get("backward_first_sync"):
            text += f"; first in backward: `{v['backward_first_sync']}`"
        if v.get("native_thread_lines"):
            text += f"; native: {v['native_thread_lines'][:2]}"
        lines.append(text)
    return lines + [""]


def _check_section(c: dict) -> list[str]:
    lines = [f"## {c['check']} — {c['status']}", ""]
    data = c.get("data") or {}
    if c.get("timed_out"):
        lines += [f"stopped at its {c['limit_s']} s limit; what finished is below; log: `{c.get('log')}`", ""]
    if data.get("setup_error"):
        lines += [f"setup error: `{data['setup_error']}`", ""]
    if c.get("log_tail"):
        lines += ["```", c["log_tail"], "```", ""]
    items = data.get("items", [])
    lines += _items(items) + _syncs(items)
    if data.get("table"):
        lines += [data["table"], ""]
    elif data.get("rows") and data.get("setup"):  # a timing check stopped part-way
        from .timing import timing_table

        lines += ["(the cases measured before the check was stopped)", ""]
        lines += [timing_table(data["rows"], data["setup"]["T"]), ""]
    return lines


def markdown(report: dict) -> str:
    """``OUT/gpu_check.md``: the run's setup, each check's status, items, synchronisations and tables."""
    lines = _header(report)
    for c in report["checks"]:
        lines += _check_section(c)
    return "\n".join(lines) + "\n"
