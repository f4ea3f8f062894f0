"""Loaders ``fashion_mnist``, ``imdb`` and ``cifar10`` on synthetic files in the official formats
(written by ``gpattn.experiments.data.fixtures_more``), read back here by independent parsers; offline errors;
downloads through file:// URLs. Debian's real Fashion-MNIST files are checked when installed."""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import pickle
import re
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gpattn.experiments.data import DataNotFoundError, dataset_options, list_datasets, load_dataset
from gpattn.experiments.data import cifar10 as cifar_module
from gpattn.experiments.data import fashion_mnist as fm_module
from gpattn.experiments.data import imdb as imdb_module
from gpattn.experiments.data.digits import CORRUPTIONS, corrupt
from gpattn.experiments.data.fashion_mnist import stratified_subsample
from gpattn.experiments.data.fixtures_more import (
    IMDB_TEST_ONLY_WORDS,
    make_cifar10_tar,
    make_cifar10c,
    make_fashion_mnist_idx,
    make_imdb_tar,
)

_SPEC_TOKEN = re.compile(r"[^\W_]+(?:'[^\W_]+)?|[^\w\s]|_")
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
HAS_DEBIAN = all((DEBIAN_DIR / n).is_file() for n in fm_module.FILES.values())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def val_size(labels, fraction: float) -> int:
    """Stratified split rule: round_half_up(n_c · fraction) per class."""
    counts = collections.Counter(np.asarray(labels).tolist()).values()
    return sum(int(np.floor(n * fraction + 0.5)) for n in counts)


def image_keys(x) -> collections.Counter:
    """Multiset of images, each as the bytes of its uint8 values (x in [0, 1] float or uint8)."""
    x = np.asarray(x)
    if x.dtype != np.uint8:
        x = np.rint(x * 255).astype(np.uint8)
    return collections.Counter(row.tobytes() for row in x.reshape(len(x), -1))


def archive_dir(parent: Path, name: str, filename: str, data: bytes) -> Path:
    """A new folder ``parent/name`` holding ``filename`` with ``data``; returns the folder."""
    d = parent / name
    d.mkdir()
    (d / filename).write_bytes(data)
    return d


def write_tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    """A gzip tar at ``path`` (its folder created) holding one regular file per (member name, content);
    returns the folder."""
    path.parent.mkdir()
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path.parent


# ----------------------------------------------------------------------------- independent readers
def parse_idx_gz(path: Path) -> np.ndarray:
    data = gzip.decompress(Path(path).read_bytes())
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data[4 + 4 * ndim :], dtype=np.uint8).reshape(shape)


def read_cifar_members(path: Path) -> dict[str, dict]:
    with tarfile.open(path, "r:gz") as archive:
        return {
            m.name.split("/")[-1]: pickle.load(archive.extractfile(m), encoding="bytes")
            for m in archive.getmembers()
            if m.isfile() and re.search(r"(data|test)_batch", m.name)
        }


def read_imdb_reviews(path: Path) -> dict[tuple[str, int], list[str]]:
    out = collections.defaultdict(list)
    with tarfile.open(path, "r:gz") as archive:
        for m in archive.getmembers():
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 4 and parts[2] in ("pos", "neg"):
                text = archive.extractfile(m).read().decode().replace("<br /><br />", " ")
                out[(parts[1], int(parts[2] == "pos"))].append(text)
    return out


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def fm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fashion")
    make_fashion_mnist_idx(d, n_train=200, n_test=100, seed=3)
    return d


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cifar")
    make_cifar10_tar(d, n_per_batch=30, n_test=50, seed=4)
    return d


@pytest.fixture(scope="module")
def cifar_c_dir(tmp_path_factory, cifar_dir):
    d = tmp_path_factory.mktemp("cifar_c")
    archive = (cifar_dir / "cifar-10-python.tar.gz").read_bytes()
    (d / "cifar-10-python.tar.gz").write_bytes(archive)
    test = read_cifar_members(d / "cifar-10-python.tar.gz")["test_batch"]
    make_cifar10c(d, test[b"data"].reshape(-1, 3, 32, 32), test[b"labels"], corruptions=("gaussian_noise", "fog"))
    return d


@pytest.fixture(scope="module")
def imdb_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("imdb")
    make_imdb_tar(d, n_train=40, n_test=25, n_unsup=7, seed=5)
    return d


def fm(data_dir, **options):
    return load_dataset("fashion_mnist", data_dir=data_dir, verify_checksum=False, debian_dir=None, **options)


# ----------------------------------------------------------------------------- registry, helpers
def test_registered_with_their_options():
    assert {"fashion_mnist", "imdb", "cifar10"} <= set(list_datasets())
    for name in ("fashion_mnist", "imdb", "cifar10"):
        opts = dataset_options(name)
        assert {"max_train", "max_val", "max_test", "val_fraction", "verify_checksum"} <= set(opts)
    assert dataset_options("imdb")["max_len"] == 256
    assert load_dataset.__module__ == "gpattn.experiments.data._bundle"
    with pytest.raises(ValueError, match="valid options"):
        load_dataset("imdb", data_dir="/nonexistent", max_lenn=3)


@pytest.mark.parametrize("max_n", [1, 7, 33, 99, 100, 150, None])
def test_stratified_subsample_sizes_and_shares(max_n):
    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1, 2, 5], [50, 30, 15, 5])
    idx = stratified_subsample(labels, max_n, np.random.default_rng(1))
    n = len(labels)
    want = n if max_n is None else min(max_n, n)
    assert len(idx) == want and len(set(idx.tolist())) == want and np.all(np.diff(idx) > 0)
    # independent largest-remainder allocation
    counts = {c: int((labels == c).sum()) for c in (0, 1, 2, 5)}
    if want < n:
        quota = {c: k * want / n for c, k in counts.items()}
        alloc = {c: int(np.floor(q)) for c, q in quota.items()}
        rest = sorted(counts, key=lambda c: (-(quota[c] - alloc[c]), c))
        for c in rest[: want - sum(alloc.values())]:
            alloc[c] += 1
    else:
        alloc = counts
    got = collections.Counter(labels[idx].tolist())
    assert {c: got.get(c, 0) for c in counts} == alloc
    del rng


# ----------------------------------------------------------------------------- Fashion-MNIST
def test_fashion_mnist_fixture_round_trip(fm_dir):
    bundle = fm(fm_dir, seed=0, max_shift=None)
    x_tr, y_tr = (
        parse_idx_gz(fm_dir / "train-images-idx3-ubyte.gz"),
        parse_idx_gz(fm_dir / "train-labels-idx1-ubyte.gz"),
    )
    x_te, y_te = parse_idx_gz(fm_dir / "t10k-images-idx3-ubyte.gz"), parse_idx_gz(fm_dir / "t10k-labels-idx1-ubyte.gz")
    assert bundle.kind == "image" and bundle.image_shape == (1, 28, 28) and bundle.num_classes == 8
    assert bundle.info["in_domain_classes"] == list(range(8)) and bundle.info["ood_classes"] == [8, 9]
    assert bundle.info["class_names"][0] == "T-shirt/top" and "Bag" not in bundle.info["class_names"]
    for key, split in bundle.splits.items():
        assert split.inputs.dtype == torch.float32 and tuple(split.inputs.shape[1:]) == (1, 28, 28), key
        assert float(split.inputs.min()) >= 0 and float(split.inputs.max()) <= 1
        assert split.mask is None
    # train + val = every in-domain official train image, each once, with its label
    in_tr = y_tr < 8
    pooled = torch.cat([bundle.splits["train"].inputs, bundle.splits["val"].inputs])
    assert image_keys(pooled.numpy()) == image_keys(x_tr[in_tr])
    lookup = {x.tobytes(): int(y) for x, y in zip(x_tr, y_tr)}
    for key in ("train", "val"):
        split = bundle.splits[key]
        got = [lookup[np.rint(x.numpy() * 255).astype(np.uint8).tobytes()] for x in split.inputs]
        assert got == split.labels.tolist()
    assert len(bundle.splits["val"]) == val_size(y_tr[in_tr], 0.1)
    # test = official in-domain test rows in order; ood = held-out test images with label -1
    rows = np.asarray(bundle.info["official_test_rows"])
    assert np.array_equal(rows, np.flatnonzero(y_te < 8))
    assert torch.equal(bundle.splits["test"].inputs, torch.from_numpy(x_te[rows][:, None].astype(np.float32) / 255))
    assert bundle.splits["test"].labels.tolist() == y_te[rows].tolist()
    ood = bundle.splits["ood"]
    assert image_keys(ood.inputs.numpy()) == image_keys(x_te[y_te >= 8]) and set(ood.labels.tolist()) == {-1}
    assert bundle.eval_splits == {"in_domain": "test", "shift": "shift", "ood": "ood"} and bundle.ood_splits == ("ood",)


def test_fashion_mnist_shift_reuses_digits_corruptions(fm_dir):
    bundle = fm(fm_dir, seed=2, max_shift=20, severities=(2, 5))
    test, shift = bundle.splits["test"], bundle.splits["shift"]
    pos = np.asarray(bundle.info["shift_test_positions"])
    assert len(pos) == 20 and len(shift) == 20 * len(CORRUPTIONS) * 2
    chunks = bundle.info["shift_chunks"]
    assert [(c["corruption"], c["severity"]) for c in chunks] == [(c, s) for c in CORRUPTIONS for s in (2, 5)]
    base = test.inputs[pos].numpy()
    for c in chunks:
        block = slice(c["start"], c["stop"])
        np.testing.assert_array_equal(shift.inputs[block].numpy(), corrupt(base, c["corruption"], c["severity"], 2))
        assert shift.labels[block].tolist() == test.labels[pos].tolist()
        assert set(shift.groups[block].tolist()) == {c["severity"]}
        assert set(bundle.info["shift_corruptions"][block]) == {c["corruption"]}
    # a blur leaves the total ink of a dark-background image nearly unchanged; noise changes pixels
    noise = chunks[0]
    assert float((shift.inputs[noise["start"] : noise["stop"]] - torch.from_numpy(base)).abs().mean()) > 0.01


def test_fashion_mnist_subsampling_options_and_seeds(fm_dir):
    a = fm(fm_dir, seed=0, max_train=40, max_val=8, max_test=24, max_ood=6, max_shift=5, ood_classes=(0,))
    assert {k: len(v) for k, v in a.splits.items()} == {"train": 40, "val": 8, "test": 24, "shift": 75, "ood": 6}
    assert a.num_classes == 9 and a.info["class_names"][0] == "Trouser"
    # balanced classes stay balanced (9 classes: 40 = 4·9 + 4 -> counts 4 or 5)
    counts = collections.Counter(a.splits["train"].labels.tolist())
    assert set(counts.values()) <= {4, 5} and len(counts) == 9
    b = fm(fm_dir, seed=0, max_train=40, max_val=8, max_test=24, max_ood=6, max_shift=5, ood_classes=(0,))
    c = fm(fm_dir, seed=1, max_train=40, max_val=8, max_test=24, max_ood=6, max_shift=5, ood_classes=(0,))
    for key in a.splits:
        assert torch.equal(a.splits[key].inputs, b.splits[key].inputs)
    assert not torch.equal(a.splits["train"].inputs, c.splits["train"].inputs)
    none = fm(fm_dir, seed=0, ood_classes=(), severities=())
    assert set(none.splits) == {"train", "val", "test"} and none.num_classes == 10 and none.ood_splits == ()
    for bad in ({"max_train": 0}, {"ood_classes": (3, 3)}, {"ood_classes": (10,)}, {"severities": (6,)}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            fm(fm_dir, **bad)
    with pytest.raises(ValueError, match="fewer than 2"):
        fm(fm_dir, ood_classes=tuple(range(9)))


def test_fashion_mnist_missing_files_name_url_path_and_debian(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("fashion_mnist", data_dir=tmp_path, debian_dir=str(tmp_path / "nothing"))
    message = str(err.value)
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in message
    assert fm_module.URL + "train-images-idx3-ubyte.gz" in message
    assert "dataset-fashion-mnist" in message and "--download" in message
    assert list(tmp_path.iterdir()) == []


def test_fashion_mnist_subfolder_and_uncompressed_lookups(fm_dir, tmp_path):
    sub = tmp_path / "fashion-mnist"
    sub.mkdir()
    for name in fm_module.FILES.values():
        (sub / name).write_bytes((fm_dir / name).read_bytes())
    a, b = fm(tmp_path, seed=0), fm(fm_dir, seed=0)
    assert torch.equal(a.splits["train"].inputs, b.splits["train"].inputs)
    raw = fm_module.read_idx(fm_dir / "t10k-labels-idx1-ubyte.gz")
    plain = tmp_path / "labels-idx1-ubyte"
    plain.write_bytes(gzip.decompress((fm_dir / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    assert np.array_equal(fm_module.read_idx(plain), raw)


def test_fashion_mnist_checksums_and_corrupt_files(fm_dir, tmp_path):
    with pytest.raises(ValueError, match="checksum mismatch for the content of"):
        load_dataset("fashion_mnist", data_dir=fm_dir, debian_dir=None)  # verify_checksum defaults to True
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in fm_module.FILES.values():
        (bad / name).write_bytes((fm_dir / name).read_bytes())
    images = bad / "train-images-idx3-ubyte.gz"
    data = images.read_bytes()
    images.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable gzip file"):
        fm(bad)
    images.write_bytes(gzip.compress(b"\x00\x00\x0d\x03" + b"\x00" * 20))  # float idx type
    with pytest.raises(ValueError, match="not an idx file of unsigned bytes"):
        fm(bad)
    images.write_bytes(gzip.compress(bytes([0, 0, 8, 3]) + struct.pack(">3I", 200, 28, 28) + b"\x00" * 100))
    with pytest.raises(ValueError, match=r"declares shape \(200, 28, 28\)"):
        fm(bad)
    images.write_bytes(gzip.compress(bytes([0, 0, 8, 3]) + struct.pack(">3I", 199, 28, 28) + b"\x00" * 199 * 784))
    with pytest.raises(ValueError, match="expected 199 labels"):
        fm(bad)


def test_fashion_mnist_download_path_end_to_end(fm_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(fm_module, "URL", fm_dir.as_uri() + "/")
    monkeypatch.setattr(fm_module, "GZ_SHA256", {k: sha256_of(fm_dir / n) for k, n in fm_module.FILES.items()})
    payload = {
        k: hashlib.sha256(gzip.decompress((fm_dir / n).read_bytes())).hexdigest() for k, n in fm_module.FILES.items()
    }
    monkeypatch.setattr(fm_module, "PAYLOAD_SHA256", payload)
    target = tmp_path / "dl"
    bundle = load_dataset("fashion_mnist", data_dir=target, download=True, debian_dir=None)
    assert sorted(p.name for p in target.iterdir()) == sorted(fm_module.FILES.values())
    assert bundle.info["checksum_verified"] and len(bundle.splits["test"]) == 80
    monkeypatch.setattr(fm_module, "GZ_SHA256", {k: "0" * 64 for k in fm_module.FILES})
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_dataset("fashion_mnist", data_dir=tmp_path / "dl2", download=True, debian_dir=None)


@pytest.mark.skipif(not HAS_DEBIAN, reason="Debian package dataset-fashion-mnist is not installed")
def test_debian_files_are_the_official_content():
    """Debian's gzip headers lack the stored file name and carry the package date. Writing back the
    name and the original time stamp must give the official files: the MD5 sums of the project's
    README (shipped in the package) and the SHA-256 the loader checks downloads against."""
    official_md5 = {
        "train_images": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train_labels": "25c81989df183df01b3e8a0aad5dffbe",
        "test_images": "bef4ecab320f06d8554ea6380940ec79",
        "test_labels": "bb300cfdad3c16e7a12a480ee83cd310",
    }
    mtime = {"train": 1504176606, "test": 1504176627}
    for key, name in fm_module.FILES.items():
        data = (DEBIAN_DIR / name).read_bytes()
        assert data[:4] == b"\x1f\x8b\x08\x00"  # gzip, deflate, no flags (no stored name)
        stored = name.removesuffix(".gz").encode() + b"\x00"
        header = data[:3] + bytes([0x08]) + struct.pack("<I", mtime[key.split("_")[0]]) + data[8:10]
        rebuilt = header + stored + data[10:]
        assert hashlib.md5(rebuilt).hexdigest() == official_md5[key]
        assert hashlib.sha256(rebuilt).hexdigest() == fm_module.GZ_SHA256[key]
        assert hashlib.sha256(gzip.decompress(data)).hexdigest() == fm_module.PAYLOAD_SHA256[key]


@pytest.mark.skipif(not HAS_DEBIAN, reason="Debian package dataset-fashion-mnist is not installed")
def test_debian_files_load_with_checksums(tmp_path):
    bundle = load_dataset("fashion_mnist", data_dir=tmp_path, max_train=300, max_val=50, max_test=80, max_shift=4)
    assert bundle.info["checksum_verified"] and bundle.info["raw_sizes"] == {"train": 60000, "test": 10000}
    assert all(str(DEBIAN_DIR) in p for p in bundle.info["source"].values())
    assert {k: len(v) for k, v in bundle.splits.items()} == {
        "train": 300,
        "val": 50,
        "test": 80,
        "shift": 60,
        "ood": 2000,
    }
    labels = parse_idx_gz(DEBIAN_DIR / "t10k-labels-idx1-ubyte.gz")
    assert collections.Counter(labels.tolist()) == {c: 1000 for c in range(10)}  # the balanced official test set
    assert collections.Counter(bundle.splits["test"].labels.tolist()) == {c: 10 for c in range(8)}


# ----------------------------------------------------------------------------- CIFAR-10
def cifar(data_dir, **options):
    return load_dataset("cifar10", data_dir=data_dir, verify_checksum=False, **options)


def test_cifar10_fixture_round_trip_and_channel_layout(cifar_dir):
    bundle = cifar(cifar_dir, seed=0, max_shift=None)
    members = read_cifar_members(cifar_dir / "cifar-10-python.tar.gz")
    train_x = np.concatenate([members[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    train_y = np.concatenate([members[f"data_batch_{i}"][b"labels"] for i in range(1, 6)])
    test_x, test_y = members["test_batch"][b"data"], np.asarray(members["test_batch"][b"labels"])
    assert bundle.image_shape == (3, 32, 32) and bundle.num_classes == 10 and bundle.ood_splits == ()
    assert bundle.info["label_names"][0] == "airplane" and bundle.info["shift_source"] == "synthetic"
    pooled = torch.cat([bundle.splits["train"].inputs, bundle.splits["val"].inputs])
    assert image_keys(pooled.numpy()) == image_keys(train_x)
    n_val = val_size(train_y, 0.1)  # 15 per class -> round_half_up(1.5) = 2 per class
    assert len(bundle.splits["val"]) == n_val == 20 and len(bundle.splits["train"]) == 150 - n_val
    test = bundle.splits["test"]
    assert test.labels.tolist() == test_y.tolist()
    # channel c of pixel (i, j) is byte c·1024 + 32·i + j of the row (CIFAR's documented layout)
    for n, (c, i, j) in enumerate([(0, 0, 0), (1, 5, 7), (2, 31, 30)]):
        assert test.inputs[n, c, i, j].item() == np.float32(test_x[n, c * 1024 + 32 * i + j]) / np.float32(255)
    assert bundle.info["sha256"] == sha256_of(cifar_dir / "cifar-10-python.tar.gz")
    assert len(bundle.splits["shift"]) == 50 * 15 and set(bundle.splits["shift"].groups.tolist()) == {1, 2, 3, 4, 5}


def test_cifar10c_shift_rows_and_ood_classes(cifar_c_dir):
    bundle = cifar(
        cifar_c_dir,
        seed=1,
        max_test=30,
        max_shift=12,
        ood_classes=(3, 7),
        shift_corruptions=("fog", "gaussian_noise"),
        severities=(1, 4),
    )
    assert bundle.info["shift_source"].startswith("CIFAR-10-C") and bundle.num_classes == 8
    test_x = read_cifar_members(cifar_c_dir / "cifar-10-python.tar.gz")["test_batch"][b"data"].reshape(-1, 3, 32, 32)
    test_y = np.asarray(read_cifar_members(cifar_c_dir / "cifar-10-python.tar.gz")["test_batch"][b"labels"])
    rows = np.asarray(bundle.info["official_test_rows"])[bundle.info["shift_test_positions"]]
    assert len(rows) == 12 and not np.isin(test_y[rows], (3, 7)).any()
    shift = bundle.splits["shift"]
    chunks = bundle.info["shift_chunks"]
    assert [(c["corruption"], c["severity"]) for c in chunks] == [
        ("fog", 1),
        ("fog", 4),
        ("gaussian_noise", 1),
        ("gaussian_noise", 4),
    ]
    offset = {"gaussian_noise": 0, "fog": 3}  # make_cifar10c: brightness 8·severity + 3·(file index)
    for c in chunks:
        want = np.clip(test_x[rows].astype(np.int64) + 8 * c["severity"] + offset[c["corruption"]], 0, 255) / 255
        got = shift.inputs[c["start"] : c["stop"]].double().numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
        assert set(shift.groups[c["start"] : c["stop"]].tolist()) == {c["severity"]}
    relabel = {c: i for i, c in enumerate(bundle.info["in_domain_classes"])}
    assert shift.labels[:12].tolist() == [relabel[int(y)] for y in test_y[rows]]
    ood = bundle.splits["ood"]
    assert set(ood.labels.tolist()) == {-1} and len(ood) == int(np.isin(test_y, (3, 7)).sum())
    assert image_keys(ood.inputs.numpy()) == image_keys(test_x[np.isin(test_y, (3, 7))])
    # forced synthetic shift ignores the CIFAR-10-C folder
    synthetic = cifar(cifar_c_dir, seed=1, shift_source="synthetic", shift_corruptions="gaussian_blur", max_shift=5)
    assert synthetic.info["shift_source"] == "synthetic" and len(synthetic.splits["shift"]) == 25


def test_cifar10c_errors(cifar_c_dir, cifar_dir, tmp_path):
    with pytest.raises(DataNotFoundError, match=re.escape(str(cifar_c_dir / "CIFAR-10-C" / "snow.npy"))):
        cifar(cifar_c_dir, shift_corruptions=("snow",))
    with pytest.raises(DataNotFoundError, match="zenodo"):
        cifar(cifar_c_dir)  # default: the 15 benchmark corruptions, the fixture has two
    with pytest.raises(ValueError, match="shift_corruptions"):
        cifar(cifar_c_dir, shift_corruptions=("pixel_dropout",))  # a synthetic name, not a CIFAR-10-C one
    with pytest.raises(ValueError, match="shift_source"):
        cifar(cifar_c_dir, shift_source="imagenet-c")
    with pytest.raises(DataNotFoundError, match="labels.npy"):
        cifar(cifar_dir, shift_source="cifar10c", shift_corruptions=("fog",))
    # CIFAR-10-C files that belong to another test set
    other = tmp_path / "other"
    other.mkdir()
    (other / "cifar-10-python.tar.gz").write_bytes((cifar_dir / "cifar-10-python.tar.gz").read_bytes())
    test = read_cifar_members(other / "cifar-10-python.tar.gz")["test_batch"]
    make_cifar10c(other, test[b"data"].reshape(-1, 3, 32, 32), (np.asarray(test[b"labels"]) + 1) % 10, ("fog",))
    with pytest.raises(ValueError, match="disagrees with the CIFAR-10 test labels"):
        cifar(other, shift_corruptions=("fog",))


def test_cifar10_archive_errors(cifar_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("GPATTN_DATA_DIR", raising=False)
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("cifar10", data_dir=tmp_path)
    assert cifar_module.CIFAR10_URL in str(err.value) and str(tmp_path / "cifar-10-python.tar.gz") in str(err.value)
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_dataset("cifar10", data_dir=cifar_dir)
    data = (cifar_dir / "cifar-10-python.tar.gz").read_bytes()
    for name, blob in (("truncated", data[: len(data) // 2]), ("garbage", b"not a tar archive" * 50)):
        with pytest.raises(ValueError, match="not a valid tar archive"):
            cifar(archive_dir(tmp_path, name, "cifar-10-python.tar.gz", blob))
    # a tar without the batches
    d = write_tar_gz(tmp_path / "wrong" / "cifar-10-python.tar.gz", {"cifar-10-batches-py/readme.html": b"hello"})
    with pytest.raises(ValueError, match="lacks member"):
        cifar(d)


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo should-never-run",))


def test_cifar10_pickles_cannot_call_arbitrary_globals(cifar_dir, tmp_path):
    d = tmp_path / "evil"
    d.mkdir()
    with (
        tarfile.open(cifar_dir / "cifar-10-python.tar.gz") as src,
        tarfile.open(d / "cifar-10-python.tar.gz", "w:gz") as dst,
    ):
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name.endswith("data_batch_3"):
                data = pickle.dumps({b"data": _Evil()}, protocol=2)
                m.size = len(data)
            dst.addfile(m, None if data is None else io.BytesIO(data))
    with pytest.raises(ValueError, match=r"global posix\.system is not allowed|global nt\.system is not allowed"):
        cifar(d)


def test_cifar10_download_path_end_to_end(cifar_dir, tmp_path, monkeypatch):
    archive = cifar_dir / "cifar-10-python.tar.gz"
    monkeypatch.setattr(cifar_module, "CIFAR10_URL", archive.as_uri())
    monkeypatch.setattr(cifar_module, "CIFAR10_SHA256", sha256_of(archive))
    bundle = load_dataset("cifar10", data_dir=tmp_path / "dl", download=True, severities=())
    assert (tmp_path / "dl" / "cifar-10-python.tar.gz").read_bytes() == archive.read_bytes()
    assert bundle.info["checksum_verified"] and set(bundle.splits) == {"train", "val", "test"}


# ----------------------------------------------------------------------------- IMDB
def imdb(data_dir, **options):
    return load_dataset("imdb", data_dir=data_dir, verify_checksum=False, **options)


def test_imdb_fixture_texts_labels_and_train_only_vocab(imdb_dir):
    bundle = imdb(imdb_dir, seed=0, max_len=None, max_vocab_size=None)
    reviews = read_imdb_reviews(imdb_dir / "aclImdb_v1.tar.gz")
    assert bundle.kind == "text" and bundle.num_classes == 2 and bundle.eval_splits == {"in_domain": "test"}
    assert bundle.info["raw_sizes"] == {"train": 80, "test": 50}  # train/unsup is not read
    assert {k: len(v) for k, v in bundle.splits.items()} == {"train": 72, "val": 8, "test": 50}
    vocab = bundle.vocab
    assert vocab[:3] == ["<pad>", "<unk>", "<cls>"]
    assert not set(IMDB_TEST_ONLY_WORDS) & set(vocab) and "br" not in vocab
    index = {w: i for i, w in enumerate(vocab)}

    def encoded(text):
        return [index.get(t, 1) for t in _SPEC_TOKEN.findall(text.lower())]

    for key, folder in (("train", "train"), ("val", "train"), ("test", "test")):
        split = bundle.splits[key]
        expected = {label: collections.Counter(tuple(encoded(t)) for t in reviews[(folder, label)]) for label in (0, 1)}
        for ids, mask, y in zip(split.inputs, split.mask, split.labels.tolist()):
            row = tuple(ids[~mask].tolist())
            assert expected[y][row] > 0, f"{key}: a row does not match a {('neg', 'pos')[y]} review of {folder}"
        assert torch.equal(split.inputs == 0, split.mask)
    test_ids = bundle.splits["test"].inputs[~bundle.splits["test"].mask]
    assert int((test_ids == 1).sum()) > 0  # the test-only words became <unk>
    assert collections.Counter(bundle.splits["test"].labels.tolist()) == {0: 25, 1: 25}


def test_imdb_truncation_subsampling_and_seeds(imdb_dir):
    a = imdb(imdb_dir, seed=0, max_len=6, max_train=20, max_val=4, max_test=10, max_vocab_size=5)
    assert {k: len(v) for k, v in a.splits.items()} == {"train": 20, "val": 4, "test": 10}
    for split in a.splits.values():
        assert split.inputs.shape[1] == 6 and collections.Counter(split.labels.tolist())[0] == len(split) // 2
    full = imdb(imdb_dir, seed=0, max_len=None, max_train=20, max_val=4, max_test=10, max_vocab_size=5)
    lengths = (~full.splits["train"].mask).sum(1)
    assert len(a.vocab) == 3 + 5 and a.info["truncated"]["train"] == int((lengths > 6).sum()) > 0
    kept = torch.minimum(lengths, torch.tensor(6))
    assert torch.equal((~a.splits["train"].mask).sum(1), kept)
    assert torch.equal(a.splits["train"].inputs, full.splits["train"].inputs[:, :6])  # the first max_len tokens
    b = imdb(imdb_dir, seed=0, max_len=6, max_train=20, max_val=4, max_test=10, max_vocab_size=5)
    c = imdb(imdb_dir, seed=1, max_len=6, max_train=20, max_val=4, max_test=10, max_vocab_size=5)
    assert torch.equal(a.splits["train"].inputs, b.splits["train"].inputs)
    assert not torch.equal(a.splits["test"].inputs, c.splits["test"].inputs)
    with pytest.raises(ValueError, match="max_test"):
        imdb(imdb_dir, max_test=0)
    with pytest.raises(ValueError, match="val_fraction"):
        imdb(imdb_dir, val_fraction=1.5)


def test_imdb_errors(imdb_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("GPATTN_DATA_DIR", raising=False)
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("imdb", data_dir=tmp_path)
    assert imdb_module.IMDB_URL in str(err.value) and str(tmp_path / "aclImdb_v1.tar.gz") in str(err.value)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_dataset("imdb", data_dir=imdb_dir)
    data = (imdb_dir / "aclImdb_v1.tar.gz").read_bytes()
    for name, blob in (("truncated", data[: len(data) * 2 // 3]), ("garbage", b"\x1f\x8b" + b"x" * 500)):
        with pytest.raises(ValueError, match="not a valid tar archive"):
            imdb(archive_dir(tmp_path, name, "aclImdb_v1.tar.gz", blob))
    names = ("aclImdb/train/neg/1_2.txt", "aclImdb/test/neg/1_2.txt", "aclImdb/test/pos/1_9.txt")
    d = write_tar_gz(tmp_path / "no_pos" / "aclImdb_v1.tar.gz", dict.fromkeys(names, b"meh."))
    with pytest.raises(ValueError, match=r"aclImdb/train/\{neg,pos\}.*label\(s\) \[1\]"):
        imdb(d)


def test_imdb_download_path_end_to_end(imdb_dir, tmp_path, monkeypatch):
    archive = imdb_dir / "aclImdb_v1.tar.gz"
    monkeypatch.setattr(imdb_module, "IMDB_URL", archive.as_uri())
    monkeypatch.setattr(imdb_module, "IMDB_SHA256", sha256_of(archive))
    bundle = load_dataset("imdb", data_dir=tmp_path, download=True)
    assert bundle.info["checksum_verified"] and (tmp_path / "aclImdb_v1.tar.gz").read_bytes() == archive.read_bytes()
