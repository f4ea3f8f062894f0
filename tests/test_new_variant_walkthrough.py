"""A toy GP variant added through gpattn.testing only — the code docs/new_variant.md walks through.

"Noisy kernel attention": per head and value column, GP regression of the values on the keys with
an RBF kernel and observation noise σ², read at the queries (self-attention, q = k):
mean K (K + σ²I)⁻¹ v, covariance K − K (K + σ²I)⁻¹ K. It imports only public names and is never
registered: the test mixins take its class, so it never shows in ``gpattn.list_attention()``.
"""

import gpytorch
import pytest
import torch
from gpytorch.constraints import Positive
from gpytorch.distributions import MultivariateNormal
from linear_operator import to_linear_operator

import gpattn
from gpattn.attention import GPAttention
from gpattn.testing import DenseReference, GPAttentionTestCase, registered_attention
from gpattn.variational import (
    AmortisedConditional,
    AmortisedVariationalStrategy,
    cholesky,
    full_precision,
    gp_algebra,
    matmul_samples,
    standard_normal,
)

NAME = "test-noisy-kernel"


# ------------------------------------------------------------------ 1. the conditional
class NoisyKernelConditional(AmortisedConditional):
    """q(f) of one batch of sequences, factorised once.  # shape: mean (B, H, T, Dv), covariance (B, H, T, T)"""

    def __init__(self, mean, covariance):
        self.mean, self.covariance = mean, covariance
        self.chol = cholesky(covariance, name="noisy kernel: posterior covariance")

    def posterior(self) -> MultivariateNormal:
        """# shape: batch (B, H, Dv), event T"""
        B, H, T, Dv = self.mean.shape
        covariance = to_linear_operator(self.covariance[:, :, None].expand(B, H, Dv, T, T))  # nothing factorised
        return MultivariateNormal(self.mean.mT, covariance)

    def rsample(self, num_samples=None, generator=None):
        """# shape: -> (B, H, T, Dv), or (P, B, H, T, Dv) with num_samples=P"""
        eps = standard_normal(self.mean.shape, self.mean, num_samples, generator)  # batch-major draws
        return self.mean + matmul_samples(self.chol, eps)  # one factor for every draw


# ------------------------------------------------------------------ 2. the strategy
class NoisyKernelStrategy(AmortisedVariationalStrategy):
    """An ARD-RBF kernel per head (lengthscale √Dh at the start) and a learned noise σ² per head."""

    def __init__(self, num_heads, head_dim, noise=0.1):
        super().__init__()
        batch = torch.Size([num_heads])
        rbf = gpytorch.kernels.RBFKernel(ard_num_dims=head_dim, batch_shape=batch)
        rbf.lengthscale = head_dim**0.5
        self.kernel = gpytorch.kernels.ScaleKernel(rbf, batch_shape=batch)
        self.register_parameter("raw_noise", torch.nn.Parameter(torch.zeros(num_heads, 1, 1)))
        self.register_constraint("raw_noise", Positive())
        self.noise = noise

    @property
    def noise(self):
        return self.raw_noise_constraint.transform(self.raw_noise)

    @noise.setter
    def noise(self, value):
        self.initialize(raw_noise=self.raw_noise_constraint.inverse_transform(torch.as_tensor(value)))

    def condition(self, keys, values, mask=None) -> NoisyKernelConditional:
        """# shape: keys (B, H, T, Dh), values (B, H, T, Dv), mask (B, T) bool or None"""
        with gp_algebra(keys.device.type):
            keys, values = full_precision(keys, values)
            K = self.kernel(keys, keys).to_dense()  # shape: (B, H, T, T)
            eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
            if mask is not None:  # padded tokens: isolated, unit prior variance, no value
                real = (~mask)[:, None, :, None].to(K.dtype)  # shape: (B, 1, T, 1)
                K, values = K * real * real.mT + eye * (1 - real), values * real
            L = cholesky(K + self.noise.to(K.dtype) * eye, name="noisy kernel: K + σ²I")
            W = torch.linalg.solve_triangular(L, K, upper=False)  # L⁻¹ K
            mean = W.mT @ torch.linalg.solve_triangular(L, values, upper=False)  # K (K + σ²I)⁻¹ v
            return NoisyKernelConditional(mean, K - W.mT @ W)


# ------------------------------------------------------------------ 3. the shim
class NoisyKernelAttention(GPAttention):
    projections = ("qk", "v")

    def __init__(self, embed_dim, num_heads, *, noise=0.1, **base):
        super().__init__(embed_dim, num_heads, **base)
        self.strategy = NoisyKernelStrategy(num_heads, self.head_dim, noise)


# ------------------------------------------------------------------ 4. the dense reference
def noisy_kernel_dense_posterior(layer, x, mask=None) -> DenseReference:
    """σ_f² exp(−½ Σ_i (a_i − b_i)² / ℓ_i²) from pairwise differences; mean K (K + σ²I)⁻¹ v and
    covariance K − K (K + σ²I)⁻¹ K by dense solves. No padding."""
    assert mask is None, "the dense reference compares unpadded sequences"
    p = {name: t.detach() for name, t in layer.project(x).items()}
    kernel = layer.strategy.kernel
    ell = kernel.base_kernel.lengthscale.detach()[:, None]  # shape: (H, 1, 1, Dh)
    diff = (p["qk"][..., :, None, :] - p["qk"][..., None, :, :]) / ell
    K = kernel.outputscale.detach()[:, None, None] * torch.exp(-0.5 * diff.square().sum(-1))
    A = K + layer.strategy.noise.detach() * torch.eye(x.shape[1], dtype=x.dtype)
    mean, cov = K @ torch.linalg.solve(A, p["v"]), K - K @ torch.linalg.solve(A, K)
    B, H, T, Dv = mean.shape
    return DenseReference(mean.mT, cov[:, :, None].expand(B, H, Dv, T, T), {})


# ------------------------------------------------------------------ 5. the test class
class TestNoisyKernelAttention(GPAttentionTestCase):
    """Every invariant and every GP shape of gpattn.testing, at the default settings: the mixins take the
    layer class itself, so an unregistered variant needs no registry fixture."""

    attention = NoisyKernelAttention
    mean_tolerance = covariance_tolerance = {"rtol": 1e-10, "atol": 1e-10}

    def dense_reference(self, layer, x, mask):
        return noisy_kernel_dense_posterior(layer, x, mask)


def test_the_test_only_name_does_not_leak():
    """A variant can also be registered for a scope only (``registered_attention``), for code that builds
    layers by name; outside the scope it is not registered, and the scope removes it again."""
    assert NAME not in gpattn.list_attention()
    with registered_attention(NAME, NoisyKernelAttention):
        assert NAME in gpattn.list_attention()
        with pytest.raises(ValueError, match="already registered"):
            with registered_attention(NAME, NoisyKernelAttention):
                pass
        assert NAME in gpattn.list_attention()
    assert NAME not in gpattn.list_attention()


def test_the_walkthrough_uses_public_names_only():
    """docs/new_variant.md's toy variant is written against the public extension API: no private module
    or name of gpattn is imported here."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text())
    private = [
        f"{node.module}: {[a.name for a in node.names]}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpattn")
        and (any(part.startswith("_") for part in node.module.split(".")) or any(a.name.startswith("_")
                                                                                  for a in node.names))
    ]
    assert not private, private
