"""gpattn attention inside Hugging Face encoders (``transformers`` 5, the ``huggingface`` extra).

``swap_attention(model, "sgpa", layers="last")`` replaces the self-attention of chosen layers of a
BERT-family encoder by :class:`HFAttentionAdapter`, which wraps a gpattn layer
(``gpattn.build_attention(name, hidden, heads, **options)``) and speaks transformers' self-attention
contract: ``forward(hidden_states, attention_mask=None, **kwargs) -> (output, None)``.

**What is transferred** (per swapped layer, also returned by :func:`swap_attention`): the pretrained
query / key / value weights and biases go into the gpattn layer's fused input projection ``in_proj``
for every projection the variant has by that name (``q`` ← query, ``k`` ← key, ``v`` ← value); a
variant with one shared query-key map (``qk``: sgpa, sgpa-decoupled, kernel) takes the **key** weights
(the query weights are dropped: W_q = W_k is the variant's parameterisation); any other projection
(cgp's ``o``) or one of another width (``value_dim`` ≠ head width) keeps its fresh initialisation, as
do every GP parameter (kernel hyperparameters, inducing / variational parameters). The output
projection: in BERT and RoBERTa the self-attention is followed by ``attention.output.dense``, so the
gpattn layer's own ``out_proj`` starts as the identity (weight I, bias 0; still trained); in
DistilBERT the swapped module is ``attention`` itself, which holds ``out_lin``, copied into
``out_proj``. With the ``softmax`` variant everything is transferred and the swapped encoder computes
the original function (tests/test_huggingface.py checks it to 1e-5).

**Masks**: transformers gives a (B, 1, T, T) mask — boolean True = attend (``sdpa``), additive 0 / very
negative (``eager``) — or None when nothing is padded; :func:`key_padding_mask` turns one that masks
keys only (the same for every query) into gpattn's ``key_padding_mask`` (True = padding) and rejects
any other structure (causal, per-query) with a ValueError. That check reads the mask once per model
forward (the layers share the tensor; the result is cached by identity).

**Loss terms**: the gpattn layers register their KLs as GPyTorch added loss terms, so
``gpattn.objectives.DeepGPELBO(hf_model, num_data)`` and ``gpattn.objectives.summed_loss_terms(hf_model)``
see them from the outer model (sequence-classification head included).

**Saving**: the swapped model's ``state_dict`` / ``save_pretrained`` hold the adapter's parameters under
``...attention.self.attention.*``; to reload, swap the same layers of a fresh model with the same
arguments and load the state dict (:func:`load_swapped`).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn as nn

from gpattn.attention import build_attention

__all__ = ["HFAttentionAdapter", "key_padding_mask", "load_swapped", "supported_architectures", "swap_attention"]

#: self-attention classes by name -> (attribute of the encoder layer holding it, names of its query /
#: key / value / output linear maps; output None when the attention block applies it after the module)
_ARCHITECTURES: dict[str, tuple[str, tuple[str, str, str, str | None]]] = {
    "BertSelfAttention": ("attention.self", ("query", "key", "value", None)),
    "RobertaSelfAttention": ("attention.self", ("query", "key", "value", None)),
    "DistilBertSelfAttention": ("attention", ("q_lin", "k_lin", "v_lin", "out_lin")),
}
#: the pretrained map each gpattn projection takes (index into the names above); others stay new
_SOURCES = {"q": 0, "k": 1, "v": 2, "qk": 1}


def supported_architectures() -> list[str]:
    """The transformers self-attention classes :func:`swap_attention` can replace."""
    return sorted(_ARCHITECTURES)


# ----------------------------------------------------------------------------- masks
_mask_cache: list = [None, None]  # [weakref to the last mask translated, its key padding mask]


def _attention_matrix_mask(attention_mask: torch.Tensor, shape) -> torch.Tensor:
    """A general (non-padding) mask. gpattn's layers take key padding only here; this is where a
    general ``attn_mask`` (causal, per query) will be passed on once the layers accept one."""
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
        allowed, plain = m, True
    elif m.is_floating_point():
        blocked = m <= torch.finfo(m.dtype).min / 2
        allowed, plain = ~blocked, ((m == 0) | blocked).all()
    else:
        raise ValueError(f"attention_mask must be bool (True = attend) or floating (additive), got {m.dtype}")
    padding = ~allowed[:, 0, :1, :].expand(B, T, T)  # the first query's row, for every query
    if not bool(plain) or not bool((~allowed[:, 0] == padding).all()):  # one host read per mask
        return _attention_matrix_mask(m, shape)
    result = padding[:, 0].contiguous()
    _mask_cache[:] = [weakref.ref(m), result]
    return result


# ----------------------------------------------------------------------------- the adapter
class HFAttentionAdapter(nn.Module):
    """A gpattn layer (``self.attention``) behind transformers' self-attention contract.

    ``forward(hidden_states, attention_mask=None, **kwargs) -> (output (B, T, D), None)``; attention
    weights are not returned (None, as transformers' sdpa path). Cross-attention and key/value caches
    are not supported (a ValueError)."""

    def __init__(self, attention: nn.Module, transferred: dict[str, str], new: list[str]):
        super().__init__()
        self.attention = attention
        #: what came from the pretrained module (gpattn name -> its name) and what is newly initialised
        self.transferred, self.new = transferred, new

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states: gpattn's swapped layers are self-attention only (got a tensor)")
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("cache / past_key_values: gpattn's swapped layers keep no key/value cache (got one)")
        kpm = key_padding_mask(attention_mask, hidden_states.shape[:2])
        return self.attention(hidden_states, key_padding_mask=kpm), None

    def extra_repr(self) -> str:
        return f"transferred={sorted(self.transferred)}, new={self.new}"


def _encoder_layers(model: nn.Module) -> tuple[nn.ModuleList, str]:
    """The encoder's layer list and the architecture's self-attention class name."""
    base = getattr(model, "base_model", model)
    for path in ("encoder.layer", "transformer.layer"):
        layers = base
        for part in path.split("."):
            layers = getattr(layers, part, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            for cls in _ARCHITECTURES:
                attr = _ARCHITECTURES[cls][0]
                module = layers[0].get_submodule(attr) if _has(layers[0], attr) else None
                if type(module).__name__ == cls:
                    return layers, cls
    raise ValueError(
        f"model: swap_attention supports encoders whose self-attention is one of "
        f"{', '.join(supported_architectures())} (BERT, RoBERTa, DistilBERT, MiniLM in transformers 5); "
        f"got {type(model).__name__}"
    )


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _layer_indices(layers, n: int) -> list[int]:
    if layers == "last":
        return [n - 1]
    if layers == "all":
        return list(range(n))
    if (
        isinstance(layers, (list, tuple))
        and layers
        and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
    ):
        bad = [i for i in layers if not -n <= i < n]
        if bad:
            raise ValueError(f"layers: indices {bad} out of range for an encoder of {n} layers")
        return sorted({i % n for i in layers})
    raise ValueError(f"layers must be 'last', 'all' or a non-empty list of layer indices, got {layers!r}")


@torch.no_grad()
def _transfer(layer: nn.Module, old: nn.Module, names) -> tuple[dict[str, str], list[str]]:
    """Copy the pretrained projections into ``layer``; return (transferred, new)."""
    transferred, new = {}, []
    offset = 0
    for proj, width in zip(layer.projections, layer._proj_widths):
        source = getattr(old, names[_SOURCES[proj]]) if proj in _SOURCES else None
        if source is not None and source.weight.shape == (width, layer.embed_dim):
            layer.in_proj.weight[offset : offset + width].copy_(source.weight)
            if layer.in_proj.bias is not None and source.bias is not None:
                layer.in_proj.bias[offset : offset + width].copy_(source.bias)
            transferred[f"in_proj[{proj}]"] = names[_SOURCES[proj]]
        else:
            new.append(f"in_proj[{proj}]")
        offset += width
    out, W = layer.out_proj, layer.out_proj.weight
    if names[3] is not None and getattr(old, names[3]).weight.shape == W.shape:
        W.copy_(getattr(old, names[3]).weight)
        if out.bias is not None:
            out.bias.copy_(getattr(old, names[3]).bias)
        transferred["out_proj"] = names[3]
    elif names[3] is None and W.shape[0] == W.shape[1]:
        W.copy_(torch.eye(W.shape[0], dtype=W.dtype))
        if out.bias is not None:
            out.bias.zero_()
        transferred["out_proj"] = "identity (the block's attention.output.dense follows)"
    else:
        new.append("out_proj")
    proj_params = {"in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"}
    new += [name for name, _ in layer.named_parameters() if name not in proj_params]
    return transferred, new


def swap_attention(
    model: nn.Module, attention: str = "sgpa", layers="last", **options
) -> dict[int, HFAttentionAdapter]:
    """Replace the self-attention of ``layers`` of a BERT-family encoder by gpattn's ``attention``, in place.

    :param model: a transformers model (``BertModel``, ``BertForSequenceClassification``, RoBERTa,
        DistilBERT, ...; encoder-only: ``config.is_decoder`` must be False).
    :param attention: a gpattn variant name (``gpattn.list_attention()``).
    :param layers: ``"last"``, ``"all"`` or a list of layer indices.
    :param options: the variant's options (``gpattn.attention_options(attention)``).
    :returns: the adapters by layer index; each says what was transferred (``.transferred``) and what
        is new (``.new``). Each adapter takes the training mode, device and dtype of the module it replaces.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_decoder", False):
        raise ValueError("model: config.is_decoder is True (causal masks); swap_attention supports encoders only")
    encoder_layers, cls = _encoder_layers(model)
    attr, names = _ARCHITECTURES[cls]
    swapped = {}
    for i in _layer_indices(layers, len(encoder_layers)):
        parent_path, _, child = attr.rpartition(".")
        parent = encoder_layers[i].get_submodule(parent_path) if parent_path else encoder_layers[i]
        old = getattr(parent, child)
        if not isinstance(old, nn.Module) or type(old).__name__ != cls:
            raise ValueError(f"layers: layer {i}'s {attr} is {type(old).__name__}, not {cls} (already swapped?)")
        q = getattr(old, names[0]).weight
        heads = getattr(old, "num_attention_heads", None) or old.n_heads
        layer = build_attention(attention, q.shape[1], heads, **options).to(device=q.device, dtype=q.dtype)
        transferred, new = _transfer(layer, old, names)
        adapter = HFAttentionAdapter(layer, transferred, new).train(old.training)
        setattr(parent, child, adapter)
        swapped[i] = adapter
    return swapped


def load_swapped(model: nn.Module, path: str | os.PathLike, attention: str = "sgpa", layers="last", **options):
    """Reload a swapped model saved with ``save_pretrained(path)``: ``model`` is a freshly built model of
    the same config (e.g. ``BertForSequenceClassification(config)``), swapped here with the same
    arguments, then given the saved weights (strict). Returns ``model`` in eval mode."""
    from safetensors.torch import load_file

    swap_attention(model, attention, layers, **options)
    file = os.path.join(os.fspath(path), "model.safetensors")
    if not os.path.exists(file):
        raise ValueError(f"path: no model.safetensors in {os.fspath(path)!r} (save it with save_pretrained(path))")
    model.load_state_dict(load_file(file), strict=True)
    return model.eval()
