"""Small synthetic files in the exact formats the loaders read, for tests and offline demos.

- :func:`make_cola_zip` writes an archive laid out like the official ``cola_public_1.1.zip``
  (same member names, tab-separated 4 columns without header, labels 0/1, a ``tokenized/`` copy and a
  README); load it with ``load_dataset("cola", data_dir=..., verify_checksum=False)``. Its dev and
  out-of-domain files use a few nouns that never occur in its train file (:data:`DEV_ONLY_WORDS`,
  :data:`OOD_ONLY_WORDS`), so "vocabulary from train only" is testable.
- :func:`make_text_table` writes a TSV/CSV of (text, label) rows for ``text_table``.

Both are deterministic given ``seed`` (the zip's bytes included: fixed member timestamps).
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpattn.experiments.data.cola import COLA_FILENAME, COLA_MEMBERS

__all__ = ["DEV_ONLY_WORDS", "OOD_ONLY_WORDS", "make_cola_zip", "make_text_table", "write_table_tokenizer"]

_NOUNS = (
    "cat",
    "dog",
    "teacher",
    "student",
    "book",
    "garden",
    "river",
    "doctor",
    "child",
    "letter",
    "city",
    "song",
    "farmer",
    "painter",
    "car",
    "table",
)
#: words that occur only in the synthetic CoLA fixture's dev split (out-of-vocabulary checks)
DEV_ONLY_WORDS = ("platypus", "zeppelin", "harpsichord")
#: words that occur only in the synthetic CoLA fixture's out-of-domain split
OOD_ONLY_WORDS = ("quasar", "xylophone", "marmalade")
_NAMES = ("John", "Mary", "Sandy", "Bill", "José")
_ADJECTIVES = ("old", "happy", "red", "quiet", "tall", "clever", "small")
_VERBS = ("saw", "liked", "found", "wrote", "carried", "painted", "followed", "heard")
_PREPOSITIONS = ("near", "behind", "under", "with", "beside")
_IN_SOURCES = ("gj04", "bc01", "ks08", "l-93")
_OUT_SOURCES = ("clc95", "swb04", "w_80")
_TIMESTAMP = (2018, 12, 14, 17, 28, 0)
_README = """CoLA (synthetic test fixture written by gpattn.experiments.data.fixtures.make_cola_zip)

Same layout and format as the public CoLA v1.1 archive, random sentences from a toy grammar.
Each line in the .tsv files consists of 4 tab-separated columns.
Column 1:\tthe code representing the source of the sentence.
Column 2:\tthe acceptability judgment label (0=unacceptable, 1=acceptable).
Column 3:\tthe acceptability judgment as originally notated by the author.
Column 4:\tthe sentence.
"""


def _sentence(rng: np.random.Generator, nouns: Sequence[str], special: str | None) -> list[str]:
    def noun_phrase(noun=None):
        if rng.random() < 0.2:
            return [str(rng.choice(_NAMES))]
        words = [str(rng.choice(("the", "a")))]
        if rng.random() < 0.5:
            words.append(str(rng.choice(_ADJECTIVES)))
        return words + [noun or str(rng.choice(nouns))]

    words = noun_phrase()
    if rng.random() < 0.2:
        words += ["didn't", str(rng.choice(("see", "like", "find")))]
    else:
        words.append(str(rng.choice(_VERBS)))
    words += noun_phrase(special)
    for _ in range(int(rng.geometric(0.35)) - 1):  # 0, 1, 2, ... prepositional phrases; a few long ones
        words += [str(rng.choice(_PREPOSITIONS))] + noun_phrase()
    if rng.random() < 0.1:
        words += [",", '"', "indeed", '"']
    return words


def _render(words: list[str]) -> str:
    text = " ".join(words).replace(" ,", ",").replace('" indeed "', '"indeed"')
    return text[0].upper() + text[1:] + "."


def _cola_rows(rng, n: int, sources, nouns, special_words) -> list[tuple[str, int, str, str]]:
    rows = []
    for i in range(n):
        special = None
        if special_words and (i == 0 or rng.random() < 0.4):
            special = str(rng.choice(special_words))
        words = _sentence(rng, nouns, special)
        label = int(rng.random() < 0.7)
        mark = ""
        if not label:  # make it ungrammatical: swap two words or drop one
            if rng.random() < 0.5 and len(words) > 2:
                i1, i2 = rng.choice(len(words), size=2, replace=False)
                words[i1], words[i2] = words[i2], words[i1]
            else:
                del words[int(rng.integers(1, len(words)))]
            mark = str(rng.choice(("*", "*", "??")))
        rows.append((str(rng.choice(sources)), label, mark, _render(words)))
    return rows


def _tsv(rows, tokenized: bool, final_newline: bool) -> bytes:
    lines = []
    for source, label, mark, sentence in rows:
        if tokenized:
            sentence = " ".join(re.findall(r"[\w']+|[^\w\s]", sentence.lower()))
        lines.append(f"{source}\t{label}\t{mark}\t{sentence}")
    return ("\n".join(lines) + ("\n" if final_newline else "")).encode("utf-8")


def _zip_entry(name: str, is_dir: bool = False) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_TIMESTAMP)
    info.compress_type = zipfile.ZIP_STORED if is_dir else zipfile.ZIP_DEFLATED
    info.external_attr = ((0o40755 << 16) | 0x10) if is_dir else (0o644 << 16)
    return info


def make_cola_zip(path, n_train: int = 200, n_dev: int = 60, n_ood: int = 40, seed: int = 0) -> Path:
    """Write a synthetic ``cola_public_1.1.zip`` and return its path.

    ``path`` is the archive's file name (ending in ``.zip``) or a directory, in which the archive is
    named ``cola_public_1.1.zip`` (the name the loader looks for). Sizes: ``n_train`` in-domain train,
    ``n_dev`` in-domain dev, ``n_ood`` out-of-domain dev rows; about 70 % are acceptable (label 1).
    """
    for name, n in (("n_train", n_train), ("n_dev", n_dev), ("n_ood", n_ood)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    path = Path(path)
    if path.suffix != ".zip":
        path = path / COLA_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tables = {
        "in_domain_train": _cola_rows(rng, n_train, _IN_SOURCES, _NOUNS, ()),
        "in_domain_dev": _cola_rows(rng, n_dev, _IN_SOURCES, _NOUNS, DEV_ONLY_WORDS),
        "out_of_domain_dev": _cola_rows(rng, n_ood, _OUT_SOURCES, _NOUNS, OOD_ONLY_WORDS),
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(_zip_entry("cola_public/", True), b"")
        archive.writestr(_zip_entry("cola_public/README"), _README.encode("utf-8"))
        for folder, tokenized in (("tokenized", True), ("raw", False)):
            archive.writestr(_zip_entry(f"cola_public/{folder}/", True), b"")
            for key, rows in tables.items():
                # The official out_of_domain_dev.tsv has no final newline; keep that quirk.
                data = _tsv(rows, tokenized, final_newline=key != "out_of_domain_dev")
                member = COLA_MEMBERS[key].replace("/raw/", f"/{folder}/")
                archive.writestr(_zip_entry(member), data)
    path.write_bytes(buffer.getvalue())
    return path


_CLASS_WORDS = {
    0: ("awful", "boring", "dull", "bad", "tedious"),
    1: ("fine", "okay", "average", "plain", "so-so"),
    2: ("great", "wonderful", "superb", "good", "delightful"),
}


def make_text_table(
    path,
    n: int = 120,
    seed: int = 0,
    class_names: Sequence[str] = ("negative", "neutral", "positive"),
    columns: Sequence[str] = ("text", "label"),
    header: bool = True,
    delimiter: str | None = None,
) -> Path:
    """Write ``n`` rows of review-like text with class-dependent words and return ``path``.

    ``columns`` orders the written columns among "id", "text", "label" (leave "label" out for an
    unlabelled table). ``delimiter`` defaults to tab for ``.tsv`` and comma otherwise; the CSV is
    written with standard quoting (texts contain commas and quotes). Up to three classes.
    """
    if not 2 <= len(class_names) <= len(_CLASS_WORDS):
        raise ValueError(f"class_names must name 2..{len(_CLASS_WORDS)} classes, got {tuple(class_names)}")
    unknown = set(columns) - {"id", "text", "label"}
    if unknown or "text" not in columns:
        raise ValueError(f"columns must include 'text' and be among 'id', 'text', 'label'; got {tuple(columns)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    delim = delimiter or ("\t" if path.suffix.lower() == ".tsv" else ",")
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        quoting = csv.QUOTE_NONE if delim == "\t" else csv.QUOTE_MINIMAL
        writer = csv.writer(handle, delimiter=delim, quoting=quoting, escapechar=None, lineterminator="\n")
        if header:
            writer.writerow(columns)
        for i in range(n):
            k = i % len(class_names)  # balanced classes
            words = _CLASS_WORDS[k]
            text = (
                f"The film was {rng.choice(words)}, the cast {rng.choice(words)}"
                f"{', and the ending' if rng.random() < 0.5 else ''} {rng.choice(words)}!"
            )
            if rng.random() < 0.2 and delim != "\t":
                text = f'"{text}" said a critic.'
            cell = {"id": str(i), "text": text, "label": class_names[k]}
            writer.writerow([cell[c] for c in columns])
    return path


def write_table_tokenizer(table, folder) -> int:
    """Write a WordPiece tokenizer (``transformers.BertTokenizerFast``) whose vocabulary is BERT's five special
    tokens and the words of ``table`` (a TSV with a ``text`` column, e.g. :func:`make_text_table`) into
    ``folder``, for tiny random encoders in tests and benchmarks (no downloads). Returns the vocabulary size."""
    import transformers

    from gpattn.experiments.data._text import tokenize

    with open(table, encoding="utf-8") as f:
        words = sorted({w for row in csv.DictReader(f, delimiter="\t") for w in tokenize(row["text"])})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    # from the folder: transformers 5 builds BertTokenizerFast(vocab_file=...) of the specials alone (every word [UNK])
    transformers.BertTokenizerFast.from_pretrained(folder).save_pretrained(folder)
    return len(vocab)
