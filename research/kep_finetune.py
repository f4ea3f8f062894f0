"""What keeps kep-svgp at the class prior when MiniLM is fine-tuned, mechanism by mechanism? A probe
(docs/results.md, "The encoder swap: fine-tuning MiniLM on CoLA").

``gpattn train`` with one change: after the stream match (``HFClassifier.match_prior_to_stream``) every swapped GP
layer's prior is multiplied by ``--prior-factor`` c through ``scale_prior`` — for kep-svgp σ² and q(u_c) together
((m_c, L_c) ← √c (m_c, L_c)), so the noise shrinks by √c at initialisation and the KL is unchanged, unlike the
``prior_variance`` option, which moves only σ² (a KL of 56,637 nats at σ² = 1e-4). The other mechanisms take the
trainer's own switches: ``--beta 0`` (no global KL), ``--eta 0`` (no KSVD term), ``--attention-option
feature_gradient=False`` (the KSVD features read the encoder without its gradient). The factor goes into the run's
``prior_scale.json`` rows as ``probe_factor``.

Run: ``python research/kep_finetune.py --prior-factor 1e-4 -- train --dataset cola --data-dir ../shared/data
--encoder minilm --attention kep-svgp --epochs 1 --seed 0 --out RUN``.
"""

from __future__ import annotations

import argparse

from gpattn.experiments import cli, training


def with_prior_factor(factor: float):
    """The trainer's stream match followed by ``scale_prior(factor)`` on every layer it scaled."""
    match = training._match_prior_to_stream

    def scaled(model, split, device):
        rows = match(model, split, device)
        for row in rows:
            model.adapters[row["layer"]].attention.scale_prior(factor)
            row["probe_factor"] = factor
        return rows

    return scaled


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prior-factor", type=float, required=True, help="c multiplying every swapped GP prior")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the gpattn command line (train ...)")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    original = training._match_prior_to_stream
    training._match_prior_to_stream = with_prior_factor(ns.prior_factor)
    try:
        return cli.main(args)
    finally:
        training._match_prior_to_stream = original


if __name__ == "__main__":
    main()
