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

from gpattn import __version__
from gpattn._settings import is_validating
from gpattn.experiments._io import CHECKPOINT_FORMAT
from gpattn.experiments._data_check import load_checked_data
from gpattn.experiments._runlock import locked_run
from gpattn.experiments._optim import DEFAULT_BATCH_SIZE, ENCODER_DEFAULTS, build_optimizer
from gpattn.experiments._runs import (
    CHECKPOINT,
    as_device,
    bundle_meta,
    load_checkpoint,
    resolve_device,
    run_checkpoint,
    valid_device,
)
from gpattn.experiments.diagnostics import (
    EpochStats,
    GPCollapseWarning,
    attention_use,
    base_rate_entropy,
    collapse_warnings,
)
from gpattn.kernels import require_kernel_spec
from gpattn.models import EncoderSpec, TransformerClassifier, ViTClassifier
from gpattn.objectives import DEFAULT_ALPHA, DeepGPELBO

__all__ = [
    "TrainConfig",
    "TrainingDivergedError",
    "atomic_save",
    "build_model",
    "evaluate_predictions",
    "load_run_with_data",
    "predict",
    "train",
]

DIVERGED = "diverged.json"
#: sequences of the validation split on which each epoch measures every attention layer's attention use
ATTENTION_PROBE = 128
#: the collapse checks of a finished run (gpattn.experiments.diagnostics): base-rate entropy and warnings
COLLAPSE = "collapse.json"
#: settings that change where and how a run executes, not what it computes: a run trained with other
#: values is resumed (``--resume``) and reused (``gpattn compare``) as it is. ``device`` is one of them:
#: CPU and GPU kernels differ only in float round-off, and a run trained on a GPU must stay usable on a
#: CPU-only machine. ``precision`` is not: bf16 autocast changes the results.
RUN_SETTINGS = ("progress", "checkpoint_every", "device")
#: the objective's settings that are TrainConfig fields of their own (``loss_weights`` holds the others)
_OWN_WEIGHTS = ("beta", "beta_anneal_steps", "eta", "alpha", "alpha_anneal_steps")
#: ``--precision``: autocast dtype of the model outside the GP algebra (which stays in fp32/fp64)
PRECISIONS = ("fp32", "bf16")


def _autocast(device: torch.device, precision: str):
    """The model's autocast for ``precision`` on ``device`` (fp32: off)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _same_run(saved: dict, cfg: TrainConfig) -> tuple[bool, list]:
    """Whether a saved config.json describes the same run as ``cfg`` (up to :data:`RUN_SETTINGS`), and
    the keys that differ."""
    defaults = TrainConfig().to_dict()
    if saved.get("encoder") is not None:  # trained before --encoder runs had their own optimizer settings
        absent = "absent (Adam, one lr, no warm-up)"
        defaults.update({k: absent for k in ("encoder_lr", "encoder_weight_decay", "warmup")})
    saved = {k: v for k, v in {**defaults, **saved}.items() if k not in RUN_SETTINGS}
    mine = {k: v for k, v in cfg.to_dict().items() if k not in RUN_SETTINGS}
    saved, mine = json.loads(json.dumps(saved)), json.loads(json.dumps(mine))
    return saved == mine, sorted(k for k in mine if saved.get(k) != mine[k])


#: attention options whose library default changed after runs were saved, by variant: the value that a config
#: written before the change trained with. ``TrainConfig`` records the current default of each in
#: ``attention_options`` (so config.json says which form ran, and ``compare`` retrains an older run rather than
#: reuse it); ``TrainConfig.from_saved`` fills the old value into a saved config that lacks it, so a checkpoint
#: reloads as the model it is. cgp: the softmax prior mean (docs/derivations.md §7a) since 2026-11-27; scgp: the
#: separate softmax mean (§7a) since 2026-11-27 (session 6).
CHANGED_DEFAULTS: dict[str, dict[str, object]] = {"cgp": {"prior_mean": "zero"}, "scgp": {"prior_mean": "zero"}}

#: how a pretrained encoder is trained (``TrainConfig.encoder_recipe``)
ENCODER_RECIPES = ("full", "frozen-trunk")


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
    #: a pretrained Hugging Face encoder (a local folder, or "minilm"): gpattn.experiments.encoders
    encoder: str | None = None
    #: with ``encoder``: truncate texts to this many word pieces (default: the encoder's limit)
    encoder_max_len: int | None = None
    #: with ``encoder``: ``"full"`` fine-tunes every weight; ``"frozen-trunk"`` freezes the layers below the
    #: first swapped one and trains on their outputs, computed once per data set (gpattn.experiments.encoders)
    encoder_recipe: str = "full"
    #: with ``encoder``: learning rate of the pretrained weights (``lr`` is the new parameters'); None: the
    #: recipe's default (gpattn.experiments._optim.ENCODER_DEFAULTS)
    encoder_lr: float | None = None
    #: with ``encoder``: AdamW's decoupled weight decay on the pretrained weight matrices; None: the default
    encoder_weight_decay: float | None = None
    #: fraction of the steps with a linear learning-rate warm-up; None: 0.1 with ``encoder``, else 0
    warmup: float | None = None
    embed_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: float = 2.0
    dropout: float = 0.1
    mc_dropout: bool = False
    #: SNGP (``compare``'s ``+sngp``): None = off, else the options of gpattn.experiments.sngp.apply_sngp, all of
    #: them (spectral-normalised blocks, a random-feature GP head, its Laplace covariance fitted after training)
    sngp: dict | None = None
    pooling: str | None = None
    patch_size: int | None = None
    epochs: int = 10
    #: None: 32, or with ``encoder`` the recipe's default (gpattn.experiments._optim.ENCODER_DEFAULTS: 16 for
    #: full fine-tuning); resolved when the config is made, so config.json holds the number
    batch_size: int | None = None
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
    alpha: float = DEFAULT_ALPHA
    alpha_anneal_steps: int = 0
    #: the weights of other loss terms, by the name of their gpattn.objectives.TermWeight (and
    #: ``NAME_anneal_steps``), given to the objective as they are (``--loss-weight NAME=VALUE``)
    loss_weights: dict = dataclasses.field(default_factory=dict)
    kl_scaling: str = "elbo"
    checkpoint_every: int = 0
    eval_batch_size: int = 256
    progress: bool = True
    device: str = "auto"
    precision: str = "fp32"

    def __post_init__(self):
        """The training loop's own settings, checked before any data is loaded (the model's, the
        attention's and the objective's are checked where they are used, with the same kind of message)."""

        def bad(name, want):
            return ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v):  # plain ints only (not data._images.is_int's NumPy ints): config.json must serialise
            return isinstance(v, int) and not isinstance(v, bool)

        if self.encoder is not None and isinstance(self.attention_options, dict):
            from gpattn.integrations.huggingface import encoder_swap_options

            # the swap's defaults written out, so config.json (and compare's reuse check) says which form ran
            self.attention_options = encoder_swap_options(self.attention, self.attention_options)
        changed = CHANGED_DEFAULTS.get(self.attention) if isinstance(self.attention, str) else None
        if changed and isinstance(self.attention_options, dict):
            from gpattn.attention.registry import attention_options

            defaults = attention_options(self.attention)
            self.attention_options = {**{k: defaults[k] for k in changed}, **self.attention_options}
        if self.batch_size is None:
            recipe = ENCODER_DEFAULTS.get(self.encoder_recipe, {}) if self.encoder is not None else {}
            self.batch_size = recipe.get("batch_size", DEFAULT_BATCH_SIZE)
        for name in ("epochs", "batch_size", "eval_batch_size", "train_samples", "num_samples"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise bad(name, "a positive int")
        for name in ("checkpoint_every", "beta_anneal_steps", "alpha_anneal_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise bad(name, "an int >= 0 (0 = off)")
        if not is_int(self.seed):
            raise bad("seed", "an int")
        weights = self.loss_weights
        if not isinstance(weights, dict) or not all(isinstance(k, str) and k.isidentifier() for k in weights):
            raise bad("loss_weights", "a dict of loss-weight names to numbers (gpattn.objectives.term_weights())")
        own = sorted(set(weights) & set(_OWN_WEIGHTS))
        if own:
            raise bad("loss_weights", f"free of {', '.join(own)}, which have their own settings (--beta, --alpha, ...)")
        for name, v in weights.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"loss_weights[{name!r}] (--loss-weight) must be a finite number >= 0, got {v!r}")
        for name, positive in (("lr", True), ("weight_decay", False), ("grad_clip", False)):
            v = getattr(self, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or v < 0 or (positive and v == 0):
                raise bad(name, "a finite number > 0" if positive else "a finite number >= 0 (0 = off)")
        if self.encoder is not None and not isinstance(self.encoder, str):
            raise bad("encoder", "None or a local encoder folder / name (a str, e.g. 'minilm')")
        if self.encoder_max_len is not None and (not is_int(self.encoder_max_len) or self.encoder_max_len < 2):
            raise bad("encoder_max_len", "None (the encoder's limit) or an int >= 2")
        if self.encoder_max_len is not None and self.encoder is None:
            raise bad("encoder_max_len", "None without an encoder (--max-len needs --encoder)")
        if self.pooling not in (None, "mean", "cls"):
            raise bad("pooling", "None (the model's default), 'mean' or 'cls'")
        if self.pooling is not None and self.encoder is not None:
            raise bad("pooling", "None with an encoder (its classification head pools as the encoder was trained to)")
        for name in ("encoder_lr", "encoder_weight_decay", "warmup"):
            v = getattr(self, name)
            if v is None:
                continue
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not number or v < 0 or (name == "encoder_lr" and v == 0) or (name == "warmup" and v >= 1):
                want = {"encoder_lr": "a finite number > 0", "encoder_weight_decay": "a finite number >= 0",
                        "warmup": "a fraction 0 <= x < 1 of the steps"}[name]
                raise bad(name, f"None (the default) or {want}")
            if name != "warmup" and self.encoder is None:
                raise bad(name, f"None without an encoder (--{name.replace('_', '-')} needs --encoder)")
        if self.encoder_recipe not in ENCODER_RECIPES:
            raise bad("encoder_recipe", f"one of {', '.join(ENCODER_RECIPES)}")
        if self.encoder_recipe != "full" and self.encoder is None:
            raise bad("encoder_recipe", "'full' without an encoder (--encoder-recipe needs --encoder)")
        if self.average not in ("probs", "logits"):
            raise bad("average", "'probs' or 'logits'")
        if not valid_device(self.device):
            raise ValueError(f"device (--device) must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision (--precision) must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if isinstance(self.attention_options, dict) and "kernel" in self.attention_options:
            # config.json stores kernel specs (gpattn.kernels), never a kernel instance
            require_kernel_spec(self.attention_options["kernel"], name="attention_options['kernel']")
        if self.sngp is not None:
            from gpattn.experiments.sngp import check_sngp_options

            if self.encoder is not None:
                raise bad("sngp", "None with an encoder (SNGP is built for gpattn's own classifiers)")
            check_sngp_options(self.sngp)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys: {', '.join(sorted(names))}")
        return cls(**d)

    @classmethod
    def from_saved(cls, d: dict) -> TrainConfig:
        """A run's saved config (its checkpoint's): as ``from_dict``, except that a run saved before a default
        changed keeps the form it trained: an encoder run saved before the swap's defaults were written out
        (``saved_swap_options``), and any run of a variant in :data:`CHANGED_DEFAULTS` saved before its new
        default was recorded."""
        options = d.get("attention_options", {})
        if isinstance(options, dict):
            if d.get("encoder") is not None:
                from gpattn.integrations.huggingface import saved_swap_options

                options = saved_swap_options(d.get("attention"), options)
            attention = d.get("attention")
            options = {**CHANGED_DEFAULTS.get(attention if isinstance(attention, str) else None, {}), **options}
            d = {**d, "attention_options": options}
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)



# ----------------------------------------------------------------------------- model and batches
#: where ``attention_layers="auto"`` puts a variant (Chen et al. (2024) replaces only the last layer by KEP-SVGP)
AUTO_LAYERS = {"kep-svgp": "last"}


def build_model(cfg: TrainConfig, bundle) -> torch.nn.Module:
    """The classifier for a data set: a transformer over token ids for text, a ViT for images, a
    pretrained encoder with ``cfg.encoder`` (gpattn.experiments.encoders)."""
    if cfg.encoder is not None:
        from gpattn.experiments.encoders import build_encoder_model

        return build_encoder_model(cfg, bundle)
    layers = AUTO_LAYERS.get(cfg.attention, "all") if cfg.attention_layers == "auto" else cfg.attention_layers
    # the config's encoder settings under their own names (EncoderSpec's), the layers resolved
    common = {name: getattr(cfg, name) for name in EncoderSpec.names()}
    common.update(attention_options=dict(cfg.attention_options), attention_layers=layers)
    if bundle.kind == "text":
        max_len = max(int(s.inputs.shape[1]) for s in bundle.splits.values())
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
    if cfg.sngp is not None:  # spectral-normalised blocks and a random-feature GP head (gpattn.experiments.sngp)
        from gpattn.experiments.sngp import apply_sngp

        apply_sngp(model, **cfg.sngp)
    return model


def _batch(split, idx, device=None):
    """Inputs, mask and labels of rows ``idx`` on ``device`` (host tensors when None); text batches are
    cut to their longest real sequence (read on the host, before the copy: no device synchronisation)."""
    x = split.inputs[idx]
    mask = None if split.mask is None else split.mask[idx]
    if mask is not None:
        longest = int((~mask).sum(1).numpy().max()) if len(idx) else 1
        x, mask = x[:, : max(longest, 1)], mask[:, : max(longest, 1)]
    y = split.labels[idx]
    if device is not None and torch.device(device).type != "cpu":  # pinned host memory: an asynchronous copy
        x, y = (t.pin_memory().to(device, non_blocking=True) for t in (x, y))
        mask = None if mask is None else mask.pin_memory().to(device, non_blocking=True)
    return x, mask, y


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


_DIVERGED_HINT = (
    "lower the learning rate (--lr) or temper the objective (--beta/--alpha); --validate checks the inputs and "
    "escalates the jitter of failed Cholesky factorisations"
)


class _DivergenceGuard:
    """Non-finite losses and gradients, watched on the device without a host synchronisation per step.

    Every step :meth:`update` records the first step whose loss (on any rank) or total gradient norm is
    not finite, with the parameters whose gradient is not finite and this rank's loss parts, in device
    tensors, and returns ``found_inf``: 1 from that step on. The optimizer (fused Adam, the mechanism
    ``torch.amp.GradScaler`` uses) skips every step with ``found_inf`` 1, so no parameter ever takes a
    non-finite update and the model keeps its last finite parameters. :meth:`check` reads the record
    (one synchronisation) and raises :class:`TrainingDivergedError` naming that step: every step with
    validation on (``gpattn.validation()``, ``--validate``), else at the next epoch end, checkpoint
    or interruption, before anything is saved."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        self.first = torch.full((), -1, dtype=torch.long, device=device)  # first bad step, -1 = none
        self.loss_bad = torch.zeros((), dtype=torch.bool, device=device)  # the loss (else a gradient)
        self.grads_bad = torch.zeros(len(self.named), dtype=torch.bool, device=device)
        self.parts: dict[str, torch.Tensor] = {}  # this rank's loss parts at that step, by name

    def update(self, step: int, loss_bad: torch.Tensor, parts: dict, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` (0 = off) and record this step; returns ``found_inf``."""
        grads = [q.grad for _, q in self.named if q.grad is not None]
        # one norm per tensor
        per = torch.stack(torch._foreach_norm(grads)) if grads else self.first.new_zeros(0, dtype=torch.float64)
        norm = torch.linalg.vector_norm(per)
        if max_norm and grads:
            torch.nn.utils.clip_grads_with_norm_([q for _, q in self.named if q.grad is not None], max_norm, norm)
        new = (loss_bad | ~torch.isfinite(norm)) & (self.first < 0)
        self.first = torch.where(new, step, self.first)
        self.loss_bad = torch.where(new, loss_bad, self.loss_bad)
        if len(grads) == len(self.named):
            self.grads_bad = torch.where(new, ~torch.isfinite(per), self.grads_bad)
        for k, v in parts.items():  # whatever terms the model reports (gpattn.objectives.DeepGPELBO)
            v = v.detach().to(device=self.first.device, dtype=torch.float64)
            self.parts[k] = torch.where(new, v, self.parts[k] if k in self.parts else torch.zeros_like(v))
        return (self.first >= 0).float()

    def check(self) -> None:
        """Raise :class:`TrainingDivergedError` if a step diverged (reads the device: one synchronisation)."""
        step = int(self.first)
        if step < 0:
            return
        parts = dict(zip(self.parts, torch.stack(list(self.parts.values())).tolist())) if self.parts else {}
        if bool(self.loss_bad):
            raise TrainingDivergedError(
                f"training diverged at step {step}: non-finite loss on a rank (this rank: {parts}); no optimizer "
                f"step was taken with it; {_DIVERGED_HINT}",
                step,
            )
        bad = [n for (n, _), b in zip(self.named, self.grads_bad.tolist()) if b]
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise TrainingDivergedError(
            f"training diverged at step {step}: non-finite gradient (loss {parts['loss']:.4g} is finite) "
            f"in {shown}; no optimizer step was taken with it; {_DIVERGED_HINT}",
            step,
        )


class _Dist:
    """Multi-process context from torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``): NCCL
    when the run's device is a GPU, gloo on CPU. A single process is world 1, rank 0.

    Gradients are reduced by ``DistributedDataParallel`` (:meth:`wrap`); the small host-side agreements
    (an interrupt request) go through a gloo group on CPU tensors, so they never synchronise a GPU."""

    def __init__(self, device_spec: str = "auto"):
        import torch.distributed as dist

        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.owned = False
        self.device = resolve_device(device_spec)
        self.cpu_group = None
        if self.world > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            # torch.distributed.nn.functional binds ``group.WORLD`` as the default argument of ten functions when
            # it is first imported, which DistributedDataParallel does: imported after init_process_group, it
            # holds the default group — and gloo's threads — past destroy_process_group until the interpreter
            # tears that module down, where rank 1 occasionally aborted ("terminate called without an active
            # exception"). Imported before any group exists, the defaults are None.
            import torch.distributed.nn as _distributed_nn  # noqa: F401  (binds only this name, not torch)
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
            self.owned = True
        if self.world > 1:
            gloo = dist.get_backend() == "gloo"
            self.cpu_group = None if gloo else dist.new_group(backend="gloo")
        self.rank = dist.get_rank() if self.world > 1 else 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (every rank sees the same global order)."""
        return idx[self.rank :: self.world]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``DistributedDataParallel`` around ``model`` (the model itself in one process).

        The set of parameters a training forward uses never changes during a run (the variant, its
        options and the sampling mode are fixed; every registered variant's model uses all of its
        parameters, tests/test_distributed.py), so ``static_graph=True``: DDP learns that set in the
        first step instead of searching the autograd graph every step (``find_unused_parameters``), and a
        variant with an option that leaves a parameter unused still trains."""
        if self.world == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, static_graph=True)

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            self.dist.all_reduce(t)
        return t

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a CPU all-reduce: no device synchronisation)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(t[0] > 0)

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable, on the CPU), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        parts = [None] * self.world
        self.dist.all_gather_object(parts, obj, group=self.cpu_group)
        return parts

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """Reassemble rows sharded as ``rank::world`` into their original order."""
        if self.world == 1:
            return local
        parts = self.gather_objects(local.cpu())
        out = torch.empty(n, *local.shape[1:], dtype=local.dtype)
        for r, part in enumerate(parts):
            out[r :: self.world] = part
        return out

    def close(self, barrier: bool = True) -> None:
        """End the process group this object started (``barrier``: wait for every rank first; off when
        leaving on an exception, which every rank may not share). Left open, or kept alive by a reference
        (see ``__init__``), gloo's threads run into interpreter teardown, which they occasionally abort
        ("terminate called without an active exception")."""
        if self.owned and self.dist.is_initialized():
            if barrier:
                self.dist.barrier()
            self.dist.destroy_process_group()
            self.owned = False


def _rng_state(device: torch.device) -> dict:
    """This process's random state: the CPU generator and, on a GPU, the device's generator."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@torch.no_grad()
def predict(
    model, split, num_samples: int, batch_size: int = 256, dist: _Dist | None = None, precision: str = "fp32",
    progress: str | None = None,
) -> torch.Tensor:
    """Sample logits of a whole split in eval mode, on the model's device (sharded over ranks under
    torchrun), returned on the CPU; ``progress``: a tqdm bar over the batches with that description (an
    evaluation of cgp or sgpa at P samples can take minutes).  # shape: (N, P, C)"""
    model.eval()
    n = len(split.labels)
    rows = torch.arange(n) if dist is None else dist.shard(torch.arange(n))
    device = next(model.parameters()).device
    out = []
    starts = range(0, len(rows), batch_size)
    bar = tqdm(starts, desc=progress, disable=progress is None, leave=False, dynamic_ncols=True, unit="batch")
    for start in bar:
        x, mask, _ = _batch(split, rows[start : start + batch_size], device)
        with _autocast(device, precision):
            out.append(model(x, mask, num_samples=num_samples).float())
    classes = getattr(model, "num_classes", 2)
    local = torch.cat(out).cpu() if out else torch.zeros(0, num_samples, classes)  # one copy to the host
    return local if dist is None else dist.gather_rows(local, n)


def evaluate_predictions(preds: dict, bundle, average: str = "probs", temperature: float = 1.0) -> dict:
    """metrics.json content from sample logits: classification metrics per evaluation split, on its
    labelled rows (``None`` where no row has a label; ``n`` / ``n_labelled`` / ``class_counts`` say
    which), and for OOD splits the OOD-detection metrics against ``in_domain`` under every score
    (max probability as ``ood_auroc`` ..., the others as ``ood_auroc_<score>`` ...)."""
    from gpattn.experiments import metrics as M

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

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


def load_run_with_data(path, device=None) -> tuple[TrainConfig, torch.nn.Module, object, dict]:
    """Load a checkpoint file (or a run folder) and reload its data set -> (config, model, data bundle,
    checkpoint dict), the model on ``device`` (``auto``/``cpu``/``cuda[:N]`` or a ``torch.device``; default:
    the CPU). To score new inputs without the data files: :func:`gpattn.experiments.inference.load_run`."""
    device = torch.device("cpu") if device is None else as_device(device)
    path, ckpt = run_checkpoint(path, map_location=device)
    cfg = TrainConfig.from_saved(ckpt["config"])
    bundle = load_checked_data(path, cfg, lambda b: _for_model(cfg, b, device))  # data.json: paths, fingerprint
    model = build_model(cfg, bundle).to(device)
    model.load_state_dict(ckpt["model"])
    return cfg, model, bundle, ckpt


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
    stop_after_steps: int | None = None,
) -> dict:
    """Fit, checkpoint and evaluate one run; returns the metrics dict (also ``out/metrics.json``).

    ``stop_after_steps`` simulates an interruption (tests): the run checkpoints after that many
    optimizer steps and raises ``KeyboardInterrupt``. A run that fails with an error leaves no
    ``config.json`` or ``data.json`` of its own (an interrupted run keeps them beside its checkpoint, a
    diverged one beside ``diverged.json``).
    """
    written = [Path(out) / name for name in ("config.json", "data.json")] if out is not None else []
    before = {p: p.stat().st_mtime_ns if p.is_file() else None for p in written}
    try:
        return _train(cfg, out, resume, bundle, stop_after_steps)
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


def _train(cfg: TrainConfig, out, resume: bool, bundle, stop_after_steps) -> dict:
    run = _setup(cfg, out, resume, bundle)
    if resume:
        _restore(run)
    run.net = run.dist.wrap(run.model)  # DistributedDataParallel under torchrun
    run.guard = _DivergenceGuard(run.model, run.device)
    _fit(run, stop_after_steps)
    if cfg.sngp is not None:  # SNGP's Laplace covariance: one pass over the training data, kept in the checkpoint
        from gpattn.experiments.sngp import fit_covariance

        split = run.bundle.splits["train"]
        rows = torch.arange(len(split)).split(cfg.eval_batch_size)
        fit_covariance(run.model, (_batch(split, idx, run.device)[:2] for idx in rows))
        _save(run)
    return _evaluate(run)


def _setup(cfg: TrainConfig, out, resume: bool, bundle) -> _Run:
    """The run's files, data (an encoder's recipe applied), model, optimizer and objective."""
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.data.summary import data_summary

    resolve_device(cfg.device)  # CUDA asked for where there is none: refused before any file is written
    out = Path(out) if out is not None else None
    writes = out is not None and int(os.environ.get("RANK", "0")) == 0
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(cfg.to_dict(), out / "config.json")
        (out / DIVERGED).unlink(missing_ok=True)  # a record of an earlier attempt in this folder
    if bundle is None:
        bundle = load_dataset(
            cfg.dataset, data_dir=cfg.data_dir, download=cfg.download, seed=cfg.seed, **cfg.dataset_options
        )
    bundle = _for_model(cfg, bundle, resolve_device(cfg.device))
    if writes:
        _write_json(data_summary(bundle), out / "data.json")  # files, sizes, class counts, fingerprint
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
        steps_per_epoch * cfg.epochs, base_rate_entropy(labels, bundle.num_classes),
    )


def _restore(run: _Run) -> None:
    """``--resume``: the model, optimizer, scheduler, step, history, epoch statistics and random states of
    the checkpoint, which must be of this configuration."""
    if run.checkpoint is None or not run.checkpoint.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {run.checkpoint}")
    ckpt = load_checkpoint(run.checkpoint)  # on the CPU: RNG states must be host tensors
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

    try:
        with _Interrupt() as interrupt:
            while run.step < run.total_steps:
                _one_step(run, bar)
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
        bar.set_postfix(loss=f"{entry['train']['loss']:.3f}", refresh=False)  # read once an epoch
        run.stats = EpochStats()
        _save(run)
    elif cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
        _save(run)


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
            warnings.warn(f"{cfg.attention} seed {cfg.seed}: {msg}", GPCollapseWarning, stacklevel=4)
    preds = {
        key: {
            "logits": predict(
                run.model, bundle.splits[key], cfg.num_samples, cfg.eval_batch_size, dist, cfg.precision,
                progress=f"{cfg.attention} seed {cfg.seed}: evaluating {key}" if cfg.progress and dist.main else None,
            ),
            "labels": bundle.splits[key].labels,
        }
        for key in sorted({"val", *bundle.eval_splits.values()})
    }
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
    if name == "load_run":  # renamed in 0.2.0: two functions of that name returned different things
        raise AttributeError(
            "gpattn.experiments.training.load_run is now load_run_with_data (it reloads the data set and returns "
            "(config, model, data bundle, checkpoint)); to score new inputs without the data files use "
            "gpattn.experiments.load_run (a Run with .predict)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
