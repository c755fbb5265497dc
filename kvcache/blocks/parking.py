"""Ids of swapped-out sequences: reserved (no new sequence may take them) until the sequence
is attached again or dropped, each with the swap space that holds its K/V."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

from attention.errors import InvalidArgumentError

__all__ = ["ParkedIds"]

_ABSENT = object()


class ParkedIds:
    """``seq_id -> holder``: the swap space holding the sequence's K/V (None: the caller
    keeps it and may drop the id itself)."""

    def __init__(self) -> None:
        self._holders: dict[Hashable, object | None] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._holders

    def __len__(self) -> int:
        return len(self._holders)

    def snapshot(self) -> dict[Hashable, object | None]:
        return dict(self._holders)

    def park(self, seq_id: Hashable, holder: object | None) -> None:
        self._holders[seq_id] = holder

    @contextlib.contextmanager
    def lifted(self, seq_id: Hashable) -> Iterator[None]:
        """Unpark ``seq_id`` for the block (an attach checking the id is free); parked again,
        with its holder, if the block raises."""
        holder = self._holders.pop(seq_id, _ABSENT)
        try:
            yield
        except BaseException:
            if holder is not _ABSENT:
                self._holders[seq_id] = holder
            raise

    def drop(self, seq_id: Hashable, holder: object | None) -> None:
        """Forget ``seq_id`` (absent: nothing to do). Raises InvalidArgumentError, nothing
        changed, when a swap space other than ``holder`` holds its K/V."""
        owner = self._holders.get(seq_id)
        if owner is not None and owner is not holder:
            raise InvalidArgumentError(
                f"seq_id: {seq_id!r:.60} is swapped out into a SwapSpace; call swap_space.drop({seq_id!r:.60}) "
                "so its host blocks are released too"
            )
        self._holders.pop(seq_id, None)
