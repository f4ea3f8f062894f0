"""gpattn.experiments.metrics: hand-computed cases, scikit-learn / torchmetrics cross-checks, degenerate cases."""

import math

import numpy as np
import pytest
import torch

from gpattn.experiments import metrics as M

# ----------------------------------------------------------------------------------------------------
# The hand-computed case used throughout: 5 binary examples, distinct confidences.
#   row  probs         label  argmax  correct  confidence
#   0    [0.90, 0.10]  0      0       yes      0.90
#   1    [0.20, 0.80]  1      1       yes      0.80
#   2    [0.70, 0.30]  1      0       no       0.70
#   3    [0.40, 0.60]  1      1       yes      0.60
#   4    [0.45, 0.55]  0      1       no       0.55
HAND_P = np.array([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.4, 0.6], [0.45, 0.55]])
HAND_Y = np.array([0, 1, 1, 1, 0])


def test_all_sorted_and_schema():
    assert M.__all__ == sorted(M.__all__)
    assert M.METRIC_KEYS == ("accuracy", "mcc", "nll", "brier", "ece", "mce", "aurc", "eaurc", "auroc",
                             "aupr_success", "aupr_error", "fpr95")
    assert M.OOD_KEYS == ("ood_auroc", "ood_aupr_in", "ood_aupr_out", "ood_fpr95")


def test_hand_accuracy_mcc_nll_brier():
    assert M.accuracy(HAND_P, HAND_Y) == pytest.approx(3 / 5)
    # class 1 as positive: TP = rows 1,3 (2); TN = row 0 (1); FP = row 4 (1); FN = row 2 (1)
    # MCC = (TP·TN − FP·FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (2 − 1) / sqrt(3·3·2·2) = 1/6
    assert M.mcc(HAND_P, HAND_Y) == pytest.approx(1 / 6, abs=1e-15)
    # NLL = −mean log p(y) = −(ln .9 + ln .8 + ln .3 + ln .6 + ln .45) / 5
    expect_nll = -(math.log(0.9) + math.log(0.8) + math.log(0.3) + math.log(0.6) + math.log(0.45)) / 5
    assert M.nll(HAND_P, HAND_Y) == pytest.approx(expect_nll, abs=1e-14)
    # binary Brier per row = 2 (1 − p_y)²: .02, .08, .98, .32, .605 -> sum 2.005, mean .401
    assert M.brier(HAND_P, HAND_Y) == pytest.approx(0.401, abs=1e-14)


def test_hand_combined_nll_scores_ood_rows_against_the_uniform_label():
    """cNLL (OOD rows: uniform label) by hand, float64: the 5 in-domain rows' −log p(y), two unlabelled OOD rows'
    −(1/C) Σ_c log p_c and one OOD row with a known label by that label, the 8 rows weighted equally."""
    ood = np.array([[0.5, 0.5], [0.99, 0.01], [0.3, 0.7]])
    in_terms = [-math.log(0.9), -math.log(0.8), -math.log(0.3), -math.log(0.6), -math.log(0.45)]
    uniform = [-(math.log(0.5) + math.log(0.5)) / 2, -(math.log(0.99) + math.log(0.01)) / 2]
    want = (sum(in_terms) + sum(uniform) - math.log(0.7)) / 8
    got = M.combined_nll(HAND_P, HAND_Y, ood, np.array([-1, -1, 1]))
    assert got == pytest.approx(want, rel=1e-14)
    unlabelled = (sum(in_terms) + sum(uniform) - (math.log(0.3) + math.log(0.7)) / 2) / 8
    assert M.combined_nll(HAND_P, HAND_Y, ood) == pytest.approx(unlabelled, rel=1e-14)  # labels_ood None: all unknown
    assert M.combined_nll(HAND_P, HAND_Y, ood[:0]) == pytest.approx(M.nll(HAND_P, HAND_Y), rel=1e-14)
    # the uniform prediction on an OOD row costs log C, its minimum: a confident one costs more
    want = (-math.log(0.9) + math.log(2)) / 2
    assert M.combined_nll(HAND_P[:1], HAND_Y[:1], np.full((1, 2), 0.5)) == pytest.approx(want)
    with pytest.raises(ValueError, match="same C"):
        M.combined_nll(HAND_P, HAND_Y, np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="labels_ood"):
        M.combined_nll(HAND_P, HAND_Y, ood, np.array([0, 2, -1]))


def test_hand_ece_mce_right_closed():
    # 10 bins: .9 -> (.8, .9]; .8 -> (.7, .8]; .7 -> (.6, .7]; .6 and .55 -> (.5, .6] (.6 on the edge: lower
    # bin). Gaps: .1, .2, .7, |0.5 − 0.575| = .075 (2 examples). ECE = (.1 + .2 + .7 + 2·.075)/5 = .23.
    assert M.ece(HAND_P, HAND_Y, n_bins=10) == pytest.approx(0.23, abs=1e-14)
    assert M.mce(HAND_P, HAND_Y, n_bins=10) == pytest.approx(0.7, abs=1e-14)
    # 15 bins: .8 = 12/15 and .6 = 9/15 sit on edges and go to the lower bins (11/15, 12/15] and
    # (8/15, 9/15]; .55 also in (8/15, 9/15] -> the same grouping, ECE = .23. Left-closed bins would give
    # (.1 + .2 + .7 + .4 + .55)/5 = .39.
    assert M.ece(HAND_P, HAND_Y) == pytest.approx(0.23, abs=1e-14)
    assert M.mce(HAND_P, HAND_Y) == pytest.approx(0.7, abs=1e-14)


def test_ece_edge_goes_to_lower_bin():
    # confidences .6 (correct) and .55 (wrong), 10 bins: both in (.5, .6] -> |1/2 − .575| = .075.
    # If .6 went up to (.6, .7]: ECE = (|1 − .6| + |0 − .55|)/2 = .475.
    p = np.array([[0.6, 0.4], [0.45, 0.55]])
    y = np.array([0, 0])
    assert M.ece(p, y, n_bins=10) == pytest.approx(0.075, abs=1e-14)
    bins = M.calibration_bins(p, y, n_bins=10)
    np.testing.assert_array_equal(bins.counts, [0, 0, 0, 0, 0, 2, 0, 0, 0, 0])
    # a confidence of exactly 1.0 is in the last bin (.9, 1] (no extra bin)
    p1 = np.array([[1.0, 0.0], [0.95, 0.05]])
    bins1 = M.calibration_bins(p1, np.array([0, 1]), n_bins=10)
    assert bins1.counts[-1] == 2 and bins1.counts.sum() == 2
    # (1 + .95)/2 − 1/2 = .475
    assert M.ece(p1, np.array([0, 1]), n_bins=10) == pytest.approx(0.475, abs=1e-14)


def test_hand_classwise_ece():
    # 10 bins. class 0: p = .9 .2 .7 .4 .45, indicator 1 0 0 0 1, all in different bins:
    #   gaps .1 .2 .7 .4 .55 -> ECE_0 = 1.95/5 = .39
    # class 1: p = .1 .8 .3 .6 .55, indicator 0 1 1 1 0; .1 -> [0, .1]; .6 and .55 share (.5, .6]:
    #   gaps .1 .2 .7 and 2·|.5 − .575| -> ECE_1 = (1.0 + .15)/5 = .23
    # classwise ECE = (.39 + .23)/2 = .31; MCE = max gap = .7
    assert M.ece(HAND_P, HAND_Y, n_bins=10, mode="classwise") == pytest.approx(0.31, abs=1e-14)
    assert M.mce(HAND_P, HAND_Y, n_bins=10, mode="classwise") == pytest.approx(0.7, abs=1e-14)
    with pytest.raises(ValueError, match="mode"):
        M.ece(HAND_P, HAND_Y, mode="all")


def test_hand_aurc_eaurc():
    # sorted by confidence: c c w c w -> cumulative errors 0 0 1 1 2, risks 0, 0, 1/3, 1/4, 2/5
    # AURC = (1/3 + 1/4 + 2/5)/5 = 59/300. Oracle (errors last): 0 0 0 1/4 2/5 -> 0.13 = 39/300.
    assert M.aurc(HAND_P, HAND_Y) == pytest.approx(59 / 300, abs=1e-15)
    assert M.eaurc(HAND_P, HAND_Y) == pytest.approx(20 / 300, abs=1e-15)
    cov, risk = M.risk_coverage_curve(HAND_P, HAND_Y)
    np.testing.assert_allclose(cov, [0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_allclose(risk, [0, 0, 1 / 3, 1 / 4, 2 / 5])


def test_aurc_ties_are_order_free():
    # two examples with the same confidence, one wrong: expected errors in the top 1 = 1/2 -> risks 1/2, 1/2
    p = np.array([[0.7, 0.3], [0.7, 0.3]])
    for y in (np.array([0, 1]), np.array([1, 0])):
        assert M.aurc(p, y) == pytest.approx(0.5, abs=1e-15)
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=300)
    probs = np.round(probs, 1)
    probs[:, 2] = 1.0 - probs[:, 0] - probs[:, 1]
    probs = np.clip(probs, 0, 1)
    probs /= probs.sum(1, keepdims=True)
    labels = rng.integers(0, 3, 300)
    perm = rng.permutation(300)
    assert M.aurc(probs, labels) == pytest.approx(M.aurc(probs[perm], labels[perm]), abs=1e-12)


def test_eaurc_perfect_ranking_is_zero_and_matches_continuous_limit():
    rng = np.random.default_rng(1)
    n, c = 2000, 4
    conf = np.sort(rng.uniform(0.4, 0.99, n))[::-1]  # strictly decreasing, errors will be the last ones
    probs = np.zeros((n, c))
    probs[:, 0] = conf
    probs[:, 1:] = ((1 - conf) / (c - 1))[:, None]
    labels = np.zeros(n, dtype=np.int64)
    n_err = 300
    labels[-n_err:] = 1  # the 300 least confident are wrong
    assert M.eaurc(probs, labels) == pytest.approx(0.0, abs=1e-14)
    # oracle AURC -> r + (1 − r) ln(1 − r) for large N
    r = n_err / n
    assert M.aurc(probs, labels) == pytest.approx(r + (1 - r) * math.log(1 - r), abs=1e-3)
    # reversed ranking (the e errors most confident): risk 1 for k ≤ e, then e/k, so
    # AURC = (1/N) [e + e (H_N − H_e)]; minus the oracle (1/N) [e − (N − e)(H_N − H_{N−e})]
    labels_rev = np.zeros(n, dtype=np.int64)
    labels_rev[:n_err] = 1

    def harmonic(m):
        return sum(1.0 / k for k in range(1, m + 1))

    worst = (n_err + n_err * (harmonic(n) - harmonic(n_err))) / n
    oracle = (n_err - (n - n_err) * (harmonic(n) - harmonic(n - n_err))) / n
    assert M.aurc(probs, labels_rev) == pytest.approx(worst, abs=1e-12)
    assert M.eaurc(probs, labels_rev) == pytest.approx(worst - oracle, abs=1e-12)


def test_hand_failure_prediction():
    # correct confidences {.9, .8, .6}, wrong {.7, .55}: pairs correct > wrong: 2 + 2 + 1 = 5 of 6
    assert M.auroc(HAND_P, HAND_Y) == pytest.approx(5 / 6, abs=1e-15)
    # ranking c c w c w: precision at each correct = 1, 1, 3/4 -> AP = 2.75/3
    assert M.aupr_success(HAND_P, HAND_Y) == pytest.approx(2.75 / 3, abs=1e-15)
    # by −confidence: w c w c c: precision at each error = 1, 2/3 -> AP = 5/6
    assert M.aupr_error(HAND_P, HAND_Y) == pytest.approx(5 / 6, abs=1e-15)
    # thresholds .9 .8 .7 .6 .55: TPR 1/3 2/3 2/3 1 1; first TPR ≥ .95 at .6 where FP = 1 of 2
    assert M.fpr95(HAND_P, HAND_Y) == pytest.approx(0.5, abs=1e-15)


def _brute_fpr95(score, positive):
    # independent reference: loop over distinct thresholds in decreasing order
    for t in sorted(set(score.tolist()), reverse=True):
        accept = score >= t
        tpr = accept[positive].mean()
        if tpr >= 0.95:
            return accept[~positive].mean()
    raise AssertionError("unreachable")


def test_cross_check_sklearn_random():
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(2)
    for trial in range(5):
        n, c = 400, 2 + trial
        logits = rng.normal(size=(n, c)) * 2.0
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        if trial % 2:  # create ties in the confidence
            probs = np.round(probs, 2)
            probs[:, -1] = 1.0 - probs[:, :-1].sum(1)
            probs = np.clip(probs, 0.0, 1.0)
            probs /= probs.sum(1, keepdims=True)
        # labels correlated with predictions so that accuracy is well inside (0, 1)
        labels = np.where(rng.random(n) < 0.6, probs.argmax(1), rng.integers(0, c, n))
        pred = probs.argmax(1)
        correct = pred == labels
        conf = probs.max(1)
        assert M.accuracy(probs, labels) == pytest.approx(sk.accuracy_score(labels, pred), abs=1e-15)
        assert M.mcc(probs, labels) == pytest.approx(sk.matthews_corrcoef(labels, pred), abs=1e-12)
        assert M.nll(probs, labels) == pytest.approx(
            sk.log_loss(labels, np.clip(probs, 1e-12, 1), labels=list(range(c))), abs=1e-9)
        assert M.auroc(probs, labels) == pytest.approx(sk.roc_auc_score(correct, conf), abs=1e-12)
        assert M.aupr_success(probs, labels) == pytest.approx(
            sk.average_precision_score(correct, conf), abs=1e-12)
        assert M.aupr_error(probs, labels) == pytest.approx(
            sk.average_precision_score(~correct, -conf), abs=1e-12)
        assert M.fpr95(probs, labels) == pytest.approx(_brute_fpr95(conf, correct), abs=1e-15)
        # Brier: brute force
        onehot = np.eye(c)[labels]
        assert M.brier(probs, labels) == pytest.approx(np.mean(np.sum((probs - onehot) ** 2, 1)), abs=1e-12)


def test_cross_check_torchmetrics_calibration():
    # torchmetrics bins left-closed [lo, hi) with an extra bin for confidence 1.0; the conventions agree
    # only when no confidence sits exactly on a bin edge and none equals 1.0, which we assert first.
    tmc = pytest.importorskip("torchmetrics.classification")
    rng = np.random.default_rng(3)
    n, c = 500, 4
    probs = rng.dirichlet(np.full(c, 0.3), size=n)
    labels = rng.integers(0, c, n)
    conf = probs.max(1)
    for n_bins in (15, 10):
        edges = np.arange(n_bins + 1) / n_bins
        assert np.min(np.abs(conf[:, None] - edges[None, :])) > 1e-9 and conf.max() < 1.0
        pt, yt = torch.from_numpy(probs), torch.from_numpy(labels)
        l1 = tmc.MulticlassCalibrationError(num_classes=c, n_bins=n_bins, norm="l1")(pt, yt)
        mx = tmc.MulticlassCalibrationError(num_classes=c, n_bins=n_bins, norm="max")(pt, yt)
        # torchmetrics accumulates in float32 here: tolerance 1e-6
        assert M.ece(probs, labels, n_bins=n_bins) == pytest.approx(float(l1), abs=1e-6)
        assert M.mce(probs, labels, n_bins=n_bins) == pytest.approx(float(mx), abs=1e-6)


def test_classification_metrics_dict_and_torch_input():
    rng = np.random.default_rng(4)
    probs = rng.dirichlet(np.ones(3), size=100)
    labels = rng.integers(0, 3, 100)
    out = M.classification_metrics(probs, labels)
    assert tuple(out) == M.METRIC_KEYS
    assert all(isinstance(v, float) for v in out.values())
    single = {k: getattr(M, k)(probs, labels) for k in M.METRIC_KEYS}
    for k in M.METRIC_KEYS:
        assert out[k] == pytest.approx(single[k], abs=1e-15), k
    out_t = M.classification_metrics(torch.from_numpy(probs).float(), torch.from_numpy(labels))
    for k in M.METRIC_KEYS:
        assert out_t[k] == pytest.approx(out[k], abs=1e-5), k
    assert M.classification_metrics(probs, labels, n_bins=10)["ece"] == pytest.approx(
        M.ece(probs, labels, n_bins=10), abs=1e-15)


def test_degenerate_cases():
    # every prediction correct: failure AUROC and FPR95 undefined, AUPR-error has no positive -> NaN
    p = np.array([[0.9, 0.1], [0.3, 0.7], [0.6, 0.4]])
    y = np.array([0, 1, 0])
    out = M.classification_metrics(p, y)
    assert math.isnan(out["auroc"]) and math.isnan(out["fpr95"]) and math.isnan(out["aupr_error"])
    assert out["aupr_success"] == 1.0 and out["aurc"] == 0.0 and out["eaurc"] == 0.0
    assert out["accuracy"] == 1.0 and out["mcc"] == pytest.approx(1.0)
    # every prediction wrong
    out_w = M.classification_metrics(p, 1 - y)
    assert math.isnan(out_w["auroc"]) and math.isnan(out_w["aupr_success"]) and out_w["aupr_error"] == 1.0
    assert out_w["aurc"] == 1.0 and out_w["eaurc"] == pytest.approx(0.0, abs=1e-15)
    # a single class in the labels -> MCC 0
    assert M.mcc(p, np.array([1, 1, 1])) == 0.0
    # N = 0
    with pytest.raises(ValueError, match="probs"):
        M.classification_metrics(np.zeros((0, 2)), np.zeros(0, dtype=np.int64))
    # NLL clamps a zero probability of the label at NLL_EPS
    assert M.nll(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(-math.log(M.NLL_EPS))


def test_validation_errors():
    y = np.array([0, 1])
    with pytest.raises(ValueError, match=r"probs.*\(N, C\).*\(2,\)"):
        M.accuracy(np.array([0.5, 0.5]), y)
    with pytest.raises(ValueError, match="probs.*sum to 1"):
        M.ece(np.array([[0.5, 0.4], [0.5, 0.5]]), y)
    with pytest.raises(ValueError, match=r"probs.*\[0, 1\]"):
        M.nll(np.array([[2.0, -1.0], [0.5, 0.5]]), y)
    with pytest.raises(ValueError, match="labels.*shape"):
        M.brier(np.full((2, 2), 0.5), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match=r"labels.*\[0, 2\)"):
        M.brier(np.full((2, 2), 0.5), np.array([0, 2]))
    with pytest.raises(ValueError, match="labels.*integer"):
        M.brier(np.full((2, 2), 0.5), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="n_bins"):
        M.ece(np.full((2, 2), 0.5), y, n_bins=0)


def test_average_samples_hand():
    # samples [0, 0] and [ln 3, 0]: softmaxes [.5, .5] and [.75, .25] -> mean [.625, .375];
    # mean logits [ln 3 / 2, 0] -> softmax [√3/(√3+1), 1/(√3+1)]
    z = np.array([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    np.testing.assert_allclose(M.average_samples(z), [[0.625, 0.375]], atol=1e-15)
    s3 = math.sqrt(3.0)
    np.testing.assert_allclose(M.average_samples(torch.from_numpy(z), average="logits"),
                               [[s3 / (s3 + 1), 1 / (s3 + 1)]], atol=1e-15)
    # large logits do not overflow
    big = M.average_samples(np.array([[[1000.0, 0.0], [0.0, 1000.0]]]))
    np.testing.assert_allclose(big, [[0.5, 0.5]], atol=1e-15)
    with pytest.raises(ValueError, match=r"sample_logits.*\(N, P, C\).*\(3, 2\)"):
        M.average_samples(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="average"):
        M.average_samples(z, average="median")


def test_ood_scores_hand():
    p = np.array([[0.5, 0.5], [1.0, 0.0]])
    np.testing.assert_allclose(M.ood_scores(p, "max_prob"), [0.5, 1.0])
    # −H: −ln 2 for the uniform row, 0 (0 log 0 = 0) for the one-hot row
    np.testing.assert_allclose(M.ood_scores(p, "entropy"), [-math.log(2.0), 0.0], atol=1e-15)
    # logsumexp([0, 0]) = ln 2, logsumexp([ln 3, 0]) = ln 4
    np.testing.assert_allclose(M.ood_scores(p, "energy", logits=np.array([[0.0, 0.0], [math.log(3), 0.0]])),
                               [math.log(2.0), math.log(4.0)], atol=1e-15)
    # samples [1, 0], [0, 1]: per-class variance 1/4 -> −1/4; identical samples -> 0
    sp = np.array([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]]])
    np.testing.assert_allclose(M.ood_scores(None, "mc_variance", sample_probs=sp), [-0.25, 0.0], atol=1e-15)
    with pytest.raises(ValueError, match="logits"):
        M.ood_scores(p, "energy")
    with pytest.raises(ValueError, match="sample_probs"):
        M.ood_scores(p, "mc_variance", sample_probs=np.zeros((3, 2, 2)))
    with pytest.raises(ValueError, match="kind"):
        M.ood_scores(p, "odin")


def test_ood_metrics_limits_and_sklearn():
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(5)
    s_in, s_out = rng.uniform(0.6, 1.0, 200), rng.uniform(0.0, 0.5, 150)
    out = M.ood_metrics(s_in, s_out)
    assert tuple(out) == M.OOD_KEYS
    assert out == {"ood_auroc": 1.0, "ood_aupr_in": 1.0, "ood_aupr_out": 1.0, "ood_fpr95": 0.0}
    # TPR exactly 0.95: in = 1..20, out = {0.5, 1.5}. At t = 2, 19/20 in-scores are accepted (TPR = .95,
    # reached) and no OOD score -> FPR95 = 0 (a strict "> .95" would go on to t = 1 and give 1/2)
    assert M.ood_metrics(np.arange(1.0, 21.0), np.array([0.5, 1.5]))["ood_fpr95"] == 0.0
    rev = M.ood_metrics(s_out, s_in)
    assert rev["ood_auroc"] == 0.0 and rev["ood_fpr95"] == 1.0
    # identical distributions: AUROC ≈ 1/2 (sd ≈ 0.007 at these sizes), FPR95 ≈ 0.95
    same = M.ood_metrics(rng.normal(size=3000), rng.normal(size=3000))
    assert abs(same["ood_auroc"] - 0.5) < 0.03 and abs(same["ood_fpr95"] - 0.95) < 0.03
    # overlapping with ties: cross-check sklearn and the brute-force FPR95
    a, b = np.round(rng.normal(1.0, 1.0, 300), 1), np.round(rng.normal(0.0, 1.0, 250), 1)
    out = M.ood_metrics(torch.from_numpy(a), b)
    y = np.r_[np.ones(300, bool), np.zeros(250, bool)]
    s = np.r_[a, b]
    assert out["ood_auroc"] == pytest.approx(sk.roc_auc_score(y, s), abs=1e-12)
    assert out["ood_aupr_in"] == pytest.approx(sk.average_precision_score(y, s), abs=1e-12)
    assert out["ood_aupr_out"] == pytest.approx(sk.average_precision_score(~y, -s), abs=1e-12)
    assert out["ood_fpr95"] == pytest.approx(_brute_fpr95(s, y), abs=1e-15)
    with pytest.raises(ValueError, match="scores_out"):
        M.ood_metrics(a, np.zeros(0))


def _nll_at(logits, labels, t):
    z = logits / t
    z = z - z.max(1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(labels)), labels]))


def test_temperature_scale_recovers_known_temperature():
    rng = np.random.default_rng(6)
    n, c, t0 = 4000, 5, 2.5
    true_logits = rng.normal(size=(n, c)) * 2.0
    pt = np.exp(true_logits - true_logits.max(1, keepdims=True))
    pt /= pt.sum(1, keepdims=True)
    labels = (rng.random(n)[:, None] > np.cumsum(pt, 1)).sum(1)  # categorical samples
    logits = true_logits * t0  # overconfident model: softmax(logits / t0) is the true distribution
    t_hat = M.temperature_scale(logits, labels)
    # MLE of T from N = 4000 examples: the standard error here is ~2%; tolerance 8%
    assert abs(t_hat - t0) / t0 < 0.08
    # it is the minimiser: not worse than a fine grid, and better than T = 1
    grid = np.exp(np.linspace(np.log(0.5), np.log(10.0), 400))
    assert _nll_at(logits, labels, t_hat) <= min(_nll_at(logits, labels, t) for t in grid) + 1e-9
    assert _nll_at(logits, labels, t_hat) < _nll_at(logits, labels, 1.0) - 0.1
    # Monte-Carlo logits: P identical samples give the same T (both averages), torch input accepted
    stacked = torch.from_numpy(np.repeat(logits[:, None, :], 3, axis=1))
    assert M.temperature_scale(stacked, torch.from_numpy(labels)) == pytest.approx(t_hat, rel=1e-4)
    assert M.temperature_scale(stacked, labels, average="logits") == pytest.approx(t_hat, rel=1e-4)
    with pytest.raises(ValueError, match="logits"):
        M.temperature_scale(np.zeros((0, 3)), np.zeros(0, dtype=np.int64))
