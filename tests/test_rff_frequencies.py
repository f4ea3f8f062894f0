"""sgpa-rff's frequency draws (docs/derivations.md §5f, "Choice: the frequencies' draw"): the i.i.d. Gaussian default
bit for bit as before, and orthogonal random features (Yu et al. 2016) — rows marginally N(0, I), orthogonal within a
block, an unbiased kernel estimate with a lower variance than the i.i.d. draw's at equal R. Float64 Monte Carlo with
tolerances a wrong scaling fails."""

import math

import pytest
import torch

import gpattn
from gpattn.variational.covariances import TrainingQueryCovariance, TrainingSequenceCovariance
from gpattn.variational.frequencies import GaussianFrequencies, OrthogonalFrequencies

F64 = torch.float64


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    yield
    torch.set_default_dtype(previous)


def test_the_default_draw_is_the_former_randn_bit_for_bit():
    """The covariance's and the layer's default Ω (and the phases drawn after it) are the bits ``torch.randn(H, R,
    Dh)`` drew before the draw was an object: checkpoints and float64 references of the default are unchanged."""
    torch.manual_seed(3)
    expected = torch.randn(2, 24, 8)
    phases = 2 * math.pi * torch.rand(2, 24)
    torch.manual_seed(3)
    cov = TrainingQueryCovariance(2, 8, num_features=24, prior_variance=1.0)
    assert isinstance(cov.frequency_draw, GaussianFrequencies)
    assert torch.equal(cov.frequencies, expected) and torch.equal(cov.phases, phases)
    torch.manual_seed(3)
    explicit = TrainingQueryCovariance(2, 8, num_features=24, prior_variance=1.0, frequency_draw=GaussianFrequencies())
    assert torch.equal(explicit.frequencies, expected)


def _rows(draw, heads, R, d, seed=0):
    return draw(heads, R, d, generator=torch.Generator().manual_seed(seed))


def test_orthogonal_rows_are_each_marginally_standard_normal(float64):
    """Over 4,000 independent draws, each of the R = 20 rows (d = 8: two full blocks and one cut to 4 rows) has mean
    0, E[ωωᵀ] = I, ‖ω‖² of a χ²(8) (mean 8, variance 16) and coordinates of kurtosis 3. Rows of a fixed norm √d (no χ
    draw) have the same E[ωωᵀ] and fail the variance of ‖ω‖²; χ(d − 1) norms fail its mean."""
    n, R, d = 4000, 20, 8
    omega = _rows(OrthogonalFrequencies(), n, R, d)  # shape: (n, R, d): n independent draws
    assert omega.shape == (n, R, d) and omega.dtype == F64
    for r in range(R):
        w = omega[:, r]  # shape: (n, d)
        torch.testing.assert_close(w.mean(0), torch.zeros(d), atol=5 / math.sqrt(n), rtol=0)
        torch.testing.assert_close(w.T @ w / n, torch.eye(d), atol=6 * math.sqrt(2 / n), rtol=0)
        sq = w.square().sum(-1)
        assert abs(sq.mean() - d) < 5 * math.sqrt(2 * d / n), (r, sq.mean())
        # the sample variance of a χ²(d): standard error √((μ₄ − σ⁴)/n) = √((12d(d + 4) − 4d²)/n) ≈ 0.47 here
        assert abs(sq.var() - 2 * d) < 0.25 * 2 * d, (r, sq.var())
        kurtosis = (w.pow(4).mean(0) / w.square().mean(0).square()).mean()
        assert abs(kurtosis - 3) < 0.3, (r, kurtosis)


def test_orthogonal_rows_are_orthogonal_within_a_block_and_not_across_blocks(float64):
    """ΩΩᵀ restricted to a block (d rows, the last block cut to R mod d) is diagonal to rounding; rows of different
    blocks are independent draws, far from orthogonal."""
    R, d = 20, 8
    omega = _rows(OrthogonalFrequencies(), 50, R, d)
    for start in range(0, R, d):
        block = omega[:, start:start + d]
        gram = block @ block.mT
        off = gram - torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))
        assert off.abs().max() < 1e-10 * gram.abs().max(), start
    across = (omega[:, :d] @ omega[:, d:2 * d].mT).abs().amax((-2, -1))
    assert across.min() > 0.5, across.min()


def _kernel_estimates(draw, heads, R, d, points, lengthscale):
    """k̂(x_i, x_j) = ψ(x_i)ᵀψ(x_j) of ``heads`` independent draws at the same points (each head one draw).
    # shape: points (N, d) -> (heads, N, N)"""
    torch.manual_seed(0)
    cov = TrainingQueryCovariance(heads, d, num_features=R, lengthscale=lengthscale, prior_variance=1.0,
                                  frequency_draw=draw)
    psi = cov.unit_features(points.expand(1, heads, *points.shape))[0]  # shape: (heads, N, R)
    return psi @ psi.mT


def test_the_kernel_estimate_is_unbiased_and_orthogonal_features_lower_its_variance(float64):
    """Monte Carlo over 6,000 draws at R = 32, d = 16 (two blocks), on fixed points at distances about ℓ: the mean of
    ψ(x)ᵀψ(y) is the RBF kernel exp(−‖x − y‖²/2ℓ²) within 5 standard errors for both draws; the orthogonal draw's
    variance is below the i.i.d. draw's at every pair and by a tenth over the pairs (Yu et al. 2016: rows of a block
    have negatively correlated terms; the random phases' terms are the same in both)."""
    heads, R, d, ell = 6000, 32, 16, 1.5
    points = torch.randn(6, d, generator=torch.Generator().manual_seed(1)) * 0.4
    exact = torch.exp(-torch.cdist(points, points).square() / (2 * ell**2))
    off = ~torch.eye(len(points), dtype=torch.bool)
    variances = {}
    for name, draw in (("iid", GaussianFrequencies()), ("orthogonal", OrthogonalFrequencies())):
        k = _kernel_estimates(draw, heads, R, d, points, ell)
        se = k.std(0) / math.sqrt(heads)
        assert ((k.mean(0) - exact).abs() < 5 * se + 1e-12)[off].all(), (name, (k.mean(0) - exact) / se)
        variances[name] = k.var(0)[off]
    assert (variances["orthogonal"] < variances["iid"]).all(), variances
    assert variances["orthogonal"].mean() < 0.9 * variances["iid"].mean(), variances


def test_the_draw_is_a_layer_option_and_survives_a_state_dict_round_trip():
    """``frequencies="orthogonal"`` (a name of the registry's choices) reaches the covariance of both g forms; a layer
    built under another seed that loads the state dict has the same Ω, phases and features."""
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa-rff", 16, 2, num_features=12, frequencies="orthogonal")
    cov = layer.strategy.covariance
    assert isinstance(cov.frequency_draw, OrthogonalFrequencies)
    gram = cov.frequencies[:, :8] @ cov.frequencies[:, :8].mT  # Dh = 8: the first block
    torch.testing.assert_close(gram, torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1)), atol=1e-4, rtol=0)
    torch.manual_seed(1)
    other = gpattn.build_attention("sgpa-rff", 16, 2, num_features=12, frequencies="orthogonal")
    assert not torch.equal(other.strategy.covariance.frequencies, cov.frequencies)
    other.load_state_dict(layer.state_dict())
    q = torch.randn(3, 2, 5, 8)
    for name in ("frequencies", "phases"):
        assert torch.equal(getattr(other.strategy.covariance, name), getattr(cov, name)), name
    assert torch.equal(other.strategy.covariance.unit_features(q), cov.unit_features(q))
    sequence = gpattn.build_attention("sgpa-rff", 16, 2, recipe="out-of-scope", frequencies="orthogonal")
    assert isinstance(sequence.strategy.covariance, TrainingSequenceCovariance)
    assert isinstance(sequence.strategy.covariance.frequency_draw, OrthogonalFrequencies)


def test_a_bad_draw_names_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"frequencies must be one of \['gaussian', 'orthogonal'\]"):
        gpattn.build_attention("sgpa-rff", 16, 2, frequencies="sobol")
    with pytest.raises(TypeError, match="frequency_draw must be a callable"):
        TrainingQueryCovariance(1, 4, num_features=8, prior_variance=1.0, frequency_draw="orthogonal")
