"""Does choosing the GP readout's lengthscale on validation lift its own OOD score?

The readout's ``gp-variance`` (:func:`gpattn.experiments.readout.gp_variance_score`) has ℓ fixed by the median
heuristic and its ridge s chosen on ``val`` against ``ood_val`` (:func:`gpattn.experiments.readout.choose_score_ridge`).
For finished runs on data with an OOD validation split, as ``compare``'s ``+gpreadout`` reads them (training
features of one pass, ``num_samples=1``; every other split at the run's P samples, the readout's draws from the run's
seed), this probe chooses (ℓ, s) together on ``val`` against ``ood_val``: ℓ = m · median for m of ``--multiples``,
each m by ``choose_score_ridge`` with that fixed ℓ (m = 1 is the library's median readout itself; a tie keeps the
median, then the earlier s). It prints per run the median ℓ, the chosen (m, s), the validation and the test-against-
``ood`` AUROC at the median-ℓ choice and at the (ℓ, s) choice (the test splits are read only for these numbers), and
the paired differences over the runs (mean, 95 % t interval, runs better) of the chosen-ℓ score against the median-ℓ
score and against the detectors (Mahalanobis, relative Mahalanobis, kNN) of ``--detectors`` runs (same order as the
runs; default the runs themselves)::

    python research/readout_lengthscale.py runs/digits/runs/kep-svgp/seed{0,1,2,3,4} --features 1024 \\
        --detectors runs/digits/runs/softmax/seed{0,1,2,3,4}

``--out`` keeps an invocation's rows and ``--rows`` joins them to the paired table (a slow run set one run per
invocation: ``--rows seed0.json seed1.json ...`` with no run folder prints the table alone).

Notes: research/notes/gp_readout.md, "The lengthscale on validation".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from readout_width import SPLITS, auroc, load_run  # noqa: E402

from gpattn.experiments import readout as R  # noqa: E402
from gpattn.experiments.features import OOD_VALIDATION_SPLIT, detector_scores  # noqa: E402
from gpattn.experiments.laplace import extract_features  # noqa: E402

#: the lengthscale's candidates, multiples of the median heuristic's ℓ (1 first: a tie keeps the median)
MULTIPLES = (1.0, 0.25, 0.5, 2.0, 4.0)
#: the detectors each readout score is paired against
DETECTORS = ("mahalanobis", "relative-mahalanobis", "knn")


def run_inputs(folder):
    """(config, linear head, training features (N, D), {split: head inputs (N, P, D)}, detectors' scores) of a run, as
    ``compare``'s ``+gpreadout`` reads them."""
    cfg, model, bundle, ckpt, head = load_run(folder)
    torch.manual_seed(cfg.seed)  # a sampling body's draws: the probe repeats itself (compare's own draws differ)
    h_train = extract_features(model, bundle.splits["train"], cfg.eval_batch_size)
    parts = {k: R.readout_split(model, bundle.splits[k], cfg.num_samples, cfg.eval_batch_size)[1] for k in SPLITS}
    detectors = ckpt.get("detectors") or {"states": {}, "num_samples": 1}
    scores = {k: {n: v.numpy() for n, v in detector_scores(model, bundle.splits[k], detectors,
                                                            cfg.eval_batch_size).items()}
              for k in ("test", "ood")}
    return cfg, head, h_train, parts, scores


def choose_lengthscale(head, h_train, parts, seed: int, num_features: int, multiples=MULTIPLES) -> dict:
    """The score's readout at the median ℓ (``choose_score_ridge`` as the library runs it) and at (m, s) chosen
    on val against ood_val over ``multiples`` × the ridge grid; their test-against-ood AUROC."""
    val, ood_val = parts["val"], parts[OOD_VALIDATION_SPLIT]
    if multiples[0] != 1.0:
        raise ValueError(f"multiples must start with 1 (the median, kept on a tie), got {multiples}")
    median, aurocs = R.choose_score_ridge(head, h_train, val, ood_val, seed=seed, num_features=num_features)
    ell = float(median.lengthscale)
    table = {1.0: aurocs}
    chosen = (max(aurocs.values()), 1.0, median)
    for m in multiples[1:]:
        readout, table[m] = R.choose_score_ridge(head, h_train, val, ood_val, seed=seed, num_features=num_features,
                                                 lengthscale=m * ell)
        if max(table[m].values()) > chosen[0]:
            chosen = (max(table[m].values()), m, readout)
        del readout

    def test_auroc(readout):
        v = [R.gp_variance_score(readout, parts[k]).numpy() for k in ("test", "ood")]
        return auroc(*v)

    median_test = test_auroc(median)
    return {
        "median_lengthscale": ell, "val_auroc": {f"{m:g}": a for m, a in table.items()},
        "median": {"ridge": float(median.ridge), "val": max(aurocs.values()), "test": median_test},
        "chosen": {"multiple": chosen[1], "ridge": float(chosen[2].ridge), "val": chosen[0],
                   "test": median_test if chosen[1] == 1.0 else test_auroc(chosen[2])},
    }


def paired(a: np.ndarray, b: np.ndarray) -> str:
    """a − b over the runs: mean [95 % t interval] (runs where a > b)."""
    d = a - b
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return f"{d.mean():+.4f} [{d.mean() - half:+.4f}, {d.mean() + half:+.4f}] ({int((d > 0).sum())}/{len(d)})"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="run folders (data with ood_val)")
    parser.add_argument("--rows", nargs="*", default=(),
                        help="JSON tables of earlier invocations (--out) whose runs join the paired table")
    parser.add_argument("--detectors", nargs="*", default=None,
                        help="run folders whose detectors each run is paired against (same order; default the runs)")
    parser.add_argument("--features", type=int, default=R.NUM_FEATURES, help="the readout's R")
    parser.add_argument("--multiples", default=",".join(f"{m:g}" for m in MULTIPLES),
                        help="ℓ's candidates as multiples of the median, comma-separated, 1 first")
    parser.add_argument("--out", default=None, help="write the per-run table as JSON here")
    args = parser.parse_args(argv)
    multiples = tuple(float(m) for m in args.multiples.split(","))
    others = args.detectors or args.runs
    if len(others) != len(args.runs):
        raise ValueError(f"--detectors must name one run per run ({len(args.runs)}), got {len(others)}")
    table = {}
    for path in args.rows:
        table.update(json.loads(Path(path).read_text()))
    if not table and not args.runs:
        parser.error("name run folders or --rows tables")
    for folder, other in zip(args.runs, others, strict=True):
        cfg, head, h_train, parts, scores = run_inputs(folder)
        if other != folder:
            scores = run_inputs(other)[4]
        row = choose_lengthscale(head, h_train, parts, cfg.seed, args.features, multiples)
        row["detectors"] = {n: auroc(scores["test"][n], scores["ood"][n]) for n in DETECTORS if n in scores["test"]}
        table[folder] = row
        if args.out:  # after every run: a cut-off invocation keeps the runs it finished
            Path(args.out).write_text(json.dumps({f: table[f] for f in args.runs if f in table}, indent=1))
        print(f"{folder}: median ℓ {row['median_lengthscale']:.4g}; median-ℓ s={row['median']['ridge']:g} val "
              f"{row['median']['val']:.4f} test {row['median']['test']:.4f}; chosen m={row['chosen']['multiple']:g} "
              f"s={row['chosen']['ridge']:g} val {row['chosen']['val']:.4f} test {row['chosen']['test']:.4f}; "
              + " ".join(f"{n} {a:.4f}" for n, a in row["detectors"].items()), flush=True)
        print("  val AUROC by m, s: " + "; ".join(f"m={m}: " + " ".join(f"{s}:{a:.4f}" for s, a in by_s.items())
                                                 for m, by_s in row["val_auroc"].items()), flush=True)
    rows = list(table.values())
    chosen = np.array([r["chosen"]["test"] for r in rows])
    median = np.array([r["median"]["test"] for r in rows])
    print(f"\nOOD AUROC, test against ood, R = {args.features}, {len(rows)} runs: chosen-ℓ {chosen.mean():.4f}, "
          f"median-ℓ {median.mean():.4f}")
    print("| against | its mean | chosen-ℓ − it | median-ℓ − it |\n|---|---|---|---|")
    print(f"| median-ℓ gp-variance | {median.mean():.4f} | {paired(chosen, median)} | – |")
    for name in DETECTORS:
        if all(name in r["detectors"] for r in rows):
            other = np.array([r["detectors"][name] for r in rows])
            print(f"| {name} | {other.mean():.4f} | {paired(chosen, other)} | {paired(median, other)} |")
    return table


if __name__ == "__main__":
    main()
