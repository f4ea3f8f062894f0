"""--device and --precision: the device is validated with a message naming the flag, runs and
checkpoints load onto it, and it is no part of what makes two runs the same (resume, compare's cache).
No GPU on CI: the CUDA paths are exercised only where one is present."""

import json

import pytest
import torch

from gpattn.experiments.cli import main
from gpattn.experiments.training import TrainConfig, _same_run, load_run_with_data, resolve_device

COMMON = ["--dataset", "digits", "--no-progress", "--epochs", "1", "--embed-dim", "8", "--num-heads", "2",
          "--num-layers", "1", "--num-samples", "1", "--batch-size", "256"]  # fmt: skip


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:", "CPU", 0])
def test_bad_device_names_the_flag(bad):
    with pytest.raises(ValueError, match=r"device \(--device\) must be auto, cpu, cuda or cuda:N"):
        TrainConfig(device=bad)
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp16")


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"--device {spec}: CUDA is not available"):
            resolve_device(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_cli_cuda_without_gpu_is_a_clear_error(tmp_path, capsys):
    assert main(["train", *COMMON, "--device", "cuda", "--out", str(tmp_path / "run")]) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before any file is written


def test_cli_device_cpu_auto_and_bf16(tmp_path, capsys):
    assert main(["train", *COMMON, "--device", "cpu", "--out", str(tmp_path / "cpu")]) == 0
    assert json.loads((tmp_path / "cpu" / "config.json").read_text())["device"] == "cpu"
    assert main(["train", *COMMON, "--device", "auto", "--precision", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    history = json.loads((tmp_path / "bf16" / "history.json").read_text())
    assert torch.isfinite(torch.tensor(history[-1]["train"]["loss"]))
    # the model sees bf16 (autocast) yet the run is a normal run: metrics, a loadable checkpoint
    metrics = json.loads((tmp_path / "bf16" / "metrics.json").read_text())
    assert 0.0 <= metrics["in_domain"]["accuracy"] <= 1.0
    assert main(["evaluate", "--checkpoint", str(tmp_path / "cpu" / "checkpoint.pt"), "--device", "cpu",
                 "--out", str(tmp_path / "eval")]) == 0  # fmt: skip
    a = json.loads((tmp_path / "cpu" / "metrics.json").read_text())
    b = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert a == b
    _, model, _, _ = load_run_with_data(tmp_path / "cpu", device="cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    capsys.readouterr()


def test_device_is_not_part_of_the_run():
    saved = TrainConfig(device="cuda:1", progress=False).to_dict()
    assert _same_run(saved, TrainConfig(device="cpu")) == (True, [])
    assert _same_run(saved, TrainConfig(precision="bf16")) == (False, ["precision"])
    old = {k: v for k, v in TrainConfig().to_dict().items() if k not in ("device", "precision")}
    assert _same_run(old, TrainConfig())[0]  # a config.json written before these settings existed
