"""Kernel attention through fused attention (gpattn/variational/_fused.py): the same values and gradients as the
kernel evaluated densely, for the kernels with a log-linear form, with key padding; the layers that use it
(kernel, kernel-asym, sgpa-decoupled's attention mean) against their dense path; where it does not run."""

import copy

import pytest
import torch
from gpytorch.kernels import MaternKernel

import gpattn.variational._fused as fused
from gpattn import deterministic
from gpattn.attention import build_attention
from gpattn.kernels import evaluate_kernel, make_kernel
from gpattn.kernels._evaluate import log_linear_form
from gpattn.variational._fused import fused_available, fused_kernel_attention

KERNELS = ("exponential", "ard-rbf", {"name": "scale", "base": "ard-rbf", "outputscale": 0.7})
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _kernel(spec, dtype, H=3, Dh=5):
    torch.manual_seed(0)
    kernel = make_kernel(spec, H, Dh).to(dtype)
    with torch.no_grad():  # away from the initial values, one per head
        for p in kernel.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return kernel


def _inputs(dtype, B=2, H=3, T=9, S=11, Dh=5, Dv=4):
    torch.manual_seed(1)
    q = torch.randn(B, H, T, Dh, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, S, Dh, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, S, Dv, dtype=dtype, requires_grad=True)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, S - 4 :] = True
    return q, k, v, pad


def _dense(kernel, q, k, v, pad, normalise):
    K = evaluate_kernel(kernel, q, k)  # shape: (B, H, T, S)
    if pad is not None:
        K = K.masked_fill(pad[:, None, None, :], 0.0)
    out = K @ v
    return out / K.sum(-1, keepdim=True) if normalise else out


def _close(a, b, tol):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.detach().abs().max()))


@pytest.mark.parametrize("normalise", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("spec", KERNELS, ids=["exponential", "ard-rbf", "scaled-ard-rbf"])
@pytest.mark.parametrize("padded", [False, True])
def test_values_and_gradients_equal_the_dense_kernel(spec, dtype, normalise, padded):
    """Fused against κ(q, k) formed densely: outputs and the gradients of q, k, v and every kernel
    hyper-parameter (T ≠ S, Dv ≠ Dh, padded keys); float64 to 1e-10, float32 to 1e-5."""
    kernel = _kernel(spec, dtype)
    q, k, v, pad = _inputs(dtype)
    pad = pad if padded else None
    got = fused_kernel_attention(kernel, q, k, v, pad, normalise=normalise)
    want = _dense(kernel, q, k, v, pad, normalise)
    _close(got, want, TOL[dtype])
    g = torch.randn_like(want)
    # σ² cancels in normalised attention (its gradient is 0 fused, round-off dense)
    params = [p for n, p in kernel.named_parameters() if not (normalise and "outputscale" in n)]
    inputs = [q, k, v, *params]
    grads = [torch.autograd.grad((t * g).sum(), inputs, allow_unused=True, materialize_grads=True) for t in (got, want)]
    for a, b in zip(*grads):
        _close(a, b, TOL[dtype])


def test_gradcheck():
    """torch.autograd.gradcheck of unnormalised fused kernel attention (float64, padded keys, ARD-RBF)."""
    kernel = _kernel("ard-rbf", torch.float64, H=2, Dh=3)
    q, k, v, pad = _inputs(torch.float64, H=2, T=4, S=5, Dh=3, Dv=2)
    assert torch.autograd.gradcheck(lambda q, k, v: fused_kernel_attention(kernel, q, k, v, pad), (q, k, v))


def test_every_key_padded_gives_zero():
    """A query whose keys are all padding gets 0, as the dense sum over no key (no NaN in the gradient)."""
    kernel = _kernel("exponential", torch.float64)
    q, k, v, _ = _inputs(torch.float64)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0] = True
    out = fused_kernel_attention(kernel, q, k, v, pad)
    assert float(out[0].detach().abs().max()) == 0.0
    _close(out[1], _dense(kernel, q, k, v, pad, False)[1], 1e-10)
    out.sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))


def test_large_logits_stay_finite_in_the_rbf_form():
    """The RBF kernel's form keeps exp(a·b) out of the arithmetic: far-out but close inputs (‖a‖² ≈ 400, where
    e^{a·b} overflows float32) give κ ≈ 1 as the dense kernel does."""
    kernel = _kernel("ard-rbf", torch.float32, H=1, Dh=4)
    q = torch.full((1, 1, 3, 4), 40.0)
    k = q + 0.01 * torch.randn(1, 1, 3, 4)
    v = torch.randn(1, 1, 3, 4)
    out = fused_kernel_attention(kernel, q, k, v)
    assert bool(out.isfinite().all())
    _close(out, _dense(kernel, q, k, v, None, False), 1e-5)


def test_where_the_fused_path_runs():
    """It runs for the log-linear kernels on CPU float32/float64/bfloat16 and CUDA float32/half/bfloat16; a
    Matérn kernel, float64 on CUDA and other devices return None (the caller's dense path runs)."""
    q, k, v, _ = _inputs(torch.float64)
    matern = MaternKernel(nu=2.5, ard_num_dims=5, batch_shape=torch.Size([3])).double()
    assert log_linear_form(matern, q, k) is None
    assert fused_kernel_attention(matern, q, k, v) is None
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert fused_available(torch.empty(1, dtype=dtype))
    assert not fused_available(torch.empty(1, dtype=torch.float16))  # no CPU flash kernel for half
    meta = torch.empty(1, device="meta")
    assert not fused_available(meta)


def test_an_older_pytorch_without_the_kernel_takes_the_dense_path(monkeypatch):
    """Where the installed PyTorch has no CPU flash kernel, the layer runs its dense path (same output)."""
    torch.manual_seed(0)
    layer = build_attention("kernel", 16, 2).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    fused_out = layer(x)
    monkeypatch.setitem(fused._FUSED_OPS, "cpu", False)
    assert not fused_available(x)
    _close(layer(x), fused_out, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "name, options",
    [
        ("kernel", {}),
        ("kernel", {"kernel": "ard-rbf"}),
        ("kernel-asym", {}),
        ("sgpa-decoupled", {"covariance": "diag"}),
    ],
)
def test_layers_equal_their_dense_path(name, options, dtype, monkeypatch):
    """A layer's output and input gradient with the fused path against the same layer with it switched off
    (the dense path), key padding included."""
    torch.manual_seed(0)
    layer = build_attention(name, 16, 2, **options).to(dtype)
    x = torch.randn(2, 12, 16, dtype=dtype, requires_grad=True)
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[1, 8:] = True
    results = []
    for on in (True, False):
        monkeypatch.setattr(fused, "fused_available", (lambda t: True) if on else (lambda t: False))
        with deterministic():
            y = layer(x, mask)
        (g,) = torch.autograd.grad(y.square().sum(), x)
        results.append((y.detach(), g))
    for a, b in zip(*results):
        _close(a, b, TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("normalise", [False, True])
@pytest.mark.parametrize("spec", KERNELS[:2], ids=["exponential", "ard-rbf"])
def test_cuda_equals_the_dense_kernel(spec, normalise):
    """On CUDA (the memory-efficient kernel, float32): values and gradients against the dense float64 kernel."""
    kernel = _kernel(spec, torch.float32).cuda()
    q, k, v, pad = (t.detach().cuda().requires_grad_(t.dtype != torch.bool) for t in _inputs(torch.float32, T=70, S=45))
    got = fused_kernel_attention(kernel, q, k, v, pad, normalise=normalise)
    assert got is not None
    reference = copy.deepcopy(kernel).double()  # a copy: got's graph holds the float32 parameters
    want = _dense(reference, q.double(), k.double(), v.double(), pad, normalise)
    _close(got.double(), want, 1e-5)
    g = torch.randn_like(got)
    a = torch.autograd.grad((got * g).sum(), (q, k, v))
    b = torch.autograd.grad((want * g.double()).sum(), (q, k, v))
    for x, y in zip(a, b):
        _close(x.double(), y, 1e-4)


def test_double_backward_is_refused_clearly():
    """The fused backward is differentiable once (as PyTorch's fused attention kernels): a second derivative raises
    PyTorch's "not implemented" instead of returning a wrong or empty one."""
    kernel = _kernel("exponential", torch.float64, H=2, Dh=3)
    q, k, v, _ = _inputs(torch.float64, H=2, T=4, S=5, Dh=3, Dv=3)
    (gq,) = torch.autograd.grad(fused_kernel_attention(kernel, q, k, v).square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for .*_backward is not implemented"):
        torch.autograd.grad(gq.sum(), q)
