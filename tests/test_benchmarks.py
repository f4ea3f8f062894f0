"""The benchmark scripts (benchmarks/): their bookkeeping, isolation and output schema.

Benchmarks are not tests: nothing here asserts a wall-clock time. What is checked is
what the numbers are made of — ratios against softmax at the same (T, mode), log-log slopes, skip
decisions, the option table, the peak-memory meter against an allocation of known size, the
timeout / error / out-of-memory paths of the isolated runner — and, in the slow smoke runs, that
each script's ``main`` runs every registered variant at a tiny size and writes rows of the
documented schema.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

import gpattn

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TESTS = Path(__file__).resolve().parent

# the forkserver children import the benchmark modules (and this one) by name
for _p in (str(BENCH), str(TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

common = importlib.import_module("_common")
scaling = importlib.import_module("attention_scaling")
epoch_time = importlib.import_module("epoch_time")

ISSUE7_SIZES = {"M": 16, "m": 16, "l": 16, "r": 10, "c": 2}


# ----------------------------------------------------------------------------- workers for the runner
def _worker_value(x):
    return {"double": 2 * x}


def _worker_raise():
    raise ValueError("bad input for the worker")


def _worker_sleep(seconds):
    time.sleep(seconds)
    return {"slept": seconds}


def _worker_allocate(mib):
    t = torch.ones(int(mib * 2**20 // 4))  # float32: mib MiB, touched
    return {"sum": float(t[:10].sum())}


def _worker_peak(mib):
    peak = common.PeakRSS()
    peak.reset()
    t = torch.ones(int(mib * 2**20 // 4))
    del t
    return {"peak_mb": peak.peak_extra_mb(), "exact": peak.exact}


# ----------------------------------------------------------------------------- option table
def test_variant_configs_cover_registry_with_issue7_sizes():
    configs = common.variant_configs()
    assert configs[0]["variant"] == common.REFERENCE == "softmax"
    names = {c["name"] for c in configs}
    assert names == set(gpattn.list_attention())
    labels = [c["variant"] for c in configs]
    assert len(labels) == len(set(labels))
    for c in configs:
        valid = gpattn.attention_options(c["name"])
        assert set(c["options"]) <= set(valid), c
        for key, value in c["options"].items():
            if key in common.EXTRA_CONFIGS:
                assert value in common.extra_values(c["name"], key)
            else:
                assert value == common.BENCH_OPTIONS[key]
        # every benchmark size the variant has under any known option name is passed
        for key in set(valid) & set(common.BENCH_OPTIONS):
            assert c["options"][key] == common.BENCH_OPTIONS[key]
        # and the layer builds with them
        gpattn.build_attention(c["name"], 128, 4, **c["options"])
    assert {common.BENCH_OPTIONS[k] for k in ("num_global", "m", "l")} == {ISSUE7_SIZES["M"]}
    assert common.BENCH_OPTIONS["rank"] == ISSUE7_SIZES["r"] and common.BENCH_OPTIONS["num_centroids"] == 2


def test_variant_configs_filter_and_errors():
    configs = common.variant_configs(["kernel"])
    assert [c["variant"] for c in configs] == ["softmax", "kernel"]  # the reference is always added
    with pytest.raises(ValueError, match="unknown variant"):
        common.variant_configs(["no-such-variant"])
    assert common.parse_variants(None) is None and common.parse_variants("all") is None
    assert common.parse_variants(" a, b ,") == ["a", "b"]
    assert common.parse_variants("a[x=1,y=2],b") == ["a[x=1,y=2]", "b"]


# ----------------------------------------------------------------------------- summaries
def _row(variant, T, mode, ms, peak=10.0, status="ok"):
    return {
        "variant": variant,
        "T": T,
        "mode": mode,
        "ms_median": ms if status == "ok" else None,
        "ms_min": ms if status == "ok" else None,
        "peak_mb": peak if status == "ok" else None,
        "status": status,
        "reason": None if status == "ok" else "test",
    }


def test_ratios_divide_by_softmax_at_same_T_and_mode():
    rows = [
        _row("softmax", 256, "forward", 2.0),
        _row("softmax", 256, "fwd+bwd", 5.0),
        _row("softmax", 1024, "forward", 8.0),
        _row("x", 256, "forward", 3.0),
        _row("x", 256, "fwd+bwd", 4.0),
        _row("x", 1024, "forward", 8.0),
        _row("x", 1024, "fwd+bwd", 1.0),  # no softmax at (1024, fwd+bwd): no ratio
        _row("y", 256, "forward", 0.0, status="skipped"),
    ]
    scaling.add_ratios(rows)
    got = {(r["variant"], r["T"], r["mode"]): r["ratio_to_softmax"] for r in rows}
    assert got[("softmax", 256, "forward")] == 1.0
    assert got[("x", 256, "forward")] == pytest.approx(1.5)
    assert got[("x", 256, "fwd+bwd")] == pytest.approx(0.8)
    assert got[("x", 1024, "forward")] == pytest.approx(1.0)
    assert got[("x", 1024, "fwd+bwd")] is None
    assert got[("y", 256, "forward")] is None
    mins = {(r["variant"], r["T"], r["mode"]): r["ratio_min_to_softmax"] for r in rows}
    assert mins[("x", 256, "fwd+bwd")] == pytest.approx(0.8) and mins[("y", 256, "forward")] is None


def test_slopes_are_loglog_between_consecutive_T():
    ts = [64, 256, 1024]
    rows = []
    for T in ts:
        rows.append(_row("lin", T, "forward", 0.01 * T, peak=0.5 * T))
        rows.append(_row("cub", T, "forward", 1e-6 * T**3, peak=1e-3 * T**2))
    rows.append(_row("tiny", 64, "forward", 1.0, peak=0.2))
    rows.append(_row("tiny", 256, "forward", 2.0, peak=0.4))
    rows.append(_row("gap", 64, "forward", 1.0))
    rows.append(_row("gap", 1024, "forward", 16.0))
    out = {(s["variant"], s["T0"]): s for s in scaling.slopes(rows, ts)}
    assert out[("lin", 256)]["time_slope"] == pytest.approx(1.0)
    assert out[("lin", 256)]["mem_slope"] == pytest.approx(1.0)
    assert out[("cub", 64)]["time_slope"] == pytest.approx(3.0)
    assert out[("cub", 256)]["mem_slope"] == pytest.approx(2.0)
    assert out[("cub", 64)]["mem_slope"] == pytest.approx(2.0)
    assert out[("tiny", 64)]["time_slope"] == pytest.approx(0.5)
    assert out[("tiny", 64)]["mem_slope"] is None  # below 1 MiB the RSS page granularity dominates
    assert not any(s["variant"] == "gap" for s in out.values())  # only consecutive T


def test_skip_only_when_predicted_not_to_fit():
    profile = dict(scaling.PROFILES["quick"])
    profile["timeout"] = 10.0
    rows = [_row("cub", 64, "fwd+bwd", 10.0, peak=5.0), _row("cub", 256, "fwd+bwd", 640.0, peak=80.0)]
    # cubic: 640 ms * 4**3 = 41 s per call > 10 s budget
    reason = scaling._skip_reason(rows, "cub", "fwd+bwd", 1024, profile, mem_limit_mb=1e6)
    assert reason is not None and "predicted 41.0 s" in reason
    # fits the time budget with a larger timeout, but its memory (80 MiB * 4**2 = 1280 MiB) does not
    profile["timeout"] = 1000.0
    reason = scaling._skip_reason(rows, "cub", "fwd+bwd", 1024, profile, mem_limit_mb=1000.0)
    assert reason is not None and "1280 MiB" in reason
    assert scaling._skip_reason(rows, "cub", "fwd+bwd", 1024, profile, mem_limit_mb=2000.0) is None
    # one measured point: no extrapolation, the case runs (the per-case timeout still applies)
    assert scaling._skip_reason(rows[:1], "cub", "fwd+bwd", 1024, dict(profile, timeout=0.001), 1.0) is None
    # a smaller T that did not fit: larger T is skipped too
    rows.append(_row("big", 256, "forward", 0.0, status="skipped"))
    assert "T=256" in scaling._skip_reason(rows, "big", "forward", 1024, profile, 1e6)


# ----------------------------------------------------------------------------- memory meter and runner
def test_peak_meter_sees_a_known_allocation():
    torch.manual_seed(0)
    out = _worker_peak(96)
    if not out["exact"]:
        pytest.skip("no /proc/self/clear_refs: the peak meter falls back to ru_maxrss")
    assert 90.0 <= out["peak_mb"] <= 96.0 + 40.0


@pytest.mark.slow  # starts the forkserver (~5 s on a loaded 2-core machine)
def test_isolated_runner_paths():
    kw = dict(threads=1, mem_limit_mb=512.0, preload=("test_benchmarks", "attention_scaling", "epoch_time"))
    assert common.run_isolated(_worker_value, {"x": 21}, timeout=60, **kw) == {"status": "ok", "double": 42}
    err = common.run_isolated(_worker_raise, {}, timeout=60, **kw)
    assert err["status"] == "error" and "ValueError" in err["reason"] and "bad input" in err["reason"]
    slow = common.run_isolated(_worker_sleep, {"seconds": 30}, timeout=1.5, **kw)
    assert slow["status"] == "skipped" and "timeout" in slow["reason"]
    # 1 GiB beyond the cap (512 MiB + the runner's 1 GiB slack for thread arenas) fails cleanly
    oom = common.run_isolated(_worker_allocate, {"mib": 4096}, timeout=60, **kw)
    assert oom["status"] == "skipped" and "out of memory" in oom["reason"], oom
    peak = common.run_isolated(_worker_peak, {"mib": 64}, timeout=60, **kw)
    assert peak["status"] == "ok"
    if peak["exact"]:
        assert 60.0 <= peak["peak_mb"] <= 64.0 + 40.0
    inproc = common.run_isolated(_worker_value, {"x": 1}, timeout=1, isolate=False, **kw)
    assert inproc == {"status": "ok", "double": 2}


# ----------------------------------------------------------------------------- end to end (tiny)
ROW_KEYS = {"variant", "name", "options", "T", "mode", "ms_median", "ms_min", "peak_mb", "ratio_to_softmax", "status"}


@pytest.mark.slow
def test_attention_scaling_smoke_schema(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "scaling.json"
    result = scaling.main(["--smoke", "--threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["ts"] == [16, 32] and data["meta"]["B"] == 2
    assert data["meta"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # --device auto
    rows = data["rows"]
    labels = {c["variant"] for c in data["meta"]["configs"]}
    assert {c["name"] for c in data["meta"]["configs"]} == set(gpattn.list_attention())
    assert len(rows) == len(labels) * 2 * 2
    by_key = {}
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert r["status"] == "ok", f"{r['variant']} T={r['T']} {r['mode']}: {r['reason']}"
        assert r["mode"] in scaling.MODES and r["T"] in (16, 32)
        assert r["ms_min"] <= r["ms_median"] and r["ms_min"] > 0 and r["peak_mb"] >= 0 and r["reps"] >= 1
        by_key[(r["variant"], r["T"], r["mode"])] = r
    for (_variant, T, mode), r in by_key.items():
        expected = r["ms_median"] / by_key[("softmax", T, mode)]["ms_median"]
        assert r["ratio_to_softmax"] == pytest.approx(expected, rel=1e-9)
    for s in data["slopes"]:
        a, b = by_key[(s["variant"], 16, s["mode"])], by_key[(s["variant"], 32, s["mode"])]
        assert s["time_slope"] == pytest.approx(math.log2(b["ms_median"] / a["ms_median"]), rel=1e-9)
    assert len(result["rows"]) == len(rows)
    for png in data["meta"]["png"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_epoch_time_smoke_schema(tmp_path):
    from gpattn.experiments.data.fixtures import make_cola_zip

    torch.manual_seed(0)
    make_cola_zip(tmp_path / "data", n_train=64, n_dev=16, n_ood=16, seed=0)
    out = tmp_path / "epoch.json"
    epoch_time.main(
        ["--data-dir", str(tmp_path / "data"), "--no-verify-checksum", "--max-steps", "2", "--batch-size", "8"]
        + ["--threads", "1", "--json", str(out)]
    )
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["name"] for r in rows} == set(gpattn.list_attention())
    assert data["meta"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # --device auto
    ref = next(r for r in rows if r["variant"] == "softmax")
    for r in rows:
        assert r["status"] == "ok", f"{r['variant']}: {r['reason']}"
        assert r["steps_timed"] == 2 and r["extrapolated"] is True
        assert r["steps_per_epoch"] == math.ceil(data["meta"]["n_train"] / 8)
        assert r["epoch_s"] == pytest.approx(r["step_ms_mean"] / 1e3 * r["steps_per_epoch"], rel=1e-9)
        assert r["ratio_to_softmax"] == pytest.approx(r["epoch_s"] / ref["epoch_s"], rel=1e-9)
    assert data["meta"]["model"] == {
        "embed_dim": 128,
        "num_heads": 4,
        "num_layers": 2,
        "mlp_ratio": 2.0,
        "dropout": 0.1,
        "batch_size": 8,
    }


@pytest.mark.slow
def test_compile_breaks_none_in_deterministic_mode(tmp_path):
    """Every registered layer traces into one graph under gpattn.deterministic() (the
    ExitStack in gp_algebra used to break sgpa's graph 11 times)."""
    compile_breaks = importlib.import_module("compile_breaks")
    rows = compile_breaks.main(["--device", "cpu", "--markdown", str(tmp_path / "breaks.md")])
    assert {r["variant"] for r in rows} == set(gpattn.list_attention())
    for r in rows:
        if r["mode"] == "deterministic":
            assert (r["graphs"], r["breaks"]) == (1, 0), r
    assert "| softmax | deterministic | 1 | 0 |" in (tmp_path / "breaks.md").read_text()


@pytest.mark.slow  # child processes; ~8 s on one core
def test_gpu_check_smoke_on_cpu(tmp_path):
    """benchmarks/gpu_check.py (the CUDA end-to-end check) runs its ``layers`` check with the CPU as the
    "device" and reports every item as passed: the script a GPU session runs has not rotted."""
    import subprocess

    out = tmp_path / "gc"
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--checks", "layers"]
    run = subprocess.run(
        [*cmd, "--variants", "softmax,sgpa-decoupled", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["overall"] == "PASS" and [c["check"] for c in report["checks"]] == ["layers"]
    items = report["checks"][0]["data"]["items"]
    assert {i["name"] for i in items} >= {"softmax", "sgpa-decoupled"} and all(i["status"] == "pass" for i in items)
    assert "| layers | pass |" in (out / "gpu_check.md").read_text()


@pytest.mark.slow  # child processes; ~25 s on one core (two digits trainings, tiny BERTs)
def test_gpu_check_every_other_check_on_cpu(tmp_path):
    """The ``train``, ``hf`` and ``timing`` checks of benchmarks/gpu_check.py (benchmarks/_gpu_checks/) run with
    the CPU as the "device": every item passes but the one that needs CUDA, and the timing rows have the schema
    of attention_scaling.py's."""
    import subprocess

    out = tmp_path / "gc"
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--checks", "train,hf,timing"]
    # --time-scale: the checks' own wall-clock limits (330 s for train on a CPU) are for a quiet machine; a loaded CI
    # runner spent train's (an item skipped, not failed), so the schema test gives them room; the 600 s timeout stays
    cmd += ["--variants", "softmax,sgpa-decoupled", "--timing-ts", "16,32", "--time-scale", "4", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["overall"] == "PASS" and [c["check"] for c in report["checks"]] == ["train", "hf", "timing"]
    items = {c["check"]: {i["name"]: i for i in c["data"]["items"]} for c in report["checks"]}
    cuda_only = {"training step: host-device synchronisations"}
    for check, by_name in items.items():
        for name, item in by_name.items():
            assert item["status"] == ("skip" if name in cuda_only else "pass"), (check, item)
    assert len(items["train"]) == 10 and "--resume on cpu (cut after 5 steps)" in items["train"]
    assert items["train"]["--resume on cpu (cut after 5 steps)"]["max_abs_metric_diff"] == 0.0
    assert len(items["hf"]) == 13 and "HFClassifier frozen trunk on the device" in items["hf"]
    rows = [r for item in items["timing"].values() for r in item["rows"]]
    variants = {"softmax", "sgpa-decoupled", "sgpa-decoupled[covariance=full]"}
    assert {(r["variant"], r["T"], r["mode"]) for r in rows} == {
        (v, T, m) for v in variants for T in (16, 32) for m in scaling.MODES
    }
    for r in rows:
        assert r["status"] == "ok" and r["ms_median"] > 0 and r["ratio_to_softmax"] > 0, r
    md = (out / "gpu_check.md").read_text()
    assert "| train | pass |" in md and "| hf | pass |" in md and "**fwd+bwd** — median ms" in md


def _gpu_checks(module):
    return importlib.import_module(f"_gpu_checks.{module}")


def test_gpu_check_differences_and_statuses():
    """The comparisons every gpu_check item is judged by, and a check's status from its items."""
    compare, runner = _gpu_checks("compare"), _gpu_checks("runner")
    b = torch.tensor([1.0, -2.0, float("nan"), 4.0])
    e = compare.err(b + torch.tensor([0.0, 0.1, 0.0, 0.0]), b)
    assert e["max_abs"] == pytest.approx(0.1) and e["norm"] == pytest.approx(0.1 / 4) and e["note"] == "NaN in both"
    assert e["max_rel"] == pytest.approx(0.1 / 2)
    assert compare.err(torch.tensor([float("nan")]), torch.tensor([1.0]))["norm"] == math.inf
    assert compare.err(torch.zeros(2), torch.zeros(3))["note"] == "shape (2,) vs (3,)"
    assert compare.err(None, None) == {"max_abs": 0.0, "max_rel": 0.0, "norm": 0.0, "note": None}
    # a vanishing reference: relative to the floor, not to round-off
    assert compare.err(torch.tensor([1e-9]), torch.tensor([0.0]), floor=1e-3)["norm"] == pytest.approx(1e-6)
    cmp = {"y": {"norm": 1e-7}, "terms": {"kl": {"norm": 1e-3}}, "grads": {"x": {"norm": 1e-5}}}
    assert compare.judge(cmp, 1e-6, {"term:kl"}) == (False, [{"quantity": "grad:x", "norm": 1e-5, "allowed": 1e-6}])
    assert compare.judge(cmp, {"y": 1e-6, "term:kl": 1e-2, "grad:x": 1e-4}, set())[0]

    def data(*statuses, done=True, **extra):
        return {"items": [{"status": s} for s in statuses], "done": done, **extra}

    assert runner.status_of(data("pass", "warn", "fail", "error"), 0, False)[0] == "fail"
    assert runner.status_of(data("pass", "error", "warn"), 0, False)[0] == "error"
    assert runner.status_of(data("pass", "warn", done=False), -9, True) == ("timeout", "1 pass, 1 warn; timed out")
    assert runner.status_of(data("pass", done=False), 1, False) == ("error", "1 pass; child exit 1")
    assert runner.status_of(data("pass", "warn", "skip"), 0, False)[0] == "warn"
    assert runner.status_of(data("skip", "skip"), 0, False)[0] == "skip"
    assert runner.status_of(data("pass", "skip"), 0, False) == ("pass", "1 pass, 1 skip")
    assert runner.status_of(data("pass", setup_error="ImportError: x"), 0, False) == ("error", "setup: ImportError: x")
    assert runner.status_of(None, 0, True) == ("timeout", "no result file (timed out)")


def test_gpu_check_sync_counter_without_a_gpu(monkeypatch):
    """gpu_check's host-device synchronisation counter, fed the warnings and native lines torch's sync debug
    mode would give (torch.cuda's calls stubbed: no GPU here): counted, located at the last gpattn line, and
    a warning raised from the checker's own files counted as the backward's."""
    sync, pkg = _gpu_checks("sync"), importlib.import_module("_gpu_checks")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda *a, **k: None)
    source = "import warnings\ndef f(message):\n    warnings.warn(message)\n"
    in_gpattn, in_checker = {}, {}
    exec(compile(source, "/somewhere/gpattn/fake_layer.py", "exec"), in_gpattn)
    exec(compile(source, str(pkg.PKG / "fake_check.py"), "exec"), in_checker)

    def work():
        in_gpattn["f"]("called a synchronizing CUDA operation")
        in_gpattn["f"]("called a synchronizing CUDA operation")
        in_gpattn["f"]("synchronization debug mode is a prototype feature")  # a notice, not an event
        in_checker["f"]("called a synchronizing CUDA operation")
        import os

        os.write(2, b"[W] called a synchronizing CUDA operation (native thread)\n")

    assert sync.sync_events(work, "cpu")["checked"] is False
    got = sync.sync_events(work, "cuda")
    assert got["checked"] and got["count"] == 4
    assert got["by_location"] == {"gpattn/fake_layer.py:3 (f)": 2, sync.BACKWARD: 1}
    assert got["by_op"] == {"gpattn/fake_layer.py:3 (f)": 2, "backward": 1}
    assert got["native_thread_lines"] == ["[W] called a synchronizing CUDA operation (native thread)"]


def test_train_step_smoke_schema(tmp_path):
    """benchmarks/train_step.py --quick: a row per (variant, mode) with softmax's steps as every ratio's divisor,
    and the table (a kernel variant and a Gumbel one, both modes; Dynamo's eager backend keeps the C++ build out
    of the test; tests/test_compile.py covers every variant compiled)."""
    train_step = importlib.import_module("train_step")
    out = tmp_path / "step.json"
    train_step.main(
        ["--quick", "--backend", "eager", "--variants", "kernel,sto", "--threads", "1"]
        + ["--json", str(out), "--markdown", str(tmp_path / "step.md")]
    )
    data = json.loads(out.read_text())
    rows = {(r["variant"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(v, m) for v in ("softmax", "kernel", "sto") for m in ("eager", "compiled")}
    for (_, mode), r in rows.items():
        assert r["status"] == "ok", r["reason"]
        assert r["T"] == 8 and r["steps_timed"] == 2 and r["step_ms"] > 0
        assert r["ratio_to_softmax"] == pytest.approx(r["step_ms"] / rows[("softmax", mode)]["step_ms"], rel=1e-12)
    table = (tmp_path / "step.md").read_text()
    assert "| variant | T=8 eager | T=8 compiled | T=8 FLOPs |" in table and "| kernel |" in table
    soft = rows[("softmax", "eager")]
    assert soft["flops"] > 0 and rows[("kernel", "eager")]["flops_ratio"] == pytest.approx(
        rows[("kernel", "eager")]["flops"] / soft["flops"], rel=1e-12
    )
    assert "flops" not in rows[("kernel", "compiled")]  # counted once per variant and T


def test_eval_cost_smoke_schema(tmp_path):
    """benchmarks/eval_cost.py --quick --detectors: a row per (variant, T) with P samples, P × 1 sample and their
    ratio, the evaluation with the feature detectors (one pass, two passes) and theirs, softmax first, and the
    tables."""
    eval_cost = importlib.import_module("eval_cost")
    out = tmp_path / "eval.json"
    eval_cost.main(["--quick", "--variants", "cgp", "--threads", "1", "--json", str(out),
                    "--markdown", str(tmp_path / "eval.md"), "--detectors"])
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == ["softmax", "cgp"]
    for r in data["rows"]:
        assert r["status"] == "ok", r["reason"]
        assert (r["T"], r["rows"], r["samples"]) == (8, 6, 3) and r["p_samples_s"] > 0 and r["p_single_s"] > 0
        assert r["ratio"] == pytest.approx(r["p_samples_s"] / r["p_single_s"], rel=1e-12)
        for ratio, seconds in (("detectors_ratio", "with_detectors_s"), ("two_passes_ratio", "two_passes_s")):
            assert r[ratio] == pytest.approx(r[seconds] / r["p_samples_s"], rel=1e-12)
    assert data["meta"]["samples"] == 3 and data["meta"]["ts"] == [8] and data["meta"]["detectors"]
    table = (tmp_path / "eval.md").read_text()
    assert "| variant | T | P=3 samples (s) | 3 × 1 sample (s) | ratio |" in table and "| cgp | 8 |" in table
    assert "| variant | T | P=3 samples (s) | with detectors (s) | ratio | two passes (s) | ratio |" in table


def test_readout_cost_smoke_schema(tmp_path):
    """benchmarks/readout_cost.py --quick: a row per N with both posterior forms' fit and evaluation, their ratios and
    the forms' agreement on v; an N the low-rank form does not take is refused."""
    readout_cost = importlib.import_module("readout_cost")
    out = tmp_path / "readout.json"
    readout_cost.main(["--quick", "--json", str(out), "--markdown", str(tmp_path / "readout.md")])
    data = json.loads(out.read_text())
    assert [r["train"] for r in data["rows"]] == [10, 31] and data["meta"]["features"] == 64
    for r in data["rows"]:
        assert r["ridges"] == 5 and r["max_rel_diff"] < 1e-9
        for step in ("fit", "evaluate"):
            assert r[f"{step}_ratio"] == pytest.approx(r[f"dense_{step}_s"] / r[f"low-rank_{step}_s"], rel=1e-12)
    assert "| 31 |" in (tmp_path / "readout.md").read_text()
    with pytest.raises(SystemExit):
        readout_cost.parse_args(["--features", "64", "--train", "32"])


def test_train_step_interleaves_the_timed_steps_and_keeps_a_failing_variant_as_a_row(monkeypatch):
    """The k-th timed step of every variant runs between the others' k-th (a load drift moves them alike); each
    variant's first and warm-up steps come before any timed one; a variant failing mid-run is an error row."""
    train_step = importlib.import_module("train_step")
    calls = []

    def fake_step(name, T, mode, cfg):
        def step():
            calls.append(name)
            if name == "sto" and calls.count("sto") == 4:
                raise FloatingPointError("non-finite loss")
            return 1.0 + len(name)

        return step

    monkeypatch.setattr(train_step, "make_step", fake_step)
    cfg = train_step.parse_args(["--variants", "kernel,sto", "--ts", "8", "--modes", "eager", "--steps", "3",
                                 "--warmup", "1", "--no-flops"])
    rows = {r["variant"]: r for r in train_step.time_block(8, "eager", cfg)}
    setup = ["softmax", "softmax", "kernel", "kernel", "sto", "sto"]  # first step and one warm-up each
    two = lambda *names: [n for n in names for _ in range(2)]  # noqa: E731  (an untimed step, then the timed one)
    assert calls == setup + two("softmax", "kernel", "sto") + two("softmax", "kernel") * 2
    assert rows["softmax"]["step_ms"] == 8.0 and rows["kernel"]["steps_timed"] == 3
    assert rows["sto"]["status"] == "error" and "non-finite" in rows["sto"]["reason"] and "step_ms" not in rows["sto"]


def test_train_step_takes_options_as_compare_spells_them_with_or_without_a_recipe():
    """``name[key=value,...]`` and ``name[key=value,...]@recipe`` (sgpa-rff at another R or frequency draw) build the
    layer with those options under that recipe; the comma inside the brackets does not split the list."""
    train_step = importlib.import_module("train_step")
    spec = "sgpa-rff[num_features=8,frequencies=orthogonal],sgpa-rff[num_features=4]@out-of-scope,kernel"
    cfg = train_step.parse_args(["--variants", spec, "--ts", "8"])
    assert cfg.variants == ["softmax", "sgpa-rff[num_features=8,frequencies=orthogonal]",
                            "sgpa-rff[num_features=4]@out-of-scope", "kernel"]
    assert train_step._attention("kernel") == "kernel"
    query = train_step._attention(cfg.variants[1])(16, 2).strategy.covariance
    assert query.num_features == 8 and type(query.frequency_draw).__name__ == "OrthogonalFrequencies"
    sequence = train_step._attention(cfg.variants[2])(16, 2).strategy.covariance
    assert sequence.num_features == 4 and type(sequence).__name__ == "TrainingSequenceCovariance"


def test_train_step_counts_factorisations_and_solves_at_their_textbook_flops():
    """The counter's additions (train_step.LINALG_FLOPS): gpattn's Cholesky (the CPU custom operator, its body not
    counted again) n³/3, a triangular solve from either side n² per right-hand side, cholesky_solve two of them,
    cholesky_inverse 2n³/3."""
    from torch.utils.flop_counter import FlopCounterMode

    from gpattn.variational._linalg import cholesky, tri_solve

    train_step = importlib.import_module("train_step")
    A = torch.randn(3, 8, 8, dtype=torch.float64)
    A = A @ A.mT + 8 * torch.eye(8, dtype=torch.float64)
    L = torch.linalg.cholesky(A)
    cases = {
        "cholesky": (lambda: cholesky(A), 3 * 8**3 // 3),
        "left solve": (lambda: tri_solve(L, torch.randn(3, 8, 5, dtype=A.dtype)), 3 * 8 * 8 * 5),
        "right solve": (lambda: tri_solve(L, torch.randn(3, 5, 8, dtype=A.dtype), left=False), 3 * 8 * 8 * 5),
        "one L for a batch": (lambda: tri_solve(L[0], torch.randn(3, 8, 5, dtype=A.dtype)), 3 * 8 * 8 * 5),
        "cholesky_solve": (lambda: torch.cholesky_solve(torch.randn(3, 8, 5, dtype=A.dtype), L), 2 * 3 * 8 * 8 * 5),
        "cholesky_inverse": (lambda: torch.cholesky_inverse(L), 2 * 3 * 8**3 // 3),
    }
    for what, (fn, expected) in cases.items():
        with FlopCounterMode(display=False, custom_mapping=train_step.LINALG_FLOPS) as counter:
            fn()
        assert counter.get_total_flops() == expected, what


def test_compile_lengths_smoke_schema(tmp_path):
    """benchmarks/compile_lengths.py: a row per (variant, strategy); with dynamic shapes one graph for batches of
    every length, with buckets one per bucket met (Dynamo's eager backend: no C++ build in the test)."""
    compile_lengths = importlib.import_module("compile_lengths")
    args = ["--variants", "kernel", "--backend", "eager", "--steps", "6", "--lengths", "3,20", "--batch-size", "4"]
    args += ["--width", "16", "--heads", "2"]
    result = compile_lengths.main(args + ["--markdown", str(tmp_path / "lengths.md")])
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "dynamic", "buckets"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["eager"]["graphs"] == 0 and rows["dynamic"]["graphs"] == 1
    longest = [batch[3] for batch in compile_lengths._batches(compile_lengths.parse_args(args))]
    assert rows["buckets"]["graphs"] == len({compile_lengths.bucket_length(n, 20) for n in longest}) > 1
    assert "| kernel | dynamic | 1 |" in (tmp_path / "lengths.md").read_text()


def test_first_call_rss_smoke_schema(tmp_path):
    """benchmarks/first_call_rss.py: a row per variant from a fresh interpreter, with the first call's peak over the
    state before it, what it retained, a later call's peak and the modules the first call imported."""
    first_call_rss = importlib.import_module("first_call_rss")
    out = tmp_path / "rss.json"
    rows = first_call_rss.main(["--ts", "32", "--variants", "kernel", "--dim", "16", "--json", str(out)])
    assert [r["variant"] for r in rows] == ["softmax", "kernel"] and json.loads(out.read_text()) == rows
    for r in rows:
        assert r["status"] == "ok", r.get("reason")
        assert r["before_mb"] > 0 and r["first_call_mb"] >= 0 and r["second_call_mb"] >= 0
        assert isinstance(r["modules_imported"], int) and r["modules_imported"] >= 0
    assert "| kernel | 32 |" in first_call_rss.to_markdown(rows)
    bad = first_call_rss.measure("no-such-variant", 8, 1, 2, 16, 1)
    assert bad["status"] == "error" and bad["reason"]


@pytest.mark.slow
def test_train_rss_smoke_schema(tmp_path):
    """benchmarks/train_rss.py --quick: a fresh ``gpattn train`` process per variant, its peak RSS as a ratio to
    softmax's, and the estimate it printed against the time after it."""
    train_rss = importlib.import_module("train_rss")
    out = tmp_path / "rss.json"
    rows = train_rss.main(["--quick", "--variants", "softmax", "--json", str(out)])["rows"]
    assert [r["variant"] for r in rows] == ["softmax"] and json.loads(out.read_text())["rows"] == rows
    r = rows[0]
    assert r["status"] == "ok", r.get("reason")
    assert r["T"] == 8 and r["peak_rss_mb"] > 0 and r["rss_ratio_to_softmax"] == 1.0
    assert r["estimate_s"] >= 0 and 0 < r["after_estimate_s"] < r["wall_s"]
    assert r["estimate_error"] == pytest.approx(r["estimate_s"] / r["after_estimate_s"] - 1)
    assert train_rss._seconds("~4.2 min") == pytest.approx(252.0) and train_rss._seconds("~2.3 h") == 8280.0


def test_device_session_steps_parse_and_fit_one_device_call(tmp_path):
    """Every step of the prepared GPU session is a command its script accepts (its own parser, the same argv), the
    limits sum within one device command (600 s, with a minute for the machine's start), and what comes back stays
    within the device tool's eight files."""
    session = importlib.import_module("device_session")
    parsers = {
        "gpu_check.py": importlib.import_module("gpu_check").parse_args,
        "attention_scaling.py": scaling.parse_args,
        "train_step.py": importlib.import_module("train_step").parse_args,
    }
    steps = session.steps(tmp_path)
    for name, limit, argv in steps:
        cfg = parsers[argv[0]](argv[1:])  # argparse exits on an unknown flag
        assert limit > 0 and cfg is not None, name
    assert sum(limit for _, limit, _ in steps) <= 540
    # what comes back: each step's JSON in the folder, the scaling plot beside its JSON, and what main() adds
    # (gpu_check's own folder goes into the archive, its two summaries copied out)
    written = {Path(a).name for _, _, argv in steps for a in argv if Path(a).parent == tmp_path and a.endswith(".json")}
    assert written == {"scaling.json", "step_eager.json", "step_graphs.json"}
    returned = written | {"scaling.png", "session.log", "gpu_check.md", "gpu_check.json", "logs.tar.gz"}
    assert len(returned) <= 8


def test_device_session_records_a_timeout_and_goes_on(tmp_path, monkeypatch):
    """A step past its limit is killed with its children and recorded; the next step still runs and its output tail
    is in session.log; the per-step logs come back in one archive."""
    session = importlib.import_module("device_session")
    (tmp_path / "hang.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    (tmp_path / "ok.py").write_text("print('finished')\n")
    out = tmp_path / "out"
    monkeypatch.setattr(
        session, "steps", lambda out: [("hang", 2, [str(tmp_path / "hang.py")]), ("ok", 30, [str(tmp_path / "ok.py")])]
    )
    start = time.monotonic()
    assert session.main(["--out", str(out)]) == 1
    assert time.monotonic() - start < 30
    log = (out / "session.log").read_text()
    assert "== hang: timed out" in log and "| started" in log
    assert "== ok: exit 0" in log and "| finished" in log
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "session.log"]
    with pytest.raises(SystemExit):
        session.main(["--out", str(out), "--only", "nope"])


def test_train_step_builds_a_variant_as_a_recipe_names_it():
    """--variants name@recipe: the model's layers are the recipe's form (sgpa-rff@out-of-scope: g on each sequence),
    a plain name the variant's scratch form."""
    from gpattn.variational.covariances import TrainingQueryCovariance, TrainingSequenceCovariance

    train_step = importlib.import_module("train_step")
    cfg = train_step.parse_args(["--quick"])
    for name, form in (("sgpa-rff@out-of-scope", TrainingSequenceCovariance), ("sgpa-rff", TrainingQueryCovariance)):
        covariances = [m for m in train_step._model(name, 8, cfg).modules() if isinstance(m, TrainingQueryCovariance)]
        assert len(covariances) == 2 and all(type(c) is form for c in covariances), name
