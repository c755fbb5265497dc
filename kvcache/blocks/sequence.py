"""Sequence records: one sequence's block table and token counts, and the table of them."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attention.checks import cdiv, require_int
from attention.errors import ArgumentTypeError, InvalidArgumentError, SequenceExistsError, UnknownSequenceError
from attention.metadata import PAD_BLOCK
from kvcache.blocks.parking import ParkedIds

if TYPE_CHECKING:
    from kvcache.blocks.allocator import BlockAllocator
    from kvcache.blocks.prefix_cache import BlockKey, PrefixCache

__all__ = ["BlockCopy", "SequenceBlocks", "SequenceTable", "checked_record"]

#: ``(source block, destination block)``: a copy the caller performs on the cache tensors.
BlockCopy = tuple[int, int]


@dataclass(slots=True)
class SequenceBlocks:
    """One sequence's block table and token counts (owned by the manager; read, don't write).

    blocks:       block ids covering its reserved tokens; ``PAD_BLOCK`` for leading blocks
                  released behind a sliding window.
    num_tokens:   token slots reserved (its length once all its tokens are computed).
    token_ids:    its token ids from position ``token_base`` on, kept only when prefix-cached
                  (to key its full blocks); the ids of blocks already keyed are dropped.
    token_base:   the position of ``token_ids[0]``.
    num_pending:  trailing reserved tokens whose ids the engine has not given yet
                  (``append_slots(..., defer_ids=True)``; an overlapped engine learns a sampled
                  token one step late); their blocks are keyed once the ids come.
    extra_key:    the caller's prefix-cache salt.
    num_computed: leading tokens whose K/V is written (``commit``).
    keys:         prefix-cache keys of its leading full blocks, as indexed (or hit).
    num_released: leading blocks released behind a sliding window.
    epoch:        grows whenever ``blocks`` changes other than by appending, so a persistent
                  metadata builder knows to rewrite the row.
    num_planned:  leading tokens computed or being computed by a step a builder has planned
                  (set when the plan is committed; an overlapped engine plans the next step
                  before committing this one): a row may start at most at
                  ``max(num_computed, num_planned)``.
    """

    blocks: list[int]
    num_tokens: int
    token_ids: list[int] | None = None
    extra_key: Hashable = None
    num_computed: int = 0
    keys: list[BlockKey] = field(default_factory=list)
    num_released: int = 0
    epoch: int = 0
    token_base: int = 0
    num_pending: int = 0
    num_planned: int = 0

    def slot_range(self, start: int, end: int, block_size: int) -> list[int]:
        """Slots (``block * block_size + offset``) of token positions ``[start, end)``; the
        one place slot arithmetic is written. The caller checks the range."""
        blocks = self.blocks
        if end - start == 1:
            return [blocks[start // block_size] * block_size + start % block_size]
        return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]

    def copy_onto(self, blocks: list[int], *, keep_keys: bool) -> SequenceBlocks:
        """A new record with this one's tokens over ``blocks`` (a fork, or a swap-in)."""
        return SequenceBlocks(
            blocks=blocks,
            num_tokens=self.num_tokens,
            token_ids=self.token_ids[:] if self.token_ids is not None else None,
            extra_key=self.extra_key,
            num_computed=self.num_computed,
            keys=list(self.keys) if keep_keys else [],
            num_released=self.num_released,
            token_base=self.token_base,
            num_pending=self.num_pending,
        )

    def key_full_blocks(self, cache: PrefixCache, block_size: int) -> None:
        """Index the computed full blocks not keyed yet in ``cache`` (a prefix-cached record,
        whose ``token_ids`` are kept), then drop their token ids: keys are read from then on."""
        assert self.token_ids is not None, "key_full_blocks needs a prefix-cached record"
        full = min(self.num_computed, self.num_tokens - self.num_pending) // block_size
        if full <= len(self.keys):
            return
        cache.index(self.blocks, self.keys, self.token_ids, self.extra_key, full, self.token_base)
        drop = full * block_size - self.token_base
        del self.token_ids[:drop]
        self.token_base += drop

    def fill_ids(self, seq_id: Hashable, ids: list[int], cache: PrefixCache | None, block_size: int) -> None:
        """The ids of the oldest pending tokens (``BlockManager.fill_token_ids``); keys the
        blocks now full, computed and known. Raises InvalidArgumentError (nothing changed)
        when more ids come than are pending."""
        if not 0 < len(ids) <= self.num_pending:
            raise InvalidArgumentError(
                f"token_ids: {len(ids)} id(s) for sequence {seq_id!r:.60}, which waits for {self.num_pending}"
            )
        self.num_pending -= len(ids)
        if self.token_ids is not None:
            self.token_ids.extend(ids)
            if cache is not None:
                self.key_full_blocks(cache, block_size)

    def problems(self, seq_id: Hashable, block_size: int, allocator: BlockAllocator) -> list[str]:
        """Every broken invariant of this record (empty: fine)."""
        name = repr(seq_id)[:60]
        found = self.count_problems(name, block_size)
        real = [b for b in self.blocks[self.num_released :]]
        if any(not 0 <= b < allocator.num_blocks for b in real):
            found.append(f"sequence {name} holds ids outside the pool: {real[:8]}")
        if len(set(real)) != len(real):
            found.append(f"sequence {name} holds a block twice: {real}")
        last_partial = self.num_tokens % block_size != 0
        if real and last_partial and 0 <= real[-1] < allocator.num_blocks and allocator.ref_count(real[-1]) > 1:
            found.append(f"sequence {name}: partly filled last block {real[-1]} is shared")
        return found

    def count_problems(self, name: str, block_size: int) -> list[str]:
        """The invariants between this record's counts, blocks and token ids (no pool needed)."""
        found = []
        want = cdiv(self.num_tokens, block_size)
        if len(self.blocks) != want:
            found.append(f"sequence {name}: {len(self.blocks)} blocks for {self.num_tokens} tokens (want {want})")
        real = [b for b in self.blocks[self.num_released :]]
        if any(b == PAD_BLOCK for b in real) or any(b != PAD_BLOCK for b in self.blocks[: self.num_released]):
            found.append(f"sequence {name}: released blocks are not exactly its first {self.num_released}")
        if self.token_ids is not None and self.token_base + len(self.token_ids) + self.num_pending != self.num_tokens:
            found.append(
                f"sequence {name}: {len(self.token_ids)} token ids from position {self.token_base} and "
                f"{self.num_pending} pending for {self.num_tokens} tokens"
            )
        if not 0 <= self.num_pending <= self.num_tokens:
            found.append(f"sequence {name}: {self.num_pending} pending token ids of {self.num_tokens} tokens")
        if not 0 <= self.num_computed <= self.num_tokens:
            found.append(f"sequence {name}: {self.num_computed} computed of {self.num_tokens} tokens")
        if self.num_released * block_size > self.num_computed:
            found.append(f"sequence {name}: {self.num_released} blocks released, {self.num_computed} tokens computed")
        full = self.num_tokens // block_size
        if len(self.keys) > full:
            found.append(f"sequence {name}: {len(self.keys)} block keys for {full} full blocks")
        if self.token_ids is not None and not 0 <= self.token_base <= len(self.keys) * block_size:
            found.append(
                f"sequence {name}: token ids from position {self.token_base}, but only {len(self.keys)} blocks keyed"
            )
        return found


def checked_record(record: object, block_size: int) -> SequenceBlocks:
    """``record`` as a :class:`SequenceBlocks` whose counts agree (what ``attach`` accepts).
    Raises ArgumentTypeError for another type or a count that is not an int, and
    InvalidArgumentError listing every count that contradicts the others."""
    if not isinstance(record, SequenceBlocks):
        raise ArgumentTypeError(f"record: expected a SequenceBlocks (from detach), got {type(record).__name__}")
    for field_name in ("num_tokens", "num_computed", "num_released", "token_base", "num_pending"):
        value = getattr(record, field_name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"record.{field_name}: expected an int, got {type(value).__name__}")
    if not isinstance(record.blocks, list) or not all(type(b) is int for b in record.blocks):
        raise ArgumentTypeError("record.blocks: expected a list of int block ids")
    if record.token_ids is not None and (
        not isinstance(record.token_ids, list) or not all(type(t) is int for t in record.token_ids)
    ):
        raise ArgumentTypeError("record.token_ids: expected None or a list of int token ids")
    if not isinstance(record.keys, list):
        raise ArgumentTypeError("record.keys: expected a list of BlockKey (the record's own, from detach)")
    try:
        hash(record.extra_key)
    except TypeError:
        raise ArgumentTypeError(
            f"record.extra_key: {type(record.extra_key).__name__} is not hashable (a prefix-cache salt is)"
        ) from None
    found = record.count_problems("record", block_size)
    if found:
        raise InvalidArgumentError("record: " + "; ".join(found))
    from kvcache.blocks.prefix_cache import BlockKey  # (that module's users import this one)

    if not all(isinstance(k, BlockKey) for k in record.keys):  # (as many as its full blocks: counted above)
        raise ArgumentTypeError("record.keys: expected a list of BlockKey (the record's own, from detach)")
    return record


class SequenceTable:
    """The records of the sequences that hold blocks, and the read-only queries on them."""

    def __init__(self) -> None:
        self._seqs: dict[Hashable, SequenceBlocks] = {}
        #: Ids detached for a swap-out: not usable for new sequences until attached or dropped.
        self._parked = ParkedIds()
        self.block_size: int

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def sequence(self, seq_id: Hashable) -> SequenceBlocks:
        """The live record of ``seq_id`` (read it, don't modify it). Raises
        UnknownSequenceError (or ArgumentTypeError for an unhashable id)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None
        except TypeError:
            raise ArgumentTypeError(f"seq_id: {type(seq_id).__name__} is not hashable") from None

    @staticmethod
    def check_hashable(seq_id: Hashable) -> None:
        """Raise ArgumentTypeError unless ``seq_id`` can be a sequence id."""
        try:
            hash(seq_id)
        except TypeError:
            raise ArgumentTypeError(f"seq_id: {type(seq_id).__name__} is not hashable") from None

    def check_new_id(self, seq_id: Hashable) -> None:
        """Raise SequenceExistsError (or ArgumentTypeError) unless ``seq_id`` can name a new
        sequence."""
        try:
            exists = seq_id in self._seqs
        except TypeError:
            raise ArgumentTypeError(f"seq_id: {type(seq_id).__name__} is not hashable") from None
        if exists:
            raise SequenceExistsError(seq_id)
        if seq_id in self._parked:
            raise SequenceExistsError(seq_id, "is swapped out (swap it in or drop it)")

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self.sequence(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.sequence(seq_id).num_tokens

    def num_computed(self, seq_id: Hashable) -> int:
        return self.sequence(seq_id).num_computed

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slot ids (``block * block_size + offset``) of token positions ``[start, end)``."""
        seq = self.sequence(seq_id)
        start, end = require_int("start", start), require_int("end", end)
        first = seq.num_released * self.block_size
        if not first <= start <= end <= seq.num_tokens:
            raise InvalidArgumentError(
                f"positions [{start}, {end}) are outside sequence {seq_id!r:.60}'s held tokens "
                f"[{first}, {seq.num_tokens}); append_slots first"
            )
        return seq.slot_range(start, end, self.block_size)
