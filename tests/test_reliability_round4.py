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


def _train_text(tmp_path, name, attention="softmax", **options):
    """A one-epoch run of a tiny model on the text_table ``options`` in ``tmp_path / name``."""
    from gpattn.experiments.training import TrainConfig, train

    cfg = TrainConfig(dataset="text_table", dataset_options=options, attention=attention, embed_dim=8, num_heads=2,
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


def test_evaluate_takes_dataset_options_for_moved_data_and_finds_data_moved_with_the_run(tmp_path, capsys,
                                                                                       monkeypatch):
    # before: evaluate took no --dataset-option, and moved data failed with the loader's own not-found message
    import shutil

    from gpattn.experiments.cli import main

    project = tmp_path / "project"
    make_text_table(project / "data" / "train.tsv", n=60, class_names=("0", "1"))
    make_text_table(project / "data" / "shift.tsv", n=20, seed=10, class_names=("0", "1"))
    monkeypatch.chdir(project)
    assert main(["train", "--dataset", "text_table", "--dataset-option", "path=data/train.tsv", "--dataset-option",
                 "shift_file=data/shift.tsv", "--attention", "softmax", *TINY, "--out", "runs/a"]) == 0
    capsys.readouterr()
    # the project folder moved: the run finds its data by the paths data.json holds relative to the run folder
    moved = tmp_path / "moved"
    shutil.move(project, moved)
    monkeypatch.chdir(tmp_path)
    assert main(["evaluate", "--checkpoint", str(moved / "runs" / "a"), "--out", str(tmp_path / "e1")]) == 0
    # the data alone moved: an error naming what was tried and the option; the option then finds it
    shutil.move(moved / "data", tmp_path / "elsewhere")
    assert main(["evaluate", "--checkpoint", str(moved / "runs" / "a"), "--out", str(tmp_path / "e2")]) == 2
    err = capsys.readouterr().err
    assert "read its path file 'data/train.tsv', which is not there any more: tried data/train.tsv" in err
    assert str(moved / "data" / "train.tsv") in err and "--dataset-option path=NEW_PATH" in err
    assert main(["evaluate", "--checkpoint", str(moved / "runs" / "a"), "--dataset-option", "path=elsewhere/train.tsv",
                 "--dataset-option", "shift_file=elsewhere/shift.tsv", "--out", str(tmp_path / "e3")]) == 0
    assert main(["evaluate", "--checkpoint", str(moved / "runs" / "a"), "--data-dir", str(tmp_path / "elsewhere"),
                 "--dataset-option", "path=train.tsv", "--dataset-option", "shift_file=shift.tsv",
                 "--out", str(tmp_path / "e4")]) == 0
    first, third = (json.loads((tmp_path / e / "metrics.json").read_text()) for e in ("e1", "e3"))
    assert first["shift"]["accuracy"] == third["shift"]["accuracy"]


def test_help_shows_the_defaults(capsys):
    # before: --help showed no default of epochs, lr, samples, width, heads, layers, dropout, beta, alpha
    import re

    from gpattn.experiments.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    for flag, default in (("--epochs EPOCHS", "10"), ("--lr LR", "0.001"), ("--num-samples NUM_SAMPLES", "10"),
                          ("--embed-dim EMBED_DIM", "64"), ("--num-heads NUM_HEADS", "4"), ("--dropout", "0.1"),
                          ("--num-layers NUM_LAYERS", "2"), ("--beta BETA", "1"), ("--alpha ALPHA", "1e-06"),
                          ("--seed SEED", "0"), ("--attention ATTENTION", "softmax")):
        after = shown.split(flag, 1)[1]
        found = re.search(r"\(default: ([^)]*)\)", after)
        assert found.group(1) == default and not re.search(r" --[a-z-]+ [A-Z_]+ ", after[: found.start()]), flag


def test_no_progress_prints_the_data_header_first_and_a_line_per_epoch_into_a_file(tmp_path):
    # before: with --no-progress a run was silent until it ended, and with stdout redirected to a file the data
    # header came after training
    import subprocess

    from tests._cli_helpers import single_thread_env, train_cmd

    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        done = subprocess.run(train_cmd("softmax", 2, "--num-samples", "2", "--out", str(tmp_path / "run")),
                              env=single_thread_env(), stdout=handle, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = log.read_text().splitlines()
    epochs = [i for i, line in enumerate(lines) if line.startswith("[train] softmax seed 0: epoch ")]
    assert lines.index("data:") < epochs[0] and len(epochs) == 2
    assert "epoch 2/2, loss " in lines[epochs[1]]
    assert all(", val NLL " in lines[i] and ", val accuracy " in lines[i] for i in epochs)
    assert epochs[-1] < next(i for i, line in enumerate(lines) if line.startswith("wrote "))


def test_a_many_class_table_is_summarised_in_the_header_and_listed_in_data_json(tmp_path):
    # before: a 150-class table printed every class count of every split, thousands of characters
    from gpattn.experiments.data.summary import data_summary, summary_lines

    rows = [f"query number {i} about topic {k}\tintent_{k:02d}" for k in range(25) for i in range(10)]
    path = tmp_path / "intents.tsv"
    path.write_text("text\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    summary = data_summary(load_dataset("text_table", path=path))
    train_line = next(line for line in summary_lines(summary) if line.startswith("- split `train`"))
    assert "25 classes, rows per class min 7 (intent_00) / median 7 / max 7; every count in data.json" in train_line
    assert len(train_line) < 200 and len(summary["class_counts"]["train"]) == 25


@pytest.fixture(scope="module")
def sampling_run(tmp_path_factory):
    from gpattn.experiments.inference import load_run

    root = tmp_path_factory.mktemp("sgpa")
    path = make_text_table(root / "t.tsv", n=60, class_names=("0", "1"))
    return load_run(_train_text(root, "run", attention="sgpa", path=str(path)))


def test_predict_with_a_seed_gives_the_same_mutual_information(sampling_run):
    # before: predict had no seed; two calls gave different mutual information for the same text
    import torch

    texts = ["the film was dull and the cast bad", "a fine film"]
    state = torch.get_rng_state()
    first, again = (sampling_run.predict(texts, num_samples=8, seed=3) for _ in range(2))
    assert torch.equal(first.mutual_information, again.mutual_information) and torch.equal(first.probs, again.probs)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is left as it was
    other = sampling_run.predict(texts, num_samples=8, seed=4)
    assert not torch.equal(first.sample_probs, other.sample_probs)  # the samples do vary
    with pytest.raises(ValueError, match="seed must be None or a non-negative int, got -1"):
        sampling_run.predict(texts, seed=-1)
