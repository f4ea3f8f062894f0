"""What a run was trained and evaluated on: files, split sizes, class counts, a content fingerprint.

``data_summary(bundle)`` is written as ``data.json`` next to every run (``gpattn train``) and by
``gpattn compare``; ``compare`` reuses a finished run only when its ``fingerprint`` (a SHA-256 of every
split's tensors and the vocabulary, so an edited data file changes it whatever the loader) is the same.
"""

from __future__ import annotations

import hashlib
import statistics

import torch

from gpattn.experiments.data._duplicates import duplicate_lines

__all__ = ["bundle_fingerprint", "data_summary", "summary_lines", "warn_max_len_cut"]


def bundle_fingerprint(bundle) -> str:
    """SHA-256 of the bundle's content: every split's inputs, labels, mask and groups, and the vocabulary.
    A bundle of a frozen trunk's outputs (``info["trunk"]``, gpattn.experiments.encoders.trunk_bundle) is
    fingerprinted by its token ids' fingerprint and the trunk, which determine the hidden states (whose float
    bits may differ between machines and thread counts)."""
    trunk = bundle.info.get("trunk")
    if trunk is not None:
        return hashlib.sha256(f"trunk|{sorted(trunk.items())}".encode()).hexdigest()
    digest = hashlib.sha256()
    digest.update(f"{bundle.name}|{bundle.kind}|{bundle.num_classes}|{sorted(bundle.eval_splits.items())}".encode())
    for key in sorted(bundle.splits):
        split = bundle.splits[key]
        digest.update(key.encode())
        for t in (split.inputs, split.labels, split.mask, split.groups):
            if t is not None:
                t = t.contiguous()
                digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
                digest.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())
    for word in bundle.vocab or ():
        digest.update(word.encode() + b"\0")
    return digest.hexdigest()


def data_summary(bundle) -> dict:
    """Plain data: data set name, files read (role, path, bytes, sha256, rows) where the loader records
    them, rows per split, labelled class counts per split, what was done with unknown labels, exact duplicate
    texts within and between splits (text data), the rows ``max_len`` cut (:func:`max_len_cut`), and the content
    fingerprint."""
    names = bundle.info.get("class_names") or [str(k) for k in range(bundle.num_classes)]
    sizes, counts, unlabelled = {}, {}, {}
    for key, split in bundle.splits.items():
        labels = split.labels
        known = labels >= 0
        sizes[key] = len(split)
        counts[key] = dict(zip(names, torch.bincount(labels[known], minlength=len(names)).tolist()))
        unlabelled[key] = int((~known).sum())
    return {
        "dataset": bundle.name,
        "files": list(bundle.info.get("files", [])),
        "source": bundle.info.get("source"),
        "class_names": list(names),
        "sizes": sizes,
        "class_counts": counts,
        "unlabelled": unlabelled,
        "unknown_labels": bundle.info.get("unknown_labels", {}),
        "duplicates": bundle.info.get("duplicates"),
        "eval_splits": dict(bundle.eval_splits),
        "max_len_cut": max_len_cut(bundle),
        "fingerprint": bundle_fingerprint(bundle),
    }


def max_len_cut(bundle) -> dict | None:
    """The rows of each split that the data set's ``max_len`` cut to their first ``max_len`` tokens, with each
    split's rows and longest text in tokens (None for images, and for a pretrained encoder's bundle, which reads
    the whole texts with its own ``--max-len``)."""
    info = bundle.info
    if bundle.kind != "text" or info.get("encoder") is not None or "truncated" not in info:
        return None
    return {"max_len": info.get("max_len"), "rows": {k: int(n) for k, n in info["truncated"].items() if n},
            "of": {k: len(bundle.splits[k]) for k, n in info["truncated"].items() if n},
            "longest": dict(info.get("max_tokens", {}))}


def warn_max_len_cut(summary: dict) -> None:
    """A :class:`gpattn.experiments.data.DataWarning` when ``max_len`` cut training rows (:func:`max_len_cut`), with
    the counts per split and the option that changes it (evaluation rows longer than ``max_len`` are also longer than
    the model's width, which cuts them with a warning of its own, :func:`gpattn.experiments._runs.fit_to_positions`)."""
    cut = summary.get("max_len_cut")
    if not cut or not set(cut["rows"]) & {"train", "val"}:  # evaluation rows alone: the model's width cuts them too
        return
    from gpattn._warnings import DataWarning, warn

    def share(n, of):
        pct = 100 * n / max(of, 1)
        return f"{pct:.0f} %" if pct >= 1 else "<1 %"

    shown = ", ".join(f"{n} of {cut['of'][k]} rows of {k!r} ({share(n, cut['of'][k])})" for k, n in cut["rows"].items())
    longest = cut["longest"].get("train")
    warn(
        f"{summary['dataset']}: max_len={cut['max_len']} cuts {shown} to their first {cut['max_len']} tokens. To keep "
        f"more of each text pass a larger max_len (--dataset-option max_len=N"
        + (f"; the longest training text has {longest} tokens" if longest else "")
        + "; time and memory grow with it); data.json's \"max_len_cut\" records the counts.",
        DataWarning,
    )


#: a split's class counts are listed one by one up to this many classes, else summarised (data.json has them all)
MAX_LISTED_CLASSES = 20


def _class_counts(counts: dict) -> str:
    """``name: count`` per class, or for more than :data:`MAX_LISTED_CLASSES` classes their number and the
    smallest, median and largest count."""
    if len(counts) <= MAX_LISTED_CLASSES:
        return ", ".join(f"{c}: {k}" for c, k in counts.items())
    values = sorted(counts.values())
    low = min(counts, key=counts.get)
    return (f"{len(values)} classes, rows per class min {values[0]} ({low}) / median {statistics.median(values):g} / "
            f"max {values[-1]}; every count in data.json")


def summary_lines(summary: dict) -> list[str]:
    """Markdown / stdout lines of :func:`data_summary`."""
    lines = []
    for f in summary["files"]:
        lines.append(f"- file ({f['role']}): `{f['path']}`, {f['bytes']} bytes, {f['rows']} rows, sha256 {f['sha256']}")
        skipped = f.get("skipped_rows")
        if skipped:
            shown = ", ".join(map(str, skipped["lines"][:10])) + (" ..." if len(skipped["lines"]) > 10 else "")
            lines.append(f"  - {skipped['rows']} row(s) left out (bad_rows='skip': wrong number of cells or empty "
                         f"text), lines {shown}")
    if not summary["files"] and summary.get("source"):
        lines.append(f"- source: {summary['source']}")
    for key, n in summary["sizes"].items():
        counts = _class_counts(summary["class_counts"][key])
        extra = f", {summary['unlabelled'][key]} unlabelled" if summary["unlabelled"][key] else ""
        lines.append(f"- split `{key}`: {n} rows ({counts}{extra})")
    for split, handled in summary.get("unknown_labels", {}).items():
        if handled.get("rows"):
            lines.append(
                f"- {split}: {handled['rows']} rows with labels unknown to training {handled['values'][:10]} "
                f"were {'dropped' if handled['policy'] == 'drop' else 'kept unlabelled'} (unknown_labels="
                f"{handled['policy']!r})"
            )
    lines += duplicate_lines(summary.get("duplicates"))
    by_option = summary.get("max_len_cut")
    if by_option and by_option["rows"]:
        shown = ", ".join(f"{n} of {by_option['of'][k]} of `{k}`" for k, n in by_option["rows"].items())
        lines.append(f"- rows cut to their first {by_option['max_len']} tokens by the data set's max_len: {shown}")
    cut = summary.get("cut_to_model")
    if cut:
        shown = ", ".join(f"{n} of `{k}`" for k, n in cut["rows"].items())
        lines.append(f"- rows longer than the {cut['tokens']} tokens of the longest training sequence (the model's "
                     f"positional embedding) keep their first {cut['tokens']}: {shown}")
    lines.append(f"- content fingerprint (sha256 of the splits' tensors and the vocabulary): {summary['fingerprint']}")
    return lines
