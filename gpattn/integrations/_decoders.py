"""gpattn attention inside Hugging Face decoders: the GPT-2 family and Llama (docs/huggingface.md,
docs/derivations.md §11d).

What :func:`gpattn.integrations.huggingface.swap_attention` needs to swap a causal self-attention
(:data:`DECODERS`: where the layers are, the pretrained maps as (weight, bias) pairs, whether the queries
and keys are rotated), the adapter that speaks the attention module's contract (:class:`HFDecoderAdapter`),
the rotary position embedding applied inside the gpattn layer (:class:`RotaryProjection`), the causal
language-model objective with the GP loss terms (:class:`CausalLMELBO`) and per-token predictive entropy
and mutual information over Monte-Carlo samples (:func:`token_uncertainty`,
:func:`generate_with_uncertainty`).

**Cache policy: recompute.** A swapped decoder keeps no key/value cache: every forward attends over the
whole prefix it is given. :func:`~gpattn.integrations.huggingface.swap_attention` sets
``config.use_cache`` and ``generation_config.use_cache`` to False, so ``model.generate`` passes the
whole sequence at every step; a cache handed to a swapped layer (``use_cache=True``) is a ValueError.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpattn.attention._masks import check_num_samples
from gpattn.objectives import DeepGPELBO

__all__ = [
    "CausalLMELBO",
    "DECODERS",
    "DecoderSpec",
    "HFDecoderAdapter",
    "RotaryProjection",
    "TokenUncertainty",
    "causal_attn_mask",
    "generate_with_uncertainty",
    "predictive_uncertainty",
    "token_uncertainty",
]


# ----------------------------------------------------------------------------- the architectures
Pair = tuple[torch.Tensor, "torch.Tensor | None"]  # (weight (out, in) as nn.Linear holds it, bias or None)


def _gpt2_sources(old: nn.Module) -> dict[str, tuple[Pair, str]]:
    """GPT2Attention's maps: c_attn is a fused Conv1D (y = x W + b, W of shape (D, 3D)); the query rows
    carry the module's score scale relative to 1/√Dh (1 unless ``scale_attn_weights=False`` or
    ``scale_attn_by_inverse_layer_idx``), so softmax's q kᵀ/√Dh is GPT-2's score."""
    D, s = old.embed_dim, old.scaling * math.sqrt(old.head_dim)
    (q, k, v), (bq, bk, bv) = old.c_attn.weight.t().split(D, 0), old.c_attn.bias.split(D)
    return {
        "q": ((q * s, bq * s), "c_attn[query]" + (f" x {s:g}" if s != 1 else "")),
        "k": ((k, bk), "c_attn[key]"),
        "v": ((v, bv), "c_attn[value]"),
        "o": ((old.c_proj.weight.t(), old.c_proj.bias), "c_proj"),
    }


def _llama_sources(old: nn.Module) -> dict[str, tuple[Pair, str]]:
    """LlamaAttention's maps; grouped-query attention's key / value heads repeated to one per query head
    (head h uses key-value head h // groups, as transformers' ``repeat_kv``)."""
    Dh, groups = old.head_dim, old.num_key_value_groups

    def repeated(lin: nn.Linear) -> Pair:
        W = lin.weight.unflatten(0, (-1, Dh)).repeat_interleave(groups, 0).flatten(0, 1)
        b = None if lin.bias is None else lin.bias.unflatten(0, (-1, Dh)).repeat_interleave(groups, 0).flatten()
        return W, b

    note = f" ({old.config.num_key_value_heads} key-value heads repeated x{groups})" if groups > 1 else ""
    s = old.scaling * math.sqrt(Dh)
    bq = None if old.q_proj.bias is None else old.q_proj.bias * s
    return {
        "q": ((old.q_proj.weight * s, bq), "q_proj"),
        "k": (repeated(old.k_proj), "k_proj" + note),
        "v": (repeated(old.v_proj), "v_proj" + note),
        "o": ((old.o_proj.weight, old.o_proj.bias), "o_proj"),
    }


def _llama_heads(old: nn.Module) -> int:
    """LlamaAttention's query heads; its head width must be hidden_size / heads, as gpattn's layers have it."""
    config = old.config
    if old.head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(
            f"model: config.head_dim ({old.head_dim}) x num_attention_heads ({config.num_attention_heads}) != "
            f"hidden_size ({config.hidden_size}); gpattn's layers have head width hidden_size / num_heads: use a "
            f"config with head_dim = hidden_size // num_attention_heads"
        )
    return config.num_attention_heads


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """How to swap one decoder architecture's self-attention.

    :ivar layers: attribute of the base model holding the decoder layers (an ``nn.ModuleList``).
    :ivar attr: attribute of a decoder layer holding the self-attention module.
    :ivar sources: the module's pretrained maps by gpattn role (``q``, ``k``, ``v``, ``o``): ((weight, bias), label).
    :ivar heads: the module's number of query heads.
    :ivar dropout: the module's attention-probability dropout (``softmax``'s ``dropout`` unless given).
    :ivar rotary: the module rotates queries and keys by ``position_embeddings`` (RoPE).
    """

    layers: str
    attr: str
    sources: Callable[[nn.Module], dict]
    heads: Callable[[nn.Module], int]
    dropout: Callable[[nn.Module], float]
    rotary: bool


#: causal self-attention classes by name (transformers 5)
DECODERS: dict[str, DecoderSpec] = {
    "GPT2Attention": DecoderSpec(
        "h", "attn", _gpt2_sources, lambda m: m.num_heads, lambda m: m.attn_dropout.p, rotary=False
    ),
    "LlamaAttention": DecoderSpec(
        "layers", "self_attn", _llama_sources, _llama_heads, lambda m: float(m.attention_dropout), rotary=True
    ),
}


def decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, str] | None:
    """The decoder's layer list and its attention class name, or None when ``model`` is no known decoder
    (one whose layers are all swapped already counts as its architecture)."""
    base = getattr(model, "base_model", model)
    for cls, spec in DECODERS.items():
        layers = getattr(base, spec.layers, None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            continue
        kinds = {type(getattr(layer, spec.attr, None)) for layer in layers}
        if cls in {k.__name__ for k in kinds} or kinds == {HFDecoderAdapter}:
            return layers, cls
    return None


# ----------------------------------------------------------------------------- masks
def causal_attn_mask(attention_mask, shape, device) -> torch.Tensor:
    """gpattn's ``attn_mask`` (bool, True = excluded) from a decoder's self-attention mask.

    :param attention_mask: None — the causal mask (transformers passes None under ``sdpa`` when nothing
        is padded and lets the kernel apply causality) — or ``(B or 1, 1, T, T)``: bool True = attend
        (``sdpa``) or additive float, 0 = attend and ≤ half the dtype minimum = masked (``eager``).
    :param shape: (B, T) of the hidden states.
    :raises ValueError: for another form (a ``flex_attention`` block mask, keys ≠ queries from a cache) or
        additive values other than 0 and the masked value (attention biases).  # shape: -> (B or 1, 1, T, T) or (T, T)
    """
    B, T = shape
    if attention_mask is None:
        return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
    m = attention_mask
    if not torch.is_tensor(m) or m.dim() != 4 or m.shape[0] not in (1, B) or m.shape[1] != 1 or m.shape[2:] != (T, T):
        got = tuple(m.shape) if torch.is_tensor(m) else type(m).__name__
        raise ValueError(
            f"attention_mask must be None or a (B, 1, T, T) tensor with (B, T) = {(B, T)}, got {got}: load the "
            f"model with attn_implementation='sdpa' or 'eager' and generate with use_cache=False"
        )
    if m.dtype == torch.bool:
        return ~m
    if not m.is_floating_point():
        raise ValueError(f"attention_mask must be bool (True = attend) or floating (additive), got {m.dtype}")
    blocked = m <= torch.finfo(m.dtype).min / 2
    if not bool(((m == 0) | blocked).all()):  # one host read
        raise ValueError(
            "attention_mask holds additive biases other than 0 and the masked value; gpattn's layers take "
            "masks only (no attention biases such as ALiBi)"
        )
    return blocked


# ----------------------------------------------------------------------------- rotary position embeddings
_ROTATION: contextvars.ContextVar = contextvars.ContextVar("gpattn_rotation", default=None)


@contextlib.contextmanager
def _rotation(position_embeddings):
    """The (cos, sin) that :class:`RotaryProjection` applies during the block (per call, not on any layer)."""
    token = _ROTATION.set(position_embeddings)
    try:
        yield
    finally:
        _ROTATION.reset(token)


class RotaryProjection:
    """A forward hook on a swapped layer's fused ``in_proj``: rotates the query and key parts (``q``,
    ``k``, ``qk``) of every head by the rotary position embedding of the current
    :class:`HFDecoderAdapter` call, as LlamaAttention rotates its queries and keys (transformers'
    ``rotate_half`` convention: dimension d pairs with d + Dh/2); values are not rotated. The GP's inputs
    are then the rotated features (docs/derivations.md §11d)."""

    def __init__(self, layer: nn.Module):
        self.rows = layer.projection_rows()  # the features of each projection in in_proj's output
        self.head_dim = layer.head_dim

    def __call__(self, module, args, output):
        from transformers.models.llama.modeling_llama import rotate_half

        rotation = _ROTATION.get()
        if rotation is None:
            raise ValueError(
                "this gpattn layer was swapped into a rotary (Llama) model and rotates its queries and keys by "
                "position: call it through its HFDecoderAdapter, which receives position_embeddings"
            )
        cos, sin = (t.unsqueeze(-2) for t in rotation)  # shape: (B or 1, T, 1, Dh)
        parts = []
        for name, rows in self.rows.items():
            part = output[..., rows]
            if name in ("q", "k", "qk"):
                h = part.unflatten(-1, (-1, self.head_dim))  # shape: (B, T, H, Dh)
                part = (h * cos + rotate_half(h) * sin).flatten(-2)
            parts.append(part)
        return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- the adapter
class HFDecoderAdapter(nn.Module):
    """A gpattn layer (``self.attention``) behind a transformers decoder's self-attention contract
    (GPT2Attention, LlamaAttention): ``forward(hidden_states, *, attention_mask=None,
    position_embeddings=None, cache=None, **kwargs) -> (output (B, T, D), None)``.

    ``attention_mask`` becomes gpattn's causal ``attn_mask`` (:func:`causal_attn_mask`); Llama's
    ``position_embeddings`` (cos, sin) rotate the queries and keys inside the layer (:class:`RotaryProjection`);
    GPT-2's residual dropout follows the output, as in GPT2Attention. The weights returned are None (as
    transformers' sdpa path). Refused with a ValueError: a key/value ``cache`` (the recompute policy: generate
    with ``use_cache=False``) and ``encoder_hidden_states`` (cross-attention). The other keywords
    (``position_ids``, ``use_cache=False``, ``output_attentions``) are not needed and not read."""

    def __init__(self, attention: nn.Module, transferred: dict[str, str], new: list[str], *, rotary: bool,
                 resid_dropout: nn.Module | None = None):
        super().__init__()
        self.attention = attention
        #: what came from the pretrained module (gpattn name -> its name) and what is newly initialised
        self.transferred, self.new = transferred, new
        self.rotary = rotary
        self.resid_dropout = resid_dropout if resid_dropout is not None else nn.Identity()

    def forward(self, hidden_states, *, attention_mask=None, position_embeddings=None, cache=None,
                past_key_values=None, encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states: gpattn's swapped decoder layers are self-attention only")
        if cache is not None or past_key_values is not None:
            raise ValueError(
                "cache: gpattn's swapped decoder layers keep no key/value cache (they recompute the prefix at every "
                "step): call the model and generate with use_cache=False (swap_attention sets it in the config)"
            )
        if self.rotary and position_embeddings is None:
            raise ValueError("position_embeddings: a rotary (Llama) layer needs the (cos, sin) of its positions")
        mask = causal_attn_mask(attention_mask, hidden_states.shape[:2], hidden_states.device)
        with _rotation(position_embeddings if self.rotary else None):
            y = self.attention(hidden_states, attn_mask=mask)
        return self.resid_dropout(y), None

    def extra_repr(self) -> str:
        return f"rotary={self.rotary}, transferred={sorted(self.transferred)}, new={self.new}"


# ----------------------------------------------------------------------------- the LM objective
class CausalLMELBO:
    r"""The deep-GP ELBO of a causal language model with swapped GP layers, per token, as a loss.

    .. math:: \mathcal L = \frac{1}{n}\sum_{b,t} \mathrm{CE}_{bt} + \frac{B}{n}\Big[\beta\,\mathrm{KL}^{seq}
        + \tfrac{\beta}{N}\mathrm{KL}^{global} + \dots - \tfrac1N \log p(\theta)\Big]

    n the number of predicted tokens in the batch, B the sequences, N the training sequences: the
    per-sequence bound of docs/derivations.md §9 (:class:`gpattn.objectives.DeepGPELBO`, whose weights and
    terms are used as they are) divided by the mean number of predicted tokens per sequence, so that the data
    term is transformers' own LM loss (docs/derivations.md §11d).

    ``objective(logits, labels, step=None)``: ``logits (B, T, V)`` of the last forward, ``labels (B, T)``
    as transformers takes them (the input ids; −100 = not predicted; shifted here: position t predicts
    label t + 1). Returns the loss, or with ``combine_terms=False`` the parts of :class:`DeepGPELBO`
    (``nll`` the mean token CE, the unweighted terms, ...) with ``loss`` as above.

    :param model: the swapped model (its added loss terms and priors are collected).
    :param num_data: N, the number of training sequences.
    :param settings: :class:`DeepGPELBO`'s (``beta``, ``beta_anneal_steps``, ``combine_terms``, ...).
    """

    def __init__(self, model: nn.Module, num_data: int, *, combine_terms: bool = True, **settings):
        self.elbo = DeepGPELBO(model, num_data, combine_terms=False, **settings)
        if not isinstance(combine_terms, bool):
            raise ValueError(f"combine_terms must be True (the loss) or False (the parts), got {combine_terms!r}")
        self.combine_terms = combine_terms

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, step: int | None = None):
        """# shape: logits (B, T, V), labels (B, T) -> the loss (0-dim) or the parts"""
        if logits.dim() != 3 or labels.shape != logits.shape[:2]:
            raise ValueError(
                f"logits must be (B, T, V) and labels (B, T) of the same B, T; got {tuple(logits.shape)} and "
                f"{tuple(labels.shape)}"
            )
        target = labels[:, 1:]
        predicted = target != -100
        if not bool(predicted.any()):
            raise ValueError("labels: no token to predict (every shifted label is -100)")
        parts = self.elbo(logits[:, :-1][predicted][:, None], target[predicted], step)
        per_token = predicted.shape[0] / predicted.sum()  # B / n
        parts["loss"] = parts["nll"] + (parts["loss"] - parts["nll"]) * per_token
        return parts["loss"] if self.combine_terms else parts


# ----------------------------------------------------------------------------- uncertainty per token
@dataclasses.dataclass
class TokenUncertainty:
    """Per-token predictive uncertainty over P Monte-Carlo samples (docs/derivations.md §11d), each ``(B, T)``
    in nats: ``entropy`` H[p̄] of the predictive p̄ = mean_p p_p (total), ``expected_entropy`` mean_p H[p_p]
    (aleatoric) and ``mutual_information`` H[p̄] − mean_p H[p_p] (epistemic, ≥ 0), and ``probs`` p̄ ``(B, T, V)``."""

    entropy: torch.Tensor
    expected_entropy: torch.Tensor
    mutual_information: torch.Tensor
    probs: torch.Tensor


def predictive_uncertainty(logits: torch.Tensor) -> TokenUncertainty:
    """:class:`TokenUncertainty` of sample logits.  # shape: logits (B, P, T, V) -> each (B, T), probs (B, T, V)

    Computed in float64 at least; the mutual information as mean_p KL(p_p ‖ p̄), which is H[p̄] − mean_p H[p_p],
    clamped at 0 (round-off: exactly 0 in exact arithmetic when the samples agree)."""
    if logits.dim() != 4:
        raise ValueError(f"logits must have shape (B, P, T, V), got {tuple(logits.shape)}")
    logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float64)), dim=-1)
    log_mean = torch.logsumexp(logp, dim=1) - math.log(logits.shape[1])  # shape: (B, T, V)
    p, mean = logp.exp(), log_mean.exp()
    entropy = -(mean * log_mean).sum(-1)
    expected = -(p * logp).sum(-1).mean(1)
    mi = (p * (logp - log_mean[:, None])).sum(-1).mean(1).clamp_min(0)
    return TokenUncertainty(entropy, expected, mi, mean)


def _is_random(model: nn.Module) -> bool:
    """Whether a forward of ``model`` draws anything: training mode (dropout) or a sampling gpattn layer."""
    from gpattn.attention import AttentionBase

    return model.training or any(m.sampling for m in model.modules() if isinstance(m, AttentionBase))


@torch.no_grad()
def token_uncertainty(model: nn.Module, input_ids, attention_mask=None, num_samples: int = 8) -> TokenUncertainty:
    """Per-token predictive entropy and mutual information of a causal LM over ``num_samples`` forward
    passes (each draws its own sample of every sampling layer); position t is the prediction of token t + 1.
    A model with nothing random in its forward (eval mode, no sampling layer: ``softmax``, or inside
    ``gpattn.deterministic()``) runs once: its mutual information is 0.
    # shape: input_ids (B, T) long, attention_mask (B, T) 1 = token, 0 = padding -> TokenUncertainty (B, T)"""
    check_num_samples(num_samples, optional=False)
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be (B, T) token ids, got {getattr(input_ids, 'shape', type(input_ids))}")
    P = num_samples if _is_random(model) else 1
    logits = [model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits for _ in range(P)]
    return predictive_uncertainty(torch.stack(logits, dim=1))


def generate_with_uncertainty(model: nn.Module, input_ids, attention_mask=None, num_samples: int = 8, **generate):
    """``model.generate(input_ids, ...)`` and the :func:`token_uncertainty` of every generated token (the
    predictive of token t given the prefix before it, over ``num_samples`` passes on the generated sequences).
    # shape: input_ids (B, T0) -> (sequences (B, T0 + n), TokenUncertainty (B, n))"""
    sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate)
    T0, n = input_ids.shape[1], sequences.shape[1] - input_ids.shape[1]
    mask = None
    if attention_mask is not None:
        mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], n)], dim=1)
    u = token_uncertainty(model, sequences, mask, num_samples)
    picked = slice(T0 - 1, T0 - 1 + n)
    return sequences, TokenUncertainty(*(getattr(u, f.name)[:, picked] for f in dataclasses.fields(u)))
