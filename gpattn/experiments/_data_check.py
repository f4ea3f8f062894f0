"""Reloading a run's data set for ``gpattn evaluate`` (issue #46 item 5).

After a data file changed, evaluate failed with a state-dict size-mismatch traceback that never said so (or,
with the same shapes, would have evaluated against other data without a word); a relative data path, stored
relative to the training command's working directory, was not found from another folder. Here the run's
``data.json`` (beside its checkpoint) supplies the absolute paths it read, and its content fingerprint is
compared with the reloaded data's before any model is built: a difference is an error naming the changed file.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

#: text_table options that name files, and the role data.json records their files under
_FILE_OPTIONS = {"path": "train", "shift_file": "shift", "ood_file": "ood"}


def _recorded_paths(cfg, recorded: dict):
    """``cfg`` with each relative file option that exists neither in the working directory nor in ``data_dir``
    replaced by the absolute path data.json recorded for it (the run's own working directory)."""
    options = dict(cfg.dataset_options)
    for option, role in _FILE_OPTIONS.items():
        value = options.get(option)
        if value is None:
            continue
        given = list(value) if isinstance(value, (list, tuple)) else [value]
        saved = [f["path"] for f in recorded.get("files", []) if f.get("role") == role]
        if len(saved) != len(given):
            continue
        fixed = [
            p if Path(p).expanduser().is_absolute() or Path(p).is_file() or (Path(cfg.data_dir or ".") / p).is_file()
            else s for p, s in zip(map(str, given), saved)
        ]
        options[option] = fixed if isinstance(value, (list, tuple)) else fixed[0]
    return dataclasses.replace(cfg, dataset_options=options)


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


def load_checked_data(ckpt_path, cfg, for_model):
    """The run's data set, reloaded (``for_model`` applied, as in training) and checked against the fingerprint
    in the ``data.json`` beside ``ckpt_path``: a :class:`ValueError` naming the changed files when it differs."""
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.data.summary import data_summary

    data_file = Path(ckpt_path).parent / "data.json"
    recorded = json.loads(data_file.read_text()) if data_file.is_file() else None
    if recorded is not None:
        cfg = _recorded_paths(cfg, recorded)
    bundle = for_model(load_dataset(cfg.dataset, data_dir=cfg.data_dir, download=cfg.download, seed=cfg.seed,
                                    **cfg.dataset_options))
    if recorded is None or "fingerprint" not in recorded:
        warnings.warn(f"{data_file} is missing or holds no data fingerprint: cannot check that the data set is the "
                      f"one the run was trained on", stacklevel=3)
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
