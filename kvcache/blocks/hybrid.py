"""The block manager of a hybrid model: one :class:`BlockManager` per KV group, over one pool.

Each group (:mod:`kvcache.blocks.groups`) keeps its own table per sequence; a windowed group
releases the blocks behind its window as its sequences advance. Every call is all or nothing
across groups: the ``can_*`` checks add up what each group needs from the shared pool, and an
action changes no group unless every group can follow.

Prefix caching: each group indexes its own blocks (the same content has one block per group).
A prompt's cached run is the longest that every group can serve, so every group starts
computing at the same token: a full group needs the run's every block; a windowed group only
the blocks its first new query can see (the run's last window, as vLLM's hybrid manager
rules), its earlier entries are ``PAD_BLOCK`` as if released behind the window. A windowed
group's early blocks, released and evicted first, then cost no hits. Hits are taken out of
the free queue in every group before any group takes fresh blocks, so one group's allocation
never evicts another group's hit.

What a serving engine asks of a :class:`BlockManager` is here too (``blocks_for``,
``append_slots(defer_ids=)``/``fill_token_ids``, ``truncate``, ``sequence``,
``reset_prefix_cache``, the prefix-cache and preemption counters), so the example engine runs
on either manager.

Not here yet: lower tiers, swap and holds (a hybrid manager has none: ``lower_tier`` is None).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

from attention.checks import cdiv, require_int
from attention.errors import ArgumentTypeError, IntegrityError, InvalidArgumentError, OutOfBlocksError
from attention.metadata import PAD_BLOCK
from kvcache.blocks.admission import checked_prompt
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.groups import KVGroupLayout
from kvcache.blocks.integrity import integrity_problems
from kvcache.blocks.manager import BlockManager, FreeReason
from kvcache.blocks.prefix_cache import BlockKey, PrefixCache
from kvcache.blocks.rows import ScheduledRow, computed_after, row_list
from kvcache.blocks.sequence import BlockCopy, SequenceBlocks
from kvcache.blocks.truncation import plan_truncation

__all__ = ["AnyBlockManager", "HybridBlockManager", "require_one_table"]


class _HybridAdmission(NamedTuple):
    """A checked prompt and what it takes from every group (changes nothing until acted on)."""

    num_tokens: int
    token_ids: list[int] | None
    run: int  # cached blocks, the same in every group
    hits: list[list[int]]  # per group: its blocks of the run (PAD_BLOCK behind a window)
    keys: list[list[BlockKey]]  # per group: the run's keys
    needed: int


class HybridBlockManager:
    """Per-group block tables over one pool of ``num_blocks`` blocks of ``block_size`` tokens
    (a block holds ``layout.group_size`` layers' K/V)."""

    def __init__(self, layout: KVGroupLayout, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if not isinstance(layout, KVGroupLayout):
            raise InvalidArgumentError(f"layout: expected a KVGroupLayout, got {type(layout).__name__}")
        self.layout = layout
        self.allocator = BlockAllocator(num_blocks, self._evicted)
        self.groups = [
            BlockManager(
                num_blocks,
                block_size,
                enable_prefix_caching,
                sliding_window=group.window,
                allocator=self.allocator,
            )
            for group in layout.groups
        ]
        self.block_size = self.groups[0].block_size
        #: No lower tier (host or disk) for KV groups yet.
        self.lower_tier: None = None

    @property
    def window_lag(self) -> int:
        """Tokens a truncation may take back (:attr:`BlockManager.window_lag`), every group's."""
        return self.groups[0].window_lag

    @window_lag.setter
    def window_lag(self, tokens: int) -> None:
        tokens = require_int("window_lag", tokens, minimum=0)
        for group in self.groups:
            group.window_lag = tokens

    # ---- queries (change nothing) ------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.allocator.num_used

    @property
    def num_sequences(self) -> int:
        return self.groups[0].num_sequences

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.groups[0]

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.groups[0].num_tokens(seq_id)

    def num_computed(self, seq_id: Hashable) -> int:
        return self.groups[0].num_computed(seq_id)

    def sequence(self, seq_id: Hashable) -> SequenceBlocks:
        """``seq_id``'s record in the first group (a full group: lengths and token ids are
        the same in every group). Raises UnknownSequenceError."""
        return self.groups[0].sequence(seq_id)

    def blocks_for(self, num_tokens: int) -> int:
        """Block ids a sequence of ``num_tokens`` tokens can hold at once, every group together
        (at most: ``allocate`` of the whole length takes it in each group; an engine reserving
        chunk by chunk holds less, its windowed groups releasing as it goes)."""
        return self.groups[0].blocks_for(num_tokens) * len(self.groups)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The first group's prefix index. Its query and hit counts are the manager's: every
        group records the same cached run of each admission."""
        return self.groups[0].prefix_cache

    @property
    def preemptions(self) -> dict[str, int]:
        """Sequences given up to make room, by how (counted once, in the first group)."""
        return self.groups[0].preemptions

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """``seq_id``'s table in each group (``PAD_BLOCK`` for blocks released behind a window)."""
        return [group.block_table(seq_id) for group in self.groups]

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[list[int]]:
        """Cache slots of tokens ``[start, end)`` in each group."""
        return [group.slots(seq_id, start, end) for group in self.groups]

    def blocks_held(self, seq_id: Hashable) -> int:
        """Blocks ``seq_id``'s tables hold, every group together."""
        return sum(sum(1 for b in group.block_table(seq_id) if b >= 0) for group in self.groups)

    def can_allocate(
        self, num_tokens: int | None = None, *, token_ids: Sequence[int] | None = None, extra_key: Hashable = None
    ) -> bool:
        """Whether ``allocate`` with these arguments would succeed (for a new id). Changes
        nothing; raises the same argument errors as ``allocate``."""
        return self.allocator.num_free >= self._admission(num_tokens, token_ids, extra_key).needed

    def cached_tokens(self, *, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Leading tokens of ``token_ids`` that ``allocate`` would take from the prefix cache
        now (the run every group serves). Changes nothing; raises ``allocate``'s argument
        errors. An engine that reserves a prompt chunk by chunk allocates ``token_ids[:cached
        + first_chunk]``: the cached run of that is the same."""
        return self._admission(None, token_ids, extra_key).run * self.block_size

    def can_append(self, seq_id: Hashable, n: int = 1) -> bool:
        """Whether ``append_slots(seq_id, n)`` would succeed. Changes nothing."""
        return self.allocator.num_free >= self._append_need(seq_id, n)

    def can_fork(self, parent_id: Hashable) -> bool:
        """Whether ``fork(parent_id, ...)`` would succeed. Changes nothing."""
        partial = self.groups[0].sequence(parent_id).num_tokens % self.block_size != 0
        return self.allocator.num_free >= (len(self.groups) if partial else 0)

    # ---- actions (all or nothing across groups) -------------------------------------------

    def allocate(
        self,
        seq_id: Hashable,
        num_tokens: int | None = None,
        *,
        token_ids: Sequence[int] | None = None,
        extra_key: Hashable = None,
    ) -> int:
        """Create ``seq_id`` in every group; returns how many leading tokens are cached (the
        longest run every group serves). Raises SequenceExistsError, OutOfBlocksError or an
        argument error; changes nothing then."""
        self.groups[0].check_new_id(seq_id)
        admission = self._admission(num_tokens, token_ids, extra_key)
        if admission.needed > self.allocator.num_free:
            raise OutOfBlocksError(admission.needed, self.allocator.num_free, f"allocate sequence {seq_id!r:.60}")
        length, tokens, run = admission.num_tokens, admission.token_ids, admission.run
        for hits in admission.hits:  # every group's hits leave the free queue before any fresh block is taken
            self.allocator.share([b for b in hits if b != PAD_BLOCK])
        cached = run * self.block_size
        for group, hits, keys in zip(self.groups, admission.hits, admission.keys, strict=True):
            fresh = self.allocator.allocate(cdiv(length, self.block_size) - run)
            stored = tokens[:] if tokens is not None else None
            released = hits.count(PAD_BLOCK)
            group._seqs[seq_id] = SequenceBlocks(
                hits + fresh, length, stored, extra_key, cached, list(keys), num_released=released
            )
            if group.prefix_cache is not None and tokens is not None:
                group.prefix_cache.record_query(length, cached)
        return cached

    def append_slots(
        self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None, *, defer_ids: bool = False
    ) -> list[list[int]]:
        """Reserve ``n`` more tokens for ``seq_id`` in every group; returns their slots per
        group (``defer_ids`` as in :meth:`BlockManager.append_slots`). Raises OutOfBlocksError
        or an argument error; changes nothing then."""
        needed = self._append_need(seq_id, n)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(needed, self.allocator.num_free, f"append to {seq_id!r:.60}")
        first = self.groups[0].append_slots(seq_id, n, token_ids, defer_ids=defer_ids)  # checks the ids first
        return [first] + [group.append_slots(seq_id, n, token_ids, defer_ids=defer_ids) for group in self.groups[1:]]

    def fill_token_ids(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """:meth:`BlockManager.fill_token_ids` in every group (checked in the first)."""
        self.groups[0].fill_token_ids(seq_id, token_ids)
        for group in self.groups[1:]:
            group.fill_token_ids(seq_id, token_ids)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> list[BlockCopy]:
        """:meth:`BlockManager.truncate` in every group, all or nothing: every group's cut is
        checked, and the fresh blocks they need counted, before any changes. Returns every
        group's block copies together (a block id belongs to one group, so copying it in
        every layer tensor copies exactly that group's layers)."""
        records = [group.sequence(seq_id) for group in self.groups]
        plans = [plan_truncation(seq, seq_id, num_tokens, self.block_size, self.allocator) for seq in records]
        needed = sum(plan.blocks_needed for plan in plans)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(needed, self.allocator.num_free, f"truncate {seq_id!r:.60}")
        return [copy for group in self.groups for copy in group.truncate(seq_id, num_tokens)]

    def commit(self, rows: Iterable[ScheduledRow]) -> None:
        """Record what a step computed (:meth:`BlockManager.commit`), in every group; windowed
        groups release what fell behind their windows. Checks every row first; changes
        nothing when one does not fit."""
        rows = row_list(rows)
        computed_after(rows, self.groups[0].sequence)  # raises before any group changes
        for group in self.groups:
            group.commit(rows)

    def mark_computed(self, seq_id: Hashable, num_computed: int) -> None:
        """:meth:`BlockManager.mark_computed` in every group (checked in the first)."""
        self.groups[0].mark_computed(seq_id, num_computed)
        for group in self.groups[1:]:
            group.mark_computed(seq_id, num_computed)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[list[BlockCopy]]:
        """:meth:`BlockManager.fork` in every group; returns each group's block copies (a
        copy in group ``g`` is made on group ``g``'s layers only)."""
        self.groups[0].sequence(parent_id)
        self.groups[0].check_new_id(child_id)
        if not self.can_fork(parent_id):
            raise OutOfBlocksError(len(self.groups), self.allocator.num_free, f"fork {parent_id!r:.60}")
        return [group.fork(parent_id, child_id) for group in self.groups]

    def free(self, seq_id: Hashable, *, reason: FreeReason = "finished") -> None:
        """Release ``seq_id``'s blocks in every group. Raises UnknownSequenceError or
        InvalidArgumentError; changes nothing then."""
        self.groups[0].sequence(seq_id)
        self.groups[0].free(seq_id, reason=reason)  # checks the reason first
        for group in self.groups[1:]:
            group.free(seq_id, reason=reason)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block key in every group (:meth:`BlockManager.reset_prefix_cache`);
        returns how many were dropped, all groups together (0 without caching)."""
        return sum(group.reset_prefix_cache() for group in self.groups)

    # ---- checks ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recount every invariant of every group, and every block's owners across groups.
        Raises IntegrityError listing each mismatch."""
        found: list[str] = []
        owners: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            problems = integrity_problems(self.allocator, group.prefix_cache, {}, group._seqs, self.block_size)
            found += [f"group {g}: {p}" for p in problems if not p.startswith("block ")]
            for seq in group._seqs.values():
                for block in seq.blocks:
                    if block >= 0:
                        owners[block] = owners.get(block, 0) + 1
        for block in range(self.num_blocks):
            if self.allocator.ref_count(block) != owners.get(block, 0):
                found.append(
                    f"block {block}: reference count {self.allocator.ref_count(block)}, but "
                    f"{owners.get(block, 0)} block tables have it"
                )
        ids = [set(group._seqs) for group in self.groups]
        if any(s != ids[0] for s in ids):
            found.append("the groups do not hold the same sequences")
        for seq_id in ids[0]:
            counts = {(g.sequence(seq_id).num_tokens, g.sequence(seq_id).num_computed) for g in self.groups}
            if len(counts) != 1:
                found.append(f"sequence {seq_id!r:.60}: token counts differ between groups: {sorted(counts)}")
        if found:
            raise IntegrityError(f"{len(found)} integrity problem(s):\n  " + "\n  ".join(found))

    # ---- internals ---------------------------------------------------------------------

    def _admission(self, num_tokens: object, token_ids: object, extra_key: Hashable) -> _HybridAdmission:
        """The longest cached run every group serves, each group's hits for it (``PAD_BLOCK``
        before a windowed group's window), and the free blocks the admission takes."""
        caching = self.groups[0].prefix_cache is not None
        length, tokens = checked_prompt(num_tokens, token_ids, extra_key, cached=caching)
        blocks = cdiv(length, self.block_size)
        if not caching or not tokens:
            empty: list[list[int]] = [[] for _ in self.groups]
            return _HybridAdmission(length, tokens, 0, empty, [[] for _ in self.groups], blocks * len(self.groups))
        bs = self.block_size
        limit = (len(tokens) - 1) // bs  # the last token is always computed
        keys: list[BlockKey] = []
        parent: BlockKey | None = None
        for i in range(limit):
            parent = BlockKey(parent, tuple(tokens[i * bs : (i + 1) * bs]), extra_key)
            keys.append(parent)
        held = [self._held(group, keys) for group in self.groups]
        run = limit
        for group, found in zip(self.groups, held, strict=True):
            if group.sliding_window is None:  # a full group serves its leading run, no more
                run = min(run, next((i for i, f in enumerate(found) if f is None), len(found)))
        while run > 0 and not all(
            self._serves(group, found, run) for group, found in zip(self.groups, held, strict=True)
        ):
            run -= 1
        hits: list[list[int]] = []
        stored: list[list[BlockKey]] = []
        needed = 0
        for group, found in zip(self.groups, held, strict=True):
            start = self._window_start(group, run)
            group_hits = [PAD_BLOCK] * start + [found[i][0] for i in range(start, run)]  # type: ignore[index]
            hits.append(group_hits)
            stored.append(keys[:start] + [found[i][1] for i in range(start, run)])  # type: ignore[index]
            needed += blocks - run + self.allocator.count_free(group_hits[start:])
        return _HybridAdmission(length, tokens, run, hits, stored, needed)

    @staticmethod
    def _held(group: BlockManager, keys: list[BlockKey]) -> list[tuple[int, BlockKey] | None]:
        cache = group.prefix_cache
        return [None if cache is None else cache.holder_of(key) for key in keys]

    def _window_start(self, group: BlockManager, run: int) -> int:
        """The first of a run's blocks that a windowed group's first new query can see."""
        window = group.sliding_window
        if window is None:
            return 0
        return min(run, max(0, run * self.block_size - window + 1) // self.block_size)

    def _serves(self, group: BlockManager, found: list[tuple[int, BlockKey] | None], run: int) -> bool:
        return all(found[i] is not None for i in range(self._window_start(group, run), run))

    def _append_need(self, seq_id: Hashable, n: int) -> int:
        n = require_int("n", n, minimum=1)
        records = [group.sequence(seq_id) for group in self.groups]
        return sum(self.groups[0].blocks_for(seq.num_tokens + n) - len(seq.blocks) for seq in records)

    def _evicted(self, block: int) -> None:
        """A cached free block is being refilled: the group that indexed it forgets it."""
        for group in self.groups:
            if group.prefix_cache is not None:
                group.prefix_cache.forget(block)


#: Either manager: what a serving engine runs on (one table per sequence, or per KV group).
AnyBlockManager = BlockManager | HybridBlockManager


def require_one_table(manager: object, name: str = "manager") -> None:
    """Raise ArgumentTypeError unless ``manager`` is a :class:`BlockManager` (one block table
    per sequence): swap spaces, pool statistics and swap preemption serve only that; a
    :class:`HybridBlockManager` is told apart, with what it can do instead."""
    if isinstance(manager, BlockManager):
        return
    if isinstance(manager, HybridBlockManager):
        raise ArgumentTypeError(
            f"{name}: a HybridBlockManager (KV groups) has no swap space, swap preemption or pool statistics "
            "yet; preempt by recompute (manager.free(seq_id, reason='preempted')), read manager.num_free_blocks, "
            "or keep one table for every layer (the example engine: --no-kv-groups)"
        )
    raise ArgumentTypeError(f"{name}: expected a BlockManager, got {type(manager).__name__}")
