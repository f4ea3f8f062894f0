"""Time of one training epoch on CoLA per registered variant against softmax.

The model is the papers' CoLA setup (Chen et al. (2024) App. D.1, following Chen & Li (2023)): a
2-layer transformer, embedding dimension 128, MLP hidden dimension 256 (``mlp_ratio=2``), 4 heads,
batch size 32, Adam. Differences from the papers, stated: word-vocabulary embeddings instead of
ELMo (no pretrained embeddings required), dropout 0.1, mean pooling, one
Monte-Carlo sample per training step (``train_samples=1``), and ``attention_layers="auto"`` — every
layer is the variant except KEP-SVGP, which replaces only the last layer as in Chen et al. (2024)
(``--attention-layers all`` to override). Data: the official ``cola_public_1.1.zip``
(``--data-dir``), preset "official": train = ``in_domain_train`` minus a seeded 10 % validation split.

A step is exactly the step of ``gpattn.experiments.training.train``: forward with ``num_samples=train_samples``,
``DeepGPELBO`` over every layer's added loss terms, backward, gradient clipping, Adam, cosine
schedule; batches visit the training set in a seeded random order and are cut to their longest
sentence. One warm-up step is not timed. ``--max-steps N`` times the first N steps only and
extrapolates: epoch time = mean step time x steps per epoch (the row says ``extrapolated``). Each
variant runs in its own child process (``_common.run_isolated``) with ``--threads`` torch threads.

    python benchmarks/epoch_time.py --data-dir /work/shared/data --json epoch.json
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

from gpattn.experiments.training import TrainConfig, build_model, resolve_device
from gpattn.objectives import DeepGPELBO

#: Chen et al. (2024) App. D.1 CoLA model ("2-layer Transformer, embedding dimension 128, hidden dimension 256,
#: 4 heads", batch size 32), as TrainConfig fields
COLA_MODEL = dict(embed_dim=128, num_heads=4, num_layers=2, mlp_ratio=2.0, dropout=0.1, batch_size=32, lr=1e-3)


def _batch(split, idx):
    """Rows ``idx`` of a text split, cut to their longest real sequence (as the training loop does)."""
    x, mask, y = split.inputs[idx], split.mask[idx], split.labels[idx]
    longest = max(int((~mask).sum(1).max()), 1)
    return x[:, :longest], mask[:, :longest], y


def time_epoch(cfg: dict, bundle, max_steps: int | None, warmup_steps: int = 1) -> dict:
    """Train one epoch (or its first ``max_steps`` steps) on ``cfg.device`` and time every optimizer step
    (in a child; GPU timings wait for the device)."""
    cfg = TrainConfig.from_dict(cfg)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, bundle).to(device)
    split = bundle.splits["train"]
    n = len(split.labels)
    steps_per_epoch = max(1, math.ceil(n / cfg.batch_size))
    steps = steps_per_epoch if max_steps is None else min(max_steps, steps_per_epoch)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps_per_epoch * cfg.epochs)
    objective = DeepGPELBO(
        model, n, beta=cfg.beta, eta=cfg.eta, alpha=cfg.alpha, kl_scaling=cfg.kl_scaling, likelihood="expected"
    )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000003))
    model.train()

    def step(i):
        x, mask, y = (t.to(device) for t in _batch(split, order[i * cfg.batch_size : (i + 1) * cfg.batch_size]))
        synchronize(device)
        start = time.perf_counter()
        logits = model(x, mask, num_samples=cfg.train_samples)  # shape: (B, P, C)
        loss = objective(logits, y, step=i)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss at step {i}")
        return elapsed, x.shape[1]

    for i in range(warmup_steps):
        step(i % steps_per_epoch)
    peak = DevicePeak(device)
    peak.reset()
    times, lengths = [], []
    for i in range(steps):
        t, length = step(i)
        times.append(t)
        lengths.append(length)
    mean = statistics.fmean(times)
    return {
        "steps_timed": steps,
        "steps_per_epoch": steps_per_epoch,
        "extrapolated": steps < steps_per_epoch,
        "epoch_s": mean * steps_per_epoch,
        "timed_s": sum(times),
        "step_ms_mean": 1e3 * mean,
        "step_ms_median": 1e3 * statistics.median(times),
        "mean_T": statistics.fmean(lengths),
        "max_T": max(lengths),
        "peak_mb": peak.peak_extra_mb(),
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def to_markdown(result) -> str:
    """A markdown table of a result dict."""
    out = [
        "| variant | epoch s | step ms (mean) | mean T | peak extra MiB | × softmax | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            out.append(f"| {r['variant']} | | | | | | {r['status']}: {r['reason']} |")
            continue
        note = (
            f"extrapolated from {r['steps_timed']} steps"
            if r["extrapolated"]
            else f"full epoch, {r['steps_timed']} steps"
        )
        out.append(
            f"| {r['variant']} | {r['epoch_s']:.1f} | {r['step_ms_mean']:.1f} | {r['mean_T']:.1f} | {r['peak_mb']:.0f} "
            f"| {r['ratio_to_softmax']:.2f} | {note} |"
        )
    return "\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--data-dir",
        default=os.environ.get("GPATTN_DATA_DIR", "/work/shared/data"),
        help="folder holding cola_public_1.1.zip (default: $GPATTN_DATA_DIR or /work/shared/data)",
    )
    p.add_argument("--no-verify-checksum", action="store_true", help="accept a non-official archive (tests)")
    p.add_argument("--variants", default=None, help="comma-separated registry names (softmax is always added)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--max-steps", type=int, default=None, help="time only N steps and extrapolate to the epoch")
    p.add_argument("--batch-size", type=int, default=COLA_MODEL["batch_size"])
    p.add_argument("--attention-layers", default="auto", help="auto (default) | all | last")
    p.add_argument("--train-samples", type=int, default=1, help="Monte-Carlo samples per training step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="per-variant wall-clock budget in seconds")
    p.add_argument("--mem-limit-mb", type=float, default=None, help="memory budget per variant")
    p.add_argument("--json", default=None, help="write rows and metadata here")
    add_omp_wait_policy_argument(p)
    add_device_argument(p)
    p.add_argument("--markdown", default=None, help="write the results as a markdown table here")
    p.add_argument("--no-isolate", action="store_true", help="run in this process (no timeout / memory cap)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be >= 1, got {args.max_steps}")
    return args


def main(argv=None) -> dict:
    from gpattn.experiments.data import load_dataset

    args = parse_args(argv)
    options = {} if not args.no_verify_checksum else {"verify_checksum": False}
    bundle = load_dataset("cola", data_dir=args.data_dir, seed=args.seed, **options)
    configs = variant_configs(parse_variants(args.variants))
    mem_limit = default_mem_limit_mb(args.mem_limit_mb)
    n_train = len(bundle.splits["train"].labels)
    base = dict(
        dataset="cola",
        data_dir=str(args.data_dir),
        **{**COLA_MODEL, "batch_size": args.batch_size},
        attention_layers=args.attention_layers,
        train_samples=args.train_samples,
        seed=args.seed,
        epochs=1,
        progress=False,
        device=str(resolve_device(args.device)),
    )
    meta = {
        **machine_info(args.threads),
        "device": base["device"],
        "omp_wait_policy": omp_env(args.omp_wait_policy).get("OMP_WAIT_POLICY"),
        "model": {k: base[k] for k in ("embed_dim", "num_heads", "num_layers", "mlp_ratio", "dropout", "batch_size")},
        "attention_layers": args.attention_layers,
        "train_samples": args.train_samples,
        "n_train": n_train,
        "max_steps": args.max_steps,
        "data": bundle.info.get("source", args.data_dir) if isinstance(bundle.info, dict) else args.data_dir,
        "configs": configs,
    }
    print(
        f"epoch_time: CoLA train N={n_train}, batch {args.batch_size}, model {meta['model']}, "
        f"{args.threads} threads, variants: {', '.join(c['variant'] for c in configs)}"
        + (f", timing {args.max_steps} steps per variant and extrapolating" if args.max_steps else ""),
        flush=True,
    )
    module = Path(__file__).stem
    rows = []
    start = time.monotonic()
    for c in configs:
        cfg = dict(base, attention=c["name"], attention_options=c["options"])
        result = run_isolated(
            time_epoch,
            dict(cfg=cfg, bundle=bundle, max_steps=args.max_steps),
            timeout=args.timeout,
            threads=args.threads,
            mem_limit_mb=mem_limit,
            preload=(module,),
            server_env=omp_env(args.omp_wait_policy),
            isolate=not args.no_isolate,
        )
        row = {"variant": c["variant"], "name": c["name"], "options": c["options"], "epoch_s": None, "reason": None}
        row.update(result)
        rows.append(row)
        if row["status"] == "ok":
            msg = (
                f"epoch {row['epoch_s']:.1f} s ({row['steps_timed']}/{row['steps_per_epoch']} steps timed"
                f"{', extrapolated' if row['extrapolated'] else ''}), step {row['step_ms_mean']:.1f} ms, "
                f"mean T {row['mean_T']:.1f}, peak {row['peak_mb']:.0f} MiB"
            )
        else:
            msg = f"{row['status']}: {row['reason']}"
        print(f"  [{time.monotonic() - start:6.1f} s] {c['variant']:<34} {msg}", flush=True)
    ref = next((r["epoch_s"] for r in rows if r["variant"] == REFERENCE and r["status"] == "ok"), None)
    for r in rows:
        r["ratio_to_softmax"] = r["epoch_s"] / ref if r["status"] == "ok" and ref else None
    meta["wall_s"] = time.monotonic() - start
    print()
    head = f"{'variant':<34} {'epoch s':>9} {'step ms':>9} {'peak MiB':>9} {'x softmax':>9}  note"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if r["status"] == "ok":
            note = f"extrapolated from {r['steps_timed']} steps" if r["extrapolated"] else "full epoch"
            print(
                f"{r['variant']:<34} {r['epoch_s']:>9.1f} {r['step_ms_mean']:>9.1f} {r['peak_mb']:>9.0f} "
                f"{r['ratio_to_softmax'] if r['ratio_to_softmax'] is not None else float('nan'):>9.2f}  {note}"
            )
        else:
            print(f"{r['variant']:<34} {r['status'].upper()}: {r['reason']}")
    result = {"meta": meta, "rows": rows}
    write_outputs(result, args.json, args.markdown, to_markdown)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
