"""The asymmetric cross-covariance kernel κ_ab(x, x') = σ_a σ_b κ_o(x W_a, x' W_b) (Bui et al. eqs. 7, 13–16)."""

import unittest

import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel
from gpytorch.test.base_kernel_test_case import BaseKernelTestCase
from linear_operator.operators import LinearOperator

from gpattn.kernels import evaluate_kernel
from gpattn.kernels.cross_covariance import CanonicalRBFKernel, CrossCovarianceKernel

F64 = torch.float64


def kappa(a, b):
    return torch.exp(-0.5 * ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1))


def make_kernel(**kw):
    kern = CrossCovarianceKernel(batch_shape=torch.Size([3]), **kw).double()
    kern.sigma_q = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    kern.sigma_k = torch.tensor([1.5, 0.3, 0.9], dtype=F64)
    return kern


def projected(seed=0, n=5, d=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 1, n, d, generator=g, dtype=F64)  # (B, 1, T, D): one sequence per batch row
    W_q, W_k = (torch.randn(3, d, d, generator=g, dtype=F64) / d**0.5 for _ in range(2))
    return x @ W_q, x @ W_k  # shape: (B, H=3, T, d)


def test_values_match_the_definition():
    kern = make_kernel()
    q, k = projected()
    sq, sk = kern.sigma_q[:, None, None], kern.sigma_k[:, None, None]
    for block in (lambda *a, **kw: kern(*a, **kw).to_dense(), lambda *a, **kw: evaluate_kernel(kern, *a, **kw)):
        torch.testing.assert_close(block(q, k), sq * sk * kappa(q, k), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(block(q, k, roles=("q", "o")), sq * kappa(q, k), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(block(q, k, roles=("o", "k")), sk * kappa(q, k), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(block(q, k, roles=("o", "o")), kappa(q, k), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kern.gram(k, "k"), sk**2 * kappa(k, k), rtol=1e-12, atol=1e-14)
    diag = kern(q, k, diag=True)
    torch.testing.assert_close(diag, evaluate_kernel(kern, q, k).diagonal(dim1=-2, dim2=-1), rtol=1e-12, atol=1e-14)


def test_dense_and_truly_transposed_also_lazy():
    """The dense block K_qk (what the GP layers use) is a plain tensor; its .mT is K_kq (a real
    transpose), and K_qk is asymmetric when W_q ≠ W_k (eq. 7), symmetric when W_q = W_k. gpytorch's lazy
    kernel tensor with the roles gives the same block, and its .mT (which re-evaluates the kernel on the
    swapped inputs) is the same true transpose."""
    kern = make_kernel()
    q, k = projected(1)
    K_qk = evaluate_kernel(kern, q, k, roles=("q", "k"))
    assert type(K_qk) is torch.Tensor
    K_kq = evaluate_kernel(kern, k, q, roles=("k", "q"))
    torch.testing.assert_close(K_qk.mT, K_kq, rtol=1e-14, atol=1e-15)
    assert (K_qk - K_qk.mT).abs().amax((-2, -1)).min() > 1e-3
    lazy = kern(q, k, roles=("q", "k"))
    assert isinstance(lazy, LinearOperator)
    torch.testing.assert_close(lazy.to_dense(), K_qk, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(lazy.mT.to_dense(), K_kq, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(kern(k, q, roles=("k", "q")).mT.to_dense(), K_qk, rtol=1e-14, atol=1e-15)
    K_qq = kern.gram(q, "q")
    torch.testing.assert_close(K_qq, K_qq.mT, rtol=0, atol=1e-15)
    assert torch.linalg.eigvalsh(K_qq).min() > -1e-12


def test_canonical_rbf_is_bounded_and_one_on_coincident_points():
    a = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(4)) * 10
    K = CanonicalRBFKernel()(a, a).to_dense()
    assert K.max() <= 1.0
    torch.testing.assert_close(K.diagonal(), torch.ones(6, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(K, kappa(a, a), rtol=1e-10, atol=1e-300)
    b = (a + 1e3).requires_grad_(True)  # far away: κ underflows to 0 without NaN gradients
    CanonicalRBFKernel().forward(a, b).sum().backward()
    assert torch.isfinite(b.grad).all()
    assert CanonicalRBFKernel().is_stationary
    assert len(list(CanonicalRBFKernel().parameters())) == 0


@pytest.mark.parametrize("canonical", [RBFKernel, lambda: MaternKernel(nu=1.5)])
def test_any_gpytorch_kernel_as_canonical(canonical):
    base = canonical().double()
    kern = CrossCovarianceKernel(base, batch_shape=torch.Size([3])).double()
    kern.sigma_q = 2.0
    q, k = projected(2)
    torch.testing.assert_close(kern(q, k, roles=("q", "o")).to_dense(), 2.0 * base(q, k).to_dense())
    # the canonical block is the gpytorch kernel's own dense evaluation, in the right orientation
    torch.testing.assert_close(kern.canonical_block(q, k).mT, base(k, q).to_dense())


def test_scales_are_positive_learnable_parameters():
    kern = make_kernel()
    q, k = projected(3)
    evaluate_kernel(kern, q, k).sum().backward()
    for name in ("raw_sigma_q", "raw_sigma_k"):
        grad = getattr(kern, name).grad
        assert grad is not None and torch.isfinite(grad).all() and (grad != 0).all()
    kern.raw_sigma_q.data.fill_(-30.0)
    assert (kern.sigma_q > 0).all()


def test_errors_name_the_argument():
    kern = make_kernel()
    q, k = projected()
    with pytest.raises(ValueError, match="roles"):
        evaluate_kernel(kern, q, k, roles=("q", "v"))
    with pytest.raises(ValueError, match="roles"):  # the lazy tensor raises when it is evaluated
        kern(q, k, roles=("q", "v")).to_dense()
    with pytest.raises(ValueError, match="last dimension"):
        evaluate_kernel(kern, q, k[..., :2])
    with pytest.raises(RuntimeError, match="dimensions"):  # gpytorch's own check on the lazy path
        kern(q, k[..., :2])
    with pytest.raises(ValueError, match="diag"):
        kern(q, k[..., :3, :], diag=True)
    with pytest.raises(ValueError, match="sigma_q"):
        CrossCovarianceKernel(sigma_q=0.0)
    with pytest.raises(ValueError, match="canonical"):
        CrossCovarianceKernel(canonical="rbf")


def test_default_batch_shape_and_per_head_scales():
    """CrossCovarianceKernel() with its default batch_shape (was a TypeError), and a per-head one, as
    gpytorch's kernels: (σ_q, σ_k) of shape batch_shape, outputs broadcast over the inputs' batch."""
    q, k = projected(5)
    plain = CrossCovarianceKernel().double()
    plain.sigma_q, plain.sigma_k = 0.5, 2.0
    assert plain.batch_shape == torch.Size([]) and plain.sigma_q.shape == torch.Size([])
    torch.testing.assert_close(evaluate_kernel(plain, q, k), kappa(q, k), rtol=1e-12, atol=1e-14)
    per_head = make_kernel()
    assert per_head.sigma_q.shape == torch.Size([3])
    assert per_head[1].batch_shape == torch.Size([]) and per_head[1].sigma_q == per_head.sigma_q[1]


def test_canonical_rbf_honours_batch_shape():
    """One point set, three heads: (3, n, n) as for any gpytorch kernel (was (n, n)); no parameters and
    no state_dict entries, whatever the batch shape."""
    a = torch.randn(4, 2, dtype=F64)
    kern = CanonicalRBFKernel(batch_shape=torch.Size([3])).double()
    K = kern(a).to_dense()
    assert K.shape == (3, 4, 4)
    torch.testing.assert_close(K, kappa(a, a).expand(3, 4, 4))
    assert kern(a, diag=True).shape == (3, 4)
    assert kern.dtype == F64 and len(list(kern.parameters())) == 0 and kern.state_dict() == {}


class TestCanonicalRBFKernelIsAGPyTorchKernel(BaseKernelTestCase, unittest.TestCase):
    """gpytorch's own kernel test case (batch shapes, active_dims, indexing, pickling, dtype)."""

    seed = 0

    def create_kernel_no_ard(self, **kwargs):
        return CanonicalRBFKernel(**kwargs)


class TestCrossCovarianceKernelIsAGPyTorchKernel(BaseKernelTestCase, unittest.TestCase):
    seed = 0

    def create_kernel_no_ard(self, **kwargs):
        return CrossCovarianceKernel(sigma_q=0.7, sigma_k=1.3, **kwargs)

    def create_kernel_ard(self, num_dims, **kwargs):
        canonical = RBFKernel(ard_num_dims=num_dims, batch_shape=kwargs.get("batch_shape", torch.Size([])))
        return CrossCovarianceKernel(canonical, sigma_q=0.7, sigma_k=1.3, **kwargs)
