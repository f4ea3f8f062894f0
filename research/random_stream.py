"""Is a GP layer's fine-tuning gap on MiniLM the random stream? A probe (research/notes/kep_svgp_robustness.md,
"The random stream").

A swapped GP layer draws normals in every training forward; each draw moves the position of every later dropout
mask in the stream. ``gpattn train`` with one change: every swapped attention layer draws ``--draws`` normals per
token and discards them before each training forward (a forward pre-hook; evaluation forwards draw nothing), so
softmax attention meets the stream a GP layer meets and computes nothing else differently. ``--draws 0`` is
``gpattn train`` itself.

Run: ``python research/random_stream.py --draws 64 -- train --dataset cola --data-dir ../shared/data --encoder
minilm --attention softmax --epochs 1 --seed 0 --out RUN``.
"""

from __future__ import annotations

import torch
from _patched_cli import run_patched

from gpattn.experiments import training


def with_dummy_draws(draws: int):
    """The trainer's ``build_model`` followed by a pre-hook on every swapped attention layer that draws
    ``draws`` standard normals per token of its input (B × T × draws) in training mode and discards them."""
    build = training.build_model

    def hook(module, args):
        if module.training and draws > 0:
            x = args[0]
            torch.randn(*x.shape[:-1], draws, dtype=x.dtype, device=x.device)

    def wrap(model):
        for adapter in getattr(model, "adapters", {}).values():
            adapter.attention.register_forward_pre_hook(hook)
        return model

    def built(cfg, bundle, *args, **kwargs):
        return wrap(build(cfg, bundle, *args, **kwargs))

    built._wrap = wrap  # the hooks alone, for a model built elsewhere (tests)
    return built


def main(argv=None):
    return run_patched(
        argv,
        __doc__.split("\n\n")[0],
        "--draws",
        int,
        "normals drawn per token by every swapped layer",
        "build_model",
        with_dummy_draws,
    )


if __name__ == "__main__":
    main()
