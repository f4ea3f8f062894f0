"""A run's settings: :class:`TrainConfig` (everything a run depends on, written to ``config.json``), its checks,
and :func:`_same_run`, which says whether a saved config describes the same run. Split from
:mod:`gpattn.experiments.training`, which re-exports every name."""

from __future__ import annotations

import dataclasses
import json
import math

from gpattn._migrate import migrate_config
from gpattn.attention.registry import former_options, list_attention, recipe_options
from gpattn.experiments._optim import DEFAULT_BATCH_SIZE, ENCODER_DEFAULTS
from gpattn.experiments._runs import valid_device
from gpattn.kernels import require_kernel_spec
from gpattn.objectives import DEFAULT_ALPHA

__all__ = ["ENCODER_RECIPES", "PRECISIONS", "RUN_SETTINGS", "TrainConfig"]

#: settings that change where and how a run executes, not what it computes: a run trained with other
#: values is resumed (``--resume``) and reused (``gpattn compare``) as it is. ``device`` is one of them:
#: CPU and GPU kernels differ only in float round-off, and a run trained on a GPU must stay usable on a
#: CPU-only machine. ``precision`` is not: bf16 autocast changes the results. ``compile`` is: a compiled step
#: computes what eager does (to round-off given the same draws, tests/test_compile.py); Inductor's own random
#: generator draws other numbers from the same distribution, as another device's does.
RUN_SETTINGS = ("progress", "checkpoint_every", "device", "compile")
#: the objective's settings that are TrainConfig fields of their own (``loss_weights`` holds the others)
_OWN_WEIGHTS = ("beta", "beta_anneal_steps", "eta", "alpha", "alpha_anneal_steps")
#: ``--precision``: autocast dtype of the model outside the GP algebra (which stays in fp32/fp64)
PRECISIONS = ("fp32", "bf16")


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
    #: them (spectral normalisation of the scope ``spectral_norm`` names, a random-feature GP head, its Laplace
    #: covariance fitted after training); on an encoder too (gpattn.experiments.sngp.sngp_options)
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
    #: train through ``torch.compile`` of the model (Inductor), one graph for batches of every length
    #: (``dynamic=True``; docs/benchmarks.md "Compiled training with varying lengths"); evaluation stays eager
    compile: bool = False

    def __post_init__(self):
        """The training loop's own settings, checked before any data is loaded (the model's, the
        attention's and the objective's are checked where they are used, with the same kind of message)."""

        def bad(name, want):
            return ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v):  # plain ints only (not data._images.is_int's NumPy ints): config.json must serialise
            return isinstance(v, int) and not isinstance(v, bool)

        if isinstance(self.attention, str) and isinstance(self.attention_options, dict):
            # the recipe (given as the option ``recipe``, else the swap's with an encoder) and its options written out
            # (gpattn.attention.recipe_options), so config.json (and compare's reuse check) says which form ran
            recipe = self.attention_options.get("recipe", "encoder-swap" if self.encoder is not None else "scratch")
            self.attention_options = {**recipe_options(self.attention, recipe), **self.attention_options}
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
            flags = "--beta, --eta, --alpha, ..."
            raise bad("loss_weights", f"free of {', '.join(own)}, which have their own settings ({flags})")
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
        if not isinstance(self.compile, bool):
            raise bad("compile", "True or False (--compile)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision (--precision) must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if isinstance(self.attention_options, dict) and "kernel" in self.attention_options:
            # config.json stores kernel specs (gpattn.kernels), never a kernel instance
            require_kernel_spec(self.attention_options["kernel"], name="attention_options['kernel']")
        if self.sngp is not None:
            from gpattn.experiments.sngp import check_sngp_options

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
        """A run's saved config (its checkpoint's): as ``from_dict``, after
        :func:`gpattn._migrate.migrate_config` (a config written by an older gpattn keeps the form it
        trained, with an ``OldVersionWarning``); one that records an option its layer no longer takes at a value no
        migration reads is an error naming what owns that form now."""
        d = migrate_config(d)
        name, options = d.get("attention"), d.get("attention_options")
        left = former_options(name, options) if name in list_attention() and isinstance(options, dict) else {}
        if left:
            raise ValueError(
                f"this run's config records {', '.join(f'{k}={options[k]!r}' for k in left)}, no option of the {name} "
                "layer any more and at a value no migration reads (runs of development commits are trained again: "
                "docs/development.md, 'Versions and compatibility'): train it again with today's form; "
                + "; ".join(f"{k}: {owner}" for k, owner in left.items())
            )
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
