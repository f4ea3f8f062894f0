"""Pre-LN transformer blocks over any registered attention, with deep-GP sample propagation."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpytorch.kernels import Kernel

from gpattn._settings import is_deterministic
from gpattn.attention.base import AttentionBase
from gpattn.attention.registry import build_attention

__all__ = ["Block", "Encoder", "MCDropout", "pool_tokens", "repeat_samples", "resolve_attention_layers"]


def repeat_samples(x: torch.Tensor, mask: torch.Tensor | None, num_samples: int):
    """Fold a B-major Monte-Carlo axis into the batch.  # shape: (B, ...) -> (B·P, ...)"""
    if num_samples == 1:
        return x, mask
    return x.repeat_interleave(num_samples, dim=0), None if mask is None else mask.repeat_interleave(num_samples, 0)


def pool_tokens(h: torch.Tensor, mask: torch.Tensor | None, cls: bool) -> torch.Tensor:
    """The first (CLS) token, or the mean over the real tokens (padding left out).

    # shape: h (B, T, D), mask (B, T) bool (True = padding) or None -> (B, D)"""
    if cls:
        return h[:, 0]
    if mask is None:
        return h.mean(1)
    keep = (~mask).unsqueeze(-1).to(h.dtype)
    return (h * keep).sum(1) / keep.sum(1).clamp_min(1.0)


class MCDropout(nn.Module):
    """Dropout that stays on in eval mode when ``mc=True`` (MC dropout, Gal & Ghahramani 2016), and is
    off inside ``gpattn.deterministic()``."""

    def __init__(self, p: float = 0.0, mc: bool = False):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p!r}")
        self.p, self.mc = p, mc

    @property
    def active(self) -> bool:
        """Whether this forward drops units (so it is random)."""
        return self.p > 0 and (self.training or self.mc) and not is_deterministic()

    def forward(self, x):
        return F.dropout(x, self.p, training=True) if self.active else x

    def extra_repr(self):
        return f"p={self.p}, mc={self.mc}"


class Block(nn.Module):
    """x + attn(LN(x)); x + MLP(LN(x)).  # shape: (B·P, T, D) -> (B·P, T, D)"""

    def __init__(self, attention: nn.Module, embed_dim: int, mlp_ratio: float, dropout: float, mc_dropout: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim)
        self.attn = attention
        self.norm2 = nn.LayerNorm(embed_dim)
        hidden = max(1, int(round(embed_dim * mlp_ratio)))
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, hidden), nn.GELU(), MCDropout(dropout, mc_dropout), nn.Linear(hidden, embed_dim)
        )
        self.drop = MCDropout(dropout, mc_dropout)

    @property
    def samples(self) -> bool:
        """Whether this block's forward is random: a sampling attention (an attention module without
        the ``sampling`` flag counts as one) or active dropout."""
        return bool(getattr(self.attn, "sampling", True)) or any(
            m.active for m in self.modules() if isinstance(m, MCDropout)
        )

    def forward(self, x, mask, num_samples: int | None = None):
        """``num_samples=P``: the attention draws P samples per input (a gpattn layer factorises once,
        :meth:`gpattn.attention.base.AttentionBase.forward`) and the residual stream is repeated to
        match.  # shape: (B, T, D) -> (B·P, T, D), B-major"""
        if num_samples is None:
            x = x + self.drop(self.attn(self.norm1(x), mask))
        else:
            a = self.attn(self.norm1(x), mask, num_samples=num_samples)  # shape: (B·P, T, D)
            x = x.repeat_interleave(num_samples, 0) + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x)))


def resolve_attention_layers(attention_layers, num_layers: int) -> list[int]:
    """``"all"``, ``"last"`` or a list of layer indices (negative allowed) -> sorted indices."""
    if attention_layers == "all":
        return list(range(num_layers))
    if attention_layers == "last":
        return [num_layers - 1]
    if isinstance(attention_layers, Sequence) and not isinstance(attention_layers, str):
        out = set()
        for i in attention_layers:
            if isinstance(i, bool) or not isinstance(i, int) or not -num_layers <= i < num_layers:
                raise ValueError(f"attention_layers entries must be ints in [{-num_layers}, {num_layers}), got {i!r}")
            out.add(i % num_layers)
        return sorted(out)
    raise ValueError(f"attention_layers must be 'all', 'last' or a list of layer indices, got {attention_layers!r}")


def _make_attention(attention, embed_dim, num_heads, options) -> nn.Module:
    if callable(attention) and not isinstance(attention, str):
        layer = attention(embed_dim, num_heads, **options)
        if not isinstance(layer, nn.Module):
            raise ValueError(f"attention callable must return an nn.Module, got {type(layer)}")
        return layer
    # a kernel instance in the options is copied per layer: layers never share hyper-parameters
    options = {k: copy.deepcopy(v) if isinstance(v, Kernel) else v for k, v in options.items()}
    return build_attention(attention, embed_dim, num_heads, **options)


class Encoder(nn.Module):
    """A stack of pre-LN blocks; the layers named by ``attention_layers`` use ``attention``, the others
    softmax attention. ``loss_terms()`` sums every attention layer's terms of the last forward."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        attention: str | Callable[..., nn.Module] = "softmax",
        attention_options: dict | None = None,
        attention_layers="all",
        mlp_ratio: float = 2.0,
        dropout: float = 0.1,
        mc_dropout: bool = False,
    ):
        super().__init__()
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        chosen = set(resolve_attention_layers(attention_layers, num_layers))
        options = dict(attention_options or {})
        self.blocks = nn.ModuleList(
            Block(
                _make_attention(attention, embed_dim, num_heads, options)
                if i in chosen
                else build_attention("softmax", embed_dim, num_heads),
                embed_dim,
                mlp_ratio,
                dropout,
                mc_dropout,
            )
            for i in range(num_layers)
        )
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x, mask, num_samples: int = 1):
        """# shape: x (B, T, D), mask (B, T) -> (B·P, T, D), P = num_samples, B-major"""
        x, mask, pending = self.propagate(x, mask, num_samples)
        return repeat_samples(x, mask, pending)[0]

    def propagate(self, x, mask, num_samples: int = 1):
        """Run the stack with an explicit sample axis: the first block that samples draws the
        ``num_samples`` samples (a gpattn attention from one factorisation per input; any other
        attention module on the batch repeated B-major just before it), and every later block
        propagates one sample per incoming sample (deep-GP). The deterministic blocks below it run
        once per input (in eval mode a softmax model runs once, not P times). Returns
        ``(x, mask, pending)``: x and mask have ``B·P/pending`` rows and the caller still owes a
        repeat by ``pending``."""
        for block in self.blocks:
            if num_samples > 1 and block.samples:
                if isinstance(block.attn, AttentionBase):
                    x = block(x, mask, num_samples=num_samples)
                    mask = None if mask is None else mask.repeat_interleave(num_samples, 0)
                    num_samples = 1
                    continue
                x, mask = repeat_samples(x, mask, num_samples)
                num_samples = 1
            x = block(x, mask)
        return self.norm(x), mask, num_samples

    def attention_modules(self) -> list[nn.Module]:
        return [b.attn for b in self.blocks]

    def layer_diagnostics(self) -> list[dict]:
        """Per GP attention layer of the last forward: its index, its loss terms and its output scale
        (:meth:`gpattn.attention.base.AttentionBase.diagnostics`), as detached 0-dim tensors."""
        rows = []
        for i, layer in enumerate(self.attention_modules()):
            diag = layer.diagnostics() if hasattr(layer, "diagnostics") else {}
            if diag:
                terms = {k: v.detach() for k, v in layer.loss_terms().items()}
                rows.append({"layer": i, **terms, **diag})
        return rows

    def loss_terms(self) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for layer in self.attention_modules():
            terms = layer.loss_terms() if hasattr(layer, "loss_terms") else {}
            for key, val in terms.items():
                total[key] = total[key] + val if key in total else val
        return total
