"""Can a swapped GP layer's noise do what temperature scaling does? A post-hoc probe
(docs/archive/results-2026-11.md, "The softmax prior mean on MiniLM").

For a finished ``--encoder`` run with GP layers (``RUN``) and the softmax run of the same seed and data
(``SOFTMAX``), the GP layers' prior variance is multiplied by each factor c of ``--factors`` in turn (cumulative
products are undone, so each row is c times the trained prior; ``scale_prior``) and the run is re-evaluated at
P samples: validation NLL (the split temperature scaling and α selection use), in-domain NLL and MCC,
out-of-domain NLL. The first row is MSP + temperature scaling of the softmax run (its temperature fitted on the
validation split, as ``compare``'s ``softmax+ts``). A prior scale chosen on validation could replace temperature
scaling only if some c reaches MSP + TS's validation NLL.

Run: ``python research/prior_noise.py RUN SOFTMAX --factors 1,64,1024,4096``.
"""

from __future__ import annotations

import argparse

import torch


def _nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> float:
    """NLL of the averaged predictive probabilities of sample logits (N, P, C) on the labelled rows."""
    from gpattn.experiments import metrics as M

    known = (labels >= 0).numpy()
    return M.nll(M.average_samples(logits / temperature, average="probs")[known], labels.numpy()[known])


def _row(name: str, preds: dict, bundle, temperature: float = 1.0) -> dict:
    from gpattn.experiments.training import evaluate_predictions

    metrics = evaluate_predictions(preds, bundle, "probs", temperature)
    row = {"model": name, "val_nll": _nll(preds["val"]["logits"], preds["val"]["labels"], temperature)}
    row.update(in_nll=metrics["in_domain"]["nll"], in_mcc=metrics["in_domain"]["mcc"])
    if "ood" in metrics:
        row["ood_nll"] = metrics["ood"]["nll"]
    return row


def probe(run, softmax_run, factors, num_samples: int = 10, seed: int = 0) -> list[dict]:
    """The rows described in the module docstring: MSP + TS first, then one per factor."""
    from gpattn.experiments import metrics as M
    from gpattn.experiments.training import load_run_with_data, predict

    torch.manual_seed(seed)
    _, model, bundle, _ = load_run_with_data(run)
    reference = torch.load(f"{softmax_run}/predictions.pt", weights_only=False)
    temperature = float(M.temperature_scale(reference["val"]["logits"], reference["val"]["labels"]))
    rows = [{**_row("MSP + TS", reference, bundle, temperature), "temperature": temperature}]
    applied = 1.0
    for c in factors:
        for adapter in model.adapters.values():
            if getattr(adapter.attention, "is_gp", False):
                adapter.attention.scale_prior(c / applied)
        applied = c
        keys = sorted({"val", *bundle.eval_splits.values()})
        preds = {k: {"logits": predict(model, bundle.splits[k], num_samples), "labels": bundle.splits[k].labels}
                 for k in keys}  # fmt: skip
        rows.append({**_row(f"c = {c:g}", preds, bundle), "factor": c})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished --encoder run folder with GP layers")
    parser.add_argument("softmax", help="the softmax run folder of the same seed and data (its predictions.pt)")
    parser.add_argument("--factors", default="1,64,1024,4096", help="prior variance factors, comma-separated")
    parser.add_argument("--samples", type=int, default=10)
    args = parser.parse_args(argv)
    factors = [float(f) for f in args.factors.split(",")]
    if not factors or min(factors) <= 0:
        parser.error(f"--factors takes positive numbers such as 1,64,1024; got {args.factors!r}")
    print("| model | val NLL | in-domain NLL | in-domain MCC | OOD NLL |\n|---|---|---|---|---|")
    for r in probe(args.run, args.softmax, factors, args.samples):
        ood = f"{r['ood_nll']:.4f}" if "ood_nll" in r else "–"
        print(f"| {r['model']} | {r['val_nll']:.4f} | {r['in_nll']:.4f} | {r['in_mcc']:.3f} | {ood} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
