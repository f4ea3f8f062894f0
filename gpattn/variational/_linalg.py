"""The numerics policy of gpattn in one place (DESIGN.md "Numerics policy").

* every factorisation goes through :func:`cholesky`, a wrapper of linear_operator's
  ``psd_safe_cholesky``: a plain Cholesky first, then — with ``gpattn.validation()`` on — a *bounded*
  jitter escalation, and a ``NotPSDError`` that names the layer and the matrix size — never an
  unbounded retry loop; with validation off (the default) matrices up to :data:`LADDER_MAX_SIZE` read
  nothing back from the device: the same escalation runs branch-free, and a factor that still fails is
  NaN, which the trainer reports as a divergence (larger ones keep the check: see :func:`cholesky`);
* GP algebra runs inside :func:`gp_algebra`: autocast disabled (float32 at least) and GPyTorch's
  silent CG/Lanczos switch above 800 points turned off, so the exact Cholesky paths are used;
* variances are clamped at 0 before a square root (:func:`safe_sqrt`);
* no explicit inverses: triangular solves (:func:`tri_solve`).

Counters in :data:`STATS` record jitter escalations and factorisation failures (read by
``benchmarks/stability.py``, which runs with validation on; off, only ``cholesky_calls`` counts).
"""

from __future__ import annotations

import contextlib
import warnings

import gpytorch
import torch
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.errors import NotPSDError
from linear_operator.utils.warnings import NumericalWarning

from gpattn._settings import is_validating

__all__ = [
    "STATS",
    "NotPSDError",
    "add_jitter",
    "cholesky",
    "full_precision",
    "gp_algebra",
    "reset_stats",
    "matmul_samples",
    "safe_sqrt",
    "standard_normal",
    "tri_solve",
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


def reset_stats() -> None:
    for key in STATS:
        STATS[key] = 0


def add_jitter(A: torch.Tensor, jitter: float | torch.Tensor) -> torch.Tensor:
    """A + jitter·I on the last two axes; ``jitter`` a float or a tensor broadcasting against the
    batch shape (e.g. one value per head).  # shape: A (..., n, n), jitter () or (...)"""
    if not torch.is_tensor(jitter):
        if jitter == 0:
            return A
        return A + jitter * torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return A + jitter.to(A.dtype)[..., None, None] * eye


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
    then names the matrix).
    """
    STATS["cholesky_calls"] += 1
    L, info = torch.linalg.cholesky_ex(A)
    if not is_validating() and A.shape[-1] <= LADDER_MAX_SIZE:
        L, info = _ladder(A, L, info, max_tries)
        return torch.where((info > 0)[..., None, None], torch.nan, L)
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


def _ladder(A: torch.Tensor, L: torch.Tensor, info: torch.Tensor, max_tries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_operator's ``psd_safe_cholesky`` escalation without its host reads: every one of the
    ``max_tries`` tries is computed, each adding jitter·10^i (cumulatively, in the same float
    operations) to the diagonals of the matrices that still fail, so each matrix gets the factor of
    the first try that succeeds for it — the factor ``psd_safe_cholesky`` returns.
    # shape: A, L (..., n, n), info (...) -> (..., n, n), (...)"""
    if max_tries < 1:
        return L, info
    jitter = gpytorch.settings.cholesky_jitter.value(A.dtype)
    Aprime, previous = A.clone(), 0
    for i in range(max_tries):
        new = jitter * (10**i)
        step = ((info > 0) * (new - previous)).unsqueeze(-1).expand(*Aprime.shape[:-1])
        Aprime.diagonal(dim1=-1, dim2=-2).add_(step)
        previous = new
        L, info = torch.linalg.cholesky_ex(Aprime)
    return L, info


def tri_solve(L: torch.Tensor, B: torch.Tensor, *, upper: bool = False, left: bool = True) -> torch.Tensor:
    """Solve L X = B (left) or X L = B (right) for triangular L."""
    return torch.linalg.solve_triangular(L, B, upper=upper, left=left)


def safe_sqrt(var: torch.Tensor) -> torch.Tensor:
    """sqrt of a variance clamped at 0 (round-off can make a true 0 slightly negative)."""
    return var.clamp_min(0).sqrt()


def full_precision(*tensors: torch.Tensor | None) -> list:
    """Each tensor in float32 at least (float64 stays float64; None passes through).

    Use at the entry of a :func:`gp_algebra` block: inputs projected under bf16/fp16 autocast arrive
    in half precision, while autocast is off inside, so they would meet float32 parameters.
    """
    return [
        t if t is None or not t.is_floating_point() else t.to(torch.promote_types(t.dtype, torch.float32))
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

    With ``num_samples`` the numbers are drawn batch-major — as ``(B, P, *rest)`` for ``shape = (B,
    *rest)``, then viewed as ``(P, B, *rest)`` — so that P draws from one factorisation consume the
    random stream exactly as one draw for a batch repeated P times (B-major) would: the same seed gives
    the same samples either way.  # shape: (P, *shape) or shape"""
    opts = {"dtype": like.dtype, "device": like.device, "generator": generator}
    if num_samples is None:
        return torch.randn(shape, **opts)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int or None, got {num_samples!r}")
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
