"""``fashion_mnist``: Zalando's Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017), 28x28 grey images.

Read from the four official idx files, gzip-compressed::

    train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz  (60000 images)
    t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz   (10000 images)

looked up, file by file, in ``<data_dir>/``, ``<data_dir>/fashion-mnist/`` and then in Debian's
package directory ``/usr/share/datasets/fashion-mnist/`` (``apt-get install dataset-fashion-mnist``).
``download=True`` fetches a missing file from the official mirror into ``data_dir``.

Checksums. Debian's files are the official ones with the gzip header normalised by the packaging
(stored file name dropped, the package date as time stamp), so their gzip bytes and digests differ
from the official files while the compressed stream, hence the content, is the same. The check that
holds for both is on the *content*: by default (``verify_checksum=True``) the SHA-256 of each
decompressed idx file is compared with :data:`PAYLOAD_SHA256` (computed from the Debian package
``dataset-fashion-mnist 0.0~git20200523.55506a9-1``). A download is checked as it arrives against
the official gzip file's SHA-256, :data:`GZ_SHA256`; these digests were verified offline: putting
the file name and the original time stamp (2017-08-31 10:50:06 / 10:50:27 UTC) back into the Debian
files' gzip headers gives files with exactly the official sizes and the MD5 sums published in the
project's README, and their SHA-256 are the values below.

The idx format (LeCun et al.): big-endian header ``0x00 0x00 <type> <ndim>`` (type 0x08 = unsigned
byte), ``ndim`` uint32 sizes, then the values in C order.
"""

from __future__ import annotations

import gzip
import hashlib
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gpattn.experiments.data._bundle import DataNotFoundError, DatasetBundle, missing_file_message, register_dataset
from gpattn.experiments.data._download import fetch
from gpattn.experiments.data._images import check_classes, check_severities, image_split, is_int
from gpattn.experiments.data._split import check_fraction, stratified_split
from gpattn.experiments.data.digits import CORRUPTIONS, SEVERITY_PARAMS, corrupt

__all__ = [
    "CLASS_NAMES",
    "DEBIAN_DIR",
    "FILES",
    "GZ_SHA256",
    "PAYLOAD_SHA256",
    "URL",
    "build_image_bundle",
    "load_fashion_mnist",
    "read_idx",
    "stratified_subsample",
    "synthetic_shift",
]

#: the official mirror of the gzip idx files (``download=True``)
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
#: where Debian's ``dataset-fashion-mnist`` package puts the idx files (read first)
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
#: the idx file of each part (train/test images and labels)
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
#: SHA-256 of the decompressed idx files (identical for the official and the Debian files)
PAYLOAD_SHA256 = {
    "train_images": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",  # 47040016 bytes
    "train_labels": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",  # 60008 bytes
    "test_images": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",  # 7840016 bytes
    "test_labels": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",  # 10008 bytes
}
#: SHA-256 of the official gzip files as served by the mirror (checked on download)
GZ_SHA256 = {
    "train_images": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",  # 26421880 bytes
    "train_labels": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",  # 29515 bytes
    "test_images": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",  # 4422102 bytes
    "test_labels": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",  # 5148 bytes
}
#: the ten Fashion-MNIST classes, in label order
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_IDX_TYPES = {0x08: np.dtype(np.uint8)}


# ----------------------------------------------------------------------------- idx files
def read_idx(path, expected_sha256: str | None = None) -> np.ndarray:
    """The array stored in an idx file (``.gz`` or uncompressed); ``ValueError`` naming the file if it
    is not a readable idx file of unsigned bytes, or if ``expected_sha256`` (of the decompressed
    bytes) differs."""
    path = Path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path} is not a readable gzip file ({err}); delete it and fetch it again") from err
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256:
            raise ValueError(
                f"checksum mismatch for the content of {path}: expected sha256 {expected_sha256} of the "
                f"decompressed idx file, got {actual}. The file is corrupt or a different version; delete it "
                f"and fetch it again (or pass verify_checksum=False for your own files in this format)."
            )
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an idx file of unsigned bytes (header {data[:4].hex()!r})")
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim < 1 or len(data) < header:
        raise ValueError(f"{path}: idx header declares {ndim} dimensions but the file has {len(data)} bytes")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    size = int(np.prod(shape, dtype=np.int64))
    if len(data) - header != size:
        raise ValueError(f"{path}: idx header declares shape {shape} ({size} values) but holds {len(data) - header}")
    return np.frombuffer(data, dtype=_IDX_TYPES[data[2]], offset=header).reshape(shape)


def _find_file(name: str, data_dir: Path, debian_dir) -> Path | None:
    candidates = [data_dir / name, data_dir / "fashion-mnist" / name]
    if debian_dir is not None:
        candidates.append(Path(debian_dir) / name)
    return next((p for p in candidates if p.is_file()), None)


def _locate(key: str, data_dir: Path, debian_dir, download: bool) -> Path:
    name = FILES[key]
    found = _find_file(name, data_dir, debian_dir)
    if found is not None:
        return found
    if not download:
        message = missing_file_message(data_dir / name, URL + name, what="Fashion-MNIST file")
        debian = f" Debian/Ubuntu: `apt-get install dataset-fashion-mnist` puts the files in {DEBIAN_DIR}/."
        raise DataNotFoundError(message + debian)
    return fetch(URL + name, data_dir / name, GZ_SHA256[key], download=True)


# ----------------------------------------------------------------------------- shared image recipe
def _check_max(name: str, value) -> int | None:
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    return None if value is None else int(value)


def stratified_subsample(labels, max_n: int | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of at most ``max_n`` rows of ``labels`` (N,), every class keeping its share:
    class c gets ``floor(n_c · max_n / N)`` rows plus one for the classes with the largest remainders
    (ties to the smaller label) until exactly ``max_n`` are taken; rows within a class are chosen
    uniformly at random by ``rng``. ``max_n`` None or >= N keeps every row."""
    labels = np.asarray(labels)
    n = len(labels)
    if max_n is None or max_n >= n:
        return np.arange(n)
    classes, counts = np.unique(labels, return_counts=True)
    exact = counts * (max_n / n)
    take = np.floor(exact).astype(np.int64)
    order = np.lexsort((classes, -(exact - take)))  # largest remainder first, then smaller label
    take[order[: max_n - int(take.sum())]] += 1
    picked = [rng.choice(np.flatnonzero(labels == c), size=k, replace=False) for c, k in zip(classes, take)]
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)


def synthetic_shift(x_test: np.ndarray, severities: Sequence[int], seed: int, corruptions=CORRUPTIONS):
    """The shift split of ``digits`` for uint8 images: every corruption of
    :func:`gpattn.experiments.data.digits.corrupt` at every severity, blocks in (corruption, severity) order.
    Returns (images float32 in [0, 1] (K·N, C, H, W), corruption name per row, chunks)."""
    xs, names, chunks = [], [], []
    x01 = x_test.astype(np.float32) / 255.0
    for corruption in corruptions:
        for s in severities:
            xs.append(corrupt(x01, corruption, s, seed))
            start = len(names)
            names.extend([corruption] * len(x_test))
            chunks.append({"corruption": corruption, "severity": s, "start": start, "stop": len(names)})
    return np.concatenate(xs), names, chunks


def build_image_bundle(
    name: str,
    *,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    class_names: Sequence[str],
    ood_classes,
    severities,
    val_fraction: float,
    max_train: int | None,
    max_val: int | None,
    max_test: int | None,
    max_ood: int | None,
    max_shift: int | None,
    seed: int,
    info: dict,
    shift_fn: Callable | None = None,
) -> DatasetBundle:
    """The image recipe shared by ``fashion_mnist`` and ``cifar10`` (uint8 ``(N, C, H, W)`` inputs).

    - in-domain classes = all but ``ood_classes``, relabelled 0..K-1 in order;
    - val = a seeded stratified ``val_fraction`` of the official train set, train = the rest; then
      train, val and test are each cut to ``max_train`` / ``max_val`` / ``max_test`` rows by
      :func:`stratified_subsample` (independent seeded streams);
    - ``shift`` = the test images (a stratified subset of ``max_shift`` of them, the same for every
      block; ``info["shift_test_positions"]`` are their rows in the test split) under corruptions at
      ``severities`` (``groups`` = severity;
      ``info["shift_corruptions"]``, ``info["shift_chunks"]`` as in ``digits``): by default
      :func:`synthetic_shift`, or ``shift_fn(test_rows, y_test_in, severities) -> (images, labels,
      names, chunks, extra_info)`` where ``test_rows`` index the official test set;
    - ``ood`` = the official test images of ``ood_classes`` (labels -1), cut to ``max_ood``.
    """
    num_all = len(class_names)
    held_out = check_classes("ood_classes", ood_classes, num_all)
    in_classes = [c for c in range(num_all) if c not in held_out]
    if len(in_classes) < 2:
        raise ValueError(f"ood_classes {held_out} leave fewer than 2 in-domain classes")
    sev = check_severities(severities)
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=False)
    limits = {k: _check_max(k, v) for k, v in (("max_train", max_train), ("max_val", max_val))}
    limits.update({k: _check_max(k, v) for k, v in (("max_test", max_test), ("max_ood", max_ood))})
    limits["max_shift"] = _check_max("max_shift", max_shift)

    train_in = np.flatnonzero(np.isin(y_train, in_classes))
    y_pool = np.searchsorted(in_classes, y_train[train_in])  # relabel to 0..K-1 in order
    tr, va = stratified_split(y_pool, (val_fraction,), seed)
    tr = tr[stratified_subsample(y_pool[tr], limits["max_train"], np.random.default_rng([seed, 1]))]
    va = va[stratified_subsample(y_pool[va], limits["max_val"], np.random.default_rng([seed, 2]))]
    test_in = np.flatnonzero(np.isin(y_test, in_classes))
    y_test_in = np.searchsorted(in_classes, y_test[test_in])
    keep = stratified_subsample(y_test_in, limits["max_test"], np.random.default_rng([seed, 3]))
    test_rows, y_test_in = test_in[keep], y_test_in[keep]

    splits = {
        "train": image_split(x_train[train_in[tr]], y_pool[tr]),
        "val": image_split(x_train[train_in[va]], y_pool[va]),
        "test": image_split(x_test[test_rows], y_test_in),
    }
    eval_splits, ood_splits = {"in_domain": "test"}, ()
    info = {
        **info,
        "class_names": [class_names[c] for c in in_classes],
        "in_domain_classes": in_classes,
        "ood_classes": list(held_out),
        "seed": seed,
        "official_test_rows": test_rows.tolist(),
    }
    if sev:
        pos = stratified_subsample(y_test_in, limits["max_shift"], np.random.default_rng([seed, 5]))
        if shift_fn is None:
            x_shift, names, chunks = synthetic_shift(x_test[test_rows[pos]], sev, seed)
            y_shift = np.tile(y_test_in[pos], len(chunks))
            info["shift_source"] = "synthetic"
            info["severity_params"] = {c: list(SEVERITY_PARAMS[c]) for c in CORRUPTIONS}
        else:
            x_shift, y_shift, names, chunks, extra = shift_fn(test_rows[pos], y_test_in[pos], sev)
            info.update(extra)
        info["shift_test_positions"] = pos.tolist()
        groups = np.concatenate([np.full(c["stop"] - c["start"], c["severity"]) for c in chunks])
        splits["shift"] = image_split(x_shift, y_shift, groups)
        info["shift_corruptions"] = names
        info["shift_chunks"] = chunks
        eval_splits["shift"] = "shift"
    if held_out:
        ood_rows = np.flatnonzero(np.isin(y_test, held_out))
        ood_rows = ood_rows[stratified_subsample(y_test[ood_rows], limits["max_ood"], np.random.default_rng([seed, 4]))]
        splits["ood"] = image_split(x_test[ood_rows], np.full(len(ood_rows), -1))
        eval_splits["ood"] = "ood"
        ood_splits = ("ood",)
    info["sizes"] = {k: len(v) for k, v in splits.items()}
    return DatasetBundle(
        name=name,
        kind="image",
        splits=splits,
        num_classes=len(in_classes),
        eval_splits=eval_splits,
        ood_splits=ood_splits,
        image_shape=tuple(int(s) for s in x_train.shape[1:]),
        info=info,
    )


# ----------------------------------------------------------------------------- the loader
@register_dataset("fashion_mnist")
def load_fashion_mnist(
    *,
    data_dir,
    download: bool,
    seed: int,
    ood_classes: Sequence[int] = (8, 9),
    val_fraction: float = 0.1,
    max_train: int | None = None,
    max_val: int | None = None,
    max_test: int | None = None,
    max_ood: int | None = None,
    max_shift: int | None = 1000,
    severities: Sequence[int] = (1, 2, 3, 4, 5),
    debian_dir: str | None = DEBIAN_DIR,
    verify_checksum: bool = True,
) -> DatasetBundle:
    """Fashion-MNIST as images ``(1, 28, 28)`` in [0, 1] (see :func:`build_image_bundle` for the
    splits). Defaults: classes 8 (Bag) and 9 (Ankle boot) held out as the ``ood`` split (from the
    official test file), 10 % of the official train set as val, the official test set as test, the
    shift split as in ``digits`` (same corruptions and severity parameters, in pixels).

    ``max_train`` / ``max_val`` / ``max_test`` / ``max_ood`` cut each split to a stratified random
    subset (CPU presets); ``max_shift`` (default 1000) test images are corrupted, 15 blocks of them
    (``None``: every test image, 150000 float images); ``debian_dir=None`` skips Debian's directory;
    ``verify_checksum=False`` skips the content digests (for synthetic files from
    :mod:`gpattn.experiments.data.fixtures_more`).
    """
    if not isinstance(verify_checksum, bool):
        raise ValueError(f"verify_checksum must be a bool, got {verify_checksum!r}")
    data_dir = Path(data_dir)
    paths = {key: _locate(key, data_dir, debian_dir, download) for key in FILES}
    arrays = {key: read_idx(path, PAYLOAD_SHA256[key] if verify_checksum else None) for key, path in paths.items()}
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(f"{paths[f'{part}_images']}: expected images of shape (N, 28, 28), got {images.shape}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(
                f"{paths[f'{part}_labels']}: expected {len(images)} labels (one per image), got shape {labels.shape}"
            )
        if len(labels) and int(labels.max()) >= len(CLASS_NAMES):
            raise ValueError(f"{paths[f'{part}_labels']}: labels must be 0..9, got max {int(labels.max())}")
    info = {
        "source": {key: str(path) for key, path in paths.items()},
        "url": URL,
        "checksum_verified": verify_checksum,
        "raw_sizes": {"train": len(arrays["train_labels"]), "test": len(arrays["test_labels"])},
    }
    return build_image_bundle(
        "fashion_mnist",
        x_train=arrays["train_images"][:, None],
        y_train=arrays["train_labels"].astype(np.int64),
        x_test=arrays["test_images"][:, None],
        y_test=arrays["test_labels"].astype(np.int64),
        class_names=CLASS_NAMES,
        ood_classes=ood_classes,
        severities=severities,
        val_fraction=val_fraction,
        max_train=max_train,
        max_val=max_val,
        max_test=max_test,
        max_ood=max_ood,
        max_shift=max_shift,
        seed=seed,
        info=info,
    )
