"""Giving blocks back: one owner fewer for each, tail first, the prefix index kept right."""

from __future__ import annotations

from attention.metadata import PAD_BLOCK
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.prefix_cache import PrefixCache

__all__ = ["release_blocks"]


def release_blocks(
    allocator: BlockAllocator, prefix_cache: PrefixCache | None, blocks: list[int], *, once_each: bool = True
) -> None:
    """Drop one owner of each block of ``blocks`` (``PAD_BLOCK`` entries are skipped). Blocks
    left without owners join the free queue; cached ones stay indexed until evicted.

    once_each: ``blocks`` is a block table's own list, each block listed once and owned, so
    the allocator's per-block checks are skipped (the hot path). Otherwise (holds) a block
    may be listed several times and every id is checked.
    """
    # Tail first: a later request is likelier to share the head, so the head is evicted last.
    real = blocks[::-1] if PAD_BLOCK not in blocks else [b for b in reversed(blocks) if b != PAD_BLOCK]
    release = allocator.release_owned if once_each else allocator.release
    if prefix_cache is None:
        release(real)
        return
    if prefix_cache.has_duplicates:
        # A duplicate losing its last owner stops being a stand-in for its key's holder.
        prefix_cache.drop_duplicates([b for b in real if allocator.ref_count(b) == 1])
    release(real, prefix_cache.holders)
