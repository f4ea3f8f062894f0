"""Evaluation cost per registered variant: evaluating N rows at P samples against P eval-mode passes of one sample
over the same rows, in the same run (issue #58's floor: the ratio ≤ 1.25 for every GP variant).

The model: ``TransformerClassifier`` over token ids at the text defaults (``TrainConfig``: 2 blocks, width 64, 4
heads), every layer the variant, eval mode; N = ``--rows`` sequences of T tokens, a quarter of them padded to half
length. Both sides run the evaluation's own loop, :func:`gpattn.experiments.training.predict` (passes of
:func:`gpattn.experiments._runs.predict_rows` rows at ``--eval-batch-size``): ``P samples`` is one call with
``num_samples=P`` (the first sampling layer draws the P samples, the layers below it run once), ``P × 1 sample`` is P
calls with ``num_samples=1``. Each is the median of ``--reps`` timings, the two interleaved, after one untimed call
of each. ``ratio`` = P samples / (P × 1 sample); softmax, which does not sample, evaluates once whatever P is.

``--detectors``: also the evaluation with the feature detectors (every one of
:data:`gpattn.experiments.detectors.DETECTORS`, fitted on the same rows' features at P, labels alternating), timed
in the same interleaved loop: ``with detectors`` is :func:`gpattn.experiments.training.predict_with_detectors` (the
features read in the logits' own pass) and ``two passes`` the evaluation before it (``predict``, then
:func:`gpattn.experiments.features.detector_scores`' second pass), each as a ratio to P samples without detectors.

    python benchmarks/eval_cost.py --ts 16,128 --rows 256 --json eval_cost.json --markdown eval_cost.md
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
import warnings

import torch
from _common import reference_first, run_and_finish

from gpattn.experiments._config import TrainConfig
from gpattn.experiments.detectors import DETECTORS, KNN, KNN_DEFAULT_K
from gpattn.experiments.features import detector_scores, split_features
from gpattn.experiments.training import predict, predict_with_detectors
from gpattn.models import TransformerClassifier


def _rows(n: int, T: int, vocab: int) -> types.SimpleNamespace:
    """N token-id rows of width T, every fourth padded to half length (the split ``predict`` reads)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (n, T), generator=g)
    mask = torch.zeros(n, T, dtype=torch.bool)
    mask[::4, T - T // 2 :] = True
    return types.SimpleNamespace(inputs=ids.masked_fill(mask, 0), mask=mask, labels=torch.zeros(n, dtype=torch.long))


def _detectors(model, split, P: int, batch_size: int) -> dict:
    """Every feature detector fitted on ``split``'s pooled features at P samples, labels alternating: a run's
    ``detectors`` entry (:func:`gpattn.experiments.features.fit_detectors`' form)."""
    feats = split_features(model, split, batch_size, P)
    labels = torch.arange(len(feats)) % 2
    k = {KNN.name: {"k": min(KNN_DEFAULT_K, len(feats))}}
    states = {n: cls(**k.get(n, {})).fit(feats, labels).state_dict() for n, cls in DETECTORS.items()}
    return {"num_samples": P, "states": states}


def measure(name: str, T: int, cfg: argparse.Namespace) -> dict:
    """One row: the median seconds of P samples and of P × 1 sample, and their ratio."""
    row = {"variant": name, "T": T, "rows": cfg.rows, "samples": cfg.samples}
    defaults = TrainConfig()
    try:
        torch.manual_seed(0)
        model = TransformerClassifier(
            2, vocab_size=cfg.vocab, max_len=T, embed_dim=defaults.embed_dim, num_heads=defaults.num_heads,
            num_layers=defaults.num_layers, attention=name,
        ).eval()
        split = _rows(cfg.rows, T, cfg.vocab)

        def many():
            predict(model, split, cfg.samples, cfg.eval_batch_size)

        def ones():
            for _ in range(cfg.samples):
                predict(model, split, 1, cfg.eval_batch_size)

        fns = {"p_samples": many, "p_single": ones}
        if cfg.detectors:
            dets = _detectors(model, split, cfg.samples, cfg.eval_batch_size)
            fns["with_detectors"] = lambda: predict_with_detectors(model, split, cfg.samples, dets, cfg.eval_batch_size)
            fns["two_passes"] = lambda: (many(), detector_scores(model, split, dets, cfg.eval_batch_size))
        times = {key: [] for key in fns}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for fn in fns.values():  # untimed: first-call work
                fn()
            for _ in range(cfg.reps):
                for key, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - start)
    except Exception as err:  # a variant that fails is a row, not the end of the run
        return {**row, "status": "error", "reason": f"{type(err).__name__}: {err}"[:300]}
    med = {k: statistics.median(v) for k, v in times.items()}
    many_s, ones_s = med["p_samples"], med["p_single"]
    row = {**row, "status": "ok", "p_samples_s": many_s, "p_single_s": ones_s, "ratio": many_s / ones_s}
    if cfg.detectors:
        row.update({f"{k}_s": med[k] for k in ("with_detectors", "two_passes")},
                   detectors_ratio=med["with_detectors"] / many_s, two_passes_ratio=med["two_passes"] / many_s)
    return row


def run(cfg: argparse.Namespace) -> list[dict]:
    rows = []
    for T in cfg.ts:
        for name in cfg.variants:
            rows.append(measure(name, T, cfg))
            r = rows[-1]
            shown = f"ratio {r['ratio']:.2f}" if r["status"] == "ok" else r["reason"]
            print(f"[eval_cost] {name} T={T}: {shown}", flush=True)
    return rows


def to_markdown(result: dict) -> str:
    meta = result["meta"]
    P = meta["samples"]
    lines = [
        f"N = {meta['rows']} rows, P = {P}, eval batch {meta['eval_batch_size']}, {meta['threads']} threads, "
        f"median of {meta['reps']}; {meta['cpu']} (load {meta['loadavg_1_5_15']})",
        "",
        f"| variant | T | P={P} samples (s) | {P} × 1 sample (s) | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['T']} | {r['status']}: {r['reason']} | | |")
            continue
        lines.append(f"| {r['variant']} | {r['T']} | {r['p_samples_s']:.3f} | {r['p_single_s']:.3f} | "
                     f"{r['ratio']:.2f} |")
    with_detectors = [r for r in result["rows"] if "detectors_ratio" in r]
    if with_detectors:
        lines += ["", f"| variant | T | P={P} samples (s) | with detectors (s) | ratio | two passes (s) | ratio |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['variant']} | {r['T']} | {r['p_samples_s']:.3f} | {r['with_detectors_s']:.3f} | "
                  f"{r['detectors_ratio']:.2f} | {r['two_passes_s']:.3f} | {r['two_passes_ratio']:.2f} |"
                  for r in with_detectors]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ts", default="16,128", help="comma-separated sequence lengths")
    p.add_argument("--variants", default=None, help="comma-separated registry names (default: all)")
    p.add_argument("--rows", type=int, default=256, help="N, the rows evaluated")
    p.add_argument("--samples", type=int, default=10, help="P, the Monte-Carlo samples")
    p.add_argument("--eval-batch-size", type=int, default=TrainConfig().eval_batch_size)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--detectors", action="store_true",
                   help="also time the evaluation with the feature detectors: one pass, and the old two passes")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: N=6, T=8, P=3, 1 rep")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    cfg = p.parse_args(argv)
    if cfg.quick:
        cfg.rows, cfg.ts, cfg.samples, cfg.reps = 6, "8", 3, 1
    cfg.ts = [int(t) for t in cfg.ts.split(",")]
    cfg.variants = reference_first(cfg.variants)
    return cfg


def main(argv=None) -> dict:
    keys = ("ts", "variants", "rows", "samples", "eval_batch_size", "reps", "threads", "detectors")
    return run_and_finish(parse_args(argv), run, keys, to_markdown)


if __name__ == "__main__":
    main()
