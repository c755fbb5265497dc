"""The host tier of the prefix cache: cached blocks the device pool evicts live on in host memory.

When the device pool needs a free block that still holds a cached prefix block, the block's K/V
(every layer's K and V) is copied to a host block pool before the block is refilled, and the
key moves to this tier's own LRU index. Admission continues a prompt's device hits here
(:mod:`kvcache.blocks.tiers`): a hit gets a fresh device block, filled from the host, and counts
as computed, so the prompt's prefill skips it. A multi-turn chat whose earlier turns no longer
fit on the device gets them back at PCIe speed instead of recomputing them.

The host pool is laid out block-major, ``[num_host_blocks, num_layers, 2, block_size,
kv_heads, head_dim]`` (one block is one contiguous copy), pinned on CUDA. Copies run on a side
stream, ordered by events:

* offload: the side stream first waits for the work already queued (an in-flight step may
  still write the block's last tokens), reads the block, and the compute stream waits for
  that read before anything queued later (the block's new owner) can write it;
* load: the side stream waits for queued work (the fresh block's previous owner may still be
  read), writes the block, and the compute stream waits for the write, so the step that reads
  the prefix sees it whole.

The host side needs no synchronisation: the side stream runs every copy in order, so a host
block reused after an eviction is written only after earlier loads have read it. Salts are part
of every key, so a tenant never hits another tenant's blocks here either. Events: the
manager's ``kv_events`` publish ``tier="host"`` stored and removed events.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention.checks import require_int
from attention.errors import InvalidArgumentError
from kvcache.blocks.manager import BlockManager
from kvcache.blocks.prefix_cache import BlockKey
from kvcache.memory.cache_tensors import KVCacheTensors
from kvcache.memory.host_pool import check_cache_serves, host_block_pool

__all__ = ["HostPrefixTier", "HostTierStats"]


@dataclass(frozen=True)
class HostTierStats:
    """What the host tier holds and has moved.

    hit_blocks:       blocks admission took from the host (each saved a block of prefill).
    offloaded_blocks: evicted device blocks copied to the host.
    dropped_blocks:   host blocks evicted to make room (their K/V is gone).
    bytes_to_host / bytes_to_device: K/V bytes copied each way.
    copy_seconds:     time the copies took: GPU time on CUDA (completed copies), wall time on CPU.
    """

    blocks_total: int
    blocks_used: int
    hit_blocks: int
    offloaded_blocks: int
    dropped_blocks: int
    bytes_to_host: int
    bytes_to_device: int
    copy_seconds: float


class HostPrefixTier:
    """A host block pool under ``manager``'s prefix cache, for ``cache``'s tensors. Attaches
    itself to the manager (:meth:`BlockManager.attach_tier`)."""

    name = "host"

    def __init__(self, manager: BlockManager, cache: KVCacheTensors, num_host_blocks: int):
        """Raises InvalidArgumentError (allocating nothing) for a pool of no block, a cache
        that does not match the manager, or a manager without prefix caching or with a tier."""
        num_host_blocks = require_int("num_host_blocks", num_host_blocks)
        if num_host_blocks < 1:
            raise InvalidArgumentError(
                f"num_host_blocks: {num_host_blocks} must be at least 1 (cache.host_cache_space is too small)"
            )
        check_cache_serves(manager, cache)
        if manager.prefix_cache is None:
            raise InvalidArgumentError("manager: the host tier extends the prefix cache; enable_prefix_caching=True")
        if manager.lower_tier is not None:
            raise InvalidArgumentError(f"manager: it has a {manager.lower_tier.name} tier already")
        self.manager = manager
        self.cache = cache
        self.host = host_block_pool(cache, num_host_blocks)
        self._stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        #: key -> host block, least recently used first.
        self._index: OrderedDict[BlockKey, int] = OrderedDict()
        self._key_at: dict[int, BlockKey] = {}
        self._free = list(range(num_host_blocks - 1, -1, -1))
        self._pinned: dict[int, int] = {}
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._copy_seconds = 0.0
        self.hit_blocks = 0
        self.offloaded_blocks = 0
        self.dropped_blocks = 0
        self._bytes_per_block = cache.bytes_per_block
        manager.attach_tier(self)

    @classmethod
    def for_bytes(cls, manager: BlockManager, cache: KVCacheTensors, num_bytes: int) -> HostPrefixTier:
        """A pool of ``num_bytes`` (``cache.host_cache_space``), in whole blocks."""
        return cls(manager, cache, require_int("num_bytes", num_bytes, minimum=0) // cache.bytes_per_block)

    @property
    def num_host_blocks(self) -> int:
        return self.host.shape[0]

    # ---- the LowerTier protocol ----------------------------------------------------------

    def lookup(self, key: BlockKey) -> int | None:
        return self._index.get(key)

    def pin(self, handles: Sequence[int]) -> None:
        for h in handles:
            self._pinned[h] = self._pinned.get(h, 0) + 1

    def unpin(self, handles: Sequence[int]) -> None:
        for h in handles:
            count = self._pinned[h] - 1
            if count:
                self._pinned[h] = count
            else:
                del self._pinned[h]

    def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        for h, _ in pairs:
            self._index.move_to_end(self._key_at[h])
        self._copy_to_device([h for h, _ in pairs], [b for _, b in pairs])
        self.hit_blocks += len(pairs)

    def offload(self, key: BlockKey, block: int) -> None:
        if key in self._index:
            self._index.move_to_end(key)  # already here (loaded earlier): nothing to copy
            return
        h = self._take_block()
        if h is None:  # every host block is pinned by an admission in progress
            return
        self._copy_to_host(block, h)
        self._index[key] = h
        self._key_at[h] = key
        self.offloaded_blocks += 1
        self.manager.kv_events.stored(self.name, key)

    def held_keys(self) -> list[BlockKey]:
        return list(self._index)

    # ---- queries ------------------------------------------------------------------------

    def stats(self) -> HostTierStats:
        """Counters so far (completed copies only, on CUDA)."""
        self._collect_timings()
        return HostTierStats(
            blocks_total=self.num_host_blocks,
            blocks_used=len(self._index),
            hit_blocks=self.hit_blocks,
            offloaded_blocks=self.offloaded_blocks,
            dropped_blocks=self.dropped_blocks,
            bytes_to_host=self.offloaded_blocks * self._bytes_per_block,
            bytes_to_device=self.hit_blocks * self._bytes_per_block,
            copy_seconds=self._copy_seconds,
        )

    def synchronize(self) -> None:
        """Wait for every copy (afterwards the host pool holds final data)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._collect_timings()

    def integrity_problems(self) -> list[str]:
        found = []
        held = list(self._index.values())
        if len(set(held)) != len(held):
            found.append("host tier: a host block holds two keys")
        if set(held) & set(self._free):
            found.append("host tier: a host block is both free and holding a key")
        if any(self._key_at.get(h) is not key for key, h in self._index.items()) or len(self._key_at) != len(held):
            found.append("host tier: the block -> key map disagrees with the index")
        if len(held) + len(self._free) != self.num_host_blocks:
            found.append(f"host tier: {len(held)} held + {len(self._free)} free != {self.num_host_blocks} blocks")
        return found

    # ---- internals ----------------------------------------------------------------------

    def _take_block(self) -> int | None:
        """A free host block, evicting the least recently used unpinned key if need be."""
        if self._free:
            return self._free.pop()
        for key, h in self._index.items():
            if h not in self._pinned:
                del self._index[key]
                del self._key_at[h]
                self.dropped_blocks += 1
                self.manager.kv_events.removed(self.name, key)
                return h
        return None

    def _copy_to_host(self, block: int, h: int) -> None:
        storage = self.cache.storage
        if self._stream is None:
            start = time.perf_counter()
            self.host[h].copy_(storage[:, :, block])
            self._copy_seconds += time.perf_counter() - start
            return
        compute = torch.cuda.current_stream(storage.device)
        self._stream.wait_stream(compute)  # the block's last writes may still be queued
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record(self._stream)
            self.host[h].copy_(storage[:, :, block].contiguous(), non_blocking=True)
            done.record(self._stream)
        compute.wait_event(done)  # its new owner writes only after the copy has read it
        self._timings.append((begin, done))

    def _copy_to_device(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        storage = self.cache.storage
        if self._stream is None:
            start = time.perf_counter()
            storage[:, :, device_blocks] = self.host[host_blocks].movedim(0, 2)
            self._copy_seconds += time.perf_counter() - start
            return
        compute = torch.cuda.current_stream(storage.device)
        self._stream.wait_stream(compute)  # the fresh blocks may still be read by queued work
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record(self._stream)
            staged = torch.empty((len(host_blocks), *self.host.shape[1:]), dtype=storage.dtype, device=storage.device)
            for i, h in enumerate(host_blocks):
                staged[i].copy_(self.host[h], non_blocking=True)
            index = torch.tensor(device_blocks, device=storage.device)
            storage.index_copy_(2, index, staged.movedim(0, 2))
            done.record(self._stream)
        compute.wait_event(done)  # the step that reads the prefix sees it whole
        self._timings.append((begin, done))

    def _collect_timings(self) -> None:
        still = []
        for begin, done in self._timings:
            if done.query():
                self._copy_seconds += begin.elapsed_time(done) / 1000
            else:
                still.append((begin, done))
        self._timings = still
