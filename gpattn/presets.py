"""Named experiment settings for ``gpattn train|compare --preset NAME`` (seeds' setups at CPU scale).

A preset is a dict of ``TrainConfig`` fields plus ``variants`` (for compare) and ``seeds``; command-line
flags given explicitly override it.
"""

from __future__ import annotations

__all__ = ["PRESETS", "get_preset"]

_DEMO_MODEL = dict(embed_dim=32, num_heads=2, num_layers=2, mlp_ratio=2.0, dropout=0.1)

PRESETS: dict[str, dict] = {
    # `make demo`: every registered variant and the baselines on the embedded digits, 2 seeds, minutes on 2 cores
    "demo": dict(
        dataset="digits",
        epochs=8,
        batch_size=64,
        lr=3e-3,
        num_samples=10,
        seeds=[0, 1],
        variants="all+baselines",
        **_DEMO_MODEL,
    ),
}


def get_preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
