"""Label spellings inside the training labels (issue #46 item 1).

Two cells that spell one label differently (``1`` and ``1.0``, ``Positive`` and ``positive``) would become two
classes, and a cell that spells a missing value (``nan``, ``NA``, ``null``) a class of its own. Both are an
error naming the spellings and their lines unless ``label_spellings='allow'``.
"""

from __future__ import annotations

from collections import defaultdict

#: ``label_spellings``: labels equal as numbers or up to case/whitespace, or spelling a missing value
LABEL_SPELLINGS = ("error", "allow")
#: cells (compared case-insensitively) that spell a missing value rather than a label
MISSING_SPELLINGS = ("nan", "na", "n/a", "null", "none", "nil", "missing", "")


def _number(value: str):
    try:
        number = float(value)
    except ValueError:
        return None
    return None if number != number else number  # nan is a missing value, not a number


def _lines_of(tables, file_labels, file_lines, value, limit: int = 3) -> str:
    at = []
    for table, labels, lines in zip(tables, file_labels, file_lines):
        found = [line for label, line in zip(labels, lines) if label == value]
        if found:
            more = f" and {len(found) - limit} more" if len(found) > limit else ""
            shown = ", ".join(map(str, found[:limit])) + more
            at.append(f"{table} line{'s' if len(found) > 1 else ''} {shown}")
    return "; ".join(at)


def check_label_spellings(tables, file_labels, file_lines, policy: str) -> None:
    """Raise naming the spellings and lines when the training labels (``file_labels``: one list of stripped
    cells per file in ``tables``, ``file_lines`` their line numbers) hold one label in several spellings or a
    missing-value spelling; nothing when ``policy == 'allow'``."""
    if policy not in LABEL_SPELLINGS:
        raise ValueError(f"label_spellings must be one of {', '.join(map(repr, LABEL_SPELLINGS))}, got {policy!r}")
    if policy == "allow":
        return
    values = sorted({v for labels in file_labels for v in labels})
    missing = [v for v in values if v.strip().lower() in MISSING_SPELLINGS]
    groups = []
    for key_of, why in ((_number, "equal as numbers"), (lambda v: " ".join(v.split()).casefold(),
                                                        "equal up to case and whitespace")):
        by_key = defaultdict(list)
        for v in values:
            if v in missing:
                continue
            key = key_of(v)
            if key is not None:
                by_key[key].append(v)
        groups += [(why, spellings) for spellings in by_key.values() if len(spellings) > 1]
    if not missing and not groups:
        return
    parts = [
        f"{' and '.join(repr(s) for s in spellings)} are {why} ("
        + "; ".join(f"{s!r}: {_lines_of(tables, file_labels, file_lines, s)}" for s in spellings) + ")"
        for why, spellings in groups
    ]
    parts += [f"{v!r} spells a missing value ({_lines_of(tables, file_labels, file_lines, v)})" for v in missing]
    raise ValueError(
        f"labels of {', '.join(map(str, tables))}: {'; '.join(parts)}. Each spelling would become a class of "
        f"its own. Write each label one way (and give the rows with a missing label a label, or remove them), or "
        f"pass label_spellings='allow' if these are different classes on purpose."
    )
