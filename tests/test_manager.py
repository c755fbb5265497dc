"""Block manager: scripted cases with exact block ids, and errors that change nothing."""

from __future__ import annotations

import pytest

from kvcache import (
    BlockManager,
    IntegrityError,
    InvalidArgumentError,
    OutOfBlocksError,
    ScheduledRow,
    SequenceExistsError,
    UnknownSequenceError,
)
from tests.manager_state import snapshot


def test_allocate_append_free_exact_blocks_and_slots() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    assert m.allocate("a", 6) == 0
    assert m.block_table("a") == [0, 1]
    assert m.slots("a", 0, 6) == [0, 1, 2, 3, 4, 5]
    assert m.append_slots("a", 1) == [6]
    assert m.append_slots("a", 3) == [7, 8, 9]  # crosses into block 2
    assert m.block_table("a") == [0, 1, 2]
    m.allocate("b", 1)
    assert m.block_table("b") == [3]
    m.free("a")
    # freed blocks hold nothing cached: reused first, tail first
    assert m.allocator.free_blocks_in_eviction_order()[:3] == [0, 1, 2]
    m.allocate("c", 9)
    assert m.block_table("c") == [0, 1, 2]
    m.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_last_block() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("p", 10)  # blocks 0, 1 full; 2 holds 2 tokens
    copies = m.fork("p", "c")
    assert copies == [(2, 3)]
    assert m.block_table("c") == [0, 1, 3]
    assert [m.allocator.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert m.append_slots("c", 1) == [3 * 4 + 2]
    assert m.append_slots("p", 1) == [2 * 4 + 2]
    m.check_integrity()
    m.free("p")
    assert [m.allocator.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    m.free("c")
    assert m.num_free_blocks == 8
    m.check_integrity()


def test_fork_of_a_full_last_block_copies_nothing() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("p", 8)
    assert m.fork("p", "c") == []
    assert m.append_slots("c", 1) == [8]  # a new private block, never the shared one
    m.check_integrity()


def test_errors_leave_state_unchanged() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 10)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.allocate("b", 9)
    with pytest.raises(SequenceExistsError, match="'a' already has blocks"):
        m.allocate("a", 1)
    with pytest.raises(UnknownSequenceError, match="'zz' is unknown"):
        m.append_slots("zz", 1)
    with pytest.raises(UnknownSequenceError):
        m.free("zz")
    with pytest.raises(OutOfBlocksError):
        m.append_slots("a", 7)  # needs 2 new blocks, 1 free
    with pytest.raises(ValueError, match="n: 0"):
        m.append_slots("a", 0)
    with pytest.raises(ValueError, match="num_tokens"):
        m.allocate("c", 0)
    with pytest.raises(SequenceExistsError):
        m.fork("a", "a")
    m.allocate("full", 2)  # takes the last block
    mid = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.fork("a", "child")  # partial last block, nothing free for the copy
    assert snapshot(m) == mid
    m.free("full")
    assert snapshot(m)["seqs"] == before["seqs"]
    m.check_integrity()


def test_can_methods_agree_with_actions() -> None:
    m = BlockManager(num_blocks=3, block_size=4)
    assert m.can_allocate(12) and not m.can_allocate(13)
    m.allocate("a", 5)
    assert m.can_append("a", 7) and not m.can_append("a", 8)  # 12 slots in all
    assert m.can_fork("a")
    m.allocate("b", 1)
    assert not m.can_fork("a")
    # can_append(seq, 0) raises exactly what append_slots(seq, 0) raises (it used to say False).
    for call in (m.can_append, m.append_slots):
        with pytest.raises(InvalidArgumentError, match="n: 0 is below the minimum 1"):
            call("a", 0)


def test_slots_outside_reserved_tokens_are_refused() -> None:
    m = BlockManager(num_blocks=2, block_size=4)
    m.allocate("a", 3)
    with pytest.raises(ValueError, match="append_slots first"):
        m.slots("a", 2, 4)


def test_check_integrity_reports_the_numbers() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 5)
    m.sequence("a").blocks.append(3)  # corrupt: block table holds a block it does not own
    with pytest.raises(IntegrityError) as info:
        m.check_integrity()
    text = str(info.value)
    assert "2 blocks for 5 tokens" not in text  # 3 blocks now
    assert "3 blocks for 5 tokens (want 2)" in text
    assert "block 3: reference count 0, but 1 block tables and holds have it" in text


def test_commit_records_exactly_what_a_step_computed() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("a", 10)
    m.allocate("b", 3)
    m.commit([ScheduledRow("a", 4, start=0), ScheduledRow("b", 3)])  # b: start defaults to 0
    assert (m.num_computed("a"), m.num_computed("b")) == (4, 3)
    m.commit([ScheduledRow("a", 6, start=2)])  # a recomputed chunk may overlap the prefix
    assert m.num_computed("a") == 8
    m.commit([ScheduledRow("a", 1, start=3)])  # entirely inside: nothing moves back
    assert m.num_computed("a") == 8
    m.append_slots("b", 1)
    m.commit([ScheduledRow("b", 1)])  # a decode row: the last reserved token
    assert m.num_computed("b") == 4
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="do not continue"):
        m.commit([ScheduledRow("b", 1, start=3), ScheduledRow("a", 1, start=9 + 1)])
    assert snapshot(m) == before, "a refused commit records none of its rows"
    m.check_integrity()


def test_free_reasons_and_preemption_counts() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    for seq in ("f", "x", "p"):
        m.allocate(seq, 5)
    m.free("f")
    m.free("x", reason="aborted")
    m.free("p", reason="preempted")
    assert m.preemptions == {"recompute": 1, "swap": 0}
    assert m.num_free_blocks == 8
    m.allocate("p", 9)  # a preempted (recompute) sequence is admitted again under its id
    m.check_integrity()


# ---- deferred token ids (an overlapped engine learns sampled tokens a step late) ----------


def test_deferred_ids_are_keyed_once_given_and_then_shared() -> None:
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = [1, 2, 3]
    m.allocate("a", token_ids=prompt)
    m.commit([ScheduledRow("a", 3, start=0)])
    # Step N sampled token 4 on the device; step N+1 reserves its slot before the host knows it.
    assert m.append_slots("a", 1, defer_ids=True) == [3]
    assert m.sequence("a").num_pending == 1
    m.commit([ScheduledRow("a", 1, start=3)])  # computed, but its id is unknown: not keyed
    assert m.sequence("a").keys == []
    m.check_integrity()
    assert m.can_allocate(token_ids=[1, 2, 3, 4, 9])
    assert m.allocate("probe", token_ids=[1, 2, 3, 4, 9]) == 0  # nothing to share yet
    m.free("probe")
    m.fill_token_ids("a", [4])
    assert m.sequence("a").num_pending == 0 and len(m.sequence("a").keys) == 1
    m.check_integrity()
    assert m.allocate("b", token_ids=[1, 2, 3, 4, 9]) == 4  # the block is shared now
    assert m.block_table("b")[0] == m.block_table("a")[0]
    m.check_integrity()


def test_deferred_ids_without_prefix_caching_only_count() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    m.allocate("a", 2)
    m.append_slots("a", 2, defer_ids=True)
    m.fill_token_ids("a", [7])
    m.fill_token_ids("a", [8])
    assert m.sequence("a").num_pending == 0 and m.num_tokens("a") == 4
    m.check_integrity()


def test_deferred_id_misuse_is_refused_and_changes_nothing() -> None:
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    m.allocate("a", token_ids=[1, 2, 3])
    m.append_slots("a", 1, defer_ids=True)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="now or later"):
        m.append_slots("a", 1, token_ids=[5], defer_ids=True)
    with pytest.raises(InvalidArgumentError, match="fill_token_ids first"):
        m.append_slots("a", 1, token_ids=[5])
    with pytest.raises(InvalidArgumentError, match="waits for 1"):
        m.fill_token_ids("a", [5, 6])
    with pytest.raises(InvalidArgumentError, match="waits for 1"):
        m.fill_token_ids("a", [])
    with pytest.raises(TypeError, match="defer_ids"):
        m.append_slots("a", 1, defer_ids=1)  # type: ignore[arg-type]
    with pytest.raises(UnknownSequenceError):
        m.fill_token_ids("nobody", [1])
    assert snapshot(m) == before
    m.check_integrity()
    m.fill_token_ids("a", [4])
    m.append_slots("a", 1, token_ids=[5])  # in order again
    m.check_integrity()


def test_fork_and_detach_keep_pending_ids() -> None:
    m = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    m.allocate("p", token_ids=[1, 2, 3])
    m.append_slots("p", 1, defer_ids=True)
    m.fork("p", "c")
    assert m.sequence("c").num_pending == 1
    record = m.detach("p", swapped=True)
    m.attach("p", record)
    for seq in ("p", "c"):
        m.fill_token_ids(seq, [4])
    m.commit([ScheduledRow("p", 4, start=0), ScheduledRow("c", 4, start=0)])
    m.check_integrity()
