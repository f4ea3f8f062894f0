"""Posterior math of the GP attention variants: one file per strategy, plus the numerics policy.

The extension API (docs/new_variant.md) is exported here: a new variant's conditional derives from
:class:`AmortisedConditional` and its strategy from :class:`AmortisedVariationalStrategy`; its numerics use
:func:`gp_algebra` (exact algebra, autocast off), :func:`full_precision`, :func:`cholesky` (bounded jitter,
:class:`NotPSDError`), :func:`standard_normal` and :func:`matmul_samples` (P draws from one factor), and
its per-sequence loss terms :func:`sequence_mean`.
"""

from gpattn.variational._linalg import (
    NotPSDError,
    cholesky,
    full_precision,
    gp_algebra,
    matmul_samples,
    safe_sqrt,
    standard_normal,
)
from gpattn.variational._strategy import AmortisedConditional, AmortisedVariationalStrategy, sequence_mean

__all__ = [
    "AmortisedConditional",
    "AmortisedVariationalStrategy",
    "NotPSDError",
    "cholesky",
    "full_precision",
    "gp_algebra",
    "matmul_samples",
    "safe_sqrt",
    "sequence_mean",
    "standard_normal",
]
