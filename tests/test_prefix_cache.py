"""Prefix caching: exact hits and eviction order on scripted cases (block_size 4)."""

from __future__ import annotations

from kvcache import BlockAllocator, BlockManager
from kvcache.prefix_cache import ROOT, PrefixCache

BS = 4


def computed(m: BlockManager, seq: object, tokens: list[int]) -> int:
    """Allocate ``tokens`` as a prompt and mark it computed; returns the cached-token count."""
    hit = m.allocate(seq, token_ids=tokens)
    m.mark_computed(seq, len(tokens))
    return hit


A, B, C, D = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [4, 3, 2, 1]


def test_hit_shares_blocks_and_the_last_token_is_always_recomputed() -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    assert computed(m, "x", A + B + C + [7]) == 0
    assert m.allocate("y", token_ids=A + B + [0, 0]) == 8
    assert m.block_table("y")[:2] == m.block_table("x")[:2]
    assert [m.allocator.ref_count(b) for b in m.block_table("x")[:2]] == [2, 2]
    # A prompt that is exactly cached full blocks still recomputes its last block.
    assert m.allocate("z", token_ids=A + B + C) == 8
    assert m.block_table("z")[2] != m.block_table("x")[2]
    stats = m.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13 + 10 + 12, 16)
    m.check_integrity()


def test_hits_need_the_whole_prefix_and_the_same_extra_key() -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    computed(m, "x", A + B + [0])
    assert m.allocate("other-head", token_ids=C + B + [0]) == 0  # same 2nd block, other parent
    assert m.allocate("salted", token_ids=A + B + [0], extra_key="lora-7") == 0
    assert m.allocate("plain", token_ids=A + B + [0]) == 8


def test_uncomputed_blocks_are_not_shared() -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    m.allocate("x", token_ids=A + B + [0])
    assert m.allocate("y", token_ids=A + B + [0]) == 0  # x's K/V is not written yet
    m.mark_computed("x", 5)
    assert m.allocate("z", token_ids=A + B + [0]) == 4  # only the first block is complete


def test_eviction_order_lru_and_tail_before_head() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    computed(m, "old", A + B + C)  # blocks 0, 1, 2 (all full, all cached)
    computed(m, "new", D + D + [0])  # blocks 3, 4, 5 (5 is partial: not cached)
    m.free("old")
    m.free("new")
    order = m.allocator.free_blocks_in_eviction_order()
    # Uncached blocks first (5, then the never-used 6, 7), then the least recently freed
    # sequence's blocks tail first, then the newer sequence's, tail first.
    assert order == [5, 6, 7, 2, 1, 0, 4, 3]
    evictions_before = m.stats().prefix_cache_evictions
    m.allocate("big", 4 * BS)  # takes 5, 6, 7 and evicts block 2 only
    assert m.block_table("big") == [5, 6, 7, 2]
    assert m.stats().prefix_cache_evictions == evictions_before + 1
    # A's first two blocks survive: the head of the old prompt outlives its tail.
    assert m.allocate("again", token_ids=A + B + C + [0]) == 8
    assert m.block_table("again")[:2] == [0, 1]
    m.check_integrity()


def test_a_hit_revives_a_free_block_from_the_middle_of_the_queue() -> None:
    m = BlockManager(6, BS, enable_prefix_caching=True)
    computed(m, "x", A + B + [0])
    m.free("x")
    assert m.allocate("y", token_ids=[*A, 0]) == 4
    assert 0 not in m.allocator.free_blocks_in_eviction_order()
    m.check_integrity()


def test_refilled_parent_block_cannot_reach_old_children() -> None:
    """Keys chain through (block, generation): once a parent block is refilled with other
    tokens, the blocks keyed under its old content are unreachable. Without the generation,
    D + B below would hit B's block, whose K/V was computed after A, not after D."""
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc, BS)
    head, tail = alloc.allocate(2)
    cache.insert(head, cache.key(ROOT, A, None))
    cache.insert(tail, cache.key(cache.parent_of(head), B, None))
    assert cache.match(A + B, None) == [head, tail]
    alloc.decref(head)  # freed as uncached: the next allocation takes it
    assert alloc.allocate(1) == [head]  # refilled: its old key is dropped, generation grows
    cache.insert(head, cache.key(ROOT, D, None))
    assert cache.match(D + B, None) == [head]
    assert cache.match(A + B, None) == []
    assert cache.evictions == 1


def test_reset_prefix_cache_forgets_everything() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    computed(m, "x", A + B + [0])
    assert m.reset_prefix_cache() == 2
    assert m.allocate("y", token_ids=A + B + [0]) == 0
    m.mark_computed("y", 9)
    m.free("x")
    m.check_integrity()


def test_fork_keeps_tokens_for_prefix_caching() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    computed(m, "p", [*A, 1, 2])
    m.fork("p", "c")
    m.append_slots("c", 2, token_ids=[3, 4])
    m.mark_computed("c", 8)
    m.free("p")
    m.free("c")
    assert m.allocate("q", token_ids=[*A, 1, 2, 3, 4, 0]) == 8
