r"""The one protocol of every GP attention variant: a strategy and its per-call conditional.

GPyTorch keeps a variational distribution q(u) apart from the strategy that maps it to q(f)
(``gpytorch.variational._VariationalStrategy``). The GP attention variants cannot subclass that
class — their inducing inputs are computed from each sequence (the keys, the KSVD features, the
latent inputs), not fixed parameters — so they keep its vocabulary through two small classes:

* :class:`AmortisedVariationalStrategy` (a ``gpytorch.Module``: ``named_hyperparameters()``,
  ``variational_parameters()``, ``register_prior`` work on it) owns the kernel and the variational
  parameters; ``condition(*inputs, mask)`` factorises once for a batch of sequences and returns
* an :class:`AmortisedConditional`, an explicit per-call object (no cache on the strategy) with
  ``prior_distribution``, ``variational_distribution``, ``kl_divergence()``, ``mean``,
  ``rsample(num_samples=None)`` (a leading sample axis, P draws from the one factorisation),
  ``posterior()`` (a gpytorch ``MultivariateNormal``, batch ``(B, H, Dv)``, event ``T``, carrying the
  numerics policy) and ``added_loss_terms(mask)``: the layer's loss terms as
  :class:`gpattn.objectives.GPLossTerm` kinds, reduced as docs/derivations.md §9 says
  (:func:`sequence_mean`).

Calling a strategy returns q(f) at the queries, ``strategy(*inputs, mask=mask)``, as calling a gpytorch
variational strategy does. Exact CGP is not variational: its conditional has no q(u) and no KL (those
members raise ``NotImplementedError`` saying why), and its loss term is the regulariser.
"""

from __future__ import annotations

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal

from gpattn._migrate import migrate_state_dict
from gpattn.objectives import GPLossTerm, SequenceKL
from gpattn.variational._scale import check_prior_factor

__all__ = [
    "AmortisedConditional",
    "AmortisedVariationalStrategy",
    "check_query_inputs",
    "kept_mean",
    "sequence_mean",
]


def check_query_inputs(queries: torch.Tensor, keys: torch.Tensor) -> None:
    """Cross-attention's queries against the keys: the same (B, H) and head width, any number of tokens.
    # shape: queries (B, H, T, Dh), keys (B, H, S, Dh)"""
    if queries.dim() != 4 or queries.shape[:2] != keys.shape[:2] or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"query_inputs must have shape (B, H, T, Dh) with the (B, H) and Dh of the keys {tuple(keys.shape)}, "
            f"got {tuple(queries.shape)}"
        )


def kept_mean(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Mean over the batch axis 0 of the rows where ``keep`` is True (all of them for ``None``), without a
    host read.  # shape: t (B, ...), keep (B,) bool or None -> (...)"""
    if keep is None:
        return t.mean(0)
    keep = keep.reshape(-1, *([1] * (t.dim() - 1)))
    return torch.where(keep, t, 0).sum(0) / keep.sum().clamp_min(1).to(t.dtype)


def sequence_mean(per_sequence: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reduction of a per-sequence loss term (docs/derivations.md §9), written once for every
    variant: summed over every axis but the batch (heads, output columns), then averaged over the
    sequences with at least one real key (all-padding rows of ``mask`` left out, without a host read).

    # shape: per_sequence (B, ...) , mask (B, T) bool (True = padding) or None -> ()
    """
    dims = tuple(range(1, per_sequence.dim()))
    per = per_sequence.sum(dims) if dims else per_sequence  # shape: (B,)
    return kept_mean(per, None if mask is None else ~mask.all(-1))


class AmortisedConditional:
    """The factors of one forward pass of a GP variant (returned by a strategy's ``condition``).

    Subclasses set ``mean`` and implement :meth:`rsample`, :meth:`posterior` and, where the
    variant is variational, :meth:`kl_divergence`, :attr:`prior_distribution` and
    :attr:`variational_distribution`. :meth:`added_loss_terms` defaults to one per-sequence KL
    (``kl_seq``) of :meth:`kl_divergence` per (b, h, d).

    :ivar mean: the posterior mean of the head outputs.  # shape: (B, H, T, Dv)
    :ivar output_dtype: the dtype the layer hands on (``None``: as computed, in full precision).
    """

    mean: torch.Tensor
    output_dtype: torch.dtype | None = None

    def _not_variational(self, member: str):
        raise NotImplementedError(
            f"{type(self).__name__}.{member}: this variant defines no q(u) of its own (its conditional is "
            f"exact given the inputs); use posterior() for q(f) and added_loss_terms() for its loss terms"
        )

    @property
    def prior_distribution(self) -> MultivariateNormal:
        """p(u) of the variant's inducing variables (gpytorch's ``prior_distribution``)."""
        self._not_variational("prior_distribution")

    @property
    def variational_distribution(self) -> MultivariateNormal:
        """q(u) of the variant's inducing variables (gpytorch's ``variational_distribution``)."""
        self._not_variational("variational_distribution")

    def kl_divergence(self) -> torch.Tensor:
        """KL(q(u) ‖ p(u)).  # shape: -> (B, H, Dv) for a per-sequence KL"""
        self._not_variational("kl_divergence()")

    def rsample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Reparameterised draw(s) of the head outputs, drawn batch-major
        (:func:`gpattn.variational._linalg.standard_normal`).

        # shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P
        """
        raise NotImplementedError

    def posterior(self) -> MultivariateNormal:
        """q(f): batch ``(B, H, Dv)``, event ``T``."""
        raise NotImplementedError

    def added_loss_terms(self, mask: torch.Tensor | None = None) -> tuple[GPLossTerm, ...]:
        """This forward's loss terms, reduced (docs/derivations.md §9). ``mask`` is the caller's key padding mask,
        all-padding rows included (they are left out of the means). Default: ``kl_seq``, the mean over
        the sequences of :meth:`kl_divergence` summed over (h, d), where the subclass defines one; none
        otherwise."""
        if type(self).kl_divergence is AmortisedConditional.kl_divergence:
            return ()
        return (SequenceKL(sequence_mean(self.kl_divergence(), mask)),)


class AmortisedVariationalStrategy(gpytorch.Module):
    """Base of the GP variants' strategies: subclasses implement :meth:`condition`. A state dict an older gpattn saved
    is migrated on load by one pre-hook (:func:`gpattn._migrate.migrate_state_dict`)."""

    def __init__(self):
        super().__init__()
        self._register_load_state_dict_pre_hook(migrate_state_dict, with_module=True)

    def condition(self, *inputs: torch.Tensor, mask: torch.Tensor | None = None) -> AmortisedConditional:
        """Factorise once for a batch of sequences.  # shape: inputs (B, H, T, ·), mask (B, T) or None"""
        raise NotImplementedError

    def scale_prior(self, factor: float) -> None:
        """Multiply the prior variance of the GP's output at a token by ``factor``, in place (the prior's
        shape is kept): by default through the kernel's outputscale(s)
        (:func:`gpattn.kernels.scale_prior_variance`). Used to put a layer on the scale of a residual
        stream other than the LayerNorm-ed one its initialisation assumes (gpattn.variational._scale).
        Subclasses whose prior variance is not a kernel's outputscale override ``_scale_prior``."""
        self._scale_prior(check_prior_factor(factor))

    def _scale_prior(self, factor: float) -> None:
        from gpattn.kernels import scale_prior_variance

        scale_prior_variance(self.kernel, factor, name=f"{type(self).__name__}.kernel")

    def forward(self, *inputs: torch.Tensor, **options) -> MultivariateNormal:
        """q(f) at the queries: ``condition(*inputs, **options).posterior()``.
        # shape: -> batch (B, H, Dv), event T"""
        return self.condition(*inputs, **options).posterior()

    def kl_divergence(self, *inputs: torch.Tensor, **options) -> torch.Tensor:
        """The conditional's KL for these inputs: ``condition(*inputs, **options).kl_divergence()``."""
        return self.condition(*inputs, **options).kl_divergence()
