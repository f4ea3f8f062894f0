"""The attention suite (gpattn.experiments.attention_suite): tasks × variants × seeds, with the
zero-attention control, in parallel processes; prints and saves the table (docs/results.md).

    python benchmarks/attention_suite.py --jobs 2 --json runs/suite/suite.json
    python benchmarks/attention_suite.py --tasks attn-match --variants softmax,zero,sgpa --seeds 0 --steps 300

A variant is a registered attention name, ``zero`` (the control), or ``name:key=value;key=value`` with
attention options (values read as JSON where they parse, else as strings), e.g.
``sgpa:prior_mean="zero"``; ``objective.beta=...`` keys go to the objective instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

DEFAULT_VARIANTS = "softmax,zero,kernel,sto,h-sto,sgpa,sgpa-decoupled,kep-svgp,cgp,scgp"


def parse_variant(spec: str) -> tuple[str, dict, dict]:
    """``name:key=value;...`` -> (name, attention options, objective settings)."""
    name, _, rest = spec.partition(":")
    options, objective = {}, {}
    for item in filter(None, rest.split(";")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise SystemExit(f"variant {spec!r}: option {item!r} is not key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key.startswith("objective."):
            objective[key.removeprefix("objective.")] = value
        else:
            options[key] = value
    return name, options, objective


def split_specs(text: str) -> list[str]:
    """Comma-separated variant specs; commas inside braces or brackets (JSON values) do not split."""
    specs, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch in "{["
        depth -= ch in "}]"
        if ch == "," and depth == 0:
            specs.append(text[start:i].strip())
            start = i + 1
    return [s for s in specs if s]


def _run(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from gpattn.experiments.attention_suite import SuiteConfig, run_task

    spec = job.pop("variant")
    name, options, objective = parse_variant(spec)
    cfg = SuiteConfig(attention=name, attention_options=options or None, objective=objective or None, **job)
    try:
        out = run_task(cfg)
    except Exception as err:  # a failed run is a row of the table, not the end of the grid
        out = {"config": {**job, "attention": name}, "error": f"{type(err).__name__}: {err}"}
    ctx = [round(layer["context_effect"], 3) for layer in out.get("layers", [])]
    keys = ("accuracy", "val_accuracy", "nll", "seconds", "error")
    job_name = f"{cfg.task} {spec} seed {cfg.seed} D {cfg.embed_dim} T {cfg.length}"
    print(json.dumps({k: out.get(k) for k in keys} | {"job": job_name, "context": ctx}), flush=True)
    return out


def table(results: list[dict], variants: list[str], tasks: list[str]) -> str:
    lines = ["| variant | " + " | ".join(tasks) + " | context effect (layers) |", "|---" * (len(tasks) + 2) + "|"]
    for v in variants:
        cells, ctx = [], []
        for t in tasks:
            rows = [r for r in results if r["variant"] == v and r["config"]["task"] == t]
            accs = [r["accuracy"] for r in rows if "accuracy" in r]
            if not accs:
                cells.append("error" if rows else "–")
                continue
            sd = statistics.pstdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{statistics.mean(accs):.3f} ± {sd:.3f} ({', '.join(f'{a:.3f}' for a in accs)})")
            for r in rows:
                ctx += [f"{layer['context_effect']:.2f}" for layer in r.get("layers", [])]
        cells.append(" ".join(ctx[:6]))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="attn-match,attn-xor,attn-repeat")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated variant specs (see module doc)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--widths", default="64", help="comma-separated model widths (embed_dim)")
    parser.add_argument("--lengths", default="12", help="comma-separated sequence lengths T of the tasks")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    tasks = args.tasks.split(",")
    variants = split_specs(args.variants)
    seeds = [int(s) for s in args.seeds.split(",")]
    shapes = [(int(w), int(n)) for w in args.widths.split(",") for n in args.lengths.split(",")]
    jobs = [
        {"variant": v, "task": t, "seed": s, "steps": args.steps, "train_size": args.train_size,
         "test_size": args.test_size, "device": args.device, "embed_dim": w, "length": n}
        for w, n in shapes for s in seeds for t in tasks for v in variants
    ]
    # one table row per variant and, with more than one (width, length), per shape
    def label(j):
        return j["variant"] if len(shapes) == 1 else f"{j['variant']} (D {j['embed_dim']}, T {j['length']})"

    labels = [label(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(_run, [dict(j) for j in jobs]))
    for r, v in zip(results, labels):
        r["variant"] = v
    text = table(results, list(dict.fromkeys(labels)), tasks)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results,
                                         "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
