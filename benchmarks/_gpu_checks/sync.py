"""Host-device synchronisations of a piece of work, under torch's CUDA sync debug mode (not on the CPU)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
import warnings

import torch

from . import PKG, SCRIPT

SYNC_MESSAGE = "called a synchronizing cuda operation"
BACKWARD = "backward (autograd thread)"
#: the checker's own files: the entry script and this package (a frame there is the check's, not gpattn's)
_OWN = (str(SCRIPT), str(PKG) + os.sep)


def _own(text: str) -> bool:
    """Whether a file name (or a traceback line naming one) is the checker's own."""
    return any(p in text for p in _OWN)


def short_path(path: str) -> str:
    p = path.replace("\\", "/")
    for marker in ("/gpattn/", "/site-packages/"):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + 1 :] if marker == "/gpattn/" else p[i + len(marker) :]
    return p


def _frame(f) -> str:
    return f"{short_path(f.filename)}:{f.lineno} ({f.name})"


@contextlib.contextmanager
def _fd2_to(fh):
    """The process's file descriptor 2 (C++ warnings from non-Python threads) into ``fh``."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fh.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _hook(events: list, original):
    """A ``warnings.showwarning`` that records each synchronisation warning as ``{"where", "op"}``:
    ``where`` = the last gpattn line on the Python stack, ``op`` = the innermost Python line."""

    def hook(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if SYNC_MESSAGE not in text.lower():
            if "synchroniz" in text.lower():  # e.g. "sync debug mode is a prototype feature": not an event
                return None
            return original(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        ours = [f for f in stack if "/gpattn/" in f.filename.replace("\\", "/") and not _own(f.filename)]
        inner = stack[-1] if stack else None
        if inner is not None and _own(inner.filename):
            where, op = BACKWARD, "backward"
        else:
            where = _frame(ours[-1]) if ours else f"{short_path(filename)}:{lineno}"
            op = _frame(inner) if inner is not None else where
        events.append({"where": where, "op": op})

    return hook


def _watch(fn, events: list) -> list:
    """Run ``fn()`` in sync debug mode "warn", its warnings to ``events``; the native threads' lines."""
    with tempfile.TemporaryFile(mode="w+b") as fh, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _hook(events, warnings.showwarning)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with _fd2_to(fh):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        fh.seek(0)
        return [ln for ln in fh.read().decode(errors="replace").splitlines() if SYNC_MESSAGE in ln.lower()]


def _counted(values) -> dict:
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def sync_events(fn, device, forward=None) -> dict:
    """Run ``fn()`` under ``torch.cuda.set_sync_debug_mode("warn")`` and collect every synchronising CUDA call:
    ``where`` = the last gpattn line on the Python stack, ``op`` = the innermost Python line (the call that
    synchronised; inside torch / gpytorch / linear_operator when gpattn calls them). Synchronisations in
    autograd's device threads (the backward) have no Python stack of their own: they are counted under
    ``backward``, and with ``forward`` (a callable returning a loss) located by a second pass that runs the
    backward in sync debug mode "error" under anomaly detection (the forward line of the first node that
    synchronises). Not on the CPU."""
    if torch.device(device).type != "cuda":
        return {"checked": False, "reason": "CPU device: no host-device synchronisation to watch"}
    events = []
    native = _watch(fn, events)
    where = _counted(e["where"] for e in events)
    out = {
        "checked": True,
        "count": len(events) + len(native),
        "by_location": where,
        "by_op": _counted(e["op"] for e in events),
        "native_thread_lines": native[:5],
    }
    if forward is not None and (BACKWARD in where or native):
        try:
            out["backward_first_sync"] = _first_backward_sync(forward)
        except Exception as exc:  # noqa: BLE001 - the locator is a best effort
            out["backward_first_sync"] = f"not located ({type(exc).__name__}: {str(exc)[:120]})"
    return out


def _first_backward_sync(forward) -> str:
    """The forward line (anomaly detection's trace) of the first backward node that synchronises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=False):
            loss = forward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
                return "no synchronisation in this backward"
            except RuntimeError as exc:
                error = str(exc).splitlines()[0][:120]
            finally:
                torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        text = str(w.message)
        if "Traceback of forward call" not in text and "Error detected in" not in text:
            continue
        node = text.split("Error detected in", 1)[-1].split(".", 1)[0].strip() if "Error detected in" in text else "?"
        files = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File ")]
        ours = [ln for ln in files if "/gpattn/" in ln and not _own(ln)]
        site = ours[-1] if ours else (files[-1] if files else "no forward trace")
        return f"{node}: {short_path(site)}"
    return f"raised {error!r} (no anomaly trace)"
