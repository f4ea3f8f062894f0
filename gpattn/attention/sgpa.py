"""SGPA attention layers (docs/derivations.md §5; Chen & Li, ICLR 2023): thin shims over
:mod:`gpattn.variational.sgpa` (standard) and :mod:`gpattn.variational.sgpa_decoupled` (decoupled)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel

from gpattn.attention._gp import GPAttention
from gpattn.attention.registry import register
from gpattn.kernels import make_kernel
from gpattn.variational._scale import PRIOR_VARIANCE
from gpattn.variational.sgpa import AmortisedDiagonalVariationalDistribution, SGPAVariationalStrategy
from gpattn.variational.sgpa_decoupled import (
    DecoupledSGPAVariationalStrategy,
    WhitenedGlobalVariationalDistribution,
)

__all__ = ["DecoupledSGPAttention", "SGPAttention"]


@register("sgpa")
class SGPAttention(GPAttention):
    r"""Standard SGPA (Chen & Li (2023) §3.2, docs/derivations.md §5a): each head's output dim d is a sparse variational
    GP whose inducing inputs are the sequence's own keys; the posterior mean is kernel attention
    :math:`K_{qk} v` and the whitened amortised covariance gives :math:`\Sigma_d = L \tilde\Sigma_d L^\top`.
    Symmetric kernel (W_q = W_k: projections ("qk", "v")). Cost O(T³) per (B, H).

    :param kernel: a kernel spec (:mod:`gpattn.kernels`, docs/kernels.md): ``"exponential"`` (default,
        text), ``"ard-rbf"`` (images; the legacy ``"rbf"`` means it here), a composition such as
        ``{"name": "sum", "kernels": ["exponential", "ard-rbf"]}``, or a gpytorch ``Kernel`` (batch_shape
        ``(H,)`` or ``()``, ``ard_num_dims`` = Dh; checked here).
    :param jitter: relative jitter of the Cholesky factor (1e-6 suits float32; 0 for float64 checks).
    :param covariance: ``"full"`` (default: exact joint samples; with L shared, as cheap as ``"diag"``)
        or ``"diag"`` (independent tokens).

    Loss terms: ``kl_seq`` — the KL, summed over heads and Dv, averaged over the batch (docs/derivations.md §9).

    Masks: any ``attn_mask`` (docs/derivations.md §11). A mask that pads is ``key_padding_mask``; under any
    other (causal, per query, per head) query i is its own sparse GP whose inducing inputs are the keys
    it may attend to: its mean is masked kernel attention, its samples are drawn from its own marginal
    (independent across tokens, for both ``covariance`` settings) and ``kl_seq`` takes the mean of the
    queries' KLs. The causal mask (with key padding) costs what the unmasked layer costs; a general mask
    one factorisation per query, O(T⁴) per (B, H). The mask is read once on the host to tell them apart.
    ``need_weights`` gives no weights.
    """

    projections = ("qk", "v")
    per_query_masks = True  # one GP per query (docs/derivations.md §11)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel = "exponential",
        jitter: float = 1e-6,
        covariance: str = "full",
        **base,
    ):
        super().__init__(embed_dim, num_heads, **base)
        self.strategy = SGPAVariationalStrategy(
            make_kernel(kernel, num_heads, self.head_dim, prior_variance=PRIOR_VARIANCE, rbf="ard-rbf"),
            AmortisedDiagonalVariationalDistribution(num_heads, self.head_dim, self.value_dim),
            jitter=jitter,
            covariance=covariance,
        )



@register("sgpa-decoupled")
class DecoupledSGPAttention(GPAttention):
    r"""Decoupled SGPA (Chen & Li (2023) §3.3–3.4, docs/derivations.md §5b): amortised mean basis from the sequence's
    keys and values plus ``num_global`` global inducing inputs per head, mapped like tokens through
    the layer's own W_qk rows for that head; whitened S̃_g,d per output dim.

    :param kernel: as for ``sgpa``.
    :param num_global: M global inducing inputs per head (default 16, as in Chen & Li (2023)).
    :param covariance: ``"diag"`` (default, the released code's mode: independent tokens) or
        ``"full"`` (exact joint samples).
    :param jitter: relative jitter (1e-6 suits float32; 0 for float64 checks).

    Loss terms: ``kl_seq`` — the γ-part (input-dependent), summed over heads and Dv, averaged over the
    batch; ``kl_global`` — the β-part (global parameters), summed (docs/derivations.md §9).

    Masks: any ``attn_mask`` (docs/derivations.md §11b). A mask that pads is ``key_padding_mask``; under any
    other (causal, per query, per head) query i's mean basis is the keys it may attend to, while the
    global basis, the covariance and the joint samples are the unmasked layer's; ``kl_seq`` takes the mean
    of the queries' γ-parts. The causal mask costs what the unmasked layer costs; a general mask
    O(T³·Dv) per (B, H). ``need_weights`` gives no weights.
    """

    projections = ("qk", "v")
    per_query_masks = True  # query i's mean basis is A_i (docs/derivations.md §11b)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel = "exponential",
        num_global: int = 16,
        covariance: str = "diag",
        jitter: float = 1e-6,
        **base,
    ):
        super().__init__(embed_dim, num_heads, **base)
        if isinstance(num_global, bool) or not isinstance(num_global, int) or num_global < 1:
            raise ValueError(f"num_global must be a positive int, got {num_global!r}")
        self.strategy = DecoupledSGPAVariationalStrategy(
            make_kernel(kernel, num_heads, self.head_dim, prior_variance=PRIOR_VARIANCE, rbf="ard-rbf"),
            WhitenedGlobalVariationalDistribution(num_heads, num_global, self.value_dim),
            torch.randn(num_heads, num_global, embed_dim),
            jitter=jitter,
            covariance=covariance,
        )
        self._qk_offset = sum(self._proj_widths[: self.projections.index("qk")])

    def global_keys(self) -> torch.Tensor:
        """Each head's global keys through that head's rows of W_qk.  # shape: (H, M, Dh)"""
        H, Dh, D, o = self.num_heads, self.head_dim, self.embed_dim, self._qk_offset
        weight = self.in_proj.weight[o : o + D].view(H, Dh, D)
        bias = None if self.in_proj.bias is None else self.in_proj.bias[o : o + D].view(H, Dh)
        return self.strategy.global_keys(weight, bias)

    def strategy_inputs(self, x):
        """The keys = queries, the values and the global keys.  # shape: (B, H, T, Dh), (B, H, T, Dv), (H, M, Dh)"""
        return (*super().strategy_inputs(x), self.global_keys())
