"""Helpers shared by test_gp_masks.py (``sgpa``) and test_sgpa_decoupled_masks.py (not a test module: no
``test_`` prefix): the masks, the cases and the decoder check, at D = 8, H = 2, T = 6, float64."""

import torch
import torch.nn as nn

import gpattn
from gpattn.testing import make_inputs

F64 = torch.float64
D, H, T = 8, 2, 6


def causal(T=T):
    return torch.ones(T, T, dtype=torch.bool).triu(1)


def general_mask(B=2, seed=3):
    """Per (sequence, head) rows: random keys, a query that may not attend to itself, one with no key."""
    g = torch.Generator().manual_seed(seed)
    blocked = torch.rand(B, H, T, T, generator=g) < 0.45
    blocked[:, :, 1, 1] = True  # i ∉ A_i
    blocked[:, :, 1, 0] = False
    blocked[:, 1, 4] = True  # A_i = ∅ in head 1
    return blocked


def cases():
    """name -> (x (2, T, D), key padding (2, T) or None, attn_mask)."""
    x, pad = make_inputs(B=2, T=T, D=D, pad=(0, 2), dtype=F64)
    return {
        "causal": (x, None, causal()),
        "causal+padding": (x, pad, causal()),
        "causal+left-padding": (x, torch.tensor([[False] * T, [True, True] + [False] * (T - 2)]), causal()),
        "general": (x, None, general_mask()),
        "general+padding": (x, pad, general_mask()),
    }


def joined(attn_mask, pad, B=2):
    """The per-query mask with the key padding joined in.  # shape: -> (B, H, T, T)"""
    excluded = attn_mask.expand(B, H, T, T)
    return excluded if pad is None else excluded | pad[:, None, None, :]


def real_queries(attn_mask, pad):
    """The queries that count: not padding, at least one allowed key.  # shape: -> (B, H, T)"""
    real = ~joined(attn_mask, pad).all(-1)
    return real if pad is None else real & ~pad[:, None, :]


def assert_decoder_does_not_see_the_future(layer, sampling):
    """``layer`` (float64) as ``self_attn`` of nn.TransformerDecoderLayer with the causal tgt mask, eval mode:
    the output at t does not change when tokens after t change — the posterior mean, and with sampling
    (fixed seed) the draws too; with sampling the output differs from the mean."""
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(D, H, 16, dropout=0.0, batch_first=True).double().eval()
    dec.self_attn = layer
    tgt, memory = torch.randn(2, T, D, dtype=F64), torch.randn(2, 3, D, dtype=F64)
    mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=F64)

    def run(t):
        torch.manual_seed(11)
        if sampling:
            return dec(t, memory, tgt_mask=mask, tgt_is_causal=True)
        with gpattn.deterministic():
            return dec(t, memory, tgt_mask=mask, tgt_is_causal=True)

    y = run(tgt)
    for t in range(T - 1):
        changed = tgt.clone()
        changed[:, t + 1 :] += torch.randn(2, T - t - 1, D, dtype=F64)
        y2 = run(changed)
        torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], rtol=1e-10, atol=1e-12)
        assert not torch.allclose(y2[:, t + 1 :], y[:, t + 1 :])
    with gpattn.deterministic():
        mean = dec(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    assert torch.allclose(y, mean) != sampling
