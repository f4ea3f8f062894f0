"""Synthetic tasks that need attention: the label depends on relations between tokens.

CoLA, digits and MiniLM can be solved largely without token interactions, so an attention layer that
only adds noise still "learns" through the residual path there. On these tasks a model without token
interactions — a layer that returns zeros, then per-token MLPs, mean pooling and a linear head — is at
chance (the label is not a threshold of a sum of per-token features; measured in docs/results.md), so
accuracy above chance is attention at work.

* ``attn-match`` (content): is the first token repeated among the other ``length - 1``? Fixed length.
* ``attn-xor`` (position): the parity of the first token's symbol XOR the parity of the last one's.
  Fixed length; the other tokens are distractors.
* ``attn-repeat`` (content, variable length with padding): does any symbol occur twice? Lengths are
  uniform in ``[min_length, length]``; half the sequences have exactly one repeated pair, the other half
  only distinct symbols, independently of the length (the length tells nothing about the label).

Every task is balanced (labels 0/1 in equal numbers up to sampling) and generated from ``seed`` alone
(train, val and test from one stream, so no sequence is shared by chance between the splits of a seed
other than with probability ~ 1/V^length). Token ids: 0 = ``<pad>``, 1 = ``<unk>``, 2 = ``<cls>``
(reserved for CLS pooling), then the V symbols ``s0 .. s{V-1}``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import torch

from gpattn.experiments.data._bundle import DatasetBundle, Split, register_dataset
from gpattn.experiments.data._text import SPECIALS

__all__ = ["ATTENTION_TASKS", "load_attn_match", "load_attn_repeat", "load_attn_xor", "make_attention_task"]

#: the task names (each a registered data set)
ATTENTION_TASKS = ("attn-match", "attn-xor", "attn-repeat")

_FIRST_SYMBOL = len(SPECIALS)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _match(rng: np.random.Generator, n: int, length: int, vocab: int):
    """x_0 and length-1 others drawn without x_0; for label 1 one random other position is set to x_0."""
    first = rng.integers(0, vocab, n)
    others = rng.integers(0, vocab - 1, (n, length - 1))
    others = others + (others >= first[:, None])  # uniform over the symbols other than x_0
    labels = rng.integers(0, 2, n)
    where = rng.integers(0, length - 1, n)
    rows = np.flatnonzero(labels)
    others[rows, where[rows]] = first[rows]
    return np.concatenate([first[:, None], others], 1), labels, np.full(n, length)


def _xor(rng: np.random.Generator, n: int, length: int, vocab: int):
    tokens = rng.integers(0, vocab, (n, length))
    labels = (tokens[:, 0] % 2) ^ (tokens[:, -1] % 2)
    return tokens, labels, np.full(n, length)


def _repeat(rng: np.random.Generator, n: int, length: int, vocab: int, min_length: int):
    """Distinct symbols per row (a random permutation's prefix); label 1: one position j copies another i."""
    lengths = rng.integers(min_length, length + 1, n)
    tokens = np.argsort(rng.random((n, vocab)), 1)[:, :length]  # distinct symbols per row
    labels = rng.integers(0, 2, n)
    for r in np.flatnonzero(labels):
        i, j = rng.choice(lengths[r], 2, replace=False)
        tokens[r, j] = tokens[r, i]
    return tokens, labels, lengths


def make_attention_task(
    name: str, num_examples: int, *, seed: int, length: int = 12, vocab: int = 16, min_length: int = 4
) -> Split:
    """``num_examples`` sequences of task ``name`` (:data:`ATTENTION_TASKS`) as one :class:`Split` of token
    ids (symbols from id 3 on, 0 = padding) and its padding mask."""
    if name not in ATTENTION_TASKS:
        raise ValueError(f"name must be one of {list(ATTENTION_TASKS)}, got {name!r}")
    num_examples = _check_int("num_examples", num_examples, 1)
    length = _check_int("length", length, 2)
    vocab = _check_int("vocab", vocab, 2)
    rng = np.random.default_rng([seed, ATTENTION_TASKS.index(name)])
    if name == "attn-match":
        tokens, labels, lengths = _match(rng, num_examples, length, vocab)
    elif name == "attn-xor":
        tokens, labels, lengths = _xor(rng, num_examples, length, vocab)
    else:
        min_length = _check_int("min_length", min_length, 2)
        if min_length > length:
            raise ValueError(f"min_length ({min_length}) must be <= length ({length})")
        if vocab < length:
            raise ValueError(f"attn-repeat needs vocab >= length for distinct symbols, got vocab={vocab} < {length}")
        tokens, labels, lengths = _repeat(rng, num_examples, length, vocab, min_length)
    mask = np.arange(length)[None, :] >= lengths[:, None]  # True = padding
    ids = np.where(mask, 0, tokens + _FIRST_SYMBOL)
    return Split(torch.from_numpy(ids).long(), torch.from_numpy(labels).long(), torch.from_numpy(mask))


def _bundle(name: str, *, seed: int, train_size: int, val_size: int, test_size: int, **task) -> DatasetBundle:
    sizes = {
        k: _check_int(k, v, 1)
        for k, v in (("train_size", train_size), ("val_size", val_size), ("test_size", test_size))
    }
    whole = make_attention_task(name, sum(sizes.values()), seed=seed, **task)
    a, b = sizes["train_size"], sizes["train_size"] + sizes["val_size"]
    splits = {
        "train": whole.subset(slice(0, a)),
        "val": whole.subset(slice(a, b)),
        "test": whole.subset(slice(b, None)),
    }
    vocab = task.get("vocab", 16)
    return DatasetBundle(
        name=name,
        kind="text",
        splits=splits,
        num_classes=2,
        eval_splits={"in_domain": "test"},
        ood_splits=(),
        vocab=[*SPECIALS, *(f"s{i}" for i in range(vocab))],
        info={
            "source": "gpattn.experiments.data.attention_tasks",
            "seed": seed,
            "class_names": ["0", "1"],
            **task,
            "sizes": {k: len(v) for k, v in splits.items()},
        },
    )


def _register(name: str, doc: str, **task_defaults) -> Callable[..., DatasetBundle]:
    """Register the loader of task ``name``: its keyword-only options are the task's (with these defaults)
    and the three split sizes, written into the loader's signature (which the registry reads)."""
    sizes = {"train_size": 8000, "val_size": 1000, "test_size": 2000}

    def load(*, data_dir, download: bool, seed: int, **options) -> DatasetBundle:
        options = {**task_defaults, **sizes, **options}  # load_dataset has checked the names
        split_sizes = {k: options.pop(k) for k in sizes}
        return _bundle(name, seed=seed, **split_sizes, **options)

    kw = inspect.Parameter.KEYWORD_ONLY
    common = [inspect.Parameter("data_dir", kw), inspect.Parameter("download", kw, annotation=bool),
              inspect.Parameter("seed", kw, annotation=int)]  # fmt: skip
    own = [inspect.Parameter(k, kw, default=v, annotation=int) for k, v in {**task_defaults, **sizes}.items()]
    load.__signature__ = inspect.Signature(common + own, return_annotation=DatasetBundle)
    load.__name__ = load.__qualname__ = f"load_{name.replace('-', '_')}"
    load.__doc__ = (
        f"{doc} Splits train / val / test of ``train_size`` / ``val_size`` / ``test_size`` sequences generated "
        f"from ``seed``; ``data_dir`` and ``download`` are unused."
    )
    return register_dataset(name.replace("-", "_"))(load)


load_attn_match = _register("attn-match", "Is the first token repeated later? (content, fixed length).", length=12,
                            vocab=16)  # fmt: skip
load_attn_xor = _register("attn-xor", "Parity of the first symbol XOR that of the last (position, fixed length).",
                          length=12, vocab=16)  # fmt: skip
load_attn_repeat = _register("attn-repeat", "Does a symbol occur twice? (content, variable length, padding).",
                             length=12, vocab=24, min_length=4)  # fmt: skip
