"""The probes of research/knobs.py — the research knobs that left the layers' options — for the tests that
check the math those knobs switch on: the released sampler, Remark 3.1's residual, the features' gradient (kep-svgp),
the regulariser's exact expectation and a learned σ (cgp, scgp)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "research"))

from knobs import CGPProbe, KEPSVGPProbe, SCGPProbe  # noqa: E402

__all__ = ["CGPProbe", "KEPSVGPProbe", "SCGPProbe"]
