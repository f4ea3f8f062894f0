"""Command lines shared by the subprocess tests (resume, torchrun)."""

import os
import signal
import subprocess
import sys

#: ``gpattn train`` on digits with a model small enough for a subprocess test
TINY_DIGITS = ("--dataset", "digits", "--batch-size", "32", "--embed-dim", "16", "--num-heads", "2",
               "--num-layers", "1", "--no-progress")  # fmt: skip


def train_cmd(attention: str, epochs: int, *extra: str, launcher: tuple = ()) -> list[str]:
    """``python [launcher] -m gpattn train`` with :data:`TINY_DIGITS` and the given attention/epochs."""
    launch = [sys.executable, *launcher] if launcher else [sys.executable]
    return [*launch, "-m", "gpattn", "train", *TINY_DIGITS, "--attention", attention, "--epochs", str(epochs), *extra]


def single_thread_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """Run to completion on one thread; the caller asserts on returncode with the stderr tail. Past ``timeout`` the
    whole process group goes (a launcher's workers too, which a kill of the launcher alone leaves running) and the
    error carries what the processes had printed."""
    with subprocess.Popen(
        cmd, env=single_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"{' '.join(cmd)} ran past {timeout} s and was killed; its stderr ends:\n{err[-6000:]}\n"
                f"its stdout ends:\n{out[-2000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
