"""The softmax prior mean of the SGPA variants (:class:`~gpattn.variational.means.SoftmaxMean`, the encoder-swap
recipe's; docs/derivations.md §5e): softmax
attention with the kernel's lengthscale as its temperature, m(q_i) = Σ_j softmax_j((q_i/ℓ)·(k_j/ℓ)) v_j, whatever
the GP's kernel. Dense float64 references (gpattn.testing.references.prior_mean_dense, written from the formula)
through the shipped GPAttentionTestCase mixin in each mode; per-query masks; the limits (the exponential kernel:
the attention mean; the RBF: only its per-key factor differs); the fused path against the dense one; the
objective (no KL on the mean); the refusal of a kernel without a lengthscale."""

import pytest
import test_prior_mean as prior_mean_tests
import test_sgpa_separate as separate_tests
import torch
import torch.nn.functional as F
from test_prior_mean import _layer, _masks, _x

import gpattn
import gpattn.variational.means as means
from gpattn.testing import layer_loss_terms
from gpattn.testing.base_attention_test_case import ATTENTION_INVARIANTS
from gpattn.testing.references import (
    gram_dense,
    prior_mean_dense,
    sgpa_attention_masked_dense_moments,
    sgpa_decoupled_global_keys,
    sgpa_heads,
)

F64 = torch.float64
#: the softmax mean: an object (the encoder-swap recipe's), stateless, so one instance serves every layer
SOFTMAX = means.SoftmaxMean()


class TestSGPASoftmaxMean(prior_mean_tests.TestSGPAAttentionMean):
    """sgpa, softmax prior mean, ARD-RBF kernel, shared map, full covariance (the contract's invariants too: this
    is not a default form, which tests/test_attention_invariants.py covers)."""

    options = {"prior_mean": SOFTMAX}
    invariants = ATTENTION_INVARIANTS


class TestSGPASoftmaxMeanDiag(TestSGPASoftmaxMean):
    options = {"prior_mean": SOFTMAX, "covariance": "diag"}
    independent_tokens = True
    exact_options = long_padding = None  # the full mode's


class TestDecoupledSoftmaxMean(prior_mean_tests.TestDecoupledAttentionMeanDiag):
    """sgpa-decoupled, softmax prior mean, diagonal covariance (its fused path without a (T, T) matrix)."""

    options = {"prior_mean": SOFTMAX}
    invariants = ATTENTION_INVARIANTS
    exact_options = {"num_global": 8, "covariance": "diag", "prior_mean": SOFTMAX}


class TestDecoupledSoftmaxMeanFull(prior_mean_tests.TestDecoupledAttentionMean):
    options = {"prior_mean": SOFTMAX, "covariance": "full"}
    invariants = ATTENTION_INVARIANTS
    exact_options = {"num_global": 8, "covariance": "full", "prior_mean": SOFTMAX}


class TestSGPASeparateSoftmaxMean(separate_tests.TestSGPASeparate):
    """The encoder swap's form: separate maps (§5d) with the softmax mean; the reference is §13's cross
    reference of a shared-map twin (tests/test_sgpa_separate.py)."""

    options = {"recipe": "encoder-swap"}  # its mean: the softmax one


class TestDecoupledSeparateSoftmaxMean(separate_tests.TestDecoupledSeparateAttentionMean):
    options = {"recipe": "encoder-swap", "num_global": 3}


def _softmax_reference(layer, x, mask=None):
    """softmax((q/ℓ)(k/ℓ)ᵀ) v by PyTorch's own attention (no gpattn code), real keys only."""
    qk, v = sgpa_heads(layer, x)
    ell = layer.kernel.base_kernel.lengthscale.detach()
    keep = None if mask is None else ~mask[:, None, None, :]
    return F.scaled_dot_product_attention(qk / ell, qk / ell, v, attn_mask=keep, scale=1.0)


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled"])
def test_the_mean_is_softmax_attention_whatever_the_outputscale(name):
    """With the RBF kernel the mean is softmax((q/ℓ)(k/ℓ)ᵀ) v (checked against F.scaled_dot_product_attention,
    key padding included): neither the outputscale nor the RBF's key factor exp(−‖k/ℓ‖²/2) enters it."""
    layer = _layer(name, prior_mean=SOFTMAX, **({"num_global": 2} if name == "sgpa-decoupled" else {}))
    x, mask = _x(T=7), torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    with torch.no_grad():
        if name == "sgpa-decoupled":
            layer.strategy.variational_distribution.inducing_values.zero_()  # no global part
        layer.kernel.outputscale = torch.full((2,), 37.0, dtype=F64)
        ref = _softmax_reference(layer, x, mask)
        real = ~mask[:, None, :, None].expand_as(ref)
        torch.testing.assert_close(layer._condition(x, mask).mean[real], ref[real], rtol=1e-10, atol=1e-12)
        rbf = _layer(name, prior_mean="attention", **({"num_global": 2} if name == "sgpa-decoupled" else {}))
        rbf.load_state_dict(layer.state_dict())
        assert (rbf._condition(x, mask).mean - layer._condition(x, mask).mean)[real].abs().max() > 1e-3


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled"])
def test_with_the_exponential_kernel_it_is_the_attention_mean(name):
    """The limit: under the exponential kernel the softmax mean and the attention mean (§5c) are one function."""
    extra = {"num_global": 2} if name == "sgpa-decoupled" else {}
    a = _layer(name, kernel="exponential", prior_mean=SOFTMAX, **extra)
    b = _layer(name, kernel="exponential", prior_mean="attention", **extra)
    b.load_state_dict(a.state_dict())
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(a._condition(x, None).mean, b._condition(x, None).mean, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("which", ["causal", "general"])
def test_per_query_masks(which):
    """Under a per-query mask query i's mean is the softmax over A_i (0 where A_i = ∅), for both variants;
    sgpa's KL is unchanged by the mean (§5c's)."""
    x = _x()
    excluded = _masks(*x.shape[:2])[which]
    layer = _layer("sgpa", prior_mean=SOFTMAX)
    ref = sgpa_attention_masked_dense_moments(layer, x, excluded)
    decoupled = _layer("sgpa-decoupled", prior_mean=SOFTMAX, num_global=3, covariance="full")
    qk, v = sgpa_heads(decoupled, x)
    Kqg = gram_dense(decoupled.kernel, qk, sgpa_decoupled_global_keys(decoupled))
    ref_d = prior_mean_dense(decoupled, qk, qk, v, excluded)
    ref_d = ref_d + Kqg @ decoupled.strategy.variational_distribution.inducing_values.detach()
    with torch.no_grad():
        cond = layer._condition(x, excluded)
        torch.testing.assert_close(cond.mean, ref["mean"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(cond.query_kl_divergence(), ref["query_kl"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(decoupled._condition(x, excluded).mean, ref_d, rtol=1e-10, atol=1e-12)
    if which == "general":
        assert ref["mean"][0, 0, 2].abs().max() == 0  # the query with no allowed key


def test_causal_mask_with_padding():
    """The causal mask joined with key padding: real queries attend to the real keys j ≤ i only."""
    layer = _layer("sgpa", prior_mean=SOFTMAX)
    x, pad = _x(T=6), torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :2] = True  # leading padding
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    excluded = (causal | pad[:, None, None, :]).expand(2, 2, 6, 6)
    qk, v = sgpa_heads(layer, x)
    ref = prior_mean_dense(layer, qk, qk, v, excluded)
    with torch.no_grad():
        mean = layer._condition(x, causal[None, None].expand(2, 2, 6, 6) | pad[:, None, None, :]).mean
    real = ~pad[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(mean[real], ref[real], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("qk", ["shared", "separate"])
def test_fused_path_equals_the_dense_one(monkeypatch, dtype, tol, qk):
    """Key padding runs in fused attention (SDPA); without a fused kernel the dense path runs: values and the
    gradients of every parameter agree (float64 to 1e-10, float32 to 1e-5), on one seeded sample."""
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(means, "fused_softmax", lambda *a, **k: None)
        torch.manual_seed(3)
        form = {"recipe": "encoder-swap"} if qk == "separate" else {"prior_mean": SOFTMAX}
        layer = gpattn.build_attention("sgpa-decoupled", 16, 2, num_global=3, **form).to(dtype)
        x = torch.randn(3, 9, 16, dtype=dtype, generator=torch.Generator().manual_seed(4))
        pad = torch.zeros(3, 9, dtype=torch.bool)
        pad[1, 6:], pad[2, 1:] = True, True
        torch.manual_seed(5)  # the same noise on both paths: a sample, so that every parameter has a gradient
        y = layer(x, pad)
        y = y[0] if isinstance(y, tuple) else y
        real = ~pad[..., None]
        (y * real).square().sum().backward()
        results.append((y[real.expand_as(y)], {n: p.grad.clone() for n, p in layer.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=tol, atol=tol)
    for n in results[0][1]:
        torch.testing.assert_close(results[0][1][n], results[1][1][n], rtol=tol, atol=tol, msg=n)


def test_no_kl_on_the_mean():
    """The mean is the prior's: sgpa's kl_seq does not depend on the values (scaling W_v changes the mean, not the
    KL), and decoupled's only term is kl_global."""
    layer = _layer("sgpa", prior_mean=SOFTMAX)
    x = _x()
    with torch.no_grad():
        layer(x)
        before = layer_loss_terms(layer)["kl_seq"]
        layer.in_proj.weight[-layer.embed_dim:] *= 3.0
        layer(x)
        torch.testing.assert_close(layer_loss_terms(layer)["kl_seq"], before, rtol=1e-12, atol=0)
        decoupled = _layer("sgpa-decoupled", prior_mean=SOFTMAX, num_global=2)
        decoupled(x)
    assert set(layer_loss_terms(decoupled)) == {"kl_global"}


def test_defaults_and_refusals():
    """The default kernel is the ARD-RBF at ℓ = Dh^¼ (softmax's temperature); a kernel without a lengthscale
    is refused when the layer is built, naming the option."""
    layer = gpattn.build_attention("sgpa", 16, 4, prior_mean=SOFTMAX)
    torch.testing.assert_close(layer.kernel.base_kernel.lengthscale, torch.full((4, 1, 4), 4 ** 0.25))
    from gpytorch.kernels import LinearKernel

    with pytest.raises(ValueError, match="prior_mean='softmax'.*LinearKernel.*lengthscale"):  # the mean's own error
        gpattn.build_attention("sgpa", 16, 4, prior_mean=SOFTMAX, kernel=LinearKernel(batch_shape=torch.Size([4])))
    with pytest.raises(ValueError, match=r"prior_mean must be one of \['attention', 'zero'\]"):
        gpattn.build_attention("sgpa", 16, 4, prior_mean="soft")
    # the softmax mean is no name of sgpa's: the error says whose it is
    with pytest.raises(ValueError, match=r"got 'softmax': the softmax mean is the encoder-swap recipe's"):
        gpattn.build_attention("sgpa", 16, 4, prior_mean="softmax")
