"""Argument checks and the ``Split`` constructor shared by the image loaders (``digits``,
``fashion_mnist`` and, through :func:`gpattn.experiments.data.fashion_mnist.build_image_bundle`, ``cifar10``)."""

from __future__ import annotations

import numpy as np
import torch

from gpattn.experiments.data._bundle import Split

__all__ = ["check_classes", "check_severities", "image_split", "is_int"]


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def image_split(x: np.ndarray, y, groups=None) -> Split:
    """Images (N, C, H, W), uint8 (scaled by 1/255) or float32 already in [0, 1], as a Split."""
    if x.dtype == np.uint8:
        x = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32).div_(255.0)
    else:
        x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return Split(
        x,
        torch.from_numpy(np.asarray(y, dtype=np.int64)),
        None,
        None if groups is None else torch.from_numpy(np.asarray(groups, dtype=np.int64)),
    )


def check_classes(name: str, value, num_classes: int, what: str = "class indices") -> tuple[int, ...]:
    """``value`` (an int or a sequence of them) as a tuple of distinct ints in 0..num_classes-1;
    ``ValueError`` naming ``name`` otherwise (``what`` names the classes in the message)."""
    value = (value,) if is_int(value) else tuple(value)
    if not all(is_int(c) for c in value) or len(set(value)) != len(value) or not set(value) <= set(range(num_classes)):
        raise ValueError(f"{name} must be distinct {what} 0..{num_classes - 1}, got {value!r}")
    return tuple(int(c) for c in value)


def check_severities(severities) -> tuple[int, ...]:
    """``severities`` (an int or a sequence of them) as a tuple of distinct ints in 1..5."""
    severities = (severities,) if is_int(severities) else tuple(severities)
    if len(set(severities)) != len(severities) or not all(is_int(s) and 1 <= s <= 5 for s in severities):
        raise ValueError(f"severities must be distinct ints in 1..5, got {severities!r}")
    return tuple(int(s) for s in severities)
