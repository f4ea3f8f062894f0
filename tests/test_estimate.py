"""An estimate before a run, progress during it (issue #58, item 3): the arithmetic on constructed timings, and the
lines ``train`` and ``compare`` print."""

import dataclasses
import json
from pathlib import Path

import pytest

from gpattn.experiments import _estimate as E
from gpattn.experiments.compare import compare
from gpattn.experiments.training import TrainConfig, train

TINY = dict(embed_dim=16, num_heads=2, num_layers=1, epochs=1, batch_size=32, lr=5e-3, pooling="mean", patch_size=4,
            num_samples=3, progress=False)


def test_run_estimate_adds_the_steps_and_the_evaluation():
    est = E.run_estimate(120, 1.5, 37_000, 0.002)  # 120 steps at 1.5 s, 3,700 rows × 10 samples at 2 ms
    assert est.training == pytest.approx(180.0) and est.evaluation == pytest.approx(74.0)
    assert est.total == pytest.approx(254.0)
    assert est.line() == ("~4.2 min (training: 120 steps at 1.5 s/step, ~3.0 min; evaluation: 37,000 rows × "
                          "samples, ~74 s)")
    assert E.run_estimate(0, 2.0, 0, 1.0).total == 0.0


@pytest.mark.parametrize("args, name", [((-1, 1.0, 1, 1.0), "steps"), ((1, 1.0, 2.5, 1.0), "row_samples"),
                                        ((1, float("nan"), 1, 1.0), "seconds_per_step"),
                                        ((1, 1.0, 1, -1.0), "seconds_per_row_sample")])
def test_run_estimate_names_a_bad_argument(args, name):
    with pytest.raises(ValueError, match=name):
        E.run_estimate(*args)


def test_time_left_counts_known_variants_at_their_time_and_the_others_at_the_mean():
    known = {"softmax": 60.0, "sgpa": 240.0}
    # the current run's 100 s, sgpa's next seed 240 s, softmax's 60 s, an untimed variant at the mean 150 s, a
    # reused run (None) nothing
    assert E.time_left(100.0, ["sgpa", "softmax", "cgp", None], known) == (100.0 + 240 + 60 + 150, 1)
    assert E.time_left(5.0, [], {}) == (5.0, 0)
    assert E.time_left(5.0, ["x"], {}) == (5.0, 1)  # nothing timed yet: nothing to guess with


def test_duration_and_the_warning_over_an_hour():
    assert [E.duration(s) for s in (40, 252, 5400, 8280)] == ["~40 s", "~4.2 min", "~1.5 h", "~2.3 h"]
    assert E.over_an_hour(3600.0, "this run") is None
    line = E.over_an_hour(8280.0, "this run (sgpa seed 0)")
    assert line.startswith("warning: this run (sgpa seed 0) is expected to take ~2.3 h on this machine")


def test_step_clock_times_the_steps_after_the_warm_up_once():
    """Steps of 10 s (the first: warm-up), then 1, 2 and 3 s: the clock reads 2 s per step, once."""
    times = iter([10.0, 16.0])  # read after the warm-up step and after the third timed step
    synced = []
    clock = E.StepClock(sync=lambda: synced.append(1), clock=lambda: next(times))
    readings = [clock.tick() for _ in range(E.WARM_UP_STEPS + E.TIMED_STEPS + 3)]
    assert readings[E.WARM_UP_STEPS + E.TIMED_STEPS - 1] == pytest.approx(2.0)
    assert sum(r is not None for r in readings) == 1 and len(synced) == 2


def test_run_plan_says_run_k_of_n_the_time_left_and_warns_once():
    lines = []
    folders = [Path("out/runs/softmax/seed0"), Path("out/runs/softmax/seed1"), Path("out/runs/sgpa/seed0"),
               Path("out/runs/softmax/seed0")]  # +ts shares softmax's run: counted once
    plan = E.RunPlan(folders, lines.append, finished=lambda f: f.name == "seed1")  # seed 1 finished: reused
    plan.start(folders[0], "softmax seed 0")
    plan.estimated(folders[0], "softmax seed 0")(E.run_estimate(100, 40.0, 0, 0.0))  # 4,000 s
    plan.estimated(folders[0], "softmax seed 0")(E.run_estimate(100, 40.0, 0, 0.0))
    plan.finish(folders[0], "softmax seed 0", reused=False)
    plan.finish(folders[1], "softmax seed 1", reused=True)
    assert lines[0] == "[compare] run 1 of 3 (softmax seed 0): started"
    # left: this run's 4,000 s, the reused seed 1 nothing, sgpa (not timed) at the mean 4,000 s
    assert lines[1].startswith("[compare] run 1 of 3 (softmax seed 0): ~66.7 min (training: 100 steps at 40 s/step")
    assert lines[1].endswith("; ~2.2 h left in this compare (1 run of variants not timed yet counted at the mean)")
    assert sum(line.startswith("[compare] warning: this compare is expected to take ~2.2 h") for line in lines) == 1
    assert lines[-2].startswith("[compare] run 1 of 3 (softmax seed 0): done in ") and lines[-2].endswith(" s")
    assert lines[-1] == "[compare] run 2 of 3 (softmax seed 1): done before, nothing to run"


def test_train_logs_its_estimate_and_a_line_per_epoch_and_split(tmp_path, capsys):
    """``train``'s log: the estimate once, a line per epoch and per evaluated split; ``gpattn evaluate --no-progress``
    prints a line per split too."""
    from gpattn.experiments.cli import main

    lines = []
    train(TrainConfig(dataset="digits", attention="softmax", **TINY), tmp_path, log=lines.append)
    estimate = [line for line in lines if "estimated" in line]
    assert len(estimate) == 1 and estimate[0].startswith("[train] softmax seed 0: estimated ~")
    assert "training: 24 steps at" in estimate[0] and estimate[0].endswith("from steps 2–4")  # 28 steps, 4 done
    # the evaluation counts every evaluated split, a validation line per epoch and the detectors' pass over the
    # training split, each row at P = 3 samples
    sizes = json.loads((tmp_path / "data.json").read_text())["sizes"]
    rows = sum(sizes[k] for k in ("val", "test", "shift", "ood")) + sizes["val"] + sizes["train"]
    assert f"evaluation: {3 * rows:,} rows × samples" in estimate[0], (sizes, estimate[0])
    assert any(line.startswith("[train] softmax seed 0: epoch 1/1, loss") for line in lines)
    for split in ("val", "test", "shift", "ood"):
        assert sum(line.startswith(f"[train] softmax seed 0: evaluated {split} (") for line in lines) == 1, lines
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(tmp_path), "--no-progress", "--out", str(tmp_path / "ev")]) == 0
    printed = capsys.readouterr().out.splitlines()
    for split in ("val", "test", "shift", "ood"):
        assert sum(line.startswith(f"evaluated {split} (") and line.endswith(" s") for line in printed) == 1, printed


def test_compare_says_run_k_of_n_with_an_estimate_and_the_time_of_each_run(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "SECONDS_PER_FIGURE", 10.0)
    lines = []
    compare("softmax,softmax+ts", [0, 1], tmp_path, TrainConfig(dataset="digits", **TINY), progress=False,
            log=lines.append)
    runs = [line for line in lines if line.startswith("[compare] run ")]
    assert runs[0] == "[compare] run 1 of 2 (softmax seed 0): started"
    assert runs[1].startswith("[compare] run 1 of 2 (softmax seed 0): ~") and "left in this compare" in runs[1]
    # the report's figures: 2 rows x (first-seed in-domain, in-domain and shift pooled) + risk-coverage + msp histograms
    assert runs[1].endswith("(the report ~80 s included)")
    assert runs[2].startswith("[compare] run 1 of 2 (softmax seed 0): done in ")
    assert runs[3] == "[compare] run 2 of 2 (softmax seed 1): started"
    assert any(line.startswith("[compare] run 2 of 2 (softmax seed 1): done in ") for line in runs)
    # +ts: the same run, not trained again
    assert runs.count("[compare] run 1 of 2 (softmax seed 0): done before, nothing to run") == 1
    assert any(line.startswith("[train] softmax seed 1: evaluated test (") for line in lines)  # --no-progress lines


def test_run_plan_adds_the_time_finished_runs_took_beyond_their_estimate(monkeypatch):
    """A run's time beyond its steps and evaluation pass (model build, post-hoc fits, saved files) is measured on
    the finished runs and added to later runs' estimates: the demo's runs took ~6 s each beyond their ~20 s."""
    now = [0.0]
    monkeypatch.setattr(E.time, "perf_counter", lambda: now[0])
    lines = []
    folders = [Path("out/runs/a/seed0"), Path("out/runs/b/seed0"), Path("out/runs/c/seed0")]
    plan = E.RunPlan(folders, lines.append, finished=lambda f: False)
    plan.start(folders[0], "a")
    plan.estimated(folders[0], "a")(E.run_estimate(10, 1.0, 0, 0.0))  # 10 s; nothing finished: no overhead yet
    assert lines[-1].endswith("; ~30 s left in this compare (2 runs of variants not timed yet counted at the mean)")
    now[0] = 30.0
    plan.finish(folders[0], "a", reused=False)  # took 30 s: 20 s beyond its estimate
    assert plan.overhead == pytest.approx(20.0)
    plan.start(folders[1], "b")
    plan.estimated(folders[1], "b")(E.run_estimate(10, 1.0, 0, 0.0))
    # b: 10 s + 20 s; c (not timed) at the mean of a's 30 s and b's 30 s
    assert lines[-1].endswith("; ~60 s left in this compare (1 run of variants not timed yet counted at the mean)")


def test_time_left_counts_untimed_variants_at_their_prior_scaled_by_the_timed_ones():
    """Priors (the probed first steps) of 100 s for cgp, 10 s for softmax and 20 s for sgpa; cgp measured 150 s
    (1.5x its prior): softmax counts 15 s, sgpa 30 s; a variant without a prior the mean of the known; the report's
    seconds once."""
    prior = {"cgp": 100.0, "softmax": 10.0, "sgpa": 20.0}
    assert E.time_left(50.0, ["cgp", "softmax", "sgpa", None], {"cgp": 150.0}, prior, extra=7.0) == (
        50.0 + 150 + 15 + 30 + 7, 2)
    # two timed variants: the ratio of their sums, (150 + 30) / (100 + 10) (not the mean of the ratios)
    left, guessed = E.time_left(0.0, ["sgpa"], {"cgp": 150.0, "softmax": 30.0}, prior)
    assert (left, guessed) == (pytest.approx(20.0 * 180 / 110), 1)
    assert E.time_left(0.0, ["x"], {"cgp": 150.0, "softmax": 30.0}, prior) == (90.0, 1)  # no prior: the mean
    assert E.time_left(0.0, ["sgpa"], {}, prior) == (20.0, 1)  # nothing timed: the prior as probed
    assert E.time_left(0.0, ["sgpa"], {"z": 5.0}, prior) == (20.0, 1)  # no timed key has a prior: ratio 1


def test_report_seconds_counts_each_figure():
    assert E.report_seconds(50) == pytest.approx(50 * E.SECONDS_PER_FIGURE) and E.report_seconds(0) == 0.0
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="figures"):
            E.report_seconds(bad)


def test_run_plan_counts_untimed_runs_at_their_prior_and_the_report(monkeypatch):
    """The demo's order at fdc5f1e: cgp (the slowest) first. With priors, the first time left is cgp's two runs
    and the others' priors, not 34 runs at cgp's time."""
    now = [0.0]
    monkeypatch.setattr(E.time, "perf_counter", lambda: now[0])
    lines = []
    folders = [Path(f"out/runs/{v}/seed{s}") for v in ("cgp", "softmax") for s in (0, 1)]
    plan = E.RunPlan(folders, lines.append, finished=lambda f: False)
    plan.prior = {Path("out/runs/cgp"): 30.0, Path("out/runs/softmax"): 4.0}
    plan.report = 15.0
    plan.start(folders[0], "cgp seed 0")
    plan.estimated(folders[0], "cgp seed 0")(E.run_estimate(20, 1.5, 0, 0.0))  # 30 s: ratio 1
    # cgp 30 + 30, softmax 4 + 4, the report 15
    assert lines[-1].endswith("; ~83 s left in this compare (2 runs of variants not timed yet counted at their first "
                              "steps' time) (the report ~15 s included)")
    now[0] = 45.0
    plan.finish(folders[0], "cgp seed 0", reused=False)  # 45 s: 1.5x its prior, and 15 s overhead
    plan.start(folders[1], "cgp seed 1")
    plan.estimated(folders[1], "cgp seed 1")(E.run_estimate(20, 1.5, 0, 0.0))
    # this run 30 + 15 overhead, softmax 2 x 4 x 1.5, the report 15
    assert "; ~72 s left in this compare (2 runs" in lines[-1]


def test_probe_runs_times_each_variant_writes_nothing_and_logs_a_failure(tmp_path, monkeypatch):
    from gpattn.experiments import training
    from gpattn.experiments.compare import probe_runs
    from gpattn.experiments.data import load_dataset

    build = training.build_model

    def broken_for_kernel(cfg, bundle, positions=None):
        if cfg.attention == "kernel":
            raise RuntimeError("out of memory")
        return build(cfg, bundle, positions)

    monkeypatch.setattr(training, "build_model", broken_for_kernel)
    monkeypatch.chdir(tmp_path)
    bundle = load_dataset("digits", data_dir=None, download=False, seed=0)
    cfg = TrainConfig(dataset="digits", **TINY)
    lines = []
    seconds = probe_runs({"a": cfg, "b": dataclasses.replace(cfg, attention="kep-svgp"),
                          "bad": dataclasses.replace(cfg, attention="kernel")}, bundle, lines.append)
    assert set(seconds) == {"a", "b"} and all(s > 0 for s in seconds.values())
    assert lines == ["[compare] kernel: no probe of its first steps (RuntimeError: out of memory); its runs count at "
                     "the mean of the timed ones until one is timed"]
    assert list(tmp_path.iterdir()) == []  # no run folder, no file


def test_the_estimate_counts_the_rows_the_detectors_read():
    """fit_detectors reads the training split, and val and ood_val where kNN's k is chosen on both."""
    from gpattn.experiments.features import detector_rows

    assert detector_rows({"train": range(10), "val": range(3), "ood_val": range(2)}) == 15
    assert detector_rows({"train": range(10), "val": range(3)}) == 10
    assert detector_rows({"train": range(10), "val": range(0), "ood_val": range(2)}) == 10
