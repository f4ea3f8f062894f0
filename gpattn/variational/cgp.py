r"""Exact correlated-GP attention, CGPT (Bui et al. §3, App. A–B; docs/derivations.md §7), and the algebra it shares
with the sparse variant (:mod:`gpattn.variational.scgp`).

A canonical GP :math:`z_o` with parameter-free kernel :math:`\kappa_o` generates the query process
:math:`z_q(x) = \sigma_q z_o(x W_q)` and the key process :math:`z_k(x) = \sigma_k z_o(x W_k)`; the
latent inputs :math:`x_o = x W_o` are a third projection. Attention is the cross-function prediction
:math:`z_q \mid z_k` through the latent values :math:`z_o` (eq. 17), one independent CGP per value
column (Remark 2).

Padding: a padded token is removed from every basis — its rows and columns of the cross-covariances
are zero and the Gram matrices get a unit diagonal block there — so the results for the real tokens
equal a run on the sequence without the padded tokens, and the padded query rows get mean 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from gpytorch.constraints import GreaterThan
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from linear_operator.operators import CholLinearOperator, TriangularLinearOperator

from gpattn.kernels._evaluate import evaluate_kernel
from gpattn.kernels.cross_covariance import CrossCovarianceKernel
from gpattn.objectives import CGPRegulariser
from gpattn.variational._linalg import (
    add_jitter,
    cholesky,
    full_precision,
    gp_algebra,
    isolate_padding,
    matmul_samples,
    standard_normal,
    tri_solve,
    with_policy,
)
from gpattn.variational._scale import CGP_SIGMA
from gpattn.variational._strategy import (
    AmortisedConditional,
    AmortisedVariationalStrategy,
    check_query_inputs,
    sequence_mean,
)
from gpattn.variational.means import add_means, when_present

#: lower bound of a learned σ: keeps the regulariser's bound 2T log σ² finite
SIGMA_FLOOR = 1e-3

__all__ = [
    "SIGMA_FLOOR",
    "CGPConditional",
    "CorrelatedConditional",
    "CorrelatedGP",
    "CorrelatedGPBase",
    "logdet_from_cholesky",
]


def _solve_parts(L: torch.Tensor, *parts: torch.Tensor) -> list[torch.Tensor]:
    """L⁻¹ X for each right-hand side X sharing the factor L, as one triangular solve of their columns side by side
    (the columns are solved independently: the same values as a solve each, one launch and one backward).
    # shape: L (..., n, n), each part (..., n, k_i) -> each (..., n, k_i)"""
    return list(tri_solve(L, torch.cat(parts, -1)).split([p.shape[-1] for p in parts], -1))


def logdet_from_cholesky(L: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """:math:`\\log|A| = 2 \\sum_t \\log L_{tt}` over the real tokens only (padded ones have a unit
    diagonal block, whose jitter must not count).  # shape: L (..., T, T), valid (B, 1, T) -> (...)"""
    logdiag = L.diagonal(dim1=-2, dim2=-1).log()
    if valid is not None:
        logdiag = logdiag * valid
    return 2.0 * logdiag.sum(-1)


class CorrelatedGPBase(AmortisedVariationalStrategy):
    r"""Parameters and Gram blocks shared by :class:`CorrelatedGP` and
    :class:`~gpattn.variational.scgp.SparseCorrelatedGP`: the strategies of the protocol
    (:mod:`gpattn.variational._strategy`) whose :meth:`condition` returns a :class:`CorrelatedConditional`.
    The conditional is exact given the inputs (no q(u), no KL); its loss term is the regulariser.

    :param num_heads: H; :math:`\sigma_q, \sigma_k` (and a learnable :math:`\sigma`) are per head.
    :param kernel: the canonical kernel :math:`\kappa_o`, a ``gpytorch.kernels.Kernel``; None (default) is
        :math:`\exp(-\tfrac12\lVert a-b\rVert^2)` (the attention layers build it from a kernel spec,
        :func:`gpattn.kernels.make_kernel`).
    :param sigma: the noise standard deviation :math:`\sigma` (:math:`\sigma^2` is added to the Gram
        matrices of the conditioning sets). Default 0.1: Bui et al. App. F uses :math:`\sigma = 0.1` for
        SCGPT on CIFAR10 (0.5 on CoLA) and states no value for CGPT, so both use 0.1.
    :param learn_sigma: learn :math:`\sigma` per head (default: fixed, as in Bui et al.). A learned σ is
        constrained to :math:`\sigma > ` ``SIGMA_FLOOR`` (1e-3): the regulariser's bound
        :math:`2T\log\sigma^2` would otherwise run to −∞ with σ.
    :param jitter: added to the diagonal of the matrices that are PSD only in exact arithmetic
        before their Cholesky factorisation (the numerics policy escalates it on failure).
    :param mean_module: the prior mean (:mod:`gpattn.variational.means`): :class:`~gpattn.variational.means.ZeroMean`
        (the papers' form) or :class:`~gpattn.variational.means.CorrelatedSoftmaxMean`: the query and key processes
        have the prior mean :math:`m(x) = \sum_j \mathrm{softmax}_j(t\, x \cdot k_j)\, v_j`, softmax attention of
        the canonical inputs at the mean's temperature :math:`t`, and the correlated GP models the departure from it
        (docs/derivations.md §7a). The covariance and the regulariser are the zero-mean model's; the mean of
        z_q | z_k is :math:`m(q) + \nu`. :class:`~gpattn.variational.means.CorrelatedSeparateSoftmaxMean` reads
        values of its own, :math:`u_j` (``condition``'s ``mean_values``), which the regulariser does not read
        (§7a).
    """

    def __init__(
        self,
        num_heads: int,
        *,
        kernel: Kernel | None = None,
        sigma: float,
        learn_sigma: bool = False,
        jitter: float,
        mean_module: nn.Module,
    ):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if kernel is not None and not isinstance(kernel, Kernel):
            raise ValueError(
                f"kernel must be a gpytorch.kernels.Kernel or None (exp(-|a-b|^2/2)), got {type(kernel).__name__}; "
                f"the layers take a kernel spec such as 'canonical-rbf' (gpattn.kernels.make_kernel)"
            )
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
            raise ValueError(f"sigma must be a float > 0, got {sigma!r}")
        if not isinstance(learn_sigma, bool):
            raise ValueError(f"learn_sigma must be True or False, got {learn_sigma!r}")
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or jitter < 0:
            raise ValueError(f"jitter must be a float >= 0, got {jitter!r}")
        self.num_heads = num_heads
        #: the prior mean function (GPyTorch's ``mean_module``)
        self.mean_module = mean_module
        self.jitter = float(jitter)
        self.covar = CrossCovarianceKernel(
            kernel, batch_shape=torch.Size([num_heads]), sigma_q=CGP_SIGMA, sigma_k=CGP_SIGMA
        )  # σ_q = σ_k on the stream's scale (gpattn.variational._scale)
        self.learn_sigma = learn_sigma
        self._sigma_value = float(sigma)  # the fixed σ, kept exact (a float32 buffer would round it)
        if learn_sigma:
            if not sigma > SIGMA_FLOOR:
                raise ValueError(f"sigma must be > SIGMA_FLOOR = {SIGMA_FLOOR} with learn_sigma=True, got {sigma!r}")
            self.sigma_constraint = GreaterThan(SIGMA_FLOOR)
            raw = self.sigma_constraint.inverse_transform(torch.full((num_heads,), float(sigma), dtype=torch.float64))
            self.raw_sigma = nn.Parameter(raw.to(torch.get_default_dtype()))

    # ------------------------------------------------------------------ hyper-parameters
    @property
    def sigma(self) -> torch.Tensor:
        """Noise standard deviation :math:`\\sigma` per head.  # shape: (H,)"""
        if self.learn_sigma:
            return self.sigma_constraint.transform(self.raw_sigma)
        return torch.full((self.num_heads,), self._sigma_value, dtype=torch.float64)

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """:math:`\\sigma^2` shaped to broadcast against ``(B, H, n, n)``, on ``like``'s device and dtype
        (a fixed σ is made there directly: no host tensor copied per call).  # shape: (H, 1, 1)"""
        sigma = self.sigma_constraint.transform(self.raw_sigma) if self.learn_sigma else None
        if sigma is None:
            sigma = like.new_full((self.num_heads,), self._sigma_value)
        return sigma.to(like).pow(2)[:, None, None]

    @torch.no_grad()
    def _scale_prior(self, factor: float) -> None:
        r"""The prior variances :math:`\sigma_q^2, \sigma_k^2` of :math:`z_q, z_k` at a token times ``factor``
        (κ_o stays canonical)."""
        self.covar.sigma_q = self.covar.sigma_q * math.sqrt(factor)
        self.covar.sigma_k = self.covar.sigma_k * math.sqrt(factor)

    # ------------------------------------------------------------------ masked dense blocks
    def cross(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        roles: tuple[str, str],
        rows: torch.Tensor | None = None,
        cols: torch.Tensor | None = None,
        sq_norms=None,
    ) -> torch.Tensor:
        """Dense cross-covariance :math:`K_{ab}` with the padded tokens' rows / columns zeroed (``sq_norms``: what
        blocks over a and b share, :meth:`~gpattn.kernels.CrossCovarianceKernel.squared_norms`, or None).

        # shape: a (B, H, n, Dh), b (B, H, p, Dh), rows (B, 1, n) bool, cols (B, 1, p) bool -> (B, H, n, p)
        """
        K = evaluate_kernel(self.covar, a, b, roles=roles, sq_norms=sq_norms)
        if rows is not None:
            K = K.masked_fill(~rows[..., :, None], 0.0)
        if cols is not None:
            K = K.masked_fill(~cols[..., None, :], 0.0)
        return K

    def gram(self, a: torch.Tensor, role: str, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Symmetric Gram block :math:`K_{aa}`: padded tokens are decoupled from the real ones and get a
        unit diagonal.  # shape: a (B, H, n, Dh), valid (B, 1, n) -> (B, H, n, n)"""
        return isolate_padding(self.covar.gram(a, role), None if valid is None else ~valid[:, 0])

    # ------------------------------------------------------------------ the public boundary
    def _check(self, q, k, o, v, mask):
        if q.dim() != 4 or q.shape[1] != self.num_heads:
            raise ValueError(f"q must have shape (B, H={self.num_heads}, T, Dh), got {tuple(q.shape)}")
        for name, t in (("k", k), ("o", o)):
            if t.shape != q.shape:
                raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
        if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError(f"v must have shape (B, H, T, Dv) = {tuple(q.shape[:3])} + (Dv,), got {tuple(v.shape)}")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (q.shape[0], q.shape[2])):
            raise ValueError(
                f"mask must be a bool tensor of shape (B, T) = {(q.shape[0], q.shape[2])} (True = padding), "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )

    @staticmethod
    def _prepare(mask, *tensors):
        """Upcast to float32 at least (autocast is off inside); mask (B, T) -> valid (B, 1, T) or None."""
        valid = None if mask is None else (~mask)[:, None, :]
        return valid, full_precision(*tensors)

    def condition(self, q, k, o, v, mask=None, query_inputs=None, mean_values=None, **options) -> AmortisedConditional:
        """Factorise once for a batch of sequences: the predictive mean ν now, the covariance
        factor and the regulariser on demand (samples: ``rsample(num_samples)``, P draws from the one
        factorisation on a leading axis; the layer's loss term: ``added_loss_terms(mask)``).
        ``query_inputs`` (B, H, T', Dh): cross-attention, z_q evaluated at these queries instead of ``q``;
        k, x_o and v are the context's, ``mask`` pads them (docs/derivations.md §13). ``mean_values``: the
        tensors of the mean's own projections (``mean_module.projections``: its values u; required there, refused
        otherwise).

        # shape: q, k, o (B, H, T, Dh) projected inputs, v (B, H, T, Dv), mask (B, T) bool (True = padding),
        # mean_values (B, H, T, Dv)
        """
        self._check(q, k, o, v, mask)
        if query_inputs is not None:
            check_query_inputs(query_inputs, k)
        with gp_algebra(q.device.type):
            queries = q if query_inputs is None else query_inputs
            valid, (q, k, o, v32, own) = self._prepare(mask, queries, k, o, v, mean_values)
            valid_q = valid if query_inputs is None else None  # cross-attention: the queries are not padded
            cond = self._condition(q, k, o, v32, valid, valid_q=valid_q, **options)
            excluded = None if valid is None else ~valid[:, :, None, :]  # the padded keys
            prior = self.mean_module(*self.mean_module.inputs(q, k, v32, own), excluded=excluded)
            cond.add_prior_mean(prior, valid_q)  # m(q) + ν, once
        cond.output_dtype = v.dtype  # the layer hands on the values' dtype (autocast)
        return cond

    #: :math:`p(z_q \mid z_k)` per value column, batch ``(B, H, Dv)``, event ``T`` (= calling the module)
    posterior = AmortisedVariationalStrategy.forward

    def conditional_mean(self, q, k, o, z, mask=None, **options) -> torch.Tensor:
        """:math:`E[z_q \\mid z_k = z]` for given observations ``z`` of the key process, of the zero-mean correlated GP
        (with ``prior_mean="softmax"``: of the departure from the prior mean, z = z_k − m(k)).

        # shape: q, k, o (B, H, T, Dh), z (B, H, T, Dv) -> (B, H, T, Dv)"""
        self._check(q, k, o, z, mask)
        with gp_algebra(q.device.type):
            valid, (q, k, o, z) = self._prepare(mask, q, k, o, z)
            return self._conditional_mean(q, k, o, z, valid, **options)

    # ------------------------------------------------------------------ to implement
    def _condition(self, q, k, o, v, valid, valid_q=None) -> AmortisedConditional:
        """``valid`` marks the real keys and latent inputs, ``valid_q`` the real queries (both (B, 1, ·))."""
        raise NotImplementedError

    def _conditional_mean(self, q, k, o, z, valid):
        raise NotImplementedError


class CorrelatedConditional(AmortisedConditional):
    r"""Base of the correlated GPs' conditionals: exact given the inputs, so there is no q(u) and no KL
    (:class:`AmortisedConditional` says so); the loss term is the regulariser R (``cgp``), docs/derivations.md §7:
    :math:`\operatorname{mean}_b \sum_{h,d} R / 2` (the weight α lives in the objective).

    Every method runs in ``gp_algebra()`` on the device of the inputs."""

    def __init__(self, gp: CorrelatedGPBase, nu: torch.Tensor, valid: torch.Tensor | None, valid_q=None):
        # nu: the zero-mean GP's predictive mean, which the regulariser reads; mean: what the layer outputs
        self.gp, self.nu, self.mean, self.valid, self.valid_q = gp, nu, nu, valid, valid_q  # valid_q: the real queries
        self._device = nu.device.type

    def add_prior_mean(self, prior: torch.Tensor | None, valid_q: torch.Tensor | None = None) -> None:
        """The predictive mean becomes m(q) + ν (docs/derivations.md §7a), m 0 at the padded queries of ``valid_q``;
        the covariance and R do not change.
        # shape: prior (B, H, T, Dv), or None: the zero mean (nothing added), valid_q (B, 1, T) or None"""
        if valid_q is not None:
            prior = when_present(lambda m: m * valid_q[..., None], prior)
        self.mean = add_means(self.nu, prior)

    def regularizer(self) -> torch.Tensor:
        """R per head and value column (a fresh Monte-Carlo estimate per call where R samples).
        # shape: -> (B, H, Dv)"""
        with gp_algebra(self._device):
            return self._regularizer()

    def added_loss_terms(self, mask=None):
        return self.loss_terms(self.regularizer(), mask)

    @staticmethod
    def loss_terms(regularizer: torch.Tensor, mask=None) -> tuple:
        r"""The loss term of R per head and value column (:meth:`regularizer`'s, or the R of sequences conditioned
        apart, side by side): :math:`\operatorname{mean}_b \sum_{h,d} R / 2` over the sequences ``mask`` does not
        leave out entirely.
        # shape: regularizer (B, H, Dv), mask (B, T) or None"""
        return (CGPRegulariser(sequence_mean(regularizer, mask) / 2),)

    def _regularizer(self) -> torch.Tensor:
        raise NotImplementedError


class CorrelatedGP(CorrelatedGPBase):
    r"""Exact CGP attention (Bui et al. eqs. 21–25, App. A–B; docs/derivations.md §7).

    Gram blocks (:class:`~gpattn.kernels.cross_covariance.CrossCovarianceKernel`; :math:`\sigma_q,
    \sigma_k` enter the cross-covariances too, eq. 16):
    :math:`K_q = \sigma_q^2\kappa_o(q, q)`, :math:`K_k = \sigma_k^2\kappa_o(k, k)`,
    :math:`K_o = \kappa_o(x_o, x_o)`, :math:`K_{qo} = \sigma_q\kappa_o(q, x_o)`,
    :math:`K_{ok} = \sigma_k\kappa_o(x_o, k)`. With observations :math:`z = (K_k + \sigma^2 I) v`
    (eq. 24) the mean is attention on :math:`v` (eq. 25):

    .. math::
        \nu = K_{qo}(K_o + \sigma^2 I)^{-1} K_{ok} (K_k + \sigma^2 I)^{-1} z
            = K_{qo}(K_o + \sigma^2 I)^{-1} K_{ok}\, v,

    and the predictive covariance (App. B, eqs. 45–52; the :math:`\mu_o\mu_o^\top` part of
    :math:`E[z_o z_o^\top\mid z_k]` cancels :math:`\nu\nu^\top`) is the same for every value column:

    .. math::
        \Sigma = K_q - K_{qo}A^{-1}K_{oq} + K_{qo}A^{-1}\big(K_o - K_{ok}(K_k+\sigma^2 I)^{-1}K_{ko}\big)
                 A^{-1}K_{oq}, \qquad A = K_o + \sigma^2 I.

    One :math:`T\times T` Cholesky of :math:`\Sigma` per (B, H) is shared by the Dv columns; samples
    are :math:`\nu + L_\Sigma\varepsilon`.

    Regulariser (App. A, eqs. 42–44), per head and value column, with prior samples
    :math:`z_o^{(i)}\sim\mathcal N(0, K_o)`, :math:`m_q^{(i)} = K_{qo}A^{-1}z_o^{(i)}`,
    :math:`m_k^{(i)} = K_{ko}A^{-1}z_o^{(i)}`, :math:`\Sigma_q = K_q - K_{qo}A^{-1}K_{oq} + \sigma^2 I`,
    :math:`\Sigma_k = K_k - K_{ko}A^{-1}K_{ok} + \sigma^2 I`:

    .. math::
        R = \tfrac{1}{P_o}\sum_i (\nu - m_q^{(i)})^\top\Sigma_q^{-1}(\nu - m_q^{(i)}) + \log|\Sigma_q|
          + \tfrac{1}{P_o}\sum_i (z - m_k^{(i)})^\top\Sigma_k^{-1}(z - m_k^{(i)}) + \log|\Sigma_k|,

    i.e. :math:`-2\times` the lower bound without its :math:`T\log 2\pi` constants.

    **Bounded** (**Choice**, docs/derivations.md §9): the conditionals carry the observation noise :math:`\sigma^2 I`
    of the conditioning sets, as the sparse bound does (App. E: :math:`z_q\mid z_m \sim
    \mathcal N(\cdot, \sigma^2 I)`). Without it (eq. 37 as printed) :math:`\Sigma_q` is the
    noise-free conditional :math:`K_q - K_{qo}A^{-1}K_{oq}`, which tends to 0 when the GP variances
    shrink (:math:`\sigma_q \to 0`, or queries predicted exactly from the latent inputs), and since
    the quadratic terms stay bounded there (ν and :math:`m_q^{(i)}` shrink with
    :math:`\sigma_q` too), :math:`\log|\Sigma_q| \to -\infty`: R ran to −∞ (bounded only by the jitter,
    :math:`T\log(\text{jitter})`), and training rewarded a vanishing attention output. With the noise,
    :math:`\log|\Sigma_q + \sigma^2 I| \ge T\log\sigma^2` and the quadratic forms are ≥ 0, so
    :math:`R \ge 2T\log\sigma^2` per head and value column (``tests/test_cgp.py`` pins the bound). The prior samples
    are shared by the Dv columns of a head. ``prior_samples=None`` uses the exact expectation over
    :math:`z_o` instead (:math:`E[\cdot] = \nu^\top\Sigma_q^{-1}\nu + \mathrm{tr}(\Sigma_q^{-1}
    K_{qo}A^{-1}K_oA^{-1}K_{oq})`, the :math:`P_o\to\infty` limit). The layer reports
    ``mean_b Σ_{h,d} R / 2``; the weight α lives in the objective.

    Cost :math:`O(T^3)` per (B, H): Cholesky factorisations and triangular solves, no inverses.

    :param prior_samples: :math:`P_o` (default 10), or ``None`` for the exact expectation.

    Other parameters: :class:`CorrelatedGPBase`.
    """

    def __init__(self, num_heads: int, *, prior_samples: int | None = 10, **kwargs):
        super().__init__(num_heads, **kwargs)
        if prior_samples is not None and (
            isinstance(prior_samples, bool) or not isinstance(prior_samples, int) or prior_samples < 1
        ):
            raise ValueError(f"prior_samples must be a positive int or None, got {prior_samples!r}")
        self.prior_samples = prior_samples

    # ------------------------------------------------------------------ shared pieces
    def _blocks(self, q, k, o, valid, valid_q) -> dict[str, torch.Tensor]:
        """K_o, K_qo, K_ok and L_o = chol(K_o + σ²I), each evaluated once per call.

        # shape: each (B, H, T, T) (cross-attention: K_qo (B, H, T, S), the others (B, H, S, S))"""
        K_o = self.gram(o, "o", valid)
        return dict(
            K_o=K_o,
            K_qo=self.cross(q, o, ("q", "o"), valid_q, valid),
            K_ok=self.cross(o, k, ("o", "k"), valid, valid),
            L_o=cholesky(add_jitter(K_o, self.noise(q)[:, 0, 0]), name="cgp: K_o + sigma^2 I"),
        )

    def _second_order(self, q, k, valid, Kb, valid_q):
        """Adds K_q, K_k and W = L_o⁻¹ K_oq (what the covariance and the regulariser share)."""
        Kb["K_q"] = self.gram(q, "q", valid_q)
        Kb["K_k"] = self.gram(k, "k", valid)
        Kb["W"] = tri_solve(Kb["L_o"], Kb["K_qo"].mT)  # L_o⁻¹ K_oq

    def _covariance(self, s2, Kb):
        """Predictive covariance Σ of App. B, shared by the value columns; also G = A⁻¹ K_oq.

        # shape: (B, H, T, T)"""
        G = tri_solve(Kb["L_o"].mT, Kb["W"], upper=True)  # A⁻¹ K_oq
        L_k = cholesky(add_jitter(Kb["K_k"], s2[:, 0, 0]), name="cgp: K_k + sigma^2 I")
        UG = tri_solve(L_k, Kb["K_ok"].mT @ G)  # L_k⁻¹ K_ko A⁻¹ K_oq
        # K_o = A − σ²I turns App. B into Σ = K_q − Gᵀ(σ²I + K_ok (K_k+σ²I)⁻¹ K_ko) G, G = A⁻¹ K_oq
        Sigma = Kb["K_q"] - s2 * (G.mT @ G) - UG.mT @ UG
        return 0.5 * (Sigma + Sigma.mT), G

    def _regularizer(self, v, valid, nu, s2, Kb, G, valid_q, prior_noise=None):
        """R of eqs. 42–44 per head and value column; ``prior_noise``: the prior samples' ε, drawn here when None
        (:meth:`forward_noise`).  # shape: (B, H, Dv)"""
        L_o, W, K_k = Kb["L_o"], Kb["W"], Kb["K_k"]
        W_k = tri_solve(L_o, Kb["K_ok"])  # L_o⁻¹ K_ok
        # Σ_q = K_q − K_qo A⁻¹ K_oq and Σ_k = K_k − K_ko A⁻¹ K_ok, the conditionals given z_o (eq. 37),
        # each with the observation noise σ²I: the bound of R below (class docstring)
        L_q = cholesky(add_jitter(Kb["K_q"] - W.mT @ W, s2[:, 0, 0]), name="cgp: Sigma_q + sigma^2 I")
        L_kk = cholesky(add_jitter(K_k - W_k.mT @ W_k, s2[:, 0, 0]), name="cgp: Sigma_k + sigma^2 I")
        z = add_jitter(K_k, s2[:, 0, 0]) @ v  # eq. 24: z = (K_k + σ²I) v
        if valid is not None:
            z = z * valid[..., :, None]
        if self.prior_samples is not None:
            B, H, T, _ = Kb["K_o"].shape  # T latent inputs (the keys' tokens)
            L_prior = cholesky(add_jitter(Kb["K_o"], self.jitter), name="cgp: K_o")
            eps = prior_noise
            if eps is None:
                eps = torch.randn(B, H, T, self.prior_samples, dtype=nu.dtype, device=nu.device)
            y = tri_solve(L_o, L_prior @ eps)  # L_o⁻¹ z_o⁽ⁱ⁾, z_o⁽ⁱ⁾ ~ N(0, K_o)  # shape: (B, H, T, P)
            quad = []
            for L, first, Wx in ((L_q, nu, W), (L_kk, z, W_k)):
                # L_q⁻¹ ν and L_q⁻¹ m_q⁽ⁱ⁾ (m_q⁽ⁱ⁾ = K_qo A⁻¹ z_o⁽ⁱ⁾), and the same for k: one solve per factor
                a, b = _solve_parts(L, first, Wx.mT @ y)
                # (1/P) Σ_i ‖a − b_i‖² = ‖a‖² − 2 aᵀ b̄ + (1/P) Σ_i ‖b_i‖²  # shape: (B, H, Dv)
                cross = 2.0 * (a * b.mean(-1, keepdim=True)).sum(-2)
                quad.append(a.pow(2).sum(-2) - cross + b.pow(2).sum(-2).mean(-1, keepdim=True))
        else:
            # E over z_o ~ N(0, K_o) adds tr(Σ⁻¹ H K_o Hᵀ), H K_o Hᵀ = WᵀW − σ² GᵀG for H = K_qo A⁻¹
            G_k = tri_solve(L_o.mT, W_k, upper=True)  # A⁻¹ K_ok
            quad = []
            for first, L, Wx, Gx in ((nu, L_q, W, G), (z, L_kk, W_k, G_k)):
                a, LW, LG = _solve_parts(L, first, Wx.mT, Gx.mT)  # L⁻¹ ν (or z), L⁻¹ Wᵀ, L⁻¹ Gᵀ: one solve
                tr = LW.pow(2).sum((-2, -1)) - s2[:, 0, 0] * LG.pow(2).sum((-2, -1))
                quad.append(a.pow(2).sum(-2) + tr[..., None])
        logdet = logdet_from_cholesky(L_q, valid_q) + logdet_from_cholesky(L_kk, valid)  # shape: (B, H)
        return quad[0] + quad[1] + logdet[..., None]

    @staticmethod
    def _mean(Kb, v):
        # eq. 25, right to left: ν = K_qo (K_o + σ²I)⁻¹ (K_ok v)
        return Kb["K_qo"] @ torch.cholesky_solve(Kb["K_ok"] @ v, Kb["L_o"])  # shape: (B, H, T, Dv)

    def forward_noise(self, queries, v, num_samples, sampling: bool, regulariser: bool) -> tuple:
        """The random numbers a forward of these inputs draws, in the order it draws them: the samples' ε (with
        ``sampling``: :func:`~gpattn.variational._linalg.standard_normal` of the mean's shape) and then the
        regulariser's prior-sample ε (with ``regulariser`` and ``prior_samples``), None for either not drawn. A
        conditional given them (``CGPConditional.given_noise``) draws nothing, so sequences conditioned apart consume
        what the whole batch would, in its order (:class:`gpattn.attention.cgp.CGPAttention`'s recomputed pieces).
        # shape: queries (B, H, T', Dh), v (B, H, T, Dv) -> (B, H, T', Dv) or (P, B, H, T', Dv), (B, H, T, P_o)"""
        (like,) = full_precision(v[:1, :1, :1, :1])  # the conditional's dtype and device
        B, H, T, Dv = v.shape
        sample = standard_normal((B, H, queries.shape[2], Dv), like, num_samples) if sampling else None
        prior = None
        if regulariser and self.prior_samples is not None:
            prior = torch.randn(B, H, T, self.prior_samples, dtype=like.dtype, device=like.device)
        return sample, prior

    # ------------------------------------------------------------------ entry points
    def _condition(self, q, k, o, v, valid, valid_q=None):
        Kb = self._blocks(q, k, o, valid, valid_q)
        return CGPConditional(self, self._mean(Kb, v), valid, Kb, q, k, v, valid_q)

    def _conditional_mean(self, q, k, o, z, valid):
        # eq. 21: E[z_q | z_k] = K_qo (K_o + σ²I)⁻¹ K_ok (K_k + σ²I)⁻¹ z_k
        Kb = self._blocks(q, k, o, valid, valid)
        K_k = self.gram(k, "k", valid)
        L_k = cholesky(add_jitter(K_k, self.noise(q)[:, 0, 0]), name="cgp: K_k + sigma^2 I")
        if valid is not None:
            z = z * valid[..., :, None]
        return self._mean(Kb, torch.cholesky_solve(z, L_k))


class CGPConditional(CorrelatedConditional):
    """One forward pass of exact CGP (``CorrelatedGP.condition``): the blocks and ν; the second-order
    blocks, Σ's Cholesky factor (shared by the value columns and the draws) and R on first use."""

    def __init__(self, gp: CorrelatedGP, nu, valid, blocks, q, k, v, valid_q=None):
        super().__init__(gp, nu, valid, valid_q)
        self._Kb, self._q, self._k, self._v = blocks, q, k, v
        self._G = self._chol = None
        #: (the samples' ε, the prior samples' ε) to use instead of drawing them (:meth:`CorrelatedGP.forward_noise`;
        #: each None: drawn at use)
        self.given_noise = (None, None)

    def _second(self):
        if "K_q" not in self._Kb:
            self.gp._second_order(self._q, self._k, self.valid, self._Kb, self.valid_q)
        return self._Kb

    def _factor(self) -> torch.Tensor:
        """chol(Σ + jitter·I).  # shape: (B, H, T, T)"""
        if self._chol is None:
            Sigma, self._G = self.gp._covariance(self.gp.noise(self._q), self._second())
            self._chol = cholesky(add_jitter(Sigma, self.gp.jitter), name="cgp: predictive covariance")
        return self._chol

    def rsample(self, num_samples=None, generator=None):
        """ν + L_Σ ε: one factor for every value column and draw.
        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        with gp_algebra(self._device):
            eps = self.given_noise[0]
            if eps is None:
                eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)
            return self.mean + matmul_samples(self._factor(), eps)

    def posterior(self) -> MultivariateNormal:
        with gp_algebra(self._device):
            L = self._factor()
            B, H, T, Dv = self.mean.shape
            covar = CholLinearOperator(TriangularLinearOperator(L.unsqueeze(2))).expand(B, H, Dv, T, T)
            return MultivariateNormal(self.mean.transpose(-1, -2), with_policy(covar))  # exact at any T

    def _regularizer(self):
        Kb = self._second()
        G = self._G
        if G is None and self.gp.prior_samples is None:
            G = tri_solve(Kb["L_o"].mT, Kb["W"], upper=True)
        return self.gp._regularizer(
            self._v, self.valid, self.nu, self.gp.noise(self._q), Kb, G, self.valid_q, prior_noise=self.given_noise[1]
        )
