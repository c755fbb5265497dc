"""Random allocate / append / fork / free / mark_computed sequences against the block manager.

After every step ``check_integrity()`` recounts everything; a refused operation must leave the
state exactly as it was; at the end every block is free again.
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import BlockManager, OutOfBlocksError

BLOCK_SIZE = 4
NUM_BLOCKS = 12
COMMON_TEXT = [7, 3, 5, 1, 2, 8, 6, 4, 9, 0, 7, 7, 3, 1, 5, 5] * 2


def snapshot(m: BlockManager) -> tuple[object, ...]:
    return (
        {k: copy.deepcopy(v) for k, v in m._seqs.items()},
        m.allocator.free_blocks_in_eviction_order(),
        list(m.allocator._ref),
        list(m.allocator._generation),
        dict(m.prefix_cache._block_of) if m.prefix_cache else None,
    )


class ManagerMachine(RuleBasedStateMachine):
    prefix_caching = False

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=self.prefix_caching)
        self.lengths: dict[int, int] = {}
        self.next_id = 0
        self.refusals = 0

    def _tokens(self, data: st.DataObject, n: int) -> list[int] | None:
        if not self.prefix_caching:
            return None
        # Most prompts start with one common text, so cache hits are frequent; a two-letter
        # alphabet for the rest makes accidental matches likely too.
        common = data.draw(st.integers(0, n))
        rest = data.draw(st.lists(st.integers(0, 1), min_size=n - common, max_size=n - common))
        return COMMON_TEXT[:common] + rest

    def _refused(self, action: object, *args: object, **kwargs: object) -> bool:
        before = snapshot(self.m)
        try:
            action(*args, **kwargs)  # type: ignore[operator]
        except OutOfBlocksError:
            assert snapshot(self.m) == before, "a refused operation changed the state"
            self.refusals += 1
            return True
        return False

    @rule(n=st.integers(1, 3 * BLOCK_SIZE + 1), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        tokens = self._tokens(data, n)
        seq = self.next_id
        expect = self.m.can_allocate(n, token_ids=tokens)
        refused = self._refused(self.m.allocate, seq, n, token_ids=tokens)
        assert refused != expect, "can_allocate disagreed with allocate"
        if not refused:
            self.next_id += 1
            self.lengths[seq] = n

    @precondition(lambda self: self.lengths)
    @rule(n=st.integers(1, BLOCK_SIZE + 2), data=st.data())
    def append(self, n: int, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        tokens = self._tokens(data, n)
        expect = self.m.can_append(seq, n)
        refused = self._refused(self.m.append_slots, seq, n, token_ids=tokens)
        assert refused != expect, "can_append disagreed with append_slots"
        if not refused:
            self.lengths[seq] += n

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.lengths)))
        child = self.next_id
        expect = self.m.can_fork(parent)
        before = {b: self.m.allocator.ref_count(b) for b in self.m.block_table(parent)}
        refused = self._refused(self.m.fork, parent, child)
        assert refused != expect, "can_fork disagreed with fork"
        if not refused:
            self.next_id += 1
            self.lengths[child] = self.lengths[parent]
            shared = set(self.m.block_table(parent)) & set(self.m.block_table(child))
            assert all(self.m.allocator.ref_count(b) == before[b] + 1 for b in shared)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        record = self.m.sequence(seq)
        upto = data.draw(st.integers(record.num_computed, record.num_tokens))
        self.m.mark_computed(seq, upto)

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        self.m.free(seq)
        del self.lengths[seq]

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()
        for seq, n in self.lengths.items():
            assert self.m.num_tokens(seq) == n
            assert len(set(self.m.slots(seq, 0, n))) == n, "a sequence maps two tokens to one slot"

    @invariant()
    def private_slots_are_not_shared(self) -> None:
        """Two sequences may share a slot only inside a full, shared block."""
        owner: dict[int, int] = {}
        for seq, n in self.lengths.items():
            for slot in self.m.slots(seq, 0, n):
                block = slot // BLOCK_SIZE
                if self.m.allocator.ref_count(block) == 1:
                    assert slot not in owner, f"slot {slot} held by {owner[slot]} and {seq}"
                owner[slot] = seq

    def teardown(self) -> None:
        for seq in list(self.lengths):
            self.m.free(seq)
        self.m.check_integrity()
        assert self.m.num_free_blocks == NUM_BLOCKS, "blocks leaked"


class PrefixCachingMachine(ManagerMachine):
    prefix_caching = True


TestManagerStateful = ManagerMachine.TestCase
TestManagerStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCachingStateful = PrefixCachingMachine.TestCase
TestPrefixCachingStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
