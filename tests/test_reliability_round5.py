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
    assert main(["evaluate", "--checkpoint", str(tmp_path), "--no-progress"]) == 2  # the folder that holds the run
    assert f"{tmp_path} holds run folders, pass one of those: {run}" in capsys.readouterr().err
    # retraining the run: the evaluation of the replaced model goes with it, and says so
    _train(tmp_path, "run", "softmax", "--overwrite")
    assert not (run / "evaluation").exists()
    assert "an evaluation of the run --overwrite replaces" in capsys.readouterr().out


# ----------------------------------------------------------------------------- item 3: zero samples
def test_zero_samples_is_refused_not_read_as_the_default(sampled_run, capsys):
    # before: num_samples=0 in predict and --num-samples 0 in evaluate silently meant "the run's default"
    from gpattn.experiments.inference import load_run

    run, _ = sampled_run
    with pytest.raises(ValueError, match="num_samples must be a positive int, got 0"):
        load_run(run).predict(["a fine film"], num_samples=0)
    assert main(["evaluate", "--checkpoint", str(run), "--num-samples", "0", "--out", str(run / "e0")]) == 2
    assert "--num-samples must be a positive int (leave it out for the run's 3), got 0" in capsys.readouterr().err
    assert main(["evaluate", "--checkpoint", str(run), "--seed", "-1", "--out", str(run / "e0")]) == 2
    assert "--seed must be a non-negative int (leave it out for the run's 0), got -1" in capsys.readouterr().err
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


def test_an_encoder_run_warns_for_texts_of_unknown_word_pieces_and_the_test_tokenizer_knows_its_words(tmp_path):
    # an encoder's tokenizer: [CLS]/[SEP] aside, every piece [UNK]. The tests' tiny tokenizer (write_table_tokenizer)
    # had been built with the five specials alone under transformers 5, every word [UNK]: this warning showed it
    import torch

    from gpattn.experiments.data.fixtures import write_table_tokenizer
    from gpattn.experiments.inference import UnknownWordsWarning, _warn_unknown

    ids = torch.tensor([[2, 1, 1, 3, 0], [2, 7, 1, 3, 0]])
    mask = ids == 0
    with pytest.warns(UnknownWordsWarning, match=r"1 of 2 texts hold no word the model knows \(positions 0,"):
        _warn_unknown(["🙂🙂", "film 🙂"], ids, mask, 1, [0, 1, 2, 3, 4])
    transformers = pytest.importorskip("transformers")
    table = make_text_table(tmp_path / "t.tsv", n=30)
    write_table_tokenizer(table, tmp_path / "tok")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tokenizer.unk_token_id not in tokenizer("the film was awful")["input_ids"]


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


# ----------------------------------------------------------------------------- item 5: C1 characters
def _all_texts(bundle) -> list[str]:
    return [t for split in bundle.texts.values() for t in split]


def _two_class_rows(n=30):
    return [f"a fine film number {i}\t1" if i % 2 else f"a dull film number {i}\t0" for i in range(n)]


def test_c1_characters_in_a_utf8_file_are_named_and_cp1252_is_not_suggested(tmp_path):
    # before: "Pass encoding=cp1252" for a UTF-8 file holding U+0096; following it garbled every multibyte
    # character ("Québec" -> "QuÃ©bec") and the run trained on that without a word
    from gpattn.experiments.data import load_dataset

    rows = _two_class_rows()
    rows[3] = "Québec \u0096 a fine film\u0085\t1"
    rows[7] = "a dull \u0097 film\t1"
    path = tmp_path / "mojibake.tsv"
    path.write_text("text\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as caught:
        load_dataset("text_table", path=path)
    msg = str(caught.value)
    assert "mojibake.tsv line 5: decoded with encoding='utf-8', the file holds 3 C1 control character(s)" in msg
    assert "U+0096 (1x, first at line 5, column 8), U+0085 (1x, first at line 5, column 21), U+0097" in msg
    assert "encoding=cp1252 would misread its other characters" in msg and "Pass encoding=cp1252" not in msg
    assert "c1_characters='repair'" in msg and "c1_characters='keep'" in msg
    # the old advice, followed anyway: refused, since the file is UTF-8 (it garbled "Québec" into "QuÃ©bec")
    with pytest.raises(ValueError, match=r"encoding='cp1252', but the file is UTF-8.*c1_characters='repair'"):
        load_dataset("text_table", path=path, encoding="cp1252")
    repaired = load_dataset("text_table", path=path, c1_characters="repair")
    texts = _all_texts(repaired)
    assert "Québec \u2013 a fine film\u2026" in texts and "a dull \u2014 film" in texts
    kept = load_dataset("text_table", path=path, c1_characters="keep")
    assert "Québec \u0096 a fine film\u0085" in _all_texts(kept)


def test_latin1_on_a_utf8_file_says_the_file_is_utf8(tmp_path):
    from gpattn.experiments.data import load_dataset

    rows = _two_class_rows()
    rows[2] = "Québec \u2013 a fine film\t1"
    path = tmp_path / "utf8.tsv"
    path.write_text("text\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    for wrong in ("latin-1", "cp1252"):
        with pytest.raises(ValueError, match=rf"encoding='{wrong}', but the file is UTF-8 \(its non-ASCII bytes are "
                                             rf"valid UTF-8.*'é' at line 4 as 'Ã©'\. Leave encoding unset"):
            load_dataset("text_table", path=path, encoding=wrong)
    assert "Québec \u2013 a fine film" in _all_texts(load_dataset("text_table", path=path))  # the hint, followed


def test_bytes_that_are_not_cp1252_get_a_hint_that_loads(tmp_path):
    # the old hint "encoding='cp1252' or encoding='latin-1'": cp1252 fails on 0x81, latin-1 then fails the C1 check
    from gpattn.experiments.data import load_dataset

    rows = _two_class_rows()
    path = tmp_path / "odd.tsv"
    path.write_bytes(("text\tlabel\n" + "\n".join(rows) + "\n").encode().replace(b"number 3\t", b"number \x81 3\t"))
    with pytest.raises(ValueError) as caught:
        load_dataset("text_table", path=path)
    assert "encoding='latin-1' with c1_characters='keep'" in str(caught.value)
    bundle = load_dataset("text_table", path=path, encoding="latin-1", c1_characters="keep")
    assert len(bundle.splits["train"]) > 0


# ----------------------------------------------------------------------------- item 6: a very long text
@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_a_text_longer_than_the_csv_field_limit_is_read(tmp_path, suffix):
    # before: _csv.Error: field larger than field limit (131072), with no file, line or option
    import csv

    from gpattn.experiments.data import load_dataset

    long = " ".join(["word"] * 60_000)  # 300 kB in one cell
    rows = _two_class_rows()
    rows[4] = f"{long}\t0"
    delim = "\t" if suffix == ".tsv" else ","
    path = tmp_path / f"long{suffix}"
    path.write_text("text\tlabel\n".replace("\t", delim) + "\n".join(r.replace("\t", delim) for r in rows) + "\n",
                    encoding="utf-8")
    before = csv.field_size_limit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cut to max_len is warned about (item 13)
        bundle = load_dataset("text_table", path=path)
    assert long in _all_texts(bundle) and csv.field_size_limit() == before


# ----------------------------------------------------------------------------- item 7: hints that lead somewhere
def test_a_missing_evaluation_file_names_its_own_option(tmp_path):
    # before: a missing shift_file said "Pass path="
    from gpattn.experiments.data import DataNotFoundError, load_dataset

    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    with pytest.raises(DataNotFoundError, match=r"^shift_file: text table not found: tried .*Pass shift_file= an "):
        load_dataset("text_table", path=train, shift_file=tmp_path / "nosuch.tsv")


def test_a_wrong_delimiter_is_named_not_header_false(tmp_path):
    # before: delimiter=comma on a TSV suggested header=false (a second error) and never named the delimiter
    from gpattn.experiments.data import load_dataset

    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    with pytest.raises(ValueError, match=r"looks tab-delimited\. Pass delimiter=tab") as caught:
        load_dataset("text_table", path=train, delimiter="comma")
    assert "header=false" not in str(caught.value)
    assert len(load_dataset("text_table", path=train, delimiter="tab").splits["train"]) > 0
    # the OOD file's own delimiter: a .csv next to a training file read with delimiter=tab
    ood = make_text_table(tmp_path / "ood.csv", n=10, seed=3, columns=("text",))
    with pytest.raises(ValueError, match=r"ood.csv: its extension says comma-delimited, but it would be read with "
                                         r"delimiter=tab, the training file.s; pass ood_delimiter=comma"):
        load_dataset("text_table", path=train, delimiter="tab", ood_file=ood)
    bundle = load_dataset("text_table", path=train, delimiter="tab", ood_file=ood, ood_delimiter="comma")
    assert len(bundle.splits["ood"]) == 10


def test_an_evaluation_file_without_a_header_has_its_own_header_option(tmp_path):
    # before: an OOD file without a header row suggested header=false, which then failed on the training file
    # (header, delimiter and encoding were one setting for every file)
    from gpattn.experiments.data import load_dataset

    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    ood = tmp_path / "questions.tsv"
    ood.write_text("".join(f"how do i reset the clock number {i}\n" for i in range(12)), encoding="utf-8")
    with pytest.raises(ValueError, match=r"questions.tsv has no header row .* pass ood_header=false \(this file "
                                         r"alone: header is the training file's"):
        load_dataset("text_table", path=train, ood_file=ood)
    bundle = load_dataset("text_table", path=train, ood_file=ood, ood_header=False)
    assert bundle.texts["ood"][0] == "how do i reset the clock number 0" and len(bundle.splits["ood"]) == 12
    assert (bundle.splits["ood"].labels == -1).all()
    # a headerless labelled shift file is read at the training file's column positions
    shift = make_text_table(tmp_path / "shift.tsv", n=20, seed=10, class_names=("0", "1"), header=False)
    with pytest.raises(ValueError, match="pass shift_header=false"):
        load_dataset("text_table", path=train, shift_file=shift)
    bundle = load_dataset("text_table", path=train, shift_file=shift, shift_header="no")
    assert len(bundle.splits["shift"]) == 20 and set(bundle.splits["shift"].labels.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="ood_header given without ood_file"):
        load_dataset("text_table", path=train, ood_header=False)
    # one question per line in a .txt: both options in one hint, which then loads
    txt = tmp_path / "questions.txt"
    txt.write_bytes(ood.read_bytes())
    with pytest.raises(ValueError, match=r"one text per line: pass ood_delimiter=tab and ood_header=false"):
        load_dataset("text_table", path=train, ood_file=txt)
    assert len(load_dataset("text_table", path=train, ood_file=txt, ood_delimiter="tab", ood_header=False)
               .splits["ood"]) == 12


def test_a_comma_string_path_and_a_folder_path_get_hints_that_work(tmp_path, monkeypatch, capsys):
    # before: path=a.tsv,b.tsv and path=<a folder> both said "not found"
    import re
    import shlex

    from gpattn.experiments.data import DataNotFoundError, load_dataset

    monkeypatch.chdir(tmp_path)
    make_text_table(tmp_path / "a.tsv", n=30, class_names=("0", "1"))
    make_text_table(tmp_path / "b.tsv", n=30, seed=5, class_names=("0", "1"))
    with pytest.raises(DataNotFoundError, match=r"2 file names in one string.*pass a list") as caught:
        load_dataset("text_table", path="a.tsv,b.tsv")
    hinted = re.search(r"--dataset-option (\"path=[^\"]+\")", str(caught.value)).group(0)
    assert main(["train", "--dataset", "text_table", *shlex.split(hinted), *TINY, "--num-samples", "1",
                 "--out", "pooled"]) == 0  # the hint, pasted as a shell would split it
    assert [f["role"] for f in json.loads((tmp_path / "pooled" / "data.json").read_text())["files"]] == ["train"] * 2
    (tmp_path / "data").mkdir()
    (tmp_path / "a.tsv").rename(tmp_path / "data" / "a.tsv")
    with pytest.raises(DataNotFoundError, match=r"path='data' is a folder .*it holds: a.tsv\), e.g. path=data/a.tsv"):
        load_dataset("text_table", path="data")
    assert len(load_dataset("text_table", path="data/a.tsv").splits["train"]) > 0


# ----------------------------------------------------------------------------- item 8: a clone shadowing the package
#: what an editable install's finder does (setuptools' __editable__ finder): gpattn's submodules from the package
#: folder, consulted after Python's own path search (which finds a folder named gpattn first)
_EDITABLE = """
import importlib.machinery, sys
class Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.rpartition(".")[0] == "gpattn":
            return importlib.machinery.PathFinder.find_spec(name, [{package!r}])
        return None
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder) + 1, Finder)
{then}
"""


def test_a_clone_that_shadows_the_package_is_an_import_error_that_says_so(tmp_path):
    # before: ImportError: cannot import name '_lazy_submodules' from 'gpattn' (unknown location)
    import os

    import gpattn

    package = str(Path(gpattn.__file__).parent)
    (tmp_path / "gpattn").symlink_to(Path(package).parent)  # `git clone ... gpattn`: the repository as ./gpattn
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(cwd, then):
        code = _EDITABLE.format(package=package, then=then)
        return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=120)

    script = "from gpattn.experiments import load_run; print('imported')"
    done = run(tmp_path, script)
    assert done.returncode != 0 and "_lazy_submodules" not in done.stderr
    assert f"`import gpattn` found the folder {tmp_path / 'gpattn'}, which has no __init__.py" in done.stderr
    assert f"cd {tmp_path / 'gpattn'}" in done.stderr
    cli = run(tmp_path, "import runpy, sys; sys.argv = ['gpattn', 'data']; runpy.run_module('gpattn', "
                        "run_name='__main__', alter_sys=True)")
    assert cli.returncode == 2 and "Traceback" not in cli.stderr and cli.stderr.startswith("gpattn: error: `import")
    followed = run(tmp_path / "gpattn", script)  # the hint: run from the clone, where ./gpattn is the package
    assert followed.returncode == 0 and followed.stdout.strip() == "imported", followed.stderr[-2000:]


# ----------------------------------------------------------------------------- item 13: rows cut by max_len
def test_rows_cut_by_max_len_are_counted_per_split_warned_and_recorded(tmp_path):
    # before: max_len cut 75 % of one domain's reviews and nothing said so (data.json counted only rows beyond the
    # model's width)
    from gpattn.experiments.data import DataWarning
    from gpattn.experiments.training import TrainConfig, train

    table = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    shift = make_text_table(tmp_path / "shift.tsv", n=20, seed=10, class_names=("0", "1"))
    cfg = TrainConfig(dataset="text_table", dataset_options={"path": str(table), "shift_file": str(shift),
                                                             "max_len": 4},
                      embed_dim=8, num_heads=2, num_layers=1, epochs=1, num_samples=1, progress=False)
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, tmp_path / "cut", log=lines.append)
    cut = [w for w in caught if issubclass(w.category, DataWarning)]
    assert len(cut) == 1 and cut[0].filename == __file__
    msg = str(cut[0].message)
    assert "text_table: max_len=4 cuts " in msg and " rows of 'train' (" in msg and " rows of 'shift' (" in msg
    assert "pass a larger max_len (--dataset-option max_len=N; the longest training text has" in msg
    record = json.loads((tmp_path / "cut" / "data.json").read_text())["max_len_cut"]
    assert record["max_len"] == 4 and record["rows"]["shift"] == record["of"]["shift"] == 20
    assert 0 < record["rows"]["train"] <= record["of"]["train"] and record["longest"]["train"] > 4
    assert any(line.startswith("  - rows cut to their first 4 tokens by the data set's max_len: ") for line in lines)
    # the hint, followed: a max_len above the longest text cuts nothing, and says nothing
    longest = max(record["longest"].values())
    import dataclasses

    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        train(dataclasses.replace(cfg, dataset_options={**cfg.dataset_options, "max_len": longest}), tmp_path / "all")
    assert json.loads((tmp_path / "all" / "data.json").read_text())["max_len_cut"]["rows"] == {}


# ----------------------------------------------------------------------------- item 15: run folder names
def test_run_folders_need_no_shell_quoting_and_an_old_folder_is_still_reused(tmp_path):
    # before: compare wrote runs/sto[tau=2.0]/seed0, a glob in bash and an error in zsh
    import re
    import shutil

    from gpattn.experiments.compare import compare, parse_variant
    from gpattn.experiments.training import TrainConfig

    table = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    base = TrainConfig(dataset="text_table", dataset_options={"path": str(table)}, embed_dim=8, num_heads=2,
                       num_layers=1, epochs=1, num_samples=1, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one tiny epoch sits at the base rate
        compare("sto[tau=2.0]", [0], tmp_path / "out", base, log=lambda line: None)
    folders = [p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*")]
    assert Path("runs/sto_tau=2.0/seed0/checkpoint.pt") in folders
    assert not [p for p in folders if re.search(r"[^A-Za-z0-9_.,=+/-]", str(p))]
    # a compare folder written before keeps its name and its runs: reused, not trained again
    shutil.move(tmp_path / "out" / "runs" / "sto_tau=2.0", tmp_path / "out" / "runs" / "sto[tau=2.0]")
    logs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare("sto[tau=2.0]", [0], tmp_path / "out", base, log=logs.append)
    assert any(f"reused {tmp_path / 'out' / 'runs' / 'sto[tau=2.0]' / 'seed0'}" in line for line in logs), logs
    assert not (tmp_path / "out" / "runs" / "sto_tau=2.0").exists()
    # options whose values hold other characters keep a hash of the run name: two specs never share a folder
    a, b = (parse_variant(s).folder_name for s in ("sgpa[kernel='ard rbf']", "sgpa[kernel='ard_rbf']"))
    assert a != b and not re.search(r"[^A-Za-z0-9_.,=+-]", a + b)
