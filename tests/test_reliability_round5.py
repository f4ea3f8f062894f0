"""Reliability, round five (issue #59): evaluate that writes where it should, seeded and recorded; warnings at the
user's line; hints that lead somewhere. Each test names what happened before the fix, and where a hint is given,
follows it and checks that the next command succeeds."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from gpattn.experiments.cli import main
from gpattn.experiments.data.fixtures import make_text_table

TINY = ["--embed-dim", "8", "--num-heads", "2", "--num-layers", "1", "--epochs", "1", "--no-progress"]
REPO = Path(__file__).resolve().parents[1]


def _train(tmp_path, name="run", attention="softmax", *extra, samples="1"):
    """A one-epoch CLI run of a tiny model on a generated two-class table; its folder."""
    table = tmp_path / "train.tsv"
    if not table.is_file():
        make_text_table(table, n=60, class_names=("0", "1"))
    assert main(["train", "--dataset", "text_table", "--dataset-option", f"path={table}", "--attention", attention,
                 *TINY, "--num-samples", samples, *extra, "--out", str(tmp_path / name)]) == 0
    return tmp_path / name


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """A finished sgpa run (Monte-Carlo predictions: each evaluation draws) and its training metrics, as bytes."""
    root = tmp_path_factory.mktemp("sampled")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one tiny epoch sits at the base rate
        run = _train(root, "run", "sgpa", samples="3")
    return run, (run / "metrics.json").read_bytes()


def _metrics(folder):
    return json.loads((Path(folder) / "metrics.json").read_text())


# ----------------------------------------------------------------------------- items 1, 2: where evaluate writes
def test_evaluate_keeps_trainings_metrics_and_is_seeded_and_recorded(sampled_run, tmp_path, capsys):
    # before: `evaluate --checkpoint RUN/checkpoint.pt` replaced training's metrics.json with fresh, unseeded draws
    run, trained = sampled_run
    ckpt = str(run / "checkpoint.pt")
    assert main(["evaluate", "--checkpoint", ckpt, "--no-progress", "--out", str(tmp_path / "a")]) == 0
    assert (run / "metrics.json").read_bytes() == trained  # training's record is untouched
    record = json.loads((tmp_path / "a" / "evaluation.json").read_text())
    assert record["seed"] == 0 and record["seed_from"].startswith("the run's seed") and record["num_samples"] == 3
    assert record["checkpoint"] == str(Path(ckpt).resolve()) and len(record["checkpoint_sha256"]) == 64
    # the same command, the same numbers (the draws are seeded); another seed, other draws, recorded
    assert main(["evaluate", "--checkpoint", ckpt, "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    assert main(["evaluate", "--checkpoint", ckpt, "--no-progress", "--seed", "5", "--out", str(tmp_path / "c")]) == 0
    assert _metrics(tmp_path / "c")["in_domain"]["nll"] != _metrics(tmp_path / "a")["in_domain"]["nll"]
    assert json.loads((tmp_path / "c" / "evaluation.json").read_text())["seed"] == 5
    capsys.readouterr()
    # an --out holding an evaluation, or the run's own metrics.json, is refused; --overwrite (the hint) replaces it
    assert main(["evaluate", "--checkpoint", ckpt, "--no-progress", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier evaluation (seed 0, 3 samples" in err and "pass --overwrite" in err
    assert main(["evaluate", "--checkpoint", ckpt, "--no-progress", "--out", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--out {run} holds a metrics.json that training wrote" in err and "--overwrite" in err
    assert (run / "metrics.json").read_bytes() == trained
    assert main(["evaluate", "--checkpoint", ckpt, "--no-progress", "--seed", "5", "--out", str(tmp_path / "a"),
                 "--overwrite"]) == 0
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "c")


def test_evaluate_of_a_run_folder_writes_into_the_run_never_its_parent(tmp_path, capsys):
    # before: `evaluate --checkpoint RUN` (the form docs/cli.md shows) wrote metrics.json into RUN's parent
    run = _train(tmp_path)
    trained = (run / "metrics.json").read_bytes()
    assert main(["evaluate", "--checkpoint", str(run), "--no-progress"]) == 0
    assert not (tmp_path / "metrics.json").exists()
    assert (run / "evaluation" / "evaluation.json").is_file() and (run / "metrics.json").read_bytes() == trained
    assert f"wrote {run / 'evaluation' / 'metrics.json'}" in capsys.readouterr().out
    assert main(["evaluate", "--checkpoint", str(run), "--no-progress"]) == 2
    assert "evaluate's default folder when no --out is given" in capsys.readouterr().err
    # retraining the run: the evaluation of the replaced model goes with it, and says so
    _train(tmp_path, "run", "softmax", "--overwrite")
    assert not (run / "evaluation").exists() and "an evaluation of the run --overwrite replaces" in capsys.readouterr().out


# ----------------------------------------------------------------------------- item 3: zero samples
def test_zero_samples_is_refused_not_read_as_the_default(sampled_run, capsys):
    # before: num_samples=0 in predict and --num-samples 0 in evaluate silently meant "the run's default"
    from gpattn.experiments.inference import load_run

    run, _ = sampled_run
    with pytest.raises(ValueError, match="num_samples must be a positive int, got 0"):
        load_run(run).predict(["a fine film"], num_samples=0)
    assert main(["evaluate", "--checkpoint", str(run), "--num-samples", "0", "--out", str(run / "e0")]) == 2
    assert "--num-samples must be a positive int (leave it out for the run's 3), got 0" in capsys.readouterr().err
    assert not (run / "e0").exists()


# ----------------------------------------------------------------------------- item 4: texts of unknown words only
def test_texts_of_unknown_words_only_warn_naming_their_positions(sampled_run):
    # before: another script, emoji or zero-width spaces got confident predictions (p = 0.96) without a word
    from gpattn.experiments.inference import UnknownWordsWarning, load_run

    run = load_run(sampled_run[0])
    texts = ["a fine film", "日本語のテキスト", "🙂🙂", "\u200b\u200b", "film 🙂"]
    with pytest.warns(UnknownWordsWarning, match=r"3 of 5 texts hold no word the model knows \(positions 1, 2, 3,") \
            as caught:
        assert run.predict(texts, num_samples=2, seed=0).probs.shape == (5, 2)
    assert caught[0].filename == __file__  # shown at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a text with one known word, and known texts: no warning
        run.predict(["a fine film", "film 🙂"], num_samples=2, seed=0)


# ----------------------------------------------------------------------------- item 9: evaluate's flags
def test_evaluate_takes_no_progress_and_max_len_without_encoder_points_at_the_data_option(sampled_run, tmp_path,
                                                                                         capsys):
    # before: evaluate refused --no-progress; --max-len without --encoder named no way to cut the texts
    run, _ = sampled_run
    assert main(["evaluate", "--checkpoint", str(run), "--out", str(tmp_path / "bar")]) == 0
    assert "evaluating test" in capsys.readouterr().err  # a bar per split without the flag
    assert main(["evaluate", "--checkpoint", str(run), "--no-progress", "--out", str(tmp_path / "quiet")]) == 0
    assert "evaluating" not in capsys.readouterr().err
    table = make_text_table(tmp_path / "t.tsv", n=60, class_names=("0", "1"))
    argv = ["train", "--dataset", "text_table", "--dataset-option", f"path={table}", *TINY, "--num-samples", "1"]
    assert main([*argv, "--max-len", "5", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "without --encoder the tokens kept per text are the data set's max_len option (default 256): " \
           "--dataset-option max_len=5" in err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cut is warned about (item 13's test)
        assert main([*argv, "--dataset-option", "max_len=5", "--out", str(tmp_path / "m")]) == 0


# ----------------------------------------------------------------------------- item 12: warnings users can read
def test_cli_warnings_are_lines_of_the_command_without_internal_files(tmp_path):
    # before: "…/gpattn/experiments/_runlock.py:97: GPCollapseWarning: softmax seed 0: …" then "return fn(*args,
    # **kwargs)"; DuplicateTextWarning pointed at _bundle.py:220
    from gpattn.experiments.data import load_dataset

    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    copied = load_dataset("text_table", path=train).texts["train"][:5]
    shift = make_text_table(tmp_path / "shift.tsv", n=20, seed=10, class_names=("0", "1"))
    shift.write_text(shift.read_text() + "".join(f"{t}\t1\n" for t in copied), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "gpattn", "train", "--dataset", "text_table", "--dataset-option", f"path={train}",
         "--dataset-option", f"shift_file={shift}", *TINY, "--num-samples", "1", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert any(line.startswith("gpattn train: warning: text_table: 5 of 25 rows of evaluation split 'shift'")
               for line in lines)
    assert any(line.startswith("gpattn train: warning: softmax seed 0: training cross-entropy") for line in lines)
    assert not [line for line in lines if ".py:" in line or "return fn(" in line or "Warning:" in line]


def test_python_warnings_point_at_the_callers_line(tmp_path):
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.diagnostics import CollapseWarning, GPCollapseWarning
    from gpattn.experiments.training import TrainConfig, train

    assert GPCollapseWarning is CollapseWarning  # the old name still filters the same warnings
    train_file = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    shift = tmp_path / "shift.tsv"
    shift.write_text("text\tlabel\n" + "".join(f"{t}\t1\n" for t in load_dataset(
        "text_table", path=train_file).texts["train"][:6]), encoding="utf-8")
    cfg = TrainConfig(dataset="text_table", dataset_options={"path": str(train_file), "shift_file": str(shift)},
                      embed_dim=8, num_heads=2, num_layers=1, epochs=1, num_samples=1, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, tmp_path / "run")
    shown = {(w.category.__name__, Path(w.filename).name) for w in caught}
    assert ("DuplicateTextWarning", Path(__file__).name) in shown and ("CollapseWarning", Path(__file__).name) in shown
    assert all(Path(w.filename).name == Path(__file__).name for w in caught), shown
