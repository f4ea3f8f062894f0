"""Time and peak memory of one attention layer per registered variant against softmax.

One layer ``gpattn.build_attention(name, D=128, H=4)`` (Dh = 32; ``--heads``, ``--head-dim``) on x of shape
(B=8, T, D) for T in {64, 256, 1024, 4096} (``--quick``: T <= 1024), with the benchmark sizes M = m = l = 16,
r = 10, c = 2 passed to the variants whose options have them (the JSON says which options each variant got), and
every non-default value of ``covariance`` ("full"/"diag") as an extra configuration.

Modes: ``forward`` — inference, ``eval()`` and ``torch.no_grad()`` (stochastic variants still
sample); ``fwd+bwd`` — ``train()``, loss = mean(y²) + the sum of ``layer.loss_terms()`` (so KL and
regulariser costs are included), ``loss.backward()``.

Each (variant, T, mode) runs in its own forked child (``_common.run_isolated``): warm-up calls, then
repetitions until a per-case time budget is spent; median and min milliseconds; peak extra memory =
the child's resident-set high-water mark during the timed calls minus its resident set after the
warm-up (with the C heap trimmed), i.e. the transient memory one call needs beyond the layer and x.
A case is skipped — and the table says why — only when it cannot fit: predicted (from the variant's
measured growth at smaller T) to exceed the per-case time budget or the memory budget, or it actually
timed out / ran out of memory under the cap. Ratios divide by softmax measured in the same run, at
the same T and mode; slopes are log-log slopes of time (and memory) between consecutive T.

    python benchmarks/attention_scaling.py --quick --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import (
    REFERENCE,
    DevicePeak,
    add_device_argument,
    add_omp_wait_policy_argument,
    default_mem_limit_mb,
    machine_info,
    omp_env,
    parse_variants,
    run_isolated,
    synchronize,
    variant_configs,
    write_outputs,
)

import gpattn
from gpattn.experiments.training import resolve_device

MODES = ("forward", "fwd+bwd")
#: the name of the pseudo-variant "PyTorch's SDPA alone" (``--sdpa``: fp32 and bf16 rows)
SDPA = "sdpa"

PROFILES = {
    #          T values,                 warm-up, min reps, max reps, budget s / case, timeout s / case
    "full": dict(ts=(64, 256, 1024, 4096), warmup=2, min_reps=5, max_reps=50, budget=4.0, timeout=300.0),
    "quick": dict(ts=(64, 256, 1024), warmup=1, min_reps=3, max_reps=15, budget=1.0, timeout=25.0),
    "smoke": dict(ts=(16, 32), warmup=1, min_reps=1, max_reps=1, budget=0.0, timeout=120.0),
}


# ----------------------------------------------------------------------------- the measured child
def measure_case(
    name: str,
    options: dict,
    T: int,
    mode: str,
    batch: int,
    heads: int,
    head_dim: int,
    warmup: int,
    min_reps: int,
    max_reps: int,
    budget: float,
    seed: int = 0,
    device: str = "cpu",
) -> dict:
    """Time ``reps`` calls of one layer on ``device`` and record the peak extra memory (run in a child):
    resident memory on the CPU, the CUDA allocator's peak on a GPU (timings wait for the device)."""
    torch.manual_seed(seed)
    if name == SDPA:
        call, params = _sdpa_case(options, T, mode, batch, heads, head_dim, device)
    else:
        call, params = _layer_case(name, options, T, mode, batch, heads, head_dim, device)
    peak = DevicePeak(device)
    times = []

    def timed():
        for p in params:
            p.grad = None
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)

    for _ in range(max(1, warmup)):
        timed()
    first = min(times)
    times.clear()
    peak.reset()  # baseline after warm-up: code pages and one-off caches are not the layer's memory
    # repetitions: as many as fit the budget, at least min_reps unless a single call is already long
    n = int(budget / first) if first > 0 else max_reps
    reps = max(1, min(max_reps, max(n, min_reps if first * min_reps <= 3 * budget else 1)))
    for _ in range(reps):
        timed()
    ms = [1e3 * t for t in times]
    return {
        "ms_median": statistics.median(ms),
        "ms_min": min(ms),
        "reps": len(ms),
        "peak_mb": peak.peak_extra_mb(),
        "exact_peak": peak.exact,
    }


def _sdpa_case(options, T, mode, batch, heads, head_dim, device):
    """PyTorch's ``scaled_dot_product_attention`` alone on (B, H, T, Dh) inputs in ``options["dtype"]``: the fused
    attention core, without the layer's projections (what the issue's "SDPA, core only" rows are)."""
    dtype = getattr(torch, options["dtype"])
    grad = mode == "fwd+bwd"
    q, k, v = (torch.randn(batch, heads, T, head_dim, device=device, dtype=dtype, requires_grad=grad) for _ in "qkv")

    def call():
        with torch.set_grad_enabled(grad):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            if grad:
                out.float().square().mean().backward()

    return call, [q, k, v]


def _layer_case(name, options, T, mode, batch, heads, head_dim, device):
    """One gpattn layer on x (B, T, D): the call of ``mode`` and the parameters whose gradients it resets."""
    D = heads * head_dim
    layer = gpattn.build_attention(name, D, heads, **options).to(device)
    x = torch.randn(batch, T, D, device=device)  # shape: (B, T, D)
    params = [p for p in layer.parameters() if p.requires_grad]

    if mode == "forward":
        layer.eval()

        def call():
            with torch.no_grad():
                layer(x)

    elif mode == "fwd+bwd":
        layer.train()

        def call():
            y = layer(x)  # shape: (B, T, D)
            loss = y.square().mean()
            for term in layer.loss_terms().values():
                loss = loss + term
            loss.backward()

    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return call, params


# ----------------------------------------------------------------------------- planning
def _predict(rows, variant, mode, T, key):
    """Extrapolate ``key`` (ms_min or peak_mb) of (variant, mode) to T from the largest measured T with
    the log-log slope of the last two measured points (at least 1). ``None`` with fewer than two points."""
    done = sorted(
        (r["T"], r[key]) for r in rows if r["variant"] == variant and r["mode"] == mode and r["status"] == "ok"
    )
    done = [(t, v) for t, v in done if v is not None and v > 0]
    if len(done) < 2:
        return None
    (t0, v0), (t1, v1) = done[-2:]
    slope = max(1.0, math.log(v1 / v0) / math.log(t1 / t0))
    return v1 * (T / t1) ** slope


def _skip_reason(rows, variant, mode, T, profile, mem_limit_mb):
    earlier = [r for r in rows if r["variant"] == variant and r["mode"] == mode and r["T"] < T]
    failed = [r for r in earlier if r["status"] == "skipped"]
    if failed:
        return f"did not fit at T={failed[-1]['T']} already"
    ms = _predict(rows, variant, mode, T, "ms_min")
    calls = profile["warmup"] + 1
    if ms is not None and ms * calls / 1e3 > profile["timeout"]:
        return (
            f"predicted {ms / 1e3:.1f} s per call x {calls} calls > the {profile['timeout']:.0f} s per-case budget "
            f"(extrapolated from smaller T)"
        )
    mb = _predict(rows, variant, mode, T, "peak_mb")
    if mb is not None and mem_limit_mb and mb > mem_limit_mb:
        return f"predicted peak {mb:.0f} MiB > the {mem_limit_mb:.0f} MiB memory budget (extrapolated from smaller T)"
    return None


# ----------------------------------------------------------------------------- summaries
def add_ratios(rows):
    """``ratio_to_softmax`` (medians) and ``ratio_min_to_softmax`` (minima: less sensitive to other
    processes on a shared machine) against softmax at the same (T, mode)."""
    ok = [r for r in rows if r["variant"] == REFERENCE and r["status"] == "ok"]
    ref = {(r["T"], r["mode"]): r["ms_median"] for r in ok}
    ref_min = {(r["T"], r["mode"]): r["ms_min"] for r in ok}
    for r in rows:
        base, base_min = ref.get((r["T"], r["mode"])), ref_min.get((r["T"], r["mode"]))
        r["ratio_to_softmax"] = r["ms_median"] / base if r["status"] == "ok" and base else None
        r["ratio_min_to_softmax"] = r["ms_min"] / base_min if r["status"] == "ok" and base_min else None


def slopes(rows, ts):
    """Log-log slopes of time and memory between consecutive T, per (variant, mode)."""
    out = []
    key = {(r["variant"], r["mode"], r["T"]): r for r in rows if r["status"] == "ok"}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        for mode in MODES:
            for t0, t1 in zip(ts[:-1], ts[1:]):
                a, b = key.get((variant, mode, t0)), key.get((variant, mode, t1))
                if a is None or b is None:
                    continue
                ms = math.log(b["ms_median"] / a["ms_median"]) / math.log(t1 / t0)
                mem = None
                if a["peak_mb"] > 1.0 and b["peak_mb"] > 1.0:  # below 1 MiB the RSS granularity dominates
                    mem = math.log(b["peak_mb"] / a["peak_mb"]) / math.log(t1 / t0)
                out.append({"variant": variant, "mode": mode, "T0": t0, "T1": t1, "time_slope": ms, "mem_slope": mem})
    return out


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(rows, slope_rows, configs) -> str:
    lines = ["options per variant (benchmark sizes, only where the variant has the option):"]
    for c in configs:
        opts = ", ".join(f"{k}={v}" for k, v in c["options"].items()) or "(defaults)"
        lines.append(f"  {c['variant']:<34} {opts}")
    lines.append("")
    head = (
        f"{'variant':<34} {'T':>5} {'mode':<8} {'median ms':>10} {'min ms':>10} {'reps':>4} "
        f"{'peak MiB':>9} {'x softmax':>9}"
    )
    lines += [head, "-" * len(head)]
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"{r['variant']:<34} {r['T']:>5} {r['mode']:<8} {r['ms_median']:>10.2f} {r['ms_min']:>10.2f} "
                f"{r['reps']:>4} {r['peak_mb']:>9.1f} {_fmt(r['ratio_to_softmax'], '9.2f'):>9}"
            )
        else:
            lines.append(f"{r['variant']:<34} {r['T']:>5} {r['mode']:<8} {r['status'].upper()}: {r['reason']}")
    if slope_rows:
        lines += ["", f"{'variant':<34} {'mode':<8} {'T0->T1':>10} {'time slope':>10} {'mem slope':>9}"]
        for s in slope_rows:
            lines.append(
                f"{s['variant']:<34} {s['mode']:<8} {str(s['T0']) + '->' + str(s['T1']):>10} "
                f"{s['time_slope']:>10.2f} {_fmt(s['mem_slope'], '9.2f'):>9}"
            )
    return "\n".join(lines)


def plot(rows, path) -> list[str]:
    """Time vs T on log-log axes, one PNG per mode (``path`` for fwd+bwd, ``<stem>_forward.png`` for
    forward), with ``gpattn.experiments.plots.scaling_curves`` when it exists, else a matplotlib figure here."""
    path = Path(path)
    written = []
    for mode in reversed(MODES):
        target = path if mode == "fwd+bwd" else path.with_name(f"{path.stem}_{mode}{path.suffix}")
        sub = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        if not sub:
            continue
        title = f"attention {mode}, ms per call vs T (log-log)"
        try:
            from gpattn.experiments.plots import scaling_curves
        except ImportError:
            scaling_curves = None
        if scaling_curves is not None:
            scaling_curves(sub, target, x="T", y="ms_median", group="variant", title=title)
        else:
            _local_plot(sub, target, title)
        written.append(str(target))
    return written


def _local_plot(rows, path, title):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.subplots()
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["T"], r["ms_median"]) for r in rows if r["variant"] == variant)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("T")
    ax.set_ylabel("ms_median")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratio_tables(rows, ts, modes) -> list[str]:
    """Markdown lines: per mode, a table of median ms (× softmax in the same run) and peak extra MiB per T
    for every variant of ``rows`` (a case that did not run shows its status and †)."""
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    key = {(r["variant"], r["T"], r["mode"]): r for r in rows}
    out = []
    for mode in modes:
        if not any(r["mode"] == mode for r in rows):
            continue
        out.append(f"**{mode}** — median ms (× softmax in the same run); peak extra MiB")
        out.append("")
        out.append(
            "| variant | " + " | ".join(f"T={t}" for t in ts) + " | " + " | ".join(f"MiB T={t}" for t in ts) + " |"
        )
        out.append("|---|" + "---:|" * (2 * len(ts)))
        for v in labels:
            cells, mems = [], []
            for t in ts:
                r = key.get((v, t, mode))
                if r is None:
                    cells.append("")
                    mems.append("")
                elif r["status"] != "ok":
                    cells.append(f"{r['status']}†")
                    mems.append("")
                else:
                    ratio = r.get("ratio_to_softmax")
                    cells.append(
                        f"{r['ms_median']:.1f} ({ratio:.2f}×)" if ratio is not None else f"{r['ms_median']:.1f}"
                    )
                    mems.append(f"{r['peak_mb']:.0f}")
            out.append(f"| {v} | " + " | ".join(cells) + " | " + " | ".join(mems) + " |")
        out.append("")
    return out


def to_markdown(result) -> str:
    """Markdown tables (fwd+bwd and forward, ms and ratio to softmax per T; slopes) of a result dict."""
    rows, meta = result["rows"], result["meta"]
    ts = meta["ts"]
    labels = list(dict.fromkeys(r["variant"] for r in rows))
    out = ratio_tables(rows, ts, list(reversed(MODES)))
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        out.append("† " + "; ".join(f"{r['variant']} T={r['T']} {r['mode']}: {r['reason']}" for r in skipped))
        out.append("")
    pairs = list(zip(ts[:-1], ts[1:]))
    out.append("log–log slopes of time (memory in brackets), fwd+bwd | forward")
    out.append("")
    out.append(
        "| variant | "
        + " | ".join(f"{a}→{b} fwd+bwd" for a, b in pairs)
        + " | "
        + " | ".join(f"{a}→{b} fwd" for a, b in pairs)
        + " |"
    )
    out.append("|---|" + "---:|" * (2 * len(pairs)))
    sl = {(s["variant"], s["mode"], s["T0"]): s for s in result["slopes"]}
    for v in labels:
        cells = []
        for mode in reversed(MODES):
            for a, _ in pairs:
                s = sl.get((v, mode, a))
                if s is None:
                    cells.append("")
                else:
                    mem = "" if s["mem_slope"] is None else f" ({s['mem_slope']:.2f})"
                    cells.append(f"{s['time_slope']:.2f}{mem}")
        out.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="T <= 1024, fewer repetitions (< 5 minutes on 2 cores)")
    size.add_argument("--smoke", action="store_true", help="T in {16, 32}, B=2, 1 repetition (tests)")
    p.add_argument("--variants", default=None, help="comma-separated registry names (softmax is always added)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per case (default 2)")
    p.add_argument("--ts", default=None, help="comma-separated T values (overrides the profile)")
    p.add_argument("--batch", type=int, default=None, help="B (default 8; 2 with --smoke)")
    p.add_argument("--heads", type=int, default=4, help="H (default 4)")
    p.add_argument("--head-dim", type=int, default=32, help="Dh (default 32); D = H·Dh")
    p.add_argument("--timeout", type=float, default=None, help="per-case wall-clock budget in seconds")
    p.add_argument(
        "--mem-limit-mb",
        type=float,
        default=None,
        help="memory budget per case (default: min(8 GiB, half of MemAvailable))",
    )
    p.add_argument("--json", default=None, help="write rows, slopes and metadata here")
    p.add_argument("--markdown", default=None, help="write the results as markdown tables here")
    p.add_argument("--png", default=None, help="time-vs-T plot (default: next to --json, else none)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default both)")
    p.add_argument("--labels", default=None, help="keep only these configurations (comma list of table labels)")
    p.add_argument("--sdpa", action="store_true", help="add scaled_dot_product_attention alone, fp32 and bf16 rows")
    add_omp_wait_policy_argument(p)
    add_device_argument(p)
    p.add_argument("--no-isolate", action="store_true", help="run cases in this process (no timeout / memory cap)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    profile = dict(PROFILES["smoke" if args.smoke else "quick" if args.quick else "full"])
    if args.ts:
        profile["ts"] = tuple(sorted(int(t) for t in args.ts.split(",")))
    if args.timeout:
        profile["timeout"] = args.timeout
    batch = args.batch or (2 if args.smoke else 8)
    heads, head_dim = args.heads, args.head_dim
    mem_limit = default_mem_limit_mb(args.mem_limit_mb)
    configs = variant_configs(parse_variants(args.variants))
    if args.labels:
        keep = {REFERENCE, *args.labels.split(",")}
        configs = [c for c in configs if c["variant"] in keep]
    if args.sdpa:
        configs += [
            {"variant": f"sdpa {d} (core)", "name": SDPA, "options": {"dtype": d}} for d in ("float32", "bfloat16")
        ]
    modes = [m for m in MODES if m in args.modes.split(",")]
    device = str(resolve_device(args.device))
    meta = {
        **machine_info(args.threads),
        "device": device,
        "omp_wait_policy": omp_env(args.omp_wait_policy).get("OMP_WAIT_POLICY"),
        "profile": "smoke" if args.smoke else "quick" if args.quick else "full",
        "B": batch,
        "H": heads,
        "Dh": head_dim,
        "D": heads * head_dim,
        "ts": list(profile["ts"]),
        "warmup": profile["warmup"],
        "min_reps": profile["min_reps"],
        "max_reps": profile["max_reps"],
        "budget_s_per_case": profile["budget"],
        "timeout_s_per_case": profile["timeout"],
        "mem_limit_mb": mem_limit,
        "configs": configs,
        "modes": {"forward": "eval() + no_grad", "fwd+bwd": "train(), loss = mean(y^2) + sum(loss_terms())"},
    }
    print(
        f"attention_scaling: {meta['profile']} profile, B={batch}, H={heads}, Dh={head_dim}, T={list(profile['ts'])}, "
        f"{args.threads} threads, device {device}, variants: {', '.join(c['variant'] for c in configs)}",
        flush=True,
    )
    module = Path(__file__).stem
    rows = []
    start = time.monotonic()
    for T in profile["ts"]:
        for cfg in configs:
            for mode in modes:
                row = {"variant": cfg["variant"], "name": cfg["name"], "options": cfg["options"], "T": T, "mode": mode}
                reason = _skip_reason(rows, cfg["variant"], mode, T, profile, mem_limit)
                if reason is not None:
                    result = {"status": "skipped", "reason": reason}
                else:
                    result = run_isolated(
                        measure_case,
                        dict(
                            name=cfg["name"],
                            options=cfg["options"],
                            T=T,
                            mode=mode,
                            batch=batch,
                            heads=heads,
                            head_dim=head_dim,
                            warmup=profile["warmup"],
                            min_reps=profile["min_reps"],
                            max_reps=profile["max_reps"],
                            budget=profile["budget"],
                            device=device,
                        ),
                        timeout=profile["timeout"],
                        threads=args.threads,
                        mem_limit_mb=mem_limit,
                        preload=(module,),
                        server_env=omp_env(args.omp_wait_policy),
                        isolate=not args.no_isolate,
                    )
                row.update({"ms_median": None, "ms_min": None, "reps": 0, "peak_mb": None, "reason": None})
                row.update(result)
                rows.append(row)
                if row["status"] == "ok":
                    msg = (
                        f"{row['ms_median']:.2f} ms (min {row['ms_min']:.2f}, {row['reps']} reps), "
                        f"{row['peak_mb']:.1f} MiB"
                    )
                else:
                    msg = f"{row['status']}: {row['reason']}"
                print(
                    f"  [{time.monotonic() - start:6.1f} s] {cfg['variant']:<34} T={T:<5} {mode:<8} {msg}", flush=True
                )
    add_ratios(rows)
    slope_rows = slopes(rows, list(profile["ts"]))
    meta["wall_s"] = time.monotonic() - start
    meta["loadavg_1_5_15_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print()
    print(format_table(rows, slope_rows, configs))
    print(
        f"\ntotal wall time {meta['wall_s']:.0f} s; load average (1 min) {meta['loadavg_1_5_15'][0]:.1f} at start, "
        f"{meta['loadavg_1_5_15_end'][0]:.1f} at end on {meta['nproc']} cores"
    )
    result = {"meta": meta, "rows": rows, "slopes": slope_rows}
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        meta["png"] = plot(rows, png)
        print(f"plots: {', '.join(meta['png'])}")
    write_outputs(result, args.json, args.markdown, to_markdown)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
