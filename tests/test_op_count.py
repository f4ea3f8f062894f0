"""Operators per forward + backward of an attention layer (issue #30's small-T overhead; benchmarks/op_count.py).

At small T a GP layer on a GPU costs what it launches, so the count of aten operators is the measure (load
independent, no GPU needed). Checked here: no operator that reads a value back to the host (aten level, below
what tests/test_no_sync.py sees from Python: ``torch.equal`` inside gpytorch, ``nonzero`` of a boolean index) in
any registered variant; and, for the layers whose overhead was cut, the kernels and constants of one forward +
backward at most their measured counts, so that a change that adds operators fails here and is measured on
purpose (rerun ``python benchmarks/op_count.py`` and update :data:`PINNED` with the table in docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

import gpattn
from gpattn.kernels import evaluate_kernel, make_kernel

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
for _p in (str(BENCH), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
op_count = importlib.import_module("op_count")
common = importlib.import_module("_common")
padded_inputs = importlib.import_module("test_no_sync")._inputs

#: (kernels, constants) of one forward + backward in training mode, B=2, T=8, H=2, Dh=8, no padding, the
#: benchmark options (docs/benchmarks.md, "Small-T overhead"); measured with torch 2.13, whose decompositions the
#: counts depend on
# cgp and scgp with their default softmax prior means (docs/derivations.md §7a): 8 kernels for cgp's mean (605 with
# the zero mean), 5 for scgp's separate one (493 with the zero mean; its v_mean rows ride in the fused in_proj)
# kep-svgp: +3 kernels for its prior outputscale σ² (176 at Chen et al.'s prior: √σ², σ·Λ, its backward; §6), +8
# for its default softmax prior mean (179 with the zero mean; its v_mean rows ride in the fused in_proj)
PINNED = {"kep-svgp": (187, 3), "scgp": (498, 9), "cgp": (613, 16)}
PINNED_TORCH = "2.13."


def _options(name: str) -> dict:
    return next(c["options"] for c in common.variant_configs([name]) if c["variant"] == name)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_operator_count_does_not_grow(name):
    if not torch.__version__.startswith(PINNED_TORCH):
        pytest.skip(f"counts pinned with torch {PINNED_TORCH}x (decompositions differ), running {torch.__version__}")
    row = op_count.count_case(name, _options(name), B=2, T=8, heads=2, head_dim=8, where=True)
    kernels, constants = PINNED[name]
    made = {k: v for k, v in row["where"].items() if k.split(" at ")[0] in op_count.CONSTANT_OPS}
    assert row["kernels"] <= kernels, f"{name}: {row['kernels']} kernels per forward + backward, pinned {kernels}"
    assert row["constants"] <= constants, f"{name}: constants {made}, pinned {constants}"
    assert row["syncs"] == 0


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_no_host_sync_below_python(name):
    """A training step's forward (with padding, an all-padding sequence, P = 2 draws, and under
    ``gpattn.deterministic()``) and backward dispatch no operator that reads a tensor back to the host."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 8, 2)
    x, mask = padded_inputs()  # some padding and a sequence that is all padding
    counter = op_count.OpCounter(where=True)
    with counter:
        y = layer(x, mask, num_samples=2)
        with gpattn.deterministic():
            y = y.sum() + layer(x, mask).sum()
        y.backward()
    syncs = [f"{name_} at {at}" for _, name_, _, at in counter.records if name_ in op_count.SYNC_OPS]
    assert syncs == []


@pytest.mark.parametrize(
    "spec",
    [
        "ard-rbf",
        "exponential",
        {"name": "sum", "kernels": ["ard-rbf", "exponential"]},
        {"name": "product", "kernels": ["ard-rbf", "exponential"]},
        {"name": "scale", "base": "ard-rbf"},
    ],
    ids=["ard-rbf", "exponential", "sum", "product", "scale-of-scale"],
)
def test_kernel_blocks_read_nothing_back(spec):
    """gpattn's kernel evaluation of the RBF and exponential kernels, alone or in gpytorch's sums, products and
    scalings, skips gpytorch's ``torch.equal(x1, x2)`` (covar_dist, ProductKernel), on distinct and equal inputs.
    (A Matérn kernel still asks it, once per block: gpytorch's covar_dist.)"""
    kernel = make_kernel(spec, 2, 4)
    x1, x2 = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 6, 4)
    counter = op_count.OpCounter(where=True)
    with counter:
        evaluate_kernel(kernel, x1, x2)
        evaluate_kernel(kernel, x1, x1)
    assert [name for _, name, _, _ in counter.records if name in op_count.SYNC_OPS] == []


# torch 2.13's dynamo instantiates every autograd.Function it traces (kernel attention's fused one too) and warns
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("name", ["kep-svgp", "scgp", "cgp"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_rewritten_layers_trace_as_one_graph(name, training):
    """The layers whose step was rewritten for fewer operators stay one ``torch.compile`` graph, sampling, with and
    without gradients (``torch._dynamo.explain``: traced, not compiled). A graph break (a lock taken by
    ``functools.cached_property``, a host read) would cut the fusion that the remaining small-T overhead needs."""
    import torch._dynamo as dynamo

    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 16, 2).train(training)
    x, mask = padded_inputs(D=16)
    dynamo.reset()
    with torch.set_grad_enabled(training):
        explained = dynamo.explain(layer)(x, mask)
    dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_counter_sees_syncs_and_constants():
    """The counter's categories on operators of known kind: a read back, a constant, a view, a kernel."""
    t = torch.randn(3, 4)
    counter = op_count.OpCounter()
    with counter:
        torch.equal(t, t)
        torch.arange(3)
        u = t.t()
        (u * 2).sum().item()
        t[t > 0]  # a boolean index: the output size is read inside the kernel
        t.repeat_interleave(2, 0)  # int repeats: no read
    rows = {name: view for _, name, view, _ in counter.records}
    summary = op_count._summary(counter.records)
    assert {"equal", "arange", "t", "mul", "sum", "_local_scalar_dense", "index[bool]"} <= set(rows)
    assert rows["t"] and not rows["mul"]
    assert summary["syncs"] == 3 and summary["constants"] == 1


def test_op_count_script_smoke(tmp_path):
    """benchmarks/op_count.py at a tiny size: softmax first, every row with its counts per phase and the ratios in
    the markdown; the JSON written."""
    out = tmp_path / "ops.json"
    result = op_count.main(
        [
            "--variants",
            "kep-svgp,scgp",
            "--batch",
            "1",
            "--ts",
            "4",
            "--heads",
            "2",
            "--head-dim",
            "4",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "ops.md"),
        ]
    )
    rows = result["rows"]
    assert [r["variant"] for r in rows] == ["softmax", "kep-svgp", "scgp"]
    for r in rows:
        assert r["ops"] == r["phase"]["forward"]["ops"] + r["phase"]["backward"]["ops"] > r["kernels"] > 0
        assert r["syncs"] == 0 and sum(r["by_op"].values()) == r["ops"]
    assert json.loads(out.read_text())["rows"][1]["kernels"] == rows[1]["kernels"]
    ratio = f"{rows[2]['kernels'] / rows[0]['kernels']:.2f}"
    assert ratio in (tmp_path / "ops.md").read_text()
