"""Numerical stability of every registered variant.

Trains each variant for ``--steps`` optimizer steps in float32 on CoLA (the official archive; a
synthetic fixture in the same format with ``--fixture``), then runs one bf16-autocast forward/backward
pass, and reports per variant: steps with a NaN/Inf loss or gradient, jitter escalations and
NotPSDErrors of the numerics policy (``gpattn.variational._linalg.STATS``). Exits 1 if any variant
produced a NaN/Inf or an unhandled factorisation failure.

    python benchmarks/stability.py --steps 2000 --data-dir ../shared/data
    python benchmarks/stability.py --steps 2000 --beta 1 --alpha 1    # the exact ELBO weights (docs/derivations.md §9)
    python benchmarks/stability.py --steps 50 --fixture --variants sgpa,cgp     # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

import gpattn
from gpattn.experiments.data import load_dataset
from gpattn.experiments.presets import get_preset
from gpattn.experiments.training import TrainConfig, _batch, _epoch_order, build_model
from gpattn.objectives import DEFAULT_ALPHA, DeepGPELBO
from gpattn.variational import _linalg

_COLA = get_preset("cola")


def _finite_grads(model) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def run_variant(name: str, bundle, args) -> dict:
    cfg = TrainConfig(
        dataset="cola",
        attention=name,
        embed_dim=args.embed_dim,
        num_heads=args.num_heads,
        num_layers=args.num_layers,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        progress=False,
    )
    torch.manual_seed(args.seed)
    model = build_model(cfg, bundle)
    train = bundle.splits["train"]
    n = len(train.labels)
    objective = DeepGPELBO(model, n, beta=args.beta, alpha=args.alpha)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    _linalg.reset_stats()
    bad_steps, not_psd, other_errors, losses = 0, 0, [], []
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        epoch, offset = divmod(step, steps_per_epoch)
        idx = _epoch_order(n, args.seed, epoch)[offset * cfg.batch_size : (offset + 1) * cfg.batch_size]
        x, mask, y = _batch(train, idx)
        optimizer.zero_grad(set_to_none=True)
        try:
            logits = model(x, mask)
            loss = objective(logits, y, step=step)
            if not torch.isfinite(loss):
                bad_steps += 1
                continue
            loss.backward()
        except _linalg.NotPSDError:
            not_psd += 1
            continue
        except (RuntimeError, ValueError) as err:  # recorded, never hidden
            other_errors.append(f"step {step}: {err}")
            continue
        if not _finite_grads(model):
            bad_steps += 1
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    stats = dict(_linalg.STATS)
    # one bf16-autocast forward/backward pass on a fresh batch
    idx = _epoch_order(n, args.seed + 1, 0)[: cfg.batch_size]
    x, mask, y = _batch(train, idx)
    optimizer.zero_grad(set_to_none=True)
    bf16_ok, bf16_error = True, ""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x, mask)
            loss = objective(logits.float(), y)
        loss.backward()
        bf16_ok = bool(torch.isfinite(loss)) and _finite_grads(model)
    except Exception as err:  # noqa: BLE001 - reported as a failure of this variant
        bf16_ok, bf16_error = False, f"{type(err).__name__}: {err}"
    return {
        "variant": name,
        "steps": args.steps,
        "nan_inf_steps": bad_steps,
        "not_psd": not_psd,
        "jitter_escalations": stats["jitter_escalations"],
        "cholesky_calls": stats["cholesky_calls"],
        "other_errors": other_errors[:5],
        "n_other_errors": len(other_errors),
        "bf16_finite": bf16_ok,
        "bf16_error": bf16_error,
        "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-50:]) / max(1, len(losses[-50:])) if losses else None,
        "seconds": round(seconds, 1),
    }


HEADER = (
    f"{'variant':<16}{'steps':>7}{'NaN/Inf':>9}{'NotPSD':>8}{'jitter':>8}{'errors':>8}{'bf16':>6}"
    f"{'loss0':>12}{'loss_end':>12}{'sec':>8}"
)


def format_row(row: dict) -> str:
    """One table line; losses in %g so an unscaled ELBO (1e4 nats) keeps its column."""
    nan = float("nan")
    return (
        f"{row['variant']:<16}{row['steps']:>7}{row['nan_inf_steps']:>9}{row['not_psd']:>8}"
        f"{row['jitter_escalations']:>8}{row['n_other_errors']:>8}{'ok' if row['bf16_finite'] else 'FAIL':>6}"
        f"{row['first_loss'] or nan:>12.5g}{row['last_loss'] or nan:>12.5g}{row['seconds']:>8.1f}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--variants", default="all", help="comma list or 'all' (every registered variant)")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    p.add_argument("--fixture", action="store_true", help="use a synthetic CoLA-format archive")
    p.add_argument("--embed-dim", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beta", type=float, default=_COLA["beta"], help="KL weight (default: the cola preset's)")
    p.add_argument(
        "--alpha", type=float, default=DEFAULT_ALPHA,
        help="CGP regulariser weight (default: the library's DEFAULT_ALPHA; the presets choose it on validation)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved --json run and exit")
    args = p.parse_args(argv)
    if args.show:
        rows = json.loads(Path(args.show).read_text())
        print(HEADER)
        for row in rows:
            print(format_row(row))
        return _verdict(rows)
    torch.set_num_threads(args.threads)
    gpattn.set_validation(True)  # the escalation counters and NotPSDErrors are read only with validation on
    variants = gpattn.list_attention() if args.variants == "all" else args.variants.split(",")
    if args.fixture:
        from gpattn.experiments.data.fixtures import make_cola_zip

        tmp = Path(tempfile.mkdtemp())
        make_cola_zip(tmp / "cola_public_1.1.zip", n_train=400)
        bundle = load_dataset("cola", data_dir=tmp, verify_checksum=False)
    else:
        bundle = load_dataset("cola", data_dir=args.data_dir)
    rows = []
    print(
        f"CoLA, {args.steps} steps/variant, float32, beta={args.beta:g}, alpha={args.alpha:g}, "
        f"batch {args.batch_size}, "
        f"width {args.embed_dim}, {args.num_layers} layers, {args.num_heads} heads, {args.threads} thread(s)",
        flush=True,
    )
    print(HEADER, flush=True)
    for name in variants:
        row = run_variant(name, bundle, args)
        rows.append(row)
        print(format_row(row), flush=True)
        for err in row["other_errors"]:
            print(f"    {err}")
        if row["bf16_error"]:
            print(f"    bf16: {row['bf16_error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return _verdict(rows)


def _verdict(rows: list) -> int:
    failed = [
        r["variant"] for r in rows if r["nan_inf_steps"] or r["not_psd"] or r["n_other_errors"] or not r["bf16_finite"]
    ]
    print("all stable" if not failed else f"UNSTABLE: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
