"""The research probes (research/): each runs at a tiny size. A probe answers one question; its finding is in the
docs (research/README.md says where), so what is checked is that it still runs, not what it measured."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

RESEARCH = Path(__file__).resolve().parents[1] / "research"


def _research(name: str):
    """The probe research/NAME.py as a module (research/ on the path, as when it runs as a script)."""
    if str(RESEARCH) not in sys.path:
        sys.path.insert(0, str(RESEARCH))
    spec = importlib.util.spec_from_file_location(name, RESEARCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gumbel_floor_smoke():
    """research/gumbel_floor.py at a tiny size: every case timed, the floor is the softmax layer plus the noise
    plus the mask read, and the ratios divide by it and by the softmax layer."""
    floor = _research("gumbel_floor")
    result = floor.main(["--smoke", "--threads", "1"])
    med = result["ms_median"]
    assert set(med) == {"softmax layer", "sto layer", "h-sto layer", "noise (B, H, T, T)", "SDPA core",
                        "SDPA core + float mask"} and all(ms > 0 for ms in med.values())
    expected = med["softmax layer"] + med["noise (B, H, T, T)"] + med["SDPA core + float mask"] - med["SDPA core"]
    assert math.isclose(result["floor_ms"], expected)
    assert math.isclose(result["ratios"]["sto"]["x_floor"], med["sto layer"] / expected)
    assert math.isclose(result["ratios"]["h-sto"]["x_softmax"], med["h-sto layer"] / med["softmax layer"])


def test_variance_by_domain_smoke(tmp_path):
    """research/variance_by_domain.py on a tiny sgpa-rff text run: one variance per text and GP layer, finite and
    positive, and the captured conditionals leave the layer as it was."""
    from gpattn.experiments.data.fixtures import make_text_table
    from gpattn.experiments.inference import UnknownWordsWarning, load_run
    from gpattn.experiments.training import TrainConfig, train

    table = make_text_table(tmp_path / "t.tsv", n=40, class_names=("0", "1"))
    cfg = TrainConfig(dataset="text_table", dataset_options={"path": str(table)}, attention="sgpa-rff", embed_dim=8,
                      num_heads=2, num_layers=1, epochs=1, num_samples=1, progress=False,
                      attention_options={"num_features": 8})
    train(cfg, tmp_path / "run")
    probe = _research("variance_by_domain")
    run = load_run(tmp_path / "run")
    (layer,) = probe.gp_layers(run.model)
    with pytest.warns(UnknownWordsWarning, match="zzz qqq"):  # the unknown text is on purpose
        (var,) = probe.sequence_variances(run, ["a good film", "a bad one indeed", "zzz qqq"])
    assert var.shape == (3,) and bool((var > 0).all()) and bool(var.isfinite().all())
    assert "_condition" not in vars(layer)


def test_sequence_distance_scores():
    """research/sequence_distance.py's scores: the random-feature variance is ≈ σ² = 1 with no weight on the data,
    shrinks on the training rows and stays near 1 far from them; the kNN distance is 0 on a training row."""
    import torch

    probe = _research("sequence_distance")
    torch.manual_seed(0)
    train = torch.randn(200, 4) * 0.1
    far = torch.randn(20, 4) * 0.1 + 5.0
    assert (probe.rff_variance(train, far, 512, 1.0, 0.0) - 1).abs().max() < 0.1  # ψᵀψ ≈ κ(x, x) = 1
    near, away = probe.rff_variance(train, train[:20], 512, 1.0, 1e4), probe.rff_variance(train, far, 512, 1.0, 1e4)
    assert near.max() < 0.05 and away.min() > 0.5
    assert probe.knn_distance(train, train[:5], k=1).abs().max() < 1e-12


def test_sequence_distance_with_energy_against_sklearn():
    """z(energy) + w·z(score): at w = 0 the energy's own AUROC (sklearn's) and FPR95 (OOD rows accepted at the
    threshold that keeps 95 % of the in-scope rows, counted by hand), and a score that separates the OOD rows
    perfectly lifts the AUROC to 1 as its weight grows."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    probe = _research("sequence_distance")
    rng = np.random.default_rng(0)
    energy = np.r_[rng.normal(0, 1, 300), rng.normal(1, 1, 100)]
    labels = np.r_[np.zeros(300), np.ones(100)]
    perfect = labels + 0.01 * rng.normal(size=400)
    got = probe.with_energy(energy, perfect, 300, weights=(0.0, 100.0))
    assert got[0.0][0] == pytest.approx(roc_auc_score(labels, energy), abs=1e-12)
    threshold = np.sort(energy[:300])[284]  # the 285th lowest in-scope energy: 95 % of them at or below it
    assert got[0.0][1] == pytest.approx((energy[300:] <= threshold).mean(), abs=1e-12)
    assert got[100.0][0] > 0.999 and got[100.0][0] > got[0.0][0] and got[100.0][1] == 0.0


def test_kep_finetune_probe_scales_the_matched_prior_and_its_posterior(tmp_path):
    """research/kep_finetune.py: after the trainer's stream match, the swapped kep-svgp layer's σ² and q(u_c)'s
    Cholesky factor are c and √c times what the match alone gives (the KL unchanged), the row records c, and the
    trainer's own function is restored after ``main``."""
    import torch

    pytest.importorskip("transformers")
    import transformers

    from gpattn.experiments import training
    from gpattn.experiments.data._bundle import Split
    from gpattn.integrations.huggingface import HFClassifier

    probe = _research("kep_finetune")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    ids = torch.randint(1, 100, (4, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(4, 7, dtype=torch.bool)
    mask[1, 4:] = True

    def matched(wrapper):
        torch.manual_seed(0)
        encoder = transformers.BertModel(config, add_pooling_layer=False)
        model = HFClassifier(encoder, 2, attention="kep-svgp", attention_layers="last")
        split = Split(inputs=ids, labels=torch.zeros(4, dtype=torch.long), mask=mask)
        rows = wrapper(model, split, torch.device("cpu"))
        layer = model.adapters[1].attention
        strategy = layer.strategy
        return rows, float(strategy.prior_variance), strategy.variational_distribution.chol_variational_covar.clone()

    rows0, var0, chol0 = matched(training._match_prior_to_stream)
    rows, var, chol = matched(probe.with_prior_factor(1e-2))
    assert rows[0]["probe_factor"] == 1e-2 and "probe_factor" not in rows0[0]
    assert math.isclose(var, 1e-2 * var0, rel_tol=1e-6)
    torch.testing.assert_close(chol, 0.1 * chol0)
    original = training._match_prior_to_stream
    with pytest.raises(SystemExit):
        probe.main(["--prior-factor", "2", "--", "train", "--help"])
    assert training._match_prior_to_stream is original


def test_random_stream_probe_draws_in_training_forwards_only(tmp_path):
    """research/random_stream.py: the swapped softmax layer draws normals before each training forward (the
    random stream after a forward moves, the outputs do not), nothing in eval mode, and the trainer's own
    build_model is restored after ``main``."""
    import copy

    import torch

    pytest.importorskip("transformers")
    import transformers

    from gpattn.experiments import training
    from gpattn.integrations.huggingface import HFClassifier

    probe = _research("random_stream")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    plain = HFClassifier(transformers.BertModel(config, add_pooling_layer=False), 2, attention="softmax",
                         attention_layers="last")
    hooked = probe.with_dummy_draws(3)._wrap(copy.deepcopy(plain))
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 5, dtype=torch.bool)

    def forward(model, train: bool):
        torch.manual_seed(1)
        model.train(train)
        with torch.no_grad():
            out = model(ids, mask)
        return out, torch.randn(1)  # the stream's next draw

    for train in (True, False):
        (out_p, next_p), (out_h, next_h) = forward(plain, train), forward(hooked, train)
        torch.testing.assert_close(out_h, out_p)  # no dropout here: the draws change nothing computed
        assert torch.equal(next_h, next_p) != train  # ... but the stream, in training forwards only
    original = training.build_model
    with pytest.raises(SystemExit):
        probe.main(["--draws", "2", "--", "train", "--help"])
    assert training.build_model is original


def test_clip_groups_probe_clips_the_layer_and_the_rest_apart():
    """research/clip_groups.py: with 2 groups each of (the swapped layer's new parameters, the rest) ends at norm
    max_norm when it started above it — unlike the trainer's guard, which scales both by the total — and the guard
    still records the step; --groups 1 is the trainer's own guard, and main restores it."""
    import torch

    pytest.importorskip("transformers")
    import transformers

    from gpattn.experiments import training
    from gpattn.integrations.huggingface import HFClassifier

    probe = _research("clip_groups")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = HFClassifier(transformers.BertModel(config, add_pooling_layer=False), 2, attention="kep-svgp",
                         attention_layers="last")
    layer, rest = probe.clip_groups(model)
    assert layer and rest and all("attention" in n for n, p in model.named_parameters() if any(p is q for q in layer))

    def norms(guard_class, big: float):
        for i, p in enumerate(layer + rest):
            p.grad = torch.full_like(p, (big if i < len(layer) else 1.0))
        guard = guard_class(model, torch.device("cpu"))
        found = guard.update(0, torch.tensor(False), {}, 1.0)
        assert float(found) == 0.0
        return [float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in g]))) for g in (layer, rest)]

    assert probe.with_groups(1) is training._DivergenceGuard
    two = norms(probe.with_groups(2), big=100.0)
    assert two == pytest.approx([1.0, 1.0], rel=1e-5)
    one = norms(training._DivergenceGuard, big=100.0)  # the total norm: the layer's huge gradient shrinks the rest
    assert one[0] == pytest.approx(1.0, rel=1e-3) and one[1] < 0.1
    with pytest.raises(ValueError, match="--groups"):
        probe.with_groups(3)
    original = training._DivergenceGuard
    with pytest.raises(SystemExit):
        probe.main(["--groups", "2", "--", "train", "--help"])
    assert training._DivergenceGuard is original


@pytest.fixture(scope="module")
def tiny_digits_run(tmp_path_factory):
    """A one-epoch softmax run on digits (the readout probes read its checkpoint)."""
    import warnings

    from gpattn.experiments.diagnostics import CollapseWarning
    from gpattn.experiments.training import TrainConfig, train

    folder = tmp_path_factory.mktemp("readout") / "run"
    cfg = TrainConfig(dataset="digits", embed_dim=8, num_heads=2, num_layers=1, epochs=1, batch_size=64,
                      num_samples=1, patch_size=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollapseWarning)  # one tiny epoch
        train(cfg, folder)
    return folder


def test_readout_forms_smoke(tiny_digits_run, capsys, monkeypatch):
    """research/readout_forms.py on a tiny digits run: one row per form of the readout's GP, each with its λ."""
    probe = _research("readout_forms")
    monkeypatch.setattr(probe.R, "NUM_FEATURES", 512)  # the default's 4096 features cost this tiny run 30 s
    probe.main([str(tiny_digits_run)])
    rows = [line for line in capsys.readouterr().out.splitlines() if "λ=" in line]
    assert [row.split("|")[0].strip() for row in rows] == list(probe.FORMS)


def test_readout_eval_smoke(tiny_digits_run, monkeypatch):
    """research/readout_eval.py: its plain row is the run's own evaluation (metrics.json) on the splits it keeps,
    the shift split left out; the readout rows carry the chosen (s, λ)."""
    from gpattn.experiments import readout

    monkeypatch.setattr(readout, "NUM_FEATURES", 512)  # the default's 4096 features cost this tiny run 15 s
    import json

    probe = _research("readout_eval")
    rows = {row["row"]: row for row in probe.main([str(tiny_digits_run)])}
    assert set(rows) == {"plain", "plain+ts", "gpreadout", "gpreadout+ts"}
    saved = json.loads((tiny_digits_run / "metrics.json").read_text())
    assert "shift" not in rows["plain"]["metrics"]
    for split in ("in_domain", "ood"):
        for key in ("accuracy", "nll", "ood_auroc", "ood_auroc_energy"):
            if key in saved[split] and saved[split][key] is not None:
                assert rows["plain"]["metrics"][split][key] == pytest.approx(saved[split][key], rel=1e-5, abs=1e-6)
    assert rows["gpreadout"]["readout"]["ridge"] in probe.R.RIDGE_GRID


def test_sgpa_rff_features_pairs_each_figure_per_seed(tmp_path, capsys):
    """research/sgpa_rff_features.py on a two-seed results.json: each figure's row has both specs' per-seed values
    and the paired difference candidate − reference with the seeds where the candidate is better (lower NLL)."""
    import json

    def metrics(acc, nll):
        return {"in_domain": {"accuracy": acc, "nll": nll}, "shift": {"nll": nll + 1, "ece": 0.1},
                "ood": {"ood_auroc": 0.8}}

    results = {"a": {"0": metrics(0.9, 0.3), "1": metrics(0.8, 0.5)},
               "b": {"0": metrics(0.95, 0.2), "1": metrics(0.8, 0.6)},
               "a+ts": {"0": metrics(0.9, 0.3), "1": metrics(0.8, 0.5)}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    _research("sgpa_rff_features").main([str(tmp_path), "--reference", "a", "--candidate", "b"])
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.count("|") == 5}
    assert "| 0.900 / 0.800 | 0.950 / 0.800 | +0.025 [" in rows["in-domain accuracy"]
    assert rows["in-domain accuracy"].endswith("(1/2) |") and rows["in-domain NLL"].endswith("(1/2) |")
    assert "shift NLL +TS" not in rows  # the candidate has no +ts row


@pytest.fixture(scope="module")
def tiny_ood_val_run(tmp_path_factory):
    """A one-epoch softmax run on digits with an OOD validation split (the readout score's probes read it)."""
    import warnings

    from gpattn.experiments.diagnostics import CollapseWarning
    from gpattn.experiments.training import TrainConfig, train

    folder = tmp_path_factory.mktemp("ood_val") / "run"
    cfg = TrainConfig(dataset="digits", dataset_options={"ood_val_fraction": 0.3}, embed_dim=8, num_heads=2,
                      num_layers=1, epochs=1, batch_size=64, num_samples=1, patch_size=4, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CollapseWarning)  # one tiny epoch
        train(cfg, folder)
    return folder


def test_readout_width_smoke(tiny_ood_val_run, capsys):
    """research/readout_width.py on a tiny digits run with an OOD validation split: one AUROC per score and width,
    the combinations' weights chosen on validation, the paired table against the readout's score."""
    probe = _research("readout_width")
    table = probe.main([str(tiny_ood_val_run), "--features", "64,128", "--orthogonal"])
    scores = table[str(tiny_ood_val_run)]
    want = {"energy", "mahalanobis", "knn", "energy + knn", "energy + mahalanobis"}
    want |= {f"gp-variance R={r}{o}" for r in (64, 128) for o in ("", " orth")}
    assert want <= set(scores) and all(0.0 <= a <= 1.0 for a in scores.values())
    assert "gp-variance R=64 − each" in capsys.readouterr().out
    # the weight is the validation's choice (the first w of the best val-against-ood_val AUROC): b separates val
    # from ood_val and a is noise there, while on the test splits a separates and b is noise
    g = np.random.default_rng(0)
    noise = {k: g.normal(size=50) for k in probe.SPLITS}
    split = {"val": g.normal(size=50), "ood_val": 2 + g.normal(size=50), "test": g.normal(size=50),
             "ood": 2 + g.normal(size=50)}
    scores = {k: {"a": split[k] if k in ("test", "ood") else noise[k], "b": split[k] if k in ("val", "ood_val")
                  else noise[k]} for k in probe.SPLITS}
    z = {k: {n: (scores[k][n] - scores["val"][n].mean()) / scores["val"][n].std() for n in "ab"} for k in scores}
    val_auroc = {w: probe.auroc((1 - w) * z["val"]["a"] + w * z["val"]["b"],
                                (1 - w) * z["ood_val"]["a"] + w * z["ood_val"]["b"]) for w in probe.WEIGHTS}
    w = next(w for w in probe.WEIGHTS if val_auroc[w] == max(val_auroc.values()))
    assert w >= 0.5  # b's weight: the test splits' best would be a alone
    mix = probe.combined(scores, "a", "b")
    np.testing.assert_allclose(mix["test"], (1 - w) * z["test"]["a"] + w * z["test"]["b"], rtol=1e-12)


def test_readout_lengthscale_smoke(tiny_ood_val_run, capsys):
    """research/readout_lengthscale.py on a tiny digits run: m = 1 is the library's median-ℓ score
    (choose_score_ridge), the chosen (m, s) is the first best validation AUROC of the (m, s) table (the median
    first), and the paired table is printed."""
    probe = _research("readout_lengthscale")
    row = probe.main([str(tiny_ood_val_run), "--features", "64", "--multiples", "1,0.5,2"])[str(tiny_ood_val_run)]
    assert "| median-ℓ gp-variance |" in capsys.readouterr().out
    assert set(row["val_auroc"]) == {"1", "0.5", "2"}
    flat = [(float(m), float(s), a) for m, by_s in row["val_auroc"].items() for s, a in by_s.items()]
    best = max(a for _, _, a in flat)
    assert row["chosen"]["val"] == best
    assert (row["chosen"]["multiple"], row["chosen"]["ridge"]) == next((m, s) for m, s, a in flat if a == best)
    assert row["median"]["val"] == max(row["val_auroc"]["1"].values())
    assert set(row["detectors"]) == set(probe.DETECTORS)
    # the median row is the library's own choice at the run's inputs
    cfg, head, h_train, parts, _ = probe.run_inputs(tiny_ood_val_run)
    readout, aurocs = probe.R.choose_score_ridge(head, h_train, parts["val"], parts["ood_val"], seed=cfg.seed,
                                                 num_features=64)
    assert aurocs == row["val_auroc"]["1"] and float(readout.ridge) == row["median"]["ridge"]
    assert float(readout.lengthscale) == pytest.approx(row["median_lengthscale"])
    v = [probe.R.gp_variance_score(readout, parts[k]).numpy() for k in ("test", "ood")]
    assert probe.auroc(*v) == pytest.approx(row["median"]["test"], abs=1e-12)
