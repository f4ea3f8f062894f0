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
from gpattn._migrate import OLD_DEFAULTS, OLD_OPTIONS, OLD_STATES, migrate_config, migrate_state_dict
from gpattn.attention import RECIPES, attention_options, recipe_options
from gpattn.attention.registry import _ENTRIES, CHOICES, resolve
from gpattn.experiments.training import TrainConfig
from gpattn.variational.means import AttentionMean, SoftmaxMean

#: every (variant, recipe) a layer is built with: every variant takes "scratch" and "encoder-swap", the others where
#: its entry names them
PAIRS = [(n, r) for n in gpattn.list_attention() for r in RECIPES
         if r in ("scratch", "encoder-swap") or r in getattr(_ENTRIES.get(n), "recipes", {})]


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_the_scratch_recipe_is_the_layers_own_defaults(name):
    """Every variant's ``"scratch"`` options are its layer's keyword defaults: the layer built with them is the
    default layer (an option the recipe changed would show in ``recipe_options``)."""
    options = attention_options(name, recipe="scratch")
    assert options == attention_options(name)
    assert set(recipe_options(name)) <= set(options)


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled", "sgpa-rff"])
def test_the_encoder_swap_recipe_of_sgpa_keeps_both_maps_and_the_softmax_mean(name):
    """The swap's internal form: separate query and key maps (a layer form the registry names) and the softmax prior
    mean (an object); the layer's own form is the shared map and the attention mean. A config records the recipe's
    name; its options leave out the mean the recipe sets, and build its layer."""
    swap, own = gpattn.build_attention(name, 8, 2, recipe="encoder-swap"), gpattn.build_attention(name, 8, 2)
    assert swap.projections == ("q", "k", "v") and isinstance(swap.strategy.mean_module, SoftmaxMean)
    assert own.projections == ("qk", "v") and type(own.strategy.mean_module) is AttentionMean
    assert swap.name == own.name == name  # a form of the variant, not a variant of its own:
    assert type(swap) not in {gpattn.attention.attention_class(n) for n in gpattn.list_attention()}
    assert recipe_options(name, "encoder-swap") == {"recipe": "encoder-swap", **_ENTRIES[name].recipes[
        "encoder-swap"].options}
    assert "prior_mean" not in attention_options(name, "encoder-swap") and recipe_options(name) == {}
    rebuilt = gpattn.build_attention(name, 8, 2, **attention_options(name, "encoder-swap"))
    assert type(rebuilt) is type(swap) and isinstance(rebuilt.strategy.mean_module, SoftmaxMean)
    given = gpattn.build_attention(name, 8, 2, recipe="encoder-swap", prior_mean="attention")  # given options win
    assert given.projections == ("q", "k", "v") and type(given.strategy.mean_module) is AttentionMean


def test_an_unknown_recipe_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; valid recipes: scratch, encoder-swap, out-of-scope"):
        attention_options("sgpa", recipe="nope")
    assert RECIPES == ("scratch", "encoder-swap", "out-of-scope")
    with pytest.raises(ValueError, match="recipe 'out-of-scope' has no form of attention 'sgpa': it is sgpa-rff's"):
        gpattn.build_attention("sgpa", 8, 2, recipe="out-of-scope")


def test_the_out_of_scope_recipe_is_the_sequence_covariance_at_the_clinc150_setting():
    """sgpa-rff's out-of-scope recipe: the encoder swap's form with g on each sequence's unit mean query, R = 1024,
    ℓ = 0.2, w = 1e4 (the clinc150-minilm preset selects it); its config records the recipe and its options."""
    from gpattn.experiments.presets import get_preset
    from gpattn.variational.covariances import TrainingSequenceCovariance

    layer = gpattn.build_attention("sgpa-rff", 16, 2, recipe="out-of-scope")
    cov = layer.strategy.covariance
    assert isinstance(cov, TrainingSequenceCovariance) and cov.num_features == 1024 and cov.data_weight == 1e4
    assert torch.equal(cov.lengthscale, torch.tensor([0.2])) and layer.projections == ("q", "k", "v")
    assert not layer.per_query_masks and isinstance(layer.strategy.mean_module, SoftmaxMean)
    assert recipe_options("sgpa-rff", "out-of-scope") == {"recipe": "out-of-scope", "num_features": 1024,
                                                          "lengthscale": 0.2}
    assert get_preset("clinc150-minilm")["variant_options"]["sgpa-rff"] == {"recipe": "out-of-scope"}


@pytest.mark.parametrize("encoder", [None, "minilm"])
@pytest.mark.parametrize("name", gpattn.list_attention())
def test_a_config_records_its_recipes_resolved_options(name, encoder):
    """config.json says which form ran: the options the recipe sets, and the recorded ones (cgp's, scgp's prior
    mean), resolved from the registry; given options win."""
    recipe = "encoder-swap" if encoder else "scratch"
    assert TrainConfig(attention=name, encoder=encoder).attention_options == recipe_options(name, recipe)
    assert TrainConfig(attention=name, encoder=encoder, attention_options={"jitter": 0.5}).attention_options == {
        **recipe_options(name, recipe),
        "jitter": 0.5,
    }


def test_a_config_learns_the_swaps_defaults_without_importing_the_integrations():
    code = (
        "import sys; from gpattn.experiments.training import TrainConfig; "
        "c = TrainConfig(attention='sgpa', encoder='minilm'); "
        "assert c.attention_options == {'recipe': 'encoder-swap'}, c.attention_options; "
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
        # written before the change: without the option, and without a recipe (configs record one now)
        kept = saved["attention_options"].items()
        saved["attention_options"] = {k: v for k, v in kept if k not in (option, "recipe")}
        said = rf"a {name} run .*{option}={old!r} \(saved before {re.escape(what)}"
        with pytest.warns(gpattn.OldVersionWarning, match=said):
            migrated = migrate_config(saved)
        # as an OLD_OPTIONS row reads it where the option left the layers since (qk="shared": their own form)
        read = next((new for _, vs, row, new in OLD_OPTIONS if name in vs and row == {option: old}), {option: old})
        assert read.items() <= migrated["attention_options"].items()
        options = TrainConfig.from_dict(migrated).attention_options
        assert read.items() <= options.items()
        gpattn.build_attention(name, 16, 2, **{k: v for k, v in options.items() if k != "v_dim"})  # the form it names


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
        ("sgpa", "minilm", {}, {"recipe": "scratch", "prior_mean": "attention"}),  # gpattn 0.2: the shared map
        ("sgpa-decoupled", "minilm", {}, {"recipe": "scratch", "prior_mean": "attention"}),
        ("cgp", None, {}, {"prior_mean": "zero"}),  # before the softmax mean
        ("scgp", "minilm", {"v_dim": 4}, {"prior_mean": "zero", "v_dim": 4}),  # before the separate softmax mean
        # options of gpattn 0.2's layers that left them (OLD_OPTIONS), at the value the layers always have now
        ("kep-svgp", None, {"token_independent": False, "include_residual": False, "rank": 2},
         {"prior_mean": "zero", "rank": 2}),
        ("cgp", None, {"prior_samples": 10, "learn_sigma": False}, {"prior_mean": "zero"}),
        ("scgp", None, {"learn_sigma": False}, {"prior_mean": "zero"}),
    ],
)
def test_each_older_config_reads_as_the_model_it_trained(name, encoder, saved, trained):
    """A config gpattn 0.2 wrote, before a default changed or with an option that left the layers since at the value
    they always have now, reads as the options that build the model it trained, and the layer builds."""
    old = {**TrainConfig(attention=name, encoder=encoder).to_dict(), "attention_options": saved}
    with pytest.warns(gpattn.OldVersionWarning, match=f"a {name} run written by an older gpattn"):
        migrated = migrate_config(old)
    assert migrated["attention_options"] == trained
    options = TrainConfig.from_dict(migrated).attention_options
    gpattn.build_attention(name, 16, 2, **{k: v for k, v in options.items() if k != "v_dim"})


def test_every_old_option_row_is_an_option_of_gpattn_0_2_at_the_value_the_layers_have_now():
    """OLD_OPTIONS serves gpattn 0.2's configs only (docs/development.md, "Migration rows serve releases"): each row
    reads an option that left the layers (the registry's error names its owner) at the value they always have now:
    dropped, or the SGPA layers' shared map (which OLD_DEFAULTS fills into gpattn 0.2's encoder configs) as their own
    form."""
    from gpattn.attention.registry import former_options

    for what, variants, old, new in OLD_OPTIONS:
        assert new in ({}, {"recipe": "scratch"}) and len(old) == 1, what
        (option, value), = old.items()
        for name in variants:
            assert set(former_options(name, old)) == {option}
            with pytest.raises(ValueError, match=rf"unknown option\(s\) \['{option}'\]"):
                gpattn.build_attention(name, 16, 2, **old)


@pytest.mark.parametrize(
    ("name", "encoder", "saved", "owner"),
    [  # configs of development commits (a form no release had) and settings no recipe owns
        ("sgpa", "minilm", {"qk": "separate", "prior_mean": "softmax"}, "recipe='encoder-swap'"),
        ("sgpa-decoupled", None, {"qk": "separate"}, "recipe='encoder-swap'"),
        ("sgpa-rff", "minilm", {"qk": "separate", "prior_mean": "softmax", "lengthscale": 0.2, "gp_input": "sequence",
                                "num_features": 1024, "data_weight": 10000.0}, "recipe='out-of-scope'"),
        ("sgpa-rff", None, {"gp_input": "sequence"}, "recipe='out-of-scope'"),
        ("kep-svgp", None, {"feature_gradient": False}, "research/knobs.py"),
        ("cgp", None, {"prior_samples": None}, "research/knobs.py"),
        ("scgp", None, {"learn_sigma": True}, "research/knobs.py"),
    ],
)
def test_a_saved_config_with_an_option_that_left_gives_one_clear_error(name, encoder, saved, owner):
    """A saved config recording an option that left the layers at a value no migration reads is not guessed at:
    loading it is one error that names the option, that such runs are trained again, and what owns the form now."""
    old = {**TrainConfig(attention=name, encoder=encoder).to_dict(), "attention_options": saved}
    old["attention_options"].setdefault("prior_mean", gpattn.attention_options(name)["prior_mean"])  # as they record
    with pytest.raises(ValueError, match=r"this run's config records .*trained again.*" + re.escape(owner)):
        TrainConfig.from_saved(old)


@pytest.mark.parametrize(
    ("name", "saved", "owner"),
    [
        ("sgpa", {"prior_mean": "softmax"}, "encoder-swap recipe's"),  # the softmax mean from scratch
        ("scgp", {"prior_mean": "softmax"}, "CorrelatedSoftmaxMean"),
        ("cgp", {"prior_mean": "softmax-separate"}, "CorrelatedSeparateSoftmaxMean"),
    ],
)
def test_a_name_a_variant_no_longer_takes_gives_one_clear_error(name, saved, owner):
    """A prior mean that is no name of the variant any more is not guessed at: building it is one error that names
    what owns the form now."""
    config = TrainConfig.from_dict({**TrainConfig(attention=name).to_dict(), "attention_options": saved})
    with pytest.raises(ValueError, match=re.escape(owner)):
        gpattn.build_attention(name, 16, 2, **config.attention_options)


#: options whose resolved value is not kept under their own name (``bias``: a parameter of the projections; ``recipe``:
#: the layer's form)
_NOT_KEPT = {"bias", "kernel", "recipe"}


#: the attribute of the strategy that holds the object a form option's name resolves to (gpattn.attention.registry)
_FORM_ATTRIBUTES = {"prior_mean": "mean_module", "covariance": "covariance", "frequencies": "covariance.frequency_draw"}


def _resolved(layer, option):
    """The value ``layer`` runs with for ``option``: the attribute of that name of the layer, its strategy, its
    q(u) or its covariance object (sgpa-rff's; a tensor as its values); for a form option, the class of the object
    its name resolved to; or :data:`_MISSING`."""
    strategy = getattr(layer, "strategy", None)
    if option in CHOICES.get(layer.name, {}):
        form = strategy
        for name in _FORM_ATTRIBUTES[option].split("."):
            form = getattr(form, name)
        return form if isinstance(form, type) else type(form)
    owners = (layer, strategy, getattr(strategy, "variational_distribution", None),
              getattr(strategy, "covariance", None))
    for owner in owners:
        if owner is not None and hasattr(owner, option):
            value = getattr(owner, option)
            return value.flatten().tolist() if torch.is_tensor(value) else value
    return _MISSING


_MISSING = object()


@pytest.mark.parametrize(("name", "recipe"), PAIRS)
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
        if option in CHOICES.get(name, {}):  # the object the name resolves to
            resolved = resolve(name, option, default)
            assert value is (resolved if isinstance(resolved, type) else type(resolved)), (name, option, value)
        elif isinstance(value, list):  # a buffer or a per-head parameter, in its dtype
            assert value == [pytest.approx(default, rel=1e-6)] * len(value), (name, option, value, default)
        else:
            assert value == default, (name, option, value, default)
        checked += 1
    assert checked, f"{name}: no option checked"


def test_the_demo_trains_the_sgpa_variants_with_separate_query_and_key_maps():
    """The demo's 8 epochs train the SGPA variants only in their separate-map form, and sgpa-rff and cgp only at a
    larger learning rate (issue #58, research/notes/time_to_accuracy.md): compare's specs and ``train --preset demo``
    build them and the run's config records them; the other GP variants keep their defaults, and the longer digits
    preset keeps the shared map."""
    from gpattn.experiments.cli import _config, build_parser
    from gpattn.experiments.compare import expand_variants
    from gpattn.experiments.presets import get_preset
    from gpattn.experiments.training import TrainConfig

    demo = get_preset("demo")
    specs = {s.attention: dict(s.options) for s in expand_variants(demo["variants"], demo.get("variant_options"))}
    for name in ("sgpa", "sgpa-decoupled"):
        cfg = TrainConfig(attention=name, attention_options=specs[name])
        layer = gpattn.build_attention(name, 16, 2, **cfg.attention_options)
        assert layer.projections == ("q", "k", "v") and cfg.attention_options["recipe"] == "encoder-swap", name
        args = build_parser().parse_args(["train", "--preset", "demo", "--attention", name, "--out", "x"])
        assert _config(args, attention=name)[0].attention_options["recipe"] == "encoder-swap", name
    assert all(not specs[name] for name in ("sgpa-rff", "kep-svgp", "cgp", "scgp"))
    # sgpa-rff and cgp train at their own, larger learning rate there; the others at the preset's
    lrs = {}
    for name in ("sgpa-rff", "cgp", "softmax", "sgpa"):
        args = build_parser().parse_args(["train", "--preset", "demo", "--attention", name, "--out", "x"])
        lrs[name] = _config(args, attention=name)[0].lr
    assert lrs == {"sgpa-rff": 2 * demo["lr"], "cgp": 2 * demo["lr"], "softmax": demo["lr"], "sgpa": demo["lr"]}
    assert gpattn.build_attention("sgpa", 16, 2).projections == ("qk", "v")  # the library's (the paper's) form
    assert "variant_options" not in get_preset("digits")
