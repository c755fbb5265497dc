"""A queue of free block ids with O(1) pop from the front, push to the back, and removal
from the middle.

The queue is a doubly linked list threaded through two arrays indexed by block id, so it
needs no node objects. Removal from the middle in O(1) is what prefix caching needs: a block
that was freed but still holds cached K/V sits in the queue until it is either evicted (popped
from the front, least recently freed first) or revived by a cache hit (removed wherever it is).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["FreeBlockQueue"]

_NONE = -1


class FreeBlockQueue:
    """Free block ids in eviction order: the front is evicted (reused) first."""

    def __init__(self, num_blocks: int, initially_free: bool = True):
        # _next[b] / _prev[b] link block b to its neighbours; _head/_tail are the ends.
        self._next = [_NONE] * num_blocks
        self._prev = [_NONE] * num_blocks
        self._in_queue = [False] * num_blocks
        self._head = _NONE
        self._tail = _NONE
        self._len = 0
        if initially_free:
            for block in range(num_blocks):
                self.push_back(block)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return self._in_queue[block]

    def __iter__(self) -> Iterator[int]:
        """Front to back. O(n); for checks and tests."""
        block = self._head
        while block != _NONE:
            yield block
            block = self._next[block]

    def push_back(self, block: int) -> None:
        """Append ``block`` at the back (evicted last). The caller guarantees it is not queued."""
        assert not self._in_queue[block], f"block {block} is already in the free queue"
        self._in_queue[block] = True
        self._prev[block] = self._tail
        self._next[block] = _NONE
        if self._tail == _NONE:
            self._head = block
        else:
            self._next[self._tail] = block
        self._tail = block
        self._len += 1

    def push_front(self, block: int) -> None:
        """Insert ``block`` at the front (evicted first). The caller guarantees it is not queued."""
        if self._head == _NONE:
            self.push_back(block)
            return
        assert not self._in_queue[block], f"block {block} is already in the free queue"
        self._in_queue[block] = True
        self._prev[block] = _NONE
        self._next[block] = self._head
        self._prev[self._head] = block
        self._head = block
        self._len += 1

    def pop_front(self) -> int:
        """Remove and return the front block. The caller checks the queue is not empty."""
        block = self._head
        assert block != _NONE, "pop_front on an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: int) -> None:
        """Unlink ``block`` from wherever it is. The caller guarantees it is queued."""
        assert self._in_queue[block], f"block {block} is not in the free queue"
        prev, nxt = self._prev[block], self._next[block]
        if prev == _NONE:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == _NONE:
            self._tail = prev
        else:
            self._prev[nxt] = prev
        self._prev[block] = self._next[block] = _NONE
        self._in_queue[block] = False
        self._len -= 1

    def check_links(self) -> list[str]:
        """Walk the list both ways; return a description of every broken link (empty: fine)."""
        found: list[str] = []
        limit = len(self._next) + 1  # a corrupted (cyclic) list must not hang the check
        forward: list[int] = []
        block = self._head
        while block != _NONE and len(forward) < limit:
            forward.append(block)
            block = self._next[block]
        if len(forward) != self._len:
            found.append(f"free queue walks {len(forward)} blocks but counts {self._len}")
        backward: list[int] = []
        block = self._tail
        while block != _NONE and len(backward) < limit:
            backward.append(block)
            block = self._prev[block]
        if backward[::-1] != forward:
            found.append("free queue's backward links disagree with its forward links")
        flagged = sum(self._in_queue)
        if flagged != len(forward) or not all(self._in_queue[b] for b in forward):
            found.append(f"{flagged} blocks flagged as queued but {len(forward)} reachable")
        return found
