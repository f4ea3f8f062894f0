"""End-to-end: train, metrics.json schema, resume after an interruption, evaluate, compare, CLI."""

import json
from pathlib import Path

import pytest
import torch

from gpattn.experiments.cli import main
from gpattn.experiments.training import TrainConfig, load_run_with_data, train

REAL_COLA = Path(__file__).resolve().parents[2] / "shared" / "data" / "cola_public_1.1.zip"

TINY = dict(
    embed_dim=16,
    num_heads=2,
    num_layers=1,
    epochs=3,
    batch_size=32,
    lr=5e-3,
    pooling="mean",
    patch_size=4,
    num_samples=3,
    progress=False,
)


def _schema_keys():
    from gpattn.experiments.metrics import METRIC_KEYS, OOD_KEYS

    return set(METRIC_KEYS), set(OOD_KEYS)


def test_train_digits_writes_schema(tmp_path):
    cfg = TrainConfig(dataset="digits", attention="softmax", **TINY)
    metrics = train(cfg, tmp_path)
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    keys, ood_keys = _schema_keys()
    assert set(on_disk) == {"in_domain", "shift", "ood"}
    assert keys <= set(on_disk["in_domain"]) and keys <= set(on_disk["shift"])
    assert ood_keys <= set(on_disk["ood"])
    assert 0.0 <= on_disk["in_domain"]["accuracy"] <= 1.0
    assert on_disk["in_domain"]["accuracy"] > 0.3  # 8 classes: chance is 0.125
    for name in ("checkpoint.pt", "config.json", "predictions.pt", "history.json"):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "config.json").read_text())["attention"] == "softmax"


def test_resume_after_interruption_matches_uninterrupted(tmp_path):
    cfg = TrainConfig(dataset="digits", attention="softmax", checkpoint_every=3, **TINY)
    full = train(cfg, tmp_path / "full")
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "cut", stop_after_steps=5)  # mid-epoch (digits train: 28 steps per epoch)
    ckpt = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 5
    resumed = train(cfg, tmp_path / "cut", resume=True)
    assert resumed == full
    h1 = json.loads((tmp_path / "full" / "history.json").read_text())
    h2 = json.loads((tmp_path / "cut" / "history.json").read_text())
    assert h1 == h2


def test_resume_refuses_a_different_configuration(tmp_path):
    cfg = TrainConfig(dataset="digits", attention="softmax", **{**TINY, "epochs": 1})
    train(cfg, tmp_path)
    other = TrainConfig(dataset="digits", attention="kernel", **{**TINY, "epochs": 1})
    with pytest.raises(ValueError, match="attention"):
        train(other, tmp_path, resume=True)


def test_unknown_config_key():
    with pytest.raises(ValueError, match="unknown config keys"):
        TrainConfig.from_dict({"epochz": 3})


def test_evaluate_checkpoint_reproduces_metrics(tmp_path):
    cfg = TrainConfig(dataset="digits", attention="softmax", **TINY)
    train(cfg, tmp_path / "run")
    _, model, bundle, ckpt = load_run_with_data(tmp_path / "run" / "checkpoint.pt")
    assert ckpt["step"] > 0 and bundle.name == "digits"
    assert (
        main(["evaluate", "--checkpoint", str(tmp_path / "run" / "checkpoint.pt"), "--out", str(tmp_path / "ev")]) == 0
    )
    a = json.loads((tmp_path / "run" / "metrics.json").read_text())
    b = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    # softmax is deterministic in eval mode: identical metrics
    assert a["in_domain"]["accuracy"] == b["in_domain"]["accuracy"]
    assert a["in_domain"]["nll"] == pytest.approx(b["in_domain"]["nll"], rel=1e-6)


def _cola_fixture(tmp_path):
    from gpattn.experiments.data.fixtures import make_cola_zip

    make_cola_zip(tmp_path / "cola_public_1.1.zip")
    return tmp_path


def test_cli_train_cola_fixture(tmp_path, capsys):
    data = _cola_fixture(tmp_path / "data")
    out = tmp_path / "run"
    args = [
        "train",
        "--dataset",
        "cola",
        "--data-dir",
        str(data),
        "--dataset-option",
        "verify_checksum=False",
        "--attention",
        "softmax",
        "--epochs",
        "1",
        "--embed-dim",
        "16",
        "--num-heads",
        "2",
        "--num-samples",
        "2",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    keys, ood_keys = _schema_keys()
    assert set(metrics) == {"in_domain", "ood"}
    assert keys <= set(metrics["in_domain"]) and (keys | ood_keys) <= set(metrics["ood"])
    assert "wrote" in capsys.readouterr().out


def test_cli_missing_data_names_file_and_url(tmp_path, capsys):
    code = main(
        [
            "train",
            "--dataset",
            "cola",
            "--data-dir",
            str(tmp_path / "nonexistent"),
            "--no-progress",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code != 0
    assert "cola_public_1.1.zip" in err and "https://" in err and "nonexistent" in err


def test_cli_unknown_attention_and_dataset(tmp_path, capsys):
    assert main(["train", "--attention", "nope", "--no-progress", "--out", str(tmp_path)]) == 2
    assert "valid names" in capsys.readouterr().err
    assert main(["train", "--dataset", "nope", "--no-progress", "--out", str(tmp_path)]) == 2
    assert "digits" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_report_with_baselines(tmp_path):
    from gpattn.experiments.compare import compare

    base = TrainConfig(dataset="digits", **{**TINY, "epochs": 1})
    results = compare(
        "softmax,kernel,softmax+ts,softmax+laplace,softmax+ens2",
        [0, 1],
        tmp_path,
        base,
        progress=False,
        log=lambda s: None,
    )
    assert set(results) == {"softmax", "kernel", "softmax+ts", "softmax+laplace", "softmax+ens2"}
    report = (tmp_path / "report.md").read_text()
    for row in ("| softmax |", "| kernel |", "| softmax+ts |", "| softmax+laplace |", "| softmax+ens2 |"):
        assert row in report
    assert "±" in report
    # paired differences to MSP: temperature scaling never changes accuracy, so its Δ accuracy is exactly 0
    delta = report.split("## Against softmax (MSP), in_domain")[1].split("## ")[0]
    ts_row = next(line for line in delta.splitlines() if line.startswith("| softmax+ts |"))
    assert "| +0.000 [+0.000, +0.000] (0/2) |" in ts_row, ts_row
    assert "| softmax |" not in delta and "| kernel |" in delta
    assert "Δ aurc" in delta and "Δ mcc" not in delta  # the split's own columns (no MCC for images)
    # one paired table per split, with that split's columns: the papers' claims are about shift and OOD too
    from gpattn.experiments.uncertainty import paired_difference

    lower = {"accuracy": False, "nll": True, "cnll": True, "ece": True, "ood_auroc": False}  # written out, not imported
    headers = (("shift", "| variant | Δ accuracy | Δ nll | Δ ece |"), ("ood", "| variant | Δ cnll | Δ ood_auroc |"))
    for split, header in headers:
        table = report.split(f"## Against softmax (MSP), {split}")[1].split("## ")[0]
        assert header in table, table
        cols = [c.strip().removeprefix("Δ ") for c in header.strip("| ").split("|")[1:]]
        # an OOD column is paired with the reference's best OOD score (the best mean over the seeds among its
        # ood_auroc* scores that every seed has), named in the table
        ref = results["softmax"]
        keys = [k for k in ref["0"][split] if k.startswith("ood_auroc") and all(ref[s][split].get(k) is not None
                                                                               for s in ("0", "1"))]  # fmt: skip
        best = max(keys, key=lambda k: ref["0"][split][k] + ref["1"][split][k]) if keys else None
        if split == "ood":
            assert f"ood_auroc against its {best}" in table, table
        for spec in ("kernel", "softmax+laplace", "softmax+ens2"):  # every cell: value, sign and k/n
            row = next(ln for ln in table.splitlines() if ln.startswith(f"| {spec} |"))
            for col, got in zip(cols, row.strip("| ").split(" | ")[1:]):
                against = best if col.startswith("ood_") else col
                diffs = [results[spec][s][split][col] - ref[s][split][against] for s in ("0", "1")]
                better = sum(d < 0 if lower[col] else d > 0 for d in diffs)
                d = paired_difference(diffs, [0.0, 0.0])  # the mean and its 95 % t-interval over the 2 seeds
                assert got == f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] ({better}/2)", (spec, col, got)
    shift = report.split("## Against softmax (MSP), shift")[1].split("## ")[0]
    ts_shift = next(ln for ln in shift.splitlines() if ln.startswith("| softmax+ts |"))
    assert "| +0.000 [+0.000, +0.000] (0/2) |" in ts_shift
    assert results["softmax+ts"]["0"]["temperature"] > 0
    # temperature scaling is fitted on val: it must not raise the val-fitted NLL's in-domain counterpart much
    assert results["softmax+ts"]["0"]["in_domain"]["accuracy"] == results["softmax"]["0"]["in_domain"]["accuracy"]
    # last-layer Laplace keeps the trained head's mean: accuracy within a few flips, never more confident on OOD
    lap, soft = results["softmax+laplace"]["0"], results["softmax"]["0"]
    assert abs(lap["in_domain"]["accuracy"] - soft["in_domain"]["accuracy"]) < 0.05
    assert lap["in_domain"]["nll"] < soft["in_domain"]["nll"] + 0.05
    # +ts and +laplace reuse the softmax run; the ensemble adds one member per seed (seed + 1000)
    runs = sorted(p.name for p in (tmp_path / "runs" / "softmax").iterdir())
    assert runs == ["seed0", "seed1", "seed1000", "seed1001"]
    for png in ("risk_coverage.png", "ood_histograms.png", "reliability_softmax.png"):
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.skipif(not REAL_COLA.is_file(), reason="official CoLA archive not present")
@pytest.mark.filterwarnings("default::gpattn.experiments.data._duplicates.DuplicateTextWarning")  # 12 OOD sentences
def test_cli_train_real_cola_one_epoch(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--dataset",
                "cola",
                "--data-dir",
                str(REAL_COLA.parent),
                "--attention",
                "softmax",
                "--epochs",
                "1",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    keys, ood_keys = _schema_keys()
    assert set(metrics) == {"in_domain", "ood"}
    assert keys <= set(metrics["in_domain"]) and ood_keys <= set(metrics["ood"])


def test_presets_are_valid_configs():
    from gpattn.attention.registry import attention_class
    from gpattn.experiments.compare import expand_variants
    from gpattn.experiments.data import list_datasets
    from gpattn.experiments.presets import PRESET_ONLY, PRESETS, get_preset

    names = __import__("gpattn").list_attention()
    for name in PRESETS:
        preset = get_preset(name)
        cfg = TrainConfig.from_dict({k: v for k, v in preset.items() if k not in PRESET_ONLY})
        assert cfg.dataset in list_datasets(), name
        specs = expand_variants(preset["variants"], preset.get("variant_options"))
        # every variant; on a pretrained encoder (one swapped layer) every GP variant and the baselines
        wanted = set(names) if cfg.encoder is None else {n for n in names if attention_class(n).is_gp}
        assert {s.attention for s in specs} >= wanted, name
        if cfg.encoder is not None:
            assert {s.spec for s in specs} >= {"softmax", "softmax+ts", "softmax+mcdropout", "softmax+laplace"}, name
            assert any(s.ensemble > 1 for s in specs) and preset["budget_minutes"] > 0, name
        assert preset["seeds"], name
    with pytest.raises(ValueError, match="valid presets"):
        get_preset("nope")


def _poison(monkeypatch, at_call: int, where: str = "grad", only: str | None = None):
    """Make the head's gradient (or logits) NaN at its ``at_call``-th use in every model built from now
    on (only for attention ``only`` when given); returns the list of models built."""
    import gpattn.experiments.training as training

    real, built = training.build_model, []

    def build(cfg, bundle):
        model = real(cfg, bundle)
        built.append(model)
        if only is not None and cfg.attention != only:
            return model
        calls = {"n": 0}

        def nan_at(value):
            calls["n"] += 1
            return value * float("nan") if calls["n"] == at_call else value

        if where == "grad":
            model.head.weight.register_hook(nan_at)
        else:
            model.head.register_forward_hook(lambda mod, args, out: nan_at(out))
        return model

    monkeypatch.setattr(training, "build_model", build)
    return built


@pytest.mark.parametrize("where,words", [("grad", "non-finite gradient"), ("logits", "non-finite loss")])
def test_divergence_stops_before_the_parameters_are_poisoned(tmp_path, monkeypatch, where, words):
    """A NaN gradient or loss at step 2 raises TrainingDivergedError naming the step (and the
    parameters), records diverged.json, and takes no optimizer step with it: clipping a NaN norm used
    to spread NaN into every parameter, and the next forward failed in an input check far away."""
    from gpattn.experiments.training import TrainingDivergedError

    built = _poison(monkeypatch, at_call=3, where=where)
    cfg = TrainConfig(dataset="digits", attention="softmax", **TINY)
    with pytest.raises(TrainingDivergedError, match=f"diverged at step 2: {words}") as info:
        train(cfg, tmp_path)
    assert info.value.step == 2
    if where == "grad":
        assert "head.weight" in str(info.value)
    assert all(torch.isfinite(p).all() for p in built[0].parameters())
    record = json.loads((tmp_path / "diverged.json").read_text())
    assert record["step"] == 2 and record["config"]["attention"] == "softmax"
    assert not (tmp_path / "metrics.json").exists()
    # the CLI reports it as a failed run (exit 1), not a traceback
    _poison(monkeypatch, at_call=3, where=where)
    code = main(["train", "--dataset", "digits", "--epochs", "1", "--embed-dim", "16", "--num-heads", "2",
                 "--num-layers", "1", "--no-progress", "--out", str(tmp_path / "cli")])  # fmt: skip
    assert code == 1


@pytest.mark.slow
def test_compare_records_a_diverged_variant_and_goes_on(tmp_path, monkeypatch, capsys):
    from gpattn.experiments.compare import compare

    _poison(monkeypatch, at_call=3, only="kernel")
    base = TrainConfig(dataset="digits", **{**TINY, "epochs": 1})
    results = compare("softmax,kernel", [0, 1], tmp_path, base, progress=False, log=lambda s: None)
    assert results["kernel"]["0"]["diverged"]["step"] == 2 and results["kernel"]["1"]["diverged"]["step"] == 2
    assert results["softmax"]["0"]["in_domain"]["accuracy"] > 0.2
    report = (tmp_path / "report.md").read_text()
    assert "| kernel (diverged: 2/2 seeds) | – |" in report and "## Diverged runs" in report
    assert "- kernel, seed 1: training diverged at step 2" in report
    assert json.loads((tmp_path / "results.json").read_text())["kernel"]["1"]["diverged"]["step"] == 2

    # a rerun reads the recorded divergence (and the finished softmax runs) instead of training again
    def no_training(*args, **kwargs):
        raise AssertionError("compare trained again")

    monkeypatch.setattr("gpattn.experiments.compare.train", no_training)
    again = compare("softmax,kernel", [0, 1], tmp_path, base, progress=False, log=lambda s: None)
    assert again == results


def test_compare_cache_ignores_progress_bars(tmp_path):
    """A finished run is reused whether or not progress bars are shown (a --no-progress rerun of the
    cola comparison retrained every run before)."""
    from gpattn.experiments.compare import compare

    base = TrainConfig(dataset="digits", attention="softmax", **{**TINY, "epochs": 1})
    compare("softmax", [0], tmp_path, base, progress=True, log=lambda s: None)
    lines = []
    compare("softmax", [0], tmp_path, base, progress=False, log=lines.append)
    assert any("softmax seed 0: reused" in ln for ln in lines), lines


def test_compare_checks_every_variant_before_training(tmp_path, monkeypatch):
    """An option a variant cannot take fails before any variant trains (it used to surface when that
    variant's turn came, after the others' runs)."""
    from gpattn.experiments.compare import compare

    def no_training(*args, **kwargs):
        raise AssertionError("compare trained before checking every variant")

    monkeypatch.setattr("gpattn.experiments.compare.train", no_training)
    base = TrainConfig(dataset="digits", **{**TINY, "epochs": 1}, attention_options={"kernel": "ard-rbf"})
    with pytest.raises(ValueError, match="variant 'kep-svgp' cannot be built with its options .*nothing was trained"):
        compare("sgpa,kep-svgp", [0], tmp_path, base, progress=False, log=lambda s: None)
    assert not (tmp_path / "runs").exists()


def test_compare_variant_settings_apply_to_every_spec_of_that_variant(tmp_path):
    """A preset's ``variant_settings`` ({name: {TrainConfig field: value}}): every run of that attention
    (its +ts and +ensN too) takes them, the other variants the base; report.md says so; bad settings
    fail before anything trains."""
    from gpattn.experiments.compare import compare

    base = TrainConfig(dataset="digits", **{**TINY, "epochs": 1})
    results = compare(
        "softmax,kernel,kernel+ts,kernel+ens2", [0], tmp_path, base, progress=False, log=lambda s: None,
        variant_settings={"kernel": {"epochs": 2, "lr": 2e-3}},
    )
    assert set(results) == {"softmax", "kernel", "kernel+ts", "kernel+ens2"}
    for run, epochs, lr in (("softmax", 1, base.lr), ("kernel", 2, 2e-3)):
        cfg = json.loads((tmp_path / "runs" / run / "seed0" / "config.json").read_text())
        assert (cfg["epochs"], cfg["lr"]) == (epochs, lr), run
        assert len(json.loads((tmp_path / "runs" / run / "seed0" / "history.json").read_text())) == epochs
    assert json.loads((tmp_path / "runs" / "kernel" / "seed1000" / "config.json").read_text())["epochs"] == 2
    assert "`kernel` runs with its own settings (every spec of it): epochs = 2, lr = 0.002" in (
        tmp_path / "report.md"
    ).read_text()
    for bad, words in (
        ({"nope": {"epochs": 2}}, "nope"),
        ({"kernel": {"epoch": 2}}, r"unknown TrainConfig fields \['epoch'\]"),
        ({"kernel": {"seed": 3}}, "cannot differ between the variants"),
        ({"kernel": {"epochs": 0}}, "epochs must be a positive int"),
    ):
        with pytest.raises(ValueError, match=words):
            compare("kernel", [0], tmp_path / "bad", base, progress=False, log=lambda s: None, variant_settings=bad)
    assert not (tmp_path / "bad").exists()


def test_cli_variant_settings_yield_to_flags(monkeypatch):
    """``train --preset P --attention NAME`` takes the preset's settings for NAME; an explicit flag wins,
    in train and in compare."""
    from gpattn.experiments import cli, presets

    monkeypatch.setitem(
        presets.PRESETS, "vs-test", dict(dataset="digits", epochs=3, seeds=[0], variants="softmax,kernel",
                                         variant_settings={"kernel": {"epochs": 7, "lr": 0.5}})
    )
    parser = cli.build_parser()
    args = parser.parse_args(["train", "--preset", "vs-test", "--attention", "kernel", "--out", "x"])
    cfg, _ = cli._config(args, attention="kernel")
    assert (cfg.epochs, cfg.lr) == (7, 0.5)
    args = parser.parse_args(["train", "--preset", "vs-test", "--attention", "kernel", "--epochs", "2", "--out", "x"])
    assert cli._config(args, attention="kernel")[0].epochs == 2
    args = parser.parse_args(["compare", "--preset", "vs-test", "--epochs", "2", "--out", "x"])
    assert cli._unflagged(args, presets.PRESETS["vs-test"]["variant_settings"]) == {"kernel": {"lr": 0.5}}


def test_pooling_flag_overrides_a_preset_and_bad_pooling_is_refused():
    """``--pooling mean`` runs an image preset (CLS pooling: the head sees only what attention gathers) with
    the mean over the patch tokens; a pooling the models do not have, or one an encoder would ignore, is refused."""
    from gpattn.experiments import cli

    args = cli.build_parser().parse_args(["compare", "--preset", "digits", "--pooling", "mean", "--out", "x"])
    assert cli._config(args)[0].pooling == "mean"
    args = cli.build_parser().parse_args(["compare", "--preset", "digits", "--out", "x"])
    assert cli._config(args)[0].pooling == "cls"
    for bad in ("max", 3):
        with pytest.raises(ValueError, match="pooling must be None .*'mean' or 'cls', got"):
            TrainConfig(pooling=bad)
    with pytest.raises(ValueError, match="pooling must be None with an encoder"):
        TrainConfig(pooling="cls", encoder="minilm", dataset="cola")


def test_eta_flag_sets_the_ksvd_weight_in_train_and_compare():
    """``--eta`` sets η (kep-svgp's KSVD weight) as ``--beta`` sets β; ``--loss-weight eta=...`` points to it."""
    from gpattn.experiments import cli

    parser = cli.build_parser()
    for command in ("train", "compare"):
        args = parser.parse_args([command, "--dataset", "digits", "--eta", "0", "--out", "x"])
        assert cli._config(args)[0].eta == 0.0
    assert cli._config(parser.parse_args(["train", "--out", "x"]))[0].eta == TrainConfig().eta
    with pytest.raises(ValueError, match="--eta"):
        TrainConfig(loss_weights={"eta": 0.0})


def test_grad_clip_flag_sets_the_clipping_norm_and_a_bad_one_is_named():
    """``--grad-clip`` sets the norm the trainer clips a step's gradients to (0: off), in train and compare."""
    from gpattn.experiments import cli

    parser = cli.build_parser()
    for command in ("train", "compare"):
        args = parser.parse_args([command, "--dataset", "digits", "--grad-clip", "0", "--out", "x"])
        assert cli._config(args)[0].grad_clip == 0.0
    assert cli._config(parser.parse_args(["train", "--out", "x"]))[0].grad_clip == TrainConfig().grad_clip == 1.0
    with pytest.raises(ValueError, match="grad_clip"):
        cli._config(parser.parse_args(["train", "--grad-clip", "-1", "--out", "x"]))
