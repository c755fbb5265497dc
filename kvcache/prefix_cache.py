"""Prefix caching: find full blocks whose K/V another sequence already computed.

A full block is identified by a chained key ``(parent, tokens, extra)``: ``parent`` names the
exact filling of the previous block as ``(block id, generation)``, ``tokens`` are this block's
token ids and ``extra`` is a caller's key (an adapter id, a salt). Keys are compared by
equality, not by a digest, so two different prefixes can never share a key: a hash collision
cannot hand out the wrong K/V. The generation grows whenever a block is refilled, so a key
whose parent block was evicted and reused can no longer be reached.

The cache only indexes blocks; the allocator owns them. A cached block with no owner waits in
the allocator's free queue (least recently freed in front) until it is revived by a hit or
evicted by an allocation, at which point :meth:`PrefixCache.forget` drops its key.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvcache.allocator import BlockAllocator

__all__ = ["ROOT", "BlockKey", "PrefixCache"]

#: ``(parent block, parent generation, token ids, extra key)``.
BlockKey = tuple[int, int, tuple[int, ...], Hashable]
#: The parent of a sequence's first block.
ROOT: tuple[int, int] = (-1, 0)


class PrefixCache:
    """Maps block keys to the block holding that K/V, and counts hits and evictions."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        allocator.on_reuse = self.forget
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._block_of)

    def parent_of(self, block: int) -> tuple[int, int]:
        """The parent name a key uses for ``block``: its id and current generation."""
        return (block, self.allocator.generation(block))

    def key(self, parent: tuple[int, int], tokens: Sequence[int], extra: Hashable) -> BlockKey:
        assert len(tokens) == self.block_size, "only full blocks are cached"
        return (parent[0], parent[1], tuple(tokens), extra)

    def match(self, token_ids: Sequence[int], extra: Hashable) -> list[int]:
        """The blocks holding the longest cached run of full blocks of ``token_ids``.

        Changes nothing (counting queries and hits is :meth:`record_query`'s job).
        """
        found: list[int] = []
        parent = ROOT
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = self._block_of.get(self.key(parent, token_ids[start : start + bs], extra))
            if block is None:
                break
            found.append(block)
            parent = self.parent_of(block)
        return found

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def insert(self, block: int, key: BlockKey) -> bool:
        """Index ``block`` under ``key``. Returns False (and indexes nothing) when another block
        already holds that key or ``block`` is already indexed."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def cached_blocks(self) -> list[int]:
        """Every indexed block (in use or free)."""
        return list(self._key_of)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def forget(self, block: int) -> None:
        """Drop ``block``'s key: it is being refilled. Counts an eviction if it had one."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            self.evictions += 1

    def reset(self) -> int:
        """Forget every key (blocks in use keep their K/V but can no longer be shared).
        Returns how many keys were dropped."""
        dropped = len(self._block_of)
        self._block_of.clear()
        self._key_of.clear()
        return dropped

    def integrity_problems(self) -> list[str]:
        found = []
        if len(self._block_of) != len(self._key_of):
            found.append(f"prefix cache maps {len(self._block_of)} keys but {len(self._key_of)} blocks")
        for key, block in self._block_of.items():
            if self._key_of.get(block) != key:
                found.append(f"prefix cache key of block {block} does not map back to it")
        return found
