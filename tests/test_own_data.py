"""Your own data without surprises: text_table refuses ambiguous input instead of guessing."""

from __future__ import annotations

import pytest

from gpattn.experiments.data import load_dataset
from gpattn.experiments.data.fixtures import make_text_table


def _headerless(tmp_path, n=60):
    return make_text_table(tmp_path / "plain.tsv", n=n, columns=("text", "label"), header=False)


def test_label_index_with_default_header_on_a_headerless_file_is_refused(tmp_path):
    # before: the first data row was dropped as a "header" (59 of 60 rows), no warning
    path = _headerless(tmp_path)
    want = r"plain.tsv line 1: header=True, but this first row looks like data.*header=False"
    with pytest.raises(ValueError, match=want):
        load_dataset("text_table", path=path, label_column=1, text_column=0)
    bundle = load_dataset("text_table", path=path, label_column=1, text_column=0, header=False)
    assert sum(len(s) for s in bundle.splits.values()) == 60


def test_header_false_on_a_file_with_a_header_is_refused(tmp_path):
    # before: the header row became a third class "label" with one example
    path = make_text_table(tmp_path / "h.tsv", n=60, class_names=("neg", "pos"))
    want = r"h.tsv line 1: header=False, but this first row looks like a header row.*header=True"
    with pytest.raises(ValueError, match=want):
        load_dataset("text_table", path=path, header=False, text_column=0, label_column=1)


def test_header_false_first_label_seen_once_in_many_rows_is_refused(tmp_path):
    path = tmp_path / "scores.csv"
    rows = ["review,stars"] + [f"text number {i},{'1' if i % 2 else '5'}" for i in range(40)]
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"line 1: .*label 'stars' occurs in no other of the 41 rows"):
        load_dataset("text_table", path=path, header=False, text_column=0, label_column=1)
    assert load_dataset("text_table", path=path, label_column="stars").num_classes == 2


@pytest.mark.parametrize("typed, want", [("false", 60), ("No", 60), (0, 60), ("0", 60), ("TRUE", 59), ("yes", 59)])
def test_header_accepts_what_people_type(tmp_path, typed, want):
    path = make_text_table(tmp_path / "t.tsv", n=59)  # 59 rows after a header
    if want == 60:
        path = _headerless(tmp_path)
    label = 1 if want == 60 else "label"
    bundle = load_dataset("text_table", path=path, header=typed, text_column=0, label_column=label)
    assert sum(len(s) for s in bundle.splits.values()) == want


def test_bad_header_value_lists_the_accepted_ones(tmp_path):
    path = make_text_table(tmp_path / "t.tsv", n=30)
    with pytest.raises(ValueError, match=r"header must be a boolean, got 'maybe'; accepted: True/False, 1/0.*yes"):
        load_dataset("text_table", path=path, header="maybe")


@pytest.mark.parametrize("typed", ["tab", "TAB", "\\t", "\t"])
def test_delimiter_names(tmp_path, typed):
    path = make_text_table(tmp_path / "t.txt", n=30, delimiter="\t")
    assert load_dataset("text_table", path=path, delimiter=typed).num_classes == 3


def test_bad_delimiter_lists_the_accepted_ones(tmp_path):
    path = make_text_table(tmp_path / "t.csv", n=30)
    with pytest.raises(ValueError, match=r"delimiter must be a single character or one of the names 'tab'.*'comma'"):
        load_dataset("text_table", path=path, delimiter="tabs")
    assert load_dataset("text_table", path=path, delimiter="comma").num_classes == 3


def test_shift_file_with_unknown_labels(tmp_path):
    # before: unknown labels became -1 and every classification metric of the split silently null
    train = make_text_table(tmp_path / "train.tsv", n=60, class_names=("0", "1"))
    shift = make_text_table(tmp_path / "shift.tsv", n=10, class_names=("pos", "neg"))
    with pytest.raises(ValueError, match=r"shift.tsv line 2: label 'pos' of the shift file never occurs in training "
                       r"\(training labels: \['0', '1'\]\); 10 of 10 rows.*unknown_labels="):
        load_dataset("text_table", path=train, shift_file=shift)
    ok = make_text_table(tmp_path / "ok.tsv", n=10, seed=1, class_names=("1", "0"))  # no training text
    bundle = load_dataset("text_table", path=train, shift_file=ok)
    assert bundle.eval_splits == {"in_domain": "test", "shift": "shift"} and bundle.ood_splits == ()
    assert bundle.splits["shift"].labels.tolist() == [1, 0] * 5
    assert [f["role"] for f in bundle.info["files"]] == ["train", "shift"]
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in bundle.info["files"])
    unlabelled = make_text_table(tmp_path / "nolabel.tsv", n=10, columns=("id", "text"))
    with pytest.raises(ValueError, match="nolabel.tsv has no label column 'label': shift_file must be labelled"):
        load_dataset("text_table", path=train, shift_file=unlabelled)
    with pytest.raises(ValueError, match="unknown_labels must be one of 'error', 'drop', 'unlabelled'"):
        load_dataset("text_table", path=train, shift_file=ok, unknown_labels="map")


def test_two_training_files_are_pooled(tmp_path):
    a = make_text_table(tmp_path / "a.tsv", n=30, seed=1)
    b = make_text_table(tmp_path / "b.tsv", n=30, seed=2)
    bundle = load_dataset("text_table", path=[str(a), str(b)])
    assert sum(len(bundle.splits[k]) for k in ("train", "val", "test")) == 60
    assert [f["rows"] for f in bundle.info["files"]] == [30, 30]
