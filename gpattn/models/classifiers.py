"""Sequence and image classifiers over any registered attention.

Both return logits with an explicit Monte-Carlo axis: ``forward(inputs, key_padding_mask=None,
num_samples=P) -> (B, P, C)``. Samples propagate through depth as in a deep GP (docs/derivations.md §9): the first
layer that samples (a stochastic attention or active dropout) draws the P samples — a gpattn attention
factorises once per input and draws P times (``(B·P, T, D)`` inside the stack, B-major) — every later
layer draws one sample per incoming sample, and the deterministic layers below it run once per input;
a model that samples nothing (softmax in eval mode) returns P equal draws.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from gpattn._settings import is_validating
from gpattn.attention.registry import attention_options as attention_defaults
from gpattn.models._blocks import Encoder, MCDropout, pool_tokens, repeat_samples
from gpattn.objectives import LossTermWalkers

__all__ = ["TransformerClassifier", "ViTClassifier"]

#: constructor arguments both classifiers hand to the shared encoder/pooling/head base unchanged
_ENCODER_ARGS = (
    "embed_dim",
    "num_heads",
    "num_layers",
    "attention",
    "attention_options",
    "attention_layers",
    "mlp_ratio",
    "dropout",
    "mc_dropout",
    "pooling",
)


#: the kernel of kernel-based attention on images: Bui et al. §5.1 (after Chen & Li's (2023) SGPA) uses the ARD-RBF
#: kernel for SGPA and kernel attention on images and the exponential dot-product kernel on text
IMAGE_KERNEL = "ard-rbf"


def _image_attention_options(attention, options: dict | None) -> dict:
    """``options`` with ``kernel=IMAGE_KERNEL`` added when the variant's own default is the text kernel
    (``"exponential"``) and the caller chose none; a kernel given by the caller is kept."""
    options = dict(options or {})
    if isinstance(attention, str) and "kernel" not in options:
        defaults = attention_defaults(attention)
        if "kernel" in defaults and defaults["kernel"] in ("exponential", None):  # None: the variant's choice
            options["kernel"] = IMAGE_KERNEL
    return options


class _SequenceClassifier(LossTermWalkers, nn.Module):
    def __init__(
        self,
        num_classes: int,
        *,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        attention: str | Callable[..., nn.Module],
        attention_options: dict | None,
        attention_layers,
        mlp_ratio: float,
        dropout: float,
        mc_dropout: bool,
        pooling: str,
        max_tokens: int,
    ):
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        self.num_classes, self.embed_dim, self.pooling = num_classes, embed_dim, pooling
        self.max_tokens = max_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pooling == "cls" else None
        self.pos = nn.Parameter(torch.randn(1, max_tokens + (pooling == "cls"), embed_dim) * 0.02)
        self.embed_drop = MCDropout(dropout, mc_dropout)
        self.encoder = Encoder(
            embed_dim,
            num_heads,
            num_layers,
            attention,
            attention_options,
            attention_layers,
            mlp_ratio,
            dropout,
            mc_dropout,
        )
        self.head = nn.Linear(embed_dim, num_classes)

    def _embed(self, inputs, key_padding_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def forward(self, inputs, key_padding_mask=None, num_samples: int = 1) -> torch.Tensor:
        """# shape: inputs (B, T) ids | (B, T, F) features | (B, C, Hpx, Wpx) images -> logits (B, P, C)"""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        h, mask = self._embed(inputs, key_padding_mask)  # shape: (B, T, D), (B, T)
        B, T, _ = h.shape
        if T > self.max_tokens:
            raise ValueError(f"inputs have {T} tokens but the model was built for at most {self.max_tokens}")
        if self.cls_token is not None:
            h = torch.cat([self.cls_token.expand(B, 1, -1), h], dim=1)
            if mask is not None:
                mask = torch.cat([mask.new_zeros(B, 1), mask], dim=1)
        h = h + self.pos[:, : h.shape[1]]
        P = num_samples
        if self.embed_drop.active:  # embedding dropout samples: repeat before it
            h, mask = repeat_samples(h, mask, P)
            P = 1
        h, mask, P = self.encoder.propagate(self.embed_drop(h), mask, P)  # shape: (B·P/pending, T, D)
        logits = self.head(pool_tokens(h, mask, cls=self.cls_token is not None))  # shape: (B·P/pending, C)
        if P > 1:  # nothing sampled: every draw is the same
            logits = logits.unsqueeze(1).expand(-1, P, -1).reshape(-1, self.num_classes)
        return logits.view(B, num_samples, self.num_classes)

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """Loss terms of every attention layer in the last forward, summed over layers."""
        return self.encoder.loss_terms()

    def layer_diagnostics(self) -> list[dict]:
        """Per GP attention layer of the last forward: loss terms and output scale (``Encoder``)."""
        return self.encoder.layer_diagnostics()


class TransformerClassifier(_SequenceClassifier):
    """Pre-LN transformer over token ids ``(B, T)`` (with ``key_padding_mask``, True = padding) or
    dense features ``(B, T, F)``; mean (over real tokens) or CLS pooling.

    :param vocab_size: for token ids (``padding_idx`` 0); or
    :param input_dim: F, for dense features (exactly one of the two).
    :param attention: a registered name or a callable ``(embed_dim, num_heads, **options) -> nn.Module``.
    :param attention_layers: ``"all"``, ``"last"`` (Chen et al.'s (2024) KEP-SVGP default) or layer indices;
        the other layers use softmax attention.
    :param mc_dropout: keep dropout on at prediction time (MC dropout baseline).
    """

    def __init__(
        self,
        num_classes: int,
        *,
        vocab_size: int | None = None,
        input_dim: int | None = None,
        max_len: int = 512,
        embed_dim: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        attention: str | Callable[..., nn.Module] = "softmax",
        attention_options: dict | None = None,
        attention_layers="all",
        mlp_ratio: float = 2.0,
        dropout: float = 0.1,
        mc_dropout: bool = False,
        pooling: str = "mean",
    ):
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("give exactly one of vocab_size (token ids) or input_dim (dense features)")
        shared = {k: v for k, v in locals().items() if k in _ENCODER_ARGS}
        super().__init__(num_classes, max_tokens=max_len, **shared)
        self.vocab_size, self.input_dim = vocab_size, input_dim
        if vocab_size is not None:
            self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        else:
            self.embed = nn.Linear(input_dim, embed_dim)

    def _embed(self, inputs, key_padding_mask):
        if not torch.is_tensor(inputs):
            raise ValueError(f"inputs must be a tensor, got {type(inputs)}")
        if self.vocab_size is not None:
            if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"inputs must be token ids of shape (B, T) and integer dtype, got {tuple(inputs.shape)} "
                    f"{inputs.dtype}"
                )
            if is_validating() and inputs.numel() and bool(((inputs < 0) | (inputs >= self.vocab_size)).any()):
                raise ValueError(f"token ids must lie in [0, vocab_size={self.vocab_size})")
        elif inputs.dim() != 3 or inputs.shape[-1] != self.input_dim:
            raise ValueError(f"inputs must have shape (B, T, input_dim={self.input_dim}), got {tuple(inputs.shape)}")
        if key_padding_mask is not None and (
            not torch.is_tensor(key_padding_mask)
            or key_padding_mask.dtype != torch.bool
            or key_padding_mask.shape != inputs.shape[:2]
        ):
            got = (
                (key_padding_mask.dtype, tuple(key_padding_mask.shape))
                if torch.is_tensor(key_padding_mask)
                else type(key_padding_mask)
            )
            raise ValueError(f"key_padding_mask must be bool of shape (B, T) = {tuple(inputs.shape[:2])}, got {got}")
        return self.embed(inputs), key_padding_mask


class ViTClassifier(_SequenceClassifier):
    """Vision transformer: non-overlapping ``patch_size`` patches of ``(B, C, Hpx, Wpx)`` images, a
    linear patch embedding, CLS (default) or mean pooling. Other arguments as ``TransformerClassifier``.

    Variants whose kernel defaults to the text kernel (``sgpa``, ``sgpa-decoupled``, ``kernel``,
    ``kernel-asym``: exponential dot product) get the ARD-RBF kernel here, as in the papers' image
    experiments, unless ``attention_options`` names a kernel."""

    def __init__(
        self,
        num_classes: int,
        *,
        image_shape: tuple[int, int, int],
        patch_size: int = 2,
        embed_dim: int = 64,
        num_heads: int = 4,
        num_layers: int = 2,
        attention: str | Callable[..., nn.Module] = "softmax",
        attention_options: dict | None = None,
        attention_layers="all",
        mlp_ratio: float = 2.0,
        dropout: float = 0.1,
        mc_dropout: bool = False,
        pooling: str = "cls",
    ):
        C, Hpx, Wpx = image_shape
        if Hpx % patch_size or Wpx % patch_size:
            raise ValueError(f"image size {Hpx}x{Wpx} is not divisible by patch_size={patch_size}")
        num_patches = (Hpx // patch_size) * (Wpx // patch_size)
        attention_options = _image_attention_options(attention, attention_options)
        shared = {k: v for k, v in locals().items() if k in _ENCODER_ARGS}
        super().__init__(num_classes, max_tokens=num_patches, **shared)
        self.image_shape, self.patch_size = tuple(image_shape), patch_size
        self.embed = nn.Linear(C * patch_size * patch_size, embed_dim)

    def _embed(self, inputs, key_padding_mask):
        if key_padding_mask is not None:
            raise ValueError("ViTClassifier takes no key_padding_mask (every patch is real)")
        if not torch.is_tensor(inputs) or inputs.dim() != 4 or tuple(inputs.shape[1:]) != self.image_shape:
            got = tuple(inputs.shape) if torch.is_tensor(inputs) else type(inputs)
            raise ValueError(f"inputs must be images of shape (B, *{self.image_shape}), got {got}")
        p = self.patch_size
        B, C, Hh, Ww = inputs.shape
        patches = inputs.reshape(B, C, Hh // p, p, Ww // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        return self.embed(patches), None
