"""The pooled penultimate features of a classifier: the input of its ``model.head``.

Every classifier gpattn trains reads its logits from one module, ``model.head``, applied to the pooled
representation: :class:`gpattn.models.TransformerClassifier` and :class:`gpattn.models.ViTClassifier`
(``nn.Linear``), :class:`gpattn.integrations.huggingface.HFClassifier` (the ``--encoder`` models, ``nn.Linear``)
and an SNGP model (:func:`gpattn.experiments.sngp.apply_sngp`: a
:class:`gpattn.experiments.sngp.RandomFeatureGP`, whose input is the pooled state before its layer norm and
random features). :func:`head_inputs` reads that input by putting a recorder around ``model.head`` for the
passes run inside it (not a forward pre-hook: a gpytorch ``Module``, as the SNGP head is, runs no hooks of its own),
so it needs nothing of the model but ``model.head`` and the classifiers' ``forward(inputs, key_padding_mask,
num_samples=P)``. :func:`pooled_features` runs a pass of its own inside it; an evaluation records the features
inside its own pass (:func:`gpattn.experiments.training.predict` with ``features=True``), so the logits and the
features come from one forward.

These are the features the post-hoc detectors (:mod:`gpattn.experiments.detectors`) are fitted on:
:func:`fit_detectors` fits every detector of :data:`gpattn.experiments.detectors.DETECTORS` on a run's training split
(the checkpoint's ``detectors`` entry), :func:`score_features` scores features with them and :func:`detector_scores`
scores a split in a pass of its own (:func:`gpattn.experiments.training.predict_with_detectors` scores it from the
evaluation's own pass where it can).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from gpattn._warnings import warn

__all__ = [
    "OOD_VALIDATION_SPLIT",
    "DetectorWarning",
    "HeadRecorder",
    "detector_rows",
    "detector_scores",
    "fit_detectors",
    "head_inputs",
    "pooled_features",
    "score_features",
    "split_features",
]

#: the bundle split (labels -1) a run's choices about OOD detection are made on, beside the in-domain ``val``
#: split, where the data set has one; never an evaluation split
OOD_VALIDATION_SPLIT = "ood_val"


class DetectorWarning(UserWarning):
    """A feature detector could not be fitted on a run's training features (its reason in the message and in the
    checkpoint's ``detectors["choices"]["not_fitted"]``): its OOD score is absent from the run's metrics."""


class HeadRecorder(nn.Module):
    """``head`` that keeps each input it reads (detached, float32, on its device), averaged over a leading sample
    axis: never more than one ``(B, D)`` per pass. :func:`head_inputs` puts one in place of ``model.head``."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.seen: list[torch.Tensor] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``head(h)``, ``h`` kept (its mean over the sample axis where it has one).  # shape: (B, D) or (P, B, D)"""
        x = h.detach()  # shape: (B, D) or (P, B, D)
        self.seen.append((x.mean(0) if x.dim() == 3 else x).float())
        return self.head(h)

    def features(self) -> torch.Tensor:
        """Every recorded row in the order read, on the CPU (one copy).  # shape: (N, D)"""
        if not self.seen:
            return torch.zeros(0, getattr(self.head, "in_features", 0))
        return torch.cat(self.seen).cpu()


@contextlib.contextmanager
def head_inputs(model: nn.Module) -> Iterator[HeadRecorder]:
    """``model.head`` wrapped in a recorder for the passes run inside the ``with`` block, restored after it; the
    recorder's ``features()`` are the head's inputs of every row read, ``(N, D)`` float32 on the CPU, averaged
    over the sample axis where the head reads one (``(P, B, D)``: the mean over the P draws, as
    :func:`pooled_features` says). The logits are unchanged: the recorder calls the head on the same input."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        raise ValueError(
            f"model must have a module model.head reading the pooled features (a gpattn classifier, an HFClassifier "
            f"or an SNGP model), got {type(model).__name__} with head {type(head).__name__}"
        )
    recorder = HeadRecorder(head)
    model.head = recorder
    try:
        yield recorder
    finally:
        model.head = head


@torch.no_grad()
def pooled_features(model: nn.Module, batches, num_samples: int = 1) -> torch.Tensor:
    """The input of ``model.head`` for every row of ``batches``, in eval mode, float32 on the CPU.

    ``batches`` yields ``(inputs, key_padding_mask)`` pairs (mask ``None`` for images), each run as
    ``model(inputs, key_padding_mask, num_samples=num_samples)``; the model's train/eval mode is restored.

    What a model that samples gives: a model that samples nothing in eval mode (softmax attention, dropout off,
    an SNGP model) gives the same features for every ``num_samples``. A model that samples in eval mode (a GP
    attention layer, ``mc_dropout``) gives with ``num_samples=1`` the features of one draw, and with
    ``num_samples=P`` the mean over the P draws of the pooled features (the head's input then has the sample
    axis first, ``(P, B, D)``, and it is averaged over that axis): the Monte-Carlo estimate of the mean features.

    Returns ``(N, D)``: N the rows of all batches, D the head's input width.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    was_training = model.training
    with head_inputs(model) as recorder:
        try:
            model.eval()
            for inputs, mask in batches:
                model(inputs, mask, num_samples=num_samples)
        finally:
            model.train(was_training)
    return recorder.features()  # shape: (N, D)


def split_features(model: nn.Module, split, batch_size: int = 256, num_samples: int = 1) -> torch.Tensor:
    """:func:`pooled_features` of every row of a data split (:class:`gpattn.experiments.data.Split`), in
    batches of at most ``batch_size`` rows on the model's device, bounded as every evaluation is
    (:func:`gpattn.experiments._runs.predict_rows`: rows × samples × tokens), rows in the split's order.
    # shape: (N, D)"""
    from gpattn.experiments._runs import _batch, predict_rows, tokens_per_row

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    device = next(model.parameters()).device
    batch_size = predict_rows(batch_size, num_samples, tokens_per_row(model, split.inputs, split.mask))
    rows = torch.arange(len(split.labels)).split(batch_size)
    return pooled_features(model, (_batch(split, idx, device)[:2] for idx in rows), num_samples)


def fit_detectors(model: nn.Module, bundle, num_samples: int = 1, batch_size: int = 256) -> dict:
    """Every detector of :data:`gpattn.experiments.detectors.DETECTORS` fitted on the pooled features of
    ``bundle``'s training split (:func:`split_features` with ``num_samples``) and its labels: the checkpoint's
    ``detectors`` entry, plain data, ``{"num_samples": P, "states": {name: state}, "choices": {...}}``.

    kNN's k is :func:`gpattn.experiments.detectors.choose_k` on the in-domain ``val`` split against
    :data:`OOD_VALIDATION_SPLIT` where the bundle has both (``choices["knn_k_auroc"]`` keeps each k's validation
    AUROC), else :data:`gpattn.experiments.detectors.KNN_DEFAULT_K`; ``choices["knn_k"]`` says which."""
    from gpattn.experiments import detectors as Dt

    train = bundle.splits["train"]
    feats = split_features(model, train, batch_size, num_samples)
    val, ood_val = bundle.splits.get("val"), bundle.splits.get(OOD_VALIDATION_SPLIT)
    k = min(Dt.KNN_DEFAULT_K, max(len(train.labels), 1))
    choices = {"knn_k": k, "knn_k_from": "default (no OOD validation split), at most the training rows"}
    if val is not None and len(val.labels) and ood_val is not None and len(ood_val.labels):
        val_in, val_ood = (split_features(model, s, batch_size, num_samples) for s in (val, ood_val))
        k, aurocs = Dt.choose_k(feats, val_in, val_ood)
        choices = {"knn_k": k, "knn_k_from": f"val against {OOD_VALIDATION_SPLIT}", "knn_k_auroc": aurocs}
    options = {Dt.KNN.name: {"k": k}}  # every other detector with its defaults
    states = {}
    for name, cls in Dt.DETECTORS.items():
        try:
            states[name] = cls(**options.get(name, {})).fit(feats, train.labels).state_dict()
        except ValueError as err:  # e.g. a class with one training row: no shared covariance to fit
            choices.setdefault("not_fitted", {})[name] = str(err)
            warn(f"the {name} OOD score is left out of this run: {err}", DetectorWarning)
    return {"num_samples": num_samples, "states": states, "choices": choices}


def detector_rows(splits: dict) -> int:
    """The rows :func:`fit_detectors` reads of a bundle's ``splits``, each at the run's P samples: the training
    split, and ``val`` and :data:`OOD_VALIDATION_SPLIT` where kNN's k is chosen on them (a run's estimate counts
    them: :mod:`gpattn.experiments._estimate`)."""
    val, ood_val = len(splits.get("val", ())), len(splits.get(OOD_VALIDATION_SPLIT, ()))
    return len(splits["train"]) + (val + ood_val if val and ood_val else 0)


def score_features(detectors: dict, features: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each fitted detector's scores of pooled ``features`` ``(N, D)`` (higher = more out-of-distribution),
    float64 ``(N,)`` by name, from ``detectors`` (:func:`fit_detectors`' entry)."""
    from gpattn.experiments.detectors import detector_from_state

    return {
        name: torch.from_numpy(detector_from_state(name, state).score(features))
        for name, state in detectors["states"].items()
    }


def detector_scores(model: nn.Module, split, detectors: dict, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """Each fitted detector's scores of ``split`` (higher = more out-of-distribution), float64 ``(N,)`` by name,
    from ``detectors`` (:func:`fit_detectors`' entry; the features at its ``num_samples``), in a pass of its own
    (:func:`split_features`); an evaluation that computes the logits too scores from its own pass
    (:func:`gpattn.experiments.training.predict_with_detectors`)."""
    return score_features(detectors, split_features(model, split, batch_size, detectors["num_samples"]))
