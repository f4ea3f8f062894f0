r"""Prior mean functions of the GP attention variants, in GPyTorch's ``mean_module`` idiom
(docs/derivations.md §5c).

A GP prior GP(m, κ) with a mean function m pays in its KL only for the posterior's deviation from m.
The SGPA variants take ``prior_mean``:

* ``"attention"`` (default): m is :class:`AttentionMean`, the normalised kernel attention of the
  sequence (the Nadaraya–Watson kernel smoother with the GP's own kernel)

  .. math:: m(q_i) = \frac{\sum_{j \in A_i} \kappa(q_i, k_j)\, v_j}{\sum_{j \in A_i} \kappa(q_i, k_j)},

  which for the exponential kernel is softmax attention with the kernel's (ARD) temperature. The
  amortised, informative part of the posterior lives in the prior mean, which is deterministic given the
  sequence, so no per-sequence KL is paid for attending; the GP's uncertainty sits on top of it.
* ``"zero"``: the papers' form (Chen & Li 2023): a zero prior mean, the amortised mean basis paid for by
  the per-sequence KL.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpattn._settings import is_validating

__all__ = ["PRIOR_MEANS", "AttentionMean", "check_prior_mean"]

#: the prior means of the SGPA variants: normalised kernel attention (default) or zero (the papers')
PRIOR_MEANS = ("attention", "zero")


def check_prior_mean(prior_mean) -> str:
    """``prior_mean`` must be one of :data:`PRIOR_MEANS`."""
    if prior_mean not in PRIOR_MEANS:
        raise ValueError(
            f"prior_mean must be one of {list(PRIOR_MEANS)} ('attention': normalised kernel attention as the GP's "
            f"prior mean, docs/derivations.md §5c; 'zero': the paper's form), got {prior_mean!r}"
        )
    return prior_mean


class AttentionMean(nn.Module):
    r"""m(q_i) = Σ_{j∈A_i} κ(q_i, k_j) v_j / Σ_{j∈A_i} κ(q_i, k_j): normalised kernel attention with the
    GP's own kernel (docs/derivations.md §5c). It takes the Gram matrix the strategy has already evaluated,
    so it costs one row normalisation and one product. The kernel must be positive (exponential, RBF,
    Matérn, their sums and products with positive scales); with ``gpattn.validation()`` on, a Gram entry
    ≤ 0 on an allowed key is an error.

    A query with no allowed key (A_i = ∅) gets m = 0. (A plain ``nn.Module`` in the role of a
    ``gpytorch.means.Mean``, whose ``__call__`` takes one input: this mean reads the keys and values too.)
    """

    def forward(self, gram: torch.Tensor, values: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
        """# shape: gram (B, H, T, T) = κ(q_i, k_j), values (B, H, T, Dv),
        excluded broadcastable to gram (True = key j not in A_i) or None -> (B, H, T, Dv)"""
        weights = gram if excluded is None else gram.masked_fill(excluded, 0.0)
        if is_validating() and bool((weights < 0).any()):  # reads the device: opt-in
            raise ValueError(
                "prior_mean='attention' needs a kernel with positive values (it normalises the kernel's rows into "
                "attention weights); this kernel gives negative ones: use prior_mean='zero'"
            )
        total = weights.sum(-1, keepdim=True)  # shape: (B, H, T, 1)
        return (weights @ values) / torch.where(total > 0, total, 1.0)
