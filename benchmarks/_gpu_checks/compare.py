"""Device results against CPU references: normalised differences, tolerances, and where tensors live."""

from __future__ import annotations

import math

import torch

from .record import fmt

#: normalised error (max |a - b| / max |b|) allowed between the device and the CPU in float64
TOL_F64 = 1e-6
#: float32: allowed = max(TOL_F32_FLOOR, TOL_F32_FACTOR x the CPU's own float32-vs-float64 error)
TOL_F32_FACTOR = 20.0
TOL_F32_FLOOR = 1e-4
#: used where no float64 yardstick exists
TOL_F32_FIXED = 2e-3


def _uniform(value: float, **note) -> dict:
    return {"max_abs": value, "max_rel": value, "norm": value, **note}


def err(a, b, floor: float = 0.0) -> dict:
    """Differences of ``a`` (device) against ``b`` (reference), in float64 on the CPU: ``max_abs``,
    ``max_rel`` (elementwise, denominators floored at 1e-3 max|b|), ``norm`` = max_abs / max(max|b|, floor)
    (``floor``: the scale below which a quantity counts as zero, e.g. a gradient that vanishes at the
    initialisation); NaN at the same places in both counts as equal; a NaN or Inf in one only is an
    infinite error."""
    if a is None or b is None:
        same = a is None and b is None
        return _uniform(0.0 if same else math.inf, note=None if same else "None on one side")
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    if a.shape != b.shape:
        return _uniform(math.inf, note=f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return _uniform(0.0)
    both_nan = torch.isnan(a) & torch.isnan(b)
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    d = (a - b).abs().masked_fill(both_nan | same_inf, 0.0)
    d = d.nan_to_num(nan=math.inf)
    finite_b = b.masked_fill(~torch.isfinite(b), 0.0)
    scale = float(finite_b.abs().max())
    max_abs = float(d.max())
    max_rel = float((d / finite_b.abs().clamp_min(max(scale * 1e-3, 1e-300))).max())
    denom = max(scale, floor)
    norm = max_abs / denom if denom > 0 else (0.0 if max_abs == 0 else math.inf)
    out = {"max_abs": max_abs, "max_rel": max_rel, "norm": norm}
    if bool(both_nan.any()):
        out["note"] = "NaN in both"
    return out


def worst(errs: dict) -> tuple[str | None, float]:
    """The key with the largest ``norm`` of a ``{name: err}`` dict."""
    if not errs:
        return None, 0.0
    key = max(errs, key=lambda k: errs[k]["norm"] if not math.isnan(errs[k]["norm"]) else math.inf)
    return key, errs[key]["norm"]


def compare_results(dev: dict, ref: dict) -> dict:
    """Per quantity of two results ``{"y", "terms", "grads"}`` (:func:`.layers.layer_pass`):
    ``{"y": err, "terms": {..}, "grads": {..}}``."""
    out = {"y": err(dev["y"], ref["y"])}
    out["term_keys"] = [sorted(dev["terms"]), sorted(ref["terms"])]
    out["terms"] = {
        k: err(dev["terms"].get(k), ref["terms"].get(k)) for k in sorted(set(dev["terms"]) | set(ref["terms"]))
    }
    out["grads"] = grad_errs(dev["grads"], ref["grads"])
    return out


def grad_errs(dev: dict, ref: dict) -> dict:
    """``{name: err}`` of two gradient dicts. A gradient below 1e-6 of the largest one counts as zero (a
    map initialised at zero, BERT's key bias under softmax): else its normalised error would be round-off
    over round-off."""
    scales = [float(g.detach().abs().max()) for g in ref.values() if g is not None and g.numel()]
    floor = 1e-6 * max(scales, default=0.0)
    return {k: err(dev.get(k), ref.get(k), floor) for k in sorted(set(dev) | set(ref))}


def quantities(cmp: dict) -> dict:
    """Flatten a :func:`compare_results` dict to ``{"y": norm, "term:kl_seq": norm, "grad:x": norm, ...}``."""
    flat = {"y": cmp["y"]["norm"]}
    flat.update({f"term:{k}": v["norm"] for k, v in cmp["terms"].items()})
    flat.update({f"grad:{k}": v["norm"] for k, v in cmp["grads"].items()})
    return flat


def judge(dev_vs_ref: dict, tol: dict | float, stochastic: set) -> tuple[bool, list]:
    """Whether every non-stochastic quantity's normalised error is within its tolerance; the offenders."""
    bad = []
    for key, norm in quantities(dev_vs_ref).items():
        if key in stochastic:
            continue
        allowed = tol if isinstance(tol, float) else tol.get(key, TOL_F32_FLOOR)
        if not (norm <= allowed):
            bad.append({"quantity": key, "norm": norm, "allowed": allowed})
    return not bad, bad


def stochastic_quantities(a: dict, b: dict) -> set:
    """Quantities that differ between two CPU passes with different seeds under deterministic(): random
    even there (e.g. cgp's prior-sample regulariser), so not comparable across devices."""
    return {k for k, v in quantities(compare_results(a, b)).items() if v != 0.0}


def f32_tolerance(yard: dict) -> dict:
    """Per quantity: ``TOL_F32_FACTOR`` x the CPU's own float32-vs-float64 error ``yard``, at least the floor."""
    return {k: max(TOL_F32_FLOOR, TOL_F32_FACTOR * v) for k, v in quantities(yard).items()}


def summarise(label: str, cmp: dict, stochastic: set) -> str:
    """``label y <norm> terms <worst> grad <worst>`` of a :func:`compare_results` dict."""
    q = {k: v for k, v in quantities(cmp).items() if k not in stochastic}
    grads = {k: v for k, v in q.items() if k.startswith("grad:")}
    terms = {k: v for k, v in q.items() if k.startswith("term:")}
    _, gv = worst({k: {"norm": v} for k, v in grads.items()})
    s = f"{label} y {fmt(q.get('y'))}"
    if terms:
        s += f" terms {fmt(max(terms.values()))}"
    if grads:
        s += f" grad {fmt(gv)}"
    return s


def devices_of(result: dict) -> set:
    """The devices of a result's output, loss terms and gradients."""
    devs = {str(result["y"].device)}
    devs |= {str(v.device) for v in result["terms"].values()}
    devs |= {str(v.device) for v in result["grads"].values() if v is not None}
    return devs


def cuda_index(device) -> int:
    """The GPU index of ``cuda`` / ``cuda:N`` (``cuda``: the current one)."""
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def same_device(found, device) -> bool:
    """Whether a tensor's device (a ``torch.device`` or its string) is ``device`` (``cuda`` = the current GPU)."""
    found, want = torch.device(found), torch.device(device)
    if found.type != want.type:
        return False
    if want.type == "cuda":
        return found.index == cuda_index(want)
    return True


def placement(module, device) -> dict:
    """Parameters, buffers and plain tensor attributes (which ``.to()`` does not move) not on ``device``."""

    def on(t):
        return same_device(t.device, device)

    params = [n for n, p in module.named_parameters() if not on(p)]
    buffers = [n for n, b in module.named_buffers() if not on(b)]
    stray = []
    for mname, m in module.named_modules():
        for k, v in vars(m).items():
            if torch.is_tensor(v) and not on(v):
                stray.append(f"{mname or '<root>'}.{k} ({v.device}, {tuple(v.shape)})")
    return {"params_off_device": params, "buffers_off_device": buffers, "plain_tensor_attrs_off_device": stray}


def off_device(pl: dict) -> bool:
    """Whether a :func:`placement` found parameters or buffers elsewhere."""
    return bool(pl["params_off_device"] or pl["buffers_off_device"])
