"""Free block ids in reuse order, with O(1) take, give back, and removal from the middle.

Two tiers, reused in this order:

1. *plain* blocks, whose content nobody will look up again: a stack, so the most recently
   freed is reused first (its memory is likeliest still warm) and a batch of n blocks moves
   with one slice operation;
2. *cached* blocks, freed while still holding K/V the prefix cache may hand out again: an
   ordered dict in least-recently-freed-first order (LRU). Removal from the middle is O(1),
   which prefix caching needs: a cached free block is either evicted (taken from the front)
   or revived by a cache hit (removed wherever it is).

The queue holds ids only; the allocator owns reference counts and decides which tier a block
goes to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

__all__ = ["FreeBlockQueue"]


class FreeBlockQueue:
    """Free block ids; :meth:`take` hands out plain blocks first, then cached ones (LRU)."""

    def __init__(self, num_blocks: int):
        # The stack's end is reused first: block 0 first on a fresh pool.
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plain) + len(self._cached)

    def __iter__(self) -> Iterator[int]:
        """In reuse order. O(n); for checks and tests."""
        yield from reversed(self._plain)
        yield from self._cached

    @property
    def cached_tier(self) -> OrderedDict[int, None]:
        """The cached tier itself, for the allocator's hot loop: set ``tier[block] = None`` to
        give back a cached block (exactly :meth:`give_back_cached` of one block)."""
        return self._cached

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold cached K/V."""
        return len(self._cached)

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """Remove the next ``n`` blocks (the caller checks ``n <= len(self)``).

        Returns ``(blocks, evicted)``: every block in reuse order, and those of them that came
        from the cached tier (their cached content is about to be overwritten).
        """
        plain = self._plain
        if n <= len(plain):
            blocks = plain[len(plain) - n :]
            del plain[len(plain) - n :]
            blocks.reverse()
            return blocks, []
        blocks = plain[::-1]
        plain.clear()
        pop = self._cached.popitem
        evicted = [pop(last=False)[0] for _ in range(n - len(blocks))]
        return blocks + evicted, evicted

    def give_back_plain(self, blocks: list[int]) -> None:
        """Return blocks whose content is worthless; ``blocks[-1]`` is reused first (like
        pushing each to the front of a queue in turn)."""
        self._plain.extend(blocks)

    def give_back_cached(self, blocks: list[int]) -> None:
        """Return blocks that still hold cached K/V; each is reused after every plain block
        and after the cached blocks returned before it (list order)."""
        self._cached.update(dict.fromkeys(blocks))

    def remove(self, block: int) -> None:
        """Take ``block`` out wherever it is (a prefix-cache hit). O(1) for a cached block.
        The caller guarantees it is free."""
        if block in self._cached:
            del self._cached[block]
        else:
            self._plain.remove(block)  # O(n): plain blocks hold nothing to hit, so this is rare

    def problems(self, num_blocks: int) -> list[str]:
        """Every inconsistency: ids out of range or queued twice (empty: fine)."""
        everything = list(self)
        found = []
        if len(set(everything)) != len(everything):
            found.append(f"free queue holds a block twice: {len(everything)} entries, {len(set(everything))} distinct")
        bad = [b for b in everything if not 0 <= b < num_blocks]
        if bad:
            found.append(f"free queue holds ids outside [0, {num_blocks}): {bad[:5]}")
        return found
