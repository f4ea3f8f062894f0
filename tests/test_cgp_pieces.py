"""cgp's forward (docs/derivations.md §7, "Conditioned in pieces"): a batch whose blocks exceed a piece is conditioned
in pieces of sequences (each checkpointed while recording gradients), the random numbers drawn for the whole batch
first. The reference is the unpieced forward every GP variant runs (``GPAttention._attend``, cgp's forward before the
pieces): outputs, loss terms, gradients (σ_q's and σ_k's to rounding) and the random state after the step must be the
same, bit for bit, and no (B, H, T, T) block may be kept for the backward."""

import pytest
import torch

import gpattn
import gpattn.attention.cgp as cgp_layer
from gpattn.attention._gp import GPAttention
from gpattn.attention.cgp import CGPAttention, piece_rows

B, T, S, D, HEADS = 5, 6, 7, 16, 2
#: the parameters whose gradients the pieces sum over the sequences
PER_HEAD = {"strategy.covar.raw_sigma_q", "strategy.covar.raw_sigma_k"}


def _step(layer, x, mask, num_samples, context):
    """One seeded forward and backward: (output, loss terms, gradients of the parameters and the inputs, the next
    random numbers)."""
    torch.manual_seed(3)
    y = layer(x, mask, num_samples, context=context)
    terms = layer.loss_terms()
    loss = y.pow(2).sum() + sum(terms.values())
    loss.backward()
    inputs = [t for t in (x, context) if t is not None]
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grads.update({f"input {i}": t.grad.clone() for i, t in enumerate(inputs)})
    layer.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    return y.detach(), {k: v.detach() for k, v in terms.items()}, grads, torch.randn(4, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "case", ["samples", "one-draw", "deterministic", "eval", "eval-with-grad", "cross-attention", "exact-expectation"]
)
def test_pieces_equal_the_unpieced_forward(monkeypatch, dtype, case):
    options = {"prior_mean": "zero"} if case == "cross-attention" else {}
    torch.manual_seed(0)
    layer = gpattn.build_attention("cgp", D, HEADS, **options).to(dtype).train(not case.startswith("eval"))
    if case == "exact-expectation":
        layer.strategy.prior_samples = None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, D, generator=g, dtype=dtype, requires_grad=True)
    context = torch.randn(B, S, D, generator=g, dtype=dtype, requires_grad=True) if case == "cross-attention" else None
    mask = torch.zeros(B, S if context is not None else T, dtype=torch.bool)
    mask[1, -2:] = True
    mask[4, -1:] = True
    mask[3] = True  # all padding: unpadded for the attention, left out of the loss term's mean
    num_samples = 3 if case in ("samples", "cross-attention", "eval", "eval-with-grad") else None
    # two sequences a piece: three pieces, the last of one sequence
    monkeypatch.setattr(cgp_layer, "PIECE_ELEMENTS", 2 * HEADS * T * mask.shape[1])
    assert piece_rows(B, HEADS, T, mask.shape[1], x.device) == 2

    def step():
        if case == "eval":  # no gradients: pieces, nothing recomputed
            with torch.no_grad():
                torch.manual_seed(3)
                return layer(x, mask, num_samples), {}, {}, torch.randn(4, dtype=dtype)
        if case == "deterministic":
            with gpattn.deterministic():
                return _step(layer, x, mask, num_samples, context)
        return _step(layer, x, mask, num_samples, context)

    pieces = step()
    monkeypatch.setattr(CGPAttention, "_attend", GPAttention._attend)  # the unpieced forward
    whole = step()
    assert torch.equal(pieces[0], whole[0])
    assert pieces[1].keys() == whole[1].keys() == ({"cgp"} if layer.training else set())
    for name in whole[1]:
        assert torch.equal(pieces[1][name], whole[1][name]), name
    assert pieces[2].keys() == whole[2].keys()
    for name in whole[2]:
        # σ_q's and σ_k's gradients are sums over the sequences, here added piece by piece: the same sum in another
        # order (measured: 2e-16 relative in float64, 2e-7 in float32). Every other one passes through the projections
        # of the whole batch, where the pieces' gradients are put side by side: the same numbers
        tol = (1e-12 if dtype == torch.float64 else 1e-5) if name in PER_HEAD else 0.0
        torch.testing.assert_close(pieces[2][name], whole[2][name], rtol=tol, atol=tol, msg=name)
    assert torch.equal(pieces[3], whole[3])  # the random state after the step: the same stream on from here


def test_no_block_of_the_batch_is_kept_for_the_backward(monkeypatch):
    """The tensors autograd saves outside the checkpointed pieces: none is a (B, H, T, T) block (the unpieced
    forward saves some thirty per layer), so the blocks live only while a piece runs."""
    monkeypatch.setattr(cgp_layer, "PIECE_ELEMENTS", 2 * HEADS * T * T)
    torch.manual_seed(0)
    layer = gpattn.build_attention("cgp", D, HEADS).train()
    x = torch.randn(B, T, D, requires_grad=True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, None, 2)
        loss = y.sum() + sum(layer.loss_terms().values())
    assert shapes, "the hook saw nothing: the test would pass whatever cgp keeps"
    assert [s for s in shapes if s[-2:] == (T, T)] == []
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_batch_of_one_piece_runs_unpieced(monkeypatch):
    """Blocks within one piece (short sequences, bound by the per-operator cost): the unpieced forward, nothing
    recomputed."""
    ran = []
    monkeypatch.setattr(CGPAttention, "_piece", lambda self, *a: ran.append(a))
    layer = gpattn.build_attention("cgp", D, HEADS).train()
    layer(torch.randn(B, T, D), None, 2).sum().backward()
    assert ran == []


def test_piece_rows():
    cpu = torch.device("cpu")
    assert piece_rows(32, 4, 128, 128, cpu) == 8  # the text defaults: four pieces of 2 MiB blocks
    assert piece_rows(32, 4, 16, 16, cpu) == 32  # short sequences: the batch at once
    assert piece_rows(2, 4, 1024, 1024, cpu) == 1  # at least one sequence
    assert piece_rows(32, 4, 128, 128, torch.device("meta")) == 32  # off the CPU: larger pieces
