r"""The initial prior scale of every GP attention variant, relative to the residual stream.

A GP attention layer is one branch of a pre-LN residual block, ``x + W_o f(LN(x))``: its input has
unit variance per coordinate (LayerNorm), and whatever it adds is added to the stream. Its prior is
therefore part of the model specification, not only of the GP: a prior whose variance is larger than
the stream's drowns it in noise, and under the exact ELBO (β = α = 1) the per-sequence KL is then paid
by shrinking the posterior mean below that noise — the model collapses to the class prior (measured on
CoLA at the previous initialisation: prior variance ≈ 7 per coordinate, training cross-entropy at the
base-rate entropy for 10 epochs).

**The scale.** Projections of a LayerNorm-ed input through ``nn.Linear``'s default initialisation
(U(±1/√D)) have variance ≈ 1/3 per coordinate, so ‖q‖² ≈ Dh/3 per head. Each variant is initialised so
that the prior variance of one output coordinate of ``f`` at a token is about :data:`PRIOR_VARIANCE`
(1/20 of the input's unit variance), and, where the posterior has its own variational covariance on
global parameters, the posterior starts with a smaller spread than the prior. After ``W_o`` (variance 1/3 per coordinate at
initialisation) the output spread per token is then ≈ 0.1–0.2 of the LayerNorm-ed input's norm, and
the posterior mean is of the same order for T up to a few hundred tokens (KEP-SVGP's spread is larger,
≈ 0.7, see below). The GP variants' tests
(``tests/test_prior_scale.py``) pin these bands for every registered GP variant, T from 1 to 512, with
padding.

How each variant reaches it (a change of parameterisation only: the models are the papers'):

* ``sgpa``, ``sgpa-decoupled`` with a kernel built from its name: outputscale σ² = PRIOR_VARIANCE and,
  for the exponential kernel, ℓ = √Dh so that the exponent q·k/ℓ² ≈ 1/3 at most (κ(q, q) ≈ σ² e^{1/3});
  the ARD-RBF kernel already has κ(q, q) = σ². A kernel instance passed by the user is used as given.
* ``kep-svgp``: Λ = I and ω_r = ω_e at initialisation, so that the KSVD objective J starts near its
  stationary value 0 (with the landmark features of LayerNorm-ed tokens, E e_c² ≈ 1, so
  ½ E‖eΛ^{-1/2}‖² + ½ E‖rΛ^{-1/2}‖² ≈ r = tr(ω_eᵀω_r)); the prior N(0, Λ²) then gives f a prior
  variance O(1); q(u_c) starts with a small mean, m_c ~ N(0, 0.1² I) (:data:`KEP_MEAN_STD`; the released
  N(0, I) made the layer's mean output 5× its input), and the released covariance S_c = I/4
  (:data:`KEP_COVARIANCE_STD`), half the prior's standard deviation. A near-deterministic start
  (S_c = 0.01 I, as Salimbeni & Deisenroth initialise inner layers) was measured worse: on CoLA
  (β = 1, seed 0, 5 epochs) the in-domain NLL / ECE were 0.96 / 0.23 with std 0.1, 0.71 / 0.12 with 0.3
  and 0.67 / 0.08 with 0.5 (softmax 0.65 / 0.09): KEP's only KL is global (÷ N), so little pulls a
  small initial variance back up and the layer stays overconfident.
* ``cgp``, ``scgp``: σ_q = σ_k = √PRIOR_VARIANCE·√2 (:data:`CGP_SIGMA`), since K_q = σ_q² κ_o with
  κ_o(q, q) = 1 sets the prior variance of z_q directly.
"""

from __future__ import annotations

import math

__all__ = ["CGP_SIGMA", "KEP_COVARIANCE_STD", "KEP_MEAN_STD", "PRIOR_VARIANCE", "exponential_lengthscale"]

#: prior variance of one GP output coordinate at a token, at initialisation (the stream has 1)
PRIOR_VARIANCE = 0.05

#: initial standard deviation of KEP-SVGP's q(u_c) mean entries
KEP_MEAN_STD = 0.1

#: initial Cholesky diagonal of KEP-SVGP's q(u_c) covariance (the released value; the prior's is 1)
KEP_COVARIANCE_STD = 0.5

#: initial σ_q = σ_k of the correlated GPs (prior variance σ_q² of z_q at a token)
CGP_SIGMA = math.sqrt(2 * PRIOR_VARIANCE)


def exponential_lengthscale(head_dim: int) -> float:
    """ℓ = √Dh: the exponent q·k/ℓ² of a projected LayerNorm-ed token pair stays ≲ 1/3."""
    return math.sqrt(head_dim)
