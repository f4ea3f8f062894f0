"""Collapse is never silent: per-epoch statistics of a training run and the checks on them.

A GP attention layer is part of a residual network. Two failure modes look fine in a calibration
table and are measured here instead (docs/derivations.md §9, ``gpattn.variational._scale``):

* **A layer's mean collapses under its noise.** ``mean_norm / spread_norm`` of a layer — the norm of
  its posterior-mean output against the norm of a drawn sample's deviation from it, per real token —
  below :data:`MEAN_UNDER_NOISE` (the exact ELBO paid its KL by shrinking the mean, so the layer adds
  noise and little else).
* **The model predicts the class prior.** The training cross-entropy of the last epoch (mean over
  its steps) within :data:`BASE_RATE_MARGIN` nats of the entropy of the training labels' frequencies
  (0.611 nats on CoLA): whatever its ECE, such a model says nothing about the input.

:class:`EpochStats` accumulates the loss parts and each GP layer's :meth:`layer_diagnostics` over an
epoch's steps without host synchronisation (0-dim tensors; one conversion per epoch);
:func:`collapse_warnings` reads a history and returns the messages that ``gpattn train`` issues as
:class:`GPCollapseWarning` and that ``gpattn compare`` flags in its report.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "BASE_RATE_MARGIN",
    "MEAN_UNDER_NOISE",
    "EpochStats",
    "GPCollapseWarning",
    "base_rate_entropy",
    "collapse_warnings",
]

#: a layer whose posterior-mean output is below this fraction of its sample spread has collapsed
MEAN_UNDER_NOISE = 0.25
#: a last-epoch training cross-entropy within this many nats of the base-rate entropy sits at it
BASE_RATE_MARGIN = 0.01


class GPCollapseWarning(UserWarning):
    """A GP layer's mean collapsed under its noise, or the model sits at the base rate."""


def base_rate_entropy(labels: torch.Tensor, num_classes: int) -> float:
    """Entropy (nats) of the label frequencies: the cross-entropy of a model predicting the prior."""
    p = torch.bincount(labels.long().reshape(-1), minlength=num_classes).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


class EpochStats:
    """Sums of the loss parts and of every GP layer's diagnostics over the steps of one epoch.

    ``add`` takes 0-dim tensors and never synchronises; ``summary`` returns plain floats (means over
    the steps). ``state_dict``/``load_state_dict`` keep a mid-epoch resume exact (checkpoints)."""

    def __init__(self):
        self.steps = 0
        self.parts: dict[str, torch.Tensor] = {}
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, parts: dict, layers: list[dict]) -> None:
        self.steps += 1
        for k, v in parts.items():
            v = v.detach().double()
            self.parts[k] = self.parts[k] + v if k in self.parts else v
        for row in layers:
            acc = self.layers.setdefault(int(row["layer"]), {})
            for k, v in row.items():
                if k != "layer":
                    v = v.detach().double()
                    acc[k] = acc[k] + v if k in acc else v

    def summary(self) -> dict:
        n = max(self.steps, 1)
        out = {"train": {k: float(v) / n for k, v in sorted(self.parts.items())}, "layers": []}
        for i in sorted(self.layers):
            row = {k: float(v) / n for k, v in sorted(self.layers[i].items())}
            inp = row.get("input_norm", 0.0)
            if inp > 0:
                row["mean_ratio"] = row.get("mean_norm", 0.0) / inp
                row["spread_ratio"] = row.get("spread_norm", 0.0) / inp
            out["layers"].append({"layer": i, **row})
        return out

    def state_dict(self) -> dict:
        layers = {str(i): dict(d) for i, d in self.layers.items()}
        return {"steps": self.steps, "parts": dict(self.parts), "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.parts = dict(state["parts"])
        self.layers = {int(i): dict(d) for i, d in state["layers"].items()}


def collapse_warnings(history: list[dict], base_rate: float | None = None) -> list[str]:
    """Messages for the last epoch of ``history`` (entries written by ``gpattn.experiments.training.train``)."""
    if not history or "train" not in history[-1]:
        return []
    last = history[-1]
    base_rate = last.get("base_rate_entropy", base_rate)
    msgs = []
    for row in last.get("layers", []):
        mean, spread = row.get("mean_norm", 0.0), row.get("spread_norm", 0.0)
        if spread > 0 and mean < MEAN_UNDER_NOISE * spread:
            msgs.append(
                f"GP layer {row['layer']}: its posterior-mean output (norm {mean:.3g} per token) collapsed under "
                f"its sample spread ({spread:.3g}; input {row.get('input_norm', float('nan')):.3g}) in epoch "
                f"{last['epoch']}: the KL is being paid by shrinking the mean"
            )
    nll = last["train"].get("nll")
    if base_rate is not None and nll is not None and math.isfinite(nll) and nll >= base_rate - BASE_RATE_MARGIN:
        msgs.append(
            f"training cross-entropy {nll:.4f} in epoch {last['epoch']} is at the base-rate entropy {base_rate:.4f} "
            "of the training labels: the model predicts the class prior"
        )
    return msgs
