"""``text_table``: your own (text, label) table, TSV or CSV, as a text-classification bundle."""

from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import re
from collections import Counter
from pathlib import Path

from gpattn.experiments._io import file_sha256
from gpattn.experiments.data._bundle import DatasetBundle, register_dataset
from gpattn.experiments.data._label_checks import check_label_spellings
from gpattn.experiments.data._split import check_fraction, stratified_split
from gpattn.experiments.data._table_hints import (
    PER_FILE,
    delimiter_hint,
    find_table,
    option,
    sniff_delimiter,
    suggest_encoding,
)
from gpattn.experiments.data._text import build_text_bundle
from gpattn.experiments.data._text_checks import C1_POLICIES, check_c1, check_misread_utf8, warn_small_splits

__all__ = ["load_text_table", "read_table"]

Column = str | int | None
_DELIMITERS = {".tsv": "\t", ".tab": "\t", ".csv": ","}
_INT = re.compile(r"[+-]?\d+")
#: what people type for a delimiter -> the character (a single character is accepted as itself)
DELIMITER_NAMES = {
    "tab": "\t", "\\t": "\t", "tsv": "\t", "comma": ",", "csv": ",", "semicolon": ";", "pipe": "|",
    "space": " ", "colon": ":",
}
#: cells of a first row that name columns (a header row), not data
COLUMN_WORDS = {"label", "labels", "class", "target", "y", "category", "sentiment", "text", "sentence"}
_TRUE = ("true", "yes", "y", "on", "1")
_FALSE = ("false", "no", "n", "off", "0")
#: ``unknown_labels``: what to do with a label of an evaluation file (``shift_file``, ``ood_file``) that
#: the training file never had
UNKNOWN_LABELS = ("error", "drop", "unlabelled")
#: a first row (header=False) whose label occurs once among at least this many rows is taken for a header
_HEADER_MIN_ROWS = 20
#: ``bad_rows``: what to do with a row whose number of cells differs from the header's (a TAB or delimiter
#: inside a text) or whose text is empty or only whitespace
BAD_ROWS = ("error", "skip")
#: ``disjoint_labels``: pooled files (``path`` a list) whose label sets share no label
DISJOINT_LABELS = ("error", "allow")
#: default ``min_class_count``: a label with fewer examples than this is an error (a typo, a fragment of a
#: text read as a label, or a class too small to reach every split)
MIN_CLASS_COUNT = 3


#: every option of ``text_table``: accepted values and meaning (``gpattn data text_table`` prints it)
OPTION_HELP = {
    "path": "required. The training table: a .tsv/.tab/.csv file, or a list of files pooled before "
    "splitting (CLI: path=data/a.tsv or path=\"['a.tsv','b.tsv']\"). A relative path is tried in the "
    "working directory, then in --data-dir.",
    "text_column": "column name (header=True) or 0-based index of the text. Default: 'text', else the "
    "other column of a two-column table.",
    "label_column": "column name (header=True) or 0-based index of the label. Default: 'label' with a "
    "header, index 1 without.",
    "delimiter": "the training file's (path): a single character or a name: tab (also \\t), comma, semicolon, "
    "pipe, space, colon. Default: from each file's extension (.tsv/.tab tab, .csv comma). Tab files are read "
    "without quote processing; other delimiters use CSV quoting. shift_file and ood_file use it unless "
    "shift_delimiter / ood_delimiter say otherwise.",
    "header": "whether the training file's (path) first row holds column names: true/false, yes/no, 1/0, on/off "
    "(any case). Default true. A first row that contradicts the setting is an error naming the line. shift_file "
    "and ood_file use it unless shift_header / ood_header say otherwise.",
    "shift_file": "a labelled file with the same columns, evaluated as split 'shift' (distribution "
    "shift: accuracy, NLL, ECE).",
    "ood_file": "a file with the same columns (the label column may be absent), evaluated as split "
    "'ood' (OOD detection against the test split; classification metrics where labelled).",
    "unknown_labels": "what to do with labels of shift_file/ood_file that training never saw: "
    "'error' (default: stop, naming file and line), 'drop' (leave those rows out), 'unlabelled' (keep "
    "them with label -1; classification metrics use the labelled rows). The report says how many.",
    "val_fraction": "fraction of each class held out for validation (temperature scaling, Laplace "
    "prior), 0 < x < 1; default 0.1.",
    "test_fraction": "fraction of each class held out as the in-domain test split, 0 < x < 1; default 0.2.",
    "max_len": "tokens kept per text (the first max_len); default 256.",
    "min_freq": "a word enters the vocabulary if it occurs at least this often in train; default 1.",
    "max_vocab_size": "keep at most this many words (most frequent first); default None (all).",
    "encoding": "text encoding of the training file(s) (path); default utf-8 (a leading byte-order mark is "
    "dropped). A file that does not decode is an error naming its line and the encoding it decodes in; cp1252 reads "
    "most Western European files. shift_file and ood_file use it unless shift_encoding / ood_encoding say otherwise.",
    "c1_characters": "C1 control characters (U+0080-U+009F) in the decoded text of any file, which ordinary text "
    "never holds (mojibake, or a cp1252 file read as latin-1): 'error' (default: stop, naming each by code point "
    "and line, with the fix that fits the file), 'keep' (keep them as they are, on purpose), or 'repair' (read each "
    "as the cp1252 character of its code: U+0096 as an en dash).",
    **{f"{role}_{name}": f"{name} of {role}_file alone (default None: the training file's); an evaluation file "
       f"from another source often differs, e.g. {role}_{example}"
       for role in ("shift", "ood") for name, example in zip(PER_FILE, (
           "header=false for a file without a header row", "delimiter=tab for a .txt file of one text per line",
           "encoding=cp1252 for a file saved by Windows software"))},
    "bad_rows": "what to do with a row whose number of cells differs from the header's (a TAB or delimiter "
    "inside a text, a missing cell) or whose text is empty or only whitespace: 'error' (default: stop, naming "
    "the file and lines) or 'skip' (leave those rows out; the report lists how many and which lines).",
    "min_class_count": f"a training label with fewer rows than this (summed over pooled files) is an error "
    f"naming it and its lines (a typo, or a text fragment read as a label); default {MIN_CLASS_COUNT}. "
    "Pass 1 to allow rare classes (a class may then be absent from the validation or test split).",
    "disjoint_labels": "pooled files (path a list) whose label sets share no label (e.g. 0/1 in one file, "
    "neg/pos in the other): 'error' (default, naming the files and their labels) or 'allow' (one file per "
    "class, say).",
    "label_spellings": "training labels equal as numbers (1 / 1.0), equal up to case or whitespace (Positive / "
    "positive), or spelling a missing value (nan, NA, null, None): 'error' (default, naming the spellings and "
    "lines) or 'allow' (each spelling is a class of its own, on purpose).",
}


def parse_bool(name: str, value) -> bool:
    """``value`` as a bool: True/False, 1/0, or the strings true/false, yes/no, y/n, on/off, 1/0 in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(
        f"{name} must be a boolean, got {value!r}; accepted: True/False, 1/0, or (any case) "
        f"{'/'.join(_TRUE)} for true and {'/'.join(_FALSE)} for false"
    )


def parse_delimiter(delimiter) -> str | None:
    """None (from the file extension), a single character, or a name of :data:`DELIMITER_NAMES`."""
    if delimiter is None:
        return None
    if isinstance(delimiter, str):
        if len(delimiter) == 1:
            return delimiter
        key = delimiter.strip().lower() if delimiter.strip() else delimiter
        if key in DELIMITER_NAMES:
            return DELIMITER_NAMES[key]
    names = ", ".join(repr(k) for k in DELIMITER_NAMES)
    raise ValueError(
        f"delimiter must be a single character or one of the names {names}, got {delimiter!r} "
        f"(leave it unset to infer it from the extension: {', '.join(_DELIMITERS)})"
    )


def _delimiter_for(path: Path, delimiter: str | None, role: str = "train") -> str:
    if delimiter is not None:
        return parse_delimiter(delimiter)
    suffix = path.suffix.lower()
    if suffix not in _DELIMITERS:
        raise ValueError(
            f"cannot infer the delimiter of {path} from its extension {suffix!r} (known: "
            f"{', '.join(_DELIMITERS)}); pass {option(role, 'delimiter')}=... (a character, or tab, comma, semicolon, "
            f"pipe){sniff_delimiter(path, role, COLUMN_WORDS)}"
        )
    return _DELIMITERS[suffix]


def read_table(path, delimiter: str | None = None, header: bool = True, encoding: str = "utf-8",
               c1_characters: str = "error", role: str = "train"):
    """(column names or None, rows as (line number, list of str)) of a delimited file.

    A tab-delimited file is read without quote processing (quotes are text, as in CoLA's TSVs);
    any other delimiter uses the CSV quoting rules. Blank lines are skipped. A cell may be as long as the file
    (the csv module's 131072-character limit is lifted for the read). ``role`` (train, shift, ood) names the
    options in the errors' hints.
    """
    path = Path(path)
    header = parse_bool("header", header)
    delim = _delimiter_for(path, delimiter, role)
    quoting = csv.QUOTE_NONE if delim == "\t" else csv.QUOTE_MINIMAL
    text = decode_file(path, encoding, c1_characters, role)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delim, quoting=quoting)
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))  # one text may be a whole file; restored below
    try:
        rows = list(_numbered(reader))
    except csv.Error as err:
        raise ValueError(
            f"{path} line {reader.line_num + 1}: the {'TAB' if delim == chr(9) else repr(delim)}-delimited reader "
            f"failed ({err}); check that line's quotes (an unclosed quote joins the lines after it) or the "
            f"delimiter ({option(role, 'delimiter')}=...)"
        ) from None
    finally:
        csv.field_size_limit(limit)
    if header:
        if not rows:
            raise ValueError(f"{path} is empty; expected a header row")
        names = [name.strip() for name in rows[0][1]]
        return names, rows[1:]
    return None, rows


def decode_file(path, encoding: str = "utf-8", c1_characters: str = "error", role: str = "train") -> str:
    """The text of ``path`` in ``encoding``, without a leading byte-order mark; bytes that do not decode are
    a ``ValueError`` naming the file, the line and the bytes, and the encoding they decode in; C1 control
    characters as ``c1_characters`` says (:func:`gpattn.experiments.data._text_checks.check_c1`)."""
    path = Path(path)
    name = option(role, "encoding")
    try:
        codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise ValueError(f"{name}={encoding!r} is not a text encoding Python knows (e.g. 'utf-8', 'latin-1', "
                         f"'cp1252', 'utf-16')") from None
    data = path.read_bytes()
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        start = data.rfind(b"\n", 0, err.start) + 1
        column = len(data[start : err.start].decode(encoding, errors="replace")) + 1
        utf8 = encoding.lower().replace("_", "-") in ("utf-8", "utf8", "utf-8-sig")
        suggest = suggest_encoding(data, role) if utf8 else f"{name}='utf-8' (--dataset-option {name}=utf-8)"
        raise ValueError(
            f"{path} line {line}, column {column}: bytes {data[err.start:err.end]!r} are not valid {encoding} "
            f"({err.reason}). Pass the file's encoding as a data set option, e.g. {suggest}, or re-save the file "
            f"as UTF-8."
        ) from None
    text = text[1:] if text.startswith("\ufeff") else text
    check_misread_utf8(path, data, text, encoding, role)  # cp1252 or latin-1 on a UTF-8 file
    return check_c1(path, data, text, encoding, c1_characters, role)


def _numbered(reader):
    for row in reader:
        if row and any(cell.strip() for cell in row):
            yield reader.line_num, row


@dataclasses.dataclass(frozen=True)
class _Where:
    """A file being read, as the hints need it: its path, role (train, shift, ood), delimiter and line 1's cells."""

    path: Path
    role: str
    delim: str
    first: list

    def header_hint(self, names) -> str:
        """What to pass when line 1 (read as column names ``names``) is data; the delimiter first if line 1 holds
        another one in a single cell (the header hint would then lead to a second error)."""
        other = delimiter_hint(self.first, self.delim, self.role)
        if other or names is None:
            return other
        then = ("and name the columns by index (text_column=0, label_column=1)" if self.role == "train" else
                "(this file alone: header is the training file's; its columns are then read at the training file's "
                "positions, and a one-column file is its texts)")
        return (f". If {self.path} has no header row (its line 1 {names} is data), pass "
                f"{option(self.role, 'header')}=false {then}")


def _column_index(column: Column, names: list[str] | None, width: int, which: str, where: _Where) -> int:
    found = names if names is not None else f"{width} unnamed columns ({option(where.role, 'header')}=False)"
    if isinstance(column, bool) or not isinstance(column, (str, int)):
        raise ValueError(f"{which} must be a column name or index, got {column!r}")
    if isinstance(column, int):
        if not 0 <= column < width:
            raise ValueError(f"{which}={column} is out of range for {where.path}; columns found: {found}"
                             + delimiter_hint(where.first, where.delim, where.role))
        return column
    if names is None or column not in names:
        raise ValueError(f"{which}={column!r} not found in {where.path}; columns found (line 1): {found}"
                         + where.header_hint(names))
    return names.index(column)


def _resolve_columns(text_column: Column, label_column: Column, names, width, where: _Where, need_label=True):
    if label_column is None:
        label_column = "label" if names is not None else 1
    label_idx = None
    if need_label:
        label_idx = _column_index(label_column, names, width, "label_column", where)
    if text_column is None:
        if names is not None and "text" in names:
            text_column = "text"
        elif width == 2 and label_idx is not None:
            text_column = 1 - label_idx
        else:
            found = f"{names} (line 1)" if names is not None else f"{width} unnamed columns"
            raise ValueError(
                f"cannot tell which column of {where.path} holds the text; pass text_column= (columns found: "
                f"{found})" + ("; a row with a TAB or delimiter inside its text has more cells" if width > 2 else "")
                + delimiter_hint(where.first, where.delim, where.role)
            )
    text_idx = _column_index(text_column, names, width, "text_column", where)
    return text_idx, label_idx


def _cells(rows, index: int, path: Path, role: str) -> list[str]:
    out = []
    for line, row in rows:
        if index >= len(row):
            raise ValueError(f"{path} line {line}: {len(row)} columns, no {role} column (index {index})")
        out.append(row[index])
    return out


def _sort_labels(values) -> list[str]:
    unique = set(values)
    if all(_INT.fullmatch(v) for v in unique):
        return sorted(unique, key=int)
    return sorted(unique)


def file_record(path: Path, role: str, rows: int) -> dict:
    """What the report says about a data file: role, path, size in bytes, SHA-256 of its content, rows."""
    return {"role": role, "path": str(Path(path).resolve()), "bytes": path.stat().st_size,
            "sha256": file_sha256(path), "rows": rows}


def _check_header(path: Path, header: bool, header_line, names, rows, label_idx, label_column, text_idx,
                  role: str = "train") -> None:
    """Refuse a header setting that the file contradicts (instead of losing or inventing a row)."""
    opt = option(role, "header")
    labels = [row[label_idx].strip() for _, row in rows if label_idx < len(row)]
    counts = Counter(labels)
    if header and isinstance(label_column, int) and names is not None:
        cell = names[label_idx]
        if cell in counts:
            raise ValueError(
                f"{path} line {header_line}: {opt}=True, but this first row looks like data: its label cell "
                f"{cell!r} (label_column={label_column}) is also the label of {counts[cell]} other row(s). "
                f"Pass {opt}=False if the file has no header row (or name the column, label_column='...', "
                f"if it does)."
            )
    if not header and rows:
        line, first = rows[0]
        value = first[label_idx].strip() if label_idx < len(first) else ""
        looks_named = value.lower() in COLUMN_WORDS or (
            text_idx < len(first) and first[text_idx].strip().lower() in COLUMN_WORDS
        )
        rare = counts[value] == 1 and len(labels) >= _HEADER_MIN_ROWS and min(
            (c for v, c in counts.items() if v != value), default=0
        ) >= 2
        if looks_named or rare:
            why = (
                f"its cells {[c.strip() for c in first]} look like column names"
                if looks_named
                else f"its label {value!r} occurs in no other of the {len(labels)} rows"
            )
            raise ValueError(
                f"{path} line {line}: {opt}=False, but this first row looks like a header row: {why}. "
                f"Pass {opt}=True{' (the default)' if role == 'train' else ''} to read it as column names; if it "
                f"is data, it would be a class with one example."
            )


def _shown_lines(lines, limit: int = 5) -> str:
    shown = ", ".join(map(str, lines[:limit]))
    return shown + (f" and {len(lines) - limit} more" if len(lines) > limit else "")


def _bad_rows(path: Path, rows, width: int, text_idx: int, bad_rows: str, delim_name: str, basis: str = "the header"):
    """``rows`` less the ragged rows (a cell count other than ``width``) and the rows with an empty text:
    an error naming the lines (``bad_rows="error"``), or left out and returned as ``{"rows", "lines"}``."""
    ragged = [(line, len(row)) for line, row in rows if len(row) != width]
    empty = [line for line, row in rows if len(row) == width and not row[text_idx].strip()]
    if (ragged or empty) and bad_rows == "error":
        parts = []
        if ragged:
            line, got = ragged[0]
            parts.append(
                f"{len(ragged)} row(s) with a number of cells other than the {width} of "
                f"{basis} (line {line} has {got}; lines {_shown_lines([r[0] for r in ragged])}) "
                f"— a {delim_name} inside a text splits it into more cells: remove it from the text"
                + ("" if delim_name == "TAB" else " or quote the text")
            )
        if empty:
            parts.append(f"{len(empty)} row(s) whose text is empty or only whitespace (lines {_shown_lines(empty)})")
        raise ValueError(
            f"{path}: {'; '.join(parts)}. Fix the file, or pass bad_rows='skip' to leave these rows out "
            f"(the report lists them)."
        )
    drop = {line for line, _ in ragged} | set(empty)
    kept = [(line, row) for line, row in rows if line not in drop]
    return kept, {"rows": len(drop), "lines": sorted(drop)}


def _read_labelled(path: Path, role: str, delimiter, header, encoding, text_column, label_column, need_label,
                   bad_rows: str = "error", c1_characters: str = "error"):
    """(texts, raw labels or None, line numbers, file record) of one table, with the header and row checks."""
    names, rows = read_table(path, delimiter, header, encoding, c1_characters, role)
    if not rows:
        raise ValueError(f"{path} has no data rows")
    header_line = 1 if names is not None else None
    if names is not None:
        width = len(names)
    else:  # no header: the number of cells most rows have (the others are ragged rows)
        width = Counter(len(r) for _, r in rows).most_common(1)[0][0]
    if role != "train":
        if names is None and width == 1:  # an evaluation file of texts alone
            text_column, label_column = 0, None
        if isinstance(label_column, str):
            need_label = names is not None and label_column in names
        else:
            need_label = isinstance(label_column, int) and label_column < width
    delim = _delimiter_for(path, delimiter, role)
    where = _Where(path, role, delim, names if names is not None else rows[0][1])
    text_idx, label_idx = _resolve_columns(text_column, label_column, names, width, where, need_label=need_label)
    delim_name = {"\t": "TAB", ",": "comma", ";": "semicolon"}.get(delim, repr(delim))
    basis = "the header" if names is not None else "most rows"
    rows, skipped = _bad_rows(path, rows, width, text_idx, bad_rows, delim_name, basis)
    if not rows:
        raise ValueError(f"{path} has no data rows left after bad_rows='skip' ({skipped['rows']} left out)")
    texts = _cells(rows, text_idx, path, "text")
    raw = None
    if label_idx is not None:
        _check_header(path, header, header_line, names, rows, label_idx, label_column, text_idx, role)
        raw = [cell.strip() for cell in _cells(rows, label_idx, path, "label")]
        for (line, _), value in zip(rows, raw):
            if not value:
                raise ValueError(f"{path} line {line}: empty label")
    record = file_record(path, role, len(rows))
    if skipped["rows"]:
        record["skipped_rows"] = skipped
    return texts, raw, [line for line, _ in rows], record, (names, text_idx, label_idx)


def _check_pooled(tables: list[Path], records: list[dict]) -> None:
    """The same file twice in ``path`` (by path or by content) would put every row in two splits at once."""
    seen = {}
    for i, (table, record) in enumerate(zip(tables, records)):
        key = record["sha256"]
        if key in seen:
            j = seen[key]
            twice = tables[j].resolve() == table.resolve()
            same = "is listed twice" if twice else f"has the same content as {tables[j]}"
            raise ValueError(
                f"path: {table} (entry {i}) {same} (entry {j}); pooling it would put each of its rows in training "
                f"and in the test split at once. List each file once."
            )
        seen[key] = i


def _check_labels(tables, file_labels, file_lines, min_class_count: int, disjoint_labels: str) -> None:
    """Rare labels (fewer than ``min_class_count`` rows) and pooled files whose label sets are disjoint."""
    if len(tables) > 1 and disjoint_labels == "error":
        sets = [set(labels) for labels in file_labels]
        for i, own in enumerate(sets):
            others = set().union(*(sets[:i] + sets[i + 1 :]))
            if not own & others:
                listed = "; ".join(f"{t}: {_sort_labels(labels)}" for t, labels in zip(tables, sets))
                raise ValueError(
                    f"path: the pooled files' label sets share no label ({listed}): {tables[i]} labels its rows "
                    f"with none of the other files' labels, which would make them classes of their own. Write "
                    f"the labels the same way in every file (e.g. 0/1 or neg/pos throughout), or pass "
                    f"disjoint_labels='allow' if each file holds other classes by design."
                )
    counts = Counter(v for labels in file_labels for v in labels)
    rare = sorted((v for v, c in counts.items() if c < min_class_count), key=lambda v: (counts[v], v))
    if rare:
        where = []
        for v in rare[:5]:
            at = []
            for t, labels, lines in zip(tables, file_labels, file_lines):
                found = [line for label, line in zip(labels, lines) if label == v]
                if found:
                    at.append(f"{t} line{'s' if len(found) > 1 else ''} {_shown_lines(found, 3)}")
            where.append(f"{v!r} ({counts[v]} row(s): {'; '.join(at)})")
        more = f" and {len(rare) - 5} more" if len(rare) > 5 else ""
        raise ValueError(
            f"label(s) with fewer than min_class_count={min_class_count} rows in {', '.join(map(str, tables))}: "
            f"{'; '.join(where)}{more}. A rare label is often a typo, another spelling of a label, or a piece of "
            f"a text read as a label (a row with an extra delimiter). Fix the file, or pass min_class_count=1 "
            f"(or a smaller number) to allow rare classes."
        )


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
    shift_file=None,
    ood_file=None,
    unknown_labels: str = "error",
    val_fraction: float = 0.1,
    test_fraction: float = 0.2,
    max_len: int = 256,
    min_freq: int = 1,
    max_vocab_size: int | None = None,
    encoding: str = "utf-8",
    bad_rows: str = "error",
    min_class_count: int = MIN_CLASS_COUNT,
    disjoint_labels: str = "error",
    label_spellings: str = "error",
    c1_characters: str = "error",
    shift_header=None,
    shift_delimiter=None,
    shift_encoding=None,
    ood_header=None,
    ood_delimiter=None,
    ood_encoding=None,
) -> DatasetBundle:
    """A (text, label) table split stratified and seeded into train / val / test.

    Every option is listed, with accepted values, by ``gpattn data text_table`` (:data:`OPTION_HELP`).
    ``path``: a ``.tsv``/``.tab``/``.csv`` file, or a list of them (pooled, then split); relative
    paths are tried in the working directory, then in ``data_dir``. Columns are names (with
    ``header=True``) or 0-based indices. Labels may be any strings: the sorted unique labels
    (numerically if all are integers) become 0..K-1 and ``info["class_names"]`` keeps the names.
    ``shift_file`` (labelled, same columns) becomes split "shift"; ``ood_file`` (same columns, label
    column optional) becomes split "ood". A label of an evaluation file that training never saw is an
    error unless ``unknown_labels`` says otherwise. Vocabulary from train only. ``info["files"]``
    records every file read (path, bytes, sha256, rows); ``info["unknown_labels"]`` what was done with
    unknown labels per split. Rows with a wrong number of cells or an empty text (``bad_rows``), labels
    with fewer than ``min_class_count`` rows, pooled files with disjoint label sets (``disjoint_labels``), the
    same file twice in ``path`` and bytes that are not ``encoding`` are errors naming the file and line.
    ``header``, ``delimiter`` and ``encoding`` are the training files'; ``shift_file`` and ``ood_file`` use them
    unless their own (``shift_header``, ``ood_encoding``, ...) say otherwise.
    """
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=False)
    test_fraction = check_fraction("test_fraction", test_fraction, allow_zero=False)
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}")
    header = parse_bool("header", header)
    delimiter = parse_delimiter(delimiter)
    if unknown_labels not in UNKNOWN_LABELS:
        accepted = ", ".join(map(repr, UNKNOWN_LABELS))
        raise ValueError(f"unknown_labels must be one of {accepted}, got {unknown_labels!r}")
    for name, value, accepted in (("bad_rows", bad_rows, BAD_ROWS), ("disjoint_labels", disjoint_labels,
                                                                     DISJOINT_LABELS),
                                  ("c1_characters", c1_characters, C1_POLICIES)):
        if value not in accepted:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}, got {value!r}")
    if isinstance(min_class_count, bool) or not isinstance(min_class_count, int) or min_class_count < 1:
        raise ValueError(f"min_class_count must be an int >= 1 (1 allows any class size), got {min_class_count!r}")
    own = _per_file(shift_file, ood_file, header, delimiter, encoding, shift_header=shift_header,
                    shift_delimiter=shift_delimiter, shift_encoding=shift_encoding, ood_header=ood_header,
                    ood_delimiter=ood_delimiter, ood_encoding=ood_encoding)
    paths = list(path) if isinstance(path, (list, tuple)) else [path]
    if not paths:
        raise ValueError("path must name at least one file")
    texts, raw_labels, files, sources, tables, file_labels, file_lines = [], [], [], [], [], [], []
    for one in paths:
        table = find_table(one, data_dir, "train")
        t, raw, lines, record, (names, text_idx, label_idx) = _read_labelled(
            table, "train", delimiter, header, encoding, text_column, label_column, True, bad_rows, c1_characters
        )
        texts += t
        raw_labels += raw
        files.append(record)
        sources.append(str(table))
        tables.append(table)
        file_labels.append(raw)
        file_lines.append(lines)
    _check_pooled(tables, files)
    check_label_spellings(tables, file_labels, file_lines, label_spellings)
    _check_labels(tables, file_labels, file_lines, min_class_count, disjoint_labels)
    # later files use the first file's columns: by name with a header, else by index
    col_text = names[text_idx] if names is not None and not isinstance(text_column, int) else text_idx
    col_label = names[label_idx] if names is not None and not isinstance(label_column, int) else label_idx
    class_names = _sort_labels(raw_labels)
    if len(class_names) < 2:
        raise ValueError(f"{', '.join(sources)} has a single label value {class_names}; need at least 2 classes")
    to_id = {name: i for i, name in enumerate(class_names)}
    label_ids = [to_id[v] for v in raw_labels]

    tr, va, te = stratified_split(label_ids, (val_fraction, test_fraction), seed)
    split_texts = {key: [texts[i] for i in idx] for key, idx in (("train", tr), ("val", va), ("test", te))}
    split_labels = {key: [label_ids[i] for i in idx] for key, idx in (("train", tr), ("val", va), ("test", te))}
    eval_splits, ood_splits = {"in_domain": "test"}, ()
    info = {"source": sources[0] if len(sources) == 1 else sources, "class_names": class_names, "seed": seed,
            "max_len": max_len, "unknown_labels": {}}

    for split, extra in (("shift", shift_file), ("ood", ood_file)):
        if extra is None:
            continue
        table = find_table(extra, data_dir, split)
        e_header, e_delimiter, e_encoding = own[split]
        own_delimiter = shift_delimiter if split == "shift" else ood_delimiter
        _check_inherited_delimiter(table, split, tables[0], delimiter, own_delimiter)
        # by the training file's column names where both have a header row, else by its column positions
        columns = (col_text, col_label) if e_header else (text_idx, label_idx)
        e_texts, e_raw, lines, record, _ = _read_labelled(
            table, split, e_delimiter, e_header, e_encoding, *columns, split == "shift", bad_rows, c1_characters
        )
        files.append(record)
        if e_raw is None and split == "shift":
            raise ValueError(
                f"{table} has no label column {col_label!r}: shift_file must be labelled with the training "
                f"file's columns (an unlabelled file belongs in ood_file)"
            )
        if e_raw is None:  # an OOD file without the label column: unlabelled by construction
            e_labels = [-1] * len(e_texts)
        else:
            e_texts, e_labels, handled = _known_labels(table, split, e_texts, e_raw, lines, to_id, unknown_labels)
            info["unknown_labels"][split] = handled
        split_texts[split], split_labels[split] = e_texts, e_labels
        info[f"{split}_source"] = str(table)
        info[f"{split}_labelled"] = e_raw is not None
        eval_splits[split] = split
    warn_small_splits({k: split_labels[k] for k in ("shift", "ood") if k in split_labels}, ", ".join(sources))
    if ood_file is not None:
        info["ood_unknown_labels"] = sum(v == -1 for v in split_labels["ood"])
        ood_splits = ("ood",)
    info["files"] = files

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


def _per_file(shift_file, ood_file, header, delimiter, encoding, **given) -> dict:
    """``{role: (header, delimiter, encoding)}`` of each evaluation file: its own options (``shift_header``, ...)
    where given, else the training file's; an option given for a file that is not there is an error."""
    out = {}
    for role, file in (("shift", shift_file), ("ood", ood_file)):
        values = {name: given[f"{role}_{name}"] for name in PER_FILE}
        set_ = [f"{role}_{name}" for name, v in values.items() if v is not None]
        if file is None and set_:
            raise ValueError(f"{', '.join(set_)} given without {role}_file: they set how {role}_file is read; pass "
                             f"{role}_file=... or leave them out")
        out[role] = (
            header if values["header"] is None else parse_bool(f"{role}_header", values["header"]),
            delimiter if values["delimiter"] is None else parse_delimiter(values["delimiter"]),
            encoding if values["encoding"] is None else values["encoding"],
        )
    return out


def _check_inherited_delimiter(table: Path, role: str, train: Path, delimiter, own) -> None:
    """An evaluation file whose extension says another delimiter than ``delimiter`` (given for the training file,
    which it inherits) and than the training file's extension: which one holds is the user's to say."""
    by_name = _DELIMITERS.get(table.suffix.lower())
    if own is not None or delimiter is None or by_name in (None, delimiter, _DELIMITERS.get(train.suffix.lower())):
        return
    names = {v: k for k, v in DELIMITER_NAMES.items() if k in ("tab", "comma", "semicolon", "pipe")}
    said, given = names.get(by_name, repr(by_name)), names.get(delimiter, repr(delimiter))
    raise ValueError(
        f"{role}_file {table}: its extension says {said}-delimited, but it would be read with delimiter={given}, "
        f"the training file's; pass {role}_delimiter={said} (or {role}_delimiter={given} if the file is "
        f"{given}-delimited after all)"
    )


def _known_labels(table, split, texts, raw, lines, to_id, unknown_labels):
    """Map an evaluation file's labels to the training ids; labels training never saw are an error
    (``unknown_labels="error"``), left out (``"drop"``) or kept as unlabelled rows, id -1 (``"unlabelled"``)."""
    unknown = [(line, v) for line, v in zip(lines, raw) if v not in to_id]
    handled = {"policy": unknown_labels, "rows": len(unknown), "values": sorted({v for _, v in unknown})}
    if unknown and unknown_labels == "error":
        line, value = unknown[0]
        shown = handled["values"][:5] + (["..."] if len(handled["values"]) > 5 else [])
        raise ValueError(
            f"{table} line {line}: label {value!r} of the {split} file never occurs in training "
            f"(training labels: {sorted(to_id)}); {len(unknown)} of {len(raw)} rows have such labels "
            f"({shown}). Pass unknown_labels='drop' to leave those rows out, or unknown_labels='unlabelled' "
            f"to keep them without a label (classification metrics then use the labelled rows only)."
        )
    if unknown_labels == "drop":
        keep = [i for i, v in enumerate(raw) if v in to_id]
        return [texts[i] for i in keep], [to_id[raw[i]] for i in keep], handled
    return texts, [to_id.get(v, -1) for v in raw], handled
