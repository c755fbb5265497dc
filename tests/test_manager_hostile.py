"""Hostile use of the manager: misuse must raise the project's typed errors and leave a full
snapshot unchanged (free-queue order, reference counts, holds, sequences, swapped-out ids,
prefix-cache index); every can_* query agrees with its action; none of it relies on
``assert`` (checked once under ``python -O``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvcache.memory.swap
from kvcache import (
    ArgumentTypeError,
    BlockManager,
    InvalidArgumentError,
    KVCacheError,
    KVCacheTensors,
    OutOfBlocksError,
    ScheduledRow,
    SequenceExistsError,
    SwapSpace,
    UnknownSequenceError,
    collect_stats,
    preempt,
)
from kvcache.blocks.sequence import SequenceBlocks
from tests.manager_state import snapshot

ROOT = Path(__file__).resolve().parent.parent
BS = 4
A, B, C, D = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [4, 3, 2, 1]


def busy_manager() -> tuple[BlockManager, SwapSpace]:
    """A manager in a state with something of everything: running sequences (one partly
    filled, one sharing cached blocks), cached free blocks, a plain free block, a hold, and a
    swapped-out sequence."""
    m = BlockManager(12, BS, enable_prefix_caching=True)
    cache = KVCacheTensors(torch.zeros(1, 2, 12, BS, 1, 8))
    swap = SwapSpace(m, cache, 4)
    m.allocate("keep", token_ids=A + B + [1])  # blocks 0, 1, 2
    m.commit([ScheduledRow("keep", 9, start=0)])
    m.allocate("old", token_ids=A + B + C + D + [2])  # hits 0, 1; new 3, 4, 5
    m.commit([ScheduledRow("old", 9, start=8)])
    m.free("old")  # 5 plain; 4, 3 cached
    m.allocate("share", token_ids=A + B + C + [7, 7])  # hits 0, 1, 3
    m.allocate("gone", 6)
    swap.swap_out("gone")
    m.hold(m.block_table("keep")[:1])
    m.check_integrity()
    return m, swap


TYPED = (ArgumentTypeError, InvalidArgumentError, UnknownSequenceError, SequenceExistsError)

MISUSES: dict[str, tuple[Callable[[BlockManager, SwapSpace], object], type[KVCacheError]]] = {
    # holds and releases
    "release a block never held": (lambda m, s: m.release([m.block_table("share")[-1]]), InvalidArgumentError),
    "release a free block": (
        lambda m, s: m.release([m.allocator.free_blocks_in_eviction_order()[0]]),
        InvalidArgumentError,
    ),
    "release a held block twice": (lambda m, s: m.release([0, 0]), InvalidArgumentError),
    "release out of range": (lambda m, s: m.release([12]), InvalidArgumentError),
    "release an unhashable id": (lambda m, s: m.release([[0]]), ArgumentTypeError),
    "release a non-iterable": (lambda m, s: m.release(0), ArgumentTypeError),
    "hold a free block": (lambda m, s: m.hold([m.allocator.free_blocks_in_eviction_order()[0]]), InvalidArgumentError),
    "hold an owned and a free block": (
        lambda m, s: m.hold([1, m.allocator.free_blocks_in_eviction_order()[-1]]),
        InvalidArgumentError,
    ),
    "hold -1": (lambda m, s: m.hold([-1]), InvalidArgumentError),
    "hold past the pool": (lambda m, s: m.hold([1, 12]), InvalidArgumentError),
    "hold a huge id": (lambda m, s: m.hold([10**30]), InvalidArgumentError),
    "hold a float id": (lambda m, s: m.hold([1.0]), ArgumentTypeError),
    "hold a bool id": (lambda m, s: m.hold([True]), ArgumentTypeError),
    "hold a string id": (lambda m, s: m.hold(["1"]), ArgumentTypeError),
    "hold a non-iterable": (lambda m, s: m.hold(1), ArgumentTypeError),
    # appends write a running sequence's partly filled last block in place: a copy would tear
    "hold a running sequence's partly filled last block": (
        lambda m, s: m.hold([m.block_table("keep")[-1]]),
        InvalidArgumentError,
    ),
    "hold a full block and a partly filled last block": (
        lambda m, s: m.hold([1, m.block_table("share")[-1]]),
        InvalidArgumentError,
    ),
    "commit a number": (lambda m, s: m.commit(5), ArgumentTypeError),
    "commit None": (lambda m, s: m.commit(None), ArgumentTypeError),
    "commit a string": (lambda m, s: m.commit("keep"), ArgumentTypeError),
    "blocks_for a string": (lambda m, s: m.blocks_for("3"), ArgumentTypeError),
    "blocks_for None": (lambda m, s: m.blocks_for(None), ArgumentTypeError),
    "blocks_for -1": (lambda m, s: m.blocks_for(-1), InvalidArgumentError),
    # the allocator underneath
    "double free in the allocator": (
        lambda m, s: m.allocator.decref(m.allocator.free_blocks_in_eviction_order()[0]),
        InvalidArgumentError,
    ),
    "incref a free block": (
        lambda m, s: m.allocator.incref(m.allocator.free_blocks_in_eviction_order()[0]),
        InvalidArgumentError,
    ),
    "batch release with one double free": (lambda m, s: m.allocator.release([2, 2]), InvalidArgumentError),
    # counts
    "allocate 1.0 tokens": (lambda m, s: m.allocate("x", 1.0), ArgumentTypeError),
    "allocate True tokens": (lambda m, s: m.allocate("x", True), ArgumentTypeError),
    "allocate '3' tokens": (lambda m, s: m.allocate("x", "3"), ArgumentTypeError),
    "allocate 0 tokens": (lambda m, s: m.allocate("x", 0), InvalidArgumentError),
    "allocate -4 tokens": (lambda m, s: m.allocate("x", -4), InvalidArgumentError),
    "allocate without a length": (lambda m, s: m.allocate("x"), InvalidArgumentError),
    "allocate a length that disagrees with the ids": (
        lambda m, s: m.allocate("x", 3, token_ids=A),
        InvalidArgumentError,
    ),
    "append 1.0": (lambda m, s: m.append_slots("share", 1.0, token_ids=[0]), ArgumentTypeError),
    "append True": (lambda m, s: m.append_slots("share", True, token_ids=[0]), ArgumentTypeError),
    "append '1'": (lambda m, s: m.append_slots("share", "1", token_ids=[0]), ArgumentTypeError),
    "append 0": (lambda m, s: m.append_slots("share", 0, token_ids=[]), InvalidArgumentError),
    "append -1": (lambda m, s: m.append_slots("share", -1), InvalidArgumentError),
    "can_append 0": (lambda m, s: m.can_append("share", 0), InvalidArgumentError),
    "can_append 2.5": (lambda m, s: m.can_append("share", 2.5), ArgumentTypeError),
    "mark_computed 9.0": (lambda m, s: m.mark_computed("keep", 9.0), ArgumentTypeError),
    "mark_computed backwards": (lambda m, s: m.mark_computed("keep", 3), InvalidArgumentError),
    "mark_computed past the end": (lambda m, s: m.mark_computed("share", 15), InvalidArgumentError),
    "slots with a float": (lambda m, s: m.slots("keep", 0.0, 2), ArgumentTypeError),
    "slots past the end": (lambda m, s: m.slots("keep", 0, 10), InvalidArgumentError),
    "commit a float num_new": (lambda m, s: m.commit([ScheduledRow("share", 1.0)]), ArgumentTypeError),
    "commit a bool start": (lambda m, s: m.commit([ScheduledRow("share", 1, start=True)]), ArgumentTypeError),
    "commit with a gap": (lambda m, s: m.commit([ScheduledRow("share", 1, start=13)]), InvalidArgumentError),
    "commit a good row and a bad one": (
        lambda m, s: m.commit([ScheduledRow("share", 2, start=12), ScheduledRow("keep", 0)]),
        InvalidArgumentError,
    ),
    "commit something that is not a row": (lambda m, s: m.commit([("share", 1)]), ArgumentTypeError),
    "free for a bad reason": (lambda m, s: m.free("share", reason="done"), InvalidArgumentError),
    "preempt in a bad mode": (lambda m, s: preempt(m, "share", "pause"), InvalidArgumentError),
    "preempt by swap without a space": (lambda m, s: preempt(m, "share", "swap"), InvalidArgumentError),
    "SwapSpace of 2.5 blocks": (lambda m, s: SwapSpace(m, s.cache, 2.5), ArgumentTypeError),
    "SwapSpace of 0 blocks": (lambda m, s: SwapSpace(m, s.cache, 0), InvalidArgumentError),
    # unhashable or unknown ids
    "allocate an unhashable id": (lambda m, s: m.allocate(["x"], 3), ArgumentTypeError),
    "allocate an existing id": (lambda m, s: m.allocate("keep", 3), SequenceExistsError),
    "allocate a swapped-out id": (lambda m, s: m.allocate("gone", 3), SequenceExistsError),
    "fork onto a swapped-out id": (lambda m, s: m.fork("keep", "gone"), SequenceExistsError),
    "fork onto an unhashable id": (lambda m, s: m.fork("keep", {}), ArgumentTypeError),
    "fork an unhashable id": (lambda m, s: m.fork({}, "x"), ArgumentTypeError),
    "append to an unhashable id": (lambda m, s: m.append_slots([], 1), ArgumentTypeError),
    "can_append an unhashable id": (lambda m, s: m.can_append([], 1), ArgumentTypeError),
    "free an unhashable id": (lambda m, s: m.free([]), ArgumentTypeError),
    "free an unknown id": (lambda m, s: m.free("nope"), UnknownSequenceError),
    "free a swapped-out id": (lambda m, s: m.free("gone"), UnknownSequenceError),
    "commit an unhashable id": (lambda m, s: m.commit([ScheduledRow([], 1)]), ArgumentTypeError),
    "mark_computed an unhashable id": (lambda m, s: m.mark_computed([], 1), ArgumentTypeError),
    "detach an unhashable id": (lambda m, s: m.detach([]), ArgumentTypeError),
    "attach onto an unhashable id": (lambda m, s: m.attach([], m.sequence("keep")), ArgumentTypeError),
    "attach onto a running id": (lambda m, s: m.attach("keep", m.sequence("keep")), SequenceExistsError),
    "drop_swapped an unhashable id": (lambda m, s: m.drop_swapped([]), ArgumentTypeError),
    "swap out an unhashable id": (lambda m, s: s.swap_out([]), ArgumentTypeError),
    "swap in a running id": (lambda m, s: s.swap_in("keep"), SequenceExistsError),
    "swap in an unknown id": (lambda m, s: s.swap_in("nope"), UnknownSequenceError),
    "unhashable extra key": (lambda m, s: m.allocate("x", token_ids=A, extra_key=[]), ArgumentTypeError),
    # token ids
    "a string as token ids": (lambda m, s: m.allocate("x", token_ids="abcd"), ArgumentTypeError),
    "a float token id": (lambda m, s: m.allocate("x", token_ids=[1, 2, 3.0]), ArgumentTypeError),
    "a string token id": (lambda m, s: m.allocate("x", token_ids=[1, "2", 3]), ArgumentTypeError),
    "a None token id": (lambda m, s: m.allocate("x", token_ids=[1, None]), ArgumentTypeError),
    "a bool token id": (lambda m, s: m.allocate("x", token_ids=[1, True, 3]), ArgumentTypeError),
    "append a bool token id": (lambda m, s: m.append_slots("share", 1, token_ids=[False]), ArgumentTypeError),
    "a token id past int64": (lambda m, s: m.allocate("x", token_ids=[2**63]), ArgumentTypeError),
    "a float tensor of ids": (lambda m, s: m.allocate("x", token_ids=torch.ones(3)), ArgumentTypeError),
    "a bool tensor of ids": (
        lambda m, s: m.allocate("x", token_ids=torch.ones(3, dtype=torch.bool)),
        ArgumentTypeError,
    ),
    "a 2-D tensor of ids": (
        lambda m, s: m.allocate("x", token_ids=torch.ones(2, 2, dtype=torch.long)),
        InvalidArgumentError,
    ),
    "can_allocate a float token id": (lambda m, s: m.can_allocate(token_ids=[1.5]), ArgumentTypeError),
    "append a string token id": (lambda m, s: m.append_slots("share", 1, token_ids=["a"]), ArgumentTypeError),
    "append without ids (prefix-cached)": (lambda m, s: m.append_slots("share", 1), InvalidArgumentError),
    "append too few ids": (lambda m, s: m.append_slots("share", 2, token_ids=[1]), InvalidArgumentError),
    "a token id of 2**70": (lambda m, s: m.allocate("x", token_ids=[1, 2**70]), ArgumentTypeError),
    "append a token id of 2**70": (lambda m, s: m.append_slots("share", 1, token_ids=[2**70]), ArgumentTypeError),
    # swapped-out ids and records
    "drop_swapped an id a SwapSpace holds": (lambda m, s: m.drop_swapped("gone"), InvalidArgumentError),
    "attach something that is not a record": (lambda m, s: m.attach("x", ("blocks", 3)), ArgumentTypeError),
    "attach a record with too few blocks": (
        lambda m, s: m.attach("x", _record(m, blocks=[0])),
        InvalidArgumentError,
    ),
    "attach a record computed past its tokens": (
        lambda m, s: m.attach("x", _record(m, num_computed=99)),
        InvalidArgumentError,
    ),
    "attach a record whose ids miss tokens": (
        lambda m, s: m.attach("x", _record(m, token_ids=[1, 2])),
        InvalidArgumentError,
    ),
    "attach a record with a float count": (
        lambda m, s: m.attach("x", _record(m, num_tokens=9.0)),
        ArgumentTypeError,
    ),
    # foreign objects
    "preempt with something that is not a manager": (lambda m, s: preempt(object(), "share"), ArgumentTypeError),
    "preempt into a swap space of another manager": (
        lambda m, s: preempt(m, "share", "swap", SwapSpace(BlockManager(12, BS), s.cache, 2)),
        InvalidArgumentError,
    ),
    "collect_stats with a swap space of another manager": (
        lambda m, s: collect_stats(m, SwapSpace(BlockManager(12, BS), s.cache, 2)),
        InvalidArgumentError,
    ),
    "collect_stats with something that is not a swap space": (
        lambda m, s: collect_stats(m, object()),
        ArgumentTypeError,
    ),
}


def _record(m: BlockManager, **change: object) -> SequenceBlocks:
    """A copy of "keep"'s record with ``change`` applied (what a caller might hand attach)."""
    return dataclasses.replace(m.sequence("keep").copy_onto(list(m.block_table("keep")), keep_keys=True), **change)


@pytest.mark.parametrize("name", list(MISUSES))
def test_misuse_raises_a_typed_error_and_changes_nothing(name: str) -> None:
    call, expected = MISUSES[name]
    m, swap = busy_manager()
    before = snapshot(m, swap)
    host = swap.host.clone().view(torch.uint8)  # bits: the unwritten pool may hold NaNs
    with pytest.raises(KVCacheError) as info:
        call(m, swap)
    assert isinstance(info.value, expected), f"{name}: raised {type(info.value).__name__}: {info.value}"
    assert snapshot(m, swap) == before, f"{name}: raised but changed the manager"
    assert torch.equal(swap.host.view(torch.uint8), host)
    m.check_integrity()
    assert swap.integrity_problems() == []


def test_out_of_blocks_changes_nothing() -> None:
    m, swap = busy_manager()
    before = snapshot(m, swap)
    free = m.num_free_blocks
    for call in (
        lambda: m.allocate("x", (free + 1) * BS),
        lambda: m.append_slots("keep", free * BS + 4, token_ids=[0] * (free * BS + 4)),
        lambda: m.allocate("x", token_ids=A + B + C + D + list(range(100, 100 + 4 * free)) + [0]),
        lambda: swap.swap_out("keep"),  # 3 blocks, the host pool has 2 left
    ):
        with pytest.raises(OutOfBlocksError):
            call()
        assert snapshot(m, swap) == before


# ---- every can_* agrees with its action ------------------------------------------------


def outcome(call: Callable[..., object], *args: object, **kwargs: object) -> tuple[str, object]:
    """``("value", result)`` or ``(error class name, message)`` for a project error."""
    try:
        return ("value", call(*args, **kwargs))
    except KVCacheError as err:
        return (type(err).__name__, str(err))


def agrees(query: tuple[str, object], action: tuple[str, object]) -> bool:
    """A can_* answer True <=> the action succeeded; False <=> it ran out of blocks; an
    argument error <=> the same error from the action."""
    if query[0] == "value":
        return (action[0] == "value") if query[1] else (action[0] == "OutOfBlocksError")
    return query == action


def cached_state(prefix_caching: bool = True) -> BlockManager:
    """7 blocks of 4: "keep" holds A, B and a partial block (0, 1, 2); C, D are cached in the
    free blocks 3, 4; 5 and 6 are plain free blocks: 4 free in all. (Without prefix caching:
    the same counts, nothing cached.)"""
    m = BlockManager(7, BS, enable_prefix_caching=prefix_caching)
    m.allocate("keep", token_ids=A + B + [1])
    m.commit([ScheduledRow("keep", 9, start=0)])
    m.allocate("old", token_ids=(A + B if prefix_caching else []) + C + D + [2])
    m.commit([ScheduledRow("old", m.num_tokens("old") - m.num_computed("old"), start=m.num_computed("old"))])
    m.free("old")
    assert m.num_free_blocks == 4
    return m


PROMPTS = {
    "none": None,
    "hits in use and free": A + B + C + D + [0],  # 4 hits, 2 revived, 1 new: 3 of 4 free
    "hits, too long": A + B + C + D + A + B + [0],  # 4 hits, 2 revived, 3 new: 5
    "ends on a block": A + B + C + D,  # the last token is recomputed: 3 hits, 1 revived, 1 new
    "no hits": C + D + [0],
    "16 fresh": list(range(100, 116)),
    "17 fresh": list(range(100, 117)),
    "tensor": torch.tensor(A + B + C + D + [0]),
    "non-int": [1, 2.5],
}
COUNTS = [None, -1, 0, 1, 16, 17, 21, 1.0, True, "3"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_can_allocate_agrees_with_allocate(prefix_caching: bool) -> None:
    for prompt_name, prompt in PROMPTS.items():
        for n in COUNTS:
            for extra in (None, "salt", ["unhashable"]):
                m = cached_state(prefix_caching)
                before = snapshot(m)
                query = outcome(m.can_allocate, n, token_ids=prompt, extra_key=extra)
                assert snapshot(m) == before, "can_allocate changed the state"
                action = outcome(m.allocate, "new", n, token_ids=prompt, extra_key=extra)
                where = f"prompt {prompt_name}, n={n!r}, extra={extra!r}: can {query}, allocate {action}"
                assert agrees(query, action), where
                if action[0] != "value":
                    assert snapshot(m) == before, where
                m.check_integrity()


def test_can_append_agrees_with_append_slots() -> None:
    for seq in ("keep", "nope", ["unhashable"]):
        for n in (-1, 0, 1, 3, 4, 7, 15, 16, 1.0, True, "1", None):
            for prefix_caching in (True, False):
                m = cached_state(prefix_caching)
                before = snapshot(m)
                query = outcome(m.can_append, seq, n)
                assert snapshot(m) == before, "can_append changed the state"
                ids = [0] * n if type(n) is int and n > 0 else [0]
                action = outcome(m.append_slots, seq, n, token_ids=ids)
                where = f"seq={seq!r}, n={n!r}, prefix caching {prefix_caching}: can {query}, append {action}"
                assert agrees(query, action), where
                if action[0] != "value":
                    assert snapshot(m) == before, where


def test_can_fork_agrees_with_fork() -> None:
    for parent in ("keep", "full", "nope", ["unhashable"]):
        for fill in (False, True):
            m = cached_state()
            m.allocate("full", 8)  # a full last block: forks copy nothing
            if fill:
                m.allocate("hog", m.num_free_blocks * BS)
            before = snapshot(m)
            query = outcome(m.can_fork, parent)
            assert snapshot(m) == before, "can_fork changed the state"
            action = outcome(m.fork, parent, "child")
            where = f"parent={parent!r}, pool full {fill}: can {query}, fork {action}"
            assert agrees(query, action), where
            if action[0] != "value":
                assert snapshot(m) == before, where
            m.check_integrity()


def test_can_swap_agrees_with_swap() -> None:
    for host_blocks in (1, 2, 3):
        for device_full in (False, True):
            m = BlockManager(6, BS)
            swap = SwapSpace(m, KVCacheTensors(torch.zeros(1, 2, 6, BS, 1, 8)), host_blocks)
            m.allocate("a", 9)  # 3 blocks
            before = snapshot(m, swap)
            query = outcome(swap.can_swap_out, "a")
            assert snapshot(m, swap) == before, "can_swap_out changed the state"
            action = outcome(swap.swap_out, "a")
            assert agrees(query, action), f"host {host_blocks}: can {query}, swap_out {action}"
            if action[0] != "value":
                assert snapshot(m, swap) == before
                continue
            if device_full:
                m.allocate("hog", 5 * BS)
            before = snapshot(m, swap)
            query = outcome(swap.can_swap_in, "a")
            assert snapshot(m, swap) == before, "can_swap_in changed the state"
            action = outcome(swap.swap_in, "a")
            assert agrees(query, action), f"device full {device_full}: can {query}, swap_in {action}"
            if action[0] != "value":
                assert snapshot(m, swap) == before


@pytest.mark.parametrize("seq", ["nope", ["unhashable"]], ids=["unknown", "unhashable"])
def test_can_swap_agrees_with_swap_for_bad_ids(seq: object) -> None:
    m = BlockManager(6, BS)
    swap = SwapSpace(m, KVCacheTensors(torch.zeros(1, 2, 6, BS, 1, 8)), 2)
    before = snapshot(m, swap)
    for query, action in ((swap.can_swap_out, swap.swap_out), (swap.can_swap_in, swap.swap_in)):
        q, a = outcome(query, seq), outcome(action, seq)
        assert q[0] != "value" and agrees(q, a), f"{query.__name__}: {q}, {action.__name__}: {a}"
    assert snapshot(m, swap) == before
    assert outcome(swap.is_swapped, seq) == ("value", False)


# ---- swapped-out ids stay reserved ------------------------------------------------------


def test_a_swapped_out_id_is_reserved_until_swapped_in_or_dropped() -> None:
    m = BlockManager(8, BS)
    swap = SwapSpace(m, KVCacheTensors(torch.zeros(1, 2, 8, BS, 1, 8)), 4)
    m.allocate("a", 6)
    m.allocate("b", 6)
    swap.swap_out("a")
    swap.swap_out("b")
    assert "a" not in m and swap.is_swapped("a")
    assert m.preemptions == {"recompute": 0, "swap": 2}
    for call in (lambda: m.allocate("a", 1), lambda: m.fork("b2", "a") if "b2" in m else m.allocate("a", 2)):
        before = snapshot(m, swap)
        with pytest.raises(SequenceExistsError, match="swapped out"):
            call()
        assert snapshot(m, swap) == before
    swap.swap_in("a")
    assert m.num_tokens("a") == 6
    with pytest.raises(SequenceExistsError):
        m.allocate("a", 1)  # running again: still taken
    swap.drop("b")
    assert m.allocate("b", 3) == 0  # dropped: the id is free
    m.free("a")
    assert m.allocate("a", 1) == 0
    m.check_integrity()
    assert swap.integrity_problems() == []


def test_detach_swapped_reserves_the_id_until_attach_or_drop() -> None:
    m = BlockManager(8, BS)
    m.allocate("a", 5)
    record = m.detach("a", swapped=True)
    assert m.preemptions["swap"] == 1 and m.num_free_blocks == 8
    with pytest.raises(SequenceExistsError):
        m.allocate("a", 1)
    assert m.attach("a", record) == [0, 1]  # fresh blocks (its own, freed plain: head reused first)
    assert m.num_tokens("a") == 5
    m.free("a", reason="preempted")
    assert m.preemptions == {"recompute": 1, "swap": 1}
    m.allocate("b", 1)
    record = m.detach("b", swapped=True)
    m.drop_swapped("b")
    m.allocate("b", 2)
    m.check_integrity()


def test_detach_with_a_hold_keeps_the_blocks_until_released() -> None:
    """What an asynchronous swap-out does: its partly filled last block is held too (nothing
    appends to a detached sequence), every block stays allocated until released; blocks a
    fork shares stay with the fork."""
    m = BlockManager(8, BS)
    m.allocate("a", 2 * BS + 1)  # three blocks, the last partly filled
    blocks = m.block_table("a")
    with pytest.raises(InvalidArgumentError, match="partly filled last block of sequence 'a'"):
        m.hold(blocks)  # running, it may still append into its last block
    m.detach("a", swapped=True, hold=True)
    assert m.num_free_blocks == 5 and "a" not in m
    m.check_integrity()
    m.release(blocks)
    assert m.num_free_blocks == 8
    m.check_integrity()
    m.allocate("p", 2 * BS)
    m.fork("p", "child")  # shares p's two full blocks
    shared = m.block_table("p")
    m.detach("p", swapped=True, hold=True)
    m.release(shared)
    assert m.block_table("child") == shared and m.num_free_blocks == 6
    m.check_integrity()


# ---- swap space construction ------------------------------------------------------------


@pytest.mark.parametrize(
    ("cache_blocks", "cache_block_size"), [(4, BS), (7, BS), (8, 2 * BS)], ids=["half", "one short", "block size"]
)
def test_swap_space_over_a_mismatched_cache_is_refused_allocating_nothing(
    monkeypatch: pytest.MonkeyPatch, cache_blocks: int, cache_block_size: int
) -> None:
    m = BlockManager(8, BS)
    cache = KVCacheTensors(torch.zeros(1, 2, cache_blocks, cache_block_size, 1, 8))
    made: list[str] = []
    real_empty, real_allocator = torch.empty, kvcache.memory.swap.BlockAllocator

    def spy_empty(*args: object, **kwargs: object) -> torch.Tensor:
        made.append("host pool")
        return real_empty(*args, **kwargs)  # type: ignore[arg-type]

    def spy_allocator(*args: object, **kwargs: object) -> object:
        made.append("host allocator")
        return real_allocator(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kvcache.memory.swap.torch, "empty", spy_empty)
    monkeypatch.setattr(kvcache.memory.swap, "BlockAllocator", spy_allocator)
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="build both from the same config"):
        SwapSpace(m, cache, 4)
    assert made == [], "refused after allocating"
    assert snapshot(m) == before
    SwapSpace(m, KVCacheTensors(torch.zeros(1, 2, 8, BS, 1, 8)), 4)  # the spies do see a good one
    assert sorted(made) == ["host allocator", "host pool"]


# ---- the same under python -O -----------------------------------------------------------

_OPTIMIZED_SCRIPT = """
import sys
if __debug__:
    print("not optimized"); raise SystemExit(2)
import torch
from kvcache import (ArgumentTypeError, BlockManager, InvalidArgumentError, KVCacheTensors,
                     ScheduledRow, SequenceExistsError, SwapSpace, UnknownSequenceError)
from tests.manager_state import snapshot

A, B = [1, 2, 3, 4], [5, 6, 7, 8]
m = BlockManager(8, 4, enable_prefix_caching=True)
swap = SwapSpace(m, KVCacheTensors(torch.zeros(1, 2, 8, 4, 1, 8)), 4)
m.allocate("a", token_ids=A + B + [0])
m.commit([ScheduledRow("a", 9, start=0)])
m.allocate("b", token_ids=A + [9])
m.allocate("c", 5)
swap.swap_out("c")
m.allocate("d", token_ids=B + [1])
m.free("d")
free = m.allocator.free_blocks_in_eviction_order()
misuse = [
    ("double free", lambda: m.allocator.decref(free[0]), InvalidArgumentError),
    ("release never held", lambda: m.release([0]), InvalidArgumentError),
    ("hold a free block", lambda: m.hold([free[-1]]), InvalidArgumentError),
    ("hold out of range", lambda: m.hold([0, 8]), InvalidArgumentError),
    ("incref a free block", lambda: m.allocator.incref(free[0]), InvalidArgumentError),
    ("float count", lambda: m.allocate("x", 2.0), ArgumentTypeError),
    ("bool count", lambda: m.append_slots("a", True, token_ids=[1]), ArgumentTypeError),
    ("string count", lambda: m.can_append("a", "1"), ArgumentTypeError),
    ("zero count", lambda: m.can_append("a", 0), InvalidArgumentError),
    ("unhashable id", lambda: m.allocate([], 1), ArgumentTypeError),
    ("non-int token", lambda: m.allocate("x", token_ids=[1, "2"]), ArgumentTypeError),
    ("swapped-out id", lambda: m.allocate("c", 1), SequenceExistsError),
    ("unknown id", lambda: m.free("zz"), UnknownSequenceError),
    ("commit with a gap", lambda: m.commit([ScheduledRow("b", 1, start=5)]), InvalidArgumentError),
    ("mark_computed backwards", lambda: m.mark_computed("a", 1), InvalidArgumentError),
]
failed = 0
for name, call, expected in misuse:
    before = snapshot(m, swap)
    try:
        call()
    except expected:
        pass
    except BaseException as err:
        print(f"{name}: raised {type(err).__name__}: {err}"); failed += 1; continue
    else:
        print(f"{name}: did not raise"); failed += 1; continue
    if snapshot(m, swap) != before:
        print(f"{name}: changed the state"); failed += 1
try:
    m.check_integrity()
except Exception as err:
    print(f"integrity: {err}"); failed += 1
if failed:
    raise SystemExit(1)
print("ok")
"""


def test_misuse_is_caught_under_python_O() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
