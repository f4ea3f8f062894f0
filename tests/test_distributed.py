"""torchrun with 2 CPU processes (gloo, DistributedDataParallel) steps like one process with the same global
batch, and resumes bit-exact."""

import json
import sys

import pytest
from _cli_helpers import run, train_cmd

ARGS = ("--dropout", "0.0", "--num-samples", "1")


def _failure(what: str, done) -> str:
    """A failed torchrun's message as one string (pytest shortens a tuple's repr to 240 characters, which hid the
    cause of a CI failure): every line of the children's output that names an error, then the output's end."""
    words = ("Error", "error:", "Traceback", "terminate", "exitcode", "Signal")
    named = [line for line in done.stderr.splitlines() if any(w in line for w in words)]
    tail = done.stderr[-4000:]
    return f"{what}: exit code {done.returncode}\n" + "\n".join(named[:60]) + f"\n--- end of stderr ---\n{tail}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_match_one(tmp_path):
    one = run(train_cmd("softmax", 2, *ARGS, "--out", str(tmp_path / "one")))
    assert one.returncode == 0, one.stderr[-3000:]
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    two = run(train_cmd("softmax", 2, *ARGS, "--out", str(tmp_path / "two"), launcher=torchrun))
    assert two.returncode == 0, _failure("torchrun", two)
    h1 = json.loads((tmp_path / "one" / "history.json").read_text())
    h2 = json.loads((tmp_path / "two" / "history.json").read_text())
    assert len(h1) == len(h2) == 2
    # same steps up to float32 summation order across ranks: losses agree to 1e-4 relative
    for a, b in zip(h1, h2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m2["in_domain"]["nll"] == pytest.approx(m1["in_domain"]["nll"], rel=1e-3)
    assert abs(m2["in_domain"]["accuracy"] - m1["in_domain"]["accuracy"]) <= 2 / 362  # at most 2 flips
    # rank 0 alone writes files: one checkpoint, no stray temporaries
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())


_SCRIPT = """
import faulthandler
import os
import sys

import torch

# a hung rank prints every thread's stack and leaves before the test's timeout, so a failure says where it hung
faulthandler.dump_traceback_later(200, exit=True)

from gpattn.experiments.training import TrainConfig, train

out, mode = sys.argv[1], sys.argv[2]
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 2
cfg = TrainConfig(dataset="digits", attention="sto", embed_dim=16, num_heads=2, num_layers=1, epochs=epochs,
                  batch_size=64, num_samples=2, progress=False)
if mode == "cut":
    try:
        train(cfg, out, stop_after_steps=5)  # mid-epoch, on every rank at the same step
    except KeyboardInterrupt:
        pass
else:
    train(cfg, out, resume=mode == "resume")
# the process group is gone with its threads once train returns: none of gloo's threads may run into
# interpreter teardown, where they occasionally aborted rank 1 ("terminate called without an active exception")
if os.path.isdir("/proc/self/task"):
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    alive = [n for n in names if "gloo" in n]
    assert not alive, f"rank {os.environ['RANK']}: gloo threads still run after train returned: {alive}"
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_resume_is_bit_exact(tmp_path):
    """2 processes interrupted mid-epoch and resumed end with the parameters and metrics of an
    uninterrupted 2-process run: each rank restores its own random state (dropout, Gumbel noise)."""
    import torch

    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    for out, mode in (("full", "full"), ("cut", "cut"), ("cut", "resume")):
        done = run([*torchrun, str(tmp_path / out), mode])
        assert done.returncode == 0, _failure(mode, done)
    full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=True)
    for name, value in full["model"].items():
        assert torch.equal(value, cut["model"][name]), (name, (value - cut["model"][name]).abs().max())
    assert len(cut["rng_ranks"]) == 2 and not torch.equal(cut["rng_ranks"][0]["cpu"], cut["rng_ranks"][1]["cpu"])
    a = json.loads((tmp_path / "full" / "metrics.json").read_text())
    b = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert a == b


def test_every_parameter_takes_part_in_a_training_step():
    """DDP runs with static_graph (training._Dist.wrap): every registered variant's model uses all its
    parameters in a training forward, so no gradient bucket waits for a parameter that never comes."""
    import torch

    import gpattn
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.training import TrainConfig, _batch, build_model
    from gpattn.objectives import DeepGPELBO

    bundle = load_dataset("digits", seed=0)
    x, mask, y = _batch(bundle.splits["train"], torch.arange(4))
    for name in gpattn.list_attention():
        torch.manual_seed(0)
        model = build_model(TrainConfig(attention=name, embed_dim=8, num_heads=2, num_layers=1), bundle).train()
        loss = DeepGPELBO(model, 100)(model(x, mask, num_samples=1), y)
        loss.backward()
        assert [n for n, p in model.named_parameters() if p.grad is None] == [], name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_jobs_end_normally_again_and_again(tmp_path):
    """The 2-process job, three times: every run exits 0 through normal interpreter teardown (no os._exit),
    with gloo's threads gone when train returns (torch.distributed.nn imported before the group exists)."""
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    for attempt in range(3):
        done = run([*torchrun, str(tmp_path / f"run{attempt}"), "full", "1"])
        assert done.returncode == 0, _failure(f"attempt {attempt}", done)
        assert "terminate called" not in done.stderr and "exitcode" not in done.stderr, done.stderr[-3000:]
        assert (tmp_path / f"run{attempt}" / "metrics.json").is_file()


def test_close_waits_at_the_store_until_every_rank_has_left_the_group():
    """_Dist.close's check-in: a rank returns only once every rank has checked in (two ranks as threads on one
    in-memory store); one rank alone waits, here until the store's timeout."""
    import datetime
    import threading

    import torch.distributed as dist

    from gpattn.experiments._dist import _Dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=2))

    def rank(r: int) -> _Dist:
        d = object.__new__(_Dist)
        d.world, d.rank, d.store, d.close_key = 2, r, store, key
        return d

    key = "alone"
    with pytest.raises(RuntimeError, match="(?i)timeout"):  # alone: nobody else checks in
        rank(0)._all_checked_in()
    key = "both"
    done = []
    threads = [threading.Thread(target=lambda r=r: (rank(r)._all_checked_in(), done.append(r))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(done) == [0, 1]
