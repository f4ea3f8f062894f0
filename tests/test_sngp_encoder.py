"""SNGP on a pretrained-encoder model (``--encoder ... --attention softmax+sngp``; gpattn.experiments.sngp): the
spectral-normalisation scope as objects (none / blocks / all), BERT-SNGP's recipe by default (a GP head, no spectral
normalisation in the pretrained encoder), one training step, and a run end to end. Tiny random BERTs, no downloads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

transformers = pytest.importorskip("transformers")

from test_hf_classifier import TINY_RUN, _text_table, tiny_encoder, tiny_encoder_folder  # noqa: E402

from gpattn.experiments import sngp as S  # noqa: E402
from gpattn.integrations.huggingface import HFClassifier  # noqa: E402
from gpattn.objectives import DeepGPELBO  # noqa: E402


def _normalised(modules) -> list[bool]:
    return [parametrize.is_parametrized(m, "weight") for m in modules]


def _encoder_linears(model) -> list[nn.Linear]:
    return [m for m in model.encoder.modules() if isinstance(m, nn.Linear)]


def test_encoder_sngp_default_is_a_gp_head_without_spectral_normalisation_and_trains_one_step():
    model = HFClassifier(tiny_encoder(), 3, "softmax", "last")
    S.apply_sngp(model, **S.sngp_options(encoder=True))
    assert isinstance(model.head, S.RandomFeatureGP)
    assert not any(_normalised(_encoder_linears(model)))  # BERT-SNGP: the pretrained layers as they are
    ids = torch.tensor([[2, 5, 7, 9, 3], [2, 8, 3, 0, 0]])
    pad = ids == 0
    labels = torch.tensor([0, 2])
    before = model.head.output.weight.detach().clone()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    parts = DeepGPELBO(model, 10, combine_terms=False)(model(ids, pad), labels)
    assert "log_prior" in parts  # the head's β prior reaches the objective (the MAP objective Laplace expands)
    parts["loss"].backward()
    optimizer.step()
    assert not torch.equal(model.head.output.weight, before)
    S.fit_covariance(model, [(ids, pad)])
    assert int(model.head.num_fitted) == 2
    assert model.eval()(ids, pad, num_samples=2).shape == (2, 2, 3)


@pytest.mark.parametrize("frozen_trunk", [False, True])
def test_spectral_scopes_all_and_blocks_normalise_the_trained_layers_only(frozen_trunk):
    encoder_layers = 2  # tiny_encoder: the last one is the top layer with the frozen trunk
    for scope in ("all", "blocks"):
        model = HFClassifier(tiny_encoder(), 3, "softmax", "last", frozen_trunk=frozen_trunk)
        S.apply_sngp(model, spectral_norm=scope, num_features=16)
        layers = model.encoder.encoder.layer
        top = [m for m in layers[encoder_layers - 1].modules() if isinstance(m, nn.Linear)]
        below = [m for m in layers[0].modules() if isinstance(m, nn.Linear)]
        assert top and all(_normalised(top)), scope
        assert all(_normalised(below)) if not frozen_trunk else not any(_normalised(below)), (scope, frozen_trunk)
        assert not any(_normalised(model.head.modules()))
    # the scopes are objects in one table; a name outside it is refused, naming the option
    assert set(S.SPECTRAL_SCOPES) == {"none", "blocks", "all"}
    with pytest.raises(ValueError, match="spectral_norm must be one of none, blocks, all"):
        S.check_sngp_options({"spectral_norm": "head"})


def test_all_differs_from_blocks_by_the_input_map_of_a_gpattn_classifier():
    from gpattn.models import ViTClassifier

    def build(scope):
        torch.manual_seed(0)
        vit = ViTClassifier(3, image_shape=(1, 8, 8), patch_size=4, embed_dim=16, num_heads=2, num_layers=1)
        return S.apply_sngp(vit, spectral_norm=scope, num_features=16)

    assert not any(_normalised([build("blocks").embed])) and all(_normalised([build("all").embed]))
    assert not any(_normalised(m for m in build("none").modules() if isinstance(m, nn.Linear)))


@pytest.mark.filterwarnings("ignore::gpattn.experiments.diagnostics.CollapseWarning")  # 1 epoch of a tiny model
def test_train_and_compare_an_encoder_with_softmax_sngp(tmp_path):
    """``gpattn compare --encoder ... --attention softmax+sngp`` trains, fits the covariance and reports; its config
    records BERT-SNGP's scope, and the reloaded model has the GP head with the fitted covariance."""
    from gpattn.experiments.cli import main
    from gpattn.experiments.training import load_run_with_data

    table = _text_table(tmp_path)
    enc = tiny_encoder_folder(tmp_path / "enc", table)
    out = tmp_path / "cmp"
    argv = ["compare", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
            "--seeds", "0", *TINY_RUN, "--attention", "softmax+sngp", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["softmax+sngp"]["0"]["in_domain"]["nll"] > 0
    run = out / "runs" / "softmax+sngp" / "seed0"
    assert json.loads((run / "config.json").read_text())["sngp"]["spectral_norm"] == "none"
    _, model, _, _ = load_run_with_data(run)
    assert isinstance(model.head, S.RandomFeatureGP) and int(model.head.num_fitted) > 0
