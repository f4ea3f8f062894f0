r"""Prior mean functions of the GP attention variants, in GPyTorch's ``mean_module`` idiom
(docs/derivations.md §5c).

A GP prior GP(m, κ) with a mean function m pays in its KL only for the posterior's deviation from m.
The SGPA variants take ``prior_mean``:

* ``"attention"`` (default): m is :class:`AttentionMean`, the normalised kernel attention of the
  sequence (the Nadaraya–Watson kernel smoother with the GP's own kernel)

  .. math:: m(q_i) = \frac{\sum_{j \in A_i} \kappa(q_i, k_j)\, v_j}{\sum_{j \in A_i} \kappa(q_i, k_j)},

  which for the exponential kernel is softmax attention with the kernel's (ARD) temperature. The
  amortised, informative part of the posterior lives in the prior mean, which is deterministic given the
  sequence, so no per-sequence KL is paid for attending; the GP's uncertainty sits on top of it.
* ``"softmax"``: m is :class:`SoftmaxMean`, softmax attention with the kernel's (ARD) temperature,

  .. math:: m(q_i) = \sum_{j \in A_i} \mathrm{softmax}_j\big((q_i/\ell) \cdot (k_j/\ell)\big)\, v_j,

  the Nadaraya–Watson smoother of the exponential kernel with the GP's lengthscale, whatever the GP's
  kernel (docs/derivations.md §5e): an encoder swap's mean is then the pretrained softmax attention
  exactly, while the covariance keeps a stationary kernel's bounded prior variance. With the exponential
  kernel it is ``"attention"``.
* ``"zero"``: the papers' form (Chen & Li 2023): a zero prior mean, the amortised mean basis paid for by
  the per-sequence KL.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gpattn._migrate import moved_names
from gpattn._settings import is_validating
from gpattn.kernels._evaluate import evaluate_kernel, temperature_lengthscale
from gpattn.variational._fused import fused_kernel_attention, fused_softmax

__all__ = [
    "AmortisedValueMean",
    "AttentionMean",
    "CentredVariationalMean",
    "CorrelatedSoftmaxMean",
    "KEPSeparateSoftmaxMean",
    "KEPSoftmaxMean",
    "OWN_VALUES",
    "SoftmaxMean",
    "ZeroMean",
    "add_means",
    "read_own_values",
    "softmax_attention",
    "variational_mean_for",
]

#: a name that moved raises an error that says where it went (gpattn._migrate.MOVED_NAMES)
__getattr__ = moved_names(__name__)

#: the value projection of a prior mean that owns its values: rows of the layer's fused ``in_proj``
#: (docs/derivations.md §6, §7a), the ``projections`` of :class:`CorrelatedSoftmaxMean` (separate) and
#: :class:`KEPSoftmaxMean`
OWN_VALUES = ("v_mean",)
#: the public spelling of a softmax mean with projections of its own (cgp/scgp's and kep-svgp's), in one place
SEPARATE = "softmax-separate"


def _read_gp_values(name: str, v, mean_values):
    """A mean that owns no values reads the GP's ``v``; ``mean_values`` passed to it are an error, not ignored."""
    if mean_values is not None:
        raise ValueError(f"mean_values: only a prior mean with values of its own reads them, not {name!r}")
    return v


def read_own_values(name: str, mean_values, shape, instead: str = "") -> torch.Tensor:
    """The values of a mean that owns them (the layer's :data:`OWN_VALUES` projection): ``mean_values``, required, a
    tensor of ``shape``; the error names the argument, the shape and ``instead`` (the alternative form)."""
    if not torch.is_tensor(mean_values) or mean_values.shape != tuple(shape):
        got = tuple(mean_values.shape) if torch.is_tensor(mean_values) else type(mean_values).__name__
        raise ValueError(
            f"mean_values: prior_mean={name!r} reads values of its own (the layer's {OWN_VALUES[0]} projection), a "
            f"tensor of shape {tuple(shape)}, got {got}{instead}"
        )
    return mean_values


class ZeroMean(nn.Module):
    """m = 0, the papers' prior mean (Chen & Li 2023; Bui et al.): the strategy's q(ũ) then carries the amortised mean
    (docs/derivations.md §5a), and the correlated GPs' ν the whole attention (§7). Its value is None, the zero that
    :func:`add_means` leaves out (no operation); it reads no values of its own (``projections`` is empty)."""

    #: the value projections this mean owns (none)
    projections = ()
    #: the public spelling of this mean (``prior_mean=``)
    name = "zero"

    def forward(self, *inputs, **kernel_inputs) -> None:
        """0, as None."""
        return None

    @staticmethod
    def fused(kernel, queries, keys, values, pad=None) -> None:
        """0, as None (nothing to fuse)."""
        return None

    @staticmethod
    def check_kernel(kernel) -> None:
        """Nothing: every kernel goes with the zero mean."""

    def mean_values_for(self, v, mean_values):
        """The values the mean reads: the GP's ``v`` (unused by a zero); ``mean_values`` are refused."""
        return _read_gp_values(self.name, v, mean_values)

    def register_state(self, strategy) -> None:
        """Nothing: the zero mean has no state."""

    def rescale(self, strategy, factor: float) -> None:
        """Nothing: the zero mean has no temperature."""


def add_means(*terms: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of the terms of a posterior mean (a prior mean m(q), a q(ũ) update, ...) or of a KL, None (the zero
    of :class:`ZeroMean` and of a centred q(ũ)) left out, so a zero costs no operation; None if all are."""
    present = [t for t in terms if t is not None]
    if not present:
        return None
    total = present[0]
    for term in present[1:]:
        total = total + term
    return total


class AttentionMean(nn.Module):
    r"""m(q_i) = Σ_{j∈A_i} κ(q_i, k_j) v_j / Σ_{j∈A_i} κ(q_i, k_j): normalised kernel attention with the
    GP's own kernel (docs/derivations.md §5c). It takes the Gram matrix the strategy has already evaluated,
    so it costs one row normalisation and one product. The kernel must be positive (exponential, RBF,
    Matérn, their sums and products with positive scales); with ``gpattn.validation()`` on, a Gram entry
    ≤ 0 on an allowed key is an error.

    A query with no allowed key (A_i = ∅) gets m = 0. (A plain ``nn.Module`` in the role of a
    ``gpytorch.means.Mean``, whose ``__call__`` takes one input: this mean reads the keys and values too.)
    """

    #: the public spelling of this mean (``prior_mean=``)
    name = "attention"

    @staticmethod
    def check_kernel(kernel) -> None:
        """Nothing at build time (a kernel's positivity is checked at a forward, under ``gpattn.validation()``)."""

    def forward(
        self, gram: torch.Tensor | None, values: torch.Tensor, excluded: torch.Tensor | None = None, *,
        kernel=None, queries=None, keys=None,
    ) -> torch.Tensor:
        """``gram`` κ(q, k), or None: evaluated from ``kernel``, ``queries`` and ``keys``.
        # shape: gram (B, H, T, S) = κ(q_i, k_j), values (B, H, S, Dv),
        excluded broadcastable to gram (True = key j not in A_i) or None -> (B, H, T, Dv)"""
        if gram is None:
            gram = evaluate_kernel(kernel, queries, keys)
        weights = gram if excluded is None else gram.masked_fill(excluded, 0.0)
        if is_validating() and bool((weights < 0).any()):  # reads the device: opt-in
            raise ValueError(
                "prior_mean='attention' needs a kernel with positive values (it normalises the kernel's rows into "
                "attention weights); this kernel gives negative ones: use prior_mean='zero'"
            )
        total = weights.sum(-1, keepdim=True)  # shape: (B, H, T, 1)
        return (weights @ values) / torch.where(total > 0, total, 1.0)

    @staticmethod
    def fused(kernel, queries, keys, values, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention (key padding ``pad`` (B, S) only; docs/derivations.md §12), or None where
        that path does not run (a kernel without the log-linear form, a device or dtype without the kernel)."""
        return fused_kernel_attention(kernel, queries, keys, values, pad, normalise=True)


class SoftmaxMean(nn.Module):
    r"""m(q_i) = Σ_{j∈A_i} softmax_j((q_i/ℓ)·(k_j/ℓ)) v_j: softmax attention with the (ARD) lengthscale ℓ of the
    GP's kernel as its temperature, whatever the kernel's form (docs/derivations.md §5e). With the exponential
    kernel it equals :class:`AttentionMean`; with the ARD-RBF it drops that kernel's per-key factor
    exp(−‖k_j/ℓ‖²/2), so that an encoder swap starts at the pretrained attention. A query with no allowed key
    (A_i = ∅) gets m = 0. Key padding alone runs in fused attention (no (T, S) matrix)."""

    #: the public spelling of this mean (``prior_mean=``)
    name = "softmax"

    def forward(
        self, gram: torch.Tensor | None, values: torch.Tensor, excluded: torch.Tensor | None = None, *,
        kernel, queries: torch.Tensor, keys: torch.Tensor,
    ) -> torch.Tensor:
        """``gram`` is not read (the mean is not a function of it).
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv), excluded broadcastable to
        (B, H, T, S) (True = key j not in A_i) or None -> (B, H, T, Dv)"""
        return softmax_attention(*self.scaled(kernel, queries, keys), values, excluded)

    @classmethod
    def fused(cls, kernel, queries, keys, values, pad=None) -> torch.Tensor | None:
        """m(q) through fused attention (key padding ``pad`` (B, S) only), or None where no fused kernel runs."""
        return fused_softmax(*cls.scaled(kernel, queries, keys), values, pad)

    @classmethod
    def scaled(cls, kernel, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q/ℓ, k/ℓ) with ℓ the kernel's lengthscale."""
        lengthscale = cls.lengthscale(kernel)
        return queries / lengthscale, keys / lengthscale

    @classmethod
    def check_kernel(cls, kernel) -> None:
        """A ``ValueError`` for a kernel without a lengthscale, at build time rather than at a forward."""
        cls.lengthscale(kernel)

    @staticmethod
    def lengthscale(kernel) -> torch.Tensor:
        """The kernel's (ARD) lengthscale, the mean's temperature; a ``ValueError`` for a kernel without one."""
        lengthscale = temperature_lengthscale(kernel)
        if lengthscale is None:
            raise ValueError(
                f"prior_mean='softmax' takes its temperature from the kernel's lengthscale, and "
                f"{type(kernel).__name__} (inside its ScaleKernels) has none: use a kernel with a lengthscale "
                f"(exponential, ard-rbf, ...) or prior_mean='attention'"
            )
        return lengthscale


def softmax_attention(a: torch.Tensor, b: torch.Tensor, values: torch.Tensor, excluded=None) -> torch.Tensor:
    """Σ_{j∈A_i} softmax_j(a_i · b_j) v_j (0 where A_i = ∅): one fused attention call under key padding or no mask
    (no (T, S) matrix, docs/derivations.md §12), the dense masked softmax otherwise.
    # shape: a (B, H, T, d), b (B, H, S, d), values (B, H, S, Dv), excluded broadcastable to (B, H, T, S)
    (True = key j not in A_i) or None -> (B, H, T, Dv)"""
    if excluded is None or (excluded.dim() == 4 and excluded.shape[1] == excluded.shape[2] == 1):  # key padding
        fused = fused_softmax(a, b, values, None if excluded is None else excluded[:, 0, 0, :])
        if fused is not None:
            return fused
    logits = a @ b.mT  # shape: (B, H, T, S)
    if excluded is None:
        return logits.softmax(-1) @ values
    logits = logits.masked_fill(excluded, torch.finfo(logits.dtype).min)
    some = (~excluded).any(-1, keepdim=True)  # shape: (.., T, 1); A_i ≠ ∅
    return (logits.softmax(-1) @ values) * some


# ------------------------------------------------------------- q(ũ)'s mean (SGPA, docs/derivations.md §5a, §5c)
class AmortisedValueMean:
    r"""q(ũ) = N(Lᵀ v, ·): the sequence's values are q(u)'s mean, m_u = K v (Chen & Li 2023, docs/derivations.md §5a),
    the pairing of the papers' zero prior mean. It adds K̂ v to the posterior mean and ½‖Lᵀv‖² = ½ vᵀK̂v to the KL,
    in the form each conditioning path (self, cross, causal, general mask) has the factors for."""


    @staticmethod
    def without_gram(plan):
        """None: the posterior mean's part K̂ v reads the sequence's Gram, so no Gram-free path runs (``plan`` is not
        called)."""
        return None

    @staticmethod
    def whitened(chol: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """m̃ = Lᵀ v.  # shape: chol (B, H, T, T), values (B, H, T, Dv) -> (B, H, T, Dv)"""
        return chol.mT @ values

    @staticmethod
    def update(gram: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The posterior mean's part K̂ v, ``gram`` with the keys out of the basis zeroed.
        # shape: gram (B, H, T, S), values (B, H, S, Dv) -> (B, H, T, Dv)"""
        return gram @ values

    @staticmethod
    def quadratic(values: torch.Tensor, update: torch.Tensor, jitter_abs: torch.Tensor) -> torch.Tensor:
        """‖Lᵀv‖² = vᵀ(K + jI)v, reusing the mean K v (self-attention).  # shape: -> (B, H, Dv)"""
        return (values * update).sum(-2) + jitter_abs[..., 0] * values.square().sum(-2)

    @staticmethod
    def cross_quadratic(chol: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """‖Lᵀv‖² of the context's keys (cross-attention).  # shape: -> (B, H, Dv)"""
        return (chol.mT @ values).square().sum(-2)

    @staticmethod
    def causal(gram: torch.Tensor, values: torch.Tensor, jit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ_{j≤i} K_ij v_j, ½ v_{≤i}ᵀ K̂_{≤i} v_{≤i}) under the causal mask, the second a prefix sum of v_j
        (2 Σ_{k<j} K_jk v_k + (K_jj + c_j) v_j).  # shape: gram (B, H, T, T), jit (B, H, T) -> (B, H, T, Dv) twice"""
        mean = gram.tril() @ values  # shape: (B, H, T, Dv)
        diag = gram.diagonal(dim1=-2, dim2=-1)[..., None]  # shape: (B, H, T, 1)
        return mean, 0.5 * (values * (2 * mean - (diag - jit[..., None]) * values)).cumsum(-2)

    @staticmethod
    def query_quadratic(chol: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """½‖L_Sᵀ v_S‖² = ½ v_Sᵀ K̂_SS v_S per query (a general per-query mask).
        # shape: chol (B, H, T, T, T), allowed (B, H, T, T) -> (B, H, T, Dv)"""
        w = allowed[..., None] * values[:, :, None]  # shape: (B, H, T, T, Dv): v_S per query, 0 elsewhere
        return 0.5 * (chol.mT @ w).square().sum(-2)

    # -- the decoupled γ-basis (docs/derivations.md §5b): (mean update, global coefficients, the γ factors)
    @staticmethod
    def decoupled(gram, interp, values, whitened) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The mean basis γ on the sequence (self-attention): K_qa v_a in the mean, ũ − c on the global basis with
        c = L_g⁻¹ K_ga v_a, and the γ-part's factors (K_aa v_a, c).
        # shape: gram (B, H, T, T), interp (B, H, T, M), values (B, H, T, Dv), whitened (H, M, Dv)"""
        Kv = gram @ values  # shape: (B, H, T, Dv); K_qa v_a (padded keys have v = 0)
        c = interp.mT @ values  # shape: (B, H, M, Dv); L_g⁻¹ K_ga v_a
        return Kv, whitened - c, dict(gram_values=Kv, proj_values=c)

    @staticmethod
    def decoupled_cross(kernel, queries, keys, values, global_basis, factors_for) -> tuple:
        """Cross-attention (docs/derivations.md §13): the γ-basis is the context's keys, so the global basis is taken
        at the queries and the keys at once (one L_g for both). Returns (the factors ``factors_for(A_q, ũ)``,
        K_qa v_a, ũ − c, the γ factors).
        # shape: queries (B, H, T, Dh), keys (B, H, S, Dh), values (B, H, S, Dv); global_basis(inputs) -> (A, ũ)"""
        both, u_tilde = global_basis(torch.cat([queries, keys], -2))
        A, A_a = both.split([queries.shape[-2], keys.shape[-2]], -2)  # shape: (B, H, T, M), (B, H, S, M)
        factors = factors_for(A, u_tilde)
        K_qa = evaluate_kernel(kernel, queries, keys)  # shape: (B, H, T, S)
        c = A_a.mT @ values  # shape: (B, H, M, Dv); L_g⁻¹ K_ga v_a
        K_aa_v = evaluate_kernel(kernel, keys, keys) @ values  # shape: (B, H, S, Dv), for the γ-part
        return factors, K_qa @ values, u_tilde - c, dict(gram_values=K_aa_v, proj_values=c)

    @staticmethod
    def decoupled_per_query(gram, interp, values, whitened, excluded, causal, mask) -> tuple:
        """Under a per-query mask query i's γ-basis is A_i (docs/derivations.md §11b). With R = K_aa − K_ag K_gg⁻¹ K_ga
        (self-attention: q = a), the update Σ_{j∈A_i} R_ij v_j and γ_i = ½ v_Sᵀ R_SS v_S. Causal: R.tril() and a
        prefix sum, O(T²·Dv); any other mask O(T³·Dv) time, O(T²·Dv) memory per (B, H).
        # shape: excluded (B, H, T, T) with padding joined, mask (B, T) or None"""
        R = gram - interp @ interp.mT  # shape: (B, H, T, T)
        allowed = ~excluded
        if causal:
            Rv = R.tril() @ values  # shape: (B, H, T, Dv); Σ_{j≤i} R_ij v_j
            diag = R.diagonal(dim1=-2, dim2=-1)[..., None]  # shape: (B, H, T, 1)
            # v_{≤i}ᵀ R_{≤i} v_{≤i} as a prefix sum of v_j (2 Σ_{k<j} R_jk v_k + R_jj v_j)
            quad = (values * (2 * Rv - diag * values)).cumsum(-2)
        else:
            Rv = R.masked_fill(excluded, 0.0) @ values
            w = allowed[..., None] * values[:, :, None]  # shape: (B, H, T, T, Dv): v_S per query, 0 elsewhere
            quad = (w * (R[:, :, None] @ w)).sum(-2)  # shape: (B, H, T, Dv)
        real = allowed.any(-1)
        if mask is not None:
            real = real & ~mask[:, None, :]
        return Rv, whitened, dict(query_gamma=0.5 * quad, real=real)


class CentredVariationalMean:
    """q(ũ) = N(0, ·) with ũ = L⁻¹(u − m(k)): centred at the prior mean (docs/derivations.md §5c), the pairing of a
    prior mean that attends. It adds nothing to the posterior mean or the KL (None, which :func:`add_means` leaves
    out)."""


    @staticmethod
    def without_gram(plan):
        """``plan()``: nothing this q(ũ)-mean adds reads the sequence's Gram, so the strategy's Gram-free path may run
        (docs/derivations.md §12)."""
        return plan()

    @staticmethod
    def whitened(chol: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """m̃ = 0.  # shape: -> (B, H, T, Dv)"""
        return torch.zeros_like(values)

    @staticmethod
    def update(*factors) -> None:
        return None

    quadratic = cross_quadratic = query_quadratic = update

    @staticmethod
    def causal(*factors) -> tuple[None, None]:
        return None, None

    # -- decoupled SGPA (docs/derivations.md §5c): no γ-basis, ũ alone on the global basis, no per-sequence KL
    @staticmethod
    def decoupled(gram, interp, values, whitened) -> tuple[None, torch.Tensor, dict]:
        """No γ-basis: no update, ũ on the global basis, no γ factors."""
        return None, whitened, dict(gram_values=None, proj_values=None)

    @staticmethod
    def decoupled_cross(kernel, queries, keys, values, global_basis, factors_for) -> tuple:
        """The global basis at the queries alone: (the factors, no update, ũ, no γ factors)."""
        A, u_tilde = global_basis(queries)  # shape: (B, H, T, M)
        return factors_for(A, u_tilde), None, u_tilde, dict(gram_values=None, proj_values=None)

    @staticmethod
    def decoupled_per_query(gram, interp, values, whitened, *mask) -> tuple[None, torch.Tensor, dict]:
        """No γ-basis under a per-query mask either (the prior mean carries the mask)."""
        return None, whitened, dict(query_gamma=None, real=None)


def variational_mean_for(mean_module: nn.Module):
    """The q(ũ)-mean the SGPA variants pair with a prior mean: amortised on the values for the zero mean (the
    papers'), centred for a mean that attends (docs/derivations.md §5c)."""
    return AmortisedValueMean() if isinstance(mean_module, ZeroMean) else CentredVariationalMean()


class CorrelatedSoftmaxMean(nn.Module):
    r"""The correlated GPs' softmax prior mean (docs/derivations.md §7a): m(x) = Σ_j softmax_j(t x·k_j) u_j over the
    real keys, 0 at padded queries, with t the strategy's ``mean_temperature`` buffer (kept there: its state-dict
    key). ``separate=False``: u = the GP's values v (``prior_mean="softmax"``); ``separate=True``: values of the
    mean's own, the :data:`OWN_VALUES` projection, passed as ``mean_values``."""

    def __init__(self, separate: bool = False):
        super().__init__()
        self.separate = bool(separate)
        #: the public spelling of this mean (``prior_mean=``)
        self.name = SEPARATE if self.separate else "softmax"
        #: the value projections this mean owns: rows of the layer's fused ``in_proj`` (docs/derivations.md §7a)
        self.projections = OWN_VALUES if self.separate else ()

    def mean_values_for(self, v, mean_values):
        """The values u the mean reads: the GP's ``v`` (``mean_values`` refused), or, when the mean owns its values,
        ``mean_values`` (required, shaped like ``v``)."""
        if not self.separate:
            return _read_gp_values(self.name, v, mean_values)
        return read_own_values(self.name, mean_values, v.shape, "; or use prior_mean='softmax' (it reads the GP's v)")

    def forward(self, strategy, q, k, values, valid=None, valid_q=None) -> torch.Tensor:
        """m(q) with the temperature t of ``strategy``.
        # shape: q (B, H, T, Dh), k (B, H, S, Dh), values (B, H, S, Dv), valid (B, 1, S), valid_q (B, 1, T)
        # -> (B, H, T, Dv)"""
        excluded = None if valid is None else ~valid[:, :, None, :]
        m = softmax_attention(q * strategy.mean_temperature.to(q), k, values, excluded)
        return m if valid_q is None else m * valid_q[..., None]

    @staticmethod
    def register_state(strategy) -> None:
        """The temperature t as the buffer ``mean_temperature`` of ``strategy``, 1 at first (in the state dict:
        :meth:`rescale`'s changes survive a reload)."""
        strategy.register_buffer("mean_temperature", torch.ones(()))

    @staticmethod
    def rescale(strategy, factor: float) -> None:
        """Divide the strategy's temperature by ``factor``² (the mean is unchanged when the canonical inputs are
        multiplied by ``factor``)."""
        strategy.mean_temperature /= factor**2


class KEPSoftmaxMean(nn.Module):
    r"""The prior mean of the head output, softmax attention over values of the layer's own
    (docs/derivations.md §6, "The softmax prior mean"):

    .. math:: m(x_i) = \sum_{j \in A_i} \operatorname{softmax}_j\big(q_i \cdot k_j / \sqrt{D_h}\big)\, u_j,
        \qquad u = x W_{vm},

    A_i the real keys, q and k the layer's own projections (those the KSVD features read), u the
    :data:`OWN_VALUES` projection. A deterministic function of the sequence, added once to the GP's mean and
    samples; the KL is unchanged. In an encoder swap q, k and u are the pretrained maps, so the layer's mean starts
    at the pretrained attention."""

    #: the public spelling of this mean (``prior_mean=``)
    name = "softmax"
    #: the value projection this mean owns: rows of the layer's fused ``in_proj``
    projections = OWN_VALUES

    def own_inputs(self, projected: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the layer passes as ``mean_values`` from its projections by name: the own values."""
        return projected[OWN_VALUES[0]]

    def mean_values_for(self, shape, mean_values) -> torch.Tensor:
        """The values the mean reads: ``mean_values``, required, of ``shape`` (B, H, T, Dv)."""
        return read_own_values(self.name, mean_values, shape, "; or use prior_mean='zero' (the paper's form)")

    def forward(self, q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, mask=None) -> torch.Tensor:
        """m(x) over the real keys of ``mask``.
        # shape: q, k (B, H, T, Dh), values (B, H, T, Dv), mask (B, T) bool (True = padding) or None -> (B, H, T, Dv)"""
        scale = q.shape[-1] ** -0.25  # (q/Dh^¼)·(k/Dh^¼) = q·k/√Dh
        excluded = None if mask is None else mask[:, None, None, :]
        return softmax_attention(q * scale, k * scale, values, excluded)


class KEPSeparateSoftmaxMean(KEPSoftmaxMean):
    r"""Softmax attention with queries, keys and values of its own as the prior mean of kep-svgp's head output
    (docs/derivations.md §6, "The mean's own queries and keys"):

    .. math:: m(x_i) = \sum_{j \in A_i} \operatorname{softmax}_j\big(q'_i \cdot k'_j / \sqrt{D_h}\big)\, u_j,
        \qquad q' = x W_{qm},\ k' = x W_{km},\ u = x W_{vm},

    so the KSVD features' q and k and the mean's q', k' are different maps: the likelihood trains the mean's
    attention through the mean alone, and the GP's features through the GP and the KSVD term. In an encoder swap
    both pairs start at the pretrained maps. ``mean_values`` is the tuple (q', k', u)."""

    name = SEPARATE
    #: the projections this mean owns: its queries and keys (H·Dh rows each) and its values (H·Dv)
    projections = ("q_mean", "k_mean", *OWN_VALUES)

    def own_inputs(self, projected: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(q', k', u) from the layer's projections by name."""
        return tuple(projected[name] for name in self.projections)

    def mean_values_for(self, shape, mean_values) -> tuple[torch.Tensor, ...]:
        """(q', k', u), required: u of ``shape`` (B, H, T, Dv), q' and k' (B, H, T, Dh) alike."""
        instead = "; or use prior_mean='softmax' (it reads the KSVD features' q and k)"
        if not isinstance(mean_values, tuple) or len(mean_values) != 3:
            got = type(mean_values).__name__ if not isinstance(mean_values, tuple) else f"{len(mean_values)} tensors"
            raise ValueError(
                f"mean_values: prior_mean={self.name!r} reads queries, keys and values of its own (the layer's "
                f"{', '.join(self.projections)} projections), a tuple of 3 tensors, got {got}{instead}"
            )
        q_own, k_own, values = mean_values
        read_own_values(self.name, values, shape, instead)
        if not (torch.is_tensor(q_own) and torch.is_tensor(k_own)) or q_own.shape != k_own.shape or (
            q_own.shape[:-1] != tuple(shape[:-1])
        ):
            shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (q_own, k_own)]
            raise ValueError(
                f"mean_values: prior_mean={self.name!r} needs its queries and keys of one shape (B, H, T, Dh) with "
                f"(B, H, T) = {tuple(shape[:-1])}, got {shapes[0]} and {shapes[1]}"
            )
        return mean_values

    def forward(self, q: torch.Tensor, k: torch.Tensor, values, mask=None) -> torch.Tensor:
        """m(x) from the mean's own (q', k', u); the features' q and k are not read.
        # shape: values a tuple of (B, H, T, Dh), (B, H, T, Dh), (B, H, T, Dv), mask (B, T) or None -> (B, H, T, Dv)"""
        q_own, k_own, own_values = values
        return super().forward(q_own, k_own, own_values, mask)
