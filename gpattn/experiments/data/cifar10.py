"""``cifar10``: CIFAR-10 (Krizhevsky, 2009), 32x32 colour images, and CIFAR-10-C as its shift split.

Read straight from the official python archive ``<data_dir>/cifar-10-python.tar.gz`` (streamed, no
extraction; SHA-256 checked by default). Its members ``cifar-10-batches-py/data_batch_1`` ..
``data_batch_5`` (50000 train images) and ``test_batch`` (10000) are Python 2 pickles of a dict with
``b"data"`` (10000, 3072) uint8 (1024 red, 1024 green, 1024 blue values per row, each a 32x32 image
in row-major order) and ``b"labels"`` (ints 0..9); ``batches.meta`` holds ``b"label_names"``. They
are read with ``encoding="bytes"`` through an unpickler that only resolves the few numpy names an
array needs (a pickle cannot run other code here).

Shift. CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019) is used when ``<data_dir>/CIFAR-10-C/`` holds
``labels.npy``: each ``<corruption>.npy`` is (50000, 32, 32, 3) uint8, the 10000 official test images
at severity 1, then 2, .., 5, and ``labels.npy`` the (50000,) labels. The shift split takes, for
every corruption and severity, the rows of the test images that are in our (possibly cut) test
split. Without CIFAR-10-C, the shift split uses the ``digits`` corruptions (in pixels).
"""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpattn.experiments.data._bundle import DataNotFoundError, DatasetBundle, missing_file_message, register_dataset
from gpattn.experiments.data._download import fetch_archive, open_tar
from gpattn.experiments.data.digits import CORRUPTIONS, SEVERITY_PARAMS
from gpattn.experiments.data.fashion_mnist import build_image_bundle, synthetic_shift

__all__ = [
    "CIFAR10C_CORRUPTIONS",
    "CIFAR10C_DIRNAME",
    "CIFAR10C_EXTRA_CORRUPTIONS",
    "CIFAR10C_URL",
    "CIFAR10_FILENAME",
    "CIFAR10_MEMBERS",
    "CIFAR10_SHA256",
    "CIFAR10_URL",
    "CLASS_NAMES",
    "load_cifar10",
    "read_cifar10",
]

#: where ``download=True`` fetches the CIFAR-10 python tarball
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
#: SHA-256 of that tarball (170,498,071 bytes), checked on every read
CIFAR10_SHA256 = "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"  # 170498071 bytes
#: the tarball's file name in the data folder
CIFAR10_FILENAME = "cifar-10-python.tar.gz"
_FOLDER = "cifar-10-batches-py"
#: the tarball's members read per split (training batches, test batch, meta)
CIFAR10_MEMBERS = {
    "train": tuple(f"{_FOLDER}/data_batch_{i}" for i in range(1, 6)),
    "test": (f"{_FOLDER}/test_batch",),
    "meta": (f"{_FOLDER}/batches.meta",),
}
#: the ten CIFAR-10 classes, in label order
CLASS_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
#: where CIFAR-10-C is published (read as the ``shift`` split when its ``*.npy`` files are present)
CIFAR10C_URL = "https://zenodo.org/records/2535967/files/CIFAR-10-C.tar"
#: the folder of CIFAR-10-C's ``*.npy`` files in the data folder
CIFAR10C_DIRNAME = "CIFAR-10-C"
#: the 15 corruptions of the CIFAR-10-C benchmark (the ``shift`` split)
CIFAR10C_CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)
#: the 4 extra corruptions the CIFAR-10-C archive also holds (not in the benchmark)
CIFAR10C_EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
SHIFT_SOURCES = ("auto", "cifar10c", "synthetic")


# ----------------------------------------------------------------------------- the archive
class _ArrayUnpickler(pickle.Unpickler):
    """Resolves only what a pickled numpy array of numbers (and a Python 3 protocol-2 bytes
    object) needs; any other global is an error, so the pickle cannot call arbitrary code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"): ("numpy", "ndarray"),
        ("numpy", "dtype"): ("numpy", "dtype"),
        ("_codecs", "encode"): ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        target = self._ALLOWED.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR-10 batch")
        if target[0] == "numpy._core.multiarray" and not hasattr(np, "_core"):  # numpy < 2
            target = ("numpy.core.multiarray", target[1])
        return super().find_class(*target)


def _unpickle(data: bytes, where: str) -> dict:
    try:
        obj = _ArrayUnpickler(io.BytesIO(data), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as err:
        raise ValueError(f"{where} is not a readable CIFAR-10 batch pickle ({err})") from err
    if not isinstance(obj, dict):
        raise ValueError(f"{where} is not a CIFAR-10 batch: expected a dict, got {type(obj).__name__}")
    return obj


def _batch_arrays(batch: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    data, labels = batch.get(b"data"), batch.get(b"labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = (data.dtype, data.shape) if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{where}: b'data' must be a (N, 3072) uint8 array, got {got}")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (data.shape[0],) or (len(labels) and (labels.min() < 0 or labels.max() > 9)):
        raise ValueError(f"{where}: b'labels' must hold {data.shape[0]} labels in 0..9, got shape {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def read_cifar10(path) -> dict:
    """{"train": (images (50000, 3, 32, 32) uint8, labels (50000,) int64), "test": (...),
    "label_names": [...]} from the archive at ``path``, streamed member by member."""
    wanted = {m for members in CIFAR10_MEMBERS.values() for m in members}
    found: dict[str, dict] = {}
    try:
        with open_tar(path) as archive:
            for member in archive:
                if member.name in wanted and member.isfile():
                    handle = archive.extractfile(member)
                    found[member.name] = _unpickle(handle.read(), f"{path}:{member.name}")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise ValueError(f"{path} is not a valid tar archive ({err}); delete it and download it again") from err
    missing = sorted(wanted - set(found))
    if missing:
        raise ValueError(f"{path} lacks member(s) {missing}; it is not the CIFAR-10 python archive")
    out = {}
    for part in ("train", "test"):
        arrays = [_batch_arrays(found[m], f"{path}:{m}") for m in CIFAR10_MEMBERS[part]]
        out[part] = (np.concatenate([a[0] for a in arrays]), np.concatenate([a[1] for a in arrays]))
    names = found[CIFAR10_MEMBERS["meta"][0]].get(b"label_names", [])
    out["label_names"] = [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names]
    return out


# ----------------------------------------------------------------------------- CIFAR-10-C
def _cifar10c_shift(folder: Path, corruptions: Sequence[str], y_test_official: np.ndarray):
    """A ``shift_fn`` for :func:`build_image_bundle` reading ``folder/<corruption>.npy``."""
    n_test = len(y_test_official)

    def load(name: str) -> np.ndarray:
        path = folder / f"{name}.npy"
        if not path.is_file():
            raise DataNotFoundError(
                missing_file_message(path, None, what="CIFAR-10-C file")
                + f" CIFAR-10-C is at {CIFAR10C_URL} (extract the tar into {folder.parent})."
            )
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise ValueError(f"{path} is not a readable .npy file ({err})") from err
        return array

    def shift_fn(test_rows: np.ndarray, y_test_in: np.ndarray, severities: Sequence[int]):
        labels = load("labels")
        if labels.shape != (5 * n_test,):
            raise ValueError(f"{folder / 'labels.npy'}: expected shape ({5 * n_test},), got {labels.shape}")
        xs, ys, names, chunks = [], [], [], []
        for corruption in corruptions:
            images = load(corruption)
            if images.shape != (5 * n_test, 32, 32, 3) or images.dtype != np.uint8:
                raise ValueError(
                    f"{folder / (corruption + '.npy')}: expected uint8 images of shape ({5 * n_test}, 32, 32, 3), "
                    f"got {images.dtype} {images.shape}"
                )
            for s in severities:
                rows = (s - 1) * n_test + test_rows
                if not np.array_equal(labels[rows].astype(np.int64), y_test_official[test_rows]):
                    raise ValueError(
                        f"{folder / 'labels.npy'} disagrees with the CIFAR-10 test labels at severity {s}; the "
                        f"CIFAR-10-C files do not belong to this test set"
                    )
                xs.append(np.ascontiguousarray(images[rows].transpose(0, 3, 1, 2)))  # NHWC -> NCHW
                ys.append(y_test_in)
                start = len(names)
                names.extend([corruption] * len(rows))
                chunks.append({"corruption": corruption, "severity": int(s), "start": start, "stop": len(names)})
        return np.concatenate(xs), np.concatenate(ys), names, chunks, {"shift_source": f"CIFAR-10-C ({folder})"}

    return shift_fn


def _synthetic_shift_fn(x_test: np.ndarray, corruptions: Sequence[str], seed: int):
    def shift_fn(test_rows, y_test_in, severities):
        x, names, chunks = synthetic_shift(x_test[test_rows], severities, seed, corruptions)
        extra = {
            "shift_source": "synthetic",
            "severity_params": {c: list(SEVERITY_PARAMS[c]) for c in corruptions},
        }
        return x, np.tile(y_test_in, len(chunks)), names, chunks, extra

    return shift_fn


# ----------------------------------------------------------------------------- the loader
@register_dataset("cifar10")
def load_cifar10(
    *,
    data_dir,
    download: bool,
    seed: int,
    ood_classes: Sequence[int] = (),
    val_fraction: float = 0.1,
    max_train: int | None = None,
    max_val: int | None = None,
    max_test: int | None = None,
    max_ood: int | None = None,
    max_shift: int | None = 200,
    severities: Sequence[int] = (1, 2, 3, 4, 5),
    shift_source: str = "auto",
    shift_corruptions: Sequence[str] | None = None,
    verify_checksum: bool = True,
) -> DatasetBundle:
    """CIFAR-10 as images ``(3, 32, 32)`` in [0, 1] (splits as
    :func:`gpattn.experiments.data.fashion_mnist.build_image_bundle`: val = 10 % of the official train
    set, test = the official test set).

    - ``ood_classes``: classes held out of training and evaluated as the ``ood`` split (official test
      images of those classes, labels -1); none by default (the 10-class benchmark).
    - ``shift_source``: ``"cifar10c"`` (``<data_dir>/CIFAR-10-C/``), ``"synthetic"`` (the ``digits``
      corruptions) or ``"auto"`` (CIFAR-10-C when ``labels.npy`` is there). ``shift_corruptions``
      picks corruptions (default: the 15 benchmark ones of CIFAR-10-C, or every synthetic one).
    - ``max_shift`` (default 200) test images are corrupted per (corruption, severity) block: the
      full CIFAR-10-C benchmark is 750000 images (9 GB as float32), pass ``None`` on a big machine.
    - ``max_*`` cut splits to stratified random subsets; ``verify_checksum=False`` skips the archive's
      SHA-256 (synthetic archives from :mod:`gpattn.experiments.data.fixtures_more`); a download is always checked.
    """
    if not isinstance(verify_checksum, bool):
        raise ValueError(f"verify_checksum must be a bool, got {verify_checksum!r}")
    if shift_source not in SHIFT_SOURCES:
        raise ValueError(f"shift_source must be one of {SHIFT_SOURCES}, got {shift_source!r}")
    data_dir = Path(data_dir)
    c_dir = data_dir / CIFAR10C_DIRNAME
    use_c = shift_source == "cifar10c" or (shift_source == "auto" and (c_dir / "labels.npy").is_file())
    valid = CIFAR10C_CORRUPTIONS + CIFAR10C_EXTRA_CORRUPTIONS if use_c else CORRUPTIONS
    if shift_corruptions is None:
        corruptions = CIFAR10C_CORRUPTIONS if use_c else CORRUPTIONS
    else:
        corruptions = (shift_corruptions,) if isinstance(shift_corruptions, str) else tuple(shift_corruptions)
        bad = [c for c in corruptions if c not in valid]
        if bad or not corruptions or len(set(corruptions)) != len(corruptions):
            source = "CIFAR-10-C" if use_c else "synthetic"
            raise ValueError(
                f"shift_corruptions must be distinct names among the {source} corruptions {valid}, got {corruptions!r}"
            )

    path = data_dir / CIFAR10_FILENAME
    provenance = fetch_archive(CIFAR10_URL, path, CIFAR10_SHA256, download, verify_checksum)
    raw = read_cifar10(path)
    x_train, y_train = raw["train"]
    x_test, y_test = raw["test"]
    shift_fn = _cifar10c_shift(c_dir, corruptions, y_test) if use_c else _synthetic_shift_fn(x_test, corruptions, seed)
    info = {
        **provenance,
        "raw_sizes": {"train": len(y_train), "test": len(y_test)},
        "label_names": raw["label_names"],
    }
    names = tuple(raw["label_names"]) if len(raw["label_names"]) == 10 else CLASS_NAMES
    return build_image_bundle(
        "cifar10",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        class_names=names,
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
        shift_fn=shift_fn,
    )
