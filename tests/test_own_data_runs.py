"""End to end: the README's own-data recipe (train + shift + OOD files) through the CLI, the
report saying what was run, compare's cache keyed on data content, per-variant options, +laplace without
laplace-torch, selectable OOD scores, and scoring new sentences from a saved run without its data files."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import gpattn
from gpattn.experiments.cli import main
from gpattn.experiments.data.fixtures import make_text_table
from gpattn.objectives import DEFAULT_ALPHA

TINY = ["--epochs", "1", "--embed-dim", "16", "--num-heads", "2", "--num-layers", "1", "--num-samples", "3",
        "--no-progress"]  # fmt: skip


#: the fixture's small vocabulary repeats a few training texts in its shift file (counted and warned about:
#: tests/test_reliability_round4.py); these tests are about other things
_DUPLICATES_EXPECTED = pytest.mark.filterwarnings("ignore::gpattn.experiments.data._duplicates.DuplicateTextWarning")


def _three_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    make_text_table(folder / "train.tsv", n=90, seed=0)
    make_text_table(folder / "shift.tsv", n=30, seed=7)
    make_text_table(folder / "ood.tsv", n=20, seed=8, columns=("id", "text"))
    return folder


def _recipe(folder, out, *extra):
    """The README's own-data recipe (one training file, a shift file, an OOD file)."""
    return main([
        "compare", "--dataset", "text_table",
        "--dataset-option", f"path={folder / 'train.tsv'}",
        "--dataset-option", f"shift_file={folder / 'shift.tsv'}",
        "--dataset-option", f"ood_file={folder / 'ood.tsv'}",
        "--attention", "softmax,sto[tau=2.0]+ts", "--seeds", "0",
        "--ood-score", "msp,mutual-information", *TINY, "--out", str(out), *extra,
    ])  # fmt: skip


@pytest.mark.slow
@_DUPLICATES_EXPECTED
def test_readme_recipe_three_files_report_and_cache(tmp_path, capsys):
    data = _three_files(tmp_path / "data")
    out = tmp_path / "cmp"
    assert _recipe(data, out) == 0
    log = capsys.readouterr().out
    assert "softmax seed 0: trained (no finished run)" in log and "sto[tau=2.0] seed 0: trained" in log
    report = (out / "report.md").read_text()
    # what was run: files with size and checksum, split sizes and class counts, objective weights
    for role, name, rows in (("train", "train.tsv", 90), ("shift", "shift.tsv", 30), ("ood", "ood.tsv", 20)):
        line = next(ln for ln in report.splitlines() if ln.startswith(f"- file ({role}):"))
        assert name in line and f"{(data / name).stat().st_size} bytes" in line and f"{rows} rows" in line
        assert "sha256 " in line
    assert "- split `train`: 63 rows (negative: 21, neutral: 21, positive: 21)" in report
    assert "- split `shift`: 30 rows (negative: 10, neutral: 10, positive: 10)" in report
    assert "- split `ood`: 20 rows (negative: 0, neutral: 0, positive: 0, 20 unlabelled)" in report
    assert "β = 1 (KL weight" in report and f"α = {DEFAULT_ALPHA:g} (CGP" in report and "η = 0.1 (KSVD" in report
    assert "| variant | cnll | ood_auroc | ood_auroc_mutual_information |" in report
    results = json.loads((out / "results.json").read_text())
    shift = results["softmax"]["0"]["shift"]
    assert shift["accuracy"] is not None and shift["n"] == 30 and shift["class_counts"]["neutral"] == 10
    assert {"ood_auroc", "ood_auroc_entropy", "ood_auroc_energy", "ood_auroc_mc_variance",
            "ood_auroc_mutual_information"} <= set(results["softmax"]["0"]["ood"])  # fmt: skip
    # reliability diagrams for every labelled split, pooled over seeds; histograms for each chosen score
    for png in ("reliability_softmax_in_domain.png", "reliability_softmax_shift.png",
                "reliability_sto_tau_2.0_ts_shift.png", "ood_histograms.png",
                "ood_histograms_mutual-information.png"):  # fmt: skip
        assert (out / png).stat().st_size > 1000, png
    assert not (out / "reliability_softmax_ood.png").exists()  # the OOD file has no labels
    assert "seeds pooled" in report or "seed pooled" in report

    # the same command again reuses both runs ...
    assert _recipe(data, out) == 0
    log = capsys.readouterr().out
    assert "softmax seed 0: reused" in log and "sto[tau=2.0] seed 0: reused" in log and "trained" not in log
    # ... and editing a data file in place is refused without --overwrite (#46), then retrains with it
    # (before #28: the stale runs were silently reused; before #46: replaced without asking)
    text = (data / "shift.tsv").read_text().replace("The film", "A film", 1)
    (data / "shift.tsv").write_text(text)
    assert _recipe(data, out) == 2
    assert "holds a finished run that compare would replace (data changed). Pass --overwrite" in capsys.readouterr().err
    assert _recipe(data, out, "--overwrite") == 0
    log = capsys.readouterr().out
    assert "softmax seed 0: trained (data changed)" in log and "sto[tau=2.0] seed 0: trained (data changed)" in log

    # scoring new sentences from the saved run, without its data files
    for f in data.iterdir():
        f.unlink()
    run = gpattn.experiments.load_run(out / "runs" / "softmax" / "seed0")
    from gpattn.experiments.inference import UnknownWordsWarning

    with pytest.warns(UnknownWordsWarning, match="unseen words only"):  # a text of unknown words: said, not silent
        pred = run.predict(["a wonderful , delightful film", "dull and tedious", "unseen words only"], num_samples=4)
    assert pred.probs.shape == (3, 3) and torch.allclose(pred.probs.sum(1), torch.ones(3), atol=1e-5)
    assert pred.sample_probs.shape == (3, 4, 3)
    assert torch.allclose(pred.total_entropy, pred.expected_entropy + pred.mutual_information, atol=1e-5)
    assert bool((pred.mutual_information >= 0).all()) and set(pred.labels) <= {"negative", "neutral", "positive"}
    ckpt = torch.load(out / "runs" / "softmax" / "seed0" / "checkpoint.pt", weights_only=True)  # plain data
    assert ckpt["data"]["vocab"][:3] == ["<pad>", "<unk>", "<cls>"]


@pytest.mark.slow
@_DUPLICATES_EXPECTED
def test_shift_file_with_unknown_labels_never_gives_silent_null_metrics(tmp_path, capsys):
    data = _three_files(tmp_path / "data")
    make_text_table(data / "shift.tsv", n=30, seed=7, class_names=("negative", "positive", "mixed"))
    assert _recipe(data, tmp_path / "a") == 2  # before: shift accuracy/NLL/ECE silently null
    err = capsys.readouterr().err
    assert "shift.tsv line 4: label 'mixed' of the shift file never occurs in training" in err
    assert "unknown_labels='drop'" in err
    assert _recipe(data, tmp_path / "b", "--dataset-option", "unknown_labels=unlabelled") == 0
    capsys.readouterr()
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    shift = results["softmax"]["0"]["shift"]
    assert shift["n"] == 30 and shift["n_labelled"] == 20 and shift["accuracy"] is not None
    report = (tmp_path / "b" / "report.md").read_text()
    assert "- shift: 10 rows with labels unknown to training ['mixed'] were kept unlabelled" in report
    assert "30 examples, 20 labelled" in report


@pytest.mark.slow
def test_global_attention_option_no_longer_aborts_and_laplace_without_laplace_torch(tmp_path, monkeypatch):
    from gpattn.experiments.compare import compare
    from gpattn.experiments.laplace import laplace_torch_available
    from gpattn.experiments.training import TrainConfig

    monkeypatch.setitem(sys.modules, "laplace", None)  # `import laplace` raises ImportError
    assert not laplace_torch_available()
    data = _three_files(tmp_path / "data")
    base = TrainConfig(
        dataset="text_table", dataset_options={"path": str(data / "train.tsv")}, attention_options={"tau": 2.0},
        epochs=1, embed_dim=16, num_heads=2, num_layers=1, num_samples=3, progress=False,
    )
    logs = []
    # before: "unknown option(s) ['tau'] for attention 'softmax'" aborted the comparison; and +laplace
    # without laplace-torch failed: the dense back end was asked for hessian_structure='kron'
    results = compare("softmax+laplace,sto", [0], tmp_path / "out", base, log=logs.append)
    assert results["softmax+laplace"]["0"]["in_domain"]["accuracy"] is not None
    report = (tmp_path / "out" / "report.md").read_text()
    assert "attention option tau=2.0 applies to ['sto']; left out for ['softmax']" in report
    assert "laplace-torch is not installed" in report and "dense" in report
    assert json.loads((tmp_path / "out" / "runs" / "sto" / "seed0" / "config.json").read_text())[
        "attention_options"
    ] == {"tau": 2.0}
    with pytest.raises(ValueError, match=r"apply to none of the variants.*sto\[tau=2\]"):
        compare("softmax", [0], tmp_path / "x", base, log=logs.append)


def test_variant_spec_syntax():
    from gpattn.experiments.compare import expand_variants, parse_variant, split_variants

    assert split_variants("sto[tau=2,hard=True]+ts,softmax") == ["sto[tau=2,hard=True]+ts", "softmax"]
    spec = parse_variant("h-sto[tau1=1.0, tau2=20]+ts+ens2")
    assert spec.attention == "h-sto" and spec.options == (("tau1", 1.0), ("tau2", 20)) and spec.ts
    assert spec.ensemble == 2 and spec.run_name == "h-sto[tau1=1.0,tau2=20]"
    with pytest.raises(ValueError, match="unknown option 'tau' for attention 'sgpa'"):
        parse_variant("sgpa[tau=2]")
    # the papers' per-variant settings through a preset: Pei et al.'s CoLA tau for sto and h-sto
    from gpattn.experiments.presets import get_preset

    preset = get_preset("cola")
    specs = {s.spec: s for s in expand_variants("sto,h-sto[tau2=3.0],softmax", preset["variant_options"])}
    assert dict(specs["sto"].options) == {"tau": 1.0}
    assert dict(specs["h-sto[tau2=3.0]"].options) == {"tau1": 1.0, "tau2": 3.0}
    assert specs["softmax"].options == ()


def test_cli_data_lists_options(capsys):
    assert main(["data"]) == 0
    assert "text_table" in capsys.readouterr().out
    assert main(["data", "text_table"]) == 0
    out = capsys.readouterr().out
    for option in ("path (required)", "header (default True)", "unknown_labels (default 'error')",
                   "delimiter (default None)", "shift_file", "ood_file", "true/false, yes/no"):  # fmt: skip
        assert option in out, option


def test_mutual_information_score():
    from gpattn.experiments import metrics as M

    # two samples that disagree completely: H(mean) = log 2, each sample certain: MI = log 2
    sp = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [0.5, 0.5]]])
    total, expected, mi = M.predictive_entropy_split(sp)
    assert total == pytest.approx([0.6931472, 0.6931472]) and expected == pytest.approx([0.0, 0.6931472])
    assert mi == pytest.approx([0.6931472, 0.0], abs=1e-7)
    assert M.ood_scores(None, "mutual_information", sample_probs=sp) == pytest.approx([-0.6931472, 0.0], abs=1e-7)
