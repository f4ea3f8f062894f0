"""Training and evaluation loops: seeded, resumable (atomic checkpoints), with tqdm progress.

``TrainConfig`` is everything a run depends on (it is written to ``config.json``); :func:`train`
fits a model, checkpoints (every epoch, and every ``checkpoint_every`` steps), and evaluates every
evaluation split of the data set with Monte-Carlo predictions, writing ``metrics.json`` (DESIGN.md
"CLI and outputs") and ``predictions.pt`` (the sample logits of every split, so that post-hoc
temperature scaling and ensembles need no retraining).

Multi-process: under ``torchrun --nproc_per_node=N -m gpattn train ...`` every rank walks the same
global batch order and takes rows ``rank::N`` of each global batch (a deterministic sharding
equivalent to a DistributedSampler over batches); gradients are weighted by each shard's share and
summed across ranks, so N processes take the same steps as one process with the same global batch.
Rank 0 alone writes files and shows progress; predictions are sharded and gathered.

Determinism and resume: the model is initialised from ``seed``; epoch e visits the training set in
the order ``randperm(N, generator=seed·1000003 + e)``; the global torch RNG (attention samples,
dropout) is saved in every checkpoint. A resumed run therefore replays exactly the steps an
uninterrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gpattn._io import load_file
from gpattn.diagnostics import EpochStats, GPCollapseWarning, base_rate_entropy, collapse_warnings
from gpattn.models import TransformerClassifier, ViTClassifier
from gpattn.objectives import ELBOObjective

__all__ = [
    "TrainConfig",
    "TrainingDivergedError",
    "atomic_save",
    "build_model",
    "evaluate_predictions",
    "load_run",
    "predict",
    "train",
]

CHECKPOINT = "checkpoint.pt"
DIVERGED = "diverged.json"
#: the collapse checks of a finished run (gpattn.diagnostics): base-rate entropy and warnings
COLLAPSE = "collapse.json"
PART_KEYS = ("nll", "kl_seq", "kl_global", "ksvd", "cgp", "beta", "alpha")


@dataclasses.dataclass
class TrainConfig:
    """Every setting of a run (``config.json``). ``attention`` may carry modifiers handled by
    ``gpattn compare`` (``+ts``, ``+mcdropout``, ``+ensN``); ``train`` takes a plain name."""

    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    dataset_options: dict = dataclasses.field(default_factory=dict)
    attention: str = "softmax"
    attention_options: dict = dataclasses.field(default_factory=dict)
    attention_layers: object = "auto"
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: float = 2.0
    dropout: float = 0.1
    mc_dropout: bool = False
    pooling: str | None = None
    patch_size: int | None = None
    epochs: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    cosine: bool = True
    seed: int = 0
    train_samples: int = 1
    num_samples: int = 10
    average: str = "probs"
    beta: float = 1.0
    beta_anneal_steps: int = 0
    eta: float = 0.1
    alpha: float = 1.0
    alpha_anneal_steps: int = 0
    kl_scaling: str = "elbo"
    checkpoint_every: int = 0
    eval_batch_size: int = 256
    progress: bool = True

    def __post_init__(self):
        """The training loop's own settings, checked before any data is loaded (the model's, the
        attention's and the objective's are checked where they are used, with the same kind of message)."""

        def bad(name, want):
            return ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v):  # plain ints only (not data._images.is_int's NumPy ints): config.json must serialise
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("epochs", "batch_size", "eval_batch_size", "train_samples", "num_samples"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "a positive int")
        for name in ("checkpoint_every", "beta_anneal_steps", "alpha_anneal_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "an int >= 0 (0 = off)")
        if not is_int(self.seed):
            raise bad("seed", "an int")
        for name, positive in (("lr", True), ("weight_decay", False), ("grad_clip", False)):
            v = getattr(self, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or v < 0 or (positive and v == 0):
                raise bad(name, "a finite number > 0" if positive else "a finite number >= 0 (0 = off)")
        if self.average not in ("probs", "logits"):
            raise bad("average", "'probs' or 'logits'")

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {', '.join(sorted(names))}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    #: fields that change how a run is shown or checkpointed, never its result
    PRESENTATION_FIELDS = ("progress", "checkpoint_every")

    @classmethod
    def result_key(cls, d: dict) -> dict:
        """A config dict (``to_dict()`` or a ``config.json``) without :data:`PRESENTATION_FIELDS`,
        JSON-normalised: equal keys mean runs with the same result (resume, compare's cache)."""
        return json.loads(json.dumps({k: v for k, v in d.items() if k not in cls.PRESENTATION_FIELDS}))


# ----------------------------------------------------------------------------- model and batches
#: where ``attention_layers="auto"`` puts a variant (seed 002 replaces only the last layer by KEP-SVGP)
AUTO_LAYERS = {"kep-svgp": "last"}


def build_model(cfg: TrainConfig, bundle) -> torch.nn.Module:
    """The classifier for a data set: a transformer over token ids for text, a ViT for images."""
    layers = AUTO_LAYERS.get(cfg.attention, "all") if cfg.attention_layers == "auto" else cfg.attention_layers
    common = dict(
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        attention=cfg.attention,
        attention_options=dict(cfg.attention_options),
        attention_layers=layers,
        mlp_ratio=cfg.mlp_ratio,
        dropout=cfg.dropout,
        mc_dropout=cfg.mc_dropout,
    )
    if bundle.kind == "text":
        max_len = max(int(s.inputs.shape[1]) for s in bundle.splits.values())
        return TransformerClassifier(
            bundle.num_classes, vocab_size=bundle.vocab_size, max_len=max_len, pooling=cfg.pooling or "mean", **common
        )
    if bundle.kind == "image":
        C, Hpx, Wpx = bundle.image_shape
        patch = cfg.patch_size or (2 if Hpx <= 8 else 4)
        return ViTClassifier(
            bundle.num_classes,
            image_shape=bundle.image_shape,
            patch_size=patch,
            pooling=cfg.pooling or "cls",
            **common,
        )
    raise ValueError(f"data set kind must be 'text' or 'image', got {bundle.kind!r}")


def _batch(split, idx):
    """Inputs, mask and labels of rows ``idx``; text batches are cut to their longest real sequence."""
    x = split.inputs[idx]
    mask = None if split.mask is None else split.mask[idx]
    if mask is not None:
        longest = int((~mask).sum(1).max()) if len(idx) else 1
        x, mask = x[:, : max(longest, 1)], mask[:, : max(longest, 1)]
    return x, mask, split.labels[idx]


def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.randperm(n, generator=g)


class TrainingDivergedError(FloatingPointError):
    """A training step produced a non-finite loss or gradient. No optimizer step was taken with it, so
    the model still holds the last finite parameters; ``step`` is the step that failed. ``train``
    records it in ``out/diverged.json`` (which ``compare`` reads instead of training again)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


_DIVERGED_HINT = "lower the learning rate (--lr) or temper the objective (--beta/--alpha)"


def _check_gradients(model, step: int, loss, max_norm: float) -> None:
    """Clip to ``max_norm`` (0 = no clipping) and raise if the total gradient norm is not finite:
    clipping would spread a NaN into every parameter, and the next forward would fail far from the cause."""
    params = [q for q in model.parameters() if q.grad is not None]
    norm = torch.nn.utils.get_total_norm([q.grad for q in params])
    if bool(torch.isfinite(norm)):
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return
    bad = [n for n, q in model.named_parameters() if q.grad is not None and not bool(torch.isfinite(q.grad).all())]
    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    raise TrainingDivergedError(
        f"training diverged at step {step}: non-finite gradient (loss {float(loss.detach()):.4g} is finite) "
        f"in {shown}; no optimizer step was taken with it; {_DIVERGED_HINT}",
        step,
    )


class _Dist:
    """Multi-process context from torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``):
    gloo on CPU, nccl when CUDA is present. A single process is world 1, rank 0."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.owned = False
        self.device = torch.device("cpu")
        if self.world > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend)
            self.owned = True
            if backend == "nccl":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
        self.rank = dist.get_rank() if self.world > 1 else 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (every rank sees the same global order)."""
        return idx[self.rank :: self.world]

    def allreduce_grads(self, model: torch.nn.Module) -> None:
        """Sum of the ranks' (already weighted) gradients, in one flat buffer."""
        if self.world == 1:
            return
        for p in model.parameters():  # every rank must reduce the same buffer
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            self.dist.all_reduce(t)
        return t

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """Reassemble rows sharded as ``rank::world`` into their original order."""
        if self.world == 1:
            return local
        parts = [None] * self.world
        self.dist.all_gather_object(parts, local.cpu())
        out = torch.empty(n, *local.shape[1:], dtype=local.dtype)
        for r, part in enumerate(parts):
            out[r :: self.world] = part
        return out

    def close(self) -> None:
        if self.owned and self.dist.is_initialized():
            self.dist.barrier()
            self.dist.destroy_process_group()


@torch.no_grad()
def predict(model, split, num_samples: int, batch_size: int = 256, dist: _Dist | None = None) -> torch.Tensor:
    """Sample logits of a whole split in eval mode (sharded over ranks under torchrun).  # shape: (N, P, C)"""
    model.eval()
    n = len(split.labels)
    rows = torch.arange(n) if dist is None else dist.shard(torch.arange(n))
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(rows), batch_size):
        x, mask, _ = _batch(split, rows[start : start + batch_size])
        mask = None if mask is None else mask.to(device)
        out.append(model(x.to(device), mask, num_samples=num_samples).float().cpu())
    local = torch.cat(out) if out else torch.zeros(0, num_samples, getattr(model, "num_classes", 2))
    return local if dist is None else dist.gather_rows(local, n)


def evaluate_predictions(preds: dict, bundle, average: str = "probs", temperature: float = 1.0) -> dict:
    """metrics.json content from sample logits: classification metrics per evaluation split, on its
    labelled rows (``None`` where no row has a label; ``n`` / ``n_labelled`` / ``class_counts`` say
    which), and for OOD splits the OOD-detection metrics against ``in_domain`` under every score
    (max probability as ``ood_auroc`` ..., the others as ``ood_auroc_<score>`` ...)."""
    from gpattn import metrics as M

    def probs_of(name):
        logits = preds[bundle.eval_splits[name]]["logits"] / temperature
        return M.average_samples(logits, average=average), logits

    names = bundle.info.get("class_names") or [str(k) for k in range(bundle.num_classes)]
    result = {}
    _, logits_in = probs_of("in_domain")
    scores_in = M.all_ood_scores(logits_in, average)
    for name, key in bundle.eval_splits.items():
        probs, logits = probs_of(name)
        labels = preds[key]["labels"]
        known = labels >= 0
        if bool(known.any()):
            row = M.classification_metrics(probs[known.numpy()], labels[known])
        else:
            row = {k: None for k in M.METRIC_KEYS}
        if name in bundle.ood_splits:
            for score, values in M.all_ood_scores(logits, average).items():
                detect = M.ood_metrics(scores_in[score], values)
                row.update({M.ood_score_key(score, k): v for k, v in detect.items()})
        result[name] = {
            k: (None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)) for k, v in row.items()
        }
        counts = torch.bincount(labels[known], minlength=len(names)).tolist()
        result[name].update(
            n=len(labels), n_labelled=int(known.sum()), class_counts={c: k for c, k in zip(names, counts)}
        )
    return result


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

    def check(self, step: int) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt(f"signal {self.requested} at step {step}")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def _load_checkpoint(path: Path, map_location="cpu") -> dict:
    """A checkpoint written by :func:`train`, or a ``ValueError`` naming the file: a truncated or
    foreign file otherwise fails deep inside unpickling with a message about neither, and a file that
    is not plain data is refused unread (:func:`gpattn._io.load_file`, ``weights_only=True``)."""
    ckpt = load_file(path, map_location=map_location, what="checkpoint")
    if not isinstance(ckpt, dict) or not {"config", "model"} <= set(ckpt):
        got = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path} is not a gpattn checkpoint: expected a dict with 'config' and 'model', got {got}")
    return ckpt


def _run_checkpoint(path) -> tuple[Path, dict]:
    """A checkpoint file or a run folder -> (checkpoint path, its contents, loaded safely)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return path, _load_checkpoint(path)


def load_run(path) -> tuple[TrainConfig, torch.nn.Module, object, dict]:
    """Load a checkpoint file (or a run folder) -> (config, model, data bundle, checkpoint dict)."""
    from gpattn.data import load_dataset

    path, ckpt = _run_checkpoint(path)
    cfg = TrainConfig.from_dict(ckpt["config"])
    bundle = load_dataset(
        cfg.dataset, data_dir=cfg.data_dir, download=cfg.download, seed=cfg.seed, **cfg.dataset_options
    )
    model = build_model(cfg, bundle)
    model.load_state_dict(ckpt["model"])
    return cfg, model, bundle, ckpt


# ----------------------------------------------------------------------------- the loop
def train(
    cfg: TrainConfig,
    out: str | os.PathLike | None = None,
    resume: bool = False,
    bundle=None,
    stop_after_steps: int | None = None,
) -> dict:
    """Fit, checkpoint and evaluate one run; returns the metrics dict (also ``out/metrics.json``).

    ``stop_after_steps`` simulates an interruption (tests): the run checkpoints after that many
    optimizer steps and raises ``KeyboardInterrupt``.
    """
    from gpattn.data import load_dataset

    out = Path(out) if out is not None else None
    if out is not None and int(os.environ.get("RANK", "0")) == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(cfg.to_dict(), out / "config.json")
        (out / DIVERGED).unlink(missing_ok=True)  # a record of an earlier attempt in this folder
    if bundle is None:
        bundle = load_dataset(
            cfg.dataset, data_dir=cfg.data_dir, download=cfg.download, seed=cfg.seed, **cfg.dataset_options
        )
    from gpattn.data.summary import data_summary
    from gpattn.inference import bundle_meta

    if out is not None and int(os.environ.get("RANK", "0")) == 0:
        _write_json(data_summary(bundle), out / "data.json")  # files, sizes, class counts, fingerprint
    meta = bundle_meta(bundle)  # plain data: what gpattn.load_run needs without the data files
    dist = _Dist()
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    model = build_model(cfg, bundle).to(dist.device)
    if dist.rank > 0:  # identical initial weights, independent Monte-Carlo noise per rank
        torch.manual_seed(cfg.seed * 1000003 + dist.rank)
    train_split = bundle.splits["train"]
    n = len(train_split.labels)
    steps_per_epoch = max(1, math.ceil(n / cfg.batch_size))
    total_steps = steps_per_epoch * cfg.epochs
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps)) if cfg.cosine else None
    objective = ELBOObjective(
        n,
        beta=cfg.beta,
        beta_anneal_steps=cfg.beta_anneal_steps,
        eta=cfg.eta,
        alpha=cfg.alpha,
        alpha_anneal_steps=cfg.alpha_anneal_steps,
        kl_scaling=cfg.kl_scaling,
    )
    step, history = 0, []
    stats = EpochStats()  # epoch means of the loss parts and of each GP layer's scale (gpattn.diagnostics)
    base_rate = base_rate_entropy(train_split.labels, bundle.num_classes)
    ckpt_path = out / CHECKPOINT if out is not None else None
    if resume:
        if ckpt_path is None or not ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        ckpt = _load_checkpoint(ckpt_path)
        saved, mine = TrainConfig.result_key(ckpt["config"]), TrainConfig.result_key(cfg.to_dict())
        if saved != mine:
            diff = sorted(k for k in mine if saved.get(k) != mine[k])
            raise ValueError(f"--resume: the checkpoint was written with a different configuration ({diff})")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(ckpt["scheduler"])
        step, history = ckpt["step"], ckpt["history"]
        if "epoch_stats" in ckpt:
            stats.load_state_dict(ckpt["epoch_stats"])
        torch.set_rng_state(ckpt["rng"])

    def save():
        if ckpt_path is not None and dist.main:
            atomic_save(
                {
                    "config": cfg.to_dict(),
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "step": step,
                    "history": history,
                    "epoch_stats": stats.state_dict(),
                    "rng": torch.get_rng_state(),
                    "data": meta,
                },
                ckpt_path,
            )

    bar = tqdm(
        total=total_steps,
        initial=step,
        disable=not cfg.progress or not dist.main,
        desc=f"{cfg.attention} seed {cfg.seed}",
        leave=False,
        dynamic_ncols=True,
    )
    try:
        with _Interrupt() as interrupt:
            while step < total_steps:
                epoch, offset = divmod(step, steps_per_epoch)
                order = _epoch_order(n, cfg.seed, epoch)
                model.train()
                idx = order[offset * cfg.batch_size : (offset + 1) * cfg.batch_size]
                local = dist.shard(idx)
                weight = len(local) / len(idx)  # ranks' weighted gradients sum to the global batch's
                optimizer.zero_grad(set_to_none=False)
                if len(local):
                    x, mask, y = _batch(train_split, local)
                    mask = None if mask is None else mask.to(dist.device)
                    logits = model(x.to(dist.device), mask, num_samples=cfg.train_samples)
                    loss, parts = objective(logits, y.to(dist.device), model.loss_terms(), step=step)
                    layer_stats = model.layer_diagnostics() if hasattr(model, "layer_diagnostics") else []
                    stats.add({k: v * weight for k, v in parts.items()}, layer_stats)
                    # a non-finite loss still goes through backward and the all-reduce below, so that
                    # every rank reaches the same check instead of the others waiting for this one
                    (loss * weight).backward()
                else:  # more ranks than rows in this (last) batch: contribute zero gradients
                    loss = torch.zeros(())
                    parts = {k: torch.zeros(()) for k in (*PART_KEYS, "loss")}
                dist.allreduce_grads(model)
                if dist.allreduce_sum(torch.tensor([float(not torch.isfinite(loss))])).item() > 0:
                    raise TrainingDivergedError(
                        f"training diverged at step {step}: non-finite loss on a rank (this rank: "
                        f"{ {k: float(v.detach()) for k, v in parts.items()} }); no optimizer step was taken "
                        f"with it; {_DIVERGED_HINT}",
                        step,
                    )
                _check_gradients(model, step, loss, cfg.grad_clip)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", refresh=False)
                if offset + 1 == steps_per_epoch:
                    keys = sorted(parts)
                    values = dist.allreduce_sum(torch.stack([parts[k].detach().float().cpu() for k in keys]) * weight)
                    entry = {"epoch": epoch + 1, "step": step, **dict(zip(keys, values.tolist()))}
                    # the epoch's means over its steps (this rank's; the keys above are the last batch's)
                    entry.update(stats.summary(), base_rate_entropy=base_rate)
                    history.append(entry)
                    stats = EpochStats()
                    save()
                elif cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    save()
                if stop_after_steps is not None and step >= stop_after_steps and step < total_steps:
                    save()
                    raise KeyboardInterrupt(f"stopped after {step} steps")
                interrupt.check(step)
    except KeyboardInterrupt:
        save()
        bar.close()
        raise
    except TrainingDivergedError as err:
        bar.close()
        if out is not None and dist.main:
            _write_json({"step": err.step, "message": str(err), "config": cfg.to_dict()}, out / DIVERGED)
        raise
    bar.close()
    warnings_ = collapse_warnings(history, base_rate)
    if dist.main:
        for msg in warnings_:
            warnings.warn(f"{cfg.attention} seed {cfg.seed}: {msg}", GPCollapseWarning, stacklevel=2)

    preds = {
        key: {
            "logits": predict(model, bundle.splits[key], cfg.num_samples, cfg.eval_batch_size, dist),
            "labels": bundle.splits[key].labels,
        }
        for key in sorted({"val", *bundle.eval_splits.values()})
    }
    result = evaluate_predictions(preds, bundle, cfg.average)
    dist.close()
    if out is not None and dist.main:
        torch.save(preds, out / "predictions.pt")
        _write_json(result, out / "metrics.json")
        _write_json(history, out / "history.json")
        _write_json({"base_rate_entropy": base_rate, "warnings": warnings_}, out / COLLAPSE)
    return result
