"""The block allocator: a fixed pool of block ids, a free queue, and reference counts.

Pure Python, no torch. Allocation is all-or-nothing. Blocks shared by several sequences
(forks, prefix-cache hits) carry a reference count and return to the free queue when the
last owner lets go.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.errors import OutOfBlocksError
from kvcache.free_queue import FreeBlockQueue

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks-1``.

    Freed blocks that still hold useful K/V (``keep_cached=True``) go to the back of the free
    queue, so they are reused last (LRU); blocks holding nothing useful go to the front. Each
    block has a *generation* that grows every time it is handed out for new content, so
    ``(block, generation)`` names one immutable filling of a block.
    """

    def __init__(self, num_blocks: int, on_reuse: Callable[[int], None] | None = None):
        """``on_reuse(block)`` is called when a free block is taken for new content (the prefix
        cache drops what it knew about the block's old content)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks: {num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.on_reuse = on_reuse
        self._ref = [0] * num_blocks
        self._generation = [0] * num_blocks
        self._free = FreeBlockQueue(num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks with no owner (some may still hold cached K/V)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks are free. Changes nothing."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, each with reference count 1.

        All or nothing: raises OutOfBlocksError(requested=n, free) and changes nothing when
        fewer than ``n`` are free.
        """
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free))
        blocks = [self._free.pop_front() for _ in range(n)]
        for block in blocks:
            self._ref[block] = 1
            self._generation[block] += 1
            if self.on_reuse is not None:
                self.on_reuse(block)
        return blocks

    def revive(self, block: int) -> None:
        """Take a specific free block (a prefix-cache hit) without touching its content."""
        self._free.remove(block)
        self._ref[block] = 1

    def incref(self, block: int) -> None:
        """One more owner of an owned block (a fork, or a cache hit on a block in use)."""
        assert self._ref[block] > 0, f"incref on free block {block}; revive it instead"
        self._ref[block] += 1

    def decref(self, block: int, keep_cached: bool = False) -> None:
        """One owner fewer. At zero the block is free: at the back of the queue when its K/V is
        worth keeping (reused last), else at the front (reused first)."""
        assert self._ref[block] > 0, f"decref on free block {block} (double free)"
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if keep_cached:
                self._free.push_back(block)
            else:
                self._free.push_front(block)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def generation(self, block: int) -> int:
        """How many times ``block`` has been handed out for new content."""
        return self._generation[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def free_blocks_in_eviction_order(self) -> list[int]:
        """Free blocks, the next to be reused first. O(n); for checks and tests."""
        return list(self._free)

    def integrity_problems(self) -> list[str]:
        """Recount every invariant; return a description of each violation (empty: fine)."""
        found = self._free.check_links()
        for block, ref in enumerate(self._ref):
            if ref < 0:
                found.append(f"block {block} has reference count {ref}")
            elif ref > 0 and block in self._free:
                found.append(f"block {block} has {ref} owners but is in the free queue")
            elif ref == 0 and block not in self._free:
                found.append(f"block {block} has no owner but is not in the free queue")
        return found
