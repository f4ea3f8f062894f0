"""STO-TRANS: Gumbel-softmax stochastic attention (docs/derivations.md §3; Pei et al. eqs. 7–11, Table 1)."""

from __future__ import annotations

import math

import torch

from gpattn.attention._call import Attended
from gpattn.attention._gumbel import _check_tau, gumbel_attention
from gpattn.attention.base import AttentionBase
from gpattn.attention.registry import register

__all__ = ["STO_PRESETS", "StochasticAttention"]

#: Pei et al.'s STO-TRANS settings: IMDB Table 1 (τ = 1 and τ = 40, the two reported rows) and CoLA
#: Table 2 (τ = 1). The released code samples soft attention in both (``hard=False``, the default).
STO_PRESETS: dict[str, dict[str, object]] = {
    "cola": {"tau": 1.0},
    "imdb-tau1": {"tau": 1.0},
    "imdb-tau40": {"tau": 40.0},
}


@register("sto")
class StochasticAttention(AttentionBase):
    r"""Stochastic self-attention with Gumbel-softmax weights (STO-TRANS, Pei et al., AAAI 2022).

    Per head (Pei et al. eqs. 9–11, docs/derivations.md §3):

    .. math::
        \hat A = \mathrm{softmax}\big((q k^\top + G)/\tau\big), \quad
        G_{ij} \overset{iid}{\sim} \mathrm{Gumbel}(0, 1), \qquad \text{out} = \hat A\, v,

    with padded keys set to :math:`-\infty` *before* the noise, so that they get exactly zero weight
    and each row renormalises over the real keys. Samples in train and eval mode; under
    ``gpattn.deterministic()`` the noise is dropped: :math:`\mathrm{softmax}(q k^\top/\tau)\, v`
    (also with ``hard=True``; see :mod:`gpattn.attention._gumbel`).

    :param tau: temperature :math:`\tau`; it replaces the :math:`\sqrt{D_h}` of softmax attention
        (Pei et al. eq. 7). ``None`` (default) means :math:`\tau = \sqrt{D_h}`, where the layer's
        noise-free attention *is* softmax attention (the paper reports that τ near
        :math:`\sqrt{D/H}` recovers vanilla accuracy). Pei et al. use τ ∈ {1, 40} on IMDB and τ = 1 on
        CoLA: see :data:`STO_PRESETS`.
    :param hard: straight-through one-hot samples (forward one-hot of
        :math:`\arg\max_j (q_i k_j^\top + G_{ij})`, which is Categorical(softmax(q_i kᵀ)) whatever τ;
        backward through the soft sample).

    Attributes: ``store_weights`` (default False) — when True every forward keeps
    ``last_weights``, the detached attention weights :math:`\hat A` of shape (B, H, T, T) (rows of
    sequences whose keys are all padding are meaningless: their output is zeroed). Storing takes
    the explicit path, which forms :math:`\hat A`; otherwise the soft path runs fused in
    ``scaled_dot_product_attention``, ``last_weights`` is None, and a forward writes nothing on the
    layer. ``layer.attend(x, need_weights=True)`` also returns the weights of one forward.
    """

    projections = ("q", "k", "v")
    is_gp = False
    per_query_masks = True  # any attn_mask: excluded keys leave the row (docs/derivations.md §11)
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)
    stochastic = True

    def __init__(self, embed_dim: int, num_heads: int, *, tau: float | None = None, hard: bool = False, **base):
        super().__init__(embed_dim, num_heads, **base)
        self.tau = math.sqrt(self.head_dim) if tau is None else _check_tau(tau, "tau")
        if not isinstance(hard, bool):
            raise ValueError(f"hard must be True or False, got {hard!r}")
        self.hard = hard
        self.store_weights = False
        self.last_weights: torch.Tensor | None = None

    def _attend(self, call):
        pq, pk = self.project_call(call)  # each: (B, H, T or S, Dh)
        out, weights = gumbel_attention(
            pq["q"], pk["k"], pk["v"], self.tau, mask=call.mask, hard=self.hard, sample=call.sampling,
            return_weights=self.store_weights or call.need_weights,
        )
        if self.store_weights or self.last_weights is not None:  # opt-in record (a debugging aid)
            self.last_weights = weights.detach() if self.store_weights else None  # no older forward's lingers
        return Attended(out, weights=weights if call.need_weights else None)  # shape: (B, H, T, Dv)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tau={self.tau:g}, hard={self.hard}"

    def __getstate__(self):
        state = super().__getstate__()
        state["last_weights"] = None
        return state
