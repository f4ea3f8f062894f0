"""Classification, calibration, failure-prediction and OOD-detection metrics (docs/derivations.md §10).

The definitions are the ones used in the papers' tables, not torchmetrics' (which bins left-closed, adds
an extra bin at confidence 1.0 and soft-maxes inputs outside [0, 1]). Every function accepts numpy
arrays or torch tensors, computes in float64 numpy and returns python floats (or float64 arrays for
the per-example / per-bin helpers). Values are fractions, never percent.

Inputs: ``probs`` is the predictive distribution p̄ of shape (N, C) (rows sum to 1 within 1e-4, entries
in [0, 1]; use :func:`average_samples` to get it from Monte-Carlo logits (N, P, C)); ``labels`` is an
integer array (N,) with values in [0, C). The prediction is ``argmax_k p̄_k`` (first index on ties) and
its confidence ``max_k p̄_k``.

Conventions, decided once here:

- NLL clamps p̄(y) at ``NLL_EPS = 1e-12`` before the log, so one impossible label costs 27.6 nats.
- ECE / MCE bins: ``n_bins`` equal-width, right-closed bins (lo, hi] with edges ``i / n_bins``; the
  first bin is [0, 1/n_bins] (it includes 0). A confidence exactly on an edge goes to the lower bin.
  ECE = Σ_b (n_b / N) ``|acc_b − conf_b|``, MCE = max over non-empty bins of ``|acc_b − conf_b|``.
  ``mode="classwise"`` bins every class probability p̄_k against the indicator 1[y = k] and averages the
  per-class ECE over classes (Kull et al. 2019; the "static calibration error"); its MCE is the max over
  classes and bins.
- AURC: sort by confidence, descending; the selective risk at coverage k/N is (errors among the k most
  confident) / k; AURC is its mean over k = 1..N. Tied confidences are not ordered arbitrarily: inside a
  tied group the error count is interpolated linearly, which is the expectation over every order of the
  group, so AURC never depends on the order of the data.
- E-AURC = AURC − AURC*, with AURC* the AURC of an oracle that ranks all e errors last, in closed form
  (1/N) Σ_{k=N−e+1}^{N} (k − N + e)/k = (1/N) [e − (N − e)(H_N − H_{N−e})] (H_n harmonic numbers),
  the exact discrete form of the usual r + (1 − r) log(1 − r) with r = e/N. A perfect ranking gives 0.
- Failure prediction: score = confidence, positive = correct prediction. ``auroc`` is the ROC area
  (ties count one half: the Mann–Whitney statistic), ``aupr_success`` the average precision
  Σ_n (R_n − R_{n−1}) P_n over the distinct score thresholds (scikit-learn's ``average_precision_score``
  convention), ``aupr_error`` the same with errors as positives and score −confidence.
  ``fpr95``: classify "positive" when score ≥ t; over the distinct scores t taken in decreasing order,
  the FPR at the first t whose TPR ≥ 0.95 (no interpolation between thresholds).
- Degenerate cases are defined, never a crash: a metric that needs both classes of its positive/negative
  split (AUROC and FPR95 when every prediction is correct or every one wrong; an AUPR with no positive)
  is ``float('nan')``; an AUPR whose examples are all positives is 1.0; MCC with a zero denominator (e.g.
  a single class in the labels or in the predictions) is 0.0, as scikit-learn defines it; N = 0 raises.
- OOD scores are oriented so that higher = more in-distribution; ``ood_metrics`` treats the
  in-distribution set as the positive class (AUPR-out scores the OOD set as positives with −score).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import optimize, special

from gpattn.experiments.detectors import DETECTORS

__all__ = [
    "CalibrationBins",
    "LOGIT_SCORE_NAMES",
    "METRIC_KEYS",
    "NLL_EPS",
    "OOD_KEYS",
    "OOD_SCORE_NAMES",
    "OWN_SCORE_NAMES",
    "PREDICTION_SCORE_ENTRIES",
    "SAME_SAMPLES",
    "SAMPLE_SCORES",
    "accuracy",
    "all_ood_scores",
    "aupr_error",
    "aupr_success",
    "aurc",
    "auroc",
    "average_samples",
    "brier",
    "calibration_bins",
    "classification_metrics",
    "combined_nll",
    "eaurc",
    "ece",
    "fpr95",
    "mcc",
    "mce",
    "nll",
    "ood_metrics",
    "ood_score_key",
    "ood_scores",
    "prediction_ood_scores",
    "predictive_entropy_split",
    "risk_coverage_curve",
    "samples_differ",
    "temperature_scale",
]

#: the metrics of every split in ``metrics.json``, in order
METRIC_KEYS = (
    "accuracy",
    "mcc",
    "nll",
    "brier",
    "ece",
    "mce",
    "aurc",
    "eaurc",
    "auroc",
    "aupr_success",
    "aupr_error",
    "fpr95",
)
#: the metrics an OOD split adds (in-domain vs that split, score = max probability)
OOD_KEYS = ("ood_auroc", "ood_aupr_in", "ood_aupr_out", "ood_fpr95")

#: probabilities are clipped below at this value before the log of the NLL
NLL_EPS = 1e-12
_ROW_SUM_TOL = 1e-4
_RANGE_TOL = 1e-6  # float32 round-off tolerated on [0, 1] before clipping
_TPR_LEVEL = 0.95


# ----------------------------------------------------------------------------------------------------
# input handling


def _as_float64(x, name: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor (torch is not imported here)
        x = x.detach().cpu().double().numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a numeric array or tensor, got {type(x).__name__}") from err
    return arr


def _check_probs(probs, name: str = "probs", allow_empty: bool = False) -> np.ndarray:
    p = _as_float64(probs, name)  # shape: (N, C)
    if p.ndim != 2 or p.shape[1] < 1:
        raise ValueError(f"{name} must have shape (N, C) with C >= 1, got shape {tuple(p.shape)}")
    if p.shape[0] == 0:
        if allow_empty:
            return p
        raise ValueError(f"{name} must hold at least one example (N >= 1), got shape {tuple(p.shape)}")
    if not np.all(np.isfinite(p)):
        raise ValueError(f"{name} must be finite, got NaN or inf")
    lo, hi = float(p.min()), float(p.max())
    if lo < -_RANGE_TOL or hi > 1.0 + _RANGE_TOL:
        raise ValueError(f"{name} must lie in [0, 1] (probabilities, not logits), got values in [{lo}, {hi}]")
    sums = p.sum(axis=1)
    worst = int(np.argmax(np.abs(sums - 1.0)))
    if abs(sums[worst] - 1.0) > _ROW_SUM_TOL:
        raise ValueError(
            f"rows of {name} must sum to 1 within {_ROW_SUM_TOL}, row {worst} of shape {tuple(p.shape)} "
            f"sums to {sums[worst]}"
        )
    return np.clip(p, 0.0, 1.0)


def _check_labels(labels, n: int, num_classes: int, name: str = "labels") -> np.ndarray:
    if hasattr(labels, "detach") and hasattr(labels, "cpu"):
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match probs, got shape {tuple(y.shape)}")
    if not (np.issubdtype(y.dtype, np.integer) and y.dtype != np.bool_):
        raise ValueError(f"{name} must be integer class indices, got dtype {y.dtype}")
    if n and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"{name} must lie in [0, {num_classes}), got values in [{y.min()}, {y.max()}]")
    return y.astype(np.int64)


def _probs_labels(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    p = _check_probs(probs)
    return p, _check_labels(labels, p.shape[0], p.shape[1])


def _confidence_correct(p: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pred = np.argmax(p, axis=1)  # shape: (N,)
    return p[np.arange(p.shape[0]), pred], (pred == y)


def _check_n_bins(n_bins) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return int(n_bins)


# ----------------------------------------------------------------------------------------------------
# Monte-Carlo averaging


def average_samples(sample_logits, average: str = "probs") -> np.ndarray:
    """Predictive probabilities from Monte-Carlo logits.

    ``sample_logits``: (N, P, C). ``average="probs"`` (default, docs/derivations.md §9): mean over P of the softmax;
    ``average="logits"``: softmax of the mean logits. Returns a float64 array (N, C).
    """
    z = _as_float64(sample_logits, "sample_logits")  # shape: (N, P, C)
    if z.ndim != 3 or z.shape[1] < 1 or z.shape[2] < 1:
        raise ValueError(f"sample_logits must have shape (N, P, C) with P, C >= 1, got shape {tuple(z.shape)}")
    if average == "probs":
        return special.softmax(z, axis=2).mean(axis=1)  # shape: (N, C)
    if average == "logits":
        return special.softmax(z.mean(axis=1), axis=1)  # shape: (N, C)
    raise ValueError(f"average must be 'probs' or 'logits', got {average!r}")


# ----------------------------------------------------------------------------------------------------
# accuracy, MCC, proper scores


def accuracy(probs, labels) -> float:
    """Fraction of examples whose argmax prediction equals the label."""
    p, y = _probs_labels(probs, labels)
    return float(np.mean(np.argmax(p, axis=1) == y))


def mcc(probs, labels) -> float:
    """Global Matthews correlation coefficient of the argmax predictions (multiclass R_K of Gorodkin 2004).

    With the confusion counts, c = correct, s = N, t_k = true class counts, p_k = predicted counts:
    (c·s − Σ_k p_k t_k) / sqrt((s² − Σ_k p_k²)(s² − Σ_k t_k²)); 0.0 when the denominator is 0.
    """
    p, y = _probs_labels(probs, labels)
    num_classes = p.shape[1]
    pred = np.argmax(p, axis=1)
    t = np.bincount(y, minlength=num_classes).astype(np.float64)  # shape: (C,)
    q = np.bincount(pred, minlength=num_classes).astype(np.float64)  # shape: (C,)
    s = float(y.shape[0])
    c = float(np.sum(pred == y))
    den = (s * s - q @ q) * (s * s - t @ t)
    if den <= 0.0:
        return 0.0
    return float((c * s - q @ t) / np.sqrt(den))


def nll(probs, labels) -> float:
    """Mean negative log predictive probability of the label, −log max(p̄(y), NLL_EPS)."""
    return _nll(*_probs_labels(probs, labels))


def _nll(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(np.log(np.maximum(p[np.arange(y.shape[0]), y], NLL_EPS))))


def combined_nll(probs_in, labels_in, probs_ood, labels_ood=None) -> float:
    """gpattn's combined in-domain + OOD NLL ("cNLL (OOD rows: uniform label)"): the mean over the in-domain rows'
    −log p̄(y) and the OOD rows' cross-entropy to the uniform label, −(1/C) Σ_c log p̄_c(x) (Outlier Exposure's
    target: a model with C outputs and no "out-of-scope" class is right on an OOD input when it spreads its mass),
    every row weighted equally; an OOD row whose label is known (``labels_ood`` ≥ 0, e.g. CoLA's out-of-domain
    sentences) is scored against that label, as an in-domain row. p̄ is clamped at :data:`NLL_EPS` as in
    :func:`nll`. Not uncertainty-baselines' cNLL, which scores CLINC150's out-of-scope rows as a 151st class
    (docs/uncertainty.md).  # shape: (N, C), (N,), (M, C), (M,) or None -> float"""
    p_in, y_in = _probs_labels(probs_in, labels_in)
    p_out = _check_probs(probs_ood, "probs_ood", allow_empty=True)
    if p_out.shape[1] != p_in.shape[1]:
        raise ValueError(f"probs_in and probs_ood must have the same C, got {p_in.shape[1]} and {p_out.shape[1]}")
    y_out = np.full(p_out.shape[0], -1) if labels_ood is None else np.asarray(labels_ood)
    if y_out.shape != (p_out.shape[0],) or not np.issubdtype(y_out.dtype, np.integer) or np.any(y_out >= p_in.shape[1]):
        raise ValueError(f"labels_ood must be None or integers < C = {p_in.shape[1]} of shape ({p_out.shape[0]},) "
                         f"(< 0: unknown, scored against the uniform label), got {y_out.dtype} {tuple(y_out.shape)}")
    log_in = np.log(np.maximum(p_in[np.arange(y_in.shape[0]), y_in], NLL_EPS))
    log_out = np.log(np.maximum(p_out, NLL_EPS))  # shape: (M, C)
    known = y_out >= 0
    uniform = np.where(known, log_out[np.arange(y_out.shape[0]), np.where(known, y_out, 0)], log_out.mean(axis=1))
    return float(-np.mean(np.concatenate([log_in, uniform])))


def brier(probs, labels) -> float:
    """Mean over examples of Σ_k (p̄_k − 1[y = k])² (ranges over [0, 2])."""
    return _brier(*_probs_labels(probs, labels))


def _brier(p: np.ndarray, y: np.ndarray) -> float:
    onehot = np.zeros_like(p)
    onehot[np.arange(y.shape[0]), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


# ----------------------------------------------------------------------------------------------------
# calibration


class CalibrationBins(NamedTuple):
    """Per-bin statistics of a reliability diagram (arrays of length n_bins, float64).

    ``edges`` (n_bins + 1,) with bin b = (edges[b], edges[b+1]] (bin 0 also holds 0); ``counts`` examples
    per bin; ``confidence`` and ``accuracy`` their means (0 in empty bins).
    """

    edges: np.ndarray
    counts: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray


def _bin_index(conf: np.ndarray, n_bins: int) -> np.ndarray:
    edges = np.arange(n_bins + 1, dtype=np.float64) / n_bins
    # side="left": the index i with edges[i-1] < conf <= edges[i], i.e. right-closed bins; 0 -> bin 0.
    return np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)


def _bins(conf: np.ndarray, hit: np.ndarray, n_bins: int) -> CalibrationBins:
    edges = np.arange(n_bins + 1, dtype=np.float64) / n_bins
    idx = _bin_index(conf, n_bins)
    counts = np.bincount(idx, minlength=n_bins).astype(np.float64)
    safe = np.maximum(counts, 1.0)
    mean_conf = np.bincount(idx, weights=conf, minlength=n_bins) / safe
    mean_acc = np.bincount(idx, weights=hit.astype(np.float64), minlength=n_bins) / safe
    return CalibrationBins(edges, counts, mean_conf, mean_acc)


def calibration_bins(probs, labels, n_bins: int = 15) -> CalibrationBins:
    """Top-label reliability bins (the binning behind :func:`ece`, :func:`mce` and the plots)."""
    n_bins = _check_n_bins(n_bins)
    p, y = _probs_labels(probs, labels)
    conf, correct = _confidence_correct(p, y)
    return _bins(conf, correct, n_bins)


def _calibration_gaps(probs, labels, n_bins, mode) -> list[CalibrationBins]:
    n_bins = _check_n_bins(n_bins)
    p, y = _probs_labels(probs, labels)
    if mode == "top":
        conf, correct = _confidence_correct(p, y)
        return [_bins(conf, correct, n_bins)]
    if mode == "classwise":
        return [_bins(p[:, k], y == k, n_bins) for k in range(p.shape[1])]
    raise ValueError(f"mode must be 'top' or 'classwise', got {mode!r}")


def _ece_of(b: CalibrationBins) -> float:
    return float(np.sum(b.counts * np.abs(b.accuracy - b.confidence)) / np.sum(b.counts))


def _mce_of(b: CalibrationBins) -> float:
    return float(np.max(np.abs(b.accuracy - b.confidence)[b.counts > 0]))


def ece(probs, labels, n_bins: int = 15, mode: str = "top") -> float:
    """Expected calibration error: Σ_b (n_b/N) ``|acc_b − conf_b|`` over right-closed equal-width bins.

    ``mode="classwise"`` averages the per-class ECE over classes (see the module docstring).
    """
    return float(np.mean([_ece_of(b) for b in _calibration_gaps(probs, labels, n_bins, mode)]))


def mce(probs, labels, n_bins: int = 15, mode: str = "top") -> float:
    """Maximum calibration error: max over non-empty bins (and classes, if classwise) of ``|acc_b − conf_b|``."""
    return float(max(_mce_of(b) for b in _calibration_gaps(probs, labels, n_bins, mode)))


# ----------------------------------------------------------------------------------------------------
# selective prediction


def _risk_coverage(conf: np.ndarray, error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = conf.shape[0]
    order = np.argsort(-conf, kind="stable")
    c_sorted = conf[order]
    cum_err = np.cumsum(error[order].astype(np.float64))  # shape: (N,)
    # Tied confidences: the error count inside a tied group is the linear interpolation between the
    # group boundaries (its expectation over all orders of the group).
    last_of_group = np.append(c_sorted[1:] != c_sorted[:-1], True)
    knots_k = np.concatenate([[0.0], np.flatnonzero(last_of_group) + 1.0])
    knots_e = np.concatenate([[0.0], cum_err[last_of_group]])
    k = np.arange(1, n + 1, dtype=np.float64)
    return k / n, np.interp(k, knots_k, knots_e) / k


def risk_coverage_curve(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """Coverage k/N (k = 1..N) and selective risk (errors among the k most confident) / k, each (N,)."""
    p, y = _probs_labels(probs, labels)
    conf, correct = _confidence_correct(p, y)
    return _risk_coverage(conf, ~correct)


def aurc(probs, labels) -> float:
    """Area under the risk–coverage curve: mean selective risk over coverages k/N (a fraction)."""
    _, risk = risk_coverage_curve(probs, labels)
    return float(np.mean(risk))


def _oracle_aurc(n: int, n_err: int) -> float:
    if n_err == 0:
        return 0.0
    k = np.arange(n - n_err + 1, n + 1, dtype=np.float64)
    return float(np.sum((k - (n - n_err)) / k) / n)


def eaurc(probs, labels) -> float:
    """Excess AURC: AURC minus the AURC of an oracle that ranks every error last (0 for a perfect ranking)."""
    p, y = _probs_labels(probs, labels)
    conf, correct = _confidence_correct(p, y)
    _, risk = _risk_coverage(conf, ~correct)
    return float(np.mean(risk) - _oracle_aurc(y.shape[0], int(np.sum(~correct))))


# ----------------------------------------------------------------------------------------------------
# binary ranking metrics (shared by failure prediction and OOD detection)


def _roc_points(score: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative true / false positives at each distinct threshold, thresholds decreasing."""
    order = np.argsort(-score, kind="stable")
    s = score[order]
    pos = positive[order].astype(np.float64)
    last = np.append(s[1:] != s[:-1], True)
    return np.cumsum(pos)[last], np.cumsum(1.0 - pos)[last]


def _auroc(score, positive) -> float:
    tp, fp = _roc_points(score, positive)
    if tp[-1] == 0 or fp[-1] == 0:
        return float("nan")
    tpr = np.concatenate([[0.0], tp / tp[-1]])
    fpr = np.concatenate([[0.0], fp / fp[-1]])
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2.0))


def _average_precision(score, positive) -> float:
    tp, fp = _roc_points(score, positive)
    if tp[-1] == 0:
        return float("nan")
    recall = np.concatenate([[0.0], tp / tp[-1]])
    precision = tp / (tp + fp)
    return float(np.sum(np.diff(recall) * precision))


def _fpr_at_tpr(score, positive, level: float = _TPR_LEVEL) -> float:
    tp, fp = _roc_points(score, positive)
    if tp[-1] == 0 or fp[-1] == 0:
        return float("nan")
    first = int(np.argmax(tp / tp[-1] >= level))  # TPR reaches 1 at the last threshold, so one exists
    return float(fp[first] / fp[-1])


def _failure_inputs(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    p, y = _probs_labels(probs, labels)
    return _confidence_correct(p, y)


def auroc(probs, labels) -> float:
    """Failure-prediction AUROC: confidence separating correct (positive) from wrong predictions; NaN if
    all predictions are correct or all wrong."""
    conf, correct = _failure_inputs(probs, labels)
    return _auroc(conf, correct)


def aupr_success(probs, labels) -> float:
    """Average precision of confidence with correct predictions as positives (NaN if none is correct)."""
    conf, correct = _failure_inputs(probs, labels)
    return _average_precision(conf, correct)


def aupr_error(probs, labels) -> float:
    """Average precision of −confidence with wrong predictions as positives (NaN if none is wrong)."""
    conf, correct = _failure_inputs(probs, labels)
    return _average_precision(-conf, ~correct)


def fpr95(probs, labels) -> float:
    """FPR (wrong predictions accepted) at the first confidence threshold, taken in decreasing order,
    where the TPR (correct predictions accepted, score ≥ threshold) reaches 0.95; NaN if degenerate."""
    conf, correct = _failure_inputs(probs, labels)
    return _fpr_at_tpr(conf, correct)


def classification_metrics(probs, labels, n_bins: int = 15) -> dict[str, float]:
    """Every in-distribution metric of metrics.json (keys :data:`METRIC_KEYS`, in that order)."""
    n_bins = _check_n_bins(n_bins)
    p, y = _probs_labels(probs, labels)
    conf, correct = _confidence_correct(p, y)
    top = _bins(conf, correct, n_bins)
    _, risk = _risk_coverage(conf, ~correct)
    out = {
        "accuracy": float(np.mean(correct)),
        "mcc": mcc(p, y),
        "nll": _nll(p, y),
        "brier": _brier(p, y),
        "ece": _ece_of(top),
        "mce": _mce_of(top),
        "aurc": float(np.mean(risk)),
        "eaurc": float(np.mean(risk) - _oracle_aurc(y.shape[0], int(np.sum(~correct)))),
        "auroc": _auroc(conf, correct),
        "aupr_success": _average_precision(conf, correct),
        "aupr_error": _average_precision(-conf, ~correct),
        "fpr95": _fpr_at_tpr(conf, correct),
    }
    return {k: out[k] for k in METRIC_KEYS}


# ----------------------------------------------------------------------------------------------------
# out-of-distribution detection


def ood_scores(probs, kind: str = "max_prob", logits=None, sample_probs=None) -> np.ndarray:
    """Per-example OOD scores (N,), higher = more in-distribution.

    - ``"max_prob"``: max_k p̄_k (needs ``probs`` (N, C));
    - ``"entropy"``: −H(p̄) = Σ_k p̄_k log p̄_k with 0 log 0 = 0 (needs ``probs``);
    - ``"energy"``: −E(x) = logsumexp_k z_k (needs ``logits`` (N, C), e.g. mean logits over samples);
    - ``"mc_variance"``: −(1/C) Σ_k Var_P[p_k] with the population variance (ddof 0) across the P
      samples (needs ``sample_probs`` (N, P, C), the per-sample softmax outputs).
    - ``"mutual_information"``: −MI = −(H(p̄) − (1/P) Σ_s H(p_s)), the epistemic part of the predictive
      entropy (BALD; needs ``sample_probs``; p̄ is their mean).

    ``probs`` may be None for the last three.
    """
    if kind in ("max_prob", "entropy"):
        p = _check_probs(probs, allow_empty=True)  # shape: (N, C)
        if kind == "max_prob":
            return p.max(axis=1)
        return np.sum(special.xlogy(p, p), axis=1)
    if kind not in ("energy", "mc_variance", "mutual_information"):
        raise ValueError(
            f"kind must be one of 'max_prob', 'entropy', 'energy', 'mc_variance', 'mutual_information', got {kind!r}"
        )
    n = None if probs is None else _check_probs(probs, allow_empty=True).shape[0]
    if kind == "energy":
        if logits is None:
            raise ValueError("ood_scores(kind='energy') needs logits of shape (N, C), got None")
        z = _as_float64(logits, "logits")  # shape: (N, C)
        if z.ndim != 2 or (n is not None and z.shape[0] != n):
            raise ValueError(f"logits must have shape (N, C) with N = {n}, got shape {tuple(z.shape)}")
        return special.logsumexp(z, axis=1)
    if sample_probs is None:
        raise ValueError(f"ood_scores(kind={kind!r}) needs sample_probs of shape (N, P, C), got None")
    sp = _as_float64(sample_probs, "sample_probs")  # shape: (N, P, C)
    if sp.ndim != 3 or (n is not None and sp.shape[0] != n):
        raise ValueError(f"sample_probs must have shape (N, P, C) with N = {n}, got shape {tuple(sp.shape)}")
    if kind == "mutual_information":
        return -predictive_entropy_split(sp)[2]
    return -np.mean(np.var(sp, axis=1), axis=1)


def predictive_entropy_split(sample_probs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total, aleatoric, epistemic) uncertainty in nats of per-sample probabilities (N, P, C): the
    entropy of the mean H(p̄), the expected entropy (1/P) Σ_s H(p_s), and their difference, the mutual
    information between the prediction and the model (≥ 0 up to round-off, clamped at 0)."""
    sp = _as_float64(sample_probs, "sample_probs")  # shape: (N, P, C)
    if sp.ndim != 3:
        raise ValueError(f"sample_probs must have shape (N, P, C), got shape {tuple(sp.shape)}")
    mean = sp.mean(axis=1)  # shape: (N, C)
    total = -np.sum(special.xlogy(mean, mean), axis=1)
    expected = -np.sum(special.xlogy(sp, sp), axis=2).mean(axis=1)
    return total, expected, np.maximum(total - expected, 0.0)


#: the scores of the logits by their CLI names -> :func:`ood_scores` kinds
LOGIT_SCORE_NAMES = {
    "msp": "max_prob",
    "entropy": "entropy",
    "energy": "energy",
    "mc-variance": "mc_variance",
    "mutual-information": "mutual_information",
}
#: the model's own scores beside its logits, by their CLI names -> metrics.json suffixes: scores a model computes of
#: itself (higher = more out-of-distribution, as the detectors') and carries in its prediction's ``own_scores``;
#: ``gp-variance`` is the GP readout's posterior variance v(h) (:data:`gpattn.experiments.readout.OWN_SCORES`,
#: ``+gpreadout`` runs). A model without the score shows "–".
OWN_SCORE_NAMES = {"gp-variance": "gp_variance"}
#: OOD scores by their CLI names (``--ood-score``) -> their metrics.json suffixes: the scores of the logits
#: (:data:`LOGIT_SCORE_NAMES`), the feature detectors (:data:`gpattn.experiments.detectors.DETECTORS`, fitted on
#: the training split, their scores in a prediction's ``detector_scores``) and the model's own scores
#: (:data:`OWN_SCORE_NAMES`, in its ``own_scores``); metrics.json keeps the max-probability
#: (msp) results under ``ood_auroc`` ..., the others as ``ood_auroc_<suffix>`` ...
OOD_SCORE_NAMES = {
    **LOGIT_SCORE_NAMES, **{name: name.replace("-", "_") for name in DETECTORS}, **OWN_SCORE_NAMES,
}

#: the entries of a split's prediction that carry per-example scores, higher = more OOD (not read from the logits):
#: the feature detectors' (:func:`gpattn.experiments.features.detector_scores`) and the model's own
#: (:data:`OWN_SCORE_NAMES`)
PREDICTION_SCORE_ENTRIES = ("detector_scores", "own_scores")


def ood_score_key(name: str, key: str) -> str:
    """The metrics.json key of OOD metric ``key`` (e.g. "ood_auroc") under score ``name`` (CLI name)."""
    if name not in OOD_SCORE_NAMES:
        raise ValueError(f"OOD score must be one of {', '.join(OOD_SCORE_NAMES)}, got {name!r}")
    return key if name == "msp" else f"{key}_{OOD_SCORE_NAMES[name]}"


#: the scores that read the spread of the Monte-Carlo samples: a model whose samples do not differ has none
SAMPLE_SCORES = ("mc-variance", "mutual-information")
#: samples whose logits differ by at most this fraction of the largest logit are one prediction (float32 round-off)
SAME_SAMPLES = 1e-5


def samples_differ(sample_logits) -> bool:
    """Whether the Monte-Carlo samples (N, P, C) are more than one prediction: P > 1 and some logit's spread over the
    samples above :data:`SAME_SAMPLES` of the largest logit (a deterministic model's copies differ by round-off)."""
    z = _as_float64(sample_logits, "sample_logits")
    if z.ndim != 3 or z.shape[1] < 2:
        return False
    return bool(np.ptp(z, axis=1).max() > SAME_SAMPLES * max(1.0, float(np.abs(z).max())))


def all_ood_scores(sample_logits, average: str = "probs") -> dict[str, np.ndarray | None]:
    """Every OOD score (CLI name -> (N,), higher = more in-distribution) of sample logits (N, P, C);
    msp and entropy use the predictive probabilities of :func:`average_samples` with ``average``. The sample scores
    (:data:`SAMPLE_SCORES`) are ``None`` for samples that do not differ (:func:`samples_differ`): a model that does
    not sample has no such score, and its round-off is not one."""
    z = _as_float64(sample_logits, "sample_logits")  # shape: (N, P, C)
    sp = special.softmax(z, axis=2)
    p = average_samples(z, average)
    sampled = samples_differ(z)
    return {
        name: (ood_scores(p, kind, logits=z.mean(axis=1), sample_probs=sp)
               if sampled or name not in SAMPLE_SCORES else None)
        for name, kind in LOGIT_SCORE_NAMES.items()
    }  # fmt: skip


def prediction_ood_scores(prediction: dict, average: str = "probs", temperature: float = 1.0) -> dict[str, np.ndarray]:
    """Every OOD score of one split's prediction (``{"logits": (N, P, C), "detector_scores": {name: (N,)},
    "own_scores": {name: (N,)}}``, the last two optional), higher = more in-distribution: :func:`all_ood_scores` of
    the logits divided by ``temperature``, and each feature detector's and own score (:data:`OWN_SCORE_NAMES`)
    negated (they score higher = more OOD)."""
    out = all_ood_scores(prediction["logits"] / temperature, average)
    for entry in PREDICTION_SCORE_ENTRIES:
        for name, values in (prediction.get(entry) or {}).items():
            out[name] = -_as_float64(values, f"{entry}[{name!r}]")
    return out



def ood_metrics(scores_in, scores_out) -> dict[str, float]:
    """OOD detection with in-distribution as the positive class (keys :data:`OOD_KEYS`).

    ``ood_auroc`` ROC area, ``ood_aupr_in`` average precision of the scores with in-distribution
    positives, ``ood_aupr_out`` of −scores with OOD positives, ``ood_fpr95`` the fraction of OOD examples
    scored ≥ the first threshold (decreasing) at which 95% of the in-distribution examples are.
    """
    s_in = _as_float64(scores_in, "scores_in")
    s_out = _as_float64(scores_out, "scores_out")
    for name, s in (("scores_in", s_in), ("scores_out", s_out)):
        if s.ndim != 1 or s.shape[0] == 0:
            raise ValueError(f"{name} must have shape (N,) with N >= 1, got shape {tuple(s.shape)}")
        if not np.all(np.isfinite(s)):
            raise ValueError(f"{name} must be finite, got NaN or inf")
    score = np.concatenate([s_in, s_out])
    is_in = np.concatenate([np.ones(s_in.shape[0], bool), np.zeros(s_out.shape[0], bool)])
    return {
        "ood_auroc": _auroc(score, is_in),
        "ood_aupr_in": _average_precision(score, is_in),
        "ood_aupr_out": _average_precision(-score, ~is_in),
        "ood_fpr95": _fpr_at_tpr(score, is_in),
    }


# ----------------------------------------------------------------------------------------------------
# post-hoc calibration

_LOG_T_BOUNDS = (np.log(1e-2), np.log(1e2))


def temperature_scale(logits, labels, max_iter: int = 200, average: str = "probs") -> float:
    """Temperature T > 0 minimising the NLL of softmax(logits / T) (Guo et al. 2017).

    ``logits`` (N, C) or Monte-Carlo (N, P, C); with samples every sample is divided by T and the
    predictive is :func:`average_samples` (``average``). Bounded Brent search on log T over
    [log 0.01, log 100] with at most ``max_iter`` evaluations (xatol 1e-6 on log T); a result on a
    bound means the optimum lies outside. Returns a python float.
    """
    z = _as_float64(logits, "logits")
    if z.ndim == 2:
        z = z[:, None, :]  # shape: (N, 1, C)
    if z.ndim != 3 or z.shape[0] == 0 or z.shape[2] < 1:
        raise ValueError(f"logits must have shape (N, C) or (N, P, C) with N >= 1, got shape {tuple(z.shape)}")
    if not np.all(np.isfinite(z)):
        raise ValueError("logits must be finite, got NaN or inf")
    if average not in ("probs", "logits"):
        raise ValueError(f"average must be 'probs' or 'logits', got {average!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
    y = _check_labels(labels, z.shape[0], z.shape[2])
    rows = np.arange(z.shape[0])
    if average == "logits":
        z = z.mean(axis=1, keepdims=True)  # shape: (N, 1, C): softmax(mean z / T) = softmax(mean(z / T))

    def objective(log_t: float) -> float:
        # log p̄(y) = logsumexp_P(log_softmax(z/T)_y) − log P: the probs average in the log domain.
        logp = special.log_softmax(z / np.exp(log_t), axis=2)[rows, :, y]  # shape: (N, P)
        return float(-np.mean(special.logsumexp(logp, axis=1) - np.log(z.shape[1])))

    res = optimize.minimize_scalar(
        objective, bounds=_LOG_T_BOUNDS, method="bounded", options={"maxiter": int(max_iter), "xatol": 1e-6}
    )
    return float(np.exp(res.x))
