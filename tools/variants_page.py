"""Write docs/variants.md, the Variants page, from docs/data/headline.json and the registry.

    python tools/variants_page.py                 # rewrite docs/variants.md from the result file
    python tools/variants_page.py --check         # exit 1 if docs/variants.md is not what the files give
    python tools/variants_page.py --refresh       # run every claim's run list, then rewrite both files
    python tools/variants_page.py --refresh digits --results runs/digits/results.json \\
        --command "gpattn compare --preset digits --out runs/digits" --commit 1234abc --date 2026-12-01

What each variant is and when to pick it is the text below; its defaults come from
``gpattn.attention_options(name)``; its numbers come from the result file, one entry per claim with the
command, commit and date of every run behind it. A claim's ``refresh`` entry is its run list: the command that
re-measures it at today's defaults (``{out}``: its folder under ``--runs``) and how to read what that writes
(``compare``: the ``results.json`` of ``gpattn compare``; ``suite``: ``benchmarks/attention_suite.py --json``;
``cost``: ``benchmarks/attention_scaling.py --json``). ``--refresh`` alone runs every claim's list (``--refresh
CLAIM`` one claim's) at the checked-out commit and *replaces* the rows of the variants it measured (an older run
that no longer backs any row is dropped), so a re-measurement changes the numbers instead of adding a section;
with ``--results`` it reads a file already written instead of running anything. Each refresh also writes
``RUNS/tables.md``, the claims' new rows with their command and commit, for docs/results.md (whose tables the
page's numbers must come from). Data sets are found as ``gpattn`` finds them (``$GPATTN_DATA_DIR``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "headline.json"
PAGE = ROOT / "docs" / "variants.md"
RUNS = ROOT / "runs" / "variants-page"

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
        "attention); also a causal decoder. `covariance=\"full\"` (default) draws the tokens jointly, one "
        "T × T factorisation per head and value dimension; `\"diag\"` draws them independently (the marginals are "
        "the same, no factorisation: cheaper at long T). With the paper's shared W_q = W_k and a CLS token it learns "
        "slowly: the digits preset's 20 epochs train it, the demo's 8 do not, so the demo builds the separate-map "
        "form (research/notes/time_to_accuracy.md).",
    },
    "sgpa-decoupled": {
        "what": "Decoupled SGPA: the keys for the mean and M global inducing points, shared by every sequence, "
        "for the covariance (orthogonally decoupled SVGP).",
        "paper": "Chen & Li, ICLR 2023, §3.3",
        "section": "5b",
        "cost": "O(T²·Dv + T·M² + M³) per (B, H)",
        "options": ("num_global", "kernel", "prior_mean", "covariance"),
        "pick": "the GP layer whose uncertainty comes from variables that see the training set (global inducing "
        "points); long sequences through the fused attention mean. `covariance=\"diag\"` (default, the released "
        "code's) keeps it linear in memory; `\"full\"` draws the tokens jointly at O(Dv·T³).",
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
        "trunk frozen (under full fine-tuning it stays below softmax's MCC). `merge=\"add\"` (default) takes any "
        "length; `\"concat\"`, Chen et al.'s other merge, learns a 2T → T map and needs a fixed `seq_len`.",
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
        "([results.md](results.md)); on digits it has the GP rows' best shift NLL (below softmax's in 5 of 5 seeds)",
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
        "`softmax+ts` first; then `kep-svgp`; under shift `kep-svgp+gpreadout`",
        "temperature scaling is the bar a GP must beat; `kep-svgp` is the row that meets it out of domain on "
        "cola-minilm; on digits (5 seeds, one run) `kep-svgp+gpreadout` has the lowest shift NLL of one model, 0.819 "
        "against MC dropout's 1.037, Laplace's 1.073 and SNGP's 0.978, at softmax's accuracy; still 0.173 above a "
        "5-member ensemble's 0.646 ([results.md](results.md))",
        "cola-minilm",
    ),
    (
        "knowing what it has not seen (OOD)",
        "from scratch `scgp` with `+gpreadout`; on a pretrained encoder `softmax` with `+gpreadout`; scored by "
        "`--ood-score gp-variance`",
        "on digits (10 seeds) scgp's GP readout ranks the held-out classes above softmax's Mahalanobis, relative "
        "Mahalanobis and kNN (0.947 against 0.897, 0.901 and 0.898, paired intervals above 0 in 9 of 10 seeds) and "
        "above `softmax+gpreadout` (0.915); on CLINC150 (MiniLM, frozen trunk, 5 seeds) its AUROC 0.981 is above energy's, Mahalanobis', "
        "kNN's, encoder SNGP's and energy + kNN's (0.980 at most; each paired interval above 0) and its FPR95 is "
        "0.080 against energy's 0.112, SNGP's 0.105 and kNN's 0.107; of the GP attention forms "
        "`sgpa-rff`'s mutual information sees them beyond its entropy (0.865) at a cost in accuracy (0.948 against "
        "0.977) ([results.md](results.md))",
        None,
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
    """One table cell from results.json: mean ± sample std over seeds (``format: "ratio"``: the mean as a multiple,
    ``1.25×``); a paired difference against another spec (``against``) or, with ``better_than``, the seeds in which
    the spec beats that one, as ``k/n``."""
    mine = _values(results, spec, field["split"], field["metric"])
    if not mine:
        return "–"
    other = field.get("against") or field.get("better_than")
    if other is None or other == spec:
        mean, std = _mean_std(list(mine.values()))
        return f"{mean:.2f}×" if field.get("format") == "ratio" else f"{mean:.3f} ± {std:.3f}"
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
        raise SystemExit(f"claim {claim!r} has no 'fields' (what to read from its runs); edit the result file")
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


def _suite_results(path: Path) -> dict:
    """``benchmarks/attention_suite.py --json`` as compare's results.json: spec -> seed -> task -> accuracy."""
    out: dict = {}
    for r in json.loads(path.read_text())["results"]:
        if "accuracy" in r:
            config = r["config"]
            out.setdefault(r["variant"], {}).setdefault(str(config["seed"]), {})[config["task"]] = {
                "accuracy": r["accuracy"]
            }
    return out


def _cost_results(path: Path) -> dict:
    """``benchmarks/attention_scaling.py --json`` as compare's results.json: variant -> "0" -> mode -> T -> time as a
    multiple of softmax's in the same run (configurations other than a variant's default are left out)."""
    out: dict = {}
    for r in json.loads(path.read_text())["rows"]:
        if r.get("ratio_to_softmax") is not None and r["variant"] == r.get("name"):  # another label: not the default
            row = out.setdefault(r["variant"], {}).setdefault("0", {}).setdefault(r["mode"], {})
            row[str(r["T"])] = r["ratio_to_softmax"]
    return out


#: how a claim's run list writes its numbers: the file under the claim's folder and the reader of that file
READERS = {
    "compare": ("results.json", lambda path: json.loads(path.read_text())),
    "suite": ("suite.json", _suite_results),
    "cost": ("cost.json", _cost_results),
}


def _argv(command: str) -> list[str]:
    """A run-list command as a process to start: ``gpattn ...`` and ``python ...`` run with this interpreter (so
    with this checkout's gpattn, whatever ``gpattn`` on the PATH is)."""
    argv = shlex.split(command)
    if argv[0] == "gpattn":
        return [sys.executable, "-m", "gpattn", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


def current_commit() -> str:
    """The checked-out commit that computes a refresh's numbers; an error if gpattn/, benchmarks/ or a preset has
    uncommitted changes (the page would name a commit that does not compute them)."""
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "gpattn", "benchmarks"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    if dirty:
        raise SystemExit(f"uncommitted changes under gpattn/ or benchmarks/ ({dirty.splitlines()[0]} ...): commit them "
                         f"first, or name the commit with --commit")  # fmt: skip
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def run_claim(data: dict, claim: str, runs: Path, commit: str, date: str, log=print) -> dict:
    """Run ``claim``'s run list into ``runs/claim`` and return the result file with its rows replaced by what the
    run measured; the run's own output is in ``runs/claim.log``."""
    entry = data["claims"].get(claim)
    if entry is None:
        raise SystemExit(f"no claim {claim!r} in the result file; claims: {', '.join(data['claims'])}")
    plan = entry.get("refresh")
    if not plan:
        raise SystemExit(f"claim {claim!r} has no run list ('refresh'): re-measure it by hand and pass --results")
    out = runs / claim
    out.mkdir(parents=True, exist_ok=True)
    shown = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
    command = plan["command"].format(out=shown)
    log(f"[variants_page] {claim}: {command}")
    with open(runs / f"{claim}.log", "w") as f:
        done = subprocess.run(_argv(plan["command"].format(out=out)), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{claim}: the run list's command failed (exit {done.returncode}); its output: "
                         f"{runs / f'{claim}.log'}")  # fmt: skip
    name, read = READERS[plan["reads"]]
    return refresh(data, claim, read(out / name), command, commit, date)


def tables(data: dict, claims: list[str]) -> str:
    """The claims' latest rows as Markdown tables with their command and commit (for docs/results.md)."""
    lines = []
    for claim in claims:
        entry, run = data["claims"][claim], data["claims"][claim]["runs"][-1]
        lines += [f"## {entry['title']}", "", "```bash", f"{run['command']}   # at {run['commit']}, {run['date']}",
                  "```", "", "| variant | " + " | ".join(entry["columns"]) + " |",
                  "|---|" + "---|" * len(entry["columns"])]  # fmt: skip
        for variant, cells in run["rows"].items():
            lines.append(f"| {variant} | " + " | ".join(cells.get(c, "–") for c in entry["columns"]) + " |")
        lines.append("")
    return "\n".join(lines)


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
    parser.add_argument("--refresh", metavar="CLAIM", nargs="?", const="all",
                        help="re-measure CLAIM (default: every claim with a run list), or read --results for it")
    parser.add_argument("--runs", type=Path, default=RUNS, help="where --refresh runs (default runs/variants-page)")
    parser.add_argument("--results", type=Path, help="a results file already written: replace CLAIM's rows with it")
    parser.add_argument("--command", help="the command that wrote --results")
    parser.add_argument("--commit", help="the commit the numbers were measured at (default: the checked-out one)")
    parser.add_argument("--date", help="the date they were measured (YYYY-MM-DD; default: today)")
    args = parser.parse_args(argv)
    data = json.loads(args.data.read_text())
    if args.refresh and args.results:
        if args.refresh == "all" or not (args.command and args.commit and args.date):
            parser.error("--refresh CLAIM --results FILE needs --command, --commit and --date")
        data = refresh(data, args.refresh, json.loads(args.results.read_text()), args.command, args.commit, args.date)
        args.data.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    elif args.refresh:
        claims = [c for c, e in data["claims"].items() if e.get("refresh")] if args.refresh == "all" else [args.refresh]
        commit = args.commit or current_commit()
        date = args.date or datetime.date.today().isoformat()
        for claim in claims:
            data = run_claim(data, claim, args.runs, commit, date)
            args.data.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")  # each claim as it finishes
        (args.runs / "tables.md").write_text(tables(data, claims))
        print(f"[variants_page] the new rows, for docs/results.md: {args.runs / 'tables.md'}")
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
