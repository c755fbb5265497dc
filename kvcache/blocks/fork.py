"""Forking a block table: full blocks are shared by reference count, a partly filled last block
is copied at once, so no block that several owners share is ever written."""

from __future__ import annotations

from attention.metadata import PAD_BLOCK
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.sequence import BlockCopy

__all__ = ["share_blocks"]


def share_blocks(allocator: BlockAllocator, blocks: list[int], partial: bool) -> tuple[list[int], list[BlockCopy]]:
    """A new owner's table for ``blocks`` and the block copies to perform: every block gets one
    more owner (``PAD_BLOCK`` entries stay), except a ``partial`` (partly filled) last block,
    which is replaced by a fresh block to copy it into. The caller checked that a block is
    free when ``partial``."""
    shared = blocks[:-1] if partial else blocks
    for block in shared:
        if block != PAD_BLOCK:
            allocator.incref(block)
    table = list(shared)
    copies: list[BlockCopy] = []
    if partial:
        (dst,) = allocator.allocate(1)
        copies.append((blocks[-1], dst))
        table.append(dst)
    return table, copies
