"""KV events (``manager.kv_events``): stored, removed and cleared blocks with stable digests,
sequence numbers, replays for late subscribers, bounded buffers, and consumers that fail.
The stateful fuzz checks that a consumer's mirror equals the index after every operation."""

from __future__ import annotations

import pytest

from kvcache import (
    AllCleared,
    ArgumentTypeError,
    BlockManager,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    KVEvent,
    block_digests,
)

BS = 4


def admitted(m: BlockManager, seq: str, ids: list[int], salt: object = None) -> None:
    m.allocate(seq, token_ids=ids, extra_key=salt)
    m.mark_computed(seq, len(ids))


def test_computed_full_blocks_are_published_with_their_chain() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    sub = m.kv_events.subscribe()
    ids = list(range(100, 113))
    admitted(m, "a", ids, salt="tenant-a")
    events = sub.poll()
    digests = block_digests(ids, BS, "tenant-a")
    assert [type(e) for e in events] == [BlockStored] * 3
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.seq for e in stored] == [1, 2, 3]
    assert [e.digest for e in stored] == digests
    assert [e.parent for e in stored] == [None, *digests[:2]]
    assert [list(e.token_ids) for e in stored] == [ids[0:4], ids[4:8], ids[8:12]]
    assert all(e.tier == "device" and e.extra_key == "tenant-a" and not e.replayed for e in stored)
    assert sub.poll() == []


def test_a_block_computed_twice_is_stored_once_and_removed_when_the_last_copy_goes() -> None:
    m = BlockManager(4, BS, enable_prefix_caching=True)
    sub = m.kv_events.subscribe()
    ids = list(range(5))
    m.allocate("a", token_ids=ids)
    m.allocate("b", token_ids=ids)  # admitted together: both compute block 0
    m.mark_computed("a", 5)
    m.mark_computed("b", 5)
    assert [type(e) for e in sub.poll()] == [BlockStored]
    m.free("a")
    m.free("b")
    m.allocate("c", 16)  # needs every block: evicts both copies
    removed = sub.poll()
    assert [type(e) for e in removed] == [BlockRemoved]
    assert removed[0].digest == block_digests(ids, BS)[0]


def test_reset_publishes_all_cleared() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    admitted(m, "a", list(range(9)))
    sub = m.kv_events.subscribe(replay=False)
    m.reset_prefix_cache()
    (event,) = sub.poll()
    assert isinstance(event, AllCleared) and event.tier == "device" and event.seq == 1  # numbered once published


def test_a_truncation_removes_the_block_it_rewrites_and_keeps_the_released_ones() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    ids = list(range(13))
    admitted(m, "a", ids)
    sub = m.kv_events.subscribe(replay=False)
    m.truncate("a", 6)
    (event,) = sub.poll()
    assert isinstance(event, BlockRemoved) and event.digest == block_digests(ids, BS)[1]


def test_a_late_subscriber_gets_the_contents_then_live_events() -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    admitted(m, "a", list(range(13)))
    admitted(m, "b", [*range(8), 50, 51, 52, 53, 54])  # shares two blocks with a
    last = m.kv_events.last_seq
    sub = m.kv_events.subscribe()
    replay = sub.poll()
    stored = [e for e in replay if isinstance(e, BlockStored)]
    assert len(stored) == len(replay) == 4 and all(e.replayed and e.seq == last for e in stored)
    seen: set[bytes] = set()
    for e in stored:  # parents first
        assert e.parent is None or e.parent in seen
        seen.add(e.digest)
    admitted(m, "c", list(range(200, 205)))
    (live,) = sub.poll()
    assert isinstance(live, BlockStored) and live.seq == last + 1 and not live.replayed


def test_callbacks_get_events_and_a_failing_one_is_unsubscribed() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    got: list[KVEvent] = []
    m.kv_events.subscribe(got.append)

    def broken(event: KVEvent) -> None:
        raise RuntimeError("consumer bug")

    bad = m.kv_events.subscribe(broken)
    admitted(m, "a", list(range(9)))  # the manager call completes
    m.check_integrity()
    assert len(got) == 2 and bad.closed and isinstance(bad.error, RuntimeError)
    assert m.num_tokens("a") == 9 and m.num_computed("a") == 9


def test_a_full_buffer_drops_the_oldest_and_counts_them() -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    sub = m.kv_events.subscribe(capacity=2)
    admitted(m, "a", list(range(17)))  # four blocks stored
    assert sub.lost == 2 and [e.seq for e in sub.poll()] == [3, 4]
    sub.close()
    admitted(m, "b", list(range(40, 49)))
    assert sub.poll() == [] and sub.closed


def test_nothing_is_digested_while_no_one_subscribes() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    admitted(m, "a", list(range(13)))
    assert m.prefix_cache is not None
    assert all(key._digest is None for key in m.prefix_cache.held_keys())


def test_tenants_never_share_blocks_and_their_events_say_whose_they_are() -> None:
    m = BlockManager(16, BS, enable_prefix_caching=True)
    sub = m.kv_events.subscribe()
    ids = list(range(13))
    admitted(m, "a", ids, salt="tenant-a")
    assert m.allocate("b", token_ids=ids, extra_key="tenant-b") == 0  # no hit on a's blocks
    m.mark_computed("b", 13)
    assert m.allocate("a2", token_ids=ids, extra_key="tenant-a") == 12
    events = [e for e in sub.poll() if isinstance(e, BlockStored)]
    by_tenant = {salt: {e.digest for e in events if e.extra_key == salt} for salt in ("tenant-a", "tenant-b")}
    assert len(by_tenant["tenant-a"]) == len(by_tenant["tenant-b"]) == 3
    assert not by_tenant["tenant-a"] & by_tenant["tenant-b"]


def test_subscribe_arguments_are_checked() -> None:
    m = BlockManager(8, BS, enable_prefix_caching=True)
    with pytest.raises(ArgumentTypeError, match="callback"):
        m.kv_events.subscribe("print")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="replay"):
        m.kv_events.subscribe(replay=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="capacity"):
        m.kv_events.subscribe(capacity=0)
    assert not m.kv_events.active
