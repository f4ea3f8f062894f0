"""``GPAttentionTestCase``: what every GP attention variant must satisfy beyond the contract's
invariants, against a dense float64 reference.

A subclass names the variant, its options and its dense reference; every test below then runs::

    class TestSGPA(GPAttentionTestCase):
        attention = "sgpa"
        options = {"jitter": 0.0}

        def dense_reference(self, layer, x, mask):
            return sgpa_dense_posterior(layer, x, mask)

Tests (each a method; a class attribute set to ``None`` switches the shape off where the variant does
not define it):

- ``test_posterior_matches_dense_reference``: ``layer.posterior`` (mean, covariance) and the loss
  terms against :meth:`GPAttentionTestCase.dense_reference`, for each seed of ``reference_seeds``;
- ``test_padding_equals_truncated_sequence``: padded tokens (with garbage in them) change nothing
  of the real tokens' posterior and deterministic output against the truncated sequence;
- ``test_sample_moments``: ``moment_samples`` draws (:meth:`GPAttentionTestCase.draw_samples`) against
  the posterior's analytic mean and covariance (5 standard errors), tokens correlated unless ``independent_tokens``;
- ``test_deterministic_is_posterior_mean``: under ``gpattn.deterministic()`` the layer is
  W_o(posterior mean);
- ``test_monte_carlo_average_is_deterministic_layer``: E[layer(x)] = the deterministic layer
  (``mc_passes`` stochastic passes, 5 standard errors);
- ``test_exact_algebra_above_800_tokens``: at T = 900 > gpytorch's 800-point switch no CG/Lanczos
  runs and the marginal variances and loss terms equal the dense reference (rtol 1e-6);
- ``test_float32_forward_backward_at_T1024``: float32, T = 1024 with 100 padded tokens: finite
  output, loss terms and gradients.

:meth:`GPAttentionTestCase.make_layer` builds a float64 layer (``embed_dim``, ``num_heads``,
``options``) and calls :meth:`GPAttentionTestCase.perturb` to move it away from its initialisation;
:meth:`GPAttentionTestCase.check_truncation_extras` adds a variant's own checks to the padding test.
"""

from __future__ import annotations

import unittest

import gpytorch
import linear_operator
import torch

from gpattn._settings import deterministic
from gpattn.attention._call import Attended, AttentionCall
from gpattn.attention.registry import build_attention
from gpattn.testing.assertions import assert_samples_match_moments, layer_loss_terms, spy_iterative_solvers
from gpattn.testing.base_attention_test_case import BaseAttentionTestCase

__all__ = ["GPAttentionTestCase"]

F64 = torch.float64


def _padding_mask(B: int, T: int, padded: dict | None) -> torch.Tensor | None:
    """(B, T) bool with ``padded[row]`` positions True; None for no padding."""
    if padded is None:
        return None
    mask = torch.zeros(B, T, dtype=torch.bool)
    for row, positions in padded.items():
        mask[row, list(positions)] = True
    return mask


def _assert_loss_terms(terms: dict, reference: dict, **tolerance) -> None:
    """Every loss term the reference knows equals the layer's (``torch.testing.assert_close``)."""
    for name, value in reference.items():
        assert name in terms, f"the layer reports no loss term {name!r} (it reports {sorted(terms)})"
        torch.testing.assert_close(terms[name], value, **tolerance, msg=lambda m, name=name: f"loss term {name}: {m}")


def _heads_to_tokens(heads: torch.Tensor) -> torch.Tensor:
    """# shape: (B, H, Dv, T) -> (B, T, H·Dv)"""
    B, H, Dv, T = heads.shape
    return heads.permute(0, 3, 1, 2).reshape(B, T, H * Dv)


class GPAttentionTestCase(BaseAttentionTestCase):
    """Mixin for GP variants: the invariants plus the GP shapes listed in the module docstring.

    :cvar embed_dim: the width D of the float64 test layer.
    :cvar num_heads: its H.
    :cvar float64_options: options added to ``options`` for the float64 test layer (e.g. ``jitter=0``
        for verification); the invariants and the T = 1024 test use ``options`` alone.
    :cvar reference_seeds: layer / input seeds of the dense-reference test.
    :cvar reference_padding: ``{row: padded positions}`` of the (2, 6) reference input, or ``None``.
    :cvar mean_tolerance: ``torch.testing.assert_close`` keywords of the reference test's mean (``{}``:
        its float64 defaults); ``covariance_tolerance`` and ``loss_term_tolerance`` the same for the
        covariance and the loss terms.
    :cvar truncation_padding: padded positions of row 1 of a (2, ``truncation_length``) input
        (``None``: no padding test); ``truncation_garbage`` scales N(0, 1) garbage in them (0: none).
    :cvar moment_samples: P of the moments test (``None``: no moments test); ``moment_padding`` the
        padded positions of its single T = 5 sequence; ``independent_tokens``: samples are drawn
        token by token (zero cross-token covariance) whatever the posterior's covariance.
    :cvar mc_passes: stochastic passes of the E[layer] test.
    :cvar exact_options: options added to ``options`` for the T = 900 layer (D = 4, H = 1); ``None``: no
        such test.
    :cvar long_padding: the padded tokens of the float32 T = 1024 test (``None``: no such test).
    """

    embed_dim: int = 8
    num_heads: int = 2
    float64_options: dict = {}
    reference_seeds: tuple[int, ...] = (0,)
    reference_padding: dict | None = None
    mean_tolerance: dict = {}
    covariance_tolerance: dict = {}
    loss_term_tolerance: dict = {}
    truncation_length: int = 7
    truncation_padding: tuple[int, ...] | None = (0, 3, 4)
    truncation_garbage: float = 0.0
    truncation_tolerance: dict = {"rtol": 1e-10, "atol": 1e-10}
    moment_samples: int | None = 4000
    moment_padding: tuple[int, ...] | None = None
    independent_tokens: bool = False
    mc_passes: int = 2000
    exact_options: dict | None = {}
    long_padding: slice | None = slice(-100, None)

    # ------------------------------------------------------------------ hooks
    def make_layer(self, seed: int = 0, **options):
        """The float64 layer under test, seeded, moved off its initialisation by :meth:`GPAttentionTestCase.perturb`."""
        torch.manual_seed(seed)
        options = {**self.options, **self.float64_options, **options}
        layer = build_attention(self.attention, self.embed_dim, self.num_heads, **options).double()
        with torch.no_grad():
            self.perturb(layer)
        return layer

    def perturb(self, layer) -> None:
        """Set the layer's parameters away from their initialisation (in place, no grad); default none."""

    def make_inputs(self, B: int = 2, T: int = 6, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(B, T, self.embed_dim, generator=g, dtype=F64)

    def dense_reference(self, layer, x, mask):
        """The layer's posterior recomputed densely: a :class:`gpattn.testing.DenseReference`."""
        raise NotImplementedError(f"{type(self).__name__} defines no dense_reference(layer, x, mask)")

    def draw_samples(self, layer, x, mask, num_samples: int) -> torch.Tensor:
        """``num_samples`` head-space draws of the layer's own sampler: from the conditional's
        ``rsample(num_samples)`` where the layer has one, else one stochastic ``_attend`` of the batch
        repeated ``num_samples`` times.  # shape: x (B, T, D) -> (P, B, H, Dv, T)"""
        condition = getattr(layer, "_condition", None)
        if condition is not None:
            return condition(x, mask).rsample(num_samples=num_samples).transpose(-1, -2)
        B, T, D = x.shape
        rep = x.repeat(num_samples, 1, 1)
        call = AttentionCall(rep, None if mask is None else mask.repeat(num_samples, 1), sampling=layer.sampling)
        heads = Attended.of(layer._attend(call)).heads
        return heads.view(num_samples, B, *heads.shape[1:]).transpose(-1, -2)

    def check_truncation_extras(self, layer, x, mask, real) -> None:
        """A variant's own checks for the padding test (row 1 of ``x`` padded by ``mask``, ``real`` its
        real positions); default none."""

    # ------------------------------------------------------------------ tests
    def test_posterior_matches_dense_reference(self):
        if not self.reference_seeds:
            raise unittest.SkipTest(f"{type(self).__name__}: no dense reference (reference_seeds = ())")
        for seed in self.reference_seeds:
            layer, x = self.make_layer(seed), self.make_inputs(seed=seed)
            mask = _padding_mask(*x.shape[:2], self.reference_padding)
            ref = self.dense_reference(layer, x, mask)
            with torch.no_grad():
                post = layer.posterior(x, mask)
                torch.testing.assert_close(post.mean, ref.mean, **self.mean_tolerance)
                torch.testing.assert_close(post.covariance_matrix, ref.covariance, **self.covariance_tolerance)
                if layer.training:  # the terms a training forward records
                    layer(x, mask)
                    terms = layer_loss_terms(layer)
                else:  # an eval-mode forward records none: the same conditional's terms, in the layer's state
                    terms = {t.name: t.loss() for t in layer._condition(x, mask).added_loss_terms(mask)}
            _assert_loss_terms(terms, ref.loss_terms, **self.loss_term_tolerance)

    def test_padding_equals_truncated_sequence(self):
        if self.truncation_padding is None:
            raise unittest.SkipTest(f"{type(self).__name__}: no padding test (truncation_padding = None)")
        layer, x = self.make_layer(), self.make_inputs(T=self.truncation_length)
        mask = _padding_mask(*x.shape[:2], {1: self.truncation_padding})
        real = (~mask[1]).nonzero()[:, 0]
        if self.truncation_garbage:
            x[mask] = self.truncation_garbage * torch.randn(int(mask.sum()), x.shape[-1], dtype=F64)
        xt = x[1:, real]
        with torch.no_grad():
            post, post_t = layer.posterior(x, mask), layer.posterior(xt)
            tol = self.truncation_tolerance
            torch.testing.assert_close(post.mean[1][..., real], post_t.mean[0], **tol)
            cov = post.covariance_matrix[1][..., real, :][..., real]
            torch.testing.assert_close(cov, post_t.covariance_matrix[0], **tol)
            with deterministic():
                torch.testing.assert_close(layer(x, mask)[1, real], layer(xt)[0], **tol)
        self.check_truncation_extras(layer, x, mask, real)

    def test_sample_moments(self):
        if self.moment_samples is None:
            raise unittest.SkipTest(f"{type(self).__name__}: no moments test (moment_samples = None)")
        layer, x = self.make_layer(), self.make_inputs(B=1, T=5)
        mask = _padding_mask(1, 5, None if self.moment_padding is None else {0: self.moment_padding})
        with torch.no_grad():
            post = layer.posterior(x, mask)
            torch.manual_seed(3)
            f = self.draw_samples(layer, x, mask, self.moment_samples)  # shape: (P, B, H, Dv, T)
        cov = post.covariance_matrix
        target = torch.diag_embed(post.variance) if self.independent_tokens else cov
        _, se = assert_samples_match_moments(f, post.mean, target)
        off = ~torch.eye(5, dtype=torch.bool)
        if not self.independent_tokens:  # the analytic covariance really is correlated across tokens
            assert (cov[..., off].abs() / se[..., off]).max() > 10

    def test_deterministic_is_posterior_mean(self):
        layer, x = self.make_layer(), self.make_inputs()
        mask = _padding_mask(*x.shape[:2], self.reference_padding)
        with torch.no_grad(), deterministic():
            y0 = layer(x, mask)
            mean = layer.posterior(x, mask).mean
            torch.testing.assert_close(y0, layer.out_proj(_heads_to_tokens(mean)), rtol=1e-10, atol=1e-10)

    def test_monte_carlo_average_is_deterministic_layer(self):
        layer, x = self.make_layer(), self.make_inputs()
        with torch.no_grad():
            with deterministic():
                y0 = layer(x)
            torch.manual_seed(0)
            N = self.mc_passes
            ys = layer(x.repeat(N, 1, 1)).view(N, *x.shape)  # N stochastic passes at once
        assert not torch.allclose(ys[0], ys[1])
        se = ys.std(0) / N**0.5
        assert ((ys.mean(0) - y0).abs() / se).max() < 5

    def test_exact_algebra_above_800_tokens(self):
        if self.exact_options is None:
            raise unittest.SkipTest(f"{type(self).__name__}: no T > 800 test (exact_options = None)")
        torch.manual_seed(0)
        layer = build_attention(self.attention, 4, 1, **{**self.options, **self.exact_options}).double()
        x = torch.randn(1, 900, 4, dtype=F64)
        with (
            spy_iterative_solvers() as calls,
            gpytorch.settings.max_cholesky_size(800),
            linear_operator.settings.max_cholesky_size(800),
            torch.no_grad(),
        ):
            var = layer.posterior(x).variance
            y = layer(x)
            terms = layer_loss_terms(layer)
        assert calls == [], f"iterative solvers ran above 800 tokens: {calls}"
        assert torch.isfinite(y).all()
        ref = self.dense_reference(layer, x, None)
        torch.testing.assert_close(var, ref.covariance.diagonal(dim1=-2, dim2=-1), rtol=1e-6, atol=0)
        _assert_loss_terms(terms, ref.loss_terms, rtol=1e-6, atol=0)

    def test_float32_forward_backward_at_T1024(self):
        if self.long_padding is None:
            raise unittest.SkipTest(f"{type(self).__name__}: no T = 1024 test (long_padding = None)")
        torch.manual_seed(0)
        layer = build_attention(self.attention, 16, 2, **self.options)
        x = torch.randn(1, 1024, 16, requires_grad=True)
        mask = torch.zeros(1, 1024, dtype=torch.bool)
        mask[0, self.long_padding] = True
        y = layer(x, mask)
        terms = layer_loss_terms(layer)
        assert torch.isfinite(y).all() and all(torch.isfinite(t) for t in terms.values())
        (y.square().mean() + sum(terms.values(), torch.zeros(()))).backward()
        assert torch.isfinite(x.grad).all()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
