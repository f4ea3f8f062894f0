"""transformers' self-attention masks as gpattn's ``key_padding_mask`` (:func:`key_padding_mask`; the rule is in
:mod:`gpattn.integrations.huggingface`, "Masks"). Split from :mod:`gpattn.integrations.huggingface`, which
re-exports :func:`key_padding_mask`."""

from __future__ import annotations

import weakref

import torch

__all__ = ["key_padding_mask"]

_mask_cache: list = [None, None]  # [weakref to the last mask translated, its key padding mask]


def _attention_matrix_mask(attention_mask: torch.Tensor, shape) -> torch.Tensor:
    """A general (non-padding) mask. The swapped layers take key padding only here: most GP variants take
    no other mask, and the per-query masks of ``sgpa`` and ``sgpa-decoupled`` (docs/derivations.md §11) are
    not passed on by this adapter (encoders only)."""
    raise ValueError(
        f"attention_mask of shape {tuple(attention_mask.shape)} masks more than padded keys (it differs "
        f"between queries, e.g. a causal mask, or holds additive biases other than 0 and the dtype "
        f"minimum); gpattn's swapped layers support key padding only: use an encoder without causal "
        f"masking (config.is_decoder=False) and an attention_mask of 1/0 per token"
    )


def key_padding_mask(attention_mask: torch.Tensor | None, shape) -> torch.Tensor | None:
    """gpattn's ``key_padding_mask`` (B, T) bool, True = padding, from transformers' self-attention mask.

    :param attention_mask: None (nothing padded), or (B, 1, T, T) / (B, 1, 1, T): boolean True = attend
        (``sdpa``) or additive float, 0 = attend and ≤ half the dtype minimum = masked (``eager``).
    :param shape: (B, T) of the hidden states.
    :raises ValueError: for a mask that is not key padding (see :func:`_attention_matrix_mask`).
    """
    if attention_mask is None:
        return None
    B, T = shape
    m = attention_mask
    if not torch.is_tensor(m) or m.dim() != 4 or m.shape[0] != B or m.shape[1] != 1 or m.shape[-1] != T:
        raise ValueError(
            f"attention_mask must be None or a (B, 1, T, T) tensor with (B, T) = {(B, T)}, got "
            f"{tuple(m.shape) if torch.is_tensor(m) else type(m).__name__}"
        )
    cached, result = _mask_cache
    if cached is not None and cached() is m:
        return result
    if m.dtype == torch.bool:
        allowed, plain = m, None
    elif m.is_floating_point():
        blocked = m <= torch.finfo(m.dtype).min / 2
        allowed, plain = ~blocked, (m == 0) | blocked
    else:
        raise ValueError(f"attention_mask must be bool (True = attend) or floating (additive), got {m.dtype}")
    padding = ~allowed[:, 0, :1, :].expand(B, T, T)  # the first query's row, for every query
    pads_only = (~allowed[:, 0] == padding).all()
    if plain is not None:
        pads_only = pads_only & plain.all()
    if not bool(pads_only):  # one host read per mask
        return _attention_matrix_mask(m, shape)
    result = padding[:, 0].contiguous()
    _mask_cache[:] = [weakref.ref(m), result]
    return result
