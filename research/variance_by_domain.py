"""Does a trained GP layer's predictive variance differ between inputs the model knows and inputs it does not?

For finished text runs (``gpattn train`` / ``compare`` folders), the posterior variance of every swapped or built GP
layer at each real token of in-domain and out-of-domain texts: its mean per sequence, the ratio OOD / in domain,
and the OOD AUROC of the per-sequence mean variance (scikit-learn's ``roc_auc_score``). A layer whose variance is
the same everywhere (a temperature) reads ratio ≈ 1 and AUROC ≈ 0.5. Finding: research/notes/sgpa_rff_variance.md.

    python research/variance_by_domain.py RUN_DIR [RUN_DIR ...] --in-texts in.txt --ood-texts ood.txt
    python research/variance_by_domain.py RUN_DIR --clinc150 ../shared/data/clinc150/data_full.json --n 500
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpattn.experiments import load_run  # noqa: E402


def gp_layers(model) -> list:
    """The model's GP attention layers (``is_gp``), in module order."""
    return [m for m in model.modules() if getattr(m, "is_gp", False) and hasattr(m, "_condition")]


@contextlib.contextmanager
def captured_variances(layers, store: list):
    """While active, each GP layer's conditional appends its posterior variance (B, T), averaged over heads and
    output dims, to ``store[i]``."""
    originals = [layer._condition for layer in layers]

    def wrap(i, original):
        def condition(x, mask, context=None):
            cond = original(x, mask, context)
            var = cond.posterior().variance  # shape: (B, H, Dv, T)
            store[i].append(var.mean((1, 2)).detach().float())
            return cond

        return condition

    for i, layer in enumerate(layers):
        layer._condition = wrap(i, originals[i])
    try:
        yield
    finally:
        for layer in layers:
            del layer._condition


def sequence_variances(run, texts: list[str], batch_size: int = 64) -> list[torch.Tensor]:
    """Per GP layer, the mean posterior variance over each text's real tokens.  # -> [(N,)] per layer"""
    layers = gp_layers(run.model)
    out = [[] for _ in layers]
    for start in range(0, len(texts), batch_size):
        store = [[] for _ in layers]
        with captured_variances(layers, store), torch.no_grad():
            run.predict(texts[start:start + batch_size], num_samples=2)
        real = _real_tokens(run, texts[start:start + batch_size])
        for i, rows in enumerate(store):
            var = rows[0]
            mask = real[:, : var.shape[1]].to(var.dtype)
            out[i].append((var * mask).sum(1) / mask.sum(1).clamp_min(1))
    return [torch.cat(rows) for rows in out]


def _real_tokens(run, texts):
    """(N, T) real-token mask of the texts as the run encodes them."""
    ids, pad = run.encode(texts) if hasattr(run, "encode") else (None, None)
    if pad is None:
        raise SystemExit("this run cannot encode texts (an image run?)")
    return ~pad


def clinc150_texts(path: Path, n: int) -> tuple[list[str], list[str]]:
    """The first ``n`` in-domain test queries and the first ``n`` out-of-scope test queries of CLINC150."""
    data = json.loads(Path(path).read_text())
    return [t for t, _ in data["test"][:n]], [t for t, _ in data["oos_test"][:n]]


def main(argv=None) -> None:
    from sklearn.metrics import roc_auc_score

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--clinc150", type=Path, help="data_full.json: its test and oos_test queries")
    p.add_argument("--in-texts", type=Path, help="one in-domain text per line")
    p.add_argument("--ood-texts", type=Path, help="one out-of-domain text per line")
    p.add_argument("--n", type=int, default=500, help="texts per side (default 500)")
    args = p.parse_args(argv)
    if args.clinc150:
        inside, outside = clinc150_texts(args.clinc150, args.n)
    elif args.in_texts and args.ood_texts:
        inside = args.in_texts.read_text().splitlines()[: args.n]
        outside = args.ood_texts.read_text().splitlines()[: args.n]
    else:
        p.error("give --clinc150 or both --in-texts and --ood-texts")
    print("| run | layer | mean variance in domain | OOD | ratio | OOD AUROC of the layer's variance |")
    print("|---|---|---|---|---|---|")
    for path in args.runs:
        run = load_run(path)
        v_in, v_out = sequence_variances(run, inside), sequence_variances(run, outside)
        for i, (a, b) in enumerate(zip(v_in, v_out)):
            labels = [0] * len(a) + [1] * len(b)
            auroc = roc_auc_score(labels, torch.cat([a, b]).double().numpy())
            print(f"| {path} | {i} | {a.mean():.4g} | {b.mean():.4g} | {b.mean() / a.mean():.3g} | {auroc:.3f} |")


if __name__ == "__main__":
    main()
