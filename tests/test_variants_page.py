"""docs/variants.md is generated: the committed page is what tools/variants_page.py writes from
docs/data/headline.json and the registry, every registered variant has its row, a compare results.json
replaces a claim's rows instead of adding to them, and ``--refresh`` runs each claim's run list (today's defaults,
every GP variant) and reads what it wrote."""

import copy
import importlib.util
import json
import shlex
import subprocess
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
    assert f"| `kep-svgp` | 0.500 ± 0.000 | 1.000 ± 0.000 (1/2) | 0.500 ± 0.000 | {len(runs)} |" in digits
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
    claims = {**data["claims"], "suite": {k: v for k, v in data["claims"]["suite"].items() if k != "fields"}}
    with pytest.raises(SystemExit, match="has no 'fields'"):
        vp.refresh({**data, "claims": claims}, "suite", json.loads(results.read_text()), "c", "abc", "d")


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


# ----------------------------------------------------------------------------- --refresh: the run lists
def test_every_claim_has_a_run_list_at_today_s_defaults_with_every_gp_variant(vp, data):
    """Each claim re-measures with one command at the variants' defaults (no option overrides), and the GP variants
    the page recommends, sgpa-rff included, are in every list."""
    from gpattn.experiments.compare import expand_variants
    from gpattn.experiments.presets import PRESETS

    gp = {"sgpa", "sgpa-decoupled", "sgpa-rff", "kep-svgp", "cgp", "scgp"}
    for claim, entry in data["claims"].items():
        plan = entry["refresh"]
        argv = shlex.split(plan["command"])
        assert plan["reads"] in vp.READERS and "{out}" in plan["command"], claim
        assert "--attention-option" not in argv and "fields" in entry, claim
        if plan["reads"] == "compare":
            preset = PRESETS[argv[argv.index("--preset") + 1]]
            assert "--attention" not in argv, claim  # the preset's list
            assert gp <= {s.attention for s in expand_variants(preset["variants"])}, claim
        elif plan["reads"] == "suite":
            assert gp <= set(argv[argv.index("--variants") + 1].split(",")), claim
        else:
            assert "--variants" not in argv, claim  # every registered variant


def _stub(tmp_path, body: str) -> str:
    """A run-list command running a script that writes ``body`` (Python, ``out`` its folder)."""
    script = tmp_path / "stub.py"
    script.write_text("import json, sys\nfrom pathlib import Path\nout = Path(sys.argv[1])\n" + body)
    return f"python {shlex.quote(str(script))} {{out}}"


def test_refresh_runs_the_run_list_and_replaces_the_claim_s_rows(vp, data, tmp_path):
    results = _results({"softmax": [(0.9, 1.0, 0.8), (0.8, 2.0, 0.6)], "sgpa-rff": [(0.7, 1.5, 0.9)] * 2})
    command = _stub(tmp_path, f"(out / 'results.json').write_text(json.dumps({results!r}))\n")
    data["claims"]["digits"]["refresh"] = {"command": command, "reads": "compare"}
    (tmp_path / "headline.json").write_text(json.dumps(data))
    runs = tmp_path / "runs"
    argv = ["--data", str(tmp_path / "headline.json"), "--out", str(tmp_path / "variants.md"), "--runs", str(runs)]
    assert vp.main([*argv, "--refresh", "digits", "--commit", "abc1234", "--date", "2026-12-07"]) == 0
    run = json.loads((tmp_path / "headline.json").read_text())["claims"]["digits"]["runs"][-1]
    assert run["command"] == command.format(out=runs / "digits") and run["commit"] == "abc1234"
    assert run["rows"]["sgpa-rff"] == {"in-domain accuracy": "0.700 ± 0.000", "shift NLL": "1.500 ± 0.000 (1/2)",
                                       "ood_auroc": "0.900 ± 0.000"}  # fmt: skip
    page = (tmp_path / "variants.md").read_text().split("## digits")[1]
    assert "| `sgpa-rff` | 0.700 ± 0.000 | 1.500 ± 0.000 (1/2) | 0.900 ± 0.000 |" in page
    assert "| sgpa-rff | 0.700 ± 0.000 | 1.500 ± 0.000 (1/2) | 0.900 ± 0.000 |" in (runs / "tables.md").read_text()
    assert "at abc1234, 2026-12-07" in (runs / "tables.md").read_text()


def test_a_failing_run_list_command_is_an_error_naming_its_log(vp, data, tmp_path):
    data["claims"]["digits"]["refresh"] = {"command": _stub(tmp_path, "print('no data'); sys.exit(3)\n"),
                                           "reads": "compare"}  # fmt: skip
    with pytest.raises(SystemExit, match=r"failed \(exit 3\); its output: .*digits\.log"):
        vp.run_claim(data, "digits", tmp_path / "runs", "abc1234", "2026-12-07", log=lambda *_: None)
    assert "no data" in (tmp_path / "runs" / "digits.log").read_text()
    with pytest.raises(SystemExit, match="no claim 'nowhere'"):
        vp.run_claim(data, "nowhere", tmp_path / "runs", "abc1234", "2026-12-07")


def test_the_suite_and_cost_readers(vp, tmp_path):
    suite = {"results": [
        {"variant": "sgpa", "config": {"task": "attn-match", "seed": 0}, "accuracy": 1.0},
        {"variant": "sgpa", "config": {"task": "attn-match", "seed": 1}, "accuracy": 0.5},
        {"variant": "sgpa", "config": {"task": "attn-xor", "seed": 0}, "error": "ValueError: ..."},
    ]}  # fmt: skip
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    read = vp._suite_results(tmp_path / "suite.json")
    assert read == {"sgpa": {"0": {"attn-match": {"accuracy": 1.0}}, "1": {"attn-match": {"accuracy": 0.5}}}}
    assert vp.cell(read, "sgpa", {"split": "attn-match", "metric": "accuracy"}) == "0.750 ± 0.354"
    cost = {"rows": [
        {"variant": "sgpa", "name": "sgpa", "T": 256, "mode": "fwd+bwd", "ratio_to_softmax": 4.5},
        {"variant": "sgpa[covariance=diag]", "name": "sgpa", "T": 256, "mode": "fwd+bwd", "ratio_to_softmax": 2.0},
        {"variant": "sgpa", "name": "sgpa", "T": 1024, "mode": "fwd+bwd", "ratio_to_softmax": None},
    ]}  # fmt: skip
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    read = vp._cost_results(tmp_path / "cost.json")
    assert read == {"sgpa": {"0": {"fwd+bwd": {"256": 4.5}}}}
    field = {"split": "fwd+bwd", "metric": "256", "format": "ratio"}
    assert vp.cell(read, "sgpa", field) == "4.50×" and vp.cell(read, "sgpa", {**field, "metric": "1024"}) == "–"


def test_a_refresh_names_a_commit_that_computes_its_numbers(vp, tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    (tmp_path / "gpattn").mkdir()
    (tmp_path / "gpattn" / "x.py").write_text("A = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    monkeypatch.setattr(vp, "ROOT", tmp_path)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    assert vp.current_commit() == head.stdout.strip()
    (tmp_path / "gpattn" / "x.py").write_text("A = 2\n")
    with pytest.raises(SystemExit, match="uncommitted changes under gpattn/"):
        vp.current_commit()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_refresh_end_to_end_on_tiny_runs(vp, data, tmp_path):
    """The real commands at a tiny size (one seed, a few steps, width 8): the suite, a digits compare and the cost
    benchmark each write their file, and sgpa-rff's rows replace its "–" on the page."""
    tiny = {
        "suite": "python benchmarks/attention_suite.py --jobs 1 --seeds 0 --steps 5 --train-size 64 --test-size 64 "
                 "--tasks attn-match --variants softmax,sgpa-rff --json {out}/suite.json",
        "digits": "gpattn compare --dataset digits --attention softmax,sgpa-rff --seeds 0 --epochs 1 --embed-dim 8 "
                  "--num-heads 2 --num-layers 1 --batch-size 256 --num-samples 2 --no-progress --out {out}",
        "cost": "python benchmarks/attention_scaling.py --smoke --variants sgpa-rff --json {out}/cost.json",
    }  # fmt: skip
    for claim, command in tiny.items():
        data["claims"][claim]["refresh"]["command"] = command
    del data["claims"]["cola-minilm"]["refresh"]  # MiniLM's frozen trunk: minutes, not a smoke test
    cost = data["claims"]["cost"]
    cost["columns"], cost["fields"] = ["T = 16"], {"T = 16": {"split": "fwd+bwd", "metric": "16", "format": "ratio"}}
    (tmp_path / "headline.json").write_text(json.dumps(data))
    argv = ["--data", str(tmp_path / "headline.json"), "--out", str(tmp_path / "variants.md"),
            "--runs", str(tmp_path / "runs"), "--refresh", "--commit", "abc1234", "--date", "2026-12-07"]  # fmt: skip
    assert vp.main(argv) == 0
    new = json.loads((tmp_path / "headline.json").read_text())["claims"]
    for claim, column in (("suite", "attn-match"), ("digits", "in-domain accuracy"), ("cost", "T = 16")):
        run = new[claim]["runs"][-1]
        assert run["commit"] == "abc1234" and set(run["rows"]) == {"softmax", "sgpa-rff"}, claim
        assert run["rows"]["sgpa-rff"][column] != "–", (claim, run["rows"])
    page = (tmp_path / "variants.md").read_text()
    assert page.count("at abc1234, 2026-12-07") == 3  # the three runs named under their tables
    assert "--seeds 0 --steps 5" in (tmp_path / "runs" / "tables.md").read_text()
