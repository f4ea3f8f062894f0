"""Standard SGPA: the sequence's keys as amortised inducing inputs (docs/derivations.md §5a).

Chen & Li, *Calibrating Transformers via Sparse Gaussian Processes*, ICLR 2023 (Chen & Li (2023) §3.1–3.2).
The q(u) parameterisation (:class:`AmortisedDiagonalVariationalDistribution`) is kept apart from
the q(u) → q(f) map (:class:`SGPAVariationalStrategy`), as GPyTorch keeps
``CholeskyVariationalDistribution`` apart from ``VariationalStrategy``. The strategy cannot subclass
``gpytorch.variational._VariationalStrategy`` (its inducing inputs are the keys of each sequence, not
fixed parameters), so it keeps that class's vocabulary instead: calling it returns q(f) as a
``gpytorch.distributions.MultivariateNormal``; the per-sequence object returned by
:meth:`SGPAVariationalStrategy.condition` holds the factors of one forward pass (no cache) and
offers ``prior_distribution``, ``variational_distribution``, ``kl_divergence()``, ``mean`` and an
exact ``rsample``.

This module also holds the helpers shared with the decoupled strategy
(:mod:`gpattn.variational.sgpa_decoupled`): option checks, the key-padding algebra and the jitter rule.

**Key padding.** Padded tokens leave the model: in the Gram matrix their rows and columns are
replaced by identity rows/columns (zero cross-covariance with every real token), their values are 0
and their whitened q(ũ_p) is the prior N(0, 1). So every quantity for the real tokens (mean,
covariance, KL, and samples drawn with the same noise) equals a run on the sequence without the
padded tokens, and padded tokens contribute exactly 0 to the KL. The output at a padded position is a
placeholder with mean 0 and variance 1 + jitter (the model discards it).

**Jitter.** ``jitter`` is *relative*: the Cholesky factor is that of ``K + jitter · mean(diag K) · I``
(mean over the real tokens, detached from the graph). The exponential kernel's diagonal
σ² exp(‖k‖²/ℓ²) spans orders of magnitude, so an absolute jitter would be either negligible or
dominant. The default 1e-6 suits float32; use ``jitter=0`` with float64 for verification (a failed
plain Cholesky still escalates through :func:`gpattn.variational._linalg.cholesky`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from linear_operator.operators import (
    CholLinearOperator,
    DiagLinearOperator,
    LinearOperator,
    TriangularLinearOperator,
)

from gpattn.kernels import evaluate_kernel
from gpattn.variational._linalg import (
    add_jitter,
    cholesky,
    full_precision,
    gp_algebra,
    isolate_padding,
    matmul_samples,
    safe_sqrt,
    standard_normal,
    with_policy,
)
from gpattn.variational._strategy import AmortisedConditional, _AmortisedVariationalStrategy

__all__ = [
    "COVARIANCE_MODES",
    "AmortisedDiagonalVariationalDistribution",
    "SGPAConditional",
    "SGPAVariationalStrategy",
    "check_covariance",
    "check_jitter",
    "check_sequence_inputs",
    "isolate_padding",
    "posterior_distribution",
    "relative_jitter",
    "standard_normal",
]

#: sampling modes: exact joint samples over the tokens, or independent tokens (marginal variances only)
COVARIANCE_MODES = ("full", "diag")


# ---------------------------------------------------------------------------------- shared helpers
def check_jitter(jitter) -> float:
    """``jitter`` must be a finite float ≥ 0 (relative to the mean diagonal of the Gram matrix)."""
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not math.isfinite(jitter) or jitter < 0:
        raise ValueError(f"jitter must be a finite number >= 0, got {jitter!r}")
    return float(jitter)


def check_covariance(covariance) -> str:
    if covariance not in COVARIANCE_MODES:
        raise ValueError(f"covariance must be one of {list(COVARIANCE_MODES)}, got {covariance!r}")
    return covariance


def check_sequence_inputs(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> None:
    """# shape: keys (B, H, T, Dh), values (B, H, T, Dv), mask (B, T) bool or None"""
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys and values must have shapes (B, H, T, Dh) and (B, H, T, Dv) with the same (B, H, T); got "
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)}"
        )
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (keys.shape[0], keys.shape[2])):
        raise ValueError(
            f"mask must be a bool tensor of shape (B, T) = {(keys.shape[0], keys.shape[2])}, got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )


def relative_jitter(diag: torch.Tensor, jitter: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute jitter ``jitter · mean(diag)`` over the real entries, detached.

    # shape: diag (..., n), mask broadcastable to diag (True = excluded) -> (..., 1, 1)
    """
    diag = diag.detach()
    if mask is None:
        scale = diag.mean(-1)
    else:
        real = (~mask).to(diag.dtype).expand_as(diag)
        scale = (diag * real).sum(-1) / real.sum(-1).clamp_min(1)
    return (jitter * scale)[..., None, None]


def posterior_distribution(mean: torch.Tensor, covariance: LinearOperator) -> MultivariateNormal:
    """q(f) in GPyTorch's form: batch (B, H, Dv), event T. The covariance carries the numerics policy
    (:func:`gpattn.variational._linalg.with_policy`): solves, log-determinants and roots stay exact
    above gpytorch's 800-point CG/Lanczos switch, outside any ``gp_algebra()`` block.

    # shape: mean (B, H, T, Dv), covariance (B, H, Dv, T, T) -> MultivariateNormal
    """
    return MultivariateNormal(mean.transpose(-1, -2), with_policy(covariance))


# ---------------------------------------------------------------------------------- q(u)
class AmortisedDiagonalVariationalDistribution(nn.Module):
    r"""Whitened, amortised q(ũ) of standard SGPA (docs/derivations.md §5a, **Choice**).

    For head h and output dim d the whitened inducing outputs at the keys are

    .. math::
        q(\tilde u_d) = \mathcal N\big(L^\top v_d,\ \operatorname{diag}(s_d(k_1)^2, \dots, s_d(k_T)^2)\big),
        \qquad s_d(k_t) = \operatorname{softplus}(w_d^\top k_t + b_d),

    one linear map :math:`D_h \to D_v` per head. The mean coefficients are the values themselves
    (amortised, no parameters), so this module only parameterises the scales. Initialised at the
    prior (w = 0, s = 1), as GPyTorch initialises its Cholesky factor at the identity.
    """

    def __init__(self, num_heads: int, head_dim: int, value_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, head_dim, value_dim))  # shape: (H, Dh, Dv)
        self.bias = nn.Parameter(torch.full((num_heads, value_dim), math.log(math.expm1(1.0))))  # shape: (H, Dv)

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        """Whitened standard deviations s.  # shape: keys (B, H, T, Dh) -> (B, H, T, Dv)"""
        return F.softplus(keys @ self.weight + self.bias[:, None, :])


# ---------------------------------------------------------------------------------- q(u) -> q(f)
class SGPAConditional(AmortisedConditional):
    """The factors of one standard-SGPA forward pass (returned by
    :meth:`SGPAVariationalStrategy.condition`; an explicit per-call object, never cached).

    :ivar chol: L = chol(K̂ + jitter·I), padded tokens isolated.  # shape: (B, H, T, T)
    :ivar mean: posterior mean K̂ v̂ = kernel attention on the real keys.  # shape: (B, H, T, Dv)
    :ivar std: whitened standard deviations s (1 at padded tokens).  # shape: (B, H, T, Dv)
    """

    def __init__(self, chol, gram, values, std, jitter_abs, covariance):
        self.chol = chol  # shape: (B, H, T, T)
        self.values = values  # shape: (B, H, T, Dv), 0 at padded tokens
        self.std = std  # shape: (B, H, T, Dv)
        self.covariance = covariance
        self._jitter_abs = jitter_abs  # shape: (B, H, 1, 1)
        self.mean = gram @ values  # shape: (B, H, T, Dv); K̂ v̂ (padded columns of K are out of the basis)

    # -- GPyTorch vocabulary (whitened u-space: ũ = L⁻¹u at the T keys)
    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(ũ) = N(0, I).  # shape: batch (B, H, Dv), event T"""
        zeros = torch.zeros_like(self.std).transpose(-1, -2)
        return MultivariateNormal(zeros, DiagLinearOperator(torch.ones_like(zeros)))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(ũ) = N(Lᵀ v, diag s²).  # shape: batch (B, H, Dv), event T"""
        m_tilde = self.chol.mT @ self.values  # shape: (B, H, T, Dv)
        return MultivariateNormal(m_tilde.transpose(-1, -2), DiagLinearOperator(self.std.square().transpose(-1, -2)))

    def kl_divergence(self) -> torch.Tensor:
        r"""KL(q(ũ_d) ‖ N(0, I)) per (b, h, d), docs/derivations.md §5a:

        .. math:: \tfrac12\Big[\sum_t s_{dt}^2 + v_d^\top (K + jI) v_d - T - \sum_t \log s_{dt}^2\Big]

        (padded tokens contribute 0). It depends on the sequence: a per-sequence term (``kl_seq``).
        # shape: -> (B, H, Dv)
        """
        s2 = self.std.square()
        trace_logdet = (s2 - 1 - s2.log()).sum(-2)  # shape: (B, H, Dv)
        # ‖Lᵀv‖² = vᵀ(K + jI)v, reusing the mean K v
        mahalanobis = (self.values * self.mean).sum(-2) + self._jitter_abs[..., 0] * self.values.square().sum(-2)
        return 0.5 * (trace_logdet + mahalanobis)

    # -- q(f)
    def variance(self) -> torch.Tensor:
        """diag Σ_d = Σ_j L_tj² s_jd².  # shape: -> (B, H, T, Dv)"""
        return self.chol.square() @ self.std.square()

    def posterior(self) -> MultivariateNormal:
        """q(f): ``covariance="full"``: Σ_d = L diag(s_d²) Lᵀ, whose Cholesky factor is L diag(s_d)
        (lower triangular, positive diagonal: a ``CholLinearOperator``, so solves and log-determinants
        reuse it); ``"diag"``: its diagonal (independent tokens). The full factor is (B, H, Dv, T, T):
        for verification, the forward pass never forms it."""
        if self.covariance == "diag":
            return posterior_distribution(self.mean, DiagLinearOperator(self.variance().transpose(-1, -2)))
        root = self.chol[:, :, None] * self.std.transpose(-1, -2)[..., None, :]  # shape: (B, H, Dv, T, T)
        return posterior_distribution(self.mean, CholLinearOperator(TriangularLinearOperator(root)))

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Exact reparameterised sample(s) with the shared factor L: f_d = K̂ v_d + L (s_d ⊙ ε_d)
        (full) or K̂ v_d + sqrt(diag Σ_d) ⊙ ε_d (diag).

        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P
        """
        eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)
        if self.covariance == "diag":
            return self.mean + safe_sqrt(self.variance()) * eps
        return self.mean + matmul_samples(self.chol, self.std * eps)


class SGPAVariationalStrategy(_AmortisedVariationalStrategy):
    r"""Standard SGPA (Chen & Li (2023) §3.2; docs/derivations.md §5a) for every head and output dim d at once.

    Inducing inputs are the sequence's keys k (W_q = W_k, so the queries are the keys), inducing
    outputs u_d ~ N(m_d, S_d) with m_d = K_kk v_d and the whitened, amortised S_d = L Σ̃_d Lᵀ,
    L = chol(K_kk + jitter), Σ̃_d = diag(s_d(k_t)²):

    .. math::
        \mu_d = K_{qk} K_{kk}^{-1} m_d = K_{qk} v_d, \qquad
        \Sigma_d = K_{qq} - K_{qk} K_{kk}^{-1} K_{kq} + K_{qk} K_{kk}^{-1} S_d K_{kk}^{-1} K_{kq}
                 = L \tilde\Sigma_d L^\top \quad (q = k),

    since with q = k the GP's values at the queries are the inducing outputs. One Cholesky per
    (B, H), shared by the Dv output dims; sampling uses the root L Σ̃_d^{1/2}. Cost O(T³) per (B, H)
    for the factorisation, O(T²·Dv) for the rest.

    :param kernel: a gpytorch kernel with batch_shape broadcasting against (B, H).
    :param variational_distribution: the amortised q(ũ) scales.
    :param jitter: relative jitter (module docstring).
    :param covariance: ``"full"`` exact joint samples, ``"diag"`` independent tokens.
    """

    def __init__(
        self,
        kernel: Kernel,
        variational_distribution: AmortisedDiagonalVariationalDistribution,
        *,
        jitter: float = 1e-6,
        covariance: str = "full",
    ):
        super().__init__()
        self.kernel = kernel
        self.variational_distribution = variational_distribution
        self.jitter = check_jitter(jitter)
        self.covariance = check_covariance(covariance)

    def condition(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None) -> SGPAConditional:
        """Factorise once for a batch of sequences.

        # shape: keys (B, H, T, Dh), values (B, H, T, Dv), mask (B, T) bool (True = padding) or None
        """
        check_sequence_inputs(keys, values, mask)
        with gp_algebra(keys.device.type):
            keys, values = full_precision(keys, values)
            K = isolate_padding(evaluate_kernel(self.kernel, keys, keys), mask)  # shape: (B, H, T, T)
            pad = None if mask is None else mask[:, None, :]  # shape: (B, 1, T)
            jit = relative_jitter(K.diagonal(dim1=-2, dim2=-1), self.jitter, pad)  # shape: (B, H, 1, 1)
            L = cholesky(add_jitter(K, jit[..., 0, 0]), name="sgpa (K_kk)")  # shape: (B, H, T, T)
            std = self.variational_distribution(keys)  # shape: (B, H, T, Dv)
            if mask is not None:
                tok = mask[:, None, :, None]  # shape: (B, 1, T, 1)
                std = std.masked_fill(tok, 1.0)  # q(ũ_p) = prior: KL contribution 0
                values = values.masked_fill(tok, 0.0)
            return SGPAConditional(L, K, values, std, jit, self.covariance)
