"""The feature-space OOD detectors (gpattn.experiments.detectors) against closed forms and scikit-learn on
constructed Gaussians, a case each must separate, their saved states, and bad inputs."""

import io

import numpy as np
import pytest
import torch
from sklearn.covariance import EmpiricalCovariance, LedoitWolf
from sklearn.metrics import roc_auc_score

from gpattn.experiments import detectors as Dt

D = 4
MEANS = np.array([[6.0, 2.0, 0.0, 1.0], [-6.0, 3.0, 0.0, 0.0]])
COV = np.array([[2.0, 0.3, 0.0, 0.1], [0.3, 1.0, 0.2, 0.0], [0.0, 0.2, 0.5, 0.0], [0.1, 0.0, 0.0, 1.5]])


def two_gaussians(n_per_class=300, seed=0):
    """Two classes, known means, one known covariance."""
    rng = np.random.default_rng(seed)
    chol = np.linalg.cholesky(COV)
    x = np.concatenate([m + rng.standard_normal((n_per_class, D)) @ chol.T for m in MEANS])
    y = np.repeat([0, 1], n_per_class)
    return x, y


def test_mahalanobis_is_the_closed_form_with_the_sample_covariance():
    """min_c (x − μ̂_c)ᵀ Σ̂⁻¹ (x − μ̂_c) in float64, Σ̂ the pooled within-class sample covariance (ddof 0)."""
    x, y = two_gaussians()
    query = np.random.default_rng(1).standard_normal((20, D)) * 3
    det = Dt.Mahalanobis(EmpiricalCovariance(assume_centered=True)).fit(torch.tensor(x), torch.tensor(y))
    mu = np.stack([x[y == c].mean(0) for c in (0, 1)])
    centred = x - mu[y]
    sigma = centred.T @ centred / len(x)
    expected = np.min([np.einsum("nd,de,ne->n", query - m, np.linalg.inv(sigma), query - m) for m in mu], axis=0)
    np.testing.assert_allclose(det.score(query), expected, rtol=1e-9)
    # the default, Ledoit-Wolf: scikit-learn's own Mahalanobis distance of the centred query to the nearest mean
    lw = Dt.Mahalanobis().fit(x, y)
    ref = LedoitWolf(assume_centered=True).fit(centred)
    np.testing.assert_allclose(lw.score(query), np.min([ref.mahalanobis(query - m) for m in mu], axis=0), rtol=1e-9)


def test_relative_mahalanobis_subtracts_the_background_gaussian():
    x, y = two_gaussians()
    query = np.random.default_rng(2).standard_normal((15, D)) * 2
    det = Dt.RelativeMahalanobis(EmpiricalCovariance(assume_centered=True)).fit(x, y)
    mu0 = x.mean(0)
    sigma0 = np.cov(x.T, bias=True)
    md0 = np.einsum("nd,de,ne->n", query - mu0, np.linalg.inv(sigma0), query - mu0)
    md = Dt.Mahalanobis(EmpiricalCovariance(assume_centered=True)).fit(x, y).score(query)
    np.testing.assert_allclose(det.score(query), md - md0, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_knn_is_the_brute_force_kth_cosine_distance(k):
    x, y = two_gaussians(50)
    query = np.random.default_rng(3).standard_normal((12, D))
    det = Dt.KNN(k).fit(torch.tensor(x, dtype=torch.float32), y)
    cos = (query / np.linalg.norm(query, axis=1, keepdims=True)) @ (x / np.linalg.norm(x, axis=1, keepdims=True)).T
    expected = np.sort(1.0 - cos, axis=1)[:, k - 1]
    np.testing.assert_allclose(det.score(query), expected, rtol=1e-5, atol=1e-6)  # the bank is kept in float32


@pytest.mark.parametrize("name", sorted(Dt.DETECTORS))
def test_each_detector_separates_a_far_cluster_and_round_trips_its_state(name):
    """In-distribution: fresh draws of the two training Gaussians; out: a tight cluster halfway between the two
    means, inside the background Gaussian's bulk (the near-OOD case Ren et al.'s relative distance is for)."""
    x, y = two_gaussians()
    x_in, _ = two_gaussians(100, seed=7)
    x_out = np.random.default_rng(8).standard_normal((200, D)) * 0.3 + MEANS.mean(0)
    det = Dt.DETECTORS[name](**({"k": 3} if name == "knn" else {})).fit(x, y)  # knn: not the default k
    s_in, s_out = det.score(x_in), det.score(x_out)
    assert roc_auc_score(np.r_[np.zeros(len(s_in)), np.ones(len(s_out))], np.r_[s_in, s_out]) > 0.95
    buffer = io.BytesIO()
    torch.save({"state": det.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["state"]  # plain data: the safe loader reads it
    again = Dt.detector_from_state(name, state)
    np.testing.assert_allclose(again.score(x_out), s_out, rtol=1e-12)
    assert again.state_dict().keys() == det.state_dict().keys() and getattr(again, "k", 3) == 3


def test_choose_k_picks_the_best_k_on_the_validation_pair():
    x, y = two_gaussians(60)
    x_in, _ = two_gaussians(30, seed=4)
    x_out = np.random.default_rng(5).standard_normal((40, D)) + np.array([0.0, -4.0, 4.0, -3.0])
    k, aurocs = Dt.choose_k(x, x_in, x_out, grid=(1, 5, 200, 10))
    assert sorted(aurocs) == [1, 5, 10]  # 200 > the 120 training rows: left out
    assert aurocs[k] == max(aurocs.values()) and all(aurocs[j] < aurocs[k] for j in aurocs if j < k)


def test_bad_inputs_name_the_argument():
    x, y = two_gaussians(10)
    det = Dt.Mahalanobis().fit(x, y)
    with pytest.raises(ValueError, match=r"features must have shape \(N, D=4\)"):
        det.score(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="train_labels .* classes \\[1\\]"):
        Dt.Mahalanobis().fit(x[:11], y[:11])  # class 1 has one row
    with pytest.raises(ValueError, match="train_labels"):
        Dt.Mahalanobis().fit(x, y[:-1])
    with pytest.raises(ValueError, match="k=30 is larger than the 20 rows of train_features"):
        Dt.KNN(30).fit(x)
    with pytest.raises(ValueError, match="k must be a positive int"):
        Dt.KNN(0)
    with pytest.raises(ValueError, match="not fitted"):
        Dt.KNN().score(x)
    with pytest.raises(ValueError, match="train_features must be finite"):
        Dt.RelativeMahalanobis().fit(np.full((20, D), np.nan), y)
    with pytest.raises(ValueError, match="detector name must be one of"):
        Dt.detector_from_state("lof", {})


# ----------------------------------------------------------------------------- in a run
def test_a_run_fits_the_detectors_reports_them_and_predict_and_evaluate_reuse_them(tmp_path):
    """digits, 1 epoch: metrics.json has each detector's OOD metrics (equal to scikit-learn's ROC area of the
    scores in predictions.pt), the checkpoint's states are the detectors refitted on the training features, and
    load_run(...).predict and ``gpattn evaluate`` score with them without the training data."""
    import json

    from gpattn.experiments import load_run
    from gpattn.experiments.cli import main
    from gpattn.experiments.features import fit_detectors
    from gpattn.experiments.metrics import ood_score_key
    from gpattn.experiments.training import TrainConfig, load_run_with_data, train

    cfg = TrainConfig(dataset="digits", dataset_options={"ood_val_fraction": 0.3}, attention="softmax",
                      embed_dim=16, num_heads=2, num_layers=1, epochs=1,
                      batch_size=32, lr=5e-3, patch_size=4, num_samples=2, progress=False)  # fmt: skip
    metrics = train(cfg, tmp_path / "run")
    preds = torch.load(tmp_path / "run" / "predictions.pt", weights_only=True)
    s_in, s_out = (preds[k]["detector_scores"] for k in ("test", "ood"))
    for name in Dt.DETECTORS:
        truth = np.r_[np.ones(len(s_in[name])), np.zeros(len(s_out[name]))]  # in-distribution positive
        expected = roc_auc_score(truth, -np.r_[s_in[name].numpy(), s_out[name].numpy()])
        assert metrics["ood"][ood_score_key(name, "ood_auroc")] == pytest.approx(expected, abs=1e-12)
    _, model, bundle, ckpt = load_run_with_data(tmp_path / "run")
    choices = ckpt["detectors"]["choices"]  # k chosen on val against digits' ood_val (held-out-class images)
    assert choices["knn_k_from"] == "val against ood_val" and choices["knn_k"] in Dt.KNN_GRID
    assert choices["knn_k_auroc"][choices["knn_k"]] == max(choices["knn_k_auroc"].values())
    refit = fit_detectors(model, bundle, num_samples=2)
    for name, state in ckpt["detectors"]["states"].items():
        for key, value in state.items():
            torch.testing.assert_close(torch.as_tensor(refit["states"][name][key]), torch.as_tensor(value))
    images = bundle.splits["ood"].inputs[:7]
    pred = load_run(tmp_path / "run").predict(images)
    for name in Dt.DETECTORS:
        torch.testing.assert_close(pred.detector_scores[name], s_out[name][:7].float(), rtol=1e-4, atol=1e-5)
    assert main(["evaluate", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "ev")]) == 0
    again = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    for name in Dt.DETECTORS:
        key = ood_score_key(name, "ood_auroc")
        assert again["ood"][key] == pytest.approx(metrics["ood"][key], abs=1e-9)
