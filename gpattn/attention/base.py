"""The attention contract: one base class every variant derives from.

A variant implements ``_attend(call)``: it reads one forward's inputs from an
:class:`gpattn.attention.AttentionCall` (the input, the mask to attend under, P, whether to sample and to return
weights) and returns its per-head outputs ``(B, H, T, Dv)`` — or ``num_samples`` draws per sequence on a leading
axis, ``(P, B, H, T, Dv)`` — as a tensor or an :class:`gpattn.attention.Attended` (heads, a GP variant's posterior
mean, attention weights). The GP variants derive from :class:`gpattn.attention.GPAttention`, which implements it
(and ``_posterior``, a gpytorch ``MultivariateNormal`` with batch ``(B, H, Dv)`` and event ``T``) through their
strategy's conditional. The base class validates inputs and masks and settles the sample axis once per forward
(:mod:`gpattn.attention._call`, :mod:`gpattn.attention._masks`), projects (one fused input projection,
:mod:`gpattn.attention._projection`), merges heads, applies ``W_o``, handles all-padding rows and keeps two records
of the last forward, both updated in place (:mod:`gpattn.attention._records`): the loss terms (GPyTorch added loss
terms, :meth:`~gpattn.attention._records.ForwardRecords.set_loss_terms`) and the diagnostics
(:meth:`~gpattn.attention._records.ForwardRecords.diagnostics`). No other attribute is written by a forward.

No host-device synchronisation in a forward: the checks that read tensor values (NaN/Inf inputs) run
only with ``gpattn.validation()`` on, and all-padding rows are handled by masked arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpattn._settings import is_deterministic
from gpattn.attention._call import Attended, AttentionCall, check_call_inputs, finish_call, prepare_call
from gpattn.attention._masks import attn_mask_excluded, check_inputs, excluded_keys, posterior_masks
from gpattn.attention._mha import multihead_call
from gpattn.attention._projection import FusedProjection
from gpattn.attention._records import ForwardRecords
from gpattn.attention._samples import attend_sample_rows, has_sample_axis

__all__ = ["AttentionBase", "excluded_keys"]


class AttentionBase(ForwardRecords, FusedProjection, nn.Module):
    """Multi-head self-attention with ``x (B, T, D) -> y (B, T, D)``.

    :param embed_dim: model width D (divisible by ``num_heads``).
    :param num_heads: H; head width Dh = D / H.
    :param bias: bias of the input and output projections.
    :param batch_first: layout of nn.MultiheadAttention's call (:meth:`forward_mha`): (B, T, D) when True
        (default), (T, B, D) otherwise; gpattn's own call ``layer(x, key_padding_mask)`` is always (B, T, D).

    Class attributes set by subclasses:
    ``projections`` — names of the per-head input projections (fused into one linear map, ``in_proj``; each
    one's rows: :meth:`~gpattn.attention._projection.FusedProjection.projection_rows`);
    ``value_dim`` — per-head output width Dv (``None`` = Dh);
    ``is_gp`` — whether ``posterior()`` is available; ``stochastic`` — whether it samples.

    All-padding rows (every key padded) are a defined result: the output is 0 for that sequence, and
    the sequence is left out of the variant's loss terms (``kl_seq`` averages over the other sequences,
    :meth:`gpattn.attention.AttentionCall.batch_mean`) and diagnostics. Without reading the mask on the host,
    such a row runs through the variant's math as if unpadded (finite values), and its output is then zeroed.
    """

    name: str = ""
    projections: tuple[str, ...] = ("q", "k", "v")
    is_gp: bool = False
    stochastic: bool = False
    #: ``_attend`` draws ``call.num_samples`` samples from one factorisation, on a leading axis (the GP variants);
    #: otherwise a sampling forward with ``num_samples`` repeats the batch P times before ``_attend``
    native_samples: bool = False
    #: whether ``_attend`` takes a per-query mask ``(B, H or 1, T, T)`` from ``attn_mask`` (read it through
    #: :func:`excluded_keys`); otherwise it gets only key padding ``(B, T)``, and an ``attn_mask`` that does
    #: more than pad is a ``ValueError`` (docs/derivations.md §11). Opt-in: a variant must handle the mask.
    #: A GP variant with per-query masks gets a mask that pads as key padding (one GP for the sequence,
    #: exactly), and other masks as they are: a query with no allowed key is its own concern (no inducing
    #: input); the other variants get such rows opened to every key (their output is zeroed afterwards).
    per_query_masks: bool = False
    #: whether ``_attend`` takes cross-attention (opt-in; docs/derivations.md §13): queries of ``call.x``, keys and
    #: values of ``call.context``
    #: (:meth:`~gpattn.attention._projection.FusedProjection.project_call`); ``no_cross_attention``: why a variant
    #: refuses it
    cross_attention: bool = False
    #: an ``attn_mask`` that only pads joins ``key_padding_mask`` (one read of the mask), as for the GP
    #: variants, so that the variant's key-padding path runs: the kernel attentions' fused path
    #: (docs/derivations.md §12), whose output is then the key-padding output exactly
    fused_key_padding: bool = False
    no_cross_attention: str = ""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        bias: bool = True,
        value_dim: int | None = None,
        batch_first: bool = True,
    ):
        super().__init__()
        if not isinstance(batch_first, bool):
            raise ValueError(f"batch_first must be True or False, got {batch_first!r}")
        #: layout of the nn.MultiheadAttention call (:meth:`forward_mha`): (B, T, D) when True, else (T, B, D)
        self.batch_first = batch_first
        for arg, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{arg} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if value_dim is not None and (isinstance(value_dim, bool) or not isinstance(value_dim, int) or value_dim < 1):
            raise ValueError(f"value_dim must be a positive int or None, got {value_dim!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.value_dim = value_dim or self.head_dim
        self._build_in_proj(bias)  # in_proj: the fused input projection (gpattn.attention._projection)
        self.out_proj = nn.Linear(num_heads * self.value_dim, embed_dim, bias=bias)
        self._init_records()  # the loss terms and diagnostics of the last forward (gpattn.attention._records)

    # ------------------------------------------------------------------ helpers for subclasses
    # (and project, project_call, split_heads, projection_rows: gpattn.attention._projection; set_loss_terms:
    # gpattn.attention._records)
    @property
    def sampling(self) -> bool:
        """Whether this forward should sample (stochastic variant, outside ``gpattn.deterministic()``)."""
        return self.stochastic and not is_deterministic()

    # ------------------------------------------------------------------ to implement
    def _attend(self, call: AttentionCall) -> torch.Tensor | Attended:
        """The variant's attention of one forward (:class:`gpattn.attention.AttentionCall`): the per-head
        outputs ``(B, H, T, Dv)`` as a tensor, or an :class:`gpattn.attention.Attended` with the posterior
        mean (GP variants) and the weights (``call.need_weights``); variants with ``native_samples`` draw
        ``call.num_samples`` samples on a leading axis (``(P, B, H, T, Dv)``, gpytorch's ``rsample(P)``) when it is
        set."""
        raise NotImplementedError

    def _posterior(self, x: torch.Tensor, mask: torch.Tensor | None, context: torch.Tensor | None = None):
        from gpattn.attention.registry import _REGISTRY

        gp = sorted(n for n, c in _REGISTRY.items() if c.is_gp)
        raise NotImplementedError(
            f"attention {self.name or type(self).__name__!r} is not a GP variant and has no posterior(); GP "
            f"variants: {', '.join(gp)}"
        )

    # ------------------------------------------------------------------ the contract
    def check_inputs(self, x, key_padding_mask=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate ``x (B, T, D)`` and ``key_padding_mask (B, T)`` bool; return them."""
        return check_inputs(x, key_padding_mask, self.embed_dim)

    def attn_mask_excluded(self, attn_mask: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """An ``attn_mask`` as nn.MultiheadAttention takes it — bool (True = not allowed) or additive float,
        of shape (T, T), (B·H, T, T), (B, T, T) or (B or 1, H or 1, T, T) — as a bool mask (True = excluded)
        of shape (B or 1, H or 1, T, T)."""
        return attn_mask_excluded(attn_mask, B, self.num_heads, T)

    def forward(self, *args, **kwargs):
        """Two call signatures, told apart by the second argument:

        * gpattn's own, ``layer(x, key_padding_mask=None, num_samples=None, *, attn_mask=None, context=None)``
          → the output tensor (:meth:`forward_gp`; ``context``: cross-attention's keys and values);
        * nn.MultiheadAttention's, ``layer(query, key, value, key_padding_mask=None, need_weights=True,
          attn_mask=None, average_attn_weights=True, is_causal=False)`` → ``(output, weights or None)``
          (:meth:`forward_mha`), taken when a third positional argument is a tensor (the value; gpattn's
          third is ``num_samples``, an int) or ``query``/``key``/``value`` is passed by name: this is how
          torch's transformer layers call ``self_attn``.
        """
        if (len(args) > 2 and torch.is_tensor(args[2])) or {"query", "key", "value"} & set(kwargs):
            return self.forward_mha(*args, **kwargs)
        return self.forward_gp(*args, **kwargs)

    #: nn.MultiheadAttention's call ``layer(query, key, value, ...)`` → ``(output, weights or None)``
    #: (:func:`gpattn.attention._mha.multihead_call`, an adapter around :meth:`attend`)
    forward_mha = multihead_call

    def forward_gp(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        num_samples: int | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """# shape: x (B, T, D), key_padding_mask (B, T) bool (True = padding) -> (B, T, D); with
        ``num_samples=P`` -> (P, B, T, D), a leading sample axis (``y[p, b]`` is draw p of sequence b); x with a
        sample axis (P, B, T, D) -> (P, B, T, D), one draw per incoming sample (``num_samples`` None).

        ``context`` (B, S, D): cross-attention, queries from x and keys and values from ``context``;
        ``key_padding_mask`` (B, S) pads the keys (docs/derivations.md §13). None: self-attention.

        ``attn_mask`` (as in :meth:`attn_mask_excluded`; True = not allowed) excludes keys per query: a
        query with no allowed key gets head output 0 (output 0 where that holds in every head). The
        variants without ``per_query_masks`` (``kep-svgp``, ``cgp``, ``scgp``) take only an ``attn_mask`` that
        pads, which then acts exactly as ``key_padding_mask``; so does a mask that pads for ``sgpa`` and
        ``sgpa-decoupled``, which condition each query on the keys it may attend to under any other mask
        (docs/derivations.md §11; a GP variant reads the mask once on the host to tell).

        With ``num_samples`` a GP variant factorises once per sequence and draws its P samples from
        that factorisation (the first sampling layer of a deep GP, docs/derivations.md §9); a layer that does not
        sample in this forward computes its output once and expands it (a view); the other stochastic variants
        (Gumbel attention) run on the batch repeated P times. The loss terms are those of the B
        sequences (each sequence's terms once, as with the repeated batch, whose rows share them). Given a
        sample axis, the layer runs on the P·B rows, batch-major (:mod:`gpattn.attention._samples`: the masks and
        a context without the axis follow their input's rows), and its loss terms are those of the P·B rows."""
        return self.attend(x, key_padding_mask, num_samples, attn_mask=attn_mask, context=context)[0]

    def attend(
        self, x, key_padding_mask=None, num_samples=None, *, attn_mask=None, need_weights: bool = False, context=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward_gp`'s output and, with ``need_weights``, the variant's attention weights
        ``(B, H, T, S)`` (None for the variants without weights): one explicit call, prepared once
        (:func:`gpattn.attention._call.prepare_call`), attended by the variant, finished by the base."""
        if torch.is_tensor(x) and has_sample_axis(x):
            return attend_sample_rows(self, x, key_padding_mask, num_samples, attn_mask, need_weights, context)
        call = prepare_call(self, x, key_padding_mask, num_samples, attn_mask, need_weights, context)
        self._clear_records()
        if call.x.shape[0] == 0:  # empty batch: a defined zero result with a graph
            y = call.x.new_zeros(call.x.shape) + 0 * sum(p.sum() for p in self.parameters())
            return (y if num_samples is None else y.expand(num_samples, *y.shape)), None
        return finish_call(self, call, Attended.of(self._attend(call)))

    def posterior(self, x: torch.Tensor, key_padding_mask=None, *, attn_mask=None, context=None):
        """Posterior over the per-head outputs (before W_o): ``MultivariateNormal`` with batch
        ``(B, H, Dv)`` and event ``T``. GP variants only; the others raise ``NotImplementedError``.
        ``attn_mask`` and ``context`` as in :meth:`forward_gp`: under a per-query mask ``sgpa-decoupled``'s
        posterior is joint (the unmasked covariance, the masked mean); ``sgpa``'s is each
        query's marginal (diagonal, docs/derivations.md §11)."""
        x, context, key_padding_mask = check_call_inputs(self, x, key_padding_mask, context)
        S = None if context is None else context.shape[1]
        key_padding_mask, mask = posterior_masks(self, x, key_padding_mask, attn_mask, S)
        if key_padding_mask is not None and bool(key_padding_mask.all(-1).any()):  # an analysis call: may read
            raise ValueError("posterior(): a sequence in the batch has every key padded (no posterior to give)")
        return self._posterior(x, mask) if context is None else self._posterior(x, mask, context)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, embed_dim={self.embed_dim}, num_heads={self.num_heads}"
