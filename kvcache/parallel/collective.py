"""The collectives a tensor-parallel engine needs, behind one small interface.

Two kinds of traffic, kept apart as vLLM keeps them (its ``device_group`` / ``cpu_group``):

* :meth:`Collective.all_reduce` sums activations on the device, inside the model's forward
  (NCCL on GPUs, gloo on CPU); with NCCL it may be captured in a CUDA graph;
* :meth:`Collective.all_gather_int` exchanges one host integer per rank (the step digest
  of :mod:`kvcache.parallel.agreement`, a block count) over gloo, so it never waits for the device.

:class:`SingleProcess` is the one-rank group (no communication); :class:`TorchDistributed`
wraps ``torch.distributed`` process groups. Tests add a thread-backed group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

__all__ = ["Collective", "SingleProcess", "TorchDistributed"]

#: The last integer gather's work (and so its tensors), referenced until the next gather or
#: interpreter exit. With torch's tensor/PyObject pairing, whichever thread drops the last
#: reference to a collective's work must hold the GIL to release its tensors. gloo's worker
#: thread drops its own reference on its own schedule; if that came last, after this
#: process's final Python line, it would wait for the GIL during interpreter shutdown and the
#: process would abort ("terminate called without an active exception", exit status -6,
#: although every rank had finished). Holding the work here makes the last reference ours.
_LAST_GATHER: list[Any] = []


class Collective(ABC):
    """A group of ``size`` ranks; this process (or thread) is ``rank``.

    Every method is collective: every rank calls it, in the same order, or the group hangs
    (or, with a timeout, fails). Results are identical on every rank.
    """

    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape, the same on every rank) over the ranks, in place; return
        it. Every rank gets the same bits."""

    @abstractmethod
    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's ``value`` (a signed 64-bit integer), indexed by rank."""

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the block count every rank can hold)."""
        return min(self.all_gather_int(value))


class SingleProcess(Collective):
    """The group of one rank: nothing to exchange."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_int(self, value: int) -> list[int]:
        return [int(value)]


class TorchDistributed(Collective):
    """``torch.distributed`` groups: ``device_group`` for activations (NCCL or gloo),
    ``cpu_group`` (gloo) for host integers; both default to the default group.

    The caller initialises the process group (``torch.distributed.init_process_group``); with
    NCCL, make a gloo group for host values with ``torch.distributed.new_group(backend="gloo")``.
    """

    def __init__(self, device_group: Any = None, cpu_group: Any = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        self._dist = dist
        self.device_group = device_group
        self.cpu_group = cpu_group if cpu_group is not None else device_group
        self.rank = dist.get_rank(device_group)
        self.size = dist.get_world_size(device_group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather_int(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        work = self._dist.all_gather(gathered, mine, group=self.cpu_group, async_op=True)
        work.wait()
        _LAST_GATHER[:] = [work]
        return [int(t.item()) for t in gathered]
