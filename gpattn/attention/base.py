"""The attention contract: one base class every variant derives from.

A variant implements ``_attend(x, mask)`` returning per-head outputs ``(B, H, T, Dv)``; the GP variants
derive from :class:`gpattn.attention.GPAttention`, which implements it (and ``_posterior``, a gpytorch
``MultivariateNormal`` with batch ``(B, H, Dv)`` and event ``T``) through their strategy's conditional
and returns the pair ``(output, posterior mean)``, from which :meth:`AttentionBase.diagnostics`
measures the layer's scale. The base class validates inputs, projects, merges heads, applies ``W_o``,
handles all-padding rows and records the loss terms of the last forward (GPyTorch added loss terms,
:meth:`AttentionBase.set_loss_terms`).

No host-device synchronisation in a forward: the checks that read tensor values (NaN/Inf inputs) run
only with ``gpattn.validation()`` on, and all-padding rows are handled by masked arithmetic.
"""

from __future__ import annotations

import gpytorch
import torch
import torch.nn as nn

from gpattn._settings import is_deterministic, is_validating
from gpattn.objectives import GPLossTerm, summed_loss_terms
from gpattn.variational._strategy import kept_mean

__all__ = ["AttentionBase", "excluded_keys"]

#: an additive float mask entry at or below this value excludes its key (−∞, or a large negative number
#: as Hugging Face writes it): exp(−1e4) underflows to 0 in float32, so softmax gives such keys no weight
_ADDITIVE_EXCLUDED = -1e4


def excluded_keys(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask a variant's ``_attend`` receives, broadcastable against scores ``(B, H, T, T)``
    (True = the key is excluded for that query): a key padding mask ``(B, T)`` becomes ``(B, 1, 1, T)``,
    a per-query mask ``(B, H or 1, T, T)`` is returned as is."""
    if mask is None or mask.dim() == 4:
        return mask
    return mask[:, None, None, :]


def _as_excluded(mask: torch.Tensor, arg: str) -> torch.Tensor:
    """A bool mask (True = excluded, nn.MultiheadAttention's polarity) or an additive float mask (0 =
    allowed, −∞ or ≤ −1e4 = excluded) as bool, True = excluded."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(
            f"{arg} must be a bool tensor (True = not allowed) or an additive float tensor (0 or -inf), got "
            f"dtype {mask.dtype}"
        )
    excluded = mask <= _ADDITIVE_EXCLUDED
    if is_validating() and not bool((excluded | (mask == 0)).all()):  # reads the device: opt-in
        raise ValueError(
            f"{arg} is an additive float mask with values other than 0 and -inf (or <= {_ADDITIVE_EXCLUDED:g}): "
            f"gpattn's layers take masks, not attention biases; pass a bool mask"
        )
    return excluded


def _check_num_samples(num_samples) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int or None, got {num_samples!r}")
    return num_samples


def _repeat_rows(P: int, *tensors):
    """Each tensor (or None) repeated P times along the batch axis, B-major."""
    return tuple(t if t is None or P == 1 else t.repeat_interleave(P, 0) for t in tensors)


def _pads_only(excluded: torch.Tensor) -> bool:
    """Whether an excluded mask (B or 1, H or 1, T, T) excludes the same keys for every query and head
    (reads the device once)."""
    return not bool((excluded != excluded[:, :1, :1, :]).any())


def _per_query_variants() -> list[str]:
    from gpattn.attention.registry import _REGISTRY

    return sorted(n for n, c in _REGISTRY.items() if c.per_query_masks)


class AttentionBase(nn.Module):
    """Multi-head self-attention with ``x (B, T, D) -> y (B, T, D)``.

    :param embed_dim: model width D (divisible by ``num_heads``).
    :param num_heads: H; head width Dh = D / H.
    :param bias: bias of the input and output projections.
    :param batch_first: layout of nn.MultiheadAttention's call (:meth:`forward_mha`): (B, T, D) when True
        (default), (T, B, D) otherwise; gpattn's own call ``layer(x, key_padding_mask)`` is always (B, T, D).

    Class attributes set by subclasses:
    ``projections`` — names of the per-head input projections (fused into one linear map);
    ``value_dim`` — per-head output width Dv (``None`` = Dh);
    ``is_gp`` — whether ``posterior()`` is available; ``stochastic`` — whether it samples.

    All-padding rows (every key padded) are a defined result: the output is 0 for that sequence, and
    the sequence is left out of the variant's loss terms (``kl_seq`` averages over the other
    sequences, :meth:`batch_mean`) and diagnostics. Without reading the mask on the host, such a row
    runs through the variant's math as if unpadded (finite values), and its output is then zeroed.
    """

    name: str = ""
    projections: tuple[str, ...] = ("q", "k", "v")
    is_gp: bool = False
    stochastic: bool = False
    #: ``_attend(x, mask, num_samples=P)`` draws P samples from one factorisation (the GP variants);
    #: otherwise a sampling forward with ``num_samples`` repeats the batch P times before ``_attend``
    native_samples: bool = False
    #: whether ``_attend`` takes a per-query mask ``(B, H or 1, T, T)`` from ``attn_mask`` (read it through
    #: :func:`excluded_keys`); otherwise it gets only key padding ``(B, T)``, and an ``attn_mask`` that does
    #: more than pad is a ``ValueError`` (docs/derivations.md §11). Opt-in: a variant must handle the mask.
    #: A GP variant with per-query masks gets a mask that pads as key padding (one GP for the sequence,
    #: exactly), and other masks as they are: a query with no allowed key is its own concern (no inducing
    #: input); the other variants get such rows opened to every key (their output is zeroed afterwards).
    per_query_masks: bool = False
    #: read by torch's transformer layers (an nn.MultiheadAttention attribute): False keeps
    #: nn.TransformerEncoderLayer's eval-mode fast path, which runs MHA's own fused kernel, off this layer
    _qkv_same_embed_dim = False

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
        # fused input projection: one matmul for every named projection (W_v maps to H·Dv)
        widths = [self.value_dim * num_heads if p == "v" else embed_dim for p in self.projections]
        self._proj_widths = widths
        self.in_proj = nn.Linear(embed_dim, sum(widths), bias=bias) if widths else None
        self.out_proj = nn.Linear(num_heads * self.value_dim, embed_dim, bias=bias)
        self._added_loss_terms: dict[str, GPLossTerm | None] = {}  # gpytorch's registry of added loss terms

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """The fused input projection's bias (nn.MultiheadAttention's attribute, read by torch's transformer
        layers; gpattn's layout differs from MHA's, see ``_qkv_same_embed_dim``)."""
        return None if self.in_proj is None else self.in_proj.bias

    # ------------------------------------------------------------------ helpers for subclasses
    @property
    def weights_wanted(self) -> bool:
        """Whether this forward should record its attention weights (``need_weights`` of :meth:`forward_mha`):
        variants with weights set ``self._attn_weights`` (B, H, T, T) when it is True."""
        return getattr(self, "_weights_wanted", False)

    @property
    def sampling(self) -> bool:
        """Whether this forward should sample (stochastic variant, outside ``gpattn.deterministic()``)."""
        return self.stochastic and not is_deterministic()

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, H·d) -> (B, H, T, d)"""
        B, T, HD = t.shape
        return t.view(B, T, self.num_heads, HD // self.num_heads).transpose(1, 2)

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-head projections of x, by name.  # shape: x (B, T, D) -> each (B, H, T, Dh or Dv)"""
        parts = self.in_proj(x).split(self._proj_widths, dim=-1)
        return {name: self.split_heads(p) for name, p in zip(self.projections, parts)}

    # GPyTorch's added-loss-term protocol (gpytorch.Module's own functions): the layer stays a plain
    # nn.Module, since gpytorch.Module.__call__ bypasses nn.Module's hooks and admits only tensor outputs
    register_added_loss_term = gpytorch.Module.register_added_loss_term
    update_added_loss_term = gpytorch.Module.update_added_loss_term
    named_added_loss_terms = gpytorch.Module.named_added_loss_terms
    added_loss_terms = gpytorch.Module.added_loss_terms

    def set_loss_terms(self, *terms: GPLossTerm, **values: torch.Tensor) -> None:
        """Record this forward's loss terms as GPyTorch added loss terms, each under its kind's name
        (registered on first use): ``set_loss_terms(SequenceKL(kl))``, or by name,
        ``set_loss_terms(kl_seq=kl)`` (the kind registered under that name, gpattn.objectives). The values
        are the layer's reduced terms (docs/derivations.md §9: ``kl_seq`` already averaged over the batch,
        :meth:`batch_mean`; ``kl_global`` the total over global parameters)."""
        for term in (*terms, *(GPLossTerm.kind(name)(value) for name, value in values.items())):
            if not isinstance(term, GPLossTerm):
                raise ValueError(
                    f"set_loss_terms takes gpattn.objectives.GPLossTerm instances (or name=value), got "
                    f"{type(term).__name__}"
                )
            if term.name not in self._added_loss_terms:
                self.register_added_loss_term(term.name)
            self.update_added_loss_term(term.name, term)

    def batch_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over the batch axis 0 of the sequences with at least one real key (all-padding rows of
        this forward are left out, without a host read).  # shape: (B, ...) -> (...)"""
        return kept_mean(t, getattr(self, "_keep", None))

    @property
    def loss_mask(self) -> torch.Tensor | None:
        """The caller's key padding mask of this forward, all-padding rows included (True = padding): for
        per-token loss terms, whose means must leave those rows out (the mask given to ``_attend`` has
        them unpadded).  # shape: (B, T) or None"""
        return getattr(self, "_loss_mask", None)

    @staticmethod
    def fold_samples(samples: torch.Tensor) -> torch.Tensor:
        """A leading sample axis folded B-major into the batch.  # shape: (P, B, ...) -> (B·P, ...)

        Head outputs ``(P, B, H, T, Dv)`` are copied once, straight into the memory order of the
        merged heads ``(B·P, T, H·Dv)`` that ``W_o`` reads, and returned as a ``(B·P, H, T, Dv)`` view."""
        P, B = samples.shape[:2]
        if samples.dim() == 5:
            _, _, H, T, Dv = samples.shape
            return samples.permute(1, 0, 3, 2, 4).reshape(B * P, T, H, Dv).transpose(1, 2)
        return samples.transpose(0, 1).reshape(B * P, *samples.shape[2:])

    def draw(self, rsample, num_samples: int | None) -> torch.Tensor:
        """``rsample()`` (one draw) or ``rsample(P)`` folded B-major: the helper of ``_attend`` for a
        conditional with gpytorch's ``rsample(num_samples)``.  # shape: -> (B, ...) or (B·P, ...)"""
        return rsample() if num_samples is None else self.fold_samples(rsample(num_samples))

    # ------------------------------------------------------------------ to implement
    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None, num_samples: int | None = None) -> torch.Tensor:
        """# shape: x (B, T, D), mask (B, T) bool or None -> (B, H, T, Dv); variants with
        ``native_samples`` take ``num_samples=P`` and return ``(B·P, H, T, Dv)`` draws (B-major,
        :meth:`fold_samples`) with the ``(B, H, T, Dv)`` posterior mean"""
        raise NotImplementedError

    def _posterior(self, x: torch.Tensor, mask: torch.Tensor | None):
        from gpattn.attention.registry import _REGISTRY

        gp = sorted(n for n, c in _REGISTRY.items() if c.is_gp)
        raise NotImplementedError(
            f"attention {self.name!r} is not a GP variant and has no posterior(); GP variants: {', '.join(gp)}"
        )

    # ------------------------------------------------------------------ the contract
    def check_inputs(self, x, key_padding_mask=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Validate ``x (B, T, D)`` and ``key_padding_mask (B, T)`` bool; return them."""
        if not torch.is_tensor(x):
            raise ValueError(f"x must be a torch.Tensor of shape (B, T, embed_dim={self.embed_dim}), got {type(x)}")
        if x.dim() != 3:
            raise ValueError(
                f"x must have shape (B, T, embed_dim={self.embed_dim}) (rank 3), got rank {x.dim()} "
                f"shape {tuple(x.shape)}"
            )
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x has last dimension {x.shape[-1]} but the layer's embed_dim is {self.embed_dim} "
                f"(x shape {tuple(x.shape)})"
            )
        if not x.is_floating_point():
            raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if x.shape[1] == 0:
            raise ValueError(f"x has no tokens (T=0): shape {tuple(x.shape)}")
        if is_validating() and not bool(torch.isfinite(x).all()):  # reads the device: opt-in
            raise ValueError(f"x contains NaN or Inf values (shape {tuple(x.shape)})")
        if key_padding_mask is not None:
            m = key_padding_mask
            if not torch.is_tensor(m) or m.dtype != torch.bool:
                raise ValueError(
                    f"key_padding_mask must be a bool tensor (True = padding), got "
                    f"{m.dtype if torch.is_tensor(m) else type(m)}"
                )
            if tuple(m.shape) != tuple(x.shape[:2]):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T) = {tuple(x.shape[:2])} to match x "
                    f"{tuple(x.shape)}, got {tuple(m.shape)}"
                )
            if m.device != x.device:
                raise ValueError(f"key_padding_mask is on {m.device} but x is on {x.device}")
        return x, key_padding_mask

    @staticmethod
    def _effective_mask(mask):
        """The mask the variant sees, without a host read: (mask or None, keep (B,) bool or None), where
        ``keep`` marks the sequences with at least one real key; an all-padding row is given unpadded
        to the variant (its output is zeroed afterwards, its loss terms left out)."""
        if mask is None:
            return None, None
        keep = ~mask.all(-1)  # shape: (B,)
        return mask & keep[:, None], keep

    def attn_mask_excluded(self, attn_mask: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """An ``attn_mask`` as nn.MultiheadAttention takes it — bool (True = not allowed) or additive float,
        of shape (T, T), (B·H, T, T), (B, T, T) or (B or 1, H or 1, T, T) — as a bool mask (True = excluded)
        of shape (B or 1, H or 1, T, T)."""
        if not torch.is_tensor(attn_mask):
            raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask)}")
        H, shape = self.num_heads, tuple(attn_mask.shape)
        m = _as_excluded(attn_mask, "attn_mask")
        if shape[-2:] == (T, T) and m.dim() == 2:
            return m[None, None]
        if shape[-2:] == (T, T) and m.dim() == 3 and shape[0] in (B * H, B, 1):
            return m.view(B, H, T, T) if shape[0] == B * H else m[:, None]
        if shape[-2:] == (T, T) and m.dim() == 4 and shape[0] in (B, 1) and shape[1] in (H, 1):
            return m
        raise ValueError(
            f"attn_mask must have shape (T, T) = {(T, T)}, (B*H, T, T) = {(B * H, T, T)}, (B, T, T) or "
            f"(B or 1, H or 1, T, T) with B={B}, H={H}, T={T}; got {shape}"
        )

    def _padding_part(self, excluded: torch.Tensor, B: int) -> torch.Tensor:
        """The key padding mask (B, T) that ``excluded`` (B or 1, H or 1, T, T) amounts to; for the variants
        without per-query masks a ``ValueError`` when it differs between queries or heads (reads the
        device once: only when such a variant is given an ``attn_mask``)."""
        if not self.per_query_masks and not _pads_only(excluded):
            raise ValueError(
                f"attn_mask: attention {self.name!r} takes only masks that pad (the same excluded keys for "
                f"every query and head, i.e. a key_padding_mask); this mask excludes different keys for "
                f"different queries (a causal mask, say). Its posterior conditions every query on one "
                f"shared set of inducing inputs (or couples all keys), and a per-query conditioning set would "
                f"make a different GP for every query, which this variant does not define "
                f"(docs/derivations.md §11). Pass the padding as key_padding_mask, or use a variant with "
                f"per-query masks: {', '.join(_per_query_variants())} (sgpa: one GP per query; sgpa-decoupled: one "
                f"mean basis per query)"
            )
        return excluded[:, 0, 0, :].expand(B, -1)

    def forward(self, *args, **kwargs):
        """Two call signatures, told apart by the second argument:

        * gpattn's own, ``layer(x, key_padding_mask=None, num_samples=None, *, attn_mask=None)`` → the output
          tensor (:meth:`forward_gp`);
        * nn.MultiheadAttention's, ``layer(query, key, value, key_padding_mask=None, need_weights=True,
          attn_mask=None, average_attn_weights=True, is_causal=False)`` → ``(output, weights or None)``
          (:meth:`forward_mha`), taken when a third positional argument is a tensor (the value; gpattn's
          third is ``num_samples``, an int) or ``query``/``key``/``value`` is passed by name: this is how
          torch's transformer layers call ``self_attn``.
        """
        if (len(args) > 2 and torch.is_tensor(args[2])) or {"query", "key", "value"} & set(kwargs):
            return self.forward_mha(*args, **kwargs)
        return self.forward_gp(*args, **kwargs)

    def forward_mha(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """nn.MultiheadAttention's call, for self-attention: ``query``, ``key`` and ``value`` must be the same
        tensor, (B, T, D) with ``batch_first`` (the default) or (T, B, D). ``key_padding_mask`` (B, T) and
        ``attn_mask`` are bool (True = not allowed) or additive float (0 / −∞); ``is_causal=True`` without an
        ``attn_mask`` means the causal mask. Returns ``(output, weights)``: the weights, with
        ``need_weights``, where the variant has attention weights — (B, T, T) averaged over heads with
        ``average_attn_weights``, else (B, H, T, T) — and None otherwise (the GP variants)."""
        if key is not query or value is not query:
            raise ValueError(
                f"attention {self.name!r} is self-attention: pass the same tensor as query, key and value "
                f"(got {'a different key' if key is not query else 'a different value'}); cross-attention is "
                f"not supported by any gpattn variant"
            )
        x = query if self.batch_first else query.transpose(0, 1)
        if key_padding_mask is not None and torch.is_tensor(key_padding_mask):
            key_padding_mask = _as_excluded(key_padding_mask, "key_padding_mask")
        if is_causal and attn_mask is None and torch.is_tensor(x) and x.dim() == 3:
            T = x.shape[1]
            attn_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        self._weights_wanted, self._attn_weights = bool(need_weights), None
        try:
            y = self.forward_gp(x, key_padding_mask, attn_mask=attn_mask)
            weights = self._attn_weights if need_weights else None
        finally:
            self._weights_wanted, self._attn_weights = False, None
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return (y if self.batch_first else y.transpose(0, 1)), weights

    def forward_gp(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        num_samples: int | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """# shape: x (B, T, D), key_padding_mask (B, T) bool (True = padding) -> (B, T, D), or (B·P, T, D)
        with ``num_samples=P``: P draws per input, B-major (row b·P + p is draw p of sequence b).

        ``attn_mask`` (as in :meth:`attn_mask_excluded`; True = not allowed) excludes keys per query: a
        query with no allowed key gets head output 0 (output 0 where that holds in every head). The
        variants without ``per_query_masks`` (``kep-svgp``, ``cgp``, ``scgp``) take only an ``attn_mask`` that
        pads, which then acts exactly as ``key_padding_mask``; so does a mask that pads for ``sgpa`` and
        ``sgpa-decoupled``, which condition each query on the keys it may attend to under any other mask
        (docs/derivations.md §11; a GP variant reads the mask once on the host to tell).

        With ``num_samples`` a GP variant factorises once per sequence and draws its P samples from
        that factorisation (the first sampling layer of a deep GP, docs/derivations.md §9); a layer that does not
        sample in this forward computes its output once and repeats it; the other stochastic variants
        (Gumbel attention) run on the batch repeated P times. The loss terms are those of the B
        sequences (each sequence's terms once, as with the repeated batch, whose rows share them)."""
        x, key_padding_mask = self.check_inputs(x, key_padding_mask)
        P = 1 if num_samples is None else _check_num_samples(num_samples)
        excluded = empty = None
        if attn_mask is not None:
            excluded = self.attn_mask_excluded(attn_mask, *x.shape[:2])
            if excluded.device != x.device:
                raise ValueError(f"attn_mask is on {excluded.device} but x is on {x.device}")
            if not self.per_query_masks or (self.is_gp and _pads_only(excluded)):  # padding: joins key_padding_mask
                pad = self._padding_part(excluded, x.shape[0])
                key_padding_mask, excluded = (pad if key_padding_mask is None else key_padding_mask | pad), None
        if P > 1 and self.sampling and not self.native_samples:
            x = x.repeat_interleave(P, 0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.repeat_interleave(P, 0)
            if excluded is not None and excluded.shape[0] > 1:
                excluded = excluded.repeat_interleave(P, 0)
            P = 1
        self._added_loss_terms, self._diagnostics = dict.fromkeys(self._added_loss_terms), {}  # registered, unset
        if x.shape[0] == 0:  # empty batch: a defined zero result with a graph
            return x.new_zeros(x.shape) + 0 * sum(p.sum() for p in self.parameters())
        mask, keep = self._effective_mask(key_padding_mask)
        if excluded is not None:  # per-query mask: padding joined in, queries with no allowed key opened
            if mask is not None:
                excluded = excluded | mask[:, None, None, :]
            empty = excluded.all(-1, keepdim=True)  # shape: (B or 1, H or 1, T, 1)
            mask = excluded if self.is_gp else excluded & ~empty
        self._keep, self._loss_mask = keep, key_padding_mask
        try:
            if P > 1 and self.sampling:
                heads = self._attend(x, mask, num_samples=P)  # shape: (B·P, H, T, Dv), mean (B, H, T, Dv)
            else:
                heads = self._attend(x, mask)  # shape: (B, H, T, Dv)
        finally:
            self._keep = self._loss_mask = None
        mean = None
        if isinstance(heads, tuple):  # GP variants: (sample or mean, posterior mean)
            heads, mean = heads
        drawn = heads.shape[0] // x.shape[0]  # P when the variant drew the samples, else 1
        if empty is not None:  # only variants with per-query masks
            if empty.shape[0] > 1:
                empty = empty.repeat_interleave(drawn, 0)  # shape: (B·P, H or 1, T, 1)
            heads = heads.masked_fill(empty, 0)
            if getattr(self, "_attn_weights", None) is not None:
                self._attn_weights = self._attn_weights.masked_fill(empty, 0)
        BP, H, T, Dv = heads.shape
        y = self.out_proj(heads.transpose(1, 2).reshape(BP, T, H * Dv))
        if empty is not None:
            y = y.masked_fill(empty.all(1), 0)  # a query with no allowed key in any head: output 0
        if mean is not None and self.training:  # the trainer reads them; prediction skips the extra W_o
            self._record_diagnostics(
                *_repeat_rows(drawn, x, key_padding_mask), heads, mean.repeat_interleave(drawn, 0)
            )
        if keep is not None:  # all-padding sequences: output 0 (masked arithmetic, no host read)
            y = y.masked_fill_(~keep.repeat_interleave(drawn, 0)[:, None, None], 0)  # y is W_o's fresh output
        if P > drawn:  # this forward did not sample: every draw is the same
            y = y.repeat_interleave(P, 0)
        return y

    def posterior(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, *, attn_mask=None):
        """Posterior over the per-head outputs (before W_o): ``MultivariateNormal`` with batch
        ``(B, H, Dv)`` and event ``T``. GP variants only; the others raise ``NotImplementedError``.
        ``attn_mask`` as in :meth:`forward_gp`: under a per-query mask ``sgpa-decoupled``'s posterior is joint
        (the unmasked covariance, the masked mean); ``sgpa``'s is each
        query's marginal (diagonal, docs/derivations.md §11)."""
        x, key_padding_mask = self.check_inputs(x, key_padding_mask)
        mask = key_padding_mask
        if attn_mask is not None:
            excluded = self.attn_mask_excluded(attn_mask, *x.shape[:2])
            if not self.per_query_masks or _pads_only(excluded):
                pad = self._padding_part(excluded, x.shape[0])
                mask = key_padding_mask = pad if key_padding_mask is None else key_padding_mask | pad
            else:
                mask = excluded if key_padding_mask is None else excluded | key_padding_mask[:, None, None, :]
        if key_padding_mask is not None and bool(key_padding_mask.all(-1).any()):  # an analysis call: may read
            raise ValueError("posterior(): a sequence in the batch has every key padded (no posterior to give)")
        return self._posterior(x, mask)

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """The unweighted loss terms of the last forward by name, summed over this layer's added loss terms
        (empty for deterministic baselines)."""
        return summed_loss_terms(self)

    @torch.no_grad()
    def _record_diagnostics(self, x, mask, heads, mean) -> None:
        """The layer's output scale against its input (:meth:`diagnostics`): detached 0-dim tensors, no
        host synchronisation.  # shape: x (B, T, D), heads, mean (B, H, T, Dv), mask (B, T) or None"""
        B, H, T, Dv = heads.shape

        def flat(h):
            return h.transpose(1, 2).reshape(B, T, H * Dv)

        mean_out = self.out_proj(flat(mean))  # shape: (B, T, D): E[layer output]
        spread = torch.nn.functional.linear(flat(heads - mean), self.out_proj.weight)  # W_o (f − E f)
        if mask is None:
            real = x.new_ones(B, T)
        else:
            real = (~mask).to(x.dtype)
        count = real.sum().clamp_min(1)

        def per_token(t):
            return (t.float().norm(dim=-1) * real).sum() / count

        self._diagnostics = {
            "input_norm": per_token(x),
            "mean_norm": per_token(mean_out),
            "spread_norm": per_token(spread),
        }

    def diagnostics(self) -> dict[str, torch.Tensor]:
        """Output scale of the last training-mode forward of a GP variant, per real token (detached 0-dim
        tensors; empty after an eval-mode forward):
        ``input_norm`` ‖x‖ of the (LayerNorm-ed) layer input, ``mean_norm`` ‖E[y]‖ of the posterior mean
        output and ``spread_norm`` ‖y − E[y]‖ of the drawn sample (0 when not sampling). Collapse shows
        as a mean far below the spread, or both far below the input (``gpattn.experiments.training`` logs them per
        epoch and warns). Empty for the other variants."""
        return dict(getattr(self, "_diagnostics", {}))

    def extra_repr(self) -> str:
        return f"name={self.name!r}, embed_dim={self.embed_dim}, num_heads={self.num_heads}"

    def __getstate__(self):
        # the last forward's loss terms hold autograd graphs: never pickle them
        state = self.__dict__.copy()
        state["_added_loss_terms"], state["_diagnostics"] = dict.fromkeys(self._added_loss_terms), {}
        return state
