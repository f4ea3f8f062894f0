"""What ``compare`` may replace in a finished ``--out`` (issue #46 item 4).

``compare`` into a finished folder with another configuration or other data silently retrained the finished
runs and rewrote report.md / results.json with only the new call's rows; ``train`` refuses the same thing
unless ``--overwrite``. Here: a finished run is replaced only with ``overwrite=True``, and rows of an earlier
results.json that the new call does not hold are named in the log and the report.
"""

from __future__ import annotations

import contextvars
import json
from pathlib import Path

#: whether the running ``compare`` call may replace finished runs (set once per call by ``compare``)
OVERWRITE = contextvars.ContextVar("gpattn_compare_overwrite", default=False)


def check_out_folder(out, flag: str = "--out") -> Path:
    """``out`` as a Path, or a ``ValueError`` when it names an existing file that is not a folder."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is an existing file, not a folder; pass a folder path (it is created if "
                         f"missing) or remove that file")
    return out


def check_replace(folder: Path, label: str, why: str, finished: bool) -> None:
    """Refuse to retrain the finished run in ``folder`` (``finished``) for reason ``why`` unless the call
    passed ``overwrite``; a run that never finished (or diverged) is retrained as before."""
    if finished and not OVERWRITE.get():
        raise ValueError(
            f"{label}: {folder} holds a finished run that compare would replace ({why}). Pass --overwrite "
            f"(compare(..., overwrite=True)) to train it again and replace its files, or choose another --out "
            f"to keep both."
        )


def earlier_rows_note(results_file: Path, results: dict, log) -> list[str]:
    """A note (logged, for report.md) naming the rows of an earlier ``results_file`` that ``results`` no longer
    holds (their run folders stay on disk); ``[]`` when there are none."""
    if not results_file.is_file():
        return []
    try:
        earlier = json.loads(results_file.read_text())
    except ValueError:
        return []
    gone = [
        f"{spec} seed {seed}" for spec, by_seed in sorted(earlier.items()) if isinstance(by_seed, dict)
        for seed in sorted(by_seed) if seed not in results.get(spec, {})
    ]
    if not gone:
        return []
    shown = ", ".join(gone[:10]) + (f" and {len(gone) - 10} more" if len(gone) > 10 else "")
    note = (
        f"this report replaces an earlier results.json in the same folder; {len(gone)} of its rows are not in this "
        f"call ({shown}): their run folders are kept under runs/, and rerunning compare with them brings them back."
    )
    log(f"[compare] {note}")
    return [note]
