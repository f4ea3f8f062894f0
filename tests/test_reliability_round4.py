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


def _train_text(tmp_path, name, monkeypatch=None, **options):
    from gpattn.experiments.training import TrainConfig, train

    cfg = TrainConfig(dataset="text_table", dataset_options=options, attention="softmax", embed_dim=8, num_heads=2,
                      num_layers=1, epochs=1, num_samples=1, progress=False)
    train(cfg, tmp_path / name)
    return tmp_path / name


@pytest.fixture
def long_shift(tmp_path):
    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    shift = make_text_table(tmp_path / "shift.tsv", n=20, seed=10, class_names=("0", "1"))
    shift.write_text(shift.read_text() + " ".join(["a very long review of the film"] * 6) + "\t1\n")
    return train, shift


def test_the_model_is_shaped_by_the_training_splits_and_longer_eval_rows_are_cut_with_a_warning(tmp_path,
                                                                                                long_shift):
    # before: the positional embedding was sized by the longest sequence of every split, the shift file
    # included: adding a shift file changed the trained model
    import torch

    from gpattn.experiments.inference import load_run
    from gpattn.experiments.training import load_run_with_data

    train, shift = long_shift
    alone = _train_text(tmp_path, "alone", path=str(train))
    with pytest.warns(UserWarning, match=r"1 of 21 rows of split 'shift' are longer than the (\d+) tokens of the "
                      r"longest training sequence \(train/val\).*keep their first \1 tokens"):
        both = _train_text(tmp_path, "both", path=str(train), shift_file=str(shift))
    a, b = (torch.load(r / "checkpoint.pt", weights_only=True)["model"] for r in (alone, both))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same model, bit for bit
    data = json.loads((both / "data.json").read_text())
    assert data["cut_to_model"] == {"tokens": a["pos"].shape[1], "rows": {"shift": 1}}
    with pytest.warns(UserWarning, match="rows of split 'shift' are longer"):
        _, model, bundle, _ = load_run_with_data(both)
    assert bundle.splits["shift"].inputs.shape[1] == model.max_tokens == a["pos"].shape[1]
    assert load_run(both).predict([" ".join(["film"] * 80)]).probs.shape == (1, 2)


def test_a_run_whose_embedding_was_sized_by_every_split_still_loads_and_evaluates(tmp_path, long_shift,
                                                                                  monkeypatch, capsys):
    # a run trained before the change recorded (and was built for) the longest sequence over every split
    from gpattn.experiments import _runs, training
    from gpattn.experiments.cli import main
    from gpattn.experiments.inference import load_run

    train, shift = long_shift
    every = lambda bundle: max(int(s.inputs.shape[1]) for s in bundle.splits.values())  # noqa: E731
    monkeypatch.setattr(_runs, "model_positions", every)
    monkeypatch.setattr(training, "model_positions", every)
    old = _train_text(tmp_path, "old", path=str(train), shift_file=str(shift))
    monkeypatch.undo()
    before = json.loads((old / "metrics.json").read_text())
    assert main(["evaluate", "--checkpoint", str(old / "checkpoint.pt"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert again["shift"]["accuracy"] == before["shift"]["accuracy"]  # nothing cut: the run's own width
    assert load_run(old).model.max_tokens > load_run(_train_text(tmp_path, "new", path=str(train))).model.max_tokens
