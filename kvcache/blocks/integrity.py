"""Recounting a block manager's bookkeeping from scratch (``BlockManager.check_integrity``)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.prefix_cache import PrefixCache
from kvcache.blocks.sequence import SequenceBlocks

__all__ = ["integrity_problems"]


def integrity_problems(
    allocator: BlockAllocator,
    prefix_cache: PrefixCache | None,
    holds: Mapping[int, int],
    seqs: Mapping[Hashable, SequenceBlocks],
    block_size: int,
) -> list[str]:
    """Every broken invariant, each with its numbers (empty: fine): the allocator's queue and
    counts, the prefix index, each sequence record, and that every block's reference count is
    exactly the number of block tables and holds that have it."""
    found = allocator.integrity_problems()
    if prefix_cache is not None:
        found += prefix_cache.integrity_problems()
    owners = [0] * allocator.num_blocks
    for block, count in holds.items():
        owners[block] += count
    for seq_id, seq in seqs.items():
        found += seq.problems(seq_id, block_size, allocator)
        for block in seq.blocks:
            if 0 <= block < allocator.num_blocks:
                owners[block] += 1
    for block, count in enumerate(owners):
        ref = allocator.ref_count(block)
        if ref != count:
            found.append(f"block {block}: reference count {ref}, but {count} block tables and holds have it")
    return found
