"""Collapse is never silent (gpattn.experiments.diagnostics): per-layer scale in the history, warnings, report flags."""

import json
import warnings

import pytest
import torch

from gpattn.experiments.diagnostics import (
    BASE_RATE_MARGIN,
    EpochStats,
    GPCollapseWarning,
    base_rate_entropy,
    collapse_warnings,
)
from gpattn.experiments.training import COLLAPSE, TrainConfig, train
from gpattn.models import TransformerClassifier
from gpattn.objectives import DEFAULT_ALPHA

TINY = dict(embed_dim=16, num_heads=2, num_layers=1, batch_size=32, pooling="mean", patch_size=4,
            num_samples=2, progress=False)  # fmt: skip


def test_base_rate_entropy():
    assert base_rate_entropy(torch.tensor([0, 1, 0, 1]), 2) == pytest.approx(0.6931471805599453)
    assert base_rate_entropy(torch.tensor([2, 2, 2]), 3) == 0.0


def _model_stats(model, steps=3):
    """EpochStats of a few training-mode forwards of ``model`` on LayerNorm-scale random ids."""
    torch.manual_seed(0)
    stats = EpochStats()
    model.train()
    for _ in range(steps):
        ids = torch.randint(1, 50, (4, 9))
        mask = torch.zeros(4, 9, dtype=torch.bool)
        mask[0, 6:] = True
        model(ids, mask)
        stats.add(model.loss_terms(), model.layer_diagnostics())
    return stats.summary()


def _history(summary, nll):
    summary["train"]["nll"] = nll
    return [{"epoch": 1, "step": 3, **summary, "base_rate_entropy": 0.6}]


def test_a_layer_whose_mean_is_under_its_noise_is_flagged():
    torch.manual_seed(0)
    model = TransformerClassifier(
        2, vocab_size=50, embed_dim=16, num_heads=2, num_layers=2, attention="sgpa-decoupled",
        attention_options={"prior_mean": "zero"},  # the paper's form: kl_seq and kl_global
    )  # fmt: skip
    healthy = _model_stats(model)
    assert [row["layer"] for row in healthy["layers"]] == [0, 1]
    for row in healthy["layers"]:  # every GP layer: its KL terms and its scale against its input
        keys = {"kl_seq", "kl_global", "input_norm", "mean_norm", "spread_norm", "mean_ratio", "spread_ratio"}
        assert keys <= set(row)
        assert 0 < row["spread_ratio"] < 1 and 0 < row["mean_ratio"] < 1
    assert collapse_warnings(_history(healthy, nll=0.3)) == []
    # the collapsed state the exact ELBO used to reach: values (the mean basis), the global mean and the
    # output bias at 0, the prior noise left
    layer = model.encoder.blocks[1].attn
    with torch.no_grad():
        D = layer.embed_dim
        layer.in_proj.weight[D:].zero_()  # W_v rows (projections ("qk", "v"))
        layer.in_proj.bias[D:].zero_()
        layer.out_proj.bias.zero_()
        layer.strategy.variational_distribution.inducing_values.zero_()
    msgs = collapse_warnings(_history(_model_stats(model), nll=0.3))
    assert len(msgs) == 1 and msgs[0].startswith("GP layer 1:") and "collapsed under its sample spread" in msgs[0]


def test_training_at_the_base_rate_is_flagged():
    summary = {"train": {}, "layers": []}
    assert collapse_warnings(_history(summary, nll=0.6 - BASE_RATE_MARGIN / 2))[0].startswith("training cross-entropy")
    assert collapse_warnings(_history(summary, nll=0.5)) == []


def test_train_warns_and_records_a_run_at_the_base_rate(tmp_path):
    """A deliberately stuck run (lr 1e-9: the model stays at its initial, prior-like prediction) warns,
    writes collapse.json and epoch means per GP layer into history.json; a healthy run does neither."""
    stuck = TrainConfig(dataset="digits", attention="sgpa", epochs=1, lr=1e-9, **TINY)
    with pytest.warns(GPCollapseWarning, match="base-rate entropy"):
        train(stuck, tmp_path / "stuck")
    record = json.loads((tmp_path / "stuck" / COLLAPSE).read_text())
    assert record["warnings"] and record["base_rate_entropy"] == pytest.approx(2.079, abs=0.01)
    history = json.loads((tmp_path / "stuck" / "history.json").read_text())
    assert history[-1]["layers"][0]["layer"] == 0 and "spread_ratio" in history[-1]["layers"][0]
    assert set(history[-1]["train"]) >= {"nll", "kl_seq", "loss"}

    healthy = TrainConfig(dataset="digits", attention="softmax", epochs=3, lr=5e-3, **TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPCollapseWarning)
        train(healthy, tmp_path / "healthy")
    assert json.loads((tmp_path / "healthy" / COLLAPSE).read_text())["warnings"] == []


def test_compare_flags_a_collapsed_row(tmp_path):
    from gpattn.experiments.compare import compare

    base = TrainConfig(dataset="digits", epochs=1, lr=1e-9, **TINY)
    with pytest.warns(GPCollapseWarning):
        compare("softmax", [0], tmp_path, base, progress=False, log=lambda s: None)
    report = (tmp_path / "report.md").read_text()
    assert "| softmax (collapse: 1/1 seeds) |" in report
    assert "## Collapse warnings" in report and "base-rate entropy" in report
    assert "Objective (docs/derivations.md §9): β = 1 " in report and "β = 1: the ELBO" in report
    assert f"α is the library default {DEFAULT_ALPHA:g}" in report


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sgpa", "sgpa-decoupled", "kep-svgp", "cgp", "scgp"])
def test_plain_train_on_a_users_table_does_not_collapse(tmp_path, attention):
    """``gpattn train --dataset text_table`` with a GP variant and no preset uses the exact ELBO (β = 1) and
    the library's CGP weight α = DEFAULT_ALPHA; at the stream-scale initialisation it learns (before:
    kl_seq 8.1 -> 0.007 and predictions at the class prior; cgp / scgp at the base rate with α = 1)."""
    from gpattn.experiments.data.fixtures import make_text_table

    path = make_text_table(tmp_path / "reviews.tsv", n=300, seed=0)
    cfg = TrainConfig(
        dataset="text_table", dataset_options={"path": str(path)}, attention=attention, epochs=4,
        embed_dim=32, num_heads=2, num_layers=2, batch_size=32, num_samples=4, progress=False,
    )  # fmt: skip
    assert cfg.beta == 1.0 and cfg.alpha == DEFAULT_ALPHA
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GPCollapseWarning)
        metrics = train(cfg, tmp_path / "run")
    messages = [str(w.message) for w in caught if issubclass(w.category, GPCollapseWarning)]
    # this table is solvable word by word, and cgp's attention path is weak (docs/results.md, the attention
    # suite): it may be flagged as not attending here (measured, seed 0: context effect 0.021 in layer 0), but
    # never as collapsed or at the base rate
    allowed = "does not attend" if attention == "cgp" else None
    assert [m for m in messages if allowed is None or allowed not in m] == [], messages
    # balanced classes: majority rate 1/3. Measured (seed 0, 4 epochs): sgpa 0.73, sgpa-decoupled 0.85,
    # kep-svgp 0.77; at the previous initialisation 0.62, 0.63 and 0.40
    assert metrics["in_domain"]["accuracy"] >= 0.7, metrics["in_domain"]
