"""What keeps kep-svgp at the class prior when MiniLM is fine-tuned, mechanism by mechanism? A probe
(research/notes/kep_svgp_robustness.md, "One mechanism at a time").

``gpattn train`` with one change: after the stream match (``HFClassifier.match_prior_to_stream``) every swapped GP
layer's prior is multiplied by ``--prior-factor`` c through ``scale_prior`` — for kep-svgp σ² and q(u_c) together
((m_c, L_c) ← √c (m_c, L_c)), so the noise shrinks by √c at initialisation and the KL is unchanged, unlike the
``prior_variance`` option, which moves only σ² (a KL of 56,637 nats at σ² = 1e-4). The other mechanisms take the
trainer's own switches: ``--beta 0`` (no global KL), ``--eta 0`` (no KSVD term), and ``python research/knobs.py --
train ... --attention-option feature_gradient=False`` (the KSVD features read the encoder without their gradient, a
research knob). The factor goes into the run's ``prior_scale.json`` rows as ``probe_factor``.

Run: ``python research/kep_finetune.py --prior-factor 1e-4 -- train --dataset cola --data-dir ../shared/data
--encoder minilm --attention kep-svgp --epochs 1 --seed 0 --out RUN``.
"""

from __future__ import annotations

from _patched_cli import run_patched

from gpattn.experiments import training


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
    return run_patched(
        argv,
        __doc__.split("\n\n")[0],
        "--prior-factor",
        float,
        "c multiplying every swapped GP prior",
        "_match_prior_to_stream",
        with_prior_factor,
    )


if __name__ == "__main__":
    main()
