"""The registry of attention variants: a variant joins with one line, ``@register("name")``.

Every module in ``gpattn/attention/`` whose name does not start with ``_`` is imported by the
package, so a new variant needs no edit anywhere else.

The names of the modelling choices resolve here, once (:func:`resolve`): a layer's ``prior_mean=`` or
``covariance=`` is a name of :data:`CHOICES` (the object it names is built here) or the object itself; the
conditioning code in :mod:`gpattn.variational` receives objects and reads no name.

A variant's defaults are data: its layer's keyword defaults (the papers'), and its entry in :data:`_ENTRIES`, the
named recipes (:data:`RECIPES`) that set options on top of them or select an internal form — a layer form registered
for the variant (``@register(name, form=...)``: sgpa's separate query and key maps) or objects in place of options
(sgpa's softmax prior mean) — and the options a run's config records even at their default.
:func:`attention_options` ``(name, recipe=...)`` returns the resolved options; :func:`recipe_options` the part a
config writes out; :func:`build_attention` ``(name, ..., recipe=...)`` builds the recipe's layer.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch.nn as nn

from gpattn.variational.covariances import (
    DiagonalCovariance,
    FullCovariance,
    TrainingQueryCovariance,
    TrainingSequenceCovariance,
)
from gpattn.variational.frequencies import GaussianFrequencies, OrthogonalFrequencies
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
    "CHOICES",
    "RECIPES",
    "Recipe",
    "VariantEntry",
    "attention_class",
    "attention_options",
    "build_attention",
    "former_options",
    "list_attention",
    "recipe_options",
    "register",
    "resolve",
]

_REGISTRY: dict[str, type[nn.Module]] = {}
#: (variant, form) -> the layer class of an internal form a recipe selects (not a registered name)
_LAYER_FORMS: dict[tuple[str, str], type[nn.Module]] = {}

#: the named recipes: ``"scratch"`` (a model trained from scratch: the layer's defaults), ``"encoder-swap"`` (the layer
#: swapped into a pretrained encoder, gpattn.integrations.huggingface.swap_attention), ``"out-of-scope"`` (an encoder
#: swap whose GP reads the whole input, for out-of-scope detection: sgpa-rff's, the clinc150-minilm preset's)
RECIPES = ("scratch", "encoder-swap", "out-of-scope")
#: the recipes every variant takes (a variant without an entry for one runs its own defaults under it)
_EVERY_VARIANT = ("scratch", "encoder-swap")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a named recipe does to a variant: ``options`` it sets (public options, written to a run's config), the
    internal ``form`` it selects (a layer form registered for the variant, or None: the variant's own layer) and
    ``objects`` it passes in place of options' names (option -> what builds the object, fresh per layer). Options
    given explicitly win over both."""

    options: dict = dataclasses.field(default_factory=dict)
    form: str | None = None
    objects: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class VariantEntry:
    """A variant's defaults beyond its layer's signature: ``recipes`` maps a recipe of :data:`RECIPES` to its
    :class:`Recipe`; ``recorded`` names options a run's config writes out at their default, so that config.json says
    which form ran (their default changed once; gpattn._migrate reads configs written before)."""

    recipes: dict = dataclasses.field(default_factory=dict)
    recorded: tuple = ()


#: the encoder swap of the SGPA variants keeps both pretrained maps (separate query and key maps,
#: docs/derivations.md §5d; the shared map would drop W_q, docs/huggingface.md) and takes the softmax prior mean
#: (§5e), so that the swapped layer's mean starts at the pretrained attention
_SGPA_SWAP = Recipe(form="separate-maps", objects={"prior_mean": SoftmaxMean})
#: every variant's entry (a variant without one has only its signature's defaults)
_ENTRIES: dict[str, VariantEntry] = {
    "sgpa": VariantEntry(recipes={"encoder-swap": _SGPA_SWAP}),
    "sgpa-decoupled": VariantEntry(recipes={"encoder-swap": _SGPA_SWAP}),
    "sgpa-rff": VariantEntry(recipes={
        # the swap's g starts at ℓ = 1, so that the median heuristic of match_prior_to_stream puts κ = e⁻¹ at the
        # median pair of queries (docs/derivations.md §5f)
        "encoder-swap": dataclasses.replace(_SGPA_SWAP, options={"lengthscale": 1.0}),
        # g on each sequence's unit mean query over all heads, R = 1024, ℓ = 0.2, w = 10⁴: chosen on CLINC150's
        # validation split, where the sequence's direction carries what no token does (docs/derivations.md §5f,
        # research/notes/sgpa_rff_variance.md, "Where MiniLM's last layer sees out-of-scope queries")
        "out-of-scope": dataclasses.replace(
            _SGPA_SWAP, options={"num_features": 1024, "lengthscale": 0.2},
            objects={**_SGPA_SWAP.objects,
                     "covariance": lambda: functools.partial(TrainingSequenceCovariance, data_weight=1e4)},
        ),
    }),
    # its mean: the pretrained attention in a swap; from scratch the softmax mean too (recorded: it was "zero" before)
    "kep-svgp": VariantEntry(
        recipes={"encoder-swap": Recipe(options={"prior_mean": "softmax"})}, recorded=("prior_mean",)
    ),
    "cgp": VariantEntry(recorded=("prior_mean",)),
    "scgp": VariantEntry(recorded=("prior_mean",)),
}

# ------------------------------------------------------------------------------------------ the names of the forms
#: the SGPA variants' prior means by name: (what builds the mean, what it is)
_SGPA_MEANS = {
    "attention": (AttentionMean, "normalised kernel attention as the GP's prior mean, docs/derivations.md §5c"),
    "zero": (ZeroMean, "the paper's form"),
}
_SGPA_COVARIANCES = {
    "full": (FullCovariance, "exact joint samples over the tokens"),
    "diag": (DiagonalCovariance, "independent tokens"),
}
#: every public name of a modelling choice, per variant and option: ``{variant: {option: {name: (what builds the
#: object it names, what it is)}}}``; :func:`resolve` builds it
CHOICES: dict[str, dict[str, dict[str, tuple]]] = {
    "sgpa": {"prior_mean": _SGPA_MEANS, "covariance": _SGPA_COVARIANCES},
    "sgpa-decoupled": {"prior_mean": _SGPA_MEANS, "covariance": _SGPA_COVARIANCES},
    "sgpa-rff": {
        "prior_mean": {"attention": _SGPA_MEANS["attention"]},
        # the covariance's class: the layer builds it with its sizes
        "covariance": {"query": (lambda: TrainingQueryCovariance, "g on each query, per head")},
        # how the random features' frequencies are drawn (docs/derivations.md §5f, "Choice: the frequencies' draw")
        "frequencies": {
            "gaussian": (GaussianFrequencies, "i.i.d. N(0, 1), Rahimi & Recht's"),
            "orthogonal": (OrthogonalFrequencies, "orthogonal random features, Yu et al. 2016: the same kernel, "
                           "unbiased, a lower variance at equal R"),
        },
    },
    "kep-svgp": {
        "prior_mean": {
            "softmax": (KEPSoftmaxMean, "softmax attention over values of the layer's own, the pretrained attention "
                        "in an encoder swap, docs/derivations.md §6"),
            "softmax-separate": (KEPSeparateSoftmaxMean, "the same with queries and keys of its own, apart from the "
                                 "KSVD features'"),
            "zero": (ZeroMean, "Chen et al.'s"),
        },
    },
    "cgp": {
        "prior_mean": {
            "softmax": (CorrelatedSoftmaxMean, "softmax attention of the canonical inputs as the prior mean of z_q "
                        "and z_k, docs/derivations.md §7a"),
            "zero": (ZeroMean, "the paper's form"),
        },
    },
    "scgp": {
        "prior_mean": {
            "softmax-separate": (CorrelatedSeparateSoftmaxMean, "softmax attention of the canonical inputs over "
                                 "values of its own, docs/derivations.md §7a"),
            "zero": (ZeroMean, "the paper's form"),
        },
    },
}
#: names a variant no longer takes, and where their form went (the error of :func:`resolve` says so)
_SGPA_SOFTMAX = (
    "the softmax mean is the encoder-swap recipe's (recipe='encoder-swap'); pass "
    "prior_mean=gpattn.variational.means.SoftmaxMean() for it alone"
)
_FORMER_NAMES = {
    ("sgpa", "prior_mean", "softmax"): _SGPA_SOFTMAX,
    ("sgpa-decoupled", "prior_mean", "softmax"): _SGPA_SOFTMAX,
    ("sgpa-rff", "prior_mean", "softmax"): "the softmax mean is the encoder-swap recipe's (recipe='encoder-swap')",
    ("cgp", "prior_mean", "softmax-separate"): "scgp's default, never measured better than 'softmax' for cgp (only "
    "at a swap's start, where both are the pretrained attention; docs/derivations.md §7a); pass "
    "prior_mean=gpattn.variational.means.CorrelatedSeparateSoftmaxMean() for it",
    ("scgp", "prior_mean", "softmax"): "over the GP's own values the regulariser shrank scgp's mean until it was inert "
    "(docs/derivations.md §7a); pass prior_mean=gpattn.variational.means.CorrelatedSoftmaxMean() for it",
}
#: options that left the layers' signatures and what owns their form now (the error of build_attention)
_FORMER_OPTIONS = {
    "qk": "separate query and key maps are the encoder-swap recipe's form: recipe='encoder-swap' (what an --encoder "
    "run builds, with the softmax mean: it replaces qk='separate' and prior_mean='softmax'); qk='shared' is the "
    "layers' own form (recipe='scratch'): drop it",
    "gp_input": "g on the sequence is the out-of-scope recipe's covariance: recipe='out-of-scope' (R = 1024, l = 0.2, "
    "w = 1e4, the clinc150-minilm preset's; it replaces gp_input='sequence', data_weight, qk and prior_mean), or "
    "covariance=functools.partial(gpattn.variational.covariances.TrainingSequenceCovariance, data_weight=...) for "
    "another setting; gp_input='query' is the default covariance: drop it",
    "data_weight": "w is a setting of g's covariance object (gpattn.variational.covariances.TrainingQueryCovariance"
    "(..., data_weight=...), passed as covariance=); the out-of-scope recipe sets 1e4; 1000.0 is the default: drop it",
    "momentum": "the running moment's weight is a setting of g's covariance object "
    "(gpattn.variational.covariances.TrainingQueryCovariance(..., momentum=...), passed as covariance=); 0.01 is the "
    "default: drop it",
    "feature_gradient": "a research probe: research/knobs.py's KEPSVGPProbe takes it; True is what the layer does: "
    "drop it",
    "token_independent": "the released code's sampler, a research probe: research/knobs.py's KEPSVGPProbe takes it; "
    "False is what the layer does: drop it",
    "include_residual": "a research probe: research/knobs.py's KEPSVGPProbe takes it; False is what the layer does: "
    "drop it",
    "prior_samples": "a research probe (the exact expectation, prior_samples=None, is a verification tool: set "
    "layer.strategy.prior_samples); research/knobs.py's CGPProbe takes it; 10 is what the layer does: drop it",
    "learn_sigma": "a research probe: research/knobs.py's CGPProbe and SCGPProbe take it; False is what the layers "
    "do: drop it",
}


def resolve(variant: str, option: str, value):
    """The object ``value`` of ``option`` stands for in ``variant``: a name of :data:`CHOICES` builds a fresh one (for a
    form the layer builds with its sizes, sgpa-rff's covariance, its class), anything else is the object itself. A
    name the variant does not have is a ``ValueError`` that lists its names and what each is, and says where a name
    it no longer takes went."""
    table = CHOICES[variant][option]
    if isinstance(value, str) and value not in table:
        meanings = "; ".join(f"{name!r}: {meaning}" for name, (_, meaning) in table.items())
        former = _FORMER_NAMES.get((variant, option, value))
        raise ValueError(
            f"{option} must be one of {list(table)} ({meanings}), got {value!r}" + (f": {former}" if former else "")
        )
    build = table.get(value, (lambda: value,))[0]
    return build()


# ------------------------------------------------------------------------------------------------- the registry
def register(name: str, *, form: str | None = None):
    """Class decorator: make an attention layer buildable as ``build_attention(name, ...)``; with ``form``, an internal
    form of the variant ``name`` that a recipe selects (:class:`Recipe`), not a name of its own."""

    def decorate(cls):
        table, key = (_REGISTRY, name) if form is None else (_LAYER_FORMS, (name, form))
        if key in table and table[key] is not cls:
            raise ValueError(f"attention {key!r} is registered twice ({table[key]} and {cls})")
        cls.name = name
        table[key] = cls
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


def _signature_options(cls) -> dict[str, object]:
    """The keyword options of a layer class and their defaults, from its signature and its base classes'."""
    options: dict[str, object] = {}
    for klass in cls.__mro__:
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


def _recipe(name, recipe: str) -> Recipe:
    """The :class:`Recipe` of ``name`` (a registered name, or a layer class: none) under ``recipe``: a recipe every
    variant takes (an empty one where the variant's entry has none), or one the variant's entry names."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")
    recipes = _ENTRIES.get(name, VariantEntry()).recipes if isinstance(name, str) else {}
    if recipe not in (*_EVERY_VARIANT, *recipes):
        takers = sorted(n for n, entry in _ENTRIES.items() if recipe in entry.recipes)
        raise ValueError(f"recipe {recipe!r} has no form of attention {name!r}: it is {', '.join(takers)}'s")
    return recipes.get(recipe, Recipe())


def attention_options(name, recipe: str = "scratch") -> dict[str, object]:
    """The options of a variant and their defaults (the papers'), as the named ``recipe`` of :data:`RECIPES` sets them
    (``"scratch"``: the layer's own defaults; ``"encoder-swap"``: in a pretrained encoder; ``"out-of-scope"``):
    ``recipe`` itself, then the layer's keyword options, those the recipe sets in its place (an internal form's
    objects: its docstring says which) left out. ``build_attention(name, D, H, **attention_options(name, recipe))``
    builds the recipe's layer."""
    chosen = _recipe(name, recipe)
    layer = _LAYER_FORMS.get((name, chosen.form), attention_class(name))
    options = {k: v for k, v in _signature_options(layer).items() if k not in chosen.objects}
    return {"recipe": recipe, **options, **chosen.options}


def recipe_options(name, recipe: str = "scratch") -> dict[str, object]:
    """The options a run's config records for ``name`` under ``recipe``: the recipe's name where it is one of the
    variant's own (its entry names it), the options it sets and those the variant's entry records at their default
    (:class:`VariantEntry`), resolved."""
    entry = _ENTRIES.get(name, VariantEntry()) if isinstance(name, str) else VariantEntry()
    resolved = attention_options(name, recipe)
    named = {"recipe": recipe} if recipe in entry.recipes else {}
    return {**named, **{k: resolved[k] for k in (*_recipe(name, recipe).options, *entry.recorded)}}


def former_options(name, options) -> dict[str, str]:
    """The options of ``options`` (names) that left the layer of ``name`` (a registered name or a layer class), each
    with what owns its form now; empty when there are none."""
    valid = _signature_options(attention_class(name))
    return {k: _FORMER_OPTIONS[k] for k in sorted(options) if k in _FORMER_OPTIONS and k not in valid}


def build_attention(name, embed_dim: int, num_heads: int, *, recipe: str = "scratch", **options) -> nn.Module:
    """Build the attention layer ``name`` (a registered name, or a layer class) for inputs of width
    ``embed_dim`` with ``num_heads`` heads, as the named ``recipe`` of :data:`RECIPES` has it (its options and
    internal form under the options given here).

    An unknown name, recipe or option is a ``ValueError`` that lists the valid ones (and, for an option that left the
    layers, says what owns its form now).
    """
    chosen = _recipe(name, recipe)
    cls = _LAYER_FORMS.get((name, chosen.form), attention_class(name))
    valid = _signature_options(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        shown = name if isinstance(name, str) else cls.name or cls.__name__
        former = "".join(f"; {k}: {owner}" for k, owner in former_options(cls, unknown).items())
        raise ValueError(
            f"unknown option(s) {unknown} for attention {shown!r}; valid options: recipe, "
            f"{', '.join(sorted(valid))}{former}"
        )
    objects = {option: build() for option, build in chosen.objects.items()}
    return cls(embed_dim, num_heads, **{**chosen.options, **objects, **options})
