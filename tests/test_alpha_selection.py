"""compare chooses the CGP regulariser weight α on the validation split (Bui et al. Remark 3): every run of a
variant whose objective has the regulariser trains once per α of the grid and keeps the lowest validation NLL."""

import json
import math

import pytest
import torch

from gpattn.experiments import compare as C
from gpattn.experiments import metrics as M
from gpattn.experiments.training import TrainConfig, TrainingDivergedError

TINY = dict(embed_dim=16, num_heads=2, num_layers=1, epochs=1, batch_size=32, lr=5e-3, pooling="mean",
            patch_size=4, num_samples=2, progress=False)


def _val_nll(preds) -> float:
    val = preds["val"]
    return M.nll(M.average_samples(val["logits"], average="probs"), val["labels"])


def test_variants_that_take_alpha_are_found_by_their_loss_terms():
    base = TrainConfig(dataset="digits", **TINY)
    specs = C.expand_variants("all")
    assert C._check_specs(specs, base) == {"cgp", "scgp"}


def _fake_preds(p_true: float, n: int = 40, classes: int = 3) -> dict:
    """Sample logits (n, 1, C) whose averaged probability of the true class is ``p_true``."""
    labels = torch.arange(n) % classes
    probs = torch.full((n, classes), (1 - p_true) / (classes - 1))
    probs[torch.arange(n), labels] = p_true
    return {"val": {"logits": probs.log()[:, None, :], "labels": labels}}


def test_selected_run_keeps_the_lowest_validation_nll_and_skips_diverged(monkeypatch):
    quality = {1e-3: 0.5, 1e-5: 0.9, 1e-6: 0.7, 1e-7: None}  # None: that candidate diverges

    def fake_run(base, spec, seed, root, bundle, progress, fingerprint, log, trained, alpha=None, plan=None):
        if quality[alpha] is None:
            raise TrainingDivergedError("diverged", 3)
        return f"cfg{alpha}", f"folder{alpha}", _fake_preds(quality[alpha])

    monkeypatch.setattr(C, "_run", fake_run)
    base = TrainConfig(dataset="digits", **TINY)
    lines = []
    cfg, folder, preds, selection = C._selected_run(
        base, C.parse_variant("cgp"), 0, None, None, False, None, lines.append, set(), tuple(quality)
    )
    assert (cfg, folder, selection["alpha"]) == ("cfg1e-05", "folder1e-05", 1e-5)
    assert selection["val_nll"]["1e-07"] == "diverged"
    for alpha, p in quality.items():
        if p is not None:
            assert math.isclose(selection["val_nll"][f"{alpha:g}"], -math.log(p), rel_tol=1e-6)
    assert "α = 1e-05 chosen on the validation NLL" in lines[-1]
    # without a grid: the one run, no selection
    quality[None] = 0.6
    assert C._selected_run(base, C.parse_variant("cgp"), 0, None, None, False, None, print, set(), ())[3] is None
    # every candidate diverged: the variant diverged
    with pytest.raises(TrainingDivergedError):
        C._selected_run(base, C.parse_variant("cgp"), 0, None, None, False, None, print, set(), (1e-7,))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:cgp seed 0")  # one epoch of a 1-layer cgp: the collapse warnings are expected
def test_compare_trains_cgp_once_per_alpha_and_reports_the_choice(tmp_path):
    base = TrainConfig(dataset="digits", **TINY)
    results = C.compare("softmax,cgp", [0], tmp_path, base, progress=False, log=lambda s: None,
                        alpha_grid=[1.0, 1e-5])
    runs = tmp_path / "runs"
    # softmax does not use α: one run, in its usual folder
    assert (runs / "softmax" / "seed0" / "predictions.pt").is_file() and not (runs / "softmax" / "alpha=1e-05").exists()
    assert "alpha" not in results["softmax"]["0"]
    nlls = {}
    for alpha in (1.0, 1e-5):
        folder = runs / "cgp" / f"alpha={alpha:g}" / "seed0"
        assert json.loads((folder / "config.json").read_text())["alpha"] == alpha
        nlls[f"{alpha:g}"] = _val_nll(torch.load(folder / "predictions.pt", weights_only=True))
    row = results["cgp"]["0"]
    assert row["alpha_selection"] == pytest.approx(nlls)
    chosen = min(nlls, key=nlls.get)
    assert row["alpha"] == float(chosen)
    # the reported metrics are the chosen run's
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.training import evaluate_predictions

    preds = torch.load(runs / "cgp" / f"alpha={chosen}" / "seed0" / "predictions.pt", weights_only=True)
    expected = evaluate_predictions(preds, load_dataset("digits", seed=0), base.average)
    assert row["in_domain"]["nll"] == pytest.approx(expected["in_domain"]["nll"])
    report = (tmp_path / "report.md").read_text()
    assert "## α chosen on the validation split" in report and f"- cgp, seed 0: α = {float(chosen):g}" in report
    assert "is chosen per run from [1.0, 1e-05]" in report
    # a rerun reuses every candidate
    lines = []
    C.compare("cgp", [0], tmp_path, base, progress=False, log=lines.append, alpha_grid=[1.0, 1e-5])
    assert sum("reused" in ln for ln in lines) == 2, lines


def test_bad_alpha_grids_fail_before_training(tmp_path, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking the grid")

    monkeypatch.setattr(C, "train", no_training)
    base = TrainConfig(dataset="digits", **TINY)
    for grid in ([], [-1e-5], [1e-5, 1e-5], ["x"], [math.nan], [True]):
        with pytest.raises(ValueError, match="alpha_grid must be a non-empty list"):
            C.compare("cgp", [0], tmp_path, base, progress=False, log=lambda s: None, alpha_grid=grid)
    with pytest.raises(ValueError, match=r"alpha_grid chooses α for \['cgp'\], whose variant_settings set alpha"):
        C.compare("cgp", [0], tmp_path, base, progress=False, log=lambda s: None, alpha_grid=[1e-5],
                  variant_settings={"cgp": {"alpha": 1e-3}})
    assert not (tmp_path / "runs").exists()


def test_cli_alpha_grid_flag_and_the_presets_grid(monkeypatch, capsys):
    from gpattn.experiments import cli, presets

    seen = {}
    monkeypatch.setattr("gpattn.experiments.compare.compare", lambda *a, **k: seen.update(k, cfg=a[3]))
    monkeypatch.setitem(presets.PRESETS, "grid-test", dict(dataset="digits", epochs=1, seeds=[0], variants="cgp",
                                                           alpha_grid=(1e-5, 1e-6)))
    assert cli.main(["compare", "--preset", "grid-test", "--out", "x"]) == 0
    assert seen["alpha_grid"] == (1e-5, 1e-6)
    assert cli.main(["compare", "--preset", "grid-test", "--alpha-grid", "1e-4,1e-7", "--out", "x"]) == 0
    assert seen["alpha_grid"] == [1e-4, 1e-7]
    assert cli.main(["compare", "--preset", "grid-test", "--alpha", "1e-3", "--out", "x"]) == 0
    assert seen["alpha_grid"] is None and seen["cfg"].alpha == 1e-3
    assert "--alpha 0.001 replaces the preset's α grid" in capsys.readouterr().out
    assert cli.main(["compare", "--alpha", "1e-3", "--alpha-grid", "1e-4", "--out", "x"]) == 2
    assert "give --alpha (one value) or --alpha-grid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["compare", "--alpha-grid", "1e-4,big", "--out", "x"])
    assert "--alpha-grid takes a comma list of numbers" in capsys.readouterr().err
    # every preset but the demo chooses α from the grid for cgp and scgp (and none fixes α itself); the demo's
    # minutes run cgp and scgp once each, at the library default
    for name, preset in presets.PRESETS.items():
        if name == "demo":
            assert "alpha_grid" not in preset and "alpha" not in preset
        elif name != "grid-test":
            assert preset["alpha_grid"] == presets.PRESET_ALPHA_GRID and "alpha" not in preset, name
