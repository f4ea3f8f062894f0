"""``cola``: the Corpus of Linguistic Acceptability (Warstadt, Singh & Bowman, 2019), public v1.1.

Read straight from the official archive ``cola_public_1.1.zip`` (no extraction), looked up as
``<data_dir>/cola_public_1.1.zip`` and checked against its SHA-256 by default. The raw TSVs
``cola_public/raw/{in_domain_train,in_domain_dev,out_of_domain_dev}.tsv`` have no header and four
tab-separated columns: source code, label (0 = unacceptable, 1 = acceptable), the author's original
mark, sentence. The archive's files hold 8551, 527 and 516 rows.
"""

from __future__ import annotations

from pathlib import Path

from gpattn.experiments.data._bundle import DatasetBundle, register_dataset
from gpattn.experiments.data._download import fetch_archive, open_zip, read_zip_member
from gpattn.experiments.data._split import check_fraction, stratified_split
from gpattn.experiments.data._text import build_text_bundle

__all__ = ["CLASS_NAMES", "COLA_FILENAME", "COLA_MEMBERS", "COLA_SHA256", "COLA_URL", "load_cola", "read_cola"]

#: where ``download=True`` fetches the official CoLA archive
COLA_URL = "https://nyu-mll.github.io/CoLA/cola_public_1.1.zip"
#: SHA-256 of ``cola_public_1.1.zip``, checked on every read
COLA_SHA256 = "2cf856f46df11c143d38e0cf2f9f34ff2fdb088c521cd859f5c4b9581683278b"
#: the archive's file name in the data folder
COLA_FILENAME = "cola_public_1.1.zip"
#: the archive's raw TSV member of each official split
COLA_MEMBERS = {
    "in_domain_train": "cola_public/raw/in_domain_train.tsv",
    "in_domain_dev": "cola_public/raw/in_domain_dev.tsv",
    "out_of_domain_dev": "cola_public/raw/out_of_domain_dev.tsv",
}
#: CoLA's labels 0 and 1
CLASS_NAMES = ("unacceptable", "acceptable")
PRESETS = ("official", "pooled")


def _parse_tsv(data: bytes, where: str) -> tuple[list[str], list[int]]:
    """(sentences, labels) of one raw CoLA TSV; ``ValueError`` naming file and line on a bad row."""
    sentences, labels = [], []
    for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            raise ValueError(f"{where} line {lineno}: expected 4 tab-separated columns, got {len(fields)}")
        if fields[1] not in ("0", "1"):
            raise ValueError(f"{where} line {lineno}: label must be 0 or 1, got {fields[1]!r}")
        labels.append(int(fields[1]))
        sentences.append(fields[3])
    return sentences, labels


def read_cola(path) -> dict[str, tuple[list[str], list[int]]]:
    """{file key: (sentences, labels)} for the three raw TSVs of the archive at ``path``."""
    with open_zip(path) as archive:
        return {
            key: _parse_tsv(read_zip_member(archive, member), f"{path}:{member}")
            for key, member in COLA_MEMBERS.items()
        }


@register_dataset("cola")
def load_cola(
    *,
    data_dir,
    download: bool,
    seed: int,
    preset: str = "official",
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    max_len: int = 64,
    min_freq: int = 1,
    max_vocab_size=None,
    verify_checksum: bool = True,
) -> DatasetBundle:
    """CoLA as a binary text-classification bundle (labels 0 = unacceptable, 1 = acceptable).

    Presets (``ood`` is ``out_of_domain_dev`` with its labels in both; it is a labelled split):

    - ``"official"``: train = ``in_domain_train`` minus a seeded stratified ``val_fraction`` held out
      as val; test = ``in_domain_dev`` (527 sentences). This is the split of KEP-SVGP (Chen et al.,
      2024, App. D.1: "This dataset provides an in-distribution training with 8551 samples and a
      in-distribution test of 527.") and of SGPA (Chen & Li, 2023), which it follows.
    - ``"pooled"``: ``in_domain_train`` and ``in_domain_dev`` pooled (9078 sentences) and split
      stratified and seeded into train / val / test with fractions (1 - val - test) : ``val_fraction``
      : ``test_fraction``, by default 7:1:2 as in H-STO-TRANS (Pei, Wang & Szarvas, AAAI 2022, Sec. 4): "As the
      labels of test set is not publicly available, we split randomly the 9078 in-domain samples
      into train/valid/test with 7:1:2. Additionally, we use the provided 516 out-of-domain samples
      for uncertainty estimation." (80 % train+val, 20 % test.)

    Sentences are tokenised by :func:`gpattn.experiments.data._text.tokenize`, the vocabulary is built on the train
    split only (``min_freq``, ``max_vocab_size``), sequences are cut to ``max_len`` tokens.
    ``verify_checksum=False`` skips the SHA-256 check of an existing archive (for a synthetic
    archive from :func:`gpattn.experiments.data.fixtures.make_cola_zip`); a download is always verified.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=False)
    test_fraction = check_fraction("test_fraction", test_fraction, allow_zero=False)
    if preset == "official" and test_fraction != 0.2:
        raise ValueError(
            f"test_fraction applies to preset='pooled' only (the official test split is in_domain_dev), "
            f"got test_fraction={test_fraction}"
        )
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}")
    if not isinstance(verify_checksum, bool):
        raise ValueError(f"verify_checksum must be a bool, got {verify_checksum!r}")

    path = Path(data_dir) / COLA_FILENAME
    provenance = fetch_archive(COLA_URL, path, COLA_SHA256, download, verify_checksum)
    raw = read_cola(path)

    train_s, train_y = raw["in_domain_train"]
    dev_s, dev_y = raw["in_domain_dev"]
    ood_s, ood_y = raw["out_of_domain_dev"]
    if preset == "official":
        tr, va = stratified_split(train_y, (val_fraction,), seed)
        test_s, test_y = dev_s, dev_y
        pool_s, pool_y = train_s, train_y
    else:
        pool_s, pool_y = train_s + dev_s, train_y + dev_y
        tr, va, te = stratified_split(pool_y, (val_fraction, test_fraction), seed)
        test_s, test_y = [pool_s[i] for i in te], [pool_y[i] for i in te]
    texts = {
        "train": [pool_s[i] for i in tr],
        "val": [pool_s[i] for i in va],
        "test": test_s,
        "ood": ood_s,
    }
    labels = {
        "train": [pool_y[i] for i in tr],
        "val": [pool_y[i] for i in va],
        "test": test_y,
        "ood": ood_y,
    }
    info = {
        **provenance,
        "preset": preset,
        "seed": seed,
        "class_names": list(CLASS_NAMES),
        "raw_sizes": {key: len(value[1]) for key, value in raw.items()},
    }
    return build_text_bundle(
        "cola",
        texts,
        labels,
        num_classes=2,
        eval_splits={"in_domain": "test", "ood": "ood"},
        ood_splits=("ood",),
        info=info,
        max_len=max_len,
        min_freq=min_freq,
        max_vocab_size=max_vocab_size,
    )
