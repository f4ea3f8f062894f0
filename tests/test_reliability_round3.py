"""Reliability, round three (issue #46): label spellings inside one file, a lock on a run folder, and the
other traps a new user met; each test names what happened before the fix."""

from __future__ import annotations

import pytest

from gpattn.experiments.data import load_dataset
from gpattn.experiments.data.fixtures import make_text_table


def _table(tmp_path, name="t.tsv", n=60, **kw):
    return make_text_table(tmp_path / name, n=n, class_names=("0", "1"), **kw)


def _relabel(path, every: int, old: str, new: str) -> None:
    """Rewrite the label ``old`` as ``new`` on every ``every``-th data row."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for i in range(1, len(lines), every):
        text, label = lines[i].rsplit("\t", 1)
        if label == old:
            lines[i] = f"{text}\t{new}"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize(
    "old, new, why",
    [("1", "1.0", "equal as numbers"), ("1", " One", None), ("0", "nan", "spells a missing value")],
)
def test_label_spellings_inside_one_file_are_an_error_naming_spellings_and_lines(tmp_path, old, new, why):
    # before: '1' and '1.0' (or 'Positive' and 'positive') in one file became 4 classes; 'nan' a third class
    path = make_text_table(tmp_path / "t.tsv", n=60, class_names=("0", "1") if new != " One" else ("0", "one"))
    if new == " One":
        old, new, why = "one", "One", "equal up to case and whitespace"
    _relabel(path, 3, old, new)
    with pytest.raises(ValueError, match=r"t.tsv lines? \d+.*label_spellings='allow'") as caught:
        load_dataset("text_table", path=path)
    assert why in str(caught.value) and repr(new) in str(caught.value)
    bundle = load_dataset("text_table", path=path, label_spellings="allow", min_class_count=1)
    assert new in bundle.info["class_names"]


def _tiny_train(out, bundle):
    from gpattn.experiments.training import TrainConfig, train

    cfg = TrainConfig(attention="softmax", embed_dim=8, num_heads=2, num_layers=1, epochs=1, num_samples=1,
                      progress=False)
    return train(cfg, out, bundle=bundle)


def test_a_second_writer_of_a_run_folder_gets_an_error_naming_the_holders_pid(tmp_path):
    # before: two `train` processes on one --out both exited 0, one run's files lost
    import json
    import os
    import socket
    import subprocess
    import sys

    from gpattn.experiments._runlock import LOCK_NAME, RunFolderLockedError

    bundle = load_dataset("digits", seed=0)
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        with pytest.raises(RunFolderLockedError, match=rf"another run \(process {holder.pid} on .*another --out"):
            _tiny_train(out, bundle)
        assert not (out / "metrics.json").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale, replaced with a warning, and removed when the run ends
    with pytest.warns(UserWarning, match=rf"stale lock of process {holder.pid}"):
        _tiny_train(out, bundle)
    assert (out / "metrics.json").is_file() and not (out / LOCK_NAME).exists()
    assert os.getpid() != holder.pid


def test_compare_refuses_to_replace_finished_runs_and_names_rows_it_drops(tmp_path, capsys):
    # before: another configuration into a finished --out retrained ("trained (configuration changed)") and
    # report.md / results.json held only the new call, the earlier rows dropped without a word
    from gpattn.experiments.cli import main

    out = tmp_path / "cmp"
    tiny = ["--dataset", "digits", "--embed-dim", "8", "--num-heads", "2", "--num-layers", "1", "--epochs", "1",
            "--num-samples", "1", "--no-progress", "--out", str(out)]
    assert main(["compare", "--attention", "softmax", "--seeds", "0,1", *tiny]) == 0
    capsys.readouterr()
    assert main(["compare", "--attention", "softmax", "--seeds", "0", "--lr", "0.02", *tiny]) == 2
    err = capsys.readouterr().err
    assert "softmax seed 0:" in err and "(configuration changed). Pass --overwrite" in err
    assert main(["compare", "--attention", "softmax", "--seeds", "0", "--lr", "0.02", "--overwrite", *tiny]) == 0
    log = capsys.readouterr().out
    assert "1 of its rows are not in this call (softmax seed 1)" in log
    assert "softmax seed 1" in (out / "report.md").read_text()


def test_evaluate_names_the_changed_data_file_and_finds_relative_paths_from_another_folder(tmp_path, capsys,
                                                                                          monkeypatch):
    # before: a state-dict size-mismatch traceback that never said the data changed; and a relative path,
    # stored relative to the training command's folder, was not found by evaluate run from another folder
    from gpattn.experiments.cli import main

    data = tmp_path / "data"
    data.mkdir()
    make_text_table(data / "train.tsv", n=60, class_names=("0", "1"))
    make_text_table(data / "shift.tsv", n=20, seed=10, class_names=("0", "1"))  # no training text
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--dataset", "text_table", "--dataset-option", "path=data/train.tsv",
                 "--dataset-option", "shift_file=data/shift.tsv", "--attention", "softmax", "--embed-dim", "8",
                 "--num-heads", "2", "--num-layers", "1", "--epochs", "1", "--num-samples", "1", "--no-progress",
                 "--out", str(run)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["evaluate", "--checkpoint", str(run / "checkpoint.pt")]) == 0
    capsys.readouterr()
    shift = data / "shift.tsv"
    shift.write_text(shift.read_text() + "a new and much much longer sentence than any other one in here\t1\n")
    assert main(["evaluate", "--checkpoint", str(run / "checkpoint.pt")]) == 2
    err = capsys.readouterr().err
    assert "changed since the run was trained" in err and "shift.tsv (shift: 20 rows" in err and "21 rows" in err


def test_a_cp1252_file_read_as_latin1_is_an_error_suggesting_cp1252(tmp_path):
    # before: curly quotes became C1 control characters (U+0093) and vocabulary tokens, without a word
    path = _table(tmp_path)
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[3] = lines[3].replace("The film", "The \u201cfilm\u201d", 1)
    path.write_bytes(("\n".join(lines) + "\n").encode("cp1252"))
    with pytest.raises(ValueError, match=r"t.tsv line 4: decoded with encoding='latin-1'.*U\+0093.*encoding=cp1252"):
        load_dataset("text_table", path=path, encoding="latin-1")
    bundle = load_dataset("text_table", path=path, encoding="cp1252")
    assert "\u201c" in " ".join(bundle.vocab) or "film" in bundle.vocab


def test_a_one_row_shift_file_warns_with_the_count(tmp_path):
    # before: shift metrics on 1 example without a word
    path = _table(tmp_path)
    shift = tmp_path / "shift.tsv"
    shift.write_text("text\tlabel\na fine film\t1\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"evaluation split 'shift' has 1 row\(s\) \(1 labelled\)"):
        load_dataset("text_table", path=path, shift_file=shift)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    from gpattn.experiments.inference import load_run
    from gpattn.experiments.training import TrainConfig, train

    root = tmp_path_factory.mktemp("textrun")
    path = make_text_table(root / "t.tsv", n=60, class_names=("0", "1"))
    cfg = TrainConfig(dataset="text_table", dataset_options={"path": str(path)}, attention="softmax", embed_dim=8,
                      num_heads=2, num_layers=1, epochs=1, num_samples=1, progress=False)
    train(cfg, root / "run")
    return load_run(root / "run")


@pytest.mark.parametrize("inputs, words", [
    (None, r"inputs must be a list of strings .*got NoneType"),
    (123, r"inputs must be a list of strings .*got int 123"),
    (["ok", 5], r"1 of 2 are not \(position 1: int 5\)"),
])
def test_predict_with_inputs_that_are_not_texts_is_a_type_error_naming_them(text_run, inputs, words):
    # before: "TypeError: 'NoneType' object is not iterable"; ["ok", 5] named neither the position nor the type
    with pytest.raises(TypeError, match=words):
        text_run.predict(inputs)


def test_out_naming_a_regular_file_and_an_interrupt_without_a_reason(tmp_path, capsys, monkeypatch):
    # before: a FileExistsError traceback; and "interrupted ()" when the interrupt carried no message
    from gpattn.experiments import cli

    file = tmp_path / "results.txt"
    file.write_text("not a folder\n")
    assert cli.main(["train", "--dataset", "digits", "--attention", "softmax", "--out", str(file)]) == 2
    assert "--out " + str(file) + " is an existing file, not a folder" in capsys.readouterr().err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_train", interrupted)
    monkeypatch.setattr(cli, "build_parser", lambda real=cli.build_parser: _with_func(real(), interrupted))
    assert cli.main(["train", "--dataset", "digits", "--attention", "softmax", "--out", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err
    assert "interrupted; the last checkpoint" in err and "()" not in err


def _with_func(parser, func):
    parser.set_defaults(func=func)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(func=func)
    return parser


def test_predict_bounds_rows_by_samples_times_tokens(text_run, monkeypatch):
    # before: every forward pass took batch_size=256 rows whatever num_samples and the text length (cgp, 300
    # texts at num_samples=50: killed at about 20 GB)
    from gpattn.experiments.inference import PREDICT_PAIR_BUDGET, PREDICT_TOKEN_BUDGET

    seen, forward = [], text_run.model.forward

    def recording(x, mask=None, num_samples=1):
        seen.append(x.shape[0] * num_samples * x.shape[1])
        return forward(x, mask, num_samples=num_samples)

    monkeypatch.setattr(text_run.model, "forward", recording)
    texts = [" ".join(["a fine film"] * 20)] * 300
    pred = text_run.predict(texts, num_samples=50)
    tokens = text_run.encode(texts[:1])[0].shape[1]
    assert pred.probs.shape[0] == 300 and len(seen) > 1
    assert max(seen) <= PREDICT_TOKEN_BUDGET and max(seen) * tokens <= PREDICT_PAIR_BUDGET
