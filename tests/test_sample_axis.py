"""The explicit Monte-Carlo axis, a leading tensor axis (P, B, ...): the first sampling layer factorises once per
input and draws its P samples from that factorisation; the draws are the ones a batch repeated P times
(B-major) would give with the same seed."""

import inspect

import pytest
import torch

import gpattn
from gpattn.attention._samples import sample_axis, sample_rows
from gpattn.attention.registry import attention_class
from gpattn.variational._linalg import cholesky

VARIANTS = gpattn.list_attention()
GP_VARIANTS = [n for n in VARIANTS if attention_class(n).is_gp]
B, T, D, H, P = 3, 7, 16, 2, 4

#: strategy settings that make every loss term deterministic (CGP: the exact expectation instead of prior samples)
EXACT_TERMS = {"cgp": {"prior_samples": None}}


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.layer_norm(torch.randn(B, T, D, generator=g, dtype=dtype), (D,))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 5:] = True  # a padded sequence
    mask[2] = True  # an all-padding sequence: zero output for every draw
    return x, mask


def _layer(name):
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, D, H).double().eval()
    for setting, value in EXACT_TERMS.get(name, {}).items():
        setattr(layer.strategy, setting, value)
    return layer


@pytest.mark.parametrize("name", VARIANTS)
def test_p_draws_equal_the_repeated_batch(name):
    """``layer(x, mask, num_samples=P)`` is ``(P, B, T, D)`` and, draw for draw, ``layer`` on the batch repeated P
    times (``y[p, b]`` = row b·P + p), with the same loss terms; a later layer given the ``(P, B, T, D)`` stream
    draws one sample per incoming sample, as on the P·B repeated rows."""
    layer = _layer(name)
    x, mask = _inputs()
    torch.manual_seed(1)
    drawn = layer(x, mask, num_samples=P)
    terms = {k: v.detach() for k, v in layer.loss_terms().items()}
    torch.manual_seed(1)
    repeated = layer(x.repeat_interleave(P, 0), mask.repeat_interleave(P, 0))
    assert drawn.shape == (P, B, T, D)
    torch.testing.assert_close(sample_rows(drawn), repeated, rtol=1e-10, atol=1e-12)
    for key, value in layer.loss_terms().items():
        torch.testing.assert_close(terms[key], value.detach(), rtol=1e-10, atol=1e-12, msg=key)
    assert drawn[:, 2].abs().max() == 0  # all-padding sequence
    if layer.sampling:
        spread = (drawn[1:, :2] - drawn[:1, :2]).abs().max()
        assert spread > 1e-6, "the P draws are copies of one sample"
    torch.manual_seed(2)
    later = layer(sample_axis(repeated, P), mask)  # the (P, B, T, D) stream: one draw per incoming sample
    torch.manual_seed(2)
    assert later.shape == (P, B, T, D)
    torch.testing.assert_close(sample_rows(later), layer(repeated, mask.repeat_interleave(P, 0)), rtol=0, atol=0)


@pytest.mark.parametrize("name", GP_VARIANTS)
def test_first_gp_layer_factorises_once(name, monkeypatch):
    """With ``num_samples=P`` a GP layer projects its B inputs once and every Cholesky factor it
    computes has batch B, not B·P: each batch dimension of a factorisation is 1, H, B or the jitter ladder's
    stack of tries (gpattn.variational._linalg, 1 + max_tries of them)."""
    layer = _layer(name)
    x, mask = _inputs()
    rows, factor_batches = [], []
    layer.in_proj.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    cholesky_ex = torch.linalg.cholesky_ex

    def recording(A, *args, **kwargs):
        factor_batches.append(tuple(A.shape[:-2]))
        return cholesky_ex(A, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", recording)
    layer(x, mask, num_samples=P)
    assert rows == [B]
    tries = 1 + inspect.signature(cholesky).parameters["max_tries"].default
    assert B * P not in (1, H, B, tries)
    assert all(b in (1, H, B, tries) for s in factor_batches for b in s), factor_batches


@pytest.mark.parametrize("name", GP_VARIANTS)
def test_draws_of_one_sequence_have_the_posterior_moments(name):
    """Monte-Carlo mean and variance of many draws from one factorisation match the layer's
    posterior (before W_o), token by token."""
    layer = _layer(name)
    x, mask = _inputs()
    x, mask = x[:1], mask[:1]
    n = 4000
    captured = {}
    layer.out_proj.register_forward_pre_hook(lambda mod, args: captured.setdefault("heads", args[0]))
    torch.manual_seed(2)
    layer(x, mask, num_samples=n)
    post = layer.posterior(x, mask)  # batch (1, H, Dv), event T
    Dv = layer.value_dim
    heads = captured["heads"].view(n, T, H, Dv).permute(2, 3, 1, 0)  # shape: (H, Dv, T, n)
    real = ~mask[0]
    mean, var = post.mean[0][..., real], post.variance[0][..., real]
    mc_mean, mc_var = heads[..., real, :].mean(-1), heads[..., real, :].var(-1)
    sd = var.sqrt()
    assert ((mc_mean - mean).abs() <= 5 * sd / n**0.5 + 1e-8).all()
    torch.testing.assert_close(mc_var, var, rtol=0.15, atol=1e-8)


def test_a_model_passes_the_sample_axis_between_blocks():
    """In a model whose middle layer is the first GP layer, the blocks below it see (B, T, D), the GP
    block (B, T, D) (it draws the P samples) and returns (P, B, T, D), and the block above it receives
    (P, B, T, D): the sample axis is a tensor axis, not rows folded into the batch."""
    from gpattn.models import TransformerClassifier

    torch.manual_seed(0)
    model = TransformerClassifier(
        2, vocab_size=20, embed_dim=16, num_heads=2, num_layers=3, attention="sgpa", attention_layers=[1], dropout=0.0
    ).eval()
    seen = []
    for i, block in enumerate(model.encoder.blocks):
        block.register_forward_hook(lambda mod, args, out, i=i: seen.append((i, args[0].shape, out.shape)))
    ids = torch.randint(1, 20, (5, 6))
    out = model(ids, num_samples=8)
    assert [(i, tuple(a), tuple(o)) for i, a, o in seen] == [
        (0, (5, 6, 16), (5, 6, 16)), (1, (5, 6, 16), (8, 5, 6, 16)), (2, (8, 5, 6, 16), (8, 5, 6, 16))
    ]
    assert out.shape == (5, 8, 2) and (out[:, 1:] - out[:, :1]).abs().max() > 1e-6


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3"])
def test_p_is_checked_once_with_a_message_naming_num_samples(bad, monkeypatch):
    """P is checked once by the model (before any block runs) and once by the layer that takes the draws, not again
    further down; a bad P is a ValueError naming ``num_samples``, from the model and from a layer called directly."""
    from gpattn.attention import _call
    from gpattn.models import TransformerClassifier, classifiers

    torch.manual_seed(0)
    model = TransformerClassifier(2, vocab_size=20, embed_dim=16, num_heads=2, attention="sgpa").eval()
    ids, calls = torch.randint(1, 20, (2, 4)), []
    for module in (_call, classifiers):

        def counted(*args, check=module.check_num_samples, module=module, **kwargs):
            calls.append(module)
            return check(*args, **kwargs)

        monkeypatch.setattr(module, "check_num_samples", counted)
    model(ids, num_samples=3)
    assert calls == [classifiers, _call]  # the model, then the first GP layer; the second gets the axis
    ran = []
    model.encoder.blocks[0].register_forward_pre_hook(lambda *a: ran.append(1))
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        model(ids, num_samples=bad)
    assert not ran
    with pytest.raises(ValueError, match="num_samples must be a positive int or None"):
        model.encoder.blocks[0].attn(torch.zeros(1, 2, 16), num_samples=bad)
    with pytest.raises(ValueError, match="already has a sample axis"):
        model.encoder.blocks[0].attn(torch.zeros(3, 1, 2, 16), num_samples=3)


# ----------------------------------------------------------------------------- HFClassifier
def _hf_model(**kwargs):
    transformers = pytest.importorskip("transformers")
    from gpattn.integrations.huggingface import HFClassifier

    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=D,
        num_hidden_layers=3,
        num_attention_heads=H,
        intermediate_size=32,
        max_position_embeddings=24,
    )
    torch.manual_seed(0)
    return HFClassifier(transformers.BertModel(config, add_pooling_layer=False), 2, "sgpa", [1], **kwargs)


def _hf_batch():
    ids = torch.tensor([[2, 5, 7, 9, 3], [2, 8, 3, 0, 0], [2, 4, 4, 6, 3]])
    return ids, ids == 0


def _hf_by_hand(model, ids, pad, seed):
    """The sample axis written out on the BERT layers: the trunk once on the B inputs, one conditional of the
    swapped layer for them and its P draws (``rsample(P)``, (P, B, ...)), the rest of the swapped layer broadcast
    over them, then the layer above on the P·B rows, batch-major.  # -> logits (B, P, C)"""
    from transformers.masking_utils import create_bidirectional_mask

    layers, gp = model.encoder.encoder.layer, model.adapters[1].attention
    x = model.trunk(ids, pad)  # shape: (B, T, D): the swapped layer's input, computed once
    cond = gp._condition(x, pad)  # one factorisation per sequence (the swap's form: separate q and k maps)
    torch.manual_seed(seed)
    heads = cond.rsample(P)  # shape: (P, B, H, T, Dv)
    y = gp.out_proj(heads.transpose(-3, -2).reshape(P, B, T_HF, -1))  # shape: (P, B, T, D)
    h = layers[1].attention.output(y, x)  # the swapped layer's residual and LayerNorm, broadcast over P
    h = layers[1].output(layers[1].intermediate(h), h)
    rows, pad_rows = sample_rows(h), pad.repeat_interleave(P, 0)
    full = create_bidirectional_mask(config=model.encoder.config, inputs_embeds=rows, attention_mask=(~pad_rows).long())
    h = layers[2](rows, full)
    h = h[0] if isinstance(h, tuple) else h
    keep = (~pad_rows).unsqueeze(-1).to(h.dtype)
    return model.head((h * keep).sum(1) / keep.sum(1)).view(B, P, -1)


def _hf_by_hand_repeated(model, ids, pad, seed):
    """The values of the repeated batch (the layers' input repeated P times in front of the swapped layer, which
    read one row per group of P): the swapped layer's P draws as B·P rows, batch-major, the rest on the B·P rows.
    In eval mode nothing else draws, so these are the sample axis's values too.  # -> logits (B, P, C)"""
    layers, gp = model.encoder.encoder.layer, model.adapters[1].attention
    x = model.trunk(ids, pad)
    cond = gp._condition(x, pad)
    torch.manual_seed(seed)
    heads = sample_rows(cond.rsample(P))  # shape: (B·P, H, T, Dv), row b·P + p = draw p of sequence b
    y = gp.out_proj(heads.transpose(1, 2).reshape(B * P, T_HF, -1))
    rows, pad_rows = x.repeat_interleave(P, 0), pad.repeat_interleave(P, 0)
    h = layers[1].attention.output(y, rows)
    h = layers[1].output(layers[1].intermediate(h), h)
    full = model._attention_mask(h, pad_rows)
    h = layers[2](h, full)
    h = h[0] if isinstance(h, tuple) else h
    keep = (~pad_rows).unsqueeze(-1).to(h.dtype)
    return model.head((h * keep).sum(1) / keep.sum(1)).view(B, P, -1)


T_HF = 5


@pytest.mark.parametrize("recipe", ["full", "frozen-trunk+mc-dropout"])
def test_hf_classifier_draws_from_one_factorisation_of_the_swapped_layer(recipe):
    """``HFClassifier(..., num_samples=P)`` is, draw for draw, the explicit axis written out: the layers below
    the first swapped layer run once on the B inputs, the swapped layer conditions once and draws P samples
    (the same generator state) that the rest of its BERT layer broadcasts over, the layer above runs on the P·B
    rows. With ``frozen_trunk`` and ``mc_dropout`` the top layers' dropout also draws, in the same order. Without
    dropout the values are those of the repeated batch (the previous path), exactly."""
    frozen = recipe != "full"
    model = _hf_model(frozen_trunk=frozen, mc_dropout=frozen).eval()
    ids, pad = _hf_batch()
    rows, projected = [], []
    for layer in model.encoder.encoder.layer:
        layer.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))  # layers that ran
    model.adapters[1].attention.in_proj.register_forward_pre_hook(lambda mod, args: projected.append(args[0].shape[0]))
    with torch.no_grad():
        torch.manual_seed(5)
        out = model(ids, pad, num_samples=P)
        assert rows == [3, 3, 3 * P] and projected == [3]  # trunk once; the GP layer projects the B inputs
        expected = _hf_by_hand(model, ids, pad, seed=5)
        old = _hf_by_hand_repeated(model, ids, pad, seed=5) if not frozen else expected
    assert out.shape == (3, P, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out, old, rtol=0, atol=0)
    assert (out[:, 1:] - out[:, :1]).abs().max() > 1e-6  # P different draws


def test_hf_classifier_sample_axis_starts_where_the_forward_first_samples():
    """Nothing random (eval, gpattn.deterministic()): one forward of the B rows, P equal draws. MC dropout with
    the whole encoder trainable: the embeddings' dropout samples, so the batch is repeated at the input and every
    layer runs on B·P rows (P dropout masks below the swapped layer, as before the sample axis). P is checked
    once, by the one check of the layers and models."""
    ids, pad = _hf_batch()
    for kwargs, det, expected in [({}, True, [3, 3, 3]), ({"mc_dropout": True}, False, [3 * P] * 3)]:
        model = _hf_model(**kwargs).eval()
        rows = []
        for layer in model.encoder.encoder.layer:
            layer.register_forward_hook(lambda mod, args, out, rows=rows: rows.append(args[0].shape[0]))
        with torch.no_grad(), gpattn.deterministic(det):
            out = model(ids, pad, num_samples=P)
        assert rows == expected, kwargs
        assert ((out[:, 1:] - out[:, :1]).abs().max() > 1e-6) != det
    with pytest.raises(ValueError, match="num_samples must be a positive int, got 0"):
        model(ids, pad, num_samples=0)
