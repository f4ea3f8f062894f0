"""Helpers shared by test_cgp.py and test_scgp.py (not a test module: no ``test_`` prefix)."""

import torch


def make_qkov(seed, b, h, t, dh, dv, scale):
    """Seeded float64 per-head inputs: q, k, o ~ scale · N(0, 1) (b, h, t, dh) and v ~ N(0, 1) (b, h, t, dv)."""
    g = torch.Generator().manual_seed(seed)
    q, k, o = (scale * torch.randn(b, h, t, dh, generator=g, dtype=torch.float64) for _ in range(3))
    v = torch.randn(b, h, t, dv, generator=g, dtype=torch.float64)
    return q, k, o, v


def assert_padding_equals_truncated(gp, q, k, o, v, padded, *, garbage_scale, atol):
    """Padded tokens are removed from every basis: with ``garbage_scale`` · N(0, 1) in the ``padded``
    positions of the single sequence (b = 1), the mean, covariance block and regulariser of the real
    tokens equal a run on the sequence without them (rtol 1e-9; ``atol`` on mean and covariance,
    1e-9 on the regulariser), and the mean is 0 at the padded positions.
    # shape: q, k, o (1, H, T, Dh), v (1, H, T, Dv)"""
    mask = torch.zeros(1, q.shape[2], dtype=torch.bool)
    mask[0, list(padded)] = True
    real = (~mask[0]).nonzero()[:, 0]
    q2, k2, o2, v2 = (t.clone() for t in (q, k, o, v))
    for t in (q2, k2, o2, v2):
        t[:, :, mask[0]] = garbage_scale * torch.randn_like(t[:, :, mask[0]])  # garbage in the padded tokens
    full = gp.condition(q2, k2, o2, v2, mask)
    cut = gp.condition(*(t[:, :, real] for t in (q, k, o, v)))
    torch.testing.assert_close(full.mean[:, :, real], cut.mean, rtol=1e-9, atol=atol)
    assert full.mean[:, :, mask[0]].abs().max() == 0
    torch.testing.assert_close(full.regularizer(), cut.regularizer(), rtol=1e-9, atol=1e-9)
    cov_full = gp.posterior(q2, k2, o2, v2, mask).covariance_matrix[..., real, :][..., real]
    cov_cut = gp.posterior(*(t[:, :, real] for t in (q, k, o, v))).covariance_matrix
    torch.testing.assert_close(cov_full, cov_cut, rtol=1e-9, atol=atol)


# ------------------------------------------------------------------ layers the dense references compare against
from gpattn.attention.cgp import CGPAttention  # noqa: E402
from gpattn.variational.means import CorrelatedSeparateSoftmaxMean, CorrelatedSoftmaxMean  # noqa: E402

#: the correlated GPs' softmax means by the names they had for both variants; now "softmax" is cgp's and
#: "softmax-separate" scgp's, and each variant takes the other's mean as an object (a fresh one per layer: it keeps its
#: temperature)
MEANS = {"softmax": CorrelatedSoftmaxMean, "softmax-separate": CorrelatedSeparateSoftmaxMean}


def mean_option(mean: str):
    """``prior_mean=`` for a mean named in :data:`MEANS` (a fresh object), or ``"zero"`` as it is."""
    return MEANS[mean]() if mean in MEANS else mean


class ExactCGP(CGPAttention):
    """cgp whose regulariser is its exact expectation over z_o (the strategy's ``prior_samples=None``): the form the
    dense references compare against (once the layer's option; the library layer draws 10 samples)."""

    def _strategy(self, **options):
        return super()._strategy(**options, prior_samples=None)


class SeparateMeanExactCGP(ExactCGP):
    """:class:`ExactCGP` with the separate softmax mean (scgp's, an object for cgp)."""

    def __init__(self, embed_dim, num_heads, **options):
        super().__init__(embed_dim, num_heads, **{"prior_mean": CorrelatedSeparateSoftmaxMean(), **options})
