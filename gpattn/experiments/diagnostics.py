"""Collapse is never silent: per-epoch statistics of a training run and the checks on them.

A GP attention layer is part of a residual network. Two failure modes look fine in a calibration
table and are measured here instead (docs/derivations.md §9, ``gpattn.variational._scale``):

* **A layer's mean collapses under its noise.** ``mean_norm / spread_norm`` of a layer — the norm of
  its posterior-mean output against the norm of a drawn sample's deviation from it, per real token —
  below :data:`MEAN_UNDER_NOISE` (the exact ELBO paid its KL by shrinking the mean, so the layer adds
  noise and little else).
* **A layer does not attend.** ``context_effect`` of a layer (:func:`attention_use`): how far its
  posterior-mean output at a token moves when the *other* tokens of the sequence are replaced by those of
  another sequence, per real token, as a fraction of the norm of its input there. A layer whose output
  ignores the other tokens (a token-wise map, or an attention path too weak to matter) scores 0; below
  :data:`INERT_CONTEXT` a GP layer is flagged as not attending (docs/results.md, "The attention suite",
  has the values of healthy and inert layers).
* **The model predicts the class prior.** The training cross-entropy of the last epoch (mean over
  its steps) within :data:`BASE_RATE_MARGIN` nats of the entropy of the training labels' frequencies
  (0.611 nats on CoLA): whatever its ECE, such a model says nothing about the input.

:class:`EpochStats` accumulates the loss parts and each GP layer's ``layer_diagnostics`` over an
epoch's steps without host synchronisation (0-dim tensors; one conversion per epoch);
:func:`collapse_warnings` reads a history and returns the messages that ``gpattn train`` issues as
:class:`CollapseWarning` and that ``gpattn compare`` flags in its report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from gpattn._settings import deterministic

__all__ = [
    "BASE_RATE_MARGIN",
    "INERT_CONTEXT",
    "MEAN_UNDER_NOISE",
    "CollapseWarning",
    "EpochStats",
    "attention_use",
    "base_rate_entropy",
    "collapse_warnings",
]

#: a layer whose posterior-mean output is below this fraction of its sample spread has collapsed
MEAN_UNDER_NOISE = 0.25
#: a GP layer whose output moves by less than this fraction of its input when the other tokens change
#: does not attend
INERT_CONTEXT = 0.03
#: a last-epoch training cross-entropy within this many nats of the base-rate entropy sits at it
BASE_RATE_MARGIN = 0.01


#: what a collapsed or inert GP layer's message suggests
_ADVICE = (
    "What helps: the SGPA variants' default prior_mean='attention' (the papers' prior_mean='zero' pays a "
    "per-sequence KL for attending, docs/derivations.md §5c); for cgp/scgp a softmax prior mean (the correlated GP "
    "models the departure from softmax attention, §7a: cgp's default prior_mean='softmax', scgp's "
    "prior_mean='softmax-separate', whose values the regulariser does not shrink) or a smaller --alpha; compare with "
    "softmax on a task that needs attention (gpattn.experiments.data.attention_tasks, docs/results.md)"
)


class CollapseWarning(UserWarning):
    """A GP layer's mean collapsed under its noise, or the model (of any attention) sits at the base rate.
    ``GPCollapseWarning``, its name before softmax runs got the base-rate check too, is this class (a filter on either
    name holds)."""


# the former name, kept importable (not exported): the same class
GPCollapseWarning = CollapseWarning


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
                f"{last['epoch']}: the KL is being paid by shrinking the mean. {_ADVICE}"
            )
    for row in last.get("attention_use", []):
        effect = row.get("context_effect", float("nan"))
        if row.get("is_gp") and math.isfinite(effect) and effect < INERT_CONTEXT:
            msgs.append(
                f"GP layer {row['layer']} does not attend: its mean output moves by {effect:.3g} of its input when "
                f"the other tokens of the sequence change (below {INERT_CONTEXT}) in epoch {last['epoch']}, so "
                f"whatever it learns it learns token by token. {_ADVICE}"
            )
    nll = last["train"].get("nll")
    if base_rate is not None and nll is not None and math.isfinite(nll) and nll >= base_rate - BASE_RATE_MARGIN:
        msgs.append(
            f"training cross-entropy {nll:.4f} in epoch {last['epoch']} is at the base-rate entropy {base_rate:.4f} "
            "of the training labels: the model predicts the class prior. Train longer or with a larger --lr; "
            "for a GP variant see also the layer messages"
        )
    return msgs


def _attention_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(index, layer)`` of every gpattn attention layer, indexed as the model's ``layer_diagnostics`` indexes
    them: the block index for gpattn's classifiers, the encoder layer of each swapped adapter for a Hugging Face
    model with ``adapters`` (``HFClassifier``: {layer index: adapter}), else the order of ``model.modules()``."""
    from gpattn.attention.base import AttentionBase

    adapters = getattr(model, "adapters", None)
    if isinstance(adapters, Mapping):
        found = [(i, getattr(a, "attention", None)) for i, a in sorted(adapters.items())]
        return [(i, m) for i, m in found if isinstance(m, AttentionBase)]
    encoder = getattr(model, "encoder", None)
    if encoder is not None and hasattr(encoder, "attention_modules"):
        return [(i, m) for i, m in enumerate(encoder.attention_modules()) if isinstance(m, AttentionBase)]
    return list(enumerate(m for m in model.modules() if isinstance(m, AttentionBase)))


def _layer_call(layer, args, kwargs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(x (B, T, D), key_padding_mask, attn_mask)`` of a recorded call: gpattn's own
    ``layer(x, key_padding_mask)`` or nn.MultiheadAttention's ``layer(query, key, value, ...)``."""
    mha = (len(args) > 2 and torch.is_tensor(args[2])) or "query" in kwargs
    if mha:
        x = args[0] if args else kwargs["query"]
        x = x if layer.batch_first else x.transpose(0, 1)
        mask = args[3] if len(args) > 3 else kwargs.get("key_padding_mask")
    else:
        x = args[0] if args else kwargs["x"]
        mask = args[1] if len(args) > 1 else kwargs.get("key_padding_mask")
    if mask is not None and mask.dtype != torch.bool:
        mask = mask <= -1e4  # an additive mask (0 / -inf)
    return x, mask, kwargs.get("attn_mask")


@torch.no_grad()
def attention_use(model: torch.nn.Module, inputs, mask=None, *, positions: int = 4, seed: int = 0) -> list[dict]:
    """How much each attention layer's output depends on the other tokens of its sequence.

    One forward of ``model(inputs, mask)`` records every gpattn attention layer's input x (B, T, D). Then,
    for ``positions`` random token positions t, the layer (posterior mean: ``gpattn.deterministic()``, eval
    mode) is run on x' = the next sequence of the batch with token t replaced by x[b, t] (so token t is the
    same and only its context changed). Per layer:

    * ``context_effect`` = mean ‖y_t(x) − y_t(x')‖ / mean ‖x_t‖ over the real tokens t: 0 for a layer that
      ignores the other tokens;
    * ``output_ratio`` = mean ‖y_t(x)‖ / mean ‖x_t‖: the size of the layer's mean output.

    A model that pools its CLS token (gpattn's classifiers with ``pooling="cls"``, ``HFClassifier``) has
    position 0 among the positions always: it is the token the head reads, and a layer may gather into it
    alone (digits, scgp, seed 0: context effect 0.93 at the CLS token, 0.01 at the patch tokens).

    Returns ``[{"layer", "is_gp", "context_effect", "output_ratio"}, ...]`` (floats; NaN for a batch of
    one sequence). The model's train/eval mode is restored.  # shape: inputs (B, ...), mask (B, T) or None
    """
    layers = _attention_layers(model)
    if not layers:
        return []
    calls: dict[int, tuple] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: calls.setdefault(i, (args, kwargs)), with_kwargs=True
        )
        for i, layer in layers
    ]
    was_training = model.training
    model.eval()
    try:
        with deterministic():
            model(inputs) if mask is None else model(inputs, mask)
            pooled = getattr(model, "cls_token", None) is not None or getattr(model, "pooling", None) == "cls"
            rows = [
                _context_effect(i, layer, *calls[i], positions, seed, pooled) for i, layer in layers if i in calls
            ]
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return rows


def _context_effect(index: int, layer, args, kwargs, positions: int, seed: int, pooled: bool = False) -> dict:
    x, mask, attn_mask = _layer_call(layer, args, kwargs)
    B, T, _ = x.shape
    y = layer.forward_gp(x, mask, attn_mask=attn_mask)
    real = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else ~mask
    perm = torch.roll(torch.arange(B, device=x.device), 1)
    gen = torch.Generator().manual_seed(seed)
    moved = norm_x = norm_y = count = 0.0
    order = torch.randperm(T, generator=gen).tolist()
    if pooled:  # the CLS token, the one the head reads, is always among the positions
        order = [0, *(t for t in order if t != 0)]
    for t in order[: min(positions, T)]:
        rows = real[:, t] & real[perm].any(-1)
        if B < 2 or not bool(rows.any()):
            continue
        x2 = x[perm].clone()
        x2[:, t] = x[:, t]
        mask2 = None
        if mask is not None:
            mask2 = mask[perm].clone()
            mask2[:, t] = False
        y2 = layer.forward_gp(x2, mask2, attn_mask=attn_mask)
        moved += float((y[rows, t] - y2[rows, t]).float().norm(dim=-1).sum())
        norm_x += float(x[rows, t].float().norm(dim=-1).sum())
        norm_y += float(y[rows, t].float().norm(dim=-1).sum())
        count += float(rows.sum())
    nan = float("nan")
    return {
        "layer": index,
        "is_gp": bool(getattr(layer, "is_gp", False)),
        "context_effect": moved / norm_x if norm_x > 0 else nan,
        "output_ratio": norm_y / norm_x if norm_x > 0 else nan,
    }
