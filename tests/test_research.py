"""The research probes (research/): each runs at a tiny size. A probe answers one question; its finding is in the
docs (research/README.md says where), so what is checked is that it still runs, not what it measured."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

RESEARCH = Path(__file__).resolve().parents[1] / "research"


def _research(name: str):
    """The probe research/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, RESEARCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gumbel_floor_smoke():
    """research/gumbel_floor.py at a tiny size: every case timed, the floor is the softmax layer plus the noise
    plus the mask read, and the ratios divide by it and by the softmax layer."""
    floor = _research("gumbel_floor")
    result = floor.main(["--smoke", "--threads", "1"])
    med = result["ms_median"]
    assert set(med) == {"softmax layer", "sto layer", "h-sto layer", "noise (B, H, T, T)", "SDPA core",
                        "SDPA core + float mask"} and all(ms > 0 for ms in med.values())
    expected = med["softmax layer"] + med["noise (B, H, T, T)"] + med["SDPA core + float mask"] - med["SDPA core"]
    assert math.isclose(result["floor_ms"], expected)
    assert math.isclose(result["ratios"]["sto"]["x_floor"], med["sto layer"] / expected)
    assert math.isclose(result["ratios"]["h-sto"]["x_softmax"], med["h-sto layer"] / med["softmax layer"])
