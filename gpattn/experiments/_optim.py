"""The optimizer and learning-rate schedule of a run (:func:`gpattn.experiments.training.train`).

Models trained from scratch: fused Adam at ``cfg.lr`` (L2 ``cfg.weight_decay``), cosine decay to 0.
A pretrained encoder (``cfg.encoder``): fused AdamW with two parameter groups — the pretrained weights
at ``cfg.encoder_lr`` with decoupled weight decay ``cfg.encoder_weight_decay`` on their matrices (not on
biases or LayerNorm), the new parameters (the head, the GP parameters, projections that came from no
pretrained weight) at ``cfg.lr`` without decay — a linear warm-up over ``cfg.warmup`` of the steps, then
cosine decay. Unset (None), those three take :data:`ENCODER_DEFAULTS`, and so does an unset batch size
(``TrainConfig`` resolves it); the reasons and the measurement are in docs/archive/results-2026-11.md ("Fine-tuning
defaults"). :func:`describe` is the line the run prints.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "ENCODER_DEFAULTS",
    "build_optimizer",
    "describe",
    "encoder_settings",
    "split_pretrained",
]

#: what an ``--encoder`` run uses for a setting left unset (None), per recipe; chosen on CoLA with MiniLM
#: (docs/archive/results-2026-11.md, "Fine-tuning defaults"): full fine-tuning as BERT-family encoders are
#: fine-tuned (AdamW, warm-up, decay) at the lr and batch size that left the class prior in one epoch in every
#: seed tried; the frozen trunk's top layer at the cola-minilm preset's measured recipe (one lr, no warm-up, no
#: decay)
ENCODER_DEFAULTS = {
    "full": {"encoder_lr": 1e-4, "encoder_weight_decay": 0.01, "warmup": 0.1, "batch_size": 16},
    "frozen-trunk": {"encoder_lr": 5e-4, "encoder_weight_decay": 0.0, "warmup": 0.0, "batch_size": 32},
}
#: a run's batch size when none is given and the recipe has none (models trained from scratch)
DEFAULT_BATCH_SIZE = 32


def encoder_settings(cfg) -> dict:
    """``encoder_lr``, ``encoder_weight_decay`` and ``warmup`` of ``cfg``, unset ones from
    :data:`ENCODER_DEFAULTS` (for a model without encoder: warm-up 0 unless set, the others unused)."""
    if cfg.encoder is None:
        return {"encoder_lr": None, "encoder_weight_decay": None, "warmup": cfg.warmup or 0.0}
    defaults = {k: v for k, v in ENCODER_DEFAULTS[cfg.encoder_recipe].items() if k != "batch_size"}
    return {k: defaults[k] if getattr(cfg, k) is None else getattr(cfg, k) for k in defaults}


def split_pretrained(model) -> tuple[list, list]:
    """(pretrained, new) trainable parameters of a model with a pretrained encoder (``HFClassifier``):
    new are the head and, in each swapped layer, what its adapter lists as new (GP parameters, a projection
    of another width, kep-svgp's zero-initialised output map); everything else came from the checkpoint."""
    new = {id(p) for p in model.head.parameters()}
    for adapter in model.adapters.values():
        layer = adapter.attention
        for name, p in layer.named_parameters():
            top = name.split(".")[0]
            transferred_in = any(k.startswith("in_proj") for k in adapter.transferred)
            if name in adapter.new or (top == "in_proj" and not transferred_in):
                new.add(id(p))
            elif top == "out_proj" and (
                "out_proj" in adapter.new or adapter.transferred.get("out_proj", "").startswith("zero")
            ):
                new.add(id(p))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in trainable if id(p) not in new], [(n, p) for n, p in trainable if id(p) in new]


def _no_decay(name: str, p) -> bool:
    return p.dim() < 2 or "LayerNorm" in name or "layer_norm" in name


def build_optimizer(cfg, model, total_steps: int):
    """(optimizer, scheduler or None, description) for ``cfg`` and ``model`` (see the module docstring)."""
    settings = encoder_settings(cfg)
    warmup_steps = int(round(settings["warmup"] * total_steps))
    if cfg.encoder is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        groups = None
    else:
        pretrained, new = split_pretrained(model)
        decay = [p for n, p in pretrained if not _no_decay(n, p)]
        plain = [p for n, p in pretrained if _no_decay(n, p)]
        groups = [
            {"params": decay, "lr": settings["encoder_lr"], "weight_decay": settings["encoder_weight_decay"]},
            {"params": plain, "lr": settings["encoder_lr"], "weight_decay": 0.0},
            {"params": [p for _, p in new], "lr": cfg.lr, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=True)
        groups = (len(pretrained), len(new))
    scheduler = None
    if warmup_steps > 0:
        total = max(1, total_steps)

        def factor(step: int) -> float:  # linear warm-up, then cosine decay (to 0 with cfg.cosine)
            if step < warmup_steps:
                return (step + 1) / warmup_steps
            if not cfg.cosine:
                return 1.0
            done = (step - warmup_steps) / max(1, total - warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    elif cfg.cosine:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))
    return optimizer, scheduler, describe(cfg, settings, groups, warmup_steps, total_steps)


def describe(cfg, settings: dict, groups, warmup_steps: int, total_steps: int) -> str:
    """One line: the optimizer, learning rates, weight decay and schedule of a run."""
    schedule = f"warm-up {warmup_steps} of {total_steps} steps, then " if warmup_steps else ""
    schedule += "cosine decay" if cfg.cosine else "constant"
    if groups is None:
        return f"optimizer: Adam, lr {cfg.lr:g}, weight decay {cfg.weight_decay:g}; {schedule}"
    n_pre, n_new = groups
    return (
        f"optimizer: AdamW, lr {settings['encoder_lr']:g} for the {n_pre} pretrained tensors (weight decay "
        f"{settings['encoder_weight_decay']:g} on their matrices), lr {cfg.lr:g} for the {n_new} new ones "
        f"(head, GP parameters; no decay); batch {cfg.batch_size}; {schedule} (--encoder-lr, --lr, "
        f"--encoder-weight-decay, --warmup, --batch-size)"
    )
