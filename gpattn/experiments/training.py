"""Training and evaluation loops: seeded, resumable (atomic checkpoints), with tqdm progress.

``TrainConfig`` is everything a run depends on (it is written to ``config.json``); :func:`train`
fits a model, checkpoints (every epoch, and every ``checkpoint_every`` steps), and evaluates every
evaluation split of the data set with Monte-Carlo predictions, writing ``metrics.json`` (the
format is in the README) and ``predictions.pt`` (the sample logits of every split, so that post-hoc
temperature scaling and ensembles need no retraining).

Device: ``cfg.device`` (``--device auto|cpu|cuda[:N]``); ``cfg.precision`` ``bf16`` runs the model
under autocast. A training step reads nothing back from the device unless ``gpattn.validation()`` is
on (``--validate``): divergence is watched on the device (:class:`_DivergenceGuard`) and read at the
epoch end, a checkpoint or an interruption.

Multi-process: under ``torchrun --nproc_per_node=N -m gpattn train ...`` the model is wrapped in
``DistributedDataParallel`` (NCCL on GPUs, gloo on CPU); every rank walks the same global batch order
and takes rows ``rank::N`` of each global batch (a deterministic sharding equivalent to a
DistributedSampler over batches); each rank's loss is weighted by its shard's share, so N processes
take the same steps as one process with the same global batch. Rank 0 alone writes files and shows
progress; predictions are sharded and gathered, the epoch statistics summed over ranks.

Determinism and resume: the model is initialised from ``seed``; epoch e visits the training set in
the order ``randperm(N, generator=seed·1000003 + e)``; every rank's torch RNG states (CPU, and CUDA
on a GPU: attention samples, dropout) are saved in every checkpoint and each rank restores its own.
A resumed run therefore replays exactly the steps an uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gpattn import __version__
from gpattn._settings import is_validating
from gpattn._warnings import warn
from gpattn.experiments._config import RUN_SETTINGS, TrainConfig, _same_run  # noqa: F401  (re-exported)
from gpattn.experiments._data_check import load_checked_data, record_run_paths
from gpattn.experiments._dist import _Dist, _rng_state, _set_rng_state
from gpattn.experiments._estimate import TIMED_STEPS, StepClock, duration, over_an_hour, run_estimate
from gpattn.experiments._guard import TrainingDivergedError, _DivergenceGuard
from gpattn.experiments._io import CHECKPOINT_FORMAT, check_resumable
from gpattn.experiments._optim import build_optimizer
from gpattn.experiments._runlock import locked_run
from gpattn.experiments._runs import (  # _batch: re-exported, laplace and the benchmarks read it here
    CHECKPOINT,
    _batch,
    as_device,
    bundle_meta,
    fit_to_positions,
    load_checkpoint,
    model_positions,
    predict_rows,
    resolve_device,
    run_checkpoint,
    tokens_per_row,
)
from gpattn.experiments.diagnostics import (
    CollapseWarning,
    EpochStats,
    attention_use,
    base_rate_entropy,
    collapse_warnings,
)
from gpattn.experiments.features import detector_scores, fit_detectors, head_inputs, score_features
from gpattn.experiments.uncertainty import evaluate_predictions  # noqa: F401  (re-exported: compare, cli, tests)
from gpattn.models import EncoderSpec, TransformerClassifier, ViTClassifier
from gpattn.objectives import DeepGPELBO

__all__ = [
    "TrainConfig",
    "TrainingDivergedError",
    "atomic_save",
    "build_model",
    "evaluate_predictions",
    "load_run_with_data",
    "model_for_checkpoint",
    "predict",
    "predict_with_detectors",
    "train",
]

DIVERGED = "diverged.json"
#: sequences of the validation split on which each epoch measures every attention layer's attention use
ATTENTION_PROBE = 128
#: the collapse checks of a finished run (gpattn.experiments.diagnostics): base-rate entropy and warnings
COLLAPSE = "collapse.json"


def _autocast(device: torch.device, precision: str):
    """The model's autocast for ``precision`` on ``device`` (fp32: off)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


# ----------------------------------------------------------------------------- model and batches
#: ``torch.compile``'s options for a ``compile=True`` run's training forward: symbolic shapes, so text batches of
#: every length (each cut to its longest row) share one graph (docs/benchmarks.md, "Compiled training with varying
#: lengths")
COMPILE_OPTIONS = {"dynamic": True}
#: where ``attention_layers="auto"`` puts a variant (Chen et al. (2024) replaces only the last layer by KEP-SVGP)
AUTO_LAYERS = {"kep-svgp": "last"}


def build_model(cfg: TrainConfig, bundle, positions: int | None = None) -> torch.nn.Module:
    """The classifier for a data set: a transformer over token ids for text, a ViT for images, a
    pretrained encoder with ``cfg.encoder`` (gpattn.experiments.encoders). A text transformer's positional
    embedding covers ``positions`` tokens, by default the longest training sequence
    (:func:`gpattn.experiments._runs.model_positions`: train and val, never an evaluation file)."""
    if cfg.encoder is not None:
        from gpattn.experiments.encoders import build_encoder_model

        return _with_sngp(build_encoder_model(cfg, bundle), cfg)
    layers = AUTO_LAYERS.get(cfg.attention, "all") if cfg.attention_layers == "auto" else cfg.attention_layers
    # the config's encoder settings under their own names (EncoderSpec's), the layers resolved
    common = {name: getattr(cfg, name) for name in EncoderSpec.names()}
    common.update(attention_options=dict(cfg.attention_options), attention_layers=layers)
    if bundle.kind == "text":
        max_len = positions or model_positions(bundle)
        model = TransformerClassifier(
            bundle.num_classes, vocab_size=bundle.vocab_size, max_len=max_len, pooling=cfg.pooling or "mean", **common
        )
    elif bundle.kind == "image":
        C, Hpx, Wpx = bundle.image_shape
        patch = cfg.patch_size or (2 if Hpx <= 8 else 4)
        model = ViTClassifier(
            bundle.num_classes,
            image_shape=bundle.image_shape,
            patch_size=patch,
            pooling=cfg.pooling or "cls",
            **common,
        )
    else:
        raise ValueError(f"data set kind must be 'text' or 'image', got {bundle.kind!r}")
    return _with_sngp(model, cfg)


def _with_sngp(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """``model`` made an SNGP model with ``cfg.sngp`` (spectral normalisation of the scope it names and a
    random-feature GP head: gpattn.experiments.sngp), or as it is without."""
    if cfg.sngp is not None:
        from gpattn.experiments.sngp import apply_sngp

        apply_sngp(model, **cfg.sngp)
    return model


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.randperm(n, generator=g)


@torch.no_grad()
def predict(
    model, split, num_samples: int, batch_size: int = 256, dist: _Dist | None = None, precision: str = "fp32",
    progress: str | None = None, features: bool = False,
):
    """Sample logits of a whole split in eval mode, on the model's device (sharded over ranks under
    torchrun), returned on the CPU. Every evaluation (a run's own, ``gpattn evaluate``, ``Run.predict``) runs
    here, in passes of at most ``batch_size`` rows, fewer where P samples of long sequences would not fit the
    memory bound of :func:`gpattn.experiments._runs.predict_rows` (rows × samples × tokens). ``progress``: a
    tqdm bar over the passes with that description (an evaluation of cgp or sgpa at P samples can take
    minutes). ``features``: return ``(logits, features)``, the pooled features ``(N, D)`` read in the same
    passes (:func:`gpattn.experiments.features.head_inputs`: the mean over the P draws of a sampling model), for
    the feature detectors without a second pass.  # shape: (N, P, C)"""
    model.eval()
    n = len(split.labels)
    rows = torch.arange(n) if dist is None else dist.shard(torch.arange(n))
    device = next(model.parameters()).device
    out = []
    batch_size = predict_rows(batch_size, num_samples, tokens_per_row(model, split.inputs, split.mask))
    starts = range(0, len(rows), batch_size)
    bar = tqdm(starts, desc=progress, disable=progress is None, leave=False, dynamic_ncols=True, unit="batch")
    with head_inputs(model) if features else contextlib.nullcontext() as recorder:
        for start in bar:
            x, mask, _ = _batch(split, rows[start : start + batch_size], device)
            with _autocast(device, precision):
                out.append(model(x, mask, num_samples=num_samples).float())
    classes = getattr(model, "num_classes", 2)
    local = torch.cat(out).cpu() if out else torch.zeros(0, num_samples, classes)  # one copy to the host
    logits = local if dist is None else dist.gather_rows(local, n)
    if not features:
        return logits
    return logits, recorder.features() if dist is None else dist.gather_rows(recorder.features(), n)


def predict_with_detectors(
    model, split, num_samples: int, detectors: dict | None, batch_size: int = 256, dist: _Dist | None = None,
    precision: str = "fp32", progress: str | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`predict`'s sample logits of ``split`` and each fitted feature detector's scores of it
    (:func:`gpattn.experiments.features.score_features`; ``{}`` without detectors), from one pass where the
    evaluation's forward is the one the detectors were fitted on (their ``num_samples``, fp32: the features are
    the mean over the same P draws the logits are); else (another P, bf16) the features in a second pass at
    the detectors' ``num_samples`` (:func:`gpattn.experiments.features.detector_scores`, on forked random streams:
    the logits' draws are those of an evaluation without detectors). ``(N, P, C)`` logits, ``{name: (N,)}``."""
    fitted = detectors is not None and bool(detectors.get("states"))
    if fitted and detectors["num_samples"] == num_samples and precision == "fp32":
        logits, feats = predict(model, split, num_samples, batch_size, dist, precision, progress, features=True)
        return logits, score_features(detectors, feats)
    logits = predict(model, split, num_samples, batch_size, dist, precision, progress)
    if not fitted:
        return logits, {}
    with _forked(next(model.parameters()).device):
        return logits, detector_scores(model, split, detectors, batch_size)


# ----------------------------------------------------------------------------- checkpoints
def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename: a crash while saving
    never leaves a corrupt checkpoint behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_json(obj, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class _Interrupt:
    """SIGTERM / SIGINT while training request a stop at the next step boundary (so the checkpoint
    never holds a half-applied optimizer step); a second signal interrupts at once."""

    def __init__(self):
        self.requested: int | None = None
        self._old: dict = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt(f"signal {signum} (second)")
        self.requested = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def load_run_with_data(
    path, device=None, dataset_options: dict | None = None, data_dir=None
) -> tuple[TrainConfig, torch.nn.Module, object, dict]:
    """Load a checkpoint file (or a run folder) and reload its data set -> (config, model, data bundle,
    checkpoint dict), the model on ``device`` (``auto``/``cpu``/``cuda[:N]`` or a ``torch.device``; default:
    the CPU). ``dataset_options`` / ``data_dir`` replace the run's (moved data: ``path=...``); the data must
    still be the run's (its fingerprint, data.json). To score new inputs without the data files:
    :func:`gpattn.experiments.inference.load_run`."""
    device = torch.device("cpu") if device is None else as_device(device)
    path, ckpt = run_checkpoint(path, map_location=device)
    cfg = TrainConfig.from_saved(ckpt["config"])
    given = dict(dataset_options or {})
    cfg = dataclasses.replace(cfg, dataset_options={**cfg.dataset_options, **given},
                              data_dir=cfg.data_dir if data_dir is None else str(data_dir))
    # data.json: the files' recorded places, the fingerprint
    bundle = load_checked_data(path, cfg, lambda b: _for_model(cfg, b, device), explicit=set(given))
    model, bundle = model_for_checkpoint(cfg, bundle, ckpt, device)
    return cfg, model, bundle, ckpt


def model_for_checkpoint(cfg: TrainConfig, bundle, ckpt: dict, device) -> tuple[torch.nn.Module, object]:
    """The checkpoint's model on ``device`` and the bundle as it reads it: a text transformer is sized by the
    width the checkpoint records (``ckpt["data"]["model_max_len"]``; a run trained before the training splits
    alone sized it recorded the longest sequence of every split), longer sequences cut to it."""
    positions = None
    if cfg.encoder is None and bundle.kind == "text":
        meta = ckpt.get("data") or {}
        positions = meta.get("model_max_len") or max(int(s.inputs.shape[1]) for s in bundle.splits.values())
        bundle, _ = fit_to_positions(bundle, positions)
    model = build_model(cfg, bundle, positions).to(device)
    model.load_state_dict(ckpt["model"])
    return model, bundle


def _for_model(cfg: TrainConfig, bundle, device=None):
    """The data as the model reads it: re-tokenised by the encoder's tokenizer with ``cfg.encoder``, and
    with the frozen-trunk recipe the trunk's outputs in place of the token ids (the trunk run on
    ``device``, a ``torch.device``; default the CPU)."""
    if cfg.encoder is None:
        return bundle
    from gpattn.experiments.encoders import encoder_bundle, trunk_bundle

    bundle = encoder_bundle(bundle, cfg)
    return trunk_bundle(bundle, cfg, device=device) if cfg.encoder_recipe == "frozen-trunk" else bundle


# ----------------------------------------------------------------------------- the loop
#: the rows of HFClassifier.match_prior_to_stream of an encoder run with GP layers (in the run folder)
PRIOR_SCALE = "prior_scale.json"
#: training sequences the stream's scale is measured on
PRIOR_SCALE_ROWS = 256


def _match_prior_to_stream(model, split, device) -> list[dict]:
    """Scale the swapped GP layers' priors to the encoder's stream, measured on the first
    :data:`PRIOR_SCALE_ROWS` training sequences (in file order), without touching the random streams."""
    inputs = split.inputs[:PRIOR_SCALE_ROWS].to(device)
    mask = None if split.mask is None else split.mask[:PRIOR_SCALE_ROWS].to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return model.match_prior_to_stream(inputs, mask)


@locked_run  # one writer per run folder: a second gets RunFolderLockedError naming the holder's pid
def train(
    cfg: TrainConfig, out: str | os.PathLike | None = None, resume: bool = False, bundle=None,
    stop_after_steps: int | None = None, log=None, estimate=None, header: bool = True,
) -> dict:
    """Fit, checkpoint and evaluate one run; returns the metrics dict (also ``out/metrics.json``).

    ``stop_after_steps`` simulates an interruption (tests): the run checkpoints after that many
    optimizer steps and raises ``KeyboardInterrupt``. A run that fails with an error leaves no
    ``config.json`` or ``data.json`` of its own (an interrupted run keeps them beside its checkpoint, a
    diverged one beside ``diverged.json``). ``log``: a callable given lines to show (``gpattn train`` prints
    them at once): the data header before training (unless ``header`` is False), the run's estimated time once its
    first steps are timed (``gpattn.experiments._estimate``; a warning line over an hour), and with
    ``cfg.progress`` off a line per epoch (loss, validation NLL and accuracy) and per evaluated split. ``estimate``:
    a callable given that ``RunEstimate`` (``gpattn.experiments._estimate``) instead of the log (``compare``'s).
    """
    written = [Path(out) / name for name in ("config.json", "data.json")] if out is not None else []
    before = {p: p.stat().st_mtime_ns if p.is_file() else None for p in written}
    try:
        return _train(cfg, out, resume, bundle, stop_after_steps, log, estimate, header)
    except TrainingDivergedError:
        raise
    except Exception:
        for p in written:  # what this call wrote describes no run
            if p.is_file() and before[p] != p.stat().st_mtime_ns and int(os.environ.get("RANK", "0")) == 0:
                p.unlink()
        raise


@dataclasses.dataclass(eq=False)
class _Run:
    """One training run's state, shared by the stages of :func:`_train` (set up, restore, fit, evaluate)."""

    cfg: TrainConfig
    out: Path | None
    bundle: object
    meta: dict
    dist: _Dist
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    objective: DeepGPELBO
    steps_per_epoch: int
    total_steps: int
    base_rate: float
    step: int = 0
    history: list = dataclasses.field(default_factory=list)
    stats: EpochStats = dataclasses.field(default_factory=EpochStats)
    net: torch.nn.Module | None = None
    guard: _DivergenceGuard | None = None
    log: object = None
    #: the feature detectors fitted after training (gpattn.experiments.features.fit_detectors), in the checkpoint
    detectors: dict | None = None
    estimate: object = None

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.out is not None and self.dist.main

    @property
    def checkpoint(self) -> Path | None:
        return None if self.out is None else self.out / CHECKPOINT


def _train(cfg: TrainConfig, out, resume: bool, bundle, stop_after_steps, log, estimate, header) -> dict:
    run = _setup(cfg, out, resume, bundle, log, header)
    run.estimate = estimate
    if resume:
        _restore(run)
    run.net = run.dist.wrap(run.model)  # DistributedDataParallel under torchrun
    if cfg.compile:
        run.net = torch.compile(run.net, **COMPILE_OPTIONS)
    run.guard = _DivergenceGuard(run.model, run.device)
    _fit(run, stop_after_steps)
    if cfg.sngp is not None:  # SNGP's Laplace covariance: one pass over the training data, kept in the checkpoint
        from gpattn.experiments.sngp import fit_covariance

        split = run.bundle.splits["train"]
        per_pass = predict_rows(cfg.eval_batch_size, 1, tokens_per_row(run.model, split.inputs, split.mask))
        rows = torch.arange(len(split)).split(per_pass)
        fit_covariance(run.model, (_batch(split, idx, run.device)[:2] for idx in rows))
    _fit_detectors(run)
    _save(run)
    return _evaluate(run)


def _forked(device: torch.device):
    """Forked random streams: a pass over the data that leaves the run's Monte-Carlo draws as they were."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _fit_detectors(run: _Run) -> None:
    """The feature detectors (Mahalanobis, kNN, ...: gpattn.experiments.detectors) fitted on the training split's
    pooled features at the final weights, the run's ``num_samples``; kept in the checkpoint."""
    with _forked(run.device):
        run.detectors = fit_detectors(run.model, run.bundle, run.cfg.num_samples, run.cfg.eval_batch_size)


def _run_data(cfg: TrainConfig, out: Path | None, writes: bool, bundle, log):
    """The run's data (loaded unless given, an encoder's recipe applied, rows longer than the model's width
    cut), its data.json, and the data header given to ``log``."""
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.data.summary import data_summary, summary_lines, warn_max_len_cut

    if bundle is None:
        bundle = load_dataset(
            cfg.dataset, data_dir=cfg.data_dir, download=cfg.download, seed=cfg.seed, **cfg.dataset_options
        )
    bundle = _for_model(cfg, bundle, resolve_device(cfg.device))
    summary = data_summary(bundle)  # the data as loaded: its fingerprint does not depend on the model's width
    if int(os.environ.get("RANK", "0")) == 0:
        warn_max_len_cut(summary)  # rows the data set's max_len cut, per split (issue #59)
    if cfg.encoder is None and bundle.kind == "text":  # evaluation files longer than training: cut, with a warning
        width = model_positions(bundle)
        bundle, cut = fit_to_positions(bundle, width)
        summary["cut_to_model"] = {"tokens": width, "rows": cut} if cut else None
    if writes:  # files, sizes, class counts, duplicates, fingerprint
        _write_json(record_run_paths(summary, out), out / "data.json")
    if log is not None and int(os.environ.get("RANK", "0")) == 0:
        for line in ["data:", *(f"  {line}" for line in summary_lines(summary))]:
            log(line)
    return bundle


def _setup(cfg: TrainConfig, out, resume: bool, bundle, log=None, header: bool = True) -> _Run:
    """The run's files, data (:func:`_run_data`), model, optimizer and objective."""
    resolve_device(cfg.device)  # CUDA asked for where there is none: refused before any file is written
    out = Path(out) if out is not None else None
    writes = out is not None and int(os.environ.get("RANK", "0")) == 0
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(cfg.to_dict(), out / "config.json")
        (out / DIVERGED).unlink(missing_ok=True)  # a record of an earlier attempt in this folder
    bundle = _run_data(cfg, out, writes, bundle, log if header else None)
    dist = _Dist(cfg.device)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    model = build_model(cfg, bundle).to(dist.device)
    if hasattr(model, "match_prior_to_stream") and not resume:  # a pretrained encoder's swapped GP layers
        scaled = _match_prior_to_stream(model, bundle.splits["train"], dist.device)
        if scaled and writes:
            _write_json(scaled, out / PRIOR_SCALE)
    if dist.rank > 0:  # identical initial weights, independent Monte-Carlo noise per rank
        torch.manual_seed(cfg.seed * 1000003 + dist.rank)
    labels = bundle.splits["train"].labels
    steps_per_epoch = max(1, math.ceil(len(labels) / cfg.batch_size))
    # fused: one kernel per step, and it skips a step flagged by ``found_inf`` on the device (_DivergenceGuard);
    # a pretrained encoder: AdamW, its own lr for the pretrained weights, warm-up (gpattn.experiments._optim)
    optimizer, scheduler, optimizer_line = build_optimizer(cfg, model, steps_per_epoch * cfg.epochs)
    if dist.main and cfg.encoder is not None:
        print(f"[train] {cfg.attention} seed {cfg.seed}: {optimizer_line}", flush=True)
    objective = DeepGPELBO(  # the loss parts: every added loss term of the model, by name, and the loss
        model, len(labels), combine_terms=False, beta=cfg.beta, beta_anneal_steps=cfg.beta_anneal_steps,
        eta=cfg.eta, alpha=cfg.alpha, alpha_anneal_steps=cfg.alpha_anneal_steps, kl_scaling=cfg.kl_scaling,
        **cfg.loss_weights,  # any other term's weight, by name
    )
    return _Run(
        cfg, out, bundle, bundle_meta(bundle), dist, model, optimizer, scheduler, objective, steps_per_epoch,
        steps_per_epoch * cfg.epochs, base_rate_entropy(labels, bundle.num_classes), log=log,
    )


def _restore(run: _Run) -> None:
    """``--resume``: the model, optimizer, scheduler, step, history, epoch statistics and random states of
    the checkpoint, which must be of this configuration."""
    if run.checkpoint is None or not run.checkpoint.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {run.checkpoint}")
    ckpt = load_checkpoint(run.checkpoint)  # on the CPU: RNG states must be host tensors
    check_resumable(ckpt, run.checkpoint)  # a release's run (migrated on load) is finished by its own version
    same, diff = _same_run(ckpt["config"], run.cfg)
    if not same:
        raise ValueError(f"--resume: the checkpoint was written with a different configuration ({diff})")
    run.model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    if run.scheduler is not None:
        run.scheduler.load_state_dict(ckpt["scheduler"])
    run.step, run.history = ckpt["step"], ckpt["history"]
    if "epoch_stats" in ckpt:
        run.stats.load_state_dict(_to_device(ckpt["epoch_stats"], run.device))
    ranks = ckpt.get("rng_ranks")
    if ranks is not None and len(ranks) == run.dist.world:
        _set_rng_state(ranks[run.dist.rank], run.device)  # each rank's own generators
    else:  # a checkpoint from before per-rank states, or from another number of processes
        torch.set_rng_state(ckpt["rng"])


def _save(run: _Run) -> None:
    """The checkpoint of the run as it stands (collective: every rank calls it; rank 0 writes)."""
    run.guard.check()  # never save parameters or statistics of a diverged run
    states = run.dist.gather_objects(_rng_state(run.device))
    if run.checkpoint is None or not run.dist.main:
        return
    atomic_save(
        {
            "format_version": CHECKPOINT_FORMAT,
            "gpattn_version": __version__,
            "config": run.cfg.to_dict(),
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
            "step": run.step,
            "history": run.history,
            "epoch_stats": _to_device(run.stats.state_dict(), "cpu"),
            "rng": states[0]["cpu"],
            "rng_ranks": states,
            "data": run.meta,
            **({"detectors": run.detectors} if run.detectors is not None else {}),
        },
        run.checkpoint,
    )


def _fit(run: _Run, stop_after_steps) -> None:
    """The optimisation loop, checkpointed once an epoch (and every ``checkpoint_every`` steps); an
    interruption saves and re-raises, a divergence is recorded in ``diverged.json``."""
    cfg = run.cfg
    bar = tqdm(
        total=run.total_steps, initial=run.step, disable=not cfg.progress or not run.dist.main,
        desc=f"{cfg.attention} seed {cfg.seed}", leave=False, dynamic_ncols=True,
    )

    def diverged(err: TrainingDivergedError) -> None:
        bar.close()
        if run.main:
            _write_json({"step": err.step, "message": str(err), "config": cfg.to_dict()}, run.out / DIVERGED)

    clock = StepClock(torch.cuda.synchronize if run.device.type == "cuda" else lambda: None)
    try:
        with _Interrupt() as interrupt:
            while run.step < run.total_steps:
                _one_step(run, bar)
                if (per_step := clock.tick()) is not None:
                    _report_estimate(run, per_step)
                if stop_after_steps is not None and stop_after_steps <= run.step < run.total_steps:
                    _save(run)
                    raise KeyboardInterrupt(f"stopped after {run.step} steps")
                if run.dist.any_rank(interrupt.requested is not None):  # every rank stops at the same step
                    raise KeyboardInterrupt(f"signal {interrupt.requested or 'on another rank'} at step {run.step}")
        run.guard.check()
    except KeyboardInterrupt:
        try:
            _save(run)
        except TrainingDivergedError as err:
            diverged(err)
            raise
        finally:
            run.dist.close(barrier=True)  # every rank stops here together (dist.any_rank, stop_after_steps)
        bar.close()
        raise
    except TrainingDivergedError as err:
        diverged(err)
        run.dist.close(barrier=False)  # the divergence record is the same on every rank
        raise
    bar.close()


def _one_step(run: _Run, bar) -> None:
    """One optimizer step; at the end of an epoch its history entry and a checkpoint."""
    cfg, split = run.cfg, run.bundle.splits["train"]
    epoch, offset = divmod(run.step, run.steps_per_epoch)
    order = _epoch_order(len(split.labels), cfg.seed, epoch)
    idx = order[offset * cfg.batch_size : (offset + 1) * cfg.batch_size]
    parts = _train_step(
        run.net, run.model, run.objective, run.optimizer, run.guard, run.stats, split, idx, run.step, cfg, run.dist
    )
    if run.scheduler is not None:
        run.scheduler.step()
    run.step += 1
    bar.update(1)
    if offset + 1 == run.steps_per_epoch:
        entry = _epoch_entry(run, parts, epoch)
        run.history.append(entry)
        # the loss and its data part: under a global KL the loss can rise while the NLL falls
        train = entry["train"]
        bar.set_postfix(loss=f"{train['loss']:.3f}", nll=f"{train['nll']:.3f}", refresh=False)  # read once an epoch
        if run.log is not None and not cfg.progress:  # no bar: a line per epoch instead
            line = _epoch_line(run, entry)
            if run.dist.main:
                run.log(line)
        run.stats = EpochStats()
        _save(run)
    elif cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
        _save(run)


def _report_estimate(run: _Run, seconds_per_step: float) -> None:
    """The run's estimated time, once its first steps are timed: the steps left at ``seconds_per_step``, the
    evaluation at the time per row and sample of an evaluation pass (the faster of two, timed here on forked random
    streams). Not counted: the metrics, the files and the process's start and exit (seconds)."""
    if not run.dist.main or (run.estimate is None and run.log is None):
        return
    cfg, splits = run.cfg, run.bundle.splits
    split = splits["val"] if len(splits["val"]) else splits["train"]
    rows = min(len(split), predict_rows(cfg.eval_batch_size, cfg.num_samples, tokens_per_row(run.model, split.inputs,
                                                                                             split.mask)))
    part = types.SimpleNamespace(**{k: None if v is None else v[:rows] for k, v in
                                    (("inputs", split.inputs), ("mask", split.mask), ("labels", split.labels))})
    seconds = []
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        for _ in range(2):  # the faster of two: a first eval-mode pass pays one-off work (~2x sgpa's at T = 128)
            start = time.perf_counter()
            predict(run.model, part, cfg.num_samples, rows, precision=cfg.precision)  # to the host: synchronised
            seconds.append(time.perf_counter() - start)
    per_row_sample = min(seconds) / max(rows * cfg.num_samples, 1)
    from gpattn.experiments.features import detector_rows

    rows = sum(len(splits[k]) for k in _evaluated(run.bundle)) + detector_rows(splits)  # and the detectors' fit
    if run.log is not None and not cfg.progress:  # a validation line per epoch left
        rows += len(splits["val"]) * (cfg.epochs - run.step // run.steps_per_epoch)
    est = run_estimate(run.total_steps - run.step, seconds_per_step, rows * cfg.num_samples, per_row_sample)
    with tqdm.external_write_mode():
        if run.estimate is not None:
            run.estimate(est)
            return
        what = f"{cfg.attention} seed {cfg.seed}"
        run.log(f"[train] {what}: estimated {est.line()} from steps {run.step - TIMED_STEPS + 1}–{run.step}")
        if warning := over_an_hour(est.total, f"this run ({what})"):
            run.log(f"[train] {warning}")


def _evaluated(bundle) -> list[str]:
    """The splits a run evaluates at its end: every evaluation split and ``val``."""
    return sorted({"val", *bundle.eval_splits.values()})


def _epoch_line(run: _Run, entry: dict) -> str:
    """The line of an epoch without a progress bar: its mean loss, and the validation NLL and accuracy at the
    run's ``num_samples`` (on forked random streams: the run takes the steps it would take without the line)."""
    cfg, split = run.cfg, run.bundle.splits["val"]
    loss, nll = entry["train"]["loss"], entry["train"]["nll"]
    line = (f"[train] {cfg.attention} seed {cfg.seed}: epoch {entry['epoch']}/{cfg.epochs}, loss {loss:.4f} "
            f"(NLL {nll:.4f} + the weighted KL and regulariser terms {loss - nll:.4f}, per training example)")
    if not len(split):
        return line
    with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
        logits = predict(run.model, split, cfg.num_samples, cfg.eval_batch_size, run.dist, cfg.precision)
    from gpattn.experiments.metrics import average_samples

    probs = torch.as_tensor(average_samples(logits, cfg.average))  # shape: (N, C)
    picked = probs.gather(1, split.labels.clamp(min=0).unsqueeze(1)).squeeze(1)[split.labels >= 0]
    accuracy = (probs.argmax(1) == split.labels)[split.labels >= 0].double().mean()
    nll = -picked.clamp(min=1e-12).log().mean()
    return f"{line}, val NLL {float(nll):.4f}, val accuracy {float(accuracy):.4f}"


def _epoch_entry(run: _Run, parts: dict, epoch: int) -> dict:
    """history.json's entry of an epoch: its last batch's parts, the epoch's means over its steps and ranks,
    and whether each attention layer uses the other tokens (:func:`gpattn.experiments.diagnostics.attention_use`)."""
    run.guard.check()
    keys = sorted(parts)
    values = run.dist.allreduce_sum(torch.stack([parts[k].detach().double() for k in keys]))
    entry = {"epoch": epoch + 1, "step": run.step, **dict(zip(keys, values.tolist()))}
    entry.update(_reduced(run.stats, run.dist).summary(), base_rate_entropy=run.base_rate)
    probe = run.bundle.splits["val"] if len(run.bundle.splits["val"]) else run.bundle.splits["train"]
    rows = torch.arange(min(ATTENTION_PROBE, len(probe)))
    entry["attention_use"] = attention_use(run.model, *_batch(probe, rows, run.device)[:2])
    return entry


def _evaluate(run: _Run) -> dict:
    """Collapse warnings, predictions of every evaluation split (and ``val``), metrics; the run's files."""
    cfg, bundle, dist = run.cfg, run.bundle, run.dist
    warnings_ = collapse_warnings(run.history, run.base_rate)
    if dist.main:
        for msg in warnings_:
            warn(f"{cfg.attention} seed {cfg.seed}: {msg}", CollapseWarning)  # at the caller's line
    preds = {}
    for key in _evaluated(bundle):
        start, split = time.perf_counter(), bundle.splits[key]
        logits, scores = predict_with_detectors(
            run.model, split, cfg.num_samples, run.detectors, cfg.eval_batch_size, dist, cfg.precision,
            progress=f"{cfg.attention} seed {cfg.seed}: evaluating {key}" if cfg.progress and dist.main else None,
        )
        preds[key] = {"logits": logits, "labels": split.labels}
        if run.detectors is not None:  # the feature detectors' scores, from the logits' own pass (fp32)
            preds[key]["detector_scores"] = scores
        if run.log is not None and not cfg.progress and dist.main:  # no bar: a line per split instead
            run.log(f"[train] {cfg.attention} seed {cfg.seed}: evaluated {key} ({len(split)} rows × "
                    f"{cfg.num_samples} samples) in {duration(time.perf_counter() - start)[1:]}")
    result = evaluate_predictions(preds, bundle, cfg.average)
    dist.close()
    if run.main:
        torch.save(preds, run.out / "predictions.pt")
        _write_json(result, run.out / "metrics.json")
        _write_json(run.history, run.out / "history.json")
        _write_json({"base_rate_entropy": run.base_rate, "warnings": warnings_}, run.out / COLLAPSE)
    return result


def _train_step(net, model, objective, optimizer, guard, stats, split, idx, step: int, cfg, dist) -> dict:
    """One optimizer step on this rank's rows of the global batch ``idx``; returns this rank's loss parts
    (weighted by its share of the batch). No host-device synchronisation unless validation is on.

    Each rank's loss is weighted by its share of the global batch (times the world size, since DDP
    averages the ranks' gradients), so N processes take the steps one process takes on the same batch.
    A rank with no row in a (last, small) batch runs the batch's first row with weight 0: under DDP every
    rank must take part in the backward."""
    device = dist.device
    model.train()
    local = dist.shard(idx)
    weight = len(local) / len(idx)
    rows = local if len(local) else idx[:1]
    optimizer.zero_grad(set_to_none=False)
    x, mask, y = _batch(split, rows, device)
    with _autocast(device, cfg.precision):
        logits = net(x, mask, num_samples=cfg.train_samples)
        parts = objective(logits, y, step=step)
    loss = parts["loss"]
    parts = {k: v * weight for k, v in parts.items()}
    layer_stats = model.layer_diagnostics() if hasattr(model, "layer_diagnostics") else []
    stats.add(parts, [{k: v if k == "layer" else v * weight for k, v in row.items()} for row in layer_stats])
    # a non-finite loss still goes through backward, so that every rank takes part in the reduction
    (loss * (weight * dist.world)).backward()
    loss_bad = dist.allreduce_sum((~torch.isfinite(loss.detach())).float()) > 0  # on the device
    found_inf = guard.update(step, loss_bad, parts, cfg.grad_clip)
    if is_validating():
        guard.check()  # raise before the (skipped) step, as soon as it happens
    optimizer.found_inf = found_inf  # fused Adam skips the update where it is 1
    optimizer.step()
    return parts


def _to_device(tree, device):
    """A copy of a nested dict/list of tensors on ``device``."""
    if torch.is_tensor(tree):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_device(v, device) for v in tree)
    return tree


def _reduced(stats: EpochStats, dist: _Dist) -> EpochStats:
    """The epoch statistics summed over ranks (each rank's were weighted by its share of every batch)."""
    if dist.world == 1:
        return stats
    keys = [("parts", k) for k in sorted(stats.parts)] + [
        (i, k) for i in sorted(stats.layers) for k in sorted(stats.layers[i])
    ]
    if not keys:
        return stats
    values = dist.allreduce_sum(
        torch.stack([stats.parts[k] if i == "parts" else stats.layers[i][k] for i, k in keys])
    )
    out = EpochStats()
    out.steps = stats.steps
    for (i, k), v in zip(keys, values):
        if i == "parts":
            out.parts[k] = v
        else:
            out.layers.setdefault(i, {})[k] = v
    return out


def __getattr__(name):
    from gpattn._migrate import MOVED_NAMES

    raise AttributeError(MOVED_NAMES.get((__name__, name), f"module {__name__!r} has no attribute {name!r}"))
