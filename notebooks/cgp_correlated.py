# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Correlated-GP attention: CGP moments by nested Monte Carlo, the SCGP → CGP limit, the regularisers, asymmetry
#
# `cgp` and `scgp` (docs/derivations.md §7–8, Bui et al.) read attention as a *cross-function* GP prediction. A
# canonical GP $z_o \sim \mathcal{GP}(0, \kappa_o)$, $\kappa_o(a, b) = \exp(-\tfrac12\|a - b\|^2)$,
# generates the query process $z_q(x) = \sigma_q z_o(x W_q)$ and the key process
# $z_k(x) = \sigma_k z_o(x W_k)$; the latent inputs $x_o = x W_o$ are a third projection. With
# observations $z = (K_k + \sigma^2 I) v$ (eq. 24) the predictive mean of $z_q \mid z_k$ is attention
# on $v$ (eq. 25):
# $$\nu = K_{qo}(K_o + \sigma^2 I)^{-1} K_{ok}\, v ,$$
# with the *asymmetric* attention matrix $K_{qo}(K_o + \sigma^2 I)^{-1}K_{ok}$. `scgp` replaces both
# conditionals by DTC approximations with m (resp. l) inducing inputs and never forms a $T\times T$
# matrix.
#
# This notebook checks, against dense float64 computations written here:
# 1. the CGP predictive mean and covariance of the layer against **nested-conditional Monte Carlo**
#    ($z_o \sim p(z_o\mid z_k)$, then $z_q \sim p(z_q \mid z_o)$) — the law of total covariance;
# 2. **SCGP → CGP**: with inducing inputs at the first m latent inputs (resp. keys), the DTC mean
#    approaches the exact CGP mean as m → T and equals it at m = T (docs/derivations.md §8);
# 3. the **regularisers**: CGP's eqs. 42–44 (the layer's $P_o$-sample estimator and its exact
#    expectation) and SCGP's closed-form App. E bound, each against an independent Monte-Carlo
#    estimate of the same bound;
# 4. **asymmetry**: $\|K - K^\top\|_F/\|K\|_F$ of the attention matrix for CGP / SCGP vs symmetric
#    kernel attention.

# %%
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

import gpattn
from gpattn.kernels import evaluate_kernel
from gpattn.testing.references import canonical_rbf, cgp_dense_blocks, cgp_dense_moments
from gpattn.variational.means import CorrelatedSeparateSoftmaxMean, ZeroMean
from gpattn.variational.scgp import SparseCorrelatedGP

SIZE = os.environ.get("GPATTN_NOTEBOOK_SIZE", "full")
OUT = Path(os.environ.get("GPATTN_NOTEBOOK_OUT", "runs/notebooks")) / "cgp_correlated"
OUT.mkdir(parents=True, exist_ok=True)
CI = SIZE == "ci"
T = 10 if CI else 24  # tokens
N_MC = 100_000 if CI else 400_000  # nested Monte-Carlo draws for the moments
N_REG = 20_000 if CI else 100_000  # Monte-Carlo draws for the regulariser bounds
REPEATS = 30 if CI else 200  # repeated P_o-sample estimates per P_o
F64 = torch.float64
torch.manual_seed(0)
print(f"SIZE={SIZE}, T={T}, plots -> {OUT}")

# %% [markdown]
# ## A CGP layer and its per-head inputs
#
# 5. the **softmax prior mean** of §7a (`cgp`'s default): the layer's mean is softmax attention plus ν, with
#    the zero-mean layer's covariance and regulariser.
#
# Sections 1–4 check the papers' form, `prior_mean="zero"`, where ν is the whole mean.
# A two-head layer of width 16 in float64 with non-trivial $\sigma_q, \sigma_k$ per head. The shim
# scales the projections by a fixed `input_scale` before $\kappa_o$ (a reparametrisation of $W$);
# everything below works on those scaled per-head inputs $q, k, x_o$ and the values $v$.

# %%
H, D = 2, 16
layer = gpattn.build_attention("cgp", D, H, jitter=0.0, prior_mean="zero").double()
gp = layer.strategy
gp.prior_samples = None  # the regulariser's exact expectation over z_o (the layer draws 10 samples)
gp.covar.sigma_q = torch.tensor([1.4, 0.8], dtype=F64)
gp.covar.sigma_k = torch.tensor([0.7, 1.3], dtype=F64)
x = torch.randn(1, T, D, dtype=F64)
with torch.no_grad():
    p = layer.project(x)
    c = layer.input_scale
    q, k, o, v = p["q"] * c, p["k"] * c, p["o"] * c, p["v"]  # shape: (1, H, T, Dh), v (1, H, T, Dv)
SIG_Q, SIG_K = gp.covar.sigma_q.detach(), gp.covar.sigma_k.detach()  # shape: (H,)
S2 = float(gp.sigma[0]) ** 2
print(f"sigma_q={gp.covar.sigma_q.tolist()}, sigma_k={gp.covar.sigma_k.tolist()}, sigma={S2**0.5}")

# the dense blocks from explicit pairwise differences (gpattn.testing.references, independent of the layer)
Kb = {name: K[0] for name, K in cgp_dense_blocks(q, k, o, SIG_Q, SIG_K).items()}  # each (H, T, T)
K_q, K_k, K_o, K_qo, K_ok = (Kb[name] for name in ("K_q", "K_k", "K_o", "K_qo", "K_ok"))
I = torch.eye(T, dtype=F64)
A, Kk = K_o + S2 * I, K_k + S2 * I

# %% [markdown]
# ## 1. Mean and covariance vs nested-conditional Monte Carlo
#
# For value column 0: $z = (K_k + \sigma^2 I) v_0$; draw $z_o \sim N(\mu_o, C_o)$ with
# $\mu_o = K_{ok}(K_k+\sigma^2 I)^{-1} z$, $C_o = K_o - K_{ok}(K_k+\sigma^2 I)^{-1}K_{ko}$ (eq. 20),
# then $z_q \sim N(K_{qo}A^{-1}z_o,\ K_q - K_{qo}A^{-1}K_{oq})$ (eq. 49), and compare the empirical
# moments of $z_q$ with the layer's `posterior()`.

# %%
with torch.no_grad():
    post = layer.posterior(x)
    nu = post.mean[0, :, 0]  # shape: (H, T)
    Sigma = post.covariance_matrix[0, :, 0]  # shape: (H, T, T)
z = Kk @ v[0, :, :, :1]  # eq. 24, column 0  # shape: (H, T, 1)
mu_o = (K_ok @ torch.linalg.solve(Kk, z))[..., 0]
C_o = K_o - K_ok @ torch.linalg.solve(Kk, K_ok.mT)
HA = torch.linalg.solve(A, K_qo.mT).mT  # K_qo A⁻¹
S_q = K_q - HA @ K_qo.mT
g = torch.Generator().manual_seed(1)
eps_o, eps_q = (torch.randn(H, N_MC, T, 1, generator=g, dtype=F64) for _ in range(2))
z_o = mu_o[:, None] + (torch.linalg.cholesky(C_o + 1e-12 * I)[:, None] @ eps_o)[..., 0]  # z_o | z_k
z_q = (HA[:, None] @ z_o[..., None])[..., 0] + (torch.linalg.cholesky(S_q + 1e-12 * I)[:, None] @ eps_q)[..., 0]
emp_mean = z_q.mean(1)
cz = z_q - emp_mean[:, None]
emp_cov = cz.mT @ cz / (N_MC - 1)
var = Sigma.diagonal(dim1=-2, dim2=-1)
z_mean = (emp_mean - nu) / (var / N_MC).sqrt()  # standardised errors
z_cov = (emp_cov - Sigma) / ((var[:, :, None] * var[:, None, :] + Sigma**2) / N_MC).sqrt()
print(f"max |z| mean {z_mean.abs().max():.2f}, covariance {z_cov.abs().max():.2f}  (N = {N_MC})")

# App. B per column, *before* the μ_o μ_oᵀ / ν νᵀ cancellation: E[z_q z_qᵀ | z_k] − ν_d ν_dᵀ (eqs. 45–52)
_, cov_app_b, _, _ = cgp_dense_moments(q, k, o, v, SIG_Q, SIG_K, S2**0.5)  # shape: (1, H, Dv, T, T)
col_err = [float((cov_app_b[0, :, d] - Sigma).abs().max()) for d in range(v.shape[-1])]
same_cols = max(col_err)
print(f"App. B covariance of each of the {v.shape[-1]} value columns vs the layer's Σ: max difference {same_cols:.1e}")

# %%
fig, ax = plt.subplots(1, 4, figsize=(17, 3.6))
im = ax[0].imshow(Sigma[0], cmap="viridis")
ax[0].set_title("analytic Σ (head 0)")
fig.colorbar(im, ax=ax[0])
im = ax[1].imshow(emp_cov[0], cmap="viridis")
ax[1].set_title(f"nested Monte Carlo, N={N_MC}")
fig.colorbar(im, ax=ax[1])
im = ax[2].imshow(z_cov[0], cmap="coolwarm", vmin=-4, vmax=4)
ax[2].set_title("standardised error")
fig.colorbar(im, ax=ax[2])
t = np.arange(T)
ax[3].errorbar(t, nu[0], yerr=2 * var[0].sqrt(), fmt="o", label="ν ± 2√Σ_tt")
ax[3].plot(t, emp_mean[0], "x", label="MC mean")
ax[3].set_xlabel("token")
ax[3].legend()
fig.tight_layout()
fig.savefig(OUT / "cgp_moments_vs_nested_mc.png", dpi=120)

# %% [markdown]
# Sample paths over tokens: draws of the layer's head output (column 0) around the mean.

# %%
with torch.no_grad():
    draws = torch.stack([gp.condition(q, k, o, v).rsample()[0, 0, :, 0] for _ in range(20)])
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(draws.T, color="0.7", lw=0.8)
ax.plot(nu[0], "k", lw=2, label="ν")
ax.set_xlabel("token")
ax.legend()
fig.tight_layout()
fig.savefig(OUT / "cgp_sample_paths.png", dpi=120)

# %% [markdown]
# ## 2. SCGP → CGP as the inducing inputs reach the latent inputs and the keys
#
# The DTC mean $E[z_q \mid z_k]$ (eq. 33) with inducing inputs $s = x_o[:m]$, $s' = k[:m]$ for the
# same observations $z$; at $m = l = T$ it must equal the exact CGP mean (eq. 21). For contrast,
# inducing inputs at random points of the canonical space.

# %%
sparse = SparseCorrelatedGP(
    H, q.shape[-1], num_inducing=T, num_inducing_keys=T, sigma=S2**0.5, jitter=0.0, mean_module=ZeroMean()
).double()
with torch.no_grad():
    sparse.covar.sigma_q = gp.covar.sigma_q
    sparse.covar.sigma_k = gp.covar.sigma_k
    z_all = torch.randn(1, H, T, 3, dtype=F64, generator=g)
    exact = gp.conditional_mean(q, k, o, z_all)
    ms = list(range(1, T + 1))
    err_subset = [
        float((sparse.conditional_mean(q, k, o, z_all, inducing=(o[:, :, :m], k[:, :, :m])) - exact).abs().max())
        for m in ms
    ]
    err_random = []
    for m in ms:
        s = o.std() * torch.randn(1, H, m, q.shape[-1], dtype=F64, generator=g)
        s_keys = k.std() * torch.randn(1, H, m, q.shape[-1], dtype=F64, generator=g)
        err_random.append(float((sparse.conditional_mean(q, k, o, z_all, inducing=(s, s_keys)) - exact).abs().max()))
print("max |ν_DTC − ν_CGP| at m = T:", err_subset[-1])
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogy(ms, err_subset, "o-", label="s = x_o[:m], s' = k[:m]")
ax.semilogy(ms, err_random, "s--", label="random inducing inputs")
ax.set_xlabel("m = l")
ax.set_ylabel("max |ν_DTC − ν_CGP|")
ax.legend()
fig.tight_layout()
fig.savefig(OUT / "scgp_to_cgp_error_vs_m.png", dpi=120)

# %% [markdown]
# ## 3. The regularisers vs Monte-Carlo estimates of the same bounds
#
# **CGP** (eqs. 42–44): $R = E_{z_o}[(\nu - m_q)^\top\Sigma_q^{-1}(\nu - m_q)] + \log|\Sigma_q|$ + the
# same for $(z, m_k, \Sigma_k)$, $z_o \sim N(0, K_o)$, with the conditionals' observation noise
# $\sigma^2 I$ in $\Sigma_q, \Sigma_k$ (the bounded form: $R \ge 2T\log\sigma^2$). The layer offers the exact
# expectation (`prior_samples=None`) and the paper's $P_o$-sample estimator; both are compared with a dense
# Monte-Carlo estimate written here, and the $P_o$-estimator's spread is shown against $1/\sqrt{P_o}$.

# %%
with torch.no_grad():
    res = gp.condition(q, k, o, v)
    R_exact = res.regularizer()[0]  # shape: (H, Dv)
    nu_all = res.mean[0]  # shape: (H, T, Dv)
    z_full = Kk @ v[0]
    Hk = torch.linalg.solve(A, K_ok).mT  # K_ko A⁻¹
    S_k = K_k - Hk @ K_ok
    zo = torch.linalg.cholesky(K_o + 1e-12 * I)[:, None] @ torch.randn(H, N_REG, T, 1, generator=g, dtype=F64)
    R_mc, R_var = 0.0, 0.0
    for target, Hx, S in ((nu_all, HA, S_q + S2 * I), (z_full, Hk, S_k + S2 * I)):  # bounded: + σ²I
        r = target.mT[:, :, None, :] - (Hx[:, None] @ zo)[..., 0][:, None]  # shape: (H, Dv, N, T)
        quad = (r * torch.linalg.solve(S[:, None, None], r[..., None])[..., 0]).sum(-1)
        R_mc = R_mc + quad.mean(-1) + torch.logdet(S)[:, None]
        R_var = R_var + quad.var(-1) / N_REG
    z_reg_cgp = (R_exact - R_mc) / R_var.sqrt()
print(f"CGP regulariser: exact {R_exact[0, 0]:.4f}, dense MC {R_mc[0, 0]:.4f}; max |z| {z_reg_cgp.abs().max():.2f}")

P_list = [1, 10, 100] if CI else [1, 10, 100, 1000]
spread, bias = [], []
for P in P_list:
    est = gpattn.build_attention("cgp", D, H, jitter=0.0, prior_mean="zero").double().strategy
    est.prior_samples = P
    est.load_state_dict(gp.state_dict())
    with torch.no_grad():
        r = torch.stack([est.condition(q, k, o, v).regularizer()[0, 0, 0] for _ in range(REPEATS)])
    spread.append(float(r.std()))
    bias.append(float((r.mean() - R_exact[0, 0]).abs() / (r.std() / REPEATS**0.5)))
print("P_o:", P_list, "sd of the estimator:", [f"{s_:.3g}" for s_ in spread], "|bias|/SE:", [f"{b:.2f}" for b in bias])
fig, ax = plt.subplots(figsize=(5, 3.5))
ax.loglog(P_list, spread, "o-", label="sd of the P_o-sample R")
ax.loglog(P_list, spread[0] / np.sqrt(P_list), "k:", label="1/√P_o")
ax.set_xlabel("P_o")
ax.legend()
fig.tight_layout()
fig.savefig(OUT / "cgp_regularizer_vs_P_o.png", dpi=120)

# %% [markdown]
# **SCGP** (App. E): the closed-form bound
# $\frac{1}{\sigma^2}E_{z_o}E_{z_m\mid z_o}\|\nu - K_{qm}K_{mm}^{-1}z_m\|^2 + T\log\sigma^2$ (+ keys),
# $z_o \sim N(0, K_{om}K_{mm}^{-1}K_{mo})$, vs sampling $z_o$, then $z_m \mid z_o$ (eq. 55).

# %%
m = max(3, T // 3)
scgp = SparseCorrelatedGP(
    H, q.shape[-1], num_inducing=m, num_inducing_keys=m, sigma=S2**0.5, jitter=0.0, mean_module=ZeroMean()
).double()
with torch.no_grad():
    scgp.covar.sigma_q = gp.covar.sigma_q
    scgp.covar.sigma_k = gp.covar.sigma_k
    s_in, s_keys = o[0, :, ::3][:, :m], k[0, :, 1::3][:, :m]  # inducing inputs near the data
    scgp.inducing_latent.copy_(s_in + 0.1 * torch.randn_like(s_in))
    scgp.inducing_keys.copy_(s_keys + 0.1 * torch.randn_like(s_keys))
    out_s = scgp.condition(q, k, o, v)
    S_in, S_keys = scgp.inducing_latent[None], scgp.inducing_keys[None]
    blocks = [
        (
            out_s.mean[0],
            SIG_Q[:, None, None] * canonical_rbf(q, S_in)[0],
            canonical_rbf(o, S_in)[0],
            canonical_rbf(S_in, S_in)[0],
        ),
        (
            v[0],
            SIG_K[:, None, None] * canonical_rbf(k, S_keys)[0],
            canonical_rbf(o, S_keys)[0],
            canonical_rbf(S_keys, S_keys)[0],
        ),
    ]
    R_s_mc, R_s_var = 0.0, 0.0
    for target, K_tm, K_om, K_mm in blocks:
        Lmm = torch.linalg.cholesky(K_mm)
        u = Lmm[:, None] @ torch.randn(H, N_REG, m, 1, generator=g, dtype=F64)
        zo = K_om[:, None] @ torch.cholesky_solve(u, Lmm[:, None])  # ~ N(0, K_om K_mm⁻¹ K_mo)
        Mq = K_mm + K_om.mT @ K_om / S2
        mean_m = (K_mm @ torch.linalg.solve(Mq, K_om.mT))[:, None] @ zo / S2
        cov_m = K_mm @ torch.linalg.solve(Mq, K_mm)
        eps = torch.randn(H, N_REG, m, 1, generator=g, dtype=F64)
        zm = mean_m + torch.linalg.cholesky(0.5 * (cov_m + cov_m.mT))[:, None] @ eps  # z_m | z_o, eq. 55
        pred = (torch.linalg.solve(K_mm, K_tm.mT).mT[:, None] @ zm)[..., 0]  # shape: (H, N, T)
        val = (target.mT[:, :, None, :] - pred[:, None]).pow(2).sum(-1) / S2 + T * np.log(S2)
        R_s_mc = R_s_mc + val.mean(-1)
        R_s_var = R_s_var + val.var(-1) / N_REG
    z_reg_scgp = (out_s.regularizer()[0] - R_s_mc) / R_s_var.sqrt()
print(
    f"SCGP regulariser: closed form {out_s.regularizer()[0, 0, 0]:.4f}, MC {R_s_mc[0, 0]:.4f}; "
    f"max |z| {z_reg_scgp.abs().max():.2f}"
)

# %% [markdown]
# ## 4. Asymmetry of the attention matrix
#
# The mean is linear in $v$, so the attention matrix is the layer's mean for $v = I_T$. CGP's
# $K_{qo}(K_o+\sigma^2I)^{-1}K_{ok}$ is asymmetric for $W_q \ne W_k$ and becomes symmetric when the
# three projections are tied ($q = k = x_o$, $\sigma_q = \sigma_k$); kernel attention with one
# projection `qk` is symmetric by construction.


# %%
def asym(K):
    return float(((K - K.mT).norm() / K.norm()).max())


eye_v = torch.eye(T, dtype=F64).expand(1, H, T, T)
with torch.no_grad():
    K_cgp = gp.condition(q, k, o, eye_v).mean
    K_scgp = scgp.condition(q, k, o, eye_v).mean
    tied = gpattn.build_attention("cgp", D, H, jitter=0.0, prior_mean="zero").double().strategy
    K_tied = tied.condition(q, q, q, eye_v).mean
    sym_layer = gpattn.build_attention("kernel", D, H).double()
    ps = sym_layer.project(x)
    K_sym = evaluate_kernel(sym_layer.kernel, ps["qk"], ps["qk"])
    asym_layer = gpattn.build_attention("kernel-asym", D, H).double()
    pa = asym_layer.project(x)
    K_asym = evaluate_kernel(asym_layer.kernel, pa["q"], pa["k"])
    # the layer's attention matrix is the one written in eq. 24
    torch.testing.assert_close(K_cgp[0], K_qo @ torch.linalg.solve(A, K_ok))
scores = {
    "cgp": asym(K_cgp),
    f"scgp (m=l={m})": asym(K_scgp),
    "kernel-asym": asym(K_asym),
    "cgp, tied W": asym(K_tied),
    "kernel (sym.)": asym(K_sym),
}
for name, val in scores.items():
    print(f"{name:16s} ‖K − Kᵀ‖_F / ‖K‖_F = {val:.3e}")
fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
ax[0].bar(range(len(scores)), [max(v_, 1e-17) for v_ in scores.values()])
ax[0].set_yscale("log")
ax[0].set_xticks(range(len(scores)), list(scores), rotation=30, ha="right")
ax[0].set_title("relative asymmetry")
im = ax[1].imshow(K_cgp[0, 0], cmap="viridis")
ax[1].set_title("CGP attention matrix (head 0)")
fig.colorbar(im, ax=ax[1])
im = ax[2].imshow((K_cgp - K_cgp.mT)[0, 0], cmap="coolwarm")
ax[2].set_title("K − Kᵀ")
fig.colorbar(im, ax=ax[2])
fig.tight_layout()
fig.savefig(OUT / "attention_asymmetry.png", dpi=120)

# %% [markdown]
# ## Checks
# Standardised errors are compared with 5 (a |z| above 5 has probability < 6e-7 per entry); the
# SCGP → CGP limit is exact up to float64 round-off.

# %% [markdown]
# ## 5. The softmax prior mean (docs/derivations.md §7a)
#
# With `prior_mean="softmax"` the query and key processes have the prior mean
# $m(q_i) = \sum_j \mathrm{softmax}_j(q_i\cdot k_j)\,v_j$ (scaled inputs), so the layer's mean is $m(q) + \nu$; a mean
# function leaves every covariance block, hence $\Sigma$ and the regulariser (evaluated at $\nu$), unchanged.

# %%
twin = gpattn.build_attention("cgp", D, H, jitter=0.0, prior_mean="softmax").double()
twin.strategy.prior_samples = None
twin.load_state_dict(layer.state_dict(), strict=False)
with torch.no_grad():
    out0, out1 = gp.condition(q, k, o, v), twin.strategy.condition(q, k, o, v)
    m_dense = torch.softmax(q @ k.mT, -1) @ v  # written here: exp(q·k) normalised over the keys
    mean_err = (out1.mean - out0.mean - m_dense).abs().max().item()
    cov_err = (twin.posterior(x).covariance_matrix - layer.posterior(x).covariance_matrix).abs().max().item()
    reg_err = (out1.regularizer() - out0.regularizer()).abs().max().item()
print(f"softmax mean: |mean − ν − m| {mean_err:.1e}, |Σ − Σ_zero| {cov_err:.1e}, |R − R_zero| {reg_err:.1e}")

# %% [markdown]
# The separate mean (scgp's default, `prior_mean="softmax-separate"`; passed to cgp as the object) reads values of
# its own, $u = x W_{vm}$: the mean is $\sum_j \mathrm{softmax}_j(q_i\cdot k_j)\,u_j + \nu$, and $R$ still reads
# $\nu$ and $v$ alone.

# %%
u = torch.randn_like(v)
sep = gpattn.build_attention("cgp", D, H, jitter=0.0, prior_mean=CorrelatedSeparateSoftmaxMean())
sep = sep.double().strategy
sep.prior_samples = None
sep.load_state_dict(twin.strategy.state_dict())
with torch.no_grad():
    out2 = sep.condition(q, k, o, v, mean_values=u)
    sep_mean_err = (out2.mean - out0.mean - torch.softmax(q @ k.mT, -1) @ u).abs().max().item()
    sep_reg_err = (out2.regularizer() - out0.regularizer()).abs().max().item()
print(f"separate mean: |mean − ν − m(u)| {sep_mean_err:.1e}, |R − R_zero| {sep_reg_err:.1e}")

# %%
assert z_mean.abs().max() < 5 and z_cov.abs().max() < 5, "CGP moments disagree with nested Monte Carlo"
assert same_cols < 1e-9, "the per-column App. B covariance differs from the layer's shared Σ"

# %%
assert err_subset[-1] < 1e-8, f"SCGP with m = l = T, s = x_o, s' = k is not the CGP mean ({err_subset[-1]:.1e})"
assert err_subset[T // 2] > 10 * err_subset[-1], "the sparse approximation does not approach the limit"

# %%
assert z_reg_cgp.abs().max() < 5, "CGP regulariser (exact expectation) disagrees with Monte Carlo"
assert max(bias) < 5, "the P_o-sample CGP regulariser is biased"
assert z_reg_scgp.abs().max() < 5, "SCGP closed-form regulariser disagrees with Monte Carlo"

# %%
assert scores["cgp"] > 1e-2 and scores["kernel-asym"] > 1e-2, "asymmetric attention came out symmetric"
assert scores["cgp, tied W"] < 1e-10 and scores["kernel (sym.)"] < 1e-10, "symmetric attention came out asymmetric"
assert max(mean_err, cov_err, reg_err) < 1e-10, "the softmax prior mean changed more than the mean"
assert max(sep_mean_err, sep_reg_err) < 1e-10, "the separate softmax mean is not m(u) + ν, or R moved"
print("all checks passed")
