r"""A GP readout: a trained classifier's linear head, its logits carried to the prediction with the posterior
variance of a GP on the pooled features the head reads (docs/derivations.md §14a).

With h = h(x) the head's input (the pooled representation) and φ the random Fourier features of an RBF kernel on
it (:class:`gpattn.experiments.sngp.RandomFeatureGP`'s features, reused),

.. math::
    \mathrm{logits}(x) = \frac{\mathrm{head}(h)}{\sqrt{1 + \lambda\, v(h)}}, \qquad
    v(h) = \phi(h)^\top \Big(s I + \sum_i w_i\, \phi(h_i) \phi(h_i)^\top\Big)^{-1} \phi(h),

the sum over the training split (one eval-mode pass, post hoc), :math:`w_i = 1` (the ridge precision: a GP
regression's posterior variance, the default) or :math:`w_i = p_i(1 - p_i)` of the head's logits (the Laplace
precision of SNGP); the mean-field rule is :func:`gpattn.experiments.sngp.mean_field_logits`. λ = 0 gives back the
head's logits exactly; ``compare`` chooses λ from :data:`gpattn.experiments.readout.FACTOR_GRID` and the ridge s
from :data:`gpattn.experiments.readout.RIDGE_GRID` together on the validation split's NLL
(:func:`gpattn.experiments.readout.readout_predictions`), π/8 being the probit-matched λ. Everything fitted (the
features' draws, the lengthscale, the posterior: its Cholesky factor, or V and σ² of the low-rank form, λ) is a
buffer, so the model's ``state_dict`` carries it: a fresh model with
:func:`gpattn.experiments.readout.attach_gp_readout` and ``load_state_dict`` predicts without the training data.

``+gpreadout`` in ``compare`` (``softmax+gpreadout``, ``sgpa-rff+gpreadout+ts``): a post-hoc modifier like
``+laplace``, on the run it modifies.

The readout's own OOD score (:data:`OWN_SCORES`, ``--ood-score gp-variance``) is v(h) itself, higher = further from
the training features: at the ridge chosen with λ, or where the data set has an OOD validation split
(:data:`gpattn.experiments.features.OOD_VALIDATION_SPLIT`), at the ridge of :data:`RIDGE_GRID` whose v separates the
in-domain validation split from it best (:func:`choose_score_ridge`; the same draws and ℓ, only s differs).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from gpattn.experiments.sngp import MEAN_FIELD_FACTOR, Gram, RandomFeatureGP, mean_field_logits

__all__ = [
    "FACTOR_GRID",
    "GPReadout",
    "NUM_FEATURES",
    "OWN_SCORES",
    "RIDGE_GRID",
    "attach_gp_readout",
    "choose_readout",
    "choose_score_ridge",
    "fit_gp_readout",
    "gp_variance_score",
    "readout_predictions",
    "readout_split",
    "select_mean_field_factor",
    "unit_weights",
]

#: the candidates of λ chosen on the validation NLL: 0 (the head itself), π/8 (the probit-matched value) and half
#: decades from 10⁻² to 10³ (v ranges from its values on the training features to the prior 1/s far from them, so
#: the useful λ moves with s)
FACTOR_GRID = (0.0, 0.01, 0.03, 0.1, 0.3, MEAN_FIELD_FACTOR, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
#: the candidates of the ridge s chosen with λ on the validation NLL (decades: a smaller s lets the data shrink v
#: further below the prior 1/s, so the variance's spread between the data and far from it grows)
RIDGE_GRID = (1.0, 0.1, 0.01, 0.001, 0.0001)
#: R, the readout's random Fourier features (docs/derivations.md §14a, "Choice (R = 4096)"): its variance is the exact
#: GP's up to the features' Monte-Carlo error, which at SNGP's 1024 still cost OOD ranking (CLINC150, 5 seeds: v's
#: AUROC 0.9787 at 1024, 0.9816 at 4096, 0.9818 at 4096 orthogonal); the posterior is R² float64 (128 MB) from N ≥ R/2
#: training rows, R·N below (:class:`gpattn.experiments.sngp.LowRankPosterior`)
NUM_FEATURES = 4096
#: training rows the median heuristic of the lengthscale reads (a fixed random subset)
MEDIAN_ROWS = 1000
#: training rows per block of the precision's accumulation
_FIT_ROWS = 4096


def unit_weights(logits: torch.Tensor) -> torch.Tensor:
    """The ridge curvature: weight 1 for every example, whatever its logits (the precision s·I + ΦᵀΦ, a GP
    regression's posterior with unit noise).  # shape: (N, C) -> (N,)"""
    return torch.ones(logits.shape[:-1], dtype=logits.dtype, device=logits.device)


def _check_factor(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"mean_field_factor must be a finite number >= 0 (0: the head's logits), got {value!r}")
    return float(value)


class GPReadout(nn.Module):
    r"""A linear head read out through a GP's posterior variance at its input: ``head(h) / sqrt(1 + λ v(h))``
    (module docstring, docs/derivations.md §14a).

    :param head: the trained ``nn.Linear`` head (kept as ``self.head``, unchanged).
    :param num_features: R = D_L, the random Fourier features (None: :data:`gpattn.experiments.readout.NUM_FEATURES`).
    :param lengthscale: ℓ of the RBF kernel; None: the median pairwise distance of (a subset of) the training
        features, set by :meth:`fit`.
    :param input_norm: a LayerNorm without affine on h before the features (SNGP's option); default off: the GP
        reads the head's input as the head does.
    :param ridge: s, the prior precision (the ``s·I`` of the precision).
    :param curvature: each training example's weight in the precision from the head's logits, a function
        ``(N, C) -> (N,)``: :func:`gpattn.experiments.readout.unit_weights` (default, the ridge precision) or
        :func:`gpattn.experiments.sngp.laplace_weights` (SNGP's Laplace precision).

    Until :meth:`fit` the readout has no variance (:meth:`variance` raises); λ (``mean_field_factor``, a buffer)
    starts at 0, where the readout returns the head's logits exactly. The GP's own output layer (``gp.output``) is
    unused and frozen: the readout's mean is the trained head.
    """

    def __init__(
        self, head: nn.Linear, *, num_features: int | None = None, lengthscale: float | None = None,
        input_norm: bool = False, ridge: float = 1.0, curvature=unit_weights,
    ):
        super().__init__()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"head must be an nn.Linear (a classifier's last layer), got {type(head).__name__}")
        if not callable(curvature):
            raise ValueError(f"curvature must be a function (N, C) logits -> (N,) weights, e.g. unit_weights, got "
                             f"{curvature!r}")
        self.head, self.curvature = head, curvature
        self.auto_lengthscale = lengthscale is None
        ell = 1.0 if lengthscale is None else lengthscale
        self.gp = RandomFeatureGP(
            head.in_features, 1, num_features=NUM_FEATURES if num_features is None else num_features, lengthscale=ell,
            input_norm=input_norm, ridge=ridge, mean_field_factor=0.0,
        ).to(head.weight.device)
        self.gp.output.requires_grad_(False)
        #: ℓ the features' draws are scaled to (W ~ N(0, ℓ⁻²))
        self.register_buffer("lengthscale", torch.tensor(float(self.gp.lengthscale), dtype=torch.float64))
        #: λ of the mean-field rule (0: the head's logits)
        self.register_buffer("mean_field_factor", torch.zeros((), dtype=torch.float64))
        #: s, the prior precision (a buffer, so that a loaded readout refits with the ridge it was fitted with)
        self.register_buffer("ridge", torch.tensor(float(self.gp.ridge), dtype=torch.float64))

    @property
    def in_features(self) -> int:
        """D, the width of the head's input."""
        return self.head.in_features

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` has set the precision (from a fit or a loaded state dict)."""
        return int(self.gp.num_fitted) > 0

    def _check_input(self, h: torch.Tensor, name: str = "h") -> None:
        if not torch.is_tensor(h) or h.dim() < 1 or h.shape[-1] != self.in_features:
            got = tuple(h.shape) if torch.is_tensor(h) else type(h).__name__
            raise ValueError(f"{name} must have shape (..., D={self.in_features}) (the head's input), got {got}")

    def set_factor(self, value: float) -> GPReadout:
        """Set λ (a finite number ≥ 0; 0: the head's logits). Returns the readout."""
        value = _check_factor(value)
        if value > 0 and not self.fitted:
            raise ValueError("the GPReadout is not fitted: fit it (fit_gp_readout(model, train_split) or "
                             "readout.fit(h)) before setting mean_field_factor > 0")
        self.mean_field_factor.fill_(value)
        return self

    def variance(self, h: torch.Tensor) -> torch.Tensor:
        """v(h) = φ(h)ᵀ Σ φ(h) of the fitted precision Σ⁻¹, float64.  # shape: (..., D) -> (...)"""
        self._check_input(h)
        if not self.fitted:
            raise ValueError("the GPReadout is not fitted: call fit_gp_readout(model, train_split) or readout.fit(h) "
                             "with the training features first")
        flat = h.reshape(-1, self.in_features).to(self.gp.feature_weight)  # the readout's device and dtype
        # equal rows (the P samples of a body that samples nothing) share one solve: R²/2 or R·N per distinct row
        rows, inverse = torch.unique(flat, dim=0, return_inverse=True)
        if rows.shape[0] == flat.shape[0]:
            rows, inverse = flat, None
        v = self.gp.variance(self.gp.features(rows))  # shape: (rows,)
        return (v if inverse is None else v[inverse]).reshape(h.shape[:-1])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The mean-field logits ``head(h) / sqrt(1 + λ v(h))``; at λ = 0 ``head(h)`` itself.
        # shape: (..., D) -> (..., C)"""
        self._check_input(h)
        logits = self.head(h)
        factor = float(self.mean_field_factor)
        if factor == 0:
            return logits
        return mean_field_logits(logits, self.variance(h).to(logits.dtype), factor)

    @torch.no_grad()
    def fit(self, h: torch.Tensor) -> GPReadout:
        """Fit the GP on the training features ``h`` ``(N, D)``: the lengthscale by the median heuristic (when
        ``lengthscale`` was None), then Σ⁻¹ = s·I + Σᵢ wᵢ φᵢ φᵢᵀ in float64 (a refit starts from the prior).
        Returns the readout."""
        return self.set_gram(self.gram(h))

    @torch.no_grad()
    def gram(self, h: torch.Tensor) -> Gram:
        """The data's part of the precision from the training features ``h`` ``(N, D)``: ℓ by the median heuristic
        (when ``lengthscale`` was None), then G = Σᵢ wᵢ φᵢ φᵢᵀ in float64 over the N rows, dense or low-rank
        (:meth:`gpattn.experiments.sngp.RandomFeatureGP.feature_gram`); :meth:`set_gram` gives the posterior of
        s·I + G, so one G serves every ridge of readouts with the same draws and ℓ."""
        self._check_input(h)
        if h.dim() != 2 or h.shape[0] < 1:
            raise ValueError(f"h must be the training features, shape (N >= 1, D={self.in_features}), got "
                             f"{tuple(h.shape)}")
        h = h.to(self.gp.feature_weight)
        if self.auto_lengthscale:
            self._set_lengthscale(self._median_distance(h))
        blocks = h.split(_FIT_ROWS)
        return self.gp.feature_gram(
            (self.gp.features(b) for b in blocks), weights=(self.curvature(self.head(b)).detach() for b in blocks)
        )

    @torch.no_grad()
    def set_gram(self, gram: Gram) -> GPReadout:
        """The posterior of Σ⁻¹ = s·I + G at the readout's ridge s, from :meth:`gram`'s G
        (a :class:`gpattn.experiments.sngp.Gram`). Returns the readout."""
        self.gp.ridge = float(self.ridge)
        self.gp.set_gram(gram)
        return self

    def _median_distance(self, h: torch.Tensor) -> float:
        rows = torch.randperm(h.shape[0], generator=torch.Generator().manual_seed(0))[:MEDIAN_ROWS]
        z = self.gp.norm(h[rows.to(h.device)]).to(torch.float64)
        median = float(torch.quantile(torch.pdist(z), 0.5)) if z.shape[0] > 1 else 0.0
        if not median > 0:
            raise ValueError("the training features are all equal, so the median heuristic has no lengthscale: "
                             "pass lengthscale= to the GPReadout")
        return median

    def _set_lengthscale(self, value: float) -> None:
        self.gp.feature_weight.mul_(float(self.lengthscale) / value)  # W ~ N(0, ℓ⁻²) at the new ℓ, same draws
        self.lengthscale.fill_(value)
        self.gp.lengthscale = value

    def extra_repr(self) -> str:
        return (f"lengthscale={float(self.lengthscale):.4g}{' (median)' if self.auto_lengthscale else ''}, "
                f"mean_field_factor={float(self.mean_field_factor):g}, fitted on {int(self.gp.num_fitted)}")


def gp_variance_score(readout: GPReadout, h: torch.Tensor) -> torch.Tensor:
    """The ``gp-variance`` OOD score: v(h) averaged over the sample axis, higher = further from the training
    features.  # shape: (N, P, D) -> (N,) float64"""
    return readout.variance(h).to(torch.float64).mean(-1)


#: the readout's own OOD scores by their ``--ood-score`` names (:data:`gpattn.experiments.metrics.OWN_SCORE_NAMES`):
#: ``(readout, h (N, P, D)) -> (N,)`` float64, higher = more out-of-distribution; ``compare`` puts them in a
#: ``+gpreadout`` run's predictions as ``own_scores``
OWN_SCORES = {"gp-variance": gp_variance_score}


def _ridge_readouts(head: nn.Linear, h_train: torch.Tensor, ridges, seed: int, make=None, **options):
    """``(s, readout)`` for each ridge s of ``ridges``: readouts of ``head`` with the draws of ``seed``, fitted on
    ``h_train`` from one Gram (:meth:`GPReadout.gram`: the features, ℓ and G computed once; a dense G is factorised
    per s, a low-rank one serves every s as it is).
    ``make``: ``(head, seed, **options) -> GPReadout`` (default ``_new_readout``; a probe's draw in research/)."""
    make = make or _new_readout
    first = make(head, seed, ridge=ridges[0], **options)
    gram = first.gram(h_train)
    for ridge in ridges:
        readout = first if ridge == ridges[0] else make(head, seed, ridge=ridge, **options)
        if readout.auto_lengthscale and readout is not first:
            readout._set_lengthscale(float(first.lengthscale))  # the same draws, rescaled as first's were
        yield ridge, readout.set_gram(gram)


def _new_readout(head: nn.Linear, seed: int, **options) -> GPReadout:
    """A :class:`gpattn.experiments.readout.GPReadout` of ``head`` whose random features are drawn from
    ``seed`` (the global RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPReadout(head, **options)


def attach_gp_readout(model: nn.Module, *, seed: int = 0, **options) -> GPReadout:
    """Wrap ``model.head`` (an ``nn.Linear``) in a :class:`gpattn.experiments.readout.GPReadout`, in place,
    and return the readout. ``options``: the readout's keywords; ``seed`` fixes the random features' draws (the
    global RNG is left as it was). A model whose readout was fitted loads into a fresh model after this call."""
    head = getattr(model, "head", None)
    if isinstance(head, GPReadout):
        raise ValueError("model.head is a GPReadout already (attach_gp_readout called twice?)")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"attach_gp_readout needs a model whose last layer model.head is an nn.Linear (gpattn's "
                         f"classifiers), got {type(head).__name__}")
    model.head = _new_readout(head, seed, **options)
    return model.head


def _readout_of(model) -> GPReadout:
    readout = getattr(model, "head", None)
    if not isinstance(readout, GPReadout):
        raise ValueError(f"model.head must be a GPReadout (attach_gp_readout(model) first), got "
                         f"{type(readout).__name__}")
    return readout


@torch.no_grad()
def fit_gp_readout(model: nn.Module, train_split, batch_size: int = 256) -> GPReadout:
    """Fit ``model.head`` (a :class:`gpattn.experiments.readout.GPReadout`) on the head's inputs over ``train_split`` (a
    ``gpattn.experiments.data.Split``), one eval-mode pass with ``num_samples=1``
    (:func:`gpattn.experiments.laplace.extract_features`). Returns the readout; its λ is kept."""
    from gpattn.experiments.laplace import extract_features

    readout = _readout_of(model)
    factor = float(readout.mean_field_factor)
    readout.mean_field_factor.fill_(0.0)  # the pass reads the head's input only
    try:
        h = extract_features(model, train_split, batch_size, head=readout.head)
    finally:
        readout.mean_field_factor.fill_(factor)
    if h.shape[0] == 0:
        raise ValueError("train_split is empty: the readout needs the training features")
    return readout.fit(h.to(readout.head.weight.device))


def _linear_head(model) -> nn.Linear:
    head = getattr(model, "head", None)
    head = head.head if isinstance(head, GPReadout) else head
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model.head must be an nn.Linear or a GPReadout of one, got {type(head).__name__}")
    return head


@torch.no_grad()
def readout_split(
    model: nn.Module, split, num_samples: int, batch_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """The linear head's logits and its inputs h on every row of ``split`` at ``num_samples`` samples, in eval mode
    (one forward per batch, as :func:`gpattn.experiments.training.predict`): ``(N, P, C)`` and ``(N, P, D)``, for
    ``model.head`` a Linear or a :class:`gpattn.experiments.readout.GPReadout`;
    ``mean_field_logits(logits, readout.variance(h), λ)`` is the prediction of the model read out at λ."""
    from gpattn.experiments.training import predict
    from gpattn.models._blocks import sample_logits

    head = _linear_head(model)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []  # (B, P, C) and (B, P, D) per batch, on the host

    def record(module, args, output):
        captured.append((sample_logits(output, num_samples).cpu(), sample_logits(args[0], num_samples).cpu()))

    hook = head.register_forward_hook(record)
    try:
        predict(model, split, num_samples, batch_size)
    finally:
        hook.remove()
    if not captured:
        return torch.zeros(0, num_samples, head.out_features), torch.zeros(0, num_samples, head.in_features)
    return torch.cat([z for z, _ in captured]), torch.cat([h for _, h in captured])


def select_mean_field_factor(
    logits: torch.Tensor, variance: torch.Tensor, labels: torch.Tensor, grid=FACTOR_GRID, average: str = "probs",
) -> tuple[float, dict]:
    """λ of ``grid`` with the lowest NLL of ``mean_field_logits(logits, variance, λ)`` on the labelled rows
    (labels ≥ 0) of a validation split, the samples averaged as ``average``
    (:func:`gpattn.experiments.metrics.average_samples`); a tie goes to the smaller λ. Returns
    ``(λ, {λ: NLL})``.  # shape: logits (N, P, C), variance (N, P), labels (N,)"""
    from gpattn.experiments import metrics as M

    grid = sorted({_check_factor(g) for g in grid}) if not isinstance(grid, (str, bytes)) else []
    if not grid:
        raise ValueError("grid must be a non-empty sequence of numbers >= 0, e.g. FACTOR_GRID")
    if logits.dim() != 3 or variance.shape != logits.shape[:2] or labels.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (N, P, C), variance (N, P) and labels (N,), got {tuple(logits.shape)}, "
                         f"{tuple(variance.shape)} and {tuple(labels.shape)}")
    known = labels >= 0
    if not bool(known.any()):
        raise ValueError("no labelled row to choose mean_field_factor on (every label is < 0)")
    z, v, y = logits[known].to(torch.float64), variance[known].to(torch.float64), labels[known]
    scores = {lam: M.nll(M.average_samples(mean_field_logits(z, v, lam), average=average), y) for lam in grid}
    best = min(grid, key=lambda lam: scores[lam])  # grid sorted: the first minimum is the smallest λ
    return best, scores


def readout_predictions(
    model: nn.Module, bundle, keys, num_samples: int, *, grid=FACTOR_GRID, ridges=RIDGE_GRID, average: str = "probs",
    seed: int = 0, batch_size: int = 256, **options,
) -> tuple[dict, dict]:
    """``compare``'s ``+gpreadout``: a :class:`gpattn.experiments.readout.GPReadout` on the trained
    ``model``'s linear head, fitted on ``bundle.splits["train"]`` at each ridge s of ``ridges``, (s, λ) chosen
    together on the NLL of ``bundle.splits["val"]`` (:func:`gpattn.experiments.readout.select_mean_field_factor`
    per s; a tie keeps the earlier s), attached as ``model.head`` at the chosen s and λ, and every split of ``keys``
    predicted with its own scores (:data:`OWN_SCORES`, at the ridge of :func:`choose_score_ridge` where the bundle
    has an OOD validation split, else at s). Returns ``(predictions, selection)``:
    ``{key: {"logits": (N, P, C), "labels", "own_scores": {name: (N,)}}}`` as a run's ``predictions.pt``, and
    ``{"mean_field_factor": λ, "ridge": s, "lengthscale": ℓ, "val_nll": {s: {λ: NLL}}, "score_ridge": s_v,
    "score_ridge_from": ..., "score_val_auroc": {s: AUROC}}`` (the last empty without an OOD validation split)."""
    from gpattn.experiments.features import OOD_VALIDATION_SPLIT
    from gpattn.experiments.laplace import extract_features

    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model.head must be an nn.Linear (a trained classifier's head), got {type(head).__name__}")
    if not list(ridges):
        raise ValueError("ridges must name at least one ridge s > 0, e.g. RIDGE_GRID")
    h_train = extract_features(model, bundle.splits["train"], batch_size).to(head.weight.device)
    if h_train.shape[0] == 0:
        raise ValueError("bundle.splits['train'] is empty: the readout needs the training features")
    ood_val = bundle.splits.get(OOD_VALIDATION_SPLIT)
    ood_val = OOD_VALIDATION_SPLIT if ood_val is not None and len(ood_val.labels) else None
    wanted = dict.fromkeys(["val", *keys, *([ood_val] if ood_val else [])])
    parts = {k: readout_split(model, bundle.splits[k], num_samples, batch_size) for k in wanted}
    readout, selection = choose_readout(
        head, h_train, *parts["val"], bundle.splits["val"].labels, grid=grid, ridges=ridges, average=average,
        seed=seed, **options,
    )
    scorer, selection["score_ridge"] = readout, selection["ridge"]
    selection["score_ridge_from"], selection["score_val_auroc"] = "the readout's (no OOD validation split)", {}
    if ood_val:
        scorer, aurocs = choose_score_ridge(head, h_train, parts["val"][1], parts[ood_val][1], ridges=ridges,
                                           seed=seed, **options)
        selection["score_ridge"], selection["score_val_auroc"] = float(scorer.ridge), aurocs
        selection["score_ridge_from"] = f"val against {ood_val} (OOD AUROC of v)"
    model.head = readout
    lam = selection["mean_field_factor"]
    preds = {
        k: {"logits": mean_field_logits(parts[k][0], readout.variance(parts[k][1]).cpu(), lam).to(torch.float32),
            "labels": bundle.splits[k].labels,
            "own_scores": {name: score(scorer, parts[k][1]).cpu() for name, score in OWN_SCORES.items()}}
        for k in keys
    }
    return preds, selection


def choose_score_ridge(
    head: nn.Linear, h_train: torch.Tensor, val_inputs: torch.Tensor, ood_val_inputs: torch.Tensor, *,
    ridges=RIDGE_GRID, seed: int = 0, **options,
) -> tuple[GPReadout, dict]:
    """The ridge of the readout's own score, chosen on validation: the readout of ``head`` (draws from ``seed``, ℓ by
    the median heuristic, as :func:`choose_readout`'s) fitted on ``h_train`` ``(N, D)`` at each s of ``ridges``,
    and the one whose v (:func:`gp_variance_score`) separates the in-domain validation inputs ``(N_v, P, D)`` from
    the OOD validation inputs ``(N_o, P, D)`` best (ROC area; a tie keeps the earlier s). λ is not read: the
    returned readout scores, it does not predict. Returns ``(readout, {s: AUROC})``."""
    from gpattn.experiments import metrics as M

    ridges = list(ridges)
    if not ridges:
        raise ValueError("ridges must name at least one ridge s > 0, e.g. RIDGE_GRID")
    for name, x in (("val_inputs", val_inputs), ("ood_val_inputs", ood_val_inputs)):
        if x.dim() != 3 or x.shape[0] < 1 or x.shape[-1] != head.in_features:
            raise ValueError(f"{name} must have shape (N >= 1, P, D={head.in_features}) (readout_split's inputs), "
                             f"got {tuple(x.shape)}")
    best, aurocs = None, {}
    for ridge, readout in _ridge_readouts(head, h_train, ridges, seed, **options):
        v_in, v_out = (gp_variance_score(readout, x).cpu() for x in (val_inputs, ood_val_inputs))
        auroc = M.ood_metrics(-v_in, -v_out)["ood_auroc"]  # higher = more in-distribution
        aurocs[f"{ridge:g}"] = auroc
        if best is None or auroc > best[0]:
            best = (auroc, readout)
    return best[1], aurocs


def choose_readout(
    head: nn.Linear, h_train: torch.Tensor, val_logits: torch.Tensor, val_inputs: torch.Tensor, val_labels, *,
    grid=FACTOR_GRID, ridges=RIDGE_GRID, average: str = "probs", seed: int = 0, **options,
) -> tuple[GPReadout, dict]:
    """The readout of ``head`` fitted on the training features ``h_train`` ``(N, D)`` at each ridge of ``ridges``,
    (s, λ) chosen on the validation NLL from the head's validation logits ``(N_v, P, C)`` and inputs
    ``(N_v, P, D)`` (:func:`readout_split`); a tie keeps the earlier s. Returns the readout at the chosen s and
    λ and ``{"mean_field_factor": λ, "ridge": s, "lengthscale": ℓ, "val_nll": {s: {λ: NLL}}}``."""
    ridges = list(ridges)
    if not ridges:
        raise ValueError("ridges must name at least one ridge s > 0, e.g. RIDGE_GRID")
    best, scores = None, {}
    for ridge, readout in _ridge_readouts(head, h_train, ridges, seed, **options):
        variance = readout.variance(val_inputs).cpu()
        lam, nll = select_mean_field_factor(val_logits, variance, val_labels, grid, average)
        scores[f"{ridge:g}"] = {f"{g:g}": v for g, v in nll.items()}
        if best is None or nll[lam] < best[0]:
            best = (nll[lam], ridge, lam, readout)
    _, ridge, lam, readout = best
    selection = {"mean_field_factor": lam, "ridge": ridge, "lengthscale": float(readout.lengthscale),
                 "val_nll": scores}
    return readout.set_factor(lam), selection
