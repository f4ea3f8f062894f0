"""The random-feature GP's low-rank posterior (gpattn.experiments.sngp.LowRankPosterior, docs/derivations.md §14a,
"Low-rank posterior when N < R"): its v against the explicit float64 inverse of s·I + G at every ridge of the readout's
grid (unit and Laplace weights, nearly collinear and duplicated rows), the form chosen by N (low-rank while N < R/2,
dense from there on, the dense Gram summed as before), one decomposition shared by every ridge, its limits (a training
row, far away), and the fitted state through state_dict: a low-rank round trip, a switch of form on load, and a state
dict saved before the posterior forms (``precision_factor``)."""

import io

import pytest
import torch
import torch.nn as nn

import gpattn
from gpattn.experiments import readout as R
from gpattn.experiments import sngp as S


def _data(n, d=4, seed=1, scale=1.0):
    return scale * torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _explicit(phi, w, ridge, query):
    """φ_qᵀ (s·I + Φᵀ diag(w) Φ)⁻¹ φ_q with an explicit float64 inverse.  # shape: (M, R) -> (M,)"""
    precision = ridge * torch.eye(phi.shape[1], dtype=torch.float64) + phi.T @ (w[:, None] * phi)
    return ((query @ torch.linalg.inv(precision)) * query).sum(-1)


def _layer(d=4, r=64, seed=0, **kw):
    torch.manual_seed(seed)
    gp = S.RandomFeatureGP(d, 3, num_features=r, lengthscale=1.5, input_norm=False, **kw).double()
    with torch.no_grad():  # a trained-looking β: Laplace weights p(1 − p) that differ between rows
        gp.output.weight.normal_(0.0, 3.0)
    return gp


def _double_readout(head, seed, **options):
    return R._new_readout(head, seed, **options).double()


# ----------------------------------------------------------------------------- v against the explicit inverse
@pytest.mark.parametrize("weights", ["laplace", "unit"])
def test_low_rank_variance_is_the_explicit_inverse_at_every_ridge(weights):
    """SNGP's layer fitted on N = 20 < R/2 rows (R = 64): the low-rank form, and at every s of RIDGE_GRID (down to
    10⁻⁴) v equals φᵀ(s·I + Σ wφφᵀ)⁻¹φ from an explicit float64 inverse, near the data and away from it."""
    gp = _layer()
    h, query = _data(20), torch.cat([_data(6, seed=2), _data(3, seed=3, scale=4.0)])
    phi, q = gp.features(h), gp.features(query)
    w = S.laplace_weights(gp.output(phi)) if weights == "laplace" else torch.ones(20, dtype=torch.float64)
    gram = gp.feature_gram(phi, None if weights == "laplace" else w)
    assert isinstance(gram, S.LowRankGram) and gram.basis.shape == (64, 20) and gram.count == 20
    for ridge in R.RIDGE_GRID:
        gp.ridge = ridge
        gp.set_gram(gram)
        assert isinstance(gp.posterior, S.LowRankPosterior)
        torch.testing.assert_close(gp.variance(q), _explicit(phi, w, ridge, q), rtol=1e-9, atol=0)
        torch.testing.assert_close(gp.variance(phi), _explicit(phi, w, ridge, phi), rtol=1e-9, atol=0)


@pytest.mark.parametrize("rows", ["duplicated", "nearly collinear"])
def test_low_rank_variance_with_duplicated_and_nearly_collinear_rows(rows):
    """Rows repeated exactly, or equal up to 10⁻⁹ (so Φ̃ has singular values at rounding level): the zero and tiny
    σ² directions fall to the prior's 1/s, as the explicit inverse says, at every ridge."""
    base = _data(8)
    if rows == "duplicated":
        h = torch.cat([base, base, base[:3]])
    else:
        h = torch.cat([base, base + 1e-9 * _data(8, seed=4), base[:3] + 1e-12])
    gp = _layer()
    phi, q = gp.features(h), gp.features(torch.cat([base[:2], _data(5, seed=5)]))
    ones = torch.ones(h.shape[0], dtype=torch.float64)
    gram = gp.feature_gram(phi, ones)
    assert isinstance(gram, S.LowRankGram) and float(gram.spectrum.min()) < 1e-12 * float(gram.spectrum.max())
    for ridge in R.RIDGE_GRID:
        gp.ridge = ridge
        gp.set_gram(gram)
        torch.testing.assert_close(gp.variance(q), _explicit(phi, ones, ridge, q), rtol=1e-9, atol=0)


@pytest.mark.parametrize("curvature", [R.unit_weights, S.laplace_weights])
def test_the_readout_grid_shares_one_decomposition_and_matches_the_explicit_inverse(curvature, monkeypatch):
    """_ridge_readouts on N < R/2 rows: one SVD (counted) whose V and σ² every ridge's posterior holds (the same
    tensors), each readout's v the explicit inverse's at its s; ridge and Laplace curvature."""
    torch.manual_seed(0)
    head = nn.Linear(4, 3).double()
    h, query = _data(25), _data(7, seed=3, scale=1.3)
    calls, of_rows = [], S.LowRankGram.of_rows
    monkeypatch.setattr(S.LowRankGram, "of_rows", lambda *a: calls.append(1) or of_rows(*a))
    shared = dict(R._ridge_readouts(head, h, R.RIDGE_GRID, seed=5, make=_double_readout, num_features=80,
                                    curvature=curvature))
    assert len(calls) == 1 and list(shared) == list(R.RIDGE_GRID)
    first = shared[R.RIDGE_GRID[0]].gp.posterior
    for ridge, readout in shared.items():
        posterior = readout.gp.posterior
        assert isinstance(posterior, S.LowRankPosterior) and float(posterior.ridge) == ridge
        assert posterior.basis is first.basis and posterior.spectrum is first.spectrum
        phi, q = readout.gp.features(h), readout.gp.features(query)
        w = curvature(head(h)).detach()
        torch.testing.assert_close(readout.variance(query), _explicit(phi, w, ridge, q), rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------- which form, by N
@pytest.mark.parametrize(("n", "form"), [(31, S.LowRankPosterior), (32, S.CholeskyPosterior),
                                         (63, S.CholeskyPosterior), (64, S.CholeskyPosterior),
                                         (90, S.CholeskyPosterior)])
def test_the_form_is_chosen_by_n_against_half_r_and_the_dense_gram_is_summed_as_before(n, form):
    """R = 64: low-rank while N < R/2 = 32, dense from N = 32 on (N = R − 1, N = R, N > R included), whether the rows
    come in one tensor or in batches that cross R/2; the dense G is the batches' Σ √wφᵀ √wφ summed in their order from
    zero, bit for bit (the accumulation before the low-rank form), and v is the explicit inverse's either way."""
    gp = _layer()
    h = _data(n)
    phi = gp.features(h)
    w = S.laplace_weights(gp.output(phi))
    whole, batched = gp.feature_gram(phi), gp.feature_gram(phi.split(7))
    assert type(whole) is type(batched) is (S.LowRankGram if form is S.LowRankPosterior else S.DenseGram)
    assert whole.count == batched.count == n
    if form is S.CholeskyPosterior:
        before = torch.zeros(64, 64, dtype=torch.float64)
        for b, wb in zip(phi.split(7), w.split(7)):
            scaled = b * wb.sqrt().unsqueeze(-1)
            before += scaled.T @ scaled
        assert torch.equal(batched.gram, before)
    q = gp.features(_data(5, seed=6, scale=2.0))
    for gram in (whole, batched):
        gp.set_gram(gram)
        assert type(gp.posterior) is form and int(gp.num_fitted) == n
        torch.testing.assert_close(gp.variance(q), _explicit(phi, w, 1.0, q), rtol=1e-9, atol=0)


def test_the_low_rank_limits_at_a_training_row_and_far_away():
    """Low-rank form, s = 10⁻⁴: at a training row v is at most the leverage 1 (unit weights), far below the prior
    ‖φ‖²/s; far from every training row v is the prior ‖φ‖²/s, up to the random features' cross terms (a far φ has
    about N/R of its norm in the training rows' span: 1 % here)."""
    torch.manual_seed(0)
    head = nn.Linear(2, 3).double()
    h = _data(20, d=2)
    readout = R._new_readout(head, 0, num_features=2000, ridge=1e-4, lengthscale=0.3).double().fit(h)
    assert isinstance(readout.gp.posterior, S.LowRankPosterior)
    prior = (readout.gp.features(h) ** 2).sum(-1) / 1e-4
    v = readout.variance(h)
    assert float(v.max()) <= 1.0 + 1e-9 and float((v / prior).max()) < 1e-3
    far = 100 + _data(5, d=2)
    prior = (readout.gp.features(far) ** 2).sum(-1) / 1e-4
    torch.testing.assert_close(readout.variance(far), prior, rtol=0.05, atol=0)


# ----------------------------------------------------------------------------- the state dict
def _readout_model(seed, n, r=128, ridge=0.01, fit_seed=1):
    torch.manual_seed(seed)
    model = nn.Module()
    model.head = nn.Linear(4, 3).double()
    readout = R.attach_gp_readout(model, seed=seed, num_features=r, ridge=ridge).double()
    if n:
        readout.fit(_data(n, seed=fit_seed))
    return model


def test_a_low_rank_readout_round_trips_through_state_dict_into_any_readout():
    """A readout fitted on N = 40 < R/2 rows saves V (R × N), σ² and s, no R × R factor; a fresh readout (other
    draws, other ridge) whose posterior is the prior, or a dense fit, or a low-rank fit of another N, loads it and
    gives the same v bit for bit (equal samples included); a dense state dict loads back into it too."""
    model = _readout_model(0, 40).double()
    readout = model.head
    readout.set_factor(3.0)
    state = model.state_dict()
    assert state["head.gp.posterior.basis"].shape == (128, 40) and "head.gp.posterior.factor" not in state
    assert float(state["head.gp.posterior.ridge"]) == 0.01
    query = _data(6, seed=7)[:, None, :].expand(6, 3, 4)  # (N, P, D): equal samples
    want = readout.variance(query)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    for fresh in (_readout_model(9, 0, ridge=1.0), _readout_model(9, 100, ridge=1.0), _readout_model(9, 10)):
        fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        assert isinstance(fresh.head.gp.posterior, S.LowRankPosterior) and fresh.head.fitted
        assert torch.equal(fresh.head.variance(query), want) and float(fresh.head.mean_field_factor) == 3.0
        torch.testing.assert_close(fresh.head(query), model.head(query), rtol=0, atol=0)
    dense = _readout_model(2, 100)
    assert isinstance(dense.head.gp.posterior, S.CholeskyPosterior)
    fresh.load_state_dict(dense.state_dict())
    assert isinstance(fresh.head.gp.posterior, S.CholeskyPosterior)
    assert torch.equal(fresh.head.variance(query), dense.head.variance(query))


def test_a_state_dict_saved_before_the_posterior_forms_loads_with_the_same_variance():
    """A state dict of the earlier layout (the Cholesky factor of s·I + G as ``precision_factor``, what a run saved
    before) loads into today's readout and SNGP layer, with an OldVersionWarning naming the key, and gives the v of
    that factor; the prior's √s·I too."""
    dense = _readout_model(3, 100)
    query = _data(5, seed=8)
    want = dense.head.variance(query)
    old = {k.replace("gp.posterior.factor", "gp.precision_factor"): v for k, v in dense.state_dict().items()}
    assert "head.gp.precision_factor" in old and not any("posterior" in k for k in old)
    fresh = _readout_model(4, 20)  # low-rank before the load
    with pytest.warns(gpattn.OldVersionWarning, match="head.gp.precision_factor"):
        fresh.load_state_dict(old)
    assert isinstance(fresh.head.gp.posterior, S.CholeskyPosterior)
    assert torch.equal(fresh.head.variance(query), want)
    gp = _layer(ridge=4.0)  # SNGP's layer, unfitted, in the earlier layout: √s·I
    old = {k: v for k, v in gp.state_dict().items() if not k.startswith("posterior.")}
    old["precision_factor"] = 2.0 * torch.eye(64, dtype=torch.float64)
    fresh = _layer(seed=1)
    with pytest.warns(gpattn.OldVersionWarning, match="precision_factor"):
        fresh.load_state_dict(old)
    phi = fresh.features(_data(5, seed=9))
    torch.testing.assert_close(fresh.variance(phi), (phi * phi).sum(-1) / 4.0, rtol=1e-12, atol=0)
