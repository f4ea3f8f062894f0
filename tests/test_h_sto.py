"""H-STO-TRANS (docs/derivations.md §4; Pei et al. eqs. 14–17, Algorithm 1, Proposition 3.1).

float64 references are written here from the layer's weights; Monte-Carlo checks state their
tolerances (chi-square at level 1e-4).
"""

import math

import pytest
import torch
from _sto_helpers import heads_float64, out_float64
from scipy import stats

import gpattn
from gpattn.attention._gumbel import gumbel_noise
from gpattn.attention.h_sto import H_STO_PRESETS, centroid_attention, hierarchical_gumbel_attention
from gpattn.testing import ATTENTION_INVARIANTS, make_inputs, run_attention_invariant


def _layer(D=8, H=2, seed=0, **opts):
    torch.manual_seed(seed)
    return gpattn.build_attention("h-sto", D, H, **opts)


def _reference(layer, x, mask):
    """Noise-free eqs. 14–17 in float64, head by head with explicit loops over heads."""
    q, k, v = heads_float64(layer, x)
    C = layer.centroids.detach().double()
    outs = []
    for h in range(layer.num_heads):
        Ch = C[h] if layer.per_head_centroids else C  # shape: (Dh, c)
        qh, kh, vh = q[:, h], k[:, h], v[:, h]
        if layer.cluster == "key":
            kh = torch.softmax(kh @ Ch / layer.tau1, -1) @ Ch.T  # k̂ = â_c Cᵀ
        else:
            qh = torch.softmax(qh @ Ch / layer.tau1, -1) @ Ch.T  # q̂ = â_c Cᵀ
        logits = qh @ kh.transpose(-1, -2) / layer.tau2
        if mask is not None:
            logits = logits.masked_fill(mask[:, None, :], float("-inf"))
        outs.append(torch.softmax(logits, -1) @ vh)
    return out_float64(layer, torch.stack(outs, 1))


# ------------------------------------------------------------------------------------ deterministic
@pytest.mark.parametrize("cluster", ["key", "query"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("hard", [False, True])
def test_deterministic_equals_noise_free_reference(cluster, per_head, hard):
    layer = _layer(
        num_centroids=3, tau1=0.7, tau2=1.3, cluster=cluster, per_head_centroids=per_head,
        hard_centroids=hard, hard_values=hard,
    ).double()
    with torch.no_grad():
        layer.centroids.mul_(4.0)  # assignments away from uniform
    x, mask = make_inputs(B=3, T=6, pad=(0, 2, 4), dtype=torch.float64, seed=1)
    x = 2 * x
    with gpattn.deterministic():
        y = layer(x, mask)
    ref = _reference(layer, x, mask)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    torch.manual_seed(0)
    assert not torch.allclose(layer(x, mask), ref, atol=1e-6), "outside deterministic() the layer must sample"


def test_centroid_shapes_and_defaults():
    layer = _layer(D=12, H=3)
    assert layer.centroids.shape == (4, 2) and layer.num_centroids == 2
    assert (layer.tau1, layer.tau2, layer.cluster) == (1.0, 1.0, "key")
    assert not layer.hard_centroids and not layer.hard_values
    per_head = _layer(D=12, H=3, per_head_centroids=True, num_centroids=5)
    assert per_head.centroids.shape == (3, 4, 5)


# ------------------------------------------------------------------------------- rows and padding
@pytest.mark.parametrize("hard_centroids", [False, True])
@pytest.mark.parametrize("hard_values", [False, True])
@pytest.mark.parametrize("cluster", ["key", "query"])
def test_rows_sum_to_one_and_padded_keys_get_zero(hard_centroids, hard_values, cluster):
    layer = _layer(hard_centroids=hard_centroids, hard_values=hard_values, cluster=cluster, tau2=0.5)
    layer.store_weights = True
    x, mask = make_inputs(B=3, T=7, pad=(0, 2, 5), seed=2)
    torch.manual_seed(3)
    y = layer(x, mask)
    a_v, a_c = layer.last_weights, layer.last_centroid_weights
    assert a_v.shape == (3, 2, 7, 7) and a_c.shape == (3, 2, 7, 2)
    assert not a_v.requires_grad and not a_c.requires_grad
    pad = mask[:, None, None, :].expand_as(a_v)
    assert torch.equal(a_v[pad], torch.zeros_like(a_v[pad])), "padded keys must get exactly 0"
    torch.testing.assert_close(a_v.sum(-1), torch.ones(3, 2, 7), rtol=0, atol=1e-6)
    torch.testing.assert_close(a_c.sum(-1), torch.ones(3, 2, 7), rtol=0, atol=1e-6)
    for w, hard in ((a_v, hard_values), (a_c, hard_centroids)):
        if hard:
            assert torch.equal((w == 1).sum(-1), torch.ones(w.shape[:-1], dtype=torch.long)), "not one-hot"
            assert torch.equal(w.sum(-1), torch.ones(w.shape[:-1]))
    # the stored weights are the ones used: eq. 17 reproduces the output
    _, _, v = heads_float64(layer, x)
    torch.testing.assert_close(out_float64(layer, a_v.double() @ v).float(), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cluster", ["key", "query"])
def test_fused_and_explicit_paths_draw_the_same_sample(cluster):
    layer = _layer(cluster=cluster, tau2=0.9)
    x, mask = make_inputs(B=3, T=6, pad=(0, 2, 4), seed=4)
    torch.manual_seed(5)
    y_fused = layer(x, mask)
    assert layer.last_weights is None and layer.last_centroid_weights is None
    layer.store_weights = True
    torch.manual_seed(5)
    y_expl = layer(x, mask)
    torch.testing.assert_close(y_fused, y_expl, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ Gumbel-max statistics
def test_hard_centroid_assignments_follow_softmax_of_k_c():
    """Hard centroid samples: argmax frequencies = softmax(k C) (τ1-free), chi-square at 1e-4 over
    4000 draws of H·T rows with c = 3; against softmax(k C/τ1) the statistic is far larger."""
    Bn, T, D, H = 4000, 4, 8, 2
    layer = _layer(D=D, H=H, num_centroids=3, tau1=3.0, hard_centroids=True)
    with torch.no_grad():
        layer.centroids.mul_(3.0)
    layer.store_weights = True
    torch.manual_seed(6)
    x1 = torch.randn(1, T, D)
    torch.manual_seed(7)
    with torch.no_grad():
        layer(x1.expand(Bn, T, D).contiguous())
    counts = layer.last_centroid_weights.double().sum(0).reshape(H * T, 3)
    _, k, _ = heads_float64(layer, x1)
    logits = (k @ layer.centroids.detach().double())[0].reshape(H * T, 3)
    probs = torch.softmax(logits, -1)
    assert (Bn * probs).min() > 5, "test design: expected counts too small for chi-square"
    threshold = stats.chi2.ppf(1 - 1e-4, H * T * 2)

    def chi2(p):
        return float(((counts - Bn * p) ** 2 / (Bn * p)).sum())

    assert chi2(probs) < threshold
    assert chi2(torch.softmax(logits / 3.0, -1)) > 10 * threshold


# ---------------------------------------------------------------------------------- Proposition 3.1
def _prop31_terms(ki, kj, C, tau, noise=None):
    """‖G(k_i C/τ) − G(k_j C/τ)‖ and ‖k_i − k_j‖ ‖C‖₂/τ through the layer's centroid step.
    # shape: ki, kj (N, Dh), C (N, Dh, c) -> (N,), (N,)"""
    x = torch.stack([ki, kj], 1)[:, None]  # shape: (N, 1, 2, Dh): token axis holds the pair
    if noise is None:
        a = centroid_attention(x, C[:, None], tau, sample=False)  # shape: (N, 1, 2, c)
    else:
        from gpattn.attention._gumbel import gumbel_softmax

        a = gumbel_softmax(x @ C[:, None], tau, noise=noise)
    lhs = (a[:, 0, 0] - a[:, 0, 1]).norm(dim=-1)
    rhs = (ki - kj).norm(dim=-1) * torch.linalg.matrix_norm(C, ord=2) / tau
    return lhs, rhs


def test_proposition_3_1_bound_holds_on_random_draws():
    """Random k_i, k_j, C, τ (10 000 cases, varied scales): ‖G(k_i C/τ) − G(k_j C/τ)‖ ≤
    ‖k_i − k_j‖ ‖C‖₂/τ — and even ≤ half of it, the Lipschitz constant of softmax being ½."""
    g = torch.Generator().manual_seed(8)
    N, Dh = 10_000, 6
    for c in (2, 5):
        scale = torch.exp(2 * torch.randn(N, 1, generator=g, dtype=torch.float64))
        ki = scale * torch.randn(N, Dh, generator=g, dtype=torch.float64)
        kj = ki + scale * torch.exp(torch.randn(N, 1, generator=g, dtype=torch.float64)) * torch.randn(
            N, Dh, generator=g, dtype=torch.float64
        )
        C = torch.randn(N, Dh, c, generator=g, dtype=torch.float64)
        tau = float(torch.exp(torch.randn((), generator=g)))
        lhs, rhs = _prop31_terms(ki, kj, C, tau)
        assert (lhs <= rhs * (1 + 1e-12)).all()
        assert (lhs <= 0.5 * rhs * (1 + 1e-12)).all()
        # with a shared noise draw the sampled assignments obey the same bound (the noise cancels)
        noise = gumbel_noise((N, 1, 2, c), dtype=torch.float64, generator=g)
        noise[:, :, 1] = noise[:, :, 0]
        lhs_s, _ = _prop31_terms(ki, kj, C, tau, noise=noise)
        assert (lhs_s <= 0.5 * rhs * (1 + 1e-12)).all()
        assert (lhs / rhs).max() > 0.2, "no draw comes near the bound: the property test is too weak"


def test_proposition_3_1_near_tight_case():
    """C = [w, −w], k_{i,j} = ±(ε/2) w/‖w‖, p = (½, ½) at the midpoint: the ratio to the bound is
    tanh(δ/2)/δ → ½ (δ = ε‖w‖/τ), so the bound is tight up to softmax's Lipschitz constant ½."""
    torch.manual_seed(9)
    w = torch.randn(5, dtype=torch.float64)
    C = torch.stack([w, -w], -1)[None]  # shape: (1, Dh, 2)
    u = w / w.norm()
    for eps, tau in ((1e-3, 1.0), (1e-2, 0.3), (0.1, 2.0)):
        lhs, rhs = _prop31_terms(eps / 2 * u[None], -eps / 2 * u[None], C, tau)
        delta = eps * w.norm() / tau
        ratio = float(lhs / rhs)
        assert ratio == pytest.approx(float(torch.tanh(delta / 2) / delta), rel=1e-9)
        if delta < 0.05:
            assert 0.499 < ratio <= 0.5


# ------------------------------------------------------------------------------------------ gradients
def test_straight_through_gradients_reach_q_k_v_and_centroids():
    """hard/hard: exact one-hot forward, soft backward. Gradients to q, k, v, C are finite, non-zero
    and equal a reference built with the `hard + soft − soft.detach()` identity and the same noise."""
    torch.manual_seed(10)
    B, H, T, Dh, c = 2, 2, 5, 4, 3
    q, k, v = (torch.randn(B, H, T, Dh, dtype=torch.float64, requires_grad=True) for _ in range(3))
    C = torch.randn(Dh, c, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    g = torch.randn(B, H, T, Dh, dtype=torch.float64)
    tau1, tau2 = 0.8, 1.7
    torch.manual_seed(11)
    out, a_v, a_c = hierarchical_gumbel_attention(
        q, k, v, C, tau1=tau1, tau2=tau2, mask=mask, hard_centroids=True, hard_values=True, return_weights=True
    )
    (out * g).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, C)]
    for t, gr in zip((q, k, v, C), grads):
        assert torch.isfinite(gr).all() and (gr != 0).any()
        t.grad = None

    def st(logits, tau):
        soft = torch.softmax(logits / tau, -1)
        hard = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
        return hard + soft - soft.detach()

    torch.manual_seed(11)
    g1 = gumbel_noise((B, H, T, c), dtype=torch.float64)  # drawn first: centroid step
    g2 = gumbel_noise((B, H, T, T), dtype=torch.float64)  # then the value step
    ref_c = st(k @ C + g1, tau1)
    k_hat = ref_c @ C.T
    logits = (q @ k_hat.transpose(-1, -2)).masked_fill(mask[:, None, None, :], float("-inf"))
    ref = st(logits + g2, tau2) @ v
    # the forward values are exact one-hots (the reference identity is one only up to rounding)
    assert torch.equal(a_c, torch.nn.functional.one_hot((k @ C + g1).argmax(-1), c).double())
    assert torch.equal(a_v, torch.nn.functional.one_hot((logits + g2).argmax(-1), T).double())
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
    (ref * g).sum().backward()
    for t, gr in zip((q, k, v, C), grads):
        torch.testing.assert_close(gr, t.grad, rtol=1e-9, atol=1e-11)


def test_centroid_parameter_gets_gradient_in_every_mode():
    for opts in ({}, {"hard_centroids": True, "hard_values": True}, {"cluster": "query"}, {"per_head_centroids": True}):
        layer = _layer(**opts)
        x, mask = make_inputs(B=2, T=5, seed=12)
        torch.manual_seed(13)
        layer(x, mask).pow(2).sum().backward()
        assert torch.isfinite(layer.centroids.grad).all() and (layer.centroids.grad != 0).any(), opts


# ------------------------------------------------------------------------------- options and errors
@pytest.mark.parametrize("check", sorted(ATTENTION_INVARIANTS))
@pytest.mark.parametrize(
    "opts",
    [
        {"hard_centroids": True, "hard_values": True},
        {"cluster": "query", "per_head_centroids": True, "num_centroids": 3},
    ],
    ids=["hard-hard", "query-per-head"],
)
def test_invariants_with_options(check, opts):
    run_attention_invariant(check, "h-sto", **opts)


def test_presets_are_the_papers_settings():
    assert {p["tau2"] for k, p in H_STO_PRESETS.items() if k.startswith("imdb")} == {20.0, 30.0}
    assert all(p["tau1"] == 1.0 for p in H_STO_PRESETS.values())
    assert H_STO_PRESETS["cola"]["tau2"] == 1.0
    for opts in H_STO_PRESETS.values():
        layer = gpattn.build_attention("h-sto", 8, 2, **opts)
        for key, val in opts.items():
            assert getattr(layer, key) == val


@pytest.mark.parametrize(
    "opts, word",
    [
        ({"num_centroids": 0}, "num_centroids"),
        ({"num_centroids": 2.0}, "num_centroids"),
        ({"tau1": 0.0}, "tau1"),
        ({"tau2": -3.0}, "tau2"),
        ({"tau2": math.nan}, "tau2"),
        ({"cluster": "value"}, "cluster"),
        ({"hard_values": "yes"}, "hard_values"),
        ({"hard_centroids": 1}, "hard_centroids"),
        ({"per_head_centroids": None}, "per_head_centroids"),
    ],
)
def test_bad_options_are_rejected(opts, word):
    with pytest.raises(ValueError, match=word):
        gpattn.build_attention("h-sto", 8, 2, **opts)


def test_not_a_gp_variant():
    layer = _layer()
    assert layer.stochastic and not layer.is_gp
    with pytest.raises(NotImplementedError, match="h-sto"):
        layer.posterior(torch.randn(1, 3, 8))
