"""End-to-end check of gpattn's CUDA paths on one GPU, against the same work on the CPU.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out gpu_check_out            # on a CUDA machine
    PYTHONPATH=. OMP_NUM_THREADS=1 python3 benchmarks/gpu_check.py --device cpu --out /tmp/gc   # dry run

Checks (each runs in its own child process with its own time limit, so a hang, a crash or a sticky CUDA
error in one is recorded and the others still run; inside a check every item is wrapped the same way):

``layers``  every registered variant (``gpattn.list_attention()``, plus the non-default ``covariance``
    values, ``cgp[prior_samples=None]``, whose regulariser draws nothing, and sgpa / kernel with the image
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
import contextlib
import copy
import io
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHECKS = ("layers", "train", "hf", "timing")
#: wall-clock limit per check in seconds on a GPU; on the CPU these are multiplied by ``CPU_SLOWDOWN``
LIMITS = {"layers": 75, "train": 110, "hf": 60, "timing": 80}
CPU_SLOWDOWN = 3.0
#: the whole run's budget on a GPU (seconds): a check never gets more than what is left of it
TOTAL_BUDGET = 290
#: normalised error (max |a - b| / max |b|) allowed between the device and the CPU in float64
TOL_F64 = 1e-6
#: float32: allowed = max(TOL_F32_FLOOR, TOL_F32_FACTOR x the CPU's own float32-vs-float64 error)
TOL_F32_FACTOR = 20.0
TOL_F32_FLOOR = 1e-4
#: used where no float64 yardstick exists
TOL_F32_FIXED = 2e-3


class Skip(Exception):
    """An item that cannot run here (a missing package, the check's budget spent): status ``skip``."""


# ============================================================================= small helpers
def _now() -> float:
    return time.monotonic()


def _jsonable(obj):
    """Plain JSON data from nested dicts/lists of numbers, strings, tensors and devices."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    try:
        import torch

        if torch.is_tensor(obj):
            return _jsonable(obj.detach().cpu().tolist())
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=1))
    os.replace(tmp, path)


def _fmt(v, spec=".1e") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _tail(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _versions() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    import importlib

    for mod in (
        "torch",
        "gpytorch",
        "linear_operator",
        "numpy",
        "transformers",
        "tokenizers",
        "safetensors",
        "sklearn",
        "scipy",
        "tqdm",
        "matplotlib",
    ):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - anything an import may raise is a "missing"
            out[mod] = f"missing ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    try:
        out["git"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        out["git_dirty_files"] = len(dirty.stdout.splitlines()) if dirty.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no git on the machine, or no .git in the copy
        out["git"] = None
    return out


def _device_info(device: str) -> dict:
    import torch

    info = {"device": device, "cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            info["float32_matmul_precision"] = torch.get_float32_matmul_precision()
            info["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
            info["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
        except Exception as exc:  # noqa: BLE001
            info["tf32_flags"] = f"unreadable: {exc}"
    if torch.cuda.is_available() and device.startswith("cuda"):
        d = torch.device(device)
        idx = d.index if d.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            device_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    info["threads"] = torch.get_num_threads()
    return info


class Recorder:
    """A check's items, rewritten to ``OUT/<check>.json`` after every item (what a timeout leaves stays)."""

    def __init__(self, out: Path, check: str, device: str, limit: float):
        self.path = out / f"{check}.json"
        self.start = _now()
        self.deadline = self.start + 0.88 * limit - 3.0  # leave time to write and exit
        self.data = {"check": check, "device": device, "limit_s": limit, "items": [], "done": False}
        self.flush()

    def left(self) -> float:
        return self.deadline - _now()

    def flush(self) -> None:
        self.data["elapsed_s"] = round(_now() - self.start, 2)
        _write_json(self.path, self.data)

    def item(self, name: str, fn, *, need_s: float = 0.0):
        """Run ``fn() -> dict`` as the item ``name``: its dict (with ``status``: pass unless it says
        otherwise), or ``skip`` / ``error`` with the reason. Prints one line."""
        t0 = _now()
        rec = {"name": name}
        if self.left() < need_s:
            rec.update(status="skip", reason=f"the check's time budget is spent ({self.left():.0f} s left)")
        else:
            try:
                res = fn() or {}
                _sync_all()
                rec.update(res)
                rec.setdefault("status", "pass")
            except Skip as exc:
                rec.update(status="skip", reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - every failure is recorded, the next item still runs
                rec.update(
                    status="error",
                    reason=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}",
                    traceback=_tail(traceback.format_exc(), 25),
                )
        rec["wall_s"] = round(_now() - t0, 2)
        self.data["items"].append(rec)
        self.flush()
        short = rec.get("summary") or rec.get("reason") or ""
        print(f"[{_now() - self.start:6.1f} s] {rec['status'].upper():5} {name}: {short}", flush=True)
        return rec

    def finish(self) -> None:
        self.data["done"] = True
        self.flush()


def _sync_all() -> None:
    """Surface asynchronous CUDA errors inside the item that caused them."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- comparisons
def _err(a, b, floor: float = 0.0) -> dict:
    """Differences of ``a`` (device) against ``b`` (reference), in float64 on the CPU: ``max_abs``,
    ``max_rel`` (elementwise, denominators floored at 1e-3 max|b|), ``norm`` = max_abs / max(max|b|, floor)
    (``floor``: the scale below which a quantity counts as zero, e.g. a gradient that vanishes at the
    initialisation); NaN at the same places in both counts as equal; a NaN or Inf in one only is an
    infinite error."""
    import torch

    if a is None or b is None:
        same = a is None and b is None
        return {
            "max_abs": 0.0 if same else math.inf,
            "max_rel": 0.0 if same else math.inf,
            "norm": 0.0 if same else math.inf,
            "note": None if same else "None on one side",
        }
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    if a.shape != b.shape:
        return {
            "max_abs": math.inf,
            "max_rel": math.inf,
            "norm": math.inf,
            "note": f"shape {tuple(a.shape)} vs {tuple(b.shape)}",
        }
    if a.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "norm": 0.0}
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


def _worst(errs: dict) -> tuple[str | None, float]:
    """The key with the largest ``norm`` of a ``{name: err}`` dict."""
    if not errs:
        return None, 0.0
    key = max(errs, key=lambda k: errs[k]["norm"] if not math.isnan(errs[k]["norm"]) else math.inf)
    return key, errs[key]["norm"]


def _compare_results(dev: dict, ref: dict) -> dict:
    """Per quantity of two :func:`_layer_pass`-style results: ``{"y": err, "terms": {..}, "grads": {..}}``."""
    out = {"y": _err(dev["y"], ref["y"])}
    out["term_keys"] = [sorted(dev["terms"]), sorted(ref["terms"])]
    out["terms"] = {
        k: _err(dev["terms"].get(k), ref["terms"].get(k)) for k in sorted(set(dev["terms"]) | set(ref["terms"]))
    }
    out["grads"] = _grad_errs(dev["grads"], ref["grads"])
    return out


def _grad_errs(dev: dict, ref: dict) -> dict:
    """``{name: err}`` of two gradient dicts. A gradient below 1e-6 of the largest one counts as zero (a
    map initialised at zero, BERT's key bias under softmax): else its normalised error would be round-off
    over round-off."""
    scales = [float(g.detach().abs().max()) for g in ref.values() if g is not None and g.numel()]
    floor = 1e-6 * max(scales, default=0.0)
    return {k: _err(dev.get(k), ref.get(k), floor) for k in sorted(set(dev) | set(ref))}


def _quantities(cmp: dict) -> dict:
    """Flatten a :func:`_compare_results` dict to ``{"y": norm, "term:kl_seq": norm, "grad:x": norm, ...}``."""
    flat = {"y": cmp["y"]["norm"]}
    flat.update({f"term:{k}": v["norm"] for k, v in cmp["terms"].items()})
    flat.update({f"grad:{k}": v["norm"] for k, v in cmp["grads"].items()})
    return flat


def _judge(dev_vs_ref: dict, tol: dict | float, stochastic: set) -> tuple[bool, list]:
    """Whether every non-stochastic quantity's normalised error is within its tolerance; the offenders."""
    bad = []
    for key, norm in _quantities(dev_vs_ref).items():
        if key in stochastic:
            continue
        allowed = tol if isinstance(tol, float) else tol.get(key, TOL_F32_FLOOR)
        if not (norm <= allowed):
            bad.append({"quantity": key, "norm": norm, "allowed": allowed})
    return not bad, bad


def _devices_of(result: dict) -> set:
    devs = {str(result["y"].device)}
    devs |= {str(v.device) for v in result["terms"].values()}
    devs |= {str(v.device) for v in result["grads"].values() if v is not None}
    return devs


def _cuda_index(device) -> int:
    """The GPU index of ``cuda`` / ``cuda:N`` (``cuda``: the current one)."""
    import torch

    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


def _same_device(found, device) -> bool:
    """Whether a tensor's device (a ``torch.device`` or its string) is ``device`` (``cuda`` = the current GPU)."""
    import torch

    found, want = torch.device(found), torch.device(device)
    if found.type != want.type:
        return False
    if want.type == "cuda":
        return found.index == _cuda_index(want)
    return True


def _placement(module, device) -> dict:
    """Parameters, buffers and plain tensor attributes (which ``.to()`` does not move) not on ``device``."""
    import torch

    def on(t):
        return _same_device(t.device, device)

    params = [n for n, p in module.named_parameters() if not on(p)]
    buffers = [n for n, b in module.named_buffers() if not on(b)]
    stray = []
    for mname, m in module.named_modules():
        for k, v in vars(m).items():
            if torch.is_tensor(v) and not on(v):
                stray.append(f"{mname or '<root>'}.{k} ({v.device}, {tuple(v.shape)})")
    return {"params_off_device": params, "buffers_off_device": buffers, "plain_tensor_attrs_off_device": stray}


# ----------------------------------------------------------------------------- host-device synchronisations
@contextlib.contextmanager
def _fd2_to(fh):
    """The process's file descriptor 2 (C++ warnings from non-Python threads) into ``fh``."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fh.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


SYNC_MESSAGE = "called a synchronizing cuda operation"


def _frame(f) -> str:
    return f"{_short_path(f.filename)}:{f.lineno} ({f.name})"


def _sync_events(fn, device, forward=None) -> dict:
    """Run ``fn()`` under ``torch.cuda.set_sync_debug_mode("warn")`` and collect every synchronising CUDA call:
    ``where`` = the last gpattn line on the Python stack, ``op`` = the innermost Python line (the call that
    synchronised; inside torch / gpytorch / linear_operator when gpattn calls them). Synchronisations in
    autograd's device threads (the backward) have no Python stack of their own: they are counted under
    ``backward``, and with ``forward`` (a callable returning a loss) located by a second pass that runs the
    backward in sync debug mode "error" under anomaly detection (the forward line of the first node that
    synchronises). Not on the CPU."""
    import torch

    if torch.device(device).type != "cuda":
        return {"checked": False, "reason": "CPU device: no host-device synchronisation to watch"}
    events = []
    original = warnings.showwarning
    this_file = str(Path(__file__).resolve())

    def hook(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if SYNC_MESSAGE not in text.lower():
            if "synchroniz" in text.lower():  # e.g. "sync debug mode is a prototype feature": not an event
                return None
            return original(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        ours = [f for f in stack if "/gpattn/" in f.filename.replace("\\", "/") and this_file != f.filename]
        inner = stack[-1] if stack else None
        if inner is not None and inner.filename == this_file:
            where, op = "backward (autograd thread)", "backward"
        else:
            where = _frame(ours[-1]) if ours else f"{_short_path(filename)}:{lineno}"
            op = _frame(inner) if inner is not None else where
        events.append({"where": where, "op": op})

    with tempfile.TemporaryFile(mode="w+b") as fh, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with _fd2_to(fh):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        fh.seek(0)
        native = [ln for ln in fh.read().decode(errors="replace").splitlines() if SYNC_MESSAGE in ln.lower()]
    where, ops = {}, {}
    for e in events:
        where[e["where"]] = where.get(e["where"], 0) + 1
        ops[e["op"]] = ops.get(e["op"], 0) + 1
    out = {
        "checked": True,
        "count": len(events) + len(native),
        "by_location": dict(sorted(where.items(), key=lambda kv: -kv[1])),
        "by_op": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "native_thread_lines": native[:5],
    }
    if forward is not None and ("backward (autograd thread)" in where or native):
        try:
            out["backward_first_sync"] = _first_backward_sync(forward)
        except Exception as exc:  # noqa: BLE001 - the locator is a best effort
            out["backward_first_sync"] = f"not located ({type(exc).__name__}: {str(exc)[:120]})"
    return out


def _first_backward_sync(forward) -> str:
    """The forward line (anomaly detection's trace) of the first backward node that synchronises."""
    import torch

    this_file = str(Path(__file__).resolve())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=False):
            loss = forward()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
                return "no synchronisation in this backward"
            except RuntimeError as exc:
                error = str(exc).splitlines()[0][:120]
            finally:
                torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        text = str(w.message)
        if "Traceback of forward call" not in text and "Error detected in" not in text:
            continue
        node = text.split("Error detected in", 1)[-1].split(".", 1)[0].strip() if "Error detected in" in text else "?"
        files = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File ")]
        ours = [ln for ln in files if "/gpattn/" in ln and this_file not in ln]
        site = ours[-1] if ours else (files[-1] if files else "no forward trace")
        return f"{node}: {_short_path(site)}"
    return f"raised {error!r} (no anomaly trace)"


def _short_path(path: str) -> str:
    p = path.replace("\\", "/")
    for marker in ("/gpattn/", "/site-packages/"):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + 1 :] if marker == "/gpattn/" else p[i + len(marker) :]
    return p


# ============================================================================= check: layers
def _layer_configs() -> list[tuple[str, str, dict]]:
    """(label, registry name, options): every variant at its defaults, every non-default ``covariance``,
    and cgp without the prior samples of its regulariser (the one random loss term under deterministic())."""
    import gpattn

    configs = []
    for name in gpattn.list_attention():
        configs.append((name, name, {}))
        valid = gpattn.attention_options(name)
        if "covariance" in valid:
            for value in ("full", "diag"):
                if value != valid["covariance"]:
                    configs.append((f"{name}[covariance={value}]", name, {"covariance": value}))
        if name == "cgp" and valid.get("prior_samples") is not None:
            configs.append(("cgp[prior_samples=None]", name, {"prior_samples": None}))
        if name in ("sgpa", "kernel") and valid.get("kernel") == "exponential":
            # the image models' kernel (gpattn.models.classifiers.IMAGE_KERNEL): a gpytorch kernel
            configs.append((f"{name}[kernel=ard-rbf]", name, {"kernel": "ard-rbf"}))
    return configs


def _inputs(B, T, D, pads, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(pads):
        if n:
            mask[i, T - n :] = True
    w = torch.randn(B, T, D, generator=g)
    return x, mask, w


def _layer_pass(layer, x, mask, w, device, seed: int, attn_mask=None) -> dict:
    """Training-mode forward under gpattn.deterministic() + backward of sum(y * w) + the loss terms."""
    import torch

    import gpattn

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


def _stochastic_quantities(a: dict, b: dict) -> set:
    """Quantities that differ between two CPU passes with different seeds under deterministic(): random
    even there (e.g. cgp's prior-sample regulariser), so not comparable across devices."""
    return {k for k, v in _quantities(_compare_results(a, b)).items() if v != 0.0}


def _f32_tolerance(yard: dict) -> dict:
    return {k: max(TOL_F32_FLOOR, TOL_F32_FACTOR * v) for k, v in _quantities(yard).items()}


def _summ_cmp(label: str, cmp: dict, stochastic: set) -> str:
    q = {k: v for k, v in _quantities(cmp).items() if k not in stochastic}
    grads = {k: v for k, v in q.items() if k.startswith("grad:")}
    terms = {k: v for k, v in q.items() if k.startswith("term:")}
    gk, gv = _worst({k: {"norm": v} for k, v in grads.items()})
    s = f"{label} y {_fmt(q.get('y'))}"
    if terms:
        s += f" terms {_fmt(max(terms.values()))}"
    if grads:
        s += f" grad {_fmt(gv)}"
    return s


def check_layers(rec: Recorder, device: str, args) -> None:
    import torch

    import gpattn

    on_cuda = torch.device(device).type == "cuda"
    configs = _layer_configs()
    if args.variants:
        wanted = set(args.variants.split(","))
        configs = [c for c in configs if c[0] in wanted or c[1] in wanted]
    D, H = 16, 2
    small = _inputs(3, 20, D, (0, 5, 12))
    large = _inputs(2, 160, D, (0, 37), seed=1)

    def one(label, name, options):
        res = {"variant": label, "options": options}
        failures, warns = [], []
        torch.manual_seed(0)
        base = gpattn.build_attention(name, D, H, **options)  # float32, on the CPU
        is_gp = bool(getattr(base, "is_gp", False))

        # ---- float64 and float32 passes, CPU reference vs device copy
        x, mask, w = small
        cpu64 = copy.deepcopy(base).double()
        r64 = _layer_pass(cpu64, x.double(), mask, w.double(), "cpu", 1)
        r64b = _layer_pass(cpu64, x.double(), mask, w.double(), "cpu", 2)
        stoch64 = _stochastic_quantities(r64, r64b)
        dev64 = copy.deepcopy(cpu64).to(device)
        res["placement"] = _placement(dev64, device)
        d64 = _layer_pass(dev64, x.double(), mask, w.double(), device, 1)
        c64 = _compare_results(d64, r64)
        ok, bad = _judge(c64, TOL_F64, stoch64)
        res["float64"] = {"compare": c64, "stochastic": sorted(stoch64), "bad": bad}
        if not ok:
            failures.append(f"float64 device vs CPU: {bad[:3]}")
        if c64["term_keys"][0] != c64["term_keys"][1]:
            failures.append(f"loss term names differ: {c64['term_keys']}")
        devs = _devices_of(d64)
        if not all(_same_device(d, device) for d in devs):
            failures.append(f"results on {sorted(devs)}, not only {device}")
        res["result_devices"] = sorted(devs)
        res["diagnostics_devices"] = d64["diag_devices"]
        if not all(_same_device(d, device) for d in d64["diag_devices"]):
            failures.append(f"diagnostics on {d64['diag_devices']}")

        cpu32 = copy.deepcopy(base)
        r32 = _layer_pass(cpu32, x, mask, w, "cpu", 1)
        r32b = _layer_pass(cpu32, x, mask, w, "cpu", 2)
        stoch32 = _stochastic_quantities(r32, r32b)
        d32 = _layer_pass(copy.deepcopy(base).to(device), x, mask, w, device, 1)
        yard = _compare_results(r32, r64)  # the CPU's own float32 error against float64
        c32 = _compare_results(d32, r32)
        tol32 = _f32_tolerance(yard)
        ok, bad = _judge(c32, tol32, stoch32)
        res["float32"] = {"compare": c32, "cpu_f32_vs_f64": yard, "stochastic": sorted(stoch32), "bad": bad}
        if not ok:
            failures.append(f"float32 device vs CPU beyond {TOL_F32_FACTOR:g}x the CPU's float32 error: {bad[:3]}")
        for k, v in _quantities(c32).items():  # recorded, not failed: the CPU's own float32 error, for scale
            if k not in stoch32 and v > 1e-2:
                warns.append(f"float32 {k} differs by {v:.1e} (normalised)")

        # ---- float64 at T = 160: factorisations above LADDER_MAX_SIZE keep their host check
        xl, ml, wl = large
        rl = _layer_pass(copy.deepcopy(cpu64), xl.double(), ml, wl.double(), "cpu", 1)
        dl = _layer_pass(copy.deepcopy(cpu64).to(device), xl.double(), ml, wl.double(), device, 1)
        cl = _compare_results(dl, rl)
        ok, bad = _judge(cl, TOL_F64, stoch64)
        res["float64_T160"] = {"compare": cl, "bad": bad}
        if not ok:
            failures.append(f"float64 T=160 device vs CPU: {bad[:3]}")

        # ---- a causal attn_mask (variants with per-query masks), float64
        if getattr(base, "per_query_masks", False):
            T = x.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool).triu(1)
            rc = _layer_pass(copy.deepcopy(cpu64), x.double(), mask, w.double(), "cpu", 1, attn_mask=causal)
            dc = _layer_pass(copy.deepcopy(cpu64).to(device), x.double(), mask, w.double(), device, 1, causal)
            cc = _compare_results(dc, rc)
            ok, bad = _judge(cc, TOL_F64, stoch64)
            res["float64_causal"] = {"compare": cc, "bad": bad}
            if not ok:
                failures.append(f"float64 causal attn_mask device vs CPU: {bad[:3]}")

        # ---- posterior (GP variants), float64, eval mode
        if is_gp:
            with torch.no_grad():
                pc = cpu64.eval().posterior(x.double(), mask)
                pd = dev64.eval().posterior(x.double().to(device), mask.to(device))
                post = {
                    "mean": _err(pd.mean, pc.mean),
                    "covariance": _err(pd.covariance_matrix, pc.covariance_matrix),
                    "devices": sorted({str(pd.mean.device), str(pd.covariance_matrix.device)}),
                }
                draw = pd.rsample(torch.Size([2]))
                post["rsample_finite"] = bool(torch.isfinite(draw).all())
                post["rsample_device"] = str(draw.device)
            res["posterior"] = post
            if max(post["mean"]["norm"], post["covariance"]["norm"]) > TOL_F64:
                failures.append(
                    f"posterior device vs CPU: mean {post['mean']['norm']:.1e}, cov {post['covariance']['norm']:.1e}"
                )
            if not post["rsample_finite"]:
                failures.append("posterior rsample not finite")

        # ---- sampling forward with num_samples (float32, train and eval)
        layer = copy.deepcopy(base).to(device)
        samp = {}
        for mode in ("train", "eval"):
            layer.train(mode == "train")
            torch.manual_seed(3)
            with torch.no_grad():
                y = layer(x.to(device), mask.to(device), num_samples=3)
            samp[mode] = {"shape": list(y.shape), "finite": bool(torch.isfinite(y).all()), "device": str(y.device)}
            if list(y.shape) != [3 * x.shape[0], *x.shape[1:]] or not samp[mode]["finite"]:
                failures.append(f"num_samples=3 ({mode}): shape {list(y.shape)}, finite {samp[mode]['finite']}")
        res["sampling"] = samp

        # ---- bf16 autocast forward + backward on the device
        layer = copy.deepcopy(base).to(device).train()
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
        res["bf16_autocast"] = bf
        if not (bf["output_finite"] and bf["grads_finite"] and all(t["finite"] for t in bf["terms"].values())):
            failures.append(f"bf16 autocast: non-finite values {bf}")
        if any(t["dtype"] != "torch.float32" for t in bf["terms"].values()):
            warns.append(f"bf16 autocast: loss terms not float32: {bf['terms']}")

        # ---- host-device synchronisations of one float32 forward + backward (after a warm-up)
        layer = copy.deepcopy(base).to(device)
        xs, ms, ws = (t.to(device) for t in small)

        def forward():
            layer.train()
            for p in layer.parameters():
                p.grad = None
            yy = layer(xs, ms)
            loss = (yy * ws).sum()
            for v in layer.loss_terms().values():
                loss = loss + v
            return loss

        def step():
            forward().backward()

        step()
        sync = _sync_events(step, device, forward)
        res["sync"] = sync
        if sync.get("count"):
            warns.append(
                f"{sync['count']} host-device synchronisation(s) in one forward+backward: "
                f"{list(sync['by_location'])[:3]}"
            )

        pl = res["placement"]
        if pl["params_off_device"] or pl["buffers_off_device"]:
            failures.append(
                f"parameters/buffers not on {device}: {pl['params_off_device'][:3]} {pl['buffers_off_device'][:3]}"
            )
        if pl["plain_tensor_attrs_off_device"]:
            warns.append(f"plain tensor attributes left on the host: {pl['plain_tensor_attrs_off_device'][:3]}")

        stoch = stoch64 | stoch32
        summary = " | ".join(
            [
                _summ_cmp("f64", c64, stoch64),
                _summ_cmp("f32", c32, stoch32)
                + f" (cpu f32 err {_fmt(max(v for k, v in _quantities(yard).items() if k not in stoch32))})",
                _summ_cmp("f64 T160", cl, stoch64),
            ]
            + ([_summ_cmp("f64 causal", res["float64_causal"]["compare"], stoch64)] if "float64_causal" in res else [])
        )
        if stoch:
            summary += f" | seed-dependent under deterministic(): {sorted(stoch)[:3]}{'...' if len(stoch) > 3 else ''}"
        if on_cuda:
            summary += f" | syncs {sync.get('count', 0)}"
        res["failures"], res["warnings"] = failures, warns
        res["status"] = "fail" if failures else "warn" if warns else "pass"
        res["summary"] = summary + (f" | FAIL: {failures[0][:200]}" if failures else "")
        return res

    for label, name, options in configs:
        rec.item(label, lambda label=label, name=name, options=options: one(label, name, options), need_s=5)


# ============================================================================= check: train
def _require(*modules):
    import importlib

    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001
            raise Skip(f"{mod} is not importable here ({type(exc).__name__}: {exc})") from None


def _cli(argv: list, log: Path) -> tuple[int, str]:
    """``gpattn <argv>`` in this process, its output appended to ``log``; (exit code, output tail)."""
    from gpattn.experiments.cli import main as cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rc = cli_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - the CLI should turn errors into exit codes; record if it does not
            buf.write(traceback.format_exc())
            rc = 99
    text = buf.getvalue()
    with open(log, "a") as fh:
        fh.write(f"\n$ gpattn {' '.join(argv)}\n{text}\n[exit {rc}]\n")
    return int(rc or 0), _tail(text, 8)


KEY_METRICS = {
    "in_domain": ("accuracy", "nll", "ece", "mcc"),
    "shift": ("accuracy", "nll", "ece"),
    "ood": ("ood_auroc",),
}


def _metrics_subset(path: Path) -> dict:
    m = json.loads(path.read_text())
    return {s: {k: m.get(s, {}).get(k) for k in ks} for s, ks in KEY_METRICS.items() if s in m}


def _finite_metrics(sub: dict) -> bool:
    vals = [v for s in sub.values() for v in s.values()]
    return bool(vals) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals)


def check_train(rec: Recorder, device: str, args) -> None:
    import torch

    out = Path(args.out) / "runs"
    out.mkdir(parents=True, exist_ok=True)
    log = Path(args.out) / "logs" / "train_cli.log"
    common = [
        "--dataset",
        "digits",
        "--no-progress",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--embed-dim",
        "32",
        "--num-heads",
        "2",
        "--num-layers",
        "1",
        "--num-samples",
        "4",
        "--lr",
        "3e-3",
        "--seed",
        "0",
    ]
    runs = {}

    def train_run(attention, dev, precision, extra=()):
        _require("sklearn", "scipy", "tqdm", "gpattn.experiments.training")
        tag = "".join(f"-{e.strip('-')}" for e in extra)
        folder = out / f"{attention}-{precision}{tag}-{dev.replace(':', '')}"
        argv = ["train", *common, "--attention", attention, "--device", dev, "--precision", precision, *extra]
        argv += ["--out", str(folder)]
        t0 = _now()
        rc, tail = _cli(argv, log)
        wall = _now() - t0
        res = {"rc": rc, "train_wall_s": round(wall, 1), "folder": str(folder)}
        if rc != 0:
            return {**res, "status": "fail", "summary": f"exit {rc}: {tail[-300:]}"}
        sub = _metrics_subset(folder / "metrics.json")
        hist = json.loads((folder / "history.json").read_text())
        cfg = json.loads((folder / "config.json").read_text())
        res.update(
            metrics=sub,
            last_epoch=hist[-1] if hist else None,
            config_device=cfg.get("device"),
            config_precision=cfg.get("precision"),
        )
        if not extra:
            runs[(attention, dev, precision)] = res
        ok = _finite_metrics(sub) and 0 <= (sub["in_domain"]["accuracy"] or -1) <= 1
        ind = sub.get("in_domain", {})
        loss = (hist[-1].get("train") or {}).get("loss") if hist else None
        return {
            **res,
            "status": "pass" if ok else "fail",
            "summary": f"{wall:.0f} s; in_domain acc {_fmt(ind.get('accuracy'), '.3f')} "
            f"nll {_fmt(ind.get('nll'), '.3f')} ece {_fmt(ind.get('ece'), '.3f')}; train loss {_fmt(loss, '.3f')}",
        }

    specs = [("sgpa", device, "fp32"), ("softmax", device, "fp32"), ("sgpa", device, "bf16")]
    if device != "cpu":
        specs += [("sgpa", "cpu", "fp32"), ("softmax", "cpu", "fp32")]
    for attention, dev, precision in specs:
        rec.item(
            f"train {attention} {precision} on {dev}",
            lambda a=attention, d=dev, p=precision: train_run(a, d, p),
            need_s=10,
        )
    # value checks on: host reads of NaN inputs, labels, Cholesky failures with jitter escalation, per step
    rec.item(f"train sgpa fp32 --validate on {device}", lambda: train_run("sgpa", device, "fp32", ("--validate",)))

    def resume():
        """An interrupted run resumed on the device ends where the uninterrupted one does (CUDA RNG state)."""
        _require("sklearn", "scipy", "tqdm", "gpattn.experiments.training")
        from gpattn.experiments.data import load_dataset
        from gpattn.experiments.training import TrainConfig, train

        cfg = TrainConfig(dataset="digits", attention="sgpa", embed_dim=16, num_heads=2, num_layers=1, epochs=2,
                          batch_size=64, num_samples=2, progress=False, device=device)  # fmt: skip
        bundle = load_dataset("digits", seed=0)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            whole = train(cfg, out / "resume-whole", bundle=bundle)
            try:
                train(cfg, out / "resume-cut", bundle=bundle, stop_after_steps=5)
                raise AssertionError("stop_after_steps=5 did not interrupt the run")
            except KeyboardInterrupt:
                pass
            resumed = train(cfg, out / "resume-cut", resume=True, bundle=bundle)
        diffs = [
            abs(resumed[s][k] - whole[s][k])
            for s in whole
            if isinstance(whole[s], dict)
            for k in whole[s]
            if isinstance(whole[s].get(k), float) and isinstance(resumed.get(s, {}).get(k), float)
        ]
        worst = max(diffs, default=math.inf)
        status = "pass" if worst == 0.0 else "warn" if worst < 1e-5 else "fail"
        return {"max_abs_metric_diff": worst, "status": status,
                "summary": f"2 epochs, cut after 5 steps and resumed on {device}: max |Δmetric| {_fmt(worst)} "
                           f"(0 = bit-exact)"}  # fmt: skip

    rec.item(f"--resume on {device} (cut after 5 steps)", resume, need_s=10)

    def compare_runs():
        ref_dev = "cpu"
        rows, warns = {}, []
        for attention in ("sgpa", "softmax"):
            a, b = runs.get((attention, device, "fp32")), runs.get((attention, ref_dev, "fp32"))
            if a is None or b is None:
                continue
            d = {
                s: {
                    k: (
                        None
                        if a["metrics"][s][k] is None or b["metrics"][s][k] is None
                        else a["metrics"][s][k] - b["metrics"][s][k]
                    )
                    for k in a["metrics"][s]
                }
                for s in a["metrics"]
                if s in b["metrics"]
            }
            rows[attention] = d
            acc = d.get("in_domain", {}).get("accuracy")
            nll = d.get("in_domain", {}).get("nll")
            if acc is not None and (abs(acc) > 0.15 or abs(nll) > 0.5):
                warns.append(f"{attention}: {device} vs cpu differ by acc {acc:+.3f}, nll {nll:+.3f}")
        bf = runs.get(("sgpa", device, "bf16"))
        fp = runs.get(("sgpa", device, "fp32"))
        if bf and fp:
            rows["sgpa bf16 - fp32"] = {
                "in_domain": {
                    k: bf["metrics"]["in_domain"][k] - fp["metrics"]["in_domain"][k] for k in ("accuracy", "nll")
                }
            }
        if not rows:
            raise Skip("no pair of finished runs to compare")
        summ = "; ".join(
            f"{k}: Δacc {_fmt(v.get('in_domain', {}).get('accuracy'), '+.3f')} "
            f"Δnll {_fmt(v.get('in_domain', {}).get('nll'), '+.3f')}"
            for k, v in rows.items()
        )
        if device == "cpu":
            summ = "(device is cpu: each run is its own reference) " + summ
        return {"differences": rows, "warnings": warns, "status": "warn" if warns else "pass", "summary": summ}

    rec.item(f"metrics {device} vs cpu (rough)", compare_runs)

    def evaluate():
        run = runs.get(("softmax", device, "fp32"))
        if run is None:
            raise Skip("the softmax run did not finish")
        folder = Path(run["folder"])
        res, failures = {}, []
        for dev in dict.fromkeys([device, "cpu"]):
            eo = out / f"eval-softmax-{dev.replace(':', '')}"
            rc, tail = _cli(
                ["evaluate", "--checkpoint", str(folder / "checkpoint.pt"), "--device", dev, "--out", str(eo)], log
            )
            if rc != 0:
                failures.append(f"evaluate on {dev}: exit {rc}: {tail[-200:]}")
                continue
            sub = _metrics_subset(eo / "metrics.json")
            diff = {s: {k: abs(sub[s][k] - run["metrics"][s][k]) for k in sub[s] if sub[s][k] is not None} for s in sub}
            worst = max((v for s in diff.values() for v in s.values()), default=0.0)
            res[dev] = {"metrics": sub, "max_abs_diff_to_train_metrics": worst}
            # softmax in eval mode is deterministic: the same device reproduces the metrics; the CPU nearly
            if worst > (1e-6 if dev == device else 5e-3):
                failures.append(f"evaluate on {dev}: metrics differ from the run's by {worst:.1e}")
        res["failures"] = failures
        res["status"] = "fail" if failures else "pass"
        res["summary"] = "; ".join(
            f"on {d}: max |Δmetric| {_fmt(v['max_abs_diff_to_train_metrics'])}"
            for d, v in res.items()
            if isinstance(v, dict)
        ) + (f" | FAIL: {failures[0]}" if failures else "")
        return res

    rec.item("gpattn evaluate (device, cpu)", evaluate, need_s=5)

    def load_and_predict():
        import gpattn
        from gpattn.experiments.data import load_dataset

        run = runs.get(("sgpa", device, "fp32"))
        if run is None:
            raise Skip("the sgpa run did not finish")
        images = load_dataset("digits", seed=0).splits["test"].inputs[:96]
        res, failures = {}, []
        dev_run = gpattn.experiments.load_run(run["folder"], device=device)
        cpu_run = gpattn.experiments.load_run(run["folder"], device="cpu")
        res["placement"] = _placement(dev_run.model, device)
        if res["placement"]["params_off_device"] or res["placement"]["buffers_off_device"]:
            failures.append(f"load_run(device={device}) left tensors elsewhere: {res['placement']}")
        with gpattn.deterministic():
            pd = dev_run.predict(images, num_samples=2)
            pc = cpu_run.predict(images, num_samples=2)
        res["deterministic_probs_dev_vs_cpu"] = _err(pd.probs, pc.probs)
        res["labels_agree"] = sum(a == b for a, b in zip(pd.labels, pc.labels)) / len(pd.labels)
        if res["deterministic_probs_dev_vs_cpu"]["max_abs"] > 1e-3:
            failures.append(
                f"deterministic predict differs between {device} and cpu: {res['deterministic_probs_dev_vs_cpu']}"
            )
        torch.manual_seed(0)
        ps = dev_run.predict(images, num_samples=8)
        fin = all(bool(torch.isfinite(t).all()) for t in (ps.probs, ps.total_entropy, ps.mutual_information))
        sums = float((ps.probs.sum(1) - 1).abs().max())
        res.update(
            sampled={
                "finite": fin,
                "max_abs_probs_sum_minus_1": sums,
                "mean_mutual_information": float(ps.mutual_information.mean()),
            }
        )
        if not fin or sums > 1e-4:
            failures.append(f"sampled predict: finite {fin}, |sum p - 1| {sums:.1e}")
        preds = torch.load(Path(run["folder"]) / "predictions.pt", weights_only=True)
        res["predictions_pt_devices"] = sorted({str(v["logits"].device) for v in preds.values()})
        res["failures"] = failures
        res["status"] = "fail" if failures else "pass"
        res["summary"] = (
            f"deterministic probs {device} vs cpu max abs {_fmt(res['deterministic_probs_dev_vs_cpu']['max_abs'])}, "
            f"labels agree {res['labels_agree']:.3f}; sampled finite {fin}"
            + (f" | FAIL: {failures[0][:200]}" if failures else "")
        )
        return res

    rec.item("load_run + predict", load_and_predict, need_s=5)

    def _model_and_batch(attention):
        _require("sklearn", "scipy", "tqdm", "gpattn.experiments.training")
        from gpattn.experiments.data import load_dataset
        from gpattn.experiments.training import TrainConfig, build_model

        cfg = TrainConfig(
            dataset="digits",
            attention=attention,
            embed_dim=32,
            num_heads=2,
            num_layers=1,
            batch_size=32,
            num_samples=2,
            progress=False,
            device=device,
        )
        bundle = load_dataset("digits", seed=0)
        torch.manual_seed(0)
        return cfg, bundle, build_model(cfg, bundle)

    def train_step_sync():
        if torch.device(device).type != "cuda":
            raise Skip("CPU device: no host-device synchronisation to watch")
        from gpattn.experiments.diagnostics import EpochStats
        from gpattn.experiments.training import _Dist, _DivergenceGuard, _train_step
        from gpattn.objectives import DeepGPELBO

        res = {}
        for attention in ("sgpa", "softmax"):
            cfg, bundle, model = _model_and_batch(attention)
            model = model.to(device)
            split = bundle.splits["train"]
            dist = _Dist(device)
            objective = DeepGPELBO(model, len(split.labels), combine_terms=False)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
            guard, stats = _DivergenceGuard(model, dist.device), EpochStats()

            def step(
                i,
                model=model,
                objective=objective,
                optimizer=optimizer,
                guard=guard,
                stats=stats,
                split=split,
                dist=dist,
                cfg=cfg,
            ):
                idx = torch.arange(i * 32, (i + 1) * 32)
                _train_step(model, model, objective, optimizer, guard, stats, split, idx, i, cfg, dist)

            def forward(model=model, objective=objective, split=split):
                from gpattn.experiments.training import _batch

                model.train()
                x, mask, y = _batch(split, torch.arange(32), device)
                return objective(model(x, mask, num_samples=1), y, step=0)["loss"]

            step(0)
            step(1)
            res[attention] = _sync_events(lambda step=step: step(2), device, forward)
        counts = {k: v.get("count", 0) for k, v in res.items()}
        res["status"] = "warn" if any(counts.values()) else "pass"
        res["summary"] = "; ".join(
            f"{k}: {c} sync(s)" + (f" at {list(res[k]['by_location'])[:3]}" if c else "") for k, c in counts.items()
        )
        return res

    rec.item("training step: host-device synchronisations", train_step_sync, need_s=10)

    def ddp_world1():
        import socket

        import torch.distributed as tdist

        from gpattn.objectives import DeepGPELBO

        if not tdist.is_available():
            raise Skip("torch.distributed is not available")
        cfg, bundle, model = _model_and_batch("sgpa")
        split = bundle.splits["train"]
        x, y = split.inputs[:32].to(device), split.labels[:32].to(device)
        plain = model.to(device)
        wrapped_model = copy.deepcopy(plain)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        if backend == "nccl" and not tdist.is_nccl_available():
            raise Skip("NCCL is not available in this torch build")
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(_cuda_index(device))
        tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            ids = [_cuda_index(device)] if backend == "nccl" else None
            ddp = torch.nn.parallel.DistributedDataParallel(wrapped_model, device_ids=ids, static_graph=True)
            losses = {}
            for label, net, inner in (("plain", plain, plain), ("ddp", ddp, wrapped_model)):
                objective = DeepGPELBO(inner, len(split.labels), combine_terms=False)
                opt = torch.optim.Adam(inner.parameters(), lr=1e-3)
                torch.manual_seed(5)
                vals = []
                for _ in range(3):
                    opt.zero_grad()
                    parts = objective(net(x, None, num_samples=2), y)
                    parts["loss"].backward()
                    opt.step()
                    vals.append(parts["loss"].detach())
                losses[label] = torch.stack(vals)
            params = _err(
                torch.cat([p.detach().flatten() for p in wrapped_model.parameters()]),
                torch.cat([p.detach().flatten() for p in plain.parameters()]),
            )
        finally:
            tdist.destroy_process_group()
        le = _err(losses["ddp"], losses["plain"])
        ok = le["norm"] < 1e-4 and params["norm"] < 1e-4 and bool(torch.isfinite(losses["ddp"]).all())
        return {
            "backend": backend,
            "losses": losses,
            "loss_err": le,
            "param_err": params,
            "status": "pass" if ok else "fail",
            "summary": f"{backend}, 3 Adam steps: losses {_fmt(le['norm'])}, parameters {_fmt(params['norm'])} "
            f"(normalised, DDP vs plain)",
        }

    rec.item("DistributedDataParallel, world size 1", ddp_world1, need_s=10)


# ============================================================================= check: hf
def check_hf(rec: Recorder, device: str, args) -> None:
    import torch

    def need_transformers():
        _require("transformers")
        import transformers

        return transformers

    def tiny_config(transformers, impl="sdpa", **kw):
        """A tiny BERT config, 2 layers and 2 heads (default width 32, vocabulary 100, no dropout); ``kw``
        overrides any field."""
        fields = dict(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        return transformers.BertConfig(attn_implementation=impl, **{**fields, **kw})

    def batch(B=3, T=7):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 100, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, 4:] = 0
        mask[2, 2:] = 0
        return ids, mask

    def swap_step(attention, impl):
        transformers = need_transformers()
        import gpattn
        from gpattn.integrations.huggingface import swap_attention
        from gpattn.objectives import DeepGPELBO, named_added_loss_terms, summed_loss_terms

        torch.manual_seed(0)
        base = transformers.BertForSequenceClassification(tiny_config(transformers, impl, num_labels=2))
        swap_attention(base, attention, "all")
        ids, mask = batch()
        labels = torch.tensor([0, 1, 1])

        def step(model, dev):
            model.train()
            objective = DeepGPELBO(model, num_data=100, combine_terms=False)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)  # linear in the gradients, unlike Adam
            with gpattn.deterministic():
                torch.manual_seed(1)
                logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
                parts = objective(logits[:, None], labels.to(dev))
                terms = summed_loss_terms(model)
            parts["loss"].backward()
            grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            model.eval()
            with torch.no_grad(), gpattn.deterministic():
                ev = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
                ev_nomask = model(input_ids=ids.to(dev)).logits
            with torch.no_grad():
                torch.manual_seed(2)
                sampled = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
            return {
                "y": logits.detach(),
                "terms": {**{f"part:{k}": v.detach() for k, v in parts.items()}},
                "grads": grads,
                "after_step": {n: p.detach().clone() for n, p in model.named_parameters()},
                "eval": ev,
                "eval_nomask": ev_nomask,
                "sampled_finite": bool(torch.isfinite(sampled).all()),
                "term_names": sorted(terms),
                "added_loss_terms": len(list(named_added_loss_terms(model))),
            }

        ref = step(copy.deepcopy(base), "cpu")
        dev_model = copy.deepcopy(base).to(device)
        placement = _placement(dev_model, device)
        got = step(dev_model, device)
        ids_d, mask_d, labels_d = ids.to(device), mask.to(device), labels.to(device)

        def hf_forward():
            dev_model.train()
            with gpattn.deterministic():
                logits = dev_model(input_ids=ids_d, attention_mask=mask_d).logits
                return DeepGPELBO(dev_model, num_data=100, combine_terms=False)(logits[:, None], labels_d)["loss"]

        sync = _sync_events(lambda: hf_forward().backward(), device, hf_forward)  # recorded, not judged
        cmp = _compare_results(got, ref)
        cmp["after_step"] = {k: _err(got["after_step"][k], ref["after_step"][k]) for k in ref["after_step"]}
        cmp["eval"] = _err(got["eval"], ref["eval"])
        cmp["eval_nomask"] = _err(got["eval_nomask"], ref["eval_nomask"])
        try:  # the float32 yardstick: the CPU's own float32 error against float64
            ref64 = step(copy.deepcopy(base).double(), "cpu")
            yard = _compare_results(ref, ref64)
            tol = _f32_tolerance(yard)
            yard_max = max(_quantities(yard).values())
        except Exception as exc:  # noqa: BLE001 - a model that does not run in float64: fixed tolerance
            tol, yard_max = TOL_F32_FIXED, f"n/a ({type(exc).__name__})"
        ok, bad = _judge(cmp, tol, set())
        failures = [f"training step {device} vs cpu: {bad[:3]}"] if not ok else []
        k, worst_after = _worst(cmp["after_step"])
        ev_norm = max(cmp["eval"]["norm"], cmp["eval_nomask"]["norm"])
        loose = TOL_F32_FIXED if isinstance(yard_max, str) else max(TOL_F32_FLOOR, TOL_F32_FACTOR * 10 * yard_max)
        if worst_after > loose or ev_norm > loose:
            failures.append(f"after the SGD step / eval: parameters {worst_after:.1e} ({k}), eval logits {ev_norm:.1e}")
        if not got["sampled_finite"]:
            failures.append("sampled eval logits not finite")
        gp = bool(gpattn.attention.attention_class(attention).is_gp)
        if gp and (not got["term_names"] or not got["added_loss_terms"]):
            failures.append(f"loss terms not reachable from the outer model: {got['term_names']}")
        if placement["params_off_device"] or placement["buffers_off_device"]:
            failures.append(f"not on {device}: {placement}")
        gk, gv = _worst(cmp["grads"])
        return {
            "compare": cmp,
            "placement": placement,
            "term_names": got["term_names"],
            "cpu_f32_vs_f64": yard_max,
            "sync": sync,
            "failures": failures,
            "status": "fail" if failures else "pass",
            "summary": f"logits {_fmt(cmp['y']['norm'])}, parts {_fmt(_worst(cmp['terms'])[1])}, "
            f"grad {_fmt(gv)}, after SGD {_fmt(worst_after)}, eval {_fmt(ev_norm)} (cpu f32 err {_fmt(yard_max)}); "
            f"terms {got['term_names']}"
            + (f"; syncs {sync['count']}" if sync.get("checked") else "")
            + (f" | FAIL: {failures[0][:200]}" if failures else ""),
        }

    for attention, impl in (
        ("sgpa", "sdpa"),
        ("sgpa", "eager"),
        ("softmax", "sdpa"),
        ("softmax", "eager"),
        ("kernel", "sdpa"),
        ("sgpa-decoupled", "sdpa"),
        ("kep-svgp", "sdpa"),
    ):
        rec.item(f"BERT swap {attention} ({impl}) step", lambda a=attention, i=impl: swap_step(a, i), need_s=3)

    def bf16_step(attention):
        transformers = need_transformers()
        from gpattn.integrations.huggingface import swap_attention
        from gpattn.objectives import DeepGPELBO

        torch.manual_seed(0)
        model = transformers.BertForSequenceClassification(tiny_config(transformers, "sdpa", num_labels=2))
        swap_attention(model, attention, "all")
        model = model.to(device).train()
        ids, mask = (t.to(device) for t in batch())
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask).logits
            parts = DeepGPELBO(model, num_data=100, combine_terms=False)(
                logits.float()[:, None], torch.tensor([0, 1, 1], device=device)
            )
        parts["loss"].backward()
        fin = {k: bool(torch.isfinite(v)) for k, v in parts.items()}
        grads = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        ok = all(fin.values()) and grads and bool(torch.isfinite(logits.float()).all())
        return {
            "parts_finite": fin,
            "grads_finite": grads,
            "logits_dtype": str(logits.dtype),
            "status": "pass" if ok else "fail",
            "summary": f"logits {logits.dtype}, loss parts finite {all(fin.values())}, gradients finite {grads}",
        }

    for attention in ("sgpa", "kep-svgp"):
        rec.item(f"BERT swap {attention} bf16 autocast step", lambda a=attention: bf16_step(a), need_s=3)

    def tiny_encoder(transformers, vocab_size=50, max_position_embeddings=24, **dropouts):
        """A tiny random BERT (width 16, 2 layers, 2 heads), seeded; ``dropouts``: the config's dropout
        probabilities (default 0: deterministic forwards)."""
        config = tiny_config(
            transformers, vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
            max_position_embeddings=max_position_embeddings, **dropouts,
        )
        torch.manual_seed(0)
        return transformers.BertModel(config, add_pooling_layer=False)

    def classifier():
        transformers = need_transformers()
        import gpattn
        from gpattn.integrations.huggingface import HFClassifier
        from gpattn.objectives import DeepGPELBO

        ids = torch.tensor([[2, 5, 7, 9, 3], [2, 8, 3, 0, 0], [2, 4, 4, 6, 3]])
        pad = ids == 0
        y = torch.tensor([0, 1, 1])
        base = HFClassifier(tiny_encoder(transformers), 2, "sgpa", "last")
        out = {}
        for dev in ("cpu", device):
            model = copy.deepcopy(base).to(dev)
            rows = model.match_prior_to_stream(ids.to(dev), pad.to(dev))
            model.train()
            with gpattn.deterministic():
                logits = model(ids.to(dev), pad.to(dev), num_samples=3)
                parts = DeepGPELBO(model, num_data=30, combine_terms=False)(logits, y.to(dev))
            parts["loss"].backward()
            diag = model.layer_diagnostics()
            with torch.no_grad():
                torch.manual_seed(0)
                sampled = model.eval()(ids.to(dev), pad.to(dev), num_samples=3)
            out[dev] = {
                "rows": rows,
                "logits": logits.detach(),
                "parts": {k: v.detach() for k, v in parts.items()},
                "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                "diag_devices": sorted({str(v.device) for r in diag for v in r.values() if torch.is_tensor(v)}),
                "sampled_finite": bool(torch.isfinite(sampled).all()),
            }
        a, b = out[device], out["cpu"]
        factor = max(
            (abs(r1["factor"] - r2["factor"]) / abs(r2["factor"]) for r1, r2 in zip(a["rows"], b["rows"])), default=0.0
        )
        le = _err(a["logits"], b["logits"])
        pe = {k: _err(a["parts"][k], b["parts"][k]) for k in b["parts"]}
        ge = _grad_errs(a["grads"], b["grads"])
        gk, gv = _worst(ge)
        failures = []
        if factor > 1e-4 or le["norm"] > TOL_F32_FIXED or _worst(pe)[1] > TOL_F32_FIXED or gv > 1e-2:
            failures.append(
                f"{device} vs cpu: prior factor {factor:.1e}, logits {le['norm']:.1e}, "
                f"parts {_worst(pe)[1]:.1e}, grads {gv:.1e} ({gk})"
            )
        if not all(_same_device(d, device) for d in a["diag_devices"]):
            failures.append(f"layer_diagnostics on {a['diag_devices']}")
        if not a["sampled_finite"]:
            failures.append("sampled logits not finite")
        return {
            "prior_scale_rows": {"dev": a["rows"], "cpu": b["rows"]},
            "logits": le,
            "parts": pe,
            "grads": ge,
            "failures": failures,
            "status": "fail" if failures else "pass",
            "summary": f"prior factor rel {_fmt(factor)}, logits {_fmt(le['norm'])}, parts {_fmt(_worst(pe)[1])}, "
            f"grad {_fmt(gv)}; parts {sorted(b['parts'])}" + (f" | FAIL: {failures[0]}" if failures else ""),
        }

    rec.item("HFClassifier sgpa: match_prior_to_stream + step", classifier, need_s=3)

    def frozen_trunk():
        transformers = need_transformers()
        import gpattn
        from gpattn.integrations.huggingface import HFClassifier

        ids = torch.tensor([[2, 5, 7, 9, 3], [2, 8, 3, 0, 0], [2, 4, 4, 6, 3]]).to(device)
        pad = ids == 0
        model = HFClassifier(tiny_encoder(transformers), 2, "sgpa", "last", frozen_trunk=True).to(device).eval()
        h = model.trunk(ids, pad)
        with torch.no_grad(), gpattn.deterministic():
            a = model(h, pad, num_samples=2)
            b = model(ids, pad, num_samples=2)
        e = _err(a, b)
        ok = e["norm"] < 1e-5 and _same_device(h.device, device)
        return {
            "trunk_device": str(h.device),
            "err": e,
            "status": "pass" if ok else "fail",
            "summary": f"forward(trunk(ids)) vs forward(ids): {_fmt(e['norm'])}; trunk on {h.device}",
        }

    rec.item("HFClassifier frozen trunk on the device", frozen_trunk, need_s=3)

    def encoder_run(recipe):
        transformers = need_transformers()
        _require("tokenizers", "sklearn", "scipy", "tqdm", "gpattn.experiments.training")
        import csv

        import gpattn
        from gpattn.experiments.data._text import tokenize
        from gpattn.experiments.data.fixtures import make_text_table

        work = Path(args.out) / "runs" / "encoder"
        table = make_text_table(work / "data" / "train.tsv", n=60, seed=0)
        enc = work / "enc"
        if not (enc / "config.json").is_file():
            with open(table, encoding="utf-8") as f:
                words = sorted({w for row in csv.DictReader(f, delimiter="\t") for w in tokenize(row["text"])})
            vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
            enc.mkdir(parents=True, exist_ok=True)
            (enc / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
            transformers.BertTokenizerFast(vocab_file=str(enc / "vocab.txt")).save_pretrained(enc)
            tiny_encoder(  # BERT's default dropouts: the runs train with them
                transformers, len(vocab), 40, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1
            ).save_pretrained(enc)
        folder = work / f"run-{recipe}"
        argv = [
            "train",
            "--dataset",
            "text_table",
            "--dataset-option",
            f"path={table}",
            "--encoder",
            str(enc),
            "--encoder-recipe",
            recipe,
            "--attention",
            "sgpa",
            "--attention-layers",
            "last",
            "--max-len",
            "12",
            "--epochs",
            "1",
            "--batch-size",
            "16",
            "--num-samples",
            "2",
            "--no-progress",
            "--device",
            device,
            "--out",
            str(folder),
        ]
        rc, tail = _cli(argv, Path(args.out) / "logs" / "hf_cli.log")
        if rc != 0:
            return {"rc": rc, "status": "fail", "summary": f"exit {rc}: {tail[-300:]}"}
        sub = _metrics_subset(folder / "metrics.json")
        run = gpattn.experiments.load_run(folder, device=device)
        pl = _placement(run.model, device)
        pred = run.predict(["a great film , really good", "terrible"], num_samples=3)
        fin = bool(torch.isfinite(pred.probs).all())
        ok = fin and _finite_metrics(sub) and not pl["params_off_device"] and not pl["buffers_off_device"]
        return {
            "metrics": sub,
            "placement": pl,
            "probs": pred.probs,
            "status": "pass" if ok else "fail",
            "summary": f"in_domain acc {_fmt(sub.get('in_domain', {}).get('accuracy'), '.3f')}, "
            f"predict finite {fin}, model on {device}: {not pl['params_off_device']}",
        }

    for recipe in ("full", "frozen-trunk"):
        rec.item(f"gpattn train --encoder ({recipe}) + load_run.predict", lambda r=recipe: encoder_run(r), need_s=8)


# ============================================================================= check: timing
def check_timing(rec: Recorder, device: str, args) -> None:
    import torch

    on_cuda = torch.device(device).type == "cuda"
    ts = [int(t) for t in (args.timing_ts or ("128,512,2048" if on_cuda else "32,64")).split(",")]
    batch = args.timing_batch or (8 if on_cuda else 2)
    heads, head_dim = 4, 32
    sys.path.insert(0, str(HERE))
    try:
        import attention_scaling as AS
        from _common import variant_configs

        measure, source = AS.measure_case, "benchmarks/attention_scaling.py measure_case"
    except Exception as exc:  # noqa: BLE001 - fall back to a local measurement
        AS, measure, source = None, _measure_local, f"local fallback ({type(exc).__name__}: {exc})"
        variant_configs = None
    import gpattn

    if variant_configs is not None:
        configs = variant_configs()
    else:
        configs = [
            {"variant": n, "name": n, "options": {}}
            for n in ["softmax"] + [v for v in gpattn.list_attention() if v != "softmax"]
        ]
    if args.variants:
        wanted = set(args.variants.split(",")) | {"softmax"}
        configs = [c for c in configs if c["name"] in wanted or c["variant"] in wanted]
    rec.data["setup"] = {
        "T": ts,
        "B": batch,
        "H": heads,
        "Dh": head_dim,
        "D": heads * head_dim,
        "source": source,
        "configs": configs,
    }
    per_case_limit = 8.0 if on_cuda else 20.0
    profile = {"timeout": per_case_limit, "warmup": 2}
    rows = []

    def case(cfg, T, mode):
        row = {"variant": cfg["variant"], "name": cfg["name"], "T": T, "mode": mode}
        reason = None
        earlier = [r for r in rows if r["variant"] == cfg["variant"] and r["mode"] == mode and r["T"] < T]
        if any(r["status"] != "ok" for r in earlier):
            reason = "did not run at a smaller T"
        elif AS is not None:
            reason = AS._skip_reason(rows, cfg["variant"], mode, T, profile, None)
        if reason is None and rec.left() < 2.0:
            reason = "the timing budget is spent"
        if reason is not None:
            row.update(status="skipped", reason=reason)
            rows.append(row)
            return
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = _now()
        try:
            got = measure(
                name=cfg["name"],
                options=cfg["options"],
                T=T,
                mode=mode,
                batch=batch,
                heads=heads,
                head_dim=head_dim,
                warmup=2,
                min_reps=3,
                max_reps=20,
                budget=min(0.4, max(0.05, rec.left() / 200)),
                device=device,
            )
            row.update(status="ok", **got)
            if on_cuda:
                row["peak_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
        except torch.cuda.OutOfMemoryError as exc:
            row.update(status="skipped", reason=f"out of memory: {str(exc).splitlines()[0][:150]}")
        except Exception as exc:  # noqa: BLE001
            row.update(
                status="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            )
        row["case_wall_s"] = round(_now() - t0, 2)
        rows.append(row)
        if on_cuda:
            torch.cuda.empty_cache()
        rec.data["rows"] = rows  # kept if the check is stopped
        rec.flush()
        ms = f"{row['ms_median']:.2f} ms" if row["status"] == "ok" else f"{row['status']}: {row.get('reason')}"
        print(f"    {cfg['variant']:<32} T={T:<5} {mode:<8} {ms} ({row['case_wall_s']} s)", flush=True)

    def run_mode(mode):
        for T in ts:
            for cfg in configs:
                case(cfg, T, mode)
        if AS is not None:
            AS.add_ratios(rows)
        else:
            ref = {
                (r["T"], r["mode"]): r["ms_median"] for r in rows if r["variant"] == "softmax" and r["status"] == "ok"
            }
            for r in rows:
                base = ref.get((r["T"], r["mode"]))
                r["ratio_to_softmax"] = r["ms_median"] / base if r["status"] == "ok" and base else None
        sub = [r for r in rows if r["mode"] == mode]
        errors = [r for r in sub if r["status"] == "error"]
        skipped = [r for r in sub if r["status"] == "skipped"]
        big = {r["variant"]: r for r in sub if r["status"] == "ok"}  # the largest T each variant reached
        parts = [f"{v} T={r['T']} {_fmt(r.get('ratio_to_softmax'), '.1f')}x" for v, r in big.items() if v != "softmax"]
        summary = f"{len(sub) - len(errors) - len(skipped)} ok, {len(skipped)} skipped, {len(errors)} errors; " + (
            ", ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")
        )
        return {
            "rows": sub,
            "status": "fail" if errors else "pass",
            "summary": summary,
            "errors": [f"{r['variant']} T={r['T']}: {r['reason']}" for r in errors],
        }

    rec.item("fwd+bwd vs softmax", lambda: run_mode("fwd+bwd"), need_s=5)
    rec.item("forward vs softmax", lambda: run_mode("forward"), need_s=5)
    rec.data["table"] = _timing_table(rows, ts)


def _measure_local(name, options, T, mode, batch, heads, head_dim, warmup, min_reps, max_reps, budget, device):
    """Median ms of one call (forward: eval + no_grad; fwd+bwd: train, mean(y^2) + loss terms, backward)."""
    import statistics

    import torch

    import gpattn

    torch.manual_seed(0)
    D = heads * head_dim
    layer = gpattn.build_attention(name, D, heads, **options).to(device)
    x = torch.randn(batch, T, D, device=device)

    def call():
        if mode == "forward":
            layer.eval()
            with torch.no_grad():
                layer(x)
        else:
            layer.train()
            for p in layer.parameters():
                p.grad = None
            y = layer(x)
            loss = y.square().mean()
            for t in layer.loss_terms().values():
                loss = loss + t
            loss.backward()

    def timed():
        _sync_all()
        t0 = time.perf_counter()
        call()
        _sync_all()
        return time.perf_counter() - t0

    first = min(timed() for _ in range(max(1, warmup)))
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    reps = max(min_reps, min(max_reps, int(budget / max(first, 1e-6))))
    ms = [1e3 * timed() for _ in range(reps)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if torch.device(device).type == "cuda" else None
    return {"ms_median": statistics.median(ms), "ms_min": min(ms), "reps": reps, "peak_mb": peak}


def _timing_table(rows, ts) -> str:
    """attention_scaling.py's tables (one per mode) of this run's timing rows."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import attention_scaling

    return "\n".join(attention_scaling.ratio_tables(rows, ts, ("fwd+bwd", "forward")))


# ============================================================================= child and parent
CHECK_FUNCS = {"layers": check_layers, "train": check_train, "hf": check_hf, "timing": check_timing}


def child_main(args) -> int:
    out = Path(args.out)
    rec = Recorder(out, args.child, args.device, args.limit)
    try:
        import torch

        if args.device.startswith("cuda"):
            torch.cuda.set_device(_cuda_index(args.device))
        torch.manual_seed(0)
        CHECK_FUNCS[args.child](rec, args.device, args)
    except Exception as exc:  # noqa: BLE001 - setup failures of the whole check
        rec.data["setup_error"] = f"{type(exc).__name__}: {exc}"
        rec.data["traceback"] = _tail(traceback.format_exc(), 25)
        print(rec.data["traceback"], flush=True)
    rec.finish()
    return 0


def _status_of(data: dict | None, rc, timed_out: bool) -> tuple[str, str]:
    """A check's status from its items: fail > error > timeout > warn > pass; skip if nothing ran."""
    if data is None:
        return ("timeout" if timed_out else "error"), (
            "no result file" + (" (timed out)" if timed_out else f", exit {rc}")
        )
    items = data.get("items", [])
    counts = {}
    for it in items:
        counts[it["status"]] = counts.get(it["status"], 0) + 1
    text = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no item finished"
    if data.get("setup_error"):
        return "error", f"setup: {data['setup_error'][:200]}"
    if counts.get("fail"):
        return "fail", text
    if counts.get("error"):
        return "error", text
    if timed_out or not data.get("done"):
        return "timeout" if timed_out else "error", text + ("; timed out" if timed_out else f"; child exit {rc}")
    if counts.get("warn"):
        return "warn", text
    if items and all(it["status"] == "skip" for it in items):
        return "skip", text
    return "pass", text


def _run_child(check: str, args, limit: float) -> dict:
    out = Path(args.out)
    log = out / "logs" / f"{check}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        check,
        "--device",
        args.device,
        "--out",
        str(out),
        "--limit",
        str(limit),
    ]
    for flag in ("variants", "timing_ts", "timing_batch"):
        v = getattr(args, flag)
        if v:
            cmd += [f"--{flag.replace('_', '-')}", str(v)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = _now()
    timed_out = False
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own child's process group
            rc = proc.wait()
    wall = _now() - t0
    path = out / f"{check}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        data = None
    status, text = _status_of(data, rc, timed_out)
    log_tail = ""
    if status in ("error", "timeout"):
        with contextlib.suppress(OSError):
            log_tail = _tail(log.read_text(errors="replace"), 15)
    return {
        "check": check,
        "status": status,
        "counts": text,
        "rc": rc,
        "timed_out": timed_out,
        "wall_s": round(wall, 1),
        "limit_s": round(limit, 1),
        "data": data,
        "log": str(log),
        "log_tail": log_tail,
    }


def _markdown(report: dict) -> str:
    env, dev = report["versions"], report["device_info"]
    lines = [
        "# gpattn CUDA check",
        "",
        f"- device: `{report['device']}` {dev.get('name', '')} (capability {dev.get('capability', '-')}, "
        f"{dev.get('memory_gib', '-')} GiB); torch {env.get('torch')} (CUDA {dev.get('torch_cuda')}), "
        f"gpytorch {env.get('gpytorch')}, linear_operator {env.get('linear_operator')}, "
        f"transformers {env.get('transformers')}, python {env.get('python')}",
        f"- git {env.get('git')} ({env.get('git_dirty_files')} changed files); float32 matmul precision "
        f"{dev.get('float32_matmul_precision')}, TF32 matmul {dev.get('matmul_allow_tf32')}",
        f"- total wall {report['wall_s']:.0f} s; overall: **{report['overall']}**",
        "",
        "| check | status | items | wall s | limit s |",
        "|---|---|---|---:|---:|",
    ]
    for c in report["checks"]:
        lines.append(f"| {c['check']} | {c['status']} | {c['counts']} | {c['wall_s']} | {c['limit_s']} |")
    lines.append("")
    for c in report["checks"]:
        lines += [f"## {c['check']} — {c['status']}", ""]
        data = c.get("data") or {}
        if c.get("timed_out"):
            lines += [f"stopped at its {c['limit_s']} s limit; what finished is below; log: `{c.get('log')}`", ""]
        if data.get("setup_error"):
            lines += [f"setup error: `{data['setup_error']}`", ""]
        if c.get("log_tail"):
            lines += ["```", c["log_tail"], "```", ""]
        items = data.get("items", [])
        if items:
            lines += ["| item | status | s | summary |", "|---|---|---:|---|"]
            for it in items:
                text = (it.get("summary") or it.get("reason") or "").replace("|", "\\|").replace("\n", " ")
                lines.append(f"| {it['name']} | {it['status']} | {it.get('wall_s', '')} | {text[:400]} |")
            lines.append("")
        for it in items:
            if it["status"] in ("error",) and it.get("traceback"):
                lines += [
                    f"<details><summary>{it['name']}: traceback</summary>",
                    "",
                    "```",
                    it["traceback"],
                    "```",
                    "",
                    "</details>",
                    "",
                ]
        syncs = {}
        for it in items:
            for k, v in it.items():
                if isinstance(v, dict) and v.get("checked") and v.get("count"):
                    syncs[it["name"] if k == "sync" else f"{it['name']} / {k}"] = v
        if syncs:
            lines += ["Host-device synchronisations (last gpattn line: count; the synchronising call: count):", ""]
            for name, v in syncs.items():
                text = f"- {name}: " + ", ".join(f"`{loc}` ×{n}" for loc, n in v["by_location"].items())
                text += "; calls: " + ", ".join(f"`{op}` ×{n}" for op, n in v.get("by_op", {}).items())
                if v.get("backward_first_sync"):
                    text += f"; first in backward: `{v['backward_first_sync']}`"
                if v.get("native_thread_lines"):
                    text += f"; native: {v['native_thread_lines'][:2]}"
                lines.append(text)
            lines.append("")
        if data.get("table"):
            lines += [data["table"], ""]
        elif data.get("rows") and data.get("setup"):  # a timing check stopped part-way
            lines += ["(the cases measured before the check was stopped)", ""]
            lines += [_timing_table(data["rows"], data["setup"]["T"]), ""]
    return "\n".join(lines) + "\n"


def parent_main(args) -> int:
    t_start = _now()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu":
            print("gpu_check: no CUDA device here: running every check on the CPU (CPU vs CPU)", flush=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: --device {args.device} but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})",
            file=sys.stderr,
        )
        return 2
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        print(f"gpu_check: unknown check(s) {unknown}; valid: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    slow = 1.0 if args.device.startswith("cuda") else CPU_SLOWDOWN
    budget = args.budget if args.budget else TOTAL_BUDGET * slow
    report = {
        "device": args.device,
        "versions": _versions(),
        "device_info": _device_info(args.device),
        "argv": sys.argv[1:],
        "budget_s": budget,
        "checks": [],
    }
    dev = report["device_info"]
    print(
        f"gpu_check on {args.device} {dev.get('name', '')}: torch {report['versions']['torch']}, "
        f"gpytorch {report['versions']['gpytorch']}, checks {', '.join(checks)}, budget {budget:.0f} s",
        flush=True,
    )
    for check in checks:
        left = budget - (_now() - t_start)
        limit = min(LIMITS[check] * slow * args.time_scale, left)
        if limit < 15:
            report["checks"].append(
                {
                    "check": check,
                    "status": "skip",
                    "counts": "overall budget spent",
                    "wall_s": 0,
                    "limit_s": round(limit, 1),
                    "data": None,
                }
            )
            print(f"  {check:<7} SKIP (overall budget spent)", flush=True)
            continue
        print(f"  {check:<7} running (limit {limit:.0f} s; log {out / 'logs' / (check + '.log')})", flush=True)
        res = _run_child(check, args, limit)
        report["checks"].append(res)
        print(f"  {check:<7} {res['status'].upper():7} {res['wall_s']:6.1f} s  {res['counts']}", flush=True)
        for it in (res.get("data") or {}).get("items", []):
            if it["status"] in ("fail", "error"):
                print(
                    f"      {it['status'].upper()} {it['name']}: {(it.get('summary') or it.get('reason') or '')[:300]}"
                )
        if res.get("log_tail") and res["status"] in ("error", "timeout"):
            print("      log tail: " + res["log_tail"].replace("\n", "\n                "))
        _write_json(out / "gpu_check.json", {**report, "wall_s": _now() - t_start, "overall": "running"})
    statuses = [c["status"] for c in report["checks"]]
    failed = any(s in ("fail", "error", "timeout") for s in statuses)
    report["overall"] = "FAIL" if failed else "WARN" if "warn" in statuses else "PASS"
    report["wall_s"] = _now() - t_start
    _write_json(out / "gpu_check.json", report)
    (out / "gpu_check.md").write_text(_markdown(report))
    print(
        f"gpu_check: {report['overall']} in {report['wall_s']:.0f} s; {out / 'gpu_check.md'}, {out / 'gpu_check.json'}",
        flush=True,
    )
    return 1 if failed else 0


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
