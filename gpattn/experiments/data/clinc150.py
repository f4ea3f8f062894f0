"""``clinc150``: CLINC150 intent classification with out-of-scope queries (Larson et al., EMNLP-IJCNLP 2019).

Released by Clinc under CC BY 3.0 (cite the paper and credit the authors). Read from the authors' "full"
data file ``data_full.json`` (repository clinc/oos-eval, ``data/data_full.json`` at commit
828f8093932c8fe6ca7936c3d2e52903b1c523de), looked up as ``<data_dir>/data_full.json`` and checked against
its SHA-256 by default. The file is one JSON object with six lists of ``[text, intent]`` pairs: ``train``
15,000 (150 intents x 100), ``val`` 3,000 (x 20), ``test`` 4,500 (x 30), and ``oos_train`` 100, ``oos_val``
100, ``oos_test`` 1,000 out-of-scope queries with intent ``"oos"``.
"""

from __future__ import annotations

import json
from pathlib import Path

from gpattn.experiments.data._bundle import DatasetBundle, register_dataset
from gpattn.experiments.data._download import fetch_archive
from gpattn.experiments.data._text import build_text_bundle

__all__ = ["CLINC150_FILENAME", "CLINC150_KEYS", "CLINC150_SHA256", "CLINC150_URL", "OOS_LABEL", "load_clinc150",
           "read_clinc150"]

#: where ``download=True`` fetches the file: the authors' repository at a fixed commit
CLINC150_URL = (
    "https://raw.githubusercontent.com/clinc/oos-eval/828f8093932c8fe6ca7936c3d2e52903b1c523de/data/data_full.json"
)
#: SHA-256 of ``data_full.json`` (2,495,390 bytes), checked on every read
CLINC150_SHA256 = "36923c3705a59e08fe9c3883d8bc2dd966ef93e22cb78ac41171782a698d56e0"
#: the authors' file name, looked up in the data folder
CLINC150_FILENAME = "data_full.json"
#: the file's six lists
CLINC150_KEYS = ("train", "val", "test", "oos_train", "oos_val", "oos_test")
#: the intent of every out-of-scope query
OOS_LABEL = "oos"


def read_clinc150(path) -> dict[str, tuple[list[str], list[str]]]:
    """{key: (texts, intents)} for the six lists of ``data_full.json`` at ``path``; ``ValueError`` naming the
    file, list and row on a malformed file."""
    with open(path, encoding="utf-8") as handle:
        raw = json.load(handle)
    if not isinstance(raw, dict) or set(CLINC150_KEYS) - set(raw):
        raise ValueError(f"{path}: expected a JSON object with keys {list(CLINC150_KEYS)}")
    out = {}
    for key in CLINC150_KEYS:
        texts, intents = [], []
        for row, pair in enumerate(raw[key]):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, str) for v in pair)):
                raise ValueError(f"{path}: {key}[{row}] must be a [text, intent] pair of strings, got {pair!r}")
            oos = key.startswith("oos_")
            if (pair[1] == OOS_LABEL) != oos:
                raise ValueError(f"{path}: {key}[{row}] has intent {pair[1]!r}; oos_* lists hold only {OOS_LABEL!r}, "
                                 f"the others never")
            texts.append(pair[0])
            intents.append(pair[1])
        out[key] = (texts, intents)
    return out


@register_dataset("clinc150")
def load_clinc150(
    *,
    data_dir,
    download: bool,
    seed: int,
    max_len: int = 32,
    min_freq: int = 1,
    max_vocab_size=None,
    verify_checksum: bool = True,
    ood_val: bool = False,
) -> DatasetBundle:
    """CLINC150's 150 in-scope intents as a text-classification bundle on the official splits, with the
    1,000 ``oos_test`` queries as the OOD split ``ood`` (label -1).

    train = ``train`` (15,000), val = ``val`` (3,000, for early stopping and temperature scaling), test =
    ``test`` (4,500); with ``ood_val=True`` (the ``clinc150-minilm`` preset's) the 100 ``oos_val`` queries are
    ``ood_val`` (label -1), the OOD validation split on which choices about OOD detection are made (never
    reported; off by default: the data set of the runs before it existed); ``oos_train`` is not used (no model
    here trains on out-of-scope queries; ``info["raw_sizes"]`` counts it). Class ids are the intents in sorted order
    (``info["class_names"]``). ``seed`` changes nothing (the splits are the official ones); it is recorded.
    Queries are short (at most 28 words in the file), so ``max_len`` 32 truncates none.
    ``verify_checksum=False`` skips the SHA-256 check of an existing file (for a synthetic one from
    :func:`gpattn.experiments.data.fixtures_clinc.make_clinc150_json`); a download is always verified.
    """
    if not isinstance(verify_checksum, bool):
        raise ValueError(f"verify_checksum must be a bool, got {verify_checksum!r}")
    path = Path(data_dir) / CLINC150_FILENAME
    provenance = fetch_archive(CLINC150_URL, path, CLINC150_SHA256, download, verify_checksum)
    raw = read_clinc150(path)
    class_names = sorted(set(raw["train"][1]))
    to_id = {name: i for i, name in enumerate(class_names)}
    for key in ("val", "test"):
        unseen = sorted(set(raw[key][1]) - set(to_id))
        if unseen:
            raise ValueError(f"{path}: {key} has intents that train lacks: {unseen[:5]}")
    if not isinstance(ood_val, bool):
        raise ValueError(f"ood_val must be True or False, got {ood_val!r}")
    texts = {"train": raw["train"][0], "val": raw["val"][0], "test": raw["test"][0], "ood": raw["oos_test"][0],
             **({"ood_val": raw["oos_val"][0]} if ood_val else {})}  # fmt: skip
    labels = {key: [to_id[v] for v in raw[key][1]] for key in ("train", "val", "test")}
    labels.update({key: [-1] * len(texts[key]) for key in ("ood", "ood_val") if key in texts})
    info = {
        **provenance,
        "seed": seed,
        "class_names": class_names,
        "raw_sizes": {key: len(value[0]) for key, value in raw.items()},
        "ood_source": "oos_test",
        **({"ood_val_source": "oos_val"} if ood_val else {}),
    }
    return build_text_bundle(
        "clinc150",
        texts,
        labels,
        num_classes=len(class_names),
        eval_splits={"in_domain": "test", "ood": "ood"},
        ood_splits=("ood",),
        info=info,
        max_len=max_len,
        min_freq=min_freq,
        max_vocab_size=max_vocab_size,
    )
