"""The contract's invariants over every registered variant at its default options: one
gpattn.testing.BaseAttentionTestCase class per name of gpattn.list_attention(), made at import."""

import importlib
import inspect
import pkgutil

import pytest

import gpattn
import gpattn.attention
from gpattn.attention.base import AttentionBase
from gpattn.testing import BaseAttentionTestCase

VARIANTS = gpattn.list_attention()

for _name in VARIANTS:  # e.g. TestInvariantsSgpaDecoupled::test_invariant_padding
    _case = type(f"TestInvariants{_name.title().replace('-', '')}", (BaseAttentionTestCase,), {"attention": _name})
    globals()[_case.__name__] = _case


def test_nothing_missed():
    """Every concrete AttentionBase subclass defined in gpattn.attention is registered (and therefore
    parametrised above); the contract's baseline names are all there."""
    found = set()
    registered = [gpattn.attention.attention_class(name) for name in VARIANTS]
    for info in pkgutil.iter_modules(gpattn.attention.__path__):
        module = importlib.import_module(f"gpattn.attention.{info.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            # private classes, and public ones a registered variant derives from (GPAttention), are shared bases
            shared = obj.__name__.startswith("_") or any(c is not obj and issubclass(c, obj) for c in registered)
            concrete = not shared
            if concrete and issubclass(obj, AttentionBase) and obj.__module__ == module.__name__:
                if "_attend" in {k for c in obj.__mro__[:-1] if c is not AttentionBase for k in vars(c)}:
                    found.add(obj)
    unregistered = [c.__qualname__ for c in found if getattr(c, "name", "") not in VARIANTS]
    assert not unregistered, f"attention classes not registered (so not tested): {unregistered}"
    assert {"softmax", "kernel", "kernel-asym"} <= set(VARIANTS)
    assert VARIANTS == sorted(VARIANTS)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: .*softmax"):
        gpattn.build_attention("nope", 8, 2)


def test_public_api_sorted():
    assert gpattn.__all__ == sorted(gpattn.__all__)
    for sub in ("attention", "kernels", "variational", "testing", "experiments"):
        mod = importlib.import_module(f"gpattn.{sub}")
        assert mod.__all__ == sorted(mod.__all__), sub
        for name in mod.__all__:
            assert hasattr(mod, name), f"gpattn.{sub}.{name} listed but missing"


def test_a_test_case_runs_the_invariants_it_names():
    """``invariants`` picks the checks a BaseAttentionTestCase class runs (the others are no test methods);
    an unknown check is an error that lists the valid ones."""
    subset = type("TestSubset", (BaseAttentionTestCase,), {"attention": "softmax", "invariants": ("shape",)})
    assert callable(subset.test_invariant_shape) and subset.test_invariant_padding is None
    with pytest.raises(ValueError, match=r"unknown checks \['no_such_check'\]; valid: shape"):
        type("TestBad", (BaseAttentionTestCase,), {"attention": "softmax", "invariants": ("no_such_check",)})
