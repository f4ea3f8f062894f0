"""Posterior math of the GP attention variants: one file per strategy, plus the numerics policy."""

from gpattn.variational._linalg import NotPSDError, cholesky, gp_algebra, safe_sqrt

__all__ = [
    "NotPSDError",
    "cholesky",
    "gp_algebra",
    "safe_sqrt",
]
