"""Attention over query blocks, for long sequences: memory linear in T, forward and backward.

A variant whose attention forms a (B, H, T, S) matrix (kernel attention's Gram, the Gumbel noise of
STO-TRANS) computes it block by block of queries instead when it would be large: each block's
(B, H, b, S) piece is formed, used and dropped, and its backward recomputes it
(``torch.utils.checkpoint``), so no tensor of T·S entries per head lives at any time. The result is
the dense path's up to round-off for a deterministic block function; a random one (Gumbel noise) draws
each block's noise from its own seed, drawn once per forward before any block, so the recomputation in
backward sees the same noise (the samples have the dense path's distribution, not its random stream).
docs/derivations.md §12 states the choice.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["BLOCK_ELEMENTS", "DENSE_FACTOR", "DEVICE_BLOCK_ELEMENTS", "blockwise", "block_rows", "block_seeds"]

#: entries of one block's (B, H, b, S) piece on the CPU (2²¹: 8 MiB in float32)
BLOCK_ELEMENTS = 1 << 21
#: on the CPU a matrix of up to this many blocks (2²⁶ entries, 256 MiB in float32) is formed whole: one fused
#: call is the fastest path there (query blocks made sto 5× the softmax layer at T = 1024, B = 8, H = 4)
DENSE_FACTOR = 32
#: a block's entries on a GPU (2²⁶: 256 MiB in float32), where a block's work must be large to fill the
#: device; a matrix of up to 4 such blocks is formed whole
DEVICE_BLOCK_ELEMENTS = 1 << 26


def block_rows(
    B: int, H: int, T: int, S: int, block_elements: int | None = None, device: torch.device | None = None
) -> int | None:
    """Query rows per block for a (B, H, T, S) matrix, or None when it is small enough to form whole.

    ``block_elements`` None: :data:`BLOCK_ELEMENTS` per block and :data:`DENSE_FACTOR` blocks formed whole on the
    CPU, :data:`DEVICE_BLOCK_ELEMENTS` and 4 on another ``device`` (read at each call); given: that many per block,
    4 blocks whole."""
    dense = 4
    if block_elements is None:
        on_cpu = device is None or device.type == "cpu"
        block_elements = BLOCK_ELEMENTS if on_cpu else DEVICE_BLOCK_ELEMENTS
        dense = DENSE_FACTOR if on_cpu else 4
    if B * H * T * S <= dense * block_elements:
        return None
    return max(1, min(T, block_elements // max(1, B * H * S)))


def block_seeds(count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` seeds (a CPU int64 tensor) drawn from ``generator`` (torch's default CPU generator for
    None) before any block runs: block i's random numbers come from seed i, in forward and recompute."""
    if generator is not None and generator.device.type != "cpu":  # a device generator: one host read
        return torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).cpu()
    return torch.randint(0, 2**62, (count,), generator=generator)


def blockwise(fn, q: torch.Tensor, *args, rows: int, per_query=(), seeds=None) -> torch.Tensor:
    """``fn(q_block, *args, *per_query_blocks[, seed])`` over blocks of ``rows`` queries (axis −2 of ``q``),
    concatenated along that axis; each block checkpointed, so its backward recomputes its pieces.

    ``per_query``: tensors with a query axis at −2 of size T (or 1: broadcast, passed whole), sliced with
    ``q``; ``seeds``: one seed per block (:func:`block_seeds`), passed as a Python int last.
    # shape: q (..., T, d) -> fn's output (..., T, e)"""
    T = q.shape[-2]
    outputs = []
    for i, start in enumerate(range(0, T, rows)):
        stop = min(T, start + rows)
        pieces = [t if t is None or t.shape[-2] == 1 else t[..., start:stop, :] for t in per_query]
        extra = () if seeds is None else (int(seeds[i]),)
        block = q[..., start:stop, :]
        if torch.is_grad_enabled():
            outputs.append(checkpoint(fn, block, *args, *pieces, *extra, use_reentrant=False))
        else:
            outputs.append(fn(block, *args, *pieces, *extra))
    return torch.cat(outputs, dim=-2)
