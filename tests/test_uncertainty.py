"""gpattn.experiments.uncertainty: adaptive ECE, split-conformal sets, the entropy-matched "temperature"
diagnostic and paired statistics, each against scikit-learn / scipy or a closed form."""

import math

import numpy as np
import pytest
from scipy import stats

from gpattn.experiments import metrics as M
from gpattn.experiments import uncertainty as U


def _dirichlet_case(n=600, c=4, seed=0):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(c, 0.7), size=n)
    labels = np.array([rng.choice(c, p=p) for p in probs])  # calibrated by construction
    return probs, labels


# ------------------------------------------------------------------------------------------ adaptive ECE
def test_adaptive_ece_closed_form():
    # 4 examples, 2 bins of 2: confidences (0.6, 0.7 | 0.8, 0.9); bin 1 has 1 hit of 2, bin 2 two of 2
    probs = np.array([[0.6, 0.4], [0.3, 0.7], [0.8, 0.2], [0.1, 0.9]])
    labels = np.array([0, 0, 0, 1])  # hits: yes, no, yes, yes
    expected = 0.5 * abs(0.5 - 0.65) + 0.5 * abs(1.0 - 0.85)
    assert U.adaptive_ece(probs, labels, n_bins=2) == pytest.approx(expected, abs=1e-12)


def test_adaptive_ece_matches_sklearn_quantile_bins():
    sk = pytest.importorskip("sklearn.calibration")
    probs, labels = _dirichlet_case(n=1000)
    conf, hit = probs.max(1), probs.argmax(1) == labels
    # equal-count bins with distinct confidences and N divisible by the bins: sklearn's quantile strategy
    # gives the same groups, so ECE is the plain mean of |acc_b - conf_b|
    frac_pos, mean_pred = sk.calibration_curve(hit, conf, n_bins=10, strategy="quantile")
    assert U.adaptive_ece(probs, labels, n_bins=10) == pytest.approx(np.mean(np.abs(frac_pos - mean_pred)), abs=1e-3)
    # one bin: |accuracy - mean confidence|, the same as equal-width ECE with one bin
    assert U.adaptive_ece(probs, labels, n_bins=1) == pytest.approx(M.ece(probs, labels, n_bins=1), abs=1e-12)


# ------------------------------------------------------------------------------------------ conformal sets
def test_conformal_lac_threshold_is_the_closed_form_quantile():
    cal = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8], [0.55, 0.45]])
    y = np.array([0, 0, 1, 0, 1])  # LAC scores 1 - p_y: 0.1, 0.4, 0.3, 0.8, 0.55
    # n = 5, alpha = 0.4: ceil(6 * 0.6) = 4th smallest of (0.1, 0.3, 0.4, 0.55, 0.8) = 0.55
    out = U.conformal_sets(cal, y, cal, y, alpha=0.4)
    assert out["qhat"] == pytest.approx(0.55)
    # sets {k : p_k >= 0.45}: {0}, {0}, {1}, {1}, {0,1} -> sizes 1,1,1,1,2; labels covered 1,1,1,0,1
    assert out["set_size"] == pytest.approx(6 / 5) and out["coverage"] == pytest.approx(4 / 5)
    # too few calibration points for the level: every class in every set
    tiny = U.conformal_sets(cal[:2], y[:2], cal, y, alpha=0.1)
    assert math.isinf(tiny["qhat"]) and tiny["set_size"] == 2.0 and tiny["coverage"] == 1.0


def test_conformal_aps_scores_closed_form():
    p = np.array([[0.5, 0.3, 0.2]])
    assert U._scores_all(p, "aps")[0].tolist() == pytest.approx([0.5, 0.8, 1.0])
    assert U._scores_all(p, "lac")[0].tolist() == pytest.approx([0.5, 0.7, 0.8])


@pytest.mark.parametrize("score", ["lac", "aps"])
def test_conformal_coverage_guarantee(score):
    # exchangeable splits: coverage averaged over random splits lies in [1 - a, 1 - a + 1/(n + 1)] (Vovk)
    probs, labels = _dirichlet_case(n=2000, seed=1)
    rng = np.random.default_rng(2)
    cover, size = [], []
    for _ in range(40):
        perm = rng.permutation(len(labels))
        cal, test = perm[:500], perm[500:]
        out = U.conformal_sets(probs[cal], labels[cal], probs[test], labels[test], alpha=0.1, score=score)
        cover.append(out["coverage"])
        size.append(out["set_size"])
    assert 0.9 - 0.01 <= np.mean(cover) <= 0.9 + 1 / 501 + 0.01
    assert 1.0 < np.mean(size) < 4.0


# ------------------------------------------------------------------------------------------ temperature diagnostic
def _constructed_logits(distance_aware: bool, n=1500, c=3, p=40, seed=0):
    """Mean logits with overlapping margins in and out of domain; logit noise constant (a temperature) or
    growing with the input's distance from the training inputs (in domain d in [0, 1], OOD d in [2, 3])."""
    rng = np.random.default_rng(seed)

    def split(margins, d):
        mean = np.zeros((len(margins), c))
        mean[np.arange(len(margins)), rng.integers(0, c, len(margins))] = margins
        sigma = (0.1 + 0.5 * d) if distance_aware else np.full(len(margins), 0.8)
        return mean[:, None, :] + sigma[:, None, None] * rng.standard_normal((len(margins), p, c))

    z_in = split(rng.uniform(0.0, 5.0, n), rng.uniform(0.0, 1.0, n))
    z_out = split(rng.uniform(0.0, 3.0, n // 2), rng.uniform(2.0, 3.0, n // 2))
    return z_in, z_out


def test_constant_noise_reads_chance_and_is_flagged():
    z_in, z_out = _constructed_logits(distance_aware=False)
    # the plain MI AUROC is well above chance: MI rises with entropy even under constant noise
    plain = M.ood_metrics(M.all_ood_scores(z_in)["mutual-information"], M.all_ood_scores(z_out)["mutual-information"])
    assert plain["ood_auroc"] > 0.6
    row = U.temperature_diagnostic(z_in, z_out)
    for key in U.MATCHED_KEYS:
        assert row[key] == pytest.approx(0.5, abs=0.06), key
    assert U.is_temperature(row)


def test_distance_aware_noise_reads_high_and_is_not_flagged():
    z_in, z_out = _constructed_logits(distance_aware=True)
    row = U.temperature_diagnostic(z_in, z_out)
    assert row["ood_matched_auroc_logit_variance"] > 0.95
    assert row["ood_matched_auroc_mutual_information"] > 0.75
    assert not U.is_temperature(row)


def test_entropy_matched_auroc_closed_form_and_sklearn():
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(3)
    h_in, h_out = rng.uniform(size=300), rng.uniform(size=200)
    s_in, s_out = rng.normal(size=300), rng.normal(0.5, 1.0, size=200)
    # one bin: the plain AUROC of the score with OOD positive
    plain = sk.roc_auc_score(np.r_[np.zeros(300), np.ones(200)], np.r_[s_in, s_out])
    assert U.entropy_matched_auroc(s_in, s_out, h_in, h_out, n_bins=1) == pytest.approx(plain, abs=1e-12)
    # two bins by entropy: the size-weighted mean of each half's sklearn AUROC
    h, s, y = np.r_[h_in, h_out], np.r_[s_in, s_out], np.r_[np.zeros(300), np.ones(200)]
    order = np.argsort(h, kind="stable")
    halves = np.array_split(order, 2)
    expected = sum(len(b) * sk.roc_auc_score(y[b], s[b]) for b in halves) / len(h)
    assert U.entropy_matched_auroc(s_in, s_out, h_in, h_out, n_bins=2) == pytest.approx(expected, abs=1e-12)
    # a score that is the entropy itself separates nothing within narrow bins once the kinds share entropies
    assert U.entropy_matched_auroc(h_in, h_out, h_in, h_out, n_bins=50) == pytest.approx(0.5, abs=0.1)


def test_temperature_seeds_reads_metrics_rows():
    flagged = {"ood": {U.MATCHED_KEYS[0]: 0.52, U.MATCHED_KEYS[1]: 0.51}, "in_domain": {"nll": 0.3}}
    fine = {"ood": {U.MATCHED_KEYS[0]: 0.52, U.MATCHED_KEYS[1]: 0.8}}
    none = {"ood": {U.MATCHED_KEYS[0]: None, U.MATCHED_KEYS[1]: None}}
    assert U.temperature_seeds({"0": flagged, "1": fine, "2": none}, [0, 1, 2]) == [0]


# ------------------------------------------------------------------------------------------ paired statistics
def test_paired_difference_against_scipy():
    a = np.array([0.61, 0.58, 0.64, 0.60, 0.59])
    b = np.array([0.63, 0.60, 0.63, 0.65, 0.62])
    out = U.paired_difference(a, b)
    d = a - b
    res = stats.ttest_rel(a, b)
    low, high = res.confidence_interval(0.95)
    assert out["mean"] == pytest.approx(d.mean(), abs=1e-12)
    assert (out["low"], out["high"]) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
    lo2, hi2 = stats.t.interval(0.95, 4, loc=d.mean(), scale=stats.sem(d))
    assert out["low"] == pytest.approx(lo2, abs=1e-12) and out["high"] == pytest.approx(hi2, abs=1e-12)
    assert (out["a_lower"], out["a_higher"], out["n"]) == (4, 1, 5)
    with pytest.raises(ValueError):
        U.paired_difference([0.1], [0.2])


# ------------------------------------------------------------------------------------------ metrics.json hook
def test_evaluate_predictions_records_the_new_metrics():
    from types import SimpleNamespace

    import torch

    from gpattn.experiments.training import evaluate_predictions

    z_in, z_out = _constructed_logits(distance_aware=False, n=300, p=8)
    rng = np.random.default_rng(5)
    y_in = torch.as_tensor(z_in.mean(1).argmax(1))
    val = z_in[:150] + 0.3 * rng.standard_normal(z_in[:150].shape)
    preds = {
        "val": {"logits": torch.as_tensor(val), "labels": torch.as_tensor(val.mean(1).argmax(1))},
        "test": {"logits": torch.as_tensor(z_in), "labels": y_in},
        "ood": {"logits": torch.as_tensor(z_out), "labels": torch.full((len(z_out),), -1)},
    }
    bundle = SimpleNamespace(eval_splits={"in_domain": "test", "ood": "ood"}, ood_splits=("ood",), num_classes=3,
                             info={})
    result = evaluate_predictions(preds, bundle)
    row = result["in_domain"]
    probs = M.average_samples(z_in)
    assert row["adaptive_ece"] == pytest.approx(U.adaptive_ece(probs, y_in.numpy()))
    lac = U.conformal_sets(M.average_samples(val), preds["val"]["labels"].numpy(), probs, y_in.numpy())
    assert row["conformal_coverage_lac"] == pytest.approx(lac["coverage"])
    assert row["conformal_set_size_lac"] == pytest.approx(lac["set_size"])
    assert "conformal_coverage_aps" in row and "adaptive_ece" not in result["ood"]
    assert result["ood"][U.MATCHED_KEYS[1]] == pytest.approx(U.temperature_diagnostic(z_in, z_out)[U.MATCHED_KEYS[1]])
    # the combined NLL: the in-domain rows and the OOD rows (labels -1: against the uniform label), by hand
    p_out = M.average_samples(z_out)
    terms = np.r_[-np.log(probs[np.arange(len(y_in)), y_in.numpy()]), -np.log(p_out).mean(axis=1)]
    assert result["ood"]["cnll"] == pytest.approx(terms.mean(), rel=1e-9)
    assert "cnll" not in result["in_domain"]
    # a score carried beside the logits (a model's own): its OOD AUROC and its entropy-matched AUROC
    h_in, h_out = (-np.sum(p * np.log(p), axis=1) for p in (probs, p_out))
    own_in, own_out = rng.random(len(z_in)), rng.random(len(z_out)) + 0.5
    preds["test"]["own_scores"] = {"gp-variance": torch.as_tensor(own_in)}
    preds["ood"]["own_scores"] = {"gp-variance": torch.as_tensor(own_out)}
    row = evaluate_predictions(preds, bundle)["ood"]
    assert row["ood_matched_auroc_gp_variance"] == pytest.approx(U.entropy_matched_auroc(own_in, own_out, h_in, h_out))
    assert row["ood_auroc_gp_variance"] == pytest.approx(M.ood_metrics(-own_in, -own_out)["ood_auroc"])


def test_compare_label_flags_a_temperature_gp():
    from gpattn.experiments.report import _label

    flagged = {"ood": {U.MATCHED_KEYS[0]: 0.52, U.MATCHED_KEYS[1]: 0.51}}
    fine = {"ood": {U.MATCHED_KEYS[0]: 0.9, U.MATCHED_KEYS[1]: 0.8}}
    assert _label("sgpa", {"0": flagged, "1": fine}, [0, 1]) == "sgpa (variance ≈ temperature: 1/2 seeds)"
    assert _label("sgpa", {"0": fine, "1": fine}, [0, 1]) == "sgpa"


def test_aps_scores_in_chunks_match_the_dense_form():
    probs, _ = _dirichlet_case(n=700, c=90, seed=4)  # 90^2 entries a row: several chunks
    probs[:5, :2] = probs[:5, :2].mean(axis=1, keepdims=True)  # ties count as "at least as probable"
    dense = np.sum(probs[:, None, :] * (probs[:, None, :] >= probs[:, :, None]), axis=2)
    np.testing.assert_allclose(U._scores_all(probs, "aps"), dense, rtol=0, atol=1e-12)


def test_a_model_without_sampling_variance_is_not_judged():
    """P equal draws (softmax in eval mode, repeated): no variance to judge, so NaN and no flag — not a
    'variance ≈ temperature' verdict on a model that has no variance at all."""
    rng = np.random.default_rng(3)
    z_in = np.repeat(rng.normal(size=(50, 1, 4)), 5, axis=1)
    z_out = np.repeat(rng.normal(size=(40, 1, 4)), 5, axis=1)
    row = U.temperature_diagnostic(z_in, z_out)
    assert all(math.isnan(row[k]) for k in U.MATCHED_KEYS) and not U.is_temperature(row)
    z_out[0, 1, 0] += 1.0  # one input with spread: judged again
    assert all(math.isfinite(U.temperature_diagnostic(z_in, z_out)[k]) for k in U.MATCHED_KEYS)
