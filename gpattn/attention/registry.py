"""The registry of attention variants: a variant joins with one line, ``@register("name")``.

Every module in ``gpattn/attention/`` whose name does not start with ``_`` is imported by the
package, so a new variant needs no edit anywhere else.

The names of the modelling choices resolve here, once (:func:`resolve`): a layer's ``prior_mean=`` or
``covariance=`` is a name of :data:`FORMS` (the object it names is built here) or the object itself; the conditioning
code in :mod:`gpattn.variational` receives objects and reads no name.

A variant's defaults are data: its layer's keyword defaults (the papers'), and its entry in :data:`_ENTRIES`, which
holds the options each named recipe (:data:`RECIPES`) sets on top of them and the options a run's config records
even at their default. :func:`attention_options` ``(name, recipe=...)`` returns the resolved options;
:func:`recipe_options` the part a config writes out.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch.nn as nn

from gpattn.variational.covariances import (
    DiagonalCovariance,
    FullCovariance,
    TrainingQueryCovariance,
    TrainingSequenceCovariance,
)
from gpattn.variational.means import (
    AttentionMean,
    CorrelatedSeparateSoftmaxMean,
    CorrelatedSoftmaxMean,
    KEPSeparateSoftmaxMean,
    KEPSoftmaxMean,
    SoftmaxMean,
    ZeroMean,
)

__all__ = [
    "FORMS",
    "RECIPES",
    "VariantEntry",
    "attention_class",
    "attention_options",
    "build_attention",
    "list_attention",
    "recipe_options",
    "register",
    "resolve",
]

_REGISTRY: dict[str, type[nn.Module]] = {}

#: the named recipes: ``"scratch"`` (a model trained from scratch: the layer's defaults) and ``"encoder-swap"`` (the
#: layer swapped into a pretrained encoder, gpattn.integrations.huggingface.swap_attention)
RECIPES = ("scratch", "encoder-swap")


@dataclasses.dataclass(frozen=True)
class VariantEntry:
    """A variant's defaults beyond its layer's signature: ``recipes`` maps a recipe of :data:`RECIPES` to the options
    it sets; ``recorded`` names options a run's config writes out at their default, so that config.json says which
    form ran (their default changed once; gpattn._migrate reads configs written before)."""

    recipes: dict = dataclasses.field(default_factory=dict)
    recorded: tuple = ()


#: the encoder swap of the SGPA variants keeps both pretrained maps (separate query and key maps,
#: docs/derivations.md §5d; the shared map would drop W_q, docs/huggingface.md) and takes the softmax prior mean
#: (§5e), so that the swapped layer's mean starts at the pretrained attention
_SGPA_SWAP = {"qk": "separate", "prior_mean": "softmax"}
#: every variant's entry (a variant without one has only its signature's defaults)
_ENTRIES: dict[str, VariantEntry] = {
    "sgpa": VariantEntry(recipes={"encoder-swap": _SGPA_SWAP}),
    "sgpa-decoupled": VariantEntry(recipes={"encoder-swap": _SGPA_SWAP}),
    # the swap's g starts at ℓ = 1, so that the median heuristic of match_prior_to_stream puts κ = e⁻¹ at the median
    # pair of queries (docs/derivations.md §5f)
    "sgpa-rff": VariantEntry(recipes={"encoder-swap": {**_SGPA_SWAP, "lengthscale": 1.0}}),
    # its mean: the pretrained attention in a swap; from scratch the softmax mean too (recorded: it was "zero" before)
    "kep-svgp": VariantEntry(recipes={"encoder-swap": {"prior_mean": "softmax"}}, recorded=("prior_mean",)),
    "cgp": VariantEntry(recorded=("prior_mean",)),
    "scgp": VariantEntry(recorded=("prior_mean",)),
}


#: the SGPA variants' prior means by name: (the mean, what it is)
_SGPA_MEANS = {
    "attention": (AttentionMean, "normalised kernel attention as the GP's prior mean, docs/derivations.md §5c"),
    "softmax": (SoftmaxMean, "softmax attention with the kernel's lengthscale, §5e"),
    "zero": (ZeroMean, "the paper's form"),
}
_SGPA_COVARIANCES = {
    "full": (FullCovariance, "exact joint samples over the tokens"),
    "diag": (DiagonalCovariance, "independent tokens"),
}
_CORRELATED_MEANS = {
    "softmax": (CorrelatedSoftmaxMean, "softmax attention of the canonical inputs as the prior mean of z_q and z_k, "
                "docs/derivations.md §7a"),
    "softmax-separate": (CorrelatedSeparateSoftmaxMean, "the same over values of its own"),
    "zero": (ZeroMean, "the paper's form"),
}
#: every public name of a modelling choice, per variant and option: ``{variant: {option: {name: (what builds the
#: object it names, what it is)}}}``; :func:`resolve` builds it
FORMS: dict[str, dict[str, dict[str, tuple]]] = {
    "sgpa": {"prior_mean": _SGPA_MEANS, "covariance": _SGPA_COVARIANCES},
    "sgpa-decoupled": {"prior_mean": _SGPA_MEANS, "covariance": _SGPA_COVARIANCES},
    "sgpa-rff": {
        "prior_mean": {k: _SGPA_MEANS[k] for k in ("attention", "softmax")},
        "gp_input": {  # the covariance's class: the layer builds it with its sizes
            "query": (lambda: TrainingQueryCovariance, "g on each query, per head"),
            "sequence": (lambda: TrainingSequenceCovariance, "g on each sequence's unit mean query"),
        },
    },
    "kep-svgp": {
        "prior_mean": {
            "zero": (ZeroMean, "Chen et al.'s"),
            "softmax": (KEPSoftmaxMean, "softmax attention over values of the layer's own, the pretrained attention "
                        "in an encoder swap, docs/derivations.md §6"),
            "softmax-separate": (KEPSeparateSoftmaxMean, "the same with queries and keys of its own, apart from the "
                                 "KSVD features'"),
        },
    },
    "cgp": {"prior_mean": _CORRELATED_MEANS},
    "scgp": {"prior_mean": _CORRELATED_MEANS},
}


def resolve(variant: str, option: str, value):
    """The object ``value`` of ``option`` stands for in ``variant``: a name of :data:`FORMS` builds a fresh one (for a
    form the layer builds with its sizes, sgpa-rff's covariance, its class), anything else is the object itself. A
    name the variant does not have is a ``ValueError`` that lists its names and what each is."""
    table = FORMS[variant][option]
    if isinstance(value, str) and value not in table:
        meanings = "; ".join(f"{name!r}: {meaning}" for name, (_, meaning) in table.items())
        raise ValueError(f"{option} must be one of {list(table)} ({meanings}), got {value!r}")
    named = table.get(value) if isinstance(value, str) else None
    return value if named is None else named[0]()


def register(name: str):
    """Class decorator: make an attention layer buildable as ``build_attention(name, ...)``."""

    def decorate(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} is registered twice ({_REGISTRY[name]} and {cls})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def list_attention() -> list[str]:
    """Sorted names of every registered attention variant."""
    return sorted(_REGISTRY)


def attention_class(name) -> type[nn.Module]:
    """The class registered as ``name`` (``ValueError`` naming the valid names otherwise). An attention
    layer class (a subclass of :class:`gpattn.attention.AttentionBase`, registered or not) is returned as
    is: every function here, and the test mixins of :mod:`gpattn.testing`, take one in place of a name."""
    if isinstance(name, type) and issubclass(name, nn.Module) and hasattr(name, "_attend"):  # an AttentionBase
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; valid names: {', '.join(list_attention())}")
    return _REGISTRY[name]


def _signature_options(name) -> dict[str, object]:
    """The keyword options of a variant's layer and their defaults, from its signature and its base classes'."""
    options: dict[str, object] = {}
    for klass in attention_class(name).__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        for p in params.values():
            if p.kind is p.KEYWORD_ONLY:
                options.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return options


def _entry(name, recipe: str) -> VariantEntry:
    """The registry entry of ``name`` (an empty one for a variant without one, or a layer class), ``recipe``
    checked against :data:`RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")
    return _ENTRIES.get(name, VariantEntry()) if isinstance(name, str) else VariantEntry()


def attention_options(name, recipe: str = "scratch") -> dict[str, object]:
    """The keyword options of a variant and their defaults (the papers'), as the named ``recipe`` of
    :data:`RECIPES` sets them (``"scratch"``: the layer's own defaults; ``"encoder-swap"``: in a pretrained encoder)."""
    options = _signature_options(name)
    options.update(_entry(name, recipe).recipes.get(recipe, {}))
    return options


def recipe_options(name, recipe: str = "scratch") -> dict[str, object]:
    """The options a run's config records for ``name`` under ``recipe``: those the recipe sets and those the
    variant's entry records at their default (:class:`VariantEntry`), resolved."""
    entry = _entry(name, recipe)
    if not entry.recipes.get(recipe) and not entry.recorded:
        return {}
    resolved = attention_options(name, recipe)
    return {k: resolved[k] for k in (*entry.recipes.get(recipe, {}), *entry.recorded)}


def build_attention(name, embed_dim: int, num_heads: int, **options) -> nn.Module:
    """Build the attention layer ``name`` (a registered name, or a layer class) for inputs of width
    ``embed_dim`` with ``num_heads`` heads.

    An unknown name or option is a ``ValueError`` that lists the valid ones.
    """
    cls = attention_class(name)
    valid = _signature_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        shown = name if isinstance(name, str) else cls.name or cls.__name__
        raise ValueError(
            f"unknown option(s) {unknown} for attention {shown!r}; valid options: {', '.join(sorted(valid))}"
        )
    return cls(embed_dim, num_heads, **options)
