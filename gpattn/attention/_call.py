"""One forward of an attention layer as explicit objects: what the layer prepares for its variant
(:class:`AttentionCall`) and what the variant returns (:class:`Attended`). Nothing of a forward is kept
on the layer but its records (GPyTorch's added loss terms and the diagnostics, updated in place).

A forward runs :func:`prepare_call` (inputs and masks checked, masks joined, the all-padding rows and
the sample axis settled), the variant's ``_attend(call)``, then :func:`finish_call` (rows with no allowed
key zeroed, heads merged, ``W_o``, the all-padding rows zeroed, the output given its leading sample axis
``(P, B, T, D)`` when the caller asked for P samples: :mod:`gpattn.attention._samples`).
"""

from __future__ import annotations

import dataclasses

import torch

from gpattn.attention._masks import (
    attn_mask_excluded,
    check_cross_inputs,
    check_cross_mask,
    check_inputs,
    check_num_samples,
    effective_mask,
    padding_part,
    pads_only,
)
from gpattn.attention._samples import sample_axis, sample_rows
from gpattn.variational._strategy import kept_mean

__all__ = ["Attended", "AttentionCall"]


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
    """One forward's inputs as a variant's ``_attend(call)`` reads them (prepared once by the layer).

    :ivar x: the layer input: the queries' (and, in self-attention, the keys' and values').  # shape: (B, T, D)
    :ivar mask: the mask to attend under (True = excluded), or None: key padding ``(B, S)`` with every
        all-padding row unpadded (its output is zeroed afterwards), or, for a variant with
        ``per_query_masks``, a per-query mask ``(B or 1, H or 1, T, S)``; read it through
        :func:`gpattn.attention.excluded_keys`.
    :ivar keep: the sequences with at least one real key, or None when nothing is padded.  # shape: (B,)
    :ivar loss_mask: the caller's key padding, all-padding rows included, for per-token loss terms.  # (B, S)
    :ivar num_samples: P when the variant is to draw P samples from one factorisation
        (``native_samples`` variants while sampling), else None.
    :ivar sampling: whether this forward samples (a stochastic variant outside ``gpattn.deterministic()``).
    :ivar need_weights: whether the caller asked for the attention weights (return them in :class:`Attended`).
    :ivar empty: per-query rows with no allowed key (their output is zeroed), or None.  # (B or 1, H or 1, T, 1)
    :ivar samples: the P samples the caller asked for (the output gets a leading sample axis), or None.
    :ivar repeated: the rows per input in ``x``: P where the batch was repeated for a stochastic variant that cannot
        draw P samples itself (row b·P + p is sample p of input b), else 1.
    :ivar context: cross-attention's keys' and values' input, or None: self-attention, the keys are ``x``'s
        (S = T). Read the keys' input as :attr:`kv_input`.  # shape: (B, S, D)
    """

    x: torch.Tensor
    mask: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    num_samples: int | None = None
    sampling: bool = False
    need_weights: bool = False
    empty: torch.Tensor | None = None
    samples: int | None = None
    repeated: int = 1
    context: torch.Tensor | None = None

    @property
    def kv_input(self) -> torch.Tensor:
        """The input the keys and values are projected from: ``context``, or ``x`` in self-attention.
        # shape: (B, S, D)"""
        return self.x if self.context is None else self.context

    def batch_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over the batch axis 0 of the sequences with at least one real key (all-padding rows left
        out, without a host read): how a per-sequence loss term is reduced.  # shape: (B, ...) -> (...)"""
        return kept_mean(t, self.keep)


@dataclasses.dataclass(eq=False)
class Attended:
    """What a variant's ``_attend`` returns (a bare tensor is read as ``Attended(heads)``).

    :ivar heads: the per-head outputs, one row per sequence, or ``num_samples`` draws per sequence on a leading
        axis (gpytorch's ``rsample(P)``).  # shape: (B, H, T, Dv) or (P, B, H, T, Dv)
    :ivar mean: a GP variant's posterior mean of the heads (its diagnostics read it), else None.  # (B, H, T, Dv)
    :ivar weights: the attention weights when ``call.need_weights`` and the variant has them.  # (B, H, T, T)
    """

    heads: torch.Tensor
    mean: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    @classmethod
    def of(cls, result) -> Attended:
        """``result`` of a variant's ``_attend``: an :class:`Attended`, a tensor of heads, or ``(heads, mean)``."""
        if isinstance(result, Attended):
            return result
        if isinstance(result, tuple):
            return cls(*result)
        return cls(result)


def prepare_call(
    layer, x, key_padding_mask=None, num_samples=None, attn_mask=None, need_weights=False, context=None
) -> AttentionCall:
    """The :class:`AttentionCall` of one forward of ``layer`` (inputs checked; an ``attn_mask`` that pads
    joins ``key_padding_mask``; the batch repeated P times for a stochastic variant that cannot draw P
    samples itself). ``context``: cross-attention's keys' and values' input (``key_padding_mask`` and
    ``attn_mask``'s columns are then over its S tokens), or None for self-attention."""
    x, context, key_padding_mask = check_call_inputs(layer, x, key_padding_mask, context)
    P = 1 if num_samples is None else check_num_samples(num_samples)
    excluded = empty = None
    if attn_mask is not None:
        S = x.shape[1] if context is None else context.shape[1]
        excluded = attn_mask_excluded(attn_mask, x.shape[0], layer.num_heads, x.shape[1], S)
        if excluded.device != x.device:
            raise ValueError(f"attn_mask is on {excluded.device} but x is on {x.device}")
        if context is not None:
            check_cross_mask(layer, excluded)
        if not layer.per_query_masks or ((layer.is_gp or layer.fused_key_padding) and pads_only(excluded)):  # padding
            pad = padding_part(excluded, x.shape[0], layer.name, layer.per_query_masks)
            key_padding_mask, excluded = (pad if key_padding_mask is None else key_padding_mask | pad), None
    sampling, repeated = layer.sampling, 1
    if P > 1 and sampling and not layer.native_samples:  # batch-major rows, as :mod:`gpattn.attention._samples`
        x, context, key_padding_mask = (
            None if t is None else t.repeat_interleave(P, 0) for t in (x, context, key_padding_mask)
        )
        if excluded is not None and excluded.shape[0] > 1:
            excluded = excluded.repeat_interleave(P, 0)
        P, repeated = 1, P
    mask, keep = effective_mask(key_padding_mask)
    if excluded is not None:  # per-query mask: padding joined in, queries with no allowed key opened
        if mask is not None:
            excluded = excluded | mask[:, None, None, :]
        empty = excluded.all(-1, keepdim=True)  # shape: (B or 1, H or 1, T, 1)
        mask = excluded if layer.is_gp else excluded & ~empty
    native = P if P > 1 and sampling else None
    return AttentionCall(
        x, mask, keep, key_padding_mask, native, sampling, bool(need_weights), empty, num_samples, repeated, context
    )


def check_call_inputs(layer, x, key_padding_mask, context):
    """``(x, context, key_padding_mask)`` checked; a variant whose model needs the same inputs on both sides
    refuses a ``context`` (its ``no_cross_attention`` says why)."""
    if context is None:
        x, key_padding_mask = check_inputs(x, key_padding_mask, layer.embed_dim)
        return x, None, key_padding_mask
    if not layer.cross_attention:
        why = layer.no_cross_attention or "its _attend does not read call.context (opt in: cross_attention = True)"
        raise ValueError(
            f"attention {layer.name or type(layer).__name__!r} does not take cross-attention (a context other "
            f"than x): {why}"
        )
    return check_cross_inputs(x, context, key_padding_mask, layer.embed_dim)


def finish_call(layer, call: AttentionCall, out: Attended) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, weights)`` of one forward from the variant's heads: rows with no allowed key zeroed, heads
    merged, ``W_o``, the diagnostics of a GP variant in training, all-padding sequences zeroed, and, when the caller
    asked for P samples, the leading sample axis: the variant's own draws as they are, the rows of a repeated batch
    viewed as it, a forward that did not sample expanded (a view).  # -> (B, T, D) or (P, B, T, D)"""
    heads, weights, empty = out.heads, out.weights, call.empty
    drawn = heads.shape[0] if heads.dim() == 5 else 1  # P when the variant drew the samples, else 1
    if empty is not None:  # only variants with per-query masks; (B or 1, H or 1, T, 1) broadcasts over P
        heads = heads.masked_fill(empty, 0)
        weights = None if weights is None else weights.masked_fill(empty, 0)
    *lead, H, T, Dv = heads.shape
    y = layer.out_proj(heads.transpose(-3, -2).reshape(*lead, T, H * Dv))
    if empty is not None:
        y = y.masked_fill(empty.all(1), 0)  # a query with no allowed key in any head: output 0
    if out.mean is not None and layer.training:  # the trainer reads them; prediction skips the extra W_o
        real = call.loss_mask if call.context is None else None  # cross-attention: the queries are not padded
        rows = [t if t is None or drawn == 1 else t.repeat_interleave(drawn, 0) for t in (call.x, real, out.mean)]
        draws = heads if drawn == 1 else sample_rows(heads)  # the P·B rows, batch-major
        layer._diagnostics.update(output_scale(layer.out_proj, *rows[:2], draws, rows[2]))
    if call.keep is not None:  # all-padding sequences: output 0 (masked arithmetic, no host read)
        y = y.masked_fill_(~call.keep[:, None, None], 0)  # y is W_o's fresh output
    weights = weights if call.need_weights else None
    if call.samples is None or drawn > 1:
        return y, weights
    if call.repeated > 1:
        return sample_axis(y, call.repeated), (None if weights is None else sample_axis(weights, call.repeated))
    return y.expand(call.samples, *y.shape), weights


@torch.no_grad()
def output_scale(out_proj, x, mask, heads, mean) -> dict[str, torch.Tensor]:
    """A GP layer's output scale against its input, per real token
    (:meth:`~gpattn.attention._records.ForwardRecords.diagnostics`): detached 0-dim tensors, no host synchronisation.
    One ``W_o`` product for the mean and the spread and one norm for the three (a few operators per forward).
    # shape: x (B, T, D), heads, mean (B, H, T, Dv), mask (B, T) or None"""
    B, H, T, Dv = heads.shape
    parts = torch.stack([mean, heads - mean]).transpose(2, 3).reshape(2, B, T, H * Dv)  # E f, f − E f
    out = parts @ out_proj.weight.mT  # shape: (2, B, T, D): W_o E f, W_o (f − E f)
    mean_out = out[0] if out_proj.bias is None else out[0] + out_proj.bias  # E[layer output]
    norms = torch.stack([x.float(), mean_out.float(), out[1].float()]).norm(dim=-1)  # shape: (3, B, T)
    norms = norms.to(torch.promote_types(norms.dtype, x.dtype))  # reduced in x's precision if higher
    if mask is None:
        per_token = norms.mean((1, 2))
    else:
        real = (~mask).to(norms.dtype)
        per_token = (norms * real).sum((1, 2)) / real.sum().clamp_min(1)
    return dict(zip(("input_norm", "mean_norm", "spread_norm"), per_token.unbind()))
