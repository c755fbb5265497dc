"""What a step schedules for one sequence."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

__all__ = ["ScheduledRow"]


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
