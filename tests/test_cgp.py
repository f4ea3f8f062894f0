"""Exact correlated-GP attention (``cgp``; docs/derivations.md §7, Bui et al. §3 and App. A–B).

Every reference is written independently of gpattn.variational (gpattn.testing.references and the
Monte-Carlo estimates here): pairwise-difference kernels, dense ``torch.linalg.solve`` and the formulas
exactly as printed (eq. 24 observations, eq. 25 mean, App. B covariance with the μ_o μ_oᵀ term *not*
cancelled, eqs. 42–44 regulariser by Monte Carlo). The shapes every GP variant shares, on the layer,
come from gpattn.testing.GPAttentionTestCase.
"""

import pytest
import torch
from _cgp_helpers import ExactCGP, SeparateMeanExactCGP, assert_padding_equals_truncated, make_qkov, mean_option
from _knobs import CGPProbe
from gpytorch.kernels import MaternKernel

import gpattn
from gpattn.testing import GPAttentionTestCase, assert_samples_match_moments, layer_loss_terms
from gpattn.testing.base_attention_test_case import ATTENTION_INVARIANTS
from gpattn.testing.references import cgp_dense_blocks, cgp_dense_moments, cgp_dense_posterior
from gpattn.variational.cgp import CorrelatedGP
from gpattn.variational.means import ZeroMean

B, H, T, DH, DV = 2, 2, 6, 3, 4
SIGMA = 0.3
SIG_Q = torch.tensor([1.3, 0.7], dtype=torch.float64)
SIG_K = torch.tensor([0.6, 1.5], dtype=torch.float64)


def dense_blocks(q, k, o):
    return cgp_dense_blocks(q, k, o, SIG_Q, SIG_K)


def dense_cgp(q, k, o, v, s2=SIGMA**2):
    """ν (eq. 25), the App. B per-column covariance, z (eq. 24) and the blocks, at this file's scales."""
    return cgp_dense_moments(q, k, o, v, SIG_Q, SIG_K, s2**0.5)


class TestCGP(GPAttentionTestCase):
    """The layer (exact expectation in the regulariser, no jitter) at this file's σ_q, σ_k."""

    attention = ExactCGP  # the exact regulariser: the strategy's prior_samples=None
    invariants = ()  # at the default options: tests/test_attention_invariants.py
    float64_options = {"jitter": 0.0}
    mean_tolerance = {"rtol": 1e-9, "atol": 1e-10}
    covariance_tolerance = truncation_tolerance = {"rtol": 1e-8, "atol": 1e-10}
    truncation_garbage = 7.0
    moment_samples = 40_000
    long_padding = None  # O(T³) per head: 7.6 s at T = 1024; test_runs_in_float32_at_moderate_length

    def perturb(self, layer):
        layer.strategy.covar.sigma_q = SIG_Q
        layer.strategy.covar.sigma_k = SIG_K

    def dense_reference(self, layer, x, mask):
        return cgp_dense_posterior(layer, x, mask)


def make_gp(prior_samples=None, jitter=0.0, sigma=SIGMA):
    gp = CorrelatedGP(H, sigma=sigma, jitter=jitter, prior_samples=prior_samples, mean_module=ZeroMean()).double()
    gp.covar.sigma_q = SIG_Q
    gp.covar.sigma_k = SIG_K
    return gp


def make_inputs(seed=0, b=B, t=T, scale=0.8):
    return make_qkov(seed, b, H, t, DH, DV, scale)


def test_mean_and_covariance_match_dense_formulas():
    gp = make_gp()
    q, k, o, v = make_inputs()
    nu_ref, cov_ref, _, _ = dense_cgp(q, k, o, v)
    cond = gp.condition(q, k, o, v)
    torch.testing.assert_close(cond.mean, nu_ref, rtol=1e-9, atol=1e-10)
    post = gp.posterior(q, k, o, v)
    assert post.batch_shape == (B, H, DV) and post.event_shape == (T,)
    torch.testing.assert_close(post.mean, nu_ref.transpose(-1, -2), rtol=1e-9, atol=1e-10)
    cov = post.covariance_matrix
    torch.testing.assert_close(cov, cov_ref, rtol=1e-8, atol=1e-10)
    # the μ_o μ_oᵀ term cancels ν νᵀ: one covariance for every value column, symmetric PSD
    for d in range(1, DV):
        torch.testing.assert_close(cov_ref[:, :, d], cov_ref[:, :, 0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(cov, cov.mT, rtol=0, atol=1e-12)
    assert torch.linalg.eigvalsh(cov).min() > -1e-10
    # conditional mean for arbitrary observations z_k (eq. 21) equals ν for z = (K_k + σ²I) v
    _, _, z, _ = dense_cgp(q, k, o, v)
    torch.testing.assert_close(gp.conditional_mean(q, k, o, z), nu_ref, rtol=1e-8, atol=1e-10)


def test_scales_enter_cross_covariances():
    """σ_q, σ_k multiply K_qo and K_ok too (docs/derivations.md §7 Choice): the mean scales with σ_q σ_k."""
    gp = make_gp()
    q, k, o, v = make_inputs(1)
    nu = gp.condition(q, k, o, v).mean
    gp.covar.sigma_q = 2 * SIG_Q
    gp.covar.sigma_k = 3 * SIG_K
    nu2 = gp.condition(q, k, o, v).mean
    torch.testing.assert_close(nu2, 6 * nu, rtol=1e-10, atol=1e-12)


def test_law_of_total_covariance_monte_carlo():
    """Sample z_o | z_k, then z_q | z_o (the nested model of eq. 17) and compare the empirical moments
    with the analytic ν and Σ. N = 200 000 draws; every mean entry within 5 standard errors
    sqrt(Σ_tt / N), every covariance entry within 5 sqrt((Σ_ii Σ_jj + Σ_ij²) / N)."""
    torch.manual_seed(0)
    gp = make_gp()
    q, k, o, v = make_inputs(2, b=1, t=5)
    v = v[..., :1]
    post = gp.posterior(q, k, o, v)
    nu, cov = post.mean[0, :, 0], post.covariance_matrix[0, :, 0]  # shape: (H, T), (H, T, T)
    _, _, z, K = dense_cgp(q, k, o, v)
    eye = torch.eye(5, dtype=torch.float64)
    A, Kk = K["K_o"][0] + SIGMA**2 * eye, K["K_k"][0] + SIGMA**2 * eye
    mu_o = (K["K_ok"][0] @ torch.linalg.solve(Kk, z[0]))[..., 0]
    C_o = K["K_o"][0] - K["K_ok"][0] @ torch.linalg.solve(Kk, K["K_ok"][0].mT)
    HA = torch.linalg.solve(A, K["K_qo"][0].mT).mT
    S_q = K["K_q"][0] - HA @ K["K_qo"][0].mT
    N = 200_000
    g = torch.Generator().manual_seed(3)
    L_o = torch.linalg.cholesky(C_o + 1e-12 * eye)
    z_o = mu_o[:, None, :] + (L_o[:, None] @ torch.randn(H, N, 5, 1, generator=g, dtype=torch.float64))[..., 0]
    L_q = torch.linalg.cholesky(S_q)
    noise = torch.randn(H, N, 5, 1, generator=g, dtype=torch.float64)
    z_q = (HA[:, None] @ z_o[..., None])[..., 0] + (L_q[:, None] @ noise)[..., 0]
    assert_samples_match_moments(z_q.movedim(1, 0), nu, cov)


def dense_regularizer_mc(q, k, o, nu, z, N, seed):
    """eqs. 42–44 by Monte Carlo over z_o ~ N(0, K_o), dense; returns (R estimate, standard error)."""
    K = dense_blocks(q, k, o)
    n = q.shape[-2]
    eye = torch.eye(n, dtype=torch.float64)
    A = K["K_o"] + SIGMA**2 * eye
    Hq = torch.linalg.solve(A, K["K_qo"].mT).mT  # K_qo A⁻¹
    Hk = torch.linalg.solve(A, K["K_ok"]).mT  # K_ko A⁻¹
    # the bounded form: each conditional with the observation noise σ²I
    S_q = K["K_q"] - Hq @ K["K_qo"].mT + SIGMA**2 * eye
    S_k = K["K_k"] - Hk @ K["K_ok"] + SIGMA**2 * eye
    g = torch.Generator().manual_seed(seed)
    L = torch.linalg.cholesky(K["K_o"] + 1e-12 * eye)
    z_o = L[:, :, None] @ torch.randn(*K["K_o"].shape[:2], N, n, 1, generator=g, dtype=torch.float64)
    total = 0.0
    var = 0.0
    for target, Hx, S in ((nu, Hq, S_q), (z, Hk, S_k)):
        m = (Hx[:, :, None] @ z_o)[..., 0]  # shape: (B, H, N, T)
        r = target.mT[:, :, :, None, :] - m[:, :, None]  # shape: (B, H, Dv, N, T)
        quad = (r * torch.linalg.solve(S[:, :, None, None], r[..., None])[..., 0]).sum(-1)  # shape: (B, H, Dv, N)
        total = total + quad.mean(-1) + torch.logdet(S)[..., None]
        var = var + quad.var(-1) / N
    return total, var.sqrt()


def test_regularizer_equals_monte_carlo_estimate_of_the_bound():
    gp = make_gp(prior_samples=None)
    q, k, o, v = make_inputs(5, b=1)
    res = gp.condition(q, k, o, v)
    _, _, z, _ = dense_cgp(q, k, o, v)
    ref, se = dense_regularizer_mc(q, k, o, res.mean, z, N=20_000, seed=6)
    assert res.regularizer().shape == (1, H, DV)
    assert torch.isfinite(res.regularizer()).all()
    assert ((res.regularizer() - ref).abs() <= 5 * se).all(), (res.regularizer() - ref) / se
    # the layer's own estimator with P_o = 20 000 samples has (about) the same standard error
    torch.manual_seed(7)
    mc = make_gp(prior_samples=20_000).condition(q, k, o, v).regularizer()
    assert ((mc - res.regularizer()).abs() <= 5 * se).all(), (mc - res.regularizer()) / se


def test_regularizer_is_eq_44_at_the_drawn_prior_samples():
    """With P_o samples the layer evaluates eq. 44 exactly at its draws z_o⁽ⁱ⁾ = chol(K_o) ε⁽ⁱ⁾
    (ε from the global generator): reproduce the draws and evaluate eq. 44 densely."""
    P = 5
    q, k, o, v = make_inputs(13, b=1)
    torch.manual_seed(14)
    R = make_gp(prior_samples=P).condition(q, k, o, v)
    R_reg = R.regularizer()  # draws its prior samples now, from the seed above
    torch.manual_seed(14)
    eps = torch.randn(1, H, T, P, dtype=torch.float64)
    _, _, z, K = dense_cgp(q, k, o, v)
    eye = torch.eye(T, dtype=torch.float64)
    A = K["K_o"] + SIGMA**2 * eye
    z_o = torch.linalg.cholesky(K["K_o"]) @ eps  # shape: (1, H, T, P)
    ref = 0.0
    for target, K_xo in ((R.mean, K["K_qo"]), (z, K["K_ok"].mT)):
        Hx = torch.linalg.solve(A, K_xo.mT).mT  # K_xo A⁻¹
        S = (K["K_q"] if K_xo is K["K_qo"] else K["K_k"]) - Hx @ K_xo.mT + SIGMA**2 * eye
        m = Hx @ z_o  # shape: (1, H, T, P)
        quad = 0.0
        for i in range(P):
            r = target - m[..., i : i + 1]  # shape: (1, H, T, Dv)
            quad = quad + (r * torch.linalg.solve(S, r)).sum(-2) / P
        ref = ref + quad + torch.logdet(S)[..., None]
    torch.testing.assert_close(R_reg, ref, rtol=1e-9, atol=1e-9)


def test_regularizer_default_p_o_is_noisy_but_centred():
    """P_o = 10 estimates averaged over 400 draws approach the exact expectation (5 SE of the average)."""
    torch.manual_seed(8)
    q, k, o, v = make_inputs(9, b=1)
    exact = make_gp(prior_samples=None).condition(q, k, o, v).regularizer()
    gp = make_gp(prior_samples=10)
    draws = torch.stack([gp.condition(q, k, o, v).regularizer() for _ in range(400)])
    se = draws.std(0) / 400**0.5
    assert (draws.std(0) > 0).all()
    assert ((draws.mean(0) - exact).abs() <= 5 * se).all()


def test_regularizer_and_samples_are_differentiable():
    torch.manual_seed(0)
    gp = make_gp(prior_samples=None)
    q, k, o, v = (t.requires_grad_(True) for t in make_inputs(10, b=1, t=4))

    def reg(q, k, o, v):
        return gp.condition(q, k, o, v).regularizer()

    def sampled(q, k, o, v):
        torch.manual_seed(11)
        return gp.condition(q, k, o, v).rsample()

    assert torch.autograd.gradcheck(reg, (q, k, o, v))
    assert torch.autograd.gradcheck(sampled, (q, k, o, v))
    gp2 = make_gp(prior_samples=3)
    gp2.covar.raw_sigma_q.requires_grad_(True)
    r = gp2.condition(q, k, o, v).regularizer().sum()
    r.backward()
    assert torch.isfinite(gp2.covar.raw_sigma_q.grad).all() and (gp2.covar.raw_sigma_q.grad != 0).all()


@pytest.mark.parametrize("padded", [(4, 5), (1, 3)])
def test_padding_equals_truncated_sequence(padded):
    """Padded tokens are removed from every basis: mean, covariance block and regulariser of the real
    tokens equal a run on the sequence without them (suffix and interior padding)."""
    gp = make_gp(prior_samples=None, jitter=0.0)
    assert_padding_equals_truncated(gp, *make_inputs(12, b=1), padded, garbage_scale=7.0, atol=1e-10)


def test_layer_loss_term_and_deterministic_mean():
    torch.manual_seed(0)
    layer = gpattn.build_attention(ExactCGP, 12, 2).double()
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True
    y = layer(x, mask)
    assert y.shape == x.shape
    p = layer.project(x)
    c = layer.input_scale
    assert c == pytest.approx(6**-0.25)
    res = layer.strategy.condition(p["q"] * c, p["k"] * c, p["o"] * c, p["v"], mask)
    # docs/derivations.md §7: mean over the batch of Σ_{h,d} R / 2
    torch.testing.assert_close(layer_loss_terms(layer)["cgp"], res.regularizer().sum((1, 2)).mean() / 2)
    with gpattn.deterministic():
        y_mean = layer(x, mask)
    B_, T_, _ = x.shape
    ref = layer.out_proj(res.mean.transpose(1, 2).reshape(B_, T_, -1))
    torch.testing.assert_close(y_mean, ref)
    torch.testing.assert_close(layer.posterior(x, mask).mean, res.mean.transpose(-1, -2))


def test_any_gpytorch_kernel_as_canonical():
    kern = MaternKernel(nu=2.5, batch_shape=torch.Size([2]))
    layer = gpattn.build_attention(ExactCGP, 8, 2, kernel=kern, prior_mean="zero").double()
    assert layer.strategy.covar.canonical is kern
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    post = layer.posterior(x)
    p = layer.project(x)
    c = layer.input_scale
    q, k, o, v = p["q"] * c, p["k"] * c, p["o"] * c, p["v"]
    K_o = kern(o, o).to_dense()
    K_qo = layer.strategy.covar.sigma_q[:, None, None] * kern(q, o).to_dense()
    K_ok = layer.strategy.covar.sigma_k[:, None, None] * kern(o, k).to_dense()
    nu = K_qo @ torch.linalg.solve(K_o + 0.01 * torch.eye(5, dtype=torch.float64), K_ok @ v)
    torch.testing.assert_close(post.mean, nu.transpose(-1, -2))
    y = layer(x)
    y.sum().backward()
    assert kern.raw_lengthscale.grad is not None and torch.isfinite(kern.raw_lengthscale.grad).all()


def test_runs_in_float32_at_moderate_length():
    torch.manual_seed(0)
    layer = gpattn.build_attention("cgp", 32, 4)
    x = torch.randn(2, 128, 32)
    y = layer(x)
    assert torch.isfinite(y).all() and torch.isfinite(layer_loss_terms(layer)["cgp"])
    y.sum().backward()


@pytest.mark.parametrize(
    "option, value, word",
    [
        ("prior_samples", 0, "prior_samples"),
        ("sigma", 0.0, "sigma"),
        ("jitter", -1.0, "jitter"),
        ("kernel", "exponential", "kernel"),
        ("input_scale", 0.0, "input_scale"),
        ("learn_sigma", 1, "learn_sigma"),
        ("prior_mean", "attention", "prior_mean"),
    ],
)
def test_bad_options_raise(option, value, word):
    with pytest.raises(ValueError, match=word):
        gpattn.build_attention("cgp", 8, 2, **{option: value})


def test_bad_shapes_raise():
    gp = make_gp()
    q, k, o, v = make_inputs()
    with pytest.raises(ValueError, match="k must have the shape of q"):
        gp.condition(q, k[:, :, :3], o, v)
    with pytest.raises(ValueError, match="v must have shape"):
        gp.condition(q, k, o, v[:, :, :3])
    with pytest.raises(ValueError, match="mask"):
        gp.condition(q, k, o, v, torch.zeros(B, T))


def test_learnable_sigma_gets_gradient():
    """A learned σ (the strategy's learn_sigma, a research knob: research/knobs.py's probe)."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(CGPProbe, 8, 2, learn_sigma=True)
    y = layer(torch.randn(2, 5, 8))
    (y.sum() + layer_loss_terms(layer)["cgp"]).backward()
    g = layer.strategy.raw_sigma.grad
    assert g is not None and torch.isfinite(g).all() and (g != 0).all()


@pytest.mark.parametrize("prior_samples", [None, 10])
@pytest.mark.parametrize("scale", [1.0, 1e-2, 1e-4])
def test_regularizer_is_bounded_below_as_the_gp_variances_shrink(prior_samples, scale):
    """R ≥ 2T log σ² per head and value column: the conditionals carry the observation noise σ²I, so
    log|Σ_q + σ²I| ≥ T log σ² and the quadratic forms are ≥ 0. Without the noise (eq. 37 as printed) the
    noise-free Σ_q = σ_q²(…) → 0 as σ_q, σ_k → 0 while ν and z shrink with them: R ran to −∞ (at
    scale 1e-4 it was ≈ 2T log 1e-8, far below the bound)."""
    gp = make_gp(prior_samples=prior_samples, jitter=0.0)
    gp.covar.sigma_q = SIG_Q * scale
    gp.covar.sigma_k = SIG_K * scale
    q, k, o, v = make_inputs(21, b=2)
    torch.manual_seed(0)
    R = gp.condition(q, k, o, v * scale).regularizer()  # shape: (B, H, Dv)
    bound = 2 * T * torch.log(torch.tensor(SIGMA**2, dtype=torch.float64))
    assert torch.isfinite(R).all()
    assert (R >= bound - 1e-9).all(), (R.min(), bound)


def test_learned_sigma_has_a_floor():
    """A learned σ cannot reach 0, where the bound 2T log σ² itself would run to −∞."""
    from gpattn.variational.cgp import SIGMA_FLOOR

    layer = gpattn.build_attention(CGPProbe, 8, 2, learn_sigma=True)
    with torch.no_grad():
        layer.strategy.raw_sigma.fill_(-1e4)
    assert (layer.strategy.sigma >= SIGMA_FLOOR).all()
    with pytest.raises(ValueError, match="SIGMA_FLOOR"):
        gpattn.build_attention(CGPProbe, 8, 2, learn_sigma=True, sigma=SIGMA_FLOOR / 2)


@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_rescale_inputs_is_a_layer_built_with_that_input_scale(name):
    """``rescale_inputs(r)`` (q, k, o rows of in_proj and scgp's inducing inputs × r) computes, in float64,
    what the same parameters compute with ``input_scale`` × r and the inducing inputs × r — the
    reparametrisation W ← cW of the canonical space — and keeps the value rows. With the zero mean: the softmax prior
    mean keeps its attention instead (test_rescale_inputs_keeps_the_softmax_mean)."""
    torch.manual_seed(0)
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[1, 4:] = True
    a = gpattn.build_attention(name, 16, 2, prior_mean="zero").double()
    b = gpattn.build_attention(name, 16, 2, input_scale=a.input_scale * 0.37, prior_mean="zero").double()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():  # inducing inputs live in the canonical space: the same points, scaled with it
        for inducing in (getattr(b.strategy, n, None) for n in ("inducing_latent", "inducing_keys")):
            if inducing is not None:
                inducing *= 0.37
    v_rows = a.in_proj.weight[-16:].detach().clone()
    a.rescale_inputs(0.37)
    assert torch.equal(a.in_proj.weight[-16:], v_rows)
    with gpattn.deterministic():
        torch.testing.assert_close(a(x, key_padding_mask=mask), b(x, key_padding_mask=mask), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="factor"):
        a.rescale_inputs(0.0)


# ------------------------------------------------------------------ the softmax prior mean (docs/derivations.md §7a)
class TestCGPZeroMean(TestCGP):
    """The papers' form, ``prior_mean="zero"``: eq. 25's mean alone, App. B's covariance (the contract's invariants
    too: this is not the default form). TestCGP runs the default, the softmax prior mean of §7a, whose dense
    reference adds softmax(q kᵀ) v of the scaled inputs to eq. 25's mean."""

    options = {"prior_mean": "zero"}
    invariants = ATTENTION_INVARIANTS


class TestCGPSeparateMean(TestCGP):
    """The separate softmax mean (§7a; scgp's, an object for cgp): over the layer's own values W_vm x (the ``v_mean``
    projection), which the regulariser does not read."""

    attention = SeparateMeanExactCGP
    invariants = ATTENTION_INVARIANTS


SOFTMAX_MEANS = ["softmax", "softmax-separate"]


def _twins(name, seed=0, mean="softmax", **options):
    """A layer with the zero mean and its twin with the softmax mean ``mean``, with the same parameters (float64;
    the separate mean's own value rows ``v_mean`` keep their initialisation)."""
    torch.manual_seed(seed)
    zero = gpattn.build_attention(name, 8, 2, prior_mean="zero", **options).double()
    twin = gpattn.build_attention(name, 8, 2, prior_mean=mean_option(mean), **options).double()
    state = {k: v for k, v in zero.state_dict().items() if not k.startswith("in_proj.")}
    twin.load_state_dict(state, strict=False)
    with torch.no_grad():
        for name_, param in zero.in_proj.named_parameters():  # the zero-mean rows come first in the twin's in_proj
            getattr(twin.in_proj, name_)[: param.shape[0]] = param
    return zero, twin


@pytest.mark.parametrize("mean", SOFTMAX_MEANS)
@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_softmax_mean_adds_attention_and_changes_nothing_else(name, mean):
    """mean = the zero-mean layer's mean + softmax(q kᵀ/√Dh) u of the layer's projections over the real keys (0 at
    padded queries), u = the values v, or the separate mean's own ``v_mean``; covariance, samples' spread and the
    regulariser (exact expectation) are the zero-mean layer's: the prior mean costs nothing in R (§7a)."""
    zero, twin = _twins(ExactCGP if name == "cgp" else name, mean=mean)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    p = twin.project(x)
    logits = (p["q"] @ p["k"].mT) / zero.head_dim**0.5  # the pretrained-style temperature at input_scale Dh^-1/4
    logits = logits.masked_fill(mask[:, None, None, :], float("-inf"))
    u = p["v_mean"] if mean == "softmax-separate" else p["v"]
    assert mean == "softmax" or not torch.allclose(p["v_mean"], p["v"])  # the separate values are not v
    softmax = (logits.softmax(-1) @ u) * (~mask)[:, None, :, None]
    post0, post1 = zero.posterior(x, mask), twin.posterior(x, mask)
    torch.testing.assert_close(post1.mean - post0.mean, softmax.transpose(-1, -2), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(post1.covariance_matrix, post0.covariance_matrix, rtol=0, atol=0)
    with gpattn.deterministic():
        zero(x, mask)
        twin(x, mask)
        torch.testing.assert_close(layer_loss_terms(twin), layer_loss_terms(zero), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mean", SOFTMAX_MEANS)
@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_rescale_inputs_keeps_the_softmax_mean(name, mean):
    """``rescale_inputs(r)`` (the swap's median heuristic) multiplies the canonical inputs by r and divides the mean's
    temperature by r²: the softmax part of the mean is unchanged, the GP part moves; a state-dict round trip keeps
    the temperature."""
    zero, twin = _twins(name, mean=mean)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    before = twin.posterior(x).mean - zero.posterior(x).mean
    for layer in (zero, twin):
        layer.rescale_inputs(1.7)
    torch.testing.assert_close(twin.strategy.mean_module.temperature, torch.tensor(1.7**-2, dtype=torch.float64))
    after = twin.posterior(x).mean - zero.posterior(x).mean
    torch.testing.assert_close(after, before, rtol=1e-10, atol=1e-12)
    reloaded = gpattn.build_attention(name, 8, 2, prior_mean=mean_option(mean)).double()
    reloaded.load_state_dict(twin.state_dict())
    torch.testing.assert_close(reloaded.posterior(x).mean, twin.posterior(x).mean, rtol=0, atol=0)


@pytest.mark.parametrize("mean", SOFTMAX_MEANS)
def test_softmax_mean_gradients_match_finite_differences(mean):
    """The mean's gradient through the fused softmax path (float64, key padding) against finite differences."""
    _, twin = _twins(ExactCGP, mean=mean)
    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    mask = torch.tensor([[False] * 4, [False] * 3 + [True]])
    assert torch.autograd.gradcheck(lambda x: twin.posterior(x, mask).mean, (x,))


def test_separate_mean_values_are_trained_by_the_output_alone():
    """The separate mean's own values get their gradient from the layer's output, never from the regulariser R
    (which reads ν and v, §7a): R's gradient is zero on the ``v_mean`` rows and nonzero on the ``v`` rows."""
    _, twin = _twins(ExactCGP, mean="softmax-separate")
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with gpattn.deterministic():
        twin(x)
    sum(layer_loss_terms(twin).values()).backward()
    rows, grad = twin.projection_rows(), twin.in_proj.weight.grad
    assert grad[rows["v_mean"]].abs().max() == 0 and grad[rows["v"]].abs().max() > 0
    twin.zero_grad()
    with gpattn.deterministic():
        twin(x).sum().backward()
    assert twin.in_proj.weight.grad[rows["v_mean"]].abs().max() > 0


@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_mean_values_only_with_the_separate_mean(name):
    """The strategy takes ``mean_values`` exactly when its prior mean reads them, shaped like the values."""
    q, k, o, v = (torch.randn(1, 2, 4, 4) for _ in range(4))
    separate = gpattn.build_attention(name, 8, 2, prior_mean=mean_option("softmax-separate")).strategy
    with pytest.raises(ValueError, match="mean_values: prior_mean='softmax-separate' reads values of its own"):
        separate.condition(q, k, o, v)
    shapes = r"a tensor of shape \(1, 2, 4, 4\), got \(1, 2, 3, 4\); or use prior_mean='softmax'"
    with pytest.raises(ValueError, match=shapes):
        separate.condition(q, k, o, v, mean_values=v[:, :, :3])
    for mean in ("softmax", "zero"):
        strategy = gpattn.build_attention(name, 8, 2, prior_mean=mean_option(mean)).strategy
        with pytest.raises(ValueError, match=f"only a prior mean with values of its own reads them, not '{mean}'"):
            strategy.condition(q, k, o, v, mean_values=v)


def test_zero_mean_state_dict_has_no_temperature():
    """The papers' form keeps its state dict (checkpoints saved before §7a load unchanged); the softmax mean keeps its
    temperature in its module, and a state dict saved with the strategy's ``mean_temperature`` loads through the one
    load hook (gpattn._migrate.OLD_KEYS), with a warning naming the key."""
    assert not any("temperature" in k for k in gpattn.build_attention("cgp", 8, 2, prior_mean="zero").state_dict())
    for mean in SOFTMAX_MEANS:
        layer = gpattn.build_attention("cgp", 8, 2, prior_mean=mean_option(mean))
        assert "strategy.mean_module.temperature" in layer.state_dict()
        old = dict(layer.state_dict())
        old["strategy.mean_temperature"] = torch.tensor(0.25)
        del old["strategy.mean_module.temperature"]
        with pytest.warns(gpattn.OldVersionWarning, match="strategy.mean_temperature .* migrated"):
            layer.load_state_dict(old)
        assert float(layer.strategy.mean_module.temperature) == 0.25
