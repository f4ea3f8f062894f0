# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Gumbel-softmax attention: Gumbel-max statistics, temperature, hard vs soft, Proposition 3.1
#
# `sto` and `h-sto` (docs/derivations.md §3–4, Pei et al.) replace the softmax of attention with a Gumbel-softmax
# sample $\hat A = \mathrm{softmax}((q k^\top + G)/\tau)$, $G_{ij} \sim \mathrm{Gumbel}(0, 1)$ i.i.d.,
# padded keys at $-\infty$ *before* the noise; `h-sto` first lets every key attend to $c$ learnable
# centroids, $\hat a_c = \mathcal G(k C/\tau_1)$, $\hat k = \hat a_c C^\top$,
# $\hat a_v = \mathcal G(q \hat k^\top/\tau_2)$.
#
# This notebook checks, on the layers themselves:
# 1. the noise is Gumbel(0, 1) (histogram, moments, Kolmogorov–Smirnov);
# 2. **Gumbel-max**: the winners of the layer's samples are Categorical(softmax($q k^\top$)) — whatever
#    τ, and never a padded key;
# 3. **temperature**: τ → 0 gives one-hot rows, τ → ∞ uniform rows over the real keys; the row
#    entropy of a sample increases monotonically with τ;
# 4. **hard vs soft**: the Monte-Carlo mean of hard (straight-through) rows converges to
#    softmax($q k^\top$) at rate $1/\sqrt P$, while the mean of soft rows is *not* the noise-free
#    softmax($q k^\top/\tau$) — a τ-dependent gap; under `gpattn.deterministic()` the layers are exactly
#    the noise-free attentions (float64 brute force);
# 5. **Proposition 3.1** (the centroid step is Lipschitz): random pairs never exceed
#    $\|k_i - k_j\|\,\|C\|_2/\tau$, in fact never half of it (softmax is ½-Lipschitz), and a constructed
#    pair attains the ½;
# 6. the straight-through gradient equals the gradient of the soft sample with the same noise.

# %%
import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy import stats

import gpattn
from gpattn.attention._gumbel import gumbel_noise, gumbel_softmax
from gpattn.attention.h_sto import centroid_attention

SIZE = os.environ.get("GPATTN_NOTEBOOK_SIZE", "full")
OUT = Path(os.environ.get("GPATTN_NOTEBOOK_OUT", "runs/notebooks")) / "gumbel_attention"
OUT.mkdir(parents=True, exist_ok=True)
CI = SIZE == "ci"
N_NOISE = 200_000 if CI else 2_000_000  # noise draws for the histogram
N_DRAWS = 4_000 if CI else 40_000  # i.i.d. layer samples for the Gumbel-max statistics
N_PAIRS = 20_000 if CI else 200_000  # random pairs for Proposition 3.1
P_MAX = 2_000 if CI else 20_000  # Monte-Carlo samples for the hard/soft means
torch.manual_seed(0)
print(f"SIZE={SIZE}, plots -> {OUT}")


def heads(layer, x):
    """float64 per-head q, k, v of a layer from its fused input projection. # shape: (B, H, T, Dh)"""
    W, b = layer.in_proj.weight.detach().double(), layer.in_proj.bias.detach().double()
    B, T, D = x.shape
    qkv = x.double() @ W.T + b
    return [t.reshape(B, T, layer.num_heads, -1).transpose(1, 2) for t in qkv.split(D, dim=-1)]


# %% [markdown]
# ## 1. The noise
# $G = -\log(-\log U)$ with $U$ on the centred grid $(2i+1)2^{-24}$ (never 0 or 1, so $G$ is always
# finite). Mean $\gamma \approx 0.5772$, variance $\pi^2/6$.

# %%
g = gumbel_noise((N_NOISE,)).double().numpy()
ks = stats.kstest(g, stats.gumbel_r.cdf)
print(f"mean {g.mean():.4f} (γ = {np.euler_gamma:.4f}), var {g.var():.4f} (π²/6 = {math.pi**2 / 6:.4f})")
print(f"KS statistic {ks.statistic:.2e}, p = {ks.pvalue:.3f}; range [{g.min():.2f}, {g.max():.2f}]")
grid = np.linspace(-3, 10, 400)
fig, ax = plt.subplots(figsize=(5, 3.2))
ax.hist(g, bins=200, range=(-3, 10), density=True, alpha=0.6, label="gumbel_noise")
ax.plot(grid, stats.gumbel_r.pdf(grid), "k", lw=1.2, label="Gumbel(0, 1) pdf")
ax.set(xlabel="G", ylabel="density", title="Gumbel noise")
ax.legend()
fig.tight_layout()
fig.savefig(OUT / "noise_histogram.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## 2. Gumbel-max statistics through the layer
# One sequence of T = 6 tokens, the last key padded, repeated `N_DRAWS` times in the batch: every
# (head, query) row of the hard samples is an i.i.d. draw. Gumbel-max says the winner is
# Categorical(softmax($q_i k^\top$)) over the real keys — the temperature does not enter (it only shapes
# the straight-through gradient), so the τ-scaled softmax is the wrong reference. With the same seed
# the winners are *identical* for every τ.

# %%
T, D, H = 6, 8, 2
x1 = torch.randn(1, T, D)
mask1 = torch.zeros(1, T, dtype=torch.bool)
mask1[0, -1] = True
taus = [0.5, 2.0, 8.0]
freqs, pvals, pvals_wrong, winners = {}, {}, {}, {}
for tau in taus:
    torch.manual_seed(1)
    layer = gpattn.build_attention("sto", D, H, tau=tau, hard=True)
    layer.store_weights = True
    torch.manual_seed(2)
    with torch.no_grad():
        layer(x1.expand(N_DRAWS, T, D).contiguous(), mask1.expand(N_DRAWS, T).contiguous())
    w = layer.last_weights.double()  # shape: (N_DRAWS, H, T, T)
    assert torch.equal(w.sum(-1), torch.ones(w.shape[:-1], dtype=torch.float64))
    counts = w.sum(0)  # shape: (H, T, T): wins per (head, query, key)
    winners[tau] = w.argmax(-1)
    q, k, _ = heads(layer, x1)
    logits = (q @ k.transpose(-1, -2))[0]  # shape: (H, T, T)
    probs = torch.softmax(logits[..., :-1], -1)
    wrong = torch.softmax(logits[..., :-1] / tau, -1)
    obs = counts[..., :-1].reshape(-1, T - 1)
    chi2 = float(((obs - N_DRAWS * probs.reshape(-1, T - 1)) ** 2 / (N_DRAWS * probs.reshape(-1, T - 1))).sum())
    chi2_wrong = float(((obs - N_DRAWS * wrong.reshape(-1, T - 1)) ** 2 / (N_DRAWS * wrong.reshape(-1, T - 1))).sum())
    df = H * T * (T - 2)
    pvals[tau], pvals_wrong[tau] = stats.chi2.sf(chi2, df), stats.chi2.sf(chi2_wrong, df)
    freqs[tau] = (counts[0, 0] / N_DRAWS, probs[0, 0], wrong[0, 0], float(counts[..., -1].sum()))
    print(
        f"τ = {tau:4}: chi-square vs softmax(qkᵀ) p = {pvals[tau]:.3f}; vs softmax(qkᵀ/τ) p = {pvals_wrong[tau]:.1e};"
        f" wins of the padded key: {freqs[tau][3]:.0f}"
    )
fig, axes = plt.subplots(1, len(taus), figsize=(11, 3), sharey=True)
for ax, tau in zip(axes, taus):
    f, p, pw, _ = freqs[tau]
    idx = np.arange(T)
    ax.bar(idx - 0.25, f.numpy(), 0.25, label="sample frequency")
    ax.bar(idx, np.append(p.numpy(), 0), 0.25, label="softmax(q kᵀ)")
    ax.bar(idx + 0.25, np.append(pw.numpy(), 0), 0.25, label="softmax(q kᵀ/τ)")
    ax.set(title=f"hard samples, τ = {tau}", xlabel="key (5 = padded)")
axes[0].set_ylabel("P(winner) — head 0, query 0")
axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(OUT / "gumbel_max.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## 3. Temperature sweep
# The same noise draw at every τ (same seed): the entropy of softmax$(z/\tau)$ increases with τ for any
# fixed $z$, from 0 (one-hot, the Gumbel-max winner) to $\log n$ (uniform over the n real keys).

# %%
T2 = 12
x2 = 2 * torch.randn(4, T2, D)
mask2 = torch.zeros(4, T2, dtype=torch.bool)
mask2[1, 8:] = True
mask2[3, 3:] = True
n_real = (~mask2).sum(-1).double()  # shape: (B,)
tau_grid = np.logspace(-4, 4, 17)
ent, ent_det, hard_agree = [], [], []


def row_entropy(w):
    return -(w * torch.log(w.clamp_min(1e-300))).sum(-1)  # shape: (B, H, T)


for tau in tau_grid:
    torch.manual_seed(3)
    layer = gpattn.build_attention("sto", D, H, tau=float(tau)).double()
    layer.store_weights = True
    torch.manual_seed(4)
    with torch.no_grad():
        layer(x2.double(), mask2)
    ent.append(row_entropy(layer.last_weights))
    with gpattn.deterministic(), torch.no_grad():
        layer(x2.double(), mask2)
    ent_det.append(row_entropy(layer.last_weights).mean().item())
ent = torch.stack(ent)  # shape: (len(tau_grid), B, H, T)
log_n = torch.log(n_real)[:, None, None]  # shape: (B, 1, 1)
monotone = bool((ent.diff(dim=0) >= -1e-9).all())
print(f"row entropy at τ = 1e-4: max {ent[0].max():.2e}")
print(f"at τ = 1e4: max |H − log n| = {(ent[-1] - log_n).abs().max():.2e}")
print(f"entropy non-decreasing in τ for every row: {monotone}")
fig, ax = plt.subplots(figsize=(5, 3.2))
ax.semilogx(tau_grid, ent.mean((1, 2, 3)).numpy(), "o-", label="Gumbel-softmax sample")
ax.semilogx(tau_grid, ent_det, "s--", label="noise-free softmax(qkᵀ/τ)")
ax.axhline(float(torch.log(n_real).mean()), color="k", lw=0.8, ls=":", label="mean log n (uniform)")
ax.set(xlabel="τ", ylabel="mean row entropy (nats)", title="STO-TRANS temperature sweep")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "temperature_sweep.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## 4. Hard vs soft: what the Monte-Carlo average converges to
# For one row of logits $\ell$: the mean of hard samples is exactly softmax($\ell$) (Gumbel-max), so its
# Monte-Carlo error falls as $1/\sqrt P$; the mean of soft samples converges to
# $\mathbb E[\mathrm{softmax}((\ell + G)/\tau)]$, which differs from the noise-free softmax($\ell/\tau$)
# used under `gpattn.deterministic()` — the gap depends on τ (it is why the deterministic mode is a
# *noise-free* attention, not the predictive mean of a stochastic layer).

# %%
torch.manual_seed(5)
ell = torch.tensor([1.2, 0.3, -0.5, 0.8, -1.5, 0.0], dtype=torch.float64)
target = torch.softmax(ell, -1)
P_grid = np.unique(np.logspace(1, math.log10(P_MAX), 8).astype(int))
noise = gumbel_noise((P_MAX, 6), dtype=torch.float64)
hard = gumbel_softmax(ell.expand(P_MAX, 6), 1.0, hard=True, noise=noise)
hard_err = [float((hard[:P].mean(0) - target).abs().max()) for P in P_grid]
se = torch.sqrt(target * (1 - target) / P_MAX)
z_hard = ((hard.mean(0) - target) / se).abs().max().item()
gap = []
for tau in (0.1, 0.3, 1.0, 3.0, 10.0):
    soft_mean = gumbel_softmax(ell.expand(P_MAX, 6), tau, noise=noise).mean(0)
    gap.append((tau, float((soft_mean - torch.softmax(ell / tau, -1)).abs().max())))
print(f"hard samples: max |z| of the MC mean vs softmax(ℓ) at P = {P_MAX}: {z_hard:.2f}")
print("soft samples: max |E[sample] − softmax(ℓ/τ)|:", ", ".join(f"τ={t}: {d:.3f}" for t, d in gap))
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
axes[0].loglog(P_grid, hard_err, "o-", label="hard: max |mean − softmax(ℓ)|")
axes[0].loglog(P_grid, 0.5 / np.sqrt(P_grid), "k--", lw=0.8, label="0.5/√P")
axes[0].set(xlabel="P samples", ylabel="error", title="MC mean of hard samples")
axes[0].legend(fontsize=8)
axes[1].semilogx([t for t, _ in gap], [d for _, d in gap], "o-")
axes[1].set(xlabel="τ", ylabel="max |E[soft] − softmax(ℓ/τ)|", title="soft samples: mean ≠ noise-free")
fig.tight_layout()
fig.savefig(OUT / "hard_vs_soft.png", dpi=120)
plt.close(fig)

# %% [markdown]
# Under `gpattn.deterministic()` both layers are their noise-free attentions; compare with float64
# formulas written here (eqs. 7 and 14–17 with $G$ dropped).

# %%
xd = torch.randn(3, 7, D, dtype=torch.float64)
maskd = torch.zeros(3, 7, dtype=torch.bool)
maskd[1, 5:] = True
maskd[2, 2:] = True
torch.manual_seed(6)
sto = gpattn.build_attention("sto", D, H, tau=0.7).double()
hsto = gpattn.build_attention("h-sto", D, H, num_centroids=3, tau1=0.5, tau2=2.0).double()


def out_proj(layer, h):
    B, Hh, T, Dv = h.shape
    return h.transpose(1, 2).reshape(B, T, Hh * Dv) @ layer.out_proj.weight.detach().T + layer.out_proj.bias.detach()


neg_inf = maskd[:, None, None, :]
q, k, v = heads(sto, xd)
ref_sto = out_proj(sto, torch.softmax((q @ k.mT / 0.7).masked_fill(neg_inf, -math.inf), -1) @ v)
q, k, v = heads(hsto, xd)
C = hsto.centroids.detach()
k_hat = torch.softmax(k @ C / 0.5, -1) @ C.T
ref_hsto = out_proj(hsto, torch.softmax((q @ k_hat.mT / 2.0).masked_fill(neg_inf, -math.inf), -1) @ v)
with gpattn.deterministic(), torch.no_grad():
    err_det = max(float((sto(xd, maskd) - ref_sto).abs().max()), float((hsto(xd, maskd) - ref_hsto).abs().max()))
print(f"deterministic() vs float64 brute force, max error over both layers: {err_det:.2e}")

# %% [markdown]
# ## 5. H-STO: centroid assignments and Proposition 3.1
# The centroid step is $\mathcal G(k C/\tau_1)$. Proposition 3.1:
# $\|\mathcal G(k_i C/\tau) - \mathcal G(k_j C/\tau)\|_2 \le \|k_i - k_j\|_2\,\|C\|_2/\tau$ for the
# noise-free softmax (and for samples that share their noise, which cancels). Softmax's Jacobian
# $\mathrm{diag}(p) - pp^\top$ has spectral norm ≤ ½ (Popoviciu), so the ratio never exceeds ½;
# $C = [w, -w]$, $k_{i,j} = \pm\frac{\varepsilon}{2} w/\|w\|$ gives ratio $\tanh(\delta/2)/\delta \to ½$,
# $\delta = \varepsilon\|w\|/\tau$.

# %%
gen = torch.Generator().manual_seed(7)
Dh, c = 8, 3
scale = torch.exp(1.5 * torch.randn(N_PAIRS, 1, generator=gen, dtype=torch.float64))
ki = scale * torch.randn(N_PAIRS, Dh, generator=gen, dtype=torch.float64)
kj = ki + scale * torch.rand(N_PAIRS, 1, generator=gen, dtype=torch.float64) * torch.randn(
    N_PAIRS, Dh, generator=gen, dtype=torch.float64
)
Cs = torch.randn(N_PAIRS, Dh, c, generator=gen, dtype=torch.float64)
tau_p = 0.7
pair = torch.stack([ki, kj], 1)[:, None]  # shape: (N, 1, 2, Dh): the pair on the token axis
a = centroid_attention(pair, Cs[:, None], tau_p, sample=False)  # shape: (N, 1, 2, c)
lhs = (a[:, 0, 0] - a[:, 0, 1]).norm(dim=-1)
rhs = (ki - kj).norm(dim=-1) * torch.linalg.matrix_norm(Cs, ord=2) / tau_p
ratio = lhs / rhs
w_vec = torch.randn(Dh, dtype=torch.float64, generator=gen)
C_tight = torch.stack([w_vec, -w_vec], -1)
deltas = np.logspace(-3, 1.3, 30)
tight = []
for delta in deltas:
    eps = delta * tau_p / float(w_vec.norm())
    u = w_vec / w_vec.norm()
    pr = torch.stack([eps / 2 * u, -eps / 2 * u])[None, None]  # shape: (1, 1, 2, Dh)
    at = centroid_attention(pr, C_tight, tau_p, sample=False)[0, 0]
    tight.append(float((at[0] - at[1]).norm() / (eps * torch.linalg.matrix_norm(C_tight, ord=2) / tau_p)))
print(f"random pairs: max ratio to the bound {float(ratio.max()):.4f} (≤ 1 claimed, ≤ ½ sharp)")
print(f"constructed pair at δ = 1e-3: ratio {tight[0]:.5f}")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
sel = slice(0, 5000)
axes[0].loglog(rhs[sel].numpy(), lhs[sel].numpy(), ".", ms=2, alpha=0.5)
lim = np.array([1e-4, 1e4])
axes[0].loglog(lim, lim, "k-", lw=0.8, label="Prop. 3.1 bound")
axes[0].loglog(lim, lim / 2, "r--", lw=0.8, label="½ · bound")
axes[0].set(xlim=(1e-4, 1e4), ylim=(1e-8, 3), xlabel="‖k_i − k_j‖ ‖C‖₂ / τ", ylabel="‖G(k_i C/τ) − G(k_j C/τ)‖")
axes[0].legend(fontsize=8)
axes[1].semilogx(deltas, tight, "o-", label="constructed pair")
axes[1].semilogx(deltas, np.tanh(deltas / 2) / deltas, "k--", lw=0.8, label="tanh(δ/2)/δ")
axes[1].axhline(0.5, color="r", lw=0.8, ls=":")
axes[1].set(xlabel="δ = ε‖w‖/τ", ylabel="ratio to the bound", title="near-tight case")
axes[1].legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "proposition_3_1.png", dpi=120)
plt.close(fig)

# %% [markdown]
# ## 6. Straight-through gradients
# Hard mode: the forward value is the one-hot winner, the backward that of the soft sample with the
# same noise — so the gradient of a loss through a hard sample equals the gradient of the same loss
# through the soft sample with the winner's value held fixed.

# %%
torch.manual_seed(8)
logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
noise = gumbel_noise((5, 7), dtype=torch.float64)
cot = torch.randn(5, 7, dtype=torch.float64)
(g_hard,) = torch.autograd.grad((gumbel_softmax(logits, 0.6, hard=True, noise=noise) * cot).sum(), logits)
(g_soft,) = torch.autograd.grad((gumbel_softmax(logits, 0.6, noise=noise) * cot).sum(), logits)
err_st = float((g_hard - g_soft).abs().max())
print(f"straight-through vs soft gradient with the same noise: max difference {err_st:.1e}")

# %% [markdown]
# ## Checks
# Each assert fails if the math is broken: the noise scaled by τ before the softmax (or the logits by
# τ before the noise) moves the winners to softmax(qkᵀ/τ); masking after sampling lets padded keys
# win; a wrong centroid step breaks the brute force or the Lipschitz bound.

# %%
assert ks.pvalue > 1e-4, f"noise is not Gumbel(0, 1): KS p = {ks.pvalue:.2e}"
assert abs(g.mean() - np.euler_gamma) < 5 * math.sqrt(math.pi**2 / 6 / N_NOISE), "noise mean is not γ"

# %%
for tau in taus:
    assert pvals[tau] > 1e-4, f"τ={tau}: hard-sample winners are not Categorical(softmax(qkᵀ)), p = {pvals[tau]:.2e}"
    assert pvals_wrong[tau] < 1e-6, f"τ={tau}: the test cannot tell softmax(qkᵀ/τ) apart"
    assert freqs[tau][3] == 0, "a padded key won"
    assert torch.equal(winners[tau], winners[taus[0]]), "the temperature changed which key wins"

# %%
assert monotone and float(ent[0].max()) < 1e-3, "τ → 0 must give one-hot rows, entropy non-decreasing in τ"
assert float((ent[-1] - log_n).abs().max()) < 1e-3, "τ → ∞ must give uniform rows over the real keys"

# %%
assert z_hard < 5.0, f"MC mean of hard samples is not softmax(ℓ): max |z| = {z_hard:.2f}"
assert err_det < 1e-10, f"deterministic() is not the noise-free attention: {err_det:.2e}"

# %%
assert float(ratio.max()) <= 0.5 + 1e-12, f"Proposition 3.1 (sharp ½ form) violated: {float(ratio.max()):.4f}"
assert 0.499 < tight[0] <= 0.5 + 1e-12, f"near-tight case should approach ½, got {tight[0]:.5f}"
assert err_st < 1e-12, "straight-through gradient differs from the soft gradient"
print("all checks passed")
