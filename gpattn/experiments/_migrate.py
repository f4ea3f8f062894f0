"""The one place where what an older gpattn wrote is read as today's: every migration of a saved run, as data.

A saved config means the model it trained. When a default changes, a config written before the change lacks the
option (it trained at the old default): :data:`OLD_DEFAULTS` has one row per such change, with the value it trained
with, and :func:`migrate_config` fills it in with an :class:`gpattn.OldVersionWarning` naming each option it filled.
A change no row can express (a state-dict layout) takes the next checkpoint format instead
(gpattn.experiments._io.CHECKPOINT_FORMAT). The rule is written once, in docs/checkpoints.md.
"""

from __future__ import annotations

import warnings

from gpattn._warnings import OldVersionWarning

__all__ = ["OLD_DEFAULTS", "migrate_config"]

_SGPA = ("sgpa", "sgpa-decoupled")
#: (what changed, the variants, whether only encoder runs (``--encoder``) are concerned, the option, the value a config
#: written before the change trained with), in the order the options are filled
OLD_DEFAULTS: tuple[tuple[str, tuple[str, ...], bool, str, object], ...] = (
    ("the encoder swap's separate query and key maps (configs of gpattn 0.2)", _SGPA, True, "qk", "shared"),
    ("the encoder swap's softmax prior mean (docs/derivations.md §5e)", _SGPA, True, "prior_mean", "attention"),
    ("cgp's softmax prior mean (docs/derivations.md §7a, 2026-11-27)", ("cgp",), False, "prior_mean", "zero"),
    ("scgp's separate softmax mean (docs/derivations.md §7a, 2026-11-27)", ("scgp",), False, "prior_mean", "zero"),
    ("kep-svgp's encoder-swap softmax mean (docs/derivations.md §6)", ("kep-svgp",), True, "prior_mean", "zero"),
)


def _old_options(d: dict) -> dict[str, tuple[object, str]]:
    """The options a saved config ``d`` lacks that an :data:`OLD_DEFAULTS` row fills: option -> (value, what)."""
    attention, options = d.get("attention"), d.get("attention_options", {})
    if not isinstance(attention, str) or not isinstance(options, dict):
        return {}
    filled: dict[str, tuple[object, str]] = {}
    for what, variants, encoder_only, option, old in OLD_DEFAULTS:
        concerned = attention in variants and (d.get("encoder") is not None or not encoder_only)
        if concerned and option not in options and option not in filled:
            filled[option] = (old, what)
    return filled


def migrate_config(d: dict) -> dict:
    """A saved run's config ``d`` (config.json, or a checkpoint's ``config``) in today's options, with an
    :class:`gpattn.OldVersionWarning` naming every option it filled in; ``d`` itself when it needs nothing."""
    filled = _old_options(d)
    if not filled:
        return d
    named = "; ".join(f"{k}={v!r} (saved before {what})" for k, (v, what) in filled.items())
    warnings.warn(
        f"a {d['attention']} run written by an older gpattn: migrated its config to the form it trained: {named}",
        OldVersionWarning,
        stacklevel=3,
    )
    return {**d, "attention_options": {**{k: v for k, (v, _) in filled.items()}, **d["attention_options"]}}
