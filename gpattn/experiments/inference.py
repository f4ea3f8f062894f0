"""Score new inputs with a saved run: ``gpattn.experiments.load_run(run_dir).predict(["a sentence"], num_samples=P)``.

A run's checkpoint carries, as plain data (``checkpoint["data"]``, readable with ``weights_only=True``),
everything needed to rebuild the model and encode new inputs: the data set's kind, the class names, the
vocabulary and the tokenizer's ``max_len`` for text, the image shape for images. No data file is read.

``Run.predict`` returns :class:`Prediction`: the predictive probabilities (the mean over P Monte-Carlo
samples of the softmax, or of the logits with ``average="logits"`` runs) and the split of the predictive
entropy into its aleatoric part (expected entropy of the samples) and epistemic part (mutual information
between prediction and model = total − expected), in nats; no gradients, in batches, on the run's device.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import torch

from gpattn._warnings import warn
from gpattn.attention._masks import check_num_samples
from gpattn.experiments._runs import (  # noqa: F401  (the memory bound, re-exported where it was defined first)
    PREDICT_PAIR_BUDGET,
    PREDICT_TOKEN_BUDGET,
    as_device,
    bundle_meta,
    predict_rows,
    run_checkpoint,
)

__all__ = ["EmptyTextWarning", "Prediction", "Run", "UnknownWordsWarning", "bundle_meta", "load_run"]


def _stub_bundle(meta: dict):
    """What :func:`gpattn.experiments.training.build_model` reads of a bundle, from :func:`bundle_meta`."""
    width = meta.get("model_max_len", 1)
    return types.SimpleNamespace(
        kind=meta["kind"],
        num_classes=meta["num_classes"],
        vocab_size=len(meta["vocab"]) if meta["kind"] == "text" else None,
        image_shape=tuple(meta["image_shape"]) if meta["kind"] == "image" else None,
        splits={"train": types.SimpleNamespace(inputs=torch.empty(0, width))},  # sizes the positional embedding
        encoder_config=meta.get("encoder_config"),
    )


@dataclasses.dataclass
class Prediction:
    """``probs`` (N, C) predictive probabilities; ``total_entropy`` = H(p̄), ``expected_entropy`` (aleatoric)
    = mean over samples of H(p_s), ``mutual_information`` (epistemic) = total − expected, each (N,) in nats;
    ``sample_probs`` (N, P, C); ``labels`` the predicted class names; ``detector_scores`` each feature detector's
    score (N,), higher = more out-of-distribution, for a run that fitted them (:mod:`gpattn.experiments.detectors`,
    on the training split after training; empty for a run from before them)."""

    probs: torch.Tensor
    total_entropy: torch.Tensor
    expected_entropy: torch.Tensor
    mutual_information: torch.Tensor
    sample_probs: torch.Tensor
    labels: list[str]
    detector_scores: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def aleatoric(self) -> torch.Tensor:
        return self.expected_entropy

    @property
    def epistemic(self) -> torch.Tensor:
        return self.mutual_information


class EmptyTextWarning(UserWarning):
    """``Run.predict`` was given texts with no words: what it returns for them is the model's answer to an
    empty input, not a judgement of any text."""


def _warn_empty(texts) -> None:
    empty = [i for i, t in enumerate(texts) if isinstance(t, str) and not t.strip()]
    if empty:
        warn(
            f"predict: {len(empty)} of {len(texts)} texts are empty or only whitespace (positions {_shown(empty)}); "
            f"their predictions are the model's answer to an empty input, not to any text",
            EmptyTextWarning,
        )


class UnknownWordsWarning(UserWarning):
    """``Run.predict`` was given texts none of whose tokens the run's vocabulary holds (another script, emoji,
    invisible characters): the model sees only unknown-token ids, so a confident answer says nothing of the text."""


def _shown(rows: list[int]) -> str:
    return ", ".join(map(str, rows[:10])) + (" ..." if len(rows) > 10 else "")


def _warn_unknown(texts: list[str], ids: torch.Tensor, mask: torch.Tensor, unknown: int, special=()) -> None:
    """An :class:`UnknownWordsWarning` naming the texts (not empty: :func:`_warn_empty` has those) whose every
    token, specials aside, is the ``unknown`` id."""
    ignored = mask | torch.isin(ids, torch.tensor(sorted(set(special) - {unknown}), dtype=ids.dtype))
    only = ((ids == unknown) | ignored).all(1) & (ids == unknown).any(1)  # shape: (N,)
    rows = [i for i in only.nonzero().flatten().tolist() if texts[i].strip()]
    if rows:
        warn(
            f"predict: {len(rows)} of {len(texts)} texts hold no word the model knows (positions {_shown(rows)}, "
            f"e.g. {texts[rows[0]]!r:.40}): every token is outside the run's vocabulary (another script, emoji, "
            f"invisible characters), so their predictions are the model's answer to unknown-word ids, not to the "
            f"text; however confident, they say nothing about it",
            UnknownWordsWarning,
        )


def _as_texts(inputs) -> list[str]:
    """``inputs`` as a list of texts (a bare string is one), or a ``TypeError`` naming what is not a text."""
    if isinstance(inputs, str):
        return [inputs]
    if inputs is None or isinstance(inputs, (bytes, torch.Tensor)) or not hasattr(inputs, "__iter__"):
        raise TypeError(f"predict: inputs must be a list of strings (or one string) for a text run, got "
                        f"{type(inputs).__name__} {inputs!r:.60}")
    texts = list(inputs)
    bad = [(i, t) for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        shown = ", ".join(f"position {i}: {type(t).__name__} {t!r:.40}" for i, t in bad[:5])
        raise TypeError(f"predict: every input must be a string; {len(bad)} of {len(texts)} are not ({shown}"
                        f"{' ...' if len(bad) > 5 else ''}). Convert them with str() or leave them out.")
    return texts


class Run:
    """A trained run: its config, model (eval mode) and data metadata. Use :func:`load_run`."""

    def __init__(self, cfg, model, meta: dict, path: Path, detectors: dict | None = None):
        self.cfg, self.model, self.meta, self.path = cfg, model, meta, path
        #: the checkpoint's fitted feature detectors (gpattn.experiments.features.fit_detectors), or None
        self.detectors = detectors
        self.class_names = list(meta["class_names"])
        self._tokenizer = None  # a pretrained encoder's, rebuilt from the checkpoint on first use

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device) -> Run:
        self.model.to(device)
        return self

    def encode(self, texts) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and padding mask of ``texts`` with the run's vocabulary and tokenizer."""
        from gpattn.experiments.data._text import encode, tokenize

        if self.meta["kind"] != "text":
            raise ValueError(f"this run was trained on images ({self.meta['dataset']}); pass an image tensor")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a list of strings (wrap a single sentence in a list)")
        if "tokenizer_files" in self.meta:  # a pretrained encoder's own tokenizer
            from gpattn.experiments.encoders import encode_texts, tokenizer_from_meta

            if self._tokenizer is None:
                self._tokenizer = tokenizer_from_meta(self.meta)
            return encode_texts(self._tokenizer, texts, self.meta["max_len"])
        limit = min(v for v in (self.meta.get("max_len"), self.meta["model_max_len"]) if v is not None)
        return encode([tokenize(t) for t in texts], self.meta["vocab"], limit)

    def _unknown_id(self) -> tuple[int | None, list[int]]:
        """The unknown-token id of the run's tokenizer and its special ids (an encoder's [CLS], [SEP], ...)."""
        from gpattn.experiments.data._text import UNK

        if self._tokenizer is None:
            return UNK, []
        return self._tokenizer.unk_token_id, list(self._tokenizer.all_special_ids)

    @torch.no_grad()
    def predict(self, inputs, num_samples: int | None = None, batch_size: int = 256, seed: int | None = None
                ) -> Prediction:
        """Predictive probabilities and their entropy split for a list of texts (text runs; a single string
        is one text, N = 1) or an image tensor (N, C, Hpx, Wpx) in [0, 1] (image runs); ``num_samples``
        defaults to the run's. An empty or whitespace-only text is scored, with an :class:`EmptyTextWarning`.
        ``batch_size`` rows per forward pass at most: fewer for many samples or long texts (:func:`predict_rows`).
        ``seed``: the Monte-Carlo draws from this seed, on forked random streams (the same inputs and seed give the
        same prediction, and the caller's random state is left as it was); None: fresh draws."""
        from gpattn.experiments import metrics as M

        P = check_num_samples(self.cfg.num_samples if num_samples is None else num_samples, optional=False)
        if self.meta["kind"] == "text":
            texts = _as_texts(inputs)  # a bare string is one text
            _warn_empty(texts)
            ids, mask = self.encode(texts)
            unknown, special = self._unknown_id()
            if unknown is not None:
                _warn_unknown(texts, ids, mask, unknown, special)
        else:
            ids = torch.as_tensor(inputs, dtype=torch.float32)
            if ids.dim() != 4 or tuple(ids.shape[1:]) != tuple(self.meta["image_shape"]):
                raise ValueError(f"images must have shape (N, {', '.join(map(str, self.meta['image_shape']))}), "
                                 f"got {tuple(ids.shape)}")
            mask = None
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            logits, scores = self._logits_and_scores(ids, mask, P, batch_size)  # shape: (N, P, C), {name: (N,)}
        sample_probs = torch.softmax(logits, dim=-1)
        probs = torch.as_tensor(M.average_samples(logits, self.cfg.average), dtype=torch.float32)
        split = M.predictive_entropy_split(sample_probs)
        total, expected, mi = (torch.as_tensor(v, dtype=torch.float32) for v in split)
        labels = [self.class_names[k] for k in probs.argmax(1).tolist()]
        return Prediction(probs, total, expected, mi, sample_probs, labels, scores)

    def _logits_and_scores(self, ids, mask, num_samples: int, batch_size: int):
        """Sample logits of encoded inputs and the fitted feature detectors' scores of them (float32 (N,) by name;
        {} without detectors), in eval mode, in passes of :func:`predict_rows` rows: the evaluation's own loop,
        one pass for both at the detectors' ``num_samples``
        (:func:`gpattn.experiments.training.predict_with_detectors`).  # shape: (N, P, C)"""
        from gpattn.experiments.training import predict_with_detectors

        rows = types.SimpleNamespace(inputs=ids, mask=mask, labels=torch.full((ids.shape[0],), -1))
        logits, scores = predict_with_detectors(self.model, rows, num_samples, self.detectors, batch_size)
        return logits, {k: v.float() for k, v in scores.items()}


def load_run(path, device=None) -> Run:
    """A saved run (folder or ``checkpoint.pt``) ready to score new inputs, without its data files."""
    from gpattn.experiments.training import TrainConfig, build_model

    target = torch.device("cpu") if device is None else as_device(device)
    path, ckpt = run_checkpoint(path, map_location=target)
    if "data" not in ckpt:
        raise ValueError(
            f"{path} was written before checkpoints carried their vocabulary; use "
            f"gpattn.experiments.training.load_run_with_data (which reloads the data set) or retrain"
        )
    cfg = TrainConfig.from_saved(ckpt["config"])
    model = build_model(cfg, _stub_bundle(ckpt["data"])).to(target)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return Run(cfg, model, ckpt["data"], path, ckpt.get("detectors"))
