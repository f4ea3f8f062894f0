"""Seeded, stratified splitting shared by the loaders."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["check_fraction", "stratified_split"]


def check_fraction(name: str, value, allow_zero: bool = True) -> float:
    """``value`` as a float in [0, 1) (or (0, 1)); ``ValueError`` naming ``name`` otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0
    if not ok or (not allow_zero and value == 0):
        low = "0 <=" if allow_zero else "0 <"
        raise ValueError(f"{name} must be a number with {low} {name} < 1, got {value!r}")
    return float(value)


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def stratified_split(labels, fractions: Sequence[float], seed: int) -> list[np.ndarray]:
    """Split indices 0..N-1 into ``[rest, part_1, ..., part_k]`` with part_j holding, in every class
    c of ``labels`` (N,), ``round_half_up(n_c * fractions[j])`` examples chosen at random (numpy
    generator seeded by ``seed``). If rounding would leave a class without a ``rest`` example, the
    largest part gives one back. Each returned index array is sorted ascending."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-d, got shape {labels.shape}")
    if sum(fractions) >= 1.0:
        raise ValueError(f"split fractions {tuple(fractions)} must sum to less than 1")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(len(fractions) + 1)]
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        counts = [_round_half_up(len(members) * f) for f in fractions]
        for _ in range(len(counts)):  # bounded: each pass gives back one example
            if len(members) - sum(counts) >= 1 or sum(counts) == 0:
                break
            counts[int(np.argmax(counts))] -= 1
        start = 0
        for j, n in enumerate(counts, start=1):
            parts[j].append(members[start : start + n])
            start += n
        parts[0].append(members[start:])
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts]
