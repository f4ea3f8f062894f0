"""Exact duplicate texts within and between the splits of a text bundle.

Counted for every text bundle (``info["duplicates"]``, shown in a run's data header and kept in ``data.json``);
nothing is dropped. An evaluation-only split (``shift``, ``ood``: a file of its own) that repeats texts of the
training splits (``train``, ``val``) gets a :class:`DuplicateTextWarning` naming the files and the counts: its
metrics then include training data. Duplicates between ``train`` and ``test`` come from repeated rows of the
training file itself (the test split is drawn from it) and are reported, not warned about.
"""

from __future__ import annotations

from collections import Counter

from gpattn._warnings import warn

__all__ = ["DuplicateTextWarning", "duplicate_counts", "duplicate_lines", "warn_eval_overlap"]

#: the splits a model learns from (their texts must not reappear in an evaluation file)
TRAINING_SPLITS = ("train", "val")
_ORDER = ("train", "val", "test", "shift", "ood")


class DuplicateTextWarning(UserWarning):
    """An evaluation file holds exact copies of training texts (its metrics include training data)."""


def _key(text: str) -> str:
    return text.strip()


def duplicate_counts(texts: dict) -> dict:
    """``{"within": {split: rows that repeat an earlier row of the split}, "between": {"a/b": rows of split b
    whose text occurs in the earlier split a}}`` for split name -> texts; only non-zero counts are listed."""
    names = sorted(texts, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))
    seen = {k: {_key(t) for t in texts[k]} for k in names}
    within = {k: len(texts[k]) - len(seen[k]) for k in names if len(texts[k]) > len(seen[k])}
    between = {}
    for j, later in enumerate(names):
        for earlier in names[:j]:
            n = sum(_key(t) in seen[earlier] for t in texts[later])
            if n:
                between[f"{earlier}/{later}"] = n
    return {"within": within, "between": between}


def duplicate_lines(duplicates: dict | None) -> list[str]:
    """The data header's line of :func:`duplicate_counts` (none without counts)."""
    if duplicates is None:
        return []
    parts = [f"{n} repeated row(s) within `{k}`" for k, n in duplicates["within"].items()]
    parts += [f"{n} row(s) of `{pair.split('/')[1]}` also in `{pair.split('/')[0]}`"
              for pair, n in duplicates["between"].items()]
    return [f"- exact duplicate texts: {'; '.join(parts) if parts else 'none within or between splits'}"]


def _files(info: dict, role: str) -> str:
    """The files of split ``role`` as data.json records them, else the loader's source."""
    found = [f["path"] for f in info.get("files", []) if f.get("role") == role]
    source = info.get("source") if role == "train" else info.get(f"{role}_source")
    if found or source:
        return ", ".join(found) if found else str(source)
    return f"split {role!r} of {info['source']}" if info.get("source") else f"split {role!r}"


def warn_eval_overlap(name: str, texts: dict, info: dict, eval_only) -> None:
    """A :class:`DuplicateTextWarning` per evaluation-only split (``eval_only``) whose rows repeat texts of
    :data:`TRAINING_SPLITS`, naming its file, the training files and the counts."""
    own = {k: {_key(t) for t in texts[k]} for k in TRAINING_SPLITS if k in texts}
    training = set().union(*own.values())
    for split in eval_only:
        hits = Counter(k for t in texts[split] for k in own if _key(t) in own[k])
        rows = sum(_key(t) in training for t in texts[split])
        if rows:
            by = ", ".join(f"{k}: {n}" for k, n in hits.items())
            warn(
                f"{name}: {rows} of {len(texts[split])} rows of evaluation split {split!r} ({_files(info, split)}) "
                f"are exact copies of training texts ({by}) of {_files(info, 'train')}: the {split} metrics include "
                f"training data. Remove those rows from the evaluation file (data.json's \"duplicates\" counts them).",
                DuplicateTextWarning,
            )
