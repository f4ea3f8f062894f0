"""The GP readout's two posterior forms (docs/derivations.md §14a, "Low-rank posterior when N < R") on the same data:
N training rows, R random features, the readout's ridge grid, and v of M rows at every ridge, in the dense form
(:class:`gpattn.experiments.sngp.DenseGram`: one R × R Gram, a Cholesky per ridge, a triangular solve per row) and
the low-rank form (:class:`gpattn.experiments.sngp.LowRankGram`: one SVD of the weighted rows for every ridge, a
product per row), float64 as the readout runs them. ``fit`` is the Gram or SVD and each ridge's posterior,
``evaluate`` v of the M rows at each ridge; each the median of ``--reps`` timings, the two forms interleaved, after
one untimed call of each. ``ratio`` = dense / low-rank (above 1: the low-rank form is faster); ``max_rel_diff`` is
the largest relative difference of the two forms' v (they are the same number up to rounding).

    python benchmarks/readout_cost.py --train 256,865,1536,2047 --json readout_cost.json --markdown readout_cost.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import run_and_finish

from gpattn.experiments.readout import RIDGE_GRID
from gpattn.experiments.sngp import DenseGram, LowRankGram, RandomFeatureGP


def _forms(rows: torch.Tensor) -> dict:
    """``{form: () -> Gram}`` from the weighted rows ``(N, R)`` float64: the dense Gram summed as ``feature_gram``
    sums it, and the low-rank one."""
    def dense():
        gram = rows.new_zeros(rows.shape[1], rows.shape[1])
        gram += rows.T @ rows
        return DenseGram(gram, rows.shape[0])

    return {"dense": dense, "low-rank": lambda: LowRankGram.of_rows(rows, rows.shape[0])}


def measure(n: int, cfg: argparse.Namespace) -> dict:
    """One row: the fit and the evaluation of both forms at N = ``n`` training rows."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    gp = RandomFeatureGP(cfg.width, 1, num_features=cfg.features, lengthscale=float(cfg.width) ** 0.5,
                         input_norm=False)
    rows = gp.features(torch.randn(n, cfg.width, generator=gen)).double()  # unit weights: the readout's default
    query = gp.features(torch.randn(cfg.rows, cfg.width, generator=gen))  # float32, as the readout's features
    forms = _forms(rows)
    times = {(form, step): [] for form in forms for step in ("fit", "evaluate")}
    variance = {}
    for rep in range(cfg.reps + 1):  # the first, untimed
        for form, make in forms.items():
            start = time.perf_counter()
            gram = make()
            posteriors = [gram.posterior(s) for s in RIDGE_GRID]
            fitted = time.perf_counter()
            variance[form] = torch.stack([p.variance(query) for p in posteriors])
            done = time.perf_counter()
            if rep:
                times[(form, "fit")].append(fitted - start)
                times[(form, "evaluate")].append(done - fitted)
    row = {"train": n, "features": cfg.features, "rows": cfg.rows, "ridges": len(RIDGE_GRID)}
    for (form, step), seconds in times.items():
        row[f"{form}_{step}_s"] = statistics.median(seconds)
    for step in ("fit", "evaluate"):
        row[f"{step}_ratio"] = row[f"dense_{step}_s"] / row[f"low-rank_{step}_s"]
    total = {form: row[f"{form}_fit_s"] + row[f"{form}_evaluate_s"] for form in forms}
    row["ratio"] = total["dense"] / total["low-rank"]
    row["max_rel_diff"] = float(((variance["dense"] - variance["low-rank"]).abs() / variance["dense"]).max())
    return row


def run(cfg: argparse.Namespace) -> list[dict]:
    rows = []
    for n in cfg.train:
        rows.append(measure(n, cfg))
        print(f"[readout_cost] N={n}: ratio {rows[-1]['ratio']:.2f}", flush=True)
    return rows


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"R = {meta['features']} features, {len(RIDGE_GRID)} ridges, M = {meta['rows']} rows evaluated per ridge, "
        f"{meta['threads']} threads, median of {meta['reps']}; {meta['cpu']} (load {meta['loadavg_1_5_15']})",
        "",
        "| N | dense fit (s) | low-rank fit (s) | ratio | dense evaluate (s) | low-rank evaluate (s) | ratio | "
        "total ratio | max rel. diff of v |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['train']} | {r['dense_fit_s']:.3f} | {r['low-rank_fit_s']:.3f} | {r['fit_ratio']:.2f} | "
              f"{r['dense_evaluate_s']:.3f} | {r['low-rank_evaluate_s']:.3f} | {r['evaluate_ratio']:.2f} | "
              f"{r['ratio']:.2f} | {r['max_rel_diff']:.1e} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", default="256,865,1536,2047", help="comma-separated N, the training rows")
    p.add_argument("--features", type=int, default=4096, help="R, the random features (the readout's NUM_FEATURES)")
    p.add_argument("--rows", type=int, default=2000, help="M, the rows whose v is evaluated at each ridge")
    p.add_argument("--width", type=int, default=64, help="D, the width of the pooled features")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny smoke run: R=64, N=10,31, M=20, 1 rep")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    cfg = p.parse_args(argv)
    if cfg.quick:
        cfg.features, cfg.train, cfg.rows, cfg.reps = 64, "10,31", 20, 1
    cfg.train = [int(n) for n in cfg.train.split(",")]
    if any(not LowRankGram.pays(n, cfg.features) for n in cfg.train):
        p.error(f"--train: every N must be below R/2 = {cfg.features / 2:g} (where the readout takes the low-rank "
                f"form), got {cfg.train}")
    return cfg


def main(argv=None) -> dict:
    return run_and_finish(parse_args(argv), run, ("features", "train", "rows", "width", "reps", "threads"),
                          to_markdown)


if __name__ == "__main__":
    main()
