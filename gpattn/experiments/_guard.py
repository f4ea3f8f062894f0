"""Divergence of a training step, watched on the device: :class:`_DivergenceGuard` and the
:class:`TrainingDivergedError` it raises. Split from :mod:`gpattn.experiments.training`, which re-exports both."""

from __future__ import annotations

import torch

__all__ = ["TrainingDivergedError"]


class TrainingDivergedError(FloatingPointError):
    """A training step produced a non-finite loss or gradient. No optimizer step was taken with it, so
    the model still holds the last finite parameters; ``step`` is the step that failed. ``train``
    records it in ``out/diverged.json`` (which ``compare`` reads instead of training again)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


_DIVERGED_HINT = (
    "lower the learning rate (--lr) or temper the objective (--beta/--alpha); --validate checks the inputs and "
    "escalates the jitter of failed Cholesky factorisations"
)


class _DivergenceGuard:
    """Non-finite losses and gradients, watched on the device without a host synchronisation per step.

    Every step :meth:`update` records the first step whose loss (on any rank) or total gradient norm is
    not finite, with the parameters whose gradient is not finite and this rank's loss parts, in device
    tensors, and returns ``found_inf``: 1 from that step on. The optimizer (fused Adam, the mechanism
    ``torch.amp.GradScaler`` uses) skips every step with ``found_inf`` 1, so no parameter ever takes a
    non-finite update and the model keeps its last finite parameters. :meth:`check` reads the record
    (one synchronisation) and raises :class:`TrainingDivergedError` naming that step: every step with
    validation on (``gpattn.validation()``, ``--validate``), else at the next epoch end, checkpoint
    or interruption, before anything is saved."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        self.first = torch.full((), -1, dtype=torch.long, device=device)  # first bad step, -1 = none
        self.loss_bad = torch.zeros((), dtype=torch.bool, device=device)  # the loss (else a gradient)
        self.grads_bad = torch.zeros(len(self.named), dtype=torch.bool, device=device)
        self.parts: dict[str, torch.Tensor] = {}  # this rank's loss parts at that step, by name

    def update(self, step: int, loss_bad: torch.Tensor, parts: dict, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` (0 = off) and record this step; returns ``found_inf``."""
        grads = [q.grad for _, q in self.named if q.grad is not None]
        # one norm per tensor
        per = torch.stack(torch._foreach_norm(grads)) if grads else self.first.new_zeros(0, dtype=torch.float64)
        norm = torch.linalg.vector_norm(per)
        if max_norm and grads:
            torch.nn.utils.clip_grads_with_norm_([q for _, q in self.named if q.grad is not None], max_norm, norm)
        new = (loss_bad | ~torch.isfinite(norm)) & (self.first < 0)
        self.first = torch.where(new, step, self.first)
        self.loss_bad = torch.where(new, loss_bad, self.loss_bad)
        if len(grads) == len(self.named):
            self.grads_bad = torch.where(new, ~torch.isfinite(per), self.grads_bad)
        for k, v in parts.items():  # whatever terms the model reports (gpattn.objectives.DeepGPELBO)
            v = v.detach().to(device=self.first.device, dtype=torch.float64)
            self.parts[k] = torch.where(new, v, self.parts[k] if k in self.parts else torch.zeros_like(v))
        return (self.first >= 0).float()

    def check(self) -> None:
        """Raise :class:`TrainingDivergedError` if a step diverged (reads the device: one synchronisation)."""
        step = int(self.first)
        if step < 0:
            return
        parts = dict(zip(self.parts, torch.stack(list(self.parts.values())).tolist())) if self.parts else {}
        if bool(self.loss_bad):
            raise TrainingDivergedError(
                f"training diverged at step {step}: non-finite loss on a rank (this rank: {parts}); no optimizer "
                f"step was taken with it; {_DIVERGED_HINT}",
                step,
            )
        bad = [n for (n, _), b in zip(self.named, self.grads_bad.tolist()) if b]
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise TrainingDivergedError(
            f"training diverged at step {step}: non-finite gradient (loss {parts['loss']:.4g} is finite) "
            f"in {shown}; no optimizer step was taken with it; {_DIVERGED_HINT}",
            step,
        )
