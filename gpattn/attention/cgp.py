"""Correlated-GP attention layers ``cgp`` (exact) and ``scgp`` (DTC sparse): thin shims over
:mod:`gpattn.variational.cgp` and :mod:`gpattn.variational.scgp` (Bui et al.; docs/derivations.md §7–8)."""

from __future__ import annotations

import functools

import torch
from gpytorch.kernels import Kernel
from torch.utils.checkpoint import checkpoint

from gpattn.attention._gp import GPAttention
from gpattn.attention.registry import register, resolve
from gpattn.kernels import make_kernel
from gpattn.variational.cgp import CorrelatedConditional, CorrelatedGP
from gpattn.variational.scgp import SparseCorrelatedGP

__all__ = ["CGPAttention", "SCGPAttention"]

#: entries of one (B, H, T, S) block over the sequences of a recomputed piece of cgp's batch, on the CPU (2¹⁹: 2 MiB
#: in float32) and on another device (2²⁴: 64 MiB), where a piece's work must be large to fill it
PIECE_ELEMENTS = 1 << 19
DEVICE_PIECE_ELEMENTS = 1 << 24


def piece_rows(B: int, H: int, T: int, S: int, device: torch.device) -> int:
    """Sequences per recomputed piece of a batch whose blocks are (B, H, T, S): as many as keep a piece's block
    within :data:`PIECE_ELEMENTS` (:data:`DEVICE_PIECE_ELEMENTS` off the CPU), at least one."""
    budget = PIECE_ELEMENTS if device.type == "cpu" else DEVICE_PIECE_ELEMENTS
    return max(1, min(B, budget // max(1, H * T * S)))


def _call(fn, *args):
    return fn(*args)


def _rows(t, rows: slice, axis: int = 0):
    """``t``'s sequences ``rows`` on ``axis`` (a tuple of tensors: each; None stays None)."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_rows(u, rows, axis) for u in t)
    return t[(slice(None),) * axis + (rows,)]


class _CorrelatedGPAttention(GPAttention):
    """Shared shim: four projections q, k, o (the latent inputs x_o) and v; the GP in ``self.strategy``.

    **Choice** (``input_scale``): the projected inputs are multiplied by a fixed
    ``input_scale`` (default :math:`D_h^{-1/4}`) before the canonical kernel. This is the
    reparametrisation :math:`W \\leftarrow cW` of the canonical representation (κ_o stays
    parameter-free), chosen so that at initialisation squared distances between projected
    unit-variance tokens are :math:`O(\\sqrt{D_h})` rather than :math:`O(D_h)`, where every
    :math:`\\kappa_o \\approx e^{-D_h/3}` would vanish (the role √Dh plays in softmax attention).
    """

    projections = ("q", "k", "o", "v")
    query_projection = "q"
    cross_attention = True  # queries of x, keys and values of the context (docs/derivations.md §13)

    def __init__(self, embed_dim: int, num_heads: int, mean_module, **base):
        # the mean's own projections (its values), before AttentionBase sizes the fused in_proj
        self.projections = (*type(self).projections, *mean_module.projections)
        super().__init__(embed_dim, num_heads, **base)

    def _init_scale(self, input_scale):
        if input_scale is None:
            input_scale = self.head_dim**-0.25
        if isinstance(input_scale, bool) or not isinstance(input_scale, (int, float)) or not input_scale > 0:
            raise ValueError(f"input_scale must be a float > 0 or None, got {input_scale!r}")
        self.input_scale = float(input_scale)

    def _canonical(self, kernel):
        """κ_o from the ``kernel`` option, checked against the head width. A spec must be stationary:
        the prior variance of z_q is σ_q² κ_o(x, x) (gpattn.variational._scale)."""
        return make_kernel(kernel, self.num_heads, self.head_dim, stationary=True)

    def strategy_inputs(self, x):
        """The projections, q, k and o scaled by ``input_scale``.  # shape: each (B, H, T, Dh), v (B, H, T, Dv)"""
        return self._scaled(self.project(x))

    def _scaled(self, p: dict) -> tuple:
        c = self.input_scale
        return p["q"] * c, p["k"] * c, p["o"] * c, p["v"]

    def strategy_call(self, x):
        """The scaled inputs and the mean's own projections (``prior_mean="softmax-separate"``: its values, the
        ``v_mean`` rows; none for the others) as ``mean_values``: one projection of x for both."""
        p = self.project(x)
        return self._scaled(p), {"mean_values": tuple(p[name] for name in self.strategy.mean_module.projections)}

    @torch.no_grad()
    def rescale_inputs(self, factor: float) -> None:
        """Multiply the canonical inputs by ``factor``, in place: the q, k and o rows of ``in_proj`` (weights
        and biases) and scgp's global inducing inputs. The correlated GP then computes what one built with
        ``input_scale`` × ``factor`` from the same parameters computes, and the change lives in the state
        dict (``input_scale`` is a constant, not saved); the softmax prior mean's temperature is divided by
        ``factor``², so the mean stays the attention it was (docs/derivations.md §7a). For a stream other than the
        one ``input_scale`` assumes (:meth:`gpattn.integrations.huggingface.HFClassifier.match_prior_to_stream`,
        docs/derivations.md §7)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"factor must be a finite float > 0, got {factor!r}")
        for name, rows in self.projection_rows().items():
            if name in ("q", "k", "o"):
                self.in_proj.weight[rows] *= factor
                if self.in_proj.bias is not None:
                    self.in_proj.bias[rows] *= factor
        for name in ("inducing_latent", "inducing_keys"):  # scgp's global inducing inputs (amortised ones follow)
            inducing = getattr(self.strategy, name, None)
            if inducing is not None:
                inducing *= factor
        self.strategy.mean_module.rescale_inputs(factor)  # the softmax prior mean stays the attention it was

    def query_inputs(self, x):
        """Cross-attention's queries, scaled by ``input_scale``.  # shape: (B, H, T, Dh)"""
        return super().query_inputs(x) * self.input_scale


@register("cgp")
class CGPAttention(_CorrelatedGPAttention):
    """Exact correlated-GP attention, CGPT (Bui et al. §3; docs/derivations.md §7): see
    :class:`gpattn.variational.cgp.CorrelatedGP` for the equations. Cost O(T³) per (B, H).

    :param kernel: canonical kernel κ_o as a kernel spec (:mod:`gpattn.kernels`): ``"canonical-rbf"`` =
        exp(−½‖a−b‖²) (default), another stationary spec, or a
        gpytorch ``Kernel`` (batch_shape ``(H,)`` or ``()``, ``ard_num_dims`` = Dh; checked here).
    :param sigma: noise standard deviation σ (default 0.1, Bui et al. App. F; fixed, as in Bui et al.).
    :param jitter: diagonal jitter before factorising Σ, Σ_q, Σ_k and K_o.
    :param input_scale: fixed factor on the projected inputs (default Dh^(-1/4), see the Choice above;
        ``match_prior_to_stream`` rescales the inputs in an encoder swap).
    :param prior_mean: ``"softmax"`` (default): softmax attention of the scaled inputs, softmax(q kᵀ/√Dh) v at
        the default ``input_scale``, as the prior mean of the query and key processes; the correlated GP models the
        departure from it (docs/derivations.md §7a). ``"zero"``: Bui et al.'s form, where ν carries the whole
        attention. Or a prior mean module (:mod:`gpattn.variational.means`).

    The regulariser draws P_o = 10 prior samples of z_o (eqs. 42–44, the strategy's ``prior_samples``; ``None`` is
    the exact expectation, a verification tool).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel = "canonical-rbf",
        sigma: float = 0.1,
        jitter: float = 1e-5,
        input_scale: float | None = None,
        prior_mean: str = "softmax",
        **base,
    ):
        mean_module = resolve("cgp", "prior_mean", prior_mean)
        super().__init__(embed_dim, num_heads, mean_module, **base)
        self._init_scale(input_scale)
        self.strategy = self._strategy(
            kernel=self._canonical(kernel), sigma=sigma, jitter=jitter, mean_module=mean_module
        )

    def _strategy(self, **options) -> CorrelatedGP:
        """The layer's strategy with ``options`` (a subclass may add the strategy's other settings)."""
        return CorrelatedGP(self.num_heads, **options)

    def _attend(self, call):
        """A batch whose blocks exceed a piece's (:data:`PIECE_ELEMENTS` entries) is conditioned in pieces of
        :func:`piece_rows` sequences: a piece's (B, H, T, T) blocks live while it runs, and no block of the whole
        batch is formed. Recording gradients, each piece is checkpointed (``torch.utils.checkpoint``): its backward
        computes its blocks again, and none is kept between the forward and the backward. The random numbers are
        drawn for the whole batch first, in the order one conditional draws them
        (:meth:`gpattn.variational.cgp.CorrelatedGP.forward_noise`), so the draws, R, the output and the gradients
        are the unpieced forward's (docs/derivations.md §7, "Conditioned in pieces")."""
        (B, T), S = call.x.shape[:2], (call.x if call.context is None else call.context).shape[1]
        rows = B if torch.compiler.is_compiling() else piece_rows(B, self.num_heads, T, S, call.x.device)
        if rows >= B:  # blocks of one piece's size: formed whole
            return super()._attend(call)
        run = functools.partial(checkpoint, use_reentrant=False) if torch.is_grad_enabled() else _call
        args, kwargs = self._strategy_args(call.x, call.context)
        q, v = kwargs.get("query_inputs", args[0]), args[3]
        noise = self.strategy.forward_noise(q, v, call.num_samples, call.sampling, self.training)
        axis = 1 if call.sampling and call.num_samples is not None else 0  # the batch axis of a draw
        pieces = [
            run(self._piece, slice(start, start + rows), args, kwargs, noise, call, axis) for start in range(0, B, rows)
        ]
        out = torch.cat([p[0] for p in pieces], axis)
        mean = torch.cat([p[1] for p in pieces])
        terms = (
            CorrelatedConditional.loss_terms(torch.cat([p[2] for p in pieces]), call.loss_mask) if self.training else ()
        )
        return self._attended(out, mean, terms, pieces[0][3])

    def _piece(self, rows: slice, args, kwargs, noise, call, axis: int) -> tuple:
        """The sequences ``rows``: their draw (or mean), mean, R per head and value column (None outside
        training) and the output dtype, from the given random numbers."""
        cond = self.strategy.condition(
            *_rows(args, rows), mask=_rows(call.mask, rows), **{name: _rows(t, rows) for name, t in kwargs.items()}
        )
        cond.given_noise = (_rows(noise[0], rows, axis), _rows(noise[1], rows))
        out = cond.rsample(call.num_samples) if call.sampling else cond.mean
        return out, cond.mean, cond.regularizer() if self.training else None, cond.output_dtype


@register("scgp")
class SCGPAttention(_CorrelatedGPAttention):
    """Sparse (DTC) correlated-GP attention, SCGPT (Bui et al. §4; docs/derivations.md §8): see
    :class:`gpattn.variational.scgp.SparseCorrelatedGP`. Cost linear in T; nothing T×T is formed.

    :param num_inducing: m, inducing inputs for z_q | z_o (default 16).
    :param num_inducing_keys: l, inducing inputs for z_o | z_k (default 16).
    :param amortize: inducing inputs computed from the sequence by a learned token map (fixed T);
        default global learnable inducing inputs per head.
    :param seq_len: the fixed T of ``amortize=True``.

    :param prior_mean: ``"softmax-separate"`` (default): softmax attention of the scaled inputs over values of its
        own (the ``v_mean`` projection), softmax(q kᵀ/√Dh) W_vm x at the default ``input_scale``, as the prior mean;
        the regulariser reads the GP's values alone (docs/derivations.md §7a; over the GP's values, cgp's mean,
        α·R shrank them and the mean with them on CoLA from scratch until scgp was flagged inert). ``"zero"``: Bui
        et al.'s form. Or a prior mean module (:mod:`gpattn.variational.means`).

    Other options as ``cgp`` (the regulariser is in closed form, App. E).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kernel: str | dict | Kernel = "canonical-rbf",
        sigma: float = 0.1,
        jitter: float = 1e-5,
        num_inducing: int = 16,
        num_inducing_keys: int = 16,
        amortize: bool = False,
        seq_len: int | None = None,
        input_scale: float | None = None,
        prior_mean: str = "softmax-separate",
        **base,
    ):
        mean_module = resolve("scgp", "prior_mean", prior_mean)
        super().__init__(embed_dim, num_heads, mean_module, **base)
        self._init_scale(input_scale)
        # initial inducing inputs spread like the scaled projections of unit-variance tokens under
        # nn.Linear's default initialisation (coordinate std 1/√3 before scaling)
        self.strategy = self._strategy(
            num_inducing=num_inducing,
            num_inducing_keys=num_inducing_keys,
            amortize=amortize,
            seq_len=seq_len,
            inducing_std=self.input_scale / 3**0.5,
            kernel=self._canonical(kernel),
            sigma=sigma,
            jitter=jitter,
            mean_module=mean_module,
        )

    def _strategy(self, **options) -> SparseCorrelatedGP:
        """The layer's strategy with ``options`` (a subclass may add the strategy's other settings)."""
        return SparseCorrelatedGP(self.num_heads, self.head_dim, **options)
