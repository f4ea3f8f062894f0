r"""Distance-aware SGPA: the attention prior mean plus a global random-feature GP whose covariance is conditioned
on the training queries (docs/derivations.md §5f).

For head h and output dim d the head's output is f_d(q) = m(q)_d + g_d(q), with m the attention prior mean of
:mod:`gpattn.variational.means` (the sequence's own attention, deterministic given the sequence) and g_d a GP on the
query space with a stationary RBF kernel σ² exp(−‖q − q'‖² / 2ℓ²), written through R random Fourier features
(Rahimi & Recht 2007),

.. math:: g_d(q) = \sigma\, \psi(q)^\top \beta_d, \qquad
          \psi(q) = \sqrt{2/R}\, \cos(\Omega q / \ell + b), \qquad \beta_d \sim \mathcal N(0, I_R),

so that the prior variance σ² ψ(q)ᵀψ(q) ≈ σ² is the same at every query. The posterior over β is
q(β_d) = N(μ_d, Σ) with μ learned (its KL to the prior, ÷ N, is ``kl_global``) and Σ conditioned on the queries the
layer has seen in training,

.. math:: \Sigma^{-1} = I_R + w\, \mathbb E_{\text{train}}[\psi(q)\psi(q)^\top],

the posterior precision of a Gaussian pseudo-likelihood at every training query (w: pseudo-observations per unit
noise, ``data_weight``); in training the expectation is over the batch's own real queries, and a running average of
it over the training batches (a buffer, updated in training mode as BatchNorm's statistics are) is the one
evaluation uses. Where training queries lie the predictive variance σ² ψᵀΣψ shrinks; along directions no training
query visited it stays at σ²: the variance grows away from the data. This is the covariance of SNGP's
Gaussian-process output layer (Liu et al. 2020, a Laplace precision over random features) moved to the query space
of the attention layer. No gradient flows from the covariance into the query map (the features of the noise path are
computed from detached queries, as SNGP computes its covariance without gradients): the likelihood cannot shrink the
noise by moving every query onto the data. """

from __future__ import annotations

import math

import torch
import torch.nn as nn
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DenseLinearOperator, DiagLinearOperator, RootLinearOperator, SumLinearOperator

from gpattn._migrate import moved_names
from gpattn.objectives import GlobalKL
from gpattn.prior_means import make_prior_mean
from gpattn.variational._linalg import full_precision, gp_algebra, matmul_samples, tri_solve
from gpattn.variational._scale import check_prior_factor
from gpattn.variational._strategy import AmortisedConditional, AmortisedVariationalStrategy, check_query_inputs
from gpattn.variational.means import add_means
from gpattn.variational.sgpa import check_sequence_inputs, posterior_distribution, split_per_query_mask, standard_normal

__all__ = [
    "GP_INPUTS", "FeatureSGPAConditional", "FeatureSGPAVariationalStrategy",
    "SequenceFeatureConditional", "TrainingQueryCovariance", "TrainingSequenceCovariance",
]

#: a name that moved raises an error that says where it went (gpattn._migrate.MOVED_NAMES)
__getattr__ = moved_names(__name__)

def _positive(name: str, value, integer: bool = False):
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if not ok or not math.isfinite(value) or value <= 0:
        kind = "int" if integer else "number"
        raise ValueError(f"{name} must be a finite {kind} > 0, got {value!r}")
    return value if integer else float(value)


def _solve_rows(chol: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
    """Ψ L⁻ᵀ, every row of every sequence against its head's factor in one solve per head (a solve broadcast over the
    batch would copy L once per sequence).  # shape: chol (H, R, R), psi (B, H, T, R) -> (B, H, T, R)"""
    B, H, T, R = psi.shape
    rows = psi.transpose(0, 1).reshape(H, B * T, R)
    return tri_solve(chol.mT, rows, upper=True, left=False).view(H, B, T, R).transpose(0, 1)


class FeatureSGPAConditional(AmortisedConditional):
    """The factors of one ``sgpa-rff`` forward pass (explicit, never cached).

    :ivar mean: m(q) + σ Ψ μ.  # shape: (B, H, T, Dv)
    :ivar root: σ Ψ L⁻ᵀ, the root of the covariance shared by the Dv output dims.  # shape: (B, H, T, R)
    :ivar chol: L, the Cholesky factor of the posterior precision.  # shape: (H, R, R), or (1, R, R) shared by the heads
    :ivar coefficients: μ.  # shape: (H, R, Dv)
    """

    def __init__(self, *, mean, root, chol, coefficients, jitter):
        self.mean, self.root, self.chol, self.coefficients, self.jitter = mean, root, chol, coefficients, jitter

    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(β) = N(0, I_R).  # shape: batch (H, Dv), event R"""
        zeros = torch.zeros_like(self.coefficients).mT
        return MultivariateNormal(zeros, DiagLinearOperator(torch.ones_like(zeros)))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(β) = N(μ, Σ), Σ = L⁻ᵀL⁻¹.  # shape: batch (H, Dv), event R"""
        eye = torch.eye(self.chol.shape[-1], dtype=self.chol.dtype, device=self.chol.device)
        root = tri_solve(self.chol.mT, eye, upper=True)  # L⁻ᵀ: Σ = L⁻ᵀ (L⁻ᵀ)ᵀ
        H, R, Dv = self.coefficients.shape  # a sequence-level g's one factor is shared by its H heads
        return MultivariateNormal(self.coefficients.mT, RootLinearOperator(root[:, None].expand(H, Dv, R, R)))

    def kl_divergence(self) -> torch.Tensor:
        """KL(q(β_d) ‖ p(β_d)) = ½[tr Σ + ‖μ_d‖² − R − log|Σ|], a global term.  # shape: -> (H, Dv)"""
        R = self.chol.shape[-1]
        eye = torch.eye(R, dtype=self.chol.dtype, device=self.chol.device)
        inv = tri_solve(self.chol, eye)  # L⁻¹: tr Σ = ‖L⁻¹‖²_F
        log_det_precision = 2 * self.chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)  # shape: (H,)
        const = inv.square().sum((-2, -1)) - R + log_det_precision  # shape: (H,)
        return 0.5 * (const[:, None] + self.coefficients.square().sum(-2))

    def added_loss_terms(self, mask=None):
        """``kl_global``: the KL of q(β), summed over (h, d) (÷ N in the objective, docs/derivations.md §9)."""
        return (GlobalKL(self.kl_divergence().sum()),)

    def variance(self) -> torch.Tensor:
        """diag Σ_d = σ² ‖L⁻¹ψ(q)‖², the same for every d.  # shape: -> (B, H, T, 1)"""
        return self.root.square().sum(-1, keepdim=True).expand(*self.mean.shape[:-1], 1)

    def posterior(self) -> MultivariateNormal:
        """q(f): batch (B, H, Dv), event T, covariance σ² Ψ Σ Ψᵀ (+ jitter) for every d."""
        *batch, T, Dv = self.mean.shape
        root = self.root[:, :, None].expand(*batch, Dv, T, self.root.shape[-1])  # shape: (B, H, Dv, T, R)
        jit = self.jitter * torch.eye(T, dtype=root.dtype, device=root.device)
        # the rank-R root plus the jitter as a dense (T, T) view (for verification; a sliced diagonal operator in a
        # sum would turn into a sparse interpolated one)
        jit = DenseLinearOperator(jit.expand(*root.shape[:-2], T, T))
        return posterior_distribution(self.mean, SumLinearOperator(RootLinearOperator(root), jit))

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """f_d = mean_d + σ Ψ L⁻ᵀ ε_d, ε_d ∈ R^R: exact joint samples over the tokens, one draw of β per sequence.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        B, H, T, Dv = self.mean.shape
        eps = standard_normal((B, H, self.root.shape[-1], Dv), self.mean, num_samples, generator)
        return self.mean + matmul_samples(self.root, eps)


class SequenceFeatureConditional(FeatureSGPAConditional):
    """The factors of a sequence-level ``sgpa-rff`` forward (:class:`TrainingSequenceCovariance`): g takes one value
    per sequence and head, the same at each of its tokens.

    :ivar root: σ ψ̂ᵀ L⁻ᵀ.  # shape: (B, H, 1, R)
    """

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """f_d = mean_d + σ ‖L⁻¹ψ̂‖ ε_d, ε_d ~ N(0, 1): at one input g_d is N(σψ̂ᵀμ_d, σ²ψ̂ᵀΣψ̂), so the value is
        drawn itself (Dv normals per sequence and head, not R·Dv), broadcast over the tokens.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        B, H, _, Dv = self.mean.shape
        eps = standard_normal((B, H, 1, Dv), self.mean, num_samples, generator)
        return self.mean + self.root.norm(dim=-1, keepdim=True) * eps


class TrainingQueryCovariance(nn.Module):

    r"""The covariance of g: R random Fourier features of an RBF kernel per head and the posterior precision
    Σ⁻¹ = I + w E[ψψᵀ] from the running second moment of the training queries' features (module docstring).

    :param num_heads: H.
    :param head_dim: Dh (the queries' width).
    :param num_features: R features per head.
    :param lengthscale: ℓ, the RBF lengthscale on the queries (fixed: a prior hyperparameter).
    :param prior_variance: σ², the prior variance of g at every query (fixed: a prior hyperparameter).
    :param data_weight: w, pseudo-observations per unit noise of the precision.
    :param momentum: the running average's weight of a new batch (after the first ⌈1/momentum⌉ batches, which
        are averaged with equal weights).
    """

    #: the conditional a strategy with this covariance returns
    conditional = FeatureSGPAConditional

    def __init__(
        self, num_heads: int, head_dim: int, *, num_features: int, lengthscale: float, prior_variance: float,
        data_weight: float, momentum: float,
    ):
        super().__init__()
        R = _positive("num_features", num_features, integer=True)
        self.data_weight = _positive("data_weight", data_weight)
        self.momentum = _positive("momentum", momentum)
        if self.momentum > 1:
            raise ValueError(f"momentum must be in (0, 1], got {momentum!r}")
        #: Ω ~ N(0, I) and b ~ U(0, 2π): the fixed random features  # shape: (H, R, Dh), (H, R)
        self.register_buffer("frequencies", torch.randn(num_heads, R, head_dim))
        self.register_buffer("phases", 2 * math.pi * torch.rand(num_heads, R))
        self.register_buffer("lengthscale", torch.full((num_heads,), _positive("lengthscale", lengthscale)))
        self.register_buffer("outputscale", torch.full((num_heads,), _positive("prior_variance", prior_variance)))
        #: E_train[ψψᵀ], the running second moment of the training queries' unit features  # shape: (H, R, R)
        self.register_buffer("second_moment", torch.zeros(num_heads, R, R))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    @property
    def num_features(self) -> int:
        """R."""
        return self.frequencies.shape[1]

    @property
    def prior_variance(self) -> torch.Tensor:
        """σ² per head (the ``outputscale`` buffer).  # shape: (H,)"""
        return self.outputscale

    def unit_features(self, queries: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """ψ(q) = √(2/R) cos(Ω q/ℓ + b), ψᵀψ' ≈ exp(−‖q − q'‖²/2ℓ²) at every query (``real`` is not needed).
        # shape: (B, H, T, Dh) -> (B, H, T, R)"""
        omega = (self.frequencies / self.lengthscale[:, None, None]).to(queries.dtype)
        angle = queries @ omega.mT + self.phases[:, None, :].to(queries.dtype)
        return math.sqrt(2.0 / self.num_features) * torch.cos(angle)

    @staticmethod
    def batch_moment(psi: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """E[ψψᵀ] over one batch's real tokens (detached).
        # shape: psi (B, H, T, R), real (B, T) or None -> (H, R, R)"""
        psi = psi.detach()
        if real is None:
            return torch.einsum("bhtr,bhts->hrs", psi, psi) / (psi.shape[0] * psi.shape[2])
        psi = psi * real[:, None, :, None].to(psi.dtype)
        return torch.einsum("bhtr,bhts->hrs", psi, psi) / real.sum().clamp_min(1).to(psi.dtype)

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
    :param input_dim: H·Dh, the width of the concatenated queries.
    :param num_features: R features (shared by the heads).
    :param lengthscale: ℓ on the unit sphere (distances in [0, 2]).
    :param prior_variance: σ² per head, as :class:`TrainingQueryCovariance`.
    :param data_weight: w, as :class:`TrainingQueryCovariance`.
    :param momentum: as :class:`TrainingQueryCovariance`.
    """

    #: the conditional a strategy with this covariance returns
    conditional = SequenceFeatureConditional

    def __init__(
        self, num_heads: int, input_dim: int, *, num_features: int, lengthscale: float, prior_variance: float,
        data_weight: float, momentum: float,
    ):
        super().__init__(
            1, input_dim, num_features=num_features, lengthscale=lengthscale, prior_variance=prior_variance,
            data_weight=data_weight, momentum=momentum,
        )
        self.outputscale = torch.full((num_heads,), float(prior_variance))  # the registered buffer, per head

    def unit_features(self, queries: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """ψ̂ = ψ(x̂) of each sequence's unit mean query over its ``real`` tokens (all when None).
        # shape: queries (B, H, T, Dh), real (B, T) or None -> (B, 1, 1, R)"""
        B, H, T, Dh = queries.shape
        joint = queries.transpose(1, 2).reshape(B, T, H * Dh)
        if real is None:
            pooled = joint.mean(1)
        else:
            weight = real.to(joint.dtype)[..., None]
            pooled = (joint * weight).sum(1) / weight.sum(1).clamp_min(1)
        unit = torch.nn.functional.normalize(pooled, dim=-1)[:, None, None, :]  # shape: (B, 1, 1, H·Dh)
        return super().unit_features(unit)

    @staticmethod
    def batch_moment(psi: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """E[ψ̂ψ̂ᵀ] over one batch's sequences (detached; ``real`` was used in pooling).
        # shape: psi (B, 1, 1, R) -> (1, R, R)"""
        psi = psi.detach()[:, 0, 0]
        return (psi.mT @ psi / psi.shape[0])[None]

    def rescale_inputs(self, factor: float) -> None:
        """The identity: g reads the unit direction of the queries, which a scale does not move."""
        check_prior_factor(factor)


class FeatureSGPAVariationalStrategy(AmortisedVariationalStrategy):
    """q(f) = m(q) + g(q) of ``sgpa-rff`` (module docstring; docs/derivations.md §5f).

    :param kernel: the prior mean's kernel (its rows are the attention weights of ``"attention"``; its lengthscale
        is the temperature of ``"softmax"``).
    :param covariance: the :class:`TrainingQueryCovariance` of g.
    :param value_dim: Dv.
    :param prior_mean: ``"attention"`` or ``"softmax"`` (gpattn.variational.means).
    :param jitter: absolute jitter of ``posterior()``'s covariance (samples need none).
    """

    def __init__(self, kernel, covariance: TrainingQueryCovariance, value_dim: int, *, prior_mean, jitter: float):
        super().__init__()
        self.kernel = kernel
        self.mean_module = make_prior_mean(prior_mean, kernel)
        self.prior_mean = self.mean_module.name
        self.covariance = covariance
        H, R = covariance.outputscale.shape[0], covariance.num_features
        #: μ, the posterior mean of β  # shape: (H, R, Dv)
        self.variational_mean = nn.Parameter(torch.zeros(H, R, value_dim))
        self.jitter = float(jitter)

    def _scale_prior(self, factor: float) -> None:
        self.covariance.scale(factor)

    def condition(self, keys, values, mask=None, query_inputs=None) -> FeatureSGPAConditional:
        """Self-attention (queries = keys) or cross-attention (``query_inputs``, docs/derivations.md §13). ``mask``:
        key padding (B, S) or a per-query mask (B|1, H|1, T, S) (the prior mean attends over A_i; g is a
        function of the query and ignores masks). In training mode the real queries' features update the
        running second moment; the precision of a training forward is the batch's own (I + w·E_batch[ψψᵀ], as BatchNorm
        normalises by the batch's statistics in training), of an evaluation forward the running one's.
        # shape: keys (B, H, S, Dh), values (B, H, S, Dv), query_inputs (B, H, T, Dh)"""
        queries = keys if query_inputs is None else query_inputs
        excluded = None
        if mask is not None and mask.dim() == 4:
            check_sequence_inputs(keys, values, None)
            if query_inputs is not None:
                raise ValueError("attn_mask: sgpa-rff's cross-attention takes key padding only (B, S)")
            excluded, mask, _ = split_per_query_mask(mask, *keys.shape[:3])
        check_sequence_inputs(keys, values, mask)
        if query_inputs is not None:
            check_query_inputs(query_inputs, keys)
        with gp_algebra(queries.device.type):
            queries, keys, values = full_precision(queries, keys, values)
            not_allowed = excluded if excluded is not None else None if mask is None else mask[:, None, None, :]
            # m(q): a mean that reads the Gram κ(q, k) evaluates it from the kernel inputs (gram=None)
            m = self.mean_module(None, values, not_allowed, kernel=self.kernel, queries=queries, keys=keys)
            cov = self.covariance
            real = None if (mask is None or query_inputs is not None) else ~mask
            features = cov.unit_features(queries, real)  # shape: (B, H|1, T|1, R); once, with its gradient for the mean
            psi = features.detach()  # the noise path's: no gradient into the query map
            if self.training:  # as BatchNorm: the batch's own statistics in training, the running ones in eval
                moment = cov.batch_moment(psi, real)
                if torch.is_grad_enabled():
                    cov.track(moment)
            else:
                moment = cov.second_moment.to(psi.dtype)
            chol = cov.precision_cholesky(moment)
            sigma = cov.outputscale.to(psi.dtype).sqrt()[:, None, None]  # shape: (H, 1, 1)
            root = sigma * _solve_rows(chol, psi)  # σ Ψ L⁻ᵀ
            mu = self.variational_mean.to(psi.dtype)
            # the mean's global part takes the queries with their gradient: μ and the query map learn together
            mean = add_means(m, sigma * (features @ mu))
        return cov.conditional(mean=mean, root=root, chol=chol, coefficients=mu, jitter=self.jitter)


#: g's input (the ``gp_input`` option of ``sgpa-rff``): each query, or each sequence's unit mean query
GP_INPUTS = {"query": TrainingQueryCovariance, "sequence": TrainingSequenceCovariance}
