"""The asymmetric cross-covariance kernel of correlated-GP attention (Bui et al. §3.1–3.2; docs/derivations.md §7).

A canonical GP :math:`z_o \\sim \\mathcal{GP}(0, \\kappa_o)` with a *parameter-free* kernel
:math:`\\kappa_o` generates every process of CGPT by an affine input scaling (Bui et al. eqs. 13–16):
:math:`z_q(x) = \\sigma_q z_o(x W_q)`, :math:`z_k(x) = \\sigma_k z_o(x W_k)`, and the latent
:math:`z_o(x W_o)` itself. Their (cross-)covariances are

.. math::
    \\kappa_{ab}(x, x') = \\sigma_a \\sigma_b\\, \\kappa_o(x W_a, x' W_b), \\qquad a, b \\in \\{q, k, o\\},
    \\quad \\sigma_o = 1,

which is *not* symmetric when :math:`W_a \\ne W_b` (eq. 7). The projections are applied first (by
the attention layer's fused input projection), so the kernel sees the projected points
:math:`\\tilde x = x W_a`, :math:`\\tilde x' = x' W_b`, and on those
:math:`\\kappa_{ab}(\\tilde x, \\tilde x') = \\sigma_a\\sigma_b \\kappa_o(\\tilde x, \\tilde x')
= \\kappa_{ab}(\\tilde x', \\tilde x)` because :math:`\\kappa_o` is symmetric. GPyTorch's lazy path is
therefore exact: ``kernel(q, k, roles=("q", "k")).mT`` re-evaluates ``forward(k, q, roles=("q", "k"))``,
which is :math:`K_{qk}^\\top` (tested). Cholesky / solves accept non-symmetric input silently, so only
the symmetric PSD Gram blocks (:math:`a = b`, same points) are ever factorised; the GP layers
evaluate the blocks densely (:func:`gpattn.kernels.evaluate_kernel`).
"""

from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from gpytorch.kernels import Kernel

from gpattn.kernels._evaluate import evaluate_kernel

__all__ = ["ROLES", "CanonicalRBFKernel", "CrossCovarianceKernel"]

#: the processes of a CGP layer: queries, keys and the canonical (latent) process
ROLES = ("q", "k", "o")


class CanonicalRBFKernel(Kernel):
    r"""The canonical squared-exponential kernel of CGPT (Bui et al. §3.1, §5.1), without parameters:

    .. math::
        \kappa_o(a, b) = \exp\big(-\tfrac12 \lVert a - b \rVert^2\big).

    Lengthscales and output scale live in the projections and in :math:`\sigma_q, \sigma_k` of
    :class:`CrossCovarianceKernel`. ``forward`` returns a dense tensor whose batch shape is the inputs'
    broadcast against ``batch_shape`` (the values do not depend on it: there are no parameters).

    :param batch_shape: e.g. ``torch.Size([H])``, as for any gpytorch kernel.
    """

    has_lengthscale = False

    def __init__(self, batch_shape: torch.Size = torch.Size([]), **kwargs):
        super().__init__(batch_shape=batch_shape, **kwargs)
        # no parameters, so nothing else would remember ``.to(dtype)`` / ``.to(device)``: an empty,
        # non-persistent buffer does (state_dict and checkpoints are unchanged)
        self.register_buffer("_anchor", torch.zeros(*self.batch_shape, 0), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        dtypes = {self._anchor.dtype} | {p.dtype for p in self.parameters()}
        if len(dtypes) > 1:
            raise RuntimeError(f"The kernel's parameters have multiple dtypes: {dtypes}.")
        return dtypes.pop()

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def is_stationary(self) -> bool:
        return True

    @staticmethod
    def squared_norm(x: torch.Tensor) -> torch.Tensor:
        """‖x‖² per point, as :meth:`forward` uses it (pass it as ``sq_norms`` to share it between blocks).
        # shape: (..., n, d) -> (..., n, 1)"""
        return x.pow(2).sum(-1, keepdim=True)

    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True
    def forward(self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, sq_norms=None, **params) -> torch.Tensor:
        """``sq_norms``: ``(‖x1‖², ‖x2‖²)`` of :meth:`squared_norm` where the caller has them (either may be None),
        so that blocks over the same points compute them once (the same values)."""
        if diag:
            K = torch.exp(-0.5 * (x1 - x2).pow(2).sum(-1))
        else:
            # -½‖a − b‖² = a·b − ½‖a‖² − ½‖b‖², clamped at 0 against round-off (κ_o ≤ 1)
            sq_a, sq_b = sq_norms or (None, None)
            sq_a = self.squared_norm(x1) if sq_a is None else sq_a  # shape: (..., n, 1)
            sq_b = sq_a if sq_b is None and x2 is x1 else (self.squared_norm(x2) if sq_b is None else sq_b)
            # in place on the fresh matmul output: one n×m temporary besides the result; the ½ rides as the
            # subtraction's alpha (exact: a power of two), one operator fewer per norm, forward and backward
            expo = x1 @ x2.transpose(-1, -2)
            expo = expo.sub_(sq_a, alpha=0.5).sub_(sq_b.transpose(-1, -2), alpha=0.5).clamp_max_(0.0)
            K = torch.exp(expo)
        event = K.shape[-1:] if diag else K.shape[-2:]
        batch = torch.broadcast_shapes(K.shape[: K.dim() - len(event)], self.batch_shape)
        return K.expand(*batch, *event)  # a view: no copy when the inputs already carry the batch

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"CanonicalRBFKernel(batch_shape={tuple(self.batch_shape)})"


class CrossCovarianceKernel(Kernel):
    r"""Cross-covariances of the correlated GPs :math:`z_q, z_k, z_o` (Bui et al. eqs. 14–16):

    .. math::
        \kappa_{ab}(\tilde x, \tilde x') = \sigma_a \sigma_b\, \kappa_o(\tilde x, \tilde x'),
        \qquad \tilde x = x W_a,\ \tilde x' = x' W_b,\ \sigma_o = 1.

    The inputs are the *projected* points :math:`\tilde x` (the attention layer owns :math:`W_q, W_k,
    W_o`); ``roles=(a, b)`` says which processes they belong to. ``kernel(x1, x2, roles=(a, b))`` is
    gpytorch's lazy kernel tensor, whose ``.mT`` re-evaluates ``forward(x2, x1, roles=(a, b))``: that is
    :math:`K_{ab}^\top`, since :math:`\sigma_a\sigma_b` commute and :math:`\kappa_o` is symmetric.
    :func:`gpattn.kernels.evaluate_kernel` (``forward``) gives the same block dense, now. A block is a
    symmetric PSD Gram matrix only for ``a == b`` on the same points (:meth:`gram`).

    :param canonical: the canonical kernel :math:`\kappa_o`; default :class:`CanonicalRBFKernel`. Any
        gpytorch kernel is accepted (a stationary one keeps the canonical representation; its own
        hyper-parameters, if any, are learned with the layer).
    :param batch_shape: e.g. ``torch.Size([H])``: one :math:`(\sigma_q, \sigma_k)` per head.
    :param sigma_q: initial :math:`\sigma_q > 0`. :param sigma_k: initial :math:`\sigma_k > 0`.
    """

    has_lengthscale = False

    def __init__(
        self,
        canonical: Kernel | None = None,
        batch_shape: torch.Size = torch.Size([]),
        sigma_q: float = 1.0,
        sigma_k: float = 1.0,
        **kwargs,
    ):
        super().__init__(batch_shape=batch_shape, **kwargs)
        if canonical is not None and not isinstance(canonical, Kernel):
            raise ValueError(f"canonical must be a gpytorch.kernels.Kernel or None, got {type(canonical)}")
        for arg, val in (("sigma_q", sigma_q), ("sigma_k", sigma_k)):
            if not float(val) > 0:
                raise ValueError(f"{arg} must be > 0, got {val!r}")
        self.canonical = canonical if canonical is not None else CanonicalRBFKernel()
        for role, init in (("q", sigma_q), ("k", sigma_k)):
            self.register_parameter(f"raw_sigma_{role}", torch.nn.Parameter(torch.zeros(self._batch_shape)))
            self.register_constraint(f"raw_sigma_{role}", Positive())
            self._set_sigma(role, init)

    # ------------------------------------------------------------------ the scales σ_q, σ_k
    def _set_sigma(self, role: str, value) -> None:
        raw = getattr(self, f"raw_sigma_{role}")
        value = torch.as_tensor(value, dtype=raw.dtype).to(raw).expand_as(raw)
        constraint = getattr(self, f"raw_sigma_{role}_constraint")
        self.initialize(**{f"raw_sigma_{role}": constraint.inverse_transform(value)})

    @property
    def sigma_q(self) -> torch.Tensor:
        """:math:`\\sigma_q` (a standard deviation, not a variance).  # shape: batch_shape"""
        return self.raw_sigma_q_constraint.transform(self.raw_sigma_q)

    @sigma_q.setter
    def sigma_q(self, value) -> None:
        self._set_sigma("q", value)

    @property
    def sigma_k(self) -> torch.Tensor:
        """:math:`\\sigma_k` (a standard deviation, not a variance).  # shape: batch_shape"""
        return self.raw_sigma_k_constraint.transform(self.raw_sigma_k)

    @sigma_k.setter
    def sigma_k(self, value) -> None:
        self._set_sigma("k", value)

    def scale(self, role: str) -> torch.Tensor | float:
        """:math:`\\sigma_a` of process ``role`` ("q", "k"; 1 for the canonical "o").  # shape: batch_shape"""
        if role == "q":
            return self.sigma_q
        if role == "k":
            return self.sigma_k
        if role == "o":
            return 1.0
        raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")

    # ------------------------------------------------------------------ dense evaluation
    def canonical_block(self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, sq_norms=None) -> torch.Tensor:
        """:math:`\\kappa_o(x_1, x_2)`, dense (``sq_norms``: :meth:`squared_norms` of x1 and x2, or None).
        # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m)"""
        if type(self.canonical) is CanonicalRBFKernel:
            return self.canonical.forward(x1, x2, diag=diag, sq_norms=sq_norms)
        return evaluate_kernel(self.canonical, x1, x2, diag=diag)

    def squared_norms(self, *xs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """What blocks over the points ``xs`` share (``sq_norms=`` of :meth:`forward`): their squared norms for the
        canonical RBF kernel, None for another canonical kernel.  # shape: each (..., n, d) -> (..., n, 1) or None"""
        if type(self.canonical) is CanonicalRBFKernel:
            return tuple(CanonicalRBFKernel.squared_norm(x) for x in xs)
        return (None,) * len(xs)

    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m), or (..., n) with diag=True
    def forward(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        diag: bool = False,
        roles: tuple[str, str] = ("q", "k"),
        sq_norms=None,
        **params,
    ) -> torch.Tensor:
        """Dense :math:`K_{ab} = \\kappa_{ab}(x_1, x_2)` for ``roles=(a, b)``. ``kernel(x1, x2, roles=...)``
        is gpytorch's lazy version of the same block (its ``.mT`` is :math:`K_{ab}^\\top`);
        :func:`gpattn.kernels.evaluate_kernel` evaluates it now. ``sq_norms``: :meth:`squared_norms` of x1 and x2
        (blocks over the same points share them), or None."""
        if len(roles) != 2 or any(r not in ROLES for r in roles):
            raise ValueError(f"roles must be a pair from {list(ROLES)}, got {roles!r}")
        if x1.shape[-1] != x2.shape[-1]:
            raise ValueError(
                f"x1 and x2 must have the same last dimension, got shapes {tuple(x1.shape)} and {tuple(x2.shape)}"
            )
        if diag and x1.shape[-2] != x2.shape[-2]:
            raise ValueError(f"diag=True needs as many points in x1 as in x2, got {x1.shape[-2]} and {x2.shape[-2]}")
        K = self.canonical_block(x1, x2, diag=diag, sq_norms=sq_norms)
        scales = [s for s in map(self.scale, roles) if torch.is_tensor(s)]  # σ_o = 1 is left out (exact)
        if not scales:
            return K
        scale = scales[0] if len(scales) == 1 else scales[0] * scales[1]
        return K * (scale[..., None] if diag else scale[..., None, None])

    def gram(self, x: torch.Tensor, role: str, sq_norm=None) -> torch.Tensor:
        """The symmetric PSD Gram block :math:`K_{aa} = \\sigma_a^2 \\kappa_o(x, x)` (``sq_norm``: x's entry of
        :meth:`squared_norms`, or None).  # shape: (..., n, n)"""
        return self.forward(x, x, roles=(role, role), sq_norms=(sq_norm, sq_norm))

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"CrossCovarianceKernel(canonical={self.canonical!r}, batch_shape={tuple(self.batch_shape)})"
