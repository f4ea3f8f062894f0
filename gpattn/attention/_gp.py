"""The one GP attention shim: every GP variant is a short declaration
on top of :class:`GPAttention` — its projections, its strategy (``self.strategy``, a
:class:`gpattn.variational._strategy.AmortisedVariationalStrategy`) and, where it needs more than the
projections, :meth:`GPAttention.strategy_inputs`.

A forward projects, conditions once (``strategy.condition(*args, mask=mask, **kwargs)``, the arguments from
:meth:`GPAttention.strategy_call`), draws from the conditional (P draws from the one factorisation with
``num_samples=P``, on a leading axis: ``native_samples = True``) or takes its mean
under ``gpattn.deterministic()``, and records the conditional's loss terms as GPyTorch added loss terms
(reduced once, :func:`gpattn.variational._strategy.sequence_mean`). ``posterior()`` is the conditional's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpattn.attention._call import Attended
from gpattn.attention.base import AttentionBase
from gpattn.variational._strategy import AmortisedConditional

__all__ = ["GPAttention"]


class GPAttention(AttentionBase):
    """Base of the GP variants: subclasses set ``projections`` and ``self.strategy`` in ``__init__``."""

    is_gp = True
    stochastic = True
    native_samples = True
    #: the projection the queries are read from in cross-attention (:meth:`query_inputs`)
    query_projection: str = "qk"

    @property
    def kernel(self):
        """The strategy's kernel (a gpytorch ``Kernel``)."""
        return self.strategy.kernel

    def scale_prior(self, factor: float) -> None:
        """Multiply the prior variance of the head outputs at a token by ``factor``, in place (the strategy's
        ``scale_prior``: a kernel's outputscale, CGP's σ_q², σ_k²; kep-svgp's σ² with its q(u_c)). For a
        stream other than the LayerNorm-ed one the initialisation assumes
        (:meth:`gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream`)."""
        self.strategy.scale_prior(factor)

    def strategy_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The strategy's inputs for ``x``: by default the per-head projections, in the order of
        ``projections``.  # shape: x (B, T, D) -> each (B, H, T, Dh or Dv)"""
        p = self.project(x)
        return tuple(p[name] for name in self.projections)

    def strategy_call(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], dict]:
        """``(args, kwargs)`` for x: the strategy's positional inputs (:meth:`strategy_inputs`) and its keyword
        inputs other than ``mask`` (none by default; cgp/scgp's separate prior mean: ``mean_values``), so that
        ``strategy(*args, mask=mask, **kwargs)`` is the layer's conditional in gpytorch's idiom."""
        return self.strategy_inputs(x), {}

    def query_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Cross-attention's queries: x through the rows of ``in_proj`` of ``query_projection`` alone
        (docs/derivations.md §13).  # shape: x (B, T, D) -> (B, H, T, Dh)"""
        rows = self.projection_rows()[self.query_projection]
        bias = None if self.in_proj.bias is None else self.in_proj.bias[rows]
        return self.split_heads(F.linear(x, self.in_proj.weight[rows], bias))

    def _strategy_args(self, x, context=None) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of ``strategy.condition`` besides ``mask``. Self-attention: the strategy's inputs of x.
        Cross-attention: its inputs of the context (keys, values, ...) and the queries of x (``query_inputs=``,
        where q(f) is evaluated)."""
        args, kwargs = self.strategy_call(x if context is None else context)
        if context is not None:
            kwargs = {**kwargs, "query_inputs": self.query_inputs(x)}
        return args, kwargs

    def _condition(self, x, mask, context=None) -> AmortisedConditional:
        args, kwargs = self._strategy_args(x, context)
        return self.strategy.condition(*args, mask=mask, **kwargs)

    def _attend(self, call):
        cond = self._condition(call.x, call.mask, call.context)
        out = cond.rsample(call.num_samples) if call.sampling else cond.mean  # shape: (B or P, B, H, T, Dv)
        # after the draw: a loss term that samples (CGP's prior samples) takes the random numbers after it. Only in
        # training: the terms are the objective's, and evaluation computes none (CGP's regulariser was ~37 % of its
        # evaluation time), so an eval-mode forward leaves loss_terms() empty, as it leaves diagnostics() empty
        terms = cond.added_loss_terms(call.loss_mask) if self.training else ()
        return self._attended(out, cond.mean, terms, cond.output_dtype)

    def _attended(self, out, mean, terms, dtype) -> Attended:
        """What ``_attend`` returns for the draw (or the mean) ``out``, recording the loss terms in training.
        # shape: out (B or P, B, H, T, Dv), mean (B, H, T, Dv)"""
        if self.training:
            self.set_loss_terms(*terms)
        if dtype is not None:
            out, mean = out.to(dtype), mean.to(dtype)
        return Attended(out, mean)

    def _posterior(self, x, mask, context=None):
        return self._condition(x, mask, context).posterior()
