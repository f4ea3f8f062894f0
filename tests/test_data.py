"""gpattn.experiments.data: loaders, tokeniser, splits, checksummed downloads and errors. No network: downloads
are exercised with file:// URLs to local temporary files."""

from __future__ import annotations

import hashlib
import math
import re
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import gpattn.experiments.data as gdata
from gpattn.experiments.data import DataNotFoundError, DatasetBundle, Split, list_datasets, load_dataset
from gpattn.experiments.data import cola as cola_module
from gpattn.experiments.data._download import fetch
from gpattn.experiments.data._text import build_vocab, encode, tokenize
from gpattn.experiments.data.fixtures import DEV_ONLY_WORDS, OOD_ONLY_WORDS, make_cola_zip, make_text_table

COLA_URL = "https://nyu-mll.github.io/CoLA/cola_public_1.1.zip"
COLA_SHA256 = "2cf856f46df11c143d38e0cf2f9f34ff2fdb088c521cd859f5c4b9581683278b"
_REAL_COLA_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "cola_public_1.1.zip",
    Path("/work/shared/data/cola_public_1.1.zip"),
)
REAL_COLA = next((p for p in _REAL_COLA_CANDIDATES if p.is_file()), None)
needs_real_cola = pytest.mark.skipif(
    REAL_COLA is None, reason="the official cola_public_1.1.zip is not on this machine (../shared/data/)"
)

# The tokenisation rule of the spec, written out here independently of the library.
_SPEC_TOKEN = re.compile(r"[^\W_]+(?:'[^\W_]+)?|[^\w\s]|_")


def spec_tokens(text: str) -> list[str]:
    return _SPEC_TOKEN.findall(text.lower())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def read_cola_member(path: Path, member: str) -> list[tuple[int, str]]:
    """(label, sentence) rows of a raw CoLA TSV, parsed here without the library."""
    text = zipfile.ZipFile(path).read(member).decode("utf-8")
    rows = []
    for line in text.split("\n"):
        if line:
            source, label, mark, sentence = line.split("\t")
            rows.append((int(label), sentence))
    return rows


def assert_mask_convention(split: Split, max_len: int | None = None):
    ids, mask = split.inputs, split.mask
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool and mask.shape == ids.shape
    assert torch.equal(ids == 0, mask), "padding id 0 must occur exactly where mask is True"
    real = (~mask).sum(1)
    assert int(real.min()) >= 1, "every row needs at least one real token"
    # real tokens first, then padding: the mask of every row is a suffix
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    assert torch.equal(mask, positions >= real.unsqueeze(1))
    assert int(real.max()) == ids.shape[1], "T must be the longest (capped) sequence of the split"
    if max_len is not None:
        assert ids.shape[1] <= max_len


# ----------------------------------------------------------------------------- API
def test_public_api_and_registry():
    assert gdata.__all__ == sorted(gdata.__all__)
    for name in ("DataNotFoundError", "DatasetBundle", "Split", "list_datasets", "load_dataset"):
        assert name in gdata.__all__
    names = list_datasets()
    assert names == sorted(names)
    assert {"cola", "digits", "text_table"} <= set(names)
    assert issubclass(DataNotFoundError, FileNotFoundError)


def test_unknown_dataset_and_option_list_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'mnist-xl'") as err:
        load_dataset("mnist-xl")
    for name in ("cola", "digits", "text_table"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="oood_classes") as err:
        load_dataset("digits", oood_classes=(9,))
    for option in ("ood_classes", "val_fraction", "test_fraction", "severities"):
        assert option in str(err.value)
    with pytest.raises(ValueError, match="requires option.*path"):
        load_dataset("text_table", data_dir=tmp_path)
    with pytest.raises(ValueError, match="seed"):
        load_dataset("digits", seed=-1)


def test_split_and_bundle_validate_shapes():
    ids = torch.zeros(3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="labels"):
        Split(ids, torch.zeros(3), None)  # float labels
    with pytest.raises(ValueError, match="N=2"):
        Split(ids, torch.zeros(2, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="mask"):
        Split(ids, torch.zeros(3, dtype=torch.int64), torch.zeros(3, 5, dtype=torch.bool))
    s = Split(ids, torch.arange(3), ids == 0, torch.arange(3))
    assert len(s) == 3 and len(s.subset(slice(0, 2))) == 2 and s.subset(torch.tensor([2])).labels.item() == 2
    with pytest.raises(ValueError, match="missing"):
        DatasetBundle("x", "text", {"train": s}, 2, {}, (), vocab=["<pad>"])
    with pytest.raises(ValueError, match="absent"):
        DatasetBundle("x", "text", {"train": s, "val": s, "test": s}, 2, {"ood": "ood"}, (), vocab=["<pad>"])


# ----------------------------------------------------------------------------- tokeniser
def test_tokenize_vocab_encode():
    assert tokenize("Don't stop, José! x_y") == ["don't", "stop", ",", "josé", "!", "x", "_", "y"]
    vocab = build_vocab([["b", "a", "b"], ["c", "a", "b"], ["<unk>"]], min_freq=1)
    assert vocab == ["<pad>", "<unk>", "<cls>", "b", "a", "c"]  # by count, ties alphabetical
    assert build_vocab([["b", "a", "b"], ["c", "a", "b"]], min_freq=2) == ["<pad>", "<unk>", "<cls>", "b", "a"]
    assert build_vocab([["b", "a", "b"], ["c"]], max_size=1) == ["<pad>", "<unk>", "<cls>", "b"]
    ids, mask = encode([["a", "zz", "b"], [], ["c", "c", "c", "c", "a"]], vocab, max_len=4)
    assert ids.tolist() == [[4, 1, 3, 0], [1, 0, 0, 0], [5, 5, 5, 5]]
    assert mask.tolist() == [[False, False, False, True], [False, True, True, True], [False] * 4]
    with pytest.raises(ValueError, match="max_len"):
        encode([["a"]], vocab, max_len=0)


# ----------------------------------------------------------------------------- digits
@pytest.fixture(scope="module")
def sk_digits():
    from sklearn.datasets import load_digits as sk_load

    raw = sk_load()
    return raw.images.astype(np.float64) / 16.0, raw.target


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def _pixel_key(x) -> bytes:
    return np.round(np.asarray(x, dtype=np.float64).reshape(-1) * 16).astype(np.int8).tobytes()


def test_digits_shapes_dtypes_range(digits):
    assert digits.kind == "image" and digits.image_shape == (1, 8, 8) and digits.num_classes == 8
    assert digits.vocab is None and digits.vocab_size is None
    assert digits.eval_splits == {"in_domain": "test", "shift": "shift", "ood": "ood"}
    assert digits.ood_splits == ("ood",)
    assert set(digits.splits) == {"train", "val", "test", "shift", "ood"}  # ood_val only when asked for
    for split in digits.splits.values():
        assert split.inputs.dtype == torch.float32 and split.inputs.shape[1:] == (1, 8, 8)
        assert split.labels.dtype == torch.int64 and split.labels.shape == (len(split),)
        assert split.mask is None
        assert float(split.inputs.min()) >= 0.0 and float(split.inputs.max()) <= 1.0
    # clean digits use the 17 grey levels k/16
    clean = digits.splits["train"].inputs * 16
    assert torch.equal(clean, clean.round())


def test_digits_relabelling_partition_and_ood(digits, sk_digits):
    images, targets = sk_digits
    label_of = {}
    for x, t in zip(images, targets):
        label_of.setdefault(_pixel_key(x), set()).add(int(t))
    # in-domain: original classes 0..7 relabelled in order, so new label == original digit
    in_domain = Counter()
    for key in ("train", "val", "test"):
        split = digits.splits[key]
        assert set(split.labels.tolist()) == set(range(8))
        for x, y in zip(split.inputs.numpy(), split.labels.tolist()):
            k = _pixel_key(x)
            assert y in label_of[k] and not label_of[k] & {8, 9}
            in_domain[k] += 1
    assert in_domain == Counter(_pixel_key(x) for x, t in zip(images, targets) if t < 8)  # exact partition
    assert len(digits.splits["ood"]) == int(np.isin(targets, (8, 9)).sum())  # the default: every one in ood
    split = load_dataset("digits", seed=0, severities=(), ood_val_fraction=0.3)
    ood, ood_val = split.splits["ood"], split.splits["ood_val"]
    assert len(ood) + len(ood_val) == int(np.isin(targets, (8, 9)).sum())
    assert set(ood.labels.tolist()) == set(ood_val.labels.tolist()) == {-1}
    for split in (ood, ood_val):
        assert all(label_of[_pixel_key(x)] <= {8, 9} for x in split.inputs.numpy())
        assert not {_pixel_key(x) for x in split.inputs.numpy()} & set(in_domain)
    # the held-out images exactly once over ood and ood_val (an exact partition), about 30 % in ood_val per digit
    held_out = Counter(_pixel_key(x) for x, t in zip(images, targets) if t >= 8)
    assert Counter(_pixel_key(x) for s in (ood, ood_val) for x in s.inputs.numpy()) == held_out
    for digit in (8, 9):
        n_val = sum(label_of[_pixel_key(x)] == {digit} for x in ood_val.inputs.numpy())
        assert abs(n_val - 0.3 * int((targets == digit).sum())) <= 1.5  # up to images that two digits share
    again = load_dataset("digits", seed=0, severities=(), ood_val_fraction=0.3)
    assert torch.equal(again.splits["ood_val"].inputs, ood_val.inputs)  # seeded
    moved = load_dataset("digits", severities=(), seed=1, ood_val_fraction=0.3).splits["ood_val"]
    assert not torch.equal(moved.inputs, ood_val.inputs)
    assert "ood_val" not in digits.splits
    with pytest.raises(ValueError, match="ood_val_fraction"):
        load_dataset("digits", ood_val_fraction=1.0)

    other = load_dataset("digits", ood_classes=(0, 3), severities=())
    assert other.num_classes == 8 and other.info["class_names"] == ["1", "2", "4", "5", "6", "7", "8", "9"]
    assert "shift" not in other.splits and other.eval_splits == {"in_domain": "test", "ood": "ood"}
    remap = {c: i for i, c in enumerate((1, 2, 4, 5, 6, 7, 8, 9))}
    for x, y in zip(other.splits["test"].inputs.numpy(), other.splits["test"].labels.tolist()):
        assert y in {remap[c] for c in label_of[_pixel_key(x)] if c in remap}
    assert all(label_of[_pixel_key(x)] & {0, 3} for x in other.splits["ood"].inputs.numpy())


def test_digits_stratified_split_sizes(digits, sk_digits):
    _, targets = sk_digits
    for c in range(8):
        n_c = int((targets == c).sum())
        n_test = int((digits.splits["test"].labels == c).sum())
        n_val = int((digits.splits["val"].labels == c).sum())
        n_train = int((digits.splits["train"].labels == c).sum())
        assert n_test == round_half_up(0.25 * n_c) and n_val == round_half_up(0.15 * n_c)
        assert n_train + n_val + n_test == n_c
    small = load_dataset("digits", val_fraction=0.3, test_fraction=0.1, severities=(2,))
    assert abs(len(small.splits["val"]) - 0.3 * 1443) <= 8 and abs(len(small.splits["test"]) - 0.1 * 1443) <= 8
    with pytest.raises(ValueError, match="val_fraction"):
        load_dataset("digits", val_fraction=1.5)
    with pytest.raises(ValueError, match="ood_classes"):
        load_dataset("digits", ood_classes=(10,))
    with pytest.raises(ValueError, match="severities"):
        load_dataset("digits", severities=(0, 6))
    one = load_dataset("digits", ood_classes=9, severities=5)
    assert one.num_classes == 9 and set(one.splits["shift"].groups.tolist()) == {5}


def test_digits_deterministic_given_seed_and_different_across_seeds(digits):
    again = load_dataset("digits", seed=0)
    for key in digits.splits:
        assert torch.equal(digits.splits[key].inputs, again.splits[key].inputs)
        assert torch.equal(digits.splits[key].labels, again.splits[key].labels)
    other = load_dataset("digits", seed=1)
    assert len(other.splits["test"]) == len(digits.splits["test"])
    assert not torch.equal(other.splits["test"].inputs, digits.splits["test"].inputs)
    assert not torch.equal(other.splits["shift"].inputs, digits.splits["shift"].inputs)


def test_digits_shift_layout_and_monotone_severity(digits):
    shift, test = digits.splits["shift"], digits.splits["test"]
    n = len(test)
    chunks = digits.info["shift_chunks"]
    names = digits.info["shift_corruptions"]
    assert len(shift) == 15 * n and len(names) == len(shift) and len(chunks) == 15
    assert shift.groups.dtype == torch.int64 and set(shift.groups.tolist()) == {1, 2, 3, 4, 5}
    for corruption in ("gaussian_noise", "gaussian_blur", "pixel_dropout"):
        ours = [c for c in chunks if c["corruption"] == corruption]
        assert [c["severity"] for c in ours] == [1, 2, 3, 4, 5]
        errors = []
        for c in ours:
            sl = slice(c["start"], c["stop"])
            assert c["stop"] - c["start"] == n and set(names[sl]) == {corruption}
            assert set(shift.groups[sl].tolist()) == {c["severity"]}
            assert torch.equal(shift.labels[sl], test.labels)  # labels kept
            errors.append(float((shift.inputs[sl] - test.inputs).abs().mean()))
        assert errors[0] > 0
        assert all(a < b for a, b in zip(errors, errors[1:])), (corruption, errors)


def _blur_reference(x: np.ndarray, sigma: float) -> np.ndarray:
    """Brute-force 2-d Gaussian blur with zero padding, float64, by explicit sums."""
    r = int(np.ceil(3 * sigma))
    g = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    g /= g.sum()
    out = np.zeros_like(x)
    h, w = x.shape[-2:]
    for i in range(h):
        for j in range(w):
            for di in range(-r, r + 1):
                for dj in range(-r, r + 1):
                    if 0 <= i - di < h and 0 <= j - dj < w:
                        out[..., i, j] += g[di + r] * g[dj + r] * x[..., i - di, j - dj]
    return np.clip(out, 0, 1)


def test_digits_corruptions_match_their_definitions(digits):
    from gpattn.experiments.data.digits import SEVERITY_PARAMS, corrupt

    clean = digits.splits["test"].inputs.numpy()
    for s in (1, 5):
        sigma = SEVERITY_PARAMS["gaussian_blur"][s - 1]
        np.testing.assert_allclose(
            corrupt(clean[:20], "gaussian_blur", s, 0), _blur_reference(clean[:20], sigma), atol=1e-6
        )
        p = SEVERITY_PARAMS["pixel_dropout"][s - 1]
        dropped = corrupt(clean, "pixel_dropout", s, 0)
        assert np.all((dropped == clean) | (dropped == 0))
        ink = clean > 0
        frac = float((dropped[ink] == 0).mean())
        assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / ink.sum())  # binomial, 4 standard errors
    # noise: severity 1 (std 0.08) is almost never clipped on mid-grey pixels, so the standardised
    # difference there is N(0, 1); severities share one normal field: clip(clean + std_s * z)
    stds = SEVERITY_PARAMS["gaussian_noise"]
    noisy = [corrupt(clean, "gaussian_noise", s, 0).astype(np.float64) for s in (1, 2, 3, 4, 5)]
    mid = (clean > 0.3) & (clean < 0.7)
    z1 = (noisy[0][mid] - clean[mid]) / stds[0]
    assert mid.sum() > 1000 and abs(z1.mean()) < 0.1 and abs(z1.std() - 1) < 0.05
    inside = (noisy[4] > 0) & (noisy[4] < 1)
    z = (noisy[4][inside] - clean[inside]) / stds[4]
    for s in (1, 2, 3, 4):
        np.testing.assert_allclose(noisy[s - 1][inside], np.clip(clean[inside] + stds[s - 1] * z, 0, 1), atol=1e-5)
    a = corrupt(clean[:5], "pixel_dropout", 2, 0)
    assert np.array_equal(a, corrupt(clean[:5], "pixel_dropout", 2, 0))
    assert not np.array_equal(a, corrupt(clean[:5], "pixel_dropout", 2, 1))
    with pytest.raises(ValueError, match="corruption"):
        corrupt(clean, "fog", 1, 0)


# ----------------------------------------------------------------------------- CoLA (real archive)
@needs_real_cola
def test_cola_real_archive_counts_and_checksum():
    assert sha256_of(REAL_COLA) == COLA_SHA256  # independent of the library's check
    raw = {k: read_cola_member(REAL_COLA, m) for k, m in cola_module.COLA_MEMBERS.items()}
    assert {k: len(v) for k, v in raw.items()} == {
        "in_domain_train": 8551,
        "in_domain_dev": 527,
        "out_of_domain_dev": 516,
    }
    from gpattn.experiments.data._duplicates import DuplicateTextWarning

    # the official out-of-domain dev set repeats 12 sentences of in_domain_train: reported and warned about
    with pytest.warns(DuplicateTextWarning, match=r"12 of 516 rows of evaluation split 'ood' \(split 'ood' of"):
        bundle = load_dataset("cola", data_dir=REAL_COLA.parent)
    assert sum(v for k, v in bundle.info["duplicates"]["between"].items() if k.endswith("/ood")) >= 12
    assert bundle.info["checksum_verified"] and bundle.info["sha256"] == COLA_SHA256
    assert bundle.info["raw_sizes"] == {"in_domain_train": 8551, "in_domain_dev": 527, "out_of_domain_dev": 516}
    n_pos = sum(y for y, _ in raw["in_domain_train"])
    val = round_half_up(0.1 * n_pos) + round_half_up(0.1 * (8551 - n_pos))
    assert {k: len(v) for k, v in bundle.splits.items()} == {"train": 8551 - val, "val": val, "test": 527, "ood": 516}
    assert int(bundle.splits["train"].labels.sum() + bundle.splits["val"].labels.sum()) == n_pos
    assert bundle.splits["test"].labels.tolist() == [y for y, _ in raw["in_domain_dev"]]
    assert bundle.splits["ood"].labels.tolist() == [y for y, _ in raw["out_of_domain_dev"]]
    for split in bundle.splits.values():
        assert_mask_convention(split, max_len=64)

    with pytest.warns(DuplicateTextWarning):
        pooled = load_dataset("cola", data_dir=REAL_COLA.parent, preset="pooled")
    labels = [y for y, _ in raw["in_domain_train"] + raw["in_domain_dev"]]
    counts = Counter(labels)
    test = sum(round_half_up(0.2 * n) for n in counts.values())
    val = sum(round_half_up(0.1 * n) for n in counts.values())
    assert {k: len(v) for k, v in pooled.splits.items()} == {
        "train": 9078 - test - val,
        "val": val,
        "test": test,
        "ood": 516,
    }


# ----------------------------------------------------------------------------- CoLA (synthetic fixture)
@pytest.fixture(scope="module")
def cola_dir(tmp_path_factory):
    path = make_cola_zip(tmp_path_factory.mktemp("cola"), n_train=200, n_dev=60, n_ood=40, seed=0)
    assert path.name == "cola_public_1.1.zip"
    return path.parent


def test_fixture_has_the_official_layout(cola_dir, tmp_path):
    path = cola_dir / "cola_public_1.1.zip"
    names = zipfile.ZipFile(path).namelist()
    for folder in ("raw", "tokenized"):
        for f in ("in_domain_train", "in_domain_dev", "out_of_domain_dev"):
            assert f"cola_public/{folder}/{f}.tsv" in names
    assert "cola_public/README" in names
    for member, n in (("in_domain_train", 200), ("in_domain_dev", 60), ("out_of_domain_dev", 40)):
        rows = read_cola_member(path, f"cola_public/raw/{member}.tsv")
        assert len(rows) == n and {y for y, _ in rows} == {0, 1}
    # deterministic bytes given the seed
    again = make_cola_zip(tmp_path / "again.zip", seed=0)
    assert again.read_bytes() == path.read_bytes()
    assert make_cola_zip(tmp_path / "other.zip", seed=1).read_bytes() != path.read_bytes()


def test_cola_vocabulary_from_train_only(cola_dir):
    path = cola_dir / "cola_public_1.1.zip"
    bundle = load_dataset("cola", data_dir=cola_dir, verify_checksum=False)
    assert not bundle.info["checksum_verified"]
    assert bundle.kind == "text" and bundle.num_classes == 2 and bundle.vocab_size == len(bundle.vocab)
    assert bundle.vocab[:3] == ["<pad>", "<unk>", "<cls>"]
    assert bundle.eval_splits == {"in_domain": "test", "ood": "ood"} and bundle.ood_splits == ("ood",)
    train_rows = read_cola_member(path, "cola_public/raw/in_domain_train.tsv")
    dev_rows = read_cola_member(path, "cola_public/raw/in_domain_dev.tsv")
    ood_rows = read_cola_member(path, "cola_public/raw/out_of_domain_dev.tsv")
    # the train split is in_domain_train minus val: its words, and only its words, form the vocabulary
    assert len(bundle.splits["train"]) + len(bundle.splits["val"]) == 200
    train_ids = bundle.splits["train"].inputs
    train_words = {bundle.vocab[i] for i in train_ids[train_ids > 2].tolist()}
    assert set(bundle.vocab[3:]) == train_words
    all_in_train_file = {t for _, s in train_rows for t in spec_tokens(s)}
    assert train_words <= all_in_train_file
    dev_only = {t for _, s in dev_rows for t in spec_tokens(s)} - all_in_train_file
    assert set(DEV_ONLY_WORDS) & dev_only and not dev_only & set(bundle.vocab)
    # the test split is in_domain_dev in file order, encoded against the train vocabulary (<unk> = 1)
    index = {t: i for i, t in enumerate(bundle.vocab)}
    test = bundle.splits["test"]
    assert test.labels.tolist() == [y for y, _ in dev_rows]
    saw_unk_for_dev_word = False
    for row, (_, sentence) in enumerate(dev_rows):
        tokens = spec_tokens(sentence)[:64]
        expected = [index.get(t, 1) for t in tokens]
        assert test.inputs[row, : len(tokens)].tolist() == expected
        saw_unk_for_dev_word |= any(t in DEV_ONLY_WORDS for t in tokens)
    assert saw_unk_for_dev_word
    ood_text = " ".join(s for _, s in ood_rows).lower()
    assert any(w in ood_text for w in OOD_ONLY_WORDS) and not set(OOD_ONLY_WORDS) & set(bundle.vocab)
    assert bundle.splits["ood"].labels.tolist() == [y for y, _ in ood_rows]
    for split in bundle.splits.values():
        assert_mask_convention(split, max_len=64)

    frequent = load_dataset("cola", data_dir=cola_dir, verify_checksum=False, min_freq=3)
    counts = Counter(bundle.vocab[i] for i in train_ids[train_ids > 2].tolist())
    assert set(frequent.vocab[3:]) == {w for w, c in counts.items() if c >= 3}


def test_cola_max_len_truncation_and_mask(cola_dir):
    full = load_dataset("cola", data_dir=cola_dir, verify_checksum=False)
    short = load_dataset("cola", data_dir=cola_dir, verify_checksum=False, max_len=5)
    assert full.info["max_tokens"]["train"] > 5
    for key in full.splits:
        assert short.splits[key].inputs.shape[1] == 5
        assert torch.equal(short.splits[key].inputs, full.splits[key].inputs[:, :5])
        assert_mask_convention(short.splits[key], max_len=5)
        assert_mask_convention(full.splits[key], max_len=64)
    assert short.info["truncated"]["train"] > 0 and full.info["truncated"]["train"] == 0


def test_cola_pooled_preset(cola_dir):
    path = cola_dir / "cola_public_1.1.zip"
    pooled = load_dataset("cola", data_dir=cola_dir, verify_checksum=False, preset="pooled", seed=3)
    rows = read_cola_member(path, "cola_public/raw/in_domain_train.tsv") + read_cola_member(
        path, "cola_public/raw/in_domain_dev.tsv"
    )
    counts = Counter(y for y, _ in rows)
    sizes = {k: len(v) for k, v in pooled.splits.items()}
    n_test = sum(round_half_up(0.2 * n) for n in counts.values())
    n_val = sum(round_half_up(0.1 * n) for n in counts.values())
    assert sizes == {"train": 260 - n_test - n_val, "val": n_val, "test": n_test, "ood": 40}
    for c, n in counts.items():  # 7:1:2 within each class
        assert int((pooled.splits["test"].labels == c).sum()) == round_half_up(0.2 * n)
        assert int((pooled.splits["val"].labels == c).sum()) == round_half_up(0.1 * n)
    assert pooled.info["preset"] == "pooled" and pooled.eval_splits == {"in_domain": "test", "ood": "ood"}
    # dev sentences are pooled into train: dev-only words enter the vocabulary
    assert set(DEV_ONLY_WORDS) & set(pooled.vocab)
    again = load_dataset("cola", data_dir=cola_dir, verify_checksum=False, preset="pooled", seed=3)
    other = load_dataset("cola", data_dir=cola_dir, verify_checksum=False, preset="pooled", seed=4)
    assert torch.equal(again.splits["test"].inputs, pooled.splits["test"].inputs)
    assert pooled.splits["test"].inputs.shape != other.splits["test"].inputs.shape or not torch.equal(
        pooled.splits["test"].inputs, other.splits["test"].inputs
    )
    with pytest.raises(ValueError, match="preset"):
        load_dataset("cola", data_dir=cola_dir, verify_checksum=False, preset="glue")
    with pytest.raises(ValueError, match="test_fraction"):
        load_dataset("cola", data_dir=cola_dir, verify_checksum=False, test_fraction=0.3)


# ----------------------------------------------------------------------------- errors and downloads
def test_missing_archive_message_names_url_and_path(tmp_path, monkeypatch):
    monkeypatch.delenv("GPATTN_DATA_DIR", raising=False)
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("cola", data_dir=tmp_path)
    message = str(err.value)
    assert COLA_URL in message and str(tmp_path / "cola_public_1.1.zip") in message
    assert "download=True" in message and "--download" in message and "--data-dir" in message
    assert not list(tmp_path.iterdir())  # nothing was downloaded

    env_dir = tmp_path / "from_env"
    monkeypatch.setenv("GPATTN_DATA_DIR", str(env_dir))
    with pytest.raises(DataNotFoundError, match=re.escape(str(env_dir / "cola_public_1.1.zip"))):
        load_dataset("cola")
    explicit = tmp_path / "explicit"
    with pytest.raises(DataNotFoundError, match=re.escape(str(explicit / "cola_public_1.1.zip"))):
        load_dataset("cola", data_dir=explicit)
    monkeypatch.delenv("GPATTN_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".cache" / "gpattn" / "cola_public_1.1.zip"
    with pytest.raises(DataNotFoundError, match=re.escape(str(default))):
        load_dataset("cola")
    assert not (tmp_path / "home").exists()


def test_checksum_mismatch_is_an_error(cola_dir, tmp_path):
    path = cola_dir / "cola_public_1.1.zip"
    with pytest.raises(ValueError) as err:
        load_dataset("cola", data_dir=cola_dir)  # verify_checksum defaults to True
    message = str(err.value)
    assert "checksum mismatch" in message and str(path) in message
    assert COLA_SHA256 in message and sha256_of(path) in message


def test_corrupt_zip_is_an_error(cola_dir, tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "cola_public_1.1.zip").write_bytes(b"this is not a zip archive at all" * 10)
    with pytest.raises(ValueError, match="not a valid zip archive"):
        load_dataset("cola", data_dir=garbage, verify_checksum=False)
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    data = (cola_dir / "cola_public_1.1.zip").read_bytes()
    (truncated / "cola_public_1.1.zip").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a valid zip archive"):
        load_dataset("cola", data_dir=truncated, verify_checksum=False)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    with zipfile.ZipFile(wrong / "cola_public_1.1.zip", "w") as z:
        z.writestr("something/else.txt", "hello")
    with pytest.raises(ValueError, match="no member 'cola_public/raw/in_domain_train.tsv'"):
        load_dataset("cola", data_dir=wrong, verify_checksum=False)


def test_fetch_from_file_url_is_checksummed_and_atomic(tmp_path):
    source = tmp_path / "source.bin"
    payload = bytes(range(256)) * 4000  # ~1 MB, several read chunks
    source.write_bytes(payload)
    digest = hashlib.sha256(payload).hexdigest()
    target_dir = tmp_path / "cache" / "nested"
    target = target_dir / "file.bin"

    with pytest.raises(ValueError, match="checksum mismatch"):
        fetch(source.as_uri(), target, "0" * 64, download=True)
    assert not target.exists() and list(target_dir.iterdir()) == []  # the partial download was removed

    with pytest.raises(DataNotFoundError, match=re.escape(str(target))):
        fetch(source.as_uri(), target, digest, download=False)
    with pytest.raises(DataNotFoundError, match="could not download"):
        fetch((tmp_path / "absent.bin").as_uri(), target, digest, download=True)
    assert list(target_dir.iterdir()) == []
    with pytest.raises(ValueError, match="without a sha256"):
        fetch(source.as_uri(), target, None, download=True)
    with pytest.raises(ValueError, match="max_bytes"):
        fetch(source.as_uri(), target, digest, download=True, max_bytes=1000)
    assert list(target_dir.iterdir()) == []

    assert fetch(source.as_uri(), target, digest, download=True) == target
    assert target.read_bytes() == payload and list(target_dir.iterdir()) == [target]
    assert fetch("http://invalid.invalid/never", target, digest, download=True) == target  # present: no network
    target.write_bytes(payload[:-1])
    with pytest.raises(ValueError, match="checksum mismatch"):
        fetch(source.as_uri(), target, digest, download=True)  # an existing bad file is never accepted


def test_cola_download_path_end_to_end(cola_dir, tmp_path, monkeypatch):
    archive = cola_dir / "cola_public_1.1.zip"
    monkeypatch.setattr(cola_module, "COLA_URL", archive.as_uri())
    monkeypatch.setattr(cola_module, "COLA_SHA256", sha256_of(archive))
    target = tmp_path / "downloaded"
    bundle = load_dataset("cola", data_dir=target, download=True)
    assert (target / "cola_public_1.1.zip").read_bytes() == archive.read_bytes()
    assert bundle.info["checksum_verified"] and len(bundle.splits["test"]) == 60
    assert sorted(p.name for p in target.iterdir()) == ["cola_public_1.1.zip"]


# ----------------------------------------------------------------------------- text_table
_CLASS_WORDS = {
    "negative": {"awful", "boring", "dull", "bad", "tedious"},
    "neutral": {"fine", "okay", "average", "plain", "so", "-"},
    "positive": {"great", "wonderful", "superb", "good", "delightful"},
}


def _check_labels_follow_texts(bundle):
    names = bundle.info["class_names"]
    for key in ("train", "val", "test"):
        split = bundle.splits[key]
        for ids, mask, y in zip(split.inputs, split.mask, split.labels.tolist()):
            words = {bundle.vocab[i] for i in ids[~mask].tolist()}
            for name, cue in _CLASS_WORDS.items():
                if name == names[y]:
                    assert words & cue or key != "train"
                else:
                    assert not words & (cue - {"-"})


@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_text_table_tsv_and_csv(tmp_path, suffix):
    path = make_text_table(tmp_path / f"reviews{suffix}", n=120, seed=1)
    bundle = load_dataset("text_table", path=str(path), seed=0)
    assert bundle.kind == "text" and bundle.num_classes == 3
    assert bundle.info["class_names"] == ["negative", "neutral", "positive"]
    assert {k: len(v) for k, v in bundle.splits.items()} == {"train": 84, "val": 12, "test": 24}
    for key, per_class in (("train", 28), ("val", 4), ("test", 8)):
        assert Counter(bundle.splits[key].labels.tolist()) == {0: per_class, 1: per_class, 2: per_class}
        assert_mask_convention(bundle.splits[key])
    _check_labels_follow_texts(bundle)
    if suffix == ".csv":
        assert '"' in bundle.vocab  # quoted fields with embedded quotes parsed by CSV rules
    # a relative path is looked up in data_dir as well
    assert len(load_dataset("text_table", data_dir=tmp_path, path=path.name).splits["test"]) == 24


def test_text_table_numeric_labels_header_off_and_empty_text(tmp_path):
    path = make_text_table(
        tmp_path / "n.csv", n=30, class_names=("10", "2", "1"), header=False, columns=("label", "text")
    )
    with open(path, "a", encoding="utf-8") as handle:
        handle.write("2,\n")  # an empty text: refused (issue #28), or left out and reported
    options = dict(path=path, header=False, text_column=1, label_column=0, val_fraction=0.2, test_fraction=0.2,
                   max_len=6)
    with pytest.raises(ValueError, match=r"n.csv: 1 row\(s\) whose text is empty .*lines 31.*bad_rows='skip'"):
        load_dataset("text_table", **options)
    bundle = load_dataset("text_table", bad_rows="skip", **options)
    assert bundle.info["class_names"] == ["1", "2", "10"]  # numeric order
    for split in bundle.splits.values():
        assert_mask_convention(split, max_len=6)
    assert sum(len(s) for s in bundle.splits.values()) == 30
    assert bundle.info["files"][0]["skipped_rows"] == {"rows": 1, "lines": [31]}
    # an empty text that reaches the encoder (predict) is one <unk> token
    ids, mask = encode([[]], bundle.vocab, 6)
    assert ids.tolist() == [[1]] and mask.tolist() == [[False]]


def test_text_table_ood_file(tmp_path):
    path = make_text_table(tmp_path / "in.tsv", n=60, seed=0)
    labelled = make_text_table(tmp_path / "ood.tsv", n=9, seed=7, class_names=("negative", "positive", "other"))
    unlabelled = make_text_table(tmp_path / "ood_nolabel.csv", n=7, seed=6, columns=("id", "text"))
    with pytest.raises(ValueError, match=r"ood.tsv line 4: label 'other' .*unknown_labels='drop'"):
        load_dataset("text_table", path=path, ood_file=labelled)  # was silently -1
    bundle = load_dataset("text_table", path=path, ood_file=labelled, unknown_labels="unlabelled")
    assert bundle.info["unknown_labels"]["ood"] == {"policy": "unlabelled", "rows": 3, "values": ["other"]}
    dropped = load_dataset("text_table", path=path, ood_file=labelled, unknown_labels="drop")
    assert dropped.splits["ood"].labels.tolist() == [0, 2] * 3
    assert bundle.eval_splits == {"in_domain": "test", "ood": "ood"} and bundle.ood_splits == ("ood",)
    # fixture classes cycle negative, positive, other; known names map to the training ids, unknown to -1
    assert bundle.splits["ood"].labels.tolist() == [0, 2, -1] * 3
    assert bundle.info["ood_labelled"] and bundle.info["ood_unknown_labels"] == 3
    assert_mask_convention(bundle.splits["ood"])
    unl = load_dataset("text_table", path=path, ood_file=unlabelled)
    assert unl.splits["ood"].labels.tolist() == [-1] * 7 and not unl.info["ood_labelled"]


def test_text_table_errors(tmp_path):
    path = make_text_table(tmp_path / "t.csv", n=20)
    with pytest.raises(ValueError, match="label_column='sentiment' not found") as err:
        load_dataset("text_table", path=path, label_column="sentiment")
    assert "'text'" in str(err.value) and "'label'" in str(err.value)
    with pytest.raises(ValueError, match="text_column='body' not found"):
        load_dataset("text_table", path=path, text_column="body")
    with pytest.raises(ValueError, match="out of range"):
        load_dataset("text_table", path=path, text_column=5)
    odd = tmp_path / "t.txt"
    odd.write_text("text,label\na,b\n")
    with pytest.raises(ValueError, match="delimiter"):
        load_dataset("text_table", path=odd)
    with pytest.raises(DataNotFoundError, match="nope.tsv"):
        load_dataset("text_table", path=tmp_path / "nope.tsv")
    three = make_text_table(tmp_path / "three.csv", n=12, columns=("id", "text", "label"))
    ok = load_dataset("text_table", path=three)  # "text" found by name among three columns
    assert ok.num_classes == 3
    headerless = make_text_table(tmp_path / "h.csv", n=12, columns=("id", "label", "text"), header=False)
    with pytest.raises(ValueError, match="text_column"):
        load_dataset("text_table", path=headerless, header=False, label_column=1)
