"""A full, comparable snapshot of a BlockManager (and its SwapSpace), for tests that check an
operation which raised changed nothing."""

from __future__ import annotations

from typing import Any

from kvcache import BlockManager, SwapSpace
from kvcache.blocks.prefix_cache import BlockKey


def key_chain(key: BlockKey | None) -> tuple[object, ...]:
    """A block key as the plain data it stands for: every block's (tokens, extra), head first."""
    links = []
    while key is not None:
        links.append((key.tokens, key.extra))
        key = key.parent
    return tuple(reversed(links))


def snapshot(m: BlockManager, swap: SwapSpace | None = None) -> dict[str, Any]:
    """Everything observable about the manager's state: sequence records, free-queue order,
    reference counts, holds, swapped-out ids, preemption counts, and the prefix-cache index
    (holders, duplicates, counters)."""
    alloc = m.allocator
    out: dict[str, Any] = {
        "seqs": {
            seq_id: (
                list(r.blocks),
                r.num_tokens,
                None if r.token_ids is None else list(r.token_ids),
                r.extra_key,
                r.num_computed,
                [key_chain(k) for k in r.keys],
                r.num_released,
                r.epoch,
                r.num_pending,
            )
            for seq_id, r in m._seqs.items()
        },
        "seq_order": list(m._seqs),
        "free": alloc.free_blocks_in_eviction_order(),
        "cached_free": alloc.num_cached_free,
        "ref": list(alloc._ref),
        "holds": dict(m.holds.counts),
        "parked": m._parked.snapshot(),
        "preemptions": dict(m.preemptions),
    }
    pc = m.prefix_cache
    if pc is not None:
        out["index"] = (
            {block: key_chain(key) for block, key in pc._key_of.items()},
            {key_chain(key): block for key, block in pc._holder.items()},
            {key_chain(key): set(blocks) for key, blocks in pc._duplicates.items()},
            {block: key_chain(key) for block, key in pc._duplicate_key.items()},
            (pc.query_tokens, pc.hit_tokens, pc.evictions),
        )
    if swap is not None:
        out["swap"] = (
            swap.allocator.free_blocks_in_eviction_order(),
            list(swap.allocator._ref),
            {seq_id: list(e.host_blocks) for seq_id, e in swap._swapped.items()},
            (swap.swapped_out_blocks, swap.swapped_in_blocks),
        )
    return out
