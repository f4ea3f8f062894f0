"""The bad-input matrix over the CLI and the Python API: every case is a clear error that
names the problem, or a documented defined result — never a hang or a traceback."""

import pytest
import torch

import gpattn
from gpattn.experiments.cli import main
from gpattn.models import TransformerClassifier

COMMON = ["--no-progress", "--epochs", "1", "--embed-dim", "8", "--num-heads", "2", "--num-samples", "1"]


def _cli(tmp_path, capsys, *args):
    code = main(["train", *args, *COMMON, "--out", str(tmp_path / "run")])
    return code, capsys.readouterr().err


def test_cli_corrupt_zip(tmp_path, capsys):
    (tmp_path / "cola_public_1.1.zip").write_bytes(b"this is not a zip archive")
    code, err = _cli(
        tmp_path, capsys, "--dataset", "cola", "--data-dir", str(tmp_path), "--dataset-option", "verify_checksum=False"
    )
    assert code == 2 and "not a valid zip archive" in err


def test_cli_checksum_mismatch(tmp_path, capsys):
    from gpattn.experiments.data.fixtures import make_cola_zip

    make_cola_zip(tmp_path / "cola_public_1.1.zip")  # right format, wrong digest
    code, err = _cli(tmp_path, capsys, "--dataset", "cola", "--data-dir", str(tmp_path))
    assert code == 2 and "2cf856f4" in err and "cola_public_1.1.zip" in err


def test_cli_missing_file_names_url_and_path(tmp_path, capsys):
    code, err = _cli(tmp_path, capsys, "--dataset", "cola", "--data-dir", str(tmp_path / "nowhere"))
    assert code == 2 and "https://" in err and str(tmp_path / "nowhere") in err


def test_cli_unknown_dataset_option_and_attention_option(tmp_path, capsys):
    code, err = _cli(tmp_path, capsys, "--dataset", "digits", "--dataset-option", "colour=1")
    assert code == 2 and "colour" in err
    code, err = _cli(tmp_path, capsys, "--dataset", "digits", "--attention-option", "temperature=2")
    assert code == 2 and "temperature" in err and "valid options" in err


def test_cli_text_table_missing_file(tmp_path, capsys):
    code, err = _cli(tmp_path, capsys, "--dataset", "text_table", "--dataset-option", f"path='{tmp_path}/none.tsv'")
    assert code == 2 and "none.tsv" in err


def test_cli_resume_without_checkpoint(tmp_path, capsys):
    code = main(["train", "--dataset", "digits", *COMMON, "--out", str(tmp_path / "fresh"), "--resume"])
    assert code == 2 and "no checkpoint" in capsys.readouterr().err


def test_api_wrong_embed_dim_names_it():
    layer = gpattn.build_attention("softmax", 8, 2)
    with pytest.raises(ValueError, match="embed_dim is 8"):
        layer(torch.randn(2, 5, 9))


def test_api_bad_constructor_arguments():
    with pytest.raises(ValueError, match="embed_dim"):
        gpattn.build_attention("softmax", 0, 2)
    with pytest.raises(ValueError, match="num_heads"):
        gpattn.build_attention("softmax", 8, 2.0)
    with pytest.raises(ValueError, match="dropout"):
        gpattn.build_attention("softmax", 8, 2, dropout=1.5)


def test_model_empty_batch_and_all_padding_rows():
    torch.manual_seed(0)
    model = TransformerClassifier(3, vocab_size=20, embed_dim=8, num_heads=2).eval()
    assert model(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5, dtype=torch.bool), num_samples=2).shape == (
        0,
        2,
        3,
    )
    ids = torch.randint(1, 20, (2, 5))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[1] = True  # a sequence that is all padding: defined (finite) logits, the other row unaffected
    out = model(ids, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], model(ids[:1], None)[0])


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--epochs", "0", "epochs must be a positive int, got 0"),  # trained nothing and reported metrics
        ("--epochs", "-1", "epochs must be a positive int"),
        ("--batch-size", "0", "batch_size must be a positive int"),  # was a ZeroDivisionError traceback
        ("--checkpoint-every", "-5", "checkpoint_every must be an int >= 0"),  # was silently ignored
        ("--lr", "inf", "lr must be a finite number > 0"),
    ],
)
def test_cli_bad_training_numbers_are_named(tmp_path, capsys, flag, value, words):
    # the flag after COMMON: the last one wins
    code = main(["train", "--dataset", "digits", *COMMON, flag, value, "--out", str(tmp_path / "run")])
    assert code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before any data is loaded or folder written


def test_train_config_checks_its_own_fields():
    from gpattn.experiments.training import TrainConfig

    for field, value in [("num_samples", 0), ("train_samples", 1.5), ("eval_batch_size", 0), ("seed", "1"),
                         ("weight_decay", -1e-3), ("grad_clip", float("nan")), ("average", "mean"),
                         ("beta_anneal_steps", -1), ("batch_size", True)]:
        with pytest.raises(ValueError, match=field):
            TrainConfig(**{field: value})
    TrainConfig(grad_clip=0.0, checkpoint_every=0, weight_decay=0.0)  # 0 = off is valid


@pytest.mark.parametrize("seeds, words", [("a,b", "--seeds takes a comma list of ints"),
                                          ("", "non-empty list of distinct ints"),  # ran the default seeds
                                          ("1,1", "distinct")])
def test_cli_compare_bad_seeds(tmp_path, capsys, seeds, words):
    try:
        code = main(["compare", "--dataset", "digits", "--attention", "softmax", "--seeds", seeds, *COMMON,
                     "--out", str(tmp_path / "cmp")])
    except SystemExit as stop:  # argparse's own usage error
        code = stop.code
    assert code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "cmp" / "runs").exists()


@pytest.mark.parametrize("content", [b"garbage\n", b""])
def test_cli_evaluate_and_resume_a_corrupt_checkpoint_name_the_file(tmp_path, capsys, content):
    # torch.load of a foreign file failed with "invalid literal for int() ... 'arbage'"
    bad = tmp_path / "run" / "checkpoint.pt"
    bad.parent.mkdir()
    bad.write_bytes(content)
    assert main(["evaluate", "--checkpoint", str(bad)]) == 2
    assert f"{bad} is not a readable gpattn checkpoint" in capsys.readouterr().err
    code, err = _cli(tmp_path, capsys, "--dataset", "digits", "--resume")
    assert code == 2 and "is not a readable gpattn checkpoint" in err


def test_cli_evaluate_a_torch_file_that_is_no_checkpoint(tmp_path, capsys):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert main(["evaluate", "--checkpoint", str(tmp_path / "other.pt")]) == 2
    assert "expected a dict with 'config' and 'model', got ['weights']" in capsys.readouterr().err
