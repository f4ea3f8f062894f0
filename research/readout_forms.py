"""Which GP does the readout (gpattn.experiments.readout, docs/derivations.md §14a) need on a trained run's pooled
features? No training: for each form of the GP (the precision's curvature, ridge ``w = 1`` or SNGP's Laplace
``w = p(1 − p)``; the input LayerNorm off or on) it fits the readout on the run's training split and prints

* the OOD AUROC of the variance v itself (in-domain test rows against the ``ood`` split; a diagnostic: the forms
  are not chosen on it, that would peek at the test split),
* λ chosen on the validation NLL and, at that λ, the in-domain accuracy and NLL, the shift NLL and the OOD AUROC of
  the model's own MSP and energy,
* the spread of v: its mean on the training features, the in-domain test rows and the ``ood`` rows.

    python research/readout_forms.py RUN_DIR [RUN_DIR ...]    # e.g. runs/digits/runs/softmax/seed0
    python research/readout_forms.py --scales 0.25,0.5,2 --ridges 0.01 RUN_DIR   # and the ridge form at ℓ = m ×
        the median distance and at other ridges s

Each row also prints the validation NLL at the chosen λ, the criterion a choice of form would read.

Finding: research/notes/gp_readout.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpattn.experiments import metrics as M  # noqa: E402
from gpattn.experiments import readout as R  # noqa: E402
from gpattn.experiments.laplace import extract_features  # noqa: E402
from gpattn.experiments.sngp import laplace_weights, mean_field_logits  # noqa: E402
from gpattn.experiments.training import load_run_with_data  # noqa: E402

FORMS = {
    "ridge": dict(curvature=R.unit_weights),
    "ridge+LN": dict(curvature=R.unit_weights, input_norm=True),
    "laplace": dict(curvature=laplace_weights),
    "laplace+LN": dict(curvature=laplace_weights, input_norm=True),
}


def _auroc(inside, outside) -> float:
    """OOD AUROC of a score that is higher in distribution."""
    return M.ood_metrics(np.asarray(inside), np.asarray(outside))["ood_auroc"]


def _attached(model, seed):
    R.attach_gp_readout(model, seed=seed)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--scales", default="", help="comma list of m: the ridge form at ℓ = m × the median distance")
    parser.add_argument("--ridges", default="", help="comma list of s: the ridge form at the median ℓ and ridge s")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {', '.join(FORMS)} (default all)")
    args = parser.parse_args(argv)
    scales = [float(m) for m in args.scales.split(",") if m]
    ridges = [float(r) for r in args.ridges.split(",") if r]
    for run in args.runs:
        cfg, model, bundle, _ = load_run_with_data(run)
        ev = bundle.eval_splits
        print(f"## {run} (splits: {ev})")
        forms = {name: FORMS[name] for name in args.forms.split(",") if name}
        if scales:
            _, model, bundle, _ = load_run_with_data(run)
            median = float(R.fit_gp_readout(_attached(model, cfg.seed), bundle.splits["train"]).lengthscale)
            forms.update({f"ridge ℓ×{m:g}": dict(lengthscale=m * median) for m in scales})
        forms.update({f"ridge s={r:g}": dict(ridge=r) for r in ridges})
        for name, options in forms.items():
            _, model, bundle, _ = load_run_with_data(run)
            readout = R.attach_gp_readout(model, seed=cfg.seed, **options)
            R.fit_gp_readout(model, bundle.splits["train"])
            parts = {}  # the head's logits and the readout's variance per split
            for k in ("val", *ev.values()):
                logits, h = R.readout_split(model, bundle.splits[k], cfg.num_samples)
                parts[k] = (logits, readout.variance(h).cpu())
            lam, val = R.select_mean_field_factor(*parts["val"], bundle.splits["val"].labels, average=cfg.average)
            v_train = readout.variance(extract_features(model, bundle.splits["train"], head=readout.head))
            v_in, v_ood = (parts[ev[k]][1].mean(1) for k in ("in_domain", "ood"))
            means = "/".join(f"{float(v.mean()):.4f}" for v in (v_train, v_in, v_ood))
            row = [f"{name:>10}", f"λ={lam:g}", f"val nll {val[lam]:.4f}", f"v AUROC {_auroc(-v_in, -v_ood):.3f}",
                   f"v mean train/in/ood {means}"]
            logits = {k: mean_field_logits(*parts[ev[k]], lam) for k in ev}
            probs = {k: M.average_samples(z, cfg.average) for k, z in logits.items()}
            labels_in = bundle.splits[ev["in_domain"]].labels
            row += [f"acc {M.accuracy(probs['in_domain'], labels_in):.4f}",
                    f"nll {M.nll(probs['in_domain'], labels_in):.4f}"]
            if "shift" in ev:
                row.append(f"shift nll {M.nll(probs['shift'], bundle.splits[ev['shift']].labels):.4f}")
            scores = {k: M.all_ood_scores(logits[k], cfg.average) for k in ("in_domain", "ood")}
            for score in ("msp", "energy"):
                if score in scores["in_domain"]:
                    row.append(f"{score} {_auroc(scores['in_domain'][score], scores['ood'][score]):.3f}")
            print("  " + " | ".join(row), flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
