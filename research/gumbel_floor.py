"""The cost floor of exact Gumbel noise drawn outside the attention kernel, against STO-TRANS and H-STO-TRANS.

STO-TRANS's CPU path is softmax attention with the (B, H, T, S) Gumbel noise G/τ as
``scaled_dot_product_attention``'s additive mask (docs/derivations.md §3). Whatever the implementation, exact
noise drawn outside the kernel costs at least: the softmax layer + drawing the noise + reading it as the mask.
This script times, interleaved in one process (so that load and frequency changes hit every case alike), one
forward + backward of each of

* the softmax layer, the ``sto`` layer and the ``h-sto`` layer on x of shape (B, T, D);
* the noise alone (:func:`gpattn.attention._gumbel.gumbel_noise` of shape (B, H, T, T));
* the attention core, ``scaled_dot_product_attention`` on (B, H, T, Dh), without and with a float mask,

and prints their medians, the floor = softmax layer + noise + (core with mask − core), and each layer's ratio
to the softmax layer and to the floor (issue #30's CPU bar: sto and h-sto ≤ 1.5× softmax at T = 1024, or within
10 % of a floor shown above 1.5×).

    python research/gumbel_floor.py                     # B=8, T=1024, H=4, Dh=32, 15 rounds, 2 threads
    python research/gumbel_floor.py --smoke             # T=32, 2 rounds (tests)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import gpattn
from gpattn.attention._gumbel import gumbel_noise


def _layer_call(name, x, heads):
    layer = gpattn.build_attention(name, x.shape[-1], heads).train()

    def call():
        for p in layer.parameters():
            p.grad = None
        layer(x).square().mean().backward()

    return call


def cases(B: int, T: int, H: int, Dh: int) -> dict:
    """The timed calls, by label."""
    x = torch.randn(B, T, H * Dh)
    q, k, v = (torch.randn(B, H, T, Dh, requires_grad=True) for _ in "qkv")
    bias = gumbel_noise((B, H, T, T))
    return {
        "softmax layer": _layer_call("softmax", x, H),
        "sto layer": _layer_call("sto", x, H),
        "h-sto layer": _layer_call("h-sto", x, H),
        "noise (B, H, T, T)": lambda: gumbel_noise((B, H, T, T)),
        "SDPA core": lambda: F.scaled_dot_product_attention(q, k, v).sum().backward(),
        "SDPA core + float mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward(),
    }


def measure(B: int, T: int, H: int, Dh: int, rounds: int) -> dict:
    """Median milliseconds per label over ``rounds`` interleaved rounds (after two warm-up calls each), the
    floor and the ratios."""
    torch.manual_seed(0)
    calls = cases(B, T, H, Dh)
    for call in calls.values():
        call()
        call()
    times = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            start = time.perf_counter()
            call()
            times[label].append(1e3 * (time.perf_counter() - start))
    med = {label: statistics.median(t) for label, t in times.items()}
    floor = med["softmax layer"] + med["noise (B, H, T, T)"] + med["SDPA core + float mask"] - med["SDPA core"]
    ratios = {
        name: {"x_softmax": med[f"{name} layer"] / med["softmax layer"], "x_floor": med[f"{name} layer"] / floor}
        for name in ("sto", "h-sto")
    }
    return {"ms_median": med, "floor_ms": floor, "floor_x_softmax": floor / med["softmax layer"], "ratios": ratios}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="T=32, B=2, 2 rounds (tests)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, T, rounds = (2, 32, 2) if args.smoke else (8, 1024, args.rounds)
    result = measure(B, T, 4, 32, rounds)
    for label, ms in result["ms_median"].items():
        print(f"{label:<24} {ms:8.2f} ms")
    print(f"floor (softmax layer + noise + mask read) {result['floor_ms']:.2f} ms = {result['floor_x_softmax']:.2f}x")
    for name, r in result["ratios"].items():
        print(f"{name:<6} {r['x_softmax']:.2f}x softmax, {r['x_floor']:.2f}x the floor")
    return result


if __name__ == "__main__":
    main()
