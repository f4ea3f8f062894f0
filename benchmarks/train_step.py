"""Whole-model training step (forward + backward + Adam) per registered variant, eager and compiled, as a
ratio to softmax's step at the same T in the same mode and run.

The model: ``TransformerClassifier`` over token ids, 2 blocks, width 64, 4 heads, dropout 0.1, every layer the
variant, batch B = 64 with a quarter of the sequences padded to half length; the step is ``DeepGPELBO``'s loss
(N = 10,000), backward, ``torch.optim.Adam``. "compiled" is ``torch.compile(model)`` (``--backend``, default
Inductor), the objective and optimizer eager; its first step (compilation included) is reported apart and
``--warmup`` steps are not timed. Each row is the median of ``--steps`` timed steps, in one process, with
``--threads`` torch threads. ``--quick``: a tiny smoke run (B = 4, T = 8, width 16, 2 steps). The FLOPs column
(``--no-flops`` skips it) is one forward + backward's arithmetic as a multiple of softmax's: a time ratio near it
is bound by arithmetic, one far above it by launches and memory traffic.

    python benchmarks/train_step.py --ts 16,128 --steps 5 --json train_step.json --markdown train_step.md
    python benchmarks/train_step.py --device cuda --compile-mode reduce-overhead --ts 16,64,256,1024   # CUDA graphs
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
import warnings

import torch
from _common import reference_first, run_and_finish

import gpattn
from gpattn.experiments._variants import parse_variant
from gpattn.models import TransformerClassifier
from gpattn.objectives import DeepGPELBO

MODES = ("eager", "compiled")
aten = torch.ops.aten


def _batch_size(*shapes) -> int:
    return math.prod(torch.broadcast_shapes(*(s[:-2] for s in shapes)))


def _tri_solve_flops(L, rhs, *args, out_shape=None, **kwargs) -> int:
    """L X = B or X L = B with L (…, n, n): n² flops per right-hand side (n²/2 multiply-adds)."""
    n = L[-1]
    return _batch_size(L, rhs) * n * n * math.prod(rhs[-2:]) // n


def _cholesky_flops(A, *args, out_shape=None, **kwargs) -> int:
    """A = L Lᵀ with A (…, n, n): n³/3 flops."""
    return _batch_size(A) * A[-1] ** 3 // 3


def _cholesky_solve_flops(rhs, L, *args, out_shape=None, **kwargs) -> int:
    """Two triangular solves of (…, n, k) against L (…, n, n)."""
    return 2 * _batch_size(L, rhs) * L[-1] ** 2 * rhs[-1]


def _cholesky_inverse_flops(L, *args, out_shape=None, **kwargs) -> int:
    """(L Lᵀ)⁻¹ from L (…, n, n): 2n³/3 flops (LAPACK's potri: L's triangular inverse, then its product)."""
    return 2 * _batch_size(L) * L[-1] ** 3 // 3


#: what FlopCounterMode does not count by itself (it counts the matrix products and attention): the factorisations
#: and solves of the GP layers, at their textbook counts
LINALG_FLOPS = {
    aten.linalg_solve_triangular: _tri_solve_flops,
    aten.linalg_cholesky_ex: _cholesky_flops,
    aten.cholesky_solve: _cholesky_solve_flops,
    aten.cholesky_inverse: _cholesky_inverse_flops,
    torch.ops.gpattn.host_cholesky: _cholesky_flops,  # gpattn's CPU factorisation, one operator (its body unseen)
}


def _attention(name: str):
    """A registered name, ``name@recipe`` (the variant as that recipe builds it, e.g. ``sgpa-rff@out-of-scope``, g on
    each sequence), each with options as ``compare`` spells them: ``name[key=value,...]`` or
    ``name[key=value,...]@recipe`` (e.g. ``sgpa-rff[num_features=64]@out-of-scope``)."""
    spec, _, recipe = name.partition("@")
    parsed = parse_variant(spec)
    if not parsed.options and not recipe:
        return parsed.attention
    return functools.partial(gpattn.build_attention, parsed.attention, recipe=recipe or "scratch",
                             **dict(parsed.options))


def _model(name: str, T: int, cfg: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    return TransformerClassifier(
        2, vocab_size=cfg.vocab, max_len=T, embed_dim=cfg.width, num_heads=cfg.heads, num_layers=2,
        attention=_attention(name),
    ).train().to(cfg.device)


def step_flops(name: str, T: int, cfg: argparse.Namespace) -> int:
    """The floating-point operations of one eager forward + backward (the step's arithmetic: matrix products,
    attention, factorisations and solves; elementwise work and Adam are not counted), the same in either mode."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _model(name, T, cfg)
    objective = DeepGPELBO(model, num_data=10_000)
    ids, mask, y = (t.to(cfg.device) for t in _batch(cfg.batch_size, T, cfg.vocab))
    with FlopCounterMode(display=False, custom_mapping=LINALG_FLOPS) as counter:
        objective(model(ids, mask), y).backward()
    return counter.get_total_flops()


def _batch(B: int, T: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[: B // 4, max(1, T // 2) :] = True
    ids[mask] = 0
    return ids, mask, torch.randint(0, 2, (B,), generator=g)


def make_step(name: str, T: int, mode: str, cfg: argparse.Namespace):
    """One variant's training step at one (T, mode): a function that runs it once and returns its time in ms."""
    model = _model(name, T, cfg)
    forward = torch.compile(model, backend=cfg.backend, mode=cfg.compile_mode) if mode == "compiled" else model
    objective = DeepGPELBO(model, num_data=10_000)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids, mask, y = (t.to(cfg.device) for t in _batch(cfg.batch_size, T, cfg.vocab))
    sync = torch.cuda.synchronize if torch.device(cfg.device).type == "cuda" else lambda: None

    def step() -> float:
        sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = objective(forward(ids, mask), y)
        loss.backward()
        optimizer.step()
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss")
        sync()
        return (time.perf_counter() - start) * 1e3

    return step


def _failed(row: dict, err: Exception) -> None:
    row.update(status="error", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")


def time_block(T: int, mode: str, cfg: argparse.Namespace) -> list[dict]:
    """Every variant at one (T, mode): each built, stepped once (``first_step_ms``, compilation included) and
    ``cfg.warmup`` times, then the timed steps interleaved — the k-th timed step of each variant runs between the
    others' k-th — so that a drift of the machine's load moves every variant's median alike. Each timed step follows
    an untimed one of the same variant: timed right after another variant's, a small model's step ran on caches that
    model had lost (softmax's at T = 16: +27 %). A failing variant is a row with its reason, not the end of the
    run."""
    torch._dynamo.reset()
    rows, steps = [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in cfg.variants:
            row = {"variant": name, "T": T, "mode": mode, "status": "ok", "reason": ""}
            rows.append(row)
            try:
                step = make_step(name, T, mode, cfg)
                row["first_step_ms"] = step()
                for _ in range(cfg.warmup):
                    step()
                if cfg.flops and mode == cfg.modes[0]:  # the same arithmetic in either mode: counted once
                    row["flops"] = step_flops(name, T, cfg)
                steps[name] = (row, step, [])
            except Exception as err:
                _failed(row, err)
        for _ in range(cfg.steps):
            for name, (row, step, times) in list(steps.items()):
                try:
                    step()  # untimed: the caches warm with this variant's data again, as in a run of its own steps
                    times.append(step())
                except Exception as err:
                    _failed(row, err)
                    del steps[name]
    for row, _, times in steps.values():
        row.update(step_ms=statistics.median(times), steps_timed=len(times))
    for row in rows:
        print(f"T={T} {mode} {row['variant']}: {row.get('step_ms', float('nan')):.1f} ms {row['reason']}", flush=True)
    return rows


def run(cfg: argparse.Namespace) -> list[dict]:
    """Every (T, mode, variant), the timed steps of one (T, mode) interleaved (:func:`time_block`)."""
    # each variant's compiled model is the same forward code with its own guards: room for every one of them
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(cfg.variants))
    rows = [row for T in cfg.ts for mode in cfg.modes for row in time_block(T, mode, cfg)]
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """``ratio_to_softmax``: the step over softmax's at the same T and mode (None where either failed)."""
    ref = {(r["T"], r["mode"]): r["step_ms"] for r in rows if r["variant"] == "softmax" and r["status"] == "ok"}
    flops = {r["T"]: r["flops"] for r in rows if r["variant"] == "softmax" and r.get("flops")}
    for r in rows:
        base = ref.get((r["T"], r["mode"]))
        r["ratio_to_softmax"] = r["step_ms"] / base if base and r["status"] == "ok" else None
        if r.get("flops") and r["T"] in flops:  # the step's arithmetic over softmax's: what no launch saving removes
            r["flops_ratio"] = r["flops"] / flops[r["T"]]


def to_markdown(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    flops = meta.get("flops", False)
    cols = [(T, mode) for T in meta["ts"] for mode in (*meta["modes"], *(("FLOPs",) if flops else ()))]
    cell = {(r["variant"], r["T"], r["mode"]): r for r in rows}
    out = ["| variant | " + " | ".join(f"T={T} {mode}" for T, mode in cols) + " |", "|---" + "|---:" * len(cols) + "|"]
    for name in meta["variants"]:
        parts = []
        for T, mode in cols:
            r = cell[(name, T, meta["modes"][0] if mode == "FLOPs" else mode)]
            if r["status"] != "ok":
                parts.append("error")
            elif mode == "FLOPs":
                parts.append(f"{r['flops'] / 1e9:.2f} G" if name == "softmax" else f"{r['flops_ratio']:.2f}×")
            elif name == "softmax":
                parts.append(f"{r['step_ms']:.1f} ms")
            else:
                parts.append(f"{r['ratio_to_softmax']:.2f}×")
        out.append(f"| {name} | " + " | ".join(parts) + " |")
    head = (
        f"B={meta['batch_size']}, width {meta['width']}, {meta['heads']} heads, 2 blocks, {meta['threads']} threads, "
        f"backend {meta['backend']}, median of {meta['steps']} interleaved steps; softmax in ms, the others as a "
        "multiple of it"
        + ("; FLOPs: one forward + backward's arithmetic (matrix products, attention, factorisations, solves), "
           "softmax's in GFLOP, the others' as a multiple of it" if flops else "")
        + "\n\n"
    )
    return head + "\n".join(out) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ts", default="16,64,256,1024", help="comma-separated sequence lengths")
    p.add_argument("--modes", default=",".join(MODES), help="eager, compiled or both")
    p.add_argument("--variants", default=None,
                   help="comma-separated registry names, name@recipe (e.g. sgpa-rff@out-of-scope), each with "
                        "options as compare's name[key=value,...] (e.g. 'sgpa-rff[num_features=64]@out-of-scope') "
                        "(default: all)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-flops", dest="flops", action="store_false",
                   help="skip counting each step's FLOPs (a column per T: the arithmetic over softmax's)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: B=4, T=8, width 16, 2 steps")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    cfg = p.parse_args(argv)
    if cfg.quick:
        cfg.batch_size, cfg.ts, cfg.width, cfg.heads, cfg.steps, cfg.warmup = 4, "8", 16, 2, 2, 1
    cfg.ts = [int(t) for t in cfg.ts.split(",")]
    cfg.modes = [m for m in cfg.modes.split(",") if m]
    if not set(cfg.modes) <= set(MODES):
        p.error(f"--modes must name {' or '.join(MODES)}, got {cfg.modes}")
    cfg.variants = reference_first(cfg.variants)
    return cfg


def main(argv=None) -> dict:
    keys = ("ts", "modes", "variants", "backend", "compile_mode", "device", "batch_size", "width", "heads", "steps",
            "warmup", "threads", "flops")
    return run_and_finish(parse_args(argv), run, keys, to_markdown)


if __name__ == "__main__":
    main()
