"""Holds: blocks kept allocated by someone other than a block table (a swap-out copy that is
still reading them). A hold is one more owner in the allocator's reference count."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

from attention.errors import ArgumentTypeError, InvalidArgumentError
from kvcache.blocks.allocator import BlockAllocator

__all__ = ["BlockHolds"]


class BlockHolds:
    """Hold counts per block, on top of an allocator."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.counts: dict[int, int] = {}

    def hold(
        self, blocks: Iterable[int], written_in_place: Callable[[], Mapping[int, Hashable]] | None = None
    ) -> list[int]:
        """One hold on each owned block of ``blocks``. Raises InvalidArgumentError (nothing
        changed) for an id that is not an owned block, or that ``written_in_place()`` (blocks
        an owner still writes into, with that owner) names. Returns the blocks held."""
        blocks = _block_list(blocks)
        for block in blocks:
            if self.allocator.is_free(block):
                raise InvalidArgumentError(f"blocks: block {block} is free; only owned blocks can be held")
        growing = written_in_place() if written_in_place is not None else {}
        for block in blocks:
            if block in growing:
                raise InvalidArgumentError(
                    f"blocks: block {block} is the partly filled last block of sequence {growing[block]!r:.60}, "
                    f"which appends write in place; hold it once it is full, or after detach()"
                )
        for block in blocks:
            self.allocator.incref(block)
            self.counts[block] = self.counts.get(block, 0) + 1
        return blocks

    def drop(self, blocks: Iterable[int]) -> list[int]:
        """Drop one hold per listed block. Raises InvalidArgumentError (nothing changed) for a
        block held fewer times than listed. Returns the blocks whose owner count the caller
        must now release in the allocator."""
        blocks = _block_list(blocks)
        listed: dict[int, int] = {}
        for block in blocks:
            listed[block] = listed.get(block, 0) + 1
        for block, n in listed.items():
            if self.counts.get(block, 0) < n:
                raise InvalidArgumentError(
                    f"blocks: block {block!r:.20} is released {n} time(s) but held {self.counts.get(block, 0)}"
                )
        for block, n in listed.items():
            left = self.counts[block] - n
            if left:
                self.counts[block] = left
            else:
                del self.counts[block]
        return blocks


def _block_list(blocks: Iterable[int]) -> list[int]:
    """``blocks`` as a list of ints; raises ArgumentTypeError for a non-iterable or a non-int."""
    if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
        raise ArgumentTypeError(f"blocks: expected an iterable of block ids, got {type(blocks).__name__}")
    out = list(blocks)
    for block in out:
        if type(block) is not int:
            raise ArgumentTypeError(f"blocks: expected int block ids, got {type(block).__name__} {block!r:.20}")
    return out
