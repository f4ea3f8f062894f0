"""The attention suite: does an attention layer attend? (docs/results.md, "The attention suite")

Each task of :mod:`gpattn.experiments.data.attention_tasks` needs token–token interactions: a model whose
attention returns zeros (:class:`ZeroAttention`, the control) is at chance there. :func:`run_task` trains
the library's :class:`gpattn.models.TransformerClassifier` (pre-LN, mean pooling, linear head) with one
attention in every layer under the library's default objective (:class:`gpattn.objectives.DeepGPELBO`:
β = 1, η and α at their defaults), Adam, and reports test accuracy (probabilities averaged over
``num_samples`` Monte-Carlo draws), the NLL, and each attention layer's use of the other tokens
(:func:`gpattn.experiments.diagnostics.attention_use`) and output scale. ``benchmarks/attention_suite.py``
runs the grid of tasks × variants × seeds and writes the table.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from gpattn._settings import deterministic
from gpattn.experiments.data import load_dataset
from gpattn.experiments.data.attention_tasks import ATTENTION_TASKS
from gpattn.experiments.diagnostics import attention_use
from gpattn.models import TransformerClassifier
from gpattn.objectives import DeepGPELBO

__all__ = ["CONTROL", "SuiteConfig", "ZeroAttention", "run_task"]

#: the name of the zero-attention control in the suite's variant lists
CONTROL = "zero"


class ZeroAttention(nn.Module):
    """The control: an attention layer that returns zeros, so every block is a per-token MLP.
    # shape: x (B, T, D) -> (B, T, D)"""

    sampling = False  # gpattn.models: this block is not random

    def __init__(self, embed_dim: int, num_heads: int, **options):
        super().__init__()
        if options:
            raise ValueError(f"ZeroAttention takes no options, got {sorted(options)}")
        self.embed_dim = embed_dim

    def forward(self, x, key_padding_mask=None, num_samples=None):
        return torch.zeros_like(x)


@dataclass
class SuiteConfig:
    """One run of the suite. The defaults are the measured setting of docs/results.md."""

    task: str = "attn-match"
    attention: str = "softmax"
    seed: int = 0
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    embed_dim: int = 64
    num_heads: int = 4
    length: int = 12  # T of the task's sequences (attn-repeat: its longest; it needs length <= vocab = 16)
    num_layers: int = 2
    dropout: float = 0.0
    train_samples: int = 1
    num_samples: int = 10
    train_size: int = 8000
    test_size: int = 2000
    pooling: str = "mean"
    device: str = "cpu"
    objective: dict | None = None  # DeepGPELBO settings other than the defaults (beta, alpha, ...)
    attention_options: dict | None = None


def _model(cfg: SuiteConfig, vocab_size: int, max_len: int) -> nn.Module:
    attention = (lambda d, h, **o: ZeroAttention(d, h, **o)) if cfg.attention == CONTROL else cfg.attention
    return TransformerClassifier(
        2,
        vocab_size=vocab_size,
        max_len=max_len,
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        attention=attention,
        attention_options=cfg.attention_options,
        dropout=cfg.dropout,
        pooling=cfg.pooling,
    )


@torch.no_grad()
def _evaluate(model, split, cfg: SuiteConfig, device) -> dict:
    model.eval()
    probs = []
    for i in range(0, len(split), 500):
        x = split.inputs[i : i + 500].to(device)
        m = split.mask[i : i + 500].to(device)
        logits = model(x, m, num_samples=cfg.num_samples)  # shape: (B, P, C)
        probs.append(logits.float().softmax(-1).mean(1).cpu())
    p = torch.cat(probs)
    y = split.labels
    return {
        "accuracy": float((p.argmax(-1) == y).double().mean()),
        "nll": float(-p[torch.arange(len(y)), y].clamp_min(1e-12).log().mean()),
    }


@torch.no_grad()
def _layer_scale(model, split, cfg: SuiteConfig, device) -> dict[int, dict]:
    """Per GP layer, ``mean_ratio`` and ``spread_ratio``: the norms of its posterior-mean output and of a
    drawn sample's deviation from it, per real token, over the norm of its input (one training-mode
    forward of 256 training sequences; ``layer_diagnostics``)."""
    model.train()
    model(split.inputs[:256].to(device), split.mask[:256].to(device), num_samples=1)
    out = {}
    for row in model.layer_diagnostics() if hasattr(model, "layer_diagnostics") else []:
        inp = float(row["input_norm"])
        out[int(row["layer"])] = {
            "mean_ratio": float(row["mean_norm"]) / inp if inp > 0 else float("nan"),
            "spread_ratio": float(row["spread_norm"]) / inp if inp > 0 else float("nan"),
        }
    return out


def run_task(cfg: SuiteConfig) -> dict:
    """Train and evaluate one (task, attention, seed); returns the config, test accuracy and NLL (and the
    validation split's, ``val_accuracy`` / ``val_nll``), the
    final training loss parts and every attention layer's attention use (on 256 test sequences)."""
    if cfg.task not in ATTENTION_TASKS:
        raise ValueError(f"task must be one of {list(ATTENTION_TASKS)}, got {cfg.task!r}")
    device = torch.device(cfg.device)
    bundle = load_dataset(
        cfg.task, seed=cfg.seed, train_size=cfg.train_size, test_size=cfg.test_size, length=cfg.length
    )
    train, test = bundle.splits["train"], bundle.splits["test"]
    torch.manual_seed(cfg.seed)
    model = _model(cfg, bundle.vocab_size, train.inputs.shape[1]).to(device)
    objective = DeepGPELBO(model, len(train), combine_terms=False, **(cfg.objective or {}))
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    generator = torch.Generator().manual_seed(cfg.seed)
    start, parts = time.perf_counter(), {}
    sums: dict[str, float] = {}
    tail = max(1, cfg.steps // 10)  # the loss parts are averaged over the last tenth of the steps
    for step in range(cfg.steps):
        model.train()
        idx = torch.randint(len(train), (cfg.batch_size,), generator=generator)
        x, m, y = train.inputs[idx].to(device), train.mask[idx].to(device), train.labels[idx].to(device)
        parts = objective(model(x, m, num_samples=cfg.train_samples), y, step=step)
        optimizer.zero_grad(set_to_none=True)
        parts["loss"].backward()
        optimizer.step()
        if step >= cfg.steps - tail:
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach()) / tail
    seconds = time.perf_counter() - start
    scale = _layer_scale(model, train, cfg, device)
    result = _evaluate(model, test, cfg, device)
    val = _evaluate(model, bundle.splits["val"], cfg, device)  # for choices made on validation (α of cgp/scgp)
    result.update(val_accuracy=val["accuracy"], val_nll=val["nll"])
    probe = test.subset(slice(0, 256))
    with deterministic():
        use = attention_use(model, probe.inputs.to(device), probe.mask.to(device), seed=cfg.seed)
    for row in use:  # each layer's posterior mean and spread against its input (training mode, one draw)
        row.update(scale.get(row["layer"], {}))
    return {
        "config": asdict(cfg),
        **result,
        "train": {k: v for k, v in sums.items() if math.isfinite(v)},
        "layers": use,
        "seconds": seconds,
    }
