"""Check ``timing``: forward+backward (then forward) of each variant on the device with
``benchmarks/attention_scaling.py``'s ``measure_case``, as ratios to softmax in the same run."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from . import BENCH
from .record import Recorder, first_line, fmt, now

if str(BENCH) not in sys.path:  # attention_scaling and _common sit beside the entry script
    sys.path.insert(0, str(BENCH))

import attention_scaling as AS  # noqa: E402
from _common import variant_configs  # noqa: E402

#: heads and head width (D = 128) of the timed layers
HEADS, HEAD_DIM = 4, 32


def timing_table(rows, ts) -> str:
    """attention_scaling.py's tables (one per mode) of this run's timing rows."""
    return "\n".join(AS.ratio_tables(rows, ts, ("fwd+bwd", "forward")))


@dataclass
class Timing:
    """The cases measured so far (``rows``) and what every case shares."""

    rec: Recorder
    device: str
    ts: list
    batch: int
    configs: list
    rows: list = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def _skip_reason(self, cfg: dict, T: int, mode: str) -> str | None:
        earlier = [r for r in self.rows if r["variant"] == cfg["variant"] and r["mode"] == mode and r["T"] < T]
        if any(r["status"] != "ok" for r in earlier):
            return "did not run at a smaller T"
        profile = {"timeout": 8.0 if self.on_cuda else 20.0, "warmup": 2}  # the per-case limit
        reason = AS._skip_reason(self.rows, cfg["variant"], mode, T, profile, None)
        if reason is None and self.rec.left() < 2.0:
            return "the timing budget is spent"
        return reason

    def _measure(self, cfg: dict, T: int, mode: str, row: dict) -> None:
        """``measure_case`` of one case into ``row`` (an out-of-memory is a skip, anything else an error)."""
        try:
            got = AS.measure_case(name=cfg["name"], options=cfg["options"], T=T, mode=mode, batch=self.batch,
                                  heads=HEADS, head_dim=HEAD_DIM, warmup=2, min_reps=3, max_reps=20,
                                  budget=min(0.4, max(0.05, self.rec.left() / 200)), device=self.device)  # fmt: skip
            row.update(status="ok", **got)
            if self.on_cuda:
                row["peak_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
        except torch.cuda.OutOfMemoryError as exc:
            row.update(status="skipped", reason=f"out of memory: {str(exc).splitlines()[0][:150]}")
        except Exception as exc:  # noqa: BLE001
            row.update(status="error", reason=first_line(exc, 200))

    def case(self, cfg: dict, T: int, mode: str) -> None:
        row = {"variant": cfg["variant"], "name": cfg["name"], "T": T, "mode": mode}
        reason = self._skip_reason(cfg, T, mode)
        if reason is not None:
            row.update(status="skipped", reason=reason)
            self.rows.append(row)
            return
        if self.on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = now()
        self._measure(cfg, T, mode, row)
        row["case_wall_s"] = round(now() - t0, 2)
        self.rows.append(row)
        if self.on_cuda:
            torch.cuda.empty_cache()
        self.rec.data["rows"] = self.rows  # kept if the check is stopped
        self.rec.flush()
        ms = f"{row['ms_median']:.2f} ms" if row["status"] == "ok" else f"{row['status']}: {row.get('reason')}"
        print(f"    {cfg['variant']:<32} T={T:<5} {mode:<8} {ms} ({row['case_wall_s']} s)", flush=True)

    def run_mode(self, mode: str) -> dict:
        """Every variant at every T in ``mode``; passes unless a case raised an error."""
        for T in self.ts:
            for cfg in self.configs:
                self.case(cfg, T, mode)
        AS.add_ratios(self.rows)
        sub = [r for r in self.rows if r["mode"] == mode]
        errors = [r for r in sub if r["status"] == "error"]
        skipped = [r for r in sub if r["status"] == "skipped"]
        big = {r["variant"]: r for r in sub if r["status"] == "ok"}  # the largest T each variant reached
        parts = [f"{v} T={r['T']} {fmt(r.get('ratio_to_softmax'), '.1f')}x" for v, r in big.items() if v != "softmax"]
        summary = f"{len(sub) - len(errors) - len(skipped)} ok, {len(skipped)} skipped, {len(errors)} errors; " + (
            ", ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")
        )
        return {
            "rows": sub,
            "status": "fail" if errors else "pass",
            "summary": summary,
            "errors": [f"{r['variant']} T={r['T']}: {r['reason']}" for r in errors],
        }


def check_timing(rec: Recorder, device: str, args) -> None:
    on_cuda = torch.device(device).type == "cuda"
    ts = [int(t) for t in (args.timing_ts or ("128,512,2048" if on_cuda else "32,64")).split(",")]
    batch = args.timing_batch or (8 if on_cuda else 2)
    configs = variant_configs()
    if args.variants:
        wanted = set(args.variants.split(",")) | {"softmax"}
        configs = [c for c in configs if c["name"] in wanted or c["variant"] in wanted]
    source = "benchmarks/attention_scaling.py measure_case"
    rec.data["setup"] = {"T": ts, "B": batch, "H": HEADS, "Dh": HEAD_DIM, "D": HEADS * HEAD_DIM, "source": source,
                         "configs": configs}  # fmt: skip
    timing = Timing(rec, device, ts, batch, configs)
    rec.item("fwd+bwd vs softmax", lambda: timing.run_mode("fwd+bwd"), need_s=5)
    rec.item("forward vs softmax", lambda: timing.run_mode("forward"), need_s=5)
    rec.data["table"] = timing_table(timing.rows, ts)
