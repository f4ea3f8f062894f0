"""Checks of decoded text and of evaluation split sizes.

``encoding=latin-1`` on a cp1252 file (the usual Windows encoding) decodes curly quotes and dashes into C1
control characters (U+0080–U+009F), which then became vocabulary tokens; the advice for them (cp1252) garbled a
UTF-8 file that held such characters in its text; cp1252 on a UTF-8 file misread every accent without a word; and a
one-row shift file gave shift metrics on one example without a word.
"""

from __future__ import annotations

import codecs
import re

from gpattn._warnings import DataWarning, warn
from gpattn.experiments.data._table_hints import decodes, is_latin1, option

#: an evaluation split with fewer labelled rows than this gets a warning: its metrics are mostly noise
MIN_EVAL_ROWS = 5
_C1 = re.compile("[\x80-\x9f]")


#: ``c1_characters``: what to do with C1 control characters (U+0080-U+009F) in a file's decoded text
C1_POLICIES = ("error", "keep", "repair")


def _c1_list(text: str, found: list) -> str:
    """Each C1 character of ``text``: its code point, how often, and the line and column of its first occurrence."""
    first, counts = {}, {}
    for m in found:
        counts[m.group()] = counts.get(m.group(), 0) + 1
        first.setdefault(m.group(), m.start())
    parts = []
    for char, at in sorted(first.items(), key=lambda kv: kv[1])[:6]:
        line = text.count("\n", 0, at) + 1
        column = at - (text.rfind("\n", 0, at) + 1) + 1
        parts.append(f"U+{ord(char):04X} ({counts[char]}x, first at line {line}, column {column})")
    return ", ".join(parts) + (f" and {len(first) - 6} more" if len(first) > 6 else "")


def _as_cp1252(char: str) -> str | None:
    """The cp1252 character whose byte is the code point of the C1 character ``char`` (None: undefined there)."""
    try:
        return char.encode("latin-1").decode("cp1252")
    except UnicodeDecodeError:
        return None


def _utf8_c1_fix() -> str:
    return ("pass c1_characters='repair' to read each as the cp1252 character of its code (U+0096 as '–', U+0085 "
            "as '…'), or c1_characters='keep' to keep them as they are (--dataset-option c1_characters=keep), "
            "or replace them in the file")


def check_misread_utf8(path, data: bytes, text: str, encoding: str, role: str = "train") -> None:
    """A ``ValueError`` when a single-byte ``encoding`` (latin-1, cp1252, ...) decoded a file whose non-ASCII bytes
    are valid UTF-8: every multibyte character would be misread ('é' as 'Ã©'), and a file in another
    encoding is valid UTF-8 almost never."""
    if data.isascii() or codecs.lookup(encoding).name.startswith("utf") or not decodes(data, "utf-8"):
        return
    utf8 = data.decode("utf-8")
    at = next(i for i, c in enumerate(utf8) if ord(c) > 127)
    char, line = utf8[at], utf8.count("\n", 0, at) + 1
    misread = char.encode("utf-8").decode(encoding, errors="replace")
    also = (" It then holds C1 control characters (mojibake in its text): " + _utf8_c1_fix()
            if _C1.search(utf8) else "")
    raise ValueError(
        f"{path}: encoding={encoding!r}, but the file is UTF-8 (its non-ASCII bytes are valid UTF-8, which a "
        f"{encoding} file almost never is): {encoding} would misread every such character, e.g. {char!r} at line "
        f"{line} as {misread!r}. Leave {option(role, 'encoding')} unset (utf-8 is the default).{also}"
    )


def check_c1(path, data: bytes, text: str, encoding: str, policy: str = "error", role: str = "train") -> str:
    """``text`` (``data`` decoded from ``path`` in ``encoding``) without C1 control characters, which ordinary text
    never holds: kept (``policy="keep"``), each read as the cp1252 character of its code (``"repair"``: U+0096 is
    '–'), or a ``ValueError`` listing them by code point and line with the fix that fits how the file decoded
    (a single-byte encoding's misreading of a UTF-8 file is :func:`check_misread_utf8`'s)."""
    found = list(_C1.finditer(text))
    if not found or policy == "keep":
        return text
    listed = _c1_list(text, found)
    undefined = sorted({m.group() for m in found if _as_cp1252(m.group()) is None})
    undefined_text = ", ".join(f"U+{ord(c):04X}" for c in undefined)
    if policy == "repair" and not undefined:
        return _C1.sub(lambda m: _as_cp1252(m.group()), text)
    encoding_opt = option(role, "encoding")
    keep = "Pass c1_characters='keep' to keep them as they are, or remove them from the file"
    if policy == "repair":
        fix = f"c1_characters='repair' cannot read {undefined_text}: no cp1252 character has that code. {keep}"
    elif is_latin1(encoding) and decodes(data, "cp1252"):
        fix = (f"The file is most likely cp1252 (Windows; curly quotes and dashes are bytes 0x80-0x9F there). Pass "
               f"{encoding_opt}=cp1252 (--dataset-option {encoding_opt}=cp1252), or re-save the file as UTF-8")
    elif is_latin1(encoding):
        fix = f"Its bytes are not cp1252 either ({undefined_text} have no cp1252 character). {keep}"
    else:
        fix = (f"The file is valid {encoding}, so these characters are in its text, usually mojibake (Windows text "
               f"once decoded as latin-1); {encoding_opt}=cp1252 would misread its other characters. "
               + ("P" + _utf8_c1_fix()[1:] if not undefined else keep))
    raise ValueError(
        f"{path} line {text.count(chr(10), 0, found[0].start()) + 1}: decoded with encoding={encoding!r}, the file "
        f"holds {len(found)} C1 control character(s), which ordinary text never contains: {listed}. {fix}."
    )


def warn_small_splits(labels_by_split: dict, where: str) -> None:
    """A warning per evaluation file's split (name -> label ids, -1 = unlabelled) with fewer than
    :data:`MIN_EVAL_ROWS` rows, giving the count."""
    for split, labels in labels_by_split.items():
        n = len(labels)
        if n < MIN_EVAL_ROWS:
            labelled = sum(1 for v in labels if v >= 0)
            warn(
                f"{where}: evaluation split {split!r} has {n} row(s) ({labelled} labelled): its metrics rest on "
                f"so few examples that they say little (fewer than {MIN_EVAL_ROWS}). Give it more rows (a larger "
                f"evaluation file).",
                DataWarning,
            )
