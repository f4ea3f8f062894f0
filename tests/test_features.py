"""The pooled penultimate features (gpattn.experiments.features): the input of ``model.head``, for gpattn's
classifiers, an SNGP model and a Hugging Face encoder classifier; the mean features of a sampling model."""

import pytest
import torch
import torch.nn as nn

from gpattn.experiments.features import pooled_features
from gpattn.models import TransformerClassifier, ViTClassifier


def _text_batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 30, (7, 6), generator=g)
    mask = torch.zeros(7, 6, dtype=torch.bool)
    mask[2:, 4:] = True
    ids[mask] = 0
    return [(ids[:4], mask[:4]), (ids[4:], mask[4:])], ids, mask


def test_features_are_the_head_input_of_a_text_model_and_the_mode_is_restored():
    torch.manual_seed(0)
    model = TransformerClassifier(3, vocab_size=30, embed_dim=16, num_heads=2, max_len=6).train()
    batches, ids, mask = _text_batches()
    feats = pooled_features(model, batches)
    assert model.training  # restored
    assert feats.shape == (7, 16) and feats.dtype == torch.float32
    with torch.no_grad():
        logits = model.eval()(ids, mask)[:, 0]  # shape: (B, C)
        torch.testing.assert_close(model.head(feats), logits, atol=1e-5, rtol=1e-5)
    model.eval()
    pooled_features(model, batches)
    assert not model.training


def test_mean_features_of_a_sampling_model_give_the_mean_logits_through_a_linear_head():
    """MC dropout samples in eval mode: with P draws the features are the mean over the draws, so a linear head
    maps them to the mean of the P sample logits (same random numbers: same seed)."""
    torch.manual_seed(0)
    model = TransformerClassifier(3, vocab_size=30, embed_dim=16, num_heads=2, max_len=6, dropout=0.3, mc_dropout=True)
    batches, ids, mask = _text_batches()
    torch.manual_seed(5)
    feats = pooled_features(model, batches[:1], num_samples=4)
    torch.manual_seed(5)
    with torch.no_grad():
        logits = model.eval()(ids[:4], mask[:4], num_samples=4)  # shape: (B, P, C)
        assert not torch.allclose(logits[:, 0], logits[:, 1])  # it does sample
        torch.testing.assert_close(model.head(feats), logits.mean(1), atol=1e-5, rtol=1e-5)


def test_sngp_model_features_are_the_random_feature_heads_input():
    from gpattn.experiments.sngp import RandomFeatureGP, apply_sngp

    torch.manual_seed(0)
    model = ViTClassifier(3, image_shape=(1, 8, 8), patch_size=4, embed_dim=16, num_heads=2, num_layers=1)
    apply_sngp(model, num_features=32)
    x = torch.randn(5, 1, 8, 8)
    feats = pooled_features(model, [(x, None)])
    assert isinstance(model.head, RandomFeatureGP) and feats.shape == (5, 16)
    with torch.no_grad():
        logits = model.eval()(x)[:, 0]  # the mean-field logits of the head in eval mode
        torch.testing.assert_close(model.head(feats), logits, atol=1e-5, rtol=1e-5)


def test_hugging_face_classifier_features():
    pytest.importorskip("transformers")
    from test_hf_classifier import tiny_encoder

    from gpattn.integrations.huggingface import HFClassifier

    model = HFClassifier(tiny_encoder(), 3, "softmax", "last")
    batches, ids, mask = _text_batches()
    feats = pooled_features(model, batches)
    assert feats.shape == (7, 16)
    with torch.no_grad():
        torch.testing.assert_close(model.head(feats), model.eval()(ids, mask)[:, 0], atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="model.head"):
        pooled_features(nn.Linear(2, 2), [])
    model = TransformerClassifier(3, vocab_size=30, embed_dim=16, num_heads=2, max_len=6)
    with pytest.raises(ValueError, match="num_samples"):
        pooled_features(model, [], num_samples=0)
    assert pooled_features(model, []).shape == (0, 16)
    from gpattn.experiments.sngp import apply_sngp

    assert pooled_features(apply_sngp(model, num_features=8), []).shape == (0, 16)


# ----------------------------------------------------------------------------- features from the evaluation's own pass
def _sgpa_split(n, seed):
    """n token-id rows of width 6 (some padded), labels 0/1: the split ``predict`` reads."""
    import types

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30, (n, 6), generator=g)
    mask = torch.arange(6)[None, :] >= torch.randint(2, 7, (n,), generator=g)[:, None]
    return types.SimpleNamespace(inputs=ids.masked_fill(mask, 0), mask=mask, labels=torch.arange(n) % 2)


def _fitted(model, P):
    """Every detector of DETECTORS fitted on the features of 40 rows at P samples: a run's ``detectors`` entry."""
    from gpattn.experiments import detectors as Dt
    from gpattn.experiments.features import split_features

    train = _sgpa_split(40, seed=2)
    torch.manual_seed(1)
    feats = split_features(model, train, 256, P)
    states = {name: cls(**({"k": 5} if name == "knn" else {})).fit(feats, train.labels).state_dict()
              for name, cls in Dt.DETECTORS.items()}
    return {"num_samples": P, "states": states}


def _gp_model():
    torch.manual_seed(0)
    return TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, max_len=6, num_layers=2,
                                 attention="sgpa")


def test_one_pass_scores_are_the_second_pass_scores_of_the_same_draws():
    """An evaluation's detector scores from its own pass (predict_with_detectors) are the old second pass's
    (detector_scores: split_features at the detectors' P) given the same random numbers (bit for bit here; to 1e-6
    asserted), over several bounded passes (5 rows each); the logits are predict's without detectors (the recorder
    changes nothing) and the features are the mean over the P draws (through the linear head: the mean logits)."""
    from gpattn.experiments.features import detector_scores
    from gpattn.experiments.training import predict, predict_with_detectors

    model, split, P = _gp_model(), _sgpa_split(23, seed=3), 3
    detectors = _fitted(model, P)
    torch.manual_seed(7)
    second_pass = detector_scores(model, split, detectors, batch_size=5)
    torch.manual_seed(7)
    alone = predict(model, split, P, batch_size=5)
    torch.manual_seed(7)
    logits, scores = predict_with_detectors(model, split, P, detectors, batch_size=5)
    assert not torch.allclose(logits[:, 0], logits[:, 1])  # the GP layers sample in eval mode
    assert torch.equal(logits, alone)
    assert sorted(scores) == sorted(detectors["states"]) and all(v.shape == (23,) for v in scores.values())
    for name, values in scores.items():
        torch.testing.assert_close(values, second_pass[name], rtol=0, atol=1e-6)
    assert predict_with_detectors(model, split, P, None, batch_size=5)[1] == {}
    torch.manual_seed(7)
    again, feats = predict(model, split, P, batch_size=5, features=True)  # the features: the mean over the P draws
    assert torch.equal(again, logits) and feats.shape == (23, 16) and isinstance(model.head, nn.Linear)
    with torch.no_grad():  # a linear head maps the mean features to the mean of the sample logits
        torch.testing.assert_close(model.head(feats), logits.mean(1), atol=1e-5, rtol=1e-5)


def test_another_num_samples_scores_at_the_detectors_num_samples_on_forked_streams():
    """Evaluated at P = 2, the detectors (fitted at P = 3) score features at P = 3 in a second pass, drawn on forked
    random streams: the logits and the random state after are those of an evaluation without detectors."""
    from gpattn.experiments.features import detector_scores
    from gpattn.experiments.training import predict, predict_with_detectors

    model, split = _gp_model(), _sgpa_split(9, seed=4)
    detectors = _fitted(model, 3)
    torch.manual_seed(7)
    alone = predict(model, split, 2, batch_size=5)
    second_pass = detector_scores(model, split, detectors, batch_size=5)  # from the state after the logits
    torch.manual_seed(7)
    predict(model, split, 2, batch_size=5)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    logits, scores = predict_with_detectors(model, split, 2, detectors, batch_size=5)
    assert torch.equal(logits, alone) and torch.equal(torch.get_rng_state(), after)
    for name, values in scores.items():
        torch.testing.assert_close(values, second_pass[name], rtol=0, atol=1e-6)
