"""The fused input projection of an attention layer: one linear map ``in_proj`` for every named per-head
projection in the layer's ``projections`` (``("q", "k", "v")``, ``("qk", "v")``, ...), stacked in that order,
each H·Dh rows wide (H·Dv for the value projections, ``"v"`` and the correlated GPs' ``"v_mean"``).
:meth:`FusedProjection.projection_rows` says where each one sits;
read it rather than walking the widths by hand.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from gpattn.attention._call import AttentionCall

__all__ = ["VALUE_PROJECTIONS", "FusedProjection"]

#: the projections H·Dv wide: the values, and the separate values of cgp/scgp's softmax prior mean
VALUE_PROJECTIONS = ("v", "v_mean")


class FusedProjection:
    """The fused input projection, mixed into :class:`gpattn.attention.AttentionBase` (which sets
    ``projections``, ``embed_dim``, ``num_heads``, ``head_dim`` and ``value_dim``, then builds ``in_proj``
    with :meth:`_build_in_proj`)."""

    #: read by torch's transformer layers (an nn.MultiheadAttention attribute): False keeps
    #: nn.TransformerEncoderLayer's eval-mode fast path, which runs MHA's own fused kernel, off this layer
    _qkv_same_embed_dim = False

    def _build_in_proj(self, bias: bool) -> None:
        """``in_proj``: one matmul for every named projection (W_v maps to H·Dv); None without projections."""
        value_width = self.value_dim * self.num_heads
        widths = [value_width if p in VALUE_PROJECTIONS else self.embed_dim for p in self.projections]
        self._proj_widths = widths
        self.in_proj = nn.Linear(self.embed_dim, sum(widths), bias=bias) if widths else None

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """The fused input projection's bias (nn.MultiheadAttention's attribute, read by torch's transformer
        layers; gpattn's layout differs from MHA's, see ``_qkv_same_embed_dim``)."""
        return None if self.in_proj is None else self.in_proj.bias

    def projection_rows(self) -> dict[str, slice]:
        """Each named projection's rows of ``in_proj.weight`` and ``in_proj.bias`` (= its features of
        ``in_proj``'s output), in the order of ``projections``: with ``("qk", "v")``, D = H·Dh and Dv,
        ``{"qk": slice(0, D), "v": slice(D, D + H·Dv)}``."""
        ends = itertools.accumulate(self._proj_widths)
        return {name: slice(end - width, end) for name, width, end in zip(self.projections, self._proj_widths, ends)}

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, H·d) -> (B, H, T, d)"""
        B, T, HD = t.shape
        return t.view(B, T, self.num_heads, HD // self.num_heads).transpose(1, 2)

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-head projections of x, by name.  # shape: x (B, T, D) -> each (B, H, T, Dh or Dv)"""
        parts = self.in_proj(x).split(self._proj_widths, dim=-1)
        return {name: self.split_heads(p) for name, p in zip(self.projections, parts)}

    def project_call(self, call: AttentionCall) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(of the queries, of the keys)``: :meth:`project` of ``call.x`` and of ``call.context`` (the same
        dict in self-attention). Read queries from the first, keys and values from the second."""
        pq = self.project(call.x)
        return pq, (pq if call.context is None else self.project(call.context))
