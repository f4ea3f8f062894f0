"""The GP readout (gpattn.experiments.readout, docs/derivations.md §14a): its variance against float64 brute force
(the explicit inverse in feature space and the GP posterior in kernel space), the median lengthscale, its limits
(λ = 0 is the head bit for bit, the prior far away, the leverage at the training points), λ chosen on the validation
NLL against a closed-form optimum, the fitted state through state_dict, bad input, and ``+gpreadout`` in compare."""

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.spatial.distance import pdist

from gpattn.experiments import compare as C
from gpattn.experiments import readout as R
from gpattn.experiments.data import Split
from gpattn.experiments.sngp import DenseGram, laplace_weights
from gpattn.experiments.training import TrainConfig, load_run_with_data, predict
from gpattn.models import ViTClassifier


def _data(n=60, d=6, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _readout(d=6, c=3, r=40, seed=0, **kw):
    torch.manual_seed(seed)
    head = nn.Linear(d, c).double()
    with torch.no_grad():
        head.weight.normal_(0.0, 2.0)
    return R.GPReadout(head, num_features=r, **kw).double()


def _phi(readout, h):
    """√(2/R) cos(W h + b), written out from the readout's draws (no input norm)."""
    w, b = readout.gp.feature_weight.double(), readout.gp.feature_bias.double()
    return math.sqrt(2.0 / w.shape[0]) * torch.cos(h @ w.T + b)


# ----------------------------------------------------------------------------- the variance
@pytest.mark.parametrize("curvature", ["ridge", "laplace"])
def test_variance_is_the_float64_brute_force_posterior_variance(curvature):
    weights = R.unit_weights if curvature == "ridge" else laplace_weights
    readout = _readout(ridge=0.7, curvature=weights)
    h, query = _data(60), _data(9, seed=2) * 1.5
    readout.fit(h)
    assert readout.fitted and int(readout.gp.num_fitted) == 60
    phi, q = _phi(readout, h), _phi(readout, query)
    w = weights(h @ readout.head.weight.double().T + readout.head.bias.double())  # (N,)
    precision = 0.7 * torch.eye(40, dtype=torch.float64) + phi.T @ torch.diag(w) @ phi
    want = ((q @ torch.linalg.inv(precision)) * q).sum(-1)  # explicit inverse
    torch.testing.assert_close(readout.variance(query), want, rtol=1e-10, atol=1e-12)
    if curvature == "ridge":  # the same number in kernel space: (k(x,x) − k_xᵀ (K + sI)⁻¹ k_x) / s, K = ΦΦᵀ
        k_xx, k_x, K = (q * q).sum(-1), phi @ q.T, phi @ phi.T
        gp = (k_xx - (k_x * torch.linalg.solve(K + 0.7 * torch.eye(60, dtype=torch.float64), k_x)).sum(0)) / 0.7
        torch.testing.assert_close(readout.variance(query), gp, rtol=1e-9, atol=1e-12)


def test_median_lengthscale_scales_the_same_draws():
    h = _data(80)
    fitted, unfitted = _readout(seed=3), _readout(seed=3)
    fitted.fit(h)
    ell = float(np.median(pdist(h.numpy())))  # every row: N ≤ MEDIAN_ROWS
    assert float(fitted.lengthscale) == pytest.approx(ell, rel=1e-12)
    torch.testing.assert_close(fitted.gp.feature_weight * ell, unfitted.gp.feature_weight, rtol=1e-12, atol=0)
    fitted.fit(2 * h)  # a refit rescales from the current ℓ, not from the unit draws twice
    torch.testing.assert_close(fitted.gp.feature_weight * 2 * ell, unfitted.gp.feature_weight, rtol=1e-12, atol=0)
    given = _readout(seed=3, lengthscale=0.5).fit(h)
    assert float(given.lengthscale) == 0.5
    torch.testing.assert_close(given.gp.feature_weight * 0.5, unfitted.gp.feature_weight, rtol=1e-12, atol=0)


def test_variance_limits_far_away_and_at_the_training_points():
    """Far from the data v is the prior's φᵀφ/s; with R ≥ N and s → 0 it is the leverage 1 at a training point,
    while the prior variance 1/s grows without bound; in between, larger far than near."""
    h = _data(20, d=2)
    readout = _readout(d=2, r=400, ridge=1e-8, lengthscale=0.3).fit(h)
    torch.testing.assert_close(readout.variance(h), torch.ones(20, dtype=torch.float64), rtol=0, atol=1e-4)
    far = 100 + _data(5, d=2)
    q = _phi(readout, far)
    prior = (q * q).sum(-1) / 1e-8
    torch.testing.assert_close(readout.variance(far), prior, rtol=0.05, atol=0)  # RFF cross-terms O(1/√R)
    readout = _readout(d=2, r=400, ridge=1.0).fit(_data(200, d=2))
    near, far = readout.variance(_data(50, d=2, seed=5)), readout.variance(20 + _data(50, d=2, seed=6))
    assert float(far.min()) > 0.5 > 0.25 > float(near.max())  # prior ≈ 1/s = 1 far away


def test_factor_zero_is_the_head_bit_for_bit_and_positive_factor_is_the_mean_field_rule():
    readout = _readout()
    h = _data(30)
    torch.testing.assert_close(readout(h), readout.head(h), rtol=0, atol=0)  # unfitted, λ = 0
    readout.fit(h)
    torch.testing.assert_close(readout(h), readout.head(h), rtol=0, atol=0)  # fitted, λ = 0
    readout.set_factor(3.0)
    query = 4 * _data(7, seed=3)
    want = readout.head(query) / torch.sqrt(1 + 3.0 * readout.variance(query)).unsqueeze(-1)
    torch.testing.assert_close(readout(query), want, rtol=1e-12, atol=0)
    assert not torch.equal(readout(query), readout.head(query))


def _vit(seed=0, **kw):
    torch.manual_seed(seed)
    return ViTClassifier(3, image_shape=(1, 8, 8), patch_size=4, embed_dim=16, num_heads=2, num_layers=1, **kw)


def _split(n, seed):
    g = torch.Generator().manual_seed(seed)
    return Split(torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g), None)


def test_model_with_readout_predicts_the_head_at_factor_zero_and_round_trips_through_state_dict():
    model, train = _vit(), _split(40, 1)
    x = _split(9, 2).inputs
    before = model.eval()(x, num_samples=2)
    readout = R.attach_gp_readout(model, seed=4, num_features=64)
    model.train()
    R.fit_gp_readout(model, train, batch_size=16)
    assert model.training and readout.fitted and int(readout.gp.num_fitted) == 40  # the mode restored
    torch.testing.assert_close(model.eval()(x, num_samples=2), before, rtol=0, atol=0)  # λ = 0: the head
    readout.set_factor(10.0)
    after = model(x, num_samples=2)
    assert not torch.allclose(after, before)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    fresh = _vit(seed=7)  # other weights, other random features, another ridge: everything from the state dict
    R.attach_gp_readout(fresh, seed=8, num_features=64, ridge=0.5)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert fresh.head.fitted and float(fresh.head.mean_field_factor) == 10.0
    torch.testing.assert_close(fresh.eval()(x, num_samples=2), after, rtol=0, atol=0)
    factor = readout.gp.posterior.factor.clone()  # N = 40 ≥ R/2: the dense form
    R.fit_gp_readout(fresh, train, batch_size=16)  # a refit of the loaded readout: its own ridge, ℓ and draws
    torch.testing.assert_close(fresh.head.gp.posterior.factor, factor, rtol=1e-10, atol=1e-10)


def test_readout_split_is_what_the_model_predicts_with_a_sample_axis():
    """MC dropout samples the pooled features: (P, B, D) at the head; the split's head logits and inputs, read out
    at λ, are the model's own prediction at λ (same random draws), with the readout attached or not."""
    model, train, val = _vit(dropout=0.3, mc_dropout=True), _split(30, 1), _split(11, 2)
    torch.manual_seed(5)
    plain = R.readout_split(model, val, num_samples=3, batch_size=4)
    readout = R.attach_gp_readout(model, num_features=32)
    R.fit_gp_readout(model, train)
    readout.set_factor(2.0)
    torch.manual_seed(5)
    logits, h = R.readout_split(model, val, num_samples=3, batch_size=4)
    assert logits.shape == (11, 3, 3) and h.shape == (11, 3, 16)
    torch.testing.assert_close((logits, h), plain, rtol=0, atol=0)  # the head's own logits, whatever λ
    variance = readout.variance(h)
    assert variance.shape == (11, 3) and float(variance.std(1).max()) > 0  # the samples' features differ
    torch.manual_seed(5)
    want = predict(model, val, num_samples=3, batch_size=4)
    from gpattn.experiments.sngp import mean_field_logits

    torch.testing.assert_close(mean_field_logits(logits, variance, 2.0).float(), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- λ on validation
def test_factor_selection_finds_the_closed_form_optimum():
    """Two classes, logits (10, 0) and v = 1 on every row, 88 % labelled 0: the NLL of softmax(t·logits) is least
    where σ(10 t) = 0.88, t = 1/√(1 + λ), so λ* = (10 / logit(0.88))² − 1 ≈ 24.2: the grid's 24 wins."""
    n = 100
    logits = torch.tensor([10.0, 0.0]).expand(n, 1, 2).clone()
    labels = torch.cat([torch.zeros(88), torch.ones(12)]).long()
    lam_star = (10 / math.log(0.88 / 0.12)) ** 2 - 1
    assert 23 < lam_star < 25
    grid = (0.0, 1.0, 10.0, 20.0, 24.0, 30.0, 100.0)
    best, scores = R.select_mean_field_factor(logits, torch.ones(n, 1), labels, grid)
    assert best == 24.0
    for lam, score in scores.items():  # each NLL by hand
        t = 10 / math.sqrt(1 + lam)
        want = -(0.88 * math.log(1 / (1 + math.exp(-t))) + 0.12 * math.log(1 / (1 + math.exp(t))))
        assert score == pytest.approx(want, rel=1e-9)
    # unlabelled rows (−1) are left out; a tie goes to the smaller λ
    best, _ = R.select_mean_field_factor(
        torch.cat([logits, logits[:5]]), torch.ones(n + 5, 1), torch.cat([labels, -torch.ones(5).long()]), grid
    )
    assert best == 24.0
    best, _ = R.select_mean_field_factor(logits, torch.zeros(n, 1), labels, (5.0, 0.0, 1.0))  # v = 0: all tie
    assert best == 0.0


class _FeatureModel(nn.Module):
    """The smallest gpattn-style classifier: the inputs are the pooled features, ``head`` the last layer."""

    def __init__(self, head):
        super().__init__()
        self.head, self.num_classes = head, head.out_features

    def forward(self, x, key_padding_mask=None, num_samples=1):
        from gpattn.models._blocks import sample_logits

        return sample_logits(self.head(x), num_samples)


@torch.no_grad()
def test_readout_predictions_choose_ridge_and_factor_as_brute_force_does():
    """Three confident clusters; validation rows between them carry random labels, so the NLL rewards shrinking
    them and how much depends on s: the chosen (s, λ) is the argmin of the validation NLL computed here with explicit
    inverses, the split's logits are the head's read out there, and the readout sits on the model at that choice."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 4.0], [-4.0, -2.0], [4.0, -2.0]])
    y = torch.arange(3).repeat(40)
    train = centres[y] + 0.5 * torch.randn(120, 2, generator=g)
    y_val = torch.randint(0, 3, (60,), generator=g)
    val = torch.cat([centres[y_val[:30]] + 0.5 * torch.randn(30, 2, generator=g), 2 * torch.randn(30, 2, generator=g)])
    test = 3 * torch.randn(25, 2, generator=g)
    head = nn.Linear(2, 3)
    with torch.no_grad():
        head.weight.copy_(2 * centres)
        head.bias.zero_()
    bundle = SimpleNamespace(splits={"train": Split(train, y, None), "val": Split(val, y_val, None),
                                     "test": Split(test, torch.zeros(25).long(), None)})
    model = _FeatureModel(head)
    preds, chosen = R.readout_predictions(model, bundle, ["test"], 2, seed=3, num_features=256)
    # brute force, float64: the readout's draws at the median ℓ, v by explicit inverses, the NLL by hand
    unit = R._new_readout(head, 3, num_features=256).gp
    w, b = unit.feature_weight.double() / float(np.median(pdist(train.numpy()))), unit.feature_bias.double()

    def phi(x):
        return math.sqrt(2 / 256) * torch.cos(x.double() @ w.T + b)

    mu = head(val).double()
    brute = {}
    for ridge in R.RIDGE_GRID:
        inv = torch.linalg.inv(ridge * torch.eye(256, dtype=torch.float64) + phi(train).T @ phi(train))
        v = ((phi(val) @ inv) * phi(val)).sum(-1)
        for lam in R.FACTOR_GRID:
            logp = torch.log_softmax(mu / torch.sqrt(1 + lam * v).unsqueeze(-1), -1)
            brute[(ridge, lam)] = float(-logp[torch.arange(60), y_val].mean())
    best = min(brute, key=brute.get)  # dict order: s as RIDGE_GRID, then λ ascending: ties keep the earlier
    assert (chosen["ridge"], chosen["mean_field_factor"]) == best and best[1] > 0
    assert chosen["val_nll"][f"{best[0]:g}"][f"{best[1]:g}"] == pytest.approx(brute[best], rel=1e-6)
    per_ridge = [min(v for (r, _), v in brute.items() if r == ridge) for ridge in R.RIDGE_GRID]
    assert max(per_ridge) - min(per_ridge) > 1e-3  # s matters here: a wrong choice of s is seen
    assert isinstance(model.head, R.GPReadout) and float(model.head.mean_field_factor) == best[1]
    assert model.head.gp.ridge == best[0]
    torch.testing.assert_close(model.head.gp.feature_bias, unit.feature_bias, rtol=0, atol=0)  # the seed's draws
    inv = torch.linalg.inv(best[0] * torch.eye(256, dtype=torch.float64) + phi(train).T @ phi(train))
    v_test = ((phi(test) @ inv) * phi(test)).sum(-1)
    want = head(test).double() / torch.sqrt(1 + best[1] * v_test).unsqueeze(-1)
    torch.testing.assert_close(preds["test"]["logits"], want.float().unsqueeze(1).expand(-1, 2, -1), rtol=1e-4,
                               atol=1e-5)
    # no OOD validation split: the own score is v at the readout's s
    assert chosen["score_ridge"] == best[0] and chosen["score_val_auroc"] == {}
    torch.testing.assert_close(preds["test"]["own_scores"]["gp-variance"], v_test, rtol=1e-4, atol=1e-6)
    # with one (far rows, labels -1): the score's s is choose_score_ridge's, λ and s of the prediction unchanged
    bundle.splits["ood_val"] = Split(8 + torch.randn(20, 2, generator=g), -torch.ones(20).long(), None)
    model = _FeatureModel(head)
    again, with_ood = R.readout_predictions(model, bundle, ["test"], 2, seed=3, num_features=256)
    scorer, aurocs = R.choose_score_ridge(head, train, val.unsqueeze(1), bundle.splits["ood_val"].inputs.unsqueeze(1),
                                          seed=3, num_features=256)
    assert with_ood["score_val_auroc"] == aurocs and with_ood["score_ridge"] == float(scorer.ridge)
    assert (with_ood["ridge"], with_ood["mean_field_factor"]) == best
    torch.testing.assert_close(again["test"]["logits"], preds["test"]["logits"], rtol=0, atol=0)
    torch.testing.assert_close(again["test"]["own_scores"]["gp-variance"],
                               R.gp_variance_score(scorer, test.unsqueeze(1)), rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- bad input
def test_errors_name_the_argument():
    readout = _readout()
    with pytest.raises(ValueError, match="not fitted"):
        readout.variance(_data(3))
    with pytest.raises(ValueError, match="not fitted"):
        readout.set_factor(1.0)
    readout.fit(_data(20))
    with pytest.raises(ValueError, match=r"h must have shape \(\.\.\., D=6\)"):
        readout(_data(3, d=5))
    with pytest.raises(ValueError, match=r"h must have shape \(\.\.\., D=6\)"):
        readout.fit(_data(3, d=5))
    with pytest.raises(ValueError, match="training features"):
        readout.fit(_data(4)[0])
    with pytest.raises(ValueError, match="mean_field_factor"):
        readout.set_factor(-1.0)
    with pytest.raises(ValueError, match="all equal"):
        _readout().fit(torch.ones(5, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="head must be an nn.Linear"):
        R.GPReadout(nn.Sequential(nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="curvature"):
        R.GPReadout(nn.Linear(3, 2), curvature="laplace")
    model = _vit()
    with pytest.raises(ValueError, match="attach_gp_readout"):
        R.fit_gp_readout(model, _split(5, 0))
    R.attach_gp_readout(model)
    with pytest.raises(ValueError, match="already"):
        R.attach_gp_readout(model)
    with pytest.raises(ValueError, match="grid"):
        R.select_mean_field_factor(torch.zeros(2, 1, 2), torch.zeros(2, 1), torch.zeros(2).long(), ())
    with pytest.raises(ValueError, match="mean_field_factor"):
        R.select_mean_field_factor(torch.zeros(2, 1, 2), torch.zeros(2, 1), torch.zeros(2).long(), (0.0, -1.0))
    with pytest.raises(ValueError, match="no labelled row"):
        R.select_mean_field_factor(torch.zeros(2, 1, 2), torch.zeros(2, 1), -torch.ones(2).long())
    with pytest.raises(ValueError, match="ridges"):
        R.readout_predictions(_vit(), None, [], 1, ridges=())
    with pytest.raises(ValueError, match=r"model.head must be an nn.Linear \(a trained"):
        R.readout_predictions(model, None, [], 1)  # its readout attached already
    with pytest.raises(ValueError, match="choose one"):
        C.parse_variant("softmax+gpreadout+laplace")
    with pytest.raises(ValueError, match=r"\+gpreadout"):
        C.parse_variant("softmax+gpreadot")


# ----------------------------------------------------------------------------- the harness
def test_compare_gpreadout_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "NUM_FEATURES", 512)  # the default's 4096 features cost this tiny model 20 s
    spec = C.parse_variant("softmax+gpreadout+ts")
    assert spec.gpreadout and spec.ts and spec.run_name == "softmax"  # post hoc: the softmax run itself
    base = TrainConfig(dataset="digits", embed_dim=16, num_heads=2, num_layers=1, epochs=1, batch_size=32, lr=5e-3,
                       pooling="mean", patch_size=4, num_samples=2, progress=False)
    fits = []
    fit = C._readout_predictions
    monkeypatch.setattr(C, "_readout_predictions", lambda *args: fits.append(args[1]) or fit(*args))
    C.compare("softmax,softmax+gpreadout,softmax+gpreadout+ts", [0], tmp_path, base, progress=False, log=lambda s: None,
              ood_scores=("msp", "gp-variance"))
    assert len(fits) == 1  # +gpreadout and +gpreadout+ts share the run's one fit
    saved = json.loads((tmp_path / "results.json").read_text())
    # the readout's own score: a number of the readout's rows, "–" in the plain run's row (a score it lacks)
    assert "ood_auroc_gp_variance" not in saved["softmax"]["0"]["ood"]
    for spec in ("softmax+gpreadout", "softmax+gpreadout+ts"):
        row = saved[spec]["0"]["ood"]
        assert 0 <= row["ood_auroc_gp_variance"] <= 1 and row["ood_matched_auroc_gp_variance"] is not None
        assert row["cnll"] > 0
    table = (tmp_path / "report.md").read_text().split("## ood")[1].split("## ")[0]
    assert "ood_auroc_gp_variance |" in table and "cnll" in table and "uniform label" in table
    plain = next(ln for ln in table.splitlines() if ln.startswith("| softmax |"))
    assert plain.rstrip(" |").endswith("–"), plain
    chosen = saved["softmax+gpreadout"]["0"]["readout"]
    with_ts = saved["softmax+gpreadout+ts"]["0"]
    assert with_ts["readout"] == chosen and "temperature" in with_ts
    assert chosen["mean_field_factor"] in R.FACTOR_GRID and chosen["ridge"] in R.RIDGE_GRID
    flat = {(float(s), float(g)): v for s, row in chosen["val_nll"].items() for g, v in row.items()}
    assert set(flat) == {(s, float(f"{g:g}")) for s in R.RIDGE_GRID for g in R.FACTOR_GRID}
    assert flat[(chosen["ridge"], float(f"{chosen['mean_field_factor']:g}"))] == min(flat.values())
    assert math.isfinite(saved["softmax+gpreadout"]["0"]["ood"]["ood_auroc"])
    assert "`+gpreadout`" in (tmp_path / "report.md").read_text()
    # the numbers are the run's model with the readout fitted on the training split at the chosen s and λ
    folder = tmp_path / "runs" / "softmax" / "seed0"
    cfg, model, bundle, _ = load_run_with_data(folder)
    readout = R.attach_gp_readout(model, seed=0, ridge=chosen["ridge"])
    R.fit_gp_readout(model, bundle.splits["train"])
    readout.set_factor(chosen["mean_field_factor"])
    key = bundle.eval_splits["in_domain"]
    run_preds = torch.load(folder / "predictions.pt", weights_only=True)
    preds, again = C._readout_predictions(cfg, folder, bundle, {key: {**run_preds[key], "kept": 1}})
    assert preds[key]["kept"] == 1 and torch.equal(preds[key]["labels"], run_preds[key]["labels"])
    assert again == chosen
    torch.testing.assert_close(predict(model, bundle.splits[key], cfg.num_samples), preds[key]["logits"], rtol=1e-5,
                               atol=1e-6)


# ----------------------------------------------------------------------------- the readout's own OOD score
def _kernel_space_variance(readout, h_train, query, ridge):
    """The GP posterior variance by an explicit kernel-matrix inverse, float64: (k(x,x) − k_xᵀ (K + sI)⁻¹ k_x) / s,
    k(x, x') = φ(x)ᵀφ(x') written out from the readout's draws."""
    phi, q = _phi(readout, h_train), _phi(readout, query)
    K = phi @ phi.T
    k_x = phi @ q.T  # (N, M)
    inv = torch.linalg.inv(K + ridge * torch.eye(K.shape[0], dtype=torch.float64))
    return ((q * q).sum(-1) - (k_x * (inv @ k_x)).sum(0)) / ridge


def test_gp_variance_score_is_the_brute_force_gp_posterior_variance():
    from gpattn.experiments import metrics as M

    assert set(R.OWN_SCORES) == set(M.OWN_SCORE_NAMES) <= set(M.OOD_SCORE_NAMES)  # one table, every name scored
    readout = _readout(ridge=0.3, r=50)
    h, query = _data(40), _data(12, seed=4) * 1.3
    readout.fit(h)
    samples = torch.stack([query, query + 0.2 * _data(12, seed=5)], dim=1)  # (N, P=2, D): the mean of v over P
    want = 0.5 * sum(_kernel_space_variance(readout, h, samples[:, p], 0.3) for p in range(2))
    got = R.OWN_SCORES["gp-variance"](readout, samples)
    assert got.dtype == torch.float64 and got.shape == (12,)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gp_variance_separates_far_inputs_and_its_ridge_is_chosen_on_the_ood_validation_split():
    """Training features in a ball; in-domain validation rows from the same ball, OOD rows on a shell further out: v
    must rank every OOD row above every in-domain row (AUROC 1). On a nearer shell the ridges' AUROCs differ, and
    choose_score_ridge's choice is the argmax of scikit-learn's ROC area of each ridge's v (ties: the earlier s)."""
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    d = 3
    h_train, val = torch.randn(150, d, generator=g), torch.randn(40, 1, d, generator=g)
    direction = torch.nn.functional.normalize(torch.randn(30, d, generator=g), dim=-1).unsqueeze(1)
    radius = torch.rand(30, 1, 1, generator=g)
    head = nn.Linear(d, 2)
    readout = R._new_readout(head, 1, num_features=300).fit(h_train)
    v_in, v_far = R.gp_variance_score(readout, val), R.gp_variance_score(readout, (10 + radius) * direction)
    assert float(v_far.min()) > float(v_in.max())  # it must separate: far points have the larger variance
    ood_val = (1 + radius) * direction
    ridges = (1.0, 1e-2, 1e-4)
    scorer, aurocs = R.choose_score_ridge(head, h_train, val, ood_val, ridges=ridges, seed=1, num_features=300)
    want = {}
    for s in ridges:
        each = R._new_readout(head, 1, num_features=300, ridge=s).fit(h_train)
        v = torch.cat([R.gp_variance_score(each, x) for x in (val, ood_val)])
        want[s] = roc_auc_score(np.r_[np.zeros(40), np.ones(30)], v.numpy())
        assert aurocs[f"{s:g}"] == pytest.approx(want[s], abs=1e-12)
    assert len(set(want.values())) == 3  # the choice matters here
    assert float(scorer.ridge) == max(ridges, key=lambda s: (want[s], -ridges.index(s)))
    with pytest.raises(ValueError, match=r"ood_val_inputs must have shape \(N >= 1, P, D=3\)"):
        R.choose_score_ridge(head, h_train, val, ood_val[:, 0], ridges=ridges)
    with pytest.raises(ValueError, match="ridges"):
        R.choose_score_ridge(head, h_train, val, ood_val, ridges=())


# ----------------------------------------------------------------------------- one Gram for every ridge; equal rows
def test_readouts_of_every_ridge_from_one_gram_equal_a_fit_per_ridge():
    """_ridge_readouts fits the features, ℓ and G = Σ wφφᵀ once and factorises s·I + G per s: each readout's draws, ℓ,
    N and variance equal those of a readout fitted on its own at that s (float64), and G is the explicit sum."""
    torch.manual_seed(0)
    head = nn.Linear(6, 3)
    h, query = _data(80).float(), _data(7, seed=3).float() * 1.3
    ridges = (1.0, 1e-2, 1e-4)
    shared = dict(R._ridge_readouts(head, h, ridges, seed=5, num_features=50))
    assert list(shared) == list(ridges)
    for s in ridges:
        alone = R._new_readout(head, 5, num_features=50, ridge=s).fit(h)
        got = shared[s]
        assert float(got.ridge) == s and int(got.gp.num_fitted) == 80
        assert torch.equal(got.gp.feature_weight, alone.gp.feature_weight)
        assert float(got.lengthscale) == float(alone.lengthscale)
        torch.testing.assert_close(got.variance(query), alone.variance(query), rtol=1e-9, atol=1e-12)
        phi, q = (_phi(got, x.double()) for x in (h, query))  # float64 from the same draws (the readout: float32 φ)
        want = ((q @ torch.linalg.inv(s * torch.eye(50, dtype=torch.float64) + phi.T @ phi)) * q).sum(-1)
        torch.testing.assert_close(got.variance(query), want, rtol=2e-3, atol=1e-6)
    gram = R._new_readout(head, 5, num_features=50).gram(h)
    phi = _phi(shared[1.0], h.double())  # the readout forms φ in float32: tolerance below
    assert gram.count == 80 and isinstance(gram, DenseGram)  # N = 80 ≥ R/2
    torch.testing.assert_close(gram.gram, phi.T @ phi, rtol=1e-5, atol=1e-6)
    other = R._new_readout(head, 5, num_features=30).gram(h)
    with pytest.raises(ValueError, match=r"gram must be the Gram of this layer's D_L = 50 features"):
        shared[1.0].set_gram(other)
    with pytest.raises(ValueError, match=r"gram must be the Gram .* got Tensor"):
        shared[1.0].set_gram(gram.gram)


def test_variance_of_equal_rows_is_computed_once_and_put_back_in_place():
    """v of (N, P, D) inputs whose P samples are equal (a body that samples nothing) and of rows repeated out of
    order equals v row by row; one solve per distinct row (counted)."""
    readout = _readout(r=30).fit(_data(40))
    rows = _data(5, seed=4)
    each = torch.stack([readout.variance(r[None])[0] for r in rows])  # (5,)
    same = rows[:, None, :].expand(5, 4, 6)  # (N, P, D): equal samples
    torch.testing.assert_close(readout.variance(same), each[:, None].expand(5, 4), rtol=1e-12, atol=0)
    order = torch.tensor([3, 0, 3, 1, 4, 2, 0])
    torch.testing.assert_close(readout.variance(rows[order]), each[order], rtol=1e-12, atol=0)
    seen = []
    solve = readout.gp.variance
    readout.gp.variance = lambda phi: seen.append(phi.shape[0]) or solve(phi)
    readout.variance(same)
    assert seen == [5]
