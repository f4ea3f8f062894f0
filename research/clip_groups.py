"""Does the trainer's one clipping norm keep a swapped GP layer from fine-tuning like softmax? A probe
(research/notes/kep_svgp_robustness.md, "The gradient clipping").

``gpattn train`` with one change: each step's gradients are clipped in two groups, each to ``--grad-clip`` by its
own norm — the swapped layers' new parameters (``split_pretrained``'s new ones other than the head) and everything
else (the pretrained encoder and the head) — instead of by their total norm. ``--groups 1`` is ``gpattn train``.

Run: ``python research/clip_groups.py --groups 2 -- train --dataset cola --data-dir ../shared/data --encoder
minilm --attention kep-svgp --epochs 1 --seed 0 --out RUN``.
"""

from __future__ import annotations

import torch
from _patched_cli import run_patched

from gpattn.experiments import training
from gpattn.experiments._optim import split_pretrained


def clip_groups(model) -> list[list[torch.nn.Parameter]]:
    """[the swapped layers' new parameters, every other trainable parameter] (either may be empty)."""
    _, new = split_pretrained(model)
    layer = {id(p) for name, p in new if not name.startswith("head.")}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [[p for p in trainable if id(p) in layer], [p for p in trainable if id(p) not in layer]]


def with_groups(groups: int):
    """The trainer's divergence guard, clipping each of :func:`clip_groups` apart when ``groups`` is 2."""
    if groups not in (1, 2):
        raise ValueError(f"--groups must be 1 (the trainer's) or 2, got {groups}")
    base = training._DivergenceGuard
    if groups == 1:
        return base

    class GroupGuard(base):
        def __init__(self, model, device):
            super().__init__(model, device)
            self.groups = clip_groups(model)

        def update(self, step, loss_bad, parts, max_norm):
            if max_norm:
                for group in self.groups:
                    grads = [p for p in group if p.grad is not None]
                    if grads:
                        torch.nn.utils.clip_grad_norm_(grads, max_norm)
            return super().update(step, loss_bad, parts, 0.0)  # the record only: no clipping by the total

    return GroupGuard


def main(argv=None):
    return run_patched(
        argv, __doc__.split("\n\n")[0], "--groups", int, "1: one clipping norm (the trainer's); 2: two groups",
        "_DivergenceGuard", with_groups,
    )


if __name__ == "__main__":
    main()
