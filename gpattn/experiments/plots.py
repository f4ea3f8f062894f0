"""PNG plots for reports: reliability diagram, risk–coverage, OOD histograms, scaling curves.

Figures are built with :class:`matplotlib.figure.Figure` on a :class:`FigureCanvasAgg`, never through
pyplot, so importing or calling this module changes no matplotlib global state (backend, figure
registry). Binning and curves come from :mod:`gpattn.experiments.metrics`, so the plots show exactly the numbers
the metrics report. Every function creates the parent directory and returns the path written.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gpattn.experiments import metrics as M

__all__ = ["ood_histograms", "reliability_diagram", "risk_coverage", "scaling_curves"]


def _figure(ncols: int = 1, width: float = 5.0, height: float = 4.0, n: int | None = None) -> tuple[Figure, list]:
    """A figure of ``n`` panels (default ``ncols``) of ``width`` x ``height`` inches, ``ncols`` a row."""
    n = ncols if n is None else n
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]
    return fig, axes


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


# Curves per plot: the ten tab10 colours, then the same colours with another dash pattern, so up to
# 40 series (a CoLA report has 16 rows) stay distinguishable instead of repeating after ten.
_COLOURS = tuple(f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink", "gray",
                                     "olive", "cyan"))
_DASHES = ("-", "--", ":", "-.")


def _line_style(i: int) -> dict:
    """Colour and line style of the ``i``-th curve: distinct for ``i < 40``."""
    return {"color": _COLOURS[i % len(_COLOURS)], "linestyle": _DASHES[(i // len(_COLOURS)) % len(_DASHES)]}


def _width(n: int) -> float:
    """Figure width for ``n`` curves: room for a legend beside the axes when :func:`_legend` puts it there."""
    return 6.0 if n <= 8 else 9.5


def _legend(ax, n: int) -> None:
    """Inside the axes for a few curves; beside them for many, where it would hide the curves."""
    if n > 8:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    else:
        ax.legend(fontsize="small")


def _check_dict(obj, name: str) -> None:
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"{name} must be a non-empty dict name -> (...), got {type(obj).__name__} {obj!r:.80}")


def reliability_diagram(probs, labels, path, n_bins: int = 15, title: str | None = None) -> Path:
    """Accuracy per confidence bin (bars) against the diagonal, the gap to each bin's mean confidence
    shaded; the ECE (same right-closed bins as :func:`gpattn.experiments.metrics.ece`) in the title."""
    bins = M.calibration_bins(probs, labels, n_bins=n_bins)
    ece = M.ece(probs, labels, n_bins=n_bins)
    left = bins.edges[:-1]
    width = np.diff(bins.edges)
    full = bins.counts > 0
    fig, (ax,) = _figure()
    ax.bar(left[full], bins.accuracy[full], width=width[full], align="edge", color="tab:blue",
           edgecolor="black", linewidth=0.5, label="accuracy")
    gap_lo = np.minimum(bins.accuracy, bins.confidence)[full]
    gap_hi = np.maximum(bins.accuracy, bins.confidence)[full]
    ax.bar(left[full], gap_hi - gap_lo, bottom=gap_lo, width=width[full], align="edge", color="tab:red",
           alpha=0.35, hatch="//", edgecolor="tab:red", linewidth=0.5, label="gap to confidence")
    ax.plot([0.0, 1.0], [0.0, 1.0], "--", color="gray", linewidth=1.0, label="perfect calibration")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("confidence (max predicted probability)")
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize="small")
    head = f"{title}\n" if title else ""
    ax.set_title(f"{head}ECE = {ece:.4f} ({n_bins} bins)")
    return _save(fig, path)


def risk_coverage(curves: dict, path, title: str | None = None) -> Path:
    """Selective risk against coverage per variant (``curves``: name -> (probs, labels)), AURC in the
    legend (a fraction, as in metrics.json)."""
    _check_dict(curves, "curves")
    fig, (ax,) = _figure(width=_width(len(curves)))
    for i, (name, (probs, labels)) in enumerate(curves.items()):
        coverage, risk = M.risk_coverage_curve(probs, labels)
        ax.plot(coverage, risk, linewidth=1.5, label=f"{name} (AURC = {np.mean(risk):.4f})", **_line_style(i))
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(bottom=0.0)
    ax.set_xlabel("coverage")
    ax.set_ylabel("selective risk")
    _legend(ax, len(curves))
    if title:
        ax.set_title(title)
    return _save(fig, path)


def ood_histograms(scores: dict, path, title: str | None = None, bins: int = 30) -> Path:
    """One panel per variant (``scores``: name -> (scores_in, scores_out)): density histograms of the
    in-distribution and OOD scores (max probability by default upstream) on shared bins, OOD AUROC in
    each panel's title."""
    _check_dict(scores, "scores")
    fig, axes = _figure(ncols=min(len(scores), 4), width=4.0, height=3.5, n=len(scores))  # rows of 4 panels
    for ax, (name, (s_in, s_out)) in zip(axes, scores.items()):
        auroc = M.ood_metrics(s_in, s_out)["ood_auroc"]
        a = np.asarray(M._as_float64(s_in, "scores_in"))
        b = np.asarray(M._as_float64(s_out, "scores_out"))
        lo, hi = float(min(a.min(), b.min())), float(max(a.max(), b.max()))
        edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
        ax.hist(a, bins=edges, density=True, alpha=0.55, color="tab:blue", label="in-distribution")
        ax.hist(b, bins=edges, density=True, alpha=0.55, color="tab:orange", label="OOD")
        ax.set_title(f"{name} (AUROC = {auroc:.3f})", fontsize="medium")
        ax.set_xlabel("score")
    axes[0].set_ylabel("density")
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _positive_finite(value) -> bool:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(v) and v > 0.0


def scaling_curves(rows, path, x: str = "T", y: str = "ms_median", group: str = "variant",
                   title: str | None = None) -> Path:
    """Log–log ``y`` against ``x`` per ``group`` from benchmark rows (a list of dicts). Rows whose x or
    y is missing, non-finite or ≤ 0 (e.g. a failed run) are skipped; a row without ``group`` is an error."""
    rows = list(rows)
    series: dict[str, list[tuple[float, float]]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or group not in row:
            raise ValueError(f"rows[{i}] must be a dict with key {group!r}, got {row!r:.80}")
        if _positive_finite(row.get(x)) and _positive_finite(row.get(y)):
            series.setdefault(str(row[group]), []).append((float(row[x]), float(row[y])))
    if not series:
        raise ValueError(f"rows hold no point with positive finite {x!r} and {y!r} ({len(rows)} rows)")
    fig, (ax,) = _figure(width=_width(len(series)))
    for i, (name, pts) in enumerate(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=1.5, label=name, **_line_style(i))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, len(series))
    if title:
        ax.set_title(title)
    return _save(fig, path)
