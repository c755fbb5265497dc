"""The block manager: one block table per sequence, over a shared block allocator.

Check, then act: every ``can_*`` method changes nothing, and every acting method either does
all of its work or raises and leaves the state exactly as it was.

Invariant that keeps appends simple: a block shared by several owners is always *full*. Forks
copy a partly filled last block at once (the copy is returned for the caller to perform) and
prefix-cache hits are full blocks, so an append never writes into a shared block and never
needs copy-on-write.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvcache.allocator import BlockAllocator
from kvcache.errors import KVCacheError, OutOfBlocksError, SequenceExistsError, UnknownSequenceError
from kvcache.prefix_cache import ROOT, PrefixCache

if TYPE_CHECKING:
    from kvcache.metrics import CacheStats

__all__ = ["BlockCopy", "BlockManager", "IntegrityError", "SequenceBlocks", "SwapTarget"]

#: ``(source block, destination block)``: a copy the caller performs on the cache tensors.
BlockCopy = tuple[int, int]


class SwapTarget(Protocol):
    """What ``preempt(mode="swap")`` needs: anything with ``swap_out(seq_id)``."""

    def swap_out(self, seq_id: Hashable) -> object: ...


class IntegrityError(KVCacheError, AssertionError):
    """``check_integrity`` found the bookkeeping inconsistent; the message lists each count."""


@dataclass
class SequenceBlocks:
    """One sequence's block table and token counts."""

    blocks: list[int]
    #: Token slots reserved (the sequence's length once all its tokens are computed).
    num_tokens: int
    #: Token ids, kept only for prefix-cached sequences (to key their full blocks).
    token_ids: list[int] | None = None
    extra_key: Hashable = None
    #: Leading tokens whose K/V has been written (see ``mark_computed``).
    num_computed: int = 0
    #: Leading full blocks already indexed in (or taken from) the prefix cache.
    num_indexed_blocks: int = 0


class BlockManager:
    """Per-sequence block tables over a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size: {block_size} must be at least 1")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache = PrefixCache(self.allocator, block_size) if enable_prefix_caching else None
        self._seqs: dict[Hashable, SequenceBlocks] = {}
        # Blocks kept alive by someone other than a block table (a swap-out copy in flight).
        self._holds: dict[int, int] = {}
        #: Preemptions by mode, counted by ``preempt``.
        self.preemptions: dict[str, int] = {"recompute": 0, "swap": 0}

    # ---- queries (change nothing) ------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def sequence(self, seq_id: Hashable) -> SequenceBlocks:
        """The live record of ``seq_id`` (read it, don't modify it)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self.sequence(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.sequence(seq_id).num_tokens

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slot ids (``block * block_size + offset``) of token positions ``[start, end)``."""
        seq = self.sequence(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"positions [{start}, {end}) are outside sequence {seq_id!r}'s "
                f"{seq.num_tokens} reserved tokens; append_slots first"
            )
        bs, blocks = self.block_size, seq.blocks
        return [blocks[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def can_allocate(
        self,
        num_tokens: int | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        extra_key: Hashable = None,
    ) -> bool:
        """Whether ``allocate`` with these arguments would succeed. Changes nothing."""
        num_tokens = _resolve_length(num_tokens, token_ids)
        hits = self._prefix_hits(token_ids, extra_key)
        return self.allocator.num_free >= self._free_blocks_needed(num_tokens, hits)

    def can_append(self, seq_id: Hashable, n: int = 1) -> bool:
        """Whether ``append_slots(seq_id, n)`` would succeed. Changes nothing."""
        seq = self.sequence(seq_id)
        return self.allocator.can_allocate(self.blocks_for(seq.num_tokens + n) - len(seq.blocks))

    def can_fork(self, parent_id: Hashable) -> bool:
        """Whether ``fork(parent_id, ...)`` would succeed. Changes nothing."""
        seq = self.sequence(parent_id)
        return seq.num_tokens % self.block_size == 0 or self.allocator.can_allocate(1)

    # ---- actions (all or nothing) ------------------------------------------------------

    def allocate(
        self,
        seq_id: Hashable,
        num_tokens: int | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        extra_key: Hashable = None,
    ) -> int:
        """Create ``seq_id`` with room for ``num_tokens`` tokens (or ``len(token_ids)``).

        With prefix caching and ``token_ids``, the longest run of cached full blocks is shared
        instead of allocated; the last token is never taken from the cache (its logits are
        needed). Returns how many leading tokens are already computed (0 without a hit).
        Raises SequenceExistsError or OutOfBlocksError and changes nothing.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(seq_id)
        num_tokens = _resolve_length(num_tokens, token_ids)
        hits = self._prefix_hits(token_ids, extra_key)
        needed = self._free_blocks_needed(num_tokens, hits)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(needed, self.allocator.num_free, f"allocate sequence {seq_id!r}")
        for block in hits:
            if self.allocator.is_free(block):
                self.allocator.revive(block)
            else:
                self.allocator.incref(block)
        blocks = hits + self.allocator.allocate(self.blocks_for(num_tokens) - len(hits))
        cached_tokens = len(hits) * self.block_size
        tracked = self.prefix_cache is not None and token_ids is not None
        if tracked:
            assert self.prefix_cache is not None
            self.prefix_cache.record_query(num_tokens, cached_tokens)
        self._seqs[seq_id] = SequenceBlocks(
            blocks=blocks,
            num_tokens=num_tokens,
            token_ids=list(token_ids) if tracked and token_ids is not None else None,
            extra_key=extra_key,
            num_computed=cached_tokens,
            num_indexed_blocks=len(hits),
        )
        return cached_tokens

    def append_slots(
        self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None
    ) -> list[int]:
        """Reserve ``n`` more tokens for ``seq_id``; return their slot ids.

        ``token_ids`` (length ``n``) are required for a prefix-cached sequence. Raises
        OutOfBlocksError (nothing changed) when the new blocks are not free.
        """
        seq = self.sequence(seq_id)
        if n < 1:
            raise ValueError(f"n: {n} must be at least 1")
        if seq.token_ids is not None and (token_ids is None or len(token_ids) != n):
            got = "none" if token_ids is None else len(token_ids)
            raise ValueError(
                f"token_ids: sequence {seq_id!r} is prefix-cached, so append_slots needs "
                f"the {n} new token ids (got {got})"
            )
        new_blocks = self.blocks_for(seq.num_tokens + n) - len(seq.blocks)
        if new_blocks > self.allocator.num_free:
            raise OutOfBlocksError(new_blocks, self.allocator.num_free, f"append to {seq_id!r}")
        seq.blocks.extend(self.allocator.allocate(new_blocks))
        start = seq.num_tokens
        seq.num_tokens += n
        if seq.token_ids is not None and token_ids is not None:
            seq.token_ids.extend(token_ids)
        return self.slots(seq_id, start, seq.num_tokens)

    def mark_computed(self, seq_id: Hashable, num_computed: int) -> None:
        """Record that the K/V of the first ``num_computed`` tokens is written.

        With prefix caching, full blocks inside that range become shareable from now on.
        """
        seq = self.sequence(seq_id)
        if not seq.num_computed <= num_computed <= seq.num_tokens:
            raise ValueError(
                f"num_computed: {num_computed} must lie in [{seq.num_computed}, "
                f"{seq.num_tokens}] for sequence {seq_id!r}"
            )
        seq.num_computed = num_computed
        cache = self.prefix_cache
        if cache is None or seq.token_ids is None:
            return
        bs = self.block_size
        full = min(num_computed, len(seq.token_ids)) // bs
        for i in range(seq.num_indexed_blocks, full):
            parent = ROOT if i == 0 else cache.parent_of(seq.blocks[i - 1])
            key = cache.key(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_key)
            cache.insert(seq.blocks[i], key)
        seq.num_indexed_blocks = max(seq.num_indexed_blocks, full)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[BlockCopy]:
        """Make ``child_id`` share ``parent_id``'s blocks.

        Full blocks are shared by reference count. A partly filled last block is copied now
        (so no shared block is ever written): the returned ``(src, dst)`` pairs are the block
        copies the caller must perform on every layer's K and V before the next write.
        Raises UnknownSequenceError, SequenceExistsError or OutOfBlocksError; changes nothing.
        """
        parent = self.sequence(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(child_id)
        partial = parent.num_tokens % self.block_size != 0
        if partial and not self.allocator.can_allocate(1):
            raise OutOfBlocksError(1, self.allocator.num_free, f"fork {parent_id!r}")
        shared = parent.blocks[:-1] if partial else parent.blocks
        for block in shared:
            self.allocator.incref(block)
        copies: list[BlockCopy] = []
        blocks = list(shared)
        if partial:
            (dst,) = self.allocator.allocate(1)
            copies.append((parent.blocks[-1], dst))
            blocks.append(dst)
        self._seqs[child_id] = _copy_of(parent, blocks, num_indexed_blocks=min(parent.num_indexed_blocks, len(shared)))
        return copies

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``'s blocks. Cached blocks stay indexed until evicted; the tail is
        queued for eviction before the head, since a later request is likelier to share the
        head. Raises UnknownSequenceError (nothing changed)."""
        self.detach(seq_id)

    def detach(self, seq_id: Hashable) -> SequenceBlocks:
        """Remove ``seq_id`` and release its blocks, returning its record (with the block ids
        it held) so that :meth:`attach` can bring it back later, e.g. after a swap."""
        seq = self.sequence(seq_id)
        del self._seqs[seq_id]
        self._release(seq.blocks)
        return seq

    def attach(self, seq_id: Hashable, record: SequenceBlocks) -> list[int]:
        """Re-create ``seq_id`` from a detached ``record`` in fresh blocks; returns them.

        Its tokens count as computed once the caller has copied the K/V back; its full blocks
        are indexed in the prefix cache again at the next :meth:`mark_computed`. Raises
        SequenceExistsError or OutOfBlocksError; changes nothing then.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(seq_id)
        blocks = self.allocator.allocate(self.blocks_for(record.num_tokens))
        self._seqs[seq_id] = _copy_of(record, blocks, num_indexed_blocks=0)
        return list(blocks)

    def preempt(self, seq_id: Hashable, mode: str = "recompute", swap_space: SwapTarget | None = None) -> None:
        """Take ``seq_id``'s blocks back from a running sequence.

        ``recompute``: its blocks are freed; the caller re-admits it later and recomputes its
        K/V (prompt + generated tokens). ``swap``: its K/V is copied to ``swap_space`` (a
        :class:`kvcache.swap.SwapSpace`) and comes back with ``swap_space.swap_in``.
        Raises UnknownSequenceError, ValueError for a bad mode, OutOfBlocksError when the
        swap space is full; changes nothing then.
        """
        if mode == "recompute":
            self.free(seq_id)
        elif mode == "swap":
            if swap_space is None:
                raise ValueError("swap_space: preempt(mode='swap') needs the SwapSpace to copy into")
            swap_space.swap_out(seq_id)
        else:
            raise ValueError(f"mode: {mode!r} is not a preemption mode; use 'recompute' or 'swap'")
        self.preemptions[mode] += 1

    def hold(self, blocks: Iterable[int]) -> None:
        """Keep ``blocks`` allocated without a block table (e.g. while a copy reads them)."""
        for block in blocks:
            self.allocator.incref(block)
            self._holds[block] = self._holds.get(block, 0) + 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop holds taken with :meth:`hold`."""
        blocks = list(blocks)
        for block in blocks:
            count = self._holds.get(block, 0)
            assert count > 0, f"release of block {block}, which is not held"
            if count == 1:
                del self._holds[block]
            else:
                self._holds[block] = count - 1
        self._release(blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block key; returns how many were dropped (0 without caching)."""
        if self.prefix_cache is None:
            return 0
        dropped = self.prefix_cache.reset()
        for seq in self._seqs.values():
            seq.num_indexed_blocks = 0
        return dropped

    def stats(self, swap_space: SwapTarget | None = None) -> CacheStats:
        """A metrics snapshot (see :mod:`kvcache.metrics`)."""
        from kvcache.metrics import collect_stats  # metrics imports this module

        return collect_stats(self, swap_space)  # type: ignore[arg-type]

    # ---- checks ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recount every invariant from scratch. Raises IntegrityError listing each mismatch."""
        found = self.allocator.integrity_problems()
        if self.prefix_cache is not None:
            found += self.prefix_cache.integrity_problems()
        owners = [0] * self.num_blocks
        for block, count in self._holds.items():
            owners[block] += count
        for seq_id, seq in self._seqs.items():
            found += self._sequence_problems(seq_id, seq)
            for block in seq.blocks:
                owners[block] += 1
        for block, count in enumerate(owners):
            ref = self.allocator.ref_count(block)
            if ref != count:
                found.append(
                    f"block {block}: reference count {ref}, but {count} block tables and holds have it"
                )
        if found:
            raise IntegrityError(f"{len(found)} integrity problem(s):\n  " + "\n  ".join(found))

    # ---- internals ---------------------------------------------------------------------

    def _sequence_problems(self, seq_id: Hashable, seq: SequenceBlocks) -> list[str]:
        found = []
        want = self.blocks_for(seq.num_tokens)
        if len(seq.blocks) != want:
            found.append(f"sequence {seq_id!r}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens (want {want})")
        if len(set(seq.blocks)) != len(seq.blocks):
            found.append(f"sequence {seq_id!r} holds a block twice: {seq.blocks}")
        if seq.token_ids is not None and len(seq.token_ids) != seq.num_tokens:
            found.append(f"sequence {seq_id!r}: {len(seq.token_ids)} token ids for {seq.num_tokens} tokens")
        last_partial = seq.num_tokens % self.block_size != 0
        if seq.blocks and last_partial and self.allocator.ref_count(seq.blocks[-1]) > 1:
            found.append(f"sequence {seq_id!r}: partly filled last block {seq.blocks[-1]} is shared")
        return found

    def _release(self, blocks: Iterable[int]) -> None:
        cache = self.prefix_cache
        for block in reversed(list(blocks)):
            self.allocator.decref(block, keep_cached=cache is not None and cache.is_cached(block))

    def _prefix_hits(self, token_ids: Sequence[int] | None, extra_key: Hashable) -> list[int]:
        if self.prefix_cache is None or token_ids is None or len(token_ids) == 0:
            return []
        # Match over all tokens but the last: its logits are needed, so it is always computed.
        return self.prefix_cache.match(token_ids[: len(token_ids) - 1], extra_key)

    def _free_blocks_needed(self, num_tokens: int, hits: list[int]) -> int:
        """New blocks, plus the hits that must be taken out of the free queue."""
        revived = sum(1 for block in hits if self.allocator.is_free(block))
        return self.blocks_for(num_tokens) - len(hits) + revived


def _copy_of(record: SequenceBlocks, blocks: list[int], num_indexed_blocks: int) -> SequenceBlocks:
    """A new record with ``record``'s tokens over ``blocks`` (a fork, or a swap-in)."""
    return SequenceBlocks(
        blocks=blocks,
        num_tokens=record.num_tokens,
        token_ids=list(record.token_ids) if record.token_ids is not None else None,
        extra_key=record.extra_key,
        num_computed=record.num_computed,
        num_indexed_blocks=num_indexed_blocks,
    )


def _resolve_length(num_tokens: int | None, token_ids: Sequence[int] | None) -> int:
    if token_ids is not None:
        if num_tokens is not None and num_tokens != len(token_ids):
            raise ValueError(
                f"num_tokens: {num_tokens} disagrees with len(token_ids) = {len(token_ids)}; "
                f"pass one of them"
            )
        num_tokens = len(token_ids)
    if num_tokens is None or num_tokens < 1:
        raise ValueError(f"num_tokens: {num_tokens} must be at least 1 (or pass token_ids)")
    return num_tokens
