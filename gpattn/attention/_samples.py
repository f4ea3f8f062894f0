"""The Monte-Carlo sample axis as a tensor axis: ``(P, B, ...)``, leading, from the first layer that samples to
the head (docs/derivations.md §9; the layout of gpytorch's ``rsample(num_samples)`` and of GPflux's ``GPLayer``).

A gpattn layer called with ``num_samples=P`` on ``(B, T, D)`` returns ``(P, B, T, D)``; a layer given
``(P, B, T, D)`` draws one sample per incoming sample. Modules that broadcast over leading axes (LayerNorm,
Linear, the MLP) take the axis as it is. Whatever needs rows instead — a later layer's own computation, a foreign
module, a dropout mask — runs on the P·B rows **batch-major** (row b·P + p is sample p of input b), through
:func:`sample_rows` and :func:`sample_axis` here: the order in which every random draw over the samples is taken
(a GP layer's P draws included, :func:`gpattn.variational._linalg.standard_normal`), so that a fixed seed gives the
draws of the batch repeated P times in front of the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpattn.attention._masks import attn_mask_excluded

__all__ = ["attend_sample_rows", "has_sample_axis", "over_sample_rows", "sample_axis", "sample_rows"]


def has_sample_axis(x: torch.Tensor) -> bool:
    """Whether a model stream carries the sample axis.  # shape: (P, B, T, D) -> True, (B, T, D) -> False"""
    return x.dim() == 4


def sample_rows(x: torch.Tensor) -> torch.Tensor:
    """The P·B rows of a tensor with a leading sample axis, batch-major (row b·P + p is sample p of input b); one
    copy, contiguous.  # shape: (P, B, ...) -> (B·P, ...)"""
    P, B = x.shape[:2]
    return x.transpose(0, 1).reshape(B * P, *x.shape[2:])


def sample_axis(rows: torch.Tensor, num_samples: int) -> torch.Tensor:
    """The inverse of :func:`sample_rows` (a view).  # shape: (B·P, ...) -> (P, B, ...)"""
    return rows.view(-1, num_samples, *rows.shape[1:]).transpose(0, 1)


def over_sample_rows(fn: Callable, x: torch.Tensor, *rows, num_samples: int | None = None) -> torch.Tensor:
    """``fn(x, *rows)`` for a module that knows no sample axis, adapted at its boundary. With a sample axis in
    ``x``, or ``num_samples=P`` for an ``x`` without one (this module takes the draws: ``x`` repeated P times),
    ``fn`` runs on the P·B rows, batch-major, each of ``rows`` (per-input tensors such as a mask, or None)
    repeated to match, and its output gets the axis back; with neither, ``fn(x, *rows)``.
    # shape: x (B, ...) or (P, B, ...), rows (B, ...) -> (P, B, ...)"""
    if num_samples is not None:  # x has no sample axis yet (the caller's contract): this module takes the draws
        x = x.expand(num_samples, *x.shape)
    elif not has_sample_axis(x):
        return fn(x, *rows)
    P = x.shape[0]
    out = fn(sample_rows(x), *(None if t is None else t.repeat_interleave(P, 0) for t in rows))
    return sample_axis(out, P)


def attend_sample_rows(layer, x, key_padding_mask, num_samples, attn_mask, need_weights, context):
    """``layer.attend`` of an ``x`` with a sample axis: one draw per incoming sample, on the P·B rows batch-major
    (the one place a gpattn layer flattens the axis); the masks and a context without the axis follow their input's
    rows.  # shape: x (P, B, T, D) -> (P, B, T, D), weights (P, B, H, T, S)"""
    if num_samples is not None:
        raise ValueError(
            f"num_samples={num_samples!r} with x of shape {tuple(x.shape)}: x already has a sample axis "
            f"(P, B, T, D) and the layer draws one sample per incoming sample; pass num_samples=None"
        )
    P, B, T = x.shape[:3]
    if attn_mask is not None:  # a per-input mask follows its input's rows
        S = T if context is None else context.shape[-2]
        attn_mask = attn_mask_excluded(attn_mask, B, layer.num_heads, T, S)
        attn_mask = attn_mask.repeat_interleave(P, 0) if attn_mask.shape[0] > 1 else attn_mask
    if context is not None:
        context = sample_rows(context) if has_sample_axis(context) else context.repeat_interleave(P, 0)
    kpm = None if key_padding_mask is None else key_padding_mask.repeat_interleave(P, 0)
    y, w = layer.attend(sample_rows(x), kpm, attn_mask=attn_mask, need_weights=need_weights, context=context)
    return sample_axis(y, P), (None if w is None else sample_axis(w, P))
