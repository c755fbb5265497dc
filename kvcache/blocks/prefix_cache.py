"""Prefix caching: find full blocks whose K/V another sequence already computed.

A full block is identified by its *content*: a :class:`BlockKey` holds the block's token ids,
a caller's extra key (an adapter id, a salt) and the key of the block before it, so a key
stands for the whole prefix up to and including its block, whichever physical blocks hold
that prefix. Two requests sharing a system prompt therefore key their later blocks alike even
when they were admitted in the same step and computed the prompt twice.

Lookups hash the chain with a per-process seeded hash (computed once per key), but equality
compares tokens and extra keys exactly, link by link, so a hash collision can never hand out
the wrong K/V. Each key also has a stable digest (BLAKE2b, :mod:`kvcache.blocks.digest`), the
same in every process, by which events and lower tiers name blocks.

The cache only indexes blocks; the allocator owns them. A cached block with no owner waits in
the allocator's free queue (least recently freed first) until it is revived by a hit or
evicted by an allocation, at which point :meth:`PrefixCache.forget` drops it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable, Sequence

from attention.metadata import PAD_BLOCK
from kvcache.blocks.digest import ROOT_DIGEST, block_digest, encode_salt, pack_ids
from kvcache.blocks.events import DEVICE_TIER, KVEventStream

__all__ = ["BlockKey", "PrefixCache"]


class BlockKey:
    """The content of one full block and of every block before it (see the module docstring).
    Immutable.

    Its hash, computed at construction, mixes the parent's hash with Python's seeded hash of
    the token ids' bytes (SipHash, keyed per process), so clients cannot craft prompts whose
    blocks collide in the index. Its :attr:`digest`, the stable name of the block outside this
    process (:mod:`kvcache.blocks.digest`), is computed the first time it is asked for (events,
    lower tiers) and kept. ``extra`` must have a stable encoding
    (:func:`kvcache.blocks.digest.encode_salt`)."""

    __slots__ = ("_digest", "_hash", "extra", "parent", "tokens")
    _hash: int
    _digest: bytes | None

    def __init__(self, parent: BlockKey | None, tokens: tuple[int, ...], extra: Hashable):
        self.parent = parent
        self.tokens = tokens
        self.extra = extra
        self._digest = None
        self._hash = hash((0 if parent is None else parent._hash, hash(pack_ids(tokens)), extra))

    @property
    def digest(self) -> bytes:
        """The stable digest of this block and its whole prefix (16 bytes)."""
        if self._digest is None:
            chain: list[BlockKey] = []
            key: BlockKey | None = self
            while key is not None and key._digest is None:  # a loop: chains can be long
                chain.append(key)
                key = key.parent
            parent = ROOT_DIGEST if key is None or key._digest is None else key._digest
            for link in reversed(chain):
                parent = link._digest = block_digest(parent, link.tokens, encode_salt(link.extra))
        return self._digest  # type: ignore[return-value]

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        a: BlockKey | None = self
        b: BlockKey | None = other
        # Walk both chains; links built from the cache's own keys are the same objects, so
        # the walk usually stops after one step. A loop, not recursion: chains can be long.
        while a is not b:
            if a is None or b is None or a._hash != b._hash or a.tokens != b.tokens or a.extra != b.extra:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockKey(tokens={self.tokens!r}, extra={self.extra!r}, has_parent={self.parent is not None})"


class PrefixCache:
    """Maps block keys to the block holding that K/V, and counts queries, hits, evictions.

    Each key has at most one *holder* block that lookups return. A block computed with the
    same content as a held key (two requests admitted together) is a *duplicate*: it is not
    returned by lookups, but takes over as holder if the holder is evicted while it lives.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._holder: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._duplicates: dict[BlockKey, set[int]] = {}
        self._duplicate_key: dict[int, BlockKey] = {}
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        #: Grows whenever the index changes (a memoised lookup is stale then).
        self.version = 0
        #: Where stored and removed keys are published (the manager's ``kv_events``).
        self.events: KVEventStream | None = None
        #: Called with ``(key, block)`` when an eviction drops a key's last device copy (a
        #: lower tier keeps it: :mod:`kvcache.blocks.tiers`).
        self.demote: Callable[[BlockKey, int], None] | None = None
        self._memo: tuple[int, int, Hashable, list[int], tuple[int, ...], tuple[BlockKey, ...]] | None = None

    def __len__(self) -> int:
        """Keys indexed (one holder block each)."""
        return len(self._holder)

    # ---- lookups (change nothing) ------------------------------------------------------

    def match(
        self, token_ids: Sequence[int], extra: Hashable, limit: int | None = None
    ) -> tuple[list[int], list[BlockKey]]:
        """The holder blocks of the longest cached run of full blocks of ``token_ids[:limit]``,
        and their keys. Changes nothing (counting is :meth:`record_query`'s job).

        A scheduler asks twice for the same prompt (``can_allocate``, then ``allocate``): the
        last answer is kept with the tokens it read and reused while the index is unchanged
        and those tokens are equal, so the second ask compares lists instead of hashing."""
        end = len(token_ids) if limit is None else limit
        memo = self._memo
        if memo is not None and memo[0] == self.version and memo[1] == end and memo[2] == extra:
            read = memo[3]
            if token_ids[: len(read)] == read:
                return list(memo[4]), list(memo[5])
        blocks: list[int] = []
        keys: list[BlockKey] = []
        parent: BlockKey | None = None
        bs = self.block_size
        holder, key_of = self._holder, self._key_of
        read_end = end
        for start in range(0, end - bs + 1, bs):
            block = holder.get(BlockKey(parent, tuple(token_ids[start : start + bs]), extra))
            if block is None:
                read_end = start + bs
                break
            parent = key_of[block]  # the stored key: later links compare by identity
            blocks.append(block)
            keys.append(parent)
        self._memo = (self.version, end, extra, list(token_ids[:read_end]), tuple(blocks), tuple(keys))
        return blocks, keys

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is the holder of a key (a lookup can return it)."""
        return block in self._key_of

    def cached_blocks(self) -> list[int]:
        """Every holder block (in use or free)."""
        return list(self._key_of)

    # ---- updates -----------------------------------------------------------------------

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def index(
        self,
        blocks: Sequence[int],
        keys: list[BlockKey],
        token_ids: Sequence[int],
        extra: Hashable,
        num_full: int,
        base: int = 0,
    ) -> None:
        """Key a sequence's full blocks ``len(keys) .. num_full - 1`` and append their keys to
        ``keys`` (the sequence's list of its blocks' keys, extended in place); ``token_ids``
        starts at position ``base`` (ids of blocks keyed before may have been dropped).

        A block whose key is already held by another block becomes a duplicate; either way
        the key appended is the stored one, so the chain continues from it. A ``PAD_BLOCK``
        entry (released behind a sliding window before its ids were known) gets its key, which
        the chain needs, but nothing is indexed for it.
        """
        bs = self.block_size
        for i in range(len(keys), num_full):
            key = BlockKey(keys[-1] if keys else None, tuple(token_ids[i * bs - base : (i + 1) * bs - base]), extra)
            keys.append(key if blocks[i] == PAD_BLOCK else self.adopt(key, blocks[i]))

    @property
    def holders(self) -> Container[int]:
        """The holder blocks, for fast membership tests (a live view)."""
        return self._key_of.keys()

    @property
    def has_duplicates(self) -> bool:
        return bool(self._duplicate_key)

    def adopt(self, key: BlockKey, block: int) -> BlockKey:
        """Index ``block``, which holds ``key``'s K/V (computed, or filled from a lower tier);
        returns the stored key: ``key``, or the equal key another block holds already (``block``
        is a duplicate of that holder then)."""
        holder = self._holder.get(key)
        if holder is None:
            self._holder[key] = block
            self._key_of[block] = key
            self.version += 1
            if self.events is not None:
                self.events.stored(DEVICE_TIER, key)
            return key
        stored = self._key_of[holder]
        if holder != block:
            self._duplicates.setdefault(stored, set()).add(block)
            self._duplicate_key[block] = stored
        return stored

    def holds_key(self, key: BlockKey) -> bool:
        """Whether a device block holds ``key`` (a lookup can return it)."""
        return key in self._holder

    def holder_of(self, key: BlockKey) -> tuple[int, BlockKey] | None:
        """The block holding ``key`` and the stored key, or None. Changes nothing."""
        block = self._holder.get(key)
        return None if block is None else (block, self._key_of[block])

    def drop_duplicates(self, blocks: Iterable[int]) -> None:
        """Called before ``blocks`` lose their last owner: a duplicate among them is forgotten
        (nothing can look it up, so its K/V is not worth keeping)."""
        for block in blocks:
            key = self._duplicate_key.pop(block, None)
            if key is not None:
                self._drop_duplicate(key, block)

    def forget(self, block: int, *, evicted: bool = True) -> None:
        """Drop ``block`` from the index: it is being refilled with other content. Counts an
        eviction if it held a key (unless ``evicted`` is False: its owner rewrites it, as a
        truncated sequence does); a live duplicate of that key takes over. A duplicate
        ``block`` just stops being one."""
        key = self._key_of.pop(block, None)
        if key is None:
            dupe_of = self._duplicate_key.pop(block, None)
            if dupe_of is not None:
                self._drop_duplicate(dupe_of, block)
            return
        self.version += 1
        del self._holder[key]
        self.evictions += evicted
        dupes = self._duplicates.get(key)
        if dupes:
            heir = dupes.pop()
            del self._duplicate_key[heir]
            if not dupes:
                del self._duplicates[key]
            self._holder[key] = heir
            self._key_of[heir] = key
        else:
            if evicted and self.demote is not None:
                self.demote(key, block)
            if self.events is not None:
                self.events.removed(DEVICE_TIER, key)

    def reset(self) -> int:
        """Forget every key (blocks in use keep their K/V). Returns how many were dropped."""
        dropped = len(self._holder)
        self.version += 1
        self._holder.clear()
        self._key_of.clear()
        self._duplicates.clear()
        self._duplicate_key.clear()
        if self.events is not None:
            self.events.cleared(DEVICE_TIER)
        return dropped

    def held_keys(self) -> list[BlockKey]:
        """Every key held (one holder block each)."""
        return list(self._holder)

    def integrity_problems(self) -> list[str]:
        found = []
        if len(self._holder) != len(self._key_of):
            found.append(f"prefix cache maps {len(self._holder)} keys but {len(self._key_of)} holder blocks")
        for key, block in self._holder.items():
            if self._key_of.get(block) is not key:
                found.append(f"prefix cache key of block {block} does not map back to it")
        for block, key in self._duplicate_key.items():
            if block in self._key_of:
                found.append(f"block {block} is both a holder and a duplicate")
            if block not in self._duplicates.get(key, ()):
                found.append(f"duplicate block {block} is missing from its key's set")
        return found

    def _drop_duplicate(self, key: BlockKey, block: int) -> None:
        dupes = self._duplicates[key]
        dupes.discard(block)
        if not dupes:
            del self._duplicates[key]
