"""The registry of attention variants: a variant joins with one line, ``@register("name")``.

Every module in ``gpattn/attention/`` whose name does not start with ``_`` is imported by the
package, so a new variant needs no edit anywhere else.
"""

from __future__ import annotations

import inspect

import torch.nn as nn

__all__ = ["attention_class", "attention_options", "build_attention", "list_attention", "register"]

_REGISTRY: dict[str, type[nn.Module]] = {}


def register(name: str):
    """Class decorator: make an attention layer buildable as ``build_attention(name, ...)``."""

    def decorate(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention {name!r} is registered twice ({_REGISTRY[name]} and {cls})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def list_attention() -> list[str]:
    """Sorted names of every registered attention variant."""
    return sorted(_REGISTRY)


def attention_class(name) -> type[nn.Module]:
    """The class registered as ``name`` (``ValueError`` naming the valid names otherwise). An attention
    layer class (a subclass of :class:`gpattn.attention.AttentionBase`, registered or not) is returned as
    is: every function here, and the test mixins of :mod:`gpattn.testing`, take one in place of a name."""
    if isinstance(name, type) and issubclass(name, nn.Module) and hasattr(name, "_attend"):  # an AttentionBase
        return name
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; valid names: {', '.join(list_attention())}")
    return _REGISTRY[name]


def attention_options(name: str) -> dict[str, object]:
    """The keyword options of a variant and their defaults (the papers' defaults), from its signature
    and those of its base classes."""
    options: dict[str, object] = {}
    for klass in attention_class(name).__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        for p in params.values():
            if p.kind is p.KEYWORD_ONLY:
                options.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            break
    return options


def build_attention(name, embed_dim: int, num_heads: int, **options) -> nn.Module:
    """Build the attention layer ``name`` (a registered name, or a layer class) for inputs of width
    ``embed_dim`` with ``num_heads`` heads.

    An unknown name or option is a ``ValueError`` that lists the valid ones.
    """
    cls = attention_class(name)
    valid = attention_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        shown = name if isinstance(name, str) else cls.name or cls.__name__
        raise ValueError(
            f"unknown option(s) {unknown} for attention {shown!r}; valid options: {', '.join(sorted(valid))}"
        )
    return cls(embed_dim, num_heads, **options)
