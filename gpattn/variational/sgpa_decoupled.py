"""Decoupled SGPA: orthogonally decoupled sparse GP attention (docs/derivations.md §5b).

Chen & Li, ICLR 2023 (Chen & Li (2023) §3.3–3.4), built on the orthogonally decoupled SVGP of Salimbeni,
Cheng, Boots & Deisenroth (NeurIPS 2018). The q(u_g) parameterisation
(:class:`WhitenedGlobalVariationalDistribution`: global, per layer, head and output dim) is kept
apart from the q(u) → q(f) map (:class:`DecoupledSGPAVariationalStrategy`), which keeps GPyTorch's
vocabulary (see :mod:`gpattn.variational.sgpa`, whose padding and jitter rules it shares:
``jitter`` is relative to the mean diagonal of each Gram matrix).

**Relation to GPyTorch.** ``gpytorch.variational.OrthogonallyDecoupledVariationalStrategy`` (1.15)
computes its mean as ``base_mean(x) + Cov_q(x, a) γ`` with the *posterior* covariance of its
covariance strategy, so its mean carries the extra term K_qg L_g⁻ᵀ S̃ L_g⁻¹ K_ga γ, and its
``kl_divergence()`` adds ½ γᵀ Cov_q(a, a) γ instead of the process KL's
½ γᵀ (K_aa − K_ag K_gg⁻¹ K_ga) γ (an extra ½ γᵀ K_ag L_g⁻ᵀ S̃ L_g⁻¹ K_ga γ). Salimbeni et al.'s mean
(and docs/derivations.md §5b) has no S̃ in the mean; the two agree as S̃ → 0 (the difference is linear in S̃). Measured in
``tests/test_sgpa_decoupled.py`` (float64, T = 12, M = 5, one output dim; the identities above hold to
4e-15): at S̃ = I (the initialisation) the relative mean difference ‖Δμ‖/‖μ‖ is 5.4 and GPyTorch's
KL is 40.4 against the process KL 5.8; at S̃ = 0.09·I, 0.48 and 12.7 vs 9.6; at S̃ = 10⁻⁸·I,
5.4·10⁻⁸ and a relative KL difference of 7·10⁻⁹.

**Key padding.** Padded keys leave the amortised mean basis (their values are set to 0, so K_qa and
K_ga lose their columns and γ its entries). Queries at padded positions stay GP test points; in
``covariance="full"`` the Cholesky factor of the shared residual is computed with the real tokens
first, so real tokens' samples never depend on padded ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.variational import CholeskyVariationalDistribution
from linear_operator.operators import (
    CholLinearOperator,
    DenseLinearOperator,
    DiagLinearOperator,
    RootLinearOperator,
    SumLinearOperator,
    TriangularLinearOperator,
)

from gpattn.kernels import evaluate_kernel
from gpattn.objectives import GlobalKL, SequenceKL
from gpattn.variational import _blockwise
from gpattn.variational._blockwise import block_rows, blockwise
from gpattn.variational._linalg import (
    add_jitter,
    cholesky,
    full_precision,
    gp_algebra,
    matmul_samples,
    tri_solve,
)
from gpattn.variational._strategy import (
    AmortisedConditional,
    AmortisedVariationalStrategy,
    check_query_inputs,
    sequence_mean,
)
from gpattn.variational.means import add_means, present, when_present
from gpattn.variational.sgpa import (
    check_jitter,
    check_sequence_inputs,
    posterior_distribution,
    relative_jitter,
    split_per_query_mask,
    standard_normal,
)

__all__ = [
    "DecoupledSGPAConditional",
    "DecoupledSGPAVariationalStrategy",
    "MaskedDecoupledSGPAConditional",
    "WhitenedGlobalVariationalDistribution",
]


# ---------------------------------------------------------------------------------- q(u_g)
class WhitenedGlobalVariationalDistribution(CholeskyVariationalDistribution):
    r"""Global whitened q(ũ_g) of decoupled SGPA, per head h and output dim d:

    .. math:: q(\tilde u_{g,d}) = \mathcal N(L_g^\top v_{g,d},\ \tilde S_{g,d}),
              \qquad \tilde S_{g,d} = L_{s,d} L_{s,d}^\top,

    gpytorch's ``CholeskyVariationalDistribution`` with batch shape ``(H, Dv)`` over the M global
    inducing inputs: :math:`L_{s,d}` is the lower triangle of ``chol_variational_covar[h, d]`` (gpytorch's
    parameterisation: an unconstrained diagonal, :math:`\log|\tilde S|` from its absolute values), and
    ``variational_mean[h, d]`` holds the *unwhitened* coefficients :math:`v_{g,d}` (the mean term is
    :math:`K_{qg} v_{g,d}`; the whitened mean :math:`L_g^\top v_{g,d}` depends on the kernel and the global
    keys, so calling this module gives :math:`N(v_{g,d}, \tilde S_{g,d})`, and q(ũ_g) itself is the
    conditional's ``variational_distribution``). Initialised as gpytorch does: S̃ = I, v_g ~ N(0, 10⁻⁶).
    """

    def __init__(self, num_heads: int, num_global: int, value_dim: int):
        super().__init__(num_global, batch_shape=torch.Size([num_heads, value_dim]))
        self.num_global = num_global
        with torch.no_grad():
            self.variational_mean.copy_(1e-3 * torch.randn(num_heads, num_global, value_dim).mT)

    @property
    def inducing_values(self) -> torch.Tensor:
        """v_g, a view of ``variational_mean``.  # shape: (H, M, Dv)"""
        return self.variational_mean.mT

    def scale_tril(self) -> torch.Tensor:
        """L_s.  # shape: -> (H, Dv, M, M)"""
        return self.chol_variational_covar.tril()


# ---------------------------------------------------------------------------------- q(u) -> q(f)
class DecoupledSGPAConditional(AmortisedConditional):
    """The factors of one decoupled-SGPA forward pass (returned by
    :meth:`DecoupledSGPAVariationalStrategy.condition`; explicit, never cached).

    :ivar mean: posterior mean.  # shape: (B, H, T, Dv)
    :ivar interp: A = K_qg L_g⁻ᵀ.  # shape: (B, H, T, M)
    :ivar scale_tril: L_s.  # shape: (H, Dv, M, M)
    :ivar inducing_values: the mean basis' coefficients α (the values v_a, 0 at padded keys), or None: no mean basis
        γ (a q(ũ) centred at the prior mean, docs/derivations.md §5c).  # shape: (B, H, T, Dv) or None
    :ivar proj_values: c = L_g⁻¹ K_ga α, the mean basis' part on the global basis, or None.  # shape: (B, H, M, Dv)
    :ivar gamma: the γ-part of the KL, ½ αᵀ (K_aa − K_ag K_gg⁻¹ K_ga) α, or None.  # shape: (B, H, Dv) or None
    """

    def __init__(
        self,
        *,
        gram,
        gram_diag,
        interp,
        mean,
        whitened_values,
        scale_tril,
        mask,
        jitter,
        covariance,
        gamma,
        inducing_values=None,
        proj_values=None,
    ):
        self.gram = gram  # shape: (B, H, T, T) or None; K_qq (= K_qa before the padded columns leave)
        self.gram_diag = gram_diag  # shape: (B, H, T); diag K_qq, evaluated on its own (no (T, T) gradient)
        self.interp = interp  # shape: (B, H, T, M)
        self.mean = mean  # shape: (B, H, T, Dv)
        self.gamma = gamma  # shape: (B, H, Dv) or None
        self.inducing_values, self.proj_values = inducing_values, proj_values  # α, c: (B, H, T, Dv), (B, H, M, Dv)
        self.whitened_values = whitened_values  # shape: (H, M, Dv); ũ = L_gᵀ v_g
        self.scale_tril = scale_tril  # shape: (H, Dv, M, M)
        self.mask = mask
        self.jitter = jitter
        self.covariance = covariance

    # -- GPyTorch vocabulary for the global (β) part, whitened
    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(ũ_g) = N(0, I_M).  # shape: batch (H, Dv), event M"""
        zeros = torch.zeros_like(self.whitened_values).transpose(-1, -2)
        return MultivariateNormal(zeros, DiagLinearOperator(torch.ones_like(zeros)))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(ũ_g) = N(L_gᵀ v_g, L_s L_sᵀ).  # shape: batch (H, Dv), event M"""
        return MultivariateNormal(
            self.whitened_values.transpose(-1, -2), CholLinearOperator(TriangularLinearOperator(self.scale_tril))
        )

    def kl_divergence_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The two parts of the process KL (docs/derivations.md §5b, §9):

        .. math::
            \mathrm{KL}_{\gamma,d} = \tfrac12\, v_{a,d}^\top (K_{aa} - K_{ag} K_{gg}^{-1} K_{ga}) v_{a,d}, \qquad
            \mathrm{KL}_{\beta,d} = \tfrac12\big[\operatorname{tr}\tilde S_{g,d} + \tilde u_d^\top \tilde u_d - M
                                     - \log|\tilde S_{g,d}|\big].

        γ depends on the sequence (``kl_seq``); β on global parameters only (``kl_global``); without the mean basis
        γ (docs/derivations.md §5c) the γ-part is 0.
        # shape: -> (B, H, Dv), (H, Dv)
        """
        B, H, _, Dv = self.mean.shape
        return add_means(self.mean.new_zeros(B, H, Dv), self.gamma), self._beta()

    def _beta(self) -> torch.Tensor:
        L_s = self.scale_tril
        log_det = 2 * L_s.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)  # shape: (H, Dv)
        M = L_s.shape[-1]
        return 0.5 * (L_s.square().sum((-2, -1)) + self.whitened_values.square().sum(-2) - M - log_det)

    def kl_divergence(self) -> torch.Tensor:
        """Process KL per (b, h, d) = γ-part + β-part.  # shape: -> (B, H, Dv)"""
        gamma, beta = self.kl_divergence_parts()
        return gamma + beta

    def added_loss_terms(self, mask=None):
        """``kl_seq``: the γ-part, per sequence (docs/derivations.md §9; none without the mean basis γ); ``kl_global``:
        the β-part, summed over (h, d)."""
        per_sequence = when_present(lambda gamma: SequenceKL(sequence_mean(gamma, mask)), self.gamma)
        return tuple(present(per_sequence, GlobalKL(self._beta().sum())))

    # -- q(f)
    def residual(self) -> torch.Tensor:
        """K_qq − K_qg K_gg⁻¹ K_gq, shared by the Dv output dims.  # shape: -> (B, H, T, T)"""
        return self.gram - self.interp @ self.interp.mT

    def variance(self) -> torch.Tensor:
        """diag Σ_d = diag K_qq − ‖A_t‖² + A_t S̃_d A_tᵀ, without any (T, T) or (Dv, T, M) tensor.

        The quadratic forms are one matmul per head over every (b, t) row, (H, B·T, M²) @ (H, M², Dv):
        with the rows laid out per head, S̃ is never broadcast (copied) over the batch.

        # shape: -> (B, H, T, Dv)
        """
        A = self.interp
        B, H, T, M = A.shape
        S = self.scale_tril @ self.scale_tril.mT  # shape: (H, Dv, M, M)
        # a long sequence: the (H, B·T, M²) products in blocks of tokens (docs/derivations.md §12)
        budget = _blockwise.BLOCK_ELEMENTS if A.device.type == "cpu" else _blockwise.DEVICE_BLOCK_ELEMENTS
        rows = block_rows(B, H, T, M * M, block_elements=budget // 4)
        if rows is None:
            return _diag_variance(A, S, self.gram_diag[..., None])
        return blockwise(_diag_variance, A, S, rows=rows, per_query=(self.gram_diag[..., None],))

    def posterior(self) -> MultivariateNormal:
        """q(f) in the covariance form of the strategy (:mod:`gpattn.variational.covariances`)."""
        return self.covariance.posterior(self)

    def joint_posterior(self) -> MultivariateNormal:
        """q(f) with Σ_d = (K_qq − Q_qq) + (A L_s,d)(A L_s,d)ᵀ as a sum of a dense and a root operator
        ((B, H, Dv, T, T) when evaluated: for verification)."""
        Dv = self.mean.shape[-1]
        R = self.residual()
        dense = DenseLinearOperator(R[:, :, None].expand(*R.shape[:2], Dv, *R.shape[2:]))
        root = self.interp[:, :, None] @ self.scale_tril  # shape: (B, H, Dv, T, M)
        # SumLinearOperator explicitly: `dense + root` would root-decompose `dense` (Lanczos) in add_low_rank
        return posterior_distribution(self.mean, SumLinearOperator(dense, RootLinearOperator(root)))

    def _jittered_residual(self) -> torch.Tensor:
        """K_qq − Q_qq + c·I, c = ``jitter`` · the mean of diag K_qq over the real tokens (detached).
        # shape: -> (B, H, T, T)"""
        pad = None if self.mask is None else self.mask[:, None, :]
        jit = relative_jitter(self.gram_diag, self.jitter, pad)  # shape: (B, H, 1, 1)
        return add_jitter(self.residual(), jit[..., 0, 0])

    def _residual_sample(self, eps: torch.Tensor) -> torch.Tensor:
        """chol(R + jitter) ε with the real tokens ordered first, so that real tokens' samples never
        depend on padded ones. One Cholesky per (B, H), shared by the Dv output dims.

        # shape: eps (..., B, H, T, Dv) -> (..., B, H, T, Dv)
        """
        R = self._jittered_residual()  # shape: (B, H, T, T)
        B, H, T, _ = R.shape
        if self.mask is None:
            L = cholesky(R, name="sgpa-decoupled (K_qq - Q_qq)")
            return matmul_samples(L, eps)
        perm = torch.argsort(self.mask.to(torch.int8), dim=-1, stable=True)  # shape: (B, T), real first
        rows = perm[:, None, :, None].expand(B, H, T, T)
        R = R.gather(-2, rows).gather(-1, rows.mT)  # R[perm][:, perm]
        L = cholesky(R, name="sgpa-decoupled (K_qq - Q_qq)")
        inv = torch.argsort(perm, dim=-1)[:, None, :, None].expand(B, H, T, eps.shape[-1])  # shape: (B, H, T, Dv)
        inv = inv.expand(*eps.shape[:-4], *inv.shape)
        return matmul_samples(L, eps).gather(-2, inv)  # rows back in token order (ε's row order is immaterial)

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Exact reparameterised sample(s) in the covariance form of the strategy.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        with gp_algebra(self.mean.device.type):
            return self.covariance.rsample(self, num_samples, generator)

    def joint_sample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Σ_d = R + (A L_s,d)(A L_s,d)ᵀ is a sum of two covariances, so f_d = μ_d + chol(R) ε₁ + A (L_s,d ε₂,d)
        with independent ε₁ ∈ R^T, ε₂ ∈ R^M: exact, one T×T Cholesky per (B, H) instead of one per (B, H, d).

        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P
        """
        with gp_algebra(self.mean.device.type):
            eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)  # shape: (..., B, H, T, Dv)
            B, H, T, Dv = self.mean.shape
            M = self.interp.shape[-1]
            eps_g = standard_normal((B, H, Dv, M), self.mean, num_samples, generator)  # shape: (..., B, H, Dv, M)
            lead = eps_g.shape[:-3]  # (B,) or (P, B)
            # L_s,d ε₂,d for every (b, d) as one batched matmul over (h, d) with the (b) draws as columns:
            # L_s is never broadcast (copied) over the batch
            cols = eps_g.reshape(-1, H, Dv, M).permute(1, 2, 3, 0)  # shape: (H, Dv, M, N), N = P·B
            low = self.scale_tril @ cols  # shape: (H, Dv, M, N)
            low_rank = low.permute(3, 0, 2, 1).reshape(*lead, H, M, Dv)  # shape: (..., B, H, M, Dv)
            return self.mean + self._residual_sample(eps) + matmul_samples(self.interp, low_rank)


def _diag_variance(A: torch.Tensor, S: torch.Tensor, gram_diag: torch.Tensor) -> torch.Tensor:
    """diag K_qq − ‖A_t‖² + A_t S̃_d A_tᵀ for the rows of ``A``: one matmul per head over every (b, t) row,
    (H, B·T, M²) @ (H, M², Dv), with S̃ never broadcast (copied) over the batch.
    # shape: A (B, H, T, M), S (H, Dv, M, M), gram_diag (B, H, T, 1) -> (B, H, T, Dv)"""
    B, H, T, M = A.shape
    resid = gram_diag[..., 0] - A.square().sum(-1)  # shape: (B, H, T)
    rows = A.transpose(0, 1).reshape(H, B * T, M)  # shape: (H, B·T, M)
    quad = _RowQuadratic.apply(rows, S).view(H, B, T, -1)  # shape: (H, B, T, Dv)
    return resid[..., None] + quad.transpose(0, 1)


class _RowQuadratic(torch.autograd.Function):
    """q_td = a_t S_d a_tᵀ for every row a_t and every S_d: forward one matmul per head of the rows' outer products,
    (H, N, M²) @ (H, M², Dv); backward two matmuls written out, S̄_d = Σ_t q̄_td a_tᵀ a_t and
    ā_t = Σ_d q̄_td a_t (S_d + S_dᵀ) as (q̄_t ⊗ a_t) @ (S + Sᵀ) — autograd's backward of the outer product takes two
    broadcast products and two reductions of an (H, N, M, M) gradient (forward + backward 2.0 against 3.3 ms at
    H = 4, N = 1024, M = Dv = 16, one CPU thread). Differentiable once, as the fused attention kernels.
    # shape: rows (H, N, M), S (H, Dv, M, M) -> (H, N, Dv)"""

    @staticmethod
    def forward(ctx, rows, S):
        H, N, M = rows.shape
        outer = (rows[..., :, None] * rows[..., None, :]).reshape(H, N, M * M)  # shape: (H, N, M²)
        ctx.save_for_backward(rows, outer, S)
        return outer @ S.reshape(H, -1, M * M).mT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # shape: grad (H, N, Dv)
        rows, outer, S = ctx.saved_tensors
        H, N, M = rows.shape
        grad_rows = grad_S = None
        if ctx.needs_input_grad[0]:
            U = (grad[..., :, None] * rows[..., None, :]).reshape(H, N, -1)  # q̄_td a_tj at [t, (d, j)]
            grad_rows = U @ (S + S.mT).reshape(H, -1, M)  # (S_d + S_dᵀ) is symmetric: rows (d, j), column i
        if ctx.needs_input_grad[1]:
            grad_S = (grad.mT @ outer).view(S.shape)
        return grad_rows, grad_S


class MaskedDecoupledSGPAConditional(DecoupledSGPAConditional):
    """Decoupled SGPA under a per-query mask (docs/derivations.md §11b): query i's mean basis is the keys in
    A_i (the keys it may attend to), the global basis is every query's.

    The γ-part is mean only, so the queries' GPs differ by a deterministic shift of the mean and share
    the random part (q(ũ_g) and the prior's conditional): the joint q(f) keeps the unmasked covariance
    with the masked mean, and ``rsample`` draws jointly as the unmasked conditional does. The
    residual's jitter (``"full"`` samples) is per token, ``jitter`` · K_ii, so that under the causal mask
    no draw depends on a later token. The γ-part of the KL is per query (:meth:`query_kl_divergence`);
    the layer's term is its mean over the real queries (not padding, A_i ≠ ∅), as for ``sgpa``.

    :ivar query_gamma: ½ v_Sᵀ (K_SS − K_Sg K_gg⁻¹ K_gS) v_S per query, S = A_i, or None (no mean basis γ).
        # shape: (B, H, T, Dv) or None
    :ivar real: the queries that count in the KL.  # shape: (B, H, T)
    """

    def __init__(self, *, query_gamma, real, **factors):
        # the layer's γ-part: the mean of the queries' over the real queries (β is unchanged: global)
        weight = real[..., None]  # shape: (B, H, T, 1)
        gamma = when_present(
            lambda g: (g * weight.to(g.dtype)).sum(-2) / weight.to(g.dtype).sum(-2).clamp_min(1), query_gamma
        )
        super().__init__(gamma=gamma, **factors)
        self.query_gamma = query_gamma
        self.real = real

    def query_kl_divergence(self) -> torch.Tensor:
        """The γ-part of each query's KL (0 where A_i = ∅; 0 everywhere without the mean basis γ).
        # shape: -> (B, H, T, Dv)"""
        return add_means(torch.zeros_like(self.mean), self.query_gamma)

    def _jittered_residual(self) -> torch.Tensor:
        """K_qq − Q_qq + diag(``jitter`` · K_ii): per token, so that token i's row of the factor depends on
        tokens ≤ i only.  # shape: -> (B, H, T, T)"""
        return self.residual() + torch.diag_embed(self.jitter * self.gram_diag.detach())


class DecoupledSGPAVariationalStrategy(AmortisedVariationalStrategy):
    r"""Decoupled SGPA (Chen & Li (2023) §3.3; docs/derivations.md §5b) for every head and output dim d at once.

    Two bases per head: the amortised mean basis (the sequence's keys k_a with coefficients the
    values v_a) and M global inducing inputs Z_g ∈ R^{M×D} per head, mapped like tokens through the
    layer's own W_qk for that head (:meth:`global_keys`). With L_g = chol(K_gg + jitter) and
    A = K_qg L_g⁻ᵀ:

    .. math::
        \mu_d &= K_{qa} v_{a,d} - K_{qg} K_{gg}^{-1} K_{ga} v_{a,d} + K_{qg} v_{g,d}
               = K_{qa} v_{a,d} + A (\tilde u_d - L_g^{-1} K_{ga} v_{a,d}), \\
        \Sigma_d &= K_{qq} - K_{qg} K_{gg}^{-1} K_{gq} + (A L_{s,d})(A L_{s,d})^\top,

    with ũ_d = L_gᵀ v_g,d. Cost per (B, H): mean and KL O(T²·(Dh + Dv) + T·M·(Dh + Dv) + M³);
    ``covariance="diag"`` adds O(T·M²·Dv) for the marginal variances A_t S̃_d A_tᵀ (docs/derivations.md §5b's
    "O(T·M·Dv)" holds only for a diagonal S̃; at M = 16 this equals the T²·Dv attention product at
    T = 256); ``"full"`` sampling adds O(T²·M) for the residual and one T×T Cholesky, O(T³/3).

    :param kernel: gpytorch kernel, batch_shape broadcasting against (B, H).
    :param variational_distribution: the global q(ũ_g).
    :param inducing_inputs: initial Z_g.  # shape: (H, M, D)
    :param jitter: relative jitter (see :mod:`gpattn.variational.sgpa`).
    :param covariance: the covariance form (:mod:`gpattn.variational.covariances`).
    :param mean_module: the prior mean (:mod:`gpattn.variational.means`).
    :param variational_mean: q(ũ)'s mean (:class:`~gpattn.variational.means.AmortisedValueMean`, the mean basis γ
        on the sequence, or :class:`~gpattn.variational.means.CentredVariationalMean`, none).
    """

    def __init__(
        self,
        kernel: Kernel,
        variational_distribution: WhitenedGlobalVariationalDistribution,
        inducing_inputs: torch.Tensor,
        *,
        jitter: float,
        covariance,
        mean_module: nn.Module,
        variational_mean,
    ):
        super().__init__()
        if inducing_inputs.dim() != 3 or inducing_inputs.shape[1] != variational_distribution.num_global:
            raise ValueError(
                f"inducing_inputs must have shape (H, M={variational_distribution.num_global}, D), got "
                f"{tuple(inducing_inputs.shape)}"
            )
        self.kernel = kernel
        self.variational_distribution = variational_distribution
        self.inducing_inputs = nn.Parameter(inducing_inputs.clone())  # shape: (H, M, D)
        self.jitter = check_jitter(jitter)
        self.covariance = covariance
        #: the prior mean function (GPyTorch's ``mean_module``; docs/derivations.md §5c);
        #: :class:`~gpattn.variational.means.ZeroMean` is the paper's zero mean
        self.mean_module = mean_module
        mean_module.check_kernel(kernel)  # a mean that cannot read the kernel fails here, not at a forward
        #: q(ũ)'s mean, which brings the mean basis γ through its one interface, ``inducing_values``: the sequence's
        #: values as its coefficients (the paper's, with the zero mean), or None (centred at a prior mean that
        #: attends: no mean basis, no per-sequence KL)
        self.variational_mean = variational_mean

    def global_keys(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """k_g[h] = Z_g[h] W_qk[h]ᵀ + b_qk[h]: each head's global inputs through *that head's* rows of
        W_qk (the released code slices a fused qkv weight wrongly, docs/derivations.md §5b Released code differs (i)).

        # shape: weight (H, Dh, D), bias (H, Dh) or None -> (H, M, Dh)
        """
        Z = self.inducing_inputs
        if weight.dim() != 3 or weight.shape[0] != Z.shape[0] or weight.shape[-1] != Z.shape[-1]:
            raise ValueError(f"weight must have shape (H, Dh, D={Z.shape[-1]}), got {tuple(weight.shape)}")
        keys = Z @ weight.mT  # shape: (H, M, Dh)
        return keys if bias is None else keys + bias[:, None, :]

    def condition(
        self,
        queries: torch.Tensor,
        values: torch.Tensor,
        global_keys: torch.Tensor,
        mask: torch.Tensor | None = None,
        query_inputs: torch.Tensor | None = None,
    ) -> DecoupledSGPAConditional:
        """Factorise once for a batch of sequences (self-attention: the keys k_a are the queries).

        ``mask`` is a key padding mask (B, T) (True = padding) or a per-query mask (B or 1, H or 1, T, T)
        (True = query i may not attend to key j: query i's mean basis is the keys in A_i, a
        :class:`MaskedDecoupledSGPAConditional`; docs/derivations.md §11b). ``query_inputs`` (B, H, T', Dh):
        cross-attention (§13): ``queries`` are the mean basis' keys, q(f) is at ``query_inputs``.

        q(ũ)'s mean reaches the algebra through its one interface (``variational_mean.inducing_values``): the
        coefficients α of the mean basis γ on the keys (the values, Chen & Li's), or None, no mean basis (a q(ũ)
        centred at the prior mean, docs/derivations.md §5c). The mean is m(q) + K_qa α + A (ũ − L_g⁻¹ K_ga α), the
        KL the global part's plus ½ αᵀ (K_aa − K_ag K_gg⁻¹ K_ga) α: the orthogonally decoupled composition of a mean
        basis around the global (covariance) basis, as gpytorch's ``OrthogonallyDecoupledVariationalStrategy``.

        # shape: queries (B, H, T, Dh), values (B, H, T, Dv), global_keys (H, M, Dh), mask (B, T), (B|1, H|1, T, T)
        """
        if query_inputs is not None:
            return self._condition_cross(query_inputs, queries, values, global_keys, mask)
        excluded = causal = None
        if mask is not None and mask.dim() == 4:
            check_sequence_inputs(queries, values, None)
            excluded, mask, causal = split_per_query_mask(mask, *queries.shape[:3])
        check_sequence_inputs(queries, values, mask)
        B, H, T, Dh = queries.shape
        if global_keys.dim() != 3 or global_keys.shape[0] != H or global_keys.shape[-1] != Dh:
            raise ValueError(f"global_keys must have shape (H={H}, M, Dh={Dh}), got {tuple(global_keys.shape)}")
        with gp_algebra(queries.device.type):
            queries, values = full_precision(queries, values)
            if mask is not None:
                values = values.masked_fill(mask[:, None, :, None], 0.0)  # padded keys leave the mean basis
            alpha = self.variational_mean.inducing_values(values)  # shape: (B, H, T, Dv) or None
            if excluded is not None:
                return self._condition_per_query(queries, values, alpha, global_keys, excluded, causal, mask)
            return self._condition_self(queries, values, alpha, global_keys, mask)

    def _condition_self(self, queries, values, alpha, global_keys, mask) -> DecoupledSGPAConditional:
        """Self-attention under key padding: the Gram K_qq where the covariance or the mean basis reads it, else none,
        and m(q) runs without it (docs/derivations.md §12: through fused attention where it runs, evaluated first).
        # shape: queries (B, H, T, Dh), values (B, H, T, Dv), alpha (B, H, T, Dv) or None, mask (B, T) or None"""
        K = self.covariance.query_gram(self.kernel, queries, alpha)  # shape: (B, H, T, T) or None
        fused = None if K is not None else self.mean_module.fused(
            queries, queries, values, kernel=self.kernel, pad=mask
        )
        A, u_tilde = self._global_basis(queries, global_keys)
        factors = self._factors(K, queries, A, u_tilde, mask)
        m = fused if fused is not None else self._self_prior_mean(queries, values, mask, K)
        update = when_present(lambda a: K @ a, alpha)  # K_qa α (padded keys have α = 0)
        shift = when_present(lambda a: A.mT @ a, alpha)  # c = L_g⁻¹ K_ga α: the mean basis' part on the global
        coefficients = add_means(u_tilde, when_present(torch.neg, shift))  # ũ − c
        mean = add_means(m, update, A @ coefficients)
        gamma = when_present(lambda a, Ka, c: 0.5 * ((a * Ka).sum(-2) - c.square().sum(-2)), alpha, update, shift)
        return DecoupledSGPAConditional(mean=mean, gamma=gamma, inducing_values=alpha, proj_values=shift, **factors)

    def _condition_per_query(self, queries, values, alpha, global_keys, excluded, causal, mask):
        """Under a per-query mask query i's mean basis is A_i (docs/derivations.md §11b). With R = K_aa − K_ag K_gg⁻¹
        K_ga (self-attention: q = a), the mean basis' part of the mean Σ_{j∈A_i} R_ij α_j and γ_i = ½ α_Sᵀ R_SS α_S.
        Causal: R.tril() and a prefix sum, O(T²·Dv); any other mask O(T³·Dv) time, O(T²·Dv) memory per (B, H).
        # shape: excluded (B, H, T, T) with padding joined, mask (B, T) or None"""
        K = evaluate_kernel(self.kernel, queries, queries)  # shape: (B, H, T, T)
        A, u_tilde = self._global_basis(queries, global_keys)
        factors = self._factors(K, queries, A, u_tilde, mask)
        m = self.mean_module(queries, queries, values, kernel=self.kernel, excluded=excluded, gram=K)
        R = when_present(lambda a: K - A @ A.mT, alpha)  # shape: (B, H, T, T)
        basis = when_present(lambda a, R: _per_query_basis(R, a, excluded, causal), alpha, R)
        update, quad = when_present(lambda b: b[0], basis), when_present(lambda b: b[1], basis)
        allowed = ~excluded
        real = allowed.any(-1) if mask is None else allowed.any(-1) & ~mask[:, None, :]  # shape: (B, H, T)
        return MaskedDecoupledSGPAConditional(
            mean=add_means(m, update, A @ u_tilde), query_gamma=when_present(lambda q: 0.5 * q, quad), real=real,
            **factors,
        )

    def _condition_cross(self, queries, keys, values, global_keys, mask) -> DecoupledSGPAConditional:
        """Cross-attention (docs/derivations.md §13): the mean basis γ is the context's keys k_a (coefficients α),
        the global basis is the layer's, q(f) is at the queries: mean = m(q) + K_qa α + A_q (ũ − L_g⁻¹ K_ga α), Σ as
        §5b at the queries, γ-part ½ αᵀ (K_aa − K_ag K_gg⁻¹ K_ga) α. The global basis is taken at the queries and
        the mean basis' keys at once (one L_g for both).
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv), mask (B, S) or None"""
        check_sequence_inputs(keys, values, mask)
        check_query_inputs(queries, keys)
        with gp_algebra(keys.device.type):
            queries, keys, values = full_precision(queries, keys, values)
            if mask is not None:
                values = values.masked_fill(mask[:, None, :, None], 0.0)  # padded keys leave the mean basis
            alpha = self.variational_mean.inducing_values(values)  # shape: (B, H, S, Dv) or None
            T = queries.shape[-2]
            points = queries if alpha is None else torch.cat([queries, keys], -2)  # the queries and the basis' keys
            both, u_tilde = self._global_basis(points, global_keys)
            A, A_a = both.split([T, both.shape[-2] - T], -2)  # shape: (B, H, T, M), (B, H, S or 0, M)
            factors = self._cross_factors(queries, A, u_tilde)
            K_qa = when_present(lambda a: evaluate_kernel(self.kernel, queries, keys), alpha)  # shape: (B, H, T, S)
            shift = when_present(lambda a: A_a.mT @ a, alpha)  # shape: (B, H, M, Dv); c = L_g⁻¹ K_ga α
            Kaa_a = when_present(lambda a: evaluate_kernel(self.kernel, keys, keys) @ a, alpha)  # K_aa α, for γ
            update = when_present(lambda K, a: K @ a, K_qa, alpha)  # K_qa α
            coefficients = add_means(u_tilde, when_present(torch.neg, shift))  # ũ − c
            m = self._cross_prior_mean(queries, keys, values, mask)
            mean = add_means(m, update, A @ coefficients)
            gamma = when_present(lambda a, Ka, c: 0.5 * ((a * Ka).sum(-2) - c.square().sum(-2)), alpha, Kaa_a, shift)
            return DecoupledSGPAConditional(
                mean=mean, gamma=gamma, inducing_values=alpha, proj_values=shift, **factors
            )

    def _factors(self, gram, queries, A, u_tilde, mask) -> dict:
        """The factors of a self-attention conditional: the Gram (or None), its diagonal, the global basis, ũ."""
        return dict(
            gram=gram, gram_diag=evaluate_kernel(self.kernel, queries, queries, diag=True), interp=A,
            whitened_values=u_tilde, scale_tril=self.variational_distribution.scale_tril(), mask=mask,
            jitter=self.jitter, covariance=self.covariance,
        )

    def _cross_factors(self, queries, A, u_tilde) -> dict:
        """The factors of a cross-attention conditional: the Gram at the queries where the covariance form reads it,
        its diagonal, the global basis A_q and ũ."""
        return self._factors(self.covariance.query_gram(self.kernel, queries), queries, A, u_tilde, None)

    def _cross_prior_mean(self, queries, keys, values, mask) -> torch.Tensor:
        """m(q) over the context's keys: through fused attention where it runs (no (T, S) matrix; key padding
        only, docs/derivations.md §12), else from the kernel's (T, S) block (the attention mean) or the dense
        softmax (the softmax mean).  # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), mask (B, S) or None"""
        fused = self.mean_module.fused(queries, keys, values, kernel=self.kernel, pad=mask)
        if fused is not None:
            return fused
        pad = None if mask is None else mask[:, None, None, :]
        # a mean that reads the Gram κ(q, k) evaluates its (T, S) block from the kernel inputs (gram=None)
        return self.mean_module(queries, keys, values, kernel=self.kernel, excluded=pad)

    def _global_basis(self, queries: torch.Tensor, global_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, ũ)``: A = K_qg L_g⁻ᵀ (L_g = chol(K_gg + jitter)) and ũ = L_gᵀ u, the whitened global basis.
        # shape: queries (B, H, T, Dh), global_keys (H, M, Dh) -> A (B, H, T, M), ũ (H, M, Dv)"""
        K_gg = evaluate_kernel(self.kernel, global_keys, global_keys)  # shape: (H, M, M)
        jit = relative_jitter(K_gg.diagonal(dim1=-2, dim2=-1), self.jitter)  # shape: (H, 1, 1)
        L_g = cholesky(add_jitter(K_gg, jit[..., 0, 0]), name="sgpa-decoupled (K_gg)")  # shape: (H, M, M)
        K_qg = evaluate_kernel(self.kernel, queries, global_keys.expand(queries.shape[0], *global_keys.shape))
        A = tri_solve(L_g.mT, K_qg, upper=True, left=False)  # shape: (B, H, T, M); A L_gᵀ = K_qg
        return A, L_g.mT @ self.variational_distribution.inducing_values

    def _attention_mean_rows(self, queries, keys, values, pad=None) -> torch.Tensor:
        """The prior mean m(q) of one block of queries.  # shape: queries (B, H, b, Dh) -> (B, H, b, Dv)"""
        with gp_algebra(queries.device.type):
            return self.mean_module(queries, keys, values, kernel=self.kernel, excluded=pad)

    def _self_prior_mean(self, queries, values, mask, gram) -> torch.Tensor | None:
        """The prior mean m(q) of self-attention over the real keys (None for the zero mean; docs/derivations.md §5c):
        from the Gram where it was formed, else (no fused path, §12) in blocks of queries for a long sequence, else
        from the Gram the mean evaluates itself.
        # shape: queries (B, H, T, Dh), values (B, H, T, Dv), mask (B, T) or None, gram (B, H, T, T) or None
        # -> (B, H, T, Dv) or None"""
        pad = None if mask is None else mask[:, None, None, :]
        rows = None if gram is not None else block_rows(*queries.shape[:3], queries.shape[-2], device=queries.device)
        if rows is None:
            return self.mean_module(queries, queries, values, kernel=self.kernel, excluded=pad, gram=gram)
        # the mean forms several block-sized temporaries
        return blockwise(self._attention_mean_rows, queries, queries, values, rows=max(1, rows // 4), per_query=(pad,))


def _per_query_basis(R, alpha, excluded, causal) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean basis' part of each query's mean, Σ_{j∈A_i} R_ij α_j, and 2γ_i = α_Sᵀ R_SS α_S (S = A_i), for a
    per-query mask (docs/derivations.md §11b).  # shape: R (B, H, T, T), alpha (B, H, T, Dv), excluded (B, H, T, T)
    -> (B, H, T, Dv) twice"""
    if causal:
        Ra = R.tril() @ alpha  # shape: (B, H, T, Dv); Σ_{j≤i} R_ij α_j
        diag = R.diagonal(dim1=-2, dim2=-1)[..., None]  # shape: (B, H, T, 1)
        # α_{≤i}ᵀ R_{≤i} α_{≤i} as a prefix sum of α_j (2 Σ_{k<j} R_jk α_k + R_jj α_j)
        return Ra, (alpha * (2 * Ra - diag * alpha)).cumsum(-2)
    w = (~excluded)[..., None] * alpha[:, :, None]  # shape: (B, H, T, T, Dv): α_S per query, 0 elsewhere
    return R.masked_fill(excluded, 0.0) @ alpha, (w * (R[:, :, None] @ w)).sum(-2)
