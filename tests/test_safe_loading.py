"""Loading a checkpoint, a run or a cache never executes code: a file whose pickle would
call a function is refused by evaluate, --resume, load_run and compare (and the call never happens);
every file today's code writes still loads, each load with ``weights_only=True``."""

import shutil
from pathlib import Path

import pytest
import torch
from _cli_helpers import TINY_DIGITS

from gpattn import list_attention
from gpattn.experiments.cli import main
from gpattn.experiments.compare import compare
from gpattn.experiments.training import TrainConfig, load_run_with_data, resolve_device, train

TINY = dict(embed_dim=16, num_heads=2, num_layers=1, epochs=1, batch_size=256, patch_size=4, num_samples=2,
            eval_batch_size=512, progress=False)  # fmt: skip
REFUSED = "or was written by an unsafe tool: refusing to unpickle it (torch.load weights_only=True rejected: "


class _Payload:
    """Unpickling this creates ``marker``: a harmless stand-in for any code a crafted file could run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _poison(path: Path, marker: Path) -> None:
    """Rewrite a file gpattn wrote with the payload added next to its real content: the old loader
    accepted such a file (and ran the payload) since everything it expects is still there."""
    content = torch.load(path, weights_only=True)
    torch.save({**content, "note": _Payload(marker)}, path)


def _assert_refused(err: str, path: Path, marker: Path) -> None:
    assert not marker.exists(), "the payload ran while loading"
    assert f"{path} is not a readable gpattn " in err and REFUSED in err, err
    assert "Unsupported global" in err and "Weights only load failed" not in err, err  # our words, not PyTorch's


def _error_of(call, marker: Path) -> str:
    """The message of the ValueError ``call`` raises; whether the payload ran is checked first."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the old loader's failures came after the payload ran
        assert not marker.exists(), "the payload ran while loading"
        assert isinstance(err, ValueError), repr(err)
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished one-epoch softmax run on digits (copied by each test before it is poisoned)."""
    folder = tmp_path_factory.mktemp("safe") / "run"
    train(TrainConfig(dataset="digits", attention="softmax", **TINY), folder)
    return folder


@pytest.fixture
def poisoned(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    marker = tmp_path / "payload-ran"
    _poison(run / "checkpoint.pt", marker)
    return run, marker


def test_evaluate_refuses_a_checkpoint_with_a_payload(poisoned, capsys):
    run, marker = poisoned
    code = main(["evaluate", "--checkpoint", str(run / "checkpoint.pt")])
    _assert_refused(capsys.readouterr().err, run / "checkpoint.pt", marker)
    assert code == 2


def test_resume_refuses_a_checkpoint_with_a_payload(poisoned, capsys):
    run, marker = poisoned
    code = main(["train", *TINY_DIGITS, "--attention", "softmax", "--out", str(run), "--resume"])
    _assert_refused(capsys.readouterr().err, run / "checkpoint.pt", marker)
    assert code == 2


def test_load_run_refuses_a_checkpoint_with_a_payload(poisoned):
    run, marker = poisoned
    _assert_refused(_error_of(lambda: load_run_with_data(run), marker), run / "checkpoint.pt", marker)


@pytest.mark.parametrize("spec, file", [("softmax", "predictions.pt"), ("softmax+laplace", "checkpoint.pt")])
def test_compare_cache_refuses_a_file_with_a_payload(tmp_path, spec, file):
    base = TrainConfig(dataset="digits", **TINY)
    compare("softmax", [0], tmp_path, base, progress=False, log=lambda s: None)
    cached = tmp_path / "runs" / "softmax" / "seed0" / file
    marker = tmp_path / "payload-ran"
    _poison(cached, marker)
    again = _error_of(lambda: compare(spec, [0], tmp_path, base, progress=False, log=lambda s: None), marker)
    _assert_refused(again, cached, marker)


@pytest.fixture
def loads(monkeypatch):
    """Every torch.load call's keyword arguments while the test runs."""
    calls, real = [], torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


def _assert_weights_only(calls: list, at_least: int) -> None:
    assert len(calls) >= at_least, calls
    # onto the CPU, or the device --device auto chose (evaluate, load_run); a resume reads RNG states: the CPU
    where = {"cpu", str(resolve_device("auto"))}
    assert all(c.get("weights_only") is True and str(c.get("map_location")) in where for c in calls), calls


@pytest.mark.parametrize("attention", list_attention())
def test_every_variant_round_trips_weights_only(tmp_path, capsys, loads, attention):
    cfg = TrainConfig(dataset="digits", attention=attention, **TINY)
    first = train(cfg, tmp_path)
    model = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]  # (recorded too)
    _, loaded, _, ckpt = load_run_with_data(tmp_path)
    assert set(ckpt) == {"format_version", "gpattn_version", "config", "model", "optimizer", "scheduler", "step",
                         "history", "epoch_stats", "rng", "data", "rng_ranks", "detectors"}  # fmt: skip
    assert ckpt["history"] and ckpt["rng"].dtype == torch.uint8
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model[name]), name
    # --resume of the finished run restores optimizer, scheduler and RNG: the same predictions again
    assert train(cfg, tmp_path, resume=True) == first
    assert main(["evaluate", "--checkpoint", str(tmp_path / "checkpoint.pt"), "--out", str(tmp_path / "ev")]) == 0
    _assert_weights_only(loads, 4)


def test_config_with_options_and_layer_list_round_trips(tmp_path, loads):
    """Configuration values that are not strings or numbers (a layer tuple, nested options) are plain data."""
    cfg = TrainConfig(dataset="digits", attention="sgpa-decoupled", attention_layers=(0,), mc_dropout=True,
                      attention_options={"num_global": 4, "covariance": "diag"}, **TINY)  # fmt: skip
    first = train(cfg, tmp_path)
    assert train(cfg, tmp_path, resume=True) == first
    _assert_weights_only(loads, 1)


def test_compare_cache_with_laplace_and_an_ensemble_loads_weights_only(tmp_path, loads, monkeypatch):
    base = TrainConfig(dataset="digits", **TINY)
    specs = "softmax,softmax+laplace,softmax+ens2"
    first = compare(specs, [0], tmp_path, base, progress=False, log=lambda s: None)
    monkeypatch.setattr(
        "gpattn.experiments.compare.train", lambda *a, **k: pytest.fail("a cached run was trained again")
    )
    loads.clear()
    again = compare(specs, [0], tmp_path, base, progress=False, log=lambda s: None)
    assert again == first
    _assert_weights_only(loads, 5)  # 3 cached predictions for the plain run and laplace, 1 more member, 1 checkpoint
