"""The exponential (dot-product) kernel of SGPA for text (docs/derivations.md "Kernels")."""

from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from gpytorch.kernels import Kernel
from gpytorch.priors import Prior

__all__ = ["ExponentialKernel"]


class ExponentialKernel(Kernel):
    r"""ARD dot-product exponential kernel

    .. math::
        \kappa(a, b) = \sigma^2 \exp\Big(\sum_i a_i b_i / \ell_i^2\Big),

    computed in the log domain as ``exp(log σ² + (a/ℓ)(b/ℓ)ᵀ)``. It is symmetric PSD (a power series
    of the linear kernel with positive coefficients) when both inputs come from one projection.

    :param ard_num_dims: input width (one lengthscale per dimension), e.g. the head width Dh.
    :param batch_shape: e.g. ``torch.Size([H])`` for one set of hyper-parameters per head.
    :param outputscale_prior: a gpytorch ``Prior`` on σ² (``lengthscale_prior`` on ℓ is gpytorch's own keyword).

    The lengthscale is initialised to ``Dh ** 0.25`` so that the exponent is ``q·k / sqrt(Dh)`` as in
    softmax attention; the outputscale σ² to 1.
    """

    has_lengthscale = True

    @property
    def is_stationary(self) -> bool:
        """False: κ(x, x) = σ² exp(‖x/ℓ‖²) depends on x (gpytorch's default reads ``has_lengthscale``)."""
        return False

    def __init__(
        self,
        ard_num_dims: int | None = None,
        batch_shape: torch.Size = torch.Size([]),
        outputscale_prior: Prior | None = None,
        **kwargs,
    ):
        super().__init__(ard_num_dims=ard_num_dims, batch_shape=batch_shape, **kwargs)
        self.register_parameter("raw_outputscale", torch.nn.Parameter(torch.zeros(self.batch_shape)))
        self.register_constraint("raw_outputscale", Positive())
        if outputscale_prior is not None:  # as gpytorch's ScaleKernel registers its own
            if not isinstance(outputscale_prior, Prior):
                raise TypeError(f"outputscale_prior must be a gpytorch Prior, got {type(outputscale_prior).__name__}")
            self.register_prior(
                "outputscale_prior", outputscale_prior, lambda m: m.outputscale, lambda m, v: m._set_outputscale(v)
            )
        self.outputscale = 1.0
        if ard_num_dims is not None:
            self.lengthscale = float(ard_num_dims) ** 0.25

    @property
    def outputscale(self) -> torch.Tensor:
        return self.raw_outputscale_constraint.transform(self.raw_outputscale)

    @outputscale.setter
    def outputscale(self, value) -> None:
        self._set_outputscale(value)

    def _set_outputscale(self, value) -> None:
        if not torch.is_tensor(value):
            value = torch.as_tensor(value, dtype=self.raw_outputscale.dtype)
        value = value.to(self.raw_outputscale).expand_as(self.raw_outputscale)
        self.initialize(raw_outputscale=self.raw_outputscale_constraint.inverse_transform(value))

    # shape: x1 (..., n, d), x2 (..., m, d) -> (..., n, m) or (..., n) with diag
    def forward(self, x1: torch.Tensor, x2: torch.Tensor, diag: bool = False, **params) -> torch.Tensor:
        ell = self.lengthscale  # shape: (*batch, 1, d)
        a = x1 / ell
        b = a if x2 is x1 else x2 / ell  # self-attention: scale once (and once in backward)
        log_s2 = self.outputscale.log()[..., None, None]  # shape: (*batch, 1, 1)
        if diag:
            return torch.exp(log_s2[..., 0] + (a * b).sum(-1))
        return torch.exp((a @ b.transpose(-1, -2)).add_(log_s2))  # in place on the fresh matmul output

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"ExponentialKernel(batch_shape={tuple(self.batch_shape)}, ard_num_dims={self.ard_num_dims})"
