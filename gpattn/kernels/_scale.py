"""The kernel-level rules of the initial prior scale: the lengthscales a kernel built from a name starts
at, and the check of a prior-variance factor. Why these values: :mod:`gpattn.variational._scale`, which
re-exports them beside the variants' own constants (the kernels sit below the variational layer and
import nothing from it)."""

from __future__ import annotations

import math

__all__ = ["attention_lengthscale", "check_prior_factor", "exponential_lengthscale"]


def exponential_lengthscale(head_dim: int) -> float:
    """ℓ = √Dh: the exponent q·k/ℓ² of a projected LayerNorm-ed token pair stays ≲ 1/3."""
    return math.sqrt(head_dim)


def attention_lengthscale(head_dim: int) -> float:
    """ℓ = Dh^¼ for a kernel whose rows are the attention prior mean (docs/derivations.md §5c): the
    normalised exponential kernel is then softmax(q·k/√Dh), softmax attention's temperature."""
    return float(head_dim) ** 0.25


def check_prior_factor(factor) -> float:
    """``factor`` of a prior-variance scaling (``scale_prior``): a finite number > 0."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    return float(factor)
