"""``gpattn compare``'s report: report.md (one table per evaluation split, the paired tables against the reference
rows, the notes on collapsed, diverged and inverted rows) and its plots."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from gpattn.experiments.training import TrainConfig
from gpattn.experiments.uncertainty import paired_difference, temperature_flags
from gpattn.objectives import DEFAULT_ALPHA

__all__ = ["LOWER_IS_BETTER", "REFERENCE_NAMES", "REPORT_COLUMNS", "write_report"]

#: metrics shown in report.md, per evaluation split (all metrics are in results.json)
REPORT_COLUMNS = {
    "in_domain": ("accuracy", "mcc", "nll", "ece", "aurc", "auroc"),
    "shift": ("accuracy", "nll", "ece"),
    # Bui et al. Table I reports MCC/NLL/ECE on CoLA OOD; cnll: in-domain and OOD rows together (CNLL_NOTE)
    "ood": ("accuracy", "mcc", "nll", "cnll", "ece", "ood_auroc"),
}
#: the note under an OOD split's table: what its ``cnll`` column is
CNLL_NOTE = ("`cnll`: cNLL (OOD rows: uniform label) — the mean over the in-domain test rows' NLL and this split's "
             "rows, each row without a label scored by its cross-entropy to the uniform label, −(1/C) Σ_c log p_c "
             "(gpattn.experiments.metrics.combined_nll); not uncertainty-baselines' cNLL, which scores out-of-scope "
             "rows as an extra class (docs/uncertainty.md).")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _plots(plot_preds, out: Path, average: str, ood_scores=("msp",)) -> list[str]:
    """Reliability diagrams of every labelled evaluation split, pooled over seeds (plus the historical
    in-domain diagram of the first seed), risk-coverage (first seed) and OOD histograms for every chosen
    score (first seed); returns the report's lines that name them."""
    from gpattn.experiments import metrics as M
    from gpattn.experiments import plots

    curves, ood = {}, {score: {} for score in ood_scores}
    pooled = set()
    for spec, per_seed in plot_preds.items():
        first = next(iter(per_seed))
        for seed, (preds, temperature, bundle) in per_seed.items():
            test = bundle.eval_splits["in_domain"]
            if seed == first:
                p_in = M.average_samples(preds[test]["logits"] / temperature, average=average)
                labels = preds[test]["labels"]
                plots.reliability_diagram(
                    p_in, labels, out / f"reliability_{_safe(spec)}.png", title=f"{spec} (in-domain, seed {seed})"
                )
                curves[spec] = (p_in, labels)
                scores_in = M.prediction_ood_scores(preds[test], average, temperature)
                for name in bundle.ood_splits:
                    scores_out = M.prediction_ood_scores(preds[bundle.eval_splits[name]], average, temperature)
                    for score in ood_scores:
                        if scores_in.get(score) is not None and scores_out.get(score) is not None:  # a score it has
                            ood[score][spec] = (scores_in[score], scores_out[score])
        bundle = per_seed[first][2]
        for split, key in bundle.eval_splits.items():
            probs, labels = [], []
            for preds, temperature, _ in per_seed.values():
                known = preds[key]["labels"] >= 0
                if bool(known.any()):
                    p = M.average_samples(preds[key]["logits"] / temperature, average=average)
                    probs.append(p[known.numpy()])
                    labels.append(preds[key]["labels"][known])
            if probs:
                seeds_txt = f"{len(probs)} seed{'s' if len(probs) > 1 else ''} pooled"
                plots.reliability_diagram(
                    np.concatenate(probs), torch.cat(labels), out / f"reliability_{_safe(spec)}_{split}.png",
                    title=f"{spec} ({split}, {seeds_txt})",
                )
                pooled.add(split)
    plots.risk_coverage(curves, out / "risk_coverage.png", title="risk–coverage (in-domain)")
    lines = [
        "- `risk_coverage.png` (in-domain, first seed); `reliability_<variant>.png` (in-domain, first seed)",
        f"- `reliability_<variant>_<split>.png` for every labelled evaluation split ({', '.join(sorted(pooled))}): "
        "predictions of all seeds pooled (each seed's test examples once per seed)",
    ]
    for score, per_spec in ood.items():
        if per_spec:
            name = "ood_histograms.png" if score == "msp" else f"ood_histograms_{_safe(score)}.png"
            plots.ood_histograms(
                per_spec, out / name, title=f"{score} scores: in-domain vs OOD (first seed; higher = more in-domain)"
            )
            lines.append(f"- `{name}`: OOD score {score}, first seed")
    return lines


def _diverged_seeds(per_seed: dict, seeds) -> list:
    return [s for s in seeds if "diverged" in per_seed[str(s)]]


def _collapsed_seeds(per_seed: dict, seeds) -> list:
    return [s for s in seeds if per_seed[str(s)].get("collapse")]


def _label(spec: str, per_seed: dict, seeds) -> str:
    """The row name, flagged when some seeds diverged (their cells are left out of mean ± std) or
    collapsed (a GP layer's mean under its noise, or training at the base rate: gpattn.experiments.diagnostics)."""
    flags = []
    bad = _diverged_seeds(per_seed, seeds)
    if bad:
        flags.append(f"diverged: {len(bad)}/{len(seeds)} seeds")
    collapsed = _collapsed_seeds(per_seed, seeds)
    if collapsed:
        flags.append(f"collapse: {len(collapsed)}/{len(seeds)} seeds")
    flags += temperature_flags(per_seed, seeds)  # a GP whose variance adds nothing beyond entropy out of domain
    return f"{spec} ({'; '.join(flags)})" if flags else spec


def _collapse_notes(results: dict, seeds) -> list:
    notes = [
        f"- {spec}, seed {s}: {msg}"
        for spec, per_seed in results.items()
        for s in _collapsed_seeds(per_seed, seeds)
        for msg in per_seed[str(s)]["collapse"]
    ]
    return ["## Collapse warnings", "", *notes, ""] if notes else []


def _alpha_notes(results: dict, seeds) -> list:
    """The α each seed's run chose from the grid, with every candidate's validation NLL (``alpha_grid``)."""
    lines = []
    for spec, per_seed in results.items():
        for s in seeds:
            row = per_seed[str(s)]
            if "alpha" not in row:
                continue
            members = [row["alpha_selection"]] if isinstance(row["alpha_selection"], dict) else row["alpha_selection"]
            chosen = row["alpha"] if isinstance(row["alpha"], list) else [row["alpha"]]
            shown = "; ".join(
                f"α = {a:g} (" + ", ".join(
                    f"{k}: {v if isinstance(v, str) else f'{v:.4f}'}" for k, v in nlls.items()
                ) + ")"
                for a, nlls in zip(chosen, members)
            )
            lines.append(f"- {spec}, seed {s}: {shown}")
    if not lines:
        return []
    return ["## α chosen on the validation split (validation NLL of each candidate)", "", *lines, ""]


#: a fitted temperature outside these bounds is degenerate: TS sharpens (T < 0.1) or flattens (T > 10) the predictive
#: by more than a calibration does (e.g. T ≈ 0.01 on digits' near-perfect validation split, which then hurts the shift)
DEGENERATE_TEMPERATURE = (0.1, 10.0)


def _temperature_notes(results: dict, seeds) -> list:
    """Each ``+ts`` row's fitted temperature per seed, and where it is degenerate (:data:`DEGENERATE_TEMPERATURE`), that
    the row without TS is the one to read beside it."""
    lines, low, high = [], *DEGENERATE_TEMPERATURE
    for spec, per_seed in results.items():
        fitted = [(s, per_seed[str(s)].get("temperature")) for s in seeds]
        fitted = [(s, t) for s, t in fitted if t is not None]
        if not fitted:
            continue
        bad = [s for s, t in fitted if not low <= t <= high]
        shown = ", ".join(f"{t:.3g}" for _, t in fitted)
        plain = spec.removesuffix("+ts")
        lines.append(f"- {spec}: T = {shown}" + (
            f"; degenerate in seed{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} (outside "
            f"[{low:g}, {high:g}]): TS there is no calibration — read `{plain}` beside it" if bad else ""))
    return ["## Temperatures fitted on the validation split", "", *lines, ""] if lines else []


def _diverged_notes(results: dict, seeds) -> list:
    notes = [
        f"- {spec}, seed {s}: {per_seed[str(s)]['diverged']['message']}"
        for spec, per_seed in results.items()
        for s in _diverged_seeds(per_seed, seeds)
    ]
    return ["## Diverged runs", "", *notes, ""] if notes else []


def _fmt(values, scale=1.0) -> str:
    vals = [v * scale for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{np.mean(vals):.3f} ± {np.std(vals, ddof=1):.3f}"


#: the direction of every metric shown in report.md: True = lower is better
LOWER_IS_BETTER = {"nll": True, "cnll": True, "ece": True, "aurc": True, "accuracy": False, "mcc": False,
                   "auroc": False, "ood_auroc": False, "ood_fpr95": True, "adaptive_ece": True}
#: the references of report.md's paired tables, by what they are
REFERENCE_NAMES = {"softmax": "MSP", "softmax+ts": "MSP + temperature scaling", "softmax+sngp+ts": "SNGP + TS",
                   "softmax+ens5+ts": "a 5-member ensemble + TS", "softmax+ens3+ts": "a 3-member ensemble + TS"}


def _split_columns(split: str, results: dict, seeds, bundle, ood_scores=("msp",)) -> tuple:
    """The metrics report.md shows for ``split``: MCC only for text, an OOD split's detection AUROC under
    every chosen score, and an unlabelled OOD split only its detection metrics."""
    from gpattn.experiments.metrics import ood_score_key

    default = REPORT_COLUMNS["ood"] if split in bundle.ood_splits else ("accuracy", "nll", "ece")
    cols = REPORT_COLUMNS.get(split, default)
    if bundle.kind == "image":
        cols = tuple(c for c in cols if c != "mcc")
    if split in bundle.ood_splits:
        chosen = tuple(ood_score_key(score, "ood_auroc") for score in ood_scores)
        cols = tuple(c for c in cols if not c.startswith("ood_")) + chosen
    if split in bundle.ood_splits and not any(
        results[s][str(seed)][split].get("accuracy") is not None for s in results for seed in seeds
    ):
        cols = tuple(c for c in cols if c.startswith("ood_") or c == "cnll")
    return cols


def _against_reference(results: dict, seeds, split: str, cols, reference: str = "softmax") -> list:
    """Paired differences to the reference per seed on ``split``: the mean of (variant − reference) with its 95 %
    Student-t interval over the seeds (gpattn.experiments.uncertainty.paired_difference) and in how many seeds the
    variant is better. Empty when the reference was not run."""
    if reference not in results:
        return []
    lines = [
        f"## Against {reference} ({REFERENCE_NAMES[reference]}), {split}",
        "",
        f"Paired over seeds: mean of (variant − {reference}) [95 % t-interval over the seeds]; `k/n` = seeds in "
        "which the variant is better (lower NLL/ECE/AURC/FPR95, higher accuracy/MCC/AUROC).",
        "",
        "| variant | " + " | ".join(f"Δ {c}" for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    best = {c: _best_score(results[reference], seeds, split, c) for c in cols if c.startswith("ood_")}
    if best:
        named = ", ".join(f"{c} against its {b or '–'}" for c, (b, _) in best.items())
        lines[4:4] = [f"OOD columns pair each score with the reference's best OOD score (mean over the seeds): "
                      f"{named}.", ""]
    for spec, per_seed in results.items():
        if spec == reference:
            continue
        cells = []
        for col in cols:
            against = best[col][1] if col in best else [results[reference][str(s)][split].get(col) for s in seeds]
            pairs = [(per_seed[str(s)][split].get(col), against[i] if against else None) for i, s in enumerate(seeds)]
            diffs = [v - r for v, r in pairs if v is not None and r is not None]
            better = sum((d < 0) if LOWER_IS_BETTER.get(col, False) else (d > 0) for d in diffs)
            cells.append(f"{_paired_cell(diffs)} ({better}/{len(diffs)})" if diffs else "–")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return lines + [""]


def _inverted(per_seed: dict, seeds, split: str, col: str) -> bool:
    """An OOD AUROC below chance in the mean over the seeds: the score ranks OOD inputs as *more* in-distribution."""
    values = [per_seed[str(s)][split].get(col) for s in seeds]
    values = [v for v in values if v is not None]
    return col.startswith("ood_auroc") and bool(values) and float(np.mean(values)) < 0.5


def _inverted_note(results: dict, seeds, split: str, cols) -> list:
    """The note under a table with an inverted score (:func:`_inverted`)."""
    if not any(_inverted(per_seed, seeds, split, c) for per_seed in results.values() for c in cols):
        return []
    return ["", "↓ below 0.5: the score ranks these OOD inputs as more in-distribution than the in-domain test rows "
            "(the model is more confident on them), worse than chance; `–`: a score the model does not have (the "
            "sample scores of a model that does not sample)."]  # fmt: skip


def _best_score(per_seed: dict, seeds, split: str, col: str) -> tuple[str | None, list]:
    """The reference's best OOD score for an OOD AUROC/FPR95 column ``col``: the score (metrics.json key) with the
    best mean over the seeds among those it has, and its per-seed values; a GP's score is paired with it, not only
    with the same score (which a model without samples does not have)."""
    stem = "ood_fpr95" if col.startswith("ood_fpr95") else "ood_auroc"
    lower = LOWER_IS_BETTER[stem]
    best, best_mean = None, None
    for key in {k for s in seeds for k in per_seed[str(s)][split] if k == stem or k.startswith(stem + "_")}:
        values = [per_seed[str(s)][split].get(key) for s in seeds]
        if any(v is None for v in values):
            continue
        mean = float(np.mean(values))
        if best is None or (mean < best_mean if lower else mean > best_mean):
            best, best_mean = key, mean
    return best, [per_seed[str(s)][split].get(best) for s in seeds] if best else []


def _paired_cell(diffs: list) -> str:
    """``+m [low, high]`` (the paired mean and its 95 % interval) for ≥ 2 seeds, ``+m`` for one."""
    if len(diffs) < 2:
        return f"{diffs[0]:+.3f}"
    d = paired_difference(np.asarray(diffs), np.zeros(len(diffs)))
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def write_report(
    results: dict, path: Path, base: TrainConfig, seeds, bundle, *, summaries=None, ood_scores=("msp",), notes=(),
    plot_notes=None, specs=None, elapsed: float | None = None, budget: float | None = None, trained=None,
) -> None:
    """report.md: what was run (data files, split sizes, class counts, objective weights, options), one
    table per evaluation split, mean ± std (sample std) over seeds; fractions."""
    from gpattn.experiments.data.summary import summary_lines

    if base.encoder is None:
        model = f"{base.num_layers} layers, width {base.embed_dim}, {base.num_heads} heads"
    else:  # the encoder's own shape
        enc = bundle.info.get("encoder", {})
        trunk = bundle.info.get("trunk")
        recipe = (
            f"frozen trunk: embeddings and layers 0–{trunk['layers'] - 1} pretrained and frozen (their outputs "
            f"computed once), the layers from {trunk['layers']} on and the head trained"
            if trunk
            else "full fine-tuning"
        )
        model = (
            f"pretrained encoder `{base.encoder}` ({enc.get('path', base.encoder)}; word pieces ≤ "
            f"{enc.get('max_len')}), attention swapped into layers {base.attention_layers}, {recipe}"
        )
    lines = [
        f"# gpattn compare — {base.dataset}",
        "",
        f"Seeds {list(seeds)}; {model}, "
        f"{base.epochs} epochs, batch {base.batch_size}, lr {base.lr}; {base.num_samples} Monte-Carlo samples, "
        f"predictions averaged over {base.average}.",
        f"Objective (docs/derivations.md §9): β = {base.beta:g} "
        f"(KL weight, annealed over {base.beta_anneal_steps} steps), "
        f"α = {base.alpha:g} (CGP regulariser weight, annealed over {base.alpha_anneal_steps} steps), "
        f"η = {base.eta:g} (KSVD weight), KL scaling {base.kl_scaling!r}. "
        + ("β = 1: the ELBO" if base.beta == 1 else "β ≠ 1: a tempered ELBO (β = 1 is the ELBO)")
        + (
            f"; α is the library default {DEFAULT_ALPHA:g} (R is not an ELBO term; gpattn.objectives.DEFAULT_ALPHA)."
            if base.alpha == DEFAULT_ALPHA
            else f"; α differs from the library default {DEFAULT_ALPHA:g} (R is not an ELBO term)."
        ),
        "Values are fractions (not percent), mean ± std over seeds. AUROC = failure prediction (in-domain), "
        f"ood_auroc = OOD detection with the max-probability (msp) score, ood_auroc_<score> with another score "
        f"(shown: {', '.join(ood_scores)}; every score is in results.json). `+ts` = temperature scaling on the "
        "validation split, `+laplace` = last-layer Laplace, `+mcdropout` = MC dropout, `+sngp` = SNGP "
        "(spectral-normalised blocks, random-feature GP head, mean-field logits), `+gpreadout` = the run's head read "
        "out through a GP's variance on its pooled features (λ on the validation NLL), `+ensN` = deep ensemble of N "
        "models.",
        "",
    ]
    if summaries:
        first = summaries[seeds[0]]
        lines += [f"## Data (seed {seeds[0]}; every seed in data.json)", "", *summary_lines(first), ""]
    opts = [s for s in (specs or ()) if s.options]
    if opts or base.attention_options or notes:
        lines += ["## Options and notes", ""]
        if base.attention_options:
            lines.append(f"- --attention-option (every variant that takes it): {base.attention_options}")
        lines += [f"- {s.spec}: attention options {dict(s.options)} (run `{s.run_name}`)" for s in opts]
        lines += [f"- {n}" for n in notes]
        lines.append("")
    columns = {split: _split_columns(split, results, seeds, bundle, ood_scores) for split in bundle.eval_splits}
    for split, cols in columns.items():
        lines += [f"## {split}", ""]
        ran = [
            results[s][str(seed)][split] for s in results for seed in seeds if results[s][str(seed)][split]
        ]
        if ran and "n" in ran[0]:
            row = ran[0]
            counts = ", ".join(f"{c}: {k}" for c, k in row["class_counts"].items())
            lines += [f"{row['n']} examples, {row['n_labelled']} labelled ({counts}).", ""]
            if row["n_labelled"] == 0 and split not in bundle.ood_splits:
                lines += ["No example of this split has a label known to training: no classification metrics.", ""]
        lines += ["| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for spec, per_seed in results.items():
            cells = [_fmt([per_seed[str(s)][split].get(c) for s in seeds]) for c in cols]
            cells = [cell + (" ↓" if _inverted(per_seed, seeds, split, c) else "") for cell, c in zip(cells, cols)]
            lines.append(f"| {_label(spec, per_seed, seeds)} | " + " | ".join(cells) + " |")
        lines += [*_inverted_note(results, seeds, split, cols), ""]
        lines += [CNLL_NOTE, ""] if "cnll" in cols else []
    lines += _alpha_notes(results, seeds)
    lines += _diverged_notes(results, seeds)
    lines += _collapse_notes(results, seeds)
    lines += _temperature_notes(results, seeds)
    # MSP, MSP + temperature scaling, and the strongest baselines with TS where they ran
    for reference in REFERENCE_NAMES:
        for split, cols in columns.items():
            lines += _against_reference(results, seeds, split, cols, reference)
    if elapsed is not None:
        done = f", training {trained[0]} of its {trained[1]} runs (the others reused)" if trained else ""
        lines += [f"Wall time of this compare call: {elapsed / 60:.1f} min{done}"
                  + (f"; the preset states {budget} min on 2 CPU cores for all of them." if budget else "."), ""]
    lines += [
        "## Plots",
        "",
        *(plot_notes or ["- `risk_coverage.png`, `ood_histograms.png`, `reliability_<variant>.png` (first seed)"]),
        "",
    ]
    Path(path).write_text("\n".join(lines))
