r"""The covariance forms of the SGPA variants, side by side: each is an object the strategy receives, so that a form
costs one class and no conditioning path tests which one it is (docs/derivations.md §5a, §5b, §5f).

* :class:`FullCovariance` and :class:`DiagonalCovariance` — how a ``sgpa`` / ``sgpa-decoupled`` conditional forms
  and samples its posterior covariance: exact joint samples over the tokens, or independent tokens with the
  marginal variances (``covariance="full"`` / ``"diag"``). A conditional offers ``variance()`` (the marginals) and
  ``joint_posterior()`` / ``joint_sample()`` (the joint form); the covariance object picks.
* :class:`TrainingQueryCovariance` and :class:`TrainingSequenceCovariance` — ``sgpa-rff``'s global GP g: R random
  Fourier features of an RBF kernel and the posterior precision Σ⁻¹ = I + w E_train[ψψᵀ] of the training inputs
  (:mod:`gpattn.variational.sgpa_rff`), on each query or on each sequence's unit mean query. Each carries what its
  layer needs to know of it: its input's width, its default lengthscale and whether it takes per-query masks.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator

from gpattn.kernels import evaluate_kernel
from gpattn.variational._linalg import safe_sqrt, standard_normal
from gpattn.variational._scale import check_prior_factor
from gpattn.variational.frequencies import GaussianFrequencies
from gpattn.variational.means import when_present
from gpattn.variational.sgpa import posterior_distribution
from gpattn.variational.sgpa_rff import FeatureSGPAConditional, SequenceFeatureConditional, _heads

__all__ = ["DiagonalCovariance", "FullCovariance", "TrainingQueryCovariance", "TrainingSequenceCovariance"]


# ------------------------------------------------------------------------- sgpa, sgpa-decoupled: full or diagonal
class FullCovariance:
    """Exact joint samples over the tokens: q(f)'s full T × T covariance per output dim (``covariance="full"``)."""

    #: the public spelling (``covariance=``)
    name = "full"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def query_gram(kernel, queries: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor:
        """K_qq, which the joint covariance's residual reads (and a mean basis with ``coefficients`` too).
        # shape: queries (B, H, T, Dh) -> (B, H, T, T)"""
        return evaluate_kernel(kernel, queries, queries)

    @staticmethod
    def posterior(conditional) -> MultivariateNormal:
        """q(f) with the joint covariance of ``conditional``."""
        return conditional.joint_posterior()

    @staticmethod
    def rsample(conditional, num_samples: int | None = None, generator: torch.Generator | None = None):
        """Joint draw(s) of ``conditional``.  # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv)"""
        return conditional.joint_sample(num_samples, generator)


class DiagonalCovariance:
    """Independent tokens: q(f)'s marginal variances only (``covariance="diag"``), f = μ + sqrt(diag Σ) ⊙ ε."""

    #: the public spelling (``covariance=``)
    name = "diag"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def query_gram(kernel, queries: torch.Tensor, coefficients: torch.Tensor | None = None) -> torch.Tensor | None:
        """K_qq only where a mean basis on the queries reads it (its ``coefficients`` given: sgpa-decoupled's γ, K α);
        None otherwise: the marginals need no K_qq beyond its diagonal, and the prior mean runs without it.
        # shape: queries (B, H, T, Dh) -> (B, H, T, T) or None"""
        return when_present(lambda _: evaluate_kernel(kernel, queries, queries), coefficients)

    @staticmethod
    def posterior(conditional) -> MultivariateNormal:
        """q(f) with the diagonal covariance diag Σ_d (independent tokens)."""
        return posterior_distribution(conditional.mean, DiagLinearOperator(conditional.variance().transpose(-1, -2)))

    @staticmethod
    def rsample(conditional, num_samples: int | None = None, generator: torch.Generator | None = None):
        """μ + sqrt(diag Σ) ⊙ ε.  # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv)"""
        eps = standard_normal(conditional.mean.shape, conditional.mean, num_samples, generator)
        return conditional.mean + safe_sqrt(conditional.variance()) * eps


# ----------------------------------------------------------------------------- sgpa-rff: g's training covariance
def _positive(name: str, value, integer: bool = False):
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "int" if integer else "number"
        raise ValueError(f"{name} must be a finite {kind} > 0, got {value!r}")
    return value if integer else float(value)


def _symmetric_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """leftᵀ right where it is symmetric (left: right's rows scaled): its upper half of block rows, the lower-left
    block mirrored — ¾ of a general product's arithmetic, in two products.
    # shape: (H, N, R), (H, N, R) -> (H, R, R)"""
    h = right.shape[-1] // 2
    top = left[..., :h].mT @ right  # shape: (H, h, R)
    bottom = left[..., h:].mT @ right[..., h:]  # shape: (H, R − h, R − h)
    return torch.cat([top, torch.cat([top[..., h:].mT, bottom], -1)], -2)


class TrainingQueryCovariance(nn.Module):
    r"""The covariance of g: R random Fourier features of an RBF kernel per head and the posterior precision
    Σ⁻¹ = I + w E[ψψᵀ] from the running second moment of the training queries' features (docs/derivations.md §5f).

    :param num_heads: H.
    :param head_dim: Dh (the queries' width).
    :param num_features: R features per head.
    :param lengthscale: ℓ, the RBF lengthscale on the queries (fixed: a prior hyperparameter); None:
        :meth:`default_lengthscale`.
    :param prior_variance: σ², the prior variance of g at every query (fixed: a prior hyperparameter).
    :param data_weight: w, pseudo-observations per unit noise of the precision.
    :param momentum: the running average's weight of a new batch (after the first ⌈1/momentum⌉ batches, which
        are averaged with equal weights).
    :param frequency_draw: what draws Ω, called ``(H, R, d)`` once here: None (default) is
        :class:`~gpattn.variational.frequencies.GaussianFrequencies` (i.i.d. N(0, 1)),
        :class:`~gpattn.variational.frequencies.OrthogonalFrequencies` the orthogonal random features.
    """

    #: the conditional a strategy with this covariance returns
    conditional = FeatureSGPAConditional
    #: g reads each query: a per-query mask changes nothing of it (its prior mean attends over A_i)
    per_query_masks = True

    def __init__(
        self, num_heads: int, head_dim: int, *, num_features: int, lengthscale: float | None = None,
        prior_variance: float, data_weight: float = 1000.0, momentum: float = 0.01, frequency_draw=None,
    ):
        super().__init__()
        self._build(num_heads, head_dim, num_features, lengthscale, prior_variance, data_weight, momentum,
                    frequency_draw)

    def _build(self, num_heads, head_dim, num_features, lengthscale, prior_variance, data_weight, momentum,
               frequency_draw):
        if lengthscale is None:
            lengthscale = self.default_lengthscale(head_dim)
        R = _positive("num_features", num_features, integer=True)
        self.data_weight = _positive("data_weight", data_weight)
        self.momentum = _positive("momentum", momentum)
        if self.momentum > 1:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        if frequency_draw is None:
            frequency_draw = GaussianFrequencies()
        if not callable(frequency_draw):
            raise TypeError(
                "frequency_draw must be a callable (H, R, d) -> Ω, e.g. gpattn.variational.frequencies."
                f"OrthogonalFrequencies(), or None for the i.i.d. Gaussian draw; got {frequency_draw!r}"
            )
        #: what drew Ω (kept for its repr; Ω itself is the buffer)
        self.frequency_draw = frequency_draw
        #: Ω (each row marginally N(0, I)) and b ~ U(0, 2π): the fixed random features  # shape: (H, R, Dh), (H, R)
        self.register_buffer("frequencies", frequency_draw(num_heads, R, head_dim))
        self.register_buffer("phases", 2 * math.pi * torch.rand(num_heads, R))
        self.register_buffer("lengthscale", torch.full((num_heads,), _positive("lengthscale", lengthscale)))
        self.register_buffer("outputscale", torch.full((num_heads,), _positive("prior_variance", prior_variance)))
        #: E_train[ψψᵀ], the running second moment of the training queries' unit features  # shape: (H, R, R)
        self.register_buffer("second_moment", torch.zeros(num_heads, R, R))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    @staticmethod
    def default_lengthscale(head_dim: int) -> float:
        """√(Dh/3): κ = e⁻¹ at the typical distance of two queries of the default initialisation."""
        return math.sqrt(head_dim / 3)

    @property
    def num_features(self) -> int:
        """R."""
        return self.frequencies.shape[1]

    @property
    def prior_variance(self) -> torch.Tensor:
        """σ² per head (the ``outputscale`` buffer).  # shape: (H,)"""
        return self.outputscale

    @property
    def feature_scale(self) -> float:
        """c = √(2/R), the features' constant: ψ = c·cos(Ω q/ℓ + b)."""
        return math.sqrt(2.0 / self.num_features)

    def cosines(self, queries: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """cos(Ω q/ℓ + b), the features without their constant c (``real`` is not needed), laid out head-major: the
        result's memory is (H, B, T, R), so that each head's rows are one matrix without a copy. Computed as
        sin(Ω q/ℓ + b + π/2) (the phase added to the (H, R) phases, in one fused product): sin's backward is one
        cos and one product over the (B, H, T, R) features, cos's a sin, a negation and a product.
        # shape: (B, H, T, Dh) -> (B, H, T, R)"""
        B, H, T, Dh = queries.shape
        omega = (self.frequencies / self.lengthscale[:, None, None]).to(queries.dtype)
        phases = (self.phases.to(queries.dtype) + math.pi / 2)[:, None, :]  # shape: (H, 1, R)
        rows = queries.transpose(0, 1).reshape(H, B * T, Dh)  # shape: (H, B·T, Dh), a copy of the narrow queries
        angle = torch.baddbmm(phases, rows, omega.mT)  # shape: (H, B·T, R)
        return torch.sin(angle).view(H, B, T, -1).transpose(0, 1)

    def unit_features(self, queries: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """ψ(q) = √(2/R) cos(Ω q/ℓ + b), ψᵀψ' ≈ exp(−‖q − q'‖²/2ℓ²) at every query (``real``: as :meth:`cosines`).
        # shape: (B, H, T, Dh) -> (B, H, T, R)"""
        return self.feature_scale * self.cosines(queries, real)

    @staticmethod
    def batch_moment(psi: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """E[ψψᵀ] over one batch's real tokens (detached): one product per head of its (B·T, R) rows, read in place
        when ``psi`` is laid out head-major (:meth:`cosines`).
        # shape: psi (B, H, T, R), real (B, T) or None -> (H, R, R)"""
        rows = _heads(psi.detach())  # shape: (H, B·T, R)
        if real is None:
            return _symmetric_product(rows, rows) / rows.shape[1]
        weight = real.reshape(-1, 1).to(rows.dtype)  # the rows' order: sequence-major, as real's
        return _symmetric_product(rows * weight, rows) / real.sum().clamp_min(1).to(rows.dtype)

    @torch.no_grad()
    def track(self, moment: torch.Tensor) -> None:
        """Fold one training batch's E[ψψᵀ] into the running second moment: equal weights for the first
        ⌈1/momentum⌉ batches, then the running average (no host read: it compiles).  # shape: moment (H, R, R)"""
        weight = (1.0 / (self.num_batches_tracked + 1).to(self.second_moment.dtype)).clamp_min(self.momentum)
        self.second_moment.lerp_(moment.to(self.second_moment.dtype), weight)
        self.num_batches_tracked.add_(1)

    def precision_cholesky(self, moment: torch.Tensor) -> torch.Tensor:
        """L with L Lᵀ = Σ⁻¹ = I + w·moment.  # shape: moment (H, R, R) -> (H, R, R)"""
        eye = torch.eye(moment.shape[-1], dtype=moment.dtype, device=moment.device)
        # I + w·(a PSD moment) has eigenvalues ≥ 1: no jitter, no failure to check (and no host read)
        return torch.linalg.cholesky_ex(eye + self.data_weight * moment)[0]

    def scale(self, factor: float) -> None:
        """σ² ← factor · σ² (``scale_prior``)."""
        self.outputscale.mul_(check_prior_factor(factor))

    def rescale_inputs(self, factor: float) -> None:
        """Queries scaled by ``factor``: ℓ ← ℓ / factor (the median heuristic of an encoder swap)."""
        self.lengthscale.div_(check_prior_factor(factor))


class TrainingSequenceCovariance(TrainingQueryCovariance):
    r"""The covariance of a sequence-level g (docs/derivations.md §5f, "The sequence as g's input"): one input per
    sequence, the unit direction of its mean query over real tokens and all heads, x̂ = q̄ / ‖q̄‖ with
    q̄ = mean_t [q_t^(1), …, q_t^(H)] ∈ R^{H·Dh}; R random Fourier features of an RBF kernel on the unit sphere,
    shared by the heads (each head keeps its own β and σ²); Σ⁻¹ = I + w E_train[ψ̂ψ̂ᵀ] over training sequences.
    A normalised input makes ℓ a prior on angles: the stream's scale does not enter (:meth:`rescale_inputs` is the
    identity).

    :param num_heads: H (σ² per head).
    :param head_dim: Dh; g's input is the H·Dh-wide concatenation of the heads' queries.
    :param num_features: R features (shared by the heads).
    :param lengthscale: ℓ on the unit sphere (distances in [0, 2]); None: :meth:`default_lengthscale`.
    :param prior_variance: σ² per head, as :class:`TrainingQueryCovariance`.
    :param data_weight: w, as :class:`TrainingQueryCovariance`.
    :param momentum: as :class:`TrainingQueryCovariance`.
    :param frequency_draw: what draws Ω, as :class:`TrainingQueryCovariance` (here d = H·Dh).
    """

    #: the conditional a strategy with this covariance returns
    conditional = SequenceFeatureConditional
    #: g's input pools every token of the sequence: key padding only, not per-query (causal) masks
    per_query_masks = False

    def __init__(
        self, num_heads: int, head_dim: int, *, num_features: int, lengthscale: float | None = None,
        prior_variance: float, data_weight: float = 1000.0, momentum: float = 0.01, frequency_draw=None,
    ):
        nn.Module.__init__(self)
        self._build(1, num_heads * head_dim, num_features, lengthscale, prior_variance, data_weight, momentum,
                    frequency_draw)
        self.outputscale = torch.full((num_heads,), float(prior_variance))  # the registered buffer, per head

    @staticmethod
    def default_lengthscale(head_dim: int) -> float:
        """0.4 on the unit sphere, whatever the width."""
        return 0.4

    def cosines(self, queries: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """ψ̂ / c = cos(Ω x̂/ℓ + b) of each sequence's unit mean query over its ``real`` tokens (all when None).
        # shape: queries (B, H, T, Dh), real (B, T) or None -> (B, 1, 1, R)"""
        B, H, T, Dh = queries.shape
        joint = queries.transpose(1, 2).reshape(B, T, H * Dh)
        if real is None:
            pooled = joint.mean(1)
        else:
            weight = real.to(joint.dtype)[..., None]
            pooled = (joint * weight).sum(1) / weight.sum(1).clamp_min(1)
        unit = torch.nn.functional.normalize(pooled, dim=-1)[:, None, None, :]  # shape: (B, 1, 1, H·Dh)
        return super().cosines(unit)

    @staticmethod
    def batch_moment(psi: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """E[ψ̂ψ̂ᵀ] over one batch's sequences (detached; ``real`` was used in pooling).
        # shape: psi (B, 1, 1, R) -> (1, R, R)"""
        psi = psi.detach()[:, 0, 0]
        return (psi.mT @ psi / psi.shape[0])[None]

    def rescale_inputs(self, factor: float) -> None:
        """The identity: g reads the unit direction of the queries, which a scale does not move."""
        check_prior_factor(factor)
