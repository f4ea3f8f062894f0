"""Sparse (DTC) correlated-GP attention (``scgp``; docs/derivations.md §8, Bui et al. §4 and App. C–E).

References are written independently of gpattn.variational (gpattn.testing.references and the
Monte-Carlo estimates here): pairwise-difference kernels, dense solves and the appendix formulas in
their printed σ⁻² / σ⁻⁴ form (eqs. 33, 55, 59–67), and Monte Carlo over the nested DTC model. The shapes
every GP variant shares, on the layer, come from gpattn.testing.GPAttentionTestCase.
"""

import pytest
import torch
from _cgp_helpers import assert_padding_equals_truncated, make_qkov
from linear_operator.operators import LowRankRootAddedDiagLinearOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gpattn
from gpattn.attention.cgp import SCGPAttention
from gpattn.testing import GPAttentionTestCase, assert_samples_match_moments, layer_loss_terms
from gpattn.testing.base_attention_test_case import ATTENTION_INVARIANTS
from gpattn.testing.references import scgp_dense_blocks, scgp_dense_moments, scgp_dense_posterior
from gpattn.variational.cgp import CorrelatedGP
from gpattn.variational.means import CorrelatedSoftmaxMean, ZeroMean
from gpattn.variational.scgp import SparseCorrelatedGP

B, H, T, DH, DV, M, L = 2, 2, 7, 3, 4, 3, 4
SIGMA = 0.4
SIG_Q = torch.tensor([1.2, 0.8], dtype=torch.float64)
SIG_K = torch.tensor([0.7, 1.4], dtype=torch.float64)
F64 = torch.float64


def make_gp(m=M, l=L, sigma=SIGMA, **kw):
    gp = SparseCorrelatedGP(
        H, DH, num_inducing=m, num_inducing_keys=l, sigma=sigma, jitter=0.0, mean_module=ZeroMean(), **kw
    ).double()
    gp.covar.sigma_q = SIG_Q
    gp.covar.sigma_k = SIG_K
    return gp


def make_inputs(seed=0, b=B, t=T, scale=0.9):
    return make_qkov(seed, b, H, t, DH, DV, scale)


def dense_blocks(q, k, o, s, s_keys):
    return scgp_dense_blocks(q, k, o, s, s_keys, SIG_Q, SIG_K)


def dense_scgp(q, k, o, z, s, s_keys, s2=SIGMA**2):
    """Mean (eq. 33), the per-column covariance (eqs. 59, 66, 67) and the blocks, at this file's scales."""
    return scgp_dense_moments(q, k, o, z, s, s_keys, SIG_Q, SIG_K, s2**0.5)


class TestSCGP(GPAttentionTestCase):
    """The layer with global inducing inputs (m = 3, l = 4, no jitter) at this file's σ_q, σ_k."""

    attention = "scgp"
    invariants = ()  # at the default options: tests/test_attention_invariants.py
    float64_options = {"jitter": 0.0, "num_inducing": M, "num_inducing_keys": L}
    mean_tolerance = {"rtol": 1e-9, "atol": 1e-11}
    covariance_tolerance = {"rtol": 1e-8, "atol": 1e-10}
    truncation_tolerance = {"rtol": 1e-9, "atol": 1e-11}
    truncation_garbage = 6.0
    moment_samples = 40_000
    exact_options = {"jitter": 0.0}

    def perturb(self, layer):
        layer.strategy.covar.sigma_q = SIG_Q
        layer.strategy.covar.sigma_k = SIG_K

    def dense_reference(self, layer, x, mask):
        return scgp_dense_posterior(layer, x, mask)


def inducing(seed=1, m=M, l=L):
    g = torch.Generator().manual_seed(seed)
    s = 0.9 * torch.randn(1, H, m, DH, generator=g, dtype=F64)
    return s, 0.9 * torch.randn(1, H, l, DH, generator=g, dtype=F64)


def set_inducing(gp, s, s_keys):
    with torch.no_grad():
        gp.inducing_latent.copy_(s[0])
        gp.inducing_keys.copy_(s_keys[0])


def test_mean_and_covariance_match_dense_formulas():
    gp = make_gp()
    s, s_keys = inducing()
    set_inducing(gp, s, s_keys)
    q, k, o, v = make_inputs()
    nu_ref, cov_ref, _ = dense_scgp(q, k, o, v, s, s_keys)
    res = gp.condition(q, k, o, v)
    torch.testing.assert_close(res.mean, nu_ref, rtol=1e-9, atol=1e-11)
    post = gp.posterior(q, k, o, v)
    assert isinstance(post.lazy_covariance_matrix, LowRankRootAddedDiagLinearOperator)
    assert post.batch_shape == (B, H, DV) and post.event_shape == (T,)
    torch.testing.assert_close(post.mean, nu_ref.transpose(-1, -2), rtol=1e-9, atol=1e-11)
    cov = post.covariance_matrix
    torch.testing.assert_close(cov, cov_ref, rtol=1e-8, atol=1e-10)
    for d in range(1, DV):  # μ_o μ_oᵀ cancels ν νᵀ: the same covariance for every column
        torch.testing.assert_close(cov_ref[:, :, d], cov_ref[:, :, 0], rtol=1e-8, atol=1e-10)
    assert torch.linalg.eigvalsh(cov).min() > SIGMA**2 * (1 - 1e-9)  # σ²I + PSD low rank
    torch.testing.assert_close(post.variance, cov.diagonal(dim1=-2, dim2=-1))


def test_sparse_limit_recovers_exact_cgp_mean():
    """docs/derivations.md §8: with m = l = T, s = x_o and s' = k, the DTC mean E[z_q | z_k] equals the exact CGP
    mean for the same observations z_k (the layers feed different z, so compare predictive means)."""
    q, k, o, _ = make_inputs(3, scale=1.0)
    z = torch.randn(B, H, T, DV, generator=torch.Generator().manual_seed(4), dtype=F64)
    exact = CorrelatedGP(H, sigma=SIGMA, jitter=0.0, mean_module=ZeroMean()).double()
    exact.covar.sigma_q, exact.covar.sigma_k = SIG_Q, SIG_K
    sparse = make_gp(m=T, l=T)
    ref = exact.conditional_mean(q, k, o, z)
    got = sparse.conditional_mean(q, k, o, z, inducing=(o, k))
    assert (got - ref).abs().max() < 1e-8
    # and it is a genuine approximation away from the limit
    s, s_keys = inducing(5, m=T - 2, l=T - 2)
    assert (sparse.conditional_mean(q, k, o, z, inducing=(s, s_keys)) - ref).abs().max() > 1e-3


def test_amortized_initialisation_is_the_sparse_limit():
    """amortize=True starts at s = x_o, s' = k when m = l = T: the layer mean (z = v) is the exact
    CGP conditional mean E[z_q | z_k = v]."""
    q, k, o, v = make_inputs(6)
    gp = make_gp(m=T, l=T, amortize=True, seq_len=T)
    exact = CorrelatedGP(H, sigma=SIGMA, jitter=0.0, mean_module=ZeroMean()).double()
    exact.covar.sigma_q, exact.covar.sigma_k = SIG_Q, SIG_K
    got = gp.condition(q, k, o, v).mean
    assert (got - exact.conditional_mean(q, k, o, v)).abs().max() < 1e-8
    with pytest.raises(ValueError, match="seq_len=7"):
        gp.condition(*(t[:, :, :5] for t in (q, k, o, v)))


def nested_dtc_samples(q, k, o, z, s, s_keys, N, seed, s2=SIGMA**2):
    """z_o | z_k (DTC, eq. 57 / 67), z_m | z_o (eq. 55), z_q | z_m ~ N(K_qm K_mm⁻¹ z_m, σ² I)."""
    K = {key: val[0] for key, val in dense_blocks(q, k, o, s, s_keys).items()}
    n, m = q.shape[-2], s.shape[-2]
    g = torch.Generator().manual_seed(seed)
    Mk = K["K_ll"] + K["K_kl"].mT @ K["K_kl"] / s2
    Fo = torch.linalg.solve(Mk, K["K_ol"].mT).mT
    mu_o = (Fo @ K["K_kl"].mT @ z[0] / s2)[..., 0]  # shape: (H, T)
    C_o = s2 * torch.eye(n, dtype=F64) + Fo @ K["K_ol"].mT
    eps = torch.randn(H, N, n, 1, generator=g, dtype=F64)
    z_o = mu_o[:, None] + (torch.linalg.cholesky(C_o)[:, None] @ eps)[..., 0]
    Mq = K["K_mm"] + K["K_om"].mT @ K["K_om"] / s2
    mean_m = (K["K_mm"] @ torch.linalg.solve(Mq, K["K_om"].mT))[:, None] @ z_o[..., None] / s2  # shape: (H, N, m, 1)
    cov_m = K["K_mm"] @ torch.linalg.solve(Mq, K["K_mm"])
    cov_m = 0.5 * (cov_m + cov_m.mT)
    z_m = mean_m + torch.linalg.cholesky(cov_m)[:, None] @ torch.randn(H, N, m, 1, generator=g, dtype=F64)
    proj = torch.linalg.solve(K["K_mm"], K["K_qm"].mT).mT  # K_qm K_mm⁻¹
    return (proj[:, None] @ z_m)[..., 0] + s2**0.5 * torch.randn(H, N, n, generator=g, dtype=F64)


def test_law_of_total_covariance_monte_carlo():
    """Nested DTC sampling z_o | z_k → z_m | z_o → z_q | z_m; N = 200 000; 5 standard errors."""
    gp = make_gp()
    s, s_keys = inducing(7)
    set_inducing(gp, s, s_keys)
    q, k, o, v = make_inputs(8, b=1, t=5)
    v = v[..., :1]
    post = gp.posterior(q, k, o, v)
    draws = nested_dtc_samples(q, k, o, v, s, s_keys, N=200_000, seed=9)  # shape: (H, N, T)
    assert_samples_match_moments(draws.movedim(1, 0), post.mean[0, :, 0], post.covariance_matrix[0, :, 0])


def dense_regularizer_mc(q, k, o, nu, z, s, s_keys, N, seed, s2=SIGMA**2):
    """App. E bound by Monte Carlo: z_o ~ N(0, K_om K_mm⁻¹ K_mo), z_m | z_o (eq. 55),
    -2 log N(ν; K_qm K_mm⁻¹ z_m, σ²I) − T log 2π; the same for the keys with the l-set."""
    K = dense_blocks(q, k, o, s, s_keys)
    n = q.shape[-2]
    g = torch.Generator().manual_seed(seed)
    total, var = 0.0, 0.0
    for target, K_tm, K_om, K_mm in ((nu, K["K_qm"], K["K_om"], K["K_mm"]), (z, K["K_kl"], K["K_ol"], K["K_ll"])):
        m = K_mm.shape[-1]
        Lmm = torch.linalg.cholesky(K_mm)
        u = Lmm[:, :, None] @ torch.randn(*K_mm.shape[:2], N, m, 1, generator=g, dtype=F64)  # u ~ N(0, K_mm)
        z_o = K_om[:, :, None] @ torch.cholesky_solve(u, Lmm[:, :, None])  # K_om K_mm⁻¹ u ~ N(0, Q_o)
        Mq = K_mm + K_om.mT @ K_om / s2
        mean_m = K_mm[:, :, None] @ torch.linalg.solve(Mq, K_om.mT)[:, :, None] @ z_o / s2
        cov_m = K_mm @ torch.linalg.solve(Mq, K_mm)
        cov_m = 0.5 * (cov_m + cov_m.mT)
        eps = torch.randn(*K_mm.shape[:2], N, m, 1, generator=g, dtype=F64)
        z_m = mean_m + torch.linalg.cholesky(cov_m)[:, :, None] @ eps
        pred = (torch.linalg.solve(K_mm, K_tm.mT).mT[:, :, None] @ z_m)[..., 0]  # shape: (B, H, N, T)
        r = target.mT[:, :, :, None, :] - pred[:, :, None]  # shape: (B, H, Dv, N, T)
        val = r.pow(2).sum(-1) / s2 + n * torch.log(torch.tensor(s2, dtype=F64))
        total = total + val.mean(-1)
        var = var + val.var(-1) / N
    return total, var.sqrt()


def test_regularizer_equals_monte_carlo_estimate_of_the_bound():
    gp = make_gp()
    s, s_keys = inducing(11)
    set_inducing(gp, s, s_keys)
    q, k, o, v = make_inputs(12)
    res = gp.condition(q, k, o, v)
    assert res.regularizer().shape == (B, H, DV) and torch.isfinite(res.regularizer()).all()
    ref, se = dense_regularizer_mc(q, k, o, res.mean, v, s, s_keys, N=20_000, seed=13)
    assert ((res.regularizer() - ref).abs() <= 5 * se).all(), (res.regularizer() - ref) / se


def test_regularizer_and_samples_are_differentiable():
    gp = make_gp()
    gp.inducing_latent.requires_grad_(True)
    q, k, o, v = (t.requires_grad_(True) for t in make_inputs(14, b=1, t=5))

    def reg(q, k, o, v):
        return gp.condition(q, k, o, v).regularizer()

    def sampled(q, k, o, v):
        torch.manual_seed(15)
        return gp.condition(q, k, o, v).rsample()

    assert torch.autograd.gradcheck(reg, (q, k, o, v))
    assert torch.autograd.gradcheck(sampled, (q, k, o, v))
    gp.condition(q, k, o, v).regularizer().sum().backward()
    for p in (gp.inducing_latent, gp.inducing_keys, gp.covar.raw_sigma_q, gp.covar.raw_sigma_k):
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).any()


@pytest.mark.parametrize("padded", [(5, 6), (0, 3)])
def test_padding_equals_truncated_sequence(padded):
    gp = make_gp()
    set_inducing(gp, *inducing(16))
    assert_padding_equals_truncated(gp, *make_inputs(17, b=1), padded, garbage_scale=6.0, atol=1e-11)


class TokenSquareRecorder(TorchDispatchMode):
    """Records every op output with two axes of size ≥ T (a T×T intermediate)."""

    def __init__(self, n_tokens):
        super().__init__()
        self.n_tokens = n_tokens
        self.offenders = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.ops += 1
                if sum(size >= self.n_tokens for size in t.shape) >= 2:
                    self.offenders.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("amortize", [False, True])
def test_no_token_by_token_tensor_at_T_4096(amortize):
    """Forward, backward and posterior() at T = 4096 never create a tensor with two T-sized axes."""
    Tn = 4096
    torch.manual_seed(0)
    opts = dict(amortize=True, seq_len=Tn) if amortize else {}
    # float64: with amortised inducing inputs at the sequence's own tokens, the m×m covariance bracket's
    # condition number grows with T, and at T = 4096 with the stream-scale σ_k (gpattn.variational._scale)
    # float32 is no longer enough for it (NotPSDError); this test is about allocations, not precision
    layer = gpattn.build_attention("scgp", 16, 2, **opts).double()
    x = torch.randn(2, Tn, 16, requires_grad=True, dtype=torch.float64)
    mask = torch.zeros(2, Tn, dtype=torch.bool)
    mask[1, 3000:] = True
    fwd = TokenSquareRecorder(Tn)
    with fwd:
        y = layer(x, mask)
        loss = y.square().mean() + layer_loss_terms(layer)["cgp"]
    bwd = TokenSquareRecorder(Tn)
    with bwd:
        loss.backward()
    post_rec = TokenSquareRecorder(Tn)
    with post_rec, torch.no_grad():
        post = layer.posterior(x, mask)
        var = post.variance
    assert fwd.ops > 50 and bwd.ops > 50 and post_rec.ops > 10  # the instrumentation saw the work
    assert fwd.offenders == [] and bwd.offenders == [] and post_rec.offenders == [], (
        fwd.offenders + bwd.offenders + post_rec.offenders
    )
    assert torch.isfinite(var).all() and x.grad is not None and torch.isfinite(x.grad).all()


def test_layer_loss_term_and_options():
    torch.manual_seed(0)
    layer = gpattn.build_attention("scgp", 12, 2, num_inducing=5, num_inducing_keys=3).double()
    assert layer.strategy.inducing_latent.shape == (2, 5, 6) and layer.strategy.inducing_keys.shape == (2, 3, 6)
    x = torch.randn(3, 9, 12, dtype=F64)
    layer(x)
    p = layer.project(x)
    c = layer.input_scale
    res = layer.strategy.condition(p["q"] * c, p["k"] * c, p["o"] * c, p["v"], mean_values=p["v_mean"])
    torch.testing.assert_close(layer_loss_terms(layer)["cgp"], res.regularizer().sum((1, 2)).mean() / 2)
    with gpattn.deterministic():
        torch.testing.assert_close(layer.posterior(x).mean, res.mean.transpose(-1, -2))


def test_amortized_layer_trains_its_token_maps():
    torch.manual_seed(0)
    layer = gpattn.build_attention("scgp", 8, 2, amortize=True, seq_len=6, num_inducing=4, num_inducing_keys=3)
    x = torch.randn(2, 6, 8)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, 4:] = True
    y = layer(x, mask)
    (y.sum() + layer_loss_terms(layer)["cgp"]).backward()
    for p in (layer.strategy.amortize_latent, layer.strategy.amortize_keys):
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).any()
    # padded tokens never enter the amortised inducing inputs
    x2 = x.clone()
    x2[1, 4:] = 50 * torch.randn(2, 8)
    with gpattn.deterministic():
        torch.testing.assert_close(layer(x, mask)[1, :4], layer(x2, mask)[1, :4])


@pytest.mark.parametrize(
    "options, word",
    [
        (dict(num_inducing=0), "num_inducing"),
        (dict(num_inducing_keys=2.5), "num_inducing_keys"),
        (dict(amortize=True), "seq_len"),
        (dict(seq_len=8), "seq_len"),
        (dict(sigma=-1.0), "sigma"),
        (dict(kernel=3), "kernel"),
    ],
)
def test_bad_options_raise(options, word):
    with pytest.raises(ValueError, match=word):
        gpattn.build_attention("scgp", 8, 2, **options)


def test_crowded_inducing_inputs_stay_finite_in_float32():
    """Inducing inputs crowded together (K_mm ≈ all ones, σ² = 0.01) make the m×m capacitances nearly
    singular: scgp's algebra runs in float64 (``ALGEBRA_DTYPE``), so a float32 layer's mean, samples and
    regulariser stay finite and its mean matches the same layer in float64; the outputs keep float32. (The papers'
    zero mean: the algebra under test is the GP's, whatever mean is added to ν.)"""
    import copy

    torch.manual_seed(0)
    layer = gpattn.build_attention("scgp", 32, 2, prior_mean="zero")
    with torch.no_grad():
        for p in (layer.strategy.inducing_latent, layer.strategy.inducing_keys):
            p.copy_(p[:, :1] + 1e-3 * torch.randn_like(p))
    layer.rescale_inputs(0.05)
    x = torch.randn(4, 12, 32)
    y = layer(x, num_samples=3)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    terms = layer.loss_terms()
    assert all(torch.isfinite(v).all() and v.dtype == torch.float32 for v in terms.values())
    with gpattn.deterministic():
        mean = layer(x)
        reference = copy.deepcopy(layer).double()(x.double())
    torch.testing.assert_close(mean.double(), reference, rtol=1e-4, atol=1e-5)


class _SoftmaxMeanSCGP(SCGPAttention):
    """scgp with the softmax mean over the GP's values (cgp's; an object for scgp, fresh per layer)."""

    def __init__(self, embed_dim, num_heads, **options):
        super().__init__(embed_dim, num_heads, **{"prior_mean": CorrelatedSoftmaxMean(), **options})


class TestSCGPSoftmaxMean(TestSCGP):
    """The softmax mean over the GP's values (docs/derivations.md §7a): the dense reference adds softmax(q kᵀ) v of the
    scaled inputs to eq. 33's mean; the covariance is the DTC one (the contract's invariants too: not the default
    form)."""

    attention = _SoftmaxMeanSCGP
    invariants = ATTENTION_INVARIANTS


class TestSCGPZeroMean(TestSCGP):
    """The papers' form, ``prior_mean="zero"``: eq. 33's mean alone. TestSCGP runs the default, the separate softmax
    mean of §7a (over the layer's own values W_vm x, the ``v_mean`` projection, which the regulariser does not read)."""

    options = {"prior_mean": "zero"}
    invariants = ATTENTION_INVARIANTS
