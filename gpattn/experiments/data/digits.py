"""``digits``: scikit-learn's 8x8 handwritten digits (ships with scikit-learn; no download).

1797 grey images, 17 levels (0..16) scaled to [0, 1], shape (1, 8, 8). Held-out classes make an OOD
split; the in-domain test images corrupted at five severities make a covariate-shift split in the
spirit of CIFAR-10-C (Hendrycks & Dietterich, 2019), written here in numpy for 8x8 images.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpattn.experiments.data._bundle import DatasetBundle, register_dataset
from gpattn.experiments.data._images import check_classes, check_severities, image_split, is_int
from gpattn.experiments.data._split import check_fraction, stratified_split

__all__ = ["CORRUPTIONS", "SEVERITY_PARAMS", "corrupt", "load_digits"]

#: corruption strength per severity 1..5 of the ``shift`` split: noise, the std of the additive Gaussian
#: (ImageNet-C's levels); blur, the std in pixels of the Gaussian kernel; dropout, the probability that a
#: pixel is set to 0 (ink lost)
SEVERITY_PARAMS = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "gaussian_blur": (0.5, 0.75, 1.0, 1.25, 1.5),
    "pixel_dropout": (0.1, 0.2, 0.3, 0.4, 0.5),
}
#: the corruptions of the ``shift`` split, in order
CORRUPTIONS = tuple(SEVERITY_PARAMS)


def _blur_matrix(size: int, sigma: float) -> np.ndarray:
    """A (size, size) matrix A with (A x)_i = sum_j g(i - j) x_j: a 1-d Gaussian convolution with
    zero padding (the digits' background is 0), g normalised over offsets -r..r, r = ceil(3 sigma)."""
    radius = int(np.ceil(3 * sigma))
    offsets = np.arange(-radius, radius + 1)
    weights = np.exp(-0.5 * (offsets / sigma) ** 2)
    weights /= weights.sum()
    diff = np.arange(size)[:, None] - np.arange(size)[None, :]  # i - j
    return np.where(np.abs(diff) <= radius, weights[np.clip(diff + radius, 0, 2 * radius)], 0.0)


def corrupt(images: np.ndarray, corruption: str, severity: int, seed: int) -> np.ndarray:
    """Corrupt ``images`` (N, C, H, W) in [0, 1] at ``severity`` 1..5; deterministic given ``seed``.

    The random draws depend on the seed and the corruption but not on the severity, so severities are
    nested: noise is one standard-normal field scaled by the severity's std, and the pixels dropped at
    a severity include those dropped at every lower one.
    """
    if corruption not in SEVERITY_PARAMS:
        raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {corruption!r}")
    if not is_int(severity) or severity not in (1, 2, 3, 4, 5):
        raise ValueError(f"severity must be an int in 1..5, got {severity!r}")
    strength = SEVERITY_PARAMS[corruption][severity - 1]
    rng = np.random.default_rng([seed, CORRUPTIONS.index(corruption)])
    x = images.astype(np.float64)
    if corruption == "gaussian_noise":
        out = x + strength * rng.standard_normal(x.shape)
    elif corruption == "gaussian_blur":
        a_h = _blur_matrix(x.shape[-2], strength)
        a_w = _blur_matrix(x.shape[-1], strength)
        out = a_h @ x @ a_w.T  # separable 2-d blur: A_h X A_w^T per image and channel
    else:
        out = np.where(rng.random(x.shape) < strength, 0.0, x)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


@register_dataset("digits")
def load_digits(
    *,
    data_dir,
    download: bool,
    seed: int,
    ood_classes: Sequence[int] = (8, 9),
    val_fraction: float = 0.15,
    test_fraction: float = 0.25,
    severities: Sequence[int] = (1, 2, 3, 4, 5),
    ood_val_fraction: float = 0.0,
) -> DatasetBundle:
    """Splits: train / val / test (stratified, seeded) of the in-domain classes relabelled 0..K-1 in
    order; ``shift`` = the test images under every corruption of :data:`CORRUPTIONS` at each of
    ``severities`` (labels kept, ``groups`` = severity; ``info["shift_corruptions"]`` names the
    corruption of each example, ``info["shift_chunks"]`` lists the contiguous blocks); the images of
    ``ood_classes``, labels -1, split (stratified by digit, seeded) into ``ood_val`` (``ood_val_fraction`` of
    them: the OOD validation split on which choices about OOD detection are made, never reported; the ``digits``
    preset takes 0.3) and ``ood`` (the rest, the evaluation split); the default 0 puts every one in ``ood``, the
    data set of the runs before the split existed. ``data_dir`` and ``download`` are unused (embedded data)."""
    from sklearn.datasets import load_digits as sklearn_digits

    raw = sklearn_digits()
    images = (raw.images.astype(np.float32) / 16.0)[:, None, :, :]  # shape: (1797, 1, 8, 8)
    targets = raw.target.astype(np.int64)

    held_out = check_classes("ood_classes", ood_classes, 10, what="digits")
    in_classes = [c for c in range(10) if c not in held_out]
    if len(in_classes) < 2:
        raise ValueError(f"ood_classes {held_out} leave fewer than 2 in-domain classes")
    sev = check_severities(severities)
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=False)
    test_fraction = check_fraction("test_fraction", test_fraction, allow_zero=False)
    ood_val_fraction = check_fraction("ood_val_fraction", ood_val_fraction)
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}")

    is_in = np.isin(targets, in_classes)
    x_in, y_in = images[is_in], np.searchsorted(in_classes, targets[is_in])  # relabel to 0..K-1 in order
    train_idx, val_idx, test_idx = stratified_split(y_in, (val_fraction, test_fraction), seed)

    splits = {
        name: image_split(x_in[idx], y_in[idx])
        for name, idx in (("train", train_idx), ("val", val_idx), ("test", test_idx))
    }
    eval_splits, ood_splits = {"in_domain": "test"}, ()
    info = {
        "source": "sklearn.datasets.load_digits",
        "class_names": [str(c) for c in in_classes],
        "in_domain_classes": in_classes,
        "ood_classes": list(held_out),
        "seed": seed,
    }

    if sev:
        x_test, y_test = x_in[test_idx], y_in[test_idx]
        chunks, xs, names = [], [], []
        for corruption in CORRUPTIONS:
            for s in sev:
                xs.append(corrupt(x_test, corruption, s, seed))
                start = len(names)
                names.extend([corruption] * len(x_test))
                chunks.append({"corruption": corruption, "severity": s, "start": start, "stop": len(names)})
        severity_of = np.repeat([c["severity"] for c in chunks], len(x_test))
        splits["shift"] = image_split(np.concatenate(xs), np.tile(y_test, len(chunks)), severity_of)
        info["shift_corruptions"] = names
        info["shift_chunks"] = chunks
        info["severity_params"] = {c: list(SEVERITY_PARAMS[c]) for c in CORRUPTIONS}
        eval_splits["shift"] = "shift"
    if held_out:
        x_ood = images[~is_in]
        ood_idx, ood_val_idx = stratified_split(targets[~is_in], (ood_val_fraction,), seed)
        splits["ood"] = image_split(x_ood[ood_idx], np.full(len(ood_idx), -1))
        if len(ood_val_idx):
            splits["ood_val"] = image_split(x_ood[ood_val_idx], np.full(len(ood_val_idx), -1))
        eval_splits["ood"] = "ood"
        ood_splits = ("ood",)
    info["sizes"] = {k: len(v) for k, v in splits.items()}

    return DatasetBundle(
        name="digits",
        kind="image",
        splits=splits,
        num_classes=len(in_classes),
        eval_splits=eval_splits,
        ood_splits=ood_splits,
        image_shape=(1, 8, 8),
        info=info,
    )
