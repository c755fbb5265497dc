"""The block manager of a hybrid model: one :class:`BlockManager` per KV group, over one pool.

Each group (:mod:`kvcache.blocks.groups`) keeps its own table per sequence; a windowed group
releases the blocks behind its window as its sequences advance. Every call is all or nothing
across groups: the ``can_*`` checks add up what each group needs from the shared pool, and an
action changes no group unless every group can follow.

Prefix caching: each group indexes its own blocks (the same content has one block per group).
A prompt's cached run is the shortest of the groups' runs, so every group starts computing at
the same token; hits are taken out of the free queue in every group before any group takes
fresh blocks, so one group's allocation never evicts another group's hit.

Not here yet: lower tiers, swap and holds (a hybrid manager has none), and vLLM's windowed-hit
rule (a windowed group needs only its last window's blocks of a hit; here it needs them all).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from attention.checks import cdiv, require_int
from attention.errors import IntegrityError, InvalidArgumentError, OutOfBlocksError
from kvcache.blocks.admission import Admission, plan_admission
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.groups import KVGroupLayout
from kvcache.blocks.integrity import integrity_problems
from kvcache.blocks.manager import BlockManager, FreeReason
from kvcache.blocks.rows import ScheduledRow, computed_after
from kvcache.blocks.sequence import BlockCopy, SequenceBlocks

__all__ = ["HybridBlockManager"]


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
        return self.allocator.num_free >= self._admission(num_tokens, token_ids, extra_key)[2]

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
        shortest cached run of the groups). Raises SequenceExistsError, OutOfBlocksError or an
        argument error; changes nothing then."""
        self.groups[0].check_new_id(seq_id)
        plans, common, needed = self._admission(num_tokens, token_ids, extra_key)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(needed, self.allocator.num_free, f"allocate sequence {seq_id!r:.60}")
        length, tokens = plans[0].num_tokens, plans[0].token_ids
        for plan in plans:  # every group's hits leave the free queue before any fresh block is taken
            self.allocator.share(plan.hits[:common])
        cached = common * self.block_size
        for group, plan in zip(self.groups, plans, strict=True):
            fresh = self.allocator.allocate(cdiv(length, self.block_size) - common)
            stored = tokens[:] if tokens is not None else None
            group._seqs[seq_id] = SequenceBlocks(
                plan.hits[:common] + fresh, length, stored, extra_key, cached, plan.keys[:common]
            )
            if group.prefix_cache is not None and tokens is not None:
                group.prefix_cache.record_query(length, cached)
        return cached

    def append_slots(self, seq_id: Hashable, n: int = 1, token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """Reserve ``n`` more tokens for ``seq_id`` in every group; returns their slots per
        group. Raises OutOfBlocksError or an argument error; changes nothing then."""
        needed = self._append_need(seq_id, n)
        if needed > self.allocator.num_free:
            raise OutOfBlocksError(needed, self.allocator.num_free, f"append to {seq_id!r:.60}")
        first = self.groups[0].append_slots(seq_id, n, token_ids)  # checks the ids first
        return [first] + [group.append_slots(seq_id, n, token_ids) for group in self.groups[1:]]

    def commit(self, rows: Iterable[ScheduledRow]) -> None:
        """Record what a step computed (:meth:`BlockManager.commit`), in every group; windowed
        groups release what fell behind their windows. Checks every row first; changes
        nothing when one does not fit."""
        rows = list(rows)
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

    def _admission(
        self, num_tokens: object, token_ids: object, extra_key: Hashable
    ) -> tuple[list[Admission], int, int]:
        """Each group's admission plan, the common cached run (blocks) and the free blocks
        the admission takes from the shared pool."""
        plans = [
            plan_admission(self.allocator, group.prefix_cache, self.block_size, num_tokens, token_ids, extra_key)
            for group in self.groups
        ]
        common = min(len(plan.hits) for plan in plans)
        blocks = cdiv(plans[0].num_tokens, self.block_size)
        needed = sum(blocks - common + self.allocator.count_free(plan.hits[:common]) for plan in plans)
        return plans, common, needed

    def _append_need(self, seq_id: Hashable, n: int) -> int:
        n = require_int("n", n, minimum=1)
        records = [group.sequence(seq_id) for group in self.groups]
        return sum(self.groups[0].blocks_for(seq.num_tokens + n) - len(seq.blocks) for seq in records)

    def _evicted(self, block: int) -> None:
        """A cached free block is being refilled: the group that indexed it forgets it."""
        for group in self.groups:
            if group.prefix_cache is not None:
                group.prefix_cache.forget(block)
