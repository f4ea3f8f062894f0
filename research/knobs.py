"""The research knobs that left the layers' options, kept for the probes that reproduce a finding: each a
subclass of a shipped layer that takes them again through the layer's strategy hook (``_strategy``). Not part of the
library: a knob here measured no better than the default (research/notes/ says where), or is a verification tool.

* :class:`KEPSVGPProbe` — kep-svgp's ``feature_gradient`` (the KSVD features read x, q and k without their gradient:
  research/notes/kep_svgp_robustness.md, "The encoder swap: fine-tuning MiniLM on CoLA"), ``token_independent`` (the
  released code's sampler) and ``include_residual`` (Remark 3.1's dropped K_ff − Q_ff term).
* :class:`CGPProbe` — cgp's ``prior_samples`` (P_o of the regulariser; None: its exact expectation) and
  ``learn_sigma``; :class:`SCGPProbe` — scgp's ``learn_sigma``.

``probing()`` puts them in place of the shipped layers while a block runs, so that a ``gpattn`` command line takes the
knobs as attention options::

    python research/knobs.py -- train --dataset cola --data-dir ../shared/data --encoder minilm \\
        --attention kep-svgp --epochs 1 --seed 0 --attention-option feature_gradient=False --out RUN
"""

from __future__ import annotations

import argparse
import contextlib

from gpattn.attention import registry
from gpattn.attention.cgp import CGPAttention, SCGPAttention
from gpattn.attention.kep_svgp import KEPSVGPAttention

__all__ = ["CGPProbe", "KEPSVGPProbe", "PROBES", "SCGPProbe", "probing"]


def _flags(**flags) -> dict:
    """``flags``, each a bool (a ``ValueError`` naming the one that is not)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    return flags


class KEPSVGPProbe(KEPSVGPAttention):
    """kep-svgp with its strategy's research settings as options (module docstring)."""

    def __init__(self, embed_dim: int, num_heads: int, *, token_independent: bool = False,
                 include_residual: bool = False, feature_gradient: bool = True, **options):
        self._probe = _flags(token_independent=token_independent, include_residual=include_residual,
                             feature_gradient=feature_gradient)
        super().__init__(embed_dim, num_heads, **options)

    def _strategy(self, **options):
        return super()._strategy(**options, **self._probe)

    def extra_repr(self) -> str:
        return super().extra_repr() + "".join(f", {k}={v}" for k, v in self._probe.items())


class CGPProbe(CGPAttention):
    """cgp with its strategy's ``prior_samples`` (P_o, or None: the exact expectation) and ``learn_sigma``."""

    def __init__(self, embed_dim: int, num_heads: int, *, prior_samples: int | None = 10, learn_sigma: bool = False,
                 **options):
        self._probe = dict(prior_samples=prior_samples, **_flags(learn_sigma=learn_sigma))
        super().__init__(embed_dim, num_heads, **options)

    def _strategy(self, **options):
        return super()._strategy(**options, **self._probe)


class SCGPProbe(SCGPAttention):
    """scgp with its strategy's ``learn_sigma``."""

    def __init__(self, embed_dim: int, num_heads: int, *, learn_sigma: bool = False, **options):
        self._probe = _flags(learn_sigma=learn_sigma)
        super().__init__(embed_dim, num_heads, **options)

    def _strategy(self, **options):
        return super()._strategy(**options, **self._probe)


#: the probe of each variant name
PROBES = {"kep-svgp": KEPSVGPProbe, "cgp": CGPProbe, "scgp": SCGPProbe}


@contextlib.contextmanager
def probing():
    """The probes registered under their variants' names while the block runs (the shipped layers after it, also
    when it raises)."""
    shipped = {name: registry._REGISTRY[name] for name in PROBES}
    registry._REGISTRY.update(PROBES)
    try:
        yield PROBES
    finally:
        registry._REGISTRY.update(shipped)


def main(argv=None):
    """``-- gpattn-command-line`` run with the probes in place (:func:`probing`)."""
    from gpattn.experiments import cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the gpattn command line (train ...)")
    ns = parser.parse_args(argv)
    with probing():
        return cli.main(ns.args[1:] if ns.args[:1] == ["--"] else ns.args)


if __name__ == "__main__":
    main()
