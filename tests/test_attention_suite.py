"""The attention suite (gpattn.experiments.attention_suite, data.attention_tasks): tasks that a model
without token interactions cannot solve, and GP layers that solve them at the library's defaults."""

import numpy as np
import pytest
import torch

from gpattn.experiments.attention_suite import SuiteConfig, ZeroAttention, run_task
from gpattn.experiments.data import load_dataset
from gpattn.experiments.data.attention_tasks import ATTENTION_TASKS, make_attention_task


@pytest.mark.parametrize("task", ATTENTION_TASKS)
def test_tasks_are_balanced_seeded_and_padded_as_declared(task):
    a, b = make_attention_task(task, 4000, seed=3), make_attention_task(task, 4000, seed=3)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.inputs, make_attention_task(task, 4000, seed=4).inputs)
    assert abs(a.labels.double().mean().item() - 0.5) < 0.03
    assert torch.equal(a.inputs == 0, a.mask)  # id 0 is padding, exactly where the mask says
    lengths = (~a.mask).sum(1)
    if task == "attn-repeat":
        assert set(lengths.tolist()) == set(range(4, 13))
        for n in range(4, 13):  # the length says nothing about the label
            assert abs(a.labels[lengths == n].double().mean().item() - 0.5) < 0.12
        ids = a.inputs.masked_fill(a.mask, -1).tolist()
        dup = [len({t for t in r if t >= 0}) < sum(t >= 0 for t in r) for r in ids]
        assert dup == a.labels.bool().tolist()
    else:
        assert (lengths == 12).all()


@pytest.mark.parametrize("task", ATTENTION_TASKS)
def test_no_sum_of_per_token_features_solves_a_task(task):
    """What a zero-attention model can compute: per-token maps g(x_t, t), mean-pooled, a linear head —
    every such model is a linear function of the mean of one-hot(symbol, position). The best of them (a
    logistic regression on exactly those features) stays near chance on every task."""
    from sklearn.linear_model import LogisticRegression

    def features(split):
        ids, mask = split.inputs.numpy(), split.mask.numpy()
        T, V = ids.shape[1], int(ids.max()) + 1
        onehot = np.zeros((len(ids), T * V))
        rows = np.repeat(np.arange(len(ids)), T)
        onehot[rows, (np.arange(T) * V)[None, :].repeat(len(ids), 0).ravel() + ids.ravel()] = 1.0
        return onehot / (~mask).sum(1, keepdims=True)

    bundle = load_dataset(task, seed=0, train_size=6000, test_size=2000)
    train, test = bundle.splits["train"], bundle.splits["test"]
    clf = LogisticRegression(C=1.0, max_iter=2000).fit(features(train), train.labels.numpy())
    assert clf.score(features(test), test.labels.numpy()) < 0.58


def test_zero_attention_control_is_zero():
    layer = ZeroAttention(8, 2)
    assert torch.equal(layer(torch.randn(3, 4, 8)), torch.zeros(3, 4, 8))
    with pytest.raises(ValueError, match="no options"):
        ZeroAttention(8, 2, kernel="x")


@pytest.mark.slow
@pytest.mark.parametrize("attention, floor", [("zero", None), ("sgpa", 0.75), ("sgpa-decoupled", 0.75)])
def test_gp_layers_attend_at_the_library_defaults(attention, floor):
    """Smoke size of the suite (attn-repeat: variable length with padding; 800 steps, 4000 sequences):
    the control stays at chance, and both SGPA variants at their defaults (β = 1: the exact bound) learn the
    task. Measured (seed 0): sgpa 0.894, sgpa-decoupled 0.831. On 629936d (the papers' zero prior mean,
    the per-sequence KL on the attention output) both scored like the control: checked by running this
    test with that tree on PYTHONPATH, sgpa 0.49 and sgpa-decoupled 0.49."""
    result = run_task(SuiteConfig(task="attn-repeat", attention=attention, steps=800, train_size=4000))
    if floor is None:
        assert result["accuracy"] < 0.6
        return
    assert result["accuracy"] >= floor, result
    assert all(row["context_effect"] > 0.1 for row in result["layers"]), result["layers"]
    assert result["train"].get("kl_seq", 0.0) >= 0.0 and result["config"]["objective"] is None  # the defaults


@pytest.mark.slow
def test_scgp_attends_at_the_library_default_alpha():
    """scgp at the library's default objective (α = DEFAULT_ALPHA, the CGP regulariser's weight) learns
    ``attn-match`` at smoke size (800 steps, 4000 sequences), with both layers using the other tokens.
    Measured (seed 0, CPU) at the default separate softmax mean (§7a): accuracy 1.000, context effect 0.19 / 0.40
    (at the papers' zero mean: 1.000, 0.19 / 0.28). At α = 1e-5, 629936d's default, with the zero mean,
    the regulariser pulls the attention output to 0 first: the same run scored 0.50 with context effect
    0.00 (checked by running it with objective={"alpha": 1e-5})."""
    result = run_task(SuiteConfig(task="attn-match", attention="scgp", steps=800, train_size=4000))
    assert result["accuracy"] >= 0.75, result
    assert all(row["context_effect"] > 0.1 for row in result["layers"]), result["layers"]
    assert result["config"]["objective"] is None  # the library defaults


@pytest.mark.slow
def test_scgp_attends_at_the_alpha_cola_chooses():
    """At α = 1e-5, the regulariser weight CoLA's validation split chooses for scgp (docs/results.md), α·R shrinks
    the GP's values; scgp's default prior mean reads values of its own (``prior_mean="softmax-separate"``, §7a) and
    attends. Measured (seed 0, CPU, smoke size): accuracy 0.989, context effect 0.42 / 1.20; the papers' zero mean
    0.504, context effect 0.00 / 0.00 (this test fails there: checked with ``attention_options={"prior_mean":
    "zero"}``); the shared softmax mean 0.982, 0.23 / 0.54 (on CoLA its second layer stayed under the bar)."""
    config = SuiteConfig(task="attn-match", attention="scgp", steps=800, train_size=4000, objective={"alpha": 1e-5})
    result = run_task(config)
    assert result["accuracy"] >= 0.75, result
    assert all(row["context_effect"] > 0.1 for row in result["layers"]), result["layers"]


@pytest.mark.slow
def test_kep_svgp_noise_stays_under_the_input_in_training():
    """kep-svgp's output spread after a short training (attn-match, width 32, 400 steps at lr 3e-3) stays well under
    its input. The global KL ÷ N pulls q(u_c)'s covariance towards the prior at Adam's step size, so the spread ends
    near the prior's (docs/derivations.md §6, "The prior's outputscale"). Measured (seed 0, CPU), layers 0 / 1: spread
    0.34 / 0.58 at the default prior_variance = 0.1; Chen et al.'s prior (``prior_variance=1.0``, today's code before
    the outputscale) fails it, 0.69 / 1.00 (checked with attention_options={"prior_variance": 1.0})."""
    config = SuiteConfig(
        task="attn-match",
        attention="kep-svgp",
        steps=400,
        lr=3e-3,
        embed_dim=32,
        train_size=2000,
        test_size=500,
        num_samples=4,
    )
    result = run_task(config)
    spread = [row["spread_ratio"] for row in result["layers"]]
    assert len(spread) == 2 and max(spread) <= 0.8, spread
