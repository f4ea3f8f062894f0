"""``BaseAttentionTestCase``: the attention contract's invariants as test methods (like
``gpytorch.test.base_kernel_test_case.BaseKernelTestCase``).

A test class names a registered variant and its options; it gets one test method per invariant of
:data:`gpattn.testing.ATTENTION_INVARIANTS` (``test_invariant_shape``, ``test_invariant_padding``, …)::

    class TestSGPADiag(BaseAttentionTestCase):
        attention = "sgpa"
        options = {"covariance": "diag"}

``invariants`` restricts the checks to a subset (e.g. a mode that only runs at a fixed length); the
others are not collected. The classes hold no state, use plain ``assert`` and need no pytest: they run
under pytest as they are, and under unittest mixed with ``unittest.TestCase``.
"""

from __future__ import annotations

from gpattn.testing.invariants import ATTENTION_INVARIANTS, run_attention_invariant

__all__ = ["BaseAttentionTestCase"]


def _invariant_test(check: str):
    def test(self):
        run_attention_invariant(check, self.attention, **self.options)

    test.__name__ = f"test_invariant_{check}"
    test.__doc__ = ATTENTION_INVARIANTS[check].__doc__
    return test


class BaseAttentionTestCase:
    """Mixin: the contract's invariants for ``attention`` built with ``options``.

    :cvar attention: the variant under test: its registered name, or its layer class (a subclass of
        :class:`gpattn.attention.AttentionBase`; no registration needed).
    :cvar options: keyword options of ``build_attention``.
    :cvar invariants: the names of the invariants to run (``None``: all of ``ATTENTION_INVARIANTS``;
        ``()``: none, e.g. where tests/test_attention_invariants.py runs them at the default options).
    """

    attention: str | type = ""
    options: dict = {}
    invariants: tuple[str, ...] | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        unknown = set(cls.invariants or ()) - set(ATTENTION_INVARIANTS)
        if unknown:
            valid = ", ".join(ATTENTION_INVARIANTS)
            raise ValueError(f"{cls.__name__}.invariants names unknown checks {sorted(unknown)}; valid: {valid}")
        for check in ATTENTION_INVARIANTS:  # a check left out is not a test method (None is not collected)
            wanted = cls.invariants is None or check in cls.invariants
            setattr(cls, f"test_invariant_{check}", _invariant_test(check) if wanted else None)
