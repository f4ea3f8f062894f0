"""``gpattn compare``: train variants over seeds, add the post-hoc baselines, write a report.

A *variant spec* is a registered attention name with optional modifiers:
``softmax+ts`` (post-hoc temperature scaling fitted on the validation split, Guo et al. 2017),
``softmax+laplace`` (post-hoc last-layer Laplace, :mod:`gpattn.laplace`; laplace-torch when installed,
else the dense float64 back end),
``softmax+mcdropout`` (dropout kept on at prediction), ``softmax+ens5`` (deep ensemble of 5
independently seeded models: the seed run plus members seeded ``seed + 1000·j``). Modifiers combine
(``kep-svgp+ens5``). Runs are cached under ``OUT/runs/<name>/seed<S>``: a finished run with the same
configuration is reused, so ``+ts`` and ensembles cost no retraining of the members they share.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from gpattn._io import load_file
from gpattn.attention.registry import attention_class, list_attention
from gpattn.training import COLLAPSE, DIVERGED, TrainConfig, TrainingDivergedError, evaluate_predictions, train

__all__ = ["VariantSpec", "compare", "expand_variants", "parse_variant", "write_report"]

BASELINES = ("softmax+ts", "softmax+mcdropout", "softmax+laplace", "softmax+ens5")

#: metrics shown in report.md, per evaluation split (all metrics are in results.json)
REPORT_COLUMNS = {
    "in_domain": ("accuracy", "mcc", "nll", "ece", "aurc", "auroc"),
    "shift": ("accuracy", "nll", "ece"),
    "ood": ("accuracy", "mcc", "nll", "ece", "ood_auroc"),  # seed 003 Table I reports MCC/NLL/ECE on CoLA OOD
}


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    spec: str
    attention: str
    ts: bool = False
    mcdropout: bool = False
    laplace: bool = False
    ensemble: int = 1

    @property
    def run_name(self) -> str:
        """The trained model this spec evaluates (post-hoc modifiers need no run of their own)."""
        return self.attention + ("+mcdropout" if self.mcdropout else "")


def parse_variant(spec: str) -> VariantSpec:
    name, *mods = spec.strip().split("+")
    attention_class(name)  # ValueError listing the valid names
    ts = mc = la = False
    ens = 1
    for mod in mods:
        if mod == "ts":
            ts = True
        elif mod == "laplace":
            la = True
        elif mod == "mcdropout":
            mc = True
        elif re.fullmatch(r"ens\d+", mod) and int(mod[3:]) >= 2:
            ens = int(mod[3:])
        else:
            raise ValueError(
                f"unknown modifier {mod!r} in variant {spec!r}; valid: +ts, +laplace, +mcdropout, +ensN (N >= 2)"
            )
    return VariantSpec(spec.strip(), name, ts, mc, la, ens)


def expand_variants(variants) -> list[VariantSpec]:
    """A comma list or list of specs; ``all`` = every registered variant; ``all+baselines`` adds
    :data:`BASELINES` (softmax+ts, softmax+mcdropout, softmax+laplace and a deep ensemble softmax+ens5)."""
    if isinstance(variants, str):
        variants = [v for v in variants.split(",") if v.strip()]
    out: list[str] = []
    for v in variants:
        if v == "all":
            out += list_attention()
        elif v == "all+baselines":
            out += list_attention() + list(BASELINES)
        else:
            out.append(v)
    if not out:
        raise ValueError("no variants to compare")
    return [parse_variant(v) for v in dict.fromkeys(out)]


def _run(base: TrainConfig, attention: str, mcdropout: bool, seed: int, root: Path, bundle, progress: bool):
    cfg = dataclasses.replace(base, attention=attention, mc_dropout=mcdropout, seed=seed, progress=progress)
    folder = root / "runs" / (attention + ("+mcdropout" if mcdropout else "")) / f"seed{seed}"
    done, diverged = folder / "predictions.pt", folder / DIVERGED
    same_config = (folder / "config.json").is_file() and json.loads((folder / "config.json").read_text()) == json.loads(
        json.dumps(cfg.to_dict())
    )
    if same_config and diverged.is_file():  # a deterministic rerun would diverge again
        record = json.loads(diverged.read_text())
        raise TrainingDivergedError(record["message"], record["step"])
    if not (same_config and done.is_file()):
        train(cfg, folder, bundle=bundle)
    return cfg, folder, load_file(done, what="predictions file")


def _laplace_predictions(cfg: TrainConfig, folder: Path, bundle, keys) -> dict:
    """Sample logits of a last-layer Laplace fitted post hoc on the trained run in ``folder``."""
    from gpattn.laplace import fit_last_layer_laplace, laplace_torch_available
    from gpattn.training import CHECKPOINT, _load_checkpoint, build_model

    model = build_model(cfg, bundle)
    model.load_state_dict(_load_checkpoint(folder / CHECKPOINT)["model"])
    backend = "laplace-torch" if laplace_torch_available() else "dense"
    la = fit_last_layer_laplace(model, bundle.splits["train"], backend=backend)
    g = torch.Generator().manual_seed(cfg.seed)
    return {
        k: {
            "logits": la.predict_logits(bundle.splits[k], cfg.num_samples, generator=g),
            "labels": bundle.splits[k].labels,
        }
        for k in keys
    }


def _log(message: str) -> None:
    print(message, flush=True)


def compare(variants, seeds, out, base: TrainConfig, progress: bool = True, log=_log) -> dict:
    """Train / evaluate every variant spec for every seed; write ``results.json``, ``report.md`` and
    the plots under ``out``; return the results dict ``{spec: {seed: metrics}}``."""
    from gpattn import metrics as M
    from gpattn.data import load_dataset

    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) or len(set(seeds)) < len(seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct ints, got {seeds!r}")
    specs = expand_variants(variants)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    plot_preds: dict[str, tuple] = {}
    bundles: dict[int, object] = {}
    for spec in specs:
        results[spec.spec] = {}
        for seed in seeds:
            if seed not in bundles:
                bundles[seed] = load_dataset(
                    base.dataset, data_dir=base.data_dir, download=base.download, seed=seed, **base.dataset_options
                )
            bundle = bundles[seed]
            log(f"[compare] {spec.spec} seed {seed}")
            members = []
            try:
                collapse = []
                for j in range(spec.ensemble):
                    cfg, folder, member = _run(
                        base, spec.attention, spec.mcdropout, seed + 1000 * j, out, bundle, progress
                    )
                    members.append(_laplace_predictions(cfg, folder, bundle, member) if spec.laplace else member)
                    if (folder / COLLAPSE).is_file():  # gpattn.diagnostics: a collapsed layer or the base rate
                        collapse += json.loads((folder / COLLAPSE).read_text())["warnings"]
            except TrainingDivergedError as err:  # one diverged run must not end the whole comparison
                log(f"[compare] {spec.spec} seed {seed}: {err}")
                results[spec.spec][str(seed)] = {"diverged": {"step": err.step, "message": str(err)}} | {
                    split: {} for split in bundle.eval_splits
                }
                continue
            # deep ensemble: pool every member's samples (equal P, so this averages member predictions)
            preds = {
                k: {"logits": torch.cat([m[k]["logits"] for m in members], dim=1), "labels": members[0][k]["labels"]}
                for k in members[0]
            }
            temperature = 1.0
            if spec.ts:
                temperature = float(M.temperature_scale(preds["val"]["logits"], preds["val"]["labels"]))
            metrics = evaluate_predictions(preds, bundle, base.average, temperature)
            if spec.ts:
                metrics["temperature"] = temperature
            if collapse:
                metrics["collapse"] = collapse
                log(f"[compare] {spec.spec} seed {seed}: collapse: " + "; ".join(collapse))
            results[spec.spec][str(seed)] = metrics
            if seed == seeds[0]:
                plot_preds[spec.spec] = (preds, temperature, bundle)
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    _plots(plot_preds, out, base.average)
    write_report(results, out / "report.md", base, seeds, bundles[seeds[0]])
    return results


def _plots(plot_preds, out: Path, average: str) -> None:
    from gpattn import metrics as M
    from gpattn import plots

    curves, ood = {}, {}
    for spec, (preds, temperature, bundle) in plot_preds.items():

        def probs(split, preds=preds, temperature=temperature):
            return M.average_samples(preds[split]["logits"] / temperature, average=average)

        test = bundle.eval_splits["in_domain"]
        p_in = probs(test)
        labels = preds[test]["labels"]
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)
        plots.reliability_diagram(p_in, labels, out / f"reliability_{safe}.png", title=f"{spec} (in-domain)")
        curves[spec] = (p_in, labels)
        for name in bundle.ood_splits:
            p_out = probs(bundle.eval_splits[name])
            ood[spec] = (M.ood_scores(p_in, "max_prob"), M.ood_scores(p_out, "max_prob"))
    plots.risk_coverage(curves, out / "risk_coverage.png", title="risk–coverage (in-domain)")
    if ood:
        plots.ood_histograms(ood, out / "ood_histograms.png", title="max-probability scores: in-domain vs OOD")


def _diverged_seeds(per_seed: dict, seeds) -> list:
    return [s for s in seeds if "diverged" in per_seed[str(s)]]


def _collapsed_seeds(per_seed: dict, seeds) -> list:
    return [s for s in seeds if per_seed[str(s)].get("collapse")]


def _label(spec: str, per_seed: dict, seeds) -> str:
    """The row name, flagged when some seeds diverged (their cells are left out of mean ± std) or
    collapsed (a GP layer's mean under its noise, or training at the base rate: gpattn.diagnostics)."""
    flags = []
    bad = _diverged_seeds(per_seed, seeds)
    if bad:
        flags.append(f"diverged: {len(bad)}/{len(seeds)} seeds")
    collapsed = _collapsed_seeds(per_seed, seeds)
    if collapsed:
        flags.append(f"collapse: {len(collapsed)}/{len(seeds)} seeds")
    return f"{spec} ({'; '.join(flags)})" if flags else spec


def _collapse_notes(results: dict, seeds) -> list:
    notes = [
        f"- {spec}, seed {s}: {msg}"
        for spec, per_seed in results.items()
        for s in _collapsed_seeds(per_seed, seeds)
        for msg in per_seed[str(s)]["collapse"]
    ]
    return ["## Collapse warnings", "", *notes, ""] if notes else []


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
LOWER_IS_BETTER = {"nll": True, "ece": True, "aurc": True, "accuracy": False, "mcc": False, "auroc": False,
                   "ood_auroc": False}


def _split_columns(split: str, results: dict, seeds, bundle) -> tuple:
    """The metrics report.md shows for ``split``: MCC only for text, and an unlabelled OOD split only
    its detection metrics."""
    default = REPORT_COLUMNS["ood"] if split in bundle.ood_splits else ("accuracy", "nll", "ece")
    cols = REPORT_COLUMNS.get(split, default)
    if bundle.kind == "image":
        cols = tuple(c for c in cols if c != "mcc")
    if split in bundle.ood_splits and not any(
        results[s][str(seed)][split].get("accuracy") is not None for s in results for seed in seeds
    ):
        cols = tuple(c for c in cols if c.startswith("ood_"))
    return cols


def _against_reference(results: dict, seeds, split: str, cols, reference: str = "softmax") -> list:
    """Paired differences to the reference (MSP) per seed on ``split``: mean ± std of (variant −
    reference) and in how many seeds the variant is better. Empty when the reference was not run."""
    if reference not in results:
        return []
    lines = [
        f"## Against {reference} (MSP), {split}",
        "",
        f"Paired over seeds: mean ± std of (variant − {reference}); `k/n` = seeds in which the variant is "
        "better (lower NLL/ECE/AURC, higher accuracy/MCC/AUROC).",
        "",
        "| variant | " + " | ".join(f"Δ {c}" for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for spec, per_seed in results.items():
        if spec == reference:
            continue
        cells = []
        for col in cols:
            pairs = [(per_seed[str(s)][split].get(col), results[reference][str(s)][split].get(col)) for s in seeds]
            diffs = [v - r for v, r in pairs if v is not None and r is not None]
            better = sum((d < 0) if LOWER_IS_BETTER[col] else (d > 0) for d in diffs)
            sign = "+" if diffs and np.mean(diffs) >= 0 else ""
            cells.append(f"{sign}{_fmt(diffs)} ({better}/{len(diffs)})" if diffs else "–")
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_report(results: dict, path: Path, base: TrainConfig, seeds, bundle) -> None:
    """report.md: one table per evaluation split, mean ± std (sample std) over seeds; fractions."""
    lines = [
        f"# gpattn compare — {base.dataset}",
        "",
        f"Seeds {list(seeds)}; {base.num_layers} layers, width {base.embed_dim}, {base.num_heads} heads, "
        f"{base.epochs} epochs, batch {base.batch_size}, lr {base.lr}; {base.num_samples} Monte-Carlo samples, "
        f"predictions averaged over {base.average}.",
        f"Objective: β = {base.beta:g}, α = {base.alpha:g}, η = {base.eta:g}, KL scaling {base.kl_scaling!r}"
        + (" (the exact ELBO weights)." if base.beta == base.alpha == 1 else " (tempered: β = α = 1 is the ELBO)."),
        "Values are fractions (not percent), mean ± std over seeds. AUROC = failure prediction (in-domain), "
        "ood_auroc = OOD detection with the max-probability score. `+ts` = temperature scaling on the "
        "validation split, `+laplace` = last-layer Laplace, `+mcdropout` = MC dropout, `+ensN` = deep ensemble "
        "of N models.",
        "",
    ]
    columns = {split: _split_columns(split, results, seeds, bundle) for split in bundle.eval_splits}
    for split, cols in columns.items():
        lines += [f"## {split}", "", "| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for spec, per_seed in results.items():
            cells = [_fmt([per_seed[str(s)][split].get(c) for s in seeds]) for c in cols]
            lines.append(f"| {_label(spec, per_seed, seeds)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _diverged_notes(results, seeds)
    lines += _collapse_notes(results, seeds)
    for split, cols in columns.items():
        lines += _against_reference(results, seeds, split, cols)
    lines += [
        "## Plots",
        "",
        "- `risk_coverage.png`, `ood_histograms.png`, `reliability_<variant>.png` (first seed)",
        "",
    ]
    Path(path).write_text("\n".join(lines))
