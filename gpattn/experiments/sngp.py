r"""SNGP: the single-pass, distance-aware baseline of Liu et al. (2020), "Simple and Principled Uncertainty
Estimation with Deterministic Deep Learning via Distance Awareness" (NeurIPS 2020), which also applies it to BERT
(BERT-SNGP).
docs/derivations.md §14 has the derivation and every choice.

Two changes to a trained-from-scratch classifier, both trained, plus one pass after training:

1. **Spectral normalisation** (:func:`spectral_normalise`) of the residual branches' weight matrices: every
   ``nn.Linear`` inside the transformer blocks (the attention's input and output projections, the FFN's two
   layers), :math:`W \leftarrow W \cdot \min(1, c/\hat\sigma(W))` with :math:`\hat\sigma` torch's power
   iteration (``torch.nn.utils.parametrizations.spectral_norm``, one iteration per training forward).
2. **A random-feature GP output layer** (:class:`RandomFeatureGP`) in place of the linear head:

   .. math::
       \phi(h) = \sqrt{2/D_L}\,\cos(W\,\mathrm{LN}(h) + b), \quad W_{ij} \sim \mathcal N(0, \ell^{-2}),\;
       b_j \sim \mathcal U(0, 2\pi) \text{ (fixed)}, \qquad \mathrm{logits} = \beta\,\phi(h) + \beta_0,

   with the prior :math:`\beta_{c} \sim \mathcal N(0, s^{-1} I)` registered as a gpytorch prior, so the
   training objective (:class:`gpattn.objectives.DeepGPELBO`) is the MAP objective the Laplace step expands.
3. **The Laplace covariance** (:func:`fit_covariance`, one pass over the training data at the final weights):

   .. math::
       \Sigma^{-1} = s I + \sum_i p_i (1 - p_i)\, \phi_i \phi_i^\top, \qquad p_i = \max_c \mathrm{softmax}(\beta\phi_i
       + \beta_0)_c,

   and in eval mode the head returns the paper's mean-field logits
   :math:`\mathrm{logits} / \sqrt{1 + \lambda\, \phi^\top \Sigma \phi}` with :math:`\lambda = \pi/8`.
   Σ is held in the form the fit chooses by the N training rows (:class:`gpattn.experiments.sngp.Posterior`):
   the Cholesky factor of :math:`\Sigma^{-1}` (:class:`gpattn.experiments.sngp.CholeskyPosterior`), or below
   :math:`D_L/2` rows the thin SVD of the weighted rows (:class:`gpattn.experiments.sngp.LowRankPosterior`,
   docs/derivations.md §14a), the same :math:`\phi^\top \Sigma \phi` at less cost.

:func:`apply_sngp` turns a gpattn classifier or a pretrained-encoder model into its SNGP form (``softmax+sngp`` in
``compare``; the ``sngp`` field of :class:`gpattn.experiments.training.TrainConfig`); which matrices are spectral-
normalised is a :class:`SpectralScope` (:data:`SPECTRAL_SCOPES`: ``none``, ``blocks``, ``all``), ``blocks`` from
scratch and ``none`` on a pretrained encoder (:func:`sngp_options`, uncertainty-baselines' BERT-SNGP). The head
works in any model:
``head(h)`` in train mode gives the MAP logits, :meth:`RandomFeatureGP.fit` sets the covariance from head
inputs, and in eval mode ``head(h)`` gives the mean-field logits (before a fit: under the prior covariance
:math:`s^{-1} I`, the posterior after no data).
"""

from __future__ import annotations

import math

import gpytorch
import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

from gpattn._migrate import migrate_state_dict
from gpattn.variational._linalg import cholesky

__all__ = [
    "ENCODER_SNGP",
    "MEAN_FIELD_FACTOR",
    "SNGP_DEFAULTS",
    "SPECTRAL_SCOPES",
    "AllLinears",
    "BlockLinears",
    "CholeskyPosterior",
    "DenseGram",
    "Gram",
    "LowRankGram",
    "LowRankPosterior",
    "NoSpectralNorm",
    "Posterior",
    "RandomFeatureGP",
    "SpectralScope",
    "apply_sngp",
    "check_sngp_options",
    "fit_covariance",
    "laplace_weights",
    "mean_field_logits",
    "sngp_options",
    "spectral_normalise",
]

#: λ of Liu et al.'s mean-field logit adjustment (the probit approximation of the logistic)
MEAN_FIELD_FACTOR = math.pi / 8

#: the options of :func:`apply_sngp` (``TrainConfig.sngp`` holds them all, so config.json records each value):
#: c the spectral bound, D_L random features, ℓ (None: √D, the unit lengthscale on LN(h)/√D), s the ridge
SNGP_DEFAULTS = {
    "spectral_bound": 0.95,
    "power_iterations": 1,
    "num_features": 1024,
    "lengthscale": None,
    "input_norm": True,
    "ridge": 1.0,
    "mean_field_factor": MEAN_FIELD_FACTOR,
}


def _positive(name: str, value, integer: bool = False):
    number = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive {'int' if integer else 'finite number'}, got {value!r}")
    return value


def check_sngp_options(options: dict) -> dict:
    """``options`` (a subset of :data:`SNGP_DEFAULTS` and ``spectral_norm``) checked and completed with the
    defaults (``spectral_norm`` absent: ``"blocks"``, the from-scratch recipe); a ``ValueError`` naming the option
    for an unknown key or a bad value."""
    valid = {*SNGP_DEFAULTS, "spectral_norm"}
    if not isinstance(options, dict):
        raise ValueError(f"sngp options must be a dict (keys {sorted(valid)}), got {options!r}")
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ValueError(f"unknown sngp options {unknown}; valid: {', '.join(sorted(valid))}")
    out = {**SNGP_DEFAULTS, "spectral_norm": BlockLinears.name, **options}
    if out["spectral_norm"] not in SPECTRAL_SCOPES:
        raise ValueError(f"spectral_norm must be one of {', '.join(SPECTRAL_SCOPES)}, got {out['spectral_norm']!r}")
    for name in ("spectral_bound", "ridge"):
        _positive(name, out[name])
    for name in ("power_iterations", "num_features"):
        _positive(name, out[name], integer=True)
    lam = out["mean_field_factor"]
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"mean_field_factor must be a finite number >= 0 (0: the MAP logits), got {lam!r}")
    if out["lengthscale"] is not None:
        _positive("lengthscale", out["lengthscale"])
    if not isinstance(out["input_norm"], bool):
        raise ValueError(f"input_norm must be True or False, got {out['input_norm']!r}")
    return out


# ----------------------------------------------------------------------------- which matrices are normalised
class SpectralScope:
    """Which ``nn.Linear`` modules of a classifier :func:`apply_sngp` spectral-normalises (docs/derivations.md §14,
    "Choice (which matrices)"): :meth:`linears` of a model, never its head."""

    #: the option's value (``TrainConfig.sngp["spectral_norm"]``)
    name = ""

    def linears(self, model: nn.Module) -> list[nn.Linear]:  # pragma: no cover - the protocol
        """The ``nn.Linear`` modules of ``model`` to spectral-normalise (never ``model.head``'s)."""
        raise NotImplementedError


class NoSpectralNorm(SpectralScope):
    """None: the GP head alone. The pretrained-encoder recipe (uncertainty-baselines' BERT-SNGP on CLINC150 leaves
    the attention and feed-forward layers of the pretrained BERT unnormalised; it hurt accuracy there)."""

    name = "none"

    def linears(self, model: nn.Module) -> list[nn.Linear]:
        return []


class BlockLinears(SpectralScope):
    """Every ``nn.Linear`` of the transformer layers the model trains (``model.trained_layers()``: a gpattn
    classifier's blocks; an encoder model's top layers with the frozen trunk, else all its layers): the attention
    projections and the feed-forward layers, the residual branches (Liu et al.'s recipe from scratch)."""

    name = "blocks"

    def linears(self, model: nn.Module) -> list[nn.Linear]:
        return [m for m in model.trained_layers().modules() if isinstance(m, nn.Linear)]


class AllLinears(SpectralScope):
    """Every ``nn.Linear`` of the model that training changes (its weight requires a gradient), the head aside:
    the blocks' and the input map's (a ViT's patch embedding, a dense-feature embedding)."""

    name = "all"

    def linears(self, model: nn.Module) -> list[nn.Linear]:
        head = set(map(id, model.head.modules()))
        return [
            m for m in model.modules()
            if isinstance(m, nn.Linear) and id(m) not in head and m.weight.requires_grad
        ]  # fmt: skip


#: ``spectral_norm`` option values -> the scope objects
SPECTRAL_SCOPES: dict[str, SpectralScope] = {s.name: s for s in (NoSpectralNorm(), BlockLinears(), AllLinears())}

#: the options a pretrained encoder's ``+sngp`` changes from :data:`SNGP_DEFAULTS` (uncertainty-baselines' BERT-SNGP,
#: baselines/clinc_intent/sngp.py: ``use_spec_norm_att=False``, ``use_spec_norm_ffn=False``)
ENCODER_SNGP = {"spectral_norm": NoSpectralNorm.name}


def sngp_options(encoder: bool) -> dict:
    """The ``TrainConfig.sngp`` of a ``+sngp`` run: :data:`SNGP_DEFAULTS` from scratch, with :data:`ENCODER_SNGP`
    on a pretrained encoder (``encoder``: whether the run has one)."""
    return {**SNGP_DEFAULTS, **(ENCODER_SNGP if encoder else {})}


# ----------------------------------------------------------------------------- spectral normalisation
class _SpectralBound(nn.Module):
    """W · min(1, c / σ̂(W)), σ̂ from torch's spectral-norm parametrisation ``normalised`` (W / σ̂, its power
    iteration and its u, v buffers): σ̂ = ⟨W, W⟩ / ⟨W, W / σ̂⟩."""

    def __init__(self, normalised: nn.Module, bound: float):
        super().__init__()
        self.normalised, self.bound = normalised, float(bound)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        unit = self.normalised(weight)  # W / σ̂; in training mode one more power iteration
        sigma = (weight * weight).sum() / (weight * unit).sum()
        return weight * torch.clamp(self.bound / sigma, max=1.0)

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def extra_repr(self) -> str:
        return f"bound={self.bound}"


def spectral_normalise(linear: nn.Linear, bound: float = 0.95, power_iterations: int = 1) -> nn.Linear:
    """Bound the spectral norm of ``linear.weight`` by ``bound`` (Liu et al.'s spectral normalisation), in place:
    torch's ``spectral_norm`` parametrisation (``power_iterations`` per training forward) wrapped so that a weight
    whose estimated norm is below the bound is left as it is. Returns ``linear``."""
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"linear must be an nn.Linear, got {type(linear).__name__}")
    _positive("bound", bound)
    _positive("power_iterations", power_iterations, integer=True)
    if parametrize.is_parametrized(linear, "weight"):
        raise ValueError("linear.weight is parametrised already (spectral normalisation applied twice?)")
    spectral_norm(linear, n_power_iterations=power_iterations)
    plist = linear.parametrizations.weight
    plist[0] = _SpectralBound(plist[0], bound)
    return linear


# ----------------------------------------------------------------------------- the GP output layer
def mean_field_logits(logits: torch.Tensor, variance: torch.Tensor, factor: float = MEAN_FIELD_FACTOR) -> torch.Tensor:
    """Liu et al.'s mean-field logits: logits / sqrt(1 + λ·var), the probit approximation of E[softmax(f)],
    f ~ N(logits, var·I).  # shape: logits (..., C), variance (...) -> (..., C)"""
    return logits / torch.sqrt(1.0 + factor * variance.clamp_min(0.0)).unsqueeze(-1)


def laplace_weights(logits: torch.Tensor) -> torch.Tensor:
    """p(1 − p) with p the predicted class's probability: the curvature weight of each example in the
    Laplace precision (docs/derivations.md §14).  # shape: (N, C) -> (N,)"""
    p = torch.softmax(logits, dim=-1).amax(dim=-1)
    return p * (1.0 - p)


# ----------------------------------------------------------------------------- the posterior covariance's two forms
class Posterior(nn.Module):
    r"""The posterior covariance Σ = (s·I + G)⁻¹ of the GP layer's β in a form that gives v(φ) = φᵀ Σ φ
    (docs/derivations.md §14a, "Low-rank posterior when N < R"): :class:`gpattn.experiments.sngp.CholeskyPosterior`
    or :class:`gpattn.experiments.sngp.LowRankPosterior`, the one the data's :class:`gpattn.experiments.sngp.Gram`
    gives. Its fitted numbers are float64 buffers, so the layer's ``state_dict`` carries them."""

    def variance(self, phi: torch.Tensor) -> torch.Tensor:  # pragma: no cover - the protocol
        """φᵀ Σ φ per row, float64, no gradient.  # shape: (M, D_L) -> (M,)"""
        raise NotImplementedError

    @classmethod
    def empty(cls, state: dict, prefix: str, device) -> Posterior:  # pragma: no cover - the protocol
        """A posterior of this form with the shapes of ``state``'s tensors under ``prefix`` (their values follow
        from ``load_state_dict``), or None where ``state`` holds no posterior of this form."""
        raise NotImplementedError


def _float64(phi: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return phi.detach().to(like.dtype)


class CholeskyPosterior(Posterior):
    """Σ⁻¹ = L Lᵀ by its lower Cholesky factor L ``(D_L, D_L)``: v(φ) = ‖L⁻¹ φ‖², one triangular solve (R²/2
    multiply-adds per row, R = D_L). The form of N ≥ R/2 training rows (:class:`gpattn.experiments.sngp.DenseGram`)."""

    def __init__(self, factor: torch.Tensor):
        super().__init__()
        self.register_buffer("factor", factor)

    def variance(self, phi: torch.Tensor) -> torch.Tensor:
        L = self.factor
        with torch.autocast(phi.device.type, enabled=False):
            v = torch.linalg.solve_triangular(L, _float64(phi, L).T, upper=False)  # shape: (D_L, M)
        return (v * v).sum(0)

    @classmethod
    def empty(cls, state: dict, prefix: str, device) -> CholeskyPosterior | None:
        factor = state.get(prefix + "factor")
        return None if factor is None else cls(torch.empty(factor.shape, dtype=torch.float64, device=device))


class LowRankPosterior(Posterior):
    r"""Σ⁻¹ = s·I + V diag(σ²) Vᵀ with V ``(D_L, K)`` orthonormal columns (the weighted training rows' right singular
    vectors, K ≤ N), σ² ``(K,)`` and s the ridge:

    .. math::
        v(\phi) = \sum_k \frac{(v_k^\top \phi)^2}{s + \sigma_k^2} + \frac{\|\phi\|^2 - \|V^\top \phi\|^2}{s},

    the first term inside the data's span, the second its complement (the prior's 1/s), each ≥ 0: R·K multiply-adds
    per row. K = 0 is the prior s⁻¹·I. The form of N < R/2 training rows
    (:class:`gpattn.experiments.sngp.LowRankGram`); V and σ² are shared by the posteriors of every ridge."""

    def __init__(self, basis: torch.Tensor, spectrum: torch.Tensor, ridge):
        super().__init__()
        self.register_buffer("basis", basis)  # V, shape: (D_L, K)
        self.register_buffer("spectrum", spectrum)  # σ², shape: (K,)
        self.register_buffer("ridge", torch.as_tensor(ridge, dtype=torch.float64, device=basis.device).clone())

    @classmethod
    def prior(cls, num_features: int, ridge: float, device=None) -> LowRankPosterior:
        """Σ = s⁻¹·I, the posterior after no data (K = 0)."""
        zeros = torch.zeros(num_features, 0, dtype=torch.float64, device=device)
        return cls(zeros, zeros.new_zeros(0), ridge)

    def variance(self, phi: torch.Tensor) -> torch.Tensor:
        V = self.basis
        with torch.autocast(phi.device.type, enabled=False):
            x = _float64(phi, V)
            inside = (x @ V) ** 2  # (v_kᵀφ)², shape: (M, K)
            outside = ((x * x).sum(-1) - inside.sum(-1)).clamp_min(0.0)  # ‖φ‖² − ‖Vᵀφ‖², rounding kept ≥ 0
            return (inside / (self.ridge + self.spectrum)).sum(-1) + outside / self.ridge

    @classmethod
    def empty(cls, state: dict, prefix: str, device) -> LowRankPosterior | None:
        basis = state.get(prefix + "basis")
        if basis is None:
            return None
        return cls(torch.empty(basis.shape, dtype=torch.float64, device=device),
                   torch.empty(basis.shape[1:], dtype=torch.float64, device=device), 1.0)


#: the posterior forms a state dict may hold (:class:`RandomFeatureGP`'s load hook builds the one it finds)
_POSTERIORS = (CholeskyPosterior, LowRankPosterior)


class Gram:
    """The data's part of the precision, G = Σᵢ wᵢ φᵢ φᵢᵀ over ``count`` training rows, in the form that gives the
    posterior at any ridge s (:meth:`gpattn.experiments.sngp.Gram.posterior`):
    :class:`gpattn.experiments.sngp.DenseGram` or :class:`gpattn.experiments.sngp.LowRankGram`, chosen by N
    (:meth:`gpattn.experiments.sngp.RandomFeatureGP.feature_gram`). One Gram serves every ridge of a grid."""

    count: int
    num_features: int

    def posterior(self, ridge: float) -> Posterior:  # pragma: no cover - the protocol
        """The posterior of Σ⁻¹ = s·I + G at ridge s."""
        raise NotImplementedError


class DenseGram(Gram):
    """G as a ``(D_L, D_L)`` float64 matrix: each ridge's posterior is one Cholesky factorisation of s·I + G
    (R³/6 multiply-adds) and a :class:`gpattn.experiments.sngp.CholeskyPosterior`."""

    def __init__(self, gram: torch.Tensor, count: int):
        self.gram, self.count, self.num_features = gram, int(count), gram.shape[-1]

    def posterior(self, ridge: float) -> CholeskyPosterior:
        eye = torch.eye(self.num_features, dtype=torch.float64, device=self.gram.device)
        return CholeskyPosterior(cholesky(ridge * eye + self.gram.to(eye), name="SNGP Laplace precision"))


class LowRankGram(Gram):
    r"""G = V diag(σ²) Vᵀ from the thin SVD of the weighted training rows Φ̃ = W^{1/2} Φ = U S Vᵀ (N × D_L, N < D_L):
    V ``(D_L, N)``, σ² = S². Every ridge's posterior is a :class:`gpattn.experiments.sngp.LowRankPosterior` on the
    same V and σ² (no factorisation per ridge)."""

    def __init__(self, basis: torch.Tensor, spectrum: torch.Tensor, count: int):
        self.basis, self.spectrum, self.count, self.num_features = basis, spectrum, int(count), basis.shape[0]

    @staticmethod
    def pays(count: int, num_features: int) -> bool:
        """Whether N = ``count`` rows make the low-rank form the cheaper one: N < R/2, where its R·N multiply-adds
        per row undercut the triangular solve's R²/2 (docs/derivations.md §14a, "Low-rank posterior when N < R")."""
        return 2 * count < num_features

    @classmethod
    def of_rows(cls, rows: torch.Tensor, count: int) -> LowRankGram:
        """From the weighted rows Φ̃ = W^{1/2} Φ ``(N, D_L)``, float64: their thin SVD."""
        if rows.shape[0] == 0:
            return cls(rows.new_zeros(rows.shape[1], 0), rows.new_zeros(0), count)
        _, singular, vh = torch.linalg.svd(rows, full_matrices=False)
        return cls(vh.mT, singular * singular, count)

    def posterior(self, ridge: float) -> LowRankPosterior:
        return LowRankPosterior(self.basis, self.spectrum, ridge)


def _load_posterior(module: RandomFeatureGP, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of :class:`RandomFeatureGP`: an older state dict's ``precision_factor`` moves to
    ``posterior.factor`` (:data:`gpattn._migrate.OLD_KEYS`), and the posterior becomes the form the state dict holds,
    at its shapes (a low-rank V is (D_L, N), N the fitted rows), for ``load_state_dict`` to fill."""
    migrate_state_dict(module, state_dict, prefix, *args)
    for form in _POSTERIORS:
        posterior = form.empty(state_dict, prefix + "posterior.", module.feature_weight.device)
        if posterior is not None:
            module.posterior = posterior
            return


class RandomFeatureGP(gpytorch.Module):
    r"""The random-feature GP output layer of SNGP (Liu et al.; module docstring, docs/derivations.md §14).

    :param in_features: D, the width of the head's input h.
    :param num_classes: C.
    :param num_features: D_L, the number of random Fourier features (1024 as in the paper).
    :param lengthscale: ℓ of the RBF kernel the features approximate; None: √D.
    :param input_norm: a LayerNorm without affine on h before the features (the paper's optional input
        normalisation), so ℓ is a lengthscale of a fixed scale.
    :param ridge: s, the prior precision of β (the Laplace precision's ``s·I``).
    :param mean_field_factor: λ of the eval-mode mean-field logits (0: the MAP logits).
    """

    def __init__(
        self, in_features: int, num_classes: int, *, num_features: int = 1024, lengthscale: float | None = None,
        input_norm: bool = True, ridge: float = 1.0, mean_field_factor: float = MEAN_FIELD_FACTOR,
    ):
        super().__init__()
        _positive("in_features", in_features, integer=True)
        _positive("num_classes", num_classes, integer=True)
        opts = check_sngp_options(dict(
            num_features=num_features, lengthscale=lengthscale, input_norm=input_norm, ridge=ridge,
            mean_field_factor=mean_field_factor,
        ))
        ell = math.sqrt(in_features) if lengthscale is None else float(lengthscale)
        self.in_features = in_features  # D, as nn.Linear names its input width
        self.num_features, self.lengthscale, self.ridge = num_features, ell, float(ridge)
        self.mean_field_factor = float(opts["mean_field_factor"])
        self.norm = nn.LayerNorm(in_features, elementwise_affine=False) if input_norm else nn.Identity()
        self.register_buffer("feature_weight", torch.randn(num_features, in_features) / ell)  # W ~ N(0, ℓ⁻²)
        self.register_buffer("feature_bias", torch.rand(num_features) * (2 * math.pi))  # b ~ U(0, 2π)
        self.output = nn.Linear(num_features, num_classes)  # β and the constant mean β₀
        # β starts at a draw of its prior N(0, s⁻¹ I): the initial logits are a draw of the GP prior (unit amplitude)
        nn.init.normal_(self.output.weight, 0.0, 1.0 / math.sqrt(self.ridge))
        nn.init.zeros_(self.output.bias)
        self.register_prior(
            "beta_prior", gpytorch.priors.NormalPrior(0.0, 1.0 / math.sqrt(self.ridge)), lambda m: m.output.weight
        )
        #: Σ in the form the fit chose (:class:`gpattn.experiments.sngp.Posterior`, float64 buffers); s⁻¹·I, the
        #: prior, until :meth:`fit`
        self.posterior: Posterior = LowRankPosterior.prior(num_features, self.ridge)
        self._register_load_state_dict_pre_hook(_load_posterior, with_module=True)
        #: how many examples the covariance was fitted on (0: the prior)
        self.register_buffer("num_fitted", torch.zeros((), dtype=torch.long))

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """φ(h) = √(2/D_L) cos(W LN(h) + b).  # shape: (..., D) -> (..., D_L)"""
        z = self.norm(h) @ self.feature_weight.T + self.feature_bias
        return math.sqrt(2.0 / self.num_features) * torch.cos(z)

    def variance(self, phi: torch.Tensor) -> torch.Tensor:
        """φᵀ Σ φ, float64, from the fitted :class:`gpattn.experiments.sngp.Posterior`.  # shape: (N, D_L) -> (N,)"""
        return self.posterior.variance(phi)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Train mode: the MAP logits βφ + β₀; eval mode: the mean-field logits.  # shape: (N, D) -> (N, C)"""
        phi = self.features(h)
        logits = self.output(phi)
        if self.training or self.mean_field_factor == 0:
            return logits
        var = self.variance(phi.reshape(-1, self.num_features)).reshape(phi.shape[:-1])
        return mean_field_logits(logits, var.to(logits.dtype), self.mean_field_factor)

    @torch.no_grad()
    def fit(self, inputs) -> RandomFeatureGP:
        """Set the Laplace covariance from head inputs h at the current weights: a tensor ``(N, D)`` or an
        iterable of such batches; Σ⁻¹ = s·I + Σᵢ pᵢ(1 − pᵢ) φᵢ φᵢᵀ accumulated in float64, then factorised."""
        batches = [inputs] if torch.is_tensor(inputs) else inputs
        return self.fit_features(self.features(b.to(self.feature_weight.device)) for b in batches)

    @torch.no_grad()
    def fit_features(self, features, weights=None) -> RandomFeatureGP:
        """:meth:`fit` from the random features φ ``(N, D_L)`` (a tensor or an iterable of batches).

        ``weights``: each example's curvature weight wᵢ in Σ⁻¹ = s·I + Σᵢ wᵢ φᵢ φᵢᵀ, a tensor ``(N,)`` beside a
        tensor of features or an iterable of ``(N_b,)`` tensors beside the batches; None: the Laplace weights
        pᵢ(1 − pᵢ) of the layer's own logits (:func:`laplace_weights`)."""
        return self.set_gram(self.feature_gram(features, weights))

    @torch.no_grad()
    def feature_gram(self, features, weights=None) -> Gram:
        """The data's part of the precision, G = Σᵢ wᵢ φᵢ φᵢᵀ in float64 over the N rows, from features and weights
        as :meth:`fit_features` reads them; :meth:`set_gram` turns it into the posterior at the layer's ridge s (one G
        serves every ridge). While N < R/2 (:meth:`gpattn.experiments.sngp.LowRankGram.pays`) the weighted rows are
        kept and G is their thin SVD (:class:`gpattn.experiments.sngp.LowRankGram`); from there on G is summed as a
        ``(D_L, D_L)`` matrix (:class:`gpattn.experiments.sngp.DenseGram`), batch by batch from zero."""
        batches = [features] if torch.is_tensor(features) else features
        if weights is not None:
            weights = [weights] if torch.is_tensor(weights) else weights
            batches = zip(batches, weights, strict=True)
        like = torch.zeros((), dtype=torch.float64, device=self.feature_weight.device)
        rows: list[torch.Tensor] = []  # √w φ while the low-rank form pays
        gram, count = None, 0
        for item in batches:
            phi, w = item if weights is not None else (item, None)
            if phi.dim() != 2 or phi.shape[1] != self.num_features:
                raise ValueError(f"features must have shape (N, D_L={self.num_features}), got {tuple(phi.shape)}")
            phi = phi.to(like)
            if w is None:
                logits = nn.functional.linear(phi, self.output.weight.to(like), self.output.bias.to(like))
                w = laplace_weights(logits)
            elif w.shape != phi.shape[:1] or bool((w < 0).any()):
                raise ValueError(f"weights must be >= 0 of shape ({phi.shape[0]},) beside the features, got "
                                 f"{tuple(w.shape)}")
            rows.append(phi * w.to(like).sqrt().unsqueeze(-1))  # √w φ (w = p(1−p): the Laplace precision)
            count += phi.shape[0]
            if gram is None and LowRankGram.pays(count, self.num_features):
                continue
            if gram is None:
                gram = like.new_zeros(self.num_features, self.num_features)
            for scaled in rows:  # the batches in their order, as one sum
                gram += scaled.T @ scaled  # shape: (D_L, D_L)
            rows = []
        if gram is not None:
            return DenseGram(gram, count)
        return LowRankGram.of_rows(torch.cat(rows) if rows else like.new_zeros(0, self.num_features), count)

    @torch.no_grad()
    def set_gram(self, gram: Gram) -> RandomFeatureGP:
        """The posterior of Σ⁻¹ = s·I + G at the layer's ridge s, from :meth:`feature_gram`'s G
        (a :class:`gpattn.experiments.sngp.Gram`)."""
        if not isinstance(gram, Gram) or gram.num_features != self.num_features:
            got = f"one of D_L = {gram.num_features}" if isinstance(gram, Gram) else type(gram).__name__
            raise ValueError(f"gram must be the Gram of this layer's D_L = {self.num_features} features "
                             f"(feature_gram's), got {got}")
        self.posterior = gram.posterior(self.ridge)
        self.num_fitted.fill_(gram.count)
        return self

    def extra_repr(self) -> str:
        return (
            f"num_features={self.num_features}, lengthscale={self.lengthscale:g}, ridge={self.ridge:g}, "
            f"mean_field_factor={self.mean_field_factor:g}"
        )


# ----------------------------------------------------------------------------- a whole classifier
def apply_sngp(model: nn.Module, **options) -> nn.Module:
    """Make a classifier an SNGP model, in place: spectral normalisation of the ``nn.Linear`` modules its
    ``spectral_norm`` option's :class:`SpectralScope` names (default ``"blocks"``: every ``nn.Linear`` of the
    transformer blocks, attention projections and FFN) and a :class:`RandomFeatureGP` as ``model.head``. The model:
    a gpattn classifier (``TransformerClassifier``, ``ViTClassifier``) or an encoder model
    (:class:`gpattn.integrations.huggingface.HFClassifier`): ``model.trained_layers()`` and a linear ``model.head``.
    ``options``: :data:`SNGP_DEFAULTS` and ``spectral_norm`` (:data:`SPECTRAL_SCOPES`). Returns ``model``."""
    opts = check_sngp_options(options)
    head = getattr(model, "head", None)
    if not callable(getattr(model, "trained_layers", None)) or not isinstance(head, nn.Linear):
        raise ValueError(
            "apply_sngp needs a gpattn classifier (TransformerClassifier, ViTClassifier or HFClassifier: "
            f"model.trained_layers() and a Linear model.head), got {type(model).__name__}; for another model use "
            "spectral_normalise and RandomFeatureGP directly"
        )
    for module in SPECTRAL_SCOPES[opts["spectral_norm"]].linears(model):
        spectral_normalise(module, opts["spectral_bound"], opts["power_iterations"])
    model.head = RandomFeatureGP(
        head.in_features, head.out_features, num_features=opts["num_features"], lengthscale=opts["lengthscale"],
        input_norm=opts["input_norm"], ridge=opts["ridge"], mean_field_factor=opts["mean_field_factor"],
    ).to(head.weight.device)
    return model


@torch.no_grad()
def fit_covariance(model: nn.Module, batches) -> RandomFeatureGP:
    """The Laplace covariance of ``model.head`` (a :class:`RandomFeatureGP`) from one eval-mode pass over the
    training data at the current weights: ``batches`` yields ``(inputs, key_padding_mask)`` pairs (mask None
    for images), each run as ``model(inputs, key_padding_mask, num_samples=1)``. Returns the head; the model's
    train/eval mode is restored. In eval mode the model then predicts the mean-field logits."""
    head = getattr(model, "head", None)
    if not isinstance(head, RandomFeatureGP):
        raise ValueError(f"model.head must be a RandomFeatureGP (apply_sngp), got {type(head).__name__}")
    phi: list[torch.Tensor] = []  # the random features, the input of β
    hook = head.output.register_forward_hook(lambda module, args, output: phi.append(args[0].detach()))
    was_training = model.training
    try:
        model.eval()
        for inputs, mask in batches:
            model(inputs, mask, num_samples=1)
    finally:
        hook.remove()
        model.train(was_training)
    return head.fit_features(phi)
