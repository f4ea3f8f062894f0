"""Where does a pretrained encoder's last layer see CLINC150's out-of-scope queries: in a token's query, or in the
sequence's? No training: the OOD AUROC (in-scope vs out-of-scope of one split) of an RBF random-feature GP's
posterior variance σ²ψᵀ(I + w E_train[ψψᵀ])⁻¹ψ (σ² = 1) with MiniLM's last-layer queries as input, per form:

* ``token``: per token and head (sgpa-rff's ``gp_input="query"``, R = 256), averaged over the sequence; ℓ a
  multiple of the median distance of the queries;
* ``unit-sequence``: the unit mean query over the tokens and all heads (``gp_input="sequence"``), ℓ on the sphere;

beside a kNN cosine distance (k = 10) of the layer's mean-pooled input. Finding: research/notes/sgpa_rff_variance.md
and docs/derivations.md §5f.

With ``--predictions`` (a trained softmax run's predictions.pt on the official test split, ``--split test``) it also
prints how much each score adds to the model's energy: the OOD AUROC and FPR95 (metrics.json's) of z(energy) +
w·z(score), z the standardisation on the in-scope rows, over a grid of w — the ceiling of a readout that combines
the two (chosen on the test split itself: an upper bound, not a result).

    python research/sequence_distance.py --clinc150 ../shared/data/clinc150/data_full.json --split val
    python research/sequence_distance.py --clinc150 ... --split test --predictions RUN/predictions.pt
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rff_variance(train: torch.Tensor, evaluation: torch.Tensor, num_features: int, lengthscale: float,
                 data_weight: float, seed: int = 0) -> torch.Tensor:
    """σ²ψ(x)ᵀ(I + w·mean_n ψ(x_n)ψ(x_n)ᵀ)⁻¹ψ(x) (σ² = 1) of an RBF kernel's random features, per row of
    ``evaluation``, the precision from the rows of ``train``.  # shape: train (N, E), evaluation (M, E) -> (M,)"""
    g = torch.Generator().manual_seed(seed)
    omega = torch.randn(train.shape[-1], num_features, generator=g, dtype=torch.float64) / lengthscale
    phase = 2 * math.pi * torch.rand(num_features, generator=g, dtype=torch.float64)

    def psi(x):
        return math.sqrt(2.0 / num_features) * torch.cos(x.double() @ omega + phase)

    f = psi(train)
    precision = torch.eye(num_features, dtype=torch.float64) + data_weight * (f.T @ f) / len(f)
    root = torch.linalg.solve_triangular(torch.linalg.cholesky(precision), psi(evaluation).T, upper=False)
    return root.square().sum(0)


def knn_distance(train: torch.Tensor, evaluation: torch.Tensor, k: int = 10) -> torch.Tensor:
    """1 − cosine similarity to the k-th nearest training row.  # shape: (N, E), (M, E) -> (M,)"""
    a = torch.nn.functional.normalize(train.double(), dim=-1)
    b = torch.nn.functional.normalize(evaluation.double(), dim=-1)
    return 1 - (b @ a.T).topk(k, dim=1).values[:, -1]


@torch.no_grad()
def last_layer_inputs(encoder, tokenizer, texts: list[str], batch_size: int = 256) -> list[tuple]:
    """Per text, its last layer's queries (T, H, Dh) and mean-pooled input (D,) over its real tokens."""
    layer = encoder.encoder.layer[-1].attention.self
    H = encoder.config.num_attention_heads
    out = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, max_length=64,
                          return_tensors="pt")
        x = encoder(**batch, output_hidden_states=True).hidden_states[-2]
        q = layer.query(x).view(*x.shape[:2], H, -1)
        for row, real in enumerate(batch["attention_mask"].bool()):
            out.append((q[row, real], x[row, real].mean(0)))
    return out


def form_scores(train: list[tuple], evaluation: list[tuple], args) -> dict[str, torch.Tensor]:
    """Each form's score per evaluation text (module docstring)."""
    scores = {}
    flat = torch.cat([q for q, _ in train[:2000]])  # (n, H, Dh)
    sample = flat[torch.randperm(len(flat), generator=torch.Generator().manual_seed(0))[:2000]]
    median = float(torch.stack([torch.pdist(sample[:, h]).median() for h in range(flat.shape[1])]).mean())
    tokens = torch.cat([q for q, _ in train])
    for factor in (0.5, 1.0):
        H = tokens.shape[1]
        per_head = [rff_variance(tokens[:, h], torch.cat([q[:, h] for q, _ in evaluation]), 256, factor * median,
                                 args.data_weight, seed=h) for h in range(H)]
        lengths = [len(q) for q, _ in evaluation]
        var = torch.stack(per_head).mean(0)
        scores[f"token, l={factor}x median"] = torch.stack([v.mean() for v in var.split(lengths)])
    unit = [torch.stack([q.mean(0).flatten() for q, _ in rows]) for rows in (train, evaluation)]
    unit = [torch.nn.functional.normalize(u, dim=-1) for u in unit]
    for ell in args.lengthscales:
        scores[f"unit-sequence, R={args.num_features}, l={ell}"] = rff_variance(
            *unit, args.num_features, ell, args.data_weight)
    pooled = [torch.stack([x for _, x in rows]) for rows in (train, evaluation)]
    scores["kNN cosine of the pooled input (k=10)"] = knn_distance(*pooled)
    return scores


def with_energy(energy, score, inside: int, weights=(0.0, 0.3, 0.5, 1.0)) -> dict[float, tuple[float, float]]:
    """OOD AUROC and FPR95 (OOD rows accepted where 95 % of the in-scope rows are, as metrics.json's ``ood_fpr95``)
    of z(energy) + w·z(score) per w, both scores higher out of scope; the first ``inside`` rows are in scope, the rest
    OOD; z standardises on the in-scope rows.  # shape: energy, score (M,)"""
    import numpy as np

    from gpattn.experiments.metrics import ood_metrics

    def z(a):
        a = np.asarray(a, dtype=np.float64)
        return (a - a[:inside].mean()) / a[:inside].std()

    result = {}
    for w in weights:
        combined = -(z(energy) + w * z(score))  # ood_metrics reads higher = in scope
        got = ood_metrics(combined[:inside], combined[inside:])
        result[w] = (got["ood_auroc"], got["ood_fpr95"])
    return result


def _energy(predictions: str, inside: int, outside: int) -> torch.Tensor:
    """−logsumexp of the sample-mean logits of a run's test and ood rows (in that order)."""
    saved = torch.load(predictions, weights_only=False)
    logits = torch.cat([saved["test"]["logits"], saved["ood"]["logits"]])  # shape: (M, P, C)
    if logits.shape[0] != inside + outside:
        raise SystemExit(f"--predictions {predictions}: {logits.shape[0]} rows, the test split has {inside + outside}")
    return -torch.logsumexp(logits.mean(1), -1)


def main(argv=None) -> dict[str, float]:
    from sklearn.metrics import roc_auc_score
    from transformers import AutoModel, AutoTokenizer

    from gpattn.experiments.data.clinc150 import read_clinc150
    from gpattn.integrations.huggingface import resolve_encoder

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clinc150", required=True, help="data_full.json")
    parser.add_argument("--split", choices=("val", "test"), default="val")
    parser.add_argument("--encoder", default="minilm")
    parser.add_argument("--num-features", type=int, default=1024)
    parser.add_argument("--data-weight", type=float, default=1e4)
    parser.add_argument("--lengthscales", type=lambda s: [float(v) for v in s.split(",")], default=[0.2, 0.4])
    parser.add_argument("--predictions", default=None, help="a softmax run's predictions.pt (needs --split test)")
    args = parser.parse_args(argv)
    if args.predictions and args.split != "test":
        parser.error("--predictions holds the official test split's rows: use --split test")
    torch.manual_seed(0)
    data = read_clinc150(args.clinc150)
    path = resolve_encoder(args.encoder)
    encoder, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    train = last_layer_inputs(encoder, tokenizer, data["train"][0])
    inside, outside = (last_layer_inputs(encoder, tokenizer, data[k][0]) for k in (args.split, f"oos_{args.split}"))
    labels = [0] * len(inside) + [1] * len(outside)
    result = {}
    energy = None if args.predictions is None else _energy(args.predictions, len(inside), len(outside))
    for name, score in form_scores(train, inside + outside, args).items():
        result[name] = float(roc_auc_score(labels, score.numpy()))
        print(f"{name}: OOD AUROC {result[name]:.3f}", flush=True)
        if energy is not None:
            log_score = score.clamp_min(1e-12).log() if name.startswith("unit") or name.startswith("token") else score
            for w, (auroc, fpr) in with_energy(energy.numpy(), log_score.numpy(), len(inside)).items():
                print(f"  energy + {w} x {name}: AUROC {auroc:.4f}, FPR95 {fpr:.3f}", flush=True)
    return result


if __name__ == "__main__":
    main()
