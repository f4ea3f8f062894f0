"""``gpattn compare``: train variants over seeds, add the post-hoc baselines, write a report.

A *variant spec* is a registered attention name with optional modifiers:
``softmax+ts`` (post-hoc temperature scaling fitted on the validation split, Guo et al. 2017),
``softmax+laplace`` (post-hoc last-layer Laplace, :mod:`gpattn.experiments.laplace`; laplace-torch when installed,
else the dense float64 back end),
``softmax+mcdropout`` (dropout kept on at prediction), ``softmax+sngp`` (SNGP, Liu et al. 2020: spectral-normalised
blocks — none on a pretrained encoder, as BERT-SNGP — and a random-feature GP head with a Laplace covariance,
:mod:`gpattn.experiments.sngp`; a training-time change, so it trains a run of its own), ``softmax+ens5`` (deep
ensemble of 5
independently seeded models: the seed run plus members seeded ``seed + 1000·j``). Modifiers combine
(``kep-svgp+ens5``). Attention options for one variant go in brackets after its name, comma-separated
``key=value`` pairs: ``sto[tau=2]``, ``h-sto[tau1=1,tau2=20]+ts`` (values are Python literals, else
strings); ``--attention-option`` applies to every variant that takes the option and is left out, with a
note, for the others. Runs are cached under ``OUT/runs/<name>/seed<S>``: a finished run is reused only
if its configuration and its data (the content fingerprint in its ``data.json``, so an edited data file
is noticed) are the same, and the log says "reused" or "trained" (and why) for every run, so ``+ts``
and ensembles cost no retraining of the members they share.

``alpha_grid`` (``--alpha-grid``, a preset's ``alpha_grid``) selects the CGP regulariser weight α on the
validation split, as Bui et al. (Remark 3) choose it: every run of a variant whose objective has the
regulariser (cgp, scgp: a layer that records a :class:`gpattn.objectives.CGPRegulariser`) is trained once per
α of the grid, under ``OUT/runs/<name>/alpha=<α>/seed<S>``, and the one with the lowest validation NLL is that
run (per seed and per ensemble member); results.json records the chosen ``alpha`` and every candidate's
validation NLL (``alpha_selection``), report.md the chosen α per seed. The other variants train once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from gpattn.attention.registry import attention_class, attention_options, build_attention
from gpattn.experiments._compare_guard import OVERWRITE, check_out_folder, check_replace, earlier_rows_note
from gpattn.experiments._estimate import RunPlan, report_seconds
from gpattn.experiments._io import CHECKPOINT_FORMAT, checkpoint_format, load_file
from gpattn.experiments._runs import CHECKPOINT, load_checkpoint, resolve_device
from gpattn.experiments._variants import (  # noqa: F401  (BASELINES re-exported)
    BASELINES,
    VariantSpec,
    expand_variants,
    parse_variant,
    split_variants,
)
from gpattn.experiments.report import REPORT_COLUMNS, _plots, write_report  # noqa: F401  (write_report re-exported)
from gpattn.experiments.sngp import sngp_options
from gpattn.experiments.training import (
    COLLAPSE,
    DIVERGED,
    TrainConfig,
    TrainingDivergedError,
    _for_model,
    _same_run,
    evaluate_predictions,
    train,
)
from gpattn.objectives import CGPRegulariser, named_added_loss_terms

__all__ = ["VariantSpec", "compare", "expand_variants", "parse_variant", "probe_runs", "split_variants",
           "write_report"]


def _run(
    base: TrainConfig, spec: VariantSpec, seed: int, root: Path, bundle, progress: bool, fingerprint, log, trained: set,
    alpha: float | None = None, plan: RunPlan | None = None,
):
    """(config, folder, predictions) of one trained run: reused when its configuration and data are the
    same as now, else trained (its folder added to ``trained``); the log line says which and why. ``alpha``:
    one candidate of an α grid (the run's own folder ``<name>/alpha=<α>``), else the base's α. ``plan``: the
    call's runs, which say "run k of n", the run's estimate and the time left."""
    cfg = _run_config(base, spec, seed, progress, alpha)
    folder = _seed_folder(root, spec, seed, alpha)
    label = f"{spec.run_name} seed {seed}" if alpha is None else f"{spec.run_name} α={alpha:g} seed {seed}"
    plan = plan or RunPlan([folder], lambda line: None, lambda f: False)
    timed = dict(log=log, estimate=plan.estimated(folder, label), header=False)  # epoch and split lines, estimate
    done, diverged = folder / "predictions.pt", folder / DIVERGED
    # up to the settings that do not change the result (training.RUN_SETTINGS: e.g. the device)
    config_file = folder / "config.json"
    same_config = config_file.is_file() and _same_run(json.loads(config_file.read_text()), cfg)[0]
    data_file = folder / "data.json"
    old_print = json.loads(data_file.read_text()).get("fingerprint") if data_file.is_file() else None
    same_data = old_print == fingerprint
    if same_config and same_data and diverged.is_file():  # a deterministic rerun would diverge again
        record = json.loads(diverged.read_text())
        log(f"[compare]   {label}: reused (diverged before with this configuration and data)")
        plan.finish(folder, label, reused=True)
        raise TrainingDivergedError(record["message"], record["step"])
    ckpt_file = folder / "checkpoint.pt"
    old_format = done.is_file() and ckpt_file.is_file() and not _current_format(ckpt_file)
    if same_config and same_data and done.is_file() and not old_format:
        log(f"[compare]   {label}: reused {folder} (same configuration and data)")
        plan.finish(folder, label, reused=True)
    elif same_data and not done.is_file() and (step := _resumable(folder, cfg)) is not None:
        log(f"[compare]   {label}: resumed from its checkpoint at step {step[0]} ({step[1]} of "
            f"{cfg.epochs} epochs done; interrupted before, same configuration and data) -> {folder}")
        plan.start(folder, label)
        train(cfg, folder, bundle=bundle, resume=True, **timed)
        trained.add(folder)
        plan.finish(folder, label, reused=False)
    else:
        why = (
            "no finished run" if not done.is_file() and not diverged.is_file()
            else "written by an older gpattn: another checkpoint format" if old_format
            else "configuration changed" if not same_config
            else "data changed" if old_print is not None
            else "no data fingerprint recorded"
        )
        if not done.is_file() and (folder / CHECKPOINT).is_file():
            why += "; its checkpoint is from another configuration or data, so it starts from scratch"
        check_replace(folder, label, why, done.is_file() and not old_format)  # finished: replaced with overwrite
        log(f"[compare]   {label}: trained ({why}) -> {folder}")
        plan.start(folder, label)
        train(cfg, folder, bundle=bundle, **timed)
        trained.add(folder)
        plan.finish(folder, label, reused=False)
    return cfg, folder, load_file(done, what="predictions file")


def _run_config(base: TrainConfig, spec: VariantSpec, seed: int, progress: bool, alpha: float | None) -> TrainConfig:
    """The ``TrainConfig`` of ``spec``'s run of ``seed`` (``base`` with the variant's own settings applied)."""
    return dataclasses.replace(
        base, attention=spec.attention, attention_options=_spec_options(base, spec), mc_dropout=spec.mcdropout,
        seed=seed, sngp=sngp_options(base.encoder is not None) if spec.sngp else None,
        progress=progress,
        **({} if alpha is None else {"alpha": alpha}),
    )


class _Probed(Exception):
    """Raised by ``probe_runs``' estimate callback: the run's estimate is all the probe wanted."""

    def __init__(self, estimate):
        super().__init__("probed")
        self.estimate = estimate


def probe_runs(configs: dict, bundle, log=None) -> dict:
    """``{key: seconds}``: each ``configs[key]`` run's estimated time (training and evaluation) from its own first
    steps and one evaluation pass (``train``'s estimate, ``gpattn.experiments._estimate``), measured now, before
    any run: nothing is written and the run stops there. ``compare`` counts the variants it has not timed yet at
    these seconds (scaled by the timed variants' ratio of measured to probed time) rather than at the mean of the
    timed ones, which was +165 % off when the slowest variant ran first (docs/benchmarks.md). A probe that fails is
    logged (``log``: default print) and its key left out (it counts at the mean)."""
    log, seconds = log or _log, {}
    for key, cfg in configs.items():

        def stop(estimate):
            raise _Probed(estimate)

        try:
            train(cfg, None, bundle=bundle, estimate=stop, header=False, log=lambda line: None)
        except _Probed as probed:
            seconds[key] = probed.estimate.total
        except Exception as err:  # noqa: BLE001  (an estimate must not stop the comparison; the run will say why)
            log(f"[compare] {cfg.attention}: no probe of its first steps ({type(err).__name__}: {err}); its runs "
                "count at the mean of the timed ones until one is timed")
    return seconds


def _selected_run(
    base: TrainConfig, spec: VariantSpec, seed: int, root: Path, bundle, progress: bool, fingerprint, log, trained: set,
    grid: tuple[float, ...], plan: RunPlan | None = None,
):
    """(config, folder, predictions, selection) of one run; with an α ``grid``, the candidate with the lowest
    validation NLL (probabilities averaged over the samples, as evaluated) and ``selection`` = ``{"alpha":
    chosen, "val_nll": {α: NLL or "diverged"}}``, else :func:`_run`'s run and ``None``. A candidate that
    diverges is left out of the choice; a ``TrainingDivergedError`` only when every candidate diverged."""
    from gpattn.experiments import metrics as M

    if not grid:
        return (*_run(base, spec, seed, root, bundle, progress, fingerprint, log, trained, plan=plan), None)
    scores, runs, error = {}, {}, None
    for alpha in grid:
        try:
            runs[alpha] = _run(
                base, spec, seed, root, bundle, progress, fingerprint, log, trained, alpha=alpha, plan=plan
            )
        except TrainingDivergedError as err:
            scores[f"{alpha:g}"], error = "diverged", err
            continue
        val = runs[alpha][2]["val"]
        known = val["labels"] >= 0
        probs = M.average_samples(val["logits"][known], average=base.average)
        scores[f"{alpha:g}"] = M.nll(probs, val["labels"][known])
    if not runs:
        raise error
    best = min(runs, key=lambda a: scores[f"{a:g}"])
    shown = ", ".join(f"α={a}: {v if isinstance(v, str) else f'{v:.4f}'}" for a, v in scores.items())
    log(f"[compare]   {spec.run_name} seed {seed}: α = {best:g} chosen on the validation NLL ({shown})")
    return (*runs[best], {"alpha": best, "val_nll": scores})


def _current_format(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is of this gpattn's format (a run cached by an older gpattn may
    be of another model under the same configuration: CHANGELOG.md)."""
    return checkpoint_format(load_file(path)) == CHECKPOINT_FORMAT


def _seed_folder(root: Path, spec: VariantSpec, seed: int, alpha: float | None = None) -> Path:
    """One run's folder: ``<variant>/seed<S>``, or ``<variant>/alpha=<α>/seed<S>`` for a candidate of an α grid."""
    return _run_folder(root, spec) / ("" if alpha is None else f"alpha={alpha:g}") / f"seed{seed}"


def _run_folder(root: Path, spec: VariantSpec) -> Path:
    """A variant's folder under ``root/runs``: :attr:`VariantSpec.folder_name`, or the run name itself where an
    earlier gpattn wrote it so (``sgpa-rff[gp_input=sequence]``) and the new name is not there."""
    new, old = root / "runs" / spec.folder_name, root / "runs" / spec.run_name
    return old if old != new and old.is_dir() and not new.exists() else new


def _resumable(folder: Path, cfg: TrainConfig):
    """(step, epochs done) of an interrupted run's checkpoint in ``folder`` written with ``cfg``'s
    configuration, or None (no checkpoint, another configuration, an unreadable file)."""
    path = folder / CHECKPOINT
    if not path.is_file():
        return None
    try:
        ckpt = load_checkpoint(path)
    except ValueError:
        return None
    if not _same_run(ckpt["config"], cfg)[0]:
        return None
    return int(ckpt.get("step", 0)), len(ckpt.get("history", []))


def _laplace_predictions(cfg: TrainConfig, folder: Path, bundle, keys) -> dict:
    """Sample logits of a last-layer Laplace fitted post hoc on the trained run in ``folder``."""
    from gpattn.experiments.laplace import fit_last_layer_laplace, laplace_torch_available
    from gpattn.experiments.training import model_for_checkpoint

    device = resolve_device(cfg.device)
    model, bundle = model_for_checkpoint(cfg, bundle, load_checkpoint(folder / CHECKPOINT, map_location=device), device)
    # the dense back end computes the full Hessian (laplace-torch's default is K-FAC "kron")
    backend, structure = ("laplace-torch", "kron") if laplace_torch_available() else ("dense", "full")
    la = fit_last_layer_laplace(model, bundle.splits["train"], backend=backend, hessian_structure=structure)
    g = torch.Generator().manual_seed(cfg.seed)
    return {
        k: {
            "logits": la.predict_logits(bundle.splits[k], cfg.num_samples, generator=g),
            "labels": bundle.splits[k].labels,
            **_member_detector_scores([keys], k),  # last-layer Laplace keeps the run's features: its detectors'
        }
        for k in keys
    }


def _member_detector_scores(members: list, key: str) -> dict:
    """``{"detector_scores": ..., "own_scores": ...}`` of split ``key`` (each entry of
    :data:`gpattn.experiments.metrics.PREDICTION_SCORE_ENTRIES` the members have): each score averaged over the
    members that all have it (one member: its own); an entry is left out when some member has none (e.g. a run from
    before the detectors, a member without a readout)."""
    from gpattn.experiments.metrics import PREDICTION_SCORE_ENTRIES

    out = {}
    for entry in PREDICTION_SCORE_ENTRIES:
        found = [m[key].get(entry) for m in members]
        if any(f is None for f in found):
            continue
        names = set.intersection(*(set(f) for f in found))
        out[entry] = {n: torch.stack([f[n] for f in found]).mean(0) for n in sorted(names)}
    return out


def _readout_predictions(cfg: TrainConfig, folder: Path, bundle, keys) -> tuple[dict, dict]:
    """The run's predictions ``keys`` (``{split: {"logits", "labels", ...}}``) with the logits of the trained run in
    ``folder`` read out through a GP on its pooled features (``+gpreadout``): fitted on the training split, (s, λ)
    chosen on the validation NLL (:mod:`gpattn.experiments.readout`)."""
    from gpattn.experiments.readout import readout_predictions
    from gpattn.experiments.training import model_for_checkpoint

    device = resolve_device(cfg.device)
    model, bundle = model_for_checkpoint(cfg, bundle, load_checkpoint(folder / CHECKPOINT, map_location=device), device)
    preds, selection = readout_predictions(model, bundle, list(keys), cfg.num_samples, average=cfg.average,
                                           seed=cfg.seed, batch_size=cfg.eval_batch_size)
    # the readout changes the logits only: whatever else the run recorded per split is kept
    return {k: {**keys[k], **preds[k]} for k in preds}, selection


def _log(message: str) -> None:
    print(message, flush=True)


def compare(
    variants, seeds, out, base: TrainConfig, progress: bool = True, log=_log, ood_scores=("msp",),
    variant_options: dict | None = None, budget_minutes: float | None = None, variant_settings: dict | None = None,
    alpha_grid=None, overwrite: bool = False,
) -> dict:
    """Train / evaluate every variant spec for every seed; write ``results.json``, ``data.json``,
    ``report.md`` and the plots under ``out``; return the results dict ``{spec: {seed: metrics}}``.

    ``ood_scores``: the OOD scores (:data:`gpattn.experiments.metrics.OOD_SCORE_NAMES`) shown in report.md and the
    histograms (every score is in results.json). ``variant_options``: per-variant default options
    (a preset's), beneath the options a spec gives in brackets. ``budget_minutes``: the time a preset states
    for itself (on 2 CPU cores), printed in report.md beside the measured wall time. ``variant_settings``:
    per-variant ``TrainConfig`` fields (a preset's, ``{name: {field: value}}``) for every run of that
    attention, its post-hoc and ensemble modifiers included; report.md lists them. ``alpha_grid``: candidate
    values of the CGP regulariser weight α, chosen per run on the validation NLL for the variants whose
    objective has the regulariser (the module docstring); None = ``base.alpha`` for every run. ``overwrite``: replace
    finished runs of another configuration or data (else an error)."""
    from gpattn.experiments import metrics as M
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.data.summary import data_summary, summary_lines
    from gpattn.experiments.laplace import laplace_torch_available

    started, _ = time.perf_counter(), OVERWRITE.set(overwrite)
    runs, trained = set(), set()  # every run folder of this call, and those trained by it (not reused)
    readout_fits = {}  # +gpreadout per run folder: x+gpreadout and x+gpreadout+ts share one fit and its predictions
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds) or len(set(seeds)) < len(seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct ints, got {seeds!r}")
    ood_scores = [ood_scores] if isinstance(ood_scores, str) else list(ood_scores)
    for score in ood_scores:
        M.ood_score_key(score, "ood_auroc")  # ValueError listing the accepted names
    specs = expand_variants(variants, variant_options)
    variant_settings = _check_variant_settings(variant_settings, base)
    notes = _option_notes(specs, base)
    for name, own in variant_settings.items():
        if own and any(s.attention == name for s in specs):
            shown = ", ".join(f"{k} = {v!r}" for k, v in own.items())
            notes.append(f"`{name}` runs with its own settings (every spec of it): {shown}; the others with the base.")
    takers = _check_specs(specs, base)
    grid = _check_alpha_grid(alpha_grid, takers, variant_settings)
    if grid and takers & {s.attention for s in specs}:
        notes.append(
            f"α (the CGP regulariser weight) of {sorted(takers & {s.attention for s in specs})} is chosen per run "
            f"from {list(grid)} on the validation split's NLL (every candidate trained; the choice per seed is "
            f"below); the other variants do not use α."
        )
    for note in notes:
        log(f"[compare] {note}")
    if any(s.laplace for s in specs) and not laplace_torch_available():
        notes.append("`+laplace`: laplace-torch is not installed, so the last-layer Laplace was fitted with gpattn's "
                     "dense float64 back end (full Hessian of the last layer; laplace-torch would use K-FAC).")
        log(f"[compare] {notes[-1]}")
    out = check_out_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    runs_of = {_seed_folder(out, s, seed + 1000 * j, a): (s, a) for s in specs for seed in seeds
               for j in range(s.ensemble) for a in (grid if grid and s.attention in takers else (None,))}
    plan = RunPlan(list(runs_of), log, lambda folder: (folder / "predictions.pt").is_file())
    results: dict[str, dict[str, dict]] = {}
    plot_preds: dict[str, dict] = {}
    bundles: dict[int, object] = {}
    summaries: dict[int, dict] = {}

    def bundle_of(seed: int):
        if seed not in bundles:
            bundle = load_dataset(
                base.dataset, data_dir=base.data_dir, download=base.download, seed=seed, **base.dataset_options
            )
            # re-tokenised by an encoder's tokenizer (--encoder); the frozen trunk runs on the runs' device
            bundles[seed] = _for_model(base, bundle, resolve_device(base.device))
            summaries[seed] = data_summary(bundles[seed])
            if len(summaries) == 1:
                for line in summary_lines(summaries[seed]):
                    log(f"[compare] data (seed {seed}): {line[2:]}")
            else:
                sizes = ", ".join(f"{k} {n}" for k, n in summaries[seed]["sizes"].items())
                log(f"[compare] data (seed {seed}): {sizes}; fingerprint {summaries[seed]['fingerprint']}")
        return bundles[seed]

    _plan_priors(plan, runs_of, base, variant_settings, seeds[0], bundle_of(seeds[0]), progress, len(specs),
                 ood_scores, log)
    for spec in specs:
        results[spec.spec] = {}
        for seed in seeds:
            bundle = bundle_of(seed)
            log(f"[compare] {spec.spec} seed {seed}")
            members = []
            try:
                collapse, chosen, readouts = [], [], []
                for j in range(spec.ensemble):
                    cfg, folder, member, selection = _selected_run(
                        dataclasses.replace(base, **variant_settings.get(spec.attention, {})), spec, seed + 1000 * j,
                        out, bundle, progress, summaries[seed]["fingerprint"], log, trained,
                        grid if spec.attention in takers else (), plan,
                    )
                    if selection is not None:
                        chosen.append(selection)
                    runs.add(folder)
                    if spec.gpreadout:
                        if folder not in readout_fits:
                            readout_fits[folder] = _readout_predictions(cfg, folder, bundle, member)
                        member, readout = readout_fits[folder]
                        readouts.append(readout)
                        log(f"[compare]   {spec.spec} seed {seed + 1000 * j}: readout λ = "
                            f"{readout['mean_field_factor']:g} chosen on the validation NLL")
                    members.append(_laplace_predictions(cfg, folder, bundle, member) if spec.laplace else member)
                    # gpattn.experiments.diagnostics: a collapsed layer or the base rate
                    if (folder / COLLAPSE).is_file():
                        collapse += json.loads((folder / COLLAPSE).read_text())["warnings"]
            except TrainingDivergedError as err:  # one diverged run must not end the whole comparison
                log(f"[compare] {spec.spec} seed {seed}: {err}")
                results[spec.spec][str(seed)] = {"diverged": {"step": err.step, "message": str(err)}} | {
                    split: {} for split in bundle.eval_splits
                }
                continue
            # deep ensemble: pool every member's samples (equal P, so this averages member predictions)
            preds = {k: {"logits": torch.cat([m[k]["logits"] for m in members], dim=1),
                         "labels": members[0][k]["labels"], **_member_detector_scores(members, k)}
                     for k in members[0]}
            temperature = 1.0
            if spec.ts:
                temperature = float(M.temperature_scale(preds["val"]["logits"], preds["val"]["labels"]))
            metrics = evaluate_predictions(preds, bundle, base.average, temperature)
            if spec.ts:
                metrics["temperature"] = temperature
            if chosen:  # one selection per ensemble member
                one = len(chosen) == 1
                metrics["alpha"] = chosen[0]["alpha"] if one else [c["alpha"] for c in chosen]
                metrics["alpha_selection"] = chosen[0]["val_nll"] if one else [c["val_nll"] for c in chosen]
            if readouts:  # one readout per ensemble member
                metrics["readout"] = readouts[0] if len(readouts) == 1 else readouts
            if collapse:
                metrics["collapse"] = collapse
                log(f"[compare] {spec.spec} seed {seed}: collapse: " + "; ".join(collapse))
            results[spec.spec][str(seed)] = metrics
            plot_preds.setdefault(spec.spec, {})[seed] = (preds, temperature, bundle)
    notes += earlier_rows_note(out / "results.json", results, log)  # rows of an earlier call not in this one
    (out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    data = {"seeds": {str(s): summaries[s] for s in seeds}, "ood_scores": ood_scores, "notes": notes}
    (out / "data.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    plot_notes = _plots(plot_preds, out, base.average, ood_scores)
    write_report(
        results, out / "report.md", base, seeds, bundles[seeds[0]], summaries=summaries, ood_scores=ood_scores,
        notes=notes, plot_notes=plot_notes, specs=specs, elapsed=time.perf_counter() - started, budget=budget_minutes,
        trained=(len(trained), len(runs)),
    )
    return results


def _plan_priors(plan: RunPlan, runs_of: dict, base, variant_settings: dict, seed: int, bundle, progress: bool,
                 n_specs: int, ood_scores, log) -> None:
    """Give ``plan`` its priors (``probe_runs`` of one run of every variant not finished, when there are two or
    more) and the report's seconds (the figures of its ``n_specs`` rows: ``gpattn.experiments.report._plots``)."""
    configs = {}
    for folder, (spec, alpha) in runs_of.items():
        key = plan.keys[folder]
        if key is not None and key not in configs:
            configs[key] = _run_config(dataclasses.replace(base, **variant_settings.get(spec.attention, {})), spec,
                                       seed, progress, alpha)
    if len(configs) > 1:
        started = time.perf_counter()
        plan.prior = probe_runs(configs, bundle, log)
        log(f"[compare] timed the first steps of {len(plan.prior)} variants in "
            f"{time.perf_counter() - started:.0f} s: the estimate of the runs not timed yet")
    labelled = sum(bool((bundle.splits[key].labels >= 0).any()) for key in bundle.eval_splits.values())
    figures = n_specs * (1 + labelled) + 1 + (len(ood_scores) if bundle.ood_splits else 0)
    plan.report = report_seconds(figures)


#: TrainConfig fields a variant's own settings may not set (compare sets them per spec and seed)
_PER_SPEC_FIELDS = ("attention", "attention_options", "mc_dropout", "seed", "progress", "dataset", "dataset_options",
                    "data_dir", "download", "encoder", "encoder_recipe", "encoder_max_len")


def _check_variant_settings(variant_settings: dict | None, base: TrainConfig) -> dict:
    """``{name: {TrainConfig field: value}}`` checked: registered names, fields that exist and may differ
    between the variants of one comparison (not the data or the encoder: every variant reads the same
    bundle), values that make a valid TrainConfig."""
    settings = dict(variant_settings or {})
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for name, own in settings.items():
        attention_class(name)  # ValueError listing the valid names
        if not isinstance(own, dict):
            raise ValueError(f"variant_settings[{name!r}] must be a dict of TrainConfig fields, got {own!r}")
        bad = sorted(set(own) - fields)
        if bad:
            raise ValueError(f"variant_settings[{name!r}]: unknown TrainConfig fields {bad}")
        fixed = sorted(set(own) & set(_PER_SPEC_FIELDS))
        if fixed:
            raise ValueError(
                f"variant_settings[{name!r}]: {fixed} cannot differ between the variants of one comparison "
                f"(set per spec and seed, or shared data); use the base configuration"
            )
        dataclasses.replace(base, **own)  # the TrainConfig's own checks
    return settings


def _spec_options(base: TrainConfig, spec: VariantSpec) -> dict:
    """The attention options of one variant's runs: the ``--attention-option``s it takes, then its own."""
    options = {k: v for k, v in base.attention_options.items() if k in attention_options(spec.attention)}
    options.update(dict(spec.options))
    return options


def _check_specs(specs, base: TrainConfig) -> set[str]:
    """Build one layer of every variant with its options before anything trains, so that a bad option
    (e.g. a kernel a variant cannot take) fails at once instead of after the other variants' runs. With a
    pretrained encoder the layer has the encoder's width and heads (read from its config, not its weights).
    Returns the names of the variants whose objective weights a term by α: those whose layer records a
    :class:`gpattn.objectives.CGPRegulariser` in one training-mode forward of three tokens."""
    width, heads = base.embed_dim, base.num_heads
    if base.encoder is not None:
        from gpattn.experiments.encoders import encoder_shape

        width, heads = encoder_shape(base)
    takers = set()
    for spec in specs:
        try:
            layer = build_attention(spec.attention, width, heads, **_spec_options(base, spec))
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"variant {spec.spec!r} cannot be built with its options (nothing was trained): {err}"
            ) from err
        with torch.no_grad():
            layer.train()(torch.randn(1, 3, width, generator=torch.Generator().manual_seed(0)))
        if any(isinstance(term, CGPRegulariser) for _, term in named_added_loss_terms(layer)):
            takers.add(spec.attention)
    return takers


def _check_alpha_grid(alpha_grid, takers: set[str], variant_settings: dict) -> tuple[float, ...]:
    """The α grid as a tuple of distinct finite floats ≥ 0 (empty for None); a ``ValueError`` naming
    ``alpha_grid`` for anything else, and for a variant whose own settings fix α while the grid would choose it."""
    if alpha_grid is None:
        return ()
    values = [alpha_grid] if isinstance(alpha_grid, (int, float)) else list(alpha_grid)
    if (
        not values
        or any(isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0 for a in values)
        or len(set(values)) < len(values)
    ):
        raise ValueError(
            f"alpha_grid must be a non-empty list of distinct finite numbers >= 0 (e.g. 1e-5,1e-6), got {alpha_grid!r}"
        )
    fixed = sorted(name for name in takers if "alpha" in variant_settings.get(name, {}))
    if fixed:
        raise ValueError(
            f"alpha_grid chooses α for {fixed}, whose variant_settings set alpha too: keep one of the two"
        )
    return tuple(float(a) for a in values)


def _option_notes(specs, base: TrainConfig) -> list[str]:
    """``--attention-option``s apply to the variants that take them; say which variants leave one out,
    and refuse an option that no variant takes (a typo)."""
    given = dict(base.attention_options)
    if not given:
        return []
    takers = {k: [s.attention for s in specs if k in attention_options(s.attention)] for k in given}
    unused = sorted(k for k, names in takers.items() if not names)
    if unused:
        raise ValueError(
            f"attention option(s) {unused} apply to none of the variants {sorted({s.attention for s in specs})}; "
            f"set options for one variant as name[key=value], e.g. sto[tau=2]"
        )
    notes = []
    for k, names in takers.items():
        left = sorted({s.attention for s in specs} - set(names))
        if left:
            notes.append(f"attention option {k}={given[k]!r} applies to {sorted(set(names))}; left out for {left}")
    return notes
