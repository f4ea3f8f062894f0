"""``text_table``: your own (text, label) table, TSV or CSV, as a text-classification bundle."""

from __future__ import annotations

import csv
import re
from pathlib import Path

from gpattn.data._bundle import DataNotFoundError, DatasetBundle, register_dataset
from gpattn.data._split import check_fraction, stratified_split
from gpattn.data._text import build_text_bundle

__all__ = ["load_text_table", "read_table"]

Column = str | int | None
_DELIMITERS = {".tsv": "\t", ".tab": "\t", ".csv": ","}
_INT = re.compile(r"[+-]?\d+")


def _delimiter_for(path: Path, delimiter: str | None) -> str:
    if delimiter is not None:
        if not isinstance(delimiter, str) or len(delimiter) != 1:
            raise ValueError(f"delimiter must be a single character, got {delimiter!r}")
        return delimiter
    suffix = path.suffix.lower()
    if suffix not in _DELIMITERS:
        raise ValueError(
            f"cannot infer the delimiter of {path} from its extension {suffix!r} (known: "
            f"{', '.join(_DELIMITERS)}); pass delimiter=..."
        )
    return _DELIMITERS[suffix]


def read_table(path, delimiter: str | None = None, header: bool = True, encoding: str = "utf-8"):
    """(column names or None, rows as lists of str, first data line number) of a delimited file.

    A tab-delimited file is read without quote processing (quotes are text, as in CoLA's TSVs);
    any other delimiter uses the CSV quoting rules. Blank lines are skipped.
    """
    path = Path(path)
    delim = _delimiter_for(path, delimiter)
    quoting = csv.QUOTE_NONE if delim == "\t" else csv.QUOTE_MINIMAL
    with open(path, newline="", encoding=encoding) as handle:
        rows = list(_numbered(csv.reader(handle, delimiter=delim, quoting=quoting)))
    if header:
        if not rows:
            raise ValueError(f"{path} is empty; expected a header row")
        names = [name.strip() for name in rows[0][1]]
        return names, rows[1:]
    return None, rows


def _numbered(reader):
    for row in reader:
        if row and any(cell.strip() for cell in row):
            yield reader.line_num, row


def _column_index(column: Column, names: list[str] | None, width: int, role: str, path: Path) -> int:
    found = names if names is not None else f"{width} unnamed columns (header=False)"
    if isinstance(column, bool) or not isinstance(column, (str, int)):
        raise ValueError(f"{role} must be a column name or index, got {column!r}")
    if isinstance(column, int):
        if not 0 <= column < width:
            raise ValueError(f"{role}={column} is out of range for {path}; columns found: {found}")
        return column
    if names is None or column not in names:
        raise ValueError(f"{role}={column!r} not found in {path}; columns found: {found}")
    return names.index(column)


def _resolve_columns(text_column: Column, label_column: Column, names, width, path, need_label=True):
    if label_column is None:
        label_column = "label" if names is not None else 1
    label_idx = None
    if need_label:
        label_idx = _column_index(label_column, names, width, "label_column", path)
    if text_column is None:
        if names is not None and "text" in names:
            text_column = "text"
        elif width == 2 and label_idx is not None:
            text_column = 1 - label_idx
        else:
            found = names if names is not None else f"{width} unnamed columns"
            raise ValueError(
                f"cannot tell which column of {path} holds the text; pass text_column= (columns found: {found})"
            )
    text_idx = _column_index(text_column, names, width, "text_column", path)
    return text_idx, label_idx


def _cells(rows, index: int, path: Path, role: str) -> list[str]:
    out = []
    for line, row in rows:
        if index >= len(row):
            raise ValueError(f"{path} line {line}: {len(row)} columns, no {role} column (index {index})")
        out.append(row[index])
    return out


def _find(path, data_dir) -> Path:
    path = Path(path).expanduser()
    candidates = [path] if path.is_absolute() else [path, Path(data_dir) / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DataNotFoundError(
        f"text table not found: tried {', '.join(str(c) for c in candidates)}. Pass path= an existing "
        f"TSV/CSV file (a relative path is looked up in the working directory, then in data_dir)."
    )


def _sort_labels(values) -> list[str]:
    unique = set(values)
    if all(_INT.fullmatch(v) for v in unique):
        return sorted(unique, key=int)
    return sorted(unique)


@register_dataset("text_table")
def load_text_table(
    *,
    data_dir,
    download: bool,
    seed: int,
    path,
    text_column: Column = None,
    label_column: Column = None,
    delimiter: str | None = None,
    header: bool = True,
    ood_file=None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    max_len: int = 256,
    min_freq: int = 1,
    max_vocab_size: int | None = None,
    encoding: str = "utf-8",
) -> DatasetBundle:
    """A (text, label) table split stratified and seeded into train / val / test.

    ``path``: a ``.tsv``/``.tab``/``.csv`` file (else pass ``delimiter``); relative paths are tried in
    the working directory, then in ``data_dir``. Columns are names (with ``header=True``) or 0-based
    indices: ``label_column`` defaults to "label" (index 1 without a header); ``text_column`` to
    "text", else the other column of a two-column table (index 0 without a header). Labels may be any
    strings: the sorted unique labels (numerically if all are integers) become 0..K-1 and
    ``info["class_names"]`` keeps the names. ``ood_file`` (same columns) becomes split "ood", with
    its labels where the label column exists and is a known class, else -1. Vocabulary from train only.
    """
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=False)
    test_fraction = check_fraction("test_fraction", test_fraction, allow_zero=False)
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}")
    if not isinstance(header, bool):
        raise ValueError(f"header must be a bool, got {header!r}")
    table = _find(path, data_dir)
    names, rows = read_table(table, delimiter, header, encoding)
    if not rows:
        raise ValueError(f"{table} has no data rows")
    width = len(names) if names is not None else max(len(r) for _, r in rows)
    text_idx, label_idx = _resolve_columns(text_column, label_column, names, width, table)
    texts = _cells(rows, text_idx, table, "text")
    raw_labels = [cell.strip() for cell in _cells(rows, label_idx, table, "label")]
    for (line, _), value in zip(rows, raw_labels):
        if not value:
            raise ValueError(f"{table} line {line}: empty label")
    class_names = _sort_labels(raw_labels)
    if len(class_names) < 2:
        raise ValueError(f"{table} has a single label value {class_names}; need at least 2 classes")
    to_id = {name: i for i, name in enumerate(class_names)}
    label_ids = [to_id[v] for v in raw_labels]

    tr, va, te = stratified_split(label_ids, (val_fraction, test_fraction), seed)
    split_texts = {key: [texts[i] for i in idx] for key, idx in (("train", tr), ("val", va), ("test", te))}
    split_labels = {key: [label_ids[i] for i in idx] for key, idx in (("train", tr), ("val", va), ("test", te))}
    eval_splits, ood_splits = {"in_domain": "test"}, ()
    info = {"source": str(table), "class_names": class_names, "seed": seed, "max_len": max_len}

    if ood_file is not None:
        ood_table = _find(ood_file, data_dir)
        ood_names, ood_rows = read_table(ood_table, delimiter, header, encoding)
        if not ood_rows:
            raise ValueError(f"{ood_table} has no data rows")
        ood_width = len(ood_names) if ood_names is not None else max(len(r) for _, r in ood_rows)
        # The OOD table uses the main table's columns: by name with a header, else by index.
        ood_text = names[text_idx] if names is not None and not isinstance(text_column, int) else text_idx
        ood_label = names[label_idx] if names is not None and not isinstance(label_column, int) else label_idx
        if isinstance(ood_label, str):
            has_label = ood_names is not None and ood_label in ood_names
        else:
            has_label = ood_label < ood_width
        ood_text_idx, ood_label_idx = _resolve_columns(
            ood_text, ood_label, ood_names, ood_width, ood_table, need_label=has_label
        )
        split_texts["ood"] = _cells(ood_rows, ood_text_idx, ood_table, "text")
        if has_label:
            ood_raw = [c.strip() for c in _cells(ood_rows, ood_label_idx, ood_table, "label")]
            split_labels["ood"] = [to_id.get(v, -1) for v in ood_raw]
        else:
            split_labels["ood"] = [-1] * len(ood_rows)
        info["ood_source"] = str(ood_table)
        info["ood_labelled"] = has_label
        info["ood_unknown_labels"] = sum(v == -1 for v in split_labels["ood"])
        eval_splits["ood"] = "ood"
        ood_splits = ("ood",)

    return build_text_bundle(
        "text_table",
        split_texts,
        split_labels,
        num_classes=len(class_names),
        eval_splits=eval_splits,
        ood_splits=ood_splits,
        info=info,
        max_len=max_len,
        min_freq=min_freq,
        max_vocab_size=max_vocab_size,
    )
