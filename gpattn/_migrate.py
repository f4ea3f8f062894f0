"""The one place where what an older gpattn wrote is read as today's: every migration, as data.

Four tables, one rule (docs/new_variant.md, "The one rule for a breaking change"):

* :data:`OLD_DEFAULTS`: a saved config means the model it trained. When a default changes, a config written before
  the change lacks the option (it trained at the old default): one row per such change, with the value it trained
  with; :func:`migrate_config` fills it in before the model is built.
* :data:`OLD_VALUES`: a value an older gpattn accepted and today's refuses (a renamed option value) is read as the
  one it meant for the saved variant; :data:`OLD_OPTIONS`: an option that left the layers, at the value a release's
  configs recorded, is read as what the layers do now.
* :data:`MOVED_NAMES`: a public name that left its module raises an ``AttributeError`` that says where it went.
* :data:`OLD_STATES`: a state dict saved before a strategy gained a buffer lacks its key (it trained at the value the
  row names); :func:`migrate_state_dict`, the load-state-dict pre-hook every GP strategy (and SNGP's random-feature
  GP layer) registers (as gpytorch's ``VariationalStrategy`` does for its old format), fills it in.
  :data:`OLD_KEYS`: a key that moved is renamed there.

Both warn with :class:`gpattn.OldVersionWarning` naming what they migrated. A change no row can express takes the next
checkpoint format instead (gpattn.experiments._io.CHECKPOINT_FORMAT).

A row serves what a release wrote or shipped: a run folder of gpattn 0.2.0 loads through these tables
(gpattn.experiments._io.MIGRATED_RELEASES; docs/development.md, "Versions and compatibility"), and a name moves
here only if a release exported it. tests/test_release_compat.py loads 0.2.0's runs and names.
"""

from __future__ import annotations

import warnings

import torch

from gpattn._warnings import OldVersionWarning

__all__ = [
    "MOVED_NAMES", "OLD_DEFAULTS", "OLD_KEYS", "OLD_OPTIONS", "OLD_STATES", "OLD_VALUES", "migrate_config",
    "migrate_state_dict", "moved_names",
]

_SGPA = ("sgpa", "sgpa-decoupled")
#: (what changed, the variants, whether only encoder runs (``--encoder``) are concerned, the option, the value a config
#: written before the change trained with), in the order the options are filled
OLD_DEFAULTS: tuple[tuple[str, tuple[str, ...], bool, str, object], ...] = (
    ("the encoder swap's separate query and key maps (configs of gpattn 0.2)", _SGPA, True, "qk", "shared"),
    ("the encoder swap's softmax prior mean (docs/derivations.md §5e)", _SGPA, True, "prior_mean", "attention"),
    ("cgp's softmax prior mean (docs/derivations.md §7a, 2026-11-27)", ("cgp",), False, "prior_mean", "zero"),
    ("scgp's separate softmax mean (docs/derivations.md §7a, 2026-11-27)", ("scgp",), False, "prior_mean", "zero"),
    ("kep-svgp's encoder-swap softmax mean (docs/derivations.md §6)", ("kep-svgp",), True, "prior_mean", "zero"),
    ("kep-svgp's softmax prior mean from scratch (docs/derivations.md §6, 2026-12-03)", ("kep-svgp",), False,
     "prior_mean", "zero"),
)

#: (what changed, the option, the old value, {variant: the value it meant}): the old value, wherever it stands in the
#: option (a kernel spec's ``base`` and ``kernels`` too), is replaced by the saved variant's meaning
OLD_VALUES: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("the kernel name 'rbf' split into 'ard-rbf' and 'canonical-rbf' (gpattn 0.2)", "kernel", "rbf",
     {**dict.fromkeys(("sgpa", "sgpa-decoupled", "kernel", "kernel-asym"), "ard-rbf"),
      **dict.fromkeys(("cgp", "scgp"), "canonical-rbf")}),
)

#: (what changed, the variants, the options a config wrote, what they are now): options that left the layers'
#: signatures for recipes, objects and research/knobs.py's probes, at the values a 0.2.0 config could record and the
#: layers always have now (each row whose options a config holds, all with those values, is applied; the config's
#: other options stay). Any other value stays, and building the layer names what owns its form now
#: (gpattn.attention.build_attention).
OLD_OPTIONS: tuple[tuple[str, tuple[str, ...], dict, dict], ...] = (
    ("the shared query-key map is the SGPA layers' own form: the option left them", _SGPA, {"qk": "shared"},
     {"recipe": "scratch"}),
    *(("what the layers always do now: the option left them", variants, {option: value}, {})
      for variants, option, value in (
          (("kep-svgp",), "token_independent", False), (("kep-svgp",), "include_residual", False),
          (("cgp",), "prior_samples", 10), (("cgp", "scgp"), "learn_sigma", False),
      )),
)

#: {(module, name): the message of its AttributeError}: public names of a release (0.2.0) that moved since, read by
#: the modules' ``__getattr__``
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("gpattn", "load_run"): "gpattn.load_run moved to gpattn.experiments.load_run after 0.2.0 (the core never imports "
    "the experiment application; pip install 'gpattn[experiments]'): "
    "gpattn.experiments.load_run(run_dir).predict([...])",
    ("gpattn.experiments.training", "load_run"): "gpattn.experiments.training.load_run is now load_run_with_data (it "
    "reloads the data set and returns (config, model, data bundle, checkpoint)); to score new inputs without the data "
    "files use gpattn.experiments.load_run (a Run with .predict)",
    ("gpattn.variational.means", "PRIOR_MEANS"): "gpattn.variational.means.PRIOR_MEANS moved to "
    "gpattn.attention.registry.CHOICES['sgpa']['prior_mean'] (every variant's names of its modelling choices, resolved "
    "where a variant is built; gpattn/variational/ receives the objects)",
    ("gpattn.variational.means", "check_prior_mean"): "gpattn.variational.means.check_prior_mean moved to "
    "gpattn.attention.registry.resolve('sgpa', 'prior_mean', name) (it returns the mean module the name stands for; "
    "gpattn/variational/ receives the objects)",
}


def moved_names(module: str):
    """A module's ``__getattr__`` that raises the ``AttributeError`` of a :data:`MOVED_NAMES` row of ``module`` (the
    plain one for any other name)."""

    def __getattr__(name):
        raise AttributeError(MOVED_NAMES.get((module, name), f"module {module!r} has no attribute {name!r}"))

    return __getattr__

#: (what changed, the strategy class, the key it gained, a key every state dict of that class has, the value a state
#: dict saved before the change trained with): a missing key is filled with that value, in the dtype of the other key
OLD_STATES: tuple[tuple[str, str, str, str, float], ...] = (
    ("kep-svgp had a prior outputscale (docs/derivations.md §6)", "KEPSVGP", "prior_variance", "out_weight", 1.0),
)
#: (what changed, the strategy class (or GP layer), the key a state dict saved before the change has, the key it has
#: now): the old key is read as the new one
OLD_KEYS: tuple[tuple[str, str, str, str], ...] = (
    ("the correlated GPs' softmax prior mean keeps its temperature in its module", "CorrelatedGPBase",
     "mean_temperature", "mean_module.temperature"),
    ("the random-feature GP keeps its posterior in a form chosen at fit time (docs/derivations.md §14a)",
     "RandomFeatureGP", "precision_factor", "posterior.factor"),
)


def _old_options(d: dict) -> dict[str, tuple[object, str]]:
    """The options a saved config ``d`` lacks that an :data:`OLD_DEFAULTS` row fills: option -> (value, what)."""
    attention, options = d.get("attention"), d.get("attention_options", {})
    # a config that records its recipe was written after the recipes owned these options (OLD_OPTIONS)
    if not isinstance(attention, str) or not isinstance(options, dict) or "recipe" in options:
        return {}
    filled: dict[str, tuple[object, str]] = {}
    for what, variants, encoder_only, option, old in OLD_DEFAULTS:
        concerned = attention in variants and (d.get("encoder") is not None or not encoder_only)
        if concerned and option not in options and option not in filled:
            filled[option] = (old, what)
    return filled


def _renamed(spec, old: str, new: str):
    """``spec`` (a name, a dict spec with ``name`` / ``base`` / ``kernels``, anything else), ``old`` read as ``new``."""
    if spec == old:
        return new
    if not isinstance(spec, dict):
        return spec
    out = {**spec, "name": _renamed(spec.get("name"), old, new)}
    if "base" in spec:
        out["base"] = _renamed(spec["base"], old, new)
    if isinstance(spec.get("kernels"), list):
        out["kernels"] = [_renamed(k, old, new) for k in spec["kernels"]]
    return out


def _old_values(d: dict) -> dict[str, tuple[object, str]]:
    """The options of a saved config ``d`` an :data:`OLD_VALUES` row rewrites: option -> (new value, what)."""
    attention, options = d.get("attention"), d.get("attention_options", {})
    if not isinstance(attention, str) or not isinstance(options, dict):
        return {}
    out: dict[str, tuple[object, str]] = {}
    for what, option, old, meant in OLD_VALUES:
        if option in options and attention in meant:
            new = _renamed(options[option], old, meant[attention])
            if new != options[option]:
                out[option] = (new, what)
    return out


def _recast(attention: str, options: dict) -> tuple[dict, list[str]]:
    """``options`` with the :data:`OLD_OPTIONS` rows that match them applied, and what each applied row changed."""
    said = []
    for what, variants, old, new in OLD_OPTIONS:
        if attention in variants and all(k in options and options[k] == v for k, v in old.items()):
            options = {**new, **{k: v for k, v in options.items() if k not in old}}
            read = f"read as {new}" if new else "dropped"
            said.append(f"{', '.join(f'{k}={v!r}' for k, v in old.items())} {read} ({what})")
    return options, said


def migrate_config(d: dict) -> dict:
    """A saved run's config ``d`` (config.json, or a checkpoint's ``config``) in today's options, with an
    :class:`gpattn.OldVersionWarning` naming every option it filled in or rewrote; ``d`` itself when it needs
    nothing."""
    filled, renamed = _old_options(d), _old_values(d)
    options = d.get("attention_options")
    if isinstance(options, dict):
        options = {**{k: v for k, (v, _) in filled.items()}, **options, **{k: v for k, (v, _) in renamed.items()}}
    recast, said = _recast(d["attention"], options) if isinstance(d.get("attention"), str) and options else (None, [])
    if not filled and not renamed and not said:
        return d
    named = "; ".join(
        [f"{k}={v!r} (saved before {what})" for k, (v, what) in {**filled, **renamed}.items()] + said
    )
    warnings.warn(
        f"a {d['attention']} run written by an older gpattn: migrated its config to the form it trained: {named}",
        OldVersionWarning,
        stacklevel=3,
    )
    return {**d, "attention_options": recast if said else options}


def migrate_state_dict(module, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of every GP strategy (``module``): renames the keys an :data:`OLD_KEYS` row names for
    its class and fills those an :data:`OLD_STATES` row names when a state dict saved before lacks them, with an
    :class:`gpattn.OldVersionWarning` naming each."""
    classes = {c.__name__ for c in type(module).__mro__}
    for what, owner, old_key, key in OLD_KEYS:
        if owner not in classes or prefix + old_key not in state_dict or prefix + key in state_dict:
            continue
        state_dict[prefix + key] = state_dict.pop(prefix + old_key)
        warnings.warn(
            f"{prefix}{old_key} in the state dict (saved before {what}): migrated to {prefix}{key}",
            OldVersionWarning,
            stacklevel=3,
        )
    for what, owner, key, present, old in OLD_STATES:
        if owner not in classes or prefix + key in state_dict or prefix + present not in state_dict:
            continue
        state_dict[prefix + key] = torch.tensor(old, dtype=state_dict[prefix + present].dtype)
        warnings.warn(
            f"{prefix}{key} missing from the state dict (saved before {what}): migrated to {key}={old!r}, the value "
            f"it was trained with",
            OldVersionWarning,
            stacklevel=3,
        )
