"""nn.MultiheadAttention's call on a gpattn layer: how torch's transformer layers call ``self_attn``,
adapted to the layer's own call (:meth:`gpattn.attention.AttentionBase.attend`)."""

from __future__ import annotations

import torch

from gpattn.attention._masks import as_excluded

__all__ = ["multihead_call"]


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
    """nn.MultiheadAttention's call on ``layer``, for self-attention (``AttentionBase.forward_mha``):
    ``query``, ``key`` and ``value`` must be the same tensor, (B, T, D) with the layer's ``batch_first``
    (the default) or (T, B, D). ``key_padding_mask`` (B, T) and ``attn_mask`` are bool (True = not allowed)
    or additive float (0 / −∞); ``is_causal=True`` without an ``attn_mask`` means the causal mask. Returns
    ``(output, weights)``: the weights, with ``need_weights``, where the variant has attention weights —
    (B, T, T) averaged over heads with ``average_attn_weights``, else (B, H, T, T) — and None otherwise
    (the GP variants)."""
    if key is not query or value is not query:
        raise ValueError(
            f"attention {layer.name!r} is self-attention: pass the same tensor as query, key and value "
            f"(got {'a different key' if key is not query else 'a different value'}); cross-attention is "
            f"not supported by any gpattn variant"
        )
    x = query if layer.batch_first else query.transpose(0, 1)
    if key_padding_mask is not None and torch.is_tensor(key_padding_mask):
        key_padding_mask = as_excluded(key_padding_mask, "key_padding_mask")
    if is_causal and attn_mask is None and torch.is_tensor(x) and x.dim() == 3:
        T = x.shape[1]
        attn_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    y, weights = layer.attend(x, key_padding_mask, attn_mask=attn_mask, need_weights=bool(need_weights))
    if weights is not None and average_attn_weights:
        weights = weights.mean(1)
    return (y if layer.batch_first else y.transpose(0, 1)), weights
