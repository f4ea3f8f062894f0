"""One writer per run folder.

Two ``train`` processes on one ``--out`` both exited 0, one run's files lost and mixed files possible. A run
takes ``out/run.lock`` (its pid and host) for as long as it writes; a second writer gets
:class:`RunFolderLockedError` naming the holder. A lock left by a process that no longer runs on this host
(killed, machine crash) is stale: it is replaced with a warning.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from gpattn._warnings import warn

LOCK_NAME = "run.lock"


class RunFolderLockedError(ValueError):
    """Another live process writes the run folder."""


class StaleLockWarning(UserWarning):
    """A run folder's lock was left by a process that no longer runs (killed, a crash) and was replaced."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds that pid
        return True
    return True


def _holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _take(path: Path, mine: dict) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as fh:
        json.dump(mine, fh)


@contextmanager
def run_lock(out):
    """Hold ``out/run.lock`` while the block runs; ``out=None`` (nothing written) and ranks other than 0 (rank 0
    writes the folder) take no lock."""
    if out is None or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    out = Path(out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    mine = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        _take(path, mine)
    except FileExistsError:
        held = _holder(path) or {}
        pid, host = held.get("pid"), held.get("host")
        if isinstance(pid, int) and host == mine["host"] and not _alive(pid):
            warn(f"{path}: replacing a stale lock of process {pid}, which no longer runs", StaleLockWarning)
        elif isinstance(pid, int):
            raise RunFolderLockedError(
                f"{out} is being written by another run (process {pid} on {host}, lock file {path}); wait for it "
                f"to finish or choose another --out. If that process is gone, delete {path}."
            ) from None
        else:
            raise RunFolderLockedError(
                f"{out} has a lock file {path} that names no process; if no run writes this folder, delete it"
            ) from None
        path.unlink(missing_ok=True)
        _take(path, mine)
    try:
        yield
    finally:
        if _holder(path) == mine:
            path.unlink(missing_ok=True)
        if created and not any(out.iterdir()):  # refused before writing anything: leave no folder behind
            out.rmdir()


def locked_run(fn):
    """Decorate a function with an ``out`` argument so that it runs under :func:`run_lock` of that folder."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = signature.bind(*args, **kwargs).arguments.get("out")
        with run_lock(out):
            return fn(*args, **kwargs)

    return wrapper
