"""Attention layers: thin ``nn.Module`` shims over the math in ``gpattn.variational``, and the registry.

Every public module of this package is imported here, so a variant registers itself with its
``@register("name")`` line alone.
"""

import importlib
import pkgutil

from gpattn.attention._call import Attended, AttentionCall
from gpattn.attention._gp import GPAttention
from gpattn.attention._masks import excluded_keys
from gpattn.attention.base import AttentionBase
from gpattn.attention.registry import (
    RECIPES,
    VariantEntry,
    attention_class,
    attention_options,
    build_attention,
    list_attention,
    recipe_options,
    register,
)

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_") and _info.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = [
    "Attended",
    "AttentionBase",
    "AttentionCall",
    "GPAttention",
    "RECIPES",
    "VariantEntry",
    "attention_class",
    "attention_options",
    "build_attention",
    "excluded_keys",
    "list_attention",
    "recipe_options",
    "register",
]
