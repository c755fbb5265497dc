"""Typed errors. Running out of blocks is an expected outcome, not a crash."""

from __future__ import annotations

__all__ = [
    "CacheAllocationError",
    "KVCacheError",
    "OutOfBlocksError",
    "SequenceExistsError",
    "UnknownSequenceError",
]


class KVCacheError(Exception):
    """Base class of every error this package raises on purpose."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks for an all-or-nothing request; nothing was changed."""

    def __init__(self, requested: int, free: int, what: str = "allocate"):
        self.requested = requested
        self.free = free
        super().__init__(
            f"cannot {what}: {requested} blocks needed, {free} free; free or preempt a sequence, "
            f"or give the cache more blocks (cache.num_blocks / cache.memory_budget)"
        )


class UnknownSequenceError(KVCacheError, KeyError):
    """The sequence id has no block table; nothing was changed."""

    def __init__(self, seq_id: object):
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} is unknown; allocate it first")

    def __str__(self) -> str:
        return str(self.args[0])


class SequenceExistsError(KVCacheError, ValueError):
    """The sequence id already has a block table; nothing was changed."""

    def __init__(self, seq_id: object):
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} already has blocks; free it first or use a new id")


class CacheAllocationError(KVCacheError, MemoryError):
    """The device cannot hold the requested cache tensors."""
