r"""How ``sgpa-rff``'s random Fourier features draw their frequencies Ω (docs/derivations.md §5f, "Choice: the
frequencies' draw"): an object the covariance receives
(:class:`~gpattn.variational.covariances.TrainingQueryCovariance`'s ``frequency_draw=``), called once when the
covariance is built; the drawn Ω is a buffer of the covariance (saved with the model), the object keeps no state.

* :class:`GaussianFrequencies` — every entry of Ω i.i.d. N(0, 1) (Rahimi & Recht 2007): the default.
* :class:`OrthogonalFrequencies` — orthogonal random features (Yu et al. 2016): Ω stacks d × d blocks of a uniformly
  random orthogonal matrix, each row rescaled by an independent χ(d) norm, so that every row is marginally N(0, I)
  (the kernel estimate stays unbiased) and the rows of a block are orthogonal (its variance is lower).
"""

from __future__ import annotations

import math

import torch

__all__ = ["GaussianFrequencies", "OrthogonalFrequencies"]


class GaussianFrequencies:
    """Ω ~ N(0, I): each of the H·R rows an independent standard normal vector in R^d, drawn as ``torch.randn(H, R,
    d)`` from the global generator (or ``generator``) — the draw of every ``sgpa-rff`` model so far, the same bits
    under the same seed."""

    def __repr__(self) -> str:
        return "GaussianFrequencies()"

    def __call__(
        self, num_heads: int, num_features: int, dim: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Ω per head.  # shape: -> (H, R, d)"""
        return torch.randn(num_heads, num_features, dim, generator=generator)


class OrthogonalFrequencies:
    r"""Orthogonal random features (Yu et al. 2016): per head, ⌈R/d⌉ independent d × d blocks, each Q = the Q factor
    of a d × d standard normal matrix with the signs of R's diagonal moved into it (then Q is uniformly distributed
    on the orthogonal group), its rows scaled by independent χ(d) norms (each the norm of a fresh d-dimensional
    standard normal vector); the blocks stacked and the last one cut to R rows. Every row is marginally N(0, I) and
    the rows of a block are orthogonal (docs/derivations.md §5f, "Choice: the frequencies' draw")."""

    def __repr__(self) -> str:
        return "OrthogonalFrequencies()"

    def __call__(
        self, num_heads: int, num_features: int, dim: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Ω per head.  # shape: -> (H, R, d)"""
        blocks = math.ceil(num_features / dim)
        gaussian = torch.randn(num_heads, blocks, dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Haar: Q diag(sign(diag R)) (QR's sign convention alone biases the distribution, Mezzadri 2007)
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]
        norms = torch.randn(num_heads, blocks, dim, dim, generator=generator, dtype=torch.float64).norm(dim=-1)
        rows = q.mT * norms[..., None]  # shape: (H, blocks, d, d): row i of block b is ρ_bi · (Q_b)ᵀ's row i
        return rows.reshape(num_heads, blocks * dim, dim)[:, :num_features].to(torch.get_default_dtype())
