"""``BlockManager.truncate``: taking back rejected draft tokens, all or nothing, with prefix
caching, forks (copy-on-write of a shared last block), deferred ids, sliding windows and the
persistent metadata builder. The stateful fuzz (``test_manager_stateful.py``) mixes it with
everything else."""

from __future__ import annotations

import pytest
import torch

from kvcache import (
    ArgumentTypeError,
    BlockManager,
    InvalidArgumentError,
    KVCacheTensors,
    MetadataBuilder,
    OutOfBlocksError,
    ScheduledRow,
    UnknownSequenceError,
    collect_stats,
)
from tests.manager_state import snapshot

BS = 4


def computed(m: BlockManager, seq: int, tokens: list[int]) -> None:
    m.allocate(seq, token_ids=tokens)
    m.mark_computed(seq, len(tokens))


def test_truncate_releases_the_blocks_past_the_end_and_clamps_the_counts() -> None:
    m = BlockManager(8, BS)
    m.allocate("a", 11)
    m.mark_computed("a", 9)
    table = m.block_table("a")
    slots = m.slots("a", 0, 5)
    assert m.truncate("a", 5) == []
    assert m.block_table("a") == table[:2]
    assert m.num_tokens("a") == 5 and m.num_computed("a") == 5
    assert m.slots("a", 0, 5) == slots
    assert m.num_free_blocks == 6
    m.append_slots("a", 4)  # grows again into a fresh block
    assert len(m.block_table("a")) == 3
    m.check_integrity()


def test_same_length_changes_nothing() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    computed(m, 0, list(range(10)))
    before = snapshot(m, None)
    assert m.truncate(0, 10) == []
    assert snapshot(m, None) == before


@pytest.mark.parametrize("bad", [0, -1, 11, 10**30])
def test_lengths_outside_the_sequence_are_refused_naming_the_range(bad: int) -> None:
    m = BlockManager(8, BS)
    m.allocate(0, 10)
    before = snapshot(m, None)
    with pytest.raises(InvalidArgumentError, match=r"num_tokens: .*between 1 and 10"):
        m.truncate(0, bad)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        m.can_truncate(0, bad)
    assert snapshot(m, None) == before


@pytest.mark.parametrize("bad", [1.5, "3", None, True])
def test_non_integers_are_type_errors(bad: object) -> None:
    m = BlockManager(8, BS)
    m.allocate(0, 10)
    with pytest.raises(ArgumentTypeError, match="num_tokens"):
        m.truncate(0, bad)  # type: ignore[arg-type]
    with pytest.raises(UnknownSequenceError):
        m.truncate(1, 3)


def test_a_cut_inside_a_shared_block_copies_it_first() -> None:
    """A fork shares the parent's full blocks; cutting the parent inside one gives it a
    fresh copy to write into, and the child keeps reading the original."""
    m = BlockManager(6, BS)
    m.allocate("p", 8)
    m.mark_computed("p", 8)
    m.fork("p", "c")
    shared = m.block_table("c")
    assert m.can_truncate("p", 6)
    copies = m.truncate("p", 6)
    assert len(copies) == 1 and copies[0][0] == shared[1]
    assert m.block_table("p") == [shared[0], copies[0][1]]
    assert m.block_table("c") == shared
    assert m.allocator.ref_count(shared[1]) == 1 and m.allocator.ref_count(shared[0]) == 2
    m.check_integrity()


def test_the_copy_is_performed_by_the_cache() -> None:
    m = BlockManager(6, BS)
    cache = KVCacheTensors(torch.randn(1, 2, 6, BS, 1, 2))
    m.allocate("p", 8)
    m.fork("p", "c")
    original = cache.storage[:, :, m.block_table("c")[1]].clone()
    cache.copy_blocks(m.truncate("p", 5))
    assert torch.equal(cache.storage[:, :, m.block_table("p")[1]], original)


def test_no_free_block_for_the_copy_refuses_and_changes_nothing() -> None:
    m = BlockManager(2, BS)
    m.allocate("p", 8)
    m.fork("p", "c")
    assert m.num_free_blocks == 0
    before = snapshot(m, None)
    assert not m.can_truncate("p", 6)
    with pytest.raises(OutOfBlocksError):
        m.truncate("p", 6)
    assert snapshot(m, None) == before
    assert m.can_truncate("p", 4) and m.truncate("p", 4) == []  # a cut at a block boundary copies nothing


def test_cut_cached_blocks_stay_cached_and_the_rewritten_one_is_not_served() -> None:
    """Blocks released whole keep their K/V and keys; the block the cut ends in is rewritten,
    so the index stops serving it; after the same tokens come back the whole prompt hits."""
    m = BlockManager(8, BS, enable_prefix_caching=True)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks, then 1
    computed(m, 0, prompt)
    assert m.truncate(0, 6) == []
    assert len(m.sequence(0).keys) == 1  # the first block stays keyed; the second is rewritten
    m.check_integrity()
    # A second request with the prompt hits the first block only: the second is being rewritten.
    assert m.allocate(1, token_ids=prompt) == BS
    m.free(1)
    # Sequence 0 takes different tokens at 6, 7: its block 1 is keyed for them.
    m.append_slots(0, 2, token_ids=[7, 7])
    m.mark_computed(0, 8)
    assert [list(k.tokens) for k in m.sequence(0).keys] == [prompt[:4], [104, 105, 7, 7]]
    m.free(0)
    # The original prompt from another request: only the first block is still right for it.
    assert m.allocate(2, token_ids=prompt) == BS
    m.check_integrity()


def test_retaking_the_same_tokens_keys_the_blocks_again() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    prompt = list(range(100, 113))
    computed(m, 0, prompt)
    m.truncate(0, 6)
    m.append_slots(0, 7, token_ids=prompt[6:])
    m.mark_computed(0, 13)
    hits = collect_stats(m).prefix_cache_hits
    assert m.allocate(1, token_ids=prompt) == 12  # all three full blocks, the rewritten one too
    assert collect_stats(m).prefix_cache_hits > hits
    m.check_integrity()


def test_deferred_ids_past_the_end_are_dropped() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    computed(m, 0, list(range(6)))
    m.append_slots(0, 3, defer_ids=True)  # positions 6, 7, 8: ids not known yet
    m.truncate(0, 7)
    assert m.sequence(0).num_pending == 1
    with pytest.raises(InvalidArgumentError):
        m.fill_token_ids(0, [1, 2])
    m.fill_token_ids(0, [42])
    m.mark_computed(0, 7)
    m.truncate(0, 3)
    assert m.sequence(0).num_pending == 0 and m.sequence(0).token_ids == [0, 1, 2]
    m.check_integrity()


def test_blocks_released_behind_the_window_cannot_come_back() -> None:
    m = BlockManager(8, BS, sliding_window=4)
    m.allocate(0, 14)
    m.mark_computed(0, 14)
    released = m.sequence(0).num_released
    assert released >= 2
    with pytest.raises(InvalidArgumentError, match="sliding window"):
        m.truncate(0, released * BS)
    m.truncate(0, released * BS + 1)
    assert m.num_tokens(0) == released * BS + 1
    m.check_integrity()


def test_the_builder_plans_the_truncated_table() -> None:
    m = BlockManager(8, BS)
    builder = MetadataBuilder("cpu")
    m.allocate(0, 9)
    m.mark_computed(0, 8)
    builder.build(m, [ScheduledRow(0, 1, start=8)])
    m.truncate(0, 5)
    meta = builder.build(m, [ScheduledRow(0, 1, start=4)])
    table = m.block_table(0)
    assert meta.block_tables[0, : len(table)].tolist() == table
    assert meta.slot_mapping.tolist() == m.slots(0, 4, 5)
    assert meta.seq_lens.tolist() == [5]


@pytest.mark.parametrize("hybrid", [False, True], ids=["windowed", "kv-groups"])
def test_a_rollback_of_up_to_window_lag_drafts_keeps_the_next_querys_window(hybrid: bool) -> None:
    """A draft row commits its drafts' K/V, which moves the window; rejecting them moves the
    next query back. With ``window_lag`` at least the drafts, every block that query sees is
    still held; without it, a block it sees can be released already (shown below)."""
    from attention import PAD_BLOCK
    from kvcache import HybridBlockManager, group_layout

    window, drafts = 9, 3

    def table_after_rollback(lag: int, start: int, keep: int) -> list[int]:
        manager: BlockManager | HybridBlockManager
        if hybrid:
            manager = HybridBlockManager(group_layout(2, window, (False, True)), 64, BS)
        else:
            manager = BlockManager(64, BS, sliding_window=window)
        manager.window_lag = lag
        manager.allocate("s", start + 1 + drafts)
        manager.mark_computed("s", start)
        manager.commit([ScheduledRow("s", 1 + drafts, start=start)])  # the sampled token and its drafts
        manager.truncate("s", keep)  # keep - start - 1 drafts agreed; the next query is at `keep`
        if isinstance(manager, HybridBlockManager):
            return manager.block_tables("s")[1]  # the windowed group's
        return manager.block_table("s")

    for lag in (0, drafts):
        failures = 0
        for start in range(1, 40):
            for keep in range(start + 1, start + 1 + drafts):
                table = table_after_rollback(lag, start, keep)
                seen = range(max(0, keep - window + 1) // BS, keep // BS + 1)  # blocks the query at keep reads
                failures += any(table[b] == PAD_BLOCK for b in seen if b < len(table))
        if lag:
            assert failures == 0
        else:
            assert failures > 0, "without the lag a rollback can need a released block (else this test shows nothing)"
