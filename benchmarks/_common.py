"""Shared helpers of the benchmark scripts: which variants to run with which options, per-case
isolation (a forked child per measurement: clean peak-RSS numbers, crashes and out-of-memory kept out
of the parent), the machine description, and JSON output.

Benchmarks are not tests: nothing here asserts a time.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import statistics
import time
import traceback
from pathlib import Path

import torch

import gpattn
from gpattn.attention.registry import CHOICES
from gpattn.experiments._variants import split_variants

__all__ = [
    "BENCH_OPTIONS",
    "EXTRA_CONFIGS",
    "extra_values",
    "REFERENCE",
    "add_omp_wait_policy_argument",
    "default_mem_limit_mb",
    "machine_info",
    "median_ms",
    "mem_available_mb",
    "omp_env",
    "parse_variants",
    "reference_first",
    "rss_mb",
    "run_isolated",
    "variant_configs",
    "write_json",
    "write_outputs",
]

#: the reference every ratio divides by (docs/derivations.md §1)
REFERENCE = "softmax"

#: the benchmark sizes, keyed by every option name the variants may use for them (M = m = l = 16 global /
#: inducing inputs, r = 10 KEP rank, c = 2 H-STO centroids). A variant gets only the keys its
#: ``gpattn.attention_options(name)`` lists; the JSON records which ones each variant got.
BENCH_OPTIONS: dict[str, int] = {
    # M: decoupled SGPA global inducing inputs
    "num_global": 16,
    "num_inducing": 16,
    "M": 16,
    # m, l: SCGP inducing inputs (z_q | z_o and z_o | z_k)
    "m": 16,
    "l": 16,
    "num_inducing_q": 16,
    "num_inducing_o": 16,
    "num_inducing_k": 16,
    "num_inducing_keys": 16,
    # r: KEP-SVGP rank
    "rank": 10,
    "r": 10,
    # c: H-STO centroids
    "num_centroids": 2,
    "num_clusters": 2,
    "c": 2,
}

#: options that select a different algorithm: each of the variant's names for it in the registry
#: (:data:`gpattn.attention.registry.CHOICES`) other than its default is benchmarked as an extra configuration,
#: labelled ``name[option=value]``
EXTRA_CONFIGS: tuple[str, ...] = ("covariance",)


def extra_values(name: str, key: str) -> tuple:
    """The names ``key`` takes in variant ``name`` (the registry's), ``()`` where it has none."""
    return tuple(CHOICES.get(name, {}).get(key, ()))


def variant_configs(names=None) -> list[dict]:
    """``[{"variant": label, "name": registry name, "options": {...}}]`` for every registered variant
    (or the given names), the reference first. Raises ``ValueError`` on an unknown name."""
    registered = gpattn.list_attention()
    if names is None:
        names = registered
    unknown = sorted(set(names) - set(registered))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; registered: {', '.join(registered)}")
    names = [REFERENCE] + sorted(n for n in set(names) if n != REFERENCE)
    configs = []
    for name in names:
        valid = gpattn.attention_options(name)
        options = {k: v for k, v in BENCH_OPTIONS.items() if k in valid}
        # the algorithm-selecting options are spelled out, so every label says which one it ran
        options.update({k: valid[k] for k in EXTRA_CONFIGS if k in valid})
        configs.append({"variant": name, "name": name, "options": options})
        for key in EXTRA_CONFIGS:
            if key not in valid:
                continue
            for value in extra_values(name, key):
                if value != valid[key]:
                    configs.append(
                        {"variant": f"{name}[{key}={value}]", "name": name, "options": {**options, key: value}}
                    )
    return configs


def parse_variants(text: str | None) -> list[str] | None:
    """``"a,b"`` -> ``["a", "b"]``; ``None`` or ``"all"`` -> ``None`` (every registered variant)."""
    if text is None or text.strip() in ("", "all"):
        return None
    return split_variants(text)  # commas inside name[key=value,...] kept


def reference_first(text: str | None) -> list[str]:
    """The variants of ``text`` (:func:`parse_variants`; every registered one for None) with :data:`REFERENCE` first:
    the reference of every ratio, so that a run cut short still has it."""
    return [REFERENCE, *(v for v in parse_variants(text) or gpattn.list_attention() if v != REFERENCE)]


# ----------------------------------------------------------------------------- memory
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mb() -> float:
    """Current resident set size of this process in MiB (``ru_maxrss`` where /proc is missing)."""
    kb = _status_kb("VmRSS")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024.0


def _malloc_trim() -> None:
    """Give the C heap's free pages back to the system (glibc), so a baseline taken after warm-up
    calls does not hide memory that later calls reuse without growing the resident set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """High-water mark of the resident set since :meth:`reset` (Linux: ``clear_refs`` 5 resets
    ``VmHWM``; elsewhere ``ru_maxrss``, which may include memory touched before the reset).

    Call :meth:`reset` after a warm-up call: the pages of library code and one-off caches that the
    first call faults in are then in the baseline, and the freed heap is trimmed first."""

    def reset(self) -> float:
        self.exact = False
        gc.collect(0)  # the young generation only: a full pass over torch's objects costs ~0.2 s
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.exact = _status_kb("VmHWM") is not None
        except OSError:
            pass
        self.base = rss_mb()
        return self.base

    def peak_extra_mb(self) -> float:
        kb = _status_kb("VmHWM") if self.exact else None
        if kb is None:
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0.0, kb / 1024.0 - self.base)


class DevicePeak:
    """Peak extra memory of a measured region: resident memory on the CPU (:class:`PeakRSS`), the CUDA
    caching allocator's peak allocation on a GPU. Same interface (``reset``, ``peak_extra_mb``, ``exact``)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._rss = PeakRSS() if self.device.type == "cpu" else None
        self._base = 0

    @property
    def exact(self) -> bool:
        return True if self._rss is None else getattr(self._rss, "exact", False)

    def reset(self) -> None:
        if self._rss is not None:
            self._rss.reset()
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def peak_extra_mb(self) -> float:
        if self._rss is not None:
            return self._rss.peak_extra_mb()
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20


def synchronize(device) -> None:
    """Wait for the device's queued work (timings of GPU work end here); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, reps: int, device, warmup: int = 0) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``reps`` calls (after ``warmup`` untimed calls),
    each ended by :func:`synchronize`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def add_device_argument(parser) -> None:
    """The scripts' ``--device auto|cpu|cuda[:N]`` (default auto: CUDA when available)."""
    parser.add_argument(
        "--device", default="auto", metavar="auto|cpu|cuda[:N]",
        help="where to measure (default auto: CUDA when available); GPU memory is the allocator's peak",
    )


def _limit_address_space(extra_mb: float | None) -> None:
    """Cap this process's virtual memory at its current size + ``extra_mb`` (+ slack for thread
    arenas), so an allocation too large for the budget fails with an error instead of driving a shared
    machine out of memory."""
    if not extra_mb:
        return
    vm_kb = _status_kb("VmSize")
    if vm_kb is None:
        return
    limit = int((vm_kb / 1024.0 + extra_mb + 1024.0) * 2**20)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


# ----------------------------------------------------------------------------- isolation
_SERVER_STARTED: list[bool] = []


def _child(conn, fn, kwargs, threads, mem_limit_mb):
    try:
        torch.set_num_threads(threads)
        _limit_address_space(mem_limit_mb)
        result = {"status": "ok", **fn(**kwargs)}
    except MemoryError as exc:
        result = {"status": "skipped", "reason": f"out of memory under the {mem_limit_mb:.0f} MiB budget ({exc})"}
    except RuntimeError as exc:
        text = str(exc)
        if any(s in text.lower() for s in ("allocate", "out of memory", "bad_alloc")):
            result = {
                "status": "skipped",
                "reason": f"out of memory under the {mem_limit_mb:.0f} MiB budget ({text.splitlines()[0][:200]})",
            }
        else:
            result = {"status": "error", "reason": f"RuntimeError: {text.splitlines()[0][:300]}"}
    except BaseException as exc:  # report every failure to the parent, never hang it
        last = traceback.format_exc().strip().splitlines()[-1]
        result = {"status": "error", "reason": f"{type(exc).__name__}: {last[:300]}"}
    try:
        conn.send(result)
    finally:
        conn.close()


def _start_server(ctx, preload, env: dict) -> None:
    """Start the forkserver now, with ``env`` in its environment only (ours is restored after)."""
    from multiprocessing import forkserver

    # torch.optim imports torch._dynamo (~800 modules, ~3 s) on its first step: import it once, here
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "gpattn", "gpattn.experiments.training", *preload])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _SERVER_STARTED.append(True)


def omp_env(policy: str | None) -> dict:
    """``{"OMP_WAIT_POLICY": ...}`` for the workers: the user's setting if they exported one, else
    ``policy`` (``PASSIVE`` by default in the scripts: on a shared, loaded machine, OpenMP threads that
    spin at barriers while their partner is descheduled make 2-thread timings 5-50x slower and erratic)."""
    if os.environ.get("OMP_WAIT_POLICY"):
        return {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]}
    return {"OMP_WAIT_POLICY": policy.upper()} if policy else {}


def add_omp_wait_policy_argument(parser) -> None:
    """The scripts' ``--omp-wait-policy`` option, whose value :func:`omp_env` turns into the workers'
    environment."""
    parser.add_argument(
        "--omp-wait-policy",
        default="passive",
        choices=("passive", "active"),
        help="OMP_WAIT_POLICY of the workers unless already exported (default passive: see docs/benchmarks.md)",
    )


def run_isolated(
    fn,
    kwargs: dict,
    *,
    timeout: float,
    threads: int,
    mem_limit_mb: float | None,
    preload=(),
    server_env: dict | None = None,
    isolate=True,
) -> dict:
    """Run ``fn(**kwargs) -> dict`` in a fresh child process with ``threads`` torch threads, a
    virtual-memory cap and a wall-clock ``timeout``; return its dict plus ``status`` (``"ok"``,
    ``"skipped"`` with a reason for a timeout or out-of-memory, ``"error"`` with the exception).

    Children come from multiprocessing's *forkserver*: a clean interpreter that imports ``torch``,
    ``gpattn`` and the modules in ``preload`` once and never runs a torch op, then forks one child per
    case. The server is started by the first call of the process; later calls' ``preload`` and
    ``server_env`` are ignored. (Forking this process directly would hang as soon as it has run an
    OpenMP parallel region; spawning a new interpreter per case repeats the imports of torch and gpattn
    every time.) ``fn`` must be
    importable by module name; ``server_env`` holds environment variables for the server (read when it starts, e.g.
    ``OMP_WAIT_POLICY``). ``isolate=False`` runs in this process (no timeout, no memory cap)."""
    if not isolate or "forkserver" not in mp.get_all_start_methods():
        torch.set_num_threads(threads)
        try:
            return {"status": "ok", **fn(**kwargs)}
        except Exception as exc:  # same reporting as the isolated path
            return {"status": "error", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    ctx = mp.get_context("forkserver")
    if not _SERVER_STARTED:
        _start_server(ctx, preload, server_env or {})
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_conn, fn, kwargs, threads, mem_limit_mb), daemon=True)
    start = time.monotonic()
    proc.start()
    child_conn.close()
    result = None
    try:
        if parent_conn.poll(timeout):
            try:
                result = parent_conn.recv()
            except EOFError:
                result = None
    finally:
        parent_conn.close()
        if result is None and proc.is_alive():
            proc.kill()  # our own child, by its handle
        proc.join(10)
    if result is not None:
        return result
    elapsed = time.monotonic() - start
    if elapsed >= timeout:
        return {"status": "skipped", "reason": f"timeout: no result within the {timeout:.0f} s per-case budget"}
    code = proc.exitcode
    if code is not None and code < 0 and -code == 9:
        return {"status": "skipped", "reason": "killed (SIGKILL: likely the kernel's out-of-memory killer)"}
    return {"status": "error", "reason": f"worker exited with code {code} and no result"}


# ----------------------------------------------------------------------------- machine and output
def machine_info(threads: int) -> dict:
    """What the numbers were measured on."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_total = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    mem_total = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": model,
        "nproc": os.cpu_count(),
        "mem_total_gib": mem_total,
        "gpu": torch.cuda.is_available(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpattn": gpattn.__version__,
        "registered_variants": gpattn.list_attention(),
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def mem_available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def default_mem_limit_mb(requested: float | None) -> float:
    """The per-case memory budget: ``requested`` if given, else min(8 GiB, half of MemAvailable) (8 GiB
    where MemAvailable cannot be read)."""
    if requested is not None:
        return requested
    avail = mem_available_mb()
    return min(8192.0, 0.5 * avail) if avail else 8192.0


def _clean(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(obj, path) -> None:
    """Write ``obj`` as JSON (non-finite floats become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n")


def write_outputs(result: dict, json_path, markdown_path, to_markdown) -> None:
    """Write ``result`` as JSON to ``json_path`` and as ``to_markdown(result)`` to ``markdown_path``
    (each only if given), printing where."""
    if json_path:
        write_json(result, json_path)
        print(f"json: {json_path}")
    if markdown_path:
        Path(markdown_path).write_text(to_markdown(result))
        print(f"markdown: {markdown_path}")


def finish(rows: list, cfg, keys: tuple, to_markdown) -> dict:
    """The result of a benchmark run: ``rows`` with the machine and the ``keys`` of ``cfg`` as ``meta``, written
    (``cfg.json``, ``cfg.markdown``) and printed as markdown."""
    result = {"rows": rows, "meta": {**machine_info(cfg.threads), **{k: getattr(cfg, k) for k in keys}}}
    write_outputs(result, cfg.json, cfg.markdown, to_markdown)
    print(to_markdown(result))
    return result


def run_and_finish(cfg, run, keys: tuple, to_markdown) -> dict:
    """A benchmark's main after its arguments: ``run(cfg)`` at ``cfg.threads`` torch threads, then :func:`finish`."""
    torch.set_num_threads(cfg.threads)
    return finish(run(cfg), cfg, keys, to_markdown)
