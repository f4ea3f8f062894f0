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

import torch
import torch.nn as nn
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DenseLinearOperator, DiagLinearOperator, RootLinearOperator, SumLinearOperator

from gpattn.objectives import GlobalKL
from gpattn.variational._linalg import full_precision, gp_algebra, matmul_samples, tri_solve
from gpattn.variational._strategy import AmortisedConditional, AmortisedVariationalStrategy, check_query_inputs
from gpattn.variational.means import add_means
from gpattn.variational.sgpa import check_sequence_inputs, posterior_distribution, split_per_query_mask, standard_normal

__all__ = ["FeatureSGPAConditional", "FeatureSGPAVariationalStrategy", "SequenceFeatureConditional"]


def _heads(x: torch.Tensor) -> torch.Tensor:
    """Every token of every sequence as a row of its head: a view where ``x`` is laid out head-major (as
    :meth:`~gpattn.variational.covariances.TrainingQueryCovariance.cosines` lays out its features), a copy otherwise.
    # shape: (B, H, T, k) -> (H, B·T, k)"""
    B, H, T, k = x.shape
    return x.transpose(0, 1).reshape(H, B * T, k)


def _tokens(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`_heads` (a view).  # shape: (H, B·T, k) -> (B, H, T, k)"""
    H, N, k = rows.shape
    return rows.view(H, batch, N // batch, k).transpose(0, 1)


def _solve_rows(chol: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
    """Ψ L⁻ᵀ by one triangular solve per head of its (B·T, R) rows.
    # shape: chol (H, R, R), psi (B, H, T, R) -> (B, H, T, R)"""
    return _tokens(tri_solve(chol.mT, _heads(psi), upper=True, left=False), psi.shape[0])


def _whitened_rows(inverse: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
    """Ψ L⁻ᵀ, every row of every sequence times its head's L⁻ᵀ in one product per head.
    # shape: inverse (H, R, R), psi (B, H, T, R) -> (B, H, T, R)"""
    return _tokens(_heads(psi) @ inverse.mT, psi.shape[0])


class FeatureSGPAConditional(AmortisedConditional):
    """The factors of one ``sgpa-rff`` forward pass (explicit, never cached).

    :ivar mean: m(q) + σ Ψ μ.  # shape: (B, H, T, Dv)
    :ivar features: Ψ / c, the queries' random features without their constant c = √(2/R) (detached).
        # shape: (B, H, T, R), laid out head-major
    :ivar scale: σ c per head.  # shape: (H, 1, 1)
    :ivar chol: L, the Cholesky factor of the posterior precision.  # shape: (H, R, R), or (1, R, R) shared by the heads
    :ivar inverse: L⁻¹, one triangular solve per head and forward, read by the KL's tr Σ, the draws and the root
        (docs/derivations.md §5f, "Cost").  # shape: as ``chol``
    :ivar coefficients: μ.  # shape: (H, R, Dv)
    """

    def __init__(self, *, mean, features, scale, chol, coefficients, jitter):
        self.mean, self.features, self.scale, self.chol = mean, features, scale, chol
        self.coefficients, self.jitter = coefficients, jitter
        self.inverse = self._inverse()

    def _inverse(self) -> torch.Tensor | None:
        eye = torch.eye(self.chol.shape[-1], dtype=self.chol.dtype, device=self.chol.device)
        return tri_solve(self.chol, eye)

    def _trace_covariance(self) -> torch.Tensor:
        """tr Σ = ‖L⁻¹‖²_F.  # shape: -> (H,) or (1,)"""
        return self.inverse.square().sum((-2, -1))

    def _covariance_root(self) -> torch.Tensor:
        """L⁻ᵀ: Σ = L⁻ᵀ (L⁻ᵀ)ᵀ.  # shape: as ``chol``"""
        return self.inverse.mT

    @property
    def root(self) -> torch.Tensor:
        """σ Ψ L⁻ᵀ, the root of the covariance shared by the Dv output dims (computed on each read: O(R²) per token).
        # shape: (B, H, T, R)"""
        return self.scale * _whitened_rows(self.inverse, self.features)

    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(β) = N(0, I_R).  # shape: batch (H, Dv), event R"""
        zeros = torch.zeros_like(self.coefficients).mT
        return MultivariateNormal(zeros, DiagLinearOperator(torch.ones_like(zeros)))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(β) = N(μ, Σ), Σ = L⁻ᵀL⁻¹.  # shape: batch (H, Dv), event R"""
        root = self._covariance_root()
        H, R, Dv = self.coefficients.shape  # a sequence-level g's one factor is shared by its H heads
        return MultivariateNormal(self.coefficients.mT, RootLinearOperator(root[:, None].expand(H, Dv, R, R)))

    def kl_divergence(self) -> torch.Tensor:
        """KL(q(β_d) ‖ p(β_d)) = ½[tr Σ + ‖μ_d‖² − R − log|Σ|], a global term.  # shape: -> (H, Dv)"""
        R = self.chol.shape[-1]
        log_det_precision = 2 * self.chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)  # shape: (H,)
        const = self._trace_covariance() - R + log_det_precision  # shape: (H,)
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
        The product σ Ψ L⁻ᵀ ε is associated the cheaper way (docs/derivations.md §5f, "Cost"): with fewer draws'
        columns (P·Dv) than tokens (T), L⁻ᵀ ε first (a product of P·Dv columns per sequence, no (T, R) root formed),
        else the root σ Ψ L⁻ᵀ first (a product of T rows); the same ε either way.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        B, H, T, Dv = self.mean.shape
        R = self.chol.shape[-1]
        eps = standard_normal((B, H, R, Dv), self.mean, num_samples, generator)
        P = 1 if num_samples is None else num_samples
        if P * Dv > T:
            return self.mean + matmul_samples(self.root, eps)
        rows = eps.reshape(-1, B, H, R, Dv).permute(2, 1, 0, 4, 3).reshape(H, B * P * Dv, R)  # εᵀ, per head
        draws = (rows @ self.inverse).view(H, B, P * Dv, R).mT  # (L⁻ᵀ ε)ᵀ = εᵀ L⁻¹, read transposed: (H, B, R, P·Dv)
        noise = self.scale[..., None] * (self.features.transpose(0, 1) @ draws)  # shape: (H, B, T, P·Dv)
        noise = noise.view(H, B, T, P, Dv).permute(3, 1, 0, 2, 4)  # shape: (P, B, H, T, Dv)
        return self.mean + (noise[0] if num_samples is None else noise)


class SequenceFeatureConditional(FeatureSGPAConditional):
    """The factors of a sequence-level ``sgpa-rff`` forward
    (:class:`~gpattn.variational.covariances.TrainingSequenceCovariance`): g takes one value
    per sequence and head, the same at each of its tokens.

    :ivar root: σ ψ̂ᵀ L⁻ᵀ.  # shape: (B, H, 1, R)
    :ivar inverse: None: with one input per sequence nothing reads L⁻¹ but the KL's tr Σ, which
        :func:`torch.cholesky_inverse` gives at ⅔ of the arithmetic of L \\ I (R = 1024 in the out-of-scope recipe).
    """

    def _inverse(self) -> None:
        return None

    def _trace_covariance(self) -> torch.Tensor:
        """tr Σ = tr (L Lᵀ)⁻¹.  # shape: -> (1,)"""
        return torch.cholesky_inverse(self.chol).diagonal(dim1=-2, dim2=-1).sum(-1)

    def _covariance_root(self) -> torch.Tensor:
        eye = torch.eye(self.chol.shape[-1], dtype=self.chol.dtype, device=self.chol.device)
        return tri_solve(self.chol.mT, eye, upper=True)

    @property
    def root(self) -> torch.Tensor:
        """σ ψ̂ᵀ L⁻ᵀ by one triangular solve of the batch's B rows.  # shape: (B, H, 1, R)"""
        return self.scale * _solve_rows(self.chol, self.features)

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """f_d = mean_d + σ ‖L⁻¹ψ̂‖ ε_d, ε_d ~ N(0, 1): at one input g_d is N(σψ̂ᵀμ_d, σ²ψ̂ᵀΣψ̂), so the value is
        drawn itself (Dv normals per sequence and head, not R·Dv), broadcast over the tokens.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        B, H, _, Dv = self.mean.shape
        eps = standard_normal((B, H, 1, Dv), self.mean, num_samples, generator)
        return self.mean + self.root.norm(dim=-1, keepdim=True) * eps


class FeatureSGPAVariationalStrategy(AmortisedVariationalStrategy):
    """q(f) = m(q) + g(q) of ``sgpa-rff`` (module docstring; docs/derivations.md §5f).

    :param kernel: the prior mean's kernel (its rows are the attention weights of the attention mean; its lengthscale
        is the temperature of the softmax mean).
    :param covariance: g's covariance, a :class:`~gpattn.variational.covariances.TrainingQueryCovariance` (each query)
        or :class:`~gpattn.variational.covariances.TrainingSequenceCovariance` (each sequence): it names the
        conditional this strategy returns.
    :param value_dim: Dv.
    :param mean_module: the prior mean m (:mod:`gpattn.variational.means`).
    :param jitter: absolute jitter of ``posterior()``'s covariance (samples need none).
    """

    def __init__(self, kernel, covariance: nn.Module, value_dim: int, *, mean_module: nn.Module, jitter: float):
        super().__init__()
        self.kernel = kernel
        #: the prior mean function (GPyTorch's ``mean_module``)
        self.mean_module = mean_module
        mean_module.check_kernel(kernel)  # a mean that cannot read the kernel fails here, not at a forward
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
            m = self.mean_module(queries, keys, values, kernel=self.kernel, excluded=not_allowed)
            cov = self.covariance
            real = None if (mask is None or query_inputs is not None) else ~mask
            # cos(Ω q/ℓ + b) once, with its gradient for the mean; ψ = c·cos, the constant c = √(2/R) kept on the
            # small factors (μ's product, the (R, R) moment, the draws) instead of a pass over the (B, H, T, R) features
            features = cov.cosines(queries, real)  # shape: (B, H|1, T|1, R), head-major
            c = cov.feature_scale
            cos = features.detach()  # the noise path's: no gradient into the query map
            if self.training:  # as BatchNorm: the batch's own statistics in training, the running ones in eval
                moment = cov.batch_moment(cos, real) * c**2  # E[ψψᵀ], a statistic: no autograd graph
                if torch.is_grad_enabled():
                    cov.track(moment)
            else:
                moment = cov.second_moment.to(cos.dtype)
            chol = cov.precision_cholesky(moment)
            scale = c * cov.outputscale.to(cos.dtype).sqrt()[:, None, None]  # σ c, shape: (H, 1, 1)
            mu = self.variational_mean.to(cos.dtype)
            # the mean's global part takes the queries with their gradient: μ and the query map learn together
            mean = add_means(m, _tokens(scale * (_heads(features) @ mu), features.shape[0]))
        return cov.conditional(
            mean=mean, features=cos, scale=scale, chol=chol, coefficients=mu, jitter=self.jitter
        )

