"""``torch.compile`` of a whole model, every registered variant, in training: one graph with no break, the same
outputs, loss terms and gradients as eager to round-off (same seed: the same draws), and no recompilation over
steps of a fixed shape, from the first step on.

The equality tests use ``backend="aot_eager"``, which traces what Inductor would (Dynamo's graph and
AOTAutograd's joint forward/backward) without its C++ build, so the tests stay cheap (the recompile test
needs only Dynamo: a counting backend); ``benchmarks/train_step.py`` times Inductor.
"""

import copy
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import gpattn
from gpattn.models import TransformerClassifier
from gpattn.objectives import DeepGPELBO

VARIANTS = gpattn.list_attention()


def _batch(B=3, T=6, F=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, F, generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, T - 2 :] = True
    return x, mask, torch.randint(0, 3, (B,), generator=g)


def _model(name, options=None):
    torch.manual_seed(0)
    return TransformerClassifier(
        3, input_dim=5, max_len=8, embed_dim=16, num_heads=2, attention=name, attention_options=options, dropout=0.0
    )


def _step(model, forward, x, mask, y):
    """One training forward + backward from seed 1: ``(logits, loss parts, grads by name)``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    parts = DeepGPELBO(model, num_data=50, combine_terms=False)(forward(x, mask), y)
    parts["loss"].backward()
    return parts, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        # Dynamo's tracing of a training forward reads .grad of non-leaf tensors and warns about it
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        # torch 2.13's Dynamo instantiates the autograd.Function it traces (_linalg's _ShiftedDiagonal), then warns
        warnings.filterwarnings("ignore", message=".*should not be instantiated", category=DeprecationWarning)
        yield
    dynamo.reset()


# the slowest to trace (4-8 s each on a quiet core, 16-95 s on the loaded 2-core machine): in the slow run
SLOW_TO_TRACE = {"cgp", "scgp", "sgpa-decoupled"}
TRACED = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TO_TRACE else n for n in VARIANTS]


@pytest.mark.parametrize("name", TRACED)
def test_compiled_training_step_equals_eager(name):
    _assert_compiled_step_equals_eager(name)


#: forms other than the defaults whose own inputs travel differently (kep-svgp's mean reads a tuple of projections)
FORMS = [("kep-svgp", {"prior_mean": "softmax-separate"}), ("kep-svgp", {"prior_mean": "zero"})]


@pytest.mark.parametrize("name, options", FORMS, ids=[f"{n}-{o['prior_mean']}" for n, o in FORMS])
def test_compiled_training_step_equals_eager_in_other_forms(name, options):
    _assert_compiled_step_equals_eager(name, options)


def _assert_compiled_step_equals_eager(name, options=None):
    """One graph (fullgraph), and the compiled step's loss parts and gradients are eager's to round-off."""
    eager = _model(name, options).train()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)  # fullgraph: a break fails
    x, mask, y = _batch()
    want, want_grads = _step(eager, eager, x, mask, y)
    got, got_grads = _step(compiled_model, compiled, x, mask, y)
    assert set(got) == set(want) and set(got_grads) == set(want_grads)
    assert len(want_grads) == len([p for p in eager.parameters() if p.requires_grad]) or name == "softmax"
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    for key in want_grads:
        torch.testing.assert_close(got_grads[key], want_grads[key], rtol=1e-3, atol=1e-5, msg=f"{name}: d{key}")


@pytest.mark.parametrize("name", TRACED)  # Dynamo only: all ten in 14 s quiet, ~45 s loaded (cgp, scgp 10 s)
def test_compiled_training_steps_do_not_recompile(name):
    frames = CompileCounter()  # a backend that counts the graphs Dynamo hands it: a recompile is one more
    model = _model(name).train()
    compiled = torch.compile(model, backend=frames)
    for seed in range(10):  # new data of the same shape, new draws; the first step creates the layers' records
        _step(model, compiled, *_batch(seed=seed))
    assert frames.frame_count == 1, f"{name}: {frames.frame_count} graphs over 10 steps of one shape"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_eval_prediction_equals_eager():
    model = _model("sgpa").eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, mask, _ = _batch()
    with torch.no_grad(), gpattn.deterministic():
        torch.testing.assert_close(compiled(x, mask, num_samples=2), model(x, mask, num_samples=2))


def _cli_run(tmp_path, name, *extra):
    from gpattn.experiments.cli import main
    from gpattn.experiments.data.fixtures import make_cola_zip

    data = tmp_path / "data"
    if not data.exists():
        make_cola_zip(data / "cola_public_1.1.zip", n_train=64, n_dev=16, n_ood=16)
    out = tmp_path / name
    args = ["train", "--dataset", "cola", "--data-dir", str(data), "--dataset-option", "verify_checksum=False",
            "--attention", "sgpa", "--epochs", "1", "--batch-size", "16", "--embed-dim", "16", "--num-heads", "2",
            "--num-layers", "1", "--num-samples", "2", "--no-progress", "--out", str(out), *extra]
    assert main(args) == 0
    return out


@pytest.mark.slow  # 25-35 s on the loaded 2-core machine (two short runs)
@pytest.mark.filterwarnings("ignore::gpattn.experiments.diagnostics.GPCollapseWarning")  # 4 steps: at the prior
@pytest.mark.filterwarnings("ignore:cola.*longer than the:UserWarning")  # the fixture's test rows cut to the model
def test_cli_compile_trains_batches_of_every_length_in_one_graph(tmp_path, monkeypatch):
    """``gpattn train --compile``: text batches cut to their longest row (lengths vary) share one graph, and the
    run equals the eager one to round-off (Dynamo's graph run as it is: the same draws; Inductor draws its own)."""
    import json

    from gpattn.experiments import training

    frames = CompileCounter()
    monkeypatch.setitem(training.COMPILE_OPTIONS, "backend", frames)  # Dynamo's graphs, counted; no Inductor
    lengths, cut = [], training._batch

    def batch(*args, **kwargs):  # training's, recording each batch's length
        out = cut(*args, **kwargs)
        lengths.append(out[0].shape[1])
        return out

    monkeypatch.setattr(training, "_batch", batch)
    compiled = _cli_run(tmp_path, "compiled", "--compile")
    assert len(set(lengths)) > 1, lengths  # the batches do vary in length
    assert frames.frame_count == 1 and not counters["graph_break"], (frames.frame_count, dict(counters["graph_break"]))
    eager = _cli_run(tmp_path, "eager")
    assert json.loads((compiled / "config.json").read_text())["compile"] is True
    want, got = (json.loads((run / "history.json").read_text())[-1]["train"] for run in (eager, compiled))
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_compile_is_a_checked_run_setting_the_flag_sets():
    from gpattn.experiments._config import RUN_SETTINGS, TrainConfig, _same_run
    from gpattn.experiments.cli import _config, build_parser

    args = build_parser().parse_args(["compare", "--dataset", "digits", "--out", "x", "--compile"])
    assert _config(args, attention="sgpa")[0].compile is True
    plain = build_parser().parse_args(["train", "--dataset", "digits", "--attention", "sgpa", "--out", "x"])
    assert _config(plain, attention="sgpa")[0].compile is False
    with pytest.raises(ValueError, match="compile must be True or False"):
        TrainConfig(compile="yes")
    assert "compile" in RUN_SETTINGS and _same_run(TrainConfig(compile=True).to_dict(), TrainConfig())[0]
