r"""Gumbel-softmax sampling shared by STO-TRANS and H-STO-TRANS (docs/derivations.md §3–4; Pei et al. eqs. 9–11).

The Gumbel-softmax of logits :math:`\ell` at temperature :math:`\tau` over the last axis is

.. math::
    \hat a = \mathrm{softmax}\big((\ell + G)/\tau\big), \qquad G_j \overset{iid}{\sim} \mathrm{Gumbel}(0, 1),
    \quad G = -\log(-\log U),\ U \sim \mathcal U(0, 1).

Conventions of this module (one place, so that both variants agree):

* **Masking before the noise.** Excluded entries (``mask`` True) get :math:`\ell = -\infty` before
  :math:`G` is added, so they receive exactly 0 weight and the rows renormalise over the real
  entries (the released code masks after sampling without renormalising).
* **Hard mode** (``hard=True``): the straight-through estimator of Jang et al. (2017), as in
  ``torch.nn.functional.gumbel_softmax``: the forward value is exactly the one-hot vector of
  :math:`\arg\max_j (\ell_j + G_j)`, the backward pass is that of the soft sample with the same
  noise. By the Gumbel-max trick the one-hot index is distributed as
  :math:`\mathrm{Categorical}(\mathrm{softmax}(\ell))` — independent of :math:`\tau`, which only
  shapes the gradient.
* **Noise-free mode** (``sample=False``, used under ``gpattn.deterministic()``): **Choice** —
  :math:`\mathrm{softmax}(\ell/\tau)` in *both* soft and hard mode, i.e. the Gumbel-softmax with
  :math:`G` dropped. In hard mode this is the relaxation whose gradient the straight-through
  estimator uses (not the argmax one-hot, which ignores :math:`\tau`, is tie-sensitive and has no
  gradient, and not the mean of the hard samples :math:`\mathrm{softmax}(\ell)`).
* **Noise generation.** On CPU the uniforms come from NumPy's SFC64 bit generator seeded by one draw
  from torch's generator (so ``torch.manual_seed`` reproduces every sample), turned into uniforms
  on the centred grid :math:`U = (2i + 1)\,2^{-24}` (float32) or :math:`(2i+1)\,2^{-53}` (float64) by
  bit manipulation — never exactly 0 or 1, so :math:`G` is always finite. Large draws use two
  spawned streams, drawn in two threads when torch may use them (the bits do not depend on it):
  the cheapest CPU noise generator measured (docs/benchmarks.md "Per-entry costs behind
  implementation choices"). Drawing the (B, H, T, T) noise and reading it as
  ``scaled_dot_product_attention``'s additive mask are the whole cost of STO-TRANS over softmax
  attention, O(B·H·T²). Other devices use ``exponential_`` on the device.

Which path :func:`gumbel_attention` runs (:func:`fused_path` decides; nothing else is guessed):

* **Fused** — CUDA, float32 / float16 / bfloat16, soft samples (``sample=True``, ``hard=False``) without
  ``return_weights``, no mask or a key padding mask (B, S), head dimensions of q and v at least 16 (the
  least Inductor's FlexAttention kernel takes), FlexAttention (PyTorch ≥ 2.5) and Triton installed: one
  FlexAttention kernel, compiled once per process on first use (:func:`_compiled_fused`), adds the noise
  :math:`G(\mathrm{seed}, b, h, i, j)` of :mod:`gpattn.attention._counter_noise` to each score, computed
  from the entry's indices (and a (B, H, T) and an (S,) table of hash words) in the forward and again in
  the backward, so no (B, H, T, S) tensor exists and memory is linear in T. One seed per forward comes
  from torch's generator (or the one passed): a different random stream from the other paths, the same
  law (docs/derivations.md §12).
* **Dense / blockwise** — everything else: the CPU (FlexAttention has no backward there), float64,
  hard samples, ``return_weights``, per-query masks (B or 1, H or 1, T, S), the noise-free
  ``sample=False`` (on CUDA ``scaled_dot_product_attention`` is already fused for it), small head
  dimensions: the noise drawn as above, whole or in blocks of queries for long sequences
  (:mod:`gpattn.variational._blockwise`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import threading
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from gpattn.attention._counter_noise import gumbel_from_words, noise_tables
from gpattn.attention._masks import excluded_keys
from gpattn.variational._blockwise import block_rows, block_seeds, blockwise

try:
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:  # PyTorch before 2.5 (setup.cfg allows 2.1): no fused path, fused_path says False
    flex_attention = None

__all__ = ["fused_path", "gumbel_attention", "gumbel_noise", "gumbel_softmax", "straight_through_one_hot"]

# constants of the centred uniform grids (exact in the target dtype, see gumbel_noise)
_F32_MANTISSA, _F32_ONE = 0x7FFFFF, 0x3F800000
_F64_MANTISSA, _F64_ONE = 0xFFFFFFFFFFFFF, 0x3FF0000000000000
_SEED_HIGH = 2**63 - 1
_PARALLEL_MIN_WORDS = 1 << 20  # below this one stream (no thread start-up)
# the fused path (module docstring): its dtypes, Inductor's least head dimension, and whether this PyTorch
# has FlexAttention and Triton to compile it
_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf"  # Dynamo's tracing reads it
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FUSED_MIN_HEAD_DIM = 16
_FUSED_AVAILABLE = flex_attention is not None and importlib.util.find_spec("triton") is not None


def _check_tau(tau, name: str = "tau") -> float:
    if torch.compiler.is_compiling():  # checked eagerly; under dynamic=True tau is symbolic, isfinite a graph break
        return tau
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {tau!r}")
    return float(tau)


def _random_words(count: int, generator: torch.Generator | None) -> list[np.ndarray]:
    """``count`` random 64-bit words (uint64 arrays, in order) seeded by one draw from torch's generator.

    Large requests come from two SFC64 streams spawned from that seed, drawn in two threads when torch
    may use more than one (NumPy releases the GIL while it draws); the bits never depend on the thread
    count.
    """
    # a CPU generator's draw read as host memory (NumPy): this path never runs for device tensors
    seed = int(torch.randint(0, _SEED_HIGH, (1,), generator=generator).numpy()[0])
    if count < _PARALLEL_MIN_WORDS:
        return [np.random.SFC64(seed).random_raw(count)]
    streams = [np.random.SFC64(s) for s in np.random.SeedSequence(seed).spawn(2)]
    sizes = (count // 2, count - count // 2)
    parts: list[np.ndarray | None] = [None, None]

    def draw(i: int) -> None:
        parts[i] = streams[i].random_raw(sizes[i])

    if torch.get_num_threads() > 1:
        worker = threading.Thread(target=draw, args=(1,))
        worker.start()
        draw(0)
        worker.join()
        if parts[1] is None:
            raise RuntimeError("drawing Gumbel noise failed in the helper thread")
    else:
        draw(0)
        draw(1)
    return parts


def _cpu_gumbel(n: int, dtype: torch.dtype, scale: float, generator: torch.Generator | None) -> torch.Tensor:
    """``scale`` · Gumbel(0, 1), ``n`` entries as a flat float32 / float64 CPU tensor (see the module doc)."""
    out = torch.empty(n, dtype=dtype)
    if dtype == torch.float64:
        words, mantissa, one, centre, int_view = n, _F64_MANTISSA, _F64_ONE, 1.0 - 2.0**-53, np.int64
    else:  # two 32-bit words per 64-bit draw
        words, mantissa, one, centre, int_view = (n + 1) // 2, _F32_MANTISSA, _F32_ONE, 1.0 - 2.0**-24, np.int32
    start = 0
    for part in _random_words(words, generator):
        bits = torch.from_numpy(part.view(int_view))[: n - start]
        # a [1, 2) float with random mantissa bits, minus (1 - 2^-p): exactly (2i + 1) 2^-p, never 0 or 1
        bits.bitwise_and_(mantissa).bitwise_or_(one)
        x = bits.view(dtype).sub_(centre)
        x.log_().neg_().log_()  # log E, E = -log U ~ Exp(1)
        torch.mul(x, -scale, out=out[start : start + x.numel()])  # scale * G = -scale * log E
        start += x.numel()
    return out


#: a token each compiled draw mutates: in a graph the draws then form a chain, taken in program order, as eager takes
#: them (operators without inputs could be scheduled in any order, and two layers' noise swapped)
_DRAW_ORDER = torch.zeros((), dtype=torch.int64)


@torch.library.custom_op("gpattn::cpu_gumbel", mutates_args=("order",), tags=(torch.Tag.nondeterministic_seeded,))
def _compiled_cpu_gumbel(order: torch.Tensor, n: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """:func:`_cpu_gumbel` from torch's default generator as one opaque operator: ``torch.compile`` keeps it in
    the graph (NumPy's draw would break it) and draws the same bits as eager (seeded: never merged by CSE)."""
    order.add_(1)
    return _cpu_gumbel(n, dtype, scale, None)


@_compiled_cpu_gumbel.register_fake
def _(order, n, dtype, scale):
    return torch.empty(n, dtype=dtype)


def gumbel_noise(
    shape,
    *,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""``scale`` times i.i.d. Gumbel(0, 1) samples, :math:`G = -\log(-\log U)`, of the given shape.

    Returns a fresh contiguous tensor (callers may modify it in place). ``scale`` folds the
    :math:`1/\tau` of the Gumbel-softmax into the last pass. Reproducible under ``torch.manual_seed``
    (or the given ``generator``).
    """
    shape = torch.Size(shape)
    device = torch.device(device)
    n = shape.numel()
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    if device.type == "cpu":
        if generator is None and torch.compiler.is_compiling():
            x = _compiled_cpu_gumbel(_DRAW_ORDER, n, work, float(scale)).view(shape)
        else:
            x = _cpu_gumbel(n, work, scale, generator).view(shape)
    else:
        x = torch.empty(shape, dtype=work, device=device).exponential_(generator=generator)
        x.clamp_(min=torch.finfo(work).tiny).log_().mul_(-scale)  # scale * G = -scale * log E
    return x if work == dtype else x.to(dtype)


class _StraightThroughOneHot(torch.autograd.Function):
    """Forward: the one-hot of ``index`` along ``dim`` (exact zeros and ones); backward: identity to ``soft``."""

    @staticmethod
    def forward(ctx, soft, index, dim):
        return torch.zeros_like(soft).scatter_(dim, index, 1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def straight_through_one_hot(soft: torch.Tensor, index: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Straight-through one-hot: value ``one_hot(index)``, gradient of ``soft`` (Jang et al., 2017).

    ``index`` has ``soft``'s shape with size 1 along ``dim`` (``argmax(..., keepdim=True)``).
    """
    return _StraightThroughOneHot.apply(soft, index, dim)


def gumbel_softmax(
    logits: torch.Tensor,
    tau: float,
    *,
    mask: torch.Tensor | None = None,
    hard: bool = False,
    sample: bool = True,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Gumbel-softmax over the last axis: :math:`\mathrm{softmax}((\ell + G)/\tau)` with masking first.

    :param logits: any shape ``(..., K)``; not modified.
    :param tau: temperature :math:`\tau > 0`.
    :param mask: bool, broadcastable to ``logits``, True = excluded (weight exactly 0). Every row
        must keep at least one entry.
    :param hard: straight-through one-hot samples (forward one-hot, backward soft).
    :param sample: False gives the noise-free :math:`\mathrm{softmax}(\ell/\tau)` (both modes).
    :param noise: the Gumbel noise :math:`G` to use (shape of ``logits``), e.g. to reproduce a sample
        in a test; drawn with :func:`gumbel_noise` when None.
    :returns: a tensor of ``logits``' shape whose rows sum to 1 over the entries that are not masked.
    """
    tau = _check_tau(tau)
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    if not sample:
        return torch.softmax(logits / tau, dim=-1)
    if noise is None:
        noise = gumbel_noise(logits.shape, dtype=logits.dtype, device=logits.device, generator=generator)
    elif noise.shape != logits.shape:
        raise ValueError(f"noise must have the shape of logits {tuple(logits.shape)}, got {tuple(noise.shape)}")
    perturbed = logits + noise  # masked entries stay at -inf
    soft = torch.softmax(perturbed / tau, dim=-1)
    if not hard:
        return soft
    return straight_through_one_hot(soft, perturbed.argmax(dim=-1, keepdim=True), -1)


def fused_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    hard: bool,
    sample: bool,
    return_weights: bool,
) -> bool:
    """Whether :func:`gumbel_attention` with these arguments runs the fused FlexAttention kernel (the
    module docstring lists the conditions; the other paths run otherwise). Only a long sequence takes it, one
    whose (B, H, T, S) noise would be cut into query blocks: below that the noise tensor read by SDPA is the
    faster path (on an H200: sto 1.1–1.2× the softmax layer at T ≤ 512, the fused kernel 3.2× at T = 1024;
    docs/benchmarks.md)."""
    return (
        q.device.type == "cuda"
        and block_rows(*q.shape[:3], k.shape[-2], device=q.device) is not None
        and q.dtype in _FUSED_DTYPES
        and sample
        and not hard
        and not return_weights
        and (mask is None or mask.dim() == 2)
        and min(q.shape[-1], v.shape[-1]) >= _FUSED_MIN_HEAD_DIM
        and _FUSED_AVAILABLE
    )


def gumbel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tau: float,
    *,
    mask: torch.Tensor | None = None,
    hard: bool = False,
    sample: bool = True,
    return_weights: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Gumbel-softmax attention :math:`\hat A v`, :math:`\hat A = \mathrm{GumbelSoftmax}(q k^\top/\tau)`
    with padded keys at :math:`-\infty` before the noise (Pei et al. eqs. 9–11).

    # shape: q (B, H, T, Dh), k (B, H, S, Dh), v (B, H, S, Dv), mask (B, S) bool (True = padding) or
    # (B or 1, H or 1, T, S) bool (True = excluded for that query) -> out (B, H, T, Dv), weights (B, H, T, S) or None

    Where :func:`fused_path` holds (CUDA soft samples without weights, no mask or key padding) one
    FlexAttention kernel computes the noise inside (module docstring). Elsewhere soft samples without
    ``return_weights`` never form the attention matrix in Python: the temperature goes into
    ``scaled_dot_product_attention``'s ``scale`` and the noise :math:`G/\tau` (with :math:`-\infty` on
    padded keys) into its additive ``attn_mask``, so the only extra cost over softmax attention is drawing
    :math:`G`. Hard samples and ``return_weights`` use the explicit path; both non-fused paths consume the
    random stream identically, so the same seed gives the same sample.
    """
    tau = _check_tau(tau)
    if fused_path(q, k, v, mask=mask, hard=hard, sample=sample, return_weights=return_weights):
        return _fused_gumbel_attention(q, k, v, tau, mask, generator), None
    B, H, T = q.shape[:3]
    key_mask = excluded_keys(mask)  # shape: (B, 1, 1, S) or a per-query (B or 1, H or 1, T, S)
    rows = None if return_weights else block_rows(B, H, T, k.shape[-2], device=q.device)
    if rows is None:
        return _gumbel_attention(q, k, v, tau, key_mask, hard, sample, return_weights, generator)
    # a long sequence: blocks of queries, each with its own noise seed (variational/_blockwise.py)
    seeds = block_seeds(-(-T // rows), generator) if sample else None

    def block(qb, k, v, excluded, seed=None):
        g = None if seed is None else torch.Generator(device=qb.device).manual_seed(seed)
        return _gumbel_attention(qb, k, v, tau, excluded, hard, sample, False, g)[0]

    return blockwise(block, q, k, v, rows=rows, per_query=(key_mask,), seeds=seeds), None


def _gumbel_attention(q, k, v, tau, key_mask, hard, sample, return_weights, generator):
    """:func:`gumbel_attention` with the (B, H, T, S) matrix formed whole; ``key_mask`` as
    :func:`excluded_keys` gives it."""
    B, H, T = q.shape[:3]
    S = k.shape[-2]
    if not return_weights and not (hard and sample):
        if sample:
            # softmax(q kᵀ/τ + G/τ): the noise enters as an additive mask, the 1/τ as SDPA's scale
            bias = gumbel_noise((B, H, T, S), scale=1.0 / tau, dtype=q.dtype, device=q.device, generator=generator)
            if key_mask is not None:
                bias.masked_fill_(key_mask, float("-inf"))
        else:
            bias = None if key_mask is None else ~key_mask  # bool: True = attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0 / tau), None
    logits = q @ k.transpose(-1, -2)  # shape: (B, H, T, S)
    if key_mask is not None:
        logits.masked_fill_(key_mask, float("-inf"))  # in place: matmul's backward does not need its output
    if sample:
        logits.add_(gumbel_noise(logits.shape, dtype=q.dtype, device=q.device, generator=generator))
    weights = torch.softmax(logits.mul_(1.0 / tau), dim=-1)  # shape: (B, H, T, S)
    if hard and sample:
        weights = straight_through_one_hot(weights, logits.argmax(dim=-1, keepdim=True), -1)
    return weights @ v, weights


def _fused_soft_attention(q, k, v, rows, columns, padding, inv_tau):
    r""":math:`\mathrm{softmax}((q k^\top + G)/\tau)\, v` by FlexAttention, padded keys at :math:`-\infty`,
    with :math:`G_{bhij}` = ``gumbel_from_words(rows[b, h, i], columns[j])`` computed in the kernel (the
    tables of :func:`~gpattn.attention._counter_noise.noise_tables`). Uncompiled it runs FlexAttention's eager
    reference (the tests' CPU check); :func:`_compiled_fused` is the kernel. ``inv_tau`` (:math:`1/\tau`:
    float32, or float64 for float64 scores) is a 0-dim tensor, so a new value does not recompile.

    # shape: q (B, H, T, D), k (B, H, S, D), v (B, H, S, Dv), rows (B, H, T) int64, columns (S,) int64,
    # padding (B, S) bool or None -> (B, H, T, Dv)"""

    def score_mod(score, b, h, i, j):
        noisy = (score + gumbel_from_words(rows[b, h, i], columns[j]).to(score.dtype)) * inv_tau
        return noisy if padding is None else torch.where(padding[b, j], float("-inf"), noisy)

    # scale 1: score_mod gets q·k and applies the 1/τ to the noisy logit itself
    return flex_attention(q, k, v, score_mod=score_mod, scale=1.0)


@functools.cache
def _compiled_fused():
    """:func:`_fused_soft_attention` under ``torch.compile`` (built on the first fused call; shapes become
    dynamic after a first change, as Dynamo does by default, so varying lengths do not recompile each time:
    checked on the CPU)."""
    return torch.compile(_fused_soft_attention, fullgraph=True)


@functools.cache
def _compiled_tables():
    """:func:`~gpattn.attention._counter_noise.noise_tables` under ``torch.compile``: a few fused kernels per
    forward instead of some two hundred small ones (the hash's integer steps run eagerly), whose launches
    alone would be of the order of a whole attention layer's time at short lengths on a GPU (an estimate)."""
    return torch.compile(noise_tables, fullgraph=True)


def _fused_gumbel_attention(q, k, v, tau, padding, generator):
    """The fused path of :func:`gumbel_attention`: one seed per forward (as :func:`block_seeds` draws it),
    its noise tables (B·H·T + S words), the compiled kernel; the backward is FlexAttention's, which
    recomputes the same noise from the same tables."""
    seed = block_seeds(1, generator)[0].to(q.device)
    rows, columns = _compiled_tables()(seed, *q.shape[:3], k.shape[-2])
    score_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # float32 in the kernel
    inv_tau = torch.tensor(1.0 / tau, dtype=score_dtype, device=q.device)
    with warnings.catch_warnings():  # Dynamo reads .grad of the (non-leaf) projected inputs while it traces
        warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
        return _compiled_fused()(q, k, v, rows, columns, padding, inv_tau)
