"""SGPA attention layers (docs/derivations.md §5; Chen & Li, ICLR 2023): thin shims over
:mod:`gpattn.variational.sgpa` (standard) and :mod:`gpattn.variational.sgpa_decoupled` (decoupled).

Each layer has Chen & Li's one shared query-key map W_q = W_k; the encoder-swap recipe's form
(:class:`SeparateMapsSGPAttention`, :class:`SeparateMapsDecoupledSGPAttention`: ``recipe="encoder-swap"`` in
:func:`gpattn.build_attention`) keeps a pretrained layer's separate W_q and W_k (docs/derivations.md §5d)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel

from gpattn.attention._gp import GPAttention
from gpattn.attention.registry import register, resolve
from gpattn.kernels import make_kernel
from gpattn.variational._scale import PRIOR_VARIANCE
from gpattn.variational.sgpa import AmortisedDiagonalVariationalDistribution, SGPAVariationalStrategy
from gpattn.variational.sgpa_decoupled import (
    DecoupledSGPAVariationalStrategy,
    WhitenedGlobalVariationalDistribution,
)

__all__ = [
    "DecoupledSGPAttention",
    "SGPAttention",
    "SeparateMaps",
    "SeparateMapsDecoupledSGPAttention",
    "SeparateMapsSGPAttention",
]


def _kernel(kernel, num_heads: int, head_dim: int, mean_module):
    """The kernel of a spec on the stream's scale; ``kernel=None``: the prior mean's own (its ``default_kernel``,
    docs/derivations.md §5c), and a spec's lengthscale starts where the mean says (Dh^¼ for a mean that attends:
    softmax attention's temperature, §5c, §5e)."""
    spec = mean_module.default_kernel if kernel is None else kernel
    return make_kernel(
        spec, num_heads, head_dim, prior_variance=PRIOR_VARIANCE, lengthscale=mean_module.initial_lengthscale(head_dim)
    )


class _SGPALayer(GPAttention):
    """The query-key maps of the SGPA variants: Chen & Li's shared W_q = W_k, projections ("qk", "v"); the strategy
    reads the keys' projections (``key_inputs``), the queries are the keys."""

    projections = ("qk", "v")
    #: the projections the strategy reads (the keys' map and the values)
    key_inputs = ("qk", "v")
    #: the projection of the keys (the global keys of sgpa-decoupled are mapped through it)
    key_projection = "qk"

    def strategy_inputs(self, x):
        """The keys and the values (with separate maps the queries are read by :meth:`query_inputs`).
        # shape: x (B, T, D) -> (B, H, T, Dh), (B, H, T, Dv)"""
        p = self.project(x)
        return tuple(p[name] for name in self.key_inputs)


class SeparateMaps:
    """Separate query and key maps W_q, W_k (docs/derivations.md §5d), the encoder-swap recipe's form of the SGPA
    variants (a pretrained layer's maps both kept, docs/huggingface.md): projections ("q", "k", "v"), the GP at the
    queries W_q x with the keys W_k x as inducing inputs: the cross-attention conditional (§13) with the same
    tokens on both sides. Per-query masks are refused (§5d): query i is not key i."""

    projections = ("q", "k", "v")
    key_inputs = ("k", "v")
    query_projection = "q"
    key_projection = "k"

    def _condition(self, x, mask, context=None):
        """Self-attention is the cross-attention conditional with ``context = x``."""
        if mask is not None and mask.dim() == 4:
            raise ValueError(
                f"attn_mask: attention {self.name!r} with separate query and key maps (the encoder-swap recipe's form) "
                f"takes only masks that pad (the same excluded keys for every query and head); per-query masks "
                f"(causal, ...) are defined for the shared map, where query i is key i (docs/derivations.md §5d, §11). "
                f"Pass the padding as key_padding_mask, or build the layer with recipe='scratch' (the shared map)"
            )
        if context is not None:
            return super()._condition(x, mask, context)
        # self-attention: keys and values of x (padded keys leave through the mask); the queries of padded
        # positions are placeholders, their inputs zeroed so that no draw depends on what they hold
        return super()._condition(x if mask is None else x.masked_fill(mask[..., None], 0.0), mask, x)


@register("sgpa")
class SGPAttention(_SGPALayer):
    r"""Standard SGPA (Chen & Li (2023) §3.2, docs/derivations.md §5a): each head's output dim d is a sparse variational
    GP whose inducing inputs are the sequence's own keys; the posterior mean is kernel attention
    :math:`K_{qk} v` and the whitened amortised covariance gives :math:`\Sigma_d = L \tilde\Sigma_d L^\top`.
    A symmetric kernel (W_q = W_k: projections ("qk", "v")). Cost O(T³) per (B, H).

    :param kernel: a kernel spec (:mod:`gpattn.kernels`, docs/kernels.md): ``"ard-rbf"`` (the default with
        ``prior_mean="attention"``), ``"exponential"`` (the default with
        ``prior_mean="zero"``: Chen & Li's text kernel), a composition such as
        ``{"name": "sum", "kernels": ["exponential", "ard-rbf"]}``, or a gpytorch ``Kernel`` (batch_shape
        ``(H,)`` or ``()``, ``ard_num_dims`` = Dh; checked here).
    :param jitter: relative jitter of the Cholesky factor (1e-6 suits float32; 0 for float64 checks).
    :param covariance: ``"full"`` (default: exact joint samples; with L shared, as cheap as ``"diag"``)
        or ``"diag"`` (independent tokens), or a covariance object (:mod:`gpattn.variational.covariances`).
    :param prior_mean: ``"attention"`` (default: the GP's prior mean is normalised kernel attention, so the
        posterior mean attends without a per-sequence KL on it and ``kl_seq`` pays only for the amortised
        covariance; docs/derivations.md §5c) or ``"zero"`` (Chen & Li's form: mean :math:`K_{qk} v`, paid by the
        per-sequence KL), or a prior mean module (:mod:`gpattn.variational.means`; the encoder-swap recipe's is
        :class:`~gpattn.variational.means.SoftmaxMean`, softmax attention with the kernel's lengthscale, §5e).

    Loss terms: ``kl_seq`` — the KL, summed over heads and Dv, averaged over the batch (docs/derivations.md §9).

    Masks: any ``attn_mask`` (docs/derivations.md §11). A mask that pads is ``key_padding_mask``; under any
    other (causal, per query, per head) query i is its own sparse GP whose inducing inputs are the keys
    it may attend to: its mean is masked kernel attention, its samples are drawn from its own marginal
    (independent across tokens, for both ``covariance`` settings) and ``kl_seq`` takes the mean of the
    queries' KLs. The causal mask (with key padding) costs what the unmasked layer costs; a general mask
    one factorisation per query, O(T⁴) per (B, H). The mask is read once on the host to tell them apart.
    ``need_weights`` gives no weights.
    """

    per_query_masks = True  # one GP per query (docs/derivations.md §11)
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel | None = None,
        jitter: float = 1e-6,
        covariance: str = "full",
        prior_mean: str = "attention",
        **base,
    ):
        mean_module = resolve("sgpa", "prior_mean", prior_mean)
        super().__init__(embed_dim, num_heads, **base)
        self.strategy = SGPAVariationalStrategy(
            _kernel(kernel, num_heads, self.head_dim, mean_module),
            AmortisedDiagonalVariationalDistribution(num_heads, self.head_dim, self.value_dim),
            jitter=jitter,
            covariance=resolve("sgpa", "covariance", covariance),
            mean_module=mean_module,
            variational_mean=mean_module.variational_mean(),  # q(ũ)'s mean: the one the prior mean pairs with
        )


@register("sgpa", form="separate-maps")
class SeparateMapsSGPAttention(SeparateMaps, SGPAttention):
    """``sgpa`` with separate query and key maps (:class:`SeparateMaps`): the encoder-swap recipe's form; the
    covariance gains the residual K_qq − K_qk K̂_kk⁻¹ K_kq (docs/derivations.md §5d)."""


@register("sgpa-decoupled")
class DecoupledSGPAttention(_SGPALayer):
    r"""Decoupled SGPA (Chen & Li (2023) §3.3–3.4, docs/derivations.md §5b): amortised mean basis from the sequence's
    keys and values plus ``num_global`` global inducing inputs per head, mapped like tokens through
    the layer's own W_qk rows for that head (W_k's with separate maps); whitened S̃_g,d per output dim.

    :param kernel: as for ``sgpa``.
    :param num_global: M global inducing inputs per head (default 16, as in Chen & Li (2023)).
    :param covariance: ``"diag"`` (default, the released code's mode: independent tokens) or
        ``"full"`` (exact joint samples), or a covariance object.
    :param jitter: relative jitter (1e-6 suits float32; 0 for float64 checks).
    :param prior_mean: ``"attention"`` (default: the prior mean is normalised kernel attention over the
        sequence, which replaces the amortised γ-basis; the posterior is m(q) + the global part, and the only
        KL is the global ``kl_global``; docs/derivations.md §5c) or ``"zero"`` (Chen & Li's form, below), or a
        prior mean module (as for ``sgpa``).

    Loss terms (``prior_mean="zero"``): ``kl_seq`` — the γ-part (input-dependent), summed over heads and Dv,
    averaged over the batch; ``kl_global`` — the β-part (global parameters), summed (docs/derivations.md §9).
    With the attention prior mean: ``kl_global`` alone.

    Masks: any ``attn_mask`` (docs/derivations.md §11b). A mask that pads is ``key_padding_mask``; under any
    other (causal, per query, per head) query i's mean basis is the keys it may attend to, while the
    global basis, the covariance and the joint samples are the unmasked layer's; ``kl_seq`` takes the mean
    of the queries' γ-parts. The causal mask costs what the unmasked layer costs; a general mask
    O(T³·Dv) per (B, H). ``need_weights`` gives no weights.
    """

    per_query_masks = True  # query i's mean basis is A_i (docs/derivations.md §11b)
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel | None = None,
        num_global: int = 16,
        covariance: str = "diag",
        jitter: float = 1e-6,
        prior_mean: str = "attention",
        **base,
    ):
        mean_module = resolve("sgpa-decoupled", "prior_mean", prior_mean)
        super().__init__(embed_dim, num_heads, **base)
        if isinstance(num_global, bool) or not isinstance(num_global, int) or num_global < 1:
            raise ValueError(f"num_global must be a positive int, got {num_global!r}")
        self.strategy = DecoupledSGPAVariationalStrategy(
            _kernel(kernel, num_heads, self.head_dim, mean_module),
            WhitenedGlobalVariationalDistribution(num_heads, num_global, self.value_dim),
            torch.randn(num_heads, num_global, embed_dim),
            jitter=jitter,
            covariance=resolve("sgpa-decoupled", "covariance", covariance),
            mean_module=mean_module,
            variational_mean=mean_module.variational_mean(),  # q(ũ)'s mean: the one the prior mean pairs with
        )
        self._qk_offset = self.projection_rows()[self.key_projection].start

    def global_keys(self) -> torch.Tensor:
        """Each head's global keys through that head's rows of W_qk (W_k).  # shape: (H, M, Dh)"""
        H, Dh, D, o = self.num_heads, self.head_dim, self.embed_dim, self._qk_offset
        weight = self.in_proj.weight[o : o + D].view(H, Dh, D)
        bias = None if self.in_proj.bias is None else self.in_proj.bias[o : o + D].view(H, Dh)
        return self.strategy.global_keys(weight, bias)

    def strategy_inputs(self, x):
        """The keys (= queries with the shared map), the values and the global keys.
        # shape: (B, H, T, Dh), (B, H, T, Dv), (H, M, Dh)"""
        return (*super().strategy_inputs(x), self.global_keys())


@register("sgpa-decoupled", form="separate-maps")
class SeparateMapsDecoupledSGPAttention(SeparateMaps, DecoupledSGPAttention):
    """``sgpa-decoupled`` with separate query and key maps (:class:`SeparateMaps`), the global inducing inputs mapped
    through W_k (they are inducing inputs, as the keys; docs/derivations.md §5d): the encoder-swap recipe's form."""
