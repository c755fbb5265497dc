"""Block allocator and free queue: exact block ids on scripted cases."""

from __future__ import annotations

import pytest

from kvcache import BlockAllocator, OutOfBlocksError
from kvcache.free_queue import FreeBlockQueue


def test_free_queue_push_pop_remove_in_order() -> None:
    q = FreeBlockQueue(6)
    assert list(q) == [0, 1, 2, 3, 4, 5]
    q.remove(3)
    q.remove(0)
    q.remove(5)
    assert list(q) == [1, 2, 4] and len(q) == 3
    q.push_back(0)
    q.push_front(5)
    assert list(q) == [5, 1, 2, 4, 0]
    assert [q.pop_front() for _ in range(5)] == [5, 1, 2, 4, 0]
    assert len(q) == 0 and q.check_links() == []
    q.push_front(3)
    assert list(q) == [3] and q.check_links() == []


def test_allocate_takes_lowest_ids_first_and_free_order_decides_reuse() -> None:
    a = BlockAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    a.decref(1)  # nothing cached: reused first
    a.decref(4, keep_cached=True)  # cached: reused last
    assert a.free_blocks_in_eviction_order() == [1, 5, 6, 7, 4]
    assert a.allocate(5) == [1, 5, 6, 7, 4]
    assert a.num_free == 0 and a.integrity_problems() == []


def test_allocation_is_all_or_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    before = a.free_blocks_in_eviction_order()
    with pytest.raises(OutOfBlocksError) as info:
        a.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "2 blocks needed, 1 free" in str(info.value)
    assert a.free_blocks_in_eviction_order() == before and a.num_free == 1


def test_reference_counts_and_generations() -> None:
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    assert a.generation(b) == 1
    a.incref(b)
    a.decref(b)
    assert a.ref_count(b) == 1 and not a.is_free(b)
    a.decref(b)
    assert a.is_free(b)
    a.allocate(2)
    assert a.generation(0) == 2 and a.generation(1) == 1


def test_revive_takes_a_block_from_the_middle() -> None:
    a = BlockAllocator(5)
    a.revive(2)
    assert a.free_blocks_in_eviction_order() == [0, 1, 3, 4] and a.ref_count(2) == 1
    assert a.integrity_problems() == []


def test_double_free_is_caught() -> None:
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    a.decref(b)
    with pytest.raises(AssertionError, match="double free"):
        a.decref(b)


def test_integrity_problems_name_the_block() -> None:
    a = BlockAllocator(3)
    a.allocate(1)
    a._ref[0] = 0  # simulate a lost reference
    assert any("block 0" in p for p in a.integrity_problems())
