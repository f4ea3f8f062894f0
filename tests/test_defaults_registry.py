"""A variant's defaults are data (gpattn.attention.registry's entries: named recipes, recorded options), and what an
older gpattn wrote migrates in one place (gpattn._migrate) with an OldVersionWarning naming it."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch

import gpattn
from gpattn._migrate import OLD_DEFAULTS, OLD_STATES, migrate_config, migrate_state_dict
from gpattn.attention import RECIPES, attention_options, recipe_options
from gpattn.attention.registry import FORMS, resolve
from gpattn.experiments.training import TrainConfig


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_the_scratch_recipe_is_the_layers_own_defaults(name):
    """Every variant's ``"scratch"`` options are its layer's keyword defaults: the layer built with them is the
    default layer (an option the recipe changed would show in ``recipe_options``)."""
    options = attention_options(name, recipe="scratch")
    assert options == attention_options(name)
    assert set(recipe_options(name)) <= set(options)


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled"])
def test_the_encoder_swap_recipe_of_sgpa_keeps_both_maps_and_the_softmax_mean(name):
    swap = attention_options(name, recipe="encoder-swap")
    assert (swap["qk"], swap["prior_mean"]) == ("separate", "softmax")
    assert (attention_options(name)["qk"], attention_options(name)["prior_mean"]) == ("shared", "attention")
    assert recipe_options(name, "encoder-swap") == {"qk": "separate", "prior_mean": "softmax"}
    assert recipe_options(name) == {}


def test_an_unknown_recipe_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; valid recipes: scratch, encoder-swap"):
        attention_options("sgpa", recipe="nope")
    assert RECIPES == ("scratch", "encoder-swap")


@pytest.mark.parametrize("encoder", [None, "minilm"])
@pytest.mark.parametrize("name", gpattn.list_attention())
def test_a_config_records_its_recipes_resolved_options(name, encoder):
    """config.json says which form ran: the options the recipe sets, and the recorded ones (cgp's, scgp's prior
    mean), resolved from the registry; given options win."""
    recipe = "encoder-swap" if encoder else "scratch"
    assert TrainConfig(attention=name, encoder=encoder).attention_options == recipe_options(name, recipe)
    assert TrainConfig(attention=name, encoder=encoder, attention_options={"qk": "x"}).attention_options == {
        **recipe_options(name, recipe),
        "qk": "x",
    }


def test_a_config_learns_the_swaps_defaults_without_importing_the_integrations():
    code = (
        "import sys; from gpattn.experiments.training import TrainConfig; "
        "c = TrainConfig(attention='sgpa', encoder='minilm'); "
        "assert c.attention_options == {'qk': 'separate', 'prior_mean': 'softmax'}, c.attention_options; "
        "assert 'gpattn.integrations' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("row", OLD_DEFAULTS, ids=lambda r: f"{r[1][0]}-{r[3]}")
def test_every_old_default_migrates_and_says_so(row):
    """A config written before each default change (it lacks the option) gets the value it trained with, and the
    warning names the option, its value and the change."""
    what, variants, encoder_only, option, old = row
    for name in variants:
        saved = {**TrainConfig(attention=name, encoder="minilm" if encoder_only else None).to_dict()}
        saved["attention_options"] = {k: v for k, v in saved["attention_options"].items() if k != option}
        said = rf"a {name} run .*{option}={old!r} \(saved before {re.escape(what)}"
        with pytest.warns(gpattn.OldVersionWarning, match=said):
            migrated = migrate_config(saved)
        assert migrated["attention_options"][option] == old
        assert TrainConfig.from_dict(migrated).attention_options[option] == old


def _strategies(name):
    """(prefix, strategy) of each GP strategy in a small layer of variant ``name``."""
    from gpattn.variational._strategy import AmortisedVariationalStrategy

    layer = gpattn.build_attention(name, 8, 2)
    return layer, [(p, m) for p, m in layer.named_modules() if isinstance(m, AmortisedVariationalStrategy)]


@pytest.mark.parametrize("row", OLD_STATES, ids=lambda r: f"{r[1]}-{r[2]}")
def test_every_old_state_migrates_in_the_one_load_hook_and_says_so(row):
    """A state dict saved before a strategy gained a key (it lacks it) loads with the value it trained with, through
    the one pre-hook every GP strategy registers, and the OldVersionWarning names the key, its value and the change."""
    what, owner, key, _, old = row
    def owned(name):
        return any(owner in {c.__name__ for c in type(m).__mro__} for _, m in _strategies(name)[1])

    owners = [n for n in gpattn.list_attention() if owned(n)]
    assert owners, f"no variant has a {owner} strategy"
    for name in owners:
        layer, strategies = _strategies(name)
        saved = {k: v for k, v in layer.state_dict().items() if not k.endswith(f".{key}")}
        fresh, _ = _strategies(name)
        said = rf"{key} missing .*saved before {re.escape(what)}.*{key}={old!r}"
        with pytest.warns(gpattn.OldVersionWarning, match=said):
            fresh.load_state_dict(saved)
        for prefix, _ in strategies:
            assert float(fresh.get_buffer(f"{prefix}.{key}")) == old


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_every_gp_strategy_migrates_old_states_in_one_hook_and_a_current_state_needs_none(name):
    layer, strategies = _strategies(name)
    for _, strategy in strategies:
        hooks = [getattr(h, "hook", h) for h in strategy._load_state_dict_pre_hooks.values()]
        ours = [h for h in hooks if getattr(h, "__module__", "").startswith("gpattn")]  # not gpytorch.Module's own
        assert ours == [migrate_state_dict], ours  # one hook, and no other
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _strategies(name)[0].load_state_dict(layer.state_dict())


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_a_current_config_needs_no_migration(name):
    for encoder in (None, "minilm"):
        saved = TrainConfig(attention=name, encoder=encoder).to_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert migrate_config(saved) is saved


def test_an_encoder_row_leaves_a_run_from_scratch_alone():
    """The swap's old defaults concern encoder runs only: an sgpa run from scratch lacking ``qk`` trained today's
    default and is not migrated."""
    saved = TrainConfig(attention="sgpa").to_dict()
    assert saved["attention_options"] == {}
    assert migrate_config(saved) is saved


@pytest.mark.parametrize(
    ("name", "encoder", "saved", "trained"),
    [
        ("sgpa", "minilm", {}, {"qk": "shared", "prior_mean": "attention"}),  # gpattn 0.2
        ("sgpa-decoupled", "minilm", {"qk": "separate"}, {"qk": "separate", "prior_mean": "attention"}),
        ("cgp", None, {}, {"prior_mean": "zero"}),  # before the softmax mean
        ("scgp", "minilm", {"v_dim": 4}, {"prior_mean": "zero", "v_dim": 4}),  # before the separate softmax mean
    ],
)
def test_each_older_config_reads_as_the_model_it_trained(name, encoder, saved, trained):
    old = {**TrainConfig(attention=name, encoder=encoder).to_dict(), "attention_options": saved}
    with pytest.warns(gpattn.OldVersionWarning, match=f"a {name} run written by an older gpattn"):
        assert migrate_config(old)["attention_options"] == trained


#: options whose resolved value is not kept under their own name (``bias``: a parameter of the projections)
_NOT_KEPT = {"bias", "kernel"}


#: the attribute of the strategy that holds the object a form option's name resolves to (gpattn.attention.registry)
_FORM_ATTRIBUTES = {"prior_mean": "mean_module", "covariance": "covariance", "gp_input": "covariance"}


def _resolved(layer, option):
    """The value ``layer`` runs with for ``option``: the attribute of that name of the layer, its strategy, its
    q(u) or its covariance object (sgpa-rff's; a tensor as its values); for a form option, the class of the object
    its name resolved to; or :data:`_MISSING`."""
    strategy = getattr(layer, "strategy", None)
    if option in FORMS.get(layer.name, {}):
        form = getattr(strategy, _FORM_ATTRIBUTES[option])
        return form if isinstance(form, type) else type(form)
    owners = (layer, strategy, getattr(strategy, "variational_distribution", None),
              getattr(strategy, "covariance", None))
    for owner in owners:
        if owner is not None and hasattr(owner, option):
            value = getattr(owner, option)
            return value.flatten().tolist() if torch.is_tensor(value) else value
    return _MISSING


_MISSING = object()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", gpattn.list_attention())
def test_the_registry_s_options_are_what_a_layer_built_without_options_runs_with(name, recipe):
    """A variant's defaults are written once (its layer's signature, a recipe's overrides in its registry entry): a
    layer built with ``attention_options(name, recipe)``'s recipe runs with exactly those values, in the layer, its
    strategy and its q(u) — a second default written in a strategy could not differ unnoticed."""
    options = attention_options(name, recipe)
    layer = gpattn.build_attention(name, 8, 2, **recipe_options(name, recipe))
    checked = 0
    for option, default in options.items():
        if default is None or option in _NOT_KEPT:  # None: resolved at build time from the sizes
            continue
        value = _resolved(layer, option)
        assert value is not _MISSING, f"{name}: {option} is kept under no attribute of that name"
        if option in FORMS.get(name, {}):  # the object the name resolves to
            resolved = resolve(name, option, default)
            assert value is (resolved if isinstance(resolved, type) else type(resolved)), (name, option, value)
        elif isinstance(value, list):  # a buffer or a per-head parameter, in its dtype
            assert value == [pytest.approx(default, rel=1e-6)] * len(value), (name, option, value, default)
        else:
            assert value == default, (name, option, value, default)
        checked += 1
    assert checked, f"{name}: no option checked"
