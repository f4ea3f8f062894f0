"""Uncertainty metrics beside :mod:`gpattn.experiments.metrics`: adaptive ECE, split-conformal
prediction sets, the "this GP is a temperature" diagnostic, and paired statistics over seeds.

Same conventions as :mod:`gpattn.experiments.metrics` (float64 numpy in, python floats out; ``probs`` (N, C),
``labels`` (N,), Monte-Carlo ``sample_logits`` (N, P, C)). OOD AUROC / AUPR / FPR95 by max-probability,
entropy, energy, MC variance and mutual information are :func:`gpattn.experiments.metrics.all_ood_scores` with
:func:`gpattn.experiments.metrics.ood_metrics`, already in every run's ``metrics.json``.

- :func:`adaptive_ece`: equal-mass ECE (Nixon et al. 2019): the examples sorted by confidence (stable sort)
  and cut into ``n_bins`` consecutive groups whose sizes differ by at most one (``numpy.array_split``);
  ECE = Σ_b (n_b / N) · abs(acc_b − conf_b).
- :func:`conformal_sets`: split conformal prediction (Vovk et al. 2005; Angelopoulos & Bates 2021) at level
  1 − α. Scores: ``"lac"`` s(x, y) = 1 − p̄_y (Sadinle et al. 2019); ``"aps"`` s(x, y) = Σ_k p̄_k 1[p̄_k ≥ p̄_y],
  the mass of every class at least as probable as y (Romano et al. 2020, without the randomisation). The
  threshold q̂ is the ⌈(n + 1)(1 − α)⌉-th smallest calibration score (+inf when that exceeds n), and the set
  of x is {k : s(x, k) ≤ q̂}; coverage ≥ 1 − α for exchangeable data.
- :func:`entropy_matched_auroc` / :func:`temperature_diagnostic`: the OOD AUROC of a score among inputs of
  matched predictive entropy. In-domain and OOD inputs are pooled and cut into ``n_bins`` equal-count bins of
  H(p̄) (as :func:`adaptive_ece`); within each bin holding both kinds the AUROC (OOD positive, higher score =
  more OOD, ties one half) is taken, and the bins' AUROCs are averaged weighted by their sizes. Under
  constant logit noise the mutual information and the logit variance are functions of the mean logits, so
  they rise with entropy but carry nothing beyond it: the matched AUROC is ≈ 0.5. A model whose noise grows
  away from the training data reads well above 0.5. :data:`TEMPERATURE_AUROC` is the flag's threshold.
- :func:`paired_difference`: mean of per-seed differences a − b, its 95 % Student-t interval and the number
  of seeds where a < b (lower is better) or a > b.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import special, stats

from gpattn.experiments import metrics as M

__all__ = [
    "CONFORMAL_ALPHA",
    "MATCHED_KEYS",
    "TEMPERATURE_AUROC",
    "adaptive_ece",
    "add_uncertainty_metrics",
    "conformal_sets",
    "entropy_matched_auroc",
    "evaluate_predictions",
    "is_temperature",
    "logit_variance",
    "paired_difference",
    "temperature_diagnostic",
    "temperature_flags",
    "temperature_seeds",
]

#: below this entropy-matched OOD AUROC (of both the logit variance and MI) a GP's variance reads as a temperature
TEMPERATURE_AUROC = 0.6
#: the metrics.json keys :func:`temperature_diagnostic` adds to an OOD split's row
MATCHED_KEYS = ("ood_matched_auroc_mutual_information", "ood_matched_auroc_logit_variance")


def _equal_count_bins(values: np.ndarray, n_bins: int) -> list[np.ndarray]:
    """Indices of ``values`` sorted ascending (stable) and cut into ``n_bins`` groups of sizes differing by ≤ 1."""
    order = np.argsort(values, kind="stable")
    return [b for b in np.array_split(order, min(n_bins, values.shape[0])) if b.size]


def adaptive_ece(probs, labels, n_bins: int = 15) -> float:
    """Equal-mass (adaptive) ECE of the top-label confidence (module docstring)."""
    p, y = M._probs_labels(probs, labels)
    n_bins = M._check_n_bins(n_bins)
    conf, hit = M._confidence_correct(p, y)
    return float(sum(b.size * abs(hit[b].mean() - conf[b].mean()) for b in _equal_count_bins(conf, n_bins)) / y.size)


def _scores_all(p: np.ndarray, score: str) -> np.ndarray:
    """s(x, k) for every class k, shape (N, C)."""
    if score == "lac":
        return 1.0 - p
    if score == "aps":
        # mass of the classes at least as probable as k: Σ_j p_j 1[p_j ≥ p_k], in row chunks of ≤ 2^22 entries
        step = max(1, (1 << 22) // max(1, p.shape[1] ** 2))
        chunks = np.split(p, range(step, len(p), step))
        return np.concatenate([np.sum(q[:, None, :] * (q[:, None, :] >= q[:, :, None]), axis=2) for q in chunks])
    raise ValueError(f"score must be 'lac' or 'aps', got {score!r}")


def conformal_sets(cal_probs, cal_labels, test_probs, test_labels, alpha: float = 0.1, score: str = "lac") -> dict:
    """Split conformal prediction sets at level 1 − ``alpha`` calibrated on (cal_probs, cal_labels):
    ``{"coverage", "set_size", "qhat"}`` on the test split (coverage = fraction whose label is in its set,
    set_size = mean number of classes per set)."""
    if not (isinstance(alpha, float) and 0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be a float in (0, 1), got {alpha!r}")
    pc, yc = M._probs_labels(cal_probs, cal_labels)
    pt, yt = M._probs_labels(test_probs, test_labels)
    if pc.shape[1] != pt.shape[1]:
        raise ValueError(f"calibration and test probs must have the same C, got {pc.shape[1]} and {pt.shape[1]}")
    cal = _scores_all(pc, score)[np.arange(yc.size), yc]  # shape: (n,)
    n = cal.size
    rank = math.ceil((n + 1) * (1.0 - alpha))
    qhat = float(np.sort(cal)[rank - 1]) if rank <= n else math.inf
    in_set = _scores_all(pt, score) <= qhat  # shape: (N, C)
    return {
        "coverage": float(in_set[np.arange(yt.size), yt].mean()),
        "set_size": float(in_set.sum(axis=1).mean()),
        "qhat": qhat,
    }


def logit_variance(sample_logits) -> np.ndarray:
    """(1/C) Σ_k Var_P[z_k] per input (N,): the spread of the Monte-Carlo logits (population variance)."""
    z = M._as_float64(sample_logits, "sample_logits")
    if z.ndim != 3:
        raise ValueError(f"sample_logits must have shape (N, P, C), got shape {tuple(z.shape)}")
    return np.var(z, axis=1).mean(axis=1)


def entropy_matched_auroc(score_in, score_out, entropy_in, entropy_out, n_bins: int = 10) -> float:
    """OOD AUROC of a score (higher = more OOD) within equal-count bins of predictive entropy, the bins'
    AUROCs weighted by their sizes (module docstring); NaN when no bin holds both kinds."""
    s = np.concatenate([M._as_float64(score_in, "score_in"), M._as_float64(score_out, "score_out")])
    h = np.concatenate([M._as_float64(entropy_in, "entropy_in"), M._as_float64(entropy_out, "entropy_out")])
    is_out = np.concatenate([np.zeros(len(score_in), bool), np.ones(len(score_out), bool)])
    if s.shape != h.shape or s.ndim != 1:
        raise ValueError("score_in/entropy_in and score_out/entropy_out must be (N,) arrays of equal lengths")
    total, weight = 0.0, 0
    for b in _equal_count_bins(h, M._check_n_bins(n_bins)):
        if 0 < is_out[b].sum() < b.size:
            total += b.size * M._auroc(s[b], is_out[b])
            weight += b.size
    return total / weight if weight else math.nan


def temperature_diagnostic(sample_logits_in, sample_logits_out, n_bins: int = 10, average: str = "probs") -> dict:
    """{:data:`MATCHED_KEYS`}: the entropy-matched OOD AUROC of the mutual information and of the logit
    variance of in-domain vs OOD Monte-Carlo logits (N, P, C). With one sample (P = 1), or samples that do not
    differ beyond round-off (a deterministic model repeated, :func:`gpattn.experiments.metrics.samples_differ`: no
    variance to judge), both are NaN."""
    out = {}
    z_in, z_out = (M._as_float64(z, "sample_logits") for z in (sample_logits_in, sample_logits_out))
    if not (M.samples_differ(z_in) or M.samples_differ(z_out)) or min(z_in.shape[1], z_out.shape[1]) < 2:
        return {k: math.nan for k in MATCHED_KEYS}
    p_in, p_out = M.average_samples(z_in, average), M.average_samples(z_out, average)
    h_in, h_out = (-np.sum(special.xlogy(p, p), axis=1) for p in (p_in, p_out))
    mi_in, mi_out = (M.predictive_entropy_split(special.softmax(z, axis=2))[2] for z in (z_in, z_out))
    out[MATCHED_KEYS[0]] = entropy_matched_auroc(mi_in, mi_out, h_in, h_out, n_bins)
    out[MATCHED_KEYS[1]] = entropy_matched_auroc(logit_variance(z_in), logit_variance(z_out), h_in, h_out, n_bins)
    return out


def is_temperature(row: dict) -> bool:
    """Whether a metrics.json OOD row says the variance adds nothing beyond entropy: both matched AUROCs
    present and below :data:`TEMPERATURE_AUROC`."""
    values = [row.get(k) for k in MATCHED_KEYS]
    return all(v is not None and math.isfinite(v) for v in values) and max(values) < TEMPERATURE_AUROC


def temperature_seeds(per_seed: dict, seeds) -> list:
    """The seeds whose metrics (``per_seed[str(seed)]``: split -> row) flag some OOD split by :func:`is_temperature`."""
    return [
        s for s in seeds
        if any(isinstance(row, dict) and is_temperature(row) for row in per_seed.get(str(s), {}).values())
    ]


def temperature_flags(per_seed: dict, seeds) -> list[str]:
    """compare's row flag for :func:`temperature_seeds`: ``["variance ≈ temperature: k/n seeds"]`` or ``[]``."""
    flagged = temperature_seeds(per_seed, seeds)
    return [f"variance ≈ temperature: {len(flagged)}/{len(seeds)} seeds"] if flagged else []


def paired_difference(a, b, confidence: float = 0.95) -> dict:
    """Paired comparison of one metric of models a and b over the same seeds (arrays (S,), S ≥ 2):
    ``{"mean", "low", "high", "n", "a_lower", "a_higher"}`` with mean = mean(a − b), [low, high] its
    Student-t interval at ``confidence`` (S − 1 degrees of freedom) and the counts of seeds where a < b / a > b."""
    x, y = M._as_float64(a, "a"), M._as_float64(b, "b")
    if x.ndim != 1 or x.shape != y.shape or x.size < 2:
        raise ValueError(f"a and b must be (S,) arrays of the same length S >= 2, got {x.shape} and {y.shape}")
    d = x - y
    mean = float(d.mean())
    half = float(stats.t.ppf(0.5 + confidence / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": int(d.size),
            "a_lower": int(np.sum(d < 0)), "a_higher": int(np.sum(d > 0))}


#: the conformal level of metrics.json (coverage and mean set size at 90 %)
CONFORMAL_ALPHA = 0.1


def add_uncertainty_metrics(result: dict, preds: dict, bundle, average: str = "probs", temperature: float = 1.0):
    """Add to the rows of :func:`gpattn.experiments.training.evaluate_predictions`'s ``result`` (in place, and
    returned): ``adaptive_ece`` on every labelled evaluation split; ``conformal_coverage_<score>`` and
    ``conformal_set_size_<score>`` (LAC, APS at 1 − :data:`CONFORMAL_ALPHA`) calibrated on ``preds["val"]``
    where it is present and labelled; and :data:`MATCHED_KEYS` on every OOD split (against ``in_domain``)."""

    def logits_of(key):
        return M._as_float64(preds[key]["logits"], "logits") / temperature

    cal = None
    if "val" in preds and len(preds["val"]["labels"]):
        y_val = np.asarray(preds["val"]["labels"])
        if np.all(y_val >= 0):
            cal = (M.average_samples(logits_of("val"), average), y_val)
    z_in = logits_of(bundle.eval_splits["in_domain"])
    for name, key in bundle.eval_splits.items():
        row = result[name]
        z = logits_of(key)
        labels = np.asarray(preds[key]["labels"])
        known = labels >= 0
        if known.any():
            probs = M.average_samples(z[known], average)
            row["adaptive_ece"] = adaptive_ece(probs, labels[known])
            for score in ("lac", "aps") if cal is not None else ():
                sets = conformal_sets(cal[0], cal[1], probs, labels[known], CONFORMAL_ALPHA, score)
                row[f"conformal_coverage_{score}"] = sets["coverage"]
                row[f"conformal_set_size_{score}"] = sets["set_size"]
        if name in bundle.ood_splits:
            row.update({k: (None if math.isnan(v) else float(v)) for k, v in temperature_diagnostic(z_in, z).items()})
            row.update(_matched_carried_scores(preds[bundle.eval_splits["in_domain"]], preds[key], z_in, z, average))
    return result


def _matched_carried_scores(pred_in: dict, pred_out: dict, z_in, z_out, average: str) -> dict:
    """``ood_matched_auroc_<suffix>``: the entropy-matched OOD AUROC (:func:`entropy_matched_auroc`) of every score a
    prediction carries beside its logits (:data:`gpattn.experiments.metrics.PREDICTION_SCORE_ENTRIES`: the feature
    detectors', the model's own), for those both splits have; None where no entropy bin holds both kinds."""
    out = {}
    h_in, h_out = None, None
    for entry in M.PREDICTION_SCORE_ENTRIES:
        have_in, have_out = pred_in.get(entry) or {}, pred_out.get(entry) or {}
        for name in sorted(set(have_in) & set(have_out)):
            if h_in is None:
                p_in, p_out = M.average_samples(z_in, average), M.average_samples(z_out, average)
                h_in, h_out = (-np.sum(special.xlogy(p, p), axis=1) for p in (p_in, p_out))
            matched = entropy_matched_auroc(have_in[name], have_out[name], h_in, h_out)
            out[f"ood_matched_auroc_{M.OOD_SCORE_NAMES[name]}"] = None if math.isnan(matched) else float(matched)
    return out


def _combined_nll(probs_in, labels_in, probs_ood, labels_ood) -> float | None:
    """:func:`gpattn.experiments.metrics.combined_nll` on the in-domain split's labelled rows and every row of an OOD
    split (a row without a label against the uniform label); None when the in-domain split has no labelled row."""
    known = np.asarray(labels_in) >= 0
    if not known.any():
        return None
    return M.combined_nll(np.asarray(probs_in)[known], np.asarray(labels_in)[known], probs_ood, np.asarray(labels_ood))


def evaluate_predictions(preds: dict, bundle, average: str = "probs", temperature: float = 1.0) -> dict:
    """metrics.json content from sample logits: classification metrics per evaluation split, on its
    labelled rows (``None`` where no row has a label; ``n`` / ``n_labelled`` / ``class_counts`` say
    which), and for OOD splits the OOD-detection metrics against ``in_domain`` under every score
    (max probability as ``ood_auroc`` ..., the others as ``ood_auroc_<score>`` ...): the scores of the logits and,
    where a split's prediction carries ``detector_scores`` (:func:`gpattn.experiments.features.detector_scores`) or
    ``own_scores`` (:data:`gpattn.experiments.metrics.OWN_SCORE_NAMES`), those; and ``cnll``, the in-domain and OOD
    rows' combined NLL (:func:`gpattn.experiments.metrics.combined_nll`: an OOD row without a label against the
    uniform label)."""
    def probs_of(name):
        logits = preds[bundle.eval_splits[name]]["logits"] / temperature
        return M.average_samples(logits, average=average), logits

    def scores_of(name):  # the logits' scores and the feature detectors' (a prediction's detector_scores)
        return M.prediction_ood_scores(preds[bundle.eval_splits[name]], average, temperature)

    names = bundle.info.get("class_names") or [str(k) for k in range(bundle.num_classes)]
    result = {}
    scores_in = scores_of("in_domain")
    for name, key in bundle.eval_splits.items():
        probs, logits = probs_of(name)
        labels = preds[key]["labels"]
        known = labels >= 0
        if bool(known.any()):
            row = M.classification_metrics(probs[known.numpy()], labels[known])
        else:
            row = {k: None for k in M.METRIC_KEYS}
        if name in bundle.ood_splits:
            row["cnll"] = _combined_nll(probs_of("in_domain")[0], preds[bundle.eval_splits["in_domain"]]["labels"],
                                        probs, labels)
            for score, values in scores_of(name).items():
                if score not in scores_in:  # a detector the in-domain split was not scored by
                    continue
                # a score the model does not have (a sample score of a model that does not sample) is None: "–"
                has = values is not None and scores_in[score] is not None
                detect = M.ood_metrics(scores_in[score], values) if has else dict.fromkeys(M.OOD_KEYS)
                row.update({M.ood_score_key(score, k): v for k, v in detect.items()})
        result[name] = {
            k: (None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)) for k, v in row.items()
        }
        counts = torch.bincount(labels[known], minlength=len(names)).tolist()
        result[name].update(
            n=len(labels), n_labelled=int(known.sum()), class_counts={c: k for c, k in zip(names, counts)}
        )
    return add_uncertainty_metrics(result, preds, bundle, average, temperature)
