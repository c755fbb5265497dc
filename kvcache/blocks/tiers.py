"""Lower tiers of the prefix cache: where a cached block's K/V goes when the device pool evicts
it, and where admission looks once the device index has no more of a prompt.

The block core stays free of torch: it names blocks by :class:`BlockKey` and tells a tier
which device block to read from or fill; the tier (:class:`kvcache.memory.host_tier.HostPrefixTier`)
owns its memory and performs the copies, ordered on the device so that a block is read before
its new owner writes it, and written before a step reads it.

Admission takes the device's cached run first, then continues the same chain in the tier:
a prompt whose head is on the device and whose next blocks were evicted to the host gets both.
A tier may have its own lower level (the host tier spills to an optional disk tier,
:mod:`kvcache.memory.disk_tier`); the manager sees one tier either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvcache.blocks.prefix_cache import BlockKey

__all__ = ["LowerTier"]


@runtime_checkable
class LowerTier(Protocol):
    """What the block manager asks of a lower tier (handles are the tier's own block ids)."""

    #: The tier's name in events and statistics ("host", "disk").
    name: str

    def lookup(self, key: BlockKey) -> int | None:
        """The handle of the K/V held under ``key``, or None. Changes nothing."""

    def pin(self, handles: Sequence[int]) -> None:
        """Keep ``handles`` from being evicted until :meth:`unpin` (between lookup and load)."""

    def unpin(self, handles: Sequence[int]) -> None:
        """Undo :meth:`pin`."""

    def load(self, keys: Sequence[BlockKey], handles: Sequence[int], blocks: Sequence[int]) -> int:
        """Copy the K/V held under ``keys[i]`` (found as ``handles[i]``) into device block
        ``blocks[i]``, before any step queued later reads it, in order; return how many leading
        blocks were filled. A tier that finds a block unusable (a disk file that fails its
        checksum) stops there: the caller recomputes that block and every later one."""

    def offload(self, key: BlockKey, block: int) -> None:
        """The device pool is evicting ``block``, which holds ``key``'s K/V: keep a copy if
        there is room (read before the block's new owner writes it). The copy may wait for
        :meth:`flush`."""

    def flush(self) -> None:
        """Start the copies of the blocks offered since the last flush (the allocator calls it
        once per allocation that evicted blocks, before the blocks' new owners can write them)."""

    def tier_contents(self) -> dict[str, list[BlockKey]]:
        """Every key the tier (and any tier below it) holds, by tier name (event replays)."""
