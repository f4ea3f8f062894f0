"""Sequence and image classifiers over any registered attention.

Both return logits with an explicit Monte-Carlo axis: ``forward(inputs, key_padding_mask=None,
num_samples=P) -> (B, P, C)``. Samples propagate through depth as in a deep GP (docs/derivations.md §9) on a
leading sample axis, ``(P, B, T, D)`` between the blocks (:mod:`gpattn.attention._samples`): the first layer that
samples (a stochastic attention or active dropout) takes the P draws — a gpattn attention factorises once per input
and draws P times — every later layer draws one sample per incoming sample, and the deterministic layers below it
run once per input on ``(B, T, D)``; a model that samples nothing (softmax in eval mode) returns P equal draws.
With P = 1 no layer takes the axis (one draw per input, the same random numbers).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from gpattn._settings import is_validating
from gpattn.attention._masks import check_num_samples
from gpattn.attention.registry import attention_options as attention_defaults
from gpattn.models._blocks import Encoder, EncoderSpec, MCDropout, pool_tokens, sample_logits, with_encoder_settings
from gpattn.objectives import LossTermWalkers

__all__ = ["TransformerClassifier", "ViTClassifier"]

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
    def __init__(self, num_classes: int, encoder: EncoderSpec, *, pooling: str, max_tokens: int):
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        embed_dim = encoder.embed_dim
        self.num_classes, self.embed_dim, self.pooling = num_classes, embed_dim, pooling
        self.max_tokens = max_tokens
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pooling == "cls" else None
        self.pos = nn.Parameter(torch.randn(1, max_tokens + (pooling == "cls"), embed_dim) * 0.02)
        self.embed_drop = MCDropout(encoder.dropout, encoder.mc_dropout)
        self.encoder = Encoder(**encoder.settings())
        self.head = nn.Linear(embed_dim, num_classes)

    def _embed(self, inputs, key_padding_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def forward(self, inputs, key_padding_mask=None, num_samples: int = 1) -> torch.Tensor:
        """# shape: inputs (B, T) ids | (B, T, F) features | (B, C, Hpx, Wpx) images -> logits (B, P, C), the head's
        (P, B, C) with the sample axis second (the models' contract)"""
        P = check_num_samples(num_samples, optional=False)  # the model's one check of P
        h, mask = self._embed(inputs, key_padding_mask)  # shape: (B, T, D), (B, T)
        B, T, _ = h.shape
        if T > self.max_tokens:
            raise ValueError(f"inputs have {T} tokens but the model was built for at most {self.max_tokens}")
        if self.cls_token is not None:
            h = torch.cat([self.cls_token.expand(B, 1, -1), h], dim=1)
            if mask is not None:
                mask = torch.cat([mask.new_zeros(B, 1), mask], dim=1)
        h = h + self.pos[:, : h.shape[1]]
        draws = P if P > 1 else None
        if draws and self.embed_drop.active:  # embedding dropout samples: the sample axis starts here
            h, draws = h.expand(P, *h.shape), None
        h = self.encoder.propagate(self.embed_drop(h), mask, draws)  # shape: (B, T, D) or (P, B, T, D)
        return sample_logits(self.head(pool_tokens(h, mask, cls=self.cls_token is not None)), P)

    def trained_layers(self) -> nn.ModuleList:
        """The transformer blocks (every one trains; the counterpart of an encoder model's trained layers)."""
        return self.encoder.blocks

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """Loss terms of every attention layer in the last forward, summed over layers."""
        return self.encoder.loss_terms()

    def layer_diagnostics(self) -> list[dict]:
        """Per GP attention layer of the last forward: loss terms and output scale (``Encoder``)."""
        return self.encoder.layer_diagnostics()


@with_encoder_settings
class TransformerClassifier(_SequenceClassifier):
    """Pre-LN transformer over token ids ``(B, T)`` (with ``key_padding_mask``, True = padding) or
    dense features ``(B, T, F)``; mean (over real tokens) or CLS pooling.

    :param vocab_size: for token ids (``padding_idx`` 0); or
    :param input_dim: F, for dense features (exactly one of the two).
    :param max_len: the longest input (T) the positional embeddings cover.
    :param pooling: ``"mean"`` over the real tokens, or ``"cls"``: a learned first token's state.
    :param encoder: the encoder's settings by name, keyword-only (:class:`gpattn.models.EncoderSpec`):
        ``embed_dim=64, num_heads=4, num_layers=2, attention="softmax", attention_options=None,
        attention_layers="all", mlp_ratio=2.0, dropout=0.1, mc_dropout=False``. ``attention`` is a registered
        name or a callable ``(embed_dim, num_heads, **options) -> nn.Module``; ``attention_layers`` is
        ``"all"``, ``"last"`` (Chen et al.'s (2024) KEP-SVGP default) or layer indices (the other layers use
        softmax attention); ``mc_dropout`` keeps dropout on at prediction time (MC dropout baseline).
    """

    def __init__(
        self,
        num_classes: int,
        *,
        vocab_size: int | None = None,
        input_dim: int | None = None,
        max_len: int = 512,
        pooling: str = "mean",
        **encoder,
    ):
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("give exactly one of vocab_size (token ids) or input_dim (dense features)")
        super().__init__(num_classes, EncoderSpec.of(type(self), encoder), pooling=pooling, max_tokens=max_len)
        self.vocab_size, self.input_dim = vocab_size, input_dim
        if vocab_size is not None:
            self.embed = nn.Embedding(vocab_size, self.embed_dim, padding_idx=0)
        else:
            self.embed = nn.Linear(input_dim, self.embed_dim)

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


@with_encoder_settings
class ViTClassifier(_SequenceClassifier):
    """Vision transformer: non-overlapping ``patch_size`` patches of ``(B, C, Hpx, Wpx)`` images, a
    linear patch embedding, CLS (default) or mean pooling. The encoder's settings, keyword-only, as
    ``TransformerClassifier``'s (:class:`gpattn.models.EncoderSpec`).

    Variants whose kernel defaults to the text kernel (``sgpa``, ``sgpa-decoupled``, ``kernel``,
    ``kernel-asym``: exponential dot product) get the ARD-RBF kernel here, as in the papers' image
    experiments, unless ``attention_options`` names a kernel."""

    def __init__(
        self,
        num_classes: int,
        *,
        image_shape: tuple[int, int, int],
        patch_size: int = 2,
        pooling: str = "cls",
        **encoder,
    ):
        C, Hpx, Wpx = image_shape
        if Hpx % patch_size or Wpx % patch_size:
            raise ValueError(f"image size {Hpx}x{Wpx} is not divisible by patch_size={patch_size}")
        num_patches = (Hpx // patch_size) * (Wpx // patch_size)
        spec = EncoderSpec.of(type(self), encoder)
        options = _image_attention_options(spec.attention, spec.attention_options)
        spec = dataclasses.replace(spec, attention_options=options)
        super().__init__(num_classes, spec, pooling=pooling, max_tokens=num_patches)
        self.image_shape, self.patch_size = tuple(image_shape), patch_size
        self.embed = nn.Linear(C * patch_size * patch_size, self.embed_dim)

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
