"""ExponentialKernel against its formula; the kernel factory."""

import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

from gpattn.kernels import ExponentialKernel, evaluate_kernel, make_kernel


def test_exponential_kernel_matches_formula_per_head():
    torch.manual_seed(0)
    H, d = 3, 4
    k = ExponentialKernel(ard_num_dims=d, batch_shape=torch.Size([H])).double()
    k.lengthscale = torch.rand(H, 1, d, dtype=torch.float64) + 0.5
    k.outputscale = torch.rand(H, dtype=torch.float64) + 0.5
    a = torch.randn(2, H, 5, d, dtype=torch.float64)
    b = torch.randn(2, H, 6, d, dtype=torch.float64)
    K = evaluate_kernel(k, a, b)
    ell, s2 = k.lengthscale.detach(), k.outputscale.detach()
    for h in range(H):
        for i in range(5):
            for j in range(6):
                ref = s2[h] * torch.exp((a[1, h, i] * b[1, h, j] / ell[h, 0] ** 2).sum())
                torch.testing.assert_close(K[1, h, i, j], ref)
    torch.testing.assert_close(
        evaluate_kernel(k, a, a, diag=True), torch.diagonal(evaluate_kernel(k, a, a), dim1=-2, dim2=-1)
    )


def test_exponential_kernel_is_psd_and_scaled_like_softmax():
    torch.manual_seed(1)
    k = ExponentialKernel(ard_num_dims=16, batch_shape=torch.Size([2])).double()
    torch.testing.assert_close(k.lengthscale, torch.full((2, 1, 16), 16**0.25, dtype=torch.float64))
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    K = evaluate_kernel(k, x, x)
    torch.testing.assert_close(K, K.mT)
    assert torch.linalg.eigvalsh(K).min() > -1e-8 * K.abs().max()
    # the outputscale 1 is initialised through a float32 softplus: 1e-6 relative
    torch.testing.assert_close(K, torch.exp(x @ x.mT / 16**0.5), rtol=1e-6, atol=0)


def test_exponential_kernel_gradients():
    k = ExponentialKernel(ard_num_dims=3, batch_shape=torch.Size([2])).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: evaluate_kernel(k, x, x), (x,))
    evaluate_kernel(k, x, x).sum().backward()
    assert k.raw_lengthscale.grad is not None and k.raw_outputscale.grad is not None


def test_factory():
    assert isinstance(make_kernel("exponential", 2, 4), ExponentialKernel)
    rbf = make_kernel("rbf", 2, 4)
    assert isinstance(rbf, ScaleKernel) and isinstance(rbf.base_kernel, RBFKernel)
    assert rbf.base_kernel.lengthscale.shape == (2, 1, 4)
    mine = MaternKernel()
    assert make_kernel(mine, 2, 4) is mine
    with pytest.raises(ValueError, match="kernel must be one of"):
        make_kernel("laplace", 2, 4)


@pytest.mark.parametrize(
    "kernel",
    [
        ExponentialKernel(ard_num_dims=3, batch_shape=torch.Size([2])),
        ScaleKernel(RBFKernel(ard_num_dims=3, batch_shape=torch.Size([2])), batch_shape=torch.Size([2])),
        MaternKernel(nu=1.5),
        RBFKernel(active_dims=torch.tensor([0, 2])),
    ],
    ids=["exponential", "scale-rbf", "matern", "rbf-active-dims"],
)
def test_evaluate_kernel_equals_gpytorch_call(kernel):
    x1 = torch.randn(4, 2, 5, 3)
    x2 = torch.randn(4, 2, 6, 3)
    torch.testing.assert_close(evaluate_kernel(kernel, x1, x2), kernel(x1, x2).to_dense())
    torch.testing.assert_close(evaluate_kernel(kernel, x1, x1, diag=True), kernel(x1, x1, diag=True))


def test_exponential_kernel_without_batch_shape():
    k = ExponentialKernel(ard_num_dims=2)
    x = torch.randn(5, 2)
    torch.testing.assert_close(evaluate_kernel(k, x, x), torch.exp(x @ x.T / 2**0.5))
