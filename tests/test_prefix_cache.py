"""Prefix caching: exact hits and eviction order on scripted cases (block_size 4)."""

from __future__ import annotations

import pytest

from kvcache import BlockAllocator, BlockManager, MetadataBuilder, ScheduledRow, collect_stats
from kvcache.blocks.prefix_cache import PrefixCache

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
    stats = collect_stats(m)
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
    evictions_before = collect_stats(m).prefix_cache_evictions
    m.allocate("big", 4 * BS)  # takes 5, 6, 7 and evicts block 2 only
    assert m.block_table("big") == [5, 6, 7, 2]
    assert collect_stats(m).prefix_cache_evictions == evictions_before + 1
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
    """Keys chain through the *content* of every earlier block (they used to chain through
    (block, generation)): once a parent block is refilled with other tokens, D + B below must
    not hit B's block, whose K/V was computed after A, not after D."""
    cache = PrefixCache(BS)
    alloc = BlockAllocator(2, on_evict=cache.forget)
    head, tail = alloc.allocate(2)
    keys: list = []
    cache.index([head, tail], keys, A + B, None, 2)
    assert cache.match(A + B, None)[0] == [head, tail]
    alloc.release([head], cache.holders)  # freed holding cached K/V; the only free block
    assert alloc.allocate(1) == [head]  # refilled: its old key is dropped (on_evict -> forget)
    cache.index([head], [], D, None, 1)
    assert cache.match(D + B, None)[0] == [head]
    assert cache.match(A + B, None)[0] == []
    assert cache.evictions == 1
    assert cache.integrity_problems() == []


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


# ---- content-keyed prefix caching (block_size 32) -------------------------------------------

BS32 = 32


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` distinct-looking token ids, different for each seed."""
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def _decode(m: BlockManager, seq: object, new: list[int], full: list[int]) -> None:
    """Feed ``new`` back one token a step: append its slot, then mark it computed."""
    for t in new:
        m.append_slots(seq, 1, token_ids=[t])
        m.mark_computed(seq, m.num_tokens(seq))
        full.append(t)


@pytest.mark.parametrize("order", ["a-first", "b-first"])
def test_same_step_shared_prefix_caches_both_continuations(order: str) -> None:
    """Issue repro: two requests sharing a 64-token prefix, admitted in the same step (so the
    prefix is computed twice), differing in their next 32 tokens. Under (block, generation)
    keys the second request's later blocks were keyed under its own copy of the prefix, which
    lookups never reach: it found 64 cached tokens instead of 128."""
    m = BlockManager(16, BS32, enable_prefix_caching=True)
    shared = _tokens(1, 64)
    full = {"a": shared + _tokens(2, 32), "b": shared + _tokens(3, 32)}
    assert m.allocate("a", token_ids=full["a"]) == 0
    assert m.allocate("b", token_ids=full["b"]) == 0  # a's K/V is not written yet
    m.commit([ScheduledRow("a", 96, start=0), ScheduledRow("b", 96, start=0)])
    for step in range(40):
        for seq in ("a", "b"):
            _decode(m, seq, [(step * 31 + len(seq) + (seq == "b") * 1000) % 32000], full[seq])
    assert m.num_tokens("a") == m.num_tokens("b") == 136
    m.free("a")
    m.free("b")
    m.check_integrity()
    first, second = ("a", "b") if order == "a-first" else ("b", "a")
    assert m.allocate(first + "2", token_ids=full[first] + _tokens(4, 10)) == 128
    assert m.allocate(second + "2", token_ids=full[second] + _tokens(5, 10)) == 128
    m.check_integrity()


@pytest.mark.parametrize("first_still_running", [False, True])
def test_repeated_prompt_follow_up_turn_finds_the_answer(first_still_running: bool) -> None:
    """Issue repro: a 64-token prompt P (exactly two blocks) is sent twice. The second request
    hits only P's first block (a prompt's last token is always recomputed), so it computes
    its own copy of P's second block, and the 32 tokens it generates fill a third block after
    that copy. Its follow-up turn, P + answer + new turn, must find all 96 tokens; with keys
    chained through physical blocks it found 64."""
    m = BlockManager(16, BS32, enable_prefix_caching=True)
    prompt = _tokens(1, 64)
    first = list(prompt)
    assert m.allocate("r1", token_ids=prompt) == 0
    m.commit([ScheduledRow("r1", 64, start=0)])
    _decode(m, "r1", _tokens(2, 32), first)
    if not first_still_running:
        m.free("r1")
    second = list(prompt)
    assert m.allocate("r2", token_ids=prompt) == 32
    m.commit([ScheduledRow("r2", 32, start=32)])
    _decode(m, "r2", _tokens(3, 32), second)  # 33 generated; the last is never fed back
    m.free("r2")
    if first_still_running:
        m.free("r1")
    m.check_integrity()
    assert m.allocate("turn2", token_ids=second + _tokens(4, 12)) == 96
    assert m.allocate("turn1", token_ids=first + _tokens(5, 12)) == 96
    m.check_integrity()


def test_commit_shares_only_the_chunk_a_step_computed() -> None:
    """The old README trap: after a step that computed only the first chunk of a prompt,
    marking the whole reserved prompt computed would hand its unwritten blocks to the next
    request with the same prompt. commit(rows) records exactly what the step computed."""
    m = BlockManager(16, BS, enable_prefix_caching=True)
    prompt = A + B + C + D + [0]  # 17 tokens, 4 full blocks
    assert m.allocate("a", token_ids=prompt) == 0
    chunk = ScheduledRow("a", 6, start=0)  # the step's token budget allowed 6 tokens
    MetadataBuilder("cpu").build(m, [chunk])
    m.commit([chunk])
    assert m.num_computed("a") == 6
    assert m.allocate("b", token_ids=prompt) == 4, "only the block the chunk completed is shared"
    m.commit([ScheduledRow("a", 6, start=6)])  # the next chunk: tokens 6..11
    assert m.allocate("c", token_ids=prompt) == 12
    m.commit([ScheduledRow("a", 5, start=12)])  # the rest
    assert m.allocate("d", token_ids=prompt) == 16
    m.check_integrity()


def test_a_refilled_block_is_never_a_hit() -> None:
    """A cached free block taken for new content is dropped from the index, so a later
    request with its old content recomputes it instead of reading another sequence's K/V."""
    m = BlockManager(11, BS, enable_prefix_caching=True)
    m.allocate("x", 2 * BS)  # blocks 0, 1, freed later as plain blocks
    computed(m, "old", A + B + C)  # blocks 2, 3, 4: all cached
    m.free("old")
    m.allocate("big", 7 * BS)  # the six never-used blocks, then evicts block 4 (C's)
    assert m.block_table("big") == [5, 6, 7, 8, 9, 10, 4]
    assert collect_stats(m).prefix_cache_evictions == 1
    m.free("x")
    assert m.allocate("again", token_ids=A + B + C + [0]) == 8
    assert not set(m.block_table("again")) & set(m.block_table("big")), "a hit on a block big now owns"
    m.check_integrity()
