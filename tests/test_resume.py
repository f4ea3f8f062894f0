"""Interruption and resume: SIGTERM mid-epoch then --resume ends with the metrics of an
uninterrupted run; a crash while saving never corrupts the latest checkpoint."""

import json
import signal
import subprocess
import time

import pytest
import torch
from _cli_helpers import run, single_thread_env, train_cmd

from gpattn.experiments import training
from gpattn.experiments.training import TrainConfig, atomic_save, train

ARGS = ("--num-samples", "2", "--checkpoint-every", "1")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_mid_epoch_then_resume_matches_uninterrupted(tmp_path):
    cmd = train_cmd("sto", 3, *ARGS)
    full = run([*cmd, "--out", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr[-2000:]

    cut = tmp_path / "cut"
    proc = subprocess.Popen(
        [*cmd, "--out", str(cut)], env=single_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    step = 0
    while time.time() < deadline and proc.poll() is None:  # bounded wait for a mid-epoch checkpoint
        if (cut / "checkpoint.pt").is_file():
            try:
                step = torch.load(cut / "checkpoint.pt", weights_only=True)["step"]
            except Exception:  # noqa: BLE001 - being replaced right now; atomic rename means retry
                step = 0
            if 3 <= step:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err
    saved = torch.load(cut / "checkpoint.pt", weights_only=True)["step"]
    assert 3 <= saved < 3 * 28, saved  # mid-run (28 steps per epoch)

    resumed = run([*cmd, "--out", str(cut), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = json.loads((tmp_path / "full" / "metrics.json").read_text())
    b = json.loads((cut / "metrics.json").read_text())
    assert a == b  # a stochastic variant: identical samples after resume, so identical metrics


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    atomic_save({"step": 1}, path)

    def broken_save(obj, fh, *a, **k):
        fh.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(training.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temporary left behind


def test_interrupt_saves_current_step(tmp_path):
    cfg = TrainConfig(
        dataset="digits",
        attention="softmax",
        embed_dim=8,
        num_heads=2,
        num_layers=1,
        epochs=1,
        batch_size=64,
        num_samples=1,
        progress=False,
    )
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path, stop_after_steps=4)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 4 and "rng" in ckpt and "optimizer" in ckpt
