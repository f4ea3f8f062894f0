"""Aten operators dispatched by one forward + backward of one attention layer, per variant, against softmax.

At small T a GP layer on a GPU is launch-bound (issue #30: kep-svgp 4.4×, sgpa-decoupled 8.1×, scgp 17× the
softmax layer at T = 1024 on an H200): its cost is the number of kernels per step, the host synchronisations
and the constants made every call, not the arithmetic. Those counts do not depend on the machine's load, so
they are measured here on the CPU, with a ``TorchDispatchMode`` that sees every aten operator below autograd
(composite operators already decomposed, the backward's operators included):

* ``ops``: every operator; ``kernels``: the ones that compute (not views — ``view``, ``transpose``, ``expand``,
  ... —, ``matmul``'s ``_unsafe_view`` or operators that return no tensor: metadata only, no kernel on a GPU);
* ``syncs``: operators that read a value back to the host (:data:`SYNC_OPS`: ``item``, ``equal``, ``nonzero``, ...);
* ``constants``: operators that make a tensor from nothing but Python values (:data:`CONSTANT_OPS`: ``arange``,
  ``eye``, ``zeros``, ``full``, ``scalar_tensor``, ``lift_fresh`` of ``torch.tensor``, their ``new_*`` and
  ``*_like`` forms), each an allocation and usually a fill kernel per call; ``_to_copy`` across devices and
  dtypes is counted apart (``casts``).

One layer ``gpattn.build_attention(name, D, H, **options)`` in training mode with the options of
``benchmarks/attention_scaling.py`` (``_common.variant_configs``), x of shape (B, T, D), loss = mean(y²) + the sum
of ``layer.loss_terms()``, backward; one uncounted call first (lazy one-off work), then one counted call.

    OMP_NUM_THREADS=1 python benchmarks/op_count.py --markdown ops.md --json ops.json
    OMP_NUM_THREADS=1 python benchmarks/op_count.py --variants kep-svgp --where   # where each constant is made
    OMP_NUM_THREADS=1 python benchmarks/op_count.py --batch 1 --ts 8 --heads 2 --head-dim 8 --reps 200  # + host ms
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import traceback

import torch
from _common import machine_info, variant_configs, write_outputs
from torch.utils._python_dispatch import TorchDispatchMode

import gpattn
from gpattn.variational._linalg import as_on_a_device

#: the layers of issue #30's small-T bar (softmax, the reference, first)
DEFAULT_VARIANTS = ("softmax", "kernel", "sto", "h-sto", "kep-svgp", "scgp", "sgpa-decoupled")

#: operators whose result is read back to the host (a device synchronisation on a GPU)
SYNC_OPS = frozenset(
    "item _local_scalar_dense equal is_nonzero nonzero nonzero_static masked_select unique _unique _unique2 "
    "unique_consecutive unique_dim tolist allclose index[bool] index_put[bool] index_put_[bool] _index_put_impl_[bool] "
    "repeat_interleave[tensor]".split()
)
#: operators whose output shape depends on tensor values for some arguments (a read back inside the kernel, not
#: dispatched on its own): boolean indexing and ``repeat_interleave`` with a tensor of repeats; recorded as
#: ``name[bool]`` / ``name[tensor]``
_VALUE_SHAPED = {
    "index": "bool",
    "index_put": "bool",
    "index_put_": "bool",
    "_index_put_impl_": "bool",
    "repeat_interleave": "tensor",
}
#: operators that make a tensor from Python values alone (each one an allocation, and a fill, per call)
CONSTANT_OPS = frozenset(
    "arange eye zeros ones full scalar_tensor lift_fresh lift_fresh_copy linspace new_zeros new_ones new_full "
    "zeros_like ones_like full_like tensor".split()
)
PHASES = ("forward", "backward")


#: operators that return a tensor without computing anything (no kernel on a GPU) but whose schema does not
#: say so (no alias annotation): ``matmul``'s reshape of its output
METADATA_OPS = frozenset({"_unsafe_view", "_reshape_alias"})


def _is_view(func) -> bool:
    """Whether an aten overload launches no kernel: it returns aliases of its inputs without writing them (a
    view: metadata only), returns no tensor (``promote_types``), or is in :data:`METADATA_OPS`."""
    if func._schema.name.split("::")[-1] in METADATA_OPS:
        return True
    returns = func._schema.returns
    if not any("Tensor" in str(r.type) for r in returns):
        return True
    return all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCounter(TorchDispatchMode):
    """Records every aten operator dispatched while active: ``(phase, name, is_view, where)``, ``where`` the last
    gpattn source line on the Python stack (``"autograd"`` in backward) when ``where=True``."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.where, self.phase, self.records = where, PHASES[0], []

    def __enter__(self):
        self._device_path = as_on_a_device()  # what a device runs: no host shortcut of the numerics policy
        self._device_path.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._device_path.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _value_shaped(func._schema.name.split("::")[-1], args, kwargs or {})
        at = ""
        if self.where and (name in CONSTANT_OPS or name in SYNC_OPS or name == "_to_copy"):
            frames = [f for f in traceback.extract_stack()[:-1] if "/gpattn/" in f.filename]
            at = f"{frames[-1].filename.split('/gpattn/')[-1]}:{frames[-1].lineno}" if frames else "autograd"
        self.records.append((self.phase, name, _is_view(func), at))
        return func(*args, **(kwargs or {}))


def _value_shaped(name: str, args, kwargs) -> str:
    """``name``, or ``name[bool]`` / ``name[tensor]`` for a call of :data:`_VALUE_SHAPED` whose output shape is read
    from tensor values: a boolean index (``x[mask]``), a tensor of repeats without ``output_size``."""
    kind = _VALUE_SHAPED.get(name)
    if kind == "bool" and len(args) > 1:
        indices = args[1] if isinstance(args[1], (list, tuple)) else ()
        if any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"{name}[bool]"
    if kind == "tensor" and args and kwargs.get("output_size") is None:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
        if torch.is_tensor(repeats):
            return f"{name}[tensor]"
    return name


def _summary(records) -> dict:
    names = collections.Counter(name for _, name, _, _ in records)
    return {
        "ops": len(records),
        "kernels": sum(not view for _, _, view, _ in records),
        "syncs": sum(n for name, n in names.items() if name in SYNC_OPS),
        "constants": sum(n for name, n in names.items() if name in CONSTANT_OPS),
        "casts": names.get("_to_copy", 0),
    }


def count_case(
    name: str,
    options: dict,
    B: int,
    T: int,
    heads: int,
    head_dim: int,
    seed: int = 0,
    where: bool = False,
    reps: int = 0,
) -> dict:
    """The counts of one forward + backward of one layer (after one uncounted call), per phase and in total, and
    the operators by name (and, with ``where``, the constants, syncs and casts by gpattn source line); with
    ``reps``, ``host_ms``: the median wall time of ``reps`` uncounted calls (at a tiny size, the host's cost per
    step: Python and dispatch, what a launch-bound GPU step waits for; it depends on the machine's load)."""
    torch.manual_seed(seed)
    layer = gpattn.build_attention(name, heads * head_dim, heads, **options).train()
    x = torch.randn(B, T, heads * head_dim)  # shape: (B, T, D)

    def step(counter=None):
        for p in layer.parameters():
            p.grad = None
        y = layer(x)  # shape: (B, T, D)
        loss = y.square().mean()
        for term in layer.loss_terms().values():
            loss = loss + term
        if counter is not None:
            counter.phase = PHASES[1]
        loss.backward()

    step()  # one-off work (lazy caches, first-call setup) is not a per-step cost
    counter = OpCounter(where)
    with counter:
        step(counter)
    recs = counter.records
    row = {"phase": {p: _summary([r for r in recs if r[0] == p]) for p in PHASES}, **_summary(recs)}
    row["by_op"] = dict(collections.Counter(n for _, n, _, _ in recs).most_common())
    if reps:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - start))
        row["host_ms"] = statistics.median(times)
    if where:
        row["where"] = dict(collections.Counter(f"{n} at {at}" for _, n, _, at in recs if at).most_common())
    return row


def to_markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    ref, timed = rows[0], "host_ms" in rows[0]
    out = [
        f"One forward + backward, training mode, B={meta['B']}, T={meta['T']}, H={meta['heads']}, "
        f"Dh={meta['head_dim']}, fp32; aten operators (benchmarks/op_count.py, torch {meta['torch']})",
        "",
        "| variant | ops fwd | ops bwd | ops | × softmax | kernels | × softmax | syncs | constants | casts |"
        + (" host ms | × softmax |" if timed else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else ""),
    ]
    for r in rows:
        line = (
            f"| {r['variant']} | {r['phase']['forward']['ops']} | {r['phase']['backward']['ops']} | {r['ops']} | "
            f"{r['ops'] / ref['ops']:.2f} | {r['kernels']} | {r['kernels'] / ref['kernels']:.2f} | {r['syncs']} | "
            f"{r['constants']} | {r['casts']} |"
        )
        if timed:
            line += f" {r['host_ms']:.2f} | {r['host_ms'] / ref['host_ms']:.2f} |"
        out.append(line)
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated registry names or 'all' (softmax is always added)",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--ts", type=int, default=64, help="T (the counts of the dense paths do not depend on it)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--top", type=int, default=0, help="print each variant's N most frequent operators")
    p.add_argument("--where", action="store_true", help="print where each constant, sync and cast is made")
    p.add_argument("--reps", type=int, default=0, help="also time this many calls (median host ms per step)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = None if args.variants.strip() == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    rows = []
    for cfg in variant_configs(names):
        if cfg["variant"] != cfg["name"] and names is not None and cfg["variant"] not in names:
            continue  # the extra covariance configurations only when asked for by label or with 'all'
        row = count_case(
            cfg["name"],
            cfg["options"],
            args.batch,
            args.ts,
            args.heads,
            args.head_dim,
            where=args.where,
            reps=args.reps,
        )
        rows.append({"variant": cfg["variant"], "options": cfg["options"], **row})
        for key, top in (("by_op", args.top), ("where", 10**6 if args.where else 0)):
            for what, n in list(row.get(key, {}).items())[:top]:
                print(f"  {cfg['variant']}: {n:5d} {what}")
    meta = {**machine_info(1), "B": args.batch, "T": args.ts, "heads": args.heads, "head_dim": args.head_dim}
    result = {"meta": meta, "rows": rows}
    print(to_markdown(result))
    write_outputs(result, args.json, args.markdown, to_markdown)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["rows"] else 1)
