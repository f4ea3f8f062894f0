r"""KEP-SVGP: kernel-eigen pair sparse variational GPs for self-attention (docs/derivations.md §6).

Chen et al. (2024) (Chen, Tao, Tonin, Suykens, ICML 2024). The paper text available to us lost its
formulas; docs/derivations.md §6 is the reconstruction followed here, written as the textbook
per-output SVGP. Everything in this file is per head; shapes use the GLOSSARY symbols (r = KEP rank,
s = landmark tokens).

Pieces, kept apart as in GPyTorch (q(u) parameterisation vs the q(u) → q(f) map):

* :func:`cosine_features`, :func:`landmark_indices`, :class:`KSVDProjection` — the primal KSVD
  projections :math:`e = \phi(q) W_e`, :math:`r = \phi(k) W_r` with :math:`W = \tilde X \omega`, the
  singular values :math:`\Lambda` and the KSVD objective :func:`ksvd_objective` (Chen et al. (2024) eqs. 10–11,
  Primal-Attention).
* :class:`KEPVariationalDistribution` — :math:`q(u_c) = N(m_c, L_c L_c^\top)`, c = 1..r, per head, and
  :func:`kep_kl_divergence` against the prior :math:`N(0, \Lambda^2)` (Chen et al. (2024) eq. 21).
* :func:`kep_mean`, :func:`kep_sample`, :func:`kep_posterior` — the q(u) → q(f) map (Chen et al. (2024) eqs.
  16–18) followed by the linear output map r → Dv, on merged features ``a = G Λ⁻¹`` (eq. 19).
* :class:`KEPSoftmaxMean` — the optional prior mean of the output: softmax attention over values of the layer's
  own (docs/derivations.md §6, "The softmax prior mean"; the mean path of an encoder swap).
* :class:`KEPSVGP` — the strategy that owns the parameters and composes the above; its
  :meth:`KEPSVGP.condition` returns a :class:`KEPConditional`; the attention layer
  ``gpattn.attention.kep_svgp`` is a declaration on the generic GP shim.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpytorch.distributions import MultivariateNormal
from gpytorch.variational import CholeskyVariationalDistribution
from linear_operator.operators import (
    ConstantDiagLinearOperator,
    DiagLinearOperator,
    LowRankRootLinearOperator,
)

from gpattn.objectives import GlobalKL, KSVDLoss
from gpattn.variational._linalg import (
    LowRankPlusDiagLinearOperator,
    cholesky,
    full_precision,
    gp_algebra,
    matmul_samples,
    safe_sqrt,
    standard_normal,
    with_policy,
)
from gpattn.variational._scale import KEP_COVARIANCE_STD, KEP_MEAN_STD
from gpattn.variational._strategy import AmortisedConditional, AmortisedVariationalStrategy
from gpattn.variational.means import KEPSoftmaxMean, add_means

__all__ = [
    "KEPSVGP",
    "KEPConditional",
    "KEPSoftmaxMean",
    "KEPVariationalDistribution",
    "KSVDProjection",
    "cosine_features",
    "kep_kl_divergence",
    "kep_mean",
    "kep_posterior",
    "kep_sample",
    "ksvd_objective",
    "landmark_indices",
    "residual_root",
]

MERGES = ("add", "concat")


# ---------------------------------------------------------------------------------------- features
def cosine_features(t: torch.Tensor) -> torch.Tensor:
    r"""Cosine-similarity feature map of Primal-Attention, :math:`\phi(t) = t / \lVert t \rVert`.

    A zero row stays zero.  # shape: (..., Dh) -> (..., Dh)
    """
    return F.normalize(t, p=2, dim=-1)


def _inv_norm(t: torch.Tensor) -> torch.Tensor:
    """1 / ‖t‖ over the last axis, with F.normalize's floor (‖t‖ ≥ 1e-12).  # shape: (..., Dh) -> (..., 1)

    Written as rsqrt of a sum of squares: its backward is a few elementwise passes, cheaper than
    ``vector_norm``'s (its backward was the largest KEP-specific cost: docs/benchmarks.md)."""
    return t.pow(2).sum(-1, keepdim=True).clamp_min(1e-24).rsqrt()


def landmark_indices(
    num_tokens: int, num_landmarks: int, mask: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    r"""Token positions of the s landmarks of every sequence: s evenly spaced *real* tokens.

    With n real tokens (in their original order), landmark j = 0..s-1 is the real token number
    :math:`\lfloor j (n-1) / (s-1) \rfloor` (integer arithmetic, so the first and last real tokens are
    always landmarks). This is the released "evenly sample" rule made padding-aware: padded tokens are
    never landmarks, whatever their position. When n < s, real tokens repeat (a repeated column of
    :math:`\tilde X` is harmless: :math:`W = \tilde X \omega` just sums their weights), so any T ≥ 1
    works. Returns ``(1, s)`` without a mask (the same positions for every row) or ``(B, s)``.

    # shape: mask (B, T) bool (True = padding) or None -> (B or 1, s) int64
    """
    j = torch.arange(num_landmarks, device=device if mask is None else mask.device)  # shape: (s,)
    denom = max(num_landmarks - 1, 1)
    if mask is None:
        return ((j * (num_tokens - 1)) // denom)[None]
    n_real = (~mask).sum(-1, keepdim=True)  # shape: (B, 1)
    rank_of_landmark = (j[None] * (n_real - 1).clamp_min(0)) // denom  # shape: (B, s)
    real_first = torch.argsort(mask.to(torch.int8), dim=-1, stable=True)  # real positions first, in order
    return real_first.gather(1, rank_of_landmark)


def ksvd_objective(
    e: torch.Tensor,
    r: torch.Tensor,
    lam: torch.Tensor,
    omega_e: torch.Tensor,
    omega_r: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""The released KSVD objective J (docs/derivations.md §6; the layer's ``ksvd`` loss term is :math:`J^2`).

    .. math::
        J = \tfrac12 \operatorname{mean}_{b,h,t} \lVert e_t \Lambda^{-1/2} \rVert^2
          + \tfrac12 \operatorname{mean}_{b,h,t} \lVert r_t \Lambda^{-1/2} \rVert^2
          - \operatorname{mean}_h \operatorname{tr}(\omega_{e,h}^\top \omega_{r,h}),

    the means over real tokens only. Relation to the primal KSVD problem of Primal-Attention
    (Chen et al. (2024) eq. 11 / App. C eq. 37), per head and sequence with n real tokens,
    :math:`J_{primal} = \tfrac12 \sum_t e_t^\top \Lambda^{-1} e_t + \tfrac12 \sum_t r_t^\top \Lambda^{-1} r_t
    - \operatorname{tr}(W_e^\top W_r)`, which is 0 at its stationary point (the SVD
    :math:`K = \Phi_q \Phi_k^\top = U \Sigma V^\top`, :math:`W_e = \Phi_k^\top V`, :math:`W_r = \Phi_q^\top U`,
    so :math:`e = U\Sigma`, :math:`r = V\Sigma`, :math:`\Lambda = \Sigma`: each sum is ½ tr Σ and
    :math:`\operatorname{tr}(W_e^\top W_r) = \operatorname{tr}(V^\top K^\top U) = \operatorname{tr}\Sigma`):
    J replaces :math:`\operatorname{tr}(W_e^\top W_r)/n = \operatorname{tr}(\omega_e^\top \tilde X^\top
    \tilde X \omega_r)/n` by :math:`\operatorname{tr}(\omega_e^\top \omega_r)`, so
    :math:`J = J_{primal}/n` exactly when the landmarks satisfy :math:`\tilde X^\top \tilde X = n I_s`,
    and J = 0 at that stationary point. Otherwise J is the released surrogate, driven to 0 by
    penalising :math:`J^2`.

    # shape: e, r (B, H, T, r), lam (H, r), omega_e, omega_r (H, s, r), mask (B, T) or None -> ()
    """
    inv_lam = lam.reciprocal()[:, None, :]  # shape: (H, 1, r)
    sq = 0.5 * ((e.pow(2) + r.pow(2)) * inv_lam).sum(-1)  # shape: (B, H, T): ½‖eΛ^{-1/2}‖² + ½‖rΛ^{-1/2}‖²
    if mask is None:
        mean_sq = sq.mean()
    else:
        real = (~mask)[:, None, :].to(sq.dtype)  # shape: (B, 1, T)
        mean_sq = (sq * real).sum() / (real.sum() * sq.shape[1]).clamp_min(1)
    trace = (omega_e * omega_r).sum((-2, -1)).mean()  # mean_h tr(ω_eᵀ ω_r)
    return mean_sq - trace


class KSVDProjection(nn.Module):
    r"""Primal KSVD projections of one attention layer (Chen et al. (2024) eq. 10; Primal-Attention).

    .. math::
        e(x_i) = \phi(q_i)^\top W_e,\quad r(x_j) = \phi(k_j)^\top W_r,\quad
        W_e = \tilde X \omega_e,\ W_r = \tilde X \omega_r \in \mathbb R^{D_h\times r},

    :math:`\tilde X \in \mathbb R^{D_h \times s}` the s landmark tokens (:func:`landmark_indices`) of
    the head-sliced layer input, :math:`\omega_e, \omega_r \in \mathbb R^{s\times r}` per head
    (orthogonal init, per head, with :math:`\omega_r = \omega_e`), :math:`\Lambda =
    \operatorname{diag}(\exp \log\lambda) > 0` the top-r singular values (log-parameterised; init
    :math:`\Lambda = I`, so that J starts near 0 on LayerNorm-ed inputs — the released
    :math:`\Lambda^{-1/2} = e^{p}, p \sim U(0, 1)` with independent ω's starts at J ≈ 29, whose
    :math:`\eta J^2` dominated the first epoch; :mod:`gpattn.variational._scale`).
    """

    def __init__(self, num_heads: int, head_dim: int, rank: int, num_landmarks: int):
        super().__init__()
        self.num_heads, self.head_dim, self.rank, self.num_landmarks = num_heads, head_dim, rank, num_landmarks
        self.omega_e = nn.Parameter(torch.empty(num_heads, num_landmarks, rank))
        self.omega_r = nn.Parameter(torch.empty(num_heads, num_landmarks, rank))
        self.log_lambda = nn.Parameter(torch.empty(num_heads, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for h in range(self.num_heads):  # orthogonal per head (not over the flattened (H, s·r) tensor)
                nn.init.orthogonal_(self.omega_e[h])
            # ω_r = ω_e and Λ = I: J starts near its stationary value 0 (gpattn.variational._scale)
            self.omega_r.copy_(self.omega_e)
            self.log_lambda.zero_()

    @property
    def lam(self) -> torch.Tensor:
        """Λ, the positive singular values.  # shape: (H, r)"""
        return self.log_lambda.exp()

    def primal_weights(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """W_e, W_r from the landmarks of x.  # shape: x (B, T, H·Dh) -> each (B, H, Dh, r)"""
        return self._stacked_weights(x, mask).unbind(0)

    def _stacked_weights(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[W_e; W_r] = X̃ [ω_e; ω_r] in one product.  # shape: x (B, T, H·Dh) -> (2, B, H, Dh, r)"""
        B, T, _ = x.shape
        idx = landmark_indices(T, self.num_landmarks, mask, device=x.device)  # shape: (B or 1, s)
        if idx.shape[0] == 1:
            lm = x[:, idx[0]]  # shape: (B, s, H·Dh)
        else:
            lm = x.gather(1, idx[..., None].expand(B, self.num_landmarks, x.shape[-1]))
        lm = lm.view(B, self.num_landmarks, self.num_heads, self.head_dim)  # shape: (B, s, H, Dh) = X̃ᵀ
        return torch.einsum("bshd,ghsr->gbhdr", lm, torch.stack([self.omega_e, self.omega_r]))

    def forward(self, x, q, k, mask=None):
        """# shape: x (B, T, H·Dh), q, k (B, H, T, Dh) -> e, r (B, H, T, r), W_e, W_r (B, H, Dh, r)

        The two branches run as one: q and k stacked (the one copy that their products would each make of the
        head views), one product with [W_e; W_r], one normalisation."""
        W = self._stacked_weights(x, mask)  # shape: (2, B, H, Dh, r)
        qk = torch.stack([q, k])  # shape: (2, B, H, T, Dh)
        # φ(q) W_e = (q W_e) / ‖q‖: normalise the r-wide product instead of the Dh-wide input (same value)
        e, r = ((qk @ W) * _inv_norm(qk)).unbind(0)
        return e, r, W[0], W[1]

    def objective(self, e, r, mask=None) -> torch.Tensor:
        """The KSVD objective J of :func:`ksvd_objective` with this layer's Λ and ω."""
        return ksvd_objective(e, r, self.lam, self.omega_e, self.omega_r, mask)


# --------------------------------------------------------------------------------------- q(u_c)
class KEPVariationalDistribution(CholeskyVariationalDistribution):
    r""":math:`q(u_c) = N(m_c, S_c = L_c L_c^\top)` for the r output GPs c = 1..r of every head (Chen et al. (2024)
    eq. 17), shared by the e- and r-branches: gpytorch's ``CholeskyVariationalDistribution`` with batch
    shape ``(H, r_c)`` over the r inducing *features* (the kernel-eigen features), prior
    :math:`N(0, \Lambda^2)`.

    ``variational_mean[h, c]`` is :math:`m_c`; :math:`L_c` is the lower triangle of
    ``chol_variational_covar[h, c]`` (gpytorch's parameterisation: the diagonal is not constrained,
    :math:`\log|S_c|` uses its absolute values). Init: :math:`m_c \sim N(0, 0.1^2 I)`, :math:`L_c = 0.1 I`
    (:mod:`gpattn.variational._scale`: the released :math:`m_c \sim N(0, I)`, :math:`L_c = I/2` made the
    layer's output 5× its input; the measured trade-off of :math:`L_c` is stated there).
    """

    def __init__(self, num_heads: int, rank: int):
        super().__init__(rank, batch_shape=torch.Size([num_heads, rank]))
        self.num_heads, self.rank = num_heads, rank
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            # near-deterministic start on the stream's scale (gpattn.variational._scale)
            self.variational_mean.normal_(0.0, KEP_MEAN_STD)
            self.chol_variational_covar.copy_(KEP_COVARIANCE_STD * torch.eye(self.rank))

    @property
    def chol(self) -> torch.Tensor:
        """L_c, lower triangular.  # shape: (H, r_c, r, r)"""
        return self.chol_variational_covar.tril()


def kep_kl_divergence(lam: torch.Tensor, m: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_{h,c} KL(N(m_c, L_c L_c^\top) \,\|\, N(0, \Lambda^2))`
    (Chen et al. (2024) eq. 21, docs/derivations.md §6):

    .. math::
        \tfrac12 \sum_c \big[\operatorname{tr}(\Lambda^{-2} S_c) + m_c^\top \Lambda^{-2} m_c - r
        + \log|\Lambda^2| - \log|S_c|\big],

    with :math:`\operatorname{tr}(\Lambda^{-2} L_c L_c^\top) + m_c^\top \Lambda^{-2} m_c = \sum_j \lambda_j^{-2}
    (\lVert L_{c,j\cdot} \rVert^2 + m_{c,j}^2)` and :math:`\log|\Lambda^2| - \log|S_c| = 2 \sum_j \log(\lambda_j /
    |L_{c,jj}|)` — only the diagonal Λ is inverted; summed over (h, c) in one reduction each. A *global* term
    (the objective divides it by N). ``lam`` is the prior's standard deviation per feature: Λ in the paper's
    form, σΛ with the kernel's outputscale σ² (:class:`KEPSVGP` ``prior_variance``).

    # shape: lam (H, r), m (H, r_c, r), L (H, r_c, r, r) -> ()
    """
    rows = L.pow(2).sum(-1) + m.pow(2)  # shape: (H, r_c, r): ‖L_{c,j·}‖² + m_{c,j}²
    quad = (rows * lam.pow(-2)[:, None, :]).sum()  # Σ_{h,c} tr(Λ⁻² S_c) + m_cᵀ Λ⁻² m_c
    # ½ Σ_{h,c} (log|Λ²| − log|S_c|)
    log_ratio = (lam.log()[:, None, :] - torch.diagonal(L, dim1=-2, dim2=-1).abs().log()).sum()
    return 0.5 * (quad - m.numel()) + log_ratio  # m.numel() = H·r_c·r: the Σ_{h,c} r


# ------------------------------------------------------------------------------- q(u) -> q(f)
def kep_mean(a: torch.Tensor, m: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    r"""Posterior mean of the head output, :math:`(a\, M^\top) W + b` with :math:`a = G \Lambda^{-1}`
    (G the merged features), :math:`M^\top = [m_1 \dots m_r]` — i.e. :math:`e\Lambda^{-1} m_c` per output c.

    # shape: a (B, H, T, r), m (H, r_c, r), weight (H, r_c, Dv), bias (H, Dv) -> (B, H, T, Dv)
    """
    return a @ (m.mT @ weight) + bias[:, None, :]


def kep_sample(
    a: torch.Tensor,
    m: torch.Tensor,
    L: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    token_independent: bool = False,
    residual: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    num_samples: int | None = None,
) -> torch.Tensor:
    r"""One reparameterised sample of the head output (Chen et al. (2024) eq. 18, docs/derivations.md §6),
    or ``num_samples`` independent samples on a leading axis (the features ``a`` computed once).

    Exact (default): :math:`f_c = a (m_c + L_c \varepsilon_c)`, :math:`\varepsilon_c \sim N(0, I_r)`
    shared by the T tokens — the exact low-rank root :math:`a L_c`, O(T·r²); then :math:`F W + b`.
    ``token_independent=True`` (the released scheme): one :math:`\varepsilon_{t,c}` per token, so the
    per-token marginals :math:`N(a_t m_c, a_t S_c a_t^\top)` are the exact ones but tokens are
    independent given the inputs. ``residual`` (``include_residual=True``): a root R of the
    :math:`K_{ff} - Q_{ff}` term shared by the r outputs, drawn independently per output (and per
    token in the token-independent mode).

    # shape: a (B, H, T, r), m (H, r_c, r), L (H, r_c, r, r), weight (H, r_c, Dv), bias (H, Dv),
    #        residual (B, H, T, q) or None -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P
    """
    B, H, T, r = a.shape
    rc = m.shape[-2]

    def randn(*shape):
        return standard_normal(shape, a, num_samples, generator)

    if not token_independent:
        eps = randn(B, H, rc, r)  # one ε_c ∈ R^r per (b, h, c), shared by the tokens
        u = m + (L @ eps[..., None])[..., 0]  # shape: (B, H, r_c, r): u_c = m_c + L_c ε_c
        if residual is None:  # (a uᵀ) W + b = a (uᵀ W) + b: one T-sized product
            return matmul_samples(a, u.mT @ weight) + bias[:, None, :]
        noise = matmul_samples(residual, randn(B, H, residual.shape[-1], rc))
        f = matmul_samples(a, u.mT) + noise  # shape: ([P,] B, H, T, r_c)
    else:
        eps = randn(B, H, T, rc, r)  # one ε per (b, h, t, c)
        noise = (a[..., None, :] * (L[:, None] @ eps[..., None])[..., 0]).sum(-1)  # shape: (B, H, T, r_c): a_t L_c ε
        f = a @ m.mT + noise
        if residual is not None:
            eps_res = randn(B, H, T, rc, residual.shape[-1])
            f = f + (residual[..., None, :] * eps_res).sum(-1)
    return f @ weight + bias[:, None, :]


def kep_posterior(
    a: torch.Tensor,
    m: torch.Tensor,
    L: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    jitter: float = 0.0,
    name: str = "kep-svgp",
) -> MultivariateNormal:
    r"""Exact posterior of the head output after the linear map r → Dv (docs/derivations.md §6).

    Output column d is :math:`y_d = \sum_c W_{cd} f_c + b_d` with independent
    :math:`f_c = a u_c`, :math:`u_c \sim N(m_c, S_c)`, so

    .. math::
        \mu_d = a M^\top W_{:d} + b_d,\qquad
        \Sigma_d = a\, C_d\, a^\top + \lVert W_{:d}\rVert^2 R R^\top + \text{jitter}\, I,\quad
        C_d = \sum_c W_{cd}^2\, L_c L_c^\top,

    returned as a ``MultivariateNormal`` (batch (B, H, Dv), event T) whose covariance is the low-rank
    root :math:`[a\, \mathrm{chol}(C_d),\ \lVert W_{:d}\rVert R]` (``LowRankRootLinearOperator``; with
    ``jitter > 0`` a ``LowRankPlusDiagLinearOperator`` adding the constant diagonal, factorised through
    the whitened root so that the jitter, far below the low-rank eigenvalues, costs no precision):
    nothing T×T is formed, and every solve, log-determinant and root is exact at any T. :math:`C_d` is
    r×r and depends on parameters only; its Cholesky goes through the numerics policy's :func:`cholesky`.

    # shape: a (B, H, T, r), m (H, r_c, r), L (H, r_c, r, r), weight (H, r_c, Dv), bias (H, Dv),
    #        residual (B, H, T, q) or None -> MultivariateNormal batch (B, H, Dv), event T
    """
    mean = kep_mean(a, m, weight, bias).mT  # shape: (B, H, Dv, T)
    S = L @ L.mT  # shape: (H, r_c, r, r)
    C = torch.einsum("hcd,hcjk->hdjk", weight.pow(2), S)  # shape: (H, Dv, r, r)
    root = a[:, :, None] @ cholesky(C, name=name)[None]  # shape: (B, H, Dv, T, r)
    if residual is not None:
        scale = weight.pow(2).sum(-2).sqrt()  # shape: (H, Dv): ‖W_{:d}‖
        res = scale[None, :, :, None, None] * residual[:, :, None]  # shape: (B, H, Dv, T, q)
        root = torch.cat([root, res], dim=-1)
    covar = LowRankRootLinearOperator(root)
    if jitter > 0:
        # rank ≤ r (+ q) plus a jitter far below its eigenvalues: factorised through the whitened root
        # (LowRankPlusDiagLinearOperator), whose solves do not cancel as the Woodbury difference does
        diag = torch.full((*mean.shape[:-1], 1), jitter, dtype=a.dtype, device=a.device)
        covar = LowRankPlusDiagLinearOperator(covar, ConstantDiagLinearOperator(diag, diag_shape=a.shape[-2]))
    return MultivariateNormal(mean, with_policy(covar))


def residual_root(phi_q: torch.Tensor, phi_k: torch.Tensor, W: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    r"""Root of the dropped SVGP term :math:`K_{ff} - Q_{ff}` of one branch (``include_residual=True``).

    For the e-branch the prior kernel is :math:`\kappa_e = \kappa\kappa^\top` over the sequence's real
    keys, :math:`K_{ff} = \Phi_q \Phi_k^\top \Phi_k \Phi_q^\top`, and :math:`Q_{ff} = K_{fu}K_{uu}^{-1}K_{uf}
    = (e\Lambda)\Lambda^{-2}(\Lambda e^\top) = e e^\top = \Phi_q W_e W_e^\top \Phi_q^\top`, so the
    residual is :math:`\Phi_q (\Phi_k^\top \Phi_k - W_e W_e^\top) \Phi_q^\top` — a Dh×Dh middle matrix,
    never T×T. (r-branch: swap q and k.) It is PSD at the KSVD stationary point; elsewhere its negative
    eigen-directions are clamped at 0 (the variance-clamping rule) through ``torch.linalg.eigh`` of the
    Dh×Dh middle matrix — gradients through eigh are unstable for (near-)repeated eigenvalues, which is
    why this opt-in term is off by default (Chen et al. (2024) Remark 3.1 drops it).

    # shape: phi_q (B, H, T, Dh) (the branch's own features), phi_k (B, H, T, Dh) (the other side),
    #        W (B, H, Dh, r), mask (B, T) or None -> (B, H, T, Dh)
    """
    if mask is not None:
        phi_k = phi_k.masked_fill(mask[:, None, :, None], 0.0)  # only real keys enter κ κᵀ
    middle = phi_k.mT @ phi_k - W @ W.mT  # shape: (B, H, Dh, Dh)
    evals, evecs = torch.linalg.eigh(0.5 * (middle + middle.mT))
    return phi_q @ (evecs * safe_sqrt(evals)[..., None, :])


# ------------------------------------------------------------------------------------ the layer
def _as_given(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The features read the layer's tensors, with their gradient (Chen et al.'s)."""
    return tensors


def _detached(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The features read the layer's tensors without their gradient (docs/derivations.md §6)."""
    return tuple(t.detach() for t in tensors)


class KEPSVGP(AmortisedVariationalStrategy):
    r"""Kernel-eigen pair SVGP attention of one layer (Chen et al. (2024) §4, eqs. 16–21; docs/derivations.md §6).

    Per head, with the KSVD projections :math:`e = \phi(q) W_e`, :math:`r = \phi(k) W_r` and singular
    values :math:`\Lambda` (:class:`KSVDProjection`), the two SVGPs of the kernel pair
    :math:`\kappa_e = \kappa\kappa^\top`, :math:`\kappa_r = \kappa^\top\kappa` (eigenvalues
    :math:`\Lambda^2`, eigen-features e, r; eqs. 12–15) have, with inducing *features*,

    .. math::
        K_{uu} = \Lambda^2,\quad K_{fu} = e\Lambda,\quad
        f_{e,c} \sim N(e\Lambda^{-1} m_c,\ e\Lambda^{-1} S_c \Lambda^{-1} e^\top)

    (and the same with r), for every output c = 1..r, :math:`q(u_c) = N(m_c, S_c)` shared by the two
    branches (:class:`KEPVariationalDistribution`). Merge (eq. 19):

    * ``merge="add"`` — :math:`F = f_e + f_r`. **Choice**: the two branches are evaluated at the *same*
      draw of :math:`u_c` (one inducing variable per output, as the released code's
      :math:`(e + r)\Lambda^{-1}(m + L\varepsilon)`), so :math:`F_c = G\Lambda^{-1}u_c` with
      :math:`G = e + r`. Variable T.
    * ``merge="concat"`` — :math:`[f_e; f_r]` (2T tokens) followed by a learned map 2T → T,
      :math:`A = [A_e\ A_r] \in \mathbb R^{T\times 2T}` (no bias; the r → Dv map has one), so
      :math:`G = A_e e + A_r r` with padded rows of e, r zeroed first. Fixed ``seq_len``; O(T²·r)
      for the map, as the released layer.

    Then the linear map r → Dv per head (weight ``(H, r, Dv)``, bias ``(H, Dv)``); the shim applies
    :math:`W_o`. Because that map is linear, the posterior of the head output is exact
    (:func:`kep_posterior`). With ``include_residual=True`` the :math:`K_{ff} - Q_{ff}` term that Chen et al. (2024)
    Remark 3.1 drops is added back (:func:`residual_root`), independently per branch and output.

    Cost per head: O(T·Dh·r + T·r²) (+ O(T²·r) for concat, O(T·Dh²) for the residual) — linear in T.

    The strategy of the protocol (:mod:`gpattn.variational._strategy`): :meth:`condition` computes the
    features of a batch once and returns a :class:`KEPConditional` (mean, samples, posterior, the KL and
    the ``kl_global`` / ``ksvd`` loss terms); ``jitter`` is the constant diagonal of the posterior it
    returns (samples and means never include it). ``feature_gradient=False`` computes the features from x, q and k
    without their gradient (docs/derivations.md §6, "The features' gradient").

    **Released code differs** (released ``kep_svgp.py``): its sampler and KL trace permute L's output and inducing
    indices (``permute(0,1,4,2,3)``), an undimensioned squeeze breaks B = 1 / H = 1 / T = 1, and padded tokens are
    landmarks. Here: the per-output SVGP above, explicit reshapes, landmarks from real tokens only.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        value_dim: int,
        *,
        rank: int,
        num_landmarks: int,
        merge: str,
        seq_len: int | None,
        jitter: float,
        prior_variance: float,
        mean_module: nn.Module,
        token_independent: bool = False,
        include_residual: bool = False,
        feature_gradient: bool = True,
    ):
        super().__init__()
        self.jitter = jitter
        #: the prior mean of the head output (:mod:`gpattn.variational.means`; the layer default: softmax)
        self.mean_module = mean_module
        # σ², the kernel's outputscale: p(u_c) = N(0, σ²Λ²); a buffer, so that scale_prior is saved with the model
        self.register_buffer("prior_variance", torch.tensor(float(prior_variance)))
        self.num_heads, self.head_dim, self.value_dim, self.rank = num_heads, head_dim, value_dim, rank
        self.merge, self.seq_len = merge, seq_len
        self.token_independent, self.include_residual = token_independent, include_residual
        #: what the features read of (x, q, k): the tensors themselves, or the tensors without their gradient
        #: (docs/derivations.md §6, "The features' gradient"); chosen once here, not tested per forward
        self.feature_gradient = feature_gradient
        self._feature_inputs = _as_given if feature_gradient else _detached
        self.ksvd = KSVDProjection(num_heads, head_dim, rank, num_landmarks)
        self.variational_distribution = KEPVariationalDistribution(num_heads, rank)
        self.out_weight = nn.Parameter(torch.empty(num_heads, rank, value_dim))  # shape: (H, r, Dv)
        self.out_bias = nn.Parameter(torch.empty(num_heads, value_dim))  # shape: (H, Dv)
        if merge == "concat":
            self.token_weight = nn.Parameter(torch.empty(seq_len, 2 * seq_len))  # shape: (T, 2T) = [A_e A_r]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.rank)  # nn.Linear's default init, per head
        with torch.no_grad():
            self.out_weight.uniform_(-bound, bound)
            self.out_bias.uniform_(-bound, bound)
            # a prior mean that attends: the GP's mean starts at 0 on top of it (the zero mean keeps the paper's draw)
            self.mean_module.start_on_mean(self.variational_distribution.variational_mean, self.out_bias)
            if self.merge == "concat":
                b = 1.0 / math.sqrt(2 * self.seq_len)
                self.token_weight.uniform_(-b, b)

    # ---------------------------------------------------------------- pieces
    def _scale_prior(self, factor: float) -> None:
        """σ² ← factor · σ² and q(u_c) with it, (m_c, L_c) ← √factor · (m_c, L_c): the GP's output f = a u scaled by
        √factor in distribution, prior and posterior alike, the KL unchanged and the mean map a = GΛ⁻¹ as it is
        (docs/derivations.md §6, "The noise on another stream")."""
        q_u = self.variational_distribution
        with torch.no_grad():
            self.prior_variance.mul_(factor)
            q_u.variational_mean.mul_(factor**0.5)
            q_u.chol_variational_covar.mul_(factor**0.5)

    @torch.no_grad()
    def match_singular_values(self, x, q, k, mask=None) -> tuple[float, float]:
        r"""Λ set so that J = 0 on a batch of the layer's inputs, q(u_c) rescaled with it: the layer computes the
        same function, its prior and posterior over f and the KL are unchanged, only the KSVD term starts at 0
        (docs/derivations.md §6, "The KSVD term on another stream").

        Per head h and feature j, with t_h = tr(ω_eᵀ ω_r) and the means over the real tokens,
        λ'_hj = (r / t_h) · ½ mean(e_hj² + r_hj²); then (m_c, L_c) ← D (m_c, L_c) with D = diag(λ'/λ), so that
        a' u' = G Λ'⁻¹ D u = a u and p(u') = N(0, σ²Λ'²) = D p(u). Returns J before and after.

        # shape: x (B, T, H·Dh), q, k (B, H, T, Dh), mask (B, T) bool (True = padding) or None -> (float, float)
        """
        ksvd, q_u = self.ksvd, self.variational_distribution
        x, q, k = full_precision(x, q, k)
        e, r, _, _ = ksvd(x, q, k, mask)  # shape: (B, H, T, r) each
        sq = e.pow(2) + r.pow(2)
        real = torch.ones(sq.shape[0], 1, sq.shape[2], 1, dtype=sq.dtype, device=sq.device)
        if mask is not None:
            real = (~mask)[:, None, :, None].to(sq.dtype)
        if not bool(real.any()):
            raise ValueError("match_singular_values: mask leaves no real token to measure the features on")
        half_mean = 0.5 * (sq * real).sum((0, 2)) / real.sum((0, 2))  # shape: (H, r)
        trace = (ksvd.omega_e * ksvd.omega_r).sum(-2).sum(-1)  # shape: (H,): t_h
        if not bool((trace > 0).all()) or not bool((half_mean > 0).all()):
            raise ValueError(
                f"match_singular_values: J = 0 needs tr(omega_e^T omega_r) > 0 and nonzero features in every head "
                f"(got traces {trace.tolist()}); call it on a freshly built or swapped layer"
            )
        before = float(self.ksvd.objective(e, r, mask))
        new = half_mean * (self.rank / trace)[:, None]
        d = (new / ksvd.lam).to(q_u.variational_mean.dtype)  # shape: (H, r): D, per feature j
        q_u.variational_mean.mul_(d[:, None, :])  # m_c ← D m_c  (coordinate j last)
        q_u.chol_variational_covar.mul_(d[:, None, :, None])  # L_c ← D L_c  (row j: stays lower triangular)
        ksvd.log_lambda.copy_(new.log())
        return before, float(self.ksvd.objective(e, r, mask))

    def check_length(self, T: int) -> None:
        if self.merge == "concat" and T != self.seq_len:
            raise ValueError(
                f"kep-svgp with merge='concat' maps 2T -> T tokens for a fixed length: it was built with "
                f"seq_len={self.seq_len}, so x must have T={self.seq_len} tokens, got T={T}"
            )

    def features(self, x, q, k, mask=None) -> dict[str, torch.Tensor]:
        """KSVD projections, merged features ``a = G Λ⁻¹`` and (optional) the residual root.

        # shape: x (B, T, H·Dh), q, k (B, H, T, Dh), mask (B, T) or None -> dict with e, r (B, H, T, r),
        #        a (B, H, T, r), residual (B, H, T, 2·Dh) or None, lam (H, r) (Λ), prior_std (H, r) (σΛ)
        """
        self.check_length(x.shape[1])
        x, q, k = self._feature_inputs(x, q, k)
        e, r, W_e, W_r = self.ksvd(x, q, k, mask)
        res = None
        if self.include_residual:
            phi_q, phi_k = cosine_features(q), cosine_features(k)
            res = (residual_root(phi_q, phi_k, W_e, mask), residual_root(phi_k, phi_q, W_r, mask))
        if self.merge == "add":
            G = e + r
            if res is not None:
                res = torch.cat(res, dim=-1)
        else:
            T = x.shape[1]
            A_e, A_r = self.token_weight[:, :T], self.token_weight[:, T:]  # shape: (T, T) each

            def keep(t):  # padded tokens never reach real ones through the token map
                return t if mask is None else t.masked_fill(mask[:, None, :, None], 0.0)

            G = A_e @ keep(e) + A_r @ keep(r)  # shape: (B, H, T, r)
            if res is not None:
                res = torch.cat([A_e @ keep(res[0]), A_r @ keep(res[1])], dim=-1)
        lam = self.ksvd.lam  # formed once per forward: the features, the KL and J read it (KEPConditional)
        a = G / lam[:, None, :]  # shape: (B, H, T, r): G Λ⁻¹ (Λ diagonal)
        prior_std = lam * self.prior_variance.to(lam.dtype).sqrt()  # shape: (H, r): σΛ, the prior's std of u_c
        return {"e": e, "r": r, "a": a, "residual": res, "lam": lam, "prior_std": prior_std}

    def condition(self, x, q, k, mask=None, mean_values=None) -> KEPConditional:
        """Features of a batch of sequences, computed once (float32 at least, autocast off); ``mean_values`` the
        values of a prior mean that owns them (:class:`KEPSoftmaxMean`; its queries, keys and values, a tuple, for
        :class:`~gpattn.variational.means.KEPSeparateSoftmaxMean`), None for the zero mean.

        # shape: x (B, T, H·Dh), q, k (B, H, T, Dh), mask (B, T) bool (True = padding) or None,
        #        mean_values (B, H, T, Dv), a tuple ((B, H, T, Dh), (B, H, T, Dh), (B, H, T, Dv)) or None
        """
        with gp_algebra(q.device.type):
            x, q, k, mean_values = full_precision(x, q, k, mean_values)
            features = self.features(x, q, k, mask)
            features["prior_mean"] = self._prior_mean(q, k, mean_values, mask)
            return KEPConditional(self, features, mask)

    def _prior_mean(self, q, k, mean_values, mask) -> torch.Tensor | None:
        """m(x) of the mean module (None: the zero mean) over the real keys, from the GP's q and k and the tensors of
        the mean's own projections.  # shape: -> (B, H, T, Dv) or None"""
        inputs = self.mean_module.inputs(q, k, None, mean_values, value_shape=(*q.shape[:-1], self.value_dim))
        return self.mean_module(*inputs, excluded=None if mask is None else mask[:, None, None, :])


class KEPConditional(AmortisedConditional):
    r"""One forward pass of KEP-SVGP (returned by :meth:`KEPSVGP.condition`): the merged features
    ``a = G Λ⁻¹`` of the batch and the layer's q(u_c), p(u_c) = N(0, Λ²).

    :ivar mean: :math:`(a M^\top) W + b`.  # shape: (B, H, T, Dv)
    """

    def __init__(self, strategy: KEPSVGP, features: dict, mask: torch.Tensor | None):
        self.strategy, self.features, self.mask, self._L = strategy, features, mask, None
        q_u = strategy.variational_distribution
        self._device = features["a"].device.type
        self._prior = features.get("prior_mean")  # m(x), or None for the zero mean
        gp_mean = kep_mean(features["a"], q_u.variational_mean, strategy.out_weight, strategy.out_bias)
        self.mean = add_means(gp_mean, self._prior)

    @property
    def _lam(self) -> torch.Tensor:
        """Λ, formed once per forward (by :meth:`KEPSVGP.features`) for the features, the KL and J.  # shape: (H, r)"""
        return self.features["lam"]

    @property
    def _chol(self) -> torch.Tensor:
        """L_c, formed once per forward (on first use) for the samples and the KL; a plain attribute of this per-call
        object (``functools.cached_property`` takes a lock, which breaks a ``torch.compile`` graph).
        # shape: (H, r_c, r, r)"""
        if self._L is None:
            self._L = self.strategy.variational_distribution.chol
        return self._L

    def _map_args(self):
        q_u, s = self.strategy.variational_distribution, self.strategy
        return self.features["a"], q_u.variational_mean, self._chol, s.out_weight, s.out_bias

    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(u_c) = N(0, σ²Λ²) on the inducing features.  # shape: batch (H, r_c), event r"""
        var = self.features["prior_std"].square()[:, None, :].expand(-1, self.strategy.rank, -1)  # shape: (H, r_c, r)
        return MultivariateNormal(torch.zeros_like(var), DiagLinearOperator(var))

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(u_c) = N(m_c, L_c L_cᵀ).  # shape: batch (H, r_c), event r"""
        return self.strategy.variational_distribution()

    def kl_divergence(self) -> torch.Tensor:
        """Σ_{h,c} KL(q(u_c) ‖ N(0, σ²Λ²)), a global term (docs/derivations.md §9: the objective divides it by
        N).  # shape: -> ()"""
        m = self.strategy.variational_distribution.variational_mean
        return kep_kl_divergence(self.features["prior_std"], m, self._chol)

    def rsample(self, num_samples=None, generator=None):
        """Exact (or, ``token_independent``, per-token) samples of the head outputs (:func:`kep_sample`).
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        with gp_algebra(self._device):
            sample = kep_sample(
                *self._map_args(),
                token_independent=self.strategy.token_independent,
                residual=self.features["residual"],
                generator=generator,
                num_samples=num_samples,
            )
            return add_means(sample, self._prior)  # the prior mean broadcasts over a leading sample axis

    def posterior(self) -> MultivariateNormal:
        """The exact posterior of the head outputs with the strategy's ``jitter`` (:func:`kep_posterior`)."""
        with gp_algebra(self._device):
            post = kep_posterior(*self._map_args(), residual=self.features["residual"], jitter=self.strategy.jitter)
            mean = add_means(post.mean.mT, self._prior).mT  # shape: (B, H, Dv, T); + m(x), once
            return MultivariateNormal(mean, post.lazy_covariance_matrix)  # batch (B, H, Dv)

    def added_loss_terms(self, mask=None):
        """``kl_global`` (the total KL) and ``ksvd`` = J², J averaged over the real tokens of ``mask`` (the
        caller's mask, all-padding rows included; default the mask of :meth:`KEPSVGP.condition`)."""
        with gp_algebra(self._device):
            mask = self.mask if mask is None else mask
            ksvd = self.strategy.ksvd
            J = ksvd_objective(self.features["e"], self.features["r"], self._lam, ksvd.omega_e, ksvd.omega_r, mask)
            return GlobalKL(self.kl_divergence()), KSVDLoss(J.pow(2))
