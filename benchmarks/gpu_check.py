"""End-to-end check of gpattn's CUDA paths on one GPU, against the same work on the CPU.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out gpu_check_out            # on a CUDA machine
    PYTHONPATH=. OMP_NUM_THREADS=1 python3 benchmarks/gpu_check.py --device cpu --out /tmp/gc   # dry run

Checks (each runs in its own child process with its own time limit, so a hang, a crash or a sticky CUDA
error in one is recorded and the others still run; inside a check every item is wrapped the same way):

``layers``  every registered variant (``gpattn.list_attention()``, plus the non-default ``covariance``
    values, the encoder swap's form of the SGPA variants, and sgpa / kernel with the image
    models' gpytorch kernel ``ard-rbf``): one CPU-built layer copied to the
    device; forward + backward with a key padding mask under ``gpattn.deterministic()`` in float64 and float32;
    outputs, loss terms (GPyTorch added loss terms / KL) and gradients (input and every parameter) against the
    CPU copy (max abs / rel differences; float32 is judged against the CPU's own float32-vs-float64 error); a
    float64 pass at T=160 (factorisations above the 128 branch-free jitter ladder); a float64 pass with a
    causal ``attn_mask`` (variants with per-query masks); the posterior (GP
    variants); a sampling forward with ``num_samples``; a bf16-autocast forward/backward that must be finite;
    placement: parameters, buffers, plain tensor attributes, outputs, loss terms, gradients and diagnostics on
    the device; on CUDA, host-device synchronisations of one forward + backward (``torch.cuda`` sync debug
    mode, with the gpattn line and the call that caused each; "warn", not "fail").
``train``   ``gpattn train`` on the embedded digits data (sgpa and softmax fp32, sgpa ``--precision bf16``) on
    the device and (fp32) on the CPU, and with ``--validate`` on the device; metrics compared roughly; a run
    cut after 5 steps and resumed on the device against the uninterrupted one; ``gpattn evaluate`` of a device
    checkpoint on
    the device and on the CPU; ``gpattn.experiments.load_run`` on both devices and ``predict`` (deterministic: the
    two must agree); host-device synchronisations of one training step of the trainer; a world-size-1
    ``DistributedDataParallel`` (NCCL on CUDA) step against the plain model.
``hf``      the Hugging Face swap on a tiny random ``BertForSequenceClassification`` (sdpa and eager) moved to the
    device: a training step (logits, loss parts, gradients, parameters after an SGD step) and eval forwards against
    the CPU copy, loss terms reachable from the outer model, host-device synchronisations of the step (recorded
    only); a bf16-autocast step; ``HFClassifier`` with ``match_prior_to_stream`` and
    the frozen trunk; ``gpattn train --encoder`` (full and frozen-trunk) on a generated text table, then
    ``load_run(...).predict`` on the device.
``timing``  forward+backward (then forward) of each variant at T in {128, 512, 2048}, B=8, D=128, H=4 on the
    device with ``benchmarks/attention_scaling.py``'s ``measure_case`` (synchronised timings, allocator peak),
    as ratios to softmax in the same run; cases past the check's budget are skipped and say so.

On one H100 (torch 2.11, CUDA 13) the whole run takes about 90 s; on the CPU (one thread) about a minute.
This file is the command line; the checks live in ``benchmarks/_gpu_checks/`` (a module per check, plus the
comparisons, the synchronisation counter, the child-process runner and the report).

Writes ``OUT/gpu_check.json`` (everything), ``OUT/gpu_check.md`` (tables), ``OUT/<check>.json`` (each
check's items, written as they finish: a check that ran out of time keeps what it did) and
``OUT/logs/<check>.log`` (the child's output). Prints a short summary; exit status 1 when a check failed,
errored or timed out, 0 otherwise (``warn`` and ``skip`` do not fail: host synchronisations and missing
optional packages are reported, not fatal). Needs torch, gpytorch, linear_operator, numpy; ``train`` also
the experiment extra's packages (scikit-learn for digits, scipy, tqdm), ``hf`` transformers (and tokenizers
for the ``--encoder`` runs); a missing one skips what needs it, with the reason.
"""

from __future__ import annotations

import argparse
import sys

from _gpu_checks.runner import CHECKS, CPU_SLOWDOWN, TOTAL_BUDGET, child_main, parent_main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.md, per-check JSON and logs")
    p.add_argument("--device", default="auto", help="auto (default: cuda when available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)} (default all)")
    p.add_argument("--variants", default=None, help="layers/timing: only these variants or labels (comma list)")
    p.add_argument("--timing-ts", default=None, help="timing: T values (default 128,512,2048 on CUDA, 32,64 on CPU)")
    p.add_argument("--timing-batch", type=int, default=None, help="timing: B (default 8 on CUDA, 2 on CPU)")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"overall seconds (default {TOTAL_BUDGET} on CUDA, x{CPU_SLOWDOWN:g} on CPU)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every check's time limit")
    p.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=float, default=60.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
