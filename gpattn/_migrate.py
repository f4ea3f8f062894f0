"""The one place where what an older gpattn wrote is read as today's: every migration, as data.

Two tables, one rule (docs/new_variant.md, "The one rule for a breaking change"):

* :data:`OLD_DEFAULTS`: a saved config means the model it trained. When a default changes, a config written before
  the change lacks the option (it trained at the old default): one row per such change, with the value it trained
  with; :func:`migrate_config` fills it in before the model is built.
* :data:`OLD_STATES`: a state dict saved before a strategy gained a buffer lacks its key (it trained at the value the
  row names); :func:`migrate_state_dict`, the load-state-dict pre-hook every GP strategy registers (as gpytorch's
  ``VariationalStrategy`` does for its old format), fills it in.

Both warn with :class:`gpattn.OldVersionWarning` naming what they migrated. A change no row can express takes the next
checkpoint format instead (gpattn.experiments._io.CHECKPOINT_FORMAT).
"""

from __future__ import annotations

import warnings

import torch

from gpattn._warnings import OldVersionWarning

__all__ = ["OLD_DEFAULTS", "OLD_STATES", "migrate_config", "migrate_state_dict"]

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

#: (what changed, the strategy class, the key it gained, a key every state dict of that class has, the value a state
#: dict saved before the change trained with): a missing key is filled with that value, in the dtype of the other key
OLD_STATES: tuple[tuple[str, str, str, str, float], ...] = (
    ("kep-svgp had a prior outputscale (docs/derivations.md §6)", "KEPSVGP", "prior_variance", "out_weight", 1.0),
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


def migrate_state_dict(module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of every GP strategy (``module``): fills the keys an :data:`OLD_STATES` row names for
    its class when a state dict saved before lacks them, with an :class:`gpattn.OldVersionWarning` naming each."""
    for what, owner, key, present, old in OLD_STATES:
        classes = {c.__name__ for c in type(module).__mro__}
        if owner not in classes or prefix + key in state_dict or prefix + present not in state_dict:
            continue
        state_dict[prefix + key] = torch.tensor(old, dtype=state_dict[prefix + present].dtype)
        warnings.warn(
            f"{prefix}{key} missing from the state dict (saved before {what}): migrated to {key}={old!r}, the value "
            f"it was trained with",
            OldVersionWarning,
            stacklevel=3,
        )
