"""Runs on a pretrained Hugging Face encoder (``TrainConfig.encoder``, ``gpattn train --encoder``).

The text data set is re-tokenised with the encoder's own tokenizer (word-piece ids; its attention mask
becomes ``key_padding_mask``, True = padding), truncated to ``TrainConfig.encoder_max_len`` or else the
encoder's ``max_position_embeddings``. The model is
:class:`gpattn.integrations.huggingface.HFClassifier`: the chosen layers' self-attention swapped for
``TrainConfig.attention`` (``attention_layers="auto"`` means the last layer), mean or CLS pooling
(``pooling``, default mean) and a linear head; every parameter is fine-tuned. The encoder's own dropout
(its config's ``hidden_dropout_prob``) applies, not ``TrainConfig.dropout``; ``mc_dropout`` (compare's
``+mcdropout``) keeps it on at prediction. ``embed_dim`` / ``num_heads`` / ``num_layers`` are the encoder's.

**Frozen-trunk recipe** (``TrainConfig.encoder_recipe="frozen-trunk"``, ``--encoder-recipe frozen-trunk``):
the embeddings and the layers below the first swapped layer (the *trunk*; with the default ``last``, five
of MiniLM's six layers) keep their pretrained weights and run in eval mode, so their output is a fixed
function of the tokens. :func:`trunk_bundle` computes it once per data set, and every split's ``inputs``
become those hidden states ``(N, T, D)`` float32 (the padding mask is kept); training and evaluation then
run only the top layers and the head (``HFClassifier.forward`` on hidden states). A checkpoint still holds
the whole encoder, so the predict API scores new text from token ids through the same function
(``forward(trunk(ids)) == forward(ids)``, tests/test_hf_classifier.py). Last-layer fine-tuning of a frozen
pretrained encoder is the standard cheap recipe for uncertainty baselines on top of pretrained features
(as last-layer Laplace, Kristiadi et al. (2020)).

A checkpoint is self-contained: its ``data`` entry holds the encoder's config (``encoder_config``) and
the tokenizer's files (``tokenizer_files``, their text), so :func:`gpattn.experiments.load_run` rebuilds the
model and tokenizer without the encoder folder, and its ``model`` entry holds every weight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import torch

from gpattn.experiments.data import DatasetBundle, Split

__all__ = [
    "build_encoder_model",
    "encode_texts",
    "encoder_bundle",
    "encoder_meta",
    "encoder_shape",
    "tokenizer_from_meta",
    "trunk_bundle",
]


class _ReportOnce(logging.Filter):
    """Let each distinct transformers "LOAD REPORT" (keys of the checkpoint the model does not use, e.g. the
    pooler) through once per process: a run loads the same weights more than once (model, trunk)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


_REPORT_ONCE = _ReportOnce()


def _transformers():
    try:
        import transformers
    except ImportError as err:  # the optional extra
        raise ImportError(
            "encoder: a run on a pretrained encoder needs transformers 5 (pip install 'gpattn[huggingface]')"
        ) from err
    for name in ("transformers.modeling_utils", "transformers.modeling_layers", "transformers.utils.loading_report"):
        log = logging.getLogger(name)
        if _REPORT_ONCE not in log.filters:
            log.addFilter(_REPORT_ONCE)
    return transformers


def _path(cfg) -> str:
    from gpattn.integrations.huggingface import resolve_encoder

    return resolve_encoder(cfg.encoder)


def _load(path: str):
    """(tokenizer, config) of the encoder folder ``path`` (local files only, never downloaded)."""
    transformers = _transformers()
    return (
        transformers.AutoTokenizer.from_pretrained(path, local_files_only=True),
        transformers.AutoConfig.from_pretrained(path, local_files_only=True),
    )


def _max_len(cfg, tokenizer, config) -> int:
    """``encoder_max_len``, capped by the encoder's positions and the tokenizer's limit (512 if none)."""
    limits = (cfg.encoder_max_len, getattr(config, "max_position_embeddings", None), tokenizer.model_max_length)
    values = [int(v) for v in limits if v and v < 10**9]  # tokenizers without a limit say ~1e30
    return min(values) if values else 512


def encode_texts(tokenizer, texts, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, T) int64, key_padding_mask (N, T) bool True = padding), padded to the longest, truncated."""
    if not len(texts):
        return torch.zeros(0, 1, dtype=torch.int64), torch.ones(0, 1, dtype=torch.bool)
    enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    return enc["input_ids"].to(torch.int64), enc["attention_mask"] == 0


def encoder_bundle(bundle, cfg) -> DatasetBundle:
    """``bundle`` (a text bundle with its raw texts) re-tokenised with the encoder's tokenizer; the
    bundle's ``info["encoder"]`` records the encoder and ``max_len``. A bundle already converted is returned."""
    if bundle.info.get("encoder") is not None:
        return bundle
    if bundle.kind != "text" or bundle.texts is None:
        raise ValueError(
            f"encoder: a pretrained text encoder needs a text data set with its raw texts (cola, text_table, "
            f"imdb); got the {bundle.kind} data set {bundle.name!r}"
        )
    path = _path(cfg)
    tokenizer, config = _load(path)
    max_len = _max_len(cfg, tokenizer, config)
    splits = {}
    for key, split in bundle.splits.items():
        ids, mask = encode_texts(tokenizer, bundle.texts[key], max_len)
        splits[key] = Split(ids, split.labels, mask, split.groups)
    info = {**bundle.info, "encoder": {"path": path, "max_len": max_len}}
    return dataclasses.replace(bundle, splits=splits, vocab=[], info=info)


def build_encoder_model(cfg, bundle) -> torch.nn.Module:
    """:class:`gpattn.integrations.huggingface.HFClassifier` for ``cfg``: the pretrained weights from the
    encoder folder, or (a stub bundle from a checkpoint's metadata, ``encoder_config``) a fresh encoder of
    the saved config whose weights the checkpoint then loads."""
    from gpattn.integrations.huggingface import HFClassifier

    _transformers()  # its load report once per process (_ReportOnce)
    kwargs = dict(
        attention=cfg.attention,
        attention_layers=_layers(cfg),
        attention_options=dict(cfg.attention_options),
        pooling=cfg.pooling or "mean",
        mc_dropout=cfg.mc_dropout,
        frozen_trunk=cfg.encoder_recipe == "frozen-trunk",
    )
    saved = getattr(bundle, "encoder_config", None)
    if saved is None:
        return HFClassifier.from_pretrained(cfg.encoder, bundle.num_classes, **kwargs)
    transformers = _transformers()
    config = transformers.AutoConfig.for_model(**saved)
    encoder = transformers.AutoModel.from_config(config, add_pooling_layer=False)
    return HFClassifier(encoder, bundle.num_classes, **kwargs)


def encoder_shape(cfg) -> tuple[int, int]:
    """(width, heads) of ``cfg.encoder`` from its config (no weights are loaded)."""
    config = _transformers().AutoConfig.from_pretrained(_path(cfg), local_files_only=True)
    return config.hidden_size, config.num_attention_heads


def _layers(cfg):
    return "last" if cfg.attention_layers == "auto" else cfg.attention_layers


@torch.no_grad()
def trunk_bundle(bundle, cfg, batch_size: int = 128, device=None) -> DatasetBundle:
    """``bundle`` (re-tokenised: :func:`encoder_bundle`) with every split's token ids replaced by the
    frozen trunk's output ``(N, T, D)`` float32 for ``cfg`` (the pretrained encoder's embeddings and layers
    below the first of ``cfg.attention_layers``; eval mode), computed in batches sorted by length. The
    bundle's ``info["trunk"]`` records the trunk (its layer count) and the token ids' fingerprint, which
    stands for the hidden states in :func:`gpattn.experiments.data.summary.bundle_fingerprint`. A bundle
    already holding this trunk's outputs is returned. The trunk runs on ``device`` (a ``torch.device``;
    default the CPU) and the outputs are kept on the CPU, as every split is."""
    from gpattn.experiments.data.summary import bundle_fingerprint
    from gpattn.integrations.huggingface import HFClassifier, _layer_indices

    path = bundle.info["encoder"]["path"]
    config = _transformers().AutoConfig.from_pretrained(path, local_files_only=True)
    spec = {"layers": min(_layer_indices(_layers(cfg), config.num_hidden_layers))}
    done = bundle.info.get("trunk")
    if done is not None:
        if {k: done[k] for k in spec} != spec:
            raise ValueError(f"bundle holds the outputs of another trunk ({done}); this run needs {spec}")
        return bundle
    trunk = HFClassifier.from_pretrained(
        path, bundle.num_classes, attention="softmax", attention_layers=_layers(cfg), frozen_trunk=True
    ).eval().to(device or "cpu")
    device = next(trunk.parameters()).device
    source = bundle_fingerprint(bundle)
    splits = {}
    for key, split in bundle.splits.items():
        n, T = split.inputs.shape
        lengths = (~split.mask).sum(1) if split.mask is not None else torch.full((n,), T)
        order = torch.argsort(lengths, descending=True)
        out = torch.zeros(n, T, trunk.encoder.config.hidden_size)
        for start in range(0, n, batch_size):
            rows = order[start : start + batch_size]
            longest = max(int(lengths[rows].max()), 1)
            mask = None if split.mask is None else split.mask[rows, :longest].to(device)
            out[rows, :longest] = trunk.trunk(split.inputs[rows, :longest].to(device), mask).float().cpu()
        splits[key] = Split(out, split.labels, split.mask, split.groups)
    info = {**bundle.info, "trunk": {**spec, "source_fingerprint": source}}
    return dataclasses.replace(bundle, splits=splits, info=info)


def encoder_meta(bundle) -> dict:
    """Plain data a checkpoint carries to rebuild the model and tokenizer of a converted bundle
    (:func:`encoder_bundle`): the encoder's config and the text of the tokenizer's files."""
    tokenizer, config = _load(bundle.info["encoder"]["path"])
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        files = {}
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                files[name] = f.read()
    return {
        "encoder": bundle.info["encoder"]["path"],
        "encoder_config": config.to_dict(),
        "tokenizer_files": files,
        "max_len": int(bundle.info["encoder"]["max_len"]),
        "tokenizer": f"the encoder's ({type(tokenizer).__name__})",
    }


def tokenizer_from_meta(meta: dict):
    """The tokenizer a checkpoint carries (:func:`encoder_meta`)."""
    with tempfile.TemporaryDirectory() as folder:
        for name, text in meta["tokenizer_files"].items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(text)
        return _transformers().AutoTokenizer.from_pretrained(folder, local_files_only=True)
