"""What does the GP readout (gpattn.experiments.readout, docs/derivations.md §14a) do to a trained run, measured on
some of its evaluation splits? ``compare``'s ``x+gpreadout`` evaluates every split at the run's P samples; for a GP
attention run on the shared CPU that pass over digits' 5430-row shift split does not fit in a ten-minute call, so
this probe reads the run's checkpoint and evaluates the splits it is given (default: every evaluation split but
``shift``) once at P samples: the head's own logits (the run as it is, λ = 0) and the readout at (s, λ) chosen on the
validation NLL (``choose_readout``, as ``compare``), each plain and with temperature scaling on the validation split.
The metrics are ``compare``'s (``evaluate_predictions``) on those splits. Prints one JSON line per run and row.

    python research/readout_eval.py RUN_DIR [RUN_DIR ...] [--skip shift] [--out FILE.jsonl]

Finding: research/notes/gp_readout.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpattn.experiments import metrics as M  # noqa: E402
from gpattn.experiments import readout as R  # noqa: E402
from gpattn.experiments.laplace import extract_features  # noqa: E402
from gpattn.experiments.sngp import mean_field_logits  # noqa: E402
from gpattn.experiments.training import evaluate_predictions, load_run_with_data  # noqa: E402


def evaluate_run(run: Path, skip=("shift",)) -> list[dict]:
    """The four rows (``plain``, ``plain+ts``, ``gpreadout``, ``gpreadout+ts``) of one run folder."""
    cfg, model, bundle, _ = load_run_with_data(run)
    keep = {name: key for name, key in bundle.eval_splits.items() if name not in skip}
    bundle = dataclasses.replace(bundle, eval_splits=keep, ood_splits=[n for n in bundle.ood_splits if n in keep])
    torch.manual_seed(cfg.seed)
    h_train = extract_features(model, bundle.splits["train"], cfg.eval_batch_size)
    keys = list(dict.fromkeys(["val", *keep.values()]))
    parts = {k: R.readout_split(model, bundle.splits[k], cfg.num_samples, cfg.eval_batch_size) for k in keys}
    readout, selection = R.choose_readout(
        model.head, h_train, *parts["val"], bundle.splits["val"].labels, average=cfg.average, seed=cfg.seed
    )
    lam = selection["mean_field_factor"]
    forms = {
        "plain": {k: logits for k, (logits, _) in parts.items()},
        "gpreadout": {k: mean_field_logits(z, readout.variance(h).cpu(), lam).float() for k, (z, h) in parts.items()},
    }
    rows = []
    for name, logits in forms.items():
        preds = {k: {"logits": z, "labels": bundle.splits[k].labels} for k, z in logits.items()}
        known = bundle.splits["val"].labels >= 0
        temperature = float(M.temperature_scale(logits["val"][known], bundle.splits["val"].labels[known]))
        for suffix, t in (("", 1.0), ("+ts", temperature)):
            metrics = evaluate_predictions(preds, bundle, cfg.average, t)
            row = {"run": str(run), "seed": cfg.seed, "attention": cfg.attention, "row": name + suffix,
                   "temperature": t, "metrics": metrics}
            if name == "gpreadout":
                row["readout"] = {k: v for k, v in selection.items() if k != "val_nll"}
            rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--skip", default="shift", help="comma list of evaluation splits left out (default: shift)")
    parser.add_argument("--out", type=Path, help="append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        for row in evaluate_run(run, tuple(s for s in args.skip.split(",") if s)):
            m = row["metrics"]
            shown = {split: {k: round(v, 4) for k, v in m[split].items()
                             if isinstance(v, float) and (k in ("accuracy", "nll") or k.startswith("ood_auroc"))}
                     for split in m}
            head = {"run": row["run"], "row": row["row"], "readout": row.get("readout")}
            print(json.dumps({**head, **shown}), flush=True)
            rows.append(row)
            if args.out is not None:
                with args.out.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    with torch.no_grad():
        main()
