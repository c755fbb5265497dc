"""Preemption: take a running sequence's blocks back, by recompute or by swap.

It sits above the manager and the swap space and only calls them: the manager stays the
owner of block tables and counts every preemption, however the engine makes it
(``free(seq, reason="preempted")`` and every swap-out count too).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

from attention.errors import ArgumentTypeError, InvalidArgumentError
from kvcache.blocks.hybrid import require_one_table
from kvcache.blocks.manager import BlockManager
from kvcache.memory.swap import SwapSpace

__all__ = ["PreemptMode", "preempt"]

PreemptMode = Literal["recompute", "swap"]


def preempt(
    manager: BlockManager, seq_id: Hashable, mode: PreemptMode = "recompute", swap_space: SwapSpace | None = None
) -> None:
    """Take ``seq_id``'s blocks back from a running sequence.

    ``recompute``: its blocks are freed; the caller re-admits it later and recomputes its K/V
    (prompt + generated tokens). ``swap``: its K/V is copied to ``swap_space`` and comes back
    with ``swap_space.swap_in``. Raises UnknownSequenceError, InvalidArgumentError for a bad
    mode or a missing swap space (or one of another manager), ArgumentTypeError for an
    argument of the wrong type, OutOfBlocksError when the swap space is full; changes nothing
    then.
    """
    require_one_table(manager)
    if swap_space is not None and not isinstance(swap_space, SwapSpace):
        raise ArgumentTypeError(f"swap_space: expected a SwapSpace or None, got {type(swap_space).__name__}")
    if mode == "recompute":
        manager.free(seq_id, reason="preempted")
    elif mode == "swap":
        if swap_space is None:
            raise InvalidArgumentError("swap_space: preempt(mode='swap') needs the SwapSpace to copy into")
        if swap_space.manager is not manager:
            raise InvalidArgumentError("swap_space: it belongs to another manager")
        swap_space.swap_out(seq_id)
    else:
        raise InvalidArgumentError(f"mode: {mode!r} is not a preemption mode; use 'recompute' or 'swap'")
