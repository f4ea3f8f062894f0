"""Evaluation at what its samples cost: passes bounded in rows × samples × tokens on every evaluating path, and no
training-only loss term computed at evaluation (issue #58, item 2)."""

import types

import pytest
import torch

import gpattn.experiments._runs as inference
from gpattn import deterministic
from gpattn.experiments.training import TrainConfig, predict, train
from gpattn.models import TransformerClassifier
from gpattn.variational.cgp import CorrelatedConditional


def _text_split(n=23, T=12, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, T), generator=g)
    lengths = torch.randint(3, T + 1, (n,), generator=g)
    lengths[0] = T  # one full row: the batches' width is the split's
    mask = torch.arange(T)[None, :] >= lengths[:, None]
    ids[mask] = 0
    return types.SimpleNamespace(inputs=ids, mask=mask, labels=torch.randint(0, 2, (n,), generator=g))


def _model(attention="sgpa", T=12, layers=2):
    torch.manual_seed(0)
    return TransformerClassifier(
        2, vocab_size=40, max_len=T, embed_dim=16, num_heads=2, num_layers=layers, attention=attention, dropout=0.0
    )


def _spy(model) -> list:
    """(rows, tokens, num_samples) of every forward of ``model``."""
    passes = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: passes.append((args[0].shape[0], args[0].shape[1], kwargs["num_samples"])),
        with_kwargs=True,
    )
    return passes


def test_predict_splits_rows_into_passes_within_the_bound(monkeypatch):
    """Every pass of an evaluation holds rows × samples × tokens ≤ the token budget and rows × samples × tokens²
    ≤ the pair budget (at budgets small enough to split 23 rows), and its sample logits equal one unbounded pass's
    (deterministic mode: the draws do not depend on how the rows are batched)."""
    split, model, P = _text_split(), _model(), 4
    with deterministic():
        whole = predict(model, split, P, batch_size=256)
        monkeypatch.setattr(inference, "PREDICT_TOKEN_BUDGET", 5 * P * 12)
        monkeypatch.setattr(inference, "PREDICT_PAIR_BUDGET", 7 * P * 12 * 12)
        passes = _spy(model)
        bounded = predict(model, split, P, batch_size=256)
    assert [p[0] for p in passes] == [5, 5, 5, 5, 3]  # min(256, 5, 7) rows per pass
    for rows, tokens, samples in passes:
        assert samples == P and tokens <= 12
        assert rows * samples * 12 <= inference.PREDICT_TOKEN_BUDGET
        assert rows * samples * 12 * 12 <= inference.PREDICT_PAIR_BUDGET
    torch.testing.assert_close(bounded, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*base-rate entropy")
def test_run_evaluation_and_run_predict_share_the_bound(tmp_path, monkeypatch):
    """The run's own evaluation (``train``'s, at ``eval_batch_size``), ``Run.predict`` and ``gpattn evaluate`` all
    evaluate in passes of ``predict_rows`` rows: with a token budget of 3 rows × P × the data's width, no eval-mode
    pass holds more. And each forwards every row once at P samples, the feature detectors' scores included (their
    features are read in the logits' own pass: once, not twice)."""
    from gpattn.experiments import load_run, training
    from gpattn.experiments.cli import main

    cfg = TrainConfig(dataset="digits", attention="sgpa", embed_dim=16, num_heads=2, num_layers=1, epochs=1,
                      batch_size=64, num_samples=3, patch_size=4, progress=False)
    tokens = 4  # digits: 8 × 8 images, 2 × 2 patches of 4 px
    monkeypatch.setattr(inference, "PREDICT_TOKEN_BUDGET", 3 * 3 * tokens)
    seen, evaluation = [], {}
    original = TransformerClassifier.__mro__[1].forward  # _SequenceClassifier.forward, which ViTClassifier runs

    def spied(self, inputs, key_padding_mask=None, num_samples=1):
        if not self.training:
            seen.append((inputs.shape[0], num_samples))
        return original(self, inputs, key_padding_mask, num_samples)

    def evaluate(run):  # the run's own evaluation: its passes, and the rows of the splits it evaluates
        seen.clear()
        evaluation["rows"] = sum(len(run.bundle.splits[k]) for k in training._evaluated(run.bundle))
        result = evaluate_run(run)
        evaluation["passes"], evaluation["detectors"] = list(seen), run.detectors
        return result

    evaluate_run = training._evaluate
    monkeypatch.setattr(TransformerClassifier.__mro__[1], "forward", spied)
    monkeypatch.setattr(training, "_evaluate", evaluate)
    train(cfg, tmp_path)
    assert set(evaluation["detectors"]["states"]) == {"mahalanobis", "relative-mahalanobis", "knn"}
    passes = evaluation["passes"]
    assert passes and max(rows for rows, _ in passes) == 3 and {P for _, P in passes} == {3}
    assert sum(rows for rows, _ in passes) == evaluation["rows"]  # each row once, detectors included
    seen.clear()
    pred = load_run(tmp_path).predict(torch.rand(7, 1, 8, 8), num_samples=3)
    assert set(pred.detector_scores) == set(evaluation["detectors"]["states"])
    assert seen == [(3, 3), (3, 3), (1, 3)]  # one pass: the logits' and the detectors' features
    seen.clear()
    assert main(["evaluate", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "ev"), "--no-progress"]) == 0
    assert max(rows for rows, _ in seen) == 3 and {P for _, P in seen} == {3}
    assert sum(rows for rows, _ in seen) == evaluation["rows"]


@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_evaluation_computes_no_regulariser_and_gives_the_same_output(name, monkeypatch):
    """CGP's regulariser R is training's (the objective's α term): an eval-mode forward never computes it and
    leaves no loss term, and its output is the output of the same forward with R computed (the layer alone in
    training mode, no dropout: the old evaluation, which drew R's prior samples after the output's)."""
    calls = []
    regularizer = CorrelatedConditional.regularizer
    monkeypatch.setattr(CorrelatedConditional, "regularizer", lambda self: calls.append(1) or regularizer(self))
    split, model = _text_split(n=6), _model(name, layers=1)
    layer = model.encoder.blocks[0].attn
    model.eval()
    torch.manual_seed(3)
    evaluated = model(split.inputs, split.mask, num_samples=5)
    assert calls == [] and model.loss_terms() == {}
    layer.train()  # the rest of the model stays in eval mode
    torch.manual_seed(3)
    with_r = model(split.inputs, split.mask, num_samples=5)
    assert len(calls) == 1 and set(model.loss_terms()) == {"cgp"}
    torch.testing.assert_close(evaluated, with_r, rtol=0, atol=0)


def test_the_objective_of_an_eval_mode_forward_says_it_is_the_data_term_alone():
    """An eval-mode forward records no loss term, so an objective computed on it is the data term alone: said, not
    silent; in training mode the terms are there and nothing is said."""
    import warnings

    from gpattn.objectives import DeepGPELBO

    split, model = _text_split(n=4), _model("sgpa", layers=1)
    objective = DeepGPELBO(model, 100, combine_terms=False)
    logits = model.eval()(split.inputs, split.mask, num_samples=2)
    with pytest.warns(UserWarning, match="eval mode.*the data term alone"):
        parts = objective(logits, split.labels)
    assert "kl_seq" not in parts
    logits = model.train()(split.inputs, split.mask, num_samples=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "kl_seq" in objective(logits, split.labels)
