"""Reloading a run's data set for ``gpattn evaluate``.

After a data file changed, evaluate failed with a state-dict size-mismatch traceback that never said so (or,
with the same shapes, would have evaluated against other data without a word); a relative data path, stored
relative to the training command's working directory, was not found from another folder. Here the run's
``data.json`` (beside its checkpoint) supplies the absolute paths it read and the same paths relative to the run
folder; ``--dataset-option`` / ``--data-dir`` of ``gpattn evaluate`` point at moved data; and the content
fingerprint is compared with the reloaded data's before any model is built: a difference is an error naming the
changed file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from gpattn._warnings import DataWarning, warn

#: text_table options that name files, and the role data.json records their files under
_FILE_OPTIONS = {"path": "train", "shift_file": "shift", "ood_file": "ood"}


def _candidates(given: str, record: dict, data_dir: Path, run_dir: Path) -> list[Path]:
    """Where a run's data file may be, in order: as given (the working directory), in ``data_dir``, at the
    absolute path data.json recorded, and at the path it recorded relative to the run folder."""
    path = Path(given).expanduser()
    found = [path] if path.is_absolute() else [path, data_dir / path]
    found.append(Path(record["path"]))
    if record.get("path_from_run"):
        found.append(Path(os.path.normpath(run_dir.resolve() / record["path_from_run"])))
    return list(dict.fromkeys(found))


def _recorded_paths(cfg, recorded: dict, run_dir: Path, explicit=()):
    """``cfg`` with each file option (not given anew, ``explicit``) replaced by the first existing of its
    :func:`_candidates`; a :class:`gpattn.experiments.data.DataNotFoundError` naming what was tried and the option
    that fixes it when none exists."""
    from gpattn.experiments.data._bundle import DataNotFoundError, resolve_data_dir

    options, data_dir = dict(cfg.dataset_options), resolve_data_dir(cfg.data_dir)
    for option, role in _FILE_OPTIONS.items():
        value = options.get(option)
        if value is None or option in explicit:
            continue
        given = list(value) if isinstance(value, (list, tuple)) else [value]
        saved = [f for f in recorded.get("files", []) if f.get("role") == role]
        if len(saved) != len(given):
            continue
        fixed = []
        for one, record in zip(map(str, given), saved):
            tried = _candidates(one, record, data_dir, run_dir)
            hit = next((p for p in tried if p.is_file()), None)
            if hit is None:
                raise DataNotFoundError(
                    f"the run in {run_dir} read its {option} file {one!r}, which is not there any more: tried "
                    f"{', '.join(map(str, tried))}. If the data moved, pass its new place: gpattn evaluate ... "
                    f"--dataset-option {option}=NEW_PATH (Python: load_run_with_data(run, dataset_options="
                    f"{{'{option}': NEW_PATH}})), or --data-dir DIR for the folder that holds {one!r}; its content "
                    f"must be the same (sha256 {record.get('sha256', '')[:12]}…)."
                )
            fixed.append(str(hit))
        options[option] = fixed if isinstance(value, (list, tuple)) else fixed[0]
    return dataclasses.replace(cfg, dataset_options=options)


def record_run_paths(summary: dict, run_dir: Path) -> dict:
    """``summary`` (data.json) with each file's path also relative to ``run_dir`` (``path_from_run``), so that a
    run moved together with its data still finds it."""
    for record in summary.get("files", []):
        try:
            record["path_from_run"] = os.path.relpath(record["path"], Path(run_dir).resolve())
        except ValueError:  # another drive (Windows): no relative path
            pass
    return summary


def _changed_files(recorded: dict, now: dict) -> list[str]:
    old = {(f.get("role"), i): f for i, f in enumerate(recorded.get("files", []))}
    changed = []
    for i, f in enumerate(now.get("files", [])):
        before = old.get((f.get("role"), i))
        if before is None:
            changed.append(f"{f['path']} ({f.get('role')}: not read by the run)")
        elif before.get("sha256") != f.get("sha256"):
            was, now = before.get("sha256", "")[:12], f["sha256"][:12]
            changed.append(f"{f['path']} ({f.get('role')}: {before.get('rows')} rows, sha256 {was}… then; "
                           f"{f.get('rows')} rows, sha256 {now}… now)")
    return changed


def load_checked_data(ckpt_path, cfg, for_model, explicit=()):
    """The run's data set, reloaded (``for_model`` applied, as in training) and checked against the fingerprint
    in the ``data.json`` beside ``ckpt_path``: a :class:`ValueError` naming the changed files when it differs.
    Its files are looked up as :func:`_recorded_paths` says, except the options in ``explicit`` (given anew)."""
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.data.summary import data_summary

    data_file = Path(ckpt_path).parent / "data.json"
    recorded = json.loads(data_file.read_text()) if data_file.is_file() else None
    if recorded is not None:
        cfg = _recorded_paths(cfg, recorded, data_file.parent, explicit)
    bundle = for_model(load_dataset(cfg.dataset, data_dir=cfg.data_dir, download=cfg.download, seed=cfg.seed,
                                    **cfg.dataset_options))
    if recorded is None or "fingerprint" not in recorded:
        warn(f"{data_file} is missing or holds no data fingerprint: cannot check that the data set is the one the "
             f"run was trained on", DataWarning)
        return bundle
    now = data_summary(bundle)
    if now["fingerprint"] != recorded["fingerprint"]:
        changed = _changed_files(recorded, now) or ["no file's content changed: the loader or its options did"]
        raise ValueError(
            f"the data set of {ckpt_path} changed since the run was trained (fingerprint "
            f"{recorded['fingerprint'][:12]}… in {data_file}, {now['fingerprint'][:12]}… now): "
            f"{'; '.join(changed)}. "
            f"Restore the data the run was trained on, or train again on the new data (gpattn train ... --overwrite)."
        )
    return bundle
