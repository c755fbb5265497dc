"""Random allocate / append / fork / free / commit / mark_computed / preempt / swap sequences
against the manager, mixed with invalid calls.

After every step ``check_integrity()`` recounts everything; a refused operation must leave the
state exactly as it was; at the end every block is free again. The swap variant also keeps
real cache tensors in which every token's K/V is a value derived from its whole prefix (as
real K/V is), and checks after every step that each sequence reads back exactly its own
values: nothing lost, duplicated, or overwritten by a swap, a fork copy or a cache hit.
Invalid calls (bad counts, bad ids, misuse) must raise the project's typed errors and change
nothing.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Hashable

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    ArgumentTypeError,
    BlockManager,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    KVCacheError,
    KVCacheTensors,
    KVEvent,
    MetadataBuilder,
    MetadataError,
    OutOfBlocksError,
    ScheduledRow,
    SequenceExistsError,
    SwapSpace,
    UnknownSequenceError,
    collect_stats,
    preempt,
)
from kvcache.blocks.prefix_cache import BlockKey
from kvcache.memory.disk_tier import HEADER_BYTES
from kvcache.memory.host_tier import HostPrefixTier
from tests.manager_state import snapshot as manager_snapshot

BLOCK_SIZE = 4
NUM_BLOCKS = 12
HOST_BLOCKS = 6
PIECES = ([7, 3, 5, 1], [2, 8, 6, 4], [0, 1, 0, 1])


def snapshot(m: BlockManager, swap: SwapSpace | None) -> tuple[object, ...]:
    tier = m.lower_tier
    held = None if tier is None else [(k.tokens, k.extra, tier.lookup(k)) for k in tier.held_keys()]
    return (manager_snapshot(m, swap), held, None if swap is None else swap.host.clone())


def same_state(before: tuple[object, ...], after: tuple[object, ...]) -> bool:
    if before[:2] != after[:2]:
        return False
    if before[2] is None:
        return True
    return torch.equal(before[2].nan_to_num(-1), after[2].nan_to_num(-1))  # type: ignore[union-attr]


#: What an invalid call may raise: the project's typed errors only.
ARGUMENT_ERRORS = (ArgumentTypeError, InvalidArgumentError, UnknownSequenceError, SequenceExistsError)


def prefix_value(tokens: list[int]) -> float:
    """A stand-in for K/V: depends on the whole prefix, like real keys and values."""
    return float(hash(tuple(tokens)) % 1_000_003)


class ManagerMachine(RuleBasedStateMachine):
    prefix_caching = False
    with_swap = False
    with_host_tier = False
    with_disk_tier = False

    def __init__(self) -> None:
        super().__init__()
        self.m = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=self.prefix_caching)
        self.tokens: dict[Hashable, list[int]] = {}  # running sequences
        self.swapped: dict[Hashable, list[int]] = {}
        #: Ids appended with defer_ids=True and not given yet (the manager keys none of them).
        self.pending: dict[Hashable, list[int]] = {}
        self.next_id = 0
        self.builder = MetadataBuilder("cpu")  # persistent, as an engine's
        self.cache: KVCacheTensors | None = None
        self.swap: SwapSpace | None = None
        if self.with_swap:
            self.cache = KVCacheTensors(torch.full((1, 2, NUM_BLOCKS, BLOCK_SIZE, 1, 1), float("nan")))
            self.swap = SwapSpace(self.m, self.cache, HOST_BLOCKS)
        self.tier: HostPrefixTier | None = None
        if self.with_host_tier:
            assert self.cache is not None
            self.folder = tempfile.mkdtemp(prefix="kv-disk-tier-") if self.with_disk_tier else None
            disk_bytes = 8 * (HEADER_BYTES + 2 * BLOCK_SIZE * 4) if self.with_disk_tier else 0  # 8 files
            host_blocks = 2 if self.with_disk_tier else HOST_BLOCKS
            self.tier = HostPrefixTier(self.m, self.cache, host_blocks, disk_dir=self.folder, disk_bytes=disk_bytes)
        #: What a router knows from the KV events: the digests each tier holds.
        self.mirror: dict[str, set[bytes]] = {"device": set(), "host": set(), "disk": set()}
        self.last_event = 0
        self.m.kv_events.subscribe(self._on_event)

    def _on_event(self, event: KVEvent) -> None:
        assert event.seq == self.last_event + 1, "event numbers skip or repeat"
        self.last_event = event.seq
        mirror = self.mirror[event.tier]
        if isinstance(event, BlockStored):
            assert event.digest not in mirror, "a block stored twice in a tier without a removal"
            mirror.add(event.digest)
        elif isinstance(event, BlockRemoved):
            mirror.remove(event.digest)
        else:
            mirror.clear()

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
            assert same_state(before, snapshot(self.m, self.swap)), "a refused operation changed the state"
            return True
        return False

    def _token_arg(self, tokens: list[int]) -> list[int] | None:
        return tokens if self.prefix_caching else None

    # ---- rules ---------------------------------------------------------------------------

    @rule(n=st.integers(1, 3 * BLOCK_SIZE + 1), data=st.data())
    def allocate(self, n: int, data: st.DataObject) -> None:
        self._admit(self._draw_tokens(data, n))

    def _admit(self, tokens: list[int]) -> None:
        n = len(tokens)
        seq = self.next_id
        expect = self.m.can_allocate(n, token_ids=self._token_arg(tokens))
        before = collect_stats(self.m).prefix_cache_hits
        refused = self._refused(self.m.allocate, seq, n, token_ids=self._token_arg(tokens))
        assert refused != expect, "can_allocate disagreed with allocate"
        if not refused:
            self.next_id += 1
            self.tokens[seq] = tokens
            hit = collect_stats(self.m).prefix_cache_hits - before
            self._write(seq, hit)  # the cached prefix is not recomputed

    @precondition(lambda self: self.m.num_free_blocks > 0)
    @rule(data=st.data())
    def allocate_every_free_block(self, data: st.DataObject) -> None:
        """A prompt as long as the free pool: evicts every cached free block (the pressure
        under which a stale prefix-cache entry would hand out refilled blocks)."""
        n = self.m.num_free_blocks * BLOCK_SIZE - data.draw(st.integers(0, BLOCK_SIZE - 1))
        self.allocate(n, data)

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(1, BLOCK_SIZE + 2), data=st.data())
    def append(self, n: int, data: st.DataObject, defer: bool = False) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        new = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        if self.pending.get(seq) and not defer:  # ids come in order: the deferred ones first
            before = snapshot(self.m, self.swap)
            with pytest.raises(InvalidArgumentError, match="fill_token_ids first"):
                self.m.append_slots(seq, n, token_ids=self._token_arg(new))
            assert same_state(before, snapshot(self.m, self.swap))
            return
        expect = self.m.can_append(seq, n)
        if defer:
            refused = self._refused(self.m.append_slots, seq, n, defer_ids=True)
        else:
            refused = self._refused(self.m.append_slots, seq, n, token_ids=self._token_arg(new))
        assert refused != expect, "can_append disagreed with append_slots"
        if not refused:
            start = len(self.tokens[seq])
            self.tokens[seq] = self.tokens[seq] + new
            if defer:
                self.pending.setdefault(seq, []).extend(new)
            self._write(seq, start)

    @precondition(lambda self: self.tokens)
    @rule(n=st.integers(1, 2), data=st.data())
    def append_deferred(self, n: int, data: st.DataObject) -> None:
        """An overlapped engine's append: the sampled token's id is not known yet."""
        self.append(n, data, defer=True)

    @precondition(lambda self: any(self.pending.get(seq) for seq in self.tokens))
    @rule(data=st.data())
    def fill_ids(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(s for s in self.tokens if self.pending.get(s))))
        k = data.draw(st.integers(1, len(self.pending[seq])))
        self.m.fill_token_ids(seq, self.pending[seq][:k])
        del self.pending[seq][:k]

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
            self.pending[child] = list(self.pending.get(parent, []))
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
    def commit(self, data: st.DataObject) -> None:
        """A step that computed a chunk continuing each chosen sequence's computed prefix (a
        chunk may start inside it, as a recomputed chunk does)."""
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=3, unique=True))
        rows = []
        for seq in seqs:
            record = self.m.sequence(seq)
            start = data.draw(st.integers(0, min(record.num_computed, record.num_tokens - 1)))
            end = data.draw(st.integers(max(start + 1, record.num_computed), record.num_tokens))
            rows.append(ScheduledRow(seq, end - start, start=start))
        expect = {
            seq: max(self.m.num_computed(seq), row.start + row.num_new) for seq, row in zip(seqs, rows, strict=True)
        }
        self.m.commit(rows)
        assert {seq: self.m.num_computed(seq) for seq in seqs} == expect

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        """Rows a step might schedule, valid or not: the builder accepts exactly the steps the
        rules allow (each sequence once; tokens within its held ones; starting no later than
        what is computed or planned) with the manager's slots, and refuses the rest naming
        the row, changing nothing."""
        ids = sorted(self.tokens)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3))
        rows = []
        for seq in chosen:
            held = self.m.num_tokens(seq)
            start = data.draw(st.integers(0, held))
            rows.append(ScheduledRow(seq, data.draw(st.integers(0, held - start + 1)), start=start))
        bs = self.m.block_size

        def allowed(row: ScheduledRow) -> bool:
            r = self.m.sequence(row.seq_id)
            end = row.start + row.num_new  # type: ignore[operator]
            frontier = max(r.num_computed, r.num_planned)
            return row.num_new >= 1 and end <= r.num_tokens and r.num_released * bs <= row.start <= frontier

        valid = len(set(chosen)) == len(chosen) and all(allowed(r) for r in rows)
        planned_before = {seq: self.m.sequence(seq).num_planned for seq in ids}
        before = snapshot(self.m, self.swap)
        if not valid:
            with pytest.raises(MetadataError, match=r"rows\[\d\]"):
                self.builder.build(self.m, rows)
            assert same_state(before, snapshot(self.m, self.swap))
            assert {seq: self.m.sequence(seq).num_planned for seq in ids} == planned_before
            return
        meta = self.builder.build(self.m, rows)
        want = [slot for r in rows for slot in self.m.slots(r.seq_id, r.start, r.start + r.num_new)]  # type: ignore[operator]
        assert meta.slot_mapping.tolist() == want
        for r in rows:
            assert self.m.sequence(r.seq_id).num_planned == max(planned_before[r.seq_id], r.start + r.num_new)  # type: ignore[operator]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        reason = data.draw(st.sampled_from(["finished", "aborted", "preempted"]))
        counts = dict(self.m.preemptions)
        self.m.free(seq, reason=reason)
        del self.tokens[seq]
        self.pending.pop(seq, None)
        counts["recompute"] += reason == "preempted"
        assert self.m.preemptions == counts

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = collect_stats(self.m, self.swap).preemptions_recompute
        preempt(self.m, seq, "recompute")
        del self.tokens[seq]
        self.pending.pop(seq, None)
        assert collect_stats(self.m, self.swap).preemptions_recompute == before + 1
        self.m.check_new_id(seq)  # a recomputed sequence can be admitted again at once

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        """Take back trailing tokens (rejected drafts): the block copies it returns are
        performed, and every sequence still reads its own K/V; later appends rewrite the cut
        positions without touching what others share or what the prefix index serves."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq]
        n = data.draw(st.integers(1, len(tokens)))
        expect = self.m.can_truncate(seq, n)
        result: list[list[tuple[int, int]]] = []
        refused = self._refused(lambda: result.append(self.m.truncate(seq, n)))
        assert refused != expect, "can_truncate disagreed with truncate"
        if refused:
            return
        if self.cache is not None:
            self.cache.copy_blocks(result[0])
        pending = self.pending.get(seq, [])
        known = len(tokens) - len(pending)
        self.tokens[seq] = tokens[:n]
        self.pending[seq] = pending[: max(0, n - known)]
        record = self.m.sequence(seq)
        assert record.num_tokens == n and record.num_computed <= n and len(record.blocks) == -(-n // BLOCK_SIZE)
        assert record.num_pending == len(self.pending[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def detach_and_attach(self, data: st.DataObject) -> None:
        """An engine's own swap: detach a sequence, move its K/V aside, attach the record back
        (under its id or a new one) and write the K/V into the fresh blocks. Refused for want
        of blocks, the manager is as after the detach, and the sequence is gone."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens.pop(seq)
        pending = self.pending.pop(seq, [])
        kv = None
        if self.cache is not None:
            kv = self.cache.storage.view(2, -1)[:, self.m.slots(seq, 0, len(tokens))].clone()
        record = self.m.detach(seq)
        target = data.draw(st.sampled_from([seq, self.next_id]))
        if self._refused(self.m.attach, target, record):
            return
        if target == self.next_id:
            self.next_id += 1
        self.tokens[target], self.pending[target] = tokens, pending
        if kv is not None and self.cache is not None:
            self.cache.storage.view(2, -1)[:, self.m.slots(target, 0, len(tokens))] = kv
        self.m.mark_computed(target, self.m.num_computed(target))  # re-index its full blocks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def attach_contradictory_record(self, data: st.DataObject) -> None:
        """A record whose counts contradict its blocks or token ids, or an id in use: refused
        at the call with a typed error, nothing changed."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        r = self.m.sequence(seq)
        bs = self.m.block_size
        bad = [
            dataclasses.replace(r, num_computed=r.num_tokens + 1),
            dataclasses.replace(r, num_computed=-1),
            dataclasses.replace(r, num_tokens=r.num_tokens + bs),
            dataclasses.replace(r, blocks=[*r.blocks, r.blocks[-1]]),
            dataclasses.replace(r, num_pending=r.num_tokens + 1),
            dataclasses.replace(r, num_released=len(r.blocks) + 1),
            dataclasses.replace(r, keys=[None] * (r.num_tokens // bs + 1)),  # keys for more blocks than are full
        ]
        if r.token_ids is not None:
            bad.append(dataclasses.replace(r, token_ids=[*r.token_ids, 0]))
            bad.append(dataclasses.replace(r, token_base=-bs))
            bad.append(dataclasses.replace(r, token_base=(len(r.keys) + 1) * bs, token_ids=r.token_ids[bs:]))
        record = data.draw(st.sampled_from(bad))
        before = snapshot(self.m, self.swap)
        with pytest.raises(InvalidArgumentError, match="record: "):
            self.m.attach(self.next_id, record)
        with pytest.raises(SequenceExistsError):
            self.m.attach(seq, r)
        assert same_state(before, snapshot(self.m, self.swap))

    @rule(data=st.data())
    def invalid_call(self, data: st.DataObject) -> None:
        """A random misuse: it must raise a typed error (the same one from the matching can_*
        query) and leave everything as it was."""
        m = self.m
        new_id = self.next_id
        calls: list[tuple[str, Callable[[], object], tuple[type[BaseException], ...]]] = []
        for bad in (0, -1, 1.5, True, "3", None):
            calls.append((f"allocate n={bad!r}", lambda b=bad: m.allocate(new_id, b), ARGUMENT_ERRORS))
            calls.append((f"can_allocate n={bad!r}", lambda b=bad: m.can_allocate(b), ARGUMENT_ERRORS))
        calls += [
            ("allocate unhashable id", lambda: m.allocate([new_id], 3), (ArgumentTypeError,)),
            ("allocate str tokens", lambda: m.allocate(new_id, token_ids="abc"), (ArgumentTypeError,)),
            (
                "allocate num_tokens != len(token_ids)",
                lambda: m.allocate(new_id, 2, token_ids=[1, 2, 3]),
                (InvalidArgumentError,),
            ),
            ("allocate unhashable extra_key", lambda: m.allocate(new_id, 3, extra_key=[1]), (ArgumentTypeError,)),
            ("append unknown", lambda: m.append_slots("nope", 1, token_ids=[0]), (UnknownSequenceError,)),
            ("can_append unknown", lambda: m.can_append("nope", 1), (UnknownSequenceError,)),
            ("free unknown", lambda: m.free("nope"), (UnknownSequenceError,)),
            ("fork unknown", lambda: m.fork("nope", new_id), (UnknownSequenceError,)),
            ("commit unknown", lambda: m.commit([ScheduledRow("nope", 1)]), (UnknownSequenceError,)),
            ("preempt bad mode", lambda: preempt(m, "nope", "pause"), ARGUMENT_ERRORS),
            (
                "hold free block",
                lambda: m.hold([b for b in range(NUM_BLOCKS) if m.allocator.is_free(b)][:1] or [-1]),
                (InvalidArgumentError,),
            ),
            ("hold out of range", lambda: m.hold([NUM_BLOCKS]), (InvalidArgumentError,)),
            ("hold float id", lambda: m.hold([0.0]), (ArgumentTypeError, InvalidArgumentError)),
            ("release never held", lambda: m.release([0]), (InvalidArgumentError,)),
        ]
        if self.prefix_caching:
            calls.append(
                ("allocate non-int token", lambda: m.allocate(new_id, token_ids=[1, 2.5, 3]), (ArgumentTypeError,))
            )
            calls.append(
                (
                    "allocate 2-D tensor tokens",
                    lambda: m.allocate(new_id, token_ids=torch.zeros(2, 2, dtype=torch.long)),
                    (InvalidArgumentError,),
                )
            )
            calls.append(
                (
                    "allocate float tensor tokens",
                    lambda: m.allocate(new_id, token_ids=torch.zeros(3)),
                    (ArgumentTypeError,),
                )
            )
        if self.tokens:
            seq = data.draw(st.sampled_from(sorted(self.tokens)))
            rec = m.sequence(seq)
            for bad in (0, -2, 2.0, False, "1"):
                calls.append(
                    (f"append n={bad!r}", lambda b=bad: m.append_slots(seq, b, token_ids=[0]), ARGUMENT_ERRORS)
                )
                calls.append((f"can_append n={bad!r}", lambda b=bad: m.can_append(seq, b), ARGUMENT_ERRORS))
            calls += [
                ("allocate existing id", lambda: m.allocate(seq, 1), (SequenceExistsError,)),
                ("fork onto existing id", lambda: m.fork(seq, seq), (SequenceExistsError,)),
                ("fork onto unhashable id", lambda: m.fork(seq, {}), (ArgumentTypeError,)),
                ("free bad reason", lambda: m.free(seq, reason="done"), (InvalidArgumentError,)),
                (
                    "mark_computed past the end",
                    lambda: m.mark_computed(seq, rec.num_tokens + 1),
                    (InvalidArgumentError,),
                ),
                ("mark_computed float", lambda: m.mark_computed(seq, float(rec.num_computed)), (ArgumentTypeError,)),
                ("commit num_new 0", lambda: m.commit([ScheduledRow(seq, 0)]), (InvalidArgumentError,)),
                (
                    "commit past the end",
                    lambda: m.commit([ScheduledRow(seq, 1, start=rec.num_tokens)]),
                    (InvalidArgumentError,),
                ),
                (
                    "commit a valid row with a bad one",
                    lambda: m.commit(
                        [ScheduledRow(seq, 1, start=min(rec.num_computed, rec.num_tokens - 1)), ScheduledRow("nope", 1)]
                    ),
                    (UnknownSequenceError,),
                ),
                ("slots past the end", lambda: m.slots(seq, 0, rec.num_tokens + 1), (InvalidArgumentError,)),
                ("release more than held", lambda: m.release(rec.blocks[-1:]), (InvalidArgumentError,)),
                ("hold owned + out of range", lambda: m.hold([rec.blocks[-1], -5]), (InvalidArgumentError,)),
            ]
            if rec.num_computed > 0:
                calls.append(
                    (
                        "mark_computed backwards",
                        lambda: m.mark_computed(seq, rec.num_computed - 1),
                        (InvalidArgumentError,),
                    )
                )
            if rec.num_computed + 1 < rec.num_tokens:
                calls.append(
                    (
                        "commit leaves a gap",
                        lambda: m.commit([ScheduledRow(seq, 1, start=rec.num_computed + 1)]),
                        (InvalidArgumentError,),
                    )
                )
            if self.prefix_caching:
                calls.append(("append without token ids", lambda: m.append_slots(seq, 1), (InvalidArgumentError,)))
                calls.append(
                    ("append with too few ids", lambda: m.append_slots(seq, 2, token_ids=[1]), (InvalidArgumentError,))
                )
                calls.append(
                    ("append non-int token", lambda: m.append_slots(seq, 1, token_ids=["x"]), (ArgumentTypeError,))
                )
            if self.swap is not None:
                calls.append(("preempt swap without a space", lambda: preempt(m, seq, "swap"), (InvalidArgumentError,)))
                calls.append(
                    (
                        "swap_in a running sequence",
                        lambda: self.swap.swap_in(seq),  # type: ignore[union-attr]
                        (SequenceExistsError,),
                    )
                )
        if self.swapped:
            parked = data.draw(st.sampled_from(sorted(self.swapped)))
            calls += [
                ("allocate a swapped-out id", lambda: m.allocate(parked, 1), (SequenceExistsError,)),
                (
                    "fork onto a swapped-out id",
                    lambda: m.fork(next(iter(self.tokens)), parked) if self.tokens else m.allocate(parked, 1),
                    (SequenceExistsError,),
                ),
                ("free a swapped-out id", lambda: m.free(parked), (UnknownSequenceError,)),
            ]
        label, call, expected = data.draw(st.sampled_from(calls), label="invalid call")
        before = snapshot(m, self.swap)
        try:
            call()
        except expected as err:
            assert isinstance(err, KVCacheError), f"{label}: {type(err).__name__} is not a KVCacheError"
        except BaseException as err:
            raise AssertionError(f"{label}: raised {type(err).__name__}: {err}, expected {expected}") from err
        else:
            raise AssertionError(f"{label}: did not raise")
        assert same_state(before, snapshot(m, self.swap)), f"{label}: raised but changed the state"

    @precondition(lambda self: self.with_swap and self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        assert self.swap is not None
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        expect = self.swap.can_swap_out(seq)
        refused = self._refused(preempt, self.m, seq, "swap", self.swap)
        assert refused != expect, "can_swap_out disagreed with swap_out"
        if not refused:
            self.swapped[seq] = self.tokens.pop(seq)
            # The id stays reserved until it is swapped in or dropped.
            assert not self.m.can_allocate(1) or not _can_take_id(self.m, seq)

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

    @precondition(lambda self: self.tier is not None and self.tier.disk is not None and self.tier.disk.held_keys())
    @rule(data=st.data())
    def damage_a_disk_file(self, data: st.DataObject, among: list[BlockKey] | None = None) -> None:
        """Flip a bit of one stored block's K (one of ``among``, when given): reading it back
        must refuse the file (the ``every_sequence_reads_its_own_kv`` invariant catches a
        served one)."""
        assert self.tier is not None and self.tier.disk is not None
        disk = self.tier.disk
        disk.flush()
        held = [k for k in (among or disk.held_keys()) if disk.holds(k)]
        if not held:
            return
        key = data.draw(st.sampled_from(held))
        path = disk.path_of(key)
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + data.draw(st.integers(0, BLOCK_SIZE * 4 - 1))] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(bytes(raw))

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.m.check_integrity()
        if self.swap is not None:
            assert self.swap.integrity_problems() == []
        if self.tier is not None:
            assert self.tier.integrity_problems() == []
        for seq, tokens in self.tokens.items():
            assert self.m.num_tokens(seq) == len(tokens)
            assert len(set(self.m.slots(seq, 0, len(tokens)))) == len(tokens), "two tokens share a slot"

    @invariant()
    def records_hold_the_tokens_given(self) -> None:
        """A prefix-cached record's keys and kept token ids are exactly the sequence's ids
        (after appends, deferred ids, forks, swaps and truncation alike)."""
        if not self.prefix_caching:
            return
        bs = BLOCK_SIZE
        for seq, tokens in self.tokens.items():
            r = self.m.sequence(seq)
            known = len(tokens) - len(self.pending.get(seq, []))
            assert r.token_ids == tokens[r.token_base : known], f"sequence {seq}: token ids differ"
            for j, key in enumerate(r.keys):
                assert list(key.tokens) == tokens[j * bs : (j + 1) * bs], f"sequence {seq}: key {j} differs"

    @invariant()
    def events_mirror_the_index(self) -> None:
        """A consumer of the KV events knows exactly what the prefix index holds; a late
        subscriber's replay says the same."""
        disk = None if self.tier is None else self.tier.disk
        held = {
            "device": set() if self.m.prefix_cache is None else {key.digest for key in self.m.prefix_cache.held_keys()},
            "host": set() if self.tier is None else {key.digest for key in self.tier.held_keys()},
            "disk": set() if disk is None else {key.digest for key in disk.held_keys()},
        }
        assert self.mirror == held
        late = self.m.kv_events.subscribe()
        replay = late.poll()
        late.close()
        for tier, digests in held.items():
            assert {e.digest for e in replay if isinstance(e, BlockStored) and e.tier == tier} == digests
        assert all(e.replayed and e.seq == self.last_event for e in replay)  # type: ignore[union-attr]

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
        if getattr(self, "folder", None):
            shutil.rmtree(self.folder, ignore_errors=True)


def _can_take_id(m: BlockManager, seq: Hashable) -> bool:
    try:
        m.check_new_id(seq)
    except SequenceExistsError:
        return False
    return True


class PrefixCachingMachine(ManagerMachine):
    prefix_caching = True


class SwapMachine(ManagerMachine):
    prefix_caching = True
    with_swap = True


class HostTierMachine(ManagerMachine):
    """Prefix caching over a host tier: evicted cached blocks come back from the host, and
    every sequence must still read exactly its own K/V."""

    prefix_caching = True
    with_swap = True
    with_host_tier = True


class DiskTierMachine(HostTierMachine):
    """A two-block host tier over a disk tier of eight files, some damaged on the way: blocks
    come back from disk, damaged ones are recomputed, and every sequence still reads exactly
    its own K/V."""

    with_disk_tier = True

    @precondition(lambda self: self.m.num_free_blocks > 0)
    @rule()
    def evict_the_free_blocks(self) -> None:
        """Take every free block and give it back: cached free blocks move down a tier (the
        host's oldest to disk), so later admissions find their prompts there."""
        filler = ("filler", self.next_id)
        self.next_id += 1
        self.m.allocate(filler, self.m.num_free_blocks * BLOCK_SIZE)
        self.m.free(filler)

    @precondition(lambda self: self.tier is not None and self.tier.disk is not None and self.tier.disk.held_keys())
    @rule(data=st.data())
    def readmit_a_prompt_from_disk(self, data: st.DataObject) -> None:
        """Admit the prompt of a block held on disk (its whole chain, one more token), half of
        the time after damaging a file: its run continues from disk wherever the device and
        the host have no more of it, up to a damaged file."""
        assert self.tier is not None and self.tier.disk is not None
        key: BlockKey | None = data.draw(st.sampled_from(self.tier.disk.held_keys()))
        links: list[BlockKey] = []
        while key is not None:
            links.append(key)
            key = key.parent
        if data.draw(st.booleans()):
            self.damage_a_disk_file(data, among=links)
        chain = [link.tokens for link in links]
        self._admit([t for block in reversed(chain) for t in block] + [data.draw(st.integers(0, 1))])


# No shrink phase: shrinking a failing 40-step run takes Hypothesis up to 5 minutes per
# machine on a 2-core box; the unshrunk failing steps are printed and are short enough to read.
_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)
TestManagerStateful = ManagerMachine.TestCase
TestManagerStateful.settings = _SETTINGS
TestPrefixCachingStateful = PrefixCachingMachine.TestCase
TestPrefixCachingStateful.settings = _SETTINGS
TestSwapStateful = SwapMachine.TestCase
TestSwapStateful.settings = _SETTINGS
TestHostTierStateful = HostTierMachine.TestCase
TestHostTierStateful.settings = _SETTINGS
TestDiskTierStateful = DiskTierMachine.TestCase
TestDiskTierStateful.settings = _SETTINGS
