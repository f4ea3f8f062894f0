"""STO-TRANS and the shared Gumbel-softmax machinery (docs/derivations.md §3; Pei et al. eqs. 9–11).

References are written here independently in float64 from the layer's weights; Monte-Carlo checks
state their tolerances (chi-square at level 1e-4, moment bounds at ≥ 5 standard errors).
"""

import math

import pytest
import torch
from _sto_helpers import heads_float64, out_float64
from scipy import stats

import gpattn
from gpattn.attention._gumbel import gumbel_attention, gumbel_noise, gumbel_softmax, straight_through_one_hot
from gpattn.attention.sto import STO_PRESETS
from gpattn.testing import ATTENTION_INVARIANTS, make_inputs, run_attention_invariant

EULER_GAMMA = 0.5772156649015329


def _layer(D=8, H=2, seed=0, **opts):
    torch.manual_seed(seed)
    return gpattn.build_attention("sto", D, H, **opts)


# ---------------------------------------------------------------------------------------------- noise
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gumbel_noise_distribution(dtype):
    """Mean γ, variance π²/6, Kolmogorov–Smirnov against the Gumbel CDF; finite; reproducible."""
    torch.manual_seed(0)
    n = 400_000
    g = gumbel_noise((n,), dtype=dtype)
    assert g.dtype == dtype and torch.isfinite(g).all()
    g64 = g.double()
    var = math.pi**2 / 6
    assert abs(g64.mean().item() - EULER_GAMMA) < 5 * math.sqrt(var / n)
    # Var of the sample variance of a Gumbel: (μ4 − σ⁴)/n with excess kurtosis 12/5
    assert abs(g64.var().item() - var) < 5 * math.sqrt((12 / 5 + 2) * var**2 / n)
    ks = stats.kstest(g64.numpy(), stats.gumbel_r.cdf)
    assert ks.pvalue > 1e-4, ks
    torch.manual_seed(3)
    a = gumbel_noise((4, 5), dtype=dtype, scale=0.5)
    torch.manual_seed(3)
    b = gumbel_noise((4, 5), dtype=dtype)
    torch.testing.assert_close(a, 0.5 * b, rtol=1e-6, atol=0)
    assert not torch.equal(b, gumbel_noise((4, 5), dtype=dtype))


@pytest.mark.parametrize("dtype, n", [(torch.float32, 2**21 + 3), (torch.float64, 2**20 + 1)])
def test_gumbel_noise_two_streams_do_not_depend_on_threads(dtype, n):
    """Large draws come from two spawned streams (drawn in two threads when allowed): the same seed
    gives the same bits with 1 or 2 threads, both halves are Gumbel and they are uncorrelated."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        a = gumbel_noise((n,), dtype=dtype)
        torch.set_num_threads(2)
        torch.manual_seed(0)
        b = gumbel_noise((n,), dtype=dtype)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(a, b)
    h = n // 2
    first, second = a[:h].double(), a[h : 2 * h].double()
    se = math.sqrt(math.pi**2 / 6 / h)
    for half in (first, second):
        assert abs(half.mean().item() - EULER_GAMMA) < 5 * se
    corr = torch.corrcoef(torch.stack([first, second]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(h)


def test_gumbel_noise_generator_and_low_precision():
    g1 = gumbel_noise((3, 7), generator=torch.Generator().manual_seed(5))
    g2 = gumbel_noise((3, 7), generator=torch.Generator().manual_seed(5))
    assert torch.equal(g1, g2)
    torch.manual_seed(0)
    h = gumbel_noise((50_000,), dtype=torch.bfloat16)
    assert h.dtype == torch.bfloat16 and abs(h.double().mean().item() - EULER_GAMMA) < 0.03


# ------------------------------------------------------------------------------- rows and padding
@pytest.mark.parametrize("hard", [False, True])
def test_rows_sum_to_one_and_padded_keys_get_zero(hard):
    layer = _layer(hard=hard, tau=1.0)
    layer.store_weights = True
    x, mask = make_inputs(B=3, T=7, pad=(0, 2, 5), seed=1)
    x = 3 * x
    torch.manual_seed(2)
    layer(x, mask)
    w = layer.last_weights  # shape: (B, H, T, T)
    assert w.shape == (3, 2, 7, 7) and not w.requires_grad
    pad = mask[:, None, None, :].expand_as(w)
    assert torch.equal(w[pad], torch.zeros_like(w[pad])), "padded keys must get exactly 0"
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 7), rtol=0, atol=1e-6)
    if hard:
        assert torch.equal(w.sum(-1), torch.ones(3, 2, 7))
        assert torch.equal((w == 1).sum(-1), torch.ones(3, 2, 7, dtype=torch.long)), "not one-hot"
    else:
        assert (w[~pad] > 0).all(), "soft samples put positive weight on every real key"


def test_gumbel_softmax_masking_before_noise():
    """The mask is applied before the noise: renormalised over the kept entries, exact zeros."""
    torch.manual_seed(0)
    logits = torch.randn(500, 6, dtype=torch.float64)
    mask = torch.zeros(500, 6, dtype=torch.bool)
    mask[:, 4:] = True
    noise = gumbel_noise((500, 6), dtype=torch.float64)
    for hard in (False, True):
        w = gumbel_softmax(logits, 0.7, mask=mask, hard=hard, noise=noise)
        assert torch.equal(w[mask], torch.zeros(1000, dtype=torch.float64))
        ref = torch.softmax((logits[:, :4] + noise[:, :4]) / 0.7, -1)  # the sample on the kept entries
        if hard:
            ref = torch.nn.functional.one_hot(ref.argmax(-1), 4).double()
        torch.testing.assert_close(w[:, :4], ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ Gumbel-max statistics
def _chi2(counts, probs, n):
    """Pearson statistic summed over rows. # shape: counts, probs (R, K)"""
    expected = n * probs
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("hard", [True, False])
def test_gumbel_max_statistics_of_the_layer(hard):
    """argmax frequencies of the layer's samples follow Categorical(softmax(q kᵀ)) over the real keys
    — not softmax(q kᵀ/τ): τ never changes which key wins (Gumbel-max). Pearson chi-square at level
    1e-4 over 3000 i.i.d. draws of each of H·T rows; the same statistic against the τ-scaled
    probabilities must be far beyond the threshold (the test has power)."""
    Bn, T, D, H = 3000, 5, 8, 2
    layer = _layer(D=D, H=H, hard=hard, tau=2.0)
    layer.store_weights = True
    torch.manual_seed(4)
    x1 = 1.0 * torch.randn(1, T, D)
    mask1 = torch.tensor([[False, False, False, False, True]])
    x, mask = x1.expand(Bn, T, D).contiguous(), mask1.expand(Bn, T).contiguous()
    torch.manual_seed(5)
    with torch.no_grad():
        layer(x, mask)
    w = layer.last_weights.double()  # shape: (Bn, H, T, T)
    win = torch.nn.functional.one_hot(w.argmax(-1), T).double()
    counts = win.sum(0)[..., :4].reshape(H * T, 4)  # real keys only
    assert torch.equal(win.sum(0)[..., 4], torch.zeros(H, T, dtype=torch.float64)), "padded key won"
    q, k, _ = heads_float64(layer, x1)
    logits = (q @ k.transpose(-1, -2))[0, ..., :4].reshape(H * T, 4)
    probs = torch.softmax(logits, -1)
    assert (Bn * probs).min() > 5, "test design: expected counts too small for chi-square"
    df = H * T * 3
    threshold = stats.chi2.ppf(1 - 1e-4, df)
    assert _chi2(counts, probs, Bn) < threshold
    wrong = torch.softmax(logits / layer.tau, -1)
    assert _chi2(counts, wrong, Bn) > 10 * threshold
    # total variation per row, a direct bound: ≤ 0.05 with 3000 draws of 4 categories
    tv = 0.5 * (counts / Bn - probs).abs().sum(-1)
    assert tv.max() < 0.05


def test_gumbel_softmax_hard_frequencies_match_softmax():
    """The shared sampler alone: 20 000 hard draws of one 6-way row, TV ≤ 0.015, chi-square at 1e-4."""
    torch.manual_seed(6)
    logits = torch.tensor([1.5, 0.2, -0.7, 0.9, 0.0, -2.0], dtype=torch.float64)
    n = 20_000
    w = gumbel_softmax(logits.expand(n, 6), 3.0, hard=True)
    counts = w.sum(0)
    probs = torch.softmax(logits, -1)
    assert torch.equal(w.sum(-1), torch.ones(n, dtype=torch.float64))
    assert _chi2(counts[None], probs[None], n) < stats.chi2.ppf(1 - 1e-4, 5)
    assert 0.5 * (counts / n - probs).abs().sum() < 0.015


# ------------------------------------------------------------------------------------- temperature
def test_large_tau_gives_near_uniform_rows_small_tau_near_one_hot():
    x, mask = make_inputs(B=4, T=9, pad=(0, 3, 6, 1), seed=7)
    n_real = (~mask).sum(-1).double()[:, None, None, None]  # shape: (B, 1, 1, 1)
    hot = _layer(tau=1e4)
    hot.store_weights = True
    torch.manual_seed(8)
    hot(x, mask)
    w = hot.last_weights.double()
    real = ~mask[:, None, None, :].expand_as(w)
    # |logits + G| < 60 here, so n·w stays within e^{±120/τ} of 1
    dev = (w * n_real - 1).abs()[real]
    assert dev.max() < math.expm1(120 / 1e4)
    cold = _layer(tau=1e-5)
    cold.store_weights = True
    torch.manual_seed(8)
    cold(x, mask)
    soft = cold.last_weights
    assert (soft.max(-1).values > 0.999).double().mean() > 0.99
    hard = _layer(tau=1e-5, hard=True)
    hard.store_weights = True
    torch.manual_seed(8)
    hard(x, mask)
    # same seed, same noise: the τ → 0 soft sample is the hard sample (Gumbel-max)
    agree = (soft.argmax(-1) == hard.last_weights.argmax(-1)).double().mean()
    assert agree == 1.0


# ------------------------------------------------------------------------------------ deterministic
@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("tau", [None, 0.5, 7.0])
def test_deterministic_equals_noise_free_softmax(hard, tau):
    layer = _layer(hard=hard, tau=tau).double()
    x, mask = make_inputs(B=3, T=6, pad=(0, 2, 4), dtype=torch.float64, seed=9)
    with gpattn.deterministic():
        y = layer(x, mask)
    q, k, v = heads_float64(layer, x)
    t = math.sqrt(layer.head_dim) if tau is None else tau
    logits = (q @ k.transpose(-1, -2) / t).masked_fill(mask[:, None, None, :], float("-inf"))
    ref = out_float64(layer, torch.softmax(logits, -1) @ v)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    torch.manual_seed(0)
    assert not torch.allclose(layer(x, mask), ref, atol=1e-6), "outside deterministic() the layer must sample"


def test_default_tau_noise_free_is_softmax_attention():
    """τ = √Dh by default: under deterministic() STO-TRANS with softmax's weights is softmax attention."""
    sto = _layer(D=16, H=4)
    soft = gpattn.build_attention("softmax", 16, 4)
    soft.load_state_dict(sto.state_dict())
    x, mask = make_inputs(B=2, T=5, D=16, seed=10)
    with gpattn.deterministic():
        torch.testing.assert_close(sto(x, mask), soft(x, mask), rtol=1e-5, atol=1e-6)
    assert sto.tau == 2.0


# --------------------------------------------------------------------------- fused vs explicit path
def test_fused_and_explicit_paths_draw_the_same_sample():
    """store_weights switches to the explicit path; the same seed gives the same sample, and the
    stored weights reproduce the output."""
    layer = _layer(tau=0.8)
    x, mask = make_inputs(B=3, T=6, pad=(0, 2, 4), seed=11)
    torch.manual_seed(12)
    y_fused = layer(x, mask)
    assert layer.last_weights is None
    layer.store_weights = True
    torch.manual_seed(12)
    y_expl = layer(x, mask)
    torch.testing.assert_close(y_fused, y_expl, rtol=1e-5, atol=1e-6)
    _, _, v = heads_float64(layer, x)
    torch.testing.assert_close(
        out_float64(layer, layer.last_weights.double() @ v).float(), y_expl, rtol=1e-5, atol=1e-5
    )
    layer.store_weights = False
    layer(x, mask)
    assert layer.last_weights is None, "weights of an older forward must not linger"


# ------------------------------------------------------------------------------------------ gradients
def test_straight_through_gradients_reach_q_k_v():
    """Hard samples: forward one-hot, backward of the soft sample with the same noise. The gradient
    to v is one-hotᵀ g; to q and k that of the soft relaxation with v held fixed (reference with the
    `hard + soft − soft.detach()` identity, written independently)."""
    torch.manual_seed(13)
    B, H, T, Dh = 2, 2, 5, 3
    q, k, v = (torch.randn(B, H, T, Dh, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    g = torch.randn(B, H, T, Dh, dtype=torch.float64)
    torch.manual_seed(14)
    out, w = gumbel_attention(q, k, v, 0.9, mask=mask, hard=True, return_weights=True)
    (out * g).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t, gr in zip((q, k, v), grads):
        assert torch.isfinite(gr).all() and (gr != 0).any()
        t.grad = None
    torch.manual_seed(14)
    noise = gumbel_noise((B, H, T, T), dtype=torch.float64)  # the same draw as inside
    logits = (q @ k.transpose(-1, -2)).masked_fill(mask[:, None, None, :], float("-inf")) + noise
    soft = torch.softmax(logits / 0.9, -1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), T).double()
    assert torch.equal(w, one_hot)
    ref = (one_hot + soft - soft.detach()) @ v
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-14)
    (ref * g).sum().backward()
    for t, gr in zip((q, k, v), grads):
        torch.testing.assert_close(gr, t.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[2], one_hot.transpose(-1, -2) @ g)


def test_soft_gumbel_softmax_gradcheck_and_straight_through_identity():
    torch.manual_seed(15)
    logits = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    noise = gumbel_noise((3, 4), dtype=torch.float64)
    mask = torch.tensor([[False, False, True, False]])
    assert torch.autograd.gradcheck(lambda z: gumbel_softmax(z, 0.6, mask=mask, noise=noise), (logits,))
    soft = torch.softmax(logits, -1)
    st = straight_through_one_hot(soft, soft.argmax(-1, keepdim=True))
    g = torch.randn(3, 4, dtype=torch.float64)
    (gs,) = torch.autograd.grad((st * g).sum(), logits, retain_graph=True)
    (gr,) = torch.autograd.grad((soft * g).sum(), logits)
    torch.testing.assert_close(gs, gr)


# ------------------------------------------------------------------------------- options and errors
@pytest.mark.parametrize("check", sorted(ATTENTION_INVARIANTS))
def test_invariants_with_hard_samples(check):
    run_attention_invariant(check, "sto", hard=True, tau=1.0)


def test_presets_build_with_the_papers_temperatures():
    assert {p["tau"] for p in STO_PRESETS.values()} == {1.0, 40.0}
    for opts in STO_PRESETS.values():
        layer = gpattn.build_attention("sto", 8, 2, **opts)
        assert layer.tau == opts["tau"] and layer.hard is False


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_tau_is_rejected(bad):
    with pytest.raises(ValueError, match="tau"):
        gpattn.build_attention("sto", 8, 2, tau=bad)


def test_bad_hard_is_rejected_and_no_posterior():
    with pytest.raises(ValueError, match="hard"):
        gpattn.build_attention("sto", 8, 2, hard=1)
    layer = _layer()
    assert layer.stochastic and not layer.is_gp
    with pytest.raises(NotImplementedError, match="sto"):
        layer.posterior(torch.randn(1, 3, 8))
