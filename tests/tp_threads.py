"""A tensor-parallel group of threads in one process, for tests.

Each rank is a thread; :class:`ThreadCollective` implements the same :class:`Collective`
interface as ``torch.distributed``: ``all_reduce`` sums every rank's tensor in rank order
(so every rank gets the same bits, as with NCCL and gloo), ``all_gather_int`` hands every
rank the list of values. A rank that raises aborts the group, so the others fail at their
next collective instead of waiting for ever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar, cast

import torch

from kvcache.parallel.collective import Collective

T = TypeVar("T")

#: Seconds a rank waits for the others at a collective before the test fails.
TIMEOUT_S = 120


class ThreadGroup:
    """The shared state of ``size`` ranks: one slot per rank and a barrier."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT_S)
        self.slots: list[object] = [None] * size


class ThreadCollective(Collective):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size

    def _exchange(self, value: object) -> list[object]:
        g = self.group
        g.slots[self.rank] = value
        g.barrier.wait()  # every rank has written its slot
        values = list(g.slots)
        g.barrier.wait()  # every rank has read them: the slots may be reused
        return values

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = cast(list[torch.Tensor], self._exchange(tensor.clone()))
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return tensor.copy_(total)

    def all_gather_int(self, value: int) -> list[int]:
        return cast(list[int], self._exchange(int(value)))


def run_ranks(size: int, work: Callable[[ThreadCollective], T]) -> list[T]:
    """Run ``work(collective)`` for every rank of a new group, each in its own thread; return
    the results by rank, or raise the first rank's exception (by rank order)."""
    group = ThreadGroup(size)
    results: list[object] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = work(ThreadCollective(group, rank))
        except BaseException as err:
            errors[rank] = err
            group.barrier.abort()  # the others leave their collective at once

    threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    primary = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if primary:
        raise primary[0]
    if any(e is not None for e in errors):
        raise next(e for e in errors if e is not None)
    return cast(list[T], results)
