r"""Post-hoc out-of-distribution detectors on a classifier's pooled features (docs/derivations.md, "Feature-space
OOD detectors"): the field's baselines for OOD detection on transformer features.

Each detector is fitted once on the training split's pooled penultimate features (the input of ``model.head``,
:func:`gpattn.experiments.features.pooled_features`) and their labels, then scores any features:
``score(features)`` is ``(N,)`` float64, **higher = more out-of-distribution** (the opposite of
:mod:`gpattn.experiments.metrics`' scores, which negate it). Its :meth:`FeatureDetector.state_dict` is plain data
(tensors, numbers), kept in the run's checkpoint, so a saved run scores new inputs without the training data.

- :class:`Mahalanobis` (Lee et al., NeurIPS 2018): class means :math:`\mu_c` and one covariance :math:`\Sigma` shared
  by the classes, fitted on the class-centred features with scikit-learn's ``LedoitWolf`` (a shrinkage estimate:
  the sample covariance is singular when D ≥ N); score :math:`\min_c (x-\mu_c)^\top\Sigma^{-1}(x-\mu_c)`.
- :class:`RelativeMahalanobis` (Ren et al. 2021, "A Simple Fix to Mahalanobis Distance for Improving Near-OOD
  Detection"): the same minus the distance under one background Gaussian :math:`N(\mu_0, \Sigma_0)` of all training
  features, :math:`\min_c \mathrm{MD}_c(x) - \mathrm{MD}_0(x)`.
- :class:`KNN` (Sun et al., ICML 2022, "Out-of-Distribution Detection with Deep Nearest Neighbors"): the cosine
  distance :math:`1 - \cos` from the L2-normalised features to their k-th nearest L2-normalised training feature
  (scikit-learn's ``NearestNeighbors``); a monotone function of Sun et al.'s Euclidean distance between normalised
  features (:math:`\lVert z - z'\rVert^2 = 2(1 - \cos)`), so the same ranking. ``k`` defaults to
  :data:`KNN_DEFAULT_K`; :func:`choose_k` picks it on a validation pair (in-domain, OOD) where one exists.

:data:`DETECTORS` is the one table from the ``--ood-score`` names to the classes.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "DETECTORS",
    "KNN",
    "KNN_DEFAULT_K",
    "KNN_GRID",
    "FeatureDetector",
    "Mahalanobis",
    "RelativeMahalanobis",
    "choose_k",
    "detector_from_state",
]

#: kNN's k without an OOD validation split. Sun et al. use k = 50 on CIFAR-10's 50,000 training images (0.1 %)
#: and find the AUROC flat over a wide range of k; gpattn's training sets are 10²–10⁴ rows, where 10 is ≥ 0.1 %
KNN_DEFAULT_K = 10
#: the k :func:`choose_k` tries on a validation pair (those ≤ the number of training rows)
KNN_GRID = (1, 5, 10, 20, 50, 100)


def _features(x, name: str = "features", width: int | None = None) -> np.ndarray:
    """``x`` as a finite float64 (N, D) array; a ``ValueError`` naming ``name`` otherwise."""
    a = x.detach().cpu().double().numpy() if torch.is_tensor(x) else np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or (width is not None and a.shape[1] != width):
        want = f"(N, D={width})" if width is not None else "(N, D)"
        raise ValueError(f"{name} must have shape {want}, got shape {tuple(a.shape)}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite, got NaN or inf")
    return a


def _labels(y, n: int) -> np.ndarray:
    a = y.detach().cpu().numpy() if torch.is_tensor(y) else np.asarray(y)
    if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer) or (n and a.min() < 0):
        raise ValueError(
            f"train_labels must be non-negative integers of shape (N,) = ({n},), got {a.dtype} {tuple(a.shape)}"
        )
    return a.astype(np.int64)


class FeatureDetector:
    """The protocol: ``fit(train_features, train_labels)`` returns the detector, ``score(features)`` the ``(N,)``
    float64 scores (higher = more OOD), ``state_dict()`` plain data that :func:`detector_from_state` restores."""

    #: the ``--ood-score`` name (a key of :data:`DETECTORS`)
    name = ""

    def fit(self, train_features, train_labels) -> FeatureDetector:  # pragma: no cover - the protocol
        """Fit on the training features ``(N, D)`` and their labels ``(N,)``; returns the detector."""
        raise NotImplementedError

    def score(self, features) -> np.ndarray:  # pragma: no cover - the protocol
        """The ``(N,)`` float64 scores of features ``(N, D)``, higher = more out-of-distribution."""
        raise NotImplementedError

    def state_dict(self) -> dict:  # pragma: no cover - the protocol
        """The fitted state as plain data (tensors, numbers), for a checkpoint read with ``weights_only=True``."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> FeatureDetector:  # pragma: no cover - the protocol
        """Restore a :meth:`state_dict`; returns the detector."""
        raise NotImplementedError

    def _check_fitted(self, attr: str) -> None:
        if getattr(self, attr, None) is None:
            raise ValueError(f"{type(self).__name__} is not fitted: call fit(train_features, train_labels) first")


def _squared_distances(x: np.ndarray, means: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """(x_n − μ_c)ᵀ P (x_n − μ_c) for every row and mean.  # shape: (N, D), (C, D), (D, D) -> (N, C)"""
    # (x − μ)ᵀP(x − μ) = xᵀPx − 2 xᵀPμ + μᵀPμ, P symmetric
    xp = x @ precision
    return np.sum(xp * x, axis=1)[:, None] - 2.0 * xp @ means.T + np.sum((means @ precision) * means, axis=1)[None]


class Mahalanobis(FeatureDetector):
    """Class-conditional Gaussians with one shared covariance (Lee et al. 2018), module docstring.

    :param estimator: an unfitted scikit-learn covariance estimator for the class-centred features (default
        ``LedoitWolf(assume_centered=True)``; ``EmpiricalCovariance(assume_centered=True)`` gives the sample
        covariance, which needs N > D); its ``precision_`` is kept.
    """

    name = "mahalanobis"

    def __init__(self, estimator=None):
        self.estimator = estimator
        self.means: np.ndarray | None = None  # shape: (C, D)
        self.precision: np.ndarray | None = None  # shape: (D, D)

    def _estimator(self):
        from sklearn.base import clone
        from sklearn.covariance import LedoitWolf

        return LedoitWolf(assume_centered=True) if self.estimator is None else clone(self.estimator)

    def fit(self, train_features, train_labels) -> Mahalanobis:
        x = _features(train_features, "train_features")
        y = _labels(train_labels, x.shape[0])
        counts = np.bincount(y)
        if counts.size < 2 or np.any(counts < 2):
            few = [int(c) for c in np.flatnonzero(counts < 2)]
            raise ValueError(
                f"train_labels must hold >= 2 classes with >= 2 rows each (a class mean and a spread); "
                f"classes {few} of {counts.size} have fewer"
            )
        self.means = np.stack([x[y == c].mean(axis=0) for c in range(counts.size)])
        self.precision = self._estimator().fit(x - self.means[y]).precision_
        return self

    def class_distances(self, features) -> np.ndarray:
        """MD_c(x), the squared Mahalanobis distance to every class mean.  # shape: (N, D) -> (N, C)"""
        self._check_fitted("means")
        return _squared_distances(_features(features, width=self.means.shape[1]), self.means, self.precision)

    def score(self, features) -> np.ndarray:
        """min_c MD_c(x).  # shape: (N, D) -> (N,)"""
        return self.class_distances(features).min(axis=1)

    def state_dict(self) -> dict:
        self._check_fitted("means")
        return {"means": torch.from_numpy(self.means), "precision": torch.from_numpy(self.precision)}

    def load_state_dict(self, state: dict) -> Mahalanobis:
        self.means, self.precision = (state[k].double().numpy() for k in ("means", "precision"))
        return self


class RelativeMahalanobis(Mahalanobis):
    """Ren et al. (2021): :class:`Mahalanobis` minus the squared distance under one background Gaussian of all
    training features (mean and covariance, the same ``estimator``), module docstring."""

    name = "relative-mahalanobis"

    def __init__(self, estimator=None):
        super().__init__(estimator)
        self.background_mean: np.ndarray | None = None  # shape: (1, D)
        self.background_precision: np.ndarray | None = None  # shape: (D, D)

    def fit(self, train_features, train_labels) -> RelativeMahalanobis:
        super().fit(train_features, train_labels)
        x = _features(train_features, "train_features")
        self.background_mean = x.mean(axis=0, keepdims=True)
        self.background_precision = self._estimator().fit(x - self.background_mean).precision_
        return self

    def score(self, features) -> np.ndarray:
        """min_c MD_c(x) − MD_0(x).  # shape: (N, D) -> (N,)"""
        md = self.class_distances(features)
        x = _features(features, width=self.means.shape[1])
        return md.min(axis=1) - _squared_distances(x, self.background_mean, self.background_precision)[:, 0]

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "background_mean": torch.from_numpy(self.background_mean),
            "background_precision": torch.from_numpy(self.background_precision),
        }

    def load_state_dict(self, state: dict) -> RelativeMahalanobis:
        super().load_state_dict(state)
        self.background_mean = state["background_mean"].double().numpy()
        self.background_precision = state["background_precision"].double().numpy()
        return self


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (a zero row stays zero)."""
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norm > 0, norm, 1.0)


class KNN(FeatureDetector):
    """Deep nearest neighbours (Sun et al. 2022), module docstring: the cosine distance to the k-th nearest
    training feature. The state keeps the normalised training features (float32: ``N × D`` numbers).

    :param k: the neighbour's rank, 1 ≤ k ≤ N (default :data:`KNN_DEFAULT_K`).
    """

    name = "knn"

    def __init__(self, k: int = KNN_DEFAULT_K):
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.k = int(k)
        self.bank: np.ndarray | None = None  # shape: (N, D), unit rows
        self._index = None

    def fit(self, train_features, train_labels=None) -> KNN:
        """Keep the normalised ``train_features``; ``train_labels`` are not used (the protocol's signature)."""
        x = _features(train_features, "train_features")
        if self.k > x.shape[0]:
            raise ValueError(
                f"k={self.k} is larger than the {x.shape[0]} rows of train_features: choose k <= {x.shape[0]}"
            )
        self.bank, self._index = _unit(x).astype(np.float32), None
        return self

    def score(self, features) -> np.ndarray:
        """1 − cos(x, its k-th nearest training feature).  # shape: (N, D) -> (N,)"""
        self._check_fitted("bank")
        x = _unit(_features(features, width=self.bank.shape[1]))
        if self._index is None:
            from sklearn.neighbors import NearestNeighbors

            self._index = NearestNeighbors(n_neighbors=self.k).fit(self.bank.astype(np.float64))
        if not x.shape[0]:
            return np.zeros(0)
        dist, _ = self._index.kneighbors(x, n_neighbors=self.k)  # Euclidean between unit rows, ascending
        return 0.5 * dist[:, -1] ** 2  # ‖z − z'‖² = 2(1 − cos)

    def state_dict(self) -> dict:
        self._check_fitted("bank")
        return {"k": self.k, "bank": torch.from_numpy(self.bank)}

    def load_state_dict(self, state: dict) -> KNN:
        self.k, self.bank, self._index = int(state["k"]), state["bank"].float().numpy(), None
        return self


#: the ``--ood-score`` names of the feature detectors -> their classes (constructed with their defaults)
DETECTORS: dict[str, type[FeatureDetector]] = {
    Mahalanobis.name: Mahalanobis,
    RelativeMahalanobis.name: RelativeMahalanobis,
    KNN.name: KNN,
}


def detector_from_state(name: str, state: dict) -> FeatureDetector:
    """The detector ``name`` (a key of :data:`DETECTORS`) restored from its :meth:`FeatureDetector.state_dict`."""
    if name not in DETECTORS:
        raise ValueError(f"detector name must be one of {', '.join(DETECTORS)}, got {name!r}")
    return DETECTORS[name]().load_state_dict(state)


def choose_k(train_features, val_in, val_ood, grid=KNN_GRID) -> tuple[int, dict[int, float]]:
    """kNN's k on a validation pair: the k of ``grid`` (those ≤ the training rows) whose scores separate the
    in-domain validation features ``val_in`` from the OOD validation features ``val_ood`` best (ROC area, the
    smallest k on ties). Returns ``(k, {k: AUROC})``."""
    from sklearn.metrics import roc_auc_score

    x = _features(train_features, "train_features")
    a, b = _features(val_in, "val_in", x.shape[1]), _features(val_ood, "val_ood", x.shape[1])
    if not a.shape[0] or not b.shape[0]:
        raise ValueError(f"val_in and val_ood need >= 1 row each, got {a.shape[0]} and {b.shape[0]}")
    ks = sorted(k for k in set(grid) if 1 <= k <= x.shape[0])
    if not ks:
        raise ValueError(f"grid {tuple(grid)} has no k in [1, {x.shape[0]}] (the training rows)")
    is_ood = np.r_[np.zeros(a.shape[0]), np.ones(b.shape[0])]
    aurocs = {}
    for k in ks:
        det = KNN(k).fit(x)
        aurocs[k] = float(roc_auc_score(is_ood, np.r_[det.score(a), det.score(b)]))
    best = max(ks, key=lambda k: (aurocs[k], -k))
    return best, aurocs
