"""A predict API that cannot misread, run folders that are not overwritten or left half-written, and CLI
messages that name the fix (issue #28)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import gpattn
from gpattn.experiments import compare as compare_module
from gpattn.experiments.cli import main
from gpattn.experiments.data.fixtures import make_text_table
from gpattn.experiments.training import TrainConfig, train

TINY = ["--embed-dim", "16", "--num-heads", "2", "--num-layers", "1", "--num-samples", "2", "--no-progress"]


def _train_args(table, out, *extra):
    return [
        "train",
        "--dataset",
        "text_table",
        "--dataset-option",
        f"path={table}",
        "--attention",
        "softmax",
        "--epochs",
        "1",
        *TINY,
        "--out",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    table = make_text_table(root / "reviews.tsv", n=60, class_names=("neg", "pos"))
    assert main(_train_args(table, root / "run")) == 0
    return root / "run", table


def test_predict_takes_a_bare_string_as_one_text(text_run):
    # before: predict("Great phone, love it.") gave 21 predictions, one per character
    run = gpattn.experiments.load_run(text_run[0])
    torch.manual_seed(0)
    one = run.predict("great film , love it", num_samples=2)
    torch.manual_seed(0)
    listed = run.predict(["great film , love it"], num_samples=2)
    assert one.probs.shape == (1, 2) and len(one.labels) == 1
    torch.testing.assert_close(one.probs, listed.probs)


def test_predict_warns_on_empty_texts(text_run):
    # before: predict([""]) gave a confident answer without a word
    run = gpattn.experiments.load_run(text_run[0])
    with pytest.warns(UserWarning, match=r"2 of 3 texts are empty or only whitespace \(positions 0, 2\)") as seen:
        pred = run.predict(["", "a good film", "   "], num_samples=2)
    assert pred.probs.shape == (3, 2)
    assert {type(w.message).__name__ for w in seen} == {"EmptyTextWarning"}


def test_load_run_on_a_compare_folder_points_at_its_runs(text_run, tmp_path):
    cmp = tmp_path / "cmp"
    shutil.copytree(text_run[0], cmp / "runs" / "softmax" / "seed0")
    want = r"no checkpoint at .*cmp/checkpoint.pt: .*is a `gpattn compare` folder.*cmp/runs/softmax/seed0"
    with pytest.raises(FileNotFoundError, match=want):
        gpattn.experiments.load_run(cmp)


def test_train_into_a_finished_out_is_refused_unless_overwrite(text_run, tmp_path, capsys):
    # before: a second `train --out` silently replaced the finished run's files
    out = tmp_path / "again"
    shutil.copytree(text_run[0], out)
    before = (out / "metrics.json").read_bytes()
    assert main(_train_args(text_run[1], out)) == 2
    assert "holds a finished run (metrics.json, checkpoint.pt); pass --overwrite" in capsys.readouterr().err
    assert (out / "metrics.json").read_bytes() == before
    (out / "metrics.json").unlink()  # an interrupted run: checkpoint, no metrics
    assert main(_train_args(text_run[1], out)) == 2
    assert "holds an interrupted run (checkpoint.pt, no metrics.json); pass --resume" in capsys.readouterr().err
    assert main(_train_args(text_run[1], out, "--overwrite")) == 0
    assert (out / "metrics.json").is_file()


def test_a_failed_run_leaves_no_config_json(tmp_path, capsys):
    # before: config.json (and data.json) described a run that never happened
    table = make_text_table(tmp_path / "t.tsv", n=60, class_names=("neg", "pos"))
    out = tmp_path / "failed"
    assert main(_train_args(table, out, "--dataset-option", "label_column=stars")) == 2
    assert "label_column='stars' not found" in capsys.readouterr().err
    assert not (out / "config.json").exists() and not (out / "data.json").exists()
    with pytest.raises(ValueError, match="unknown attention|not a registered|registered"):
        train(TrainConfig(dataset="digits", attention="no-such-attention", epochs=1), tmp_path / "failed2")
    assert not (tmp_path / "failed2" / "config.json").exists()


def test_gpattn_data_prints_whole_lines_without_markup(capsys):
    # before: the docstring's first source line, cut mid-phrase (``:func:`gpattn.experiments.data.fashion_mnist.``)
    assert main(["data"]) == 0
    out = capsys.readouterr().out
    assert ":func:" not in out and "``" not in out
    assert "gpattn.experiments.data.fashion_mnist.build_image_bundle: val = 10 % of" in " ".join(out.split())
    assert "the official test set)." in out


def test_compare_resumes_an_interrupted_run_and_says_so(tmp_path, monkeypatch):
    # before: the interrupt said "rerun with --resume" (unknown to compare); the rerun retrained from scratch
    table = make_text_table(tmp_path / "t.tsv", n=60, class_names=("neg", "pos"))
    base = TrainConfig(
        dataset="text_table",
        dataset_options={"path": str(table)},
        embed_dim=16,
        num_heads=2,
        num_layers=1,
        epochs=2,
        num_samples=2,
        progress=False,
    )
    real = compare_module.train
    calls = []

    def cut(cfg, folder, **kw):
        calls.append(kw.get("resume", False))
        if len(calls) == 1:
            return real(cfg, folder, stop_after_steps=2, **kw)
        return real(cfg, folder, **kw)

    monkeypatch.setattr(compare_module, "train", cut)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        compare_module.compare("softmax", [0], tmp_path / "cmp", base, progress=False, log=lines.append)
    lines.clear()
    compare_module.compare("softmax", [0], tmp_path / "cmp", base, progress=False, log=lines.append)
    assert calls == [False, True], lines
    want = "softmax seed 0: resumed from its checkpoint at step 2 (1 of 2 epochs done; interrupted before"
    assert any(want in line for line in lines), [x for x in lines if "seed 0:" in x]
    history = json.loads((tmp_path / "cmp" / "runs" / "softmax" / "seed0" / "history.json").read_text())
    assert len(history) == 2


def test_compare_interrupt_message_says_what_a_rerun_does(monkeypatch, tmp_path, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("signal 2 at step 3")

    monkeypatch.setattr(compare_module, "compare", interrupted)
    assert main(["compare", "--dataset", "digits", "--attention", "softmax", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "rerun the same command to continue" in err and "resumes from its checkpoint" in err
    assert "--resume" not in err


def test_evaluation_shows_progress(capsys):
    # before: cgp's evaluation in compare ran for minutes without a word
    from gpattn.experiments.data import load_dataset

    bundle = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    cfg = TrainConfig(
        attention="softmax",
        embed_dim=8,
        num_heads=2,
        num_layers=1,
        epochs=1,
        num_samples=1,
        eval_batch_size=64,
        progress=True,
    )
    train(cfg, bundle=bundle)
    err = capsys.readouterr().err
    for split in ("val", "test", "shift", "ood"):
        assert f"softmax seed 0: evaluating {split}" in err
    cfg = TrainConfig(
        attention="softmax", embed_dim=8, num_heads=2, num_layers=1, epochs=1, num_samples=1, progress=False
    )
    train(cfg, bundle=bundle)
    assert "evaluating" not in capsys.readouterr().err


def test_compare_accepts_resume(monkeypatch, tmp_path):
    # before: `gpattn compare ... --resume` (what the interrupt message said) was "unrecognized arguments"
    seen = []
    monkeypatch.setattr(compare_module, "compare", lambda *a, **k: seen.append(a))
    assert main(["compare", "--dataset", "digits", "--attention", "softmax", "--out", str(tmp_path), "--resume"]) == 0
    assert len(seen) == 1
