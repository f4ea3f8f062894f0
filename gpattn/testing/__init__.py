"""Shipped test helpers (like ``gpytorch.test``): the invariant checks every attention variant passes,
and small input factories. Users adding a variant run the same checks on theirs."""

from gpattn.testing.invariants import (
    ATTENTION_INVARIANTS,
    make_inputs,
    run_attention_invariant,
)

__all__ = [
    "ATTENTION_INVARIANTS",
    "make_inputs",
    "run_attention_invariant",
]
