"""GP layers start on the scale of the residual stream (gpattn.variational._scale, docs/derivations.md §9).

At initialisation, on LayerNorm-ed inputs, the norm per real token of a GP layer's posterior-mean
output and of a sample's deviation from it must lie in a stated band of the input's norm, for T from 1
to 512 and with padding. Before this was pinned, sgpa's mean was 3.4–22× and kep-svgp's 3.7–5× the
input, and every GP variant's spread 0.5–2.6× (the exact ELBO then collapsed the layers).
"""

import pytest
import torch

import gpattn

GP_VARIANTS = [n for n in gpattn.list_attention() if gpattn.build_attention(n, 8, 2).is_gp]
#: the bands (fractions of the LayerNorm-ed input's norm per token)
MEAN_BAND = (0.01, 1.0)
SPREAD_BAND = (0.03, 0.5)
D, H = 128, 4


def _scale(layer, x, mask, draws=6):
    real = torch.ones(x.shape[:2]) if mask is None else (~mask).float()

    def per_token(t):
        return float((t.norm(dim=-1) * real).sum() / real.sum())

    with torch.no_grad():
        with gpattn.deterministic():
            mean = layer(x, mask)
        diag = layer.diagnostics()
        spread = torch.stack([layer(x, mask) - mean for _ in range(draws)]).pow(2).mean(0).sqrt()
    ref = per_token(x)
    return per_token(mean) / ref, per_token(spread) / ref, diag, per_token(mean), ref


def test_every_gp_variant_is_covered():
    assert set(GP_VARIANTS) == {"cgp", "kep-svgp", "scgp", "sgpa", "sgpa-decoupled", "sgpa-rff"}


#: sgpa-rff's training noise is conditioned on its own batch's queries (docs/derivations.md §5f), so its training
#: spread starts below the band by design; tests/test_sgpa_rff.py checks its prior and training spreads
@pytest.mark.parametrize("T", [1, 16, 128, 512])
@pytest.mark.parametrize("name", [n for n in GP_VARIANTS if n != "sgpa-rff"])
def test_output_mean_and_spread_start_on_the_input_scale(name, T):
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, D, H)
    B = 2
    x = torch.nn.functional.layer_norm(torch.randn(B, T, D), (D,))
    mask = None
    if T > 1:  # the second sequence is padded to a third of its length
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[1, max(1, T // 3) :] = True
    mean_ratio, spread_ratio, diag, mean_norm, in_norm = _scale(layer, x, mask)
    assert MEAN_BAND[0] <= mean_ratio <= MEAN_BAND[1], (name, T, mean_ratio)
    assert SPREAD_BAND[0] <= spread_ratio <= SPREAD_BAND[1], (name, T, spread_ratio)
    # the layer's own diagnostics (gpattn.experiments.diagnostics) measure the same per-token norms
    assert diag["spread_norm"] == 0  # deterministic(): no sample was drawn
    torch.testing.assert_close(float(diag["mean_norm"]), mean_norm, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(float(diag["input_norm"]), in_norm, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", GP_VARIANTS)
def test_diagnostics_spread_is_the_sample_deviation(name):
    torch.manual_seed(1)
    layer = gpattn.build_attention(name, 32, 2)
    x = torch.nn.functional.layer_norm(torch.randn(3, 7, 32), (32,))
    with torch.no_grad():
        with gpattn.deterministic():
            mean = layer(x)
        torch.manual_seed(5)
        y = layer(x)
        diag = layer.diagnostics()
    torch.testing.assert_close(float(diag["spread_norm"]), float((y - mean).norm(dim=-1).mean()), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(float(diag["mean_norm"]), float(mean.norm(dim=-1).mean()), rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # prediction (eval mode) skips the measurement
        layer.eval()(x)
    assert layer.diagnostics() == {}


# ----------------------------------------------------------------------------- scale_prior
def _prior_variances(layer, q):
    """κ(q, q) on the diagonal of every prior the layer's GP has at tokens ``q``."""
    from gpattn.kernels._evaluate import evaluate_kernel

    strategy = layer.strategy
    if hasattr(getattr(strategy, "covariance", None), "unit_features"):  # sgpa-rff: σ² ψ(q)ᵀψ(q)
        cov = strategy.covariance
        return [cov.outputscale[:, None] * cov.unit_features(q).square().sum(-1)]
    if hasattr(strategy, "covar"):  # the correlated GPs: K_q = σ_q² κ_o, K_k = σ_k² κ_o
        return [evaluate_kernel(strategy.covar, q, q, roles=(r, r)).diagonal(dim1=-2, dim2=-1) for r in "qk"]
    return [evaluate_kernel(layer.kernel, q, q).diagonal(dim1=-2, dim2=-1)]


@pytest.mark.parametrize("name", [n for n in GP_VARIANTS if n != "kep-svgp"])
def test_scale_prior_multiplies_the_prior_variance_and_keeps_its_shape(name):
    """scale_prior(c): every prior variance at a token times c (float64, exact up to rounding), the
    correlations unchanged; a bad factor is refused before anything changes."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 16, 2).double()
    q = torch.randn(3, 2, 5, 8, dtype=torch.float64)
    before = _prior_variances(layer, q)
    for bad in (0, -1.0, float("nan"), True, "2"):
        with pytest.raises(ValueError, match="factor must be a finite number > 0"):
            layer.scale_prior(bad)
    layer.scale_prior(0.3)
    for b, a in zip(before, _prior_variances(layer, q)):
        torch.testing.assert_close(a, 0.3 * b, rtol=1e-10, atol=0)


def test_scale_prior_of_kep_svgp_multiplies_its_outputscale():
    """kep-svgp's prior p(u_c) = N(0, σ²Λ²): scale_prior(c) multiplies σ² (Λ, in its mean too, is untouched)."""
    layer = gpattn.build_attention("kep-svgp", 16, 2)
    before, lam = float(layer.strategy.prior_variance), layer.strategy.ksvd.lam.detach().clone()
    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        layer.scale_prior(-1.0)
    layer.scale_prior(0.5)
    assert float(layer.strategy.prior_variance) == pytest.approx(0.5 * before, rel=1e-6)
    torch.testing.assert_close(layer.strategy.ksvd.lam, lam, rtol=0, atol=0)


def test_scale_prior_variance_of_kernel_compositions():
    """A sum scales every term, a product one factor, a ScaleKernel its outputscale: κ(x, x) times c for
    each; a kernel with no outputscale is refused with the fix."""
    from gpytorch.kernels import AdditiveKernel, ProductKernel, RBFKernel, ScaleKernel

    from gpattn.kernels import ExponentialKernel, scale_prior_variance
    from gpattn.kernels._evaluate import evaluate_kernel

    x = torch.randn(4, 3, dtype=torch.float64)
    kernels = [
        ScaleKernel(RBFKernel()),
        ExponentialKernel(),
        AdditiveKernel(ScaleKernel(RBFKernel()), ExponentialKernel()),
        ProductKernel(RBFKernel(), ScaleKernel(RBFKernel())),
        ProductKernel(ScaleKernel(RBFKernel()), ExponentialKernel()),  # one factor's scale, not both
    ]
    for k in kernels:
        k.double()
        before = evaluate_kernel(k, x, x)
        scale_prior_variance(k, 0.25)
        torch.testing.assert_close(evaluate_kernel(k, x, x), 0.25 * before, rtol=1e-10, atol=0)
    for k in (RBFKernel(), AdditiveKernel(RBFKernel(), ScaleKernel(RBFKernel()))):
        with pytest.raises(ValueError, match="wrap it in gpytorch.kernels.ScaleKernel"):
            scale_prior_variance(k, 0.25)
