"""Softmax attention, the MSP baseline and the reference of every benchmark (docs/derivations.md §1)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gpattn.attention._call import Attended
from gpattn.attention.base import AttentionBase, excluded_keys
from gpattn.attention.registry import register

__all__ = ["SoftmaxAttention"]


@register("softmax")
class SoftmaxAttention(AttentionBase):
    r"""Scaled dot-product attention :math:`\mathrm{softmax}(q k^\top/\sqrt{D_h} + \text{mask}) v`
    through ``torch.nn.functional.scaled_dot_product_attention``.

    :param dropout: dropout on the attention weights (training mode only).
    """

    projections = ("q", "k", "v")
    per_query_masks = True  # any attn_mask: excluded keys leave the row (docs/derivations.md §11)
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)

    def __init__(self, embed_dim: int, num_heads: int, *, dropout: float = 0.0, **base):
        super().__init__(embed_dim, num_heads, **base)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout = dropout

    def _attend(self, call):
        pq, pk = self.project_call(call)  # cross-attention: queries of x, keys and values of the context
        excluded = excluded_keys(call.mask)  # shape: (B, 1, 1, S) or (B or 1, H or 1, T, S)
        dropout = self.dropout if self.training else 0.0
        if call.need_weights:  # the explicit path, which forms the weights
            scores = pq["q"] @ pk["k"].transpose(-1, -2) / math.sqrt(self.head_dim)  # shape: (B, H, T, S)
            if excluded is not None:
                scores = scores.masked_fill(excluded, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            return Attended(F.dropout(weights, dropout, self.training) @ pk["v"], weights=weights)
        return F.scaled_dot_product_attention(
            pq["q"], pk["k"], pk["v"], attn_mask=None if excluded is None else ~excluded, dropout_p=dropout
        )
