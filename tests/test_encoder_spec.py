"""The encoder's nine settings are written once (gpattn.models.EncoderSpec): the Encoder takes them positionally
or by name, the classifiers as keyword arguments shown in their signatures, build_model from the config by
name; an unknown keyword is refused by name."""

import dataclasses
import inspect
import types

import pytest
import torch

from gpattn.experiments.training import TrainConfig, build_model
from gpattn.models import Encoder, EncoderSpec, TransformerClassifier, ViTClassifier

#: a value other than the default for every setting
CHANGED = dict(
    embed_dim=24,
    num_heads=3,
    num_layers=3,
    attention="kernel",
    attention_options={"kernel": "ard-rbf"},
    attention_layers=[0, 2],
    mlp_ratio=3.0,
    dropout=0.25,
    mc_dropout=True,
)


def _describe(encoder: Encoder) -> dict:
    """What an encoder was built with, read off its modules."""
    block = encoder.blocks[0]
    return {
        "embed_dim": encoder.norm.normalized_shape[0],
        "num_heads": block.attn.num_heads,
        "num_layers": len(encoder.blocks),
        "attention": [b.attn.name for b in encoder.blocks],
        "kernel": type(block.attn.kernel).__name__ if hasattr(block.attn, "kernel") else None,
        "mlp_hidden": block.mlp[0].out_features,
        "dropout": block.drop.p,
        "mc_dropout": block.drop.mc,
    }


EXPECTED = {
    "embed_dim": 24,
    "num_heads": 3,
    "num_layers": 3,
    "attention": ["kernel", "softmax", "kernel"],
    "mlp_hidden": 72,
    "dropout": 0.25,
    "mc_dropout": True,
}


def test_every_setting_reaches_the_encoder_in_every_call_form():
    assert set(CHANGED) == set(EncoderSpec.names())
    defaults = EncoderSpec()
    assert all(CHANGED[name] != getattr(defaults, name) for name in CHANGED)  # each one is a change
    forms = {
        "positional": Encoder(*(CHANGED[name] for name in EncoderSpec.names())),
        "keywords": Encoder(**CHANGED),
        "text": TransformerClassifier(2, vocab_size=9, **CHANGED).encoder,
        "image": ViTClassifier(2, image_shape=(1, 4, 4), **CHANGED).encoder,
    }
    seen = {form: _describe(encoder) for form, encoder in forms.items()}
    for form, described in seen.items():
        assert {k: described[k] for k in EXPECTED} == EXPECTED, form
    assert seen["positional"] == seen["keywords"] == seen["text"] == seen["image"]
    assert seen["text"]["kernel"] != _describe(Encoder(**{**CHANGED, "attention_options": None}))["kernel"]
    model = TransformerClassifier(2, vocab_size=9, **CHANGED)
    assert model.embed_drop.p == 0.25 and model.embed_drop.mc and model.embed.embedding_dim == 24


def test_signatures_show_the_settings_with_their_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(EncoderSpec)}
    for cls, kind in [
        (Encoder, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        (TransformerClassifier, inspect.Parameter.KEYWORD_ONLY),
        (ViTClassifier, inspect.Parameter.KEYWORD_ONLY),
    ]:
        params = inspect.signature(cls).parameters
        shown = {name: p.default for name, p in params.items() if name in defaults}
        assert shown == defaults, cls
        assert all(params[name].kind == kind for name in defaults), cls
        assert not any(p.kind == p.VAR_KEYWORD for p in params.values()), cls
    assert list(inspect.signature(Encoder).parameters) == list(EncoderSpec.names())  # the positional order
    assert "pooling" in inspect.signature(TransformerClassifier).parameters


def test_unknown_settings_and_bad_values_are_refused_by_name():
    with pytest.raises(TypeError, match=r"TransformerClassifier\(\) got unexpected keyword argument\(s\) 'embed_dimm'"):
        TransformerClassifier(2, vocab_size=9, embed_dimm=8)
    with pytest.raises(TypeError, match="image_shape, patch_size, pooling, embed_dim, num_heads, num_layers"):
        ViTClassifier(2, image_shape=(1, 4, 4), heads=2)
    with pytest.raises(TypeError):
        Encoder(16, 2, 2, "softmax", None, "all", 2.0, 0.1, False, "one too many")
    for bad, match in [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"attention_layers": [5]}, "attention_layers"),
    ]:
        with pytest.raises(ValueError, match=match):
            EncoderSpec(**bad)
        with pytest.raises(ValueError, match=match):
            TransformerClassifier(2, vocab_size=9, **bad)


def test_build_model_passes_every_setting_of_the_config():
    """Every encoder setting is a TrainConfig field of the same name, and build_model hands each one over."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(EncoderSpec.names()) <= fields
    cfg = TrainConfig(dataset="text_table", **CHANGED)
    split = types.SimpleNamespace(inputs=torch.zeros(4, 7, dtype=torch.long))
    bundle = types.SimpleNamespace(kind="text", num_classes=2, vocab_size=9, splits={"train": split})
    model = build_model(cfg, bundle)
    described = _describe(model.encoder)
    assert {k: described[k] for k in EXPECTED} == EXPECTED
    assert described["kernel"] == _describe(Encoder(**CHANGED))["kernel"]
    auto = dataclasses.replace(cfg, attention="kep-svgp", attention_options={}, attention_layers="auto")
    auto = build_model(auto, bundle)
    assert [b.attn.name for b in auto.encoder.blocks] == ["softmax", "softmax", "kep-svgp"]  # "auto" resolved
