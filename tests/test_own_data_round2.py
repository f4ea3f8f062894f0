"""Own data, round two (issue #28): the last silent corruptions of ``text_table`` are errors naming the file,
the line, what was found and the option that fixes it — or a reported behaviour."""

from __future__ import annotations

import pytest

from gpattn.experiments.data import load_dataset
from gpattn.experiments.data.fixtures import make_text_table
from gpattn.experiments.data.summary import data_summary, summary_lines


def _table(tmp_path, name="t.tsv", n=60, **kw):
    return make_text_table(tmp_path / name, n=n, class_names=("0", "1"), **kw)


def _insert(path, line_no: int, row: str) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    lines.insert(line_no - 1, row)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_a_row_with_an_extra_tab_is_an_error_naming_the_line(tmp_path):
    # before: the fragment after the TAB became a third class ("0: 30, 1: 30, but the battery: 1")
    path = _table(tmp_path)
    _insert(path, 5, "great screen\tbut the battery\t1")
    with pytest.raises(
        ValueError,
        match=r"t.tsv: 1 row\(s\) with a number of cells other than the 2 .*line 5 has 3.*"
        r"TAB inside a text.*bad_rows='skip'",
    ):
        load_dataset("text_table", path=path, text_column=0)
    bundle = load_dataset("text_table", path=path, text_column=0, bad_rows="skip")
    assert bundle.num_classes == 2 and sum(len(s) for s in bundle.splits.values()) == 60
    summary = data_summary(bundle)
    assert summary["files"][0]["skipped_rows"] == {"rows": 1, "lines": [5]}
    assert any("1 row(s) left out" in line and "lines 5" in line for line in summary_lines(summary))


def test_a_two_tab_row_with_default_options_names_its_line(tmp_path):
    path = _table(tmp_path)
    _insert(path, 7, "a\tb\tc")
    with pytest.raises(ValueError, match=r"line 7 has 3"):
        load_dataset("text_table", path=path)


def test_a_whitespace_only_text_is_an_error_or_skipped(tmp_path):
    # before: a text of spaces trained as an example (one <unk> token)
    path = _table(tmp_path)
    _insert(path, 4, "   \t1")
    with pytest.raises(ValueError, match=r"1 row\(s\) whose text is empty or only whitespace \(lines 4\)"):
        load_dataset("text_table", path=path)
    bundle = load_dataset("text_table", path=path, bad_rows="skip")
    assert sum(len(s) for s in bundle.splits.values()) == 60


def test_a_rare_label_is_an_error_naming_it_unless_allowed(tmp_path):
    path = _table(tmp_path)
    _insert(path, 3, "a sentence with a typo label\t11")
    with pytest.raises(
        ValueError,
        match=r"fewer than min_class_count=3 rows .*'11' \(1 row\(s\): .*t.tsv line 3\)"
        r".*min_class_count=1",
    ):
        load_dataset("text_table", path=path)
    bundle = load_dataset("text_table", path=path, min_class_count=1)
    assert bundle.info["class_names"] == ["0", "1", "11"]


def test_pooled_files_with_disjoint_label_sets_are_an_error_naming_files_and_labels(tmp_path):
    # before: a 4-class model, class_names ['0', '1', 'neg', 'pos'], no warning
    a = _table(tmp_path, "a.txt", delimiter="\t")
    b = make_text_table(tmp_path / "b.txt", n=60, seed=1, class_names=("neg", "pos"), delimiter="\t")
    with pytest.raises(
        ValueError,
        match=r"share no label .*a.txt: \['0', '1'\]; .*b.txt: \['neg', 'pos'\].*"
        r"disjoint_labels='allow'",
    ):
        load_dataset("text_table", path=[a, b], delimiter="tab")
    bundle = load_dataset("text_table", path=[a, b], delimiter="tab", disjoint_labels="allow")
    assert bundle.info["class_names"] == ["0", "1", "neg", "pos"]


def test_the_same_file_twice_in_path_is_an_error(tmp_path):
    # before: every row twice, so the test split held copies of training rows
    a = _table(tmp_path)
    with pytest.raises(ValueError, match=r"t.tsv \(entry 1\) is listed twice \(entry 0\)"):
        load_dataset("text_table", path=[a, a])
    copy = tmp_path / "copy.tsv"
    copy.write_bytes(a.read_bytes())
    with pytest.raises(ValueError, match=r"copy.tsv \(entry 1\) has the same content as .*t.tsv"):
        load_dataset("text_table", path=[a, copy])


@pytest.mark.parametrize("role", ["path", "shift_file", "ood_file"])
def test_a_file_that_is_not_utf8_names_the_file_line_and_encoding_option(tmp_path, role):
    # before: "'utf-8' codec can't decode byte 0xe9 in position 1382" — no file, no line, no option
    train = _table(tmp_path)
    bad = make_text_table(tmp_path / "latin.tsv", n=60, seed=2, class_names=("0", "1"))
    lines = bad.read_text(encoding="utf-8").splitlines()
    lines[8] = "un caf\u00e9 tr\u00e8s bon\t1"
    bad.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    options = {"path": train, role: bad} if role != "path" else {"path": bad}
    with pytest.raises(
        ValueError,
        match=r"latin.tsv line 9, column 7: bytes b'\\xe9' are not valid utf-8 .*"
        r"encoding='latin-1'",
    ):
        load_dataset("text_table", **options)
    if role == "path":
        bundle = load_dataset("text_table", path=bad, encoding="latin-1")
        assert any("caf\u00e9" in t for texts in bundle.texts.values() for t in texts)


def test_a_byte_order_mark_is_not_a_token_nor_part_of_a_column_name(tmp_path):
    # before: '\ufeff' became a vocabulary word of a headerless file (and hid the first column's name)
    plain = _table(tmp_path, header=False)
    plain.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    bundle = load_dataset("text_table", path=plain, header=False, text_column=0, label_column=1)
    assert not any("\ufeff" in word for word in bundle.vocab)
    assert not any(t.startswith("\ufeff") for texts in bundle.texts.values() for t in texts)
    named = _table(tmp_path, "named.tsv")
    named.write_bytes(b"\xef\xbb\xbf" + named.read_bytes())
    assert load_dataset("text_table", path=named).num_classes == 2


def test_a_headerless_file_read_with_defaults_suggests_header_false(tmp_path):
    plain = _table(tmp_path, header=False)
    with pytest.raises(ValueError, match=r"label_column='label' not found .*line 1.*pass header=false"):
        load_dataset("text_table", path=plain)


def test_a_ragged_row_of_a_headerless_file_names_its_line(tmp_path):
    path = _table(tmp_path, header=False)
    _insert(path, 10, "one text\twith a tab\t0")
    with pytest.raises(ValueError, match=r"other than the 2 of most rows \(line 10 has 3"):
        load_dataset("text_table", path=path, header=False, text_column=0, label_column=1)
