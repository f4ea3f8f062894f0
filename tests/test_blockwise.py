"""Long sequences in query blocks (gpattn/variational/_blockwise.py): the same attention as the dense path,
memory linear in T, Gumbel noise with the dense path's distribution and one seed per block."""

import math

import pytest
import torch

import gpattn.variational._blockwise as bw
import gpattn.variational._fused as fused
from gpattn import deterministic
from gpattn.attention import build_attention
from gpattn.attention._gumbel import gumbel_attention
from gpattn.variational.means import SoftmaxMean

LONG = ("kernel", "kernel-asym", "sto", "h-sto", "sgpa-decoupled")
#: the options under which each is linear in T (sgpa-decoupled: the attention mean with the diagonal covariance)
OPTIONS = {"sgpa-decoupled": {"covariance": "diag"}}


def _inputs(dtype, T=40):
    torch.manual_seed(0)
    x = torch.randn(2, T, 16, dtype=dtype, requires_grad=True)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[1, T - 10 :] = True
    return x, mask


def _run(layer, x, mask, attn_mask, block_elements, monkeypatch, seed=None):
    monkeypatch.setattr(bw, "BLOCK_ELEMENTS", block_elements)
    if seed is not None:
        torch.manual_seed(seed)
    y = layer(x, mask, attn_mask=attn_mask)
    (g,) = torch.autograd.grad(y.square().sum(), x)
    return y.detach(), g


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", LONG)
def test_blocks_equal_the_dense_path(name, dtype, tol, monkeypatch):
    """Values and input gradients of the block path against the dense one (the noise-free path of the
    stochastic variants), with padding and, where the variant takes it, a causal mask. (The fused path of the
    kernel attentions is off here: tests/test_fused_attention.py compares it.)"""
    monkeypatch.setattr(fused, "fused_available", lambda t: False)
    layer = build_attention(name, 16, 2, **OPTIONS.get(name, {})).to(dtype)
    x, mask = _inputs(dtype)
    causal = torch.ones(40, 40, dtype=torch.bool).triu(1)
    for attn_mask in (None, causal) if layer.per_query_masks else (None,):
        with deterministic():
            dense = _run(layer, x, mask, attn_mask, 1 << 21, monkeypatch)
            blocks = _run(layer, x, mask, attn_mask, 64, monkeypatch)  # 64 // (2·2·40) → one query per block
        for a, b in zip(dense, blocks):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * float(a.abs().max()))


@pytest.mark.parametrize("name", ["sto", "h-sto"])
def test_the_backward_recomputes_the_forwards_noise(name, monkeypatch):
    """Each block is recomputed in backward (checkpoint): it must draw the noise its forward drew, so the
    gradient equals that of the same blocks kept in memory."""
    layer = build_attention(name, 16, 2, hard=True) if name == "sto" else build_attention(name, 16, 2)
    x, mask = _inputs(torch.float64)
    layer = layer.double()
    kept = _run(layer, x, mask, None, 64, monkeypatch, seed=3)
    monkeypatch.setattr(bw, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    stored = _run(layer, x, mask, None, 64, monkeypatch, seed=3)
    for a, b in zip(kept, stored):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    again = _run(layer, x, mask, None, 64, monkeypatch, seed=4)
    assert not torch.equal(again[0], kept[0])  # another seed: another sample


def _hard_indices(q, k, draws, monkeypatch):
    """The one-hot index of ``draws`` hard Gumbel samples per query, every query its own block."""
    monkeypatch.setattr(bw, "BLOCK_ELEMENTS", 1)  # one query per block
    monkeypatch.setattr(bw, "DENSE_FACTOR", 1)
    eye = torch.eye(k.shape[-2], dtype=q.dtype)[None, None]
    g = torch.Generator().manual_seed(0)
    out = [gumbel_attention(q, k, eye, 1.0, hard=True, generator=g)[0].argmax(-1) for _ in range(draws)]
    return torch.stack(out)[:, 0, 0]  # shape: (draws, T)


def test_block_samples_have_the_categorical_distribution(monkeypatch):
    """Gumbel-max: each query's hard index is Categorical(softmax(q kᵀ)) — per entry within 5 standard
    errors over 3000 draws."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 6, 3, dtype=torch.float64), torch.randn(1, 1, 6, 3, dtype=torch.float64)
    draws = 3000
    idx = _hard_indices(q, k, draws, monkeypatch)
    p = torch.softmax(q @ k.mT, -1)[0, 0]  # shape: (T, S)
    freq = torch.nn.functional.one_hot(idx, 6).double().mean(0)
    z = (freq - p) / torch.sqrt(p * (1 - p) / draws)
    assert float(z.abs().max()) < 5, z


def test_blocks_draw_independent_noise(monkeypatch):
    """Identical queries in different blocks: their indices agree with probability Σ p² (independent
    noise), not always (a seed shared between blocks)."""
    torch.manual_seed(2)
    q = 0.3 * torch.randn(1, 1, 1, 3, dtype=torch.float64).expand(1, 1, 4, 3).contiguous()
    k = 0.3 * torch.randn(1, 1, 6, 3, dtype=torch.float64)  # near-uniform p: Σ p² ≈ 1/6
    draws = 2000
    idx = _hard_indices(q, k, draws, monkeypatch)
    p = torch.softmax(q[0, 0, 0] @ k[0, 0].mT, -1)
    agree = float(p.square().sum())
    assert agree < 0.3
    for a, b in ((0, 1), (0, 3), (2, 3)):
        rate = float((idx[:, a] == idx[:, b]).double().mean())
        assert abs(rate - agree) < 5 * math.sqrt(agree * (1 - agree) / draws), (a, b, rate, agree)


@pytest.mark.parametrize(
    "name, fused_path, extra",
    [(name, True, {}) for name in LONG]
    + [(name, False, {}) for name in ("kernel", "kernel-asym", "sgpa-decoupled")]
    + [("sgpa-decoupled", path, {"prior_mean": SoftmaxMean()}) for path in (True, False)]
    + [("sgpa-decoupled", True, {"recipe": "encoder-swap", **mean}) for mean in ({}, {"prior_mean": "attention"})],
)
def test_no_tensor_of_T_by_T_entries_per_head(name, fused_path, extra, monkeypatch):
    """Forward and backward of a long sequence form no tensor with T·T entries per head: every op's output
    is counted (a dispatch mode) and the largest stays at the size of one block (query blocks, or the kernel
    attentions' fused path); sgpa-decoupled also with the softmax prior mean (docs/derivations.md §5e) and with
    separate maps (the encoder swap's form: its mean over the keys in fused attention)."""
    if not fused_path:
        monkeypatch.setattr(fused, "fused_available", lambda t: False)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if torch.is_tensor(t):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    monkeypatch.setattr(bw, "BLOCK_ELEMENTS", 1 << 14)
    T, H = 2048, 2
    layer = build_attention(name, 16, H, **OPTIONS.get(name, {}), **extra)
    x = torch.randn(1, T, 16, requires_grad=True)
    with Largest():
        layer(x).square().sum().backward()
    # the largest: a block's piece, the input projection (T × 3D) or sgpa-decoupled's T·M² variance terms; the
    # dense path forms H·T² = 8.4M entries
    assert Largest.numel <= H * T * T // 8, (Largest.numel, H * T * T)


def test_sgpa_decoupled_diag_variance_in_blocks(monkeypatch):
    """sgpa-decoupled's diagonal variance (its T·M² products) in blocks of tokens equals the whole computation,
    values and gradients (float64)."""
    layer = build_attention("sgpa-decoupled", 16, 2, covariance="diag").double()
    x, mask = _inputs(torch.float64)
    out = []
    for block_elements in (1 << 21, 64):
        monkeypatch.setattr(bw, "BLOCK_ELEMENTS", block_elements)
        var = layer.posterior(x, mask).variance
        (g,) = torch.autograd.grad(var.sum(), x)
        out.append((var.detach(), g))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10 * float(a.abs().max()))


def test_dense_limit_on_the_cpu():
    """The CPU forms a matrix of up to DENSE_FACTOR blocks whole (the T = 1024, B = 8, H = 4 benchmark case runs
    in one fused call: in 16 recomputed blocks sto took 5× the softmax layer) and cuts the T = 8192, B = 1, H = 2
    case of issue #30's memory bar into blocks of BLOCK_ELEMENTS; a GPU forms up to 4 of its larger blocks."""
    assert bw.block_rows(8, 4, 1024, 1024) is None
    rows = bw.block_rows(1, 2, 8192, 8192)
    assert rows is not None and 2 * rows * 8192 <= bw.BLOCK_ELEMENTS
    cuda = torch.device("cuda")
    assert bw.block_rows(2, 8, 4096, 4096, device=cuda) is None  # 2^28 entries = 4 · 2^26
    assert bw.block_rows(2, 8, 8192, 8192, device=cuda) is not None
    assert bw.block_rows(2, 8, 65536, 65536, device=cuda) == bw.DEVICE_BLOCK_ELEMENTS // (16 * 65536)
