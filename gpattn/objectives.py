"""The deep-GP ELBO objective in GPyTorch's marginal-log-likelihood idiom (docs/derivations.md §9;
Chen et al. (2024) eq. 20, Chen & Li (2023) §3.4).

.. math::
    \\mathcal{L} = \\overline{\\mathrm{CE}} + \\beta\\Big[\\operatorname{mean}_b \\sum_\\ell KL^{seq}_\\ell(x_b)
        + \\tfrac{1}{N}\\sum_\\ell KL^{global}_\\ell\\Big] + \\eta \\sum_{KEP} J^2 + \\alpha \\sum_{CGP} R
        - \\tfrac{1}{N} \\log p(\\theta)

Each GP layer registers the terms of its last forward as GPyTorch added loss terms
(:class:`gpytorch.mlls.AddedLossTerm`, through ``register_added_loss_term`` / ``update_added_loss_term``).
A :class:`GPLossTerm` knows its kind: its ``name`` (the key of the loss parts and of the trainer's
history) and its weight, a :class:`TermWeight` looked up by name in the objective's weights
(:meth:`GPLossTerm.weight`). The library's kinds: :class:`SequenceKL` (already a batch mean, weight β),
:class:`GlobalKL` (weight β / N), :class:`KSVDLoss` (weight η) and :class:`CGPRegulariser` (weight α).
:class:`DeepGPELBO` is built like ``gpytorch.mlls.VariationalELBO`` (``num_data``, ``beta``,
``combine_terms``) and sums the model's added loss terms with their weights, plus the log densities of the
gpytorch priors registered anywhere in the model (``named_priors()``), divided by N as GPyTorch's MLLs
divide them. A new regulariser is one :class:`GPLossTerm` subclass in its layer's file, with its own
:class:`TermWeight` if it needs one: the objective (``DeepGPELBO(..., gamma=0.5)``), the trainer's history
and config (``TrainConfig(loss_weights={"gamma": 0.5})``) and the CLI (``--loss-weight gamma=0.5``) take it
by name.

Signs: GPyTorch's MLLs return the ELBO to maximise; :class:`DeepGPELBO` returns the loss to minimise
(its negative). With the deterministic baselines every term is absent and the loss is the NLL.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import ClassVar

import gpytorch
import torch
import torch.nn.functional as F
from gpytorch.mlls import AddedLossTerm

from gpattn._settings import is_validating
from gpattn._warnings import warn

__all__ = [
    "ALPHA",
    "BETA",
    "CGPRegulariser",
    "DEFAULT_ALPHA",
    "DeepGPELBO",
    "ETA",
    "GPLossTerm",
    "GlobalKL",
    "KSVDLoss",
    "LossTermWalkers",
    "LossWeights",
    "SequenceKL",
    "TermWeight",
    "expected_nll",
    "named_added_loss_terms",
    "summed_loss_terms",
    "term_weights",
]

#: Default weight α of the CGP regulariser, everywhere (DeepGPELBO, TrainConfig, the CLI). R (Bui et al. eqs.
#: 28, 44) is not an ELBO term and α is a hyperparameter chosen on validation data (Bui et al. Remark 3):
#: ``compare`` chooses it from a grid (``--alpha-grid``; the presets' ``PRESET_ALPHA_GRID``). How this default
#: was measured: docs/derivations.md §9 and docs/archive/results-2026-11.md ("cgp and scgp: the regulariser weight α").
DEFAULT_ALPHA = 1e-6

#: keys of the loss parts that belong to the objective, never to a term or a weight (the weights in force
#: that anneal are reported under their own names, which no term may take either)
RESERVED_PARTS = ("nll", "log_prior", "loss")


def expected_nll(logits: torch.Tensor, labels: torch.Tensor, likelihood: str = "expected") -> torch.Tensor:
    """Monte-Carlo data term from sample logits.

    ``"expected"`` (the ELBO's E_q[-log p(y|F)]): mean over B and P of the cross-entropy;
    ``"predictive"``: -log of the sample-averaged probability (the predictive NLL).
    # shape: logits (B, P, C), labels (B,)
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, P, C), got {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must have shape (B,) = {tuple(logits.shape[:1])}, got {tuple(labels.shape)}")
    B, P, C = logits.shape
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"labels must be class indices of integer dtype, got {labels.dtype}")
    if labels.numel() and is_validating():  # reads the device: opt-in (gpattn.validation())
        low, high = (int(v) for v in torch.aminmax(labels))
        if low < 0 or high >= C:
            raise ValueError(
                f"labels must lie in [0, C={C}) for logits of shape {tuple(logits.shape)}, "
                f"got values in [{low}, {high}]"
            )
    labels = labels.long()
    if likelihood == "expected":
        return F.cross_entropy(logits.reshape(B * P, C), labels.repeat_interleave(P))
    if likelihood == "predictive":
        logp = torch.logsumexp(F.log_softmax(logits, -1), dim=1) - math.log(P)  # shape: (B, C)
        return F.nll_loss(logp, labels)
    raise ValueError(f"likelihood must be 'expected' or 'predictive', got {likelihood!r}")


# ----------------------------------------------------------------------------- the terms
@dataclasses.dataclass(frozen=True)
class TermWeight:
    """A weight of the objective, declared by the loss terms it multiplies (:attr:`GPLossTerm.weight_of`).

    ``name`` is the objective's keyword (``DeepGPELBO(model, N, beta=...)``), the key of :class:`LossWeights`
    and of ``TrainConfig.loss_weights``; ``default`` its value where none is given; ``anneals``: it ramps
    linearly 0 → value over ``<name>_anneal_steps`` optimizer steps, and the value in force is reported in
    the loss parts. Kinds that share a weight declare the same one (:class:`SequenceKL` and :class:`GlobalKL`:
    :data:`BETA`)."""

    name: str
    default: float
    anneals: bool = False


#: the KL weight β (:class:`SequenceKL`, :class:`GlobalKL`)
BETA = TermWeight("beta", 1.0, anneals=True)
#: the KSVD weight η (:class:`KSVDLoss`; 0.1, as in the authors' released code)
ETA = TermWeight("eta", 0.1)
#: the CGP regulariser weight α (:class:`CGPRegulariser`; Bui et al. anneal it)
ALPHA = TermWeight("alpha", DEFAULT_ALPHA, anneals=True)


@dataclasses.dataclass(frozen=True)
class LossWeights(Mapping):
    """The objective's weights in force at one step, by name, handed to every term's weight rule:
    ``weights["beta"]`` (also ``weights.beta``), after annealing. ``kl_divisor`` is N under
    ``kl_scaling="elbo"`` and 1 under ``"peer"``."""

    #: the weights in force, by name (every TermWeight of the registered kinds)
    named: Mapping[str, float]
    num_data: int
    kl_divisor: int

    def __getitem__(self, name: str) -> float:
        if name not in self.named:
            raise KeyError(f"no loss weight {name!r}; the objective's weights: {', '.join(self.named)}")
        return self.named[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.named)

    def __len__(self) -> int:
        return len(self.named)

    def __getattr__(self, name: str) -> float:
        if name.startswith("_") or name == "named":  # not a weight (and no recursion while unpickling)
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(err.args[0]) from None


class GPLossTerm(AddedLossTerm):
    """A scalar loss term of one forward of a layer, which knows its kind (a GPyTorch added loss term).

    A subclass sets ``name`` (an identifier: the key of the loss parts, of the trainer's history and
    of ``layer.loss_terms()``; one class per name) and its weight: ``weight_of``, the objective's
    :class:`TermWeight` it is multiplied by (a new one, with its own name and default, needs no edit
    anywhere else: the objective, ``TrainConfig.loss_weights`` and ``gpattn train --loss-weight NAME=VALUE``
    take it by name), or its own :meth:`weight` rule. The value is the layer's reduced term
    (docs/derivations.md §9: summed over heads and Dv, averaged over the batch where it depends on the
    sequence), a 0-dim tensor."""

    name: ClassVar[str] = ""
    #: the objective's weight this term is multiplied by (None: the subclass implements :meth:`weight`)
    weight_of: ClassVar[TermWeight | None] = None
    _kinds: ClassVar[dict[str, type[GPLossTerm]]] = {}
    _weights: ClassVar[dict[str, TermWeight]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name, weight = cls.name, cls.weight_of
        weight_names = {*GPLossTerm._weights, *([getattr(weight, "name", None)] if weight is not None else [])}
        if not isinstance(name, str) or not name.isidentifier() or name in (*RESERVED_PARTS, *weight_names):
            raise TypeError(
                f"{cls.__qualname__}.name must be an identifier other than {', '.join(RESERVED_PARTS)} and the "
                f"objective's weights ({', '.join(GPLossTerm._weights)}) (the key of its loss part), got {name!r}: "
                f"set the class attribute name = '...'"
            )
        known = GPLossTerm._kinds.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(
                f"loss term name {name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                f"{known.__module__}.{known.__qualname__}: choose another name"
            )
        if weight is None and cls.weight is GPLossTerm.weight:
            raise TypeError(
                f"{cls.__qualname__} needs a weight: set weight_of = TermWeight(name, default) (or an existing "
                f"one: {', '.join(GPLossTerm._weights)}), or implement weight(self, weights)"
            )
        if weight is not None:
            _declare_weight(weight, cls)
        GPLossTerm._kinds[name] = cls

    def __init__(self, value: torch.Tensor):
        if not torch.is_tensor(value) or value.dim() != 0:
            got = f"shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__
            raise ValueError(
                f"{type(self).__name__}(value): value must be a 0-dim tensor (the layer's reduced term), got {got}"
            )
        self.value = value

    def loss(self) -> torch.Tensor:
        """The unweighted term (what the loss parts report)."""
        return self.value

    def weight(self, weights: LossWeights) -> float:
        """The factor of this term in the loss, from the objective's weights at this step: its
        ``weight_of`` by name."""
        return weights[self.weight_of.name]

    @classmethod
    def kind(cls, name: str) -> type[GPLossTerm]:
        """The term class registered under ``name``."""
        if name not in cls._kinds:
            raise ValueError(f"unknown loss terms [{name!r}]; known: {sorted(cls._kinds)}")
        return cls._kinds[name]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


def _declare_weight(weight: TermWeight, cls: type) -> None:
    """Register the weight ``cls`` declares; another declaration under the same name is an error."""
    if not isinstance(weight, TermWeight):
        raise TypeError(f"{cls.__qualname__}.weight_of must be a TermWeight, got {type(weight).__name__}")
    name = weight.name
    if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_PARTS or name in GPLossTerm._kinds:
        raise TypeError(
            f"{cls.__qualname__}.weight_of.name must be an identifier other than {', '.join(RESERVED_PARTS)} and "
            f"the loss terms' names, got {name!r}"
        )
    if not (isinstance(weight.default, (int, float)) and not isinstance(weight.default, bool) and weight.default >= 0):
        raise TypeError(f"{cls.__qualname__}.weight_of.default must be a number >= 0, got {weight.default!r}")
    known = GPLossTerm._weights.setdefault(name, weight)
    if known != weight:
        raise TypeError(
            f"{cls.__qualname__} declares the loss weight {weight}, but {name!r} is declared as {known}: use that "
            f"one (weight_of = the same TermWeight) or another name"
        )


def term_weights() -> dict[str, TermWeight]:
    """Every weight the registered :class:`GPLossTerm` kinds declare, by name, in declaration order."""
    return dict(GPLossTerm._weights)


class SequenceKL(GPLossTerm):
    """KL terms that depend on the input sequence (SGPA; the γ-part of decoupled SGPA), already averaged
    over the batch: weight β, not divided by N."""

    name = "kl_seq"
    weight_of = BETA


class GlobalKL(GPLossTerm):
    """KL terms over global parameters only (the β-part of decoupled SGPA, KEP-SVGP): weight β / N
    (β under ``kl_scaling="peer"``), as ``gpytorch.mlls.VariationalELBO`` divides its KL."""

    name = "kl_global"
    weight_of = BETA

    def weight(self, weights: LossWeights) -> float:
        return weights[BETA.name] / weights.kl_divisor


class KSVDLoss(GPLossTerm):
    """KEP-SVGP's J² (docs/derivations.md §6): weight η."""

    name = "ksvd"
    weight_of = ETA


class CGPRegulariser(GPLossTerm):
    """The CGP regulariser mean_b Σ_{h,d} R / 2 (docs/derivations.md §7–8): weight α (not an ELBO term)."""

    name = "cgp"
    weight_of = ALPHA


class LossTermWalkers:
    """GPyTorch's walkers over a module tree's added loss terms and priors (``gpytorch.Module``'s own
    functions, which need only ``nn.Module``), for plain ``nn.Module`` models: mixed into gpattn's
    classifiers, the Hugging Face wrapper and the attention layers, it gives them the objective's view
    (:class:`DeepGPELBO`) without ``gpytorch.Module.__call__``, which skips forward hooks."""

    named_added_loss_terms = gpytorch.Module.named_added_loss_terms
    added_loss_terms = gpytorch.Module.added_loss_terms
    named_priors = gpytorch.Module.named_priors


def named_added_loss_terms(module: torch.nn.Module) -> Iterator[tuple[str, AddedLossTerm]]:
    """``(path, term)`` for every added loss term of a module tree, each once: GPyTorch's own walker
    (``gpytorch.Module.named_added_loss_terms``), which needs only ``named_children`` and each module's
    registered terms, so it also runs on plain ``nn.Module`` models and DDP wrappers."""
    return gpytorch.Module.named_added_loss_terms(module)


def summed_loss_terms(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unweighted added loss terms of a module tree's last forward, summed by name (the keys of the
    loss parts): what ``layer.loss_terms()`` returns."""
    total: dict[str, torch.Tensor] = {}
    for path, term in named_added_loss_terms(module):
        key, value = _part_name(path, term), term.loss()
        total[key] = total[key] + value if key in total else value
    return total


def _part_name(path: str, term: AddedLossTerm) -> str:
    """A GPLossTerm's kind; another AddedLossTerm (GPyTorch's own) under its registered name."""
    return term.name if isinstance(term, GPLossTerm) else path.rpartition(".")[2]


def _part_weight(term: AddedLossTerm, weights: LossWeights) -> float:
    """A GPLossTerm's weight rule; GPyTorch's MLLs add the other terms with weight 1."""
    return term.weight(weights) if isinstance(term, GPLossTerm) else 1.0


# ----------------------------------------------------------------------------- the objectives
class _Objective:
    """Settings, validation and weighting of :class:`DeepGPELBO`: the weights by name (:func:`term_weights`)."""

    def __init__(self, num_data: int, *, kl_scaling: str = "elbo", likelihood: str = "expected", **weights):
        if isinstance(num_data, bool) or not isinstance(num_data, int) or num_data < 1:
            raise ValueError(f"num_data must be a positive int (the training-set size N), got {num_data!r}")
        if kl_scaling not in ("elbo", "peer"):
            raise ValueError(f"kl_scaling must be 'elbo' or 'peer', got {kl_scaling!r}")
        declared = term_weights()
        ramps = {f"{name}_anneal_steps": name for name, w in declared.items() if w.anneals}
        unknown = sorted(set(weights) - set(declared) - set(ramps))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown settings {unknown}: its weights are {', '.join(declared)} (those "
                f"the registered GPLossTerm kinds declare, TermWeight), annealed by {', '.join(ramps)}"
            )
        for name in declared:
            if name in weights and not weights[name] >= 0:
                raise ValueError(f"{name} must be >= 0, got {weights[name]!r}")
        for key in ramps:
            val = weights.get(key, 0)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{key} must be an int >= 0, got {val!r}")
        expected_nll(torch.zeros(1, 1, 2), torch.zeros(1, dtype=torch.long), likelihood)  # validates likelihood
        self.num_data, self.kl_scaling, self.likelihood = num_data, kl_scaling, likelihood
        #: the weights given by name (the others take their TermWeight's default) and the annealing steps
        self.loss_weights = {name: weights[name] for name in declared if name in weights}
        self.anneal_steps = {ramps[key]: weights[key] for key in ramps if key in weights}

    def __getattr__(self, name: str):
        """``objective.beta`` and every other weight by name (its default where none was given), and
        ``objective.beta_anneal_steps``."""
        if name.startswith("_") or name in ("loss_weights", "anneal_steps"):
            raise AttributeError(name)
        declared = term_weights()
        if name in declared:
            return self.loss_weights.get(name, declared[name].default)
        weight, _, suffix = name.rpartition("_anneal_")
        if suffix == "steps" and weight in declared and declared[weight].anneals:
            return self.anneal_steps.get(weight, 0)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @staticmethod
    def _ramp(value: float, steps: int, step: int | None) -> float:
        if steps == 0 or step is None:
            return value
        return value * min(1.0, max(0, step) / steps)

    def weights(self, step: int | None = None) -> LossWeights:
        """The weights in force at optimizer step ``step`` (``None``: after annealing), by name."""
        values = {
            name: self._ramp(self.loss_weights.get(name, w.default), self.anneal_steps.get(name, 0), step)
            for name, w in term_weights().items()
        }
        return LossWeights(values, num_data=self.num_data, kl_divisor=self.num_data if self.kl_scaling == "elbo" else 1)

    def _parts(self, logits, labels, terms: Iterable[tuple[str, AddedLossTerm]], log_prior, step) -> dict:
        """``{"nll", one entry per term name (unweighted, summed over layers), ["log_prior"], every annealed
        weight in force ("beta", "alpha"), "loss"}``; ``loss`` = nll + Σ weight · term − log_prior / N."""
        nll = expected_nll(logits, labels, self.likelihood)
        weights = self.weights(step)
        parts, loss = {"nll": nll}, nll
        for path, term in terms:
            key, value = _part_name(path, term), term.loss()
            parts[key] = parts[key] + value if key in parts else value
            loss = loss + _part_weight(term, weights) * value
        if log_prior is not None:
            parts["log_prior"] = log_prior
            loss = loss - log_prior / self.num_data
        # new_full fills on the device; new_tensor would copy a host scalar and synchronise every step
        parts.update({name: nll.new_full((), weights[name]) for name, w in term_weights().items() if w.anneals})
        parts["loss"] = loss
        return parts


class DeepGPELBO(_Objective):
    """The deep-GP ELBO of ``model`` (docs/derivations.md §9), in ``gpytorch.mlls.VariationalELBO``'s idiom, as a loss.

    ``objective(logits, labels, step=None)`` after a forward of ``model``: ``combine_terms=True`` returns
    the loss (a 0-dim tensor); ``combine_terms=False`` the parts, unweighted and separate (``nll``, one
    entry per added-loss-term name, summed over layers, ``log_prior`` when the model has priors), the
    annealed weights in force (``beta``, ``alpha``) and ``loss``.

    The weights are keywords by name: those below, and any other :class:`TermWeight` a registered
    :class:`GPLossTerm` kind declares (:func:`term_weights`; its default where not given, annealed by
    ``<name>_anneal_steps`` when it ``anneals``).

    :param model: any ``torch.nn.Module``; its added loss terms (of its last forward) and gpytorch priors
        are collected over the whole module tree.
    :param num_data: N, the training-set size (divides ``kl_global`` and the log prior).
    :param beta: KL weight β; ``beta_anneal_steps > 0`` ramps it linearly 0 → β.
    :param eta: KSVD weight η (default 0.1, as in the authors' released code).
    :param alpha: CGP regulariser weight α (default :data:`DEFAULT_ALPHA`); ``alpha_anneal_steps > 0``
        ramps 0 → α (Bui et al.).
    :param combine_terms: the loss (True) or the parts (False), as in GPyTorch's MLLs.
    :param kl_scaling: ``"elbo"`` (docs/derivations.md §9) or ``"peer"`` (the SGPA release: every KL undivided).
    :param likelihood: see :func:`expected_nll`.
    """

    def __init__(self, model: torch.nn.Module, num_data: int, *, combine_terms: bool = True, **settings):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"model must be the torch.nn.Module whose loss terms the objective sums, got {type(model).__name__}"
            )
        if not isinstance(combine_terms, bool):
            raise ValueError(f"combine_terms must be True (the loss) or False (the parts), got {combine_terms!r}")
        super().__init__(num_data, **settings)
        self.model, self.combine_terms = model, combine_terms

    def named_loss_terms(self) -> Iterator[tuple[str, AddedLossTerm]]:
        """The model's added loss terms of its last forward, ``(path, term)``."""
        return named_added_loss_terms(self.model)

    def log_prior(self) -> torch.Tensor | None:
        """Σ log p(θ) over the gpytorch priors registered in the model (``None`` if it has none)."""
        total = None
        for _, module, prior, closure, _ in gpytorch.Module.named_priors(self.model):
            value = prior.log_prob(closure(module)).sum()
            total = value if total is None else total + value
        return total

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, step: int | None = None):
        """The objective of the model's last forward, which must be a training-mode one for its GP layers' terms: an
        eval-mode forward records none (the KL terms and the CGP regulariser are training's, not evaluation's), so a
        model in eval mode with a GP layer gets a warning that the loss is the data term alone.
        # shape: logits (B, P, C), labels (B,) -> the loss (combine_terms) or the parts"""
        if not self.model.training and any(getattr(m, "is_gp", False) for m in self.model.modules()):
            warn(
                f"{type(self).__name__}: the model is in eval mode, and a GP layer records its loss terms (KL, CGP "
                f"regulariser) in training mode only: this loss is the data term alone. Call model.train() before "
                f"the forward whose objective you compute."
            )
        parts = self._parts(logits, labels, self.named_loss_terms(), self.log_prior(), step)
        return parts["loss"] if self.combine_terms else parts
