"""The numerics policy of gpattn in one place.

* every factorisation goes through :func:`cholesky`, a wrapper of linear_operator's
  ``psd_safe_cholesky``: a plain Cholesky first, then — with ``gpattn.validation()`` on — a *bounded*
  jitter escalation, and a ``NotPSDError`` that names the layer and the matrix size — never an
  unbounded retry loop; with validation off (the default) matrices up to :data:`LADDER_MAX_SIZE` read
  nothing back from the device: the same escalation runs branch-free, and a factor that still fails is
  NaN, which the trainer reports as a divergence (larger ones keep the check, and so do CPU tensors, where the
  read is free — under ``torch.compile`` inside one custom operator: see :func:`cholesky`);
* GP algebra runs inside :func:`gp_algebra`: autocast disabled (float32 at least) and GPyTorch's
  silent CG/Lanczos switch above 800 points turned off, so the exact Cholesky paths are used;
* variances are clamped at 0 before a square root (:func:`safe_sqrt`);
* no explicit inverses: triangular solves (:func:`tri_solve`);
* posteriors handed to users carry the policy: their covariance operators run gpytorch's size-switched
  algorithms (solves, log-determinants, roots, samples) under :func:`gp_algebra` wherever they are
  called, and keep doing so through slicing, expansion and repetition (:func:`with_policy`);
  ``U Uᵀ + D`` covariances use a QR-whitened factorisation (:class:`LowRankPlusDiagLinearOperator`).

Counters in :data:`STATS` record jitter escalations and factorisation failures (read by
``benchmarks/stability.py``, which runs with validation on; off, only ``cholesky_calls`` counts, and
only in eager mode: under ``torch.compile`` nothing is counted).
"""

from __future__ import annotations

import contextlib
import copy
import struct
import warnings

import gpytorch
import torch
from linear_operator.operators import (
    CholLinearOperator,
    DenseLinearOperator,
    DiagLinearOperator,
    LinearOperator,
    LowRankRootAddedDiagLinearOperator,
    LowRankRootLinearOperator,
    MatmulLinearOperator,
    RootLinearOperator,
    TriangularLinearOperator,
)
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.memoize import cached
from linear_operator.utils.warnings import NumericalWarning

from gpattn._settings import is_validating

__all__ = [
    "STATS",
    "LowRankPlusDiagLinearOperator",
    "NotPSDError",
    "add_jitter",
    "as_on_a_device",
    "isolate_padding",
    "cholesky",
    "full_precision",
    "gp_algebra",
    "reset_stats",
    "matmul_samples",
    "safe_sqrt",
    "standard_normal",
    "tri_solve",
    "with_policy",
]

#: counters since the last :func:`reset_stats`: ``cholesky_calls``, ``jitter_escalations``, ``not_psd``
STATS = {"cholesky_calls": 0, "jitter_escalations": 0, "not_psd": 0}

#: matrices up to this size use exact Cholesky paths inside gpytorch too (never CG/Lanczos)
_EXACT_SIZE = 10**9

#: with validation off, matrices up to this size run the whole jitter escalation without reading the
#: device (every try computed: a few extra small batched factorisations cost less than a host sync;
#: SCGP's m x m covariance bracket needs it routinely when T < m). Larger ones keep the host check:
#: their O(n^3) factorisation dwarfs one read, while 4 extra ones would not (and SGPA's T x T key
#: Gram needs the escalation in float32 at T = 1024)
LADDER_MAX_SIZE = 128


#: the host shortcut of :func:`cholesky` (a CPU tensor in eager mode: the plain factorisation, the ladder only on
#: failure); the innermost open :func:`as_on_a_device` block turns it off
_HOST_SHORTCUT: list = []


@contextlib.contextmanager
def as_on_a_device():
    """CPU tensors take the path of a device tensor through the numerics policy (no host shortcut, nothing read
    back): for counting what a device runs on the host (``benchmarks/op_count.py``, the host-read tests).
    Process-wide, like the switches of :mod:`gpattn._settings`."""
    _HOST_SHORTCUT.append(False)
    try:
        yield
    finally:
        _HOST_SHORTCUT.pop()


def _host_shortcut(A: torch.Tensor) -> bool:
    return A.device.type == "cpu" and not _HOST_SHORTCUT


def reset_stats() -> None:
    for key in STATS:
        STATS[key] = 0


def add_jitter(A: torch.Tensor, jitter: float | torch.Tensor) -> torch.Tensor:
    """A + c·I on the last two axes: the one helper for every shifted diagonal (a jitter, the noise σ²
    of a Gram matrix, a relative jitter per sequence and head). ``jitter`` is a float or a tensor
    broadcasting against the batch shape of A (e.g. one value per head, ``(H,)``, against ``(B, H, n,
    n)``); the identity is never formed (a copy of A with its diagonal shifted), and a float 0 returns A
    itself.  # shape: A (..., n, n), jitter () or (...) -> (..., n, n)"""
    if not torch.is_tensor(jitter):
        if jitter == 0:
            return A
        value = jitter  # a Python number: no tensor made for it (no host-to-device copy)
        batch = A.shape[:-2]
    else:
        value = jitter.to(A.dtype)[..., None]  # shape: (..., 1), against the diagonal (..., n)
        batch = torch.broadcast_shapes(A.shape[:-2], value.shape[:-1])
    A = A.expand(*batch, *A.shape[-2:])
    # out of place: the backward takes the diagonal apart once (no in-place copy of A to undo)
    return A.diagonal_scatter(A.diagonal(dim1=-2, dim2=-1) + value, dim1=-2, dim2=-1)


def isolate_padding(K: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Replace padded rows and columns of a Gram matrix by identity rows/columns.

    The padded tokens become isolated dummy inputs (zero covariance with every real token, unit
    variance), so a Cholesky factor's real rows equal those of the real block alone.
    # shape: K (B, H, T, T), mask (B, T) -> (B, H, T, T)
    """
    if mask is None:
        return K
    real = ~mask
    both = real[:, None, :, None] & real[:, None, None, :]  # shape: (B, 1, T, T)
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    return torch.where(both, K, eye)


def cholesky(A: torch.Tensor, *, max_tries: int = 4, name: str = "") -> torch.Tensor:
    """Lower Cholesky factor of a batch of symmetric PSD matrices.  # shape: (..., n, n)

    Tries ``torch.linalg.cholesky_ex`` first; only on failure escalates jitter through
    ``psd_safe_cholesky`` (at most ``max_tries`` times, 1e-6/1e-8 relative to float32/float64 and
    ×10 each time). Raises ``NotPSDError`` naming ``name`` and the size after the last try.

    That is the behaviour with ``gpattn.validation()`` on, and for matrices larger than
    :data:`LADDER_MAX_SIZE`. Off (the default), asking whether a small factorisation failed would read
    ``info`` back from the device on every call, so nothing is read: they run the same escalation
    branch-free (:func:`_ladder`: the same factor, bit for bit), and a factor that still fails is NaN —
    the loss turns non-finite and the trainer stops with a divergence naming the step (``--validate``
    then names the matrix). A CPU tensor has no device to read back from: it gets the plain factorisation,
    and the ladder only if one of its matrices fails (the ladder's 1 + ``max_tries`` batched tries cost several
    factorisations on the host, where nothing is gained) — eagerly and under ``torch.compile`` through the custom
    operator :func:`_host_cholesky`, which a graph calls whole and whose backward is :func:`cholesky_backward`;
    inside :func:`as_on_a_device` it takes the device path.
    """
    if not torch.compiler.is_compiling():  # a global mutated in a compiled graph is a guard: a recompile per call
        STATS["cholesky_calls"] += 1
    if not is_validating() and A.shape[-1] <= LADDER_MAX_SIZE:
        if _host_shortcut(A):  # on the host, reading info is free: no ladder when none fails (one operator,
            return _host_cholesky(A, max_tries)  # eager and compiled, with the written backward)
        L, info = _ladder(A, max_tries)
        return L.masked_fill((info > 0)[..., None, None], torch.nan)
    L, info = torch.linalg.cholesky_ex(A)
    if not bool(info.any()):
        return L
    STATS["jitter_escalations"] += 1
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericalWarning)
            return psd_safe_cholesky(A, max_tries=max_tries)
    except NotPSDError as err:
        STATS["not_psd"] += 1
        where = f" in {name}" if name else ""
        raise NotPSDError(
            f"matrix of size {A.shape[-1]}x{A.shape[-1]} (batch {tuple(A.shape[:-2])}){where} is not "
            f"positive definite after {max_tries} jitter escalations; increase the layer's `jitter` "
            f"option or use float64 ({err})"
        ) from err


def _ladder(A: torch.Tensor, max_tries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_operator's ``psd_safe_cholesky`` escalation without its host reads: the plain try and the
    ``max_tries`` jittered ones (jitter·10^i added cumulatively, in the same float operations) factorised in one
    batched call without gradients, then the first try that succeeds for each matrix factorised again, with
    gradients — the factor ``psd_safe_cholesky`` returns, bit for bit, from two factorisation calls and one
    backward (an escalation per try costs a call each and a backward through every in-place jitter).
    # shape: A (..., n, n) -> L (..., n, n), info (...) (> 0 where every try failed)"""
    jitter = gpytorch.settings.cholesky_jitter.value(A.dtype)
    with torch.no_grad():  # the jitter is a constant: A's gradient passes the shift unchanged (_ShiftedDiagonal)
        diag, previous = A.diagonal(dim1=-2, dim2=-1), 0.0
        tries = [diag]  # shape: each (..., n): the diagonal of the plain try, then of each jittered one
        for i in range(max(max_tries, 0)):
            new = jitter * (10**i)
            tries.append(tries[-1] + _in_default_dtype(new - previous))  # as psd_safe_cholesky's (info > 0) * step
            previous = new
        tries = torch.stack(tries)  # shape: (1 + max_tries, ..., n)
        stacked = A.expand(tries.shape[0], *A.shape).diagonal_scatter(tries, dim1=-2, dim2=-1)
        first = torch.linalg.cholesky_ex(stacked)[1].argmin(0)  # the first 0 (a try that fails if none succeeds)
        chosen = tries.gather(0, first[None, ..., None].expand(1, *diag.shape))[0]  # shape: (..., n)
    return torch.linalg.cholesky_ex(_ShiftedDiagonal.apply(A, chosen))


@torch.library.custom_op("gpattn::host_cholesky", mutates_args=(), device_types="cpu")
def _host_cholesky(A: torch.Tensor, max_tries: int) -> torch.Tensor:
    """:func:`cholesky`'s host shortcut as one operator that ``torch.compile`` calls without tracing into it (a
    custom op: the graph has no break and no data-dependent branch): the plain factorisation, and the ladder only
    when a matrix fails, NaN where every try fails. (The branch-free ladder costs 1 + ``max_tries`` batched
    factorisations forward, ~2.3× the plain step of 256 matrices of 128 × 128 here; ``torch.cond`` would branch in
    the graph, but Dynamo in torch 2.13 then drops every later attribute store of the frame, which the
    conditionals' caches are.) # shape: A (..., n, n) -> L (..., n, n)"""
    L, info = torch.linalg.cholesky_ex(A)
    if bool(info.any()):
        with torch.no_grad():
            L, info = _ladder(A, max_tries)
        L = L.masked_fill((info > 0)[..., None, None], torch.nan)
    return L.contiguous()


@_host_cholesky.register_fake
def _(A, max_tries):
    return torch.empty_like(A, memory_format=torch.contiguous_format)


def _host_cholesky_context(ctx, inputs, output):
    ctx.save_for_backward(output)


def _host_cholesky_backward(ctx, grad):
    """For A = L Lᵀ, Ā = L⁻ᵀ Φ(Lᵀ L̄) L⁻¹ with Φ(X) = ½(tril(X) + tril(X, -1)ᵀ), symmetric (docs/derivations.md,
    "Numerics policy"); a fallback's jitter is a constant, so the same formula at the jittered factor is A's."""
    (L,) = ctx.saved_tensors
    return cholesky_backward(L, grad), None


def cholesky_backward(L: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Ā = L⁻ᵀ S L⁻¹ for A = L Lᵀ and L̄ = ``grad``, S = Φ(Lᵀ L̄) symmetric: as two solves from the right,
    Y = S L⁻¹ and Ā = Āᵀ = Yᵀ L⁻¹ (a row-major factor solves from the right in ~half the time of a left solve
    with Lᵀ: docs/benchmarks.md), with S = ½(P + Pᵀ) − ½ diag(P), P = tril(Lᵀ L̄).  # shape: (..., n, n)"""
    P = (L.mT @ grad).tril_()
    S = P + P.mT
    S.diagonal(dim1=-2, dim2=-1).mul_(0.5)  # its diagonal holds 2 P_ii: P_ii, then ½ P_ii with the rest below
    S.mul_(0.5)
    Y = torch.linalg.solve_triangular(L, S, upper=False, left=False)
    return torch.linalg.solve_triangular(L, Y.mT, upper=False, left=False)


_host_cholesky.register_autograd(_host_cholesky_backward, setup_context=_host_cholesky_context)


class _ShiftedDiagonal(torch.autograd.Function):
    """A with its diagonal replaced by ``diag``, a constant shift of A's own (a jitter computed without gradients):
    the gradient passes to A whole, as through A + c·I, without a backward through the shift's arithmetic."""

    @staticmethod
    def forward(ctx, A, diag):  # shape: A (..., n, n), diag (..., n) -> (..., n, n)
        return A.diagonal_scatter(diag, dim1=-2, dim2=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _in_default_dtype(x: float) -> float | torch.Tensor:
    """``x`` rounded to torch's default float dtype (``psd_safe_cholesky`` multiplies its jitter steps by a bool
    tensor, which makes them default-dtype tensors): eagerly a Python float, without a tensor op; compiled a 0-dim
    tensor of that dtype, which the compiler folds (the float may be symbolic there: a SymFloat under
    ``dynamic=True``, which ``struct`` cannot pack)."""
    if torch.compiler.is_compiling():
        return torch.full((), x, dtype=torch.get_default_dtype())
    code = {torch.float32: "f", torch.float16: "e"}.get(torch.get_default_dtype())
    return x if code is None else struct.unpack(code, struct.pack(code, x))[0]


def tri_solve(L: torch.Tensor, B: torch.Tensor, *, upper: bool = False, left: bool = True) -> torch.Tensor:
    """Solve L X = B (left) or X L = B (right) for triangular L.

    A left solve whose factor is shared along batch axes of B (L's size 1 there, B's not: a per-head factor
    against a batch of sequences) runs as one solve of those axes' columns side by side: the columns of a
    triangular solve are independent, so the values are the broadcast solve's, in one call per matrix of L instead
    of one per matrix of the broadcast batch.  # shape: L (..., n, n), B (..., n, k) -> (..., n, k)"""
    shared = _shared_axes(L, B) if left else ()
    if not shared:
        return torch.linalg.solve_triangular(L, B, upper=upper, left=left)
    nb = B.dim() - 2
    own = [i for i in range(nb) if i not in shared]
    cols = B.permute(*own, nb, *shared, nb + 1)  # shape: (own..., n, shared..., k)
    X = torch.linalg.solve_triangular(L.squeeze(shared), cols.reshape(*cols.shape[: len(own) + 1], -1), upper=upper)
    inverse = sorted(range(B.dim()), key=[*own, nb, *shared, nb + 1].__getitem__)
    return X.view(*X.shape[:-1], *cols.shape[len(own) + 1 :]).permute(*inverse)  # own axes broadcast against L's


def _shared_axes(L: torch.Tensor, B: torch.Tensor) -> tuple[int, ...]:
    """The batch axes of B along which L has size 1 (B's larger), when L has B's number of axes."""
    if L.dim() != B.dim():
        return ()
    return tuple(i for i in range(B.dim() - 2) if L.shape[i] == 1 and B.shape[i] != 1)


def safe_sqrt(var: torch.Tensor) -> torch.Tensor:
    """sqrt of a variance clamped at 0 (round-off can make a true 0 slightly negative)."""
    return var.clamp_min(0).sqrt()


def full_precision(*tensors: torch.Tensor | tuple | None) -> list:
    """Each tensor in float32 at least (float64 stays float64; None passes through; a tuple of tensors, such as a
    prior mean's own queries, keys and values, comes back a tuple of them).

    Use at the entry of a :func:`gp_algebra` block: inputs projected under bf16/fp16 autocast arrive
    in half precision, while autocast is off inside, so they would meet float32 parameters.
    """
    return [
        tuple(full_precision(*t))
        if isinstance(t, tuple)
        else t
        if t is None or not t.is_floating_point()
        else t.to(torch.promote_types(t.dtype, torch.float32))
        for t in tensors
    ]


@contextlib.contextmanager
def gp_algebra(device_type: str = "cpu"):
    """Exact, full-precision GP algebra: autocast off, gpytorch's CG/Lanczos switch off.

    The gpytorch settings are context managers, so nothing global changes outside the block. (Plain
    nested ``with`` blocks, not an ``ExitStack``: torch.compile traces them without a graph break.)
    """
    off = (  # autocast off; "meta" (shape and device checks) has no autocast
        torch.autocast(device_type=device_type, enabled=False)
        if torch.amp.is_autocast_available(device_type)
        else contextlib.nullcontext()
    )
    with (
        off,
        gpytorch.settings.max_cholesky_size(_EXACT_SIZE),
        gpytorch.settings.max_root_decomposition_size(_EXACT_SIZE),
        gpytorch.settings.fast_computations(covar_root_decomposition=False, log_prob=False, solves=False),
    ):
        yield


def standard_normal(shape, like: torch.Tensor, num_samples: int | None, generator=None) -> torch.Tensor:
    """ε ~ N(0, I) with an optional leading sample axis P (gpytorch's ``rsample(num_samples)`` layout).

    With ``num_samples`` the numbers are drawn batch-major — as ``(B, P, *rest)`` for
    ``shape = (B, *rest)``, then viewed as ``(P, B, *rest)`` — so that P draws from one factorisation consume the
    random stream exactly as one draw for a batch repeated P times (B-major) would: the same seed gives
    the same samples either way.  # shape: ``(P, *shape)`` or ``shape``"""
    opts = {"dtype": like.dtype, "device": like.device}
    if generator is not None:  # no generator=None: randn's generator overload refuses a symbolic (dynamic) shape
        opts["generator"] = generator
    if num_samples is None:
        return torch.randn(shape, **opts)
    return torch.randn(shape[0], num_samples, *shape[1:], **opts).transpose(0, 1)


def matmul_samples(A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``A @ X`` where X may carry one extra leading sample axis P that A lacks, computed as one batched
    product over the columns of all P draws (``torch.matmul`` would copy A P times to broadcast it).

    # shape: A (..., n, k), X (..., k, d) or (P, ..., k, d) -> (..., n, d) or (P, ..., n, d)"""
    if X.dim() <= A.dim():
        return A @ X
    P, d = X.shape[0], X.shape[-1]
    cols = X.movedim(0, -2)  # shape: (..., k, P, d)
    out = A @ cols.reshape(*cols.shape[:-2], P * d)  # shape: (..., n, P·d)
    return out.view(*out.shape[:-1], P, d).movedim(-2, 0)


# ------------------------------------------------------------------- operators that carry the policy
#: LinearOperator methods whose algorithm gpytorch switches on the matrix size (CG / Lanczos above
#: ``max_cholesky_size``, 800): a policy operator runs them inside :func:`gp_algebra`
_SWITCHED = (
    "cholesky",
    "diagonalization",
    "eigh",
    "inv_quad",
    "inv_quad_logdet",
    "logdet",
    "root_decomposition",
    "root_inv_decomposition",
    "solve",
    "sqrt_inv_matmul",
    "svd",
    "zero_mean_mvn_samples",
)
#: methods that return a new operator: the policy is carried over to it (slices of a posterior, the
#: batch expansion and repetition ``MultivariateNormal.log_prob`` applies to a sample axis, ...)
_DERIVED = (
    "__add__",
    "__getitem__",
    "__mul__",
    "add_diagonal",
    "add_jitter",
    "add_low_rank",
    "detach",
    "double",
    "evaluate_kernel",
    "expand",
    "float",
    "mul",
    "permute",
    "repeat",
    "to",
    "transpose",
    "unsqueeze",
)

_NOOP = slice(None, None, None)


class _NumericsPolicy:
    """Mixin for a ``LinearOperator`` class: the size-switched algorithms (:data:`_SWITCHED`) run under
    :func:`gp_algebra`, so a posterior's covariance is factorised exactly (Cholesky) whatever its size
    and whatever gpytorch settings the caller has, and operators derived from it (:data:`_DERIVED`)
    carry the policy too. Built by :func:`with_policy`; the operator's own structure and algorithms
    are kept (a ``CholLinearOperator`` still solves with its factor)."""

    @cached(name="cholesky")
    def _cholesky(self, upper=False):
        # an operator without a structured factorisation is factorised densely through cholesky()
        # (bounded jitter escalation, no NumericalWarning, a named NotPSDError under validation())
        # instead of linear_operator's psd_safe_cholesky; structured ones keep theirs
        if super()._cholesky.__func__ is not LinearOperator._cholesky:
            return super()._cholesky(upper=upper)
        L = cholesky(self.to_dense(), name=f"posterior covariance ({type(self).__name__})")
        return TriangularLinearOperator(L.mT if upper else L, upper=upper)

    def _getitem(self, row_index, col_index, *batch_indices):
        tokens = not all(isinstance(i, slice) and i == _NOOP for i in (row_index, col_index))
        if isinstance(self, CholLinearOperator) and tokens:
            # the rows of a Cholesky factor are no longer triangular (CholLinearOperator would reject
            # them): a token slice of L Lᵀ is the root operator of L's rows
            L = self.root.to_dense()
            return RootLinearOperator(L.mT if self.upper else L)._getitem(row_index, col_index, *batch_indices)
        if isinstance(self, DiagLinearOperator) and tokens:
            # a diagonal stays diagonal on equal row and column slices; otherwise the dense block
            # (linear_operator's interpolated slice goes through sparse tensors)
            diag = self._diag[(*batch_indices, _NOOP)]
            if isinstance(row_index, slice) and row_index == col_index:
                return DiagLinearOperator(diag[..., row_index])
            return DenseLinearOperator(_diagonal_block(diag, row_index, col_index))
        return super()._getitem(row_index, col_index, *batch_indices)


def _diagonal_block(diag: torch.Tensor, row_index, col_index) -> torch.Tensor:
    """The (rows, cols) block of diag(d), without forming diag(d).

    # shape: diag (..., n), row_index / col_index a slice or an index tensor -> (..., rows, cols)"""
    n = diag.shape[-1]
    rows, cols = (torch.arange(n, device=diag.device)[i] if isinstance(i, slice) else i for i in (row_index, col_index))
    return torch.where(rows[:, None] == cols[None, :], diag[..., rows, None], diag.new_zeros(()))


def _switched(name):
    def method(self, *args, **kwargs):
        with gp_algebra(self.device.type if self.device is not None else "cpu"):
            return getattr(super(_NumericsPolicy, self), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}`` under the numerics policy (:func:`gp_algebra`)."
    return method


def _derived(name):
    def method(self, *args, **kwargs):
        return with_policy(getattr(super(_NumericsPolicy, self), name)(*args, **kwargs))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``{name}``; the result carries the numerics policy."
    return method


for _name in _SWITCHED:
    setattr(_NumericsPolicy, _name, _switched(_name))
for _name in _DERIVED:
    setattr(_NumericsPolicy, _name, _derived(_name))

#: linear_operator class -> its policy subclass (also reachable as a module attribute, for pickle)
_POLICY_CLASSES: dict[type, type] = {}


def _policy_class(cls: type) -> type:
    if issubclass(cls, _NumericsPolicy):
        return cls
    if cls not in _POLICY_CLASSES:
        name = f"Exact{cls.__name__}"
        _POLICY_CLASSES[cls] = type(name, (_NumericsPolicy, cls), {"__module__": __name__, "__qualname__": name})
    return _POLICY_CLASSES[cls]


def __getattr__(name: str):
    """``ExactCholLinearOperator`` etc.: the policy subclasses, made on demand (unpickling)."""
    import linear_operator.operators as operators

    base = getattr(operators, name[len("Exact") :], None) if name.startswith("Exact") else None
    if isinstance(base, type) and issubclass(base, LinearOperator):
        return _policy_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def with_policy(op):
    """``op`` as an operator of the same class (so ``isinstance`` and its attributes still hold) that
    carries the numerics policy (:class:`_NumericsPolicy`); anything that is not a ``LinearOperator``
    (a tensor, a tuple of results) is returned unchanged."""
    if not isinstance(op, LinearOperator) or isinstance(op, _NumericsPolicy):
        return op
    out = copy.copy(op)  # shallow: the same tensors and caches, another class
    out.__class__ = _policy_class(type(op))
    return out


class LowRankPlusDiagLinearOperator(_NumericsPolicy, LowRankRootAddedDiagLinearOperator):
    r""":math:`\Sigma = U U^\top + D` (U of shape (..., n, k), D diagonal > 0), factorised through the
    whitened root :math:`\tilde U = D^{-1/2} U = Q R` (thin QR, Q of shape (..., n, p), p = min(n, k)):

    .. math::
        \Sigma = D^{1/2}\big[Q (R R^\top + I) Q^\top + (I - Q Q^\top)\big] D^{1/2},\qquad
        R R^\top + I = L_p L_p^\top,

    so, with :math:`\tilde x = D^{-1/2} x`, :math:`x^\top \Sigma^{-1} x =
    \lVert L_p^{-1} Q^\top \tilde x \rVert^2 + \lVert \tilde x - Q Q^\top \tilde x \rVert^2`,
    :math:`\log|\Sigma| = \sum \log d + 2 \sum \log \operatorname{diag} L_p`, and
    :math:`S = D^{1/2}\big[(I - Q Q^\top) + Q L_p Q^\top\big]` is an exact square root (:math:`S S^\top = \Sigma`)
    applied in O(n·p). The quadratic form is a sum of squares: unlike the Woodbury difference
    :math:`(\lVert x \rVert^2 - x^\top U C^{-1} U^\top x)/d` of ``LowRankRootAddedDiagLinearOperator``, it
    does not cancel when D is tiny against :math:`U U^\top` (KEP-SVGP's jitter; float32 KL(p‖p) ≈ 0).
    Only p×p matrices are factorised; nothing n×n is formed unless asked for (``to_dense``, a Cholesky).
    Samples: :math:`U \varepsilon_1 + D^{1/2} \varepsilon_2`, O(n·k).

    # shape: low_rank root (..., n, k), diag (..., n)
    """

    def __init__(self, low_rank: LowRankRootLinearOperator, diag: DiagLinearOperator, **kwargs):
        super().__init__(low_rank, diag, **kwargs)

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """D^{1/2}, Q and L_p (computed once per operator).  # shape: (..., n), (..., n, p), (..., p, p)"""
        cache = self.__dict__.setdefault("_policy_factors", [])
        if not cache:
            sqrt_d = self._diag_tensor.diagonal().sqrt()
            Q, R = torch.linalg.qr(self._linear_op.root.to_dense() / sqrt_d[..., None])
            L_p = cholesky(add_jitter(R @ R.mT, 1.0), name="low-rank-plus-diagonal covariance (R Rᵀ + I)")
            cache.extend([sqrt_d, Q, L_p])
        return tuple(cache)

    def _whitened_parts(self, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x̃ = D^{-1/2} x, its coordinates Qᵀx̃ and its part outside span Q.  # shape: rhs (..., n, c)"""
        sqrt_d, Q, _ = self._factors()
        x = rhs / sqrt_d[..., None]
        coords = Q.mT @ x
        return x, coords, x - Q @ coords

    def _solve(self, rhs, preconditioner=None, num_tridiag=0):
        sqrt_d, Q, L_p = self._factors()
        _, coords, outside = self._whitened_parts(rhs)
        return (outside + Q @ torch.cholesky_solve(coords, L_p)) / sqrt_d[..., None]

    def solve(self, right_tensor, left_tensor=None):
        vector = right_tensor.dim() == 1
        res = self._solve(right_tensor[:, None] if vector else right_tensor)
        res = res[..., 0] if vector else res
        return res if left_tensor is None else left_tensor @ res

    def _logdet(self):
        sqrt_d, _, L_p = self._factors()
        return 2.0 * (sqrt_d.log().sum(-1) + L_p.diagonal(dim1=-2, dim2=-1).log().sum(-1))

    def inv_quad_logdet(self, inv_quad_rhs=None, logdet=False, reduce_inv_quad=True):
        inv_quad = None
        if inv_quad_rhs is not None:
            vector = inv_quad_rhs.dim() == self.dim() - 1
            rhs = inv_quad_rhs[..., None] if vector else inv_quad_rhs
            _, coords, outside = self._whitened_parts(rhs)
            inside = tri_solve(self._factors()[2], coords)
            inv_quad = inside.square().sum(-2) + outside.square().sum(-2)  # shape: (..., c)
            if vector:
                inv_quad = inv_quad[..., 0]
            elif reduce_inv_quad:
                inv_quad = inv_quad.sum(-1)
        return inv_quad, (self._logdet() if logdet else None)

    def inv_quad(self, inv_quad_rhs, reduce_inv_quad=True):
        return self.inv_quad_logdet(inv_quad_rhs, reduce_inv_quad=reduce_inv_quad)[0]

    def logdet(self):
        return self._logdet()

    def root_decomposition(self, method=None):
        """The exact square root S = D^{1/2}[(I − QQᵀ) + Q L_p Qᵀ] (n×n, applied in O(n·p))."""
        sqrt_d, Q, L_p = self._factors()
        scaled = Q * sqrt_d[..., None]  # D^{1/2} Q
        eye = DiagLinearOperator(sqrt_d)
        # D^{1/2}(I − QQᵀ) + D^{1/2} Q L_p Qᵀ = D^{1/2} + D^{1/2} Q (L_p − I) Qᵀ
        eye_p = torch.eye(L_p.shape[-1], dtype=L_p.dtype, device=L_p.device)
        inner = MatmulLinearOperator(scaled, (L_p - eye_p) @ Q.mT)
        return RootLinearOperator(with_policy(eye + inner))

    def zero_mean_mvn_samples(self, num_samples: int) -> torch.Tensor:
        U = self._linear_op.root.to_dense()
        sqrt_d = self._diag_tensor.diagonal().sqrt()
        eps_u = torch.randn(num_samples, *U.shape[:-2], U.shape[-1], 1, dtype=U.dtype, device=U.device)
        eps_d = torch.randn(num_samples, *sqrt_d.shape, dtype=U.dtype, device=U.device)
        return (U @ eps_u)[..., 0] + sqrt_d * eps_d

    def evaluate_kernel(self):
        # nothing lazy to evaluate; AddedDiagLinearOperator's rebuilds a plain sum, losing this class
        return self

    def _rebuilt(self, root: torch.Tensor, diag: torch.Tensor) -> LowRankPlusDiagLinearOperator:
        return LowRankPlusDiagLinearOperator(LowRankRootLinearOperator(root), DiagLinearOperator(diag))

    def _getitem(self, row_index, col_index, *batch_indices):
        root = self._linear_op.root.to_dense()[(*batch_indices, _NOOP, _NOOP)]
        diag = self._diag_tensor.diagonal()[(*batch_indices, _NOOP)]
        # Σ[rows, rows] = U[rows] U[rows]ᵀ + D[rows]: the same structure (slices of the same rows)
        if isinstance(row_index, slice) and isinstance(col_index, slice) and row_index == col_index:
            return self._rebuilt(root[..., row_index, :], diag[..., row_index])
        # any other block: U[rows] U[cols]ᵀ + D[rows, cols], dense (linear_operator's slice of the
        # diagonal part goes through sparse tensors)
        block = root[..., row_index, :] @ root[..., col_index, :].mT + _diagonal_block(diag, row_index, col_index)
        return with_policy(DenseLinearOperator(block))

    def _expand_batch(self, batch_shape):
        root, diag = self._linear_op.root.to_dense(), self._diag_tensor.diagonal()
        return self._rebuilt(root.expand(*batch_shape, *root.shape[-2:]), diag.expand(*batch_shape, diag.shape[-1]))

    def repeat(self, *sizes):
        sizes = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
        root, diag = self._linear_op.root.to_dense(), self._diag_tensor.diagonal()
        pad = len(sizes) - root.dim()  # repeat may add leading batch axes
        root = root.reshape((1,) * pad + tuple(root.shape))
        diag = diag.reshape((1,) * pad + tuple(diag.shape))
        return self._rebuilt(root.repeat(*sizes), diag.repeat(*sizes[:-1]))
