r"""Prior mean functions of the GP attention variants: one protocol, GPyTorch's ``mean_module`` (docs/derivations.md
§5c, §5e, §6, §7a).

A GP prior GP(m, κ) with a mean function m pays in its KL only for the posterior's deviation from m. Every variant
that takes a prior mean (sgpa, sgpa-decoupled, sgpa-rff, kep-svgp, cgp, scgp) receives a :class:`PriorMean`, one kind
of module::

    mean(queries, keys, values, *, kernel=None, excluded=None, gram=None) -> m(q), or None

``excluded`` (broadcastable to (B, H, T, S), True = key j not in A_i) leaves keys out; ``gram`` is κ(q, k) where the
caller has it; ``None`` is the zero of :class:`ZeroMean` (the papers'), which :func:`add_means` leaves out, so it
costs no operation. A mean owns what a layer needs of it: the projections it reads of its own
(:attr:`PriorMean.projections`, rows of the layer's fused ``in_proj``; :meth:`PriorMean.inputs` puts them in the
roles they take), the kernel an SGPA layer builds for it (:attr:`PriorMean.default_kernel`,
:meth:`PriorMean.initial_lengthscale`), the q(ũ) mean an SGPA strategy pairs with it
(:attr:`PriorMean.variational_mean`: :class:`AmortisedValueMean` or :class:`CentredVariationalMean`, which reach the
conditioning code through one interface, their ``inducing_values``) and its own state (the correlated GPs'
temperature). Names resolve to these objects once, in the registry (``gpattn.attention.registry``): nothing here reads
a name.

* :class:`AttentionMean`: the normalised kernel attention of the sequence with the GP's own kernel (the SGPA
  variants' default),

  .. math:: m(q_i) = \frac{\sum_{j \in A_i} \kappa(q_i, k_j)\, v_j}{\sum_{j \in A_i} \kappa(q_i, k_j)}.

* :class:`SoftmaxMean`: softmax attention with the kernel's (ARD) lengthscale as its temperature, whatever the
  kernel (§5e): an encoder swap's mean is the pretrained softmax attention exactly,

  .. math:: m(q_i) = \sum_{j \in A_i} \mathrm{softmax}_j\big((q_i/\ell) \cdot (k_j/\ell)\big)\, v_j.

* :class:`CorrelatedSoftmaxMean`: the correlated GPs' softmax attention of the canonical inputs at a temperature it
  keeps (§7a); :class:`CorrelatedSeparateSoftmaxMean` over values of its own.
* :class:`KEPSoftmaxMean`: kep-svgp's softmax attention over values of its own (§6);
  :class:`KEPSeparateSoftmaxMean` with queries and keys of its own too.
* :class:`ZeroMean`: m = 0, the papers' form.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.nn as nn

from gpattn._migrate import moved_names
from gpattn._settings import is_validating
from gpattn.kernels._evaluate import evaluate_kernel, temperature_lengthscale
from gpattn.variational._fused import fused_kernel_attention, fused_softmax
from gpattn.variational._scale import attention_lengthscale

__all__ = [
    "AmortisedValueMean",
    "AttentionMean",
    "CentredVariationalMean",
    "CorrelatedSeparateSoftmaxMean",
    "CorrelatedSoftmaxMean",
    "KEPSeparateSoftmaxMean",
    "KEPSoftmaxMean",
    "OWN_VALUES",
    "PriorMean",
    "SoftmaxMean",
    "ZeroMean",
    "add_means",
    "present",
    "softmax_attention",
    "when_present",
]

#: a name a release exported that moved raises an error that says where it went (gpattn._migrate.MOVED_NAMES)
__getattr__ = moved_names(__name__)

#: the value projection of a prior mean that owns its values: rows of the layer's fused ``in_proj``
#: (docs/derivations.md §6, §7a)
OWN_VALUES = ("v_mean",)
#: the role in :meth:`PriorMean.forward` each projection a mean may own takes
ROLES = {"q_mean": "queries", "k_mean": "keys", "v_mean": "values"}


def present(*terms):
    """The terms that are not None, in order: None is the zero of :class:`ZeroMean` and of a q(ũ) centred at the prior
    mean (a posterior mean's term, a KL's, a loss term built from one), which costs no operation. With
    :func:`when_present`, the one place the conditioning code asks whether a term is there."""
    return [term for term in terms if term is not None]


def add_means(*terms: torch.Tensor | None) -> torch.Tensor:
    """The sum of the terms of a posterior mean (a prior mean m(q), a q(ũ) update, ...) or of a KL, the zeros (None)
    left out, in order (at least one term is present)."""
    return functools.reduce(operator.add, present(*terms))


def when_present(fn, *terms: torch.Tensor | None):
    """``fn(*terms)``, or None where a term is None: for the terms that vanish with a zero mean (products and quadratic
    forms of a zero prior mean or of a q(ũ) centred at the prior mean), so that a zero costs no operation."""
    return None if any(term is None for term in terms) else fn(*terms)


# -------------------------------------------------------------- q(ũ)'s mean (SGPA, docs/derivations.md §5a-§5c)
class AmortisedValueMean:
    r"""q(ũ) = N(Lᵀv, ·): the sequence's values are q(u)'s mean, m_u = K v (Chen & Li 2023, docs/derivations.md §5a),
    the pairing of the papers' zero prior mean; in sgpa-decoupled the coefficients of the mean basis γ on the
    sequence's keys (§5b). Its one interface, :meth:`inducing_values`, is what the conditioning code reads, as
    GPyTorch's strategies read ``inducing_values``: every term of q(ũ)'s mean (the posterior mean's K̂ v, the KL's
    ½ vᵀK̂v, the decoupled γ-basis) is formed from it there."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def inducing_values(values: torch.Tensor) -> torch.Tensor:
        """q(u)'s mean in coefficient form, α with m_u = K α: the values.  # shape: (B, H, T, Dv) -> (B, H, T, Dv)"""
        return values


class CentredVariationalMean:
    """q(ũ) = N(0, ·) with ũ = L⁻¹(u − m(k)): centred at the prior mean (docs/derivations.md §5c), the pairing of a
    prior mean that attends. Its coefficients are None, the zero: every term of q(ũ)'s mean vanishes (no K̂ v, no
    ½ vᵀK̂v, no γ-basis, no per-sequence KL)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def inducing_values(values: torch.Tensor) -> None:
        """None: q(ũ)'s mean is 0."""
        return None


class PriorMean(nn.Module):
    """The protocol of every prior mean (module docstring): :meth:`forward` gives m(q); the class attributes say
    what a layer needs of the mean. (A plain ``nn.Module`` in the role of a ``gpytorch.means.Mean``, whose
    ``__call__`` takes one input: this mean reads the keys and values too.)"""

    #: the public spelling a layer shows for this mean (``extra_repr``, error messages)
    name = ""
    #: the projections the mean reads of its own (rows of the layer's fused ``in_proj``), in the roles of
    #: :data:`ROLES`: none (it reads the GP's queries, keys and values)
    projections: tuple[str, ...] = ()
    #: the kernel spec of ``kernel=None`` in the SGPA variants: the stationary ARD-RBF (a similarity smoother whose
    #: prior variance does not grow with the sharpness of the attention, docs/derivations.md §5c)
    default_kernel = "ard-rbf"
    #: the other form, named in the error for a wrong ``mean_values``
    instead = ""
    #: the q(ũ) mean an SGPA strategy pairs with this prior mean: centred at it
    variational_mean = CentredVariationalMean

    @staticmethod
    def initial_lengthscale(head_dim: int) -> float | None:
        """The SGPA kernel's initial lengthscale: Dh^¼, so that a mean that attends starts at softmax attention's
        temperature (docs/derivations.md §5c, §5e)."""
        return attention_lengthscale(head_dim)

    def check_kernel(self, kernel) -> None:
        """Nothing: a ``ValueError`` where the mean cannot read ``kernel`` (at build time rather than at a forward)."""

    def start_on_mean(self, *parameters: torch.Tensor) -> None:
        """Start the layer on this mean: the GP's own mean ``parameters`` zeroed in place, so that its posterior mean
        starts at 0 on top of a mean that attends (kep-svgp, docs/derivations.md §6)."""
        for parameter in parameters:
            parameter.zero_()

    def rescale_inputs(self, factor: float) -> None:
        """The layer's canonical inputs are multiplied by ``factor``: keep m as it was (nothing by default)."""

    def inputs(self, queries, keys, values, mean_values=(), value_shape=None) -> tuple:
        """(queries, keys, values) the mean reads: the GP's, with the tensors of its own projections (``mean_values``,
        one per :attr:`projections`, in order; one tensor alone for one projection) in their roles. ``value_shape``:
        the shape its own values must have (default ``values.shape``). A ``ValueError`` names a missing, extra or
        misshapen tensor.  # shape: queries, keys (B, H, T, Dh), values (B, H, T, Dv) or None"""
        given = (mean_values,) if torch.is_tensor(mean_values) else tuple(mean_values or ())
        if given and not self.projections:
            raise ValueError(f"mean_values: only a prior mean with values of its own reads them, not {self.name!r}")
        roles = {"queries": queries, "keys": keys, "values": values}
        shape = tuple(values.shape) if value_shape is None else tuple(value_shape)
        self._check_own(given, shape)
        roles.update((ROLES[name], tensor) for name, tensor in zip(self.projections, given))
        return roles["queries"], roles["keys"], roles["values"]

    def _check_own(self, given: tuple, shape: tuple) -> None:
        """The own tensors of :meth:`inputs`: one per projection, the values of ``shape``, queries and keys of one
        shape with its (B, H, T)."""
        values = given[-1] if given else None
        misshapen = bool(given) and (not torch.is_tensor(values) or tuple(values.shape) != shape)
        if len(given) != len(self.projections) or misshapen:
            got = (
                tuple(values.shape) if torch.is_tensor(values) and len(given) == len(self.projections)
                else f"{len(given)} tensors" if len(given) > 1 else type(values).__name__
            )
            what = (
                f"a tensor of shape {shape}" if len(self.projections) == 1
                else f"a tuple of {len(self.projections)} tensors, the values of shape {shape}"
            )
            roles = [ROLES[name] for name in self.projections]
            reads = ", ".join(roles[:-1]) + " and " * (len(roles) > 1) + "".join(roles[-1:])
            raise ValueError(
                f"mean_values: prior_mean={self.name!r} reads {reads} of its own (the layer's "
                f"{', '.join(self.projections)} projection{'s' * (len(roles) > 1)}), {what}, got {got}{self.instead}"
            )
        q_own = given[:-1]
        if q_own and (
            not all(torch.is_tensor(t) for t in q_own) or q_own[0].shape != q_own[-1].shape
            or q_own[0].shape[:-1] != shape[:-1]
        ):
            shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in q_own]
            raise ValueError(
                f"mean_values: prior_mean={self.name!r} needs its queries and keys of one shape (B, H, T, Dh) with "
                f"(B, H, T) = {shape[:-1]}, got {' and '.join(map(str, shapes))}"
            )

    def forward(self, queries, keys, values, *, kernel=None, excluded=None, gram=None) -> torch.Tensor | None:
        """m(q).  # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv) -> (B, H, T, Dv) or None"""
        raise NotImplementedError

    def fused(self, queries, keys, values, *, kernel=None, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention under key padding ``pad`` (B, S) alone (no (T, S) matrix, docs/derivations.md
        §12), or None where no fused path runs (by default: none)."""
        return None


class ZeroMean(PriorMean):
    """m = 0, the papers' prior mean (Chen & Li 2023; Chen et al. 2024; Bui et al.): the SGPA strategies' q(ũ) then
    carries the amortised mean on the values (docs/derivations.md §5a), kep-svgp's GP the whole output, the
    correlated GPs' ν the whole attention (§7). Its value is None, the zero that :func:`add_means` leaves out; it
    reads nothing of its own; its SGPA kernel is Chen & Li's exponential dot-product kernel."""

    name = "zero"
    default_kernel = "exponential"
    #: the papers' pairing: q(ũ)'s mean is the amortised one on the values
    variational_mean = AmortisedValueMean

    @staticmethod
    def initial_lengthscale(head_dim: int) -> None:
        """None: the exponential kernel's own (√Dh on the stream's scale, :mod:`gpattn.variational._scale`)."""
        return None

    def start_on_mean(self, *parameters: torch.Tensor) -> None:
        """Nothing: with the zero mean the GP's own mean is the layer's mean (the papers' initialisation)."""

    def forward(self, queries, keys, values, *, kernel=None, excluded=None, gram=None) -> None:
        """0, as None."""
        return None


class AttentionMean(PriorMean):
    r"""m(q_i) = Σ_{j∈A_i} κ(q_i, k_j) v_j / Σ_{j∈A_i} κ(q_i, k_j): normalised kernel attention with the GP's own
    kernel (docs/derivations.md §5c). It takes the Gram matrix ``gram`` where the strategy has already evaluated it,
    so it costs one row normalisation and one product. The kernel must be positive (exponential, RBF, Matérn, their
    sums and products with positive scales); with ``gpattn.validation()`` on, a Gram entry ≤ 0 on an allowed key is
    an error. A query with no allowed key (A_i = ∅) gets m = 0."""

    name = "attention"

    def forward(self, queries, keys, values, *, kernel=None, excluded=None, gram=None) -> torch.Tensor:
        """m(q) from ``gram`` = κ(q, k), evaluated here from ``kernel`` where the caller has none.
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv), gram (B, H, T, S), excluded
        broadcastable to it or None -> (B, H, T, Dv)"""
        gram = evaluate_kernel(kernel, queries, keys) if gram is None else gram
        weights = gram if excluded is None else gram.masked_fill(excluded, 0.0)
        if is_validating() and bool((weights < 0).any()):  # reads the device: opt-in
            raise ValueError(
                "prior_mean='attention' needs a kernel with positive values (it normalises the kernel's rows into "
                "attention weights); this kernel gives negative ones: use prior_mean='zero'"
            )
        total = weights.sum(-1, keepdim=True)  # shape: (B, H, T, 1)
        return (weights @ values) / torch.where(total > 0, total, 1.0)

    def fused(self, queries, keys, values, *, kernel=None, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention (a kernel with the log-linear form, a device and dtype with the kernel)."""
        return fused_kernel_attention(kernel, queries, keys, values, pad, normalise=True)


class SoftmaxMean(PriorMean):
    r"""m(q_i) = Σ_{j∈A_i} softmax_j((q_i/ℓ)·(k_j/ℓ)) v_j: softmax attention with the (ARD) lengthscale ℓ of the
    GP's kernel as its temperature, whatever the kernel's form (docs/derivations.md §5e). With the exponential
    kernel it equals :class:`AttentionMean`; with the ARD-RBF it drops that kernel's per-key factor
    exp(−‖k_j/ℓ‖²/2), so that an encoder swap starts at the pretrained attention. A query with no allowed key
    (A_i = ∅) gets m = 0. Key padding alone runs in fused attention (no (T, S) matrix)."""

    name = "softmax"

    def forward(self, queries, keys, values, *, kernel=None, excluded=None, gram=None) -> torch.Tensor:
        """m(q); ``gram`` is not read (the mean is not a function of it).
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv), excluded broadcastable to
        (B, H, T, S) (True = key j not in A_i) or None -> (B, H, T, Dv)"""
        return softmax_attention(*self.scaled(kernel, queries, keys), values, excluded)

    def fused(self, queries, keys, values, *, kernel=None, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention (key padding ``pad`` (B, S) only), or None where no fused kernel runs."""
        return fused_softmax(*self.scaled(kernel, queries, keys), values, pad)

    def scaled(self, kernel, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q/ℓ, k/ℓ) with ℓ the kernel's lengthscale."""
        lengthscale = self.lengthscale(kernel)
        return queries / lengthscale, keys / lengthscale

    def check_kernel(self, kernel) -> None:
        """A ``ValueError`` for a kernel without a lengthscale, at build time rather than at a forward."""
        self.lengthscale(kernel)

    @staticmethod
    def lengthscale(kernel) -> torch.Tensor:
        """The kernel's (ARD) lengthscale, the mean's temperature; a ``ValueError`` for a kernel without one."""
        lengthscale = temperature_lengthscale(kernel)
        if lengthscale is None:
            raise ValueError(
                f"prior_mean='softmax' takes its temperature from the kernel's lengthscale, and "
                f"{type(kernel).__name__} (inside its ScaleKernels) has none: use a kernel with a lengthscale "
                f"(exponential, ard-rbf, ...) or prior_mean='attention'"
            )
        return lengthscale


def softmax_attention(a: torch.Tensor, b: torch.Tensor, values: torch.Tensor, excluded=None) -> torch.Tensor:
    """Σ_{j∈A_i} softmax_j(a_i · b_j) v_j (0 where A_i = ∅): one fused attention call under key padding or no mask
    (no (T, S) matrix, docs/derivations.md §12), the dense masked softmax otherwise.
    # shape: a (B, H, T, d), b (B, H, S, d), values (B, H, S, Dv), excluded broadcastable to (B, H, T, S)
    (True = key j not in A_i) or None -> (B, H, T, Dv)"""
    if excluded is None or (excluded.dim() == 4 and excluded.shape[1] == excluded.shape[2] == 1):  # key padding
        fused = fused_softmax(a, b, values, None if excluded is None else excluded[:, 0, 0, :])
        if fused is not None:
            return fused
    logits = a @ b.mT  # shape: (B, H, T, S)
    if excluded is None:
        return logits.softmax(-1) @ values
    logits = logits.masked_fill(excluded, torch.finfo(logits.dtype).min)
    some = (~excluded).any(-1, keepdim=True)  # shape: (.., T, 1); A_i ≠ ∅
    return (logits.softmax(-1) @ values) * some


class CorrelatedSoftmaxMean(PriorMean):
    r"""The correlated GPs' softmax prior mean (docs/derivations.md §7a): m(x) = Σ_j softmax_j(t x·k_j) u_j over the
    allowed keys, softmax attention of the canonical inputs at the temperature t (the buffer ``temperature``, 1 at
    first: :meth:`rescale_inputs` moves it, and the state dict keeps it), over the GP's values v
    (``prior_mean="softmax"``, cgp's default)."""

    name = "softmax"
    instead = "; or use prior_mean='softmax' (it reads the GP's v)"

    def __init__(self):
        super().__init__()
        self.register_buffer("temperature", torch.ones(()))

    def forward(self, queries, keys, values, *, kernel=None, excluded=None, gram=None) -> torch.Tensor:
        """m(q) at the temperature t.
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv), excluded broadcastable to
        (B, H, T, S) or None -> (B, H, T, Dv)"""
        return softmax_attention(queries * self.temperature.to(queries), keys, values, excluded)

    @torch.no_grad()
    def rescale_inputs(self, factor: float) -> None:
        """t ← t / factor²: the mean is unchanged when the canonical inputs are multiplied by ``factor``."""
        self.temperature /= factor**2


class CorrelatedSeparateSoftmaxMean(CorrelatedSoftmaxMean):
    """:class:`CorrelatedSoftmaxMean` over values u of its own, the :data:`OWN_VALUES` projection, which the
    correlated GP's regulariser does not read (scgp's default; §7a)."""

    name = "softmax-separate"
    projections = OWN_VALUES


class KEPSoftmaxMean(PriorMean):
    r"""The prior mean of kep-svgp's head output, softmax attention over values of the layer's own
    (docs/derivations.md §6, "The softmax prior mean"):

    .. math:: m(x_i) = \sum_{j \in A_i} \operatorname{softmax}_j\big(q_i \cdot k_j / \sqrt{D_h}\big)\, u_j,
        \qquad u = x W_{vm},

    A_i the real keys, q and k the layer's own projections (those the KSVD features read), u the
    :data:`OWN_VALUES` projection. A deterministic function of the sequence, added once to the GP's mean and
    samples; the KL is unchanged. In an encoder swap q, k and u are the pretrained maps, so the layer's mean starts
    at the pretrained attention."""

    name = "softmax"
    projections = OWN_VALUES
    instead = "; or use prior_mean='zero' (the paper's form)"

    def forward(self, queries, keys, values, *, kernel=None, excluded=None, gram=None) -> torch.Tensor:
        """m(x) over the allowed keys.
        # shape: queries, keys (B, H, T, Dh), values (B, H, T, Dv), excluded broadcastable to (B, H, T, T) or None
        -> (B, H, T, Dv)"""
        scale = queries.shape[-1] ** -0.25  # (q/Dh^¼)·(k/Dh^¼) = q·k/√Dh
        return softmax_attention(queries * scale, keys * scale, values, excluded)


class KEPSeparateSoftmaxMean(KEPSoftmaxMean):
    r""":class:`KEPSoftmaxMean` with queries and keys of its own (docs/derivations.md §6, "The mean's own queries and
    keys"): m(x_i) = Σ_{j∈A_i} softmax_j(q'_i · k'_j / √Dh) u_j with q' = x W_qm, k' = x W_km, u = x W_vm, so the
    KSVD features' q and k and the mean's q', k' are different maps: the likelihood trains the mean's attention
    through the mean alone, and the GP's features through the GP and the KSVD term. In an encoder swap both pairs
    start at the pretrained maps."""

    name = "softmax-separate"
    #: the projections this mean owns: its queries and keys (H·Dh rows each) and its values (H·Dv)
    projections = ("q_mean", "k_mean", *OWN_VALUES)
    instead = "; or use prior_mean='softmax' (it reads the KSVD features' q and k)"
