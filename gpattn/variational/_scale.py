r"""The initial prior scale of every GP attention variant, relative to the residual stream
(docs/derivations.md §9, "The initial prior scale": the derivation, the choice, and the measurements
behind each constant).

A GP attention layer is one branch of a pre-LN residual block, ``x + W_o f(LN(x))``: its input has
unit variance per coordinate (LayerNorm), and whatever it adds is added to the stream. Its prior is
therefore part of the model specification, not only of the GP: a prior whose variance is larger than
the stream's drowns it in noise, and under the exact ELBO (β = α = 1) the per-sequence KL is then paid
by shrinking the posterior mean below that noise — the model collapses to the class prior.

**The scale.** Projections of a LayerNorm-ed input through ``nn.Linear``'s default initialisation
(U(±1/√D)) have variance ≈ 1/3 per coordinate, so ‖q‖² ≈ Dh/3 per head. Each variant is initialised so
that the prior variance of one output coordinate of ``f`` at a token is a small fraction of the input's
unit variance (:data:`PRIOR_VARIANCE` = 0.01 for SGPA, 0.1 for the correlated GPs), and, where the
posterior has its own variational covariance on global parameters, the posterior starts with a smaller
spread than the prior. Why small: under the exact ELBO a GP layer pays for its output mean with KL
(∝ 1/σ² per coordinate) and adds noise ∝ σ. The GP variants' tests (``tests/test_prior_scale.py``) pin the
resulting output bands for every registered GP variant, T from 1 to 512, with padding.

How each variant reaches it (a change of parameterisation only: the models are the papers'):

* ``sgpa``, ``sgpa-decoupled`` with a kernel built from its name: outputscale σ² = PRIOR_VARIANCE and,
  for the exponential kernel, ℓ = √Dh so that the exponent q·k/ℓ² ≈ 1/3 at most (κ(q, q) ≈ σ² e^{1/3});
  the ARD-RBF kernel already has κ(q, q) = σ². A kernel instance passed by the user is used as given.
* ``kep-svgp``: Λ = I and ω_r = ω_e at initialisation, so that the KSVD objective J starts near its
  stationary value 0 (with the landmark features of LayerNorm-ed tokens, E e_c² ≈ 1, so
  ½ E‖eΛ^{-1/2}‖² + ½ E‖rΛ^{-1/2}‖² ≈ r = tr(ω_eᵀω_r)); the paper's prior N(0, Λ²) then gives f a prior
  spread 1.5× the input, so the kernel gets the outputscale σ² = :data:`KEP_PRIOR_VARIANCE`, p(u_c) =
  N(0, σ²Λ²) (docs/derivations.md §6, "The prior's outputscale"); q(u_c) starts near-deterministic,
  m_c ~ N(0, 0.1² I) (:data:`KEP_MEAN_STD`; released:
  N(0, I)) and S_c = 0.01 I (:data:`KEP_COVARIANCE_STD`; released: I/4), as Salimbeni & Deisenroth
  initialise inner layers. KEP's only KL is global (÷ N), yet under Adam it still pulls S_c to the prior in
  training: that is why the prior itself is scaled.
* ``cgp``, ``scgp``: σ_q = σ_k = √0.1 (:data:`CGP_SIGMA`), since K_q = σ_q² κ_o with κ_o(q, q) = 1 sets
  the prior variance of z_q directly.

**Another stream** (a layer swapped into a pretrained encoder, :mod:`gpattn.integrations.huggingface`).
The fractions above assume a unit-variance input and a fresh W_o of gain :data:`NATIVE_OUTPUT_GAIN` = 1/3.
Inside a pretrained encoder the input has the stream's own variance v_s per coordinate and the swapped
``out_proj`` starts as the identity (gain g_o = 1), so the same prior adds more noise than designed.
``scale_prior(v_s · (1/3) / g_o)`` on every GP layer's strategy (``HFClassifier.match_prior_to_stream``)
restores the designed fraction; kep-svgp, whose noise already follows its input's amplitude, takes
``scale_prior((1/3) / g_o)``, which multiplies σ² and q(u_c)'s covariance (docs/derivations.md §6).
"""

from __future__ import annotations

import math

from gpattn.kernels._scale import attention_lengthscale, check_prior_factor, exponential_lengthscale

__all__ = [
    "CGP_SIGMA",
    "KEP_COVARIANCE_STD",
    "KEP_MEAN_STD",
    "KEP_PRIOR_VARIANCE",
    "NATIVE_OUTPUT_GAIN",
    "PRIOR_VARIANCE",
    "attention_lengthscale",
    "check_prior_factor",
    "exponential_lengthscale",
]

#: prior variance of one SGPA output coordinate at a token, at initialisation (the stream has 1)
PRIOR_VARIANCE = 0.01

#: initial standard deviation of KEP-SVGP's q(u_c) mean entries
KEP_MEAN_STD = 0.1

#: initial Cholesky diagonal of KEP-SVGP's q(u_c) covariance (the released value is 0.5; the prior's is 1)
KEP_COVARIANCE_STD = 0.1

#: σ², the outputscale of KEP-SVGP's attention kernel: p(u_c) = N(0, σ²Λ²) (1.0 is Chen et al.'s prior)
KEP_PRIOR_VARIANCE = 0.1

#: initial σ_q = σ_k of the correlated GPs (prior variance σ_q² = 0.1 of z_q at a token)
CGP_SIGMA = math.sqrt(0.1)


#: variance gain of a freshly initialised ``nn.Linear(D, D)`` output map W_o (U(±1/√D) entries): the
#: prior variances above reach the stream divided by 3
NATIVE_OUTPUT_GAIN = 1.0 / 3.0
