"""report.md's OOD columns (issue #59 items 10-11): a score a model does not have is "–", a paired OOD difference is
against the reference's best score, and a score that ranks OOD inputs below chance says so."""

import numpy as np
import pytest
import torch

from gpattn.experiments import metrics as M
from gpattn.experiments.report import _against_reference, _best_score, _inverted, _inverted_note


def _logits(n=40, P=5, C=3, spread=0.0, seed=0):
    g = np.random.default_rng(seed)
    mean = g.normal(size=(n, 1, C)) * 3
    return mean + spread * g.normal(size=(n, P, C))


def test_samples_differ_tells_round_off_from_samples():
    assert not M.samples_differ(_logits(P=1, spread=1.0))  # one sample
    copies = _logits()
    assert not M.samples_differ(copies)
    assert not M.samples_differ(copies + 1e-7 * np.random.default_rng(1).normal(size=copies.shape))  # float32 noise
    assert M.samples_differ(_logits(spread=0.1))
    assert M.samples_differ(torch.tensor(_logits(spread=0.1), dtype=torch.float32))


def test_a_model_without_samples_has_no_sample_scores():
    # before: mutual information and MC variance of round-off, AUROC ~ 0.5 of noise, reported as a number
    noisy_copies = _logits() + 1e-7 * np.random.default_rng(2).normal(size=(40, 5, 3))
    scores = M.all_ood_scores(noisy_copies)
    assert set(scores) == set(M.LOGIT_SCORE_NAMES)
    for name in M.SAMPLE_SCORES:
        assert scores[name] is None
    for name in set(M.LOGIT_SCORE_NAMES) - set(M.SAMPLE_SCORES):
        assert scores[name].shape == (40,)
    sampled = M.all_ood_scores(_logits(spread=0.5))
    assert all(sampled[name].shape == (40,) for name in M.LOGIT_SCORE_NAMES)


def _results(values: dict, split="ood", seeds=(0, 1, 2)):
    """{spec: {seed: {split: {key: value}}}} with per-seed values (lists) per key."""
    return {
        spec: {str(s): {split: {k: (v[i] if v is not None else None) for k, v in row.items()}} for i, s in
               enumerate(seeds)}
        for spec, row in values.items()
    }  # fmt: skip


def test_paired_ood_differences_are_against_the_references_best_score():
    results = _results({
        "softmax": {"ood_auroc": [0.60, 0.62, 0.61], "ood_auroc_energy": [0.80, 0.82, 0.81],
                    "ood_auroc_mutual_information": [None, None, None]},
        "sgpa-rff": {"ood_auroc": [0.70, 0.70, 0.70], "ood_auroc_energy": [0.75, 0.75, 0.75],
                     "ood_auroc_mutual_information": [0.85, 0.86, 0.84]},
    })  # fmt: skip
    seeds = (0, 1, 2)
    key, values = _best_score(results["softmax"], seeds, "ood", "ood_auroc_mutual_information")
    assert key == "ood_auroc_energy" and values == [0.80, 0.82, 0.81]
    lines = _against_reference(results, seeds, "ood", ("ood_auroc", "ood_auroc_mutual_information"))
    row = next(line for line in lines if line.startswith("| sgpa-rff"))
    cells = [c.strip() for c in row.split("|")[2:-1]]
    # MI 0.85 against softmax's energy 0.81 (+0.04), not against its MI (which it does not have: "–" before)
    assert cells[1].startswith("+0.040") and cells[1].endswith("(3/3)")
    assert cells[0].startswith("-0.110") and cells[0].endswith("(0/3)")  # msp 0.70 against energy 0.81
    assert any("ood_auroc_energy" in line for line in lines)


def test_a_score_below_chance_is_marked_and_explained():
    results = _results({"softmax": {"ood_auroc": [0.31, 0.35, 0.40], "ood_auroc_energy": [0.55, 0.5, 0.6]}})
    seeds = (0, 1, 2)
    assert _inverted(results["softmax"], seeds, "ood", "ood_auroc")
    assert not _inverted(results["softmax"], seeds, "ood", "ood_auroc_energy")
    assert not _inverted(_results({"x": {"nll": [0.1, 0.2, 0.3]}})["x"], seeds, "ood", "nll")  # not an AUROC
    note = _inverted_note(results, seeds, "ood", ("ood_auroc", "ood_auroc_energy"))
    assert note and "more in-distribution" in note[-1]
    assert _inverted_note(results, seeds, "ood", ("ood_auroc_energy",)) == []


@pytest.mark.parametrize("P", [1, 4])
def test_evaluate_predictions_writes_none_for_a_score_the_model_lacks(P):
    from types import SimpleNamespace

    from gpattn.experiments.training import evaluate_predictions

    g = torch.Generator().manual_seed(0)
    base = torch.randn(30, 1, 3, generator=g)
    preds = {k: {"logits": base.expand(30, P, 3).clone(), "labels": torch.randint(0, 3, (30,), generator=g)}
             for k in ("test", "ood")}  # fmt: skip
    preds["ood"]["labels"][:] = -1
    bundle = SimpleNamespace(eval_splits={"in_domain": "test", "ood": "ood"}, ood_splits=("ood",), num_classes=3,
                             info={}, kind="image")  # fmt: skip
    out = evaluate_predictions(preds, bundle)
    assert out["ood"]["ood_auroc_mutual_information"] is None and out["ood"]["ood_auroc_mc_variance"] is None
    assert out["ood"]["ood_auroc"] is not None


def test_the_epoch_line_shows_the_nll_beside_the_loss(tmp_path):
    # before (issue #59 item 14): sgpa-rff's loss rose every epoch while its NLL fell, and only the loss was shown
    import re
    import subprocess

    from tests._cli_helpers import single_thread_env, train_cmd

    done = subprocess.run(train_cmd("sgpa-rff", 2, "--num-samples", "2", "--out", str(tmp_path / "run")),
                          env=single_thread_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("[train] sgpa-rff seed 0: epoch ")]
    assert len(lines) == 2
    for line in lines:
        found = re.search(r"loss (-?[0-9.]+) \(NLL ([0-9.]+) \+ the weighted KL and regulariser terms (-?[0-9.]+)",
                          line)
        assert found, line
        loss, nll, rest = map(float, found.groups())
        assert rest > 0 and abs(loss - (nll + rest)) < 2e-4  # a GP layer's KL is a part of the loss


def test_the_temperature_diagnostic_ignores_round_off():
    from gpattn.experiments.uncertainty import temperature_diagnostic

    g = np.random.default_rng(3)
    copies_in, copies_out = _logits(seed=4), _logits(seed=5)
    noisy = [z + 1e-7 * g.normal(size=z.shape) for z in (copies_in, copies_out)]
    assert all(np.isnan(v) for v in temperature_diagnostic(*noisy).values())
    assert all(np.isfinite(v) for v in temperature_diagnostic(_logits(spread=0.3, seed=4),
                                                              _logits(spread=0.3, seed=5)).values())


def test_a_degenerate_temperature_points_at_the_plain_row():
    # issue #57 item 4: TS can fit T ~ 0.01 on digits' near-perfect validation split and then hurts the shift
    from gpattn.experiments.report import _temperature_notes

    seeds = (0, 1)
    results = {
        "softmax": {"0": {}, "1": {}},
        "softmax+ts": {"0": {"temperature": 0.0101}, "1": {"temperature": 1.3}},
        "sgpa+ts": {"0": {"temperature": 0.9}, "1": {"temperature": 1.1}},
    }
    lines = _temperature_notes(results, seeds)
    ts = next(line for line in lines if line.startswith("- softmax+ts"))
    assert "0.0101, 1.3" in ts and "degenerate in seed 0" in ts and "`softmax`" in ts
    sgpa = next(line for line in lines if line.startswith("- sgpa+ts"))
    assert "degenerate" not in sgpa
    assert _temperature_notes({"softmax": {"0": {}, "1": {}}}, seeds) == []
