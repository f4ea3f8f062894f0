"""Softmax attention, the MSP baseline and the reference of every benchmark (docs/derivations.md §1)."""

from __future__ import annotations

import torch.nn.functional as F

from gpattn.attention.base import AttentionBase
from gpattn.attention.registry import register

__all__ = ["SoftmaxAttention"]


@register("softmax")
class SoftmaxAttention(AttentionBase):
    r"""Scaled dot-product attention :math:`\mathrm{softmax}(q k^\top/\sqrt{D_h} + \text{mask}) v`
    through ``torch.nn.functional.scaled_dot_product_attention``.

    :param dropout: dropout on the attention weights (training mode only).
    """

    projections = ("q", "k", "v")

    def __init__(self, embed_dim: int, num_heads: int, *, dropout: float = 0.0, **base):
        super().__init__(embed_dim, num_heads, **base)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.dropout = dropout

    def _attend(self, x, mask):
        p = self.project(x)
        attn_mask = None if mask is None else ~mask[:, None, None, :]  # shape: (B, 1, 1, T), True = attend
        return F.scaled_dot_product_attention(
            p["q"], p["k"], p["v"], attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
        )
