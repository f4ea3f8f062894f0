"""Shipped test infrastructure (like ``gpytorch.test``): the contract's invariant checks, test-case
mixins for attention variants and GP attention variants, dense float64 references and the assertions
they share. A user adding a variant subclasses :class:`GPAttentionTestCase` (docs/new_variant.md)."""

from gpattn.testing.assertions import (
    assert_samples_match_moments,
    layer_loss_terms,
    registered_attention,
    spy_iterative_solvers,
)
from gpattn.testing.base_attention_test_case import BaseAttentionTestCase
from gpattn.testing.gp_attention_test_case import GPAttentionTestCase
from gpattn.testing.invariants import (
    ATTENTION_INVARIANTS,
    make_inputs,
    run_attention_invariant,
)
from gpattn.testing.references import DenseReference

__all__ = [
    "ATTENTION_INVARIANTS",
    "BaseAttentionTestCase",
    "DenseReference",
    "GPAttentionTestCase",
    "assert_samples_match_moments",
    "layer_loss_terms",
    "make_inputs",
    "registered_attention",
    "run_attention_invariant",
    "spy_iterative_solvers",
]
