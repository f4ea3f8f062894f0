"""nn.MultiheadAttention's call on a gpattn layer: how torch's transformer layers call ``self_attn``,
adapted to the layer's own call (:meth:`gpattn.attention.AttentionBase.attend`)."""

from __future__ import annotations

import torch

from gpattn.attention._masks import as_excluded

__all__ = ["causal_mask", "multihead_call"]


def multihead_call(
    layer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """nn.MultiheadAttention's call on ``layer`` (``AttentionBase.forward_mha``), (B, T, D) with the layer's
    ``batch_first`` (the default) or (T, B, D). Self-attention: ``query``, ``key`` and ``value`` the same
    tensor. Cross-attention (docs/derivations.md §13): ``key`` and ``value`` one tensor (B, S, D), the
    layer's ``context``, other than ``query``; every variant projects its keys and values from the same
    tokens (a GP variant's key j and value j are one observation), so a ``value`` other than ``key`` is an
    error. ``key_padding_mask`` (B, S) and ``attn_mask`` (T, S) are bool (True = not allowed) or additive
    float (0 / −∞); ``is_causal=True`` without an ``attn_mask`` means the causal mask (T == S). Returns
    ``(output, weights)``: the weights, with ``need_weights``, where the variant has attention weights —
    (B, T, S) averaged over heads with ``average_attn_weights``, else (B, H, T, S) — and None otherwise
    (the GP variants)."""
    if value is not key:
        raise ValueError(
            f"attention {layer.name!r}: key and value must be the same tensor (got a different value): every "
            f"gpattn variant projects keys and values from the same tokens. Pass key=value=query for "
            f"self-attention, or key=value=the context (the encoder's output) for cross-attention"
        )
    x = query if layer.batch_first else query.transpose(0, 1)
    context = None if key is query else (key if layer.batch_first else key.transpose(0, 1))
    if key_padding_mask is not None and torch.is_tensor(key_padding_mask):
        key_padding_mask = as_excluded(key_padding_mask, "key_padding_mask")
    if is_causal and attn_mask is None and torch.is_tensor(x) and x.dim() == 3:
        attn_mask = causal_mask(x, context)
    y, weights = layer.attend(
        x, key_padding_mask, attn_mask=attn_mask, need_weights=bool(need_weights), context=context
    )
    if weights is not None and average_attn_weights:
        weights = weights.mean(1)
    return (y if layer.batch_first else y.transpose(0, 1)), weights


def causal_mask(x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
    """``is_causal``'s mask (True = not allowed): query i attends to keys j ≤ i. In cross-attention it is
    defined only for as many queries as keys (T == S); otherwise a ``ValueError``.  # shape: -> (T, T)"""
    T = x.shape[1]
    if context is not None and torch.is_tensor(context) and context.dim() == 3 and context.shape[1] != T:
        raise ValueError(
            f"is_causal=True in cross-attention needs as many queries as keys (the causal mask lets query i see "
            f"keys j <= i); got T={T} queries (query {tuple(x.shape)}) and S={context.shape[1]} keys "
            f"(key {tuple(context.shape)}). Pass is_causal=False, or an attn_mask of shape (T, S)"
        )
    return torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
