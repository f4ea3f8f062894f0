"""A small, dependency-free word tokeniser and vocabulary (no network tokenizers).

- ``tokenize``: lowercase, then words (letters/digits of any script, with an optional clitic such as
  "won't" or "i'm") and single punctuation characters.
- ``build_vocab``: on the training split only; specials ``<pad>`` = 0, ``<unk>`` = 1, ``<cls>`` = 2,
  then words by decreasing count (ties alphabetical) with count >= ``min_freq``, at most ``max_size``.
- ``encode``: padded int64 ids ``(N, T)`` with T = the longest sequence of that split capped by
  ``max_len`` (longer sequences keep their first ``max_len`` tokens), and the bool padding mask
  (True = padding). An empty text becomes one ``<unk>``, so every row has a real token.

``<cls>`` is reserved in the vocabulary but not inserted: a model that pools on a class token
prepends id 2 itself.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from gpattn.experiments.data._bundle import DatasetBundle, Split
from gpattn.experiments.data._duplicates import duplicate_counts, warn_eval_overlap

__all__ = [
    "CLS",
    "PAD",
    "SPECIALS",
    "UNK",
    "build_text_bundle",
    "build_vocab",
    "encode",
    "make_text_splits",
    "tokenize",
]

PAD, UNK, CLS = 0, 1, 2
SPECIALS = ("<pad>", "<unk>", "<cls>")
_TOKEN = re.compile(r"[^\W_]+(?:'[^\W_]+)?|[^\w\s]|_")


def tokenize(text: str) -> list[str]:
    """Lowercased words and punctuation marks of ``text``."""
    return _TOKEN.findall(text.lower())


def build_vocab(token_lists: Iterable[Sequence[str]], min_freq: int = 1, max_size: int | None = None) -> list[str]:
    """Index -> token: the three specials, then the kept words (``max_size`` counts words, not specials)."""
    if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
        raise ValueError(f"min_freq must be an int >= 1, got {min_freq!r}")
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0):
        raise ValueError(f"max_size must be None or an int >= 0, got {max_size!r}")
    counts = Counter(tok for tokens in token_lists for tok in tokens)
    for special in SPECIALS:
        counts.pop(special, None)
    words = sorted((w for w, c in counts.items() if c >= min_freq), key=lambda w: (-counts[w], w))
    if max_size is not None:
        words = words[:max_size]
    return [*SPECIALS, *words]


def encode(
    token_lists: Sequence[Sequence[str]], vocab: Sequence[str], max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids ``(N, T)`` int64, mask ``(N, T)`` bool with True = padding)."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be None or an int >= 1, got {max_len!r}")
    index = {tok: i for i, tok in enumerate(vocab)}
    rows = [[index.get(tok, UNK) for tok in tokens] or [UNK] for tokens in token_lists]
    if max_len is not None:
        rows = [row[:max_len] for row in rows]
    width = max((len(row) for row in rows), default=1)  # T
    ids = torch.full((len(rows), width), PAD, dtype=torch.int64)  # shape: (N, T)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)  # shape: (N,)
    mask = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)  # shape: (N, T)
    return ids, mask


def make_text_splits(
    texts: dict[str, Sequence[str]],
    labels: dict[str, Sequence[int]],
    *,
    max_len: int | None,
    min_freq: int = 1,
    max_vocab_size: int | None = None,
) -> tuple[dict[str, Split], list[str], dict]:
    """Tokenise every split, build the vocabulary on ``texts["train"]`` only, encode each split.

    Returns (splits, vocab, stats) with stats = {"max_tokens": {split: longest}, "truncated": {split: rows}}.
    """
    tokens = {key: [tokenize(t) for t in values] for key, values in texts.items()}
    vocab = build_vocab(tokens["train"], min_freq=min_freq, max_size=max_vocab_size)
    splits, stats = {}, {"max_tokens": {}, "truncated": {}}
    for key, token_lists in tokens.items():
        ids, mask = encode(token_lists, vocab, max_len)
        splits[key] = Split(ids, torch.as_tensor(list(labels[key]), dtype=torch.int64), mask)
        lengths = [len(t) for t in token_lists]
        stats["max_tokens"][key] = max(lengths, default=0)
        stats["truncated"][key] = sum(n > max_len for n in lengths) if max_len is not None else 0
    return splits, vocab, stats


def build_text_bundle(
    name: str,
    texts: dict[str, Sequence[str]],
    labels: dict[str, Sequence[int]],
    *,
    num_classes: int,
    eval_splits: dict[str, str],
    ood_splits: tuple[str, ...],
    info: dict,
    max_len: int | None,
    min_freq: int = 1,
    max_vocab_size: int | None = None,
) -> DatasetBundle:
    """The text recipe shared by ``cola``, ``imdb`` and ``text_table``: :func:`make_text_splits` on the
    loader's split texts and labels, then a ``kind="text"`` bundle whose ``info`` is the loader's
    ``info`` followed by ``sizes`` (rows per split), ``max_len``, the ``max_tokens`` / ``truncated``
    statistics and ``duplicates`` (exact duplicate texts within and between splits,
    gpattn.experiments.data._duplicates; an evaluation-only split repeating training texts is warned about)."""
    splits, vocab, stats = make_text_splits(
        texts, labels, max_len=max_len, min_freq=min_freq, max_vocab_size=max_vocab_size
    )
    info = {
        **info,
        "sizes": {key: len(value) for key, value in splits.items()},
        "max_len": max_len,
        **stats,
        "duplicates": duplicate_counts(texts),
    }
    warn_eval_overlap(name, texts, info, [k for k in eval_splits.values() if k not in ("train", "val", "test")])
    return DatasetBundle(
        name=name,
        kind="text",
        splits=splits,
        num_classes=num_classes,
        eval_splits=eval_splits,
        ood_splits=ood_splits,
        vocab=vocab,
        info=info,
        texts={key: list(values) for key, values in texts.items()},
    )
