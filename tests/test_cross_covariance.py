"""The asymmetric cross-covariance kernel κ_ab(x, x') = σ_a σ_b κ_o(x W_a, x' W_b) (seed 003 eqs. 7, 13–16)."""

import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel

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
    torch.testing.assert_close(kern(q, k), sq * sk * kappa(q, k), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kern(q, k, roles=("q", "o")), sq * kappa(q, k), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kern(q, k, roles=("o", "k")), sk * kappa(q, k), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kern(q, k, roles=("o", "o")), kappa(q, k), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(kern.gram(k, "k"), sk**2 * kappa(k, k), rtol=1e-12, atol=1e-14)
    diag = kern(q, k, diag=True)
    torch.testing.assert_close(diag, kern(q, k).diagonal(dim1=-2, dim2=-1), rtol=1e-12, atol=1e-14)


def test_dense_and_truly_transposed_never_lazy():
    """K_qk is a plain dense tensor; its .mT is K_kq (a real transpose), and K_qk is asymmetric when
    W_q ≠ W_k (eq. 7), symmetric when W_q = W_k."""
    kern = make_kernel()
    q, k = projected(1)
    K_qk = kern(q, k, roles=("q", "k"))
    assert type(K_qk) is torch.Tensor
    torch.testing.assert_close(K_qk.mT, kern(k, q, roles=("k", "q")), rtol=1e-14, atol=1e-15)
    assert (K_qk - K_qk.mT).abs().amax((-2, -1)).min() > 1e-3
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
    torch.testing.assert_close(kern(q, k, roles=("q", "o")), 2.0 * base(q, k).to_dense())
    # the canonical block is the gpytorch kernel's own dense evaluation, in the right orientation
    torch.testing.assert_close(kern.canonical_block(q, k).mT, base(k, q).to_dense())


def test_scales_are_positive_learnable_parameters():
    kern = make_kernel()
    q, k = projected(3)
    kern(q, k).sum().backward()
    for name in ("raw_sigma_q", "raw_sigma_k"):
        grad = getattr(kern, name).grad
        assert grad is not None and torch.isfinite(grad).all() and (grad != 0).all()
    kern.raw_sigma_q.data.fill_(-30.0)
    assert (kern.sigma_q > 0).all()


def test_errors_name_the_argument():
    kern = make_kernel()
    q, k = projected()
    with pytest.raises(ValueError, match="roles"):
        kern(q, k, roles=("q", "v"))
    with pytest.raises(ValueError, match="last dimension"):
        kern(q, k[..., :2])
    with pytest.raises(ValueError, match="diag"):
        kern(q, k[..., :3, :], diag=True)
    with pytest.raises(ValueError, match="sigma_q"):
        CrossCovarianceKernel(sigma_q=0.0)
    with pytest.raises(ValueError, match="canonical"):
        CrossCovarianceKernel(canonical="rbf")
