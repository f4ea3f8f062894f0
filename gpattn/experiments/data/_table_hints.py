"""The hints of ``text_table``'s errors, each naming the option that fixes the file it is about.

``header``, ``delimiter`` and ``encoding`` are the training file's; an evaluation file has its own
(``shift_header``, ``ood_encoding``, ...), so a hint about the OOD file names ``ood_header``, and following it
leaves the training file as it was read. A hint is given only where following it works: an encoding is suggested
when the bytes decode in it, a delimiter when line 1 holds it, a list when every comma-separated part is a file.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from gpattn.experiments.data._bundle import DataNotFoundError

#: the options an evaluation file may set for itself (``<role>_<option>``; None: the training file's)
PER_FILE = ("header", "delimiter", "encoding")
#: the file option of each role
FILE_OPTIONS = {"train": "path", "shift": "shift_file", "ood": "ood_file"}
#: delimiters a hint may suggest, by the name ``delimiter=`` takes
_COMMON = {"tab": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}


def option(role: str, name: str) -> str:
    """The option that sets ``name`` (header, delimiter, encoding) for the file of ``role``."""
    return name if role == "train" else f"{role}_{name}"


def is_latin1(encoding: str) -> bool:
    """Whether ``encoding`` is latin-1 (ISO 8859-1) under any of its names."""
    try:
        return codecs.lookup(encoding).name == "iso8859-1"
    except LookupError:
        return False


def decodes(data: bytes, encoding: str) -> bool:
    try:
        data.decode(encoding)
    except UnicodeDecodeError:
        return False
    return True


def suggest_encoding(data: bytes, role: str) -> str:
    """What to pass for bytes that are not valid UTF-8: cp1252 where they decode in it (the same as latin-1 for every
    byte but 0x80-0x9F, where latin-1 has control characters), else latin-1, which decodes any byte, with
    ``c1_characters='keep'`` for the bytes cp1252 leaves undefined."""
    name = option(role, "encoding")
    if decodes(data, "cp1252"):
        return (f"{name}='cp1252' (Windows; for bytes 0xA0-0xFF the same as {name}='latin-1') "
                f"(--dataset-option {name}=cp1252)")
    return (f"{name}='latin-1' with c1_characters='keep' (its bytes 0x81, 0x8D, 0x8F, 0x90 or 0x9D are not cp1252) "
            f"(--dataset-option {name}=latin-1 --dataset-option c1_characters=keep)")


def delimiter_hint(first: list[str], delim: str, role: str) -> str:
    """A sentence for a line 1 read as ``first`` (its cells) that holds another common delimiter in one cell: the
    file is most likely delimited by that one ("" when nothing suggests so)."""
    if len(first) != 1:
        return ""
    found = {name: first[0].count(char) for name, char in _COMMON.items() if char != delim and char in first[0]}
    if not found:
        return ""
    name = max(found, key=found.get)
    shown = {"\t": "TAB", ",": "comma", ";": "semicolon", "|": "pipe"}.get(delim, repr(delim))
    return (f"; its line 1 is a single {shown}-delimited cell holding {found[name]} {name} character(s): the file "
            f"looks {name}-delimited. Pass {option(role, 'delimiter')}={name} (or leave it unset for a .tsv/.csv "
            f"file, whose extension says it)")


def sniff_delimiter(path: Path, role: str, column_words) -> str:
    """For a file whose extension names no delimiter: the one its line 1 holds most, or, where it holds none, that
    the file is one text per line (an evaluation file; a headerless one also needs ``<role>_header=false``)."""
    with open(path, "rb") as handle:
        first = handle.readline(1 << 16).decode("utf-8", errors="replace").strip().lstrip("\ufeff")
    counts = {name: first.count(char) for name, char in _COMMON.items() if char in first}
    if counts:
        name = max(counts, key=counts.get)
        return f"; its line 1 holds {counts[name]} {name} character(s): {option(role, 'delimiter')}={name}?"
    if role == "train":
        return ""
    header = "" if first.lower() in column_words else f" and {option(role, 'header')}=false (line 1 is a text)"
    return f"; its line 1 holds no delimiter, one text per line: pass {option(role, 'delimiter')}=tab{header}"


def find_table(path, data_dir, role: str) -> Path:
    """The file ``path`` names (in the working directory, then in ``data_dir``), or a
    :class:`DataNotFoundError` naming the option, and what ``path`` is when it is not a file: a folder (its tables
    listed) or a comma string whose parts are files (the list syntax)."""
    name = FILE_OPTIONS[role]
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [given, Path(data_dir) / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is not None:
        tables = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in (".tsv", ".tab", ".csv", ".txt"))
        shown = ", ".join(tables[:8]) + (" ..." if len(tables) > 8 else "") if tables else "no .tsv/.csv file"
        raise DataNotFoundError(
            f"{name}={str(path)!r} is a folder ({folder}), not a file; pass {name}= one TSV/CSV file in it "
            f"(it holds: {shown})" + (f", e.g. {name}={folder / tables[0]}" if tables else "")
        )
    parts = [p.strip() for p in str(path).split(",")]
    if role == "train" and len(parts) > 1 and all(any(Path(c).is_file() for c in (Path(p), Path(data_dir) / p))
                                                   for p in parts):
        listed = "[" + ", ".join(repr(p) for p in parts) + "]"
        raise DataNotFoundError(
            f"path={str(path)!r} is not a file: it is {len(parts)} file names in one string. To pool several files, "
            f"pass a list: --dataset-option \"path={listed}\" (Python: path={listed})"
        )
    raise DataNotFoundError(
        f"{name}: text table not found: tried {', '.join(str(c) for c in candidates)}. Pass {name}= an existing "
        f"TSV/CSV file (a relative path is looked up in the working directory, then in data_dir)."
    )
