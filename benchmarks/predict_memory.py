"""Peak memory of ``run.predict(1000 texts, num_samples=50)`` per registered variant (target: under 4 GB).

For each variant a run is trained for one epoch on a synthetic review table
(``gpattn.experiments.data.fixtures.make_text_table``, two reviews per row; the model is 24 tokens wide), then a fresh
Python process loads it (``gpattn.experiments.load_run``) and scores 1,000 texts of that length at
``num_samples=50`` with ``predict``'s default ``batch_size=256`` (which ``predict_rows`` lowers for many
samples or long texts). The table gives that process's peak resident set (``ru_maxrss``: the interpreter, torch,
the model and predict together), the same peak just before ``predict`` (after ``load_run``), and the wall time
of ``predict``.

    python benchmarks/predict_memory.py --json predict_memory.json --markdown predict_memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the acceptance bound: peak resident set of one predict process
TARGET_MB = 4096


def _table(folder: Path) -> Path:
    """A labelled TSV whose rows join two fixture reviews of the same class (longer texts than one review)."""
    from gpattn.experiments.data.fixtures import make_text_table

    a = make_text_table(folder / "a.tsv", n=120, seed=0, class_names=("0", "1"))
    b = make_text_table(folder / "b.tsv", n=120, seed=1, class_names=("0", "1"))
    rows = [f"{x.split(chr(9))[0]} {y.split(chr(9))[0]}\t{x.split(chr(9))[1]}"
            for x, y in zip(a.read_text().splitlines()[1:], b.read_text().splitlines()[1:])]
    path = folder / "reviews.tsv"
    path.write_text("text\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def _train(variant: str, table: Path, out: Path, args) -> None:
    from gpattn.experiments.training import TrainConfig, train

    cfg = TrainConfig(dataset="text_table", dataset_options={"path": str(table)}, attention=variant,
                      embed_dim=args.embed_dim, num_heads=args.num_heads, num_layers=args.num_layers, epochs=1,
                      num_samples=2, progress=False, device="cpu")
    train(cfg, out)


def _child(run: str, texts: int, samples: int) -> None:
    """In the measured process: load the run, predict, print one JSON line."""
    import torch

    from gpattn.experiments.inference import load_run

    loaded = load_run(run)
    rows = Path(run, "texts.txt").read_text(encoding="utf-8").splitlines()
    inputs = [rows[i % len(rows)] for i in range(texts)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    pred = loaded.predict(inputs, num_samples=samples, seed=0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = int(loaded.encode(inputs[:1])[0].shape[1])
    print(json.dumps({"peak_mb": round(peak, 1), "before_mb": round(before, 1), "predict_s": round(seconds, 2),
                      "tokens": tokens, "rows": int(pred.probs.shape[0]), "threads": torch.get_num_threads()}))


def _measure(run: Path, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, __file__, "--child", str(run), "--texts", str(args.texts),
                           "--num-samples", str(args.num_samples)], env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if done.returncode != 0:
        return {"status": "error", "reason": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"status": "ok", **json.loads(done.stdout.strip().splitlines()[-1])}


def to_markdown(result: dict) -> str:
    """The table of docs/benchmarks.md."""
    s = result["settings"]
    lines = [f"`run.predict({s['texts']} texts, num_samples={s['num_samples']})`, model embed_dim {s['embed_dim']}, "
             f"{s['num_heads']} heads, {s['num_layers']} layer(s), {s['threads']} thread(s); target < {TARGET_MB} MB.",
             "", "| variant | tokens | peak RSS after load (MB) | peak RSS with predict (MB) | predict (s) "
             "| under target |",
             "|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        if row["status"] != "ok":
            lines.append(f"| {name} | — | — | — | — | {row['status']}: {row['reason']} |")
            continue
        ok = "yes" if row["peak_mb"] < TARGET_MB else "**no**"
        lines.append(f"| {name} | {row['tokens']} | {row['before_mb']:.0f} | {row['peak_mb']:.0f} | "
                     f"{row['predict_s']:.1f} | {ok} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    """Train, measure every variant in its own process, print (and save) the table."""
    import gpattn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variants", help="comma list (default: every registered variant)")
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--num-samples", type=int, default=50)
    p.add_argument("--embed-dim", type=int, default=32)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900, help="seconds per measured process")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.texts, args.num_samples)
    variants = args.variants.split(",") if args.variants else gpattn.list_attention()
    settings = {k: getattr(args, k) for k in ("texts", "num_samples", "embed_dim", "num_heads", "num_layers",
                                              "threads")}
    result = {"settings": settings, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        table = _table(Path(tmp))
        texts = [line.split("\t")[0] for line in table.read_text().splitlines()[1:]]
        for name in variants:
            run = Path(tmp) / name
            _train(name, table, run, args)
            (run / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
            result["rows"][name] = _measure(run, args)
            print(name, result["rows"][name], flush=True)
    print(to_markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(to_markdown(result))
    return result


if __name__ == "__main__":
    main()
