"""Mask algebra of the attention contract: the masks a caller may give, checked and brought to the one form
a variant's ``_attend`` reads (bool, True = the key is excluded). No host read unless a check needs one
(said per function)."""

from __future__ import annotations

import torch

from gpattn._settings import is_validating

__all__ = ["excluded_keys"]

#: an additive float mask entry at or below this value excludes its key (−∞, or a large negative number
#: as Hugging Face writes it): exp(−1e4) underflows to 0 in float32, so softmax gives such keys no weight
_ADDITIVE_EXCLUDED = -1e4


def excluded_keys(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask a variant's ``_attend`` receives, broadcastable against scores ``(B, H, T, S)``
    (True = the key is excluded for that query; S = T in self-attention): a key padding mask ``(B, S)``
    becomes ``(B, 1, 1, S)``, a per-query mask ``(B, H or 1, T, S)`` is returned as is."""
    if mask is None or mask.dim() == 4:
        return mask
    return mask[:, None, None, :]


def as_excluded(mask: torch.Tensor, arg: str) -> torch.Tensor:
    """A bool mask (True = excluded, nn.MultiheadAttention's polarity) or an additive float mask (0 =
    allowed, −∞ or ≤ −1e4 = excluded) as bool, True = excluded."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(
            f"{arg} must be a bool tensor (True = not allowed) or an additive float tensor (0 or -inf), got "
            f"dtype {mask.dtype}"
        )
    excluded = mask <= _ADDITIVE_EXCLUDED
    if is_validating() and not bool((excluded | (mask == 0)).all()):  # reads the device: opt-in
        raise ValueError(
            f"{arg} is an additive float mask with values other than 0 and -inf (or <= {_ADDITIVE_EXCLUDED:g}): "
            f"gpattn's layers take masks, not attention biases; pass a bool mask"
        )
    return excluded


def check_num_samples(num_samples, optional: bool = True) -> int:
    """``num_samples`` of a forward: a positive int (a ``ValueError`` naming the argument otherwise); the
    one check of P, once in a layer's call (where None, one draw, is handled by the caller: ``optional``) and once
    in a model's forward."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int{' or None' if optional else ''}, got {num_samples!r}")
    return num_samples


def pads_only(excluded: torch.Tensor) -> bool:
    """Whether an excluded mask (B or 1, H or 1, T, T) excludes the same keys for every query and head
    (reads the device once)."""
    return not bool((excluded != excluded[:, :1, :1, :]).any())


def per_query_variants() -> list[str]:
    """The registered variants that take per-query masks (for the error that names them)."""
    from gpattn.attention.registry import _REGISTRY

    return sorted(n for n, c in _REGISTRY.items() if c.per_query_masks)


def check_inputs(x, key_padding_mask, embed_dim: int, arg: str = "x") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate ``x (B, T, D)`` and ``key_padding_mask (B, T)`` bool; return them (``arg`` names ``x`` in
    the messages: the keys' input is ``context`` in cross-attention)."""
    if not torch.is_tensor(x):
        raise ValueError(f"{arg} must be a torch.Tensor of shape (B, T, embed_dim={embed_dim}), got {type(x)}")
    if x.dim() != 3:
        raise ValueError(
            f"{arg} must have shape (B, T, embed_dim={embed_dim}) (rank 3), got rank {x.dim()} shape {tuple(x.shape)}"
        )
    if x.shape[-1] != embed_dim:
        raise ValueError(
            f"{arg} has last dimension {x.shape[-1]} but the layer's embed_dim is {embed_dim} "
            f"({arg} shape {tuple(x.shape)})"
        )
    if not x.is_floating_point():
        raise ValueError(f"{arg} must be a floating-point tensor, got dtype {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError(f"{arg} has no tokens (T=0): shape {tuple(x.shape)}")
    if is_validating() and not bool(torch.isfinite(x).all()):  # reads the device: opt-in
        raise ValueError(f"{arg} contains NaN or Inf values (shape {tuple(x.shape)})")
    if key_padding_mask is not None:
        m = key_padding_mask
        if not torch.is_tensor(m) or m.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be a bool tensor (True = padding), got "
                f"{m.dtype if torch.is_tensor(m) else type(m)}"
            )
        if tuple(m.shape) != tuple(x.shape[:2]):
            raise ValueError(
                f"key_padding_mask must have shape (B, T) = {tuple(x.shape[:2])} to match {arg} "
                f"{tuple(x.shape)}, got {tuple(m.shape)}"
            )
        if m.device != x.device:
            raise ValueError(f"key_padding_mask is on {m.device} but {arg} is on {x.device}")
    return x, key_padding_mask


def check_cross_inputs(x, context, key_padding_mask, embed_dim: int):
    """Cross-attention's inputs: queries ``x (B, T, D)``, keys and values ``context (B, S, D)`` and the
    keys' padding ``key_padding_mask (B, S)``; return them.
    # shape: x (B, T, D), context (B, S, D), key_padding_mask (B, S) or None"""
    x, _ = check_inputs(x, None, embed_dim)
    context, key_padding_mask = check_inputs(context, key_padding_mask, embed_dim, arg="context")
    for what, a, b in (("batch size", x.shape[0], context.shape[0]), ("dtype", x.dtype, context.dtype),
                       ("device", x.device, context.device)):
        if a != b:
            raise ValueError(
                f"context (the keys' and values' input, shape {tuple(context.shape)}) must have the {what} of x "
                f"(the queries' input, shape {tuple(x.shape)}): got {b} for context and {a} for x"
            )
    return x, context, key_padding_mask


def effective_mask(mask):
    """The mask the variant sees, without a host read: (mask or None, keep (B,) bool or None), where
    ``keep`` marks the sequences with at least one real key; an all-padding row is given unpadded
    to the variant (its output is zeroed afterwards, its loss terms left out)."""
    if mask is None:
        return None, None
    keep = ~mask.all(-1)  # shape: (B,)
    return mask & keep[:, None], keep


def attn_mask_excluded(attn_mask: torch.Tensor, B: int, H: int, T: int, S: int | None = None) -> torch.Tensor:
    """An ``attn_mask`` as nn.MultiheadAttention takes it — bool (True = not allowed) or additive float,
    of shape (T, S), (B·H, T, S), (B, T, S) or (B or 1, H or 1, T, S), S the number of keys (T in
    self-attention) — as a bool mask (True = excluded) of shape (B or 1, H or 1, T, S)."""
    S = T if S is None else S
    if not torch.is_tensor(attn_mask):
        raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask)}")
    shape = tuple(attn_mask.shape)
    m = as_excluded(attn_mask, "attn_mask")
    if shape[-2:] == (T, S) and m.dim() == 2:
        return m[None, None]
    if shape[-2:] == (T, S) and m.dim() == 3 and shape[0] in (B * H, B, 1):
        return m.view(B, H, T, S) if shape[0] == B * H else m[:, None]
    if shape[-2:] == (T, S) and m.dim() == 4 and shape[0] in (B, 1) and shape[1] in (H, 1):
        return m
    n, keys = ("T, T", "") if S == T else ("T, S", f" queries, S={S} keys")  # S keys: cross-attention
    raise ValueError(
        f"attn_mask must have shape ({n}) = {(T, S)}, (B*H, {n}) = {(B * H, T, S)}, (B, {n}) or "
        f"(B or 1, H or 1, {n}) with B={B}, H={H}, T={T}{keys}; got {shape}"
    )


def check_cross_mask(layer, excluded: torch.Tensor) -> None:
    """Cross-attention under an ``attn_mask``: a GP variant takes only a mask that pads (it then joins the
    keys' padding); a per-query conditioning set (docs/derivations.md §11a–b) is defined for self-attention,
    where query i is token i (reads the device once: only when a GP variant is given one)."""
    if layer.is_gp and not pads_only(excluded):
        raise ValueError(
            f"attn_mask: in cross-attention, attention {layer.name!r} takes only masks that pad (the same "
            f"excluded keys for every query and head); this mask excludes different keys for different queries. "
            f"Its per-query masks (a GP per query, docs/derivations.md §11) are defined for self-attention, where "
            f"query i and key i are the same token; a causal mask needs T == S and self-attention. Pass the "
            f"keys' padding as key_padding_mask"
        )


def padding_part(excluded: torch.Tensor, B: int, name: str, per_query_masks: bool) -> torch.Tensor:
    """The key padding mask (B, T) that ``excluded`` (B or 1, H or 1, T, T) amounts to; for a variant
    without per-query masks a ``ValueError`` when it differs between queries or heads (reads the
    device once: only when such a variant is given an ``attn_mask``)."""
    if not per_query_masks and not pads_only(excluded):
        raise ValueError(
            f"attn_mask: attention {name!r} takes only masks that pad (the same excluded keys for "
            f"every query and head, i.e. a key_padding_mask); this mask excludes different keys for "
            f"different queries (a causal mask, say). Its posterior conditions every query on one "
            f"shared set of inducing inputs (or couples all keys), and a per-query conditioning set would "
            f"make a different GP for every query, which this variant does not define "
            f"(docs/derivations.md §11). Pass the padding as key_padding_mask, or use a variant with "
            f"per-query masks: {', '.join(per_query_variants())} (sgpa: one GP per query; sgpa-decoupled: one "
            f"mean basis per query)"
        )
    return excluded[:, 0, 0, :].expand(B, -1)


def posterior_masks(layer, x, key_padding_mask, attn_mask, S: int | None = None):
    """``(key padding, mask)`` of a ``posterior()`` call: an ``attn_mask`` that pads (or any for a variant
    without per-query masks, which must pad) joins the key padding; another per-query mask is joined with it.
    ``S``: the number of keys in cross-attention (None: self-attention)."""
    if attn_mask is None:
        return key_padding_mask, key_padding_mask
    excluded = attn_mask_excluded(attn_mask, x.shape[0], layer.num_heads, x.shape[1], S)
    if S is not None:
        check_cross_mask(layer, excluded)
    if not layer.per_query_masks or pads_only(excluded):
        pad = padding_part(excluded, x.shape[0], layer.name, layer.per_query_masks)
        key_padding_mask = pad if key_padding_mask is None else key_padding_mask | pad
        return key_padding_mask, key_padding_mask
    return key_padding_mask, excluded if key_padding_mask is None else excluded | key_padding_mask[:, None, None, :]
