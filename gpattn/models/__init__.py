"""Classifiers over any registered attention, with deep-GP sample propagation (docs/derivations.md §9)."""

from gpattn.models._blocks import Encoder, EncoderSpec, resolve_attention_layers
from gpattn.models.classifiers import TransformerClassifier, ViTClassifier

__all__ = [
    "Encoder",
    "EncoderSpec",
    "TransformerClassifier",
    "ViTClassifier",
    "resolve_attention_layers",
]
