"""Write docs/variants.md, the Variants page, from docs/data/headline.json and the registry.

    python tools/variants_page.py                 # rewrite docs/variants.md from the result file
    python tools/variants_page.py --check         # exit 1 if docs/variants.md is not what the files give
    python tools/variants_page.py --refresh digits --results runs/digits/results.json \\
        --command "gpattn compare --preset digits --out runs/digits" --commit 1234abc --date 2026-12-01

What each variant is and when to pick it is the text below; its defaults come from
``gpattn.attention_options(name)``; its numbers come from the result file, one entry per claim with the
command, commit and date of every run behind it. ``--refresh CLAIM`` reads a ``results.json`` that
``gpattn compare`` wrote and *replaces* the rows of the variants it measured (an older run that no longer
backs any row is dropped), so a re-measurement changes the numbers instead of adding a section.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "headline.json"
PAGE = ROOT / "docs" / "variants.md"

#: what each registered variant is: paper, section of docs/derivations.md, cost and the options that matter
VARIANTS = {
    "softmax": {
        "what": "Scaled dot-product attention: the deterministic baseline, and its max-probability score (MSP).",
        "paper": "Vaswani et al. 2017",
        "section": "1",
        "cost": "O(T²·D)",
        "options": ("dropout",),
        "pick": "the baseline every other row is measured against; with temperature scaling (`softmax+ts`) the "
        "calibration baseline to beat.",
    },
    "kernel": {
        "what": "Kernel attention with tied query and key maps (W_q = W_k): the symmetric kernel's posterior mean "
        "without the GP noise.",
        "paper": "Bui et al. eq. 6; Chen & Li §3.1",
        "section": "2",
        "cost": "O(T²·D)",
        "options": ("kernel",),
        "pick": "an ablation: the kernel of the GP variants without their uncertainty.",
    },
    "kernel-asym": {
        "what": "Kernel attention with separate query and key maps (an asymmetric kernel).",
        "paper": "Bui et al. eq. 6; Chen & Li §3.1",
        "section": "2",
        "cost": "O(T²·D)",
        "options": ("kernel",),
        "pick": "an ablation, as `kernel`; fused with PyTorch's attention kernel at long T.",
    },
    "sto": {
        "what": "STO-TRANS: Gumbel-softmax attention, a sampled attention matrix per call.",
        "paper": "Pei et al. 2022, eqs. 9–11",
        "section": "3",
        "cost": "O(T²·D), plus the T × T Gumbel noise",
        "options": ("tau", "hard"),
        "pick": "stochastic attention without a GP: a Monte-Carlo predictive from sampled attention.",
    },
    "h-sto": {
        "what": "H-STO-TRANS: keys assigned to c learnable centroids by Gumbel-softmax, then Gumbel attention "
        "over them.",
        "paper": "Pei et al. 2022, eqs. 14–17, Algorithm 1",
        "section": "4",
        "cost": "O(T²·D), plus the T × T Gumbel noise",
        "options": ("num_centroids", "tau1", "tau2", "hard_centroids", "hard_values", "cluster"),
        "pick": "as `sto`, with the papers' hierarchical form.",
    },
    "sgpa": {
        "what": "SGPA: a sparse GP whose inducing inputs are the sequence's keys; the attention is the GP's prior "
        "mean and the GP adds its posterior spread.",
        "paper": "Chen & Li, ICLR 2023, §3.2",
        "section": "5a, §5c",
        "cost": "O(T³) per (B, H)",
        "options": ("kernel", "prior_mean", "covariance"),
        "pick": "a GP attention layer from scratch or swapped into a pretrained encoder (the swap's recipe, "
        '`recipe="encoder-swap"`, keeps both pretrained maps and the softmax mean so it starts at the pretrained '
        "attention); also a causal decoder.",
    },
    "sgpa-decoupled": {
        "what": "Decoupled SGPA: the keys for the mean and M global inducing points, shared by every sequence, "
        "for the covariance (orthogonally decoupled SVGP).",
        "paper": "Chen & Li, ICLR 2023, §3.3",
        "section": "5b",
        "cost": "O(T²·Dv + T·M² + M³) per (B, H)",
        "options": ("num_global", "kernel", "prior_mean", "covariance"),
        "pick": "the GP layer whose uncertainty comes from variables that see the training set (global inducing "
        "points); long sequences through the fused attention mean.",
    },
    "sgpa-rff": {
        "what": "Distance-aware SGPA: the attention prior mean plus a global GP on the queries (random Fourier "
        "features) whose covariance is conditioned on the training queries, so its variance grows away from them.",
        "paper": "gpattn's own form (SNGP's Laplace precision, Liu et al. 2020, in the query space of SGPA)",
        "section": "5f",
        "cost": "O(T²·Dv + T·R·(Dh + Dv) + R³) per (B, H)",
        "options": ("num_features", "prior_variance", "lengthscale", "prior_mean"),
        "pick": "a predictive variance that knows where the training queries (or, with `recipe=\"out-of-scope\"`, "
        "the training sentences) were: below softmax + TS out of domain on digits; on CoLA and CLINC150 still a "
        "temperature (docs/results.md).",
    },
    "kep-svgp": {
        "what": "KEP-SVGP: SVGPs on the kernel-eigen pairs of the attention matrix (a rank-r KSVD) around a softmax "
        "prior mean; with Chen et al.'s zero mean (prior_mean='zero') linear in T.",
        "paper": "Chen, Tao, Tonin & Suykens, ICML 2024",
        "section": "6",
        "cost": "O(T·Dh·r + T·r²) per head, + O(T²·Dh) for the default softmax mean",
        "options": ("rank", "merge", "num_landmarks", "prior_mean"),
        "pick": "calibration from scratch (CoLA: NLL below MSP's, where the zero mean overfits) and, with "
        "prior_mean='zero', long sequences (linear in T); with prior_mean='softmax-separate' (the mean's own queries "
        "and keys) where the attention must find content at small widths (attention suite at width 32, T 24: mean over "
        "seeds softmax's, against 0.82 by default; CoLA out of domain worse); in a pretrained encoder only with the "
        "trunk frozen (under full fine-tuning it stays below softmax's MCC).",
    },
    "cgp": {
        "what": "CGPT: correlated GPs on the queries and keys; the attention is the key process conditioned on the "
        "query process, around a softmax prior mean.",
        "paper": "Bui et al., CGPT §3, Appendices A–B",
        "section": "7, §7a",
        "cost": "O(T³) per (B, H)",
        "options": ("sigma", "prior_mean", "input_scale"),
        "pick": "the exact correlated-GP model at short T, from scratch or swapped into an encoder.",
    },
    "scgp": {
        "what": "SCGPT: CGPT with DTC-sparse inducing points for both processes, never forming a T × T matrix; a "
        "softmax prior mean with values of its own.",
        "paper": "Bui et al., SCGPT §4, Appendices C–E",
        "section": "8, §7a",
        "cost": "O(T·(m + l)·Dh + T·m·l + m³ + l³) per (B, H)",
        "options": ("num_inducing", "num_inducing_keys", "sigma", "prior_mean", "amortize"),
        "pick": "the correlated-GP model at long T (linear in memory).",
    },
}

#: baselines of ``gpattn compare`` shown beside the variants in the numbers (not registered variants)
BASELINES = ("softmax+ts", "softmax+ens5")

#: "which variant for X": (situation, the pick, why, the claim whose numbers say it)
SITUATIONS = (
    (
        "a model from scratch",
        "`sgpa`, `kep-svgp`",
        "both attend on every task of the suite at the default width; on CoLA `kep-svgp` keeps its NLL below MSP's "
        "([results.md](results.md)); on digits its zero-mean form has the GP rows' best shift NLL and OOD AUROC",
        "digits",
    ),
    (
        "swapped into a pretrained encoder",
        "`cgp`; `kep-svgp` with the trunk frozen; `sgpa` starts at the pretrained attention",
        "the rows that keep MSP's MCC on cola-minilm; out of domain every GP row there is "
        "MSP, not MSP + temperature scaling",
        "cola-minilm",
    ),
    (
        "long sequences",
        "`kep-svgp` with `prior_mean=\"zero\"`, `scgp`; `sgpa-decoupled` for its memory",
        "those two are linear in T; `sgpa-decoupled`'s attention mean runs fused, in linear memory; "
        "`cgp` and `sgpa` are cubic",
        "cost",
    ),
    (
        "a decoder (causal mask)",
        "`sgpa`, `sgpa-decoupled`",
        "the GP variants with an exact per-query mask "
        "([derivations §11](derivations.md)); `kep-svgp`, `cgp` and `scgp` take only masks that pad",
        None,
    ),
    (
        "calibration",
        "`softmax+ts` first; then `kep-svgp`",
        "temperature scaling is the bar a GP must beat; "
        "`kep-svgp` is the row that meets it out of domain on cola-minilm",
        "cola-minilm",
    ),
)


def _fmt(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def _values(results: dict, spec: str, split: str, metric: str) -> dict[str, float]:
    """seed -> value of one metric of one spec in a compare results.json (diverged seeds left out)"""
    out = {}
    for seed, metrics in results.get(spec, {}).items():
        value = metrics.get(split, {}).get(metric)
        if value is not None:
            out[seed] = float(value)
    return out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std


def cell(results: dict, spec: str, field: dict) -> str:
    """One table cell from results.json: mean ± sample std over seeds; a paired difference against another spec
    (``against``) or, with ``better_than``, the seeds in which the spec beats that one, as ``k/n``."""
    mine = _values(results, spec, field["split"], field["metric"])
    if not mine:
        return "–"
    other = field.get("against") or field.get("better_than")
    if other is None or other == spec:
        mean, std = _mean_std(list(mine.values()))
        return f"{mean:.3f} ± {std:.3f}"
    theirs = _values(results, other, field["split"], field["metric"])
    seeds = sorted(set(mine) & set(theirs))
    if not seeds:
        return "–"
    diffs = [mine[s] - theirs[s] for s in seeds]
    sign = 1.0 if field.get("higher_is_better", True) else -1.0
    better = f"({sum(sign * d > 0 for d in diffs)}/{len(diffs)})"
    if "better_than" in field:
        mean, std = _mean_std([mine[s] for s in seeds])
        return f"{mean:.3f} ± {std:.3f} {better}"
    mean, std = _mean_std(diffs)
    return f"{_fmt(mean)} ± {std:.3f} {better}"


def refresh(data: dict, claim: str, results: dict, command: str, commit: str, date: str) -> dict:
    """The result file with ``claim``'s rows for every variant in ``results`` replaced by a new run."""
    entry = data["claims"][claim]
    fields = entry.get("fields")
    if not fields:
        raise SystemExit(f"claim {claim!r} is not measured by gpattn compare (no 'fields'); edit the result file")
    known = set(VARIANTS) | set(BASELINES)
    measured = [spec for spec in results if spec in known]
    rows = {spec: {col: cell(results, spec, fields[col]) for col in entry["columns"]} for spec in measured}
    if not rows:
        raise SystemExit(f"no variant of {sorted(known)} in the results file")
    runs = []
    for run in entry["runs"]:
        kept = {v: r for v, r in run["rows"].items() if v not in rows}
        if kept:
            runs.append({**run, "rows": kept})
    runs.append({"command": command, "commit": commit, "date": date, "rows": rows})
    return {**data, "claims": {**data["claims"], claim: {**entry, "runs": runs}}}


def _row_of(entry: dict) -> dict[str, tuple[dict, int]]:
    """variant -> (its cells, the index of the run that measured it); a later run wins"""
    out = {}
    for i, run in enumerate(entry["runs"]):
        for variant, cells in run["rows"].items():
            out[variant] = (cells, i)
    return out


def _defaults(options: dict, names: tuple[str, ...]) -> str:
    shown = [f"`{n}={options[n]!r}`" for n in names if n in options]
    return ", ".join(shown).replace("'", '"')


def render(data: dict, names: list[str], options: dict[str, dict]) -> str:
    """The page, from the result file, the registered names and their options."""
    missing = sorted(set(names) - set(VARIANTS))
    if missing:
        raise SystemExit(f"tools/variants_page.py has no text for the registered variants {missing}")
    claims = data["claims"]
    lines = [
        "# Variants",
        "",
        "<!-- generated by tools/variants_page.py from docs/data/headline.json and gpattn.attention_options(); "
        "edit those, not this file -->",
        "",
        "Every attention variant of `gpattn.list_attention()`: what it is, when to pick it, its defaults, its cost "
        "and what it scores today. The numbers are the latest run of each claim "
        "([results](results.md), [benchmarks](benchmarks.md)); each table names the commands and commits "
        "behind it.",
        "",
        "## Which variant for what",
        "",
        "| situation | pick | why |",
        "|---|---|---|",
    ]
    for situation, pick, why, claim in SITUATIONS:
        link = f" ([numbers](#{_slug(claims[claim]['title'])}))" if claim else ""
        lines.append(f"| {situation} | {pick} | {why}{link} |")
    lines += [
        "",
        "## The variants",
        "",
        "| variant | what it is (paper; derivation) | cost | pick it for |",
        "|---|---|---|---|",
    ]
    for name in names:
        v = VARIANTS[name]
        what = f"{v['what']} ({v['paper']}; [§{v['section']}](derivations.md))"
        lines.append(f"| `{name}` | {what} | {v['cost']} | {v['pick']} |")
    lines += [
        "",
        "## Defaults and the options that matter",
        "",
        "From `gpattn.attention_options(name)`; every option is a keyword of "
        "`gpattn.build_attention(name, embed_dim, num_heads, **options)`.",
        "",
        "| variant | options that matter (default) |",
        "|---|---|",
    ]
    for name in names:
        lines.append(f"| `{name}` | {_defaults(options[name], VARIANTS[name]['options']) or '–'} |")
    for entry in claims.values():
        rows = _row_of(entry)
        lines += [
            "",
            f"## {entry['title']}",
            "",
            f"{entry['what'][0].upper()}{entry['what'][1:]}; [the full tables]({entry['page']}).",
            "",
        ]
        lines.append("| variant | " + " | ".join(entry["columns"]) + " | run |")
        lines.append("|---|" + "---|" * (len(entry["columns"]) + 1))
        for name in [*names, *BASELINES]:
            if name not in rows and name in BASELINES:
                continue
            cells, run = rows.get(name, ({}, None))
            values = " | ".join(cells.get(c, "–") for c in entry["columns"])
            lines.append(f"| `{name}` | {values} | {'–' if run is None else run + 1} |")
        lines += ["", "The runs (the last column; – : not measured):", ""]
        for i, run in enumerate(entry["runs"], 1):
            note = f"; {run['note']}" if run.get("note") else ""
            lines.append(f"{i}. `{run['command']}` at {run['commit']}, {run['date']}{note}")
    return "\n".join(lines) + "\n"


def _slug(title: str) -> str:
    """MyST's heading anchor (myst_heading_anchors) of a heading with this title"""
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return keep.strip().replace(" ", "-")


def page(data: dict) -> str:
    import gpattn

    names = gpattn.list_attention()
    return render(data, names, {n: gpattn.attention_options(n) for n in names})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from the generated page")
    parser.add_argument("--refresh", metavar="CLAIM", help="replace CLAIM's rows with a gpattn compare results.json")
    parser.add_argument("--results", type=Path, help="the results.json of --refresh")
    parser.add_argument("--command", help="the command that wrote --results")
    parser.add_argument("--commit", help="the commit --results was measured at")
    parser.add_argument("--date", help="the date --results was measured (YYYY-MM-DD)")
    args = parser.parse_args(argv)
    data = json.loads(args.data.read_text())
    if args.refresh:
        if not (args.results and args.command and args.commit and args.date):
            parser.error("--refresh needs --results, --command, --commit and --date")
        data = refresh(data, args.refresh, json.loads(args.results.read_text()), args.command, args.commit, args.date)
        args.data.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    text = page(data)
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        if not same:
            print(f"{args.out} is not what tools/variants_page.py writes: run it", file=sys.stderr)
        return 0 if same else 1
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
