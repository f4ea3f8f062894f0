"""The explicit Monte-Carlo axis: the first sampling layer factorises once per input
and draws its P samples from that factorisation; the draws are the ones a batch repeated P times
(B-major) would give with the same seed."""

import pytest
import torch

import gpattn
from gpattn.attention.registry import attention_class

VARIANTS = gpattn.list_attention()
GP_VARIANTS = [n for n in VARIANTS if attention_class(n).is_gp]
B, T, D, H, P = 3, 7, 16, 2, 4

#: options that make every loss term deterministic (CGP: the exact expectation instead of prior samples)
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
    return gpattn.build_attention(name, D, H, **EXACT_TERMS.get(name, {})).double().eval()


@pytest.mark.parametrize("name", VARIANTS)
def test_p_draws_equal_the_repeated_batch(name):
    """``layer(x, mask, num_samples=P)`` is, draw for draw, ``layer`` on the batch repeated P times
    (row b·P + p = draw p of sequence b), with the same loss terms."""
    layer = _layer(name)
    x, mask = _inputs()
    torch.manual_seed(1)
    drawn = layer(x, mask, num_samples=P)
    terms = {k: v.detach() for k, v in layer.loss_terms().items()}
    torch.manual_seed(1)
    repeated = layer(x.repeat_interleave(P, 0), mask.repeat_interleave(P, 0))
    assert drawn.shape == (B * P, T, D)
    torch.testing.assert_close(drawn, repeated, rtol=1e-10, atol=1e-12)
    for key, value in layer.loss_terms().items():
        torch.testing.assert_close(terms[key], value.detach(), rtol=1e-10, atol=1e-12, msg=key)
    assert drawn.view(B, P, T, D)[2].abs().max() == 0  # all-padding sequence
    if layer.sampling:
        spread = (drawn.view(B, P, T, D)[:2, 1:] - drawn.view(B, P, T, D)[:2, :1]).abs().max()
        assert spread > 1e-6, "the P draws are copies of one sample"


@pytest.mark.parametrize("name", GP_VARIANTS)
def test_first_gp_layer_factorises_once(name, monkeypatch):
    """With ``num_samples=P`` a GP layer projects its B inputs once and every Cholesky factor it
    computes has batch B, not B·P."""
    layer = _layer(name)
    x, mask = _inputs()
    rows, factor_batches = [], []
    layer.in_proj.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    cholesky_ex = torch.linalg.cholesky_ex

    def recording(A, *args, **kwargs):
        factor_batches.append(A.shape[0] if A.dim() > 2 else 1)
        return cholesky_ex(A, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", recording)
    layer(x, mask, num_samples=P)
    assert rows == [B]
    assert all(b in (1, H, B) for b in factor_batches), factor_batches


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


def test_a_model_samples_at_its_first_gp_layer_only():
    """In a model whose middle layer is the first GP layer, the blocks below it see B rows, the GP
    block B rows (it draws the P samples), and the block above it B·P rows."""
    from gpattn.models import TransformerClassifier

    torch.manual_seed(0)
    model = TransformerClassifier(
        2, vocab_size=20, embed_dim=16, num_heads=2, num_layers=3, attention="sgpa", attention_layers=[1], dropout=0.0
    ).eval()
    seen = []
    for i, block in enumerate(model.encoder.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: seen.append((i, args[0].shape[0])))
    ids = torch.randint(1, 20, (5, 6))
    out = model(ids, num_samples=8)
    assert seen == [(0, 5), (1, 5), (2, 40)] and out.shape == (5, 8, 2)
    with pytest.raises(ValueError, match="num_samples"):
        model.encoder.blocks[1].attn(torch.zeros(1, 2, 16), num_samples=0)
