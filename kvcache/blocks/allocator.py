"""The block allocator: a fixed pool of block ids, a free queue, and reference counts.

Pure Python, no torch. Allocation is all-or-nothing. Blocks shared by several sequences
(forks, prefix-cache hits) carry a reference count and return to the free queue when the
last owner lets go. Every public method checks its arguments before it changes anything and
raises the project's own errors (never ``assert``), so a caller's mistake cannot corrupt the
counts even under ``python -O``.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from attention.checks import require_int
from attention.errors import InvalidArgumentError, OutOfBlocksError
from kvcache.blocks.free_queue import FreeBlockQueue

__all__ = ["MAX_BLOCKS", "BlockAllocator"]

#: Block ids are stored in int32 block tables.
MAX_BLOCKS = 2**31 - 1


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks-1``.

    Freed blocks that still hold useful K/V (``keep_cached=True``) are reused last, least
    recently freed first (LRU); blocks holding nothing useful are reused first.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None):
        """``on_evict(block)`` is called when a cached free block is taken for new content
        (the prefix cache drops what it knew about the block's old content)."""
        self.num_blocks = require_int("num_blocks", num_blocks, minimum=1, maximum=MAX_BLOCKS)
        self.on_evict = on_evict
        #: Called once after an allocation that evicted cached blocks (after every
        #: ``on_evict``): a lower tier copies the evicted blocks out as one batch.
        self.after_evict: Callable[[], None] | None = None
        self._ref = [0] * self.num_blocks
        self._free = FreeBlockQueue(self.num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks with no owner (some may still hold cached K/V)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold cached K/V."""
        return self._free.num_cached

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks are free. Changes nothing."""
        return require_int("n", n, minimum=0) <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks in reuse order, each with reference count 1.

        All or nothing: raises OutOfBlocksError(requested=n, free) and changes nothing when
        fewer than ``n`` are free.
        """
        n = require_int("n", n, minimum=0)
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free))
        blocks, evicted = self._free.take(n)
        ref = self._ref
        for block in blocks:
            ref[block] = 1
        if evicted and self.on_evict is not None:
            for block in evicted:
                self.on_evict(block)
            if self.after_evict is not None:
                self.after_evict()
        return blocks

    def revive(self, block: int) -> None:
        """Take a specific free block (a prefix-cache hit) without touching its content.
        Raises InvalidArgumentError (nothing changed) when it is not free."""
        self._check_id(block)
        if self._ref[block] != 0:
            raise InvalidArgumentError(
                f"block {block}: has {self._ref[block]} owners, so it cannot be revived; incref it"
            )
        self._free.remove(block)
        self._ref[block] = 1

    def incref(self, block: int) -> None:
        """One more owner of an owned block (a fork, or a cache hit on a block in use).
        Raises InvalidArgumentError (nothing changed) for a free block."""
        self._check_id(block)
        if self._ref[block] <= 0:
            raise InvalidArgumentError(f"block {block}: incref on a free block; revive it instead")
        self._ref[block] += 1

    def share(self, blocks: Sequence[int]) -> None:
        """One more owner for each of ``blocks``, ids the caller guarantees are valid and
        distinct (prefix-cache hits): a free one is taken out of the free queue with its
        content, an owned one gets another owner. No checks (admission's hot path)."""
        ref = self._ref
        for block in blocks:
            if ref[block]:
                ref[block] += 1
            else:
                self._free.remove(block)
                ref[block] = 1

    def count_free(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (valid ids, as :meth:`share` takes) are free."""
        ref = self._ref
        return sum(1 for block in blocks if not ref[block])

    def decref(self, block: int, keep_cached: bool = False) -> None:
        """One owner fewer. At zero the block is free: reused last when its K/V is worth
        keeping, else first. Raises InvalidArgumentError (nothing changed) on a double free."""
        self.release([block], {block} if keep_cached else None)

    def release(self, blocks: Sequence[int], cached: Container[int] | None = None) -> None:
        """One owner fewer for each of ``blocks`` (a block listed twice loses two owners).
        Blocks reaching zero are freed in list order: those in ``cached`` keep their K/V
        (reused last, in list order); the others are reused first, the last of them first.
        Checks every id and count before changing any: raises InvalidArgumentError on a
        double free or an unknown id, and then nothing has changed."""
        if self._needs_careful_check(blocks):
            self._check_release(blocks)
        self.release_owned(blocks, cached)

    def release_owned(self, blocks: Sequence[int], cached: Container[int] | None = None) -> None:
        """:meth:`release` for ids the caller guarantees are owned blocks, each listed once
        (a block table's own blocks): no checks, one plain loop (this is most of a free)."""
        ref = self._ref
        plain: list[int] = []
        keep = plain.append
        if cached:
            cached_tier = self._free.cached_tier
            for block in blocks:
                count = ref[block] - 1
                ref[block] = count
                if not count:
                    if block in cached:
                        cached_tier[block] = None  # reused last, least recently freed first
                    else:
                        keep(block)
        else:
            for block in blocks:
                count = ref[block] - 1
                ref[block] = count
                if not count:
                    keep(block)
        if plain:
            self._free.give_back_plain(plain)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def is_free(self, block: int) -> bool:
        self._check_id(block)
        return self._ref[block] == 0

    def free_blocks_in_eviction_order(self) -> list[int]:
        """Free blocks, the next to be reused first. O(n); for checks and tests."""
        return list(self._free)

    def integrity_problems(self) -> list[str]:
        """Recount every invariant; return a description of each violation (empty: fine)."""
        found = self._free.problems(self.num_blocks)
        queued = set(self._free)
        for block, ref in enumerate(self._ref):
            if ref < 0:
                found.append(f"block {block} has reference count {ref}")
            elif ref > 0 and block in queued:
                found.append(f"block {block} has {ref} owners but is in the free queue")
            elif ref == 0 and block not in queued:
                found.append(f"block {block} has no owner but is not in the free queue")
        return found

    # ---- checks ------------------------------------------------------------------------

    def _check_id(self, block: int) -> None:
        if type(block) is int and 0 <= block < self.num_blocks:
            return
        require_int("block", block, minimum=0, maximum=self.num_blocks - 1)
        raise InvalidArgumentError(f"block: {block!r} is not a plain int block id")

    def _needs_careful_check(self, blocks: Sequence[int]) -> bool:
        """False when C-speed scans prove every id is an owned int block listed once (the
        common case); then release needs no per-block validation pass."""
        if not blocks:
            return False
        try:
            return (
                len(set(blocks)) != len(blocks)
                or min(blocks) < 0
                or min(map(self._ref.__getitem__, blocks)) < 1  # IndexError past the end
                or set(map(type, blocks)) != {int}
            )
        except (IndexError, TypeError):
            return True

    def _check_release(self, blocks: Sequence[int]) -> None:
        pending: dict[int, int] = {}
        for block in blocks:
            self._check_id(block)
            pending[block] = pending.get(block, 0) + 1
        for block, count in pending.items():
            if self._ref[block] < count:
                raise InvalidArgumentError(
                    f"block {block}: released {count} time(s) but has {self._ref[block]} owner(s) (a double free); "
                    f"nothing was released"
                )
