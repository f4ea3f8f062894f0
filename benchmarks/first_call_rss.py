"""What a user's process holds: peak resident memory of one layer's forward + backward, measured from the process's
state before its first call and from its state after a warm-up call, with what the first call imported.

attention_scaling.py reports the second figure (the transient memory of a call). The first adds what a process pays
once: the first call of a blockwise (checkpointed) path imports torch.utils.checkpoint's machinery (some 800 modules,
~80 MiB resident, whatever T is), which a probe that baselines before the first call counts as the layer's memory
(docs/benchmarks.md, "Long sequences on the CPU"). Each variant runs in a fresh interpreter, so no variant's imports
are another's baseline.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/first_call_rss.py --ts 8192 --variants sto,h-sto,sgpa-decoupled
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_CHILD = r"""
import json, sys, torch, gpattn
from _common import PeakRSS, rss_mb
name, T, B, H, D, threads = sys.argv[1], *map(int, sys.argv[2:7])
torch.set_num_threads(threads)
torch.manual_seed(0)
layer = gpattn.build_attention(name, D, H).train()
x = torch.randn(B, T, D, requires_grad=True)

def call():
    y = layer(x)
    (y[0] if isinstance(y, tuple) else y).sum().backward()
    layer.zero_grad(set_to_none=True)
    x.grad = None

peak = PeakRSS()
before, modules = peak.reset(), len(sys.modules)
call()
first = peak.peak_extra_mb()
imported = len(sys.modules) - modules
after = peak.reset()
call()
print(json.dumps(dict(before_mb=before, first_call_mb=first, retained_mb=after - before,
                      second_call_mb=peak.peak_extra_mb(), modules_imported=imported)))
"""


def measure(name: str, T: int, batch: int, heads: int, dim: int, threads: int) -> dict:
    """One variant in a fresh interpreter: the row of the table (``status`` says what failed, if anything)."""
    args = [sys.executable, "-c", _CHILD, name, *map(str, (T, batch, heads, dim, threads))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1])
    row = {"variant": name, "T": T}
    if done.returncode != 0:
        return {**row, "status": "error", "reason": done.stderr.strip().splitlines()[-1:]}
    return {**row, "status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


def to_markdown(rows: list[dict]) -> str:
    """The table: MiB from the state before the first call, retained after it, and a later call's transient."""
    lines = [
        "| variant | T | first call (MiB over the state before it) | retained after it | a later call | modules "
        "imported by the first call |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['T']} | {r['status']}: {r['reason']} | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['T']} | {r['first_call_mb']:.0f} | {r['retained_mb']:.0f} | "
            f"{r['second_call_mb']:.0f} | {r['modules_imported']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="sto,h-sto,sgpa-decoupled", help="comma list (softmax is always added)")
    p.add_argument("--ts", default="8192", help="comma list of sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64, help="embed_dim (head dim = dim / heads)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    names = ["softmax", *(v for v in args.variants.split(",") if v and v != "softmax")]
    sizes = (args.batch, args.heads, args.dim, args.threads)
    rows = [measure(n, int(t), *sizes) for t in args.ts.split(",") for n in names]
    print(to_markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
