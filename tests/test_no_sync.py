"""No host-device synchronisation in a layer's forward or a training step in the default configuration.
There is no GPU on CI, so the test counts the Tensor methods that read a value back to the
host (and so wait for the device): ``item``, ``__bool__``, ``__int__``, ``__float__``, ``tolist``,
``nonzero``, ``cpu``, ``torch.equal``, and those that copy a host value to the device (``new_tensor``,
``torch.tensor``); and runs every layer on the ``meta`` device, where any such read fails and any
tensor made on the wrong device does not mix with the input's. On a GPU, benchmarks/gpu_check.py counts
the synchronisations themselves (torch's sync debug mode)."""

import collections
import traceback

import pytest
import torch

import gpattn
from gpattn.experiments.data import load_dataset
from gpattn.experiments.training import EpochStats, TrainConfig, _Dist, _DivergenceGuard, _train_step, build_model
from gpattn.models import TransformerClassifier
from gpattn.objectives import DeepGPELBO
from gpattn.variational._linalg import as_on_a_device

READS = ("item", "__bool__", "__int__", "__float__", "tolist", "nonzero", "cpu")
#: host values copied to the device (``new_tensor``, ``torch.tensor``: a synchronising copy on CUDA) and a
#: comparison whose answer comes back to the host (``torch.equal``); each was seen on an H100
#: (benchmarks/gpu_check.py) where the counts above saw nothing
COPIES = (("Tensor", "new_tensor"), ("torch", "tensor"), ("torch", "equal"))


@pytest.fixture
def host_reads(monkeypatch):
    """Counter of host reads of tensor values and host-to-device copies, by method and the gpattn line
    that made them."""
    counts = collections.Counter()

    def count(owner, name):
        real = getattr(owner, name)

        def counted(*args, **kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if "/gpattn/" in f.filename]
            where = f"{frames[-1].filename.split('/gpattn/')[-1]}:{frames[-1].lineno}" if frames else "?"
            counts[f"{name} at {where}"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in READS:
        count(torch.Tensor, name)
    for owner, name in COPIES:
        count(torch.Tensor if owner == "Tensor" else torch, name)
    with as_on_a_device():  # the path a device tensor takes (the CPU shortcut of cholesky reads info, for free)
        yield counts


def _inputs(B=3, T=6, D=8):
    x = torch.randn(B, T, D)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 4:] = True  # some padding
    mask[2] = True  # a sequence that is all padding
    return x, mask


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_layer_forward_reads_nothing_back(name, host_reads):
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 8, 2)
    x, mask = _inputs()
    host_reads.clear()  # construction may read values: only the forward counts
    y = layer(x, mask)
    layer(x)  # no mask
    with gpattn.deterministic():
        layer(x, mask)
    y.sum().backward()
    assert dict(host_reads) == {}


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_layer_runs_on_the_meta_device(name):
    """A value read or a tensor made on the CPU fails on ``meta``: the forward makes everything on its
    input's device."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, 8, 2).to("meta")
    x, mask = (t.to("meta") for t in _inputs())
    y = layer(x, mask)
    assert y.device.type == "meta" and y.shape == x.shape
    with gpattn.deterministic():
        assert layer(x, mask).device.type == "meta"


def test_model_forward_and_objective_read_nothing_back(host_reads):
    torch.manual_seed(0)
    model = TransformerClassifier(3, vocab_size=20, embed_dim=8, num_heads=2, attention="sgpa")
    ids = torch.randint(1, 20, (4, 5))
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1, 3:] = True
    labels = torch.tensor([0, 1, 2, 0])
    host_reads.clear()
    logits = model(ids, mask, num_samples=2)
    loss = DeepGPELBO(model, 100)(logits, labels)
    loss.backward()
    assert dict(host_reads) == {}


@pytest.mark.parametrize("name", ["softmax", "sgpa", "cgp", "sto"])
def test_training_step_reads_nothing_back(name, host_reads):
    bundle = load_dataset("digits", seed=0)
    cfg = TrainConfig(attention=name, embed_dim=8, num_heads=2, num_layers=1, device="cpu", progress=False)
    torch.manual_seed(0)
    model = build_model(cfg, bundle)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    guard, stats, dist = _DivergenceGuard(model, torch.device("cpu")), EpochStats(), _Dist("cpu")
    objective = DeepGPELBO(model, len(bundle.splits["train"].labels), combine_terms=False)  # as train() builds it
    host_reads.clear()  # building the model and data may read values: not part of a step
    for step in range(2):
        idx = torch.arange(step * 16, (step + 1) * 16)
        _train_step(model, model, objective, optimizer, guard, stats, bundle.splits["train"], idx, step, cfg, dist)
    # digits' sgpa has gpytorch's ARD-RBF kernel, whose covar_dist asks torch.equal(x1, x2) once per
    # evaluation; gpattn.kernels.evaluate_kernel evaluates it without (docs/benchmarks.md, CUDA)
    assert dict(host_reads) == {}
    guard.check()  # the one read, at the epoch end
