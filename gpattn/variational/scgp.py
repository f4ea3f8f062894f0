r"""Sparse correlated-GP attention, SCGPT: the DTC approximation of CGP, linear in T
(Bui et al. §4, App. C–E; docs/derivations.md §8).

Nothing with two token-sized axes is ever formed: every product is contracted over T into an
:math:`m\times m`, :math:`l\times l` or :math:`m\times l` matrix first, and only those are factorised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator, LowRankRootLinearOperator

from gpattn.variational._linalg import (
    LowRankPlusDiagLinearOperator,
    add_jitter,
    cholesky,
    gp_algebra,
    matmul_samples,
    standard_normal,
    tri_solve,
)
from gpattn.variational.cgp import CorrelatedConditional, CorrelatedGPBase

#: the dtype of sparse CGP's algebra (its blocks, the m×m and l×l capacitance factorisations and solves); the
#: outputs come back in the inputs' dtype. The capacitances σ²K_mm + K_mo K_om are nearly singular when the
#: inducing inputs crowd together (K_mm close to all ones, σ² = 0.01), beyond float32: in MiniLM's last layer
#: (docs/derivations.md §7, numerics policy §9) float32 factorisations failed at initialisation and in training.
#: Every matrix is m×m or T×m, so float64 costs little.
ALGEBRA_DTYPE = torch.float64

__all__ = ["DTCTerms", "SCGPConditional", "SparseCorrelatedGP"]


class DTCTerms(NamedTuple):
    """The token-by-inducing blocks and small factorisations of one SCGP evaluation."""

    K_qm: torch.Tensor  # σ_q κ_o(q, s)  # shape: (B, H, T, m)
    K_om: torch.Tensor  # κ_o(x_o, s)  # shape: (B, H, T, m)
    K_ol: torch.Tensor  # κ_o(x_o, s')  # shape: (B, H, T, l)
    K_kl: torch.Tensor  # σ_k κ_o(k, s')  # shape: (B, H, T, l)
    K_mm: torch.Tensor  # κ_o(s, s)  # shape: (B or 1, H, m, m)
    K_ll: torch.Tensor  # κ_o(s', s')  # shape: (B or 1, H, l, l)
    S_m: torch.Tensor  # K_mo K_om  # shape: (B, H, m, m)
    P: torch.Tensor  # K_mo K_ol  # shape: (B, H, m, l)
    L_q: torch.Tensor  # chol(B_q), B_q = σ² K_mm + K_mo K_om  # shape: (B, H, m, m)
    L_k: torch.Tensor  # chol(B_k), B_k = σ² K_ll + K_lk K_kl  # shape: (B, H, l, l)
    s2: torch.Tensor  # σ²  # shape: (H, 1, 1)
    S_k: torch.Tensor  # K_lk K_kl  # shape: (B, H, l, l)


class SparseCorrelatedGP(CorrelatedGPBase):
    r"""SCGP attention: DTC approximations of :math:`z_q\mid z_o` (inducing inputs :math:`s_{1..m}`)
    and :math:`z_o\mid z_k` (inducing inputs :math:`s'_{1..l}`), both in the canonical input space
    (Bui et al. §4, App. C–E; docs/derivations.md §8).

    With :math:`K_{qm} = \sigma_q\kappa_o(q, s)`, :math:`K_{om} = \kappa_o(x_o, s)`,
    :math:`K_{ol} = \kappa_o(x_o, s')`, :math:`K_{kl} = \sigma_k\kappa_o(k, s')` and the
    :math:`\sigma^2`-rescaled capacitance matrices :math:`B_q = \sigma^2 K_{mm} + K_{mo}K_{om}`,
    :math:`B_k = \sigma^2 K_{ll} + K_{lk}K_{kl}` (so that the :math:`\sigma^{-4}` of eq. 33 cancels),
    the mean with :math:`z = v` (eq. 34) is evaluated right to left:

    .. math::
        \nu = \sigma^{-4} K_{qm}(K_{mm} + \sigma^{-2}K_{mo}K_{om})^{-1}K_{mo}K_{ol}
              (K_{ll} + \sigma^{-2}K_{lk}K_{kl})^{-1}K_{lk}\, z
            = K_{qm}B_q^{-1}\big(K_{mo}K_{ol}\big)B_k^{-1}K_{lk}\, z .

    Predictive covariance (App. D; the :math:`\mu_o\mu_o^\top` part of :math:`E[z_oz_o^\top\mid z_k]`
    cancels :math:`\nu\nu^\top`), the same for every value column:

    .. math::
        \Sigma = \sigma^2 I + K_{qm}\big[A_q + \sigma^{-4}A_q K_{mo}C_oK_{om}A_q\big]K_{mq}
               = \sigma^2 I + K_{qm} R R^\top K_{mq},\qquad
        RR^\top = \sigma^2 B_q^{-1}\big(B_q + K_{mo}K_{om} + P B_k^{-1}P^\top\big)B_q^{-1},

    with :math:`A_q = \sigma^2 B_q^{-1}`, :math:`C_o = \sigma^2 I + K_{ol}A_kK_{lo}`,
    :math:`P = K_{mo}K_{ol}`. Samples are :math:`\nu + \sigma\varepsilon_1 + K_{qm}R\varepsilon_2`
    (:math:`\varepsilon_2\in\mathbb R^m`), never a :math:`T\times T` factorisation.

    Regulariser (App. E, eqs. 68–72), per head and value column, :math:`-2\times` the bound without
    its :math:`T\log 2\pi` constants, for the query part (and likewise for the keys with
    :math:`z, K_{kl}, K_{ll}, K_{ol}`):

    .. math::
        R_q = \frac{1}{\sigma^2}E_{z_o}E_{z_m\mid z_o}\lVert\nu - K_{qm}K_{mm}^{-1}z_m\rVert^2
              + T\log\sigma^2
            = \frac{1}{\sigma^2}\Big[\lVert\nu\rVert^2
              + \mathrm{tr}\big(B_q^{-1}S K_{mm}^{-1}S B_q^{-1}K_{mq}K_{qm}\big)
              + \sigma^2\,\mathrm{tr}\big(B_q^{-1}K_{mq}K_{qm}\big)\Big] + T\log\sigma^2,

    :math:`S = K_{mo}K_{om}`, with :math:`z_m\mid z_o` the DTC posterior (eq. 55) and — **Choice** —
    the prior of :math:`z_o` taken in the sparse model, :math:`z_o\sim\mathcal N(0, K_{om}K_{mm}^{-1}
    K_{mo})` (the DTC / Nyström counterpart of App. A's :math:`\mathcal N(0, K_o)`; the exact
    :math:`K_o` would need :math:`T\times T` work). Two deviations from the printed App. E, both
    typos there: the capacitance is :math:`K_{mm} + \sigma^{-2}K_{mo}K_{om}` (eqs. 55, 56), not
    :math:`K_{mm} + \sigma^{-2}I`; and :math:`\lVert\nu\rVert^2` is kept (dropping it, as the last
    "≥" of eq. 72 does, would turn the lower bound into an upper bound).

    Cost :math:`O(T(m + l)(D_h + D_v) + T(m^2 + ml + l^2) + m^3 + l^3)` per (B, H).

    :param head_dim: Dh, the width of the canonical input space.
    :param num_inducing: m, inducing inputs for :math:`z_q\mid z_o` (the scgp layer's default: Bui et al. §5.1).
    :param num_inducing_keys: l, inducing inputs for :math:`z_o\mid z_k`.
    :param amortize: compute the inducing inputs from the sequence, :math:`s = C_m x_o` and
        :math:`s' = C_l k` with learnable token maps :math:`C_m\in\mathbb R^{m\times T}`,
        :math:`C_l\in\mathbb R^{l\times T}` per head (the released variant); needs ``seq_len``.
        Default: global learnable inducing inputs per head (Remark 4).
    :param seq_len: T for ``amortize=True``; every input must have exactly this many tokens.
    :param inducing_std: standard deviation of the initial global inducing inputs.

    Other parameters: :class:`~gpattn.variational.cgp.CorrelatedGPBase`.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        num_inducing: int,
        num_inducing_keys: int,
        amortize: bool = False,
        seq_len: int | None = None,
        inducing_std: float = 1.0,
        **kwargs,
    ):
        super().__init__(num_heads, **kwargs)
        sizes = {"head_dim": head_dim, "num_inducing": num_inducing, "num_inducing_keys": num_inducing_keys}
        for arg, val in sizes.items():
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg} must be a positive int, got {val!r}")
        if not isinstance(amortize, bool):
            raise ValueError(f"amortize must be True or False, got {amortize!r}")
        self.head_dim, self.num_inducing, self.num_inducing_keys = head_dim, num_inducing, num_inducing_keys
        self.amortize = amortize
        self.seq_len = seq_len
        H, m, l = num_heads, num_inducing, num_inducing_keys
        if amortize:
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
                raise ValueError(f"amortize=True needs seq_len, a positive int (the fixed T), got {seq_len!r}")
            # initialised to pick m (resp. l) evenly spaced tokens: with m = l = T this is s = x_o, s' = k
            self.amortize_latent = nn.Parameter(self._pick_tokens(H, m, seq_len))  # shape: (H, m, T)
            self.amortize_keys = nn.Parameter(self._pick_tokens(H, l, seq_len))  # shape: (H, l, T)
        else:
            if seq_len is not None:
                raise ValueError(f"seq_len is only used with amortize=True, got seq_len={seq_len!r}")
            if not float(inducing_std) > 0:
                raise ValueError(f"inducing_std must be > 0, got {inducing_std!r}")
            self.inducing_latent = nn.Parameter(torch.randn(H, m, head_dim) * inducing_std)  # s, shape: (H, m, Dh)
            self.inducing_keys = nn.Parameter(torch.randn(H, l, head_dim) * inducing_std)  # s', shape: (H, l, Dh)

    @staticmethod
    def _pick_tokens(H: int, n: int, T: int) -> torch.Tensor:
        C = torch.zeros(H, n, T)
        C[:, torch.arange(n), (torch.arange(n) * T) // n] = 1.0
        return C

    def _check(self, q, k, o, v, mask):
        super()._check(q, k, o, v, mask)
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q must have head width Dh={self.head_dim}, got shape {tuple(q.shape)}")
        if self.amortize and q.shape[2] != self.seq_len:
            raise ValueError(
                f"amortize=True was built for seq_len={self.seq_len} tokens, got T={q.shape[2]} "
                f"(shape {tuple(q.shape)})"
            )

    # ------------------------------------------------------------------ inducing inputs and blocks
    def inducing_inputs(self, o: torch.Tensor, k: torch.Tensor, valid: torch.Tensor | None = None):
        """:math:`s` (for :math:`z_q\\mid z_o`) and :math:`s'` (for :math:`z_o\\mid z_k`).

        # shape: o, k (B, H, T, Dh), valid (B, 1, T) -> (B or 1, H, m, Dh), (B or 1, H, l, Dh)"""
        if not self.amortize:
            return self.inducing_latent.to(o)[None], self.inducing_keys.to(o)[None]
        if valid is not None:
            o, k = o * valid[..., :, None], k * valid[..., :, None]
        return self.amortize_latent.to(o) @ o, self.amortize_keys.to(o) @ k

    def terms(self, q, k, o, s, s_keys, valid, valid_q=None) -> DTCTerms:
        """All token-by-inducing blocks, their T-contractions and the two capacitance factors (``valid_q``: the
        real queries; ``valid`` the real keys and latent inputs)."""
        s2 = self.noise(q)
        n_q, n_o, n_k, n_s, n_l = self.covar.squared_norms(q, o, k, s, s_keys)  # each point set's, once
        K_qm = self.cross(q, s, ("q", "o"), rows=valid_q, sq_norms=(n_q, n_s))
        K_om = self.cross(o, s, ("o", "o"), rows=valid, sq_norms=(n_o, n_s))
        K_ol = self.cross(o, s_keys, ("o", "o"), rows=valid, sq_norms=(n_o, n_l))
        K_kl = self.cross(k, s_keys, ("k", "o"), rows=valid, sq_norms=(n_k, n_l))
        K_mm = self.covar.gram(s, "o", n_s)
        K_ll = self.covar.gram(s_keys, "o", n_l)
        S_m = K_om.mT @ K_om  # K_mo K_om  # shape: (B, H, m, m)
        P = K_om.mT @ K_ol  # K_mo K_ol  # shape: (B, H, m, l)
        S_k = K_kl.mT @ K_kl  # K_lk K_kl  # shape: (B, H, l, l)
        L_q, L_k = _pairwise(  # B_q = σ² K_mm + K_mo K_om, B_k = σ² K_ll + K_lk K_kl
            lambda A: cholesky(A, name="scgp: sigma^2 K_mm + K_mo K_om, sigma^2 K_ll + K_lk K_kl"),
            (s2 * K_mm + S_m,),
            (s2 * K_ll + S_k,),
        )
        return DTCTerms(K_qm, K_om, K_ol, K_kl, K_mm, K_ll, S_m, P, L_q, L_k, s2, S_k)

    @staticmethod
    def predictive_mean(t: DTCTerms, z: torch.Tensor) -> torch.Tensor:
        """Eq. 33 right to left: :math:`\\nu = K_{qm}B_q^{-1}PB_k^{-1}K_{lk}z`.

        # shape: z (B, H, T, Dv) -> (B, H, T, Dv)"""
        u = torch.cholesky_solve(t.K_kl.mT @ z, t.L_k)  # B_k⁻¹ K_lk z  # shape: (B, H, l, Dv)
        return t.K_qm @ torch.cholesky_solve(t.P @ u, t.L_q)  # shape: (B, H, T, Dv)

    def covariance_root(self, t: DTCTerms) -> torch.Tensor:
        """:math:`K_{qm}R` with :math:`\\Sigma = \\sigma^2 I + (K_{qm}R)(K_{qm}R)^\\top` (App. D).

        # shape: (B, H, T, m)"""
        Y = tri_solve(t.L_k, t.P.mT)  # L_k⁻¹ Pᵀ, so P B_k⁻¹ Pᵀ = YᵀY  # shape: (B, H, l, m)
        M = t.s2 * t.K_mm + 2.0 * t.S_m + Y.mT @ Y  # B_q + K_mo K_om + P B_k⁻¹ Pᵀ
        L_M = cholesky(M, name="scgp: covariance bracket")
        R = t.s2.sqrt() * torch.cholesky_solve(L_M, t.L_q)  # σ B_q⁻¹ L_M  # shape: (B, H, m, m)
        return t.K_qm @ R

    def _dtc_trace(self, G: torch.Tensor, S: torch.Tensor, K_mm: torch.Tensor, L_B: torch.Tensor, s2):
        """:math:`\\mathrm{tr}(B^{-1}SK_{mm}^{-1}SB^{-1}G) + \\sigma^2\\mathrm{tr}(B^{-1}G)` for
        :math:`B = \\sigma^2K_{mm} + S = L_BL_B^\\top`.  # shape: G, S, K_mm (..., B, H, m, m) -> (..., B, H)"""
        L_mm = cholesky(add_jitter(K_mm, self.jitter), name="scgp: inducing Gram")
        BS, BG = torch.cholesky_solve(torch.cat((S, G), -1), L_B).split(S.shape[-1], -1)  # B⁻¹S, B⁻¹G: one solve
        V = tri_solve(L_mm, BS.mT)  # L_mm⁻¹ S B⁻¹ (a per-head L_mm solves the batch's columns at once)
        return ((V @ G) * V).sum((-2, -1)) + s2[:, 0, 0] * BG.diagonal(dim1=-2, dim2=-1).sum(-1)  # … + σ² tr(B⁻¹G)

    def regularizer(self, t: DTCTerms, nu: torch.Tensor, z: torch.Tensor, valid, valid_q) -> torch.Tensor:
        """App. E, per head and value column (see the class docstring).  # shape: (B, H, Dv)"""
        s2 = t.s2[:, 0, 0]  # shape: (H,)
        # the real queries and keys: a count per sequence, or the lengths (Python numbers: no tensor made for them)
        n_q, n_k = (n if m is None else m.sum(-1).to(nu) for m, n in ((valid_q, nu.shape[-2]), (valid, z.shape[-2])))
        # query part: z_m | z_o is the DTC posterior of the mean (capacitance B_q);
        # key part: z_l | z_o, the DTC posterior with z_o as observations (B'_k = σ² K_ll + K_lo K_ol)
        S_l = t.K_ol.mT @ t.K_ol  # shape: (B, H, l, l)
        L_kb = cholesky(t.s2 * t.K_ll + S_l, name="scgp: sigma^2 K_ll + K_lo K_ol")
        tr_q, tr_k = _pairwise(
            lambda G, S, K, L_B: self._dtc_trace(G, S, K, L_B, t.s2),
            (t.K_qm.mT @ t.K_qm, t.S_m, t.K_mm, t.L_q),
            (t.S_k, S_l, t.K_ll, L_kb),
        )
        sq = nu.pow(2).sum(-2) + z.pow(2).sum(-2)  # shape: (B, H, Dv)
        # both parts carry T log σ² (the log-determinant of σ²I over the real tokens)
        return (sq + (tr_q + tr_k)[..., None]) / s2[:, None] + ((n_q + n_k) * s2.log())[..., None]

    # ------------------------------------------------------------------ entry points
    def _terms_for(self, q, k, o, valid, inducing, valid_q):
        if inducing is None:
            s, s_keys = self.inducing_inputs(o, k, valid)
        else:
            s, s_keys = (x.to(q) for x in inducing)
        return self.terms(q, k, o, s, s_keys, valid, valid_q)

    def _condition(self, q, k, o, v, valid, valid_q=None, inducing=None):
        dtype = v.dtype
        q, k, o, v = _algebra_inputs(q, k, o, v)
        t = self._terms_for(q, k, o, valid, inducing, valid_q)
        z = v if valid is None else v * valid[..., :, None]  # eq. 34: z = v, padded keys removed
        return SCGPConditional(self, self.predictive_mean(t, z).to(dtype), valid, t, z, valid_q)

    def _conditional_mean(self, q, k, o, z, valid, inducing=None):
        dtype = z.dtype
        q, k, o, z = _algebra_inputs(q, k, o, z)
        t = self._terms_for(q, k, o, valid, inducing, valid)
        if valid is not None:
            z = z * valid[..., :, None]
        return self.predictive_mean(t, z).to(dtype)


def _pairwise(fn, first: tuple, second: tuple) -> tuple:
    """``(fn(*first), fn(*second))``, computed as one call of fn on the stacked arguments when their shapes agree
    (m = l, the default): each of fn's operators runs once for both (batched factorisations and products treat
    every matrix on its own, so the values are those of the two calls)."""
    if all(a.shape == b.shape for a, b in zip(first, second)):
        return tuple(fn(*(torch.stack(pair) for pair in zip(first, second))).unbind(0))
    return fn(*first), fn(*second)


def _algebra_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The inputs in :data:`ALGEBRA_DTYPE` (or wider), laid out contiguously by the same copy: the head views of the
    projections would otherwise be copied again by every product they enter.  # shape: each (B, H, T, ·)"""
    return [t.to(torch.promote_types(t.dtype, ALGEBRA_DTYPE), memory_format=torch.contiguous_format) for t in tensors]


class SCGPConditional(CorrelatedConditional):
    """One forward pass of sparse CGP (``SparseCorrelatedGP.condition``): the DTC terms and ν; the
    covariance root :math:`K_{qm}R` on first use (shared by samples and posterior)."""

    def __init__(self, gp: SparseCorrelatedGP, nu, valid, terms: DTCTerms, z, valid_q=None):
        super().__init__(gp, nu, valid, valid_q)
        self.terms, self._z, self._root = terms, z, None

    def _covariance_root(self) -> torch.Tensor:
        """# shape: (B, H, T, m)"""
        if self._root is None:
            self._root = self.gp.covariance_root(self.terms).to(self.mean.dtype)
        return self._root

    def _noise(self) -> torch.Tensor:
        """σ² in the dtype of the outputs.  # shape: (H, 1, 1)"""
        return self.terms.s2.to(self.mean.dtype)

    def rsample(self, num_samples=None, generator=None):
        """ν + σ ε₁ + K_qm R ε₂ (ε₂ ∈ R^m): never a T×T factorisation.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        with gp_algebra(self._device):
            nu, root = self.mean, self._covariance_root()
            B, H, T, Dv = nu.shape
            eps = standard_normal((B, H, T + root.shape[-1], Dv), nu, num_samples, generator)
            return nu + self._noise().sqrt() * eps[..., :T, :] + matmul_samples(root, eps[..., T:, :])

    def posterior(self) -> MultivariateNormal:
        with gp_algebra(self._device):
            nu, root = self.mean, self._covariance_root()
            B, H, T, Dv = nu.shape
            root = root.unsqueeze(2).expand(B, H, Dv, T, root.shape[-1])  # a view: no copy per column
            diag = self._noise().reshape(1, H, 1, 1).expand(B, H, Dv, T)  # σ² on every token
            # σ²I + rank m, factorised through m×m matrices only and exact at any T (numerics policy)
            covar = LowRankPlusDiagLinearOperator(LowRankRootLinearOperator(root), DiagLinearOperator(diag))
            return MultivariateNormal(nu.transpose(-1, -2), covar)

    def _regularizer(self):
        nu = self.nu.to(self._z.dtype)  # the zero-mean GP's: the prior mean costs nothing (§7a)
        return self.gp.regularizer(self.terms, nu, self._z, self.valid, self.valid_q).to(self.mean.dtype)
