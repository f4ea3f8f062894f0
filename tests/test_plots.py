"""gpattn.experiments.plots: every function writes a real, non-blank PNG; importing changes no matplotlib global."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from matplotlib import image as mpimg

from gpattn.experiments import metrics as M
from gpattn.experiments import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    with open(path, "rb") as fh:
        assert fh.read(8) == PNG_SIGNATURE
    img = mpimg.imread(path)  # shape: (height, width, 3 or 4), floats in [0, 1]
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    rgb = img[..., :3]
    # not blank: a white canvas has zero variance; a plot with axes, bars and text has clearly more
    assert float(rgb.std()) > 0.02
    # and it is not one flat colour either: many distinct colours (bars, shading, antialiased text)
    assert len(np.unique(np.round(rgb.reshape(-1, 3), 2), axis=0)) > 10


def _probs_labels(seed, n=300, c=4, sharp=2.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, c)) * sharp
    probs = M.average_samples(logits[:, None, :])
    labels = np.where(rng.random(n) < 0.7, probs.argmax(1), rng.integers(0, c, n))
    return probs, labels


def test_reliability_diagram(tmp_path):
    probs, labels = _probs_labels(0)
    out = plots.reliability_diagram(probs, labels, tmp_path / "sub" / "rel.png", title="test")
    assert out == tmp_path / "sub" / "rel.png"
    _assert_png(out)
    out10 = plots.reliability_diagram(probs, labels, tmp_path / "rel10.png", n_bins=10)
    _assert_png(out10)
    with pytest.raises(ValueError, match="probs"):
        plots.reliability_diagram(probs[:, :2], labels, tmp_path / "bad.png")


def test_reliability_diagram_uses_metrics_binning(monkeypatch, tmp_path):
    # the plot must reuse metrics.calibration_bins (one binning implementation, not a copy)
    calls = []
    original = M.calibration_bins

    def spy(*args, **kwargs):
        calls.append(kwargs.get("n_bins"))
        return original(*args, **kwargs)

    monkeypatch.setattr(M, "calibration_bins", spy)
    probs, labels = _probs_labels(1)
    plots.reliability_diagram(probs, labels, tmp_path / "rel.png", n_bins=7)
    assert calls == [7]


def test_risk_coverage(tmp_path):
    curves = {"softmax": _probs_labels(2), "sgpa": _probs_labels(3, sharp=1.0)}
    out = plots.risk_coverage(curves, tmp_path / "rc.png", title="risk-coverage")
    _assert_png(out)
    with pytest.raises(ValueError, match="curves"):
        plots.risk_coverage({}, tmp_path / "empty.png")


def test_ood_histograms(tmp_path):
    rng = np.random.default_rng(4)
    scores = {
        "softmax": (rng.beta(8, 2, 400), rng.beta(4, 3, 300)),
        "kep-svgp": (rng.beta(9, 2, 400), rng.beta(3, 3, 300)),
        "constant": (np.full(10, 0.5), np.full(10, 0.5)),  # zero-width range must not crash
    }
    out = plots.ood_histograms(scores, tmp_path / "ood.png", title="max prob")
    _assert_png(out)


def test_scaling_curves(tmp_path):
    rows = []
    for variant, power in (("softmax", 2.0), ("kep-svgp", 1.0)):
        for t in (64, 128, 256, 512):
            rows.append({"variant": variant, "T": t, "ms_median": 1e-3 * t**power})
    rows.append({"variant": "sgpa", "T": 1024, "ms_median": None})  # a failed run is skipped
    out = plots.scaling_curves(rows, tmp_path / "scale.png", title="forward+backward")
    _assert_png(out)
    with pytest.raises(ValueError, match="variant"):
        plots.scaling_curves([{"T": 1, "ms_median": 1.0}], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="ms_median"):
        plots.scaling_curves([{"variant": "a", "T": 1, "ms_median": float("nan")}], tmp_path / "bad.png")


def test_import_changes_no_matplotlib_global(tmp_path):
    # Fresh interpreter: pick a non-Agg backend first, so an import-time matplotlib.use("Agg") (or a
    # pyplot import) would show up; then draw a plot and check again.
    code = textwrap.dedent(
        """
        import sys
        import matplotlib
        matplotlib.use("svg")
        before = matplotlib.get_backend()
        import numpy as np
        import gpattn.experiments.plots as plots
        assert "matplotlib.pyplot" not in sys.modules, "gpattn.experiments.plots imported pyplot"
        assert matplotlib.get_backend() == before, (before, matplotlib.get_backend())
        plots.scaling_curves([{"variant": "a", "T": 2, "ms_median": 1.0},
                              {"variant": "a", "T": 4, "ms_median": 2.0}], sys.argv[1])
        assert matplotlib.get_backend() == before, (before, matplotlib.get_backend())
        assert "matplotlib.pyplot" not in sys.modules
        print("ok", before)
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MPLBACKEND", None)
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s.png")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok svg"
    _assert_png(tmp_path / "s.png")


@pytest.mark.parametrize("kind", ["risk_coverage", "scaling_curves"])
def test_many_curves_stay_distinguishable(monkeypatch, tmp_path, kind):
    # A CoLA report plots 16 variants: matplotlib's default cycle repeats its 10 colours, so two
    # curves were drawn alike. Every (colour, line style) pair must differ, for up to 40 curves.
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    n = 16
    if kind == "risk_coverage":
        plots.risk_coverage({f"v{i}": _probs_labels(i) for i in range(n)}, tmp_path / "rc.png")
    else:
        rows = [{"variant": f"v{i}", "T": t, "ms_median": (i + 1) * t} for i in range(n) for t in (8, 16)]
        plots.scaling_curves(rows, tmp_path / "s.png")
    (ax,) = figures[0].axes
    styles = {(line.get_color(), line.get_linestyle()) for line in ax.get_lines() if line.get_label().startswith("v")}
    assert len(styles) == n
    assert len({(plots._line_style(i)["color"], plots._line_style(i)["linestyle"]) for i in range(40)}) == 40
    # the legend of many curves sits beside the axes, not over the curves
    assert ax.get_legend().get_bbox_to_anchor().x0 > ax.bbox.x1 - 1


def test_ood_histograms_of_many_variants_wrap_into_rows(monkeypatch, tmp_path):
    # one row of 14 panels was a 5600 x 350 px strip; rows of at most four panels stay readable
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    rng = np.random.default_rng(5)
    plots.ood_histograms({f"v{i}": (rng.beta(8, 2, 50), rng.beta(4, 3, 40)) for i in range(14)}, tmp_path / "o.png")
    fig = figures[0]
    width, height = fig.get_size_inches()
    assert len(fig.axes) == 14 and width <= 4 * 4.0 + 1e-9 and height == 4 * 3.5
    assert [ax.get_title().split(" ")[0] for ax in fig.axes] == [f"v{i}" for i in range(14)]
