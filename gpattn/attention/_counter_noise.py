r"""Counter-based Gumbel noise: :math:`G(\mathrm{seed}, b, h, i, j)`, a pure function of its counter
(docs/derivations.md §12, "Fused Gumbel noise on CUDA").

The fused STO-TRANS kernel (:mod:`gpattn.attention._gumbel`) cannot read a stored (B, H, T, S) noise
tensor without the memory it avoids, so it computes each entry's noise from the entry's indices inside
FlexAttention's ``score_mod``, in the forward and again in the backward. The same code runs eagerly on
tensors (the tests' dense reference) and traced by ``torch.compile`` into Triton: it uses only int64
``+``, ``*``, ``^``, ``&``, ``>>`` on values kept in :math:`[0, 2^{32})`, so every product stays below
:math:`2^{49}` (no signed overflow anywhere) and every right shift is a logical one.

Construction. A 32-bit state absorbs the words (seed low, seed high, b, h, i, j) in turn:
``state ← mix(state ^ mix(word + K))`` with ``mix`` the "lowbias32" integer finaliser (xor-shift,
multiply, xor-shift, multiply, xor-shift; both multipliers odd, so ``mix`` is a bijection of 32-bit
words). Mixing the word before the xor keeps neighbouring counters from giving shifted copies of one
sequence. The top 23 bits ``m`` of the final state give the uniform :math:`U = (2m + 1)\,2^{-24}`: the
centred grid of the CPU path's float32 noise, exact in float32 and never 0 or 1, so
:math:`G = -\log(-\log U) \in [-2.81, 16.6]` is always finite (a 24-bit grid
:math:`(2m+1)\,2^{-25}` is not exact in float32: its top point rounds to 1).
"""

from __future__ import annotations

import torch

__all__ = ["counter_gumbel", "counter_gumbel_grid"]

_MASK32 = 0xFFFFFFFF
_MIX_A, _MIX_B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers (odd: mix is invertible)
_WORD_OFFSET = 0x9E3779B9  # 2^32 / golden ratio: keeps a zero word from mixing to zero
_STATE0 = 0x6A09E667  # fractional bits of sqrt(2): the state before the first word


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x · c mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, by 16-bit halves of
    ``c`` so that no product reaches 2^63 (signed overflow would differ between backends)."""
    low = x * (c & 0xFFFF)  # < 2^48
    high = ((x * (c >> 16)) & 0xFFFF) << 16  # the high half's product, mod 2^32
    return (low + high) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of 32-bit words with strong avalanche (int64 values in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_A)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_B)
    return x ^ (x >> 16)


def _absorb(state: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """The state after one more counter word (int64, any shapes that broadcast)."""
    return _mix(state ^ _mix((word.to(torch.int64) + _WORD_OFFSET) & _MASK32))


def counter_gumbel(seed: torch.Tensor, b, h, i, j) -> torch.Tensor:
    r"""Gumbel(0, 1) noise :math:`G(\mathrm{seed}, b, h, i, j)` as float32, broadcast over the inputs.

    :param seed: int64 tensor (0-dim in a ``score_mod``) in :math:`[0, 2^{62})`; a new value needs no
        recompilation.
    :param b, h, i, j: integer tensors (int32 in a ``score_mod``), non-negative: batch, head, query
        and key index.
    """
    seed = seed.to(torch.int64)
    state = _absorb(torch.full_like(seed, _STATE0), seed & _MASK32)
    state = _absorb(state, (seed >> 32) & _MASK32)
    for word in (b, h, i, j):
        state = _absorb(state, word)
    top = state >> 9  # the top 23 bits
    uniform = (2 * top + 1).to(torch.float32) * 2.0**-24  # exact: (2m + 1) < 2^24
    return -torch.log(-torch.log(uniform))


def counter_gumbel_grid(seed: torch.Tensor, B: int, H: int, T: int, S: int, device=None) -> torch.Tensor:
    """:func:`counter_gumbel` on the whole (B, H, T, S) grid of counters (the dense reference of the
    fused kernel's noise; tests)."""
    device = seed.device if device is None else device
    b, h, i, j = (torch.arange(n, device=device) for n in (B, H, T, S))
    return counter_gumbel(seed.to(device), b[:, None, None, None], h[:, None, None], i[:, None], j)
