"""``imdb``: the Large Movie Review Dataset v1.0 (Maas et al., ACL 2011), binary sentiment.

Read straight from the official archive ``<data_dir>/aclImdb_v1.tar.gz`` (streamed member by
member, no extraction; SHA-256 checked by default). Its labelled reviews are the text files
``aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`` (12500 per folder; ratings 7..10 are
positive, 1..4 negative); ``train/unsup`` and the bag-of-words files are ignored. The reviews hold
HTML line breaks ``<br />``, read as spaces. Labels: 0 = negative, 1 = positive.
"""

from __future__ import annotations

import re
import tarfile
import zlib
from pathlib import Path

import numpy as np

from gpattn.experiments.data._bundle import DatasetBundle, register_dataset
from gpattn.experiments.data._download import fetch_archive, open_tar
from gpattn.experiments.data._split import check_fraction, stratified_split
from gpattn.experiments.data._text import build_text_bundle
from gpattn.experiments.data.fashion_mnist import stratified_subsample

__all__ = ["CLASS_NAMES", "IMDB_FILENAME", "IMDB_SHA256", "IMDB_URL", "load_imdb", "read_imdb"]

#: where ``download=True`` fetches the IMDB archive
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
#: SHA-256 of ``aclImdb_v1.tar.gz`` (84,125,825 bytes), checked on every read
IMDB_SHA256 = "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe"  # 84125825 bytes
#: the archive's file name in the data folder
IMDB_FILENAME = "aclImdb_v1.tar.gz"
#: IMDB's labels 0 and 1
CLASS_NAMES = ("negative", "positive")
_MEMBER = re.compile(r"aclImdb/(train|test)/(neg|pos)/(\d+)_(\d+)\.txt")
_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)


def read_imdb(path) -> dict[str, tuple[list[str], list[int], list[int]]]:
    """{"train" | "test": (texts, labels, ratings)} of the labelled reviews in the archive at
    ``path``, each split in (label, review id) order; ``ValueError`` naming the file if it is not a
    readable tar archive or lacks a folder."""
    rows: dict[str, list[tuple[int, int, int, str]]] = {"train": [], "test": []}
    try:
        with open_tar(path) as archive:
            for member in archive:
                match = _MEMBER.fullmatch(member.name)
                if match is None or not member.isfile():
                    continue
                split, folder, review_id, rating = match.groups()
                raw = archive.extractfile(member).read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{path}:{member.name} is not UTF-8 text ({err})") from err
                label = int(folder == "pos")
                rows[split].append((label, int(review_id), int(rating), _BREAK.sub(" ", text)))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as err:
        raise ValueError(f"{path} is not a valid tar archive ({err}); delete it and download it again") from err
    out = {}
    for split, items in rows.items():
        labels = {label for label, *_ in items}
        if labels != {0, 1}:
            raise ValueError(
                f"{path} has no reviews under aclImdb/{split}/{{neg,pos}}/<id>_<rating>.txt for label(s) "
                f"{sorted({0, 1} - labels)}; it is not the aclImdb archive"
            )
        items.sort(key=lambda r: (r[0], r[1]))
        out[split] = ([r[3] for r in items], [r[0] for r in items], [r[2] for r in items])
    return out


def _check_max(name: str, value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    return value


@register_dataset("imdb")
def load_imdb(
    *,
    data_dir,
    download: bool,
    seed: int,
    val_fraction: float = 0.1,
    max_train: int | None = None,
    max_val: int | None = None,
    max_test: int | None = None,
    max_len: int = 256,
    min_freq: int = 1,
    max_vocab_size: int | None = 20000,
    verify_checksum: bool = True,
) -> DatasetBundle:
    """IMDB as a binary text-classification bundle (0 = negative, 1 = positive).

    val = a seeded stratified ``val_fraction`` of the official train folder, train = the rest,
    test = the official test folder; ``max_train`` / ``max_val`` / ``max_test`` then cut each to a
    stratified random subset (CPU presets). Reviews are tokenised by
    :func:`gpattn.experiments.data._text.tokenize`, the vocabulary is built on the (cut) train split only
    (``min_freq``, at most ``max_vocab_size`` words), sequences are cut to their first ``max_len``
    tokens. ``eval_splits`` = {"in_domain": "test"}. ``verify_checksum=False`` skips the SHA-256
    check of an existing archive (synthetic archives from :mod:`gpattn.experiments.data.fixtures_more`); a
    download is always verified.
    """
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=False)
    limits = {k: _check_max(k, v) for k, v in (("max_train", max_train), ("max_val", max_val), ("max_test", max_test))}
    if not isinstance(verify_checksum, bool):
        raise ValueError(f"verify_checksum must be a bool, got {verify_checksum!r}")

    path = Path(data_dir) / IMDB_FILENAME
    provenance = fetch_archive(IMDB_URL, path, IMDB_SHA256, download, verify_checksum)
    raw = read_imdb(path)

    pool_t, pool_y, _ = raw["train"]
    test_t, test_y, _ = raw["test"]
    pool_y_np = np.asarray(pool_y)
    tr, va = stratified_split(pool_y_np, (val_fraction,), seed)
    tr = tr[stratified_subsample(pool_y_np[tr], limits["max_train"], np.random.default_rng([seed, 1]))]
    va = va[stratified_subsample(pool_y_np[va], limits["max_val"], np.random.default_rng([seed, 2]))]
    te = stratified_subsample(np.asarray(test_y), limits["max_test"], np.random.default_rng([seed, 3]))
    texts = {
        "train": [pool_t[i] for i in tr],
        "val": [pool_t[i] for i in va],
        "test": [test_t[i] for i in te],
    }
    labels = {
        "train": [pool_y[i] for i in tr],
        "val": [pool_y[i] for i in va],
        "test": [test_y[i] for i in te],
    }
    info = {
        **provenance,
        "seed": seed,
        "class_names": list(CLASS_NAMES),
        "raw_sizes": {key: len(value[1]) for key, value in raw.items()},
    }
    return build_text_bundle(
        "imdb",
        texts,
        labels,
        num_classes=2,
        eval_splits={"in_domain": "test"},
        ood_splits=(),
        info=info,
        max_len=max_len,
        min_freq=min_freq,
        max_vocab_size=max_vocab_size,
    )
