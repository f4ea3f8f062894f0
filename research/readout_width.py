"""How many random features the GP readout's own score needs, and the detectors' route without a GP.

For finished runs of a model whose body samples nothing (softmax attention; e.g. the CLINC150 frozen-trunk runs),
on data with an OOD validation split (``ood_val``): the pooled features of every split (one pass), then

- the readout's ``gp-variance`` (:func:`gpattn.experiments.readout.gp_variance_score`) at each R of ``--features``
  (``--orthogonal`` adds each R with orthogonal frequency draws), its ridge chosen on ``val`` against ``ood_val``
  as ``compare`` chooses it (one Gram per R: :func:`gpattn.experiments.readout._ridge_readouts`);
- the run's fitted detectors (the checkpoint's ``detectors``) and energy;
- energy + kNN and energy + Mahalanobis, each score standardised on ``val`` and weighted (1 − w, w), w from
  0, 0.05, …, 1 chosen by the ROC area on ``val`` against ``ood_val`` — the route a user could take without a GP.

It prints each score's OOD AUROC on ``test`` against ``ood`` (the test splits are read only here) per run, and the
paired difference of the readout's score at its default R (else the first R) against every other over the runs
(mean, 95 % t interval, runs better)::

    python research/readout_width.py runs/clinc-ro/runs/softmax/seed{0,1,2,3,4} --features 1024,2048,4096

Notes: research/notes/gp_readout.md, "How many features".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from scipy import special, stats
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpattn.experiments import readout as R  # noqa: E402
from gpattn.experiments.features import OOD_VALIDATION_SPLIT, score_features, split_features  # noqa: E402
from gpattn.experiments.training import load_run_with_data  # noqa: E402
from gpattn.variational.frequencies import OrthogonalFrequencies  # noqa: E402

SPLITS = ("val", OOD_VALIDATION_SPLIT, "test", "ood")
#: the weights of a two-score combination tried on validation
WEIGHTS = np.linspace(0.0, 1.0, 21)


def auroc(s_in: np.ndarray, s_out: np.ndarray) -> float:
    """ROC area of scores higher = more OOD, in-domain rows negative."""
    return float(roc_auc_score(np.r_[np.zeros(len(s_in)), np.ones(len(s_out))], np.r_[s_in, s_out]))


def load_run(folder):
    """(config, model, data bundle, checkpoint, linear head) of a finished run whose data has every split of
    ``SPLITS`` and ``train`` (an OOD validation split is needed)."""
    cfg, model, bundle, ckpt = load_run_with_data(folder)
    missing = [k for k in ("train", *SPLITS) if k not in bundle.splits]
    if missing:
        raise ValueError(f"{folder}: the run's data has no split {missing} (an OOD validation split is needed: e.g. "
                         f"digits with dataset_options ood_val_fraction, CLINC150 with ood_val)")
    return cfg, model, bundle, ckpt, R._linear_head(model)


def run_features(folder) -> tuple[torch.nn.Module, dict, dict]:
    """(head, {split: features (N, D)}, {split: {score: (N,)}}) of a run: its fitted detectors and energy."""
    _, model, bundle, ckpt, head = load_run(folder)
    feats = {k: split_features(model, bundle.splits[k]) for k in ("train", *SPLITS)}
    scores = {}
    for k in SPLITS:
        with torch.no_grad():
            logits = head(feats[k]).double().numpy()
        scores[k] = {"energy": -special.logsumexp(logits, axis=1)}
        scores[k].update({n: v.numpy() for n, v in score_features(ckpt.get("detectors") or {"states": {}},
                                                                   feats[k]).items()})
    return head, feats, scores


def readout_scores(head, feats: dict, num_features: int, orthogonal: bool) -> dict:
    """{split: v} of the readout at R = ``num_features``, its ridge chosen on val against ood_val."""

    def orthogonal_readout(h, seed, **options):
        readout = R._new_readout(h, seed, **options)
        draw = OrthogonalFrequencies()(1, readout.gp.num_features, readout.gp.in_features,
                                       generator=torch.Generator().manual_seed(seed))[0]
        readout.gp.feature_weight.copy_(draw / float(readout.lengthscale))
        return readout

    best = None
    readouts = R._ridge_readouts(head, feats["train"], R.RIDGE_GRID, 0, make=orthogonal_readout if orthogonal else None,
                                 num_features=num_features)
    for _, readout in readouts:
        v = {k: R.gp_variance_score(readout, feats[k][:, None, :]).numpy() for k in SPLITS}
        score = auroc(v["val"], v[OOD_VALIDATION_SPLIT])
        if best is None or score > best[0]:
            best = (score, v)
    return best[1]


def combined(scores: dict, a: str, b: str) -> dict:
    """{split: (1 − w) z_a + w z_b}, z standardised on val, w chosen on val against ood_val."""
    z = {k: {n: (scores[k][n] - scores["val"][n].mean()) / scores["val"][n].std() for n in (a, b)} for k in SPLITS}
    mix = {w: {k: (1 - w) * z[k][a] + w * z[k][b] for k in SPLITS} for w in WEIGHTS}
    w = max(WEIGHTS, key=lambda w: auroc(mix[w]["val"], mix[w][OOD_VALIDATION_SPLIT]))  # ties: the smaller w
    return mix[w]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (a body that samples nothing, data with ood_val)")
    parser.add_argument("--features", default="1024,4096", help="the readout's R, comma-separated")
    parser.add_argument("--orthogonal", action="store_true", help="each R with orthogonal draws too")
    args = parser.parse_args(argv)
    widths = [int(r) for r in args.features.split(",")]
    table = {}
    for folder in args.runs:
        head, feats, scores = run_features(folder)
        for width in widths:
            for orth in (False, True) if args.orthogonal else (False,):
                v = readout_scores(head, feats, width, orth)
                for k in SPLITS:
                    scores[k][f"gp-variance R={width}{' orth' if orth else ''}"] = v[k]
        for a, b in (("energy", "knn"), ("energy", "mahalanobis")):
            if b in scores["val"]:
                mix = combined(scores, a, b)
                for k in SPLITS:
                    scores[k][f"{a} + {b}"] = mix[k]
        table[folder] = {n: auroc(scores["test"][n], scores["ood"][n]) for n in scores["test"]}
        print(folder, " ".join(f"{n}: {a:.4f}" for n, a in table[folder].items()), flush=True)
    names = list(next(iter(table.values())))
    default = f"gp-variance R={R.NUM_FEATURES}"
    first = default if default in names else next(n for n in names if n.startswith("gp-variance"))
    ref = np.array([table[f][first] for f in table])
    print(f"\n{first} − each (OOD AUROC, test against ood; {len(table)} runs)")
    for name in names:
        other = np.array([table[f][name] for f in table])
        d = ref - other
        half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        print(f"| {name} | {other.mean():.4f} | {d.mean():+.4f} [{d.mean() - half:+.4f}, {d.mean() + half:+.4f}] "
              f"({int((d > 0).sum())}/{len(d)}) |")
    return table


if __name__ == "__main__":
    main()
