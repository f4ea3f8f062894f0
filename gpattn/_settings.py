"""Global switches of gpattn that users toggle with context managers (no import-time side effects)."""

from __future__ import annotations

import contextlib
import threading

__all__ = ["deterministic", "is_deterministic"]

_STATE = threading.local()


def _stack() -> list[bool]:
    if not hasattr(_STATE, "stack"):
        _STATE.stack = []
    return _STATE.stack


def is_deterministic() -> bool:
    """True inside ``with gpattn.deterministic():`` (the innermost block decides)."""
    stack = _stack()
    return bool(stack[-1]) if stack else False


class deterministic(contextlib.ContextDecorator):
    """Switch every stochastic attention layer to its mean.

    GP variants return their posterior mean, Gumbel variants their noise-free attention. Nests; the
    innermost block wins, so ``with deterministic(False):`` restores sampling inside an outer block.
    Thread-local. Usable as a decorator.

    Example::

        with gpattn.deterministic():
            y_mean = layer(x)
    """

    def __init__(self, state: bool = True):
        if not isinstance(state, bool):
            raise ValueError(f"deterministic(state) takes True or False, got {state!r}")
        self.state = state

    def __enter__(self):
        _stack().append(self.state)
        return self

    def __exit__(self, *exc):
        _stack().pop()
        return False
