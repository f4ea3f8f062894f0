"""torch.compile on one attention layer per registered variant: graph breaks and speed.

For every variant, one layer ``gpattn.build_attention(name, D=32, H=4)`` on x of shape (B=2, T=16, D)
with some padding, in eval mode, under ``gpattn.deterministic()`` (the posterior mean / noise-free
attention) and sampling: the graphs and graph breaks ``torch._dynamo.explain`` finds, with their
reasons. With ``--speed``, also the first compiled call (compilation included) and the median of
eager and compiled calls after it (``torch.compile``'s default inductor backend; needs a C++
compiler on the CPU). The default configuration runs no value check (``gpattn.validation()`` off).

    python benchmarks/compile_breaks.py --device auto --speed --markdown out.md
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
from _common import add_device_argument, machine_info, median_ms, synchronize

import gpattn
from gpattn.experiments.training import resolve_device


def _inputs(device, B=2, T=16, D=32):
    torch.manual_seed(0)
    x = torch.randn(B, T, D, device=device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    mask[0, T - 4 :] = True
    return x, mask


def measure(name: str, deterministic: bool, device, speed: bool, reps: int) -> dict:
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 32, 4).to(device).eval()
    x, mask = _inputs(device)
    row = {"variant": name, "mode": "deterministic" if deterministic else "sampling"}
    with torch.no_grad(), gpattn.deterministic(deterministic), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamo.reset()
        explained = dynamo.explain(layer)(x, mask)
        row["graphs"] = explained.graph_count
        row["breaks"] = explained.graph_break_count
        row["reasons"] = sorted({str(b.reason).splitlines()[0][:100] for b in explained.break_reasons})
        if speed:
            dynamo.reset()
            compiled = torch.compile(layer)
            synchronize(device)
            start = time.perf_counter()
            compiled(x, mask)
            synchronize(device)
            row["first_call_s"] = time.perf_counter() - start
            row["eager_ms"] = median_ms(lambda: layer(x, mask), reps, device)
            row["compiled_ms"] = median_ms(lambda: compiled(x, mask), reps, device)
    return row


def to_markdown(rows, meta) -> str:
    speed = "compiled_ms" in rows[0]
    head = "| variant | mode | graphs | breaks | reasons |"
    head += " first call s | eager ms | compiled ms |" if speed else ""
    out = [head, "|---|---|---:|---:|---|" + ("---:|---:|---:|" if speed else "")]
    for r in rows:
        line = f"| {r['variant']} | {r['mode']} | {r['graphs']} | {r['breaks']} | {'; '.join(r['reasons'])} |"
        if speed:
            line += f" {r['first_call_s']:.1f} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} |"
        out.append(line)
    return f"device {meta['device']}, torch {torch.__version__}\n\n" + "\n".join(out) + "\n"


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=None, help="comma-separated registry names (default: all)")
    p.add_argument("--speed", action="store_true", help="also time eager vs compiled calls")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--markdown", default=None, help="write the table here")
    add_device_argument(p)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    names = args.variants.split(",") if args.variants else gpattn.list_attention()
    meta = {**machine_info(args.threads), "device": str(device)}
    rows = [measure(n, det, device, args.speed, args.reps) for n in names for det in (True, False)]
    text = to_markdown(rows, meta)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
