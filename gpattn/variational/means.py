r"""Prior mean functions of the GP attention variants, in GPyTorch's ``mean_module`` idiom
(docs/derivations.md §5c).

A GP prior GP(m, κ) with a mean function m pays in its KL only for the posterior's deviation from m.
The SGPA variants take ``prior_mean``:

* ``"attention"`` (default): m is :class:`AttentionMean`, the normalised kernel attention of the
  sequence (the Nadaraya–Watson kernel smoother with the GP's own kernel)

  .. math:: m(q_i) = \frac{\sum_{j \in A_i} \kappa(q_i, k_j)\, v_j}{\sum_{j \in A_i} \kappa(q_i, k_j)},

  which for the exponential kernel is softmax attention with the kernel's (ARD) temperature. The
  amortised, informative part of the posterior lives in the prior mean, which is deterministic given the
  sequence, so no per-sequence KL is paid for attending; the GP's uncertainty sits on top of it.
* ``"softmax"``: m is :class:`SoftmaxMean`, softmax attention with the kernel's (ARD) temperature,

  .. math:: m(q_i) = \sum_{j \in A_i} \mathrm{softmax}_j\big((q_i/\ell) \cdot (k_j/\ell)\big)\, v_j,

  the Nadaraya–Watson smoother of the exponential kernel with the GP's lengthscale, whatever the GP's
  kernel (docs/derivations.md §5e): an encoder swap's mean is then the pretrained softmax attention
  exactly, while the covariance keeps a stationary kernel's bounded prior variance. With the exponential
  kernel it is ``"attention"``.
* ``"zero"``: the papers' form (Chen & Li 2023): a zero prior mean, the amortised mean basis paid for by
  the per-sequence KL.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpattn._settings import is_validating
from gpattn.kernels._evaluate import evaluate_kernel, temperature_lengthscale
from gpattn.variational._fused import fused_kernel_attention, fused_softmax

__all__ = [
    "CGP_PRIOR_MEANS",
    "PRIOR_MEANS",
    "AttentionMean",
    "CorrelatedSoftmaxMean",
    "SoftmaxMean",
    "ZeroMean",
    "add_means",
    "check_prior_mean",
    "make_correlated_mean",
    "make_prior_mean",
    "softmax_attention",
]

#: the prior means of the SGPA variants: normalised kernel attention (default), softmax attention with the
#: kernel's temperature, or zero (the papers')
PRIOR_MEANS = ("attention", "softmax", "zero")


#: the prior means of ``cgp`` and ``scgp`` (docs/derivations.md §7a): softmax attention of the canonical inputs over
#: the GP's values or over values of its own (``mean_values``), or the papers' zero mean
CGP_PRIOR_MEANS = ("softmax", "softmax-separate", "zero")

#: what each of the SGPA variants' prior means is, for the error message
_SGPA_MEANS = (
    "'attention': normalised kernel attention as the GP's prior mean, docs/derivations.md §5c; 'softmax': softmax "
    "attention with the kernel's lengthscale, §5e; 'zero': the paper's form"
)


def check_prior_mean(prior_mean, choices: tuple[str, ...] = PRIOR_MEANS, meanings: str = _SGPA_MEANS) -> str:
    """``prior_mean`` must be one of ``choices`` (default :data:`PRIOR_MEANS`, the SGPA variants'); the error lists them
    with their ``meanings``."""
    if prior_mean not in choices:
        raise ValueError(f"prior_mean must be one of {list(choices)} ({meanings}), got {prior_mean!r}")
    return prior_mean


class ZeroMean(nn.Module):
    """m = 0, the papers' prior mean (Chen & Li 2023; Bui et al.): the strategy's q(ũ) then carries the amortised mean
    (docs/derivations.md §5a), and the correlated GPs' ν the whole attention (§7). Its value is None, the zero that
    :func:`add_means` leaves out (no operation); it reads no values of its own (``projections`` is empty)."""

    #: the mean is a function of no Gram
    uses_gram = False
    #: the value projections this mean owns (none)
    projections = ()
    #: the public spelling of this mean (``prior_mean=``)
    name = "zero"

    def forward(self, *inputs, **kernel_inputs) -> None:
        """0, as None."""
        return None

    @staticmethod
    def fused(kernel, queries, keys, values, pad=None) -> None:
        """0, as None (nothing to fuse)."""
        return None

    def register_state(self, strategy) -> None:
        """Nothing: the zero mean has no state."""

    def rescale(self, strategy, factor: float) -> None:
        """Nothing: the zero mean has no temperature."""


def add_means(*terms: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of the terms of a posterior mean (a prior mean m(q), a q(ũ) update, ...) or of a KL, None (the zero
    of :class:`ZeroMean` and of a centred q(ũ)) left out, so a zero costs no operation; None if all are."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0]
    for term in present[1:]:
        total = total + term
    return total


class AttentionMean(nn.Module):
    r"""m(q_i) = Σ_{j∈A_i} κ(q_i, k_j) v_j / Σ_{j∈A_i} κ(q_i, k_j): normalised kernel attention with the
    GP's own kernel (docs/derivations.md §5c). It takes the Gram matrix the strategy has already evaluated,
    so it costs one row normalisation and one product. The kernel must be positive (exponential, RBF,
    Matérn, their sums and products with positive scales); with ``gpattn.validation()`` on, a Gram entry
    ≤ 0 on an allowed key is an error.

    A query with no allowed key (A_i = ∅) gets m = 0. (A plain ``nn.Module`` in the role of a
    ``gpytorch.means.Mean``, whose ``__call__`` takes one input: this mean reads the keys and values too.)
    """

    #: the mean is a function of the Gram κ(q, k): callers that have it pass it
    uses_gram = True

    def forward(
        self, gram: torch.Tensor | None, values: torch.Tensor, excluded: torch.Tensor | None = None, *,
        kernel=None, queries=None, keys=None,
    ) -> torch.Tensor:
        """``gram`` κ(q, k), or None: evaluated from ``kernel``, ``queries`` and ``keys``.
        # shape: gram (B, H, T, S) = κ(q_i, k_j), values (B, H, S, Dv),
        excluded broadcastable to gram (True = key j not in A_i) or None -> (B, H, T, Dv)"""
        if gram is None:
            gram = evaluate_kernel(kernel, queries, keys)
        weights = gram if excluded is None else gram.masked_fill(excluded, 0.0)
        if is_validating() and bool((weights < 0).any()):  # reads the device: opt-in
            raise ValueError(
                "prior_mean='attention' needs a kernel with positive values (it normalises the kernel's rows into "
                "attention weights); this kernel gives negative ones: use prior_mean='zero'"
            )
        total = weights.sum(-1, keepdim=True)  # shape: (B, H, T, 1)
        return (weights @ values) / torch.where(total > 0, total, 1.0)

    @staticmethod
    def fused(kernel, queries, keys, values, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention (key padding ``pad`` (B, S) only; docs/derivations.md §12), or None where
        that path does not run (a kernel without the log-linear form, a device or dtype without the kernel)."""
        return fused_kernel_attention(kernel, queries, keys, values, pad, normalise=True)


class SoftmaxMean(nn.Module):
    r"""m(q_i) = Σ_{j∈A_i} softmax_j((q_i/ℓ)·(k_j/ℓ)) v_j: softmax attention with the (ARD) lengthscale ℓ of the
    GP's kernel as its temperature, whatever the kernel's form (docs/derivations.md §5e). With the exponential
    kernel it equals :class:`AttentionMean`; with the ARD-RBF it drops that kernel's per-key factor
    exp(−‖k_j/ℓ‖²/2), so that an encoder swap starts at the pretrained attention. A query with no allowed key
    (A_i = ∅) gets m = 0. Key padding alone runs in fused attention (no (T, S) matrix)."""

    #: the mean needs no Gram: callers need not evaluate one for it
    uses_gram = False

    def forward(
        self, gram: torch.Tensor | None, values: torch.Tensor, excluded: torch.Tensor | None = None, *,
        kernel, queries: torch.Tensor, keys: torch.Tensor,
    ) -> torch.Tensor:
        """``gram`` is not read (the mean is not a function of it).
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv), excluded broadcastable to
        (B, H, T, S) (True = key j not in A_i) or None -> (B, H, T, Dv)"""
        return softmax_attention(*self.scaled(kernel, queries, keys), values, excluded)

    @classmethod
    def fused(cls, kernel, queries, keys, values, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention (key padding ``pad`` (B, S) only), or None where no fused kernel runs."""
        return fused_softmax(*cls.scaled(kernel, queries, keys), values, pad)

    @classmethod
    def scaled(cls, kernel, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q/ℓ, k/ℓ) with ℓ the kernel's lengthscale."""
        lengthscale = cls.lengthscale(kernel)
        return queries / lengthscale, keys / lengthscale

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


def make_prior_mean(prior_mean: str, kernel) -> nn.Module | None:
    """The ``mean_module`` of a prior mean name (:data:`PRIOR_MEANS`) for a strategy with ``kernel``: None for the
    papers' zero mean; ``"softmax"`` needs a kernel with a lengthscale (a ``ValueError`` here, not at a forward)."""
    if check_prior_mean(prior_mean) == "softmax":
        SoftmaxMean.lengthscale(kernel)
    return {"attention": AttentionMean, "softmax": SoftmaxMean}.get(prior_mean, lambda: None)()


class CorrelatedSoftmaxMean(nn.Module):
    r"""The correlated GPs' softmax prior mean (docs/derivations.md §7a): m(x) = Σ_j softmax_j(t x·k_j) u_j over the
    real keys, 0 at padded queries, with t the strategy's ``mean_temperature`` buffer (kept there: its state-dict
    key). ``separate=False``: u = the GP's values v (``prior_mean="softmax"``); ``separate=True``: values of the
    mean's own, the ``v_mean`` projection (``prior_mean="softmax-separate"``), passed as ``mean_values``."""

    def __init__(self, separate: bool = False):
        super().__init__()
        self.separate = bool(separate)
        #: the public spelling of this mean (``prior_mean=``)
        self.name = "softmax-separate" if self.separate else "softmax"
        #: the value projections this mean owns: rows of the layer's fused ``in_proj`` (docs/derivations.md §7a)
        self.projections = ("v_mean",) if self.separate else ()

    def forward(self, strategy, q, k, values, valid=None, valid_q=None) -> torch.Tensor:
        """m(q) with the temperature t of ``strategy``.
        # shape: q (B, H, T, Dh), k (B, H, S, Dh), values (B, H, S, Dv), valid (B, 1, S), valid_q (B, 1, T)
        # -> (B, H, T, Dv)"""
        m = softmax_attention(q * strategy.mean_temperature.to(q), k, values, None if valid is None else ~valid[:, :, None, :])
        return m if valid_q is None else m * valid_q[..., None]

    @staticmethod
    def register_state(strategy) -> None:
        """The temperature t as the buffer ``mean_temperature`` of ``strategy``, 1 at first (in the state dict:
        :meth:`rescale`'s changes survive a reload)."""
        strategy.register_buffer("mean_temperature", torch.ones(()))

    @staticmethod
    def rescale(strategy, factor: float) -> None:
        """Divide the strategy's temperature by ``factor``² (the mean is unchanged when the canonical inputs are
        multiplied by ``factor``)."""
        strategy.mean_temperature /= factor**2


def make_correlated_mean(prior_mean) -> nn.Module:
    """The ``mean_module`` of a correlated GP's prior mean name (:data:`CGP_PRIOR_MEANS`); a mean module is returned
    as it is."""
    if isinstance(prior_mean, nn.Module):
        return prior_mean
    check_prior_mean(
        prior_mean, CGP_PRIOR_MEANS, "'softmax': softmax attention of the canonical inputs as the prior mean of "
        "z_q and z_k, docs/derivations.md §7a; 'zero': the paper's form",
    )
    return {
        "softmax": lambda: CorrelatedSoftmaxMean(),
        "softmax-separate": lambda: CorrelatedSoftmaxMean(separate=True),
        "zero": ZeroMean,
    }[prior_mean]()
