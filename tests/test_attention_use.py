""""Does not attend" is never silent (gpattn.experiments.diagnostics.attention_use): a token-wise layer scores
0 and is flagged, an attending one is not; the trainer records it per layer in history.json."""

import json
import math

import pytest
import torch

import gpattn
from gpattn.attention.base import AttentionBase
from gpattn.experiments.diagnostics import INERT_CONTEXT, attention_use, collapse_warnings
from gpattn.models import TransformerClassifier


class TokenWise(AttentionBase):
    """A deliberately inert 'attention': each token's output is its own value (no other token enters)."""

    name = "token-wise"
    projections = ("v",)
    is_gp = True  # treated as a GP layer by the checks

    def _attend(self, call):
        return self.project(call.x)["v"]


def _model(attention, **options):
    torch.manual_seed(0)
    return TransformerClassifier(
        2, vocab_size=30, embed_dim=16, num_heads=2, num_layers=2, attention=attention,
        attention_options=options or None, dropout=0.0,
    )  # fmt: skip


def _ids():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (16, 9), generator=g)
    mask = torch.zeros(16, 9, dtype=torch.bool)
    mask[::3, 6:] = True
    return ids.masked_fill(mask, 0), mask


def test_token_wise_layer_scores_zero_and_attending_layers_do_not():
    ids, mask = _ids()
    inert = attention_use(_model(lambda d, h, **o: TokenWise(d, h)), ids, mask)
    assert [r["layer"] for r in inert] == [0, 1]
    assert all(r["context_effect"] == 0 and r["output_ratio"] > 0 for r in inert)
    for name in ("softmax", "sgpa", "sgpa-decoupled", "cgp", "scgp", "kep-svgp"):
        rows = attention_use(_model(name), ids, mask)
        assert len(rows) == 2 and all(r["context_effect"] > INERT_CONTEXT for r in rows), (name, rows)


def test_the_measure_is_of_the_mean_and_restores_the_mode():
    """Posterior means (gpattn.deterministic): two calls agree exactly; the model's mode is kept."""
    model = _model("sgpa").train()
    ids, mask = _ids()
    a, b = attention_use(model, ids, mask), attention_use(model, ids, mask)
    assert a == b and model.training
    assert all(r["is_gp"] for r in a)


def test_a_gp_layer_that_does_not_attend_is_warned_about():
    rows = [{"layer": 0, "is_gp": True, "context_effect": 0.01, "output_ratio": 0.3},
            {"layer": 1, "is_gp": True, "context_effect": 0.4, "output_ratio": 0.3},
            {"layer": 2, "is_gp": False, "context_effect": 0.0, "output_ratio": 0.3}]  # fmt: skip
    history = [{"epoch": 2, "train": {"nll": 0.2}, "layers": [], "attention_use": rows, "base_rate_entropy": 0.69}]
    msgs = collapse_warnings(history)
    assert len(msgs) == 1 and msgs[0].startswith("GP layer 0 does not attend")
    assert "prior_mean='attention'" in msgs[0]  # says what to do


def test_a_narrow_kernel_makes_sgpa_inert_and_the_measure_sees_it():
    """A GP layer whose kernel only sees the token itself (ARD-RBF lengthscale 1e-3: the attention mean is
    the token's own value) is inert; the same layer at its initial lengthscale attends."""
    model = _model("sgpa")
    ids, mask = _ids()
    with torch.no_grad():
        for block in model.encoder.blocks:
            block.attn.kernel.base_kernel.lengthscale = 1e-3
    rows = attention_use(model, ids, mask)
    assert all(r["context_effect"] < INERT_CONTEXT for r in rows), rows


def test_train_records_attention_use_per_layer(tmp_path):
    from gpattn.experiments.training import TrainConfig, train

    cfg = TrainConfig(dataset="attn-repeat", dataset_options={"train_size": 200, "val_size": 50, "test_size": 50},
                      attention="sgpa", epochs=1, embed_dim=16, num_heads=2, num_layers=2, batch_size=50,
                      num_samples=2, progress=False)  # fmt: skip
    train(cfg, tmp_path / "run")
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    rows = history[-1]["attention_use"]
    assert [r["layer"] for r in rows] == [0, 1] and all(r["is_gp"] for r in rows)
    assert all(math.isfinite(r["context_effect"]) and r["context_effect"] > 0 for r in rows)


def test_layers_of_a_swapped_encoder_are_found():
    """A model that is not a gpattn classifier: the attention layers are found in module order and called
    through nn.MultiheadAttention's signature."""
    layer = gpattn.build_attention("sgpa", 16, 2)
    enc = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    enc.self_attn = layer
    x = torch.randn(4, 7, 16)
    mask = torch.zeros(4, 7, dtype=torch.bool)
    mask[0, 5:] = True

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = enc

        def forward(self, x, mask):
            return self.enc(x, src_key_padding_mask=mask)

    rows = attention_use(Wrap(), x, mask)
    assert len(rows) == 1 and rows[0]["context_effect"] > INERT_CONTEXT


@pytest.mark.parametrize("B", [1])
def test_a_batch_of_one_gives_nan(B):
    rows = attention_use(_model("softmax"), torch.randint(3, 30, (B, 5)))
    assert all(math.isnan(r["context_effect"]) for r in rows)


class CLSOnly(AttentionBase):
    """Attends at the first token only (its output: the mean of the values); every other token keeps its value."""

    name = "cls-only"
    projections = ("v",)
    is_gp = True

    def _attend(self, call):
        v = self.project(call.x)["v"]
        return torch.cat([v.mean(-2, keepdim=True), v[..., 1:, :]], dim=-2)


def test_a_cls_pooled_model_is_measured_at_its_cls_token():
    """With CLS pooling the head reads token 0 only, and a layer may gather into it alone: the measured
    positions always include it (else such a layer reads as inert at the other positions)."""
    from gpattn.experiments.diagnostics import attention_use

    ids, mask = _ids()
    seed = next(s for s in range(10) if int(torch.randperm(10, generator=torch.Generator().manual_seed(s))[0]) != 0)
    for pooling, attends in (("cls", True), ("mean", False)):
        torch.manual_seed(0)
        model = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, num_layers=1, attention=CLSOnly,
                                      dropout=0.0, pooling=pooling)
        (row,) = attention_use(model, ids, mask, positions=1, seed=seed)
        assert (row["context_effect"] > 0.05) == attends, (pooling, row)


def test_a_swapped_hugging_face_layer_keeps_its_encoder_layer_index():
    """HFClassifier's swapped layers are named by their encoder layer, as in ``layer_diagnostics`` (a swap of
    the last of 2 layers is layer 1 in both, not layer 0 in one and 1 in the other)."""
    pytest.importorskip("transformers")
    from test_hf_classifier import batch, tiny_encoder

    from gpattn.integrations.huggingface import HFClassifier

    model = HFClassifier(tiny_encoder(), 2, attention="sgpa", attention_layers="last")
    ids, pad = batch()
    model(ids, pad, num_samples=2)  # a sampling forward records the layers' diagnostics
    diagnosed = [row["layer"] for row in model.layer_diagnostics()]
    rows = attention_use(model, ids, pad)
    assert [row["layer"] for row in rows] == diagnosed == [1]
    assert rows[0]["is_gp"] and math.isfinite(rows[0]["context_effect"])
