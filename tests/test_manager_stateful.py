"""Random allocate / append / fork / free / mark_computed / swap sequences against the manager.

After every step ``check_integrity()`` recounts everything; a refused operation must leave the
state exactly as it was; at the end every block is free again. The swap variant also keeps
real cache tensors in which every token's K/V is a value derived from its whole prefix (as
real K/V is), and checks after every step that each sequence reads back exactly its own
values: nothing lost, duplicated, or overwritten by a swap, a fork copy or a cache hit.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import BlockManager, KVCacheTensors, OutOfBlocksError, SwapSpace

BLOCK_SIZE = 4
NUM_BLOCKS = 12
HOST_BLOCKS = 6
PIECES = ([7, 3, 5, 1], [2, 8, 6, 4], [0, 1, 0, 1])


def snapshot(m: BlockManager, swap: SwapSpace | None) -> tuple[object, ...]:
    return (
        {k: copy.deepcopy(v) for k, v in m._seqs.items()},
        m.allocator.free_blocks_in_eviction_order(),
        list(m.allocator._ref),
        list(m.allocator._generation),
        dict(m.prefix_cache._block_of) if m.prefix_cache else None,
        None if swap is None else (swap.allocator.free_blocks_in_eviction_order(), dict(swap._swapped).keys()),
        None if swap is None else swap.host.clone(),
    )


def prefix_value(tokens: list[int]) -> float:
    """A stand-in for K/V: depends on the whole prefix, like real keys and values."""
    return float(hash(tuple(tokens)) % 1_000_003)


class ManagerMachine(RuleBasedStateMachine):
    prefix_caching = False
    with_swap = False

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=self.prefix_caching)
        self.tokens: dict[Hashable, list[int]] = {}  # running sequences
        self.swapped: dict[Hashable, list[int]] = {}
        self.next_id = 0
        self.cache: KVCacheTensors | None = None
        self.swap: SwapSpace | None = None
        if self.with_swap:
            self.cache = KVCacheTensors(torch.full((1, 2, NUM_BLOCKS, BLOCK_SIZE, 1, 1), float("nan")))
            self.swap = SwapSpace(self.m, self.cache, HOST_BLOCKS)

    # ---- helpers -------------------------------------------------------------------------

    def _draw_tokens(self, data: st.DataObject, n: int) -> list[int]:
        # Prompts are built from three block-sized pieces, so equal blocks are common both at
        # the same position (true cache hits) and at different positions after different
        # prefixes (which must never hit).
        count = -(-n // BLOCK_SIZE)
        pieces = data.draw(st.lists(st.sampled_from(PIECES), min_size=count, max_size=count))
        return [t for piece in pieces for t in piece][:n]

    def _write(self, seq: Hashable, start: int) -> None:
        """Write the K/V stand-ins of ``seq``'s tokens from ``start`` on, as a kernel would."""
        if self.cache is None:
            return
        tokens = self.tokens[seq]
        slots = self.m.slots(seq, start, len(tokens))
        flat = self.cache.storage.view(2, -1)
        for pos, slot in zip(range(start, len(tokens)), slots, strict=True):
            flat[:, slot] = torch.tensor([prefix_value(tokens[: pos + 1]), -prefix_value(tokens[: pos + 1])])

    def _refused(self, action: object, *args: object, **kwargs: object) -> bool:
        before = snapshot(self.m, self.swap)
        try:
            action(*args, **kwargs)  # type: ignore[operator]
        except OutOfBlocksError:
            after = snapshot(self.m, self.swap)
            assert str(after[:-1]) == str(before[:-1]), "a refused operation changed the state"
            if self.swap is not None:
                assert torch.equal(after[-1].nan_to_num(-1), before[-1].nan_to_num(-1))  # type: ignore[union-attr]
            return True
        return False

    def _token_arg(self, tokens: list[int]) -> list[int] | None:
        return tokens if self.prefix_caching else None

    # ---- rules ---------------------------------------------------------------------------

    @rule(n=st.integers(1, 3 * BLOCK_SIZE + 1), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        tokens = self._draw_tokens(data, n)
        seq = self.next_id
        expect = self.m.can_allocate(n, token_ids=self._token_arg(tokens))
        before = self.m.stats().prefix_cache_hits
        refused = self._refused(self.m.allocate, seq, n, token_ids=self._token_arg(tokens))
        assert refused != expect, "can_allocate disagreed with allocate"
        if not refused:
            self.next_id += 1
            self.tokens[seq] = tokens
            hit = self.m.stats().prefix_cache_hits - before
            self._write(seq, hit)  # the cached prefix is not recomputed

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(1, BLOCK_SIZE + 2), data=st.data())
    def append(self, n: int, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        new = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        expect = self.m.can_append(seq, n)
        refused = self._refused(self.m.append_slots, seq, n, token_ids=self._token_arg(new))
        assert refused != expect, "can_append disagreed with append_slots"
        if not refused:
            start = len(self.tokens[seq])
            self.tokens[seq] = self.tokens[seq] + new
            self._write(seq, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        expect = self.m.can_fork(parent)
        before = {b: self.m.allocator.ref_count(b) for b in self.m.block_table(parent)}
        result: list[list[tuple[int, int]]] = []
        refused = self._refused(lambda: result.append(self.m.fork(parent, child)))
        assert refused != expect, "can_fork disagreed with fork"
        if not refused:
            if self.cache is not None:
                self.cache.copy_blocks(result[0])
            self.next_id += 1
            self.tokens[child] = list(self.tokens[parent])
            shared = set(self.m.block_table(parent)) & set(self.m.block_table(child))
            assert all(self.m.allocator.ref_count(b) == before[b] + 1 for b in shared)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        record = self.m.sequence(seq)
        self.m.mark_computed(seq, data.draw(st.integers(record.num_computed, record.num_tokens)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.with_swap and self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        assert self.swap is not None
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        expect = self.swap.can_swap_out(seq)
        refused = self._refused(self.m.preempt, seq, "swap", self.swap)
        assert refused != expect, "can_swap_out disagreed with swap_out"
        if not refused:
            self.swapped[seq] = self.tokens.pop(seq)

    @precondition(lambda self: self.with_swap and self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        assert self.swap is not None
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        expect = self.swap.can_swap_in(seq)
        refused = self._refused(self.swap.swap_in, seq)
        assert refused != expect, "can_swap_in disagreed with swap_in"
        if not refused:
            self.tokens[seq] = self.swapped.pop(seq)
            record = self.m.sequence(seq)
            self.m.mark_computed(seq, record.num_computed)  # re-index its full blocks

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()
        if self.swap is not None:
            assert self.swap.integrity_problems() == []
        for seq, tokens in self.tokens.items():
            assert self.m.num_tokens(seq) == len(tokens)
            assert len(set(self.m.slots(seq, 0, len(tokens)))) == len(tokens), "two tokens share a slot"

    @invariant()
    def private_slots_are_not_shared(self) -> None:
        """Two sequences may share a slot only inside a full, shared block."""
        owner: dict[int, Hashable] = {}
        for seq, tokens in self.tokens.items():
            for slot in self.m.slots(seq, 0, len(tokens)):
                if self.m.allocator.ref_count(slot // BLOCK_SIZE) == 1:
                    assert slot not in owner, f"slot {slot} held by {owner[slot]} and {seq}"
                owner[slot] = seq

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        if self.cache is None:
            return
        flat = self.cache.storage.view(2, -1)
        for seq, tokens in self.tokens.items():
            got = flat[0, self.m.slots(seq, 0, len(tokens))].tolist()
            want = [prefix_value(tokens[: p + 1]) for p in range(len(tokens))]
            assert got == want, f"sequence {seq} reads K/V that is not its own"

    def teardown(self) -> None:
        for seq in list(self.tokens):
            self.m.free(seq)
        for seq in list(self.swapped):
            assert self.swap is not None
            self.swap.drop(seq)
        self.m.check_integrity()
        assert self.m.num_free_blocks == NUM_BLOCKS, "device blocks leaked"
        if self.swap is not None:
            assert self.swap.allocator.num_free == HOST_BLOCKS, "host blocks leaked"


class PrefixCachingMachine(ManagerMachine):
    prefix_caching = True


class SwapMachine(ManagerMachine):
    prefix_caching = True
    with_swap = True


_SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestManagerStateful = ManagerMachine.TestCase
TestManagerStateful.settings = _SETTINGS
TestPrefixCachingStateful = PrefixCachingMachine.TestCase
TestPrefixCachingStateful.settings = _SETTINGS
TestSwapStateful = SwapMachine.TestCase
TestSwapStateful.settings = _SETTINGS
