"""The multi-process context of a run (:class:`_Dist`, torchrun's environment) and each process's random
state (:func:`_rng_state`, :func:`_set_rng_state`). Split from :mod:`gpattn.experiments.training`."""

from __future__ import annotations

import itertools
import os

import torch

from gpattn.experiments._runs import resolve_device

__all__: list[str] = []

_GROUPS = itertools.count()  # the process groups this process has started (the key of each one's check-in)


class _Dist:
    """Multi-process context from torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``): NCCL
    when the run's device is a GPU, gloo on CPU. A single process is world 1, rank 0.

    Gradients are reduced by ``DistributedDataParallel`` (:meth:`wrap`); the small host-side agreements
    (an interrupt request) go through a gloo group on CPU tensors, so they never synchronise a GPU."""

    def __init__(self, device_spec: str = "auto"):
        import torch.distributed as dist

        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.owned = False
        self.device = resolve_device(device_spec)
        self.cpu_group = self.store = self.close_key = None
        if self.world > 1 and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            # torch.distributed.nn.functional binds ``group.WORLD`` as the default argument of ten functions when
            # it is first imported, which DistributedDataParallel does: imported after init_process_group, it
            # holds the default group — and gloo's threads — past destroy_process_group until the interpreter
            # tears that module down, where rank 1 occasionally aborted ("terminate called without an active
            # exception"). Imported before any group exists, the defaults are None.
            import torch.distributed.nn as _distributed_nn  # noqa: F401  (binds only this name, not torch)

            # the rendezvous init_process_group would make, kept: its store (torchrun's agent holds it, apart from
            # gloo's connections) is where close() waits for every rank before the group is torn down
            store, rank, world = next(dist.rendezvous("env://"))
            self.store = dist.PrefixStore("gpattn", store)
            # every rank starts its groups in the same order: the n-th group's key is the same on each (a worker
            # restart, its own)
            self.close_key = f"closed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_GROUPS)}"
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world)
            self.owned = True
        if self.world > 1:
            gloo = dist.get_backend() == "gloo"
            self.cpu_group = None if gloo else dist.new_group(backend="gloo")
        self.rank = dist.get_rank() if self.world > 1 else 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (every rank sees the same global order)."""
        return idx[self.rank :: self.world]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``DistributedDataParallel`` around ``model`` (the model itself in one process).

        The set of parameters a training forward uses never changes during a run (the variant, its
        options and the sampling mode are fixed; every registered variant's model uses all of its
        parameters, tests/test_distributed.py), so ``static_graph=True``: DDP learns that set in the
        first step instead of searching the autograd graph every step (``find_unused_parameters``), and a
        variant with an option that leaves a parameter unused still trains."""
        if self.world == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, static_graph=True)

    def allreduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            self.dist.all_reduce(t)
        return t

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a CPU all-reduce: no device synchronisation)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(t[0] > 0)

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable, on the CPU), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        parts = [None] * self.world
        self.dist.all_gather_object(parts, obj, group=self.cpu_group)
        return parts

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """Reassemble rows sharded as ``rank::world`` into their original order."""
        if self.world == 1:
            return local
        parts = self.gather_objects(local.cpu())
        out = torch.empty(n, *local.shape[1:], dtype=local.dtype)
        for r, part in enumerate(parts):
            out[r :: self.world] = part
        return out

    def close(self, barrier: bool = True) -> None:
        """End the process group this object started (``barrier``: wait for every rank first; off when
        leaving on an exception, which every rank may not share). Left open, or kept alive by a reference
        (see ``__init__``), gloo's threads run into interpreter teardown, which they occasionally abort
        ("terminate called without an active exception").

        The wait is the group's barrier, then a check-in at the rendezvous store: a rank leaves the barrier once
        it has the others' messages, while another may still be in it, and a group torn down under a peer's
        last collective left that peer hung in the group's destructor (a 2-process CPU run, rarely). Past the
        store every rank has finished every collective of the group."""
        if self.owned and self.dist.is_initialized():
            if barrier:
                self.dist.barrier()
                self._all_checked_in()
            self.dist.destroy_process_group()
            self.owned = False

    def _all_checked_in(self) -> None:
        """Return once every rank has called this for the group (a count and a flag in the store)."""
        key = self.close_key
        if self.store.add(key, 1) == self.world:
            self.store.set(f"{key}/all", "1")
        self.store.wait([f"{key}/all"])


def _rng_state(device: torch.device) -> dict:
    """This process's random state: the CPU generator and, on a GPU, the device's generator."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
