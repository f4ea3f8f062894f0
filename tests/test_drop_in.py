"""Drop-in layers: every registered variant replaces ``self_attn`` of torch's transformer
layers through nn.MultiheadAttention's call signature, with ``attn_mask``, ``batch_first`` and
``need_weights`` (docs/derivations.md §11)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gpattn
from gpattn.attention import attention_class
from gpattn.testing import make_inputs

NAMES = gpattn.list_attention()
PER_QUERY = [n for n in NAMES if attention_class(n).per_query_masks]
PADDING_ONLY = [n for n in NAMES if not attention_class(n).per_query_masks]
WITH_WEIGHTS = {"softmax", "kernel", "kernel-asym", "sto", "h-sto"}
D, H, T = 8, 2, 6


def _layer(name, dtype=torch.float32, **options):
    torch.manual_seed(0)
    return gpattn.build_attention(name, D, H, **options).to(dtype)


def _causal(T=T):
    return torch.ones(T, T, dtype=torch.bool).triu(1)


def test_variant_lists_cover_the_registry():
    assert set(PER_QUERY) == {"softmax", "kernel", "kernel-asym", "sto", "h-sto", "sgpa", "sgpa-decoupled", "sgpa-rff"}
    assert set(PER_QUERY) | set(PADDING_ONLY) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_encoder_layer_train_and_eval(name):
    """The layer as ``self_attn`` of nn.TransformerEncoderLayer: train mode runs and backpropagates; eval
    mode (where torch would take its fused fast path for nn.MultiheadAttention) gives the train-mode output
    under gpattn.deterministic() (dropout 0), so the fast path was not taken."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(D, H, 16, dropout=0.0, batch_first=True)
    enc.self_attn = _layer(name)
    x, mask = make_inputs(B=2, T=T, D=D)
    enc.train()
    y = enc(x, src_key_padding_mask=mask)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.sum().backward()
    assert enc.self_attn.out_proj.weight.grad is not None
    with gpattn.deterministic(), torch.no_grad():
        train_out = enc(x, src_key_padding_mask=mask)
        enc.eval()
        eval_out = enc(x, src_key_padding_mask=mask)
        whole = nn.TransformerEncoder(enc, 2, enable_nested_tensor=False).eval()(x, src_key_padding_mask=mask)
    torch.testing.assert_close(eval_out, train_out)
    assert whole.shape == x.shape


@pytest.mark.parametrize("name", NAMES)
def test_mha_call_matches_gpattn_call(name):
    """``layer(q, k, v, key_padding_mask)`` (batch-first, or (T, B, D) with batch_first=False) is
    ``layer(x, key_padding_mask)``; a float key_padding_mask (0 / -inf, as torch's layers pass it) is the
    bool one."""
    x, mask = make_inputs(B=2, T=T, D=D)
    layer = _layer(name)
    with gpattn.deterministic():
        ref = layer(x, mask)
        y, _ = layer(x, x, x, key_padding_mask=mask, need_weights=False)
        y_float, _ = layer(x, x, x, torch.zeros(mask.shape).masked_fill(mask, float("-inf")), False)
        layer.batch_first = False
        xt = x.transpose(0, 1)
        y_seq, _ = layer(xt, xt, xt, key_padding_mask=mask)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(y_float, ref)
    torch.testing.assert_close(y_seq.transpose(0, 1), ref)


@pytest.mark.parametrize("name", PER_QUERY)
def test_causal_mask_is_the_prefix(name):
    """Causal mask, dense float64 reference: token t's output equals the unmasked layer run on the prefix
    1..t (its last token), for the variants with per-query masks (``is_causal=True`` without a mask too)."""
    x, _ = make_inputs(B=2, T=T, D=D, dtype=torch.float64)
    layer = _layer(name, torch.float64)
    with gpattn.deterministic():
        y = layer(x, attn_mask=_causal())
        y_hint, _ = layer(x, x, x, is_causal=True, need_weights=False)
        prefix = torch.stack([layer(x[:, : t + 1])[:, t] for t in range(T)], 1)
    torch.testing.assert_close(y, prefix, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y_hint, prefix, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", PADDING_ONLY)
def test_causal_mask_is_refused_by_the_gp_variants(name):
    x, _ = make_inputs(B=2, T=T, D=D)
    with pytest.raises(ValueError, match=r"attn_mask: .*takes only masks that pad.*different GP for every query.*sgpa"):
        _layer(name)(x, attn_mask=_causal())
    dec = nn.TransformerDecoderLayer(D, H, 16, dropout=0.0, batch_first=True)
    dec.self_attn = _layer(name)
    with pytest.raises(ValueError, match="takes only masks that pad"):
        dec(x, x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True)


@pytest.mark.parametrize("name", PER_QUERY)
def test_decoder_layer_with_a_causal_mask(name):
    """nn.TransformerDecoderLayer's self-attention (sequence-first here): the first token's output does not
    depend on the later tokens."""
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(D, H, 16, dropout=0.0)
    dec.self_attn = _layer(name, batch_first=False)
    tgt, memory = torch.randn(T, 2, D), torch.randn(3, 2, D)
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    with gpattn.deterministic():
        y = dec(tgt, memory, tgt_mask=causal, tgt_is_causal=True)
        changed = tgt.clone()
        changed[1:] += 1.0
        y2 = dec(changed, memory, tgt_mask=causal, tgt_is_causal=True)
    torch.testing.assert_close(y[0], y2[0])
    assert not torch.allclose(y[1:], y2[1:])


@pytest.mark.parametrize("name", PER_QUERY)
def test_additive_and_boolean_masks_agree(name):
    """A random mask (every query keeps at least one key) with per-head rows (B·H, T, T): bool and
    additive give the same output; with a query that may attend to nothing, its output is 0."""
    x, _ = make_inputs(B=2, T=T, D=D)
    g = torch.Generator().manual_seed(3)
    blocked = torch.rand(2 * H, T, T, generator=g) < 0.4
    blocked[..., 0] = False
    additive = torch.zeros(blocked.shape).masked_fill(blocked, float("-inf"))
    layer = _layer(name)
    with gpattn.deterministic():
        y_bool = layer(x, attn_mask=blocked)
        y_add = layer(x, attn_mask=additive)
        y_hf = layer(x, attn_mask=torch.zeros(blocked.shape).masked_fill(blocked, torch.finfo(torch.float32).min))
        unmasked = layer(x)
        none_for_2 = blocked.clone()
        none_for_2[:, 2] = True
        y_none = layer(x, attn_mask=none_for_2)
    torch.testing.assert_close(y_add, y_bool)
    torch.testing.assert_close(y_hf, y_bool)
    assert not torch.allclose(y_bool, unmasked)
    assert torch.equal(y_none[:, 2], torch.zeros_like(y_none[:, 2])) and torch.isfinite(y_none).all()


@pytest.mark.parametrize("name", NAMES)
def test_padding_attn_mask_is_key_padding(name):
    """An attn_mask that only pads — (B·H, T, T), (B, 1, T, T), bool or additive — gives exactly the
    output (and loss terms) of key_padding_mask, an all-padding sequence included."""
    x, mask = make_inputs(B=3, T=T, D=D, pad=(0, 2, T))
    per_key = mask[:, None, None, :].expand(3, H, T, T)
    layer = _layer(name)
    additive = torch.zeros(per_key.shape).masked_fill(per_key, float("-inf"))
    with gpattn.deterministic():
        torch.manual_seed(1)  # cgp's regulariser draws prior samples
        ref = layer(x, mask)
        ref_terms = layer.loss_terms()
        for attn_mask in (per_key.reshape(3 * H, T, T), per_key[:, :1], additive):
            torch.manual_seed(1)
            torch.testing.assert_close(layer(x, attn_mask=attn_mask), ref, rtol=0, atol=0)
            torch.testing.assert_close(layer.loss_terms(), ref_terms, rtol=0, atol=0)
        y, _ = layer(x, x, x, attn_mask=per_key.reshape(3 * H, T, T), need_weights=False)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_need_weights(name):
    """``need_weights``: (B, T, T) averaged over heads or (B, H, T, T) where the variant has attention
    weights, excluded keys weighted 0 (rows summing to 1 for the normalised ones), None for the GP
    variants; the output is the same with or without weights."""
    x, mask = make_inputs(B=2, T=T, D=D)
    layer = _layer(name)
    causal = _causal() if name in PER_QUERY else None
    with gpattn.deterministic():
        torch.manual_seed(1)
        y0, none = layer(x, x, x, mask, need_weights=False, attn_mask=causal)
        torch.manual_seed(1)
        y, avg = layer(x, x, x, mask, attn_mask=causal)
        _, per_head = layer(x, x, x, mask, True, causal, average_attn_weights=False)
    assert none is None
    torch.testing.assert_close(y, y0)
    if name not in WITH_WEIGHTS:
        assert avg is None and per_head is None
        return
    assert avg.shape == (2, T, T) and per_head.shape == (2, H, T, T)
    torch.testing.assert_close(avg, per_head.mean(1))
    excluded = _causal() | mask[:, None, :]
    assert torch.equal(per_head.masked_select(excluded[:, None]), torch.zeros(int(excluded.sum()) * H))
    if name in {"softmax", "sto", "h-sto"}:
        torch.testing.assert_close(per_head.sum(-1), torch.ones(2, H, T))
    if name == "softmax":
        p = layer.project(x)
        scores = (p["q"] @ p["k"].mT / (D // H) ** 0.5).masked_fill(excluded[:, None], float("-inf"))
        torch.testing.assert_close(per_head, scores.softmax(-1))


def test_call_errors_name_the_argument():
    x, _ = make_inputs(B=2, T=T, D=D)
    layer = _layer("softmax")
    with pytest.raises(ValueError, match="key and value must be the same tensor"):
        layer(x, x.clone(), x)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(T, T\) = \(6, 6\).*got \(3, 6, 6\)"):
        layer(x, attn_mask=torch.zeros(3, T, T, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be a bool tensor .* got dtype torch.int64"):
        layer(x, attn_mask=torch.zeros(T, T, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_first must be True or False, got 1"):
        gpattn.build_attention("softmax", D, H, batch_first=1)
    with gpattn.validation(), pytest.raises(ValueError, match="gpattn's layers take masks, not attention biases"):
        layer(x, attn_mask=torch.full((T, T), 0.5))
