"""Reliability, round four (issue #46, the rest): duplicate texts between splits and evaluation files, a model
shaped by the training splits only, evaluate pointed at moved data, and the frictions a new user noticed; each
test names what happened before the fix."""

from __future__ import annotations

import json

import pytest

from gpattn.experiments.data import load_dataset
from gpattn.experiments.data._duplicates import DuplicateTextWarning
from gpattn.experiments.data.fixtures import make_text_table

TINY = ["--embed-dim", "8", "--num-heads", "2", "--num-layers", "1", "--epochs", "1", "--num-samples", "1",
        "--no-progress"]


def _rows(path):
    return path.read_text(encoding="utf-8").splitlines()[1:]


def test_training_texts_inside_an_evaluation_file_are_counted_and_warned_about(tmp_path, capsys):
    # before: 300 training rows copied into the shift file gave no word; the shift metrics included training data
    from gpattn.experiments.cli import main

    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    shift = make_text_table(tmp_path / "shift.tsv", n=20, seed=10, class_names=("0", "1"))
    copied = load_dataset("text_table", path=train).texts["train"][:15]
    shift.write_text("text\tlabel\n" + "\n".join(_rows(shift) + [f"{t}\t1" for t in copied]) + "\n", encoding="utf-8")
    with pytest.warns(DuplicateTextWarning, match=r"15 of 35 rows of evaluation split 'shift' \(.*shift.tsv\) are "
                      r"exact copies of training texts \(train: 15(, val: \d+)?\) of .*train.tsv"):
        bundle = load_dataset("text_table", path=train, shift_file=shift)
    dup = bundle.info["duplicates"]
    assert dup["between"]["train/shift"] == 15
    with pytest.warns(DuplicateTextWarning):
        assert main(["train", "--dataset", "text_table", "--dataset-option", f"path={train}", "--dataset-option",
                     f"shift_file={shift}", "--attention", "softmax", *TINY, "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "exact duplicate texts:" in out and "of `shift` also in `train`" in out
    saved = json.loads((tmp_path / "run" / "data.json").read_text())["duplicates"]
    assert saved == json.loads(json.dumps(dup))
    # no copy: no warning (filterwarnings=error), and the header says so
    clean = load_dataset("text_table", path=train, shift_file=make_text_table(tmp_path / "s2.tsv", n=20, seed=10,
                                                                              class_names=("0", "1")))
    assert not any(k.endswith("/shift") for k in clean.info["duplicates"]["between"])
