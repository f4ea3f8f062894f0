"""Does sgpa-rff keep its uncertainty figures at fewer, orthogonal random features (docs/derivations.md §5f, "Choice:
the frequencies' draw")? Reads one ``gpattn compare`` output folder (its results.json) with a reference spec and a
candidate spec trained on the same seeds, and prints, per figure, each seed's pair and the paired difference
(candidate − reference: mean, 95 % Student-t interval, seeds where the candidate is better) —
``gpattn.experiments.uncertainty.paired_difference``, as report.md's paired tables.

    python research/sgpa_rff_features.py RUN_DIR --reference sgpa-rff \\
        --candidate 'sgpa-rff[num_features=64,frequencies=orthogonal]'

Finding: research/notes/sgpa_rff_features.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpattn.experiments.uncertainty import paired_difference  # noqa: E402

#: (label, spec suffix, split, metric, higher is better)
FIGURES = (
    ("in-domain accuracy", "", "in_domain", "accuracy", True),
    ("in-domain NLL", "", "in_domain", "nll", False),
    ("shift NLL", "", "shift", "nll", False),
    ("shift NLL +TS", "+ts", "shift", "nll", False),
    ("shift ECE +TS", "+ts", "shift", "ece", False),
    ("OOD AUROC, MSP", "", "ood", "ood_auroc", True),
    ("OOD AUROC, mutual information", "", "ood", "ood_auroc_mutual_information", True),
    ("entropy-matched AUROC, MI", "", "ood", "ood_matched_auroc_mutual_information", True),
    ("entropy-matched AUROC, logit variance", "", "ood", "ood_matched_auroc_logit_variance", True),
)


def table(results: dict, reference: str, candidate: str) -> list[str]:
    """Markdown rows: figure | reference per seed | candidate per seed | paired difference."""
    seeds = sorted(set(results[reference]) & set(results[candidate]), key=int)
    rows = [f"seeds {', '.join(seeds)}; difference = candidate − reference, mean [95 % t-interval] (seeds better)", "",
            f"| figure | {reference} | {candidate} | difference |", "|---|---|---|---|"]
    for label, suffix, split, metric, higher in FIGURES:
        ref_spec, cand_spec = reference + suffix, candidate + suffix
        if ref_spec not in results or cand_spec not in results:
            continue
        a = [results[cand_spec][s][split].get(metric) for s in seeds]
        b = [results[ref_spec][s][split].get(metric) for s in seeds]
        if any(v is None for v in (*a, *b)):
            continue
        cell = lambda v: " / ".join(f"{x:.3f}" for x in v)  # noqa: E731
        if len(seeds) >= 2:
            d = paired_difference(np.asarray(a), np.asarray(b))
            better = d["a_higher"] if higher else d["a_lower"]
            diff = f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] ({better}/{d['n']})"
        else:
            diff = f"{a[0] - b[0]:+.3f}"
        rows.append(f"| {label} | {cell(b)} | {cell(a)} | {diff} |")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--reference", default="sgpa-rff")
    p.add_argument("--candidate", default="sgpa-rff[num_features=64,frequencies=orthogonal]")
    args = p.parse_args(argv)
    results = json.loads((args.run_dir / "results.json").read_text())
    print("\n".join(table(results, args.reference, args.candidate)))


if __name__ == "__main__":
    main()
