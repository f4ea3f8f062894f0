"""Checks of decoded text and of evaluation split sizes.

``encoding=latin-1`` on a cp1252 file (the usual Windows encoding) decodes curly quotes and dashes into C1
control characters (U+0080–U+009F), which then became vocabulary tokens; and a one-row shift file gave
shift metrics on one example without a word.
"""

from __future__ import annotations

import re

from gpattn._warnings import DataWarning, warn

#: an evaluation split with fewer labelled rows than this gets a warning: its metrics are mostly noise
MIN_EVAL_ROWS = 5
_C1 = re.compile("[\x80-\x9f]")


def check_c1(path, text: str, encoding: str) -> str:
    """``text`` (decoded from ``path`` in ``encoding``) or a ``ValueError`` naming the line of the first C1
    control character, which ordinary text never holds, and suggesting cp1252."""
    found = _C1.search(text)
    if found is None:
        return text
    line = text.count("\n", 0, found.start()) + 1
    count = len(_C1.findall(text))
    raise ValueError(
        f"{path} line {line}: decoded with encoding={encoding!r}, the file holds {count} C1 control character(s) "
        f"(first U+{ord(found.group()):04X}), which ordinary text never contains: the file is most likely cp1252 "
        f"(Windows; curly quotes and dashes are bytes 0x80-0x9F there). Pass encoding=cp1252 "
        f"(--dataset-option encoding=cp1252), or re-save the file as UTF-8."
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
