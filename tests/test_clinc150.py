"""The ``clinc150`` loader: official splits, oos_test as OOD, checksummed download; a synthetic file in the official
format, and the real file where ../shared/data/clinc150/ holds it. No network (downloads read file:// URLs)."""

import json
from pathlib import Path

import numpy as np
import pytest

from gpattn.experiments.data import DataNotFoundError, list_datasets, load_dataset
from gpattn.experiments.data import clinc150 as clinc_module
from gpattn.experiments.data._download import sha256_file
from gpattn.experiments.data.fixtures_clinc import make_clinc150_json

_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "clinc150" / "data_full.json",
    Path("/work/shared/data/clinc150/data_full.json"),
)
REAL = next((p for p in _CANDIDATES if p.exists()), None)
needs_real = pytest.mark.skipif(REAL is None, reason="CLINC150's data_full.json is not on this machine")


@pytest.fixture()
def clinc_dir(tmp_path):
    path = make_clinc150_json(tmp_path, n_intents=5, per_intent=(8, 3, 4), n_oos=(2, 2, 6), seed=0)
    assert path.name == "data_full.json"
    return tmp_path


def test_registered():
    assert "clinc150" in list_datasets()


def test_fixture_bundle_has_official_splits_and_unlabelled_ood(clinc_dir):
    bundle = load_dataset("clinc150", data_dir=clinc_dir, verify_checksum=False, ood_val=True)
    raw = json.loads((clinc_dir / "data_full.json").read_text())
    sizes = {name: len(split.labels) for name, split in bundle.splits.items()}
    assert sizes == {"train": 40, "val": 15, "test": 20, "ood": 6, "ood_val": 2}  # ood_val: oos_val's queries
    assert bundle.texts["ood_val"] == [text for text, _ in raw["oos_val"]]
    assert "ood_val" not in load_dataset("clinc150", data_dir=clinc_dir, verify_checksum=False).splits  # default
    with pytest.raises(ValueError, match="ood_val must be True or False"):
        load_dataset("clinc150", data_dir=clinc_dir, verify_checksum=False, ood_val="yes")
    assert bundle.num_classes == 5
    assert bundle.info["class_names"] == [f"intent_{k}" for k in range(5)]
    assert bundle.info["raw_sizes"] == {k: len(v) for k, v in raw.items()}
    assert bundle.info["checksum_verified"] is False
    assert bundle.ood_splits == ("ood",)
    assert np.all(np.asarray(bundle.splits["ood"].labels) == -1)
    assert np.all(np.asarray(bundle.splits["ood_val"].labels) == -1)
    # labels follow the file's intents in sorted order, row by row
    test_ids = [int(v) for v in bundle.splits["test"].labels]
    assert test_ids == [int(intent.split("_")[1]) for _, intent in raw["test"]]


def test_checksum_is_checked_by_default(clinc_dir):
    with pytest.raises(ValueError, match="(?i)sha-?256|checksum|digest"):
        load_dataset("clinc150", data_dir=clinc_dir)


def test_missing_file_is_not_downloaded(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_dataset("clinc150", data_dir=tmp_path)
    assert "download" in str(err.value) and clinc_module.CLINC150_URL in str(err.value)
    assert not list(tmp_path.iterdir())


def test_download_fetches_and_verifies(clinc_dir, tmp_path, monkeypatch):
    source = clinc_dir / "data_full.json"
    target = tmp_path / "fresh"
    monkeypatch.setattr(clinc_module, "CLINC150_URL", source.as_uri())
    monkeypatch.setattr(clinc_module, "CLINC150_SHA256", sha256_file(source))
    bundle = load_dataset("clinc150", data_dir=target, download=True)
    assert (target / "data_full.json").read_bytes() == source.read_bytes()
    assert bundle.info["checksum_verified"] is True
    monkeypatch.setattr(clinc_module, "CLINC150_SHA256", "0" * 64)
    with pytest.raises(ValueError):
        load_dataset("clinc150", data_dir=tmp_path / "other", download=True)


def test_malformed_file_names_the_row(tmp_path):
    path = make_clinc150_json(tmp_path)
    raw = json.loads(path.read_text())
    raw["test"][2] = ["a query", "oos"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"test\[2\]"):
        load_dataset("clinc150", data_dir=tmp_path, verify_checksum=False)


@needs_real
def test_real_file_counts_and_checksum():
    bundle = load_dataset("clinc150", data_dir=REAL.parent)
    assert bundle.info["checksum_verified"] is True and bundle.info["sha256"] == clinc_module.CLINC150_SHA256
    assert {name: len(s.labels) for name, s in bundle.splits.items()} == {
        "train": 15000, "val": 3000, "test": 4500, "ood": 1000
    }
    assert bundle.num_classes == 150
    assert np.bincount(np.asarray(bundle.splits["train"].labels), minlength=150).tolist() == [100] * 150
    assert sum(bundle.info["truncated"].values()) == 0
