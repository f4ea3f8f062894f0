"""Dense float64 references for the GP attention variants, written independently of
:mod:`gpattn.variational`: explicit Gram matrices from pairwise formulas, ``torch.linalg.solve`` /
``cholesky`` on dense matrices, and the papers' equations as printed (docs/derivations.md §5–§8).

Each ``*_dense_posterior(layer, x, mask=None)`` recomputes a layer's head-space posterior from its
parameters and returns a :class:`DenseReference`; the lower-level functions take the per-head inputs
and the parameters explicitly, for tests and notebooks that set them by hand. Nothing here imports
pytest. All inputs are expected in float64 (the references are as exact as the dtype they are given).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from gpattn.variational.covariances import DiagonalCovariance
from gpattn.variational.means import AttentionMean, ZeroMean

__all__ = [
    "DenseReference",
    "canonical_rbf",
    "cgp_dense_blocks",
    "cgp_dense_moments",
    "cgp_cross_dense_posterior",
    "cgp_dense_posterior",
    "correlated_prior_mean_dense",
    "exponential_gram",
    "kep_svgp_dense_features",
    "kep_svgp_dense_moments",
    "kep_svgp_dense_posterior",
    "scgp_dense_blocks",
    "scgp_cross_dense_posterior",
    "scgp_dense_moments",
    "scgp_dense_posterior",
    "attention_mean_dense",
    "prior_mean_dense",
    "gram_dense",
    "rbf_gram",
    "sgpa_amortised_std",
    "sgpa_attention_dense_posterior",
    "sgpa_attention_masked_dense_moments",
    "sgpa_cross_dense_posterior",
    "sgpa_decoupled_cross_dense_posterior",
    "sgpa_decoupled_attention_dense_posterior",
    "sgpa_decoupled_dense_posterior",
    "sgpa_decoupled_global_keys",
    "sgpa_decoupled_kl_parts",
    "sgpa_decoupled_masked_dense_moments",
    "sgpa_dense_posterior",
    "sgpa_heads",
    "sgpa_masked_dense_moments",
]


class DenseReference(NamedTuple):
    """A layer's head-space posterior, densely.

    :ivar mean: posterior mean.  # shape: (B, H, Dv, T)
    :ivar covariance: per-output covariance.  # shape: (B, H, Dv, T, T)
    :ivar loss_terms: the layer's loss terms for the same input (docs/derivations.md §9 reductions), where the
        reference knows them (empty otherwise).
    """

    mean: torch.Tensor
    covariance: torch.Tensor
    loss_terms: dict


def _relative_jitter(K: torch.Tensor, jitter: float) -> torch.Tensor:
    """K + jitter · mean(diag K) · I (the SGPA variants' relative jitter).  # shape: (..., n, n)"""
    scale = jitter * K.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    return K + scale * torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)


# ------------------------------------------------------------------------------ SGPA (docs/derivations.md §5)
def exponential_gram(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """σ² exp(Σ_i a_i b_i / ℓ_i²) per head, from an ``ExponentialKernel``'s lengthscale and outputscale.

    # shape: a (..., H, n, Dh), b (..., H, m, Dh) -> (..., H, n, m)
    """
    ell = kernel.lengthscale.detach()  # shape: (H, 1, Dh)
    s2 = kernel.outputscale.detach()  # shape: (H,)
    return s2[:, None, None] * torch.exp((a / ell) @ (b / ell).mT)


def sgpa_heads(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qk and v per head straight from the fused input weight of an ``sgpa`` / ``sgpa-decoupled``
    layer.  # shape: x (B, T, D) -> (B, H, T, Dh), (B, H, T, Dv)"""
    W, b = layer.in_proj.weight.detach(), layer.in_proj.bias.detach()
    B, T, D = x.shape
    H = layer.num_heads
    qk = (x @ W[:D].T + b[:D]).view(B, T, H, D // H).transpose(1, 2)
    v = (x @ W[D:].T + b[D:]).view(B, T, H, -1).transpose(1, 2)
    return qk, v


def sgpa_amortised_std(layer, k: torch.Tensor) -> torch.Tensor:
    """Standard SGPA's amortised standard deviations softplus(k W_s + b_s).

    # shape: k (B, H, T, Dh) -> (B, H, T, Dv)"""
    q_u = layer.strategy.variational_distribution
    return F.softplus(torch.einsum("bhtk,hkd->bhtd", k, q_u.weight.detach()) + q_u.bias.detach()[:, None, :])


def sgpa_dense_posterior(layer, x: torch.Tensor, mask: torch.Tensor | None = None) -> DenseReference:
    """Standard SGPA (docs/derivations.md §5a), q = k: mean K v, covariance L diag(s_d²) Lᵀ with L = chol(K + jI)
    (j relative to mean diag K), KL ½ Σ_t (s² − 1 − log s²) + ½ vᵀ(K + jI)v per (b, h, d); ``kl_seq``
    its sum over heads and Dv, averaged over the batch; ``covariance="diag"`` keeps the diagonal. An
    ``ExponentialKernel`` only; no padding."""
    if mask is not None:
        raise ValueError("sgpa_dense_posterior takes no key_padding_mask (got one): compare truncated sequences")
    qk, v = sgpa_heads(layer, x)
    K = exponential_gram(layer.kernel, qk, qk)  # shape: (B, H, T, T)
    Kj = _relative_jitter(K, layer.strategy.jitter)
    L = torch.linalg.cholesky(Kj)[:, :, None]  # shape: (B, H, 1, T, T)
    s = sgpa_amortised_std(layer, qk).transpose(-1, -2)  # shape: (B, H, Dv, T)
    root = L * s[..., None, :]
    kl = 0.5 * ((s.square() - 1 - s.square().log()).sum(-1) + (v * (Kj @ v)).sum(-2))  # shape: (B, H, Dv)
    cov = root @ root.mT
    if isinstance(layer.strategy.covariance, DiagonalCovariance):
        cov = torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    return DenseReference((K @ v).transpose(-1, -2), cov, {"kl_seq": kl.sum((1, 2)).mean(0)})


def sgpa_masked_dense_moments(layer, x: torch.Tensor, excluded: torch.Tensor) -> dict:
    """Standard SGPA under a per-query mask (docs/derivations.md §11), by brute force, one query at a time:
    query i's inducing inputs are S = A_i (the keys it may attend to), L_S = chol(K_SS + cI) with c the
    sequence's relative jitter (mean diag K over its real tokens; a key excluded for every query is
    padding), mean_i = K_iS v_S, variance_i = [L_S diag(s_S²) L_Sᵀ]_ii when i ∈ S and
    K_ii + c − ‖a‖² + Σ_j a_j² s_j² (a = L_S⁻¹ K_Si) otherwise, KL_i = ½[Σ_{j∈S}(s_j² − 1 − log s_j²) +
    v_Sᵀ(K_SS + cI)v_S]; ``kl_seq`` = Σ_{h,d} of the mean of KL_i over the real queries (not padding,
    S ≠ ∅), averaged over the batch. An ``ExponentialKernel`` only.

    # shape: x (B, T, D), excluded (B, H, T, T) bool, padding joined -> mean, variance, query_kl (B, H, T, Dv)
    """
    qk, v = sgpa_heads(layer, x)
    K = exponential_gram(layer.kernel, qk, qk)  # shape: (B, H, T, T)
    Kj = K + torch.diag_embed(layer.strategy.jitter * K.diagonal(dim1=-2, dim2=-1))
    s2 = sgpa_amortised_std(layer, qk).square()  # shape: (B, H, T, Dv)
    mean, variance, query_kl = (torch.zeros_like(v) for _ in range(3))
    for b, h, i, S in _query_sets(excluded):
        if len(S) == 0:
            variance[b, h, i] = Kj[b, h, i, i]
            continue
        Kss = Kj[b, h][S][:, S]
        L = torch.linalg.cholesky(Kss)
        mean[b, h, i] = K[b, h, i, S] @ v[b, h, S]
        if i in S.tolist():
            row = L[S.tolist().index(i)]
            variance[b, h, i] = row.square() @ s2[b, h, S]
        else:
            a = torch.linalg.solve_triangular(L, K[b, h, S, i][:, None], upper=False)[:, 0]
            variance[b, h, i] = Kj[b, h, i, i] - a.square().sum() + a.square() @ s2[b, h, S]
        vs, ss = v[b, h, S], s2[b, h, S]
        query_kl[b, h, i] = 0.5 * ((ss - 1 - ss.log()).sum(0) + (vs * (Kss @ vs)).sum(0))
    kl_seq = _mean_over_real_queries(query_kl, excluded)
    return {"mean": mean, "variance": variance, "query_kl": query_kl, "kl_seq": kl_seq}


def _query_sets(excluded: torch.Tensor):
    """(b, h, i, S) for every query, S = A_i the indices of the keys it may attend to, one at a time.
    # shape: excluded (B, H, T, T)"""
    B, H, T, _ = excluded.shape
    for b in range(B):
        for h in range(H):
            for i in range(T):
                yield b, h, i, (~excluded[b, h, i]).nonzero()[:, 0]


def _mean_over_real_queries(query_terms: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """Σ_{h,d} of the mean of a per-query term over the real queries (not padding — a key no query may
    attend to — and A_i ≠ ∅), averaged over the batch, by loops.  # shape: query_terms (B, H, T, Dv) -> ()"""
    B, H, T, _ = query_terms.shape
    total = query_terms.new_zeros(())
    for b in range(B):
        pad = excluded[b].all(0).all(0)  # shape: (T,)
        for h in range(H):
            real = [i for i in range(T) if not pad[i] and not bool(excluded[b, h, i].all())]
            if real:
                total = total + sum(query_terms[b, h, i].sum() for i in real) / len(real) / B
    return total


def sgpa_decoupled_global_keys(layer) -> torch.Tensor:
    """k_g[h] = Z_g[h] W_qk[h]ᵀ + b_qk[h], head by head.  # shape: -> (H, M, Dh)"""
    D, H = layer.embed_dim, layer.num_heads
    Dh = D // H
    W, b = layer.in_proj.weight.detach()[:D], layer.in_proj.bias.detach()[:D]
    Z = layer.strategy.inducing_inputs.detach()
    return torch.stack([Z[h] @ W[h * Dh : (h + 1) * Dh].T + b[h * Dh : (h + 1) * Dh] for h in range(H)])


def _decoupled(layer, x, mask, context=None):
    """(mean, cov, γ, β) of decoupled SGPA; with ``context`` the mean basis is the context's keys and values
    and q(f) is at x's queries (cross-attention, docs/derivations.md §13)."""
    qk, v = sgpa_heads(layer, x)
    ka, v = (qk, v) if context is None else sgpa_heads(layer, context)
    if mask is not None:
        v = v * (~mask)[:, None, :, None]  # padded keys leave the mean basis
    kg = sgpa_decoupled_global_keys(layer)
    gram = layer.kernel
    Kqq, Kqg = gram_dense(gram, qk, qk), gram_dense(gram, qk, kg)
    Kqa, Kag, Kaa = gram_dense(gram, qk, ka), gram_dense(gram, ka, kg), gram_dense(gram, ka, ka)
    Kgg = _relative_jitter(gram_dense(gram, kg, kg), layer.strategy.jitter)
    q_u = layer.strategy.variational_distribution
    vg = q_u.inducing_values.detach()  # shape: (H, M, Dv)
    Lg = torch.linalg.cholesky(Kgg)
    St = q_u.chol_variational_covar.detach().tril()  # L_s: gpytorch's lower-triangular factor
    St = St @ St.mT  # shape: (H, Dv, M, M)
    Sg = Lg[:, None] @ St @ Lg[:, None].mT  # unwhitened S_g = L_g S̃ L_gᵀ
    mean = Kqa @ v - Kqg @ torch.linalg.solve(Kgg, Kag.mT @ v) + Kqg @ vg
    P = torch.linalg.solve(Kgg, Kqg.mT)[:, :, None]  # K_gg⁻¹ K_gq, shape: (B, H, 1, M, T)
    cov = (Kqq - Kqg @ torch.linalg.solve(Kgg, Kqg.mT))[:, :, None] + P.mT @ Sg @ P
    schur = Kaa - Kag @ torch.linalg.solve(Kgg, Kag.mT)  # K_aa − K_ag K_gg⁻¹ K_ga
    gamma = 0.5 * (v * (schur @ v)).sum(-2)  # v is 0 on padding
    u = Lg.mT @ vg
    logdet = torch.linalg.slogdet(St)[1]
    beta = 0.5 * (St.diagonal(dim1=-2, dim2=-1).sum(-1) + u.square().sum(-2) - Kgg.shape[-1] - logdet)
    return mean.transpose(-1, -2), cov, gamma, beta


def sgpa_decoupled_dense_posterior(layer, x: torch.Tensor, mask: torch.Tensor | None = None) -> DenseReference:
    """Decoupled SGPA (docs/derivations.md §5b): mean K_qa v_a − K_qg K_gg⁻¹ K_ga v_a + K_qg v_g, covariance
    K_qq − K_qg K_gg⁻¹ K_gq + K_qg K_gg⁻¹ S_g K_gg⁻¹ K_gq with S_g = L_g S̃ L_gᵀ (K_gg with the relative
    jitter); loss terms ``kl_seq`` (γ summed over heads and Dv, batch mean) and ``kl_global`` (β summed)."""
    mean, cov, gamma, beta = _decoupled(layer, x, mask)
    return DenseReference(mean, cov, {"kl_seq": gamma.sum((1, 2)).mean(0), "kl_global": beta.sum()})


def sgpa_decoupled_kl_parts(layer, x: torch.Tensor, mask: torch.Tensor | None = None):
    """The two KL parts of decoupled SGPA: γ (B, H, Dv), input-dependent, and β (H, Dv), global."""
    return _decoupled(layer, x, mask)[2:]


def sgpa_decoupled_masked_dense_moments(layer, x: torch.Tensor, excluded: torch.Tensor) -> dict:
    """Decoupled SGPA under a per-query mask (docs/derivations.md §11b), by brute force, one query at a time:
    query i's mean basis is S = A_i, so mean_i = K_iS v_S − K_ig K_gg⁻¹ K_gS v_S + K_ig v_g and
    γ_i = ½ v_Sᵀ (K_SS − K_Sg K_gg⁻¹ K_gS) v_S (explicit solves, no Cholesky factor shared with the layer);
    the covariance and β are the unmasked layer's; ``kl_seq`` = Σ_{h,d} of the mean of γ_i over the real
    queries (not padding, S ≠ ∅), averaged over the batch. An ``ExponentialKernel`` only.

    # shape: x (B, T, D), excluded (B, H, T, T) bool, padding joined -> mean, query_gamma (B, H, T, Dv),
    #        covariance (B, H, Dv, T, T)
    """
    qk, v = sgpa_heads(layer, x)
    kg = sgpa_decoupled_global_keys(layer)
    Kqq, Kqg = exponential_gram(layer.kernel, qk, qk), exponential_gram(layer.kernel, qk, kg)
    Kgg = _relative_jitter(exponential_gram(layer.kernel, kg, kg), layer.strategy.jitter)
    vg = layer.strategy.variational_distribution.inducing_values.detach()  # shape: (H, M, Dv)
    mean, query_gamma = torch.zeros_like(v), torch.zeros_like(v)
    for b, h, i, S in _query_sets(excluded):
        mean[b, h, i] = Kqg[b, h, i] @ vg[h]
        if len(S) == 0:
            continue
        vs, Kgs = v[b, h, S], Kqg[b, h, S].T  # shape: (|S|, Dv), (M, |S|)
        mean[b, h, i] += Kqq[b, h, i, S] @ vs - Kqg[b, h, i] @ torch.linalg.solve(Kgg[h], Kgs @ vs)
        Q = Kqq[b, h][S][:, S] - Kgs.T @ torch.linalg.solve(Kgg[h], Kgs)
        query_gamma[b, h, i] = 0.5 * (vs * (Q @ vs)).sum(0)
    covariance = _decoupled(layer, x, None)[1]
    kl_seq = _mean_over_real_queries(query_gamma, excluded)
    return {"mean": mean, "query_gamma": query_gamma, "covariance": covariance, "kl_seq": kl_seq}


# ------------------------------------------------------------------------------ attention prior mean (§5c)
def rbf_gram(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """σ² exp(−½ Σ_i (a_i − b_i)² / ℓ_i²) per head, pair by pair, from a ``ScaleKernel(RBFKernel)``.

    # shape: a (..., H, n, Dh), b (..., H, m, Dh) -> (..., H, n, m)
    """
    ell = kernel.base_kernel.lengthscale.detach()  # shape: (H, 1, Dh)
    s2 = kernel.outputscale.detach()  # shape: (H,)
    diff = (a / ell)[..., :, None, :] - (b / ell)[..., None, :, :]  # shape: (..., H, n, m, Dh)
    return s2[:, None, None] * torch.exp(-0.5 * diff.square().sum(-1))


def gram_dense(kernel, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Gram matrix of an ``ExponentialKernel`` or a ``ScaleKernel(RBFKernel)`` by its formula."""
    from gpytorch.kernels import RBFKernel, ScaleKernel

    if isinstance(kernel, ScaleKernel) and isinstance(kernel.base_kernel, RBFKernel):
        return rbf_gram(kernel, a, b)
    return exponential_gram(kernel, a, b)


def attention_mean_dense(K: torch.Tensor, v: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """m(q_i) = Σ_{j∈A_i} K_ij v_j / Σ_{j∈A_i} K_ij by the formula (0 where A_i = ∅).

    # shape: K (B, H, T, T), v (B, H, T, Dv), excluded (B, H, T, T) or None -> (B, H, T, Dv)
    """
    allowed = torch.ones_like(K, dtype=torch.bool) if excluded is None else ~excluded
    w = torch.where(allowed, K, torch.zeros_like(K))
    total = w.sum(-1, keepdim=True)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, (w @ v) / safe, torch.zeros_like(total))


def prior_mean_dense(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, excluded=None) -> torch.Tensor:
    """The SGPA prior mean m(q) of ``layer.strategy.mean_module`` by its formula (docs/derivations.md §5c, §5e):
    ``"attention"`` normalises the kernel's Gram κ(q_i, k_j) over A_i; ``"softmax"`` normalises
    exp((q_i/ℓ)·(k_j/ℓ)) with ℓ the lengthscale of the kernel (inside its ScaleKernel) (0 where A_i = ∅).

    # shape: q (B, H, T, Dh), k (B, H, S, Dh), v (B, H, S, Dv), excluded (B, H, T, S) or None -> (B, H, T, Dv)
    """
    kernel = layer.kernel
    if isinstance(layer.strategy.mean_module, AttentionMean):
        return attention_mean_dense(gram_dense(kernel, q, k), v, excluded)
    base = kernel.base_kernel if hasattr(kernel, "base_kernel") else kernel
    ell = base.lengthscale.detach()  # shape: (H, 1, Dh)
    return attention_mean_dense(torch.exp((q / ell) @ (k / ell).mT), v, excluded)


def sgpa_attention_dense_posterior(layer, x: torch.Tensor, mask: torch.Tensor | None = None) -> DenseReference:
    """Standard SGPA with the attention prior mean (docs/derivations.md §5c): mean = the normalised kernel
    attention m(q), covariance L diag(s_d²) Lᵀ (L = chol(K + jI), as §5a), KL ½ Σ_t (s² − 1 − log s²) per
    (b, h, d); ``kl_seq`` its sum over heads and Dv, averaged over the batch. No padding."""
    if mask is not None:
        raise ValueError("sgpa_attention_dense_posterior takes no key_padding_mask: compare truncated sequences")
    qk, v = sgpa_heads(layer, x)
    K = gram_dense(layer.kernel, qk, qk)  # shape: (B, H, T, T)
    L = torch.linalg.cholesky(_relative_jitter(K, layer.strategy.jitter))[:, :, None]  # shape: (B, H, 1, T, T)
    s = sgpa_amortised_std(layer, qk).transpose(-1, -2)  # shape: (B, H, Dv, T)
    root = L * s[..., None, :]
    cov = root @ root.mT
    if isinstance(layer.strategy.covariance, DiagonalCovariance):
        cov = torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    kl = 0.5 * (s.square() - 1 - s.square().log()).sum(-1)  # shape: (B, H, Dv)
    mean = prior_mean_dense(layer, qk, qk, v).transpose(-1, -2)
    return DenseReference(mean, cov, {"kl_seq": kl.sum((1, 2)).mean(0)})


def sgpa_attention_masked_dense_moments(layer, x: torch.Tensor, excluded: torch.Tensor) -> dict:
    """Standard SGPA with the attention prior mean under a per-query mask (docs/derivations.md §5c, §11a),
    one query at a time: mean_i = m over A_i, KL_i = ½ Σ_{j∈A_i} (s_j² − 1 − log s_j²) (the variance is
    §11a's, unchanged by the mean: :func:`sgpa_masked_dense_moments`).

    # shape: x (B, T, D), excluded (B, H, T, T) bool, padding joined -> mean, query_kl (B, H, T, Dv), kl_seq ()
    """
    qk, v = sgpa_heads(layer, x)
    s2 = sgpa_amortised_std(layer, qk).square()
    query_kl = torch.zeros_like(v)
    for b, h, i, S in _query_sets(excluded):
        query_kl[b, h, i] = 0.5 * (s2[b, h, S] - 1 - s2[b, h, S].log()).sum(0)
    return {"mean": prior_mean_dense(layer, qk, qk, v, excluded), "query_kl": query_kl,
            "kl_seq": _mean_over_real_queries(query_kl, excluded)}


def sgpa_decoupled_attention_dense_posterior(
    layer, x: torch.Tensor, mask: torch.Tensor | None = None
) -> DenseReference:
    """Decoupled SGPA with the attention prior mean (docs/derivations.md §5c): mean m(q) + K_qg v_g (m over the
    real keys), covariance and β as §5b (:func:`sgpa_decoupled_dense_posterior`'s), the only loss term
    ``kl_global`` (β summed)."""
    _, cov, _, beta = _decoupled(layer, x, mask)
    qk, v = sgpa_heads(layer, x)
    Kqq = gram_dense(layer.kernel, qk, qk)
    Kqg = gram_dense(layer.kernel, qk, sgpa_decoupled_global_keys(layer))
    excluded = None if mask is None else mask[:, None, None, :].expand(*Kqq.shape)
    vg = layer.strategy.variational_distribution.inducing_values.detach()  # shape: (H, M, Dv)
    mean = prior_mean_dense(layer, qk, qk, v, excluded) + Kqg @ vg
    return DenseReference(mean.transpose(-1, -2), cov, {"kl_global": beta.sum()})


# ------------------------------------------------------------------------------ KEP-SVGP (docs/derivations.md §6)
def kep_svgp_dense_moments(G, lam, m, L, W, b, extra=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: stack every u_c of a head into one vector u (r·r), write the head output y (T·Dv)
    as an explicit matrix J times u plus b, then mean = J μ_u + b, cov = J S_u Jᵀ. ``extra`` (B, H, T, T):
    a covariance added to every output GP f_c independently (the residual term).

    # shape: G (B, H, T, r), lam (H, r), m (H, r, r), L (H, r, r, r), W (H, r, Dv), b (H, Dv)
    #        -> mean (B, H, Dv, T), cov (B, H, Dv, T, T)"""
    B, H, T, r = G.shape
    Dv = W.shape[-1]
    dt = G.dtype
    mean = torch.zeros(B, H, Dv, T, dtype=dt)
    cov = torch.zeros(B, H, Dv, T, T, dtype=dt)
    for bb in range(B):
        for h in range(H):
            feat = torch.linalg.solve(torch.diag(lam[h]), G[bb, h].T).T  # G Λ⁻¹, T × r
            J = torch.zeros(T * Dv, r * r, dtype=dt)  # y[t, d] = Σ_c W[c, d] feat[t] · u_c
            for t in range(T):
                for d in range(Dv):
                    for c in range(r):
                        J[t * Dv + d, c * r : (c + 1) * r] = W[h, c, d] * feat[t]
            mu_u = m[h].reshape(-1)
            S_u = torch.block_diag(*[L[h, c] @ L[h, c].T for c in range(r)])
            y_mean = (J @ mu_u).view(T, Dv) + b[h]
            y_cov = (J @ S_u @ J.T).view(T, Dv, T, Dv)
            for d in range(Dv):
                mean[bb, h, d] = y_mean[:, d]
                cov[bb, h, d] = y_cov[:, d, :, d]
                if extra is not None:
                    cov[bb, h, d] += (W[h, :, d] ** 2).sum() * extra[bb, h]
    return mean, cov


def kep_svgp_dense_features(layer, x: torch.Tensor, mask: torch.Tensor | None = None):
    """The KSVD features of a ``kep-svgp`` layer, token by token: (G, E, R) with e = φ(q) X̃ ω_e,
    r = φ(k) X̃ ω_r over landmarks X̃ at evenly spaced real tokens and G = e + r (``merge="add"``) or
    the token map of ``merge="concat"``.  # shape: x (B, T, D) -> each (B, H, T, r)"""
    B, T, D = x.shape
    H, Dh = layer.num_heads, layer.head_dim
    kep = layer.strategy
    s = kep.ksvd.num_landmarks
    w, bias = layer.in_proj.weight, layer.in_proj.bias
    q = (x @ w[:D].T + bias[:D]).view(B, T, H, Dh)
    k = (x @ w[D:].T + bias[D:]).view(B, T, H, Dh)
    G = torch.zeros(B, H, T, kep.rank, dtype=x.dtype)
    E = torch.zeros_like(G)
    R = torch.zeros_like(G)
    for bb in range(B):
        real = [t for t in range(T) if mask is None or not bool(mask[bb, t])]
        n = len(real)
        lm = [real[(j * (n - 1)) // max(s - 1, 1)] for j in range(s)]
        for h in range(H):
            Xt = x[bb, lm, h * Dh : (h + 1) * Dh].T  # Dh × s
            phq = q[bb, :, h] / q[bb, :, h].norm(dim=-1, keepdim=True)
            phk = k[bb, :, h] / k[bb, :, h].norm(dim=-1, keepdim=True)
            E[bb, h] = phq @ (Xt @ kep.ksvd.omega_e[h])
            R[bb, h] = phk @ (Xt @ kep.ksvd.omega_r[h])
            if kep.merge == "add":
                G[bb, h] = E[bb, h] + R[bb, h]
            else:
                keep = torch.tensor([t in real for t in range(T)], dtype=x.dtype)[:, None]
                A = kep.token_weight
                G[bb, h] = A[:, :T] @ (E[bb, h] * keep) + A[:, T:] @ (R[bb, h] * keep)
    return G, E, R


def kep_svgp_dense_posterior(layer, x: torch.Tensor, mask: torch.Tensor | None = None) -> DenseReference:
    """KEP-SVGP (docs/derivations.md §6) recomputed from the layer's parameters: features (``kep_svgp_dense_features``),
    the brute-force moments (``kep_svgp_dense_moments``) and the layer's diagonal jitter. No residual
    term (``include_residual=False``) and no loss terms."""
    with torch.no_grad():
        G = kep_svgp_dense_features(layer, x, mask)[0]
        v, kep = layer.strategy.variational_distribution, layer.strategy
        lam = kep.ksvd.log_lambda.exp()
        mean, cov = kep_svgp_dense_moments(G, lam, v.variational_mean, v.chol, kep.out_weight, kep.out_bias)
    return DenseReference(mean, cov + layer.jitter * torch.eye(x.shape[1], dtype=x.dtype), {})


# ------------------------------------------------------------------ correlated GPs (docs/derivations.md §7–§8)
def canonical_rbf(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(−½‖a − b‖²) from explicit pairwise differences.  # shape: (..., n, d), (..., m, d) -> (..., n, m)"""
    return torch.exp(-0.5 * ((a[..., :, None, :] - b[..., None, :, :]) ** 2).sum(-1))


def cgp_dense_blocks(q, k, o, sigma_q, sigma_k) -> dict:
    """The CGP covariance blocks K_q, K_k, K_o, K_qo, K_ok with per-head scales σ_q, σ_k (H,).

    # shape: q, k, o (B, H, T, Dh) -> each (B, H, T, T)"""
    sq, sk = sigma_q[:, None, None], sigma_k[:, None, None]
    return dict(
        K_q=sq**2 * canonical_rbf(q, q),
        K_k=sk**2 * canonical_rbf(k, k),
        K_o=canonical_rbf(o, o),
        K_qo=sq * canonical_rbf(q, o),
        K_ok=sk * canonical_rbf(o, k),
    )


def cgp_dense_moments(q, k, o, v, sigma_q, sigma_k, sigma):
    """Exact CGP: ν (eq. 25 with z of eq. 24) and the per-column covariance of App. B (eqs. 45–52, the
    μ_o μ_oᵀ term *not* cancelled). Returns (ν, covariance, z, blocks).

    # shape: q, k, o (B, H, T, Dh), v (B, H, T, Dv) -> ν (B, H, T, Dv), cov (B, H, Dv, T, T), z like v"""
    K = cgp_dense_blocks(q, k, o, sigma_q, sigma_k)
    s2 = sigma**2
    eye = torch.eye(k.shape[-2], dtype=q.dtype)  # the keys' and latent inputs' (cross-attention: S ≠ T)
    A, Kk = K["K_o"] + s2 * eye, K["K_k"] + s2 * eye
    z = Kk @ v  # eq. 24
    mu_o = K["K_ok"] @ torch.linalg.solve(Kk, z)  # eq. 20
    nu = K["K_qo"] @ torch.linalg.solve(A, mu_o)  # eq. 21 / 25
    C_o = K["K_o"] - K["K_ok"] @ torch.linalg.solve(Kk, K["K_ok"].mT)
    HA = torch.linalg.solve(A, K["K_qo"].mT).mT  # K_qo A⁻¹
    covs = []
    for d in range(v.shape[-1]):
        m, nd = mu_o[..., d : d + 1], nu[..., d : d + 1]
        E_oo = C_o + m @ m.mT  # eq. 52
        E_qq = K["K_q"] - HA @ K["K_qo"].mT + HA @ E_oo @ HA.mT  # eq. 51
        covs.append(E_qq - nd @ nd.mT)  # eq. 45
    return nu, torch.stack(covs, 2), z, K


def _correlated_inputs(layer, x):
    p = layer.project(x)
    c = layer.input_scale
    return [t.detach() for t in (p["q"] * c, p["k"] * c, p["o"] * c, p["v"])]


def _mean_values(layer, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The values the correlated GPs' prior mean reads: the layer's own ``v_mean`` projection of ``x`` with
    ``prior_mean="softmax-separate"``, else the GP's values ``v``."""
    own = layer.strategy.mean_module.projections  # the mean's own value projection, if it has one
    return layer.project(x)[own[0]].detach() if own else v


def correlated_prior_mean_dense(gp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The prior mean of ``cgp`` / ``scgp`` (docs/derivations.md §7a) by its formula: 0 for the papers' zero mean;
    for ``prior_mean="softmax"`` exp(t q_i·k_j) v_j normalised over the keys, t the mean module's ``temperature``
    (``"softmax-separate"``: pass the mean's own values u as ``v``). No padding (compare truncated sequences).
    # shape: q (B, H, T, Dh), k (B, H, S, Dh), v (B, H, S, Dv) -> (B, H, T, Dv)"""
    if isinstance(gp.mean_module, ZeroMean):
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=v.dtype)
    return attention_mean_dense(torch.exp(gp.mean_module.temperature.detach() * (q @ k.mT)), v)


def _sigmas(gp):
    sigma = gp.sigma.detach()
    return gp.covar.sigma_q.detach(), gp.covar.sigma_k.detach(), sigma if sigma.dim() == 0 else sigma[:, None, None]


def cgp_dense_posterior(layer, x: torch.Tensor, mask: torch.Tensor | None = None) -> DenseReference:
    """A ``cgp`` layer (canonical RBF κ_o) recomputed densely: ``cgp_dense_moments`` on the layer's scaled
    per-head inputs, plus the diagonal jitter its posterior carries. No padding; the regulariser is not a
    dense quantity (no loss terms)."""
    if mask is not None:
        raise ValueError("cgp_dense_posterior takes no key_padding_mask (got one): compare truncated sequences")
    q, k, o, v = _correlated_inputs(layer, x)
    nu, cov, _, _ = cgp_dense_moments(q, k, o, v, *_sigmas(layer.strategy))
    jitter = layer.strategy.jitter * torch.eye(x.shape[1], dtype=x.dtype)  # the layer's posterior carries it
    m = correlated_prior_mean_dense(layer.strategy, q, k, _mean_values(layer, x, v))
    return DenseReference((nu + m).transpose(-1, -2), cov + jitter, {})


def scgp_dense_blocks(q, k, o, s, s_keys, sigma_q, sigma_k) -> dict:
    """The SCGP blocks against inducing inputs s (m latent) and s' (l keys).

    # shape: q, k, o (B, H, T, Dh), s (1, H, m, Dh), s_keys (1, H, l, Dh)"""
    sq, sk = sigma_q[:, None, None], sigma_k[:, None, None]
    return dict(
        K_qm=sq * canonical_rbf(q, s),
        K_om=canonical_rbf(o, s),
        K_mm=canonical_rbf(s, s).expand(q.shape[0], -1, -1, -1),
        K_ol=canonical_rbf(o, s_keys),
        K_kl=sk * canonical_rbf(k, s_keys),
        K_ll=canonical_rbf(s_keys, s_keys).expand(q.shape[0], -1, -1, -1),
    )


def scgp_dense_moments(q, k, o, z, s, s_keys, sigma_q, sigma_k, sigma):
    """Sparse (DTC) CGP: mean (eq. 33, σ⁻⁴ form) and per-column covariance from eqs. 59, 66, 67
    (μ_o μ_oᵀ kept). Returns (ν, covariance, blocks).

    # shape: -> ν (B, H, T, Dv), cov (B, H, Dv, T, T)"""
    K = scgp_dense_blocks(q, k, o, s, s_keys, sigma_q, sigma_k)
    s2 = sigma**2
    eye, eye_o = torch.eye(q.shape[-2], dtype=q.dtype), torch.eye(o.shape[-2], dtype=q.dtype)
    Mq = K["K_mm"] + K["K_om"].mT @ K["K_om"] / s2  # A_q⁻¹
    Mk = K["K_ll"] + K["K_kl"].mT @ K["K_kl"] / s2  # A_k⁻¹
    Fq = torch.linalg.solve(Mq, K["K_qm"].mT).mT  # K_qm A_q
    Fo = torch.linalg.solve(Mk, K["K_ol"].mT).mT  # K_ol A_k
    mu_o = Fo @ K["K_kl"].mT @ z / s2  # eq. 57
    nu = Fq @ K["K_om"].mT @ mu_o / s2  # eq. 58 (= eq. 33)
    covs = []
    for d in range(z.shape[-1]):
        w = Fo @ K["K_kl"].mT @ z[..., d : d + 1]
        E_oo = s2 * eye_o + Fo @ K["K_ol"].mT + w @ w.mT / s2**2  # eq. 67
        FqKmo = Fq @ K["K_om"].mT
        E_qq = s2 * eye + Fq @ K["K_qm"].mT + FqKmo @ E_oo @ FqKmo.mT / s2**2  # eq. 66
        nd = nu[..., d : d + 1]
        covs.append(E_qq - nd @ nd.mT)  # eq. 59
    return nu, torch.stack(covs, 2), K


def scgp_dense_posterior(layer, x: torch.Tensor, mask: torch.Tensor | None = None) -> DenseReference:
    """An ``scgp`` layer with global inducing inputs (``amortize=False``, ``jitter=0``) recomputed
    densely: ``scgp_dense_moments`` on the layer's scaled per-head inputs with z = v. No padding."""
    if mask is not None:
        raise ValueError("scgp_dense_posterior takes no key_padding_mask (got one): compare truncated sequences")
    gp = layer.strategy
    s, s_keys = gp.inducing_latent.detach()[None], gp.inducing_keys.detach()[None]
    q, k, o, v = _correlated_inputs(layer, x)
    nu, cov, _ = scgp_dense_moments(q, k, o, v, s, s_keys, *_sigmas(gp))
    m = correlated_prior_mean_dense(gp, q, k, _mean_values(layer, x, v))
    return DenseReference((nu + m).transpose(-1, -2), cov, {})


# ------------------------------------------------------------------ cross-attention (docs/derivations.md §13)
def sgpa_cross_dense_posterior(layer, x: torch.Tensor, context: torch.Tensor) -> DenseReference:
    """Standard SGPA in cross-attention as the textbook SVGP predictive at new inputs: inducing inputs the
    context's keys k (S of them), q(u_d) = N(m_d, S_d), S_d = L diag(s_d²) Lᵀ, L = chol(K_kk + jI); at x's
    queries q: mean K_qk K_kk⁻¹ m_d = K_qk v_d (zero prior mean, m_d = K_kk v_d) or m(q) (attention mean),
    covariance K_qq − K_qk K̂_kk⁻¹ K_kq + K_qk K̂_kk⁻¹ S_d K̂_kk⁻¹ K_kq by dense solves; KL of the keys' q(ũ)
    (``kl_seq``). No padding: compare a truncated context."""
    q, _ = sgpa_heads(layer, x)
    k, v = sgpa_heads(layer, context)
    kernel = layer.kernel
    Kj = _relative_jitter(gram_dense(kernel, k, k), layer.strategy.jitter)  # shape: (B, H, S, S)
    Kqk, Kqq = gram_dense(kernel, q, k), gram_dense(kernel, q, q)
    L = torch.linalg.cholesky(Kj)[:, :, None]  # shape: (B, H, 1, S, S)
    s = sgpa_amortised_std(layer, k).transpose(-1, -2)  # shape: (B, H, Dv, S)
    S_d = (L * s[..., None, :].square()) @ L.mT  # L diag(s_d²) Lᵀ, shape: (B, H, Dv, S, S)
    P = torch.linalg.solve(Kj, Kqk.mT)[:, :, None]  # K̂_kk⁻¹ K_kq, shape: (B, H, 1, S, T)
    cov = (Kqq - Kqk @ P[:, :, 0])[:, :, None] + P.mT @ S_d @ P
    if isinstance(layer.strategy.covariance, DiagonalCovariance):
        cov = torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    kl = 0.5 * (s.square() - 1 - s.square().log()).sum(-1)  # shape: (B, H, Dv)
    if not isinstance(layer.strategy.mean_module, ZeroMean):
        mean = prior_mean_dense(layer, q, k, v)
    else:
        mean, kl = Kqk @ v, kl + 0.5 * (v * (Kj @ v)).sum(-2)
    return DenseReference(mean.transpose(-1, -2), cov, {"kl_seq": kl.sum((1, 2)).mean(0)})


def sgpa_decoupled_cross_dense_posterior(layer, x: torch.Tensor, context: torch.Tensor) -> DenseReference:
    """Decoupled SGPA in cross-attention: the mean basis γ is the context's keys and values, the global basis
    the layer's, q(f) at x's queries (§5b's formulas with K_qa, K_ga, K_aa of the context); with the attention
    prior mean, m(q) over the context's keys + K_qg v_g. No padding: compare a truncated context."""
    mean, cov, gamma, beta = _decoupled(layer, x, None, context)
    if isinstance(layer.strategy.mean_module, ZeroMean):
        return DenseReference(mean, cov, {"kl_seq": gamma.sum((1, 2)).mean(0), "kl_global": beta.sum()})
    q, _ = sgpa_heads(layer, x)
    k, v = sgpa_heads(layer, context)
    vg = layer.strategy.variational_distribution.inducing_values.detach()  # shape: (H, M, Dv)
    Kqg = gram_dense(layer.kernel, q, sgpa_decoupled_global_keys(layer))
    mean = prior_mean_dense(layer, q, k, v) + Kqg @ vg
    return DenseReference(mean.transpose(-1, -2), cov, {"kl_global": beta.sum()})


def _cross_correlated_inputs(layer, x, context):
    """q of x and (k, o, v) of the context, scaled as the layer scales them."""
    return [_correlated_inputs(layer, x)[0], *_correlated_inputs(layer, context)[1:]]


def cgp_cross_dense_posterior(layer, x: torch.Tensor, context: torch.Tensor) -> DenseReference:
    """``cgp`` in cross-attention: z_q at x's queries given z_k at the context's keys through z_o at the
    context's latent inputs (App. B's covariance with the μ_o μ_oᵀ term kept, S ≠ T), plus the jitter its
    posterior carries; with ``prior_samples=None`` also the regulariser (eqs. 42–44 in expectation over z_o,
    T queries and S keys) as the loss term ``cgp`` (mean over the batch of Σ_{h,d} R / 2). No padding."""
    sigmas = _sigmas(layer.strategy)
    q, k, o, v = _cross_correlated_inputs(layer, x, context)
    nu, cov, z, K = cgp_dense_moments(q, k, o, v, *sigmas)
    jitter = layer.strategy.jitter * torch.eye(x.shape[1], dtype=x.dtype)
    m = correlated_prior_mean_dense(layer.strategy, q, k, _mean_values(layer, context, v))
    mean = (nu + m).transpose(-1, -2)  # R reads ν alone (§7a)
    if layer.strategy.prior_samples is not None:
        return DenseReference(mean, cov + jitter, {})
    s2 = sigmas[2] ** 2
    A = K["K_o"] + s2 * torch.eye(K["K_o"].shape[-1], dtype=x.dtype)
    R = 0
    for f, K_fo, K_f in ((nu, K["K_qo"], K["K_q"]), (z, K["K_ok"].mT, K["K_k"])):
        H_f = torch.linalg.solve(A, K_fo.mT).mT  # K_fo A⁻¹: m_f = H_f z_o
        Sig = K_f - H_f @ K_fo.mT + s2 * torch.eye(K_f.shape[-1], dtype=x.dtype)  # Σ_f + σ²I
        # E_{z_o ~ N(0, K_o)} (f − H_f z_o)ᵀ Σ⁻¹ (f − H_f z_o) = fᵀ Σ⁻¹ f + tr(Σ⁻¹ H_f K_o H_fᵀ)
        trace = torch.linalg.solve(Sig, H_f @ K["K_o"] @ H_f.mT).diagonal(dim1=-2, dim2=-1).sum(-1)
        R = R + (f * torch.linalg.solve(Sig, f)).sum(-2) + (trace + torch.linalg.slogdet(Sig)[1])[..., None]
    return DenseReference(mean, cov + jitter, {"cgp": R.sum((1, 2)).mean(0) / 2})


def scgp_cross_dense_posterior(layer, x: torch.Tensor, context: torch.Tensor) -> DenseReference:
    """``scgp`` (global inducing inputs) in cross-attention: eqs. 33, 59, 66, 67 with x's queries and the
    context's keys, latent inputs and z = v. No padding."""
    gp = layer.strategy
    s, s_keys = gp.inducing_latent.detach()[None], gp.inducing_keys.detach()[None]
    inputs = _cross_correlated_inputs(layer, x, context)
    nu, cov, K = scgp_dense_moments(*inputs, s, s_keys, *_sigmas(gp))
    s2, z = _sigmas(gp)[2] ** 2, inputs[3]
    R = 0  # App. E: (1/σ²)[‖f‖² + tr(C⁻¹ S K⁻¹ S C⁻¹ G) + σ² tr(C⁻¹ G)] + n log σ², per part (class docstring)
    for f, K_fi, K_oi, K_ii in ((nu, K["K_qm"], K["K_om"], K["K_mm"]), (z, K["K_kl"], K["K_ol"], K["K_ll"])):
        S_i, G = K_oi.mT @ K_oi, K_fi.mT @ K_fi
        C = s2 * K_ii + S_i
        CS = torch.linalg.solve(C, S_i)
        trace = (CS @ torch.linalg.solve(K_ii, S_i) @ torch.linalg.solve(C, G)).diagonal(dim1=-2, dim2=-1).sum(-1)
        s2_hd = torch.as_tensor(s2).reshape(-1, 1)  # shape: (H or 1, 1), against (B, H, ·)
        trace = trace[..., None] + s2_hd * torch.linalg.solve(C, G).diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)
        R = R + (f.square().sum(-2) + trace) / s2_hd + f.shape[-2] * s2_hd.log()
    m = correlated_prior_mean_dense(gp, inputs[0], inputs[1], _mean_values(layer, context, z))
    mean = nu + m  # R reads ν alone (§7a)
    return DenseReference(mean.transpose(-1, -2), cov, {"cgp": R.sum((1, 2)).mean(0) / 2})
