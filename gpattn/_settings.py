"""Global switches of gpattn that users toggle with context managers (no import-time side effects).

Both switches are process-wide, not thread-local: a block opened in one thread is seen by every
thread of the process (``nn.DataParallel`` replicas, data-loader or serving threads). Blocks nest
as a stack; the innermost open block decides.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["deterministic", "is_deterministic", "is_validating", "set_validation", "validation"]

_LOCK = threading.Lock()
_DETERMINISTIC: list = []  # the open deterministic() blocks, innermost last
_VALIDATION: list = []  # the open validation() blocks, innermost last
_VALIDATION_DEFAULT = [False]  # set_validation(); off: no host-device synchronisation per forward


def _check_state(what: str, state) -> bool:
    if not isinstance(state, bool):
        raise ValueError(f"{what}(state) takes True or False, got {state!r}")
    return state


def is_deterministic() -> bool:
    """True inside ``with gpattn.deterministic():`` (the innermost block decides)."""
    return _DETERMINISTIC[-1].state if _DETERMINISTIC else False


class _Switch(contextlib.ContextDecorator):
    """A block pushes itself on its switch's stack and removes itself on exit (itself, not the top:
    blocks of different threads may close out of order)."""

    _stack: list
    _what = ""

    def __init__(self, state: bool = True):
        self.state = _check_state(self._what, state)

    def __enter__(self):
        with _LOCK:
            self._stack.append(self)
        return self

    def __exit__(self, *exc):
        with _LOCK:
            for i in range(len(self._stack) - 1, -1, -1):
                if self._stack[i] is self:
                    del self._stack[i]
                    break
        return False


class deterministic(_Switch):
    """Switch every stochastic attention layer to its mean.

    GP variants return their posterior mean, Gumbel variants their noise-free attention. Nests; the
    innermost block wins, so ``with deterministic(False):`` restores sampling inside an outer block.
    Process-wide: layers running in other threads (``nn.DataParallel`` replicas) see the block too.
    Usable as a decorator.

    Example::

        with gpattn.deterministic():
            y_mean = layer(x)
    """

    _stack = _DETERMINISTIC
    _what = "deterministic"


def is_validating() -> bool:
    """Whether layers, models and objectives run their value checks (innermost :class:`validation`
    block, else :func:`set_validation`; off by default)."""
    return _VALIDATION[-1].state if _VALIDATION else _VALIDATION_DEFAULT[0]


def set_validation(state: bool) -> None:
    """Turn value checks on or off for the whole process (as ``torch.distributions``'
    ``Distribution.set_default_validate_args``).

    Shape, dtype and option checks always run: they read no tensor value. The checks that must read
    values from the device — and so synchronise the host with it on every forward — run only with
    validation on: NaN/Inf inputs, token ids and labels out of range, and the Cholesky failure check
    with its bounded jitter escalation and a ``NotPSDError`` naming the layer. Off (the default), a
    failed factorisation gives NaN instead, which the trainer reports as a divergence.
    """
    _VALIDATION_DEFAULT[0] = _check_state("set_validation", state)


class validation(_Switch):
    """``with gpattn.validation():`` runs the value checks of :func:`set_validation` inside the block
    (``validation(False)`` turns them off). Process-wide, nests, usable as a decorator."""

    _stack = _VALIDATION
    _what = "validation"
