"""docs/variants.md is generated: the committed page is what tools/variants_page.py writes from
docs/data/headline.json and the registry, every registered variant has its row, and a compare results.json
replaces a claim's rows instead of adding to them."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest

import gpattn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vp():
    spec = importlib.util.spec_from_file_location("variants_page", ROOT / "tools" / "variants_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def data(vp):
    return json.loads(vp.DATA.read_text())


def test_the_committed_page_is_the_generated_one(vp, data):
    assert (ROOT / "docs" / "variants.md").read_text() == vp.page(data), "run python tools/variants_page.py"
    assert vp.main(["--check"]) == 0


def test_every_registered_variant_has_its_text_and_rows(vp, data):
    assert set(vp.VARIANTS) == set(gpattn.list_attention())
    text = vp.page(data)
    for name in gpattn.list_attention():
        assert text.count(f"| `{name}` |") == 2 + len(data["claims"]), name


def test_the_five_situations_are_answered(vp, data):
    text = vp.page(data)
    table = text.split("## Which variant for what")[1].split("## ")[0]
    for situation in ("from scratch", "pretrained encoder", "long sequences", "decoder", "calibration"):
        assert situation in table
    for _, pick, _, claim in vp.SITUATIONS:
        assert claim is None or claim in data["claims"]
        assert any(f"`{v}`" in pick for v in [*vp.VARIANTS, *vp.BASELINES]), pick


def test_defaults_come_from_the_registry(vp, data):
    names = gpattn.list_attention()
    options = {n: gpattn.attention_options(n) for n in names}
    options["sgpa"] = {**options["sgpa"], "prior_mean": "somewhere-else"}
    text = vp.render(data, names, options)
    assert '| `sgpa` | `kernel=None`, `prior_mean="somewhere-else"`' in text
    assert 'prior_mean="somewhere-else"' not in vp.page(data)


def test_a_missing_variant_text_is_an_error(vp, data):
    names = [*gpattn.list_attention(), "new-variant"]
    options = {n: gpattn.attention_options(n) for n in gpattn.list_attention()} | {"new-variant": {}}
    with pytest.raises(SystemExit, match="new-variant"):
        vp.render(data, names, options)


def _results(values):
    """a compare results.json: spec -> seed -> split -> metric"""
    return {
        spec: {
            str(seed): {"in_domain": {"accuracy": acc}, "shift": {"nll": nll}, "ood": {"ood_auroc": auroc}}
            for seed, (acc, nll, auroc) in enumerate(rows)
        }
        for spec, rows in values.items()
    }


def test_cells_are_mean_and_sample_std_and_paired_counts(vp):
    results = _results({"softmax": [(0.9, 1.0, 0.8), (0.8, 2.0, 0.6)], "sgpa": [(1.0, 0.5, 0.9), (0.9, 2.5, 0.9)]})
    assert vp.cell(results, "sgpa", {"split": "in_domain", "metric": "accuracy"}) == "0.950 ± 0.071"
    nll = {"split": "shift", "metric": "nll", "better_than": "softmax", "higher_is_better": False}
    assert vp.cell(results, "sgpa", nll) == "1.500 ± 1.414 (1/2)"
    assert vp.cell(results, "softmax", nll) == "1.500 ± 0.707"
    paired = {"split": "ood", "metric": "ood_auroc", "against": "softmax", "higher_is_better": True}
    assert vp.cell(results, "sgpa", paired) == "+0.200 ± 0.141 (2/2)"
    assert vp.cell(results, "kep-svgp", paired) == "–"


def test_a_remeasurement_replaces_rows(vp, data):
    before = copy.deepcopy(data)
    results = _results({"softmax": [(0.9, 1.0, 0.8), (0.8, 2.0, 0.6)], "kep-svgp": [(0.5, 1.0, 0.5)] * 2})
    new = vp.refresh(data, "digits", results, "gpattn compare --preset digits", "abc1234", "2026-12-01")
    assert data == before  # the input is not modified
    runs = new["claims"]["digits"]["runs"]
    assert runs[-1] == {
        "command": "gpattn compare --preset digits",
        "commit": "abc1234",
        "date": "2026-12-01",
        "rows": {
            "kep-svgp": {
                "in-domain accuracy": "0.500 ± 0.000",
                "shift NLL": "1.000 ± 0.000 (1/2)",
                "ood_auroc": "0.500 ± 0.000",
            },
            "softmax": {
                "in-domain accuracy": "0.850 ± 0.071",
                "shift NLL": "1.500 ± 0.707",
                "ood_auroc": "0.700 ± 0.141",
            },
        },
    }
    assert all("kep-svgp" not in r["rows"] and "softmax" not in r["rows"] for r in runs[:-1])
    assert len(runs) == len(before["claims"]["digits"]["runs"]) + 1
    assert new["claims"]["cola-minilm"] == before["claims"]["cola-minilm"]
    # the same measurement again: the same rows, not one more run
    again = vp.refresh(new, "digits", results, "gpattn compare --preset digits", "abc1234", "2026-12-01")
    assert again == new
    text = vp.page(new)
    digits = text.split("## digits")[1].split("\n## ")[0]
    assert "| `kep-svgp` | 0.500 ± 0.000 | 1.000 ± 0.000 (1/2) | 0.500 ± 0.000 | 4 |" in digits
    assert "`gpattn compare --preset digits` at abc1234, 2026-12-01" in digits


def test_a_run_that_backs_no_row_is_dropped(vp, data):
    specs = {v for run in data["claims"]["digits"]["runs"] for v in run["rows"]}
    results = _results({spec: [(0.5, 1.0, 0.5)] for spec in specs})
    new = vp.refresh(data, "digits", results, "cmd", "abc1234", "2026-12-01")
    assert len(new["claims"]["digits"]["runs"]) == 1


def test_the_command_line_refresh_writes_both_files(vp, data, tmp_path):
    (tmp_path / "headline.json").write_text(json.dumps(data))
    results = tmp_path / "results.json"
    results.write_text(json.dumps(_results({"softmax": [(0.9, 1.0, 0.8)], "sgpa": [(1.0, 0.5, 0.9)]})))
    argv = ["--data", str(tmp_path / "headline.json"), "--out", str(tmp_path / "variants.md")]
    refresh = ["--refresh", "digits", "--results", str(results), "--command", "c", "--commit", "abc", "--date", "d"]
    assert vp.main(argv + refresh) == 0
    written = json.loads((tmp_path / "headline.json").read_text())
    assert written["claims"]["digits"]["runs"][-1]["commit"] == "abc"
    assert vp.main(argv + ["--check"]) == 0
    with pytest.raises(SystemExit, match="not measured by gpattn compare"):
        vp.main(argv + ["--refresh", "suite", *refresh[2:]])


def test_every_number_on_the_page_is_in_the_results_or_benchmarks_page(vp, data):
    """The result file holds the latest tables' numbers, not numbers of its own: each cell (its mean ± std or
    difference, before the seed count) is in docs/results.md or docs/benchmarks.md. After --refresh, put the
    run's table into those pages too."""
    pages = "".join((ROOT / "docs" / name).read_text() for name in ("results.md", "benchmarks.md"))
    pages = pages.replace("−", "-")
    absent = []
    for key, entry in data["claims"].items():
        for run in entry["runs"]:
            for variant, cells in run["rows"].items():
                for column, value in cells.items():
                    number = value.split(" (")[0].replace("−", "-")
                    if number not in {"0", "–"} and number not in pages:
                        absent.append(f"{key}: {variant}, {column}: {value}")
            assert run["commit"] in pages, f"{key}: the commit {run['commit']} is named on no results page"
    assert not absent, absent
