"""A small synthetic ``data_full.json`` in CLINC150's exact format (:mod:`gpattn.experiments.data.clinc150`).

Load it with ``load_dataset("clinc150", data_dir=..., verify_checksum=False)``. Deterministic given ``seed``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gpattn.experiments.data.clinc150 import CLINC150_FILENAME, OOS_LABEL

__all__ = ["make_clinc150_json"]

_WORDS = ("please", "can", "you", "tell", "me", "what", "is", "my", "the", "how", "do", "i", "now", "today")
_OOS_WORDS = ("volcano", "penguin", "origami", "sonnet", "glacier", "tuba")


def make_clinc150_json(path, n_intents: int = 5, per_intent=(8, 3, 4), n_oos=(2, 2, 6), seed: int = 0) -> Path:
    """Write a synthetic ``data_full.json`` and return its path (``path`` is the file or its directory).

    ``n_intents`` intents named ``intent_<k>``, each with ``per_intent`` (train, val, test) queries built
    from shared filler words and two words of its own; ``n_oos`` (oos_train, oos_val, oos_test) queries
    from words no intent uses, labelled ``"oos"``.
    """
    path = Path(path)
    if path.suffix != ".json":
        path = path / CLINC150_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def query(own) -> str:
        words = list(rng.choice(_WORDS, size=4)) + list(own)
        return " ".join(words[i] for i in rng.permutation(len(words)))

    data = {}
    for key, n in zip(("train", "val", "test"), per_intent):
        rows = [[query((f"topic{k}a", f"topic{k}b")), f"intent_{k}"] for k in range(n_intents) for _ in range(n)]
        data[key] = [rows[i] for i in rng.permutation(len(rows))]
    for key, n in zip(("oos_train", "oos_val", "oos_test"), n_oos):
        data[key] = [[query(rng.choice(_OOS_WORDS, size=2)), OOS_LABEL] for _ in range(n)]
    path.write_text(json.dumps(data), encoding="utf-8")
    return path
