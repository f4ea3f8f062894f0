"""Small synthetic files in the exact formats of ``fashion_mnist``, ``imdb`` and ``cifar10``.

- :func:`make_fashion_mnist_idx`: the four gzip-compressed idx files under their official names.
- :func:`make_imdb_tar`: an ``aclImdb_v1.tar.gz`` laid out like the official one (``aclImdb/{train,
  test}/{pos,neg}/<id>_<rating>.txt``, ``train/unsup``, README, vocabulary and feature files), with
  ``<br />`` line breaks in the reviews, members in a shuffled order; the test reviews use a few
  words that never occur in train (:data:`IMDB_TEST_ONLY_WORDS`).
- :func:`make_cifar10_tar`: a ``cifar-10-python.tar.gz`` whose batches are pickles written opcode by
  opcode the way Python 2's cPickle wrote the official ones (byte-string keys, ``numpy.core``
  globals), so ``pickle.load(..., encoding="bytes")`` is exercised as on the real files.
- :func:`make_cifar10c`: ``CIFAR-10-C/<corruption>.npy`` and ``labels.npy`` for given test images.

Load them with ``load_dataset(name, data_dir=..., verify_checksum=False)``. Every writer is
deterministic given ``seed`` (archive bytes included: fixed time stamps).
"""

from __future__ import annotations

import gzip
import io
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpattn.experiments.data.cifar10 import CIFAR10_FILENAME, CIFAR10C_DIRNAME
from gpattn.experiments.data.cifar10 import CLASS_NAMES as CIFAR10_CLASS_NAMES
from gpattn.experiments.data.fashion_mnist import FILES as FASHION_FILES
from gpattn.experiments.data.imdb import IMDB_FILENAME

__all__ = [
    "IMDB_TEST_ONLY_WORDS",
    "cifar10c_corrupt",
    "make_cifar10_tar",
    "make_cifar10c",
    "make_fashion_mnist_idx",
    "make_imdb_tar",
    "py2_pickle",
]

_MTIME = 1504176606  # a fixed time stamp for gzip headers and tar members


def _check_count(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _class_images(rng: np.random.Generator, labels: np.ndarray, channels: int, size: int) -> np.ndarray:
    """uint8 (N, channels, size, size): class c lights a horizontal band at row ~ c and has its own
    colour mix, plus noise, so that the classes are learnable."""
    n = len(labels)
    x = rng.integers(0, 40, size=(n, channels, size, size)).astype(np.float64)
    rows = np.arange(size)
    for i, c in enumerate(labels):
        centre = (c + 0.5) * size / 10
        band = np.exp(-0.5 * ((rows - centre) / (size / 20)) ** 2)[:, None] * np.ones(size)[None, :]
        for ch in range(channels):
            weight = 0.5 + 0.5 * np.cos(c + 2.0 * ch)
            x[i, ch] += 200 * weight * band
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


# ----------------------------------------------------------------------------- Fashion-MNIST
def _idx_bytes(array: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _gzip_named(data: bytes, name: str) -> bytes:
    """gzip bytes whose header stores ``name`` and a fixed time stamp, as the official files do."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename=name, mode="wb", fileobj=buffer, mtime=_MTIME) as handle:
        handle.write(data)
    return buffer.getvalue()


def make_fashion_mnist_idx(directory, n_train: int = 120, n_test: int = 60, seed: int = 0) -> dict[str, Path]:
    """Write the four Fashion-MNIST idx files (gzip) into ``directory``; returns {key: path}.

    Labels cycle through 0..9 in a shuffled order (balanced classes); images are 28x28 uint8.
    """
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for part, n in (("train", n_train), ("test", n_test)):
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        arrays[f"{part}_images"] = _class_images(rng, labels, 1, 28)[:, 0]
        arrays[f"{part}_labels"] = labels
    paths = {}
    for key, name in FASHION_FILES.items():
        path = directory / name
        path.write_bytes(_gzip_named(_idx_bytes(arrays[key]), name.removesuffix(".gz")))
        paths[key] = path
    return paths


# ----------------------------------------------------------------------------- IMDB
_POSITIVE = ("wonderful", "brilliant", "moving", "superb", "delightful", "great", "touching")
_NEGATIVE = ("awful", "boring", "dreadful", "tedious", "terrible", "bad", "clumsy")
_NEUTRAL = ("film", "movie", "plot", "actors", "director", "story", "scene", "ending", "music", "script")
#: words that occur only in the synthetic IMDB fixture's test split
IMDB_TEST_ONLY_WORDS = ("zeitgeist", "quixotic", "marzipan")
_IMDB_README = """Large Movie Review Dataset v1.0 (synthetic test fixture, gpattn.experiments.data.fixtures_more)

Same layout as the official aclImdb_v1.tar.gz: [[train/, test/]] x [[pos/, neg/]] with files
<id>_<rating>.txt, plus train/unsup/ (unlabelled, rating 0) and bag-of-words feature files.
"""


def _review(rng: np.random.Generator, label: int, special: str | None) -> str:
    mood = _POSITIVE if label else _NEGATIVE
    sentences = []
    for _ in range(int(rng.integers(1, 5))):
        words = [str(rng.choice(_NEUTRAL)), "was", str(rng.choice(mood))]
        if rng.random() < 0.3:
            words += ["and", "the", str(rng.choice(_NEUTRAL)), "felt", str(rng.choice(_POSITIVE + _NEGATIVE))]
        if special is not None and rng.random() < 0.5:
            words += ["with", special]
        sentences.append("The " + " ".join(words) + ("!" if rng.random() < 0.3 else "."))
    return "<br /><br />".join(sentences)


def _tar_add(archive: tarfile.TarFile, name: str, data: bytes | None) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = _MTIME
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        archive.addfile(info)
    else:
        info.size, info.mode = len(data), 0o644
        archive.addfile(info, io.BytesIO(data))


def make_imdb_tar(path, n_train: int = 40, n_test: int = 20, n_unsup: int = 6, seed: int = 0) -> Path:
    """Write a synthetic ``aclImdb_v1.tar.gz`` and return its path (``path`` is the file name, or a
    directory in which it is named ``aclImdb_v1.tar.gz``). ``n_train`` and ``n_test`` reviews per
    label (pos / neg), ``n_unsup`` unlabelled ones. Positive ratings are 7..10, negative 1..4."""
    _check_count("n_train", n_train)
    _check_count("n_test", n_test)
    _check_count("n_unsup", n_unsup, low=0)
    path = Path(path)
    if not path.name.endswith(".tar.gz"):
        path = path / IMDB_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files: list[tuple[str, bytes]] = []
    for split, n in (("train", n_train), ("test", n_test)):
        for folder, label in (("neg", 0), ("pos", 1)):
            ids = rng.permutation(5 * n)[:n]  # ids are not contiguous in the official archive either
            for review_id in ids:
                rating = int(rng.integers(7, 11)) if label else int(rng.integers(1, 5))
                special = str(rng.choice(IMDB_TEST_ONLY_WORDS)) if split == "test" else None
                files.append(
                    (f"aclImdb/{split}/{folder}/{review_id}_{rating}.txt", _review(rng, label, special).encode())
                )
    for review_id in range(n_unsup):
        files.append((f"aclImdb/train/unsup/{review_id}_0.txt", _review(rng, int(rng.integers(2)), None).encode()))
    order = rng.permutation(len(files))
    vocab = sorted(set(_POSITIVE + _NEGATIVE + _NEUTRAL))
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="aclImdb_v1.tar", mode="wb", fileobj=buffer, mtime=_MTIME) as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.GNU_FORMAT) as archive:
            for folder in ("aclImdb", "aclImdb/train", "aclImdb/test"):
                _tar_add(archive, folder + "/", None)
            _tar_add(archive, "aclImdb/README", _IMDB_README.encode())
            _tar_add(archive, "aclImdb/imdb.vocab", ("\n".join(vocab) + "\n").encode())
            for folder in ("aclImdb/train/pos", "aclImdb/train/neg", "aclImdb/train/unsup", "aclImdb/test/pos"):
                _tar_add(archive, folder + "/", None)
            _tar_add(archive, "aclImdb/test/neg/", None)
            for i in order:
                _tar_add(archive, *files[i])
            _tar_add(archive, "aclImdb/train/labeledBow.feat", b"9 0:9 1:1 2:4\n")
            _tar_add(archive, "aclImdb/test/urls_pos.txt", b"http://www.imdb.com/title/tt0000000/usercomments\n")
    path.write_bytes(buffer.getvalue())
    return path


# ----------------------------------------------------------------------------- CIFAR-10
def _py2_str(value: bytes) -> bytes:
    if len(value) < 256:
        return b"U" + bytes([len(value)]) + value  # SHORT_BINSTRING
    return b"T" + struct.pack("<i", len(value)) + value  # BINSTRING


def _py2_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])  # BININT1
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)  # BININT2
    return b"J" + struct.pack("<i", value)  # BININT


def _py2_value(value) -> bytes:
    if isinstance(value, bytes):
        return _py2_str(value)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return _py2_int(int(value))
    if isinstance(value, list):
        return b"](" + b"".join(_py2_value(v) for v in value) + b"e"  # EMPTY_LIST MARK ... APPENDS
    if isinstance(value, np.ndarray) and value.dtype == np.uint8:
        shape = b"(" + b"".join(_py2_int(s) for s in value.shape) + b"t"  # MARK ... TUPLE
        dtype = b"cnumpy\ndtype\n" + _py2_str(b"u1") + _py2_int(0) + _py2_int(1) + b"\x87R"  # dtype('u1', 0, 1)
        minus_one = b"J" + struct.pack("<i", -1)
        state = b"(" + _py2_int(3) + _py2_str(b"|") + b"NNN" + minus_one + minus_one + _py2_int(0) + b"t"
        dtype += state + b"b"  # BUILD with (3, '|', None, None, None, -1, -1, 0)
        array = b"cnumpy.core.multiarray\n_reconstruct\n" + b"cnumpy\nndarray\n" + _py2_int(0) + b"\x85"
        array += _py2_str(b"b") + b"\x87R"  # _reconstruct(ndarray, (0,), 'b')
        state = b"(" + _py2_int(1) + shape + dtype + b"\x89" + _py2_str(np.ascontiguousarray(value).tobytes()) + b"t"
        return array + state + b"b"  # BUILD with (1, shape, dtype, False, raw bytes)
    raise TypeError(f"py2_pickle cannot write {type(value).__name__}")


def py2_pickle(obj: dict) -> bytes:
    """Protocol-2 pickle of a dict with byte-string keys and values among bytes, ints, lists of those
    and uint8 numpy arrays, with the opcodes and globals Python 2's cPickle used for CIFAR-10."""
    items = b"".join(_py2_value(k) + _py2_value(v) for k, v in obj.items())
    return b"\x80\x02}(" + items + b"u."  # PROTO 2, EMPTY_DICT, MARK ... SETITEMS, STOP


def make_cifar10_tar(path, n_per_batch: int = 20, n_test: int = 40, seed: int = 0) -> Path:
    """Write a synthetic ``cifar-10-python.tar.gz`` (5 train batches of ``n_per_batch`` images and a
    test batch of ``n_test``) and return its path (``path``: file name or directory)."""
    _check_count("n_per_batch", n_per_batch)
    _check_count("n_test", n_test)
    path = Path(path)
    if not path.name.endswith(".tar.gz"):
        path = path / CIFAR10_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    members = []
    for i, (name, n) in enumerate([(f"data_batch_{b}", n_per_batch) for b in range(1, 6)] + [("test_batch", n_test)]):
        labels = rng.permutation(np.arange(n) % 10)
        images = _class_images(rng, labels, 3, 32).reshape(n, 3072)
        title = b"testing batch 1 of 1" if name == "test_batch" else f"training batch {i + 1} of 5".encode()
        batch = {
            b"batch_label": title,
            b"labels": [int(c) for c in labels],
            b"data": images,
            b"filenames": [f"{CIFAR10_CLASS_NAMES[c]}_s_{i:02d}{j:04d}.png".encode() for j, c in enumerate(labels)],
        }
        members.append((f"cifar-10-batches-py/{name}", py2_pickle(batch)))
    meta = {
        b"num_cases_per_batch": n_per_batch,
        b"label_names": [c.encode() for c in CIFAR10_CLASS_NAMES],
        b"num_vis": 3072,
    }
    members.insert(0, ("cifar-10-batches-py/batches.meta", py2_pickle(meta)))
    members.append(("cifar-10-batches-py/readme.html", b"<meta HTTP-EQUIV='REFRESH' content='0; url=...'>\n"))
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="cifar-10-python.tar", mode="wb", fileobj=buffer, mtime=_MTIME) as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.GNU_FORMAT) as archive:
            _tar_add(archive, "cifar-10-batches-py/", None)
            for name, data in members:
                _tar_add(archive, name, data)
    path.write_bytes(buffer.getvalue())
    return path


def cifar10c_corrupt(images_nhwc: np.ndarray, corruption_index: int, severity: int) -> np.ndarray:
    """The fixture's stand-in for a CIFAR-10-C corruption: a brightness offset of 8 · severity plus a
    corruption-specific constant ``3 · corruption_index``, clipped to 255 (uint8 NHWC in and out)."""
    shifted = images_nhwc.astype(np.int64) + 8 * severity + 3 * corruption_index
    return np.clip(shifted, 0, 255).astype(np.uint8)


def make_cifar10c(
    directory, test_images: np.ndarray, test_labels, corruptions: Sequence[str] = ("gaussian_noise", "fog")
) -> Path:
    """Write ``directory/CIFAR-10-C/`` for the given official-order test set: ``test_images`` uint8
    (N, 3, 32, 32), ``test_labels`` (N,). Each ``<corruption>.npy`` is (5·N, 32, 32, 3) uint8, rows
    ``(s-1)·N + i`` = :func:`cifar10c_corrupt` of test image i at severity s; ``labels.npy`` is the
    labels tiled 5 times (uint8). Returns the folder."""
    test_images = np.asarray(test_images)
    if test_images.dtype != np.uint8 or test_images.ndim != 4 or test_images.shape[1:] != (3, 32, 32):
        raise ValueError(
            f"test_images must be uint8 of shape (N, 3, 32, 32), got {test_images.dtype} {test_images.shape}"
        )
    folder = Path(directory) / CIFAR10C_DIRNAME
    folder.mkdir(parents=True, exist_ok=True)
    nhwc = test_images.transpose(0, 2, 3, 1)
    for k, corruption in enumerate(corruptions):
        stacked = np.concatenate([cifar10c_corrupt(nhwc, k, s) for s in range(1, 6)])
        np.save(folder / f"{corruption}.npy", stacked)
    np.save(folder / "labels.npy", np.tile(np.asarray(test_labels, dtype=np.uint8), 5))
    return folder
