"""Check ``layers``: every registered variant's forward + backward on the device against a CPU copy."""

from __future__ import annotations

import copy

import torch

import gpattn
from gpattn.attention.sgpa import SeparateMaps

from .compare import (
    TOL_F32_FACTOR,
    TOL_F64,
    compare_results,
    devices_of,
    err,
    f32_tolerance,
    judge,
    placement,
    quantities,
    same_device,
    stochastic_quantities,
    summarise,
)
from .record import Recorder, fmt, verdict
from .sync import sync_events

#: the layers' width and heads
D, H = 16, 2


def layer_configs() -> list[tuple[str, str, dict]]:
    """(label, registry name, options): every variant at its defaults, every non-default ``covariance``, and the
    SGPA variants in the encoder swap's form (separate maps, the softmax prior mean: ``recipe="encoder-swap"``)."""
    configs = []
    for name in gpattn.list_attention():
        configs.append((name, name, {}))
        valid = gpattn.attention_options(name)
        if valid.get("covariance") in ("full", "diag"):  # sgpa, sgpa-decoupled (sgpa-rff's is g's)
            for value in ("full", "diag"):
                if value != valid["covariance"]:
                    configs.append((f"{name}[covariance={value}]", name, {"covariance": value}))
        if valid.get("prior_mean") == "attention":  # the encoder swap's form (docs/derivations.md §5d, §5e)
            configs.append((f"{name}[recipe=encoder-swap]", name, {"recipe": "encoder-swap"}))
        if name in ("sgpa", "kernel") and valid.get("kernel") == "exponential":
            # the image models' kernel (gpattn.models.classifiers.IMAGE_KERNEL): a gpytorch kernel
            configs.append((f"{name}[kernel=ard-rbf]", name, {"kernel": "ard-rbf"}))
    return configs


def inputs(B, T, D, pads, seed=0):
    """Inputs ``x``, a key padding mask (``pads[i]`` padded tokens at the end of row i) and output weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(pads):
        if n:
            mask[i, T - n :] = True
    w = torch.randn(B, T, D, generator=g)
    return x, mask, w


def layer_pass(layer, x, mask, w, device, seed: int, attn_mask=None) -> dict:
    """Training-mode forward under gpattn.deterministic() + backward of sum(y * w) + the loss terms."""
    layer.train()
    for p in layer.parameters():
        p.grad = None
    xx = x.detach().to(device).clone().requires_grad_(True)
    m = mask.to(device)
    with gpattn.deterministic():
        torch.manual_seed(seed)
        if attn_mask is None:
            y = layer(xx, m)
        else:
            y = layer(xx, m, attn_mask=attn_mask.to(device))
        terms = layer.loss_terms()
    loss = (y * w.to(device=device, dtype=y.dtype)).sum()
    for v in terms.values():
        loss = loss + v
    loss.backward()
    grads = {"x": xx.grad}
    grads.update({n: (None if p.grad is None else p.grad.detach().clone()) for n, p in layer.named_parameters()})
    diag = layer.diagnostics() if hasattr(layer, "diagnostics") else {}
    return {
        "y": y.detach(),
        "terms": {k: v.detach() for k, v in terms.items()},
        "grads": grads,
        "diag_devices": sorted({str(v.device) for v in diag.values() if hasattr(v, "device")}),
    }


class LayerCase:
    """One configuration's comparisons: a layer built once on the CPU (float32); each step below copies it,
    runs it on the CPU and on the device, and adds to ``res``, the failures and the warnings."""

    def __init__(self, label: str, name: str, options: dict, device: str, small: tuple, large: tuple):
        self.device, self.small, self.large = device, small, large
        self.res = {"variant": label, "options": options}
        self.failures, self.warns = [], []
        torch.manual_seed(0)
        self.base = gpattn.build_attention(name, D, H, **options)  # float32, on the CPU

    def _pair64(self, data, key: str, what: str, attn_mask=None) -> dict:
        """A float64 pass of fresh copies on the CPU and on the device, judged at ``TOL_F64``."""
        x, mask, w = data
        ref = layer_pass(copy.deepcopy(self.cpu64), x.double(), mask, w.double(), "cpu", 1, attn_mask)
        dev = copy.deepcopy(self.cpu64).to(self.device)
        got = layer_pass(dev, x.double(), mask, w.double(), self.device, 1, attn_mask)
        cmp = compare_results(got, ref)
        ok, bad = judge(cmp, TOL_F64, self.stoch64)
        self.res[key] = {"compare": cmp, "bad": bad}
        if not ok:
            self.failures.append(f"{what} device vs CPU: {bad[:3]}")
        return cmp

    def float64(self) -> None:
        x, mask, w = self.small
        self.cpu64 = copy.deepcopy(self.base).double()
        r64 = layer_pass(self.cpu64, x.double(), mask, w.double(), "cpu", 1)
        r64b = layer_pass(self.cpu64, x.double(), mask, w.double(), "cpu", 2)
        self.stoch64 = stochastic_quantities(r64, r64b)
        self.dev64 = copy.deepcopy(self.cpu64).to(self.device)
        self.res["placement"] = placement(self.dev64, self.device)
        d64 = layer_pass(self.dev64, x.double(), mask, w.double(), self.device, 1)
        self.r64, self.c64 = r64, compare_results(d64, r64)
        ok, bad = judge(self.c64, TOL_F64, self.stoch64)
        self.res["float64"] = {"compare": self.c64, "stochastic": sorted(self.stoch64), "bad": bad}
        if not ok:
            self.failures.append(f"float64 device vs CPU: {bad[:3]}")
        if self.c64["term_keys"][0] != self.c64["term_keys"][1]:
            self.failures.append(f"loss term names differ: {self.c64['term_keys']}")
        devs = devices_of(d64)
        if not all(same_device(d, self.device) for d in devs):
            self.failures.append(f"results on {sorted(devs)}, not only {self.device}")
        self.res["result_devices"] = sorted(devs)
        self.res["diagnostics_devices"] = d64["diag_devices"]
        if not all(same_device(d, self.device) for d in d64["diag_devices"]):
            self.failures.append(f"diagnostics on {d64['diag_devices']}")

    def float32(self) -> None:
        """Judged against the CPU's own float32-vs-float64 error (``TOL_F32_FACTOR`` times it)."""
        x, mask, w = self.small
        cpu32 = copy.deepcopy(self.base)
        r32 = layer_pass(cpu32, x, mask, w, "cpu", 1)
        r32b = layer_pass(cpu32, x, mask, w, "cpu", 2)
        self.stoch32 = stochastic_quantities(r32, r32b)
        d32 = layer_pass(copy.deepcopy(self.base).to(self.device), x, mask, w, self.device, 1)
        self.yard = compare_results(r32, self.r64)  # the CPU's own float32 error against float64
        self.c32 = compare_results(d32, r32)
        ok, bad = judge(self.c32, f32_tolerance(self.yard), self.stoch32)
        self.res["float32"] = {
            "compare": self.c32,
            "cpu_f32_vs_f64": self.yard,
            "stochastic": sorted(self.stoch32),
            "bad": bad,
        }
        if not ok:
            self.failures.append(f"float32 device vs CPU beyond {TOL_F32_FACTOR:g}x the CPU's float32 error: {bad[:3]}")
        for k, v in quantities(self.c32).items():  # recorded, not failed: the CPU's own float32 error, for scale
            if k not in self.stoch32 and v > 1e-2:
                self.warns.append(f"float32 {k} differs by {v:.1e} (normalised)")

    def large_and_causal(self) -> None:
        """float64 at T = 160 (factorisations above LADDER_MAX_SIZE keep their host check), and with a causal
        ``attn_mask`` for the variants with per-query masks (not the SGPA variants' separate maps, which take masks
        that pad only: docs/derivations.md §5d)."""
        self.cl = self._pair64(self.large, "float64_T160", "float64 T=160")
        if getattr(self.base, "per_query_masks", False) and not isinstance(self.base, SeparateMaps):
            T = self.small[0].shape[1]
            causal = torch.ones(T, T, dtype=torch.bool).triu(1)
            self._pair64(self.small, "float64_causal", "float64 causal attn_mask", attn_mask=causal)

    def posterior(self) -> None:
        """GP variants: the posterior in float64, eval mode, and a draw from it on the device."""
        if not bool(getattr(self.base, "is_gp", False)):
            return
        x, mask, _ = self.small
        with torch.no_grad():
            pc = self.cpu64.eval().posterior(x.double(), mask)
            pd = self.dev64.eval().posterior(x.double().to(self.device), mask.to(self.device))
            post = {
                "mean": err(pd.mean, pc.mean),
                "covariance": err(pd.covariance_matrix, pc.covariance_matrix),
                "devices": sorted({str(pd.mean.device), str(pd.covariance_matrix.device)}),
            }
            draw = pd.rsample(torch.Size([2]))
            post["rsample_finite"] = bool(torch.isfinite(draw).all())
            post["rsample_device"] = str(draw.device)
        self.res["posterior"] = post
        if max(post["mean"]["norm"], post["covariance"]["norm"]) > TOL_F64:
            self.failures.append(
                f"posterior device vs CPU: mean {post['mean']['norm']:.1e}, cov {post['covariance']['norm']:.1e}"
            )
        if not post["rsample_finite"]:
            self.failures.append("posterior rsample not finite")

    def sampling(self) -> None:
        """A sampling forward with ``num_samples=3`` (float32, train and eval): shape and finiteness."""
        x, mask, _ = self.small
        layer = copy.deepcopy(self.base).to(self.device)
        samp = {}
        for mode in ("train", "eval"):
            layer.train(mode == "train")
            torch.manual_seed(3)
            with torch.no_grad():
                y = layer(x.to(self.device), mask.to(self.device), num_samples=3)
            samp[mode] = {"shape": list(y.shape), "finite": bool(torch.isfinite(y).all()), "device": str(y.device)}
            if list(y.shape) != [3, *x.shape] or not samp[mode]["finite"]:  # the sample axis leads: (P, B, T, D)
                self.failures.append(f"num_samples=3 ({mode}): shape {list(y.shape)}, finite {samp[mode]['finite']}")
        self.res["sampling"] = samp

    def bf16(self) -> None:
        """A bf16-autocast forward + backward on the device: everything finite, loss terms in float32."""
        x, mask, _ = self.small
        device = self.device
        layer = copy.deepcopy(self.base).to(device).train()
        xx = x.detach().to(device).clone().requires_grad_(True)
        torch.manual_seed(4)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = layer(xx, mask.to(device))
            terms = layer.loss_terms()
        (y.float().sum() + sum(terms.values(), torch.zeros((), device=device))).backward()
        bf = {
            "output_dtype": str(y.dtype),
            "output_finite": bool(torch.isfinite(y.float()).all()),
            "terms": {k: {"dtype": str(v.dtype), "finite": bool(torch.isfinite(v))} for k, v in terms.items()},
            "grads_finite": all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in layer.parameters())
            and bool(torch.isfinite(xx.grad).all()),
        }
        self.res["bf16_autocast"] = bf
        if not (bf["output_finite"] and bf["grads_finite"] and all(t["finite"] for t in bf["terms"].values())):
            self.failures.append(f"bf16 autocast: non-finite values {bf}")
        if any(t["dtype"] != "torch.float32" for t in bf["terms"].values()):
            self.warns.append(f"bf16 autocast: loss terms not float32: {bf['terms']}")

    def syncs(self) -> None:
        """Host-device synchronisations of one float32 forward + backward (after a warm-up): warnings."""
        layer = copy.deepcopy(self.base).to(self.device)
        xs, ms, ws = (t.to(self.device) for t in self.small)

        def forward():
            layer.train()
            for p in layer.parameters():
                p.grad = None
            loss = (layer(xs, ms) * ws).sum()
            for v in layer.loss_terms().values():
                loss = loss + v
            return loss

        def step():
            forward().backward()

        step()
        self.sync = sync_events(step, self.device, forward)
        self.res["sync"] = self.sync
        if self.sync.get("count"):
            self.warns.append(
                f"{self.sync['count']} host-device synchronisation(s) in one forward+backward: "
                f"{list(self.sync['by_location'])[:3]}"
            )

    def placed(self) -> None:
        """Parameters and buffers must be on the device; plain tensor attributes left behind are warnings."""
        pl = self.res["placement"]
        if pl["params_off_device"] or pl["buffers_off_device"]:
            self.failures.append(
                f"parameters/buffers not on {self.device}: {pl['params_off_device'][:3]} {pl['buffers_off_device'][:3]}"
            )
        if pl["plain_tensor_attrs_off_device"]:
            self.warns.append(f"plain tensor attributes left on the host: {pl['plain_tensor_attrs_off_device'][:3]}")

    def summary(self) -> str:
        stoch64, stoch32 = self.stoch64, self.stoch32
        yard = max(v for k, v in quantities(self.yard).items() if k not in stoch32)
        parts = [
            summarise("f64", self.c64, stoch64),
            summarise("f32", self.c32, stoch32) + f" (cpu f32 err {fmt(yard)})",
            summarise("f64 T160", self.cl, stoch64),
        ]
        if "float64_causal" in self.res:
            parts.append(summarise("f64 causal", self.res["float64_causal"]["compare"], stoch64))
        summary = " | ".join(parts)
        stoch = stoch64 | stoch32
        if stoch:
            summary += f" | seed-dependent under deterministic(): {sorted(stoch)[:3]}{'...' if len(stoch) > 3 else ''}"
        if torch.device(self.device).type == "cuda":
            summary += f" | syncs {self.sync.get('count', 0)}"
        return summary

    def run(self) -> dict:
        for step in (self.float64, self.float32, self.large_and_causal, self.posterior, self.sampling, self.bf16):
            step()
        self.syncs()
        self.placed()
        return verdict(self.res, self.summary(), self.failures, self.warns)


def check_layers(rec: Recorder, device: str, args) -> None:
    configs = layer_configs()
    if args.variants:
        wanted = set(args.variants.split(","))
        configs = [c for c in configs if c[0] in wanted or c[1] in wanted]
    small = inputs(3, 20, D, (0, 5, 12))
    large = inputs(2, 160, D, (0, 37), seed=1)
    for config in configs:
        rec.item(config[0], lambda c=config: LayerCase(*c, device, small, large).run(), need_s=5)
