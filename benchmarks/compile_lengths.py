"""Compiled training on text of varying length: ``torch.compile(model, dynamic=True)`` against static graphs of
batches padded to length buckets (the alternative ``gpattn train --compile``'s ``dynamic=True`` was chosen over),
with eager as the reference.

Each step draws a batch whose longest row has a length uniform in ``--lengths`` (the other rows shorter, the
rest padding), as a text run's batches cut to their longest sequence are. "eager" and "dynamic" cut each batch to
its longest row; "buckets" cuts it to :func:`bucket_length` of that length and compiles with ``dynamic=False``. Per
(variant, strategy): the graphs Dynamo compiled (each a recompile after the first), the whole run's wall time
(compilation included) and the median time of the steps that compiled nothing.

    python benchmarks/compile_lengths.py --variants softmax,sgpa,kep-svgp --steps 30 --markdown lengths.md
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _common import finish, parse_variants
from torch._dynamo.utils import counters

from gpattn.models import TransformerClassifier
from gpattn.objectives import DeepGPELBO

STRATEGIES = ("eager", "dynamic", "buckets")


def bucket_length(longest: int, width: int) -> int:
    """The length "buckets" cuts a batch to: the power of two at or above its ``longest`` row (at least 8, at most
    the data's ``width``), so a run sees a handful of shapes, each compiled once."""
    return min(width, max(8, 1 << (max(longest, 1) - 1).bit_length()))


def _batches(cfg: argparse.Namespace):
    """``cfg.steps`` batches ``(ids, mask, y)`` of width ``cfg.width_max``, the longest row of each drawn."""
    g = torch.Generator().manual_seed(0)
    lo, hi = cfg.lengths
    for _ in range(cfg.steps):
        longest = int(torch.randint(lo, hi + 1, (), generator=g))
        lengths = torch.randint(1, longest + 1, (cfg.batch_size,), generator=g)
        lengths[0] = longest
        mask = torch.arange(hi)[None, :] >= lengths[:, None]
        ids = torch.randint(3, cfg.vocab, (cfg.batch_size, hi), generator=g).masked_fill(mask, 0)
        yield ids, mask, torch.randint(0, 2, (cfg.batch_size,), generator=g), longest


def run_one(name: str, strategy: str, cfg: argparse.Namespace) -> dict:
    """One variant trained ``cfg.steps`` steps with one strategy: graphs, wall time, steady step time."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    hi = cfg.lengths[1]
    model = TransformerClassifier(2, vocab_size=cfg.vocab, max_len=hi, embed_dim=cfg.width, num_heads=cfg.heads,
                                  num_layers=2, attention=name).train()
    forward = model if strategy == "eager" else torch.compile(model, backend=cfg.backend, dynamic=strategy == "dynamic")
    objective, optimizer = DeepGPELBO(model, num_data=10_000), torch.optim.Adam(model.parameters(), lr=1e-3)
    steady, start = [], time.perf_counter()
    for ids, mask, y, longest in _batches(cfg):
        cut = bucket_length(longest, hi) if strategy == "buckets" else longest
        graphs, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        objective(forward(ids[:, :cut].contiguous(), mask[:, :cut].contiguous()), y).backward()  # as training's
        optimizer.step()
        if counters["stats"]["unique_graphs"] == graphs:
            steady.append((time.perf_counter() - t0) * 1e3)
    return {
        "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
        "wall_s": time.perf_counter() - start, "steady_step_ms": statistics.median(steady) if steady else None,
        "steady_steps": len(steady),
    }


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    out = [
        f"B={meta['batch_size']}, width {meta['width']}, {meta['heads']} heads, 2 blocks, {meta['steps']} steps, "
        f"longest row uniform in {meta['lengths']}, {meta['threads']} threads\n",
        "| variant | strategy | graphs | wall (s) | steady step (ms) |", "|---|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        step = "–" if r.get("steady_step_ms") is None else f"{r['steady_step_ms']:.1f}"
        wall = f"{r['wall_s']:.1f}" if "wall_s" in r else r["reason"]
        out.append(f"| {r['variant']} | {r['strategy']} | {r.get('graphs', 0)} | {wall} | {step} |")
    return "\n".join(out) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="softmax,sgpa,kep-svgp", help="comma-separated registry names")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--lengths", default="6,48", help="LO,HI: the range of a batch's longest row")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    cfg = p.parse_args(argv)
    cfg.lengths = tuple(int(v) for v in cfg.lengths.split(","))
    cfg.strategies = [s for s in cfg.strategies.split(",") if s]
    if len(cfg.lengths) != 2 or not 1 <= cfg.lengths[0] <= cfg.lengths[1]:
        p.error(f"--lengths must be LO,HI with 1 <= LO <= HI, got {cfg.lengths}")
    if not set(cfg.strategies) <= set(STRATEGIES):
        p.error(f"--strategies must name {', '.join(STRATEGIES)}, got {cfg.strategies}")
    cfg.variants = parse_variants(cfg.variants)
    return cfg


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    rows = []
    for name in cfg.variants:
        for strategy in cfg.strategies:
            row = {"variant": name, "strategy": strategy, "status": "ok", "reason": ""}
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    row.update(run_one(name, strategy, cfg))
            except Exception as err:  # a failing case is a row, not the end of the run
                row.update(status="error", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            rows.append(row)
            print(row, flush=True)
    keys = ("variants", "strategies", "backend", "lengths", "steps", "batch_size", "width", "heads", "threads")
    return finish(rows, cfg, keys, to_markdown)


if __name__ == "__main__":
    main()
