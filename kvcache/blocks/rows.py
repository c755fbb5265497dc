"""What a step schedules for one sequence, and checking a step's rows before they are
committed."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

from attention.checks import require_int
from attention.errors import ArgumentTypeError, InvalidArgumentError
from kvcache.blocks.sequence import SequenceBlocks

__all__ = ["ScheduledRow", "checked_computed", "computed_after", "row_list"]


class ScheduledRow(NamedTuple):
    """One sequence's share of a step: ``num_new`` tokens starting at position ``start``.

    ``start`` defaults to the last ``num_new`` reserved tokens (a decode step after
    ``append_slots``). For a chunk of a prompt whose slots were all reserved by ``allocate``,
    give the chunk's first position. (A named tuple: an engine makes one per row per step,
    so it is cheap to create.)
    """

    seq_id: Hashable
    num_new: int
    start: int | None = None


def row_list(rows: Iterable[ScheduledRow]) -> list[ScheduledRow]:
    """``rows`` as a list; raises ArgumentTypeError naming ``rows`` for a non-iterable (its
    entries are checked where they are used)."""
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
        raise ArgumentTypeError(f"rows: expected an iterable of ScheduledRow, got {type(rows).__name__}")
    return list(rows)


def computed_after(
    rows: Iterable[ScheduledRow], sequence: Callable[[Hashable], SequenceBlocks]
) -> list[tuple[SequenceBlocks, int]]:
    """``(record, computed prefix after the step)`` for each row, every row checked first: each
    must continue its sequence's computed prefix within its reserved tokens (``start`` >= 0).
    Raises an argument error (UnknownSequenceError for an unknown id); reads, never writes."""
    updates = []
    for i, row in enumerate(row_list(rows)):
        if not isinstance(row, ScheduledRow):
            raise ArgumentTypeError(f"rows[{i}]: expected a ScheduledRow, got {type(row).__name__}")
        seq = sequence(row.seq_id)
        num_new = require_int(f"rows[{i}].num_new", row.num_new, minimum=1)
        start = seq.num_tokens - num_new if row.start is None else require_int(f"rows[{i}].start", row.start, minimum=0)
        if not start <= seq.num_computed or start + num_new > seq.num_tokens:
            raise InvalidArgumentError(
                f"rows[{i}]: tokens [{start}, {start + num_new}) of sequence {row.seq_id!r:.60} do not continue "
                f"its {seq.num_computed} computed tokens within its {seq.num_tokens} reserved ones"
            )
        updates.append((seq, max(seq.num_computed, start + num_new)))
    return updates


def checked_computed(seq: SequenceBlocks, seq_id: Hashable, num_computed: object) -> int:
    """``num_computed`` as a new computed prefix of ``seq``: an int from its current computed
    prefix up to its reserved tokens. Raises an argument error naming ``num_computed``."""
    value = require_int("num_computed", num_computed)
    if not seq.num_computed <= value <= seq.num_tokens:
        raise InvalidArgumentError(
            f"num_computed: {value} must lie in [{seq.num_computed}, {seq.num_tokens}] for sequence {seq_id!r:.60}"
        )
    return value
