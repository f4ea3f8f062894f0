"""Classifiers over any registered attention, with deep-GP sample propagation (docs/derivations.md §9)."""

from gpattn.models._blocks import Encoder, resolve_attention_layers
from gpattn.models.classifiers import TransformerClassifier, ViTClassifier

__all__ = [
    "Encoder",
    "TransformerClassifier",
    "ViTClassifier",
    "resolve_attention_layers",
]
