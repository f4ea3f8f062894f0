"""A check's items, written to ``OUT/<check>.json`` as they finish, and the small helpers every check uses."""

from __future__ import annotations

import importlib
import json
import math
import os
import time
import traceback
from pathlib import Path


class Skip(Exception):
    """An item that cannot run here (a missing package, the check's budget spent): status ``skip``."""


def now() -> float:
    return time.monotonic()


def jsonable(obj):
    """Plain JSON data from nested dicts/lists of numbers, strings, tensors and devices."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    try:
        import torch

        if torch.is_tensor(obj):
            return jsonable(obj.detach().cpu().tolist())
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


def write_json(path: Path, data) -> None:
    """``data`` as JSON at ``path``, replaced in one step (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(data), indent=1))
    os.replace(tmp, path)


def fmt(v, spec=".1e") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def tail(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def first_line(exc: BaseException, n: int) -> str:
    """``Type: first line of the message`` (at most ``n`` characters of it)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:n] if str(exc).strip() else ''}"


def sync_all() -> None:
    """Surface asynchronous CUDA errors inside the item that caused them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def require(*modules) -> None:
    """:class:`Skip` unless every module imports."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001
            raise Skip(f"{mod} is not importable here ({type(exc).__name__}: {exc})") from None


def verdict(res: dict, summary: str, failures: list, warns: list | None = None, cut: int | None = 200) -> dict:
    """``res`` with its ``failures`` (and ``warnings``), its status (fail > warn > pass) and its summary,
    followed by the first failure (at most ``cut`` characters of it)."""
    res["failures"] = failures
    if warns is not None:
        res["warnings"] = warns
    res["status"] = "fail" if failures else "warn" if warns else "pass"
    res["summary"] = summary + (f" | FAIL: {failures[0][:cut]}" if failures else "")
    return res


class Recorder:
    """A check's items, rewritten to ``OUT/<check>.json`` after every item (what a timeout leaves stays)."""

    def __init__(self, out: Path, check: str, device: str, limit: float):
        self.path = out / f"{check}.json"
        self.start = now()
        self.deadline = self.start + 0.88 * limit - 3.0  # leave time to write and exit
        self.data = {"check": check, "device": device, "limit_s": limit, "items": [], "done": False}
        self.flush()

    def left(self) -> float:
        return self.deadline - now()

    def flush(self) -> None:
        self.data["elapsed_s"] = round(now() - self.start, 2)
        write_json(self.path, self.data)

    def item(self, name: str, fn, *, need_s: float = 0.0):
        """Run ``fn() -> dict`` as the item ``name``: its dict (with ``status``: pass unless it says
        otherwise), or ``skip`` / ``error`` with the reason. Prints one line."""
        t0 = now()
        rec = {"name": name}
        if self.left() < need_s:
            rec.update(status="skip", reason=f"the check's time budget is spent ({self.left():.0f} s left)")
        else:
            try:
                res = fn() or {}
                sync_all()
                rec.update(res)
                rec.setdefault("status", "pass")
            except Skip as exc:
                rec.update(status="skip", reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, the next item still runs
                rec.update(status="error", reason=first_line(exc, 300), traceback=tail(traceback.format_exc(), 25))
        rec["wall_s"] = round(now() - t0, 2)
        self.data["items"].append(rec)
        self.flush()
        short = rec.get("summary") or rec.get("reason") or ""
        print(f"[{now() - self.start:6.1f} s] {rec['status'].upper():5} {name}: {short}", flush=True)
        return rec

    def finish(self) -> None:
        self.data["done"] = True
        self.flush()
