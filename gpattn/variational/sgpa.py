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
plain Cholesky still escalates through :func:`gpattn.variational._linalg.cholesky`). Under a per-query
mask the jitter is relative to each key's own diagonal, ``K + jitter · diag(K)``, so that no query
depends on keys it may not attend to (:class:`MaskedSGPAConditional`, docs/derivations.md §11).

**Per-query masks.** :meth:`SGPAVariationalStrategy.condition` also takes a mask (B or 1, H or 1, T, T):
every query is then its own sparse GP whose inducing inputs are the keys it may attend to
(:class:`MaskedSGPAConditional`): the causal mask (with key padding) from one factorisation and prefix
sums, any other mask with one factorisation per query.
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
    DenseLinearOperator,
    DiagLinearOperator,
    LinearOperator,
    RootLinearOperator,
    SumLinearOperator,
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
    tri_solve,
    with_policy,
)
from gpattn.variational._strategy import AmortisedConditional, AmortisedVariationalStrategy, check_query_inputs
from gpattn.variational.means import add_means, when_present

__all__ = [
    "AmortisedDiagonalVariationalDistribution",
    "CrossSGPAConditional",
    "MaskedSGPAConditional",
    "SGPAConditional",
    "SGPAVariationalStrategy",
    "check_jitter",
    "check_sequence_inputs",
    "isolate_padding",
    "posterior_distribution",
    "relative_jitter",
    "split_per_query_mask",
    "standard_normal",
]

# ---------------------------------------------------------------------------------- shared helpers
def check_jitter(jitter) -> float:
    """``jitter`` must be a finite float ≥ 0 (relative to the mean diagonal of the Gram matrix)."""
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not math.isfinite(jitter) or jitter < 0:
        raise ValueError(f"jitter must be a finite number >= 0, got {jitter!r}")
    return float(jitter)


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


def split_per_query_mask(excluded: torch.Tensor, B: int, H: int, T: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A per-query mask (True = query i may not attend to key j), checked and expanded; its padding (the
    keys no query may attend to) and whether it is the causal mask with that padding
    (docs/derivations.md §11). Reads the device once, for the last.

    # shape: excluded (B or 1, H or 1, T, T) bool -> (B, H, T, T), (B, T), bool
    """
    if excluded.dtype != torch.bool or excluded.shape[-2:] != (T, T) or excluded.shape[0] not in (1, B) or (
        excluded.shape[1] not in (1, H)
    ):
        raise ValueError(
            f"a per-query mask must be a bool tensor of shape (B or 1, H or 1, T, T) with (B, H, T) = "
            f"{(B, H, T)}, got {excluded.dtype} {tuple(excluded.shape)}"
        )
    excluded = excluded.expand(B, H, T, T)
    pad = excluded.all(-2).all(1)  # shape: (B, T): a key no query may attend to is padding
    causal = torch.ones(T, T, dtype=torch.bool, device=excluded.device).triu(1)
    return excluded, pad, bool((excluded == (causal | pad[:, None, None, :])).all())


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

    def __init__(self, chol, gram, std, jitter_abs, covariance, prior_mean, inducing_values):
        self.chol = chol  # shape: (B, H, T, T)
        self.std = std  # shape: (B, H, T, Dv)
        self.covariance = covariance
        self._jitter_abs = jitter_abs  # shape: (B, H, 1, 1)
        #: m(q) of the prior (docs/derivations.md §5c), or None: the paper's zero mean
        self.prior_mean = prior_mean  # shape: (B, H, T, Dv) or None
        #: q(ũ)'s mean in coefficient form, α with m_u = K α: the values (0 at padded tokens), or None (centred)
        self.inducing_values = inducing_values  # shape: (B, H, T, Dv) or None
        #: K̂ α, q(ũ)'s part of the posterior mean (padded columns of K are out of the basis)
        self._update = when_present(lambda a: gram @ a, inducing_values)  # shape: (B, H, T, Dv) or None
        self.mean = add_means(prior_mean, self._update)  # shape: (B, H, T, Dv); m(q) + K̂ α, each where it is not 0

    # -- GPyTorch vocabulary (whitened u-space: ũ = L⁻¹u at the T keys)
    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(ũ) = N(0, I).  # shape: batch (B, H, Dv), event T"""
        zeros = torch.zeros_like(self.std).transpose(-1, -2)
        return MultivariateNormal(zeros, DiagLinearOperator(torch.ones_like(zeros)))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(ũ) = N(Lᵀ v, diag s²) (zero prior mean), N(0, diag s²) (attention prior mean, ũ = L⁻¹(u − m(k))).
        # shape: batch (B, H, Dv), event T"""
        m_tilde = add_means(torch.zeros_like(self.std), when_present(lambda a: self.chol.mT @ a, self.inducing_values))
        return MultivariateNormal(m_tilde.transpose(-1, -2), DiagLinearOperator(self.std.square().transpose(-1, -2)))

    def kl_divergence(self) -> torch.Tensor:
        r"""KL(q(ũ_d) ‖ N(0, I)) per (b, h, d), docs/derivations.md §5a:

        .. math:: \tfrac12\Big[\sum_t s_{dt}^2 + v_d^\top (K + jI) v_d - T - \sum_t \log s_{dt}^2\Big]

        (padded tokens contribute 0). It depends on the sequence: a per-sequence term (``kl_seq``). With the
        attention prior mean (docs/derivations.md §5c) q(ũ) has mean 0 and only the first, third and fourth
        terms remain: ½ Σ_t (s² − 1 − log s²).
        # shape: -> (B, H, Dv)
        """
        s2 = self.std.square()
        trace_logdet = (s2 - 1 - s2.log()).sum(-2)  # shape: (B, H, Dv)
        # + ‖Lᵀv‖² = vᵀ(K + jI)v with q(ũ) amortised on the values, reusing its part K v of the mean
        quadratic = when_present(
            lambda a, update: (a * update).sum(-2) + self._jitter_abs[..., 0] * a.square().sum(-2),
            self.inducing_values, self._update,
        )
        return 0.5 * add_means(trace_logdet, quadratic)

    # -- q(f)
    def variance(self) -> torch.Tensor:
        """diag Σ_d = Σ_j L_tj² s_jd².  # shape: -> (B, H, T, Dv)"""
        return self.chol.square() @ self.std.square()

    def posterior(self) -> MultivariateNormal:
        """q(f) in the covariance form of the strategy (:mod:`gpattn.variational.covariances`)."""
        return self.covariance.posterior(self)

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Exact reparameterised sample(s) in the covariance form of the strategy.

        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P
        """
        return self.covariance.rsample(self, num_samples, generator)

    def joint_posterior(self) -> MultivariateNormal:
        """q(f) with Σ_d = L diag(s_d²) Lᵀ, whose Cholesky factor is L diag(s_d) (lower triangular, positive
        diagonal: a ``CholLinearOperator``, so solves and log-determinants reuse it). The factor is
        (B, H, Dv, T, T): for verification, the forward pass never forms it."""
        root = self.chol[:, :, None] * self.std.transpose(-1, -2)[..., None, :]  # shape: (B, H, Dv, T, T)
        return posterior_distribution(self.mean, CholLinearOperator(TriangularLinearOperator(root)))

    def joint_sample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """f_d = K̂ v_d + L (s_d ⊙ ε_d) with the shared factor L: exact joint samples.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)
        return self.mean + matmul_samples(self.chol, self.std * eps)


class CrossSGPAConditional(SGPAConditional):
    r"""Standard SGPA in cross-attention (docs/derivations.md §13): the context's S keys are the inducing
    inputs, q(ũ) is theirs (whitened, L = chol(K_kk + jitter)), and q(f) is evaluated at T other queries.
    With A = K_qk L⁻ᵀ (padded keys: zero columns),

    .. math::
        \mu_d = K_{qk} v_d \ (	ext{zero prior mean}) 	ext{ or } m(q)_d, \qquad
        \Sigma_d = (K_{qq} - A A^	op) + (A\,\mathrm{diag}\,s_d)(A\,\mathrm{diag}\,s_d)^	op,

    the KL is the keys' (:meth:`kl_divergence`, as self-attention's). Samples: μ + chol(R + jitter) ε₁ +
    A (s ⊙ ε₂), one T×T factorisation of the residual R = K_qq − A Aᵀ per (B, H) (``"full"``), or
    independent tokens (``"diag"``: K_qq's diagonal only).

    :ivar interp: A = K_qk L⁻ᵀ.  # shape: (B, H, T, S)
    """

    def __init__(self, chol, std, jitter_abs, covariance, *, mean, interp, gram_diag, gram, jitter, prior_mean,
                 inducing_values):
        self.chol, self.std = chol, std  # shapes: (B, H, S, S), (B, H, S, Dv)
        self.covariance, self._jitter_abs, self.jitter = covariance, jitter_abs, jitter
        self.prior_mean, self.mean, self.interp = prior_mean, mean, interp  # mean (B, H, T, Dv)
        self.inducing_values = inducing_values  # shape: (B, H, S, Dv) or None: the keys' coefficients α
        self.gram_diag, self.gram = gram_diag, gram  # diag K_qq (B, H, T); K_qq (B, H, T, T) or None ("diag")

    def kl_divergence(self) -> torch.Tensor:
        """KL(q(ũ_d) ‖ N(0, I)) of the keys' inducing outputs: ½[Σ(s² − 1 − log s²) + ‖Lᵀv‖²] (the last term
        with the zero prior mean only).  # shape: -> (B, H, Dv)"""
        s2 = self.std.square()
        trace_logdet = (s2 - 1 - s2.log()).sum(-2)
        quadratic = when_present(lambda a: (self.chol.mT @ a).square().sum(-2), self.inducing_values)  # ‖Lᵀα‖²
        return 0.5 * add_means(trace_logdet, quadratic)

    def variance(self) -> torch.Tensor:
        """diag Σ_d = K_tt − ‖A_t‖² + Σ_j A_tj² s_jd² (the residual clamped at 0).  # shape: -> (B, H, T, Dv)"""
        A2 = self.interp.square()
        return (self.gram_diag - A2.sum(-1)).clamp_min(0)[..., None] + A2 @ self.std.square()

    def residual(self) -> torch.Tensor:
        """K_qq − K_qk K̂_kk⁻¹ K_kq, shared by the Dv output dims.  # shape: -> (B, H, T, T)"""
        return self.gram - self.interp @ self.interp.mT

    def joint_posterior(self) -> MultivariateNormal:
        """q(f) with the residual plus the root A diag(s_d) ((B, H, Dv, T, T) when evaluated: for verification)."""
        R = self.residual()
        dense = DenseLinearOperator(R[:, :, None].expand(*R.shape[:2], self.std.shape[-1], *R.shape[2:]))
        root = self.interp[:, :, None] * self.std.transpose(-1, -2)[..., None, :]  # shape: (B, H, Dv, T, S)
        return posterior_distribution(self.mean, SumLinearOperator(dense, RootLinearOperator(root)))

    def joint_sample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Exact joint sample(s): μ + chol(R + jitter·mean diag K_qq) ε₁ + A (s ⊙ ε₂).
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)
        eps_k = standard_normal(self.std.shape, self.mean, num_samples, generator)  # shape: (..., B, H, S, Dv)
        jit = relative_jitter(self.gram_diag, self.jitter)[..., 0, 0]  # shape: (B, H)
        with gp_algebra(self.mean.device.type):
            L_r = cholesky(add_jitter(self.residual(), jit), name="sgpa (K_qq - Q_qq, cross-attention)")
        return self.mean + matmul_samples(L_r, eps) + matmul_samples(self.interp, self.std * eps_k)


class MaskedSGPAConditional(AmortisedConditional):
    """Standard SGPA under a per-query mask (returned by :meth:`SGPAVariationalStrategy.condition` for a
    mask (B or 1, H or 1, T, T); docs/derivations.md §11): query i is its own sparse GP, whose inducing
    inputs are the keys in A_i (the keys it may attend to), with q_i(ũ_S) = N(L_Sᵀ v_S, diag s_S²),
    L_S = chol(K̂_SS), K̂ = K + jitter · diag(K): the jitter is relative to each key's own prior variance
    (the unmasked layer's, relative to the mean, would make every query depend on every key).

    The queries are different GPs, so there is no joint posterior over the tokens: for both
    ``covariance`` settings, :meth:`posterior` is diagonal (each query's marginal) and :meth:`rsample`
    draws each query from its marginal, independently across tokens. There is no single q(ũ) either
    (``prior_distribution`` and ``variational_distribution`` raise); :meth:`query_kl_divergence` gives
    each query's KL and :meth:`kl_divergence` the layer's term, their mean over the real queries.

    :ivar mean: Σ_{j∈A_i} K_ij v_j, masked kernel attention.  # shape: (B, H, T, Dv)
    :ivar real: the queries that count in the KL: not padding, A_i ≠ ∅.  # shape: (B, H, T)
    """

    def __init__(self, mean, variance, query_kl, real):
        self.mean = mean  # shape: (B, H, T, Dv)
        self._variance = variance  # shape: (B, H, T, Dv)
        self._query_kl = query_kl  # shape: (B, H, T, Dv)
        self.real = real  # shape: (B, H, T)

    def _one_q_per_query(self, member: str):
        raise NotImplementedError(
            f"MaskedSGPAConditional.{member}: under a per-query mask every query has its own q(ũ) over its "
            f"own inducing inputs (docs/derivations.md §11), so there is no single one; use "
            f"query_kl_divergence(), kl_divergence() and posterior()"
        )

    @property
    def prior_distribution(self) -> MultivariateNormal:
        self._one_q_per_query("prior_distribution")

    @property
    def variational_distribution(self) -> MultivariateNormal:
        self._one_q_per_query("variational_distribution")

    def query_kl_divergence(self) -> torch.Tensor:
        """KL_i = ½[Σ_{j∈A_i}(s_j² − 1 − log s_j²) + v_Sᵀ K̂_SS v_S] per query and output dim (0 where
        A_i = ∅).  # shape: -> (B, H, T, Dv)"""
        return self._query_kl

    def kl_divergence(self) -> torch.Tensor:
        """The layer's per-sequence term: the mean of KL_i over the real queries (docs/derivations.md §11;
        equal to the unmasked KL when every query has the same A_i).  # shape: -> (B, H, Dv)"""
        real = self.real.to(self._query_kl.dtype)[..., None]  # shape: (B, H, T, 1)
        return (self._query_kl * real).sum(-2) / real.sum(-2).clamp_min(1)

    def variance(self) -> torch.Tensor:
        """Each query's marginal variance.  # shape: -> (B, H, T, Dv)"""
        return self._variance

    def posterior(self) -> MultivariateNormal:
        """The per-query marginals as one diagonal q(f) (independent tokens), for both ``covariance``
        settings."""
        return posterior_distribution(self.mean, DiagLinearOperator(self._variance.transpose(-1, -2)))

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Each query drawn from its own marginal: mean + sqrt(variance) ⊙ ε.

        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P
        """
        eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)
        return self.mean + safe_sqrt(self._variance) * eps


class SGPAVariationalStrategy(AmortisedVariationalStrategy):
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
    :param covariance: the covariance form (:mod:`gpattn.variational.covariances`): ``FullCovariance()`` exact joint
        samples, ``DiagonalCovariance()`` independent tokens.
    :param mean_module: the prior mean (:mod:`gpattn.variational.means`).
    :param variational_mean: q(ũ)'s mean (:class:`~gpattn.variational.means.AmortisedValueMean`, amortised on the
        values, or :class:`~gpattn.variational.means.CentredVariationalMean`, centred at the prior mean).
    """

    def __init__(
        self,
        kernel: Kernel,
        variational_distribution: AmortisedDiagonalVariationalDistribution,
        *,
        jitter: float,
        covariance,
        mean_module: nn.Module,
        variational_mean,
    ):
        super().__init__()
        self.kernel = kernel
        self.variational_distribution = variational_distribution
        self.jitter = check_jitter(jitter)
        self.covariance = covariance
        #: the prior mean function (GPyTorch's ``mean_module``, :mod:`gpattn.variational.means`)
        self.mean_module = mean_module
        mean_module.check_kernel(kernel)  # a mean that cannot read the kernel fails here, not at a forward
        #: q(ũ)'s mean (docs/derivations.md §5a, §5c): its coefficients reach the conditioning code through its one
        #: interface, ``inducing_values(values)``
        self.variational_mean = variational_mean

    def condition(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None, query_inputs=None
    ) -> SGPAConditional | MaskedSGPAConditional:
        """Factorise once for a batch of sequences.

        ``mask`` is a key padding mask (B, T) (True = padding: one GP per sequence, an
        :class:`SGPAConditional`) or a per-query mask (B or 1, H or 1, T, T) (True = query i may not
        attend to key j: one GP per query, a :class:`MaskedSGPAConditional`, docs/derivations.md §11).
        ``query_inputs`` (B, H, T', Dh): cross-attention, q(f) evaluated at these queries, the keys the
        inducing inputs (a :class:`CrossSGPAConditional`, docs/derivations.md §13; key padding only).

        # shape: keys (B, H, T, Dh), values (B, H, T, Dv), mask (B, T) or (B or 1, H or 1, T, T) bool or None
        """
        if query_inputs is not None:
            return self._condition_cross(query_inputs, keys, values, mask)
        if mask is not None and mask.dim() == 4:
            return self._condition_per_query(keys, values, mask)
        check_sequence_inputs(keys, values, mask)
        with gp_algebra(keys.device.type):
            L, K, values, std, jit = self._factorise(keys, values, mask)
            m = self._prior_mean(K, values, keys, keys, None if mask is None else mask[:, None, None, :])
            alpha = self.variational_mean.inducing_values(values)
            return SGPAConditional(L, K, std, jit, self.covariance, m, alpha)

    def _condition_cross(self, queries, keys, values, mask) -> CrossSGPAConditional:
        """Cross-attention (docs/derivations.md §13): the keys' factorisation as in self-attention, then
        A = K_qk L⁻ᵀ at the queries.  # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), mask (B, S) or None"""
        check_sequence_inputs(keys, values, mask)
        check_query_inputs(queries, keys)
        with gp_algebra(keys.device.type):
            L, _, values, std, jit = self._factorise(keys, values, mask)
            queries, keys = full_precision(queries, keys)
            K_qk = evaluate_kernel(self.kernel, queries, keys)  # shape: (B, H, T, S)
            if mask is not None:
                K_qk = K_qk.masked_fill(mask[:, None, None, :], 0.0)  # padded keys leave the basis
            A = tri_solve(L.mT, K_qk, upper=True, left=False)  # shape: (B, H, T, S); A Lᵀ = K_qk
            m = self._prior_mean(K_qk, values, queries, keys, None if mask is None else mask[:, None, None, :])
            gram = self.covariance.query_gram(self.kernel, queries)  # K_qq where the covariance form reads it
            alpha = self.variational_mean.inducing_values(values)
            return CrossSGPAConditional(
                L, std, jit, self.covariance, mean=add_means(m, when_present(lambda a: K_qk @ a, alpha)),
                interp=A, gram_diag=evaluate_kernel(self.kernel, queries, queries, diag=True), gram=gram,
                jitter=self.jitter, prior_mean=m, inducing_values=alpha,
            )

    def _prior_mean(self, gram, values, queries, keys, excluded=None) -> torch.Tensor | None:
        """m(q) of the prior mean function (None: the papers' zero mean), the keys in ``excluded`` left out.
        # shape: gram (B, H, T, S) = κ(q, k), excluded broadcastable to it or None"""
        return self.mean_module(queries, keys, values, kernel=self.kernel, excluded=excluded, gram=gram)

    def _factorise(self, keys, values, mask):
        """The padded factors: (L, K̂, v̂, s, jitter).  # shape: mask (B, T) or None"""
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
        return L, K, values, std, jit

    def _condition_per_query(self, keys, values, excluded) -> MaskedSGPAConditional:
        """One GP per query (docs/derivations.md §11): query i's inducing inputs are the keys it may
        attend to. Reads the mask once on the host, to tell a causal mask (with key padding) from a
        general one.  # shape: excluded (B or 1, H or 1, T, T) bool"""
        check_sequence_inputs(keys, values, None)
        excluded, pad, causal = split_per_query_mask(excluded, *keys.shape[:3])
        with gp_algebra(keys.device.type):
            if causal:
                return self._condition_causal(keys, values, pad if bool(pad.any()) else None)
            return self._condition_general(keys, values, excluded, pad)

    def _key_jitter(self, K: torch.Tensor) -> torch.Tensor:
        """Per-query masks: the jitter of key j is ``jitter · K_jj`` (detached), whichever query's K_SS it
        is in, so that the leading block of the jittered Gram is the prefix's own and no query's
        factor depends on keys it may not attend to (docs/derivations.md §11).
        # shape: K (B, H, T, T) -> (B, H, T)"""
        return self.jitter * K.diagonal(dim1=-2, dim2=-1).detach()

    def _condition_causal(self, keys, values, pad) -> MaskedSGPAConditional:
        """The causal mask (A_i = the real keys j ≤ i): the factor of a leading block is the leading block
        of L, so every query's quantities come from one factorisation of the sequence (O(T³) once,
        O(T²·Dv) for the rest; docs/derivations.md §11).  # shape: pad (B, T) or None"""
        keys, values = full_precision(keys, values)
        K = isolate_padding(evaluate_kernel(self.kernel, keys, keys), pad)  # shape: (B, H, T, T)
        jit = self._key_jitter(K)  # shape: (B, H, T)
        L = cholesky(K + torch.diag_embed(jit), name="sgpa (K_kk, causal)")  # shape: (B, H, T, T)
        std = self.variational_distribution(keys)  # shape: (B, H, T, Dv)
        if pad is not None:
            tok = pad[:, None, :, None]  # shape: (B, 1, T, 1)
            std = std.masked_fill(tok, 1.0)  # padded keys are in no query's inducing set
            values = values.masked_fill(tok, 0.0)
        alpha = self.variational_mean.inducing_values(values)
        update = when_present(lambda a: K.tril() @ a, alpha)  # Σ_{j≤i} K_ij α_j
        # ½ α_{≤i}ᵀ K̂_{≤i} α_{≤i} as a prefix sum of α_j (2 Σ_{k<j} K_jk α_k + (K_jj + c_j) α_j)
        diag, j = K.diagonal(dim1=-2, dim2=-1)[..., None], jit[..., None]  # shape: (B, H, T, 1) views
        quadratic = when_present(lambda a, u: 0.5 * (a * (2 * u - (diag - j) * a)).cumsum(-2), alpha, update)
        s2 = std.square()
        variance = L.square() @ s2  # Σ_{j≤i} L_ij² s_j²: row i of L is row i of the prefix's factor
        query_kl = add_means(0.5 * (s2 - 1 - s2.log()).cumsum(-2), quadratic)  # shape: (B, H, T, Dv)
        T = K.shape[-1]
        later = torch.ones(T, T, dtype=torch.bool, device=K.device).triu(1)  # j > i
        prior = self._prior_mean(K, values, keys, keys, later if pad is None else later | pad[:, None, None, :])
        mean = add_means(prior, update)  # m(q) over A_i (docs/derivations.md §5c) + q(ũ)'s part
        real = keys.new_ones(keys.shape[:3], dtype=torch.bool) if pad is None else ~pad[:, None, :].expand(
            keys.shape[:3]
        )
        return MaskedSGPAConditional(mean, variance, query_kl, real)

    def _condition_general(self, keys, values, excluded, pad) -> MaskedSGPAConditional:
        """Any per-query mask: one Cholesky factorisation of K_SS per query, batched over the queries
        (O(T⁴) time and O(T³) memory per (B, H); docs/derivations.md §11).
        # shape: excluded (B, H, T, T), pad (B, T)"""
        keys, values = full_precision(keys, values)
        K = evaluate_kernel(self.kernel, keys, keys)  # shape: (B, H, T, T)
        jit = self._key_jitter(K)  # shape: (B, H, T)
        Kj = K + torch.diag_embed(jit)
        allowed = ~excluded  # shape: (B, H, T, T): row i = A_i
        both = allowed[..., :, None] & allowed[..., None, :]  # shape: (B, H, T, T, T): A_i × A_i
        eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
        L = cholesky(torch.where(both, Kj[:, :, None], eye), name="sgpa (K_SS per query)")  # shape: (B, H, T, T, T)
        # the prior mean over A_i (§5c) + q(ũ)'s part: masked kernel attention where q(ũ) is amortised on the values
        alpha = self.variational_mean.inducing_values(values)
        mean = add_means(
            self._prior_mean(K, values, keys, keys, excluded),
            when_present(lambda a: K.masked_fill(excluded, 0.0) @ a, alpha),
        )
        # L_S⁻¹ K̂_{S,i} per query i (the jittered column: with i ∈ A_i it is row i of L_S)
        a = tri_solve(L, Kj.masked_fill(excluded, 0.0)[..., None])[..., 0]  # shape: (B, H, T, T)
        own = allowed.diagonal(dim1=-2, dim2=-1)  # shape: (B, H, T): i ∈ A_i
        # K̂_ii − K̂_iS K̂_SS⁻¹ K̂_Si: 0 when i ∈ A_i (the value at query i is an inducing output), the
        # prior variance when A_i = ∅
        residual = torch.where(own, 0.0, (Kj.diagonal(dim1=-2, dim2=-1) - a.square().sum(-1)).clamp_min(0))
        std = self.variational_distribution(keys)  # shape: (B, H, T, Dv)
        s2 = std.square()
        variance = residual[..., None] + a.square() @ s2  # shape: (B, H, T, Dv)
        query_kl = add_means(  # shape: (B, H, T, Dv); + ½‖L_Sᵀ α_S‖² with q(ũ) amortised on the values
            0.5 * (allowed.to(s2.dtype) @ (s2 - 1 - s2.log())),
            when_present(lambda a: 0.5 * (L.mT @ (allowed[..., None] * a[:, :, None])).square().sum(-2), alpha),
        )
        real = allowed.any(-1) & ~pad[:, None, :]  # shape: (B, H, T)
        return MaskedSGPAConditional(mean, variance, query_kl, real)
