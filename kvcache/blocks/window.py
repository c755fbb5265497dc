"""Sliding windows: blocks that no future query can see are released from a sequence's table.

A query at position ``p`` sees keys ``(p - window, p]``. Once the first ``num_computed``
tokens are written, the next query is at ``num_computed`` or later, so every block wholly
before ``num_computed - window + 1`` is out of sight for good.
"""

from __future__ import annotations

from attention.metadata import PAD_BLOCK
from kvcache.blocks.sequence import SequenceBlocks

__all__ = ["release_behind_window"]


def release_behind_window(seq: SequenceBlocks, window: int, block_size: int, lag: int = 0) -> list[int]:
    """Replace the table entries of ``seq``'s blocks behind its window by ``PAD_BLOCK`` (from
    its computed prefix less ``lag`` tokens: a truncation may take back up to ``lag`` computed
    tokens, rejected drafts, and the query after it must still see its window); return the
    block ids taken out, for the caller to release (empty when none). Bumps ``seq.epoch`` when
    the table changes."""
    behind = max(0, seq.num_computed - lag - window + 1) // block_size
    if behind <= seq.num_released:
        return []
    gone = seq.blocks[seq.num_released : behind]
    seq.blocks[seq.num_released : behind] = [PAD_BLOCK] * len(gone)
    seq.num_released = behind
    seq.epoch += 1
    return gone
