"""Block allocator and free queue: exact block ids on scripted cases."""

from __future__ import annotations

import pytest

from kvcache import ArgumentTypeError, BlockAllocator, InvalidArgumentError, OutOfBlocksError
from kvcache.blocks.free_queue import FreeBlockQueue


def state(a: BlockAllocator) -> tuple[object, ...]:
    """Everything observable about an allocator."""
    return (a.free_blocks_in_eviction_order(), list(a._ref), a.num_free, a.num_cached_free)


def test_free_queue_give_back_take_remove_in_order() -> None:
    # Was push_back / push_front / pop_front on one linked list; the same reuse order now
    # comes from two tiers: plain blocks (reused first, last given back first) and cached
    # blocks (reused last, least recently given back first).
    q = FreeBlockQueue(6)
    assert list(q) == [0, 1, 2, 3, 4, 5]
    q.remove(3)
    q.remove(0)
    q.remove(5)
    assert list(q) == [1, 2, 4] and len(q) == 3
    q.give_back_cached([0])  # was push_back: reused last
    q.give_back_plain([5])  # was push_front: reused first
    assert list(q) == [5, 1, 2, 4, 0]
    blocks, evicted = q.take(5)
    assert blocks == [5, 1, 2, 4, 0]
    assert evicted == [0], "only the block from the cached tier is reported as evicted"
    assert len(q) == 0 and q.problems(6) == []
    q.give_back_plain([3])
    assert list(q) == [3] and q.problems(6) == []


def test_free_queue_tiers_and_batch_give_back() -> None:
    q = FreeBlockQueue(4)
    assert q.take(4) == ([0, 1, 2, 3], [])
    q.give_back_cached([2, 0])  # 2 is reused before 0
    q.give_back_plain([1, 3])  # 3 (the last) is reused first
    assert list(q) == [3, 1, 2, 0] and q.num_cached == 2
    q.remove(2)  # a cache hit from the middle of the cached tier
    assert list(q) == [3, 1, 0] and q.num_cached == 1
    assert q.take(2) == ([3, 1], [])
    assert q.take(1) == ([0], [0])
    assert q.problems(4) == []


def test_allocate_takes_lowest_ids_first_and_free_order_decides_reuse() -> None:
    a = BlockAllocator(8)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    a.decref(1)  # nothing cached: reused first
    a.decref(4, keep_cached=True)  # cached: reused last
    assert a.free_blocks_in_eviction_order() == [1, 5, 6, 7, 4]
    assert a.num_cached_free == 1
    assert a.allocate(5) == [1, 5, 6, 7, 4]
    assert a.num_free == 0 and a.num_cached_free == 0 and a.integrity_problems() == []


def test_release_batch_frees_in_list_order() -> None:
    a = BlockAllocator(6)
    assert a.allocate(6) == [0, 1, 2, 3, 4, 5]
    a.incref(3)
    a.release([5, 4, 3, 2, 1], {4, 2})
    assert a.ref_count(3) == 1, "a shared block loses one owner and stays allocated"
    # Plain ones: the last of them is reused first; cached ones: in list order, after them.
    assert a.free_blocks_in_eviction_order() == [1, 5, 4, 2]
    assert a.num_cached_free == 2
    a.release([3, 0])
    assert a.free_blocks_in_eviction_order() == [0, 3, 1, 5, 4, 2]
    assert a.integrity_problems() == []


def test_allocation_is_all_or_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    before = a.free_blocks_in_eviction_order()
    with pytest.raises(OutOfBlocksError) as info:
        a.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "2 blocks needed, 1 free" in str(info.value)
    assert a.free_blocks_in_eviction_order() == before and a.num_free == 1


def test_reference_counts_and_reuse_is_reported() -> None:
    # Was "generations": a counter per block that grew on every reuse, so a stale prefix-cache
    # key could not match a refilled block. Now the allocator tells the prefix cache directly:
    # ``on_evict(block)`` fires exactly when a block that still held cached K/V is taken for
    # new content (and never for a block whose content nobody could look up).
    evicted: list[int] = []
    a = BlockAllocator(2, on_evict=evicted.append)
    (b,) = a.allocate(1)
    a.incref(b)
    a.decref(b)
    assert a.ref_count(b) == 1 and not a.is_free(b)
    a.decref(b)
    assert a.is_free(b)
    a.allocate(2)
    assert evicted == [], "block 0 was freed as plain: there is nothing cached to forget"
    a.decref(0, keep_cached=True)
    a.decref(1)
    assert a.allocate(2) == [1, 0]
    assert evicted == [0], "reusing a cached block is reported once, for that block only"


def test_revive_takes_a_block_from_the_middle() -> None:
    a = BlockAllocator(5)
    a.revive(2)
    assert a.free_blocks_in_eviction_order() == [0, 1, 3, 4] and a.ref_count(2) == 1
    assert a.integrity_problems() == []


def test_double_free_is_caught() -> None:
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    a.decref(b)
    before = state(a)
    with pytest.raises(InvalidArgumentError, match="double free"):
        a.decref(b)
    assert state(a) == before


def test_misuse_raises_typed_errors_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(2)
    a.decref(1, keep_cached=True)
    before = state(a)
    with pytest.raises(InvalidArgumentError, match="incref on a free block"):
        a.incref(2)
    with pytest.raises(InvalidArgumentError, match="cannot be revived"):
        a.revive(0)
    with pytest.raises(InvalidArgumentError, match="double free"):
        a.release([0, 0])  # one owner, released twice
    with pytest.raises(InvalidArgumentError):
        a.release([0, 4])  # 4 is past the pool: nothing released, 0 included
    for bad in (-1, 4, 10**12):
        with pytest.raises(InvalidArgumentError):
            a.incref(bad)
        with pytest.raises(InvalidArgumentError):
            a.ref_count(bad)
    for bad in (1.0, True, "0", None):
        with pytest.raises(ArgumentTypeError):
            a.incref(bad)  # type: ignore[arg-type]
        with pytest.raises((ArgumentTypeError, InvalidArgumentError)):
            a.release([0, bad])  # type: ignore[list-item]
    for bad_n in (1.5, True, "2"):
        with pytest.raises(ArgumentTypeError):
            a.allocate(bad_n)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError):
            a.can_allocate(bad_n)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        a.allocate(-1)
    assert state(a) == before
    assert a.integrity_problems() == []


def test_integrity_problems_name_the_block() -> None:
    a = BlockAllocator(3)
    a.allocate(1)
    a._ref[0] = 0  # simulate a lost reference
    assert any("block 0" in p for p in a.integrity_problems())
