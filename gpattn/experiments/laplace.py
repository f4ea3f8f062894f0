r"""Last-layer Laplace approximation: the post-hoc Bayesian baseline of "Laplace Redux" (Daxberger et
al., NeurIPS 2021), on a trained classifier whose last layer is the Linear ``model.head``.

The body of the network is frozen and only the head is Bayesian. With features
:math:`\phi_n = \phi(x_n) \in \mathbb{R}^D` (the head's input: the pooled representation) and
parameters :math:`\theta = (\mathrm{vec}\,W, b)` (``W`` row-major, then ``b``; the order of
``parameters_to_vector(head.parameters())``), the logits are linear in :math:`\theta`:

.. math::
    f_n(\theta) = W\phi_n + b = J_n\theta, \qquad J_n = [\,I_C \otimes \phi_n^\top,\; I_C\,].

Laplace around the trained :math:`\theta^*` with prior :math:`\mathcal{N}(0, \lambda^{-1} I)`:

.. math::
    q(\theta) = \mathcal{N}(\theta^*, \Sigma), \quad \Sigma^{-1} = G + \lambda I, \quad
    G = \sum_n J_n^\top \Lambda_n J_n, \quad \Lambda_n = \mathrm{diag}(p_n) - p_n p_n^\top,

:math:`p_n = \mathrm{softmax}(f_n(\theta^*))`. For the last layer the generalised Gauss-Newton
:math:`G` is the exact Hessian of the summed cross-entropy (the loss is convex in the logits and
the logits are linear in :math:`\theta`). Since :math:`f_n` is linear in :math:`\theta`, the
predictive distribution of the logits is exactly Gaussian ("GLM predictive"):

.. math::
    f_n \sim \mathcal{N}(f_n(\theta^*),\; J_n \Sigma J_n^\top),

and :meth:`LastLayerLaplace.predict_logits` returns ``P`` samples of it, shape ``(N, P, C)``, which
``gpattn.experiments.metrics.average_samples`` turns into the Monte-Carlo predictive (mean softmax). The prior
precision is a given float or maximises the Laplace evidence (MacKay, 1992)

.. math::
    \log p(\mathcal{D} \mid \lambda) \approx \log p(\mathcal{D} \mid \theta^*)
    - \tfrac{\lambda}{2}\lVert\theta^*\rVert^2 + \tfrac{P_\theta}{2}\log\lambda
    - \tfrac12 \log\det(G + \lambda I).

Two back ends:

- ``"laplace-torch"`` (default): the ``laplace-torch`` package (the ``gpattn[laplace]`` extra), with
  ``hessian_structure`` ``"kron"`` (K-FAC, its default), ``"full"`` or ``"diag"``; it is fitted on a
  Linear module over the precomputed features (the body runs once), in float64. The evidence is
  maximised by laplace-torch (Adam on :math:`\log\lambda`, scalar prior).
- ``"dense"``: this module's own float64 implementation of the equations above with the full
  :math:`G` (``hessian_structure="full"``; fine for heads of a few thousand parameters); the
  evidence is maximised over a grid of :math:`\lambda \in [10^{-4}, 10^{4}]` refined by a bounded
  scalar search. It needs no extra package and is the reference the tests pin laplace-torch to.

Features are computed in eval mode with one forward pass (``num_samples=1``); for a stochastic body
(GP attention) they are one draw of it. The baseline is meant for the deterministic softmax model.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from gpattn.variational._linalg import cholesky

__all__ = [
    "HESSIAN_STRUCTURES",
    "LastLayerLaplace",
    "dense_ggn",
    "extract_features",
    "fit_last_layer_laplace",
    "laplace_torch_available",
]

#: the Hessian structures of ``fit_last_layer_laplace`` (laplace-torch's names)
HESSIAN_STRUCTURES = ("kron", "full", "diag")
BACKENDS = ("laplace-torch", "dense")
_LOG10_GRID = (-4.0, 4.0, 81)  # evidence grid for the dense back end: 10^-4 .. 10^4, 10 points per decade
_INSTALL_HINT = (
    "pip install --no-deps laplace-torch==0.3 asdfghjkl==0.1a4 backpack-for-pytorch==1.7.1 "
    "curvlinops-for-pytorch==3.0.1 unfoldNd==0.2.3 einconv==0.1.0 opt-einsum einops"
)


def laplace_torch_available() -> bool:
    """True if ``laplace`` (laplace-torch) imports."""
    try:
        _import_laplace()
    except ImportError:
        return False
    return True


def _import_laplace():
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        with warnings.catch_warnings():
            # asdl and linear_operator decorate functions with torch.jit.script, deprecated in torch 2.13
            warnings.filterwarnings(
                "ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning
            )
            import laplace
    finally:
        # laplace-torch 0.3 calls logging.info() at import when the old `asdfghjkl` module is absent,
        # which runs logging.basicConfig() and adds a stderr handler to the root logger: undo that.
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
    return laplace


# ----------------------------------------------------------------------------- features
def _head_of(model) -> nn.Linear:
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"model must have a Linear last layer named 'head' (gpattn classifiers do), got {type(head).__name__}"
        )
    return head


def _check_split(split, name: str = "split"):
    for attr in ("inputs", "labels", "mask"):
        if not hasattr(split, attr):
            raise ValueError(
                f"{name} must be a gpattn.experiments.data.Split (inputs, labels, mask), got {type(split).__name__}"
            )


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@torch.no_grad()
def extract_features(model, split, batch_size: int = 256, head: nn.Linear | None = None) -> torch.Tensor:
    """The input of ``model.head`` (or of ``head``, a Linear inside the model: a readout's, e.g.
    :class:`gpattn.experiments.readout.GPReadout`'s) for every row of ``split``, in eval mode, one forward pass per
    batch with ``num_samples=1``.  # shape: (N, D)

    Batches are formed as in training (:func:`gpattn.experiments.training._batch`: text cut to its longest real
    sequence, padding mask passed as ``key_padding_mask``). The model's train/eval mode is restored.
    """
    from gpattn.experiments.training import _batch

    head = _head_of(model) if head is None else head
    if not isinstance(head, nn.Linear):
        raise ValueError(f"head must be an nn.Linear inside the model, got {type(head).__name__}")
    _check_split(split)
    _check_positive_int("batch_size", batch_size)
    captured: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda module, args, output: captured.append(args[0].detach()))
    was_training = model.training
    device = head.weight.device
    try:
        model.eval()
        for start in range(0, len(split), batch_size):
            x, mask, _ = _batch(split, torch.arange(start, min(start + batch_size, len(split))))
            model(x.to(device), None if mask is None else mask.to(device), num_samples=1)
    finally:
        hook.remove()
        model.train(was_training)
    if not captured:
        return torch.zeros(0, head.in_features)
    return torch.cat(captured).reshape(-1, head.in_features).cpu()  # shape: (N, D)


# ----------------------------------------------------------------------------- dense reference
def _augment(features: torch.Tensor) -> torch.Tensor:
    """psi_n = [phi_n, 1] in float64.  # shape: (N, D+1)"""
    f = features.to(torch.float64)
    return torch.cat([f, torch.ones(f.shape[0], 1, dtype=torch.float64)], dim=1)


def _to_augmented_order(C: int, D: int) -> torch.Tensor:
    """Index map: position k of theta_aug = vec([W, b]) row-major  ->  index in theta = (vec W, b)."""
    c = torch.arange(C).unsqueeze(1)
    d = torch.arange(D + 1).unsqueeze(0)
    return torch.where(d < D, c * D + d, C * D + c).reshape(-1)


def dense_ggn(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """G = sum_n J_n^T Lambda_n J_n in the order theta = (vec W row-major, b), float64.  # shape: (C(D+1), C(D+1))

    In the augmented order theta_aug = vec([W b]), J_n = I_C (x) psi_n^T, so the (c, k) block of G is
    sum_n Lambda_n[c, k] psi_n psi_n^T; the result is permuted back to the parameter order."""
    psi = _augment(features)  # shape: (N, D+1)
    W, b = weight.to(torch.float64), bias.to(torch.float64)
    p = torch.softmax(psi[:, :-1] @ W.T + b, dim=-1)  # shape: (N, C)
    lam = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)  # shape: (N, C, C)
    C, D1 = W.shape[0], psi.shape[1]
    blocks = torch.zeros(C, D1, C, D1, dtype=torch.float64)
    rows = max(1, (1 << 22) // (C * C * D1))  # chunk N so the (n, C, C, D+1) product stays ~32 MB
    for start in range(0, psi.shape[0], rows):
        lam_psi = lam[start : start + rows].unsqueeze(-1) * psi[start : start + rows, None, None, :]  # (n, C, C, D+1)
        blocks += torch.einsum("nckd,ne->cdke", lam_psi, psi[start : start + rows])  # shape: (C, D+1, C, D+1)
    g_aug = blocks.reshape(C * D1, C * D1)
    order = _to_augmented_order(C, D1 - 1)
    g = torch.empty_like(g_aug)
    g[order.unsqueeze(1), order.unsqueeze(0)] = g_aug
    return 0.5 * (g + g.T)  # exactly symmetric (chunked sums round differently in the two triangles)


def _dense_log_evidence(eigs: np.ndarray, theta_sq: float, loglik: float, prior_precision: float) -> float:
    """log p(D | lambda) from the eigenvalues of G (log det(G + lambda I) = sum log(e_i + lambda))."""
    lam = prior_precision
    return float(loglik - 0.5 * lam * theta_sq + 0.5 * len(eigs) * math.log(lam) - 0.5 * np.sum(np.log(eigs + lam)))


def _maximise_evidence(eigs: np.ndarray, theta_sq: float, loglik: float) -> float:
    from scipy.optimize import minimize_scalar

    grid = np.linspace(*_LOG10_GRID)
    values = [_dense_log_evidence(eigs, theta_sq, loglik, 10.0**g) for g in grid]
    best = int(np.argmax(values))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    result = minimize_scalar(
        lambda g: -_dense_log_evidence(eigs, theta_sq, loglik, 10.0**g),
        bounds=(low, high),
        method="bounded",
        options={"xatol": 1e-6},
    )
    g_star = float(result.x) if -result.fun >= values[best] else float(grid[best])
    return 10.0**g_star


# ----------------------------------------------------------------------------- the posterior
@dataclass
class LastLayerLaplace:
    """A fitted last-layer Laplace posterior (see the module docstring).

    ``model`` is the classifier whose body computes the features; ``weight`` (C, D) and ``bias`` (C,)
    are float64 copies of its head at fitting time; ``prior_precision`` is the lambda used;
    ``log_marginal_likelihood`` the Laplace evidence at that lambda; ``posterior`` the laplace-torch
    object (back end "laplace-torch") or the dense posterior covariance Sigma (back end "dense",
    in the parameter order (vec W, b)).
    """

    model: nn.Module
    weight: torch.Tensor  # shape: (C, D)
    bias: torch.Tensor  # shape: (C,)
    backend: str
    hessian_structure: str
    prior_precision: float
    log_marginal_likelihood: float
    num_train: int
    posterior: object
    batch_size: int = 256

    @property
    def num_classes(self) -> int:
        return int(self.weight.shape[0])

    def features(self, split) -> torch.Tensor:
        """Features of ``split`` from the frozen body.  # shape: (N, D)"""
        return extract_features(self.model, split, self.batch_size)

    def predictive_moments(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and covariance of the Gaussian predictive of the logits, float64.

        ``inputs``: a Split, or features ``(N, D)``. Returns (mean ``(N, C)``, cov ``(N, C, C)``)."""
        phi = inputs if torch.is_tensor(inputs) else self.features(inputs)
        D = self.weight.shape[1]
        if phi.dim() != 2 or phi.shape[1] != D:
            raise ValueError(f"features must have shape (N, D={D}), got {tuple(phi.shape)}")
        means, covs = [], []
        sigma_aug = self._sigma_augmented() if self.backend == "dense" else None
        for start in range(0, phi.shape[0], self.batch_size):
            chunk = phi[start : start + self.batch_size].to(torch.float64)
            if sigma_aug is not None:
                mean, cov = self._dense_moments(chunk, sigma_aug)
            else:
                with torch.no_grad():
                    js, mean = self.posterior.backend.last_layer_jacobians(chunk)  # (n, C, P), (n, C)
                    cov = self.posterior.functional_variance(js)  # shape: (n, C, C)
            means.append(mean.detach().to(torch.float64))
            covs.append(cov.detach().to(torch.float64))
        if not means:
            C = self.num_classes
            return torch.zeros(0, C, dtype=torch.float64), torch.zeros(0, C, C, dtype=torch.float64)
        return torch.cat(means), torch.cat(covs)

    def _sigma_augmented(self) -> torch.Tensor:
        """Sigma in the augmented order theta_aug = vec([W b]), as blocks.  # shape: (C, D+1, C, D+1)"""
        C, D = self.weight.shape
        order = _to_augmented_order(C, D)
        return self.posterior[order.unsqueeze(1), order.unsqueeze(0)].reshape(C, D + 1, C, D + 1)

    def _dense_moments(self, phi: torch.Tensor, sigma_aug: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # J_n Sigma J_n^T with J_n = I_C (x) psi_n^T: cov[n, c, k] = psi_n^T Sigma_aug[c, :, k, :] psi_n
        psi = _augment(phi)  # shape: (n, D+1)
        half = torch.einsum("cdke,ne->nckd", sigma_aug, psi)  # shape: (n, C, C, D+1)
        cov = torch.einsum("nckd,nd->nck", half, psi)  # shape: (n, C, C)
        mean = psi[:, :-1] @ self.weight.T + self.bias  # shape: (n, C)
        return mean, 0.5 * (cov + cov.transpose(1, 2))

    def predict_logits(self, inputs, num_samples: int = 10, generator: torch.Generator | None = None) -> torch.Tensor:
        """``num_samples`` draws of the logits from the Gaussian predictive, float32.  # shape: (N, P, C)

        ``inputs``: a Split (features from the body) or features ``(N, D)``. Draws are
        ``mean + L eps`` with ``cov = L L^T`` (Cholesky, bounded jitter only if needed), eps standard
        normal from ``generator`` (the global RNG if None). A Cholesky factor is continuous in ``cov``;
        an eigenbasis is not (its signs follow rounding), so the same seed gives the same draws on any
        thread count. Same layout as ``gpattn.experiments.training.predict``."""
        _check_positive_int("num_samples", num_samples)
        mean, cov = self.predictive_moments(inputs)  # shape: (N, C), (N, C, C)
        scale = cholesky(cov, name="last-layer Laplace predictive covariance")  # shape: (N, C, C)
        eps = torch.randn(mean.shape[0], num_samples, mean.shape[1], generator=generator, dtype=torch.float64)
        samples = mean.unsqueeze(1) + torch.einsum("nck,npk->npc", scale, eps)  # shape: (N, P, C)
        return samples.to(torch.float32)


def _prior_value(prior_precision):
    if prior_precision == "marglik":
        return None
    ok = isinstance(prior_precision, (int, float)) and not isinstance(prior_precision, bool)
    if not ok or not math.isfinite(prior_precision) or prior_precision <= 0:
        raise ValueError(f"prior_precision must be 'marglik' or a positive finite float, got {prior_precision!r}")
    return float(prior_precision)


def fit_last_layer_laplace(
    model,
    train_split,
    *,
    batch_size: int = 256,
    hessian_structure: str = "kron",
    prior_precision="marglik",
    backend: str = "laplace-torch",
    marglik_steps: int = 300,
    marglik_lr: float = 0.1,
) -> LastLayerLaplace:
    """Fit a last-layer Laplace posterior to the trained ``model`` on ``train_split`` (a
    ``gpattn.experiments.data.Split``; every row counts, N = ``len(train_split)``).

    :param hessian_structure: ``"kron"`` (default), ``"full"`` or ``"diag"`` for laplace-torch;
        the dense back end supports ``"full"`` only.
    :param prior_precision: ``"marglik"`` (maximise the Laplace evidence) or a positive float.
    :param backend: ``"laplace-torch"`` (needs the ``gpattn[laplace]`` extra) or ``"dense"``.
    :param marglik_steps: laplace-torch's evidence optimisation (Adam on log lambda): its steps ...
    :param marglik_lr: ... and its learning rate.
    """
    head = _head_of(model)
    _check_split(train_split, "train_split")
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("marglik_steps", marglik_steps)
    if hessian_structure not in HESSIAN_STRUCTURES:
        raise ValueError(f"hessian_structure must be one of {HESSIAN_STRUCTURES}, got {hessian_structure!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "dense" and hessian_structure != "full":
        raise ValueError(
            f"backend='dense' computes the full Hessian: pass hessian_structure='full', got {hessian_structure!r}"
        )
    lam = _prior_value(prior_precision)
    if len(train_split) == 0:
        raise ValueError("train_split is empty")
    labels = train_split.labels
    if int(labels.min()) < 0 or int(labels.max()) >= head.out_features:
        raise ValueError(
            f"train_split labels must lie in 0..{head.out_features - 1}, got {int(labels.min())}..{int(labels.max())}"
        )

    features = extract_features(model, train_split, batch_size).to(torch.float64)  # shape: (N, D)
    weight = head.weight.detach().to(torch.float64).cpu().clone()  # shape: (C, D)
    bias = (
        head.bias.detach().to(torch.float64).cpu().clone()
        if head.bias is not None
        else torch.zeros(head.out_features, dtype=torch.float64)
    )
    common = dict(model=model, weight=weight, bias=bias, num_train=len(train_split), batch_size=batch_size)

    if backend == "dense":
        if head.bias is None:
            raise ValueError("backend='dense' expects a head with a bias")
        g = dense_ggn(features, weight, bias)
        logits = features @ weight.T + bias
        loglik = -float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        theta_sq = float((weight**2).sum() + (bias**2).sum())
        eigs = torch.linalg.eigvalsh(g).clamp_min(0.0).numpy()
        if lam is None:
            lam = _maximise_evidence(eigs, theta_sq, loglik)
        precision = g + lam * torch.eye(g.shape[0], dtype=torch.float64)
        chol = torch.linalg.cholesky(precision)
        # Sigma = L^-T L^-1 from one triangular solve (no explicit inverse of the precision)
        l_inv = torch.linalg.solve_triangular(chol, torch.eye(g.shape[0], dtype=torch.float64), upper=False)
        sigma = l_inv.T @ l_inv
        evidence = _dense_log_evidence(eigs, theta_sq, loglik, lam)
        return LastLayerLaplace(
            backend="dense",
            hessian_structure="full",
            prior_precision=lam,
            log_marginal_likelihood=evidence,
            posterior=sigma,
            **common,
        )

    try:
        laplace = _import_laplace()
    except ImportError as err:
        raise ImportError(
            f"backend='laplace-torch' needs the optional laplace-torch package (gpattn[laplace]); install it "
            f"beside your torch with: {_INSTALL_HINT}. Or pass backend='dense'."
        ) from err
    head64 = copy.deepcopy(head).to(device="cpu", dtype=torch.float64)
    net = nn.Sequential(head64)  # the last layer is the whole net: laplace-torch sees phi as the input
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(features, labels.cpu()), batch_size=batch_size, shuffle=False
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*link_approx.*", category=UserWarning)
        la = laplace.Laplace(
            net,
            "classification",
            subset_of_weights="last_layer",
            hessian_structure=hessian_structure,
            prior_precision=1.0 if lam is None else lam,
            last_layer_name="0",
        )
        la.fit(loader)
        if lam is None:
            la.optimize_prior_precision(
                pred_type="glm",
                method="marglik",
                prior_structure="scalar",
                n_steps=marglik_steps,
                lr=marglik_lr,
            )
        with torch.no_grad():
            evidence = float(la.log_marginal_likelihood())
    prior = la.prior_precision
    return LastLayerLaplace(
        backend="laplace-torch",
        hessian_structure=hessian_structure,
        prior_precision=float(prior.reshape(-1)[0]) if torch.is_tensor(prior) else float(prior),
        log_marginal_likelihood=evidence,
        posterior=la,
        **common,
    )
