"""H-STO-TRANS: hierarchical stochastic attention over learnable centroids and values
(docs/derivations.md §4; Pei et al. eqs. 14–17, Algorithm 1, Proposition 3.1, Tables 1–2)."""

from __future__ import annotations

import torch
import torch.nn as nn

from gpattn.attention._call import Attended
from gpattn.attention._gumbel import _check_tau, gumbel_attention, gumbel_softmax
from gpattn.attention.base import AttentionBase
from gpattn.attention.registry import register

__all__ = ["H_STO_PRESETS", "HierarchicalStochasticAttention", "centroid_attention", "hierarchical_gumbel_attention"]

#: Pei et al.'s H-STO-TRANS settings. IMDB (Table 1): τ1 = 1, τ2 ∈ {20, 30}, soft/soft as the released
#: IMDB code. CoLA (Table 2): τ1 = τ2 = 1; ``"cola"`` keeps our soft/soft default, ``"cola-released"``
#: the released CoLA code's hard/hard straight-through sampling. c = 2 centroids everywhere (the
#: released default ``k_centroid=2``; the paper does not state c).
H_STO_PRESETS: dict[str, dict[str, object]] = {
    "cola": {"tau1": 1.0, "tau2": 1.0},
    "cola-released": {"tau1": 1.0, "tau2": 1.0, "hard_centroids": True, "hard_values": True},
    "imdb-tau20": {"tau1": 1.0, "tau2": 20.0},
    "imdb-tau30": {"tau1": 1.0, "tau2": 30.0},
}

_CLUSTER = ("key", "query")


def centroid_attention(
    x: torch.Tensor,
    centroids: torch.Tensor,
    tau: float,
    *,
    hard: bool = False,
    sample: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Attention of every token over the centroids, :math:`\hat a_c = \mathcal G(x C/\tau)` (eq. 14).

    # shape: x (B, H, T, Dh), centroids (Dh, c) or (H, Dh, c) -> (B, H, T, c)

    With ``sample=False`` this is the noise-free :math:`\mathrm{softmax}(x C/\tau)` of Proposition 3.1:
    :math:`\|\mathcal G(k_i C/\tau) - \mathcal G(k_j C/\tau)\|_2 \le \|k_i - k_j\|_2 \|C\|_2/\tau`
    (softmax is 1-Lipschitz; in fact ½-Lipschitz, by Popoviciu's inequality on its Jacobian).
    """
    return gumbel_softmax(x @ centroids, tau, hard=hard, sample=sample, generator=generator)


def hierarchical_gumbel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    centroids: torch.Tensor,
    *,
    tau1: float = 1.0,
    tau2: float = 1.0,
    mask: torch.Tensor | None = None,
    hard_centroids: bool = False,
    hard_values: bool = False,
    cluster: str = "key",
    sample: bool = True,
    return_weights: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""Pei et al. Algorithm 1 for one layer, all heads at once.

    # shape: q, k (B, H, T, Dh), v (B, H, T, Dv), centroids (Dh, c) or (H, Dh, c), mask (B, T) bool or
    # a per-query (B or 1, H or 1, T, T) bool (True = excluded; the value step only)
    # -> out (B, H, T, Dv), value weights (B, H, T, T) or None, centroid weights (B, H, T, c)

    ``cluster="key"`` (eqs. 14–17): :math:`\hat a_c = \mathcal G(k C/\tau_1)`,
    :math:`\hat k = \hat a_c C^\top`, :math:`\hat a_v = \mathcal G(q \hat k^\top/\tau_2)` (padded keys
    at :math:`-\infty` before the noise), out :math:`= \hat a_v v`. ``cluster="query"`` applies the
    centroid step to the queries instead (Pei et al., "Why perform clustering on key heads?").
    The centroid noise is drawn before the value noise.
    """
    if cluster not in _CLUSTER:
        raise ValueError(f"cluster must be one of {_CLUSTER}, got {cluster!r}")
    explicit = return_weights or (hard_values and sample)
    source = k if cluster == "key" else q
    a_c = centroid_attention(source, centroids, tau1, hard=hard_centroids, sample=sample, generator=generator)
    if explicit:
        # q k̂ᵀ = (q C) â_cᵀ (resp. q̂ kᵀ = â_c (k C)ᵀ): a rank-c product, T²·c instead of T²·Dh
        if cluster == "key":
            q2, k2 = q @ centroids, a_c  # shape: (B, H, T, c) each
        else:
            q2, k2 = a_c, k @ centroids
    else:
        # fused path: form k̂ = â_c Cᵀ (T·c·Dh) so that scaled_dot_product_attention keeps its fused
        # kernel (with a head width of c = 2 it falls back to a slower path: docs/benchmarks.md)
        mixed = a_c @ centroids.mT  # shape: (B, H, T, Dh)
        q2, k2 = (q, mixed) if cluster == "key" else (mixed, k)
    out, a_v = gumbel_attention(
        q2, k2, v, tau2, mask=mask, hard=hard_values, sample=sample, return_weights=return_weights,
        generator=generator,
    )
    return out, a_v, a_c


@register("h-sto")
class HierarchicalStochasticAttention(AttentionBase):
    r"""Hierarchical stochastic self-attention (H-STO-TRANS, Pei et al., AAAI 2022; docs/derivations.md §4).

    Per head, with learnable centroids :math:`C \in \mathbb R^{D_h \times c}` (Pei et al. eqs. 14–17):

    .. math::
        \hat a_c = \mathcal G(k C/\tau_1) \in \mathbb R^{T \times c}, \quad
        \hat k = \hat a_c C^\top, \quad
        \hat a_v = \mathcal G(q \hat k^\top/\tau_2) \in \mathbb R^{T \times T}, \quad
        \text{out} = \hat a_v v,

    where :math:`\mathcal G` is the Gumbel-softmax (:mod:`gpattn.attention._gumbel`): padded keys at
    :math:`-\infty` before the noise, no :math:`1/\sqrt{D_h}` (the temperatures play its role).
    Samples in train and eval mode; under ``gpattn.deterministic()`` both steps are the noise-free
    soft attentions :math:`\mathrm{softmax}(\cdot/\tau)`, whatever ``hard_*``.

    :param num_centroids: c (default 2, the released code's ``k_centroid``; Pei et al. do not state it).
    :param tau1: centroid temperature τ1 (default 1, Pei et al. Table 2).
    :param tau2: value temperature τ2 (default 1, Table 2; IMDB uses 20 or 30: :data:`H_STO_PRESETS`).
    :param hard_centroids: straight-through one-hot centroid assignments (released CoLA code: True).
    :param hard_values: straight-through one-hot value attention (released CoLA code: True).
    :param cluster: ``"key"`` (eqs. 14–16) or ``"query"`` (the centroid step on q instead).
    :param per_head_centroids: one C per head, shape (H, Dh, c); default one C shared by all heads
        (**Choice** of docs/derivations.md §4, as the released code).

    ``centroids`` are initialised U(−½, ½) as in the released code. Attributes: ``store_weights``
    (default False) — when True every forward keeps ``last_weights`` (B, H, T, T), the detached
    value attention :math:`\hat a_v`, and ``last_centroid_weights`` (B, H, T, c), the detached
    :math:`\hat a_c` (taking the explicit path); otherwise both are None and a forward writes nothing on
    the layer. ``layer.attend(x, need_weights=True)`` returns one forward's :math:`\hat a_v`.
    """

    projections = ("q", "k", "v")
    is_gp = False
    per_query_masks = True  # any attn_mask: excluded keys leave the row (docs/derivations.md §11)
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)
    stochastic = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_centroids: int = 2,
        tau1: float = 1.0,
        tau2: float = 1.0,
        hard_centroids: bool = False,
        hard_values: bool = False,
        cluster: str = "key",
        per_head_centroids: bool = False,
        **base,
    ):
        super().__init__(embed_dim, num_heads, **base)
        if isinstance(num_centroids, bool) or not isinstance(num_centroids, int) or num_centroids < 1:
            raise ValueError(f"num_centroids must be a positive int, got {num_centroids!r}")
        for name, val in (
            ("hard_centroids", hard_centroids),
            ("hard_values", hard_values),
            ("per_head_centroids", per_head_centroids),
        ):
            if not isinstance(val, bool):
                raise ValueError(f"{name} must be True or False, got {val!r}")
        if cluster not in _CLUSTER:
            raise ValueError(f"cluster must be one of {_CLUSTER}, got {cluster!r}")
        self.num_centroids = num_centroids
        self.tau1 = _check_tau(tau1, "tau1")
        self.tau2 = _check_tau(tau2, "tau2")
        self.hard_centroids = hard_centroids
        self.hard_values = hard_values
        self.cluster = cluster
        self.per_head_centroids = per_head_centroids
        shape = (num_heads, self.head_dim, num_centroids) if per_head_centroids else (self.head_dim, num_centroids)
        self.centroids = nn.Parameter(torch.empty(shape).uniform_(-0.5, 0.5))  # shape: ([H,] Dh, c)
        self.store_weights = False
        self.last_weights: torch.Tensor | None = None
        self.last_centroid_weights: torch.Tensor | None = None

    def _attend(self, call):
        pq, pk = self.project_call(call)  # each: (B, H, T or S, Dh)
        out, a_v, a_c = hierarchical_gumbel_attention(
            pq["q"], pk["k"], pk["v"], self.centroids.to(call.x.dtype),
            tau1=self.tau1, tau2=self.tau2, mask=call.mask, hard_centroids=self.hard_centroids,
            hard_values=self.hard_values, cluster=self.cluster, sample=call.sampling,
            return_weights=self.store_weights or call.need_weights,
        )
        if self.store_weights or self.last_weights is not None:  # opt-in record (a debugging aid)
            stored = (a_v.detach(), a_c.detach()) if self.store_weights else (None, None)  # none of an older forward
            self.last_weights, self.last_centroid_weights = stored
        return Attended(out, weights=a_v if call.need_weights else None)  # shape: (B, H, T, Dv)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_centroids={self.num_centroids}, tau1={self.tau1:g}, "
            f"tau2={self.tau2:g}, hard_centroids={self.hard_centroids}, hard_values={self.hard_values}, "
            f"cluster={self.cluster!r}, per_head_centroids={self.per_head_centroids}"
        )

    def __getstate__(self):
        state = super().__getstate__()
        state["last_weights"] = None
        state["last_centroid_weights"] = None
        return state
