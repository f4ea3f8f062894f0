"""Pre-LN transformer blocks over any registered attention, with deep-GP sample propagation on a leading sample
axis ``(P, B, T, D)`` (:mod:`gpattn.attention._samples`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpytorch.kernels import Kernel

from gpattn._settings import is_deterministic
from gpattn.attention._masks import check_num_samples
from gpattn.attention._samples import has_sample_axis, over_sample_rows
from gpattn.attention.base import AttentionBase
from gpattn.attention.registry import build_attention

__all__ = [
    "Block",
    "Encoder",
    "EncoderSpec",
    "MCDropout",
    "attend_samples",
    "pool_tokens",
    "resolve_attention_layers",
    "sample_logits",
]


def sample_logits(logits: torch.Tensor, num_samples: int) -> torch.Tensor:
    """A classifier's output, ``(B, P, C)``, from its head's: the logits of the P samples, or the one result of a
    forward in which nothing sampled repeated P times.  # shape: (P, B, C) or (B, C) -> (B, P, C)"""
    if logits.dim() == 2:
        return logits.unsqueeze(1).expand(-1, num_samples, -1).contiguous()
    return logits.transpose(0, 1).contiguous()


def attend_samples(attn: nn.Module, x: torch.Tensor, mask, num_samples: int | None = None) -> torch.Tensor:
    """A block's attention over the sample axis: a gpattn layer takes the axis itself (``num_samples=P``: P draws
    from one factorisation per input; a sample axis in: one draw per incoming sample); any other attention module is
    adapted at its boundary, on the P·B rows (:func:`gpattn.attention._samples.over_sample_rows`).
    # shape: x (B, T, D) or (P, B, T, D), mask (B, T) -> (B, T, D) or (P, B, T, D)"""
    if isinstance(attn, AttentionBase):
        return attn(x, mask, num_samples=num_samples)
    return over_sample_rows(attn, x, mask, num_samples=num_samples)


def pool_tokens(h: torch.Tensor, mask: torch.Tensor | None, cls: bool) -> torch.Tensor:
    """The first (CLS) token, or the mean over the real tokens (padding left out); a leading sample axis is kept.

    # shape: h (B, T, D) or (P, B, T, D), mask (B, T) bool (True = padding) or None -> (B, D) or (P, B, D)"""
    if cls:
        return h[..., 0, :]
    if mask is None:
        return h.mean(-2)
    keep = (~mask).unsqueeze(-1).to(h.dtype)
    return (h * keep).sum(-2) / keep.sum(-2).clamp_min(1.0)


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
        """# shape: (B, T, D) or (P, B, T, D): with a sample axis the masks are drawn on the P·B rows, batch-major
        (:mod:`gpattn.attention._samples`), as for the batch repeated P times"""
        if not self.active:
            return x
        return over_sample_rows(lambda rows: F.dropout(rows, self.p, training=True), x)

    def extra_repr(self):
        return f"p={self.p}, mc={self.mc}"


class Block(nn.Module):
    """x + attn(LN(x)); x + MLP(LN(x)).  # shape: (B, T, D) or (P, B, T, D) -> (B, T, D) or (P, B, T, D)"""

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
        """``num_samples=P``: this block takes the model's P draws: a gpattn attention draws them from one
        factorisation of each input and returns ``(P, B, T, D)``, over which the residual stream, the LayerNorms,
        the MLP and the dropout broadcast; any other attention module runs on its input repeated P times
        (:func:`attend_samples`). ``x`` with a sample axis: one draw per incoming sample.
        # shape: x (B, T, D) or (P, B, T, D), mask (B, T) -> (B, T, D), or (P, B, T, D)"""
        a = attend_samples(self.attn, self.norm1(x), mask, num_samples)
        x = x + self.drop(a)
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


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
    """The settings of an :class:`Encoder`, with their defaults and checks in one place: the encoder's
    arguments (positional in this order, or by name) and the keyword arguments
    :class:`gpattn.models.TransformerClassifier` and :class:`gpattn.models.ViTClassifier` pass on to it.

    :param embed_dim: model width D (divisible by ``num_heads``).
    :param num_heads: H.
    :param num_layers: the number of pre-LN blocks.
    :param attention: a registered name or a callable ``(embed_dim, num_heads, **options) -> nn.Module``.
    :param attention_options: the variant's options (a kernel instance among them is copied per layer).
    :param attention_layers: ``"all"``, ``"last"`` (Chen et al.'s (2024) KEP-SVGP default) or layer indices;
        the other layers use softmax attention.
    :param mlp_ratio: the MLP's hidden width over D.
    :param dropout: the dropout probability after the attention, in the MLP (and of the classifiers' embeddings).
    :param mc_dropout: keep dropout on at prediction time (MC dropout baseline).
    """

    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    attention: str | Callable[..., nn.Module] = "softmax"
    attention_options: dict | None = None
    attention_layers: str | Sequence[int] = "all"
    mlp_ratio: float = 2.0
    dropout: float = 0.1
    mc_dropout: bool = False

    def __post_init__(self):
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {self.num_layers!r}")
        resolve_attention_layers(self.attention_layers, self.num_layers)  # its ValueError names the argument

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names, in the encoder's positional order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, owner: type, settings: dict) -> EncoderSpec:
        """The settings ``owner`` (a class taking them as ``**encoder``) was given; an unknown keyword is a
        ``TypeError`` naming it and every keyword ``owner`` takes."""
        unknown = sorted(set(settings) - set(cls.names()))
        if unknown:
            valid = ", ".join(inspect.signature(owner).parameters)
            raise TypeError(
                f"{owner.__name__}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; it takes "
                f"{valid}"
            )
        return cls(**settings)

    def settings(self) -> dict:
        """The settings by name (the values themselves, not copies)."""
        return {name: getattr(self, name) for name in self.names()}


def with_encoder_settings(cls: type, kind=inspect.Parameter.KEYWORD_ONLY) -> type:
    """``cls`` whose ``__init__(..., **encoder)`` shows :class:`EncoderSpec`'s settings, with their defaults, as
    its parameters of ``kind`` in its signature (``help()``, ``inspect.signature``)."""
    init = inspect.signature(cls.__init__)
    own = [p for p in init.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    settings = [p.replace(kind=kind) for p in inspect.signature(EncoderSpec).parameters.values()]
    cls.__init__.__signature__ = init.replace(parameters=[*own, *settings])
    return cls


@functools.partial(with_encoder_settings, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
class Encoder(nn.Module):
    """A stack of pre-LN blocks; the layers named by ``attention_layers`` use ``attention``, the others
    softmax attention. ``loss_terms()`` sums every attention layer's terms of the last forward.

    Arguments: :class:`EncoderSpec`'s settings, positional in its order or by name:
    ``Encoder(embed_dim, num_heads, num_layers, attention="softmax", attention_options=None,
    attention_layers="all", mlp_ratio=2.0, dropout=0.1, mc_dropout=False)``."""

    def __init__(self, *settings, **named):
        super().__init__()
        spec = EncoderSpec(*settings, **named)
        chosen = set(resolve_attention_layers(spec.attention_layers, spec.num_layers))
        options = dict(spec.attention_options or {})
        D, H = spec.embed_dim, spec.num_heads
        self.blocks = nn.ModuleList(
            Block(
                _make_attention(spec.attention, D, H, options) if i in chosen else build_attention("softmax", D, H),
                D,
                spec.mlp_ratio,
                spec.dropout,
                spec.mc_dropout,
            )
            for i in range(spec.num_layers)
        )
        self.norm = nn.LayerNorm(D)

    def forward(self, x, mask, num_samples: int = 1):
        """# shape: x (B, T, D), mask (B, T) -> (P, B, T, D), P = num_samples"""
        P = check_num_samples(num_samples, optional=False)
        x = self.propagate(x, mask, P)
        return x if has_sample_axis(x) else x.expand(P, *x.shape)

    def propagate(self, x, mask, num_samples: int | None):
        """Run the stack: the first block that samples takes the P draws (``num_samples``; a gpattn attention from
        one factorisation per input, :meth:`Block.forward`), every later block propagates one sample per incoming
        sample (deep GP) on the ``(P, B, T, D)`` stream, and the deterministic blocks below it run once per input
        (in eval mode a softmax model runs once, not P times). ``num_samples`` None (or x with the axis already):
        no block takes draws.  # shape: x (B, T, D) or (P, B, T, D) -> (B, T, D) or (P, B, T, D)"""
        for block in self.blocks:
            draws = num_samples if num_samples is not None and block.samples and not has_sample_axis(x) else None
            x = block(x, mask, num_samples=draws)
        return self.norm(x)

    def attention_modules(self) -> list[nn.Module]:
        return [b.attn for b in self.blocks]

    def layer_diagnostics(self) -> list[dict]:
        """Per GP attention layer of the last forward: its index, its loss terms and its output scale
        (:meth:`~gpattn.attention._records.ForwardRecords.diagnostics`), as detached 0-dim tensors."""
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
