"""The block manager: one block table per sequence, over a shared block allocator.

Check, then act: every ``can_*`` method changes nothing and agrees with its action for every
input (both raise the same error for an invalid argument); every acting method checks all of
its arguments first, then either does all of its work or raises and leaves the state exactly
as it was.

Invariant that keeps appends simple: a block shared by several owners is always *full*. Forks
copy a partly filled last block at once (the copy is returned for the caller to perform) and
prefix-cache hits are full blocks, so an append never writes into a shared block; a
:meth:`BlockManager.truncate` that ends inside a shared block copies it first.

With a sliding window (every layer windowed), blocks that no future query can see are
released as soon as :meth:`commit` passes them; their table entries become ``PAD_BLOCK``
(:mod:`kvcache.blocks.window`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Literal

from attention.checks import cdiv, require_int
from attention.errors import ArgumentTypeError, IntegrityError, InvalidArgumentError, OutOfBlocksError
from attention.metadata import PAD_BLOCK
from kvcache.blocks.admission import plan_admission
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.events import DEVICE_TIER, KVEventStream
from kvcache.blocks.fork import share_blocks
from kvcache.blocks.holds import BlockHolds
from kvcache.blocks.integrity import integrity_problems
from kvcache.blocks.prefix_cache import BlockKey, PrefixCache
from kvcache.blocks.release import release_blocks
from kvcache.blocks.rows import ScheduledRow, checked_computed, computed_after
from kvcache.blocks.sequence import BlockCopy, SequenceBlocks, SequenceTable, checked_record
from kvcache.blocks.tiers import LowerTier
from kvcache.blocks.tokens import appended_ids, token_list
from kvcache.blocks.truncation import cut_token_ids, plan_truncation
from kvcache.blocks.window import release_behind_window

__all__ = ["BlockCopy", "BlockManager", "FreeReason"]

FreeReason = Literal["finished", "aborted", "preempted"]
_REASONS = ("finished", "aborted", "preempted")


class BlockManager(SequenceTable):
    """Per-sequence block tables over a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    enable_prefix_caching: share full blocks whose content (and whole prefix) matches.
    sliding_window: tokens each query sees when *every* layer is windowed (None otherwise):
                    blocks behind the window are released as the sequence advances.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        *,
        sliding_window: int | None = None,
        allocator: BlockAllocator | None = None,
    ):
        """``allocator``: a pool shared with other managers (the KV groups of a hybrid model,
        :mod:`kvcache.blocks.hybrid`), of ``num_blocks`` blocks; its owner routes evictions to
        this manager's prefix cache. Default: a pool of its own."""
        self.block_size = require_int("block_size", block_size, minimum=1, maximum=1 << 20)
        if not isinstance(enable_prefix_caching, bool):
            raise ArgumentTypeError(
                f"enable_prefix_caching: expected a bool, got {type(enable_prefix_caching).__name__}"
            )
        self.sliding_window = (
            None if sliding_window is None else require_int("sliding_window", sliding_window, minimum=1)
        )
        self.prefix_cache = PrefixCache(self.block_size) if enable_prefix_caching else None
        if allocator is None:
            allocator = BlockAllocator(num_blocks, None if self.prefix_cache is None else self.prefix_cache.forget)
        elif not isinstance(allocator, BlockAllocator) or allocator.num_blocks != num_blocks:
            raise InvalidArgumentError(
                f"allocator: expected a BlockAllocator of {num_blocks} blocks, got {allocator!r:.80}"
            )
        self.allocator = allocator
        super().__init__()
        #: Blocks kept alive by someone other than a block table (a swap-out copy in flight).
        self.holds = BlockHolds(self.allocator)
        #: Sequences given up to make room, by how (``free(reason="preempted")`` counts
        #: "recompute"; a swap-out counts "swap").
        self.preemptions: dict[str, int] = {"recompute": 0, "swap": 0}
        #: What the prefix cache stores and removes, for routers (:mod:`kvcache.blocks.events`;
        #: nothing is published without prefix caching).
        self.kv_events = KVEventStream(self._tier_contents)
        if self.prefix_cache is not None:
            self.prefix_cache.events = self.kv_events
        #: Where evicted cached blocks go and admission looks next (:meth:`attach_tier`).
        self.lower_tier: LowerTier | None = None
        self._window_lag = 0

    @property
    def window_lag(self) -> int:
        """Computed tokens a later :meth:`truncate` may take back (an engine sets the most
        draft tokens a row carries): a sliding window releases only the blocks that a query
        this many tokens earlier no longer sees, so the query after a rollback finds its whole
        window. 0 without drafts; setting anything but an int >= 0 raises (nothing changed)."""
        return self._window_lag

    @window_lag.setter
    def window_lag(self, tokens: int) -> None:
        self._window_lag = require_int("window_lag", tokens, minimum=0)

    # ---- queries (change nothing) ------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens. Raises ArgumentTypeError / InvalidArgumentError
        naming ``num_tokens`` for a non-integer or a negative count."""
        if type(num_tokens) is not int or num_tokens < 0:  # (the hot path: a plain int, checked once)
            num_tokens = require_int("num_tokens", num_tokens, minimum=0)
        return cdiv(num_tokens, self.block_size)

    def can_allocate(
        self, num_tokens: int | None = None, *, token_ids: Sequence[int] | None = None, extra_key: Hashable = None
    ) -> bool:
        """Whether ``allocate`` with these arguments would succeed (for a new id). Changes
        nothing; raises the same argument errors as ``allocate``."""
        admission = plan_admission(
            self.allocator, self.prefix_cache, self.block_size, num_tokens, token_ids, extra_key, self.lower_tier
        )
        return self.allocator.num_free >= admission.needed

    def can_append(self, seq_id: Hashable, n: int = 1) -> bool:
        """Whether ``append_slots(seq_id, n)`` would succeed. Changes nothing; raises the same
        argument errors as ``append_slots``."""
        seq = self.sequence(seq_id)
        n = require_int("n", n, minimum=1)
        return self.allocator.num_free >= self.blocks_for(seq.num_tokens + n) - len(seq.blocks)

    def can_fork(self, parent_id: Hashable) -> bool:
        """Whether ``fork(parent_id, ...)`` would succeed. Changes nothing."""
        seq = self.sequence(parent_id)
        return seq.num_tokens % self.block_size == 0 or self.allocator.num_free >= 1

    def can_truncate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether ``truncate(seq_id, num_tokens)`` would succeed (it needs one free block
        when the new last block is shared). Changes nothing; raises the same argument errors
        as ``truncate``."""
        seq = self.sequence(seq_id)
        plan = plan_truncation(seq, seq_id, num_tokens, self.block_size, self.allocator)
        return self.allocator.num_free >= plan.blocks_needed

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
        instead of allocated, and continued from a lower tier (:meth:`attach_tier`) into fresh
        blocks the tier fills; the last token is never taken from the cache (its logits are
        needed). Returns how many leading tokens are already computed (0 without a hit).
        Raises SequenceExistsError, OutOfBlocksError or an argument error; changes nothing then.
        """
        self.check_new_id(seq_id)
        num_tokens, tokens, hits, keys, needed, lower_keys, lower = plan_admission(
            self.allocator, self.prefix_cache, self.block_size, num_tokens, token_ids, extra_key, self.lower_tier
        )
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(needed, self.allocator.num_free, f"allocate sequence {seq_id!r:.60}")
        self.allocator.share(hits)  # holder blocks from the index: valid and distinct
        if lower and self.lower_tier is not None and self.prefix_cache is not None:
            # Taking fresh blocks may evict device blocks into the tier: keep our hits there.
            self.lower_tier.pin(lower)
            try:
                fresh = self.allocator.allocate(self.blocks_for(num_tokens) - len(hits))
            finally:
                self.lower_tier.unpin(lower)
            filled = fresh[: len(lower)]
            # A block the tier cannot serve (a corrupt disk file) ends the run: it and the
            # blocks after it are computed again, in the fresh blocks they already have.
            loaded = self.lower_tier.load(lower_keys, lower, filled)
            adopt = self.prefix_cache.adopt
            keys = keys + [adopt(key, block) for key, block in zip(lower_keys[:loaded], filled[:loaded], strict=True)]
            blocks = hits + fresh
            hits = hits + filled[:loaded]
        else:
            blocks = hits + self.allocator.allocate(self.blocks_for(num_tokens) - len(hits))
        cached = len(hits) * self.block_size
        if self.prefix_cache is not None and tokens is not None:
            self.prefix_cache.record_query(num_tokens, cached)
        stored = tokens[:] if tokens is not None else None  # our copy: the caller may reuse its list
        self._seqs[seq_id] = SequenceBlocks(blocks, num_tokens, stored, extra_key, cached, keys)
        return cached

    def append_slots(
        self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None, *, defer_ids: bool = False
    ) -> list[int]:
        """Reserve ``n`` more tokens for ``seq_id``; return their slot ids.

        ``token_ids`` (length ``n``) are required for a prefix-cached sequence, unless
        ``defer_ids``: the ids are not known yet (an overlapped engine samples a token on the
        device and learns it a step later) and come later through :meth:`fill_token_ids`, in
        order; until then the blocks holding them are not keyed. Raises OutOfBlocksError or
        an argument error; changes nothing then.
        """
        seq = self.sequence(seq_id)
        n = require_int("n", n, minimum=1)
        new_ids = appended_ids(token_ids, n, seq, seq_id, defer_ids)
        new_blocks = self.blocks_for(seq.num_tokens + n) - len(seq.blocks)
        if new_blocks > self.allocator.num_free:
            raise OutOfBlocksError(new_blocks, self.allocator.num_free, f"append to {seq_id!r:.60}")
        if new_blocks:
            seq.blocks.extend(self.allocator.allocate(new_blocks))
        start = seq.num_tokens
        seq.num_tokens = start + n
        if defer_ids:
            seq.num_pending += n
        elif new_ids is not None:
            seq.token_ids.extend(new_ids)  # type: ignore[union-attr]
        return seq.slot_range(start, start + n, self.block_size)

    def fill_token_ids(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Give the ids of the oldest deferred tokens of ``seq_id`` (``append_slots(...,
        defer_ids=True)``), in order; blocks now full, computed and known are keyed. Raises
        InvalidArgumentError when more ids are given than are pending; changes nothing then."""
        self.sequence(seq_id).fill_ids(seq_id, token_list(token_ids), self.prefix_cache, self.block_size)

    def commit(self, rows: Iterable[ScheduledRow]) -> None:
        """Record what a step computed: row ``r`` wrote the K/V of tokens ``[start, start +
        num_new)`` of its sequence (``start`` as the metadata resolved it). Each row must
        continue its sequence's computed prefix. Checks every row first; raises an argument
        error and changes nothing when one does not fit."""
        for seq, computed in computed_after(rows, self.sequence):
            self._advance(seq, computed)

    def mark_computed(self, seq_id: Hashable, num_computed: int) -> None:
        """Record that the K/V of the first ``num_computed`` tokens is written. Prefer
        :meth:`commit` with the step's rows: under chunked prefill, passing the reserved length
        here would share blocks whose K/V is not written yet."""
        seq = self.sequence(seq_id)
        self._advance(seq, checked_computed(seq, seq_id, num_computed))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[BlockCopy]:
        """Make ``child_id`` share ``parent_id``'s blocks.

        Full blocks are shared by reference count. A partly filled last block is copied now
        (so no shared block is ever written): the returned ``(src, dst)`` pairs are the block
        copies the caller must perform on every layer's K and V before the next write
        (``KVCacheTensors.copy_blocks``). Raises UnknownSequenceError, SequenceExistsError or
        OutOfBlocksError; changes nothing then.
        """
        parent = self.sequence(parent_id)
        self.check_new_id(child_id)
        if not self.can_fork(parent_id):
            raise OutOfBlocksError(1, self.allocator.num_free, f"fork {parent_id!r:.60}")
        blocks, copies = share_blocks(self.allocator, parent.blocks, parent.num_tokens % self.block_size != 0)
        self._seqs[child_id] = parent.copy_onto(blocks, keep_keys=True)
        return copies

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[BlockCopy]:
        """Shorten ``seq_id`` to its first ``num_tokens`` tokens (take back rejected draft
        tokens): blocks past the new end are released, block keys of blocks no longer full
        are dropped, and the computed count is clamped (:mod:`kvcache.blocks.truncation`).

        Returns the block copies to perform before the next write, as :meth:`fork` does: a
        new last block that others share is replaced by a fresh copy. ``num_tokens`` equal to
        the current length changes nothing. Raises UnknownSequenceError, OutOfBlocksError (a
        copy is needed and no block is free) or an argument error (``num_tokens`` not in
        ``[1, length]``, or inside blocks released behind the sliding window); changes
        nothing then.
        """
        seq = self.sequence(seq_id)
        plan = plan_truncation(seq, seq_id, num_tokens, self.block_size, self.allocator)
        if plan.blocks_needed > self.allocator.num_free:
            raise OutOfBlocksError(plan.blocks_needed, self.allocator.num_free, f"truncate {seq_id!r:.60}")
        if plan.num_tokens == seq.num_tokens:
            return []
        copies: list[BlockCopy] = []
        if plan.rewrite is not None:
            if plan.copy:
                (fresh,) = self.allocator.allocate(1)
                copies.append((plan.rewrite, fresh))
                self._release_blocks([plan.rewrite])
                seq.blocks[plan.keep_blocks - 1] = fresh
            elif self.prefix_cache is not None:
                self.prefix_cache.forget(plan.rewrite, evicted=False)  # its tail will be rewritten
        self._release_blocks(seq.blocks[plan.keep_blocks :])
        del seq.blocks[plan.keep_blocks :]
        cut_token_ids(seq, plan, self.block_size)
        del seq.keys[plan.keep_keys :]
        seq.num_tokens = plan.num_tokens
        seq.num_computed = min(seq.num_computed, plan.num_tokens)
        seq.num_planned = min(seq.num_planned, plan.num_tokens)
        seq.epoch += 1
        return copies

    def free(self, seq_id: Hashable, *, reason: FreeReason = "finished") -> None:
        """Release ``seq_id``'s blocks. ``reason="preempted"`` counts a preemption (the engine
        will recompute it). Cached blocks stay indexed until evicted; the tail is queued for
        eviction before the head, since a later request is likelier to share the head.
        Raises UnknownSequenceError or InvalidArgumentError; changes nothing then."""
        if reason not in _REASONS:
            raise InvalidArgumentError(f"reason: {reason!r} is not one of {', '.join(_REASONS)}")
        self.detach(seq_id)
        if reason == "preempted":
            self.preemptions["recompute"] += 1

    def detach(
        self, seq_id: Hashable, *, swapped: bool = False, holder: object | None = None, hold: bool = False
    ) -> SequenceBlocks:
        """Remove ``seq_id`` and release its blocks, returning its record (with the block ids
        it held) so that :meth:`attach` can bring it back later. ``swapped``: its K/V was
        copied out (a swap preemption, counted); the id stays reserved until :meth:`attach`
        or :meth:`drop_swapped`. ``holder``: the swap space holding that K/V (a SwapSpace
        passes itself), which alone may drop the id. ``hold``: keep its blocks allocated
        under a hold (:meth:`release` them later), e.g. while an asynchronous copy still
        reads them; its partly filled last block may be held, since nothing appends to a
        detached sequence. Raises InvalidArgumentError (nothing changed) when another running
        sequence still appends into one of them."""
        seq = self.sequence(seq_id)
        if hold:
            real = [b for b in seq.blocks if b != PAD_BLOCK]
            others = {b: s for b, s in self._partial_last_blocks().items() if s != seq_id}
            self.holds.hold(real, lambda: others)
        del self._seqs[seq_id]
        self._release_blocks(seq.blocks)
        if swapped:
            self._parked.park(seq_id, holder)
            self.preemptions["swap"] += 1
        return seq

    def attach(self, seq_id: Hashable, record: SequenceBlocks) -> list[int]:
        """Bring back a detached sequence in fresh blocks (e.g. a swap-in): returns the new
        block ids, one per real block of ``record``, in order. It keeps its blocks' content
        keys (the fresh blocks are not indexed under them). Raises InvalidArgumentError for a
        record whose counts contradict each other, SequenceExistsError or OutOfBlocksError;
        changes nothing then."""
        self.check_hashable(seq_id)
        checked_record(record, self.block_size)
        with self._parked.lifted(seq_id):
            self.check_new_id(seq_id)
            real = sum(1 for b in record.blocks if b != PAD_BLOCK)
            fresh = self.allocator.allocate(real)
        # The keys describe content, which the fresh blocks hold again: keyed positions are
        # not keyed twice (the fresh blocks are not holders).
        self._seqs[seq_id] = record.copy_onto([PAD_BLOCK] * (len(record.blocks) - real) + fresh, keep_keys=True)
        return list(fresh)

    def drop_swapped(self, seq_id: Hashable, *, holder: object | None = None) -> None:
        """Free the id of a swapped-out sequence that will not come back. Raises
        InvalidArgumentError (nothing changed) when a swap space other than ``holder`` holds
        its K/V: call that space's ``drop``, which releases its host blocks too."""
        self.check_hashable(seq_id)
        self._parked.drop(seq_id, holder)

    def hold(self, blocks: Iterable[int]) -> None:
        """Keep owned ``blocks`` allocated without a block table (while a copy reads them).
        Raises InvalidArgumentError (nothing changed) for an id that is not an owned block, or
        that is a running sequence's partly filled last block: appends write into that one in
        place, so a copy would read it torn (hold it once it is full, or after :meth:`detach`)."""
        self.holds.hold(blocks, self._partial_last_blocks)

    def release(self, blocks: Iterable[int]) -> None:
        """Drop holds taken with :meth:`hold`. Raises InvalidArgumentError (nothing changed)
        for a block that is not held (as many times as listed)."""
        self._release_blocks(self.holds.drop(blocks), once_each=False)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block key; returns how many were dropped (0 without caching).
        Blocks in use keep their K/V but are not shared again; running sequences key only
        the blocks they fill from now on."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.reset()

    def attach_tier(self, tier: LowerTier) -> None:
        """Give the prefix cache a lower tier (:mod:`kvcache.blocks.tiers`): cached blocks the
        device pool evicts are offered to it, and admission continues a prompt's cached run
        there. One tier per manager. Raises InvalidArgumentError without prefix caching or
        when a tier is attached already."""
        if self.prefix_cache is None:
            raise InvalidArgumentError("tier: a lower prefix-cache tier needs enable_prefix_caching=True")
        if self.lower_tier is not None:
            raise InvalidArgumentError(f"tier: this manager has a {self.lower_tier.name} tier already")
        if not isinstance(tier, LowerTier):  # every member of the protocol present
            raise ArgumentTypeError(
                f"tier: {type(tier).__name__} is not a lower tier (it lacks members of "
                "kvcache.blocks.tiers.LowerTier); pass a HostPrefixTier"
            )
        self.lower_tier = tier
        self.prefix_cache.demote = tier.offload
        self.allocator.after_evict = tier.flush

    def _tier_contents(self) -> dict[str, list[BlockKey]]:
        """The keys each tier holds now (a replay for a new event subscriber)."""
        contents = {DEVICE_TIER: [] if self.prefix_cache is None else self.prefix_cache.held_keys()}
        if self.lower_tier is not None:
            contents.update(self.lower_tier.tier_contents())
        return contents

    # ---- checks ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recount every invariant from scratch. Raises IntegrityError listing each mismatch."""
        found = integrity_problems(self.allocator, self.prefix_cache, self.holds.counts, self._seqs, self.block_size)
        if found:
            raise IntegrityError(f"{len(found)} integrity problem(s):\n  " + "\n  ".join(found))

    # ---- internals ---------------------------------------------------------------------

    def _partial_last_blocks(self) -> dict[int, Hashable]:
        """Each running sequence's partly filled last block (appends write into it), with
        the sequence's id."""
        return {
            seq.blocks[-1]: seq_id
            for seq_id, seq in self._seqs.items()
            if seq.num_tokens % self.block_size and len(seq.blocks) > seq.num_released
        }

    def _advance(self, seq: SequenceBlocks, num_computed: int) -> None:
        """Set the computed prefix; index newly full blocks; release blocks behind the window."""
        seq.num_computed = num_computed
        if self.prefix_cache is not None and seq.token_ids is not None:
            seq.key_full_blocks(self.prefix_cache, self.block_size)
        if self.sliding_window is not None:
            gone = release_behind_window(seq, self.sliding_window, self.block_size, self.window_lag)
            if gone:
                self._release_blocks(gone)

    def _release_blocks(self, blocks: list[int], *, once_each: bool = True) -> None:
        release_blocks(self.allocator, self.prefix_cache, blocks, once_each=once_each)
