"""Checkpoints carry their format: a fresh run writes ``format_version`` (and the gpattn version), and a
checkpoint of another format, older or newer, is refused by every reader (``load_run``, ``evaluate``,
``--resume``) with an error naming the file, its format and the formats this gpattn reads — but a release's
(gpattn 0.2.0's format 2: tests/test_release_compat.py), which loads through the migrations. Checkpoints of
gpattn 0.1.0, written before the field, are read off their state-dict keys."""

import shutil
import warnings

import pytest
import torch
from _cli_helpers import TINY_DIGITS

import gpattn
from gpattn.experiments._io import CHECKPOINT_FORMAT, checkpoint_format
from gpattn.experiments.cli import main
from gpattn.experiments.diagnostics import GPCollapseWarning
from gpattn.experiments.training import TrainConfig, load_run_with_data, train

TINY = dict(embed_dim=16, num_heads=2, num_layers=1, epochs=1, batch_size=256, patch_size=4, num_samples=2,
            eval_batch_size=512, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-epoch softmax run on digits (each test edits a copy of it)."""
    folder = tmp_path_factory.mktemp("fmt") / "run"
    train(TrainConfig(dataset="digits", attention="softmax", **TINY), folder)
    return folder


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def _rewrite(run, **changes):
    """Set (value) or drop (None) top-level fields of the run's checkpoint."""
    path = run / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=True)
    for key, value in changes.items():
        if value is None:
            ckpt.pop(key, None)
        else:
            ckpt[key] = value
    torch.save(ckpt, path)
    return path


def _format_1_keys(state: dict) -> dict:
    """A KEP-SVGP layer's parameters as gpattn 0.1.0 named them before the strategy protocol (``kep.``)."""
    layer = gpattn.build_attention("kep-svgp", embed_dim=16, num_heads=2)
    old = {f"encoder.blocks.0.attn.{k.replace('strategy.', 'kep.')}": v for k, v in layer.state_dict().items()}
    assert any(".kep." in k for k in old)
    return {**state, **old}


def test_a_fresh_checkpoint_names_its_format_and_gpattn_version(finished):
    ckpt = torch.load(finished / "checkpoint.pt", weights_only=True)
    assert ckpt["format_version"] == CHECKPOINT_FORMAT == 3
    assert ckpt["gpattn_version"] == gpattn.__version__
    _, _, _, loaded = load_run_with_data(finished)
    assert loaded["format_version"] == CHECKPOINT_FORMAT


@pytest.mark.parametrize("found, words", [(CHECKPOINT_FORMAT + 1, "newer than this gpattn"), (1, "reads checkpoint")])
def test_load_run_refuses_another_format_naming_both(run, found, words):
    path = _rewrite(run, format_version=found)
    with pytest.raises(ValueError) as err:
        load_run_with_data(run)
    text = str(err.value)
    assert str(path) in text and words in text, text
    assert f"checkpoint of format {found} (written by gpattn {gpattn.__version__})" in text, text
    assert f"checkpoint format {CHECKPOINT_FORMAT}" in text and f"this gpattn ({gpattn.__version__})" in text, text


def test_evaluate_and_resume_refuse_a_newer_format(run, capsys):
    path = _rewrite(run, format_version=CHECKPOINT_FORMAT + 1)
    assert main(["evaluate", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint of format {CHECKPOINT_FORMAT + 1}" in err and f"format {CHECKPOINT_FORMAT} and" in err, err
    assert "pip install --upgrade gpattn" in err, err
    code = main(["train", *TINY_DIGITS, "--attention", "softmax", "--out", str(run), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and f"checkpoint of format {CHECKPOINT_FORMAT + 1}" in err, err


@pytest.mark.parametrize("found", [1, 2])
def test_an_unversioned_checkpoint_of_a_development_version_is_refused_saying_what_to_do(run, found):
    """A checkpoint without ``format_version`` is of the 0.1.0 series, read off its keys: format 1 before the strategy
    protocol (KEP-SVGP under ``kep.``), format 2 after it, with the SGPA variants' zero mean, which format 3 keeps from
    being read as the attention-mean model (0.2.0's own format-2 runs name their version and load:
    tests/test_release_compat.py)."""
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    model = _format_1_keys(ckpt["model"]) if found == 1 else ckpt["model"]
    path = _rewrite(run, format_version=None, gpattn_version=None, model=model)
    assert checkpoint_format(torch.load(path, weights_only=True)) == found < CHECKPOINT_FORMAT
    with pytest.raises(ValueError) as err:
        load_run_with_data(run)
    text = str(err.value)
    assert f"checkpoint of format {found} (written before checkpoints named their gpattn version)" in text, text
    assert f"reads checkpoint format {CHECKPOINT_FORMAT} and the runs of gpattn 0.2.0 (format 2)" in text, text
    assert "train the run again with this version" in text, text


@pytest.mark.parametrize("value", ["2", 2.0, True])
def test_a_format_that_is_no_number_is_named(run, value):
    _rewrite(run, format_version=value)
    with pytest.raises(ValueError, match=f"its format_version is {value!r}, not a format number"):
        load_run_with_data(run)


def test_compare_retrains_a_cached_run_of_an_older_format(tmp_path):
    """compare reuses a cached run only if its checkpoint is of this format: a run cached by an older gpattn
    may be another model under the same configuration (defaults changed since)."""
    import warnings

    from gpattn.experiments.compare import compare

    base = TrainConfig(dataset="digits", **TINY)
    logs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare("softmax", [0], tmp_path, base, progress=False, log=logs.append)
        _rewrite(tmp_path / "runs" / "softmax" / "seed0", format_version=CHECKPOINT_FORMAT - 1)
        compare("softmax", [0], tmp_path, base, progress=False, log=logs.append)
        compare("softmax", [0], tmp_path, base, progress=False, log=logs.append)
    runs = [line for line in logs if "softmax seed 0: trained" in line or "softmax seed 0: reused" in line]
    assert "trained (no finished run)" in runs[0]
    assert "trained (written by an older gpattn: another checkpoint format)" in runs[1], runs
    assert "reused" in runs[2], runs


@pytest.mark.parametrize("name, default", [("cgp", "softmax"), ("scgp", "softmax-separate")])
def test_a_correlated_gp_run_saved_before_the_softmax_mean_reloads_in_its_own_form(tmp_path, name, default):
    """cgp's and scgp's default prior means changed from the papers' zero mean to a softmax mean (docs/derivations.md
    §7a): a config records ``prior_mean``; a checkpoint whose config lacks it (written before) trained the zero mean
    and reloads with it (gpattn._migrate), predicting what it predicted and saying what it migrated."""
    assert TrainConfig(dataset="digits", attention=name, **TINY).attention_options == {"prior_mean": default}
    assert TrainConfig(dataset="digits", attention="sgpa", **TINY).attention_options == {}
    out, images = tmp_path / "run", torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(GPCollapseWarning):  # one epoch of a tiny model
        train(TrainConfig(dataset="digits", attention=name, attention_options={"prior_mean": "zero"}, **TINY), out)
    with gpattn.deterministic():
        before = gpattn.experiments.load_run(out).predict(images, num_samples=1).probs
    path = out / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["attention_options"] = {}  # as gpattn wrote it before the change
    torch.save(ckpt, path)
    with pytest.warns(gpattn.OldVersionWarning, match=f"a {name} run written by an older gpattn: .*prior_mean='zero'"):
        run = gpattn.experiments.load_run(out)
    assert run.cfg.attention_options == {"prior_mean": "zero"}
    with gpattn.deterministic():
        torch.testing.assert_close(run.predict(images, num_samples=1).probs, before)


def test_a_kep_svgp_run_saved_before_the_prior_outputscale_reloads_with_the_prior_it_trained(tmp_path):
    """kep-svgp gained ``prior_variance`` σ² (a buffer, default 0.1; docs/derivations.md §6): a run folder whose
    checkpoint's state dict and config lack it (written before) trained under σ² = 1 and reloads with it through the
    one load hook (gpattn._migrate.OLD_STATES), predicting what it predicted and saying what it migrated."""
    out, images = tmp_path / "run", torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    old_form = {"prior_variance": 1.0, "prior_mean": "zero"}  # the defaults then (the config migration fills both)
    cfg = TrainConfig(dataset="digits", attention="kep-svgp", attention_options=old_form, **TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPCollapseWarning)  # one epoch of a tiny model
        train(cfg, out)
    with gpattn.deterministic():
        before = gpattn.experiments.load_run(out).predict(images, num_samples=1).probs
    path = out / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["config"]["attention_options"] = {}  # as gpattn wrote it before the change
    ckpt["model"] = {k: v for k, v in ckpt["model"].items() if not k.endswith(".prior_variance")}
    assert len(ckpt["model"]) < len(torch.load(path, weights_only=True)["model"])
    torch.save(ckpt, path)
    config_warning = pytest.warns(gpattn.OldVersionWarning, match=r"migrated its config .*prior_mean='zero'")
    with config_warning, pytest.warns(gpattn.OldVersionWarning, match=r"prior_variance missing .*prior_variance=1\.0"):
        run = gpattn.experiments.load_run(out)
    assert {float(b) for k, b in run.model.named_buffers() if k.endswith(".prior_variance")} == {1.0}
    with gpattn.deterministic():
        torch.testing.assert_close(run.predict(images, num_samples=1).probs, before)
