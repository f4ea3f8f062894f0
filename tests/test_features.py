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
