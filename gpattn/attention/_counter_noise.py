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
sequence. The state before j depends on (seed, b, h, i) only and ``mix(j + K)`` on j only: the fused
kernel reads them from a (B, H, T) table (:func:`row_states`) and an (S,) table (:func:`column_words`),
computed once per forward, and does only the last step per entry (:func:`gumbel_from_words`). Written as
one expression in ``score_mod``, the whole chain kept Inductor compiling for over ten minutes and past
17 GB on the CPU (it appears to inline each intermediate once per use); with the tables it takes seconds.
The top 23 bits ``m`` of the final state give the uniform :math:`U = (2m + 1)\,2^{-24}`: the centred
grid of the CPU path's float32 noise, exact in float32 and never 0 or 1, so
:math:`G = -\log(-\log U) \in [-2.81, 16.6]` is always finite (a 24-bit grid :math:`(2m+1)\,2^{-25}` is
not exact in float32: its top point rounds to 1).
"""

from __future__ import annotations

import torch

__all__ = ["column_words", "counter_gumbel", "counter_gumbel_grid", "gumbel_from_words", "noise_tables", "row_states"]

_MASK32 = 0xFFFFFFFF
_MIX_A, _MIX_B = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers (odd: mix is invertible)
# keeps a zero word from mixing to zero; below 2^31 (Triton types a bare integer literal beside an int32 index as
# int32: 0x9E3779B9 failed to compile on CUDA), with room for counters up to 1.5e9
_WORD_OFFSET = 0x2545F491
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
    return _mix(state ^ column_words(word))


def column_words(j: torch.Tensor) -> torch.Tensor:
    """A counter word as the state absorbs it, ``mix(j + K)`` (int64; the key index's half of the last step)."""
    return _mix((j.to(torch.int64) + _WORD_OFFSET) & _MASK32)


def row_states(seed: torch.Tensor, b, h, i) -> torch.Tensor:
    """The state after (seed low, seed high, b, h, i): int64 in [0, 2^32), broadcast over the inputs."""
    seed = seed.to(torch.int64)
    state = _absorb(torch.full_like(seed, _STATE0), seed & _MASK32)
    state = _absorb(state, (seed >> 32) & _MASK32)
    for word in (b, h, i):
        state = _absorb(state, word)
    return state


def gumbel_from_words(row_state: torch.Tensor, column_word: torch.Tensor) -> torch.Tensor:
    """The last step, ``mix(row_state ^ column_word)``, turned into Gumbel(0, 1) noise (float32): the whole
    per-entry work of the fused kernel, which reads the two words from a (B, H, T) and an (S,) table."""
    top = _mix(row_state ^ column_word) >> 9  # the top 23 bits
    uniform = (2 * top + 1).to(torch.float32) * 2.0**-24  # exact: (2m + 1) < 2^24
    return -torch.log(-torch.log(uniform))


def counter_gumbel(seed: torch.Tensor, b, h, i, j) -> torch.Tensor:
    r"""Gumbel(0, 1) noise :math:`G(\mathrm{seed}, b, h, i, j)` as float32, broadcast over the inputs.

    :param seed: int64 tensor in :math:`[0, 2^{62})`.
    :param b: batch index (a non-negative integer tensor; so are h, i and j).
    :param h: head index.
    :param i: query index.
    :param j: key index.
    """
    return gumbel_from_words(row_states(seed, b, h, i), column_words(j))


def noise_tables(seed: torch.Tensor, B: int, H: int, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, H, T) row states and the (S,) key words of the (B, H, T, S) grid of counters (int64, on
    ``seed``'s device): entry (b, h, i, j)'s noise is ``gumbel_from_words(rows[b, h, i], columns[j])``."""
    b, h, i, j = (torch.arange(n, device=seed.device) for n in (B, H, T, S))
    return row_states(seed, b[:, None, None], h[:, None], i), column_words(j)


def counter_gumbel_grid(seed: torch.Tensor, B: int, H: int, T: int, S: int) -> torch.Tensor:
    """:func:`counter_gumbel` on the whole (B, H, T, S) grid of counters, on ``seed``'s device (the dense
    reference of the fused kernel's noise; tests)."""
    rows, columns = noise_tables(seed, B, H, T, S)
    return gumbel_from_words(rows[..., None], columns)
