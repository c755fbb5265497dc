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

Copies move in batches: the blocks one allocation evicts leave together (:meth:`flush`), the
blocks one admission loads arrive together. On CUDA an offloaded block is one ``cudaMemcpy2DAsync``
of its ``2 * num_layers`` rows (:mod:`kvcache.memory.pitched_copy`): the copy engines move it
while the step's kernels run, with no gather kernel that would wait for free SMs. Loads go the
same way when rows are at least :data:`MIN_PITCHED_LOAD_ROW_BYTES`; below that the copy
engines move short rows slowly, and one contiguous copy into a staging tensor, then a scatter
kernel, is faster. Where the runtime call is not available, both directions are staged (one
copy per run of consecutive host blocks). :attr:`HostPrefixTier.pitched_offloads` and
:attr:`~HostPrefixTier.pitched_loads` say which path runs.

With a disk tier (:mod:`kvcache.memory.disk_tier`), a block the host pool drops is written to
a file first, and admission continues a prompt's run there once the host has no more of it: the
file is read and checked whole before its block counts as computed; an unusable file ends the
run, and the rest of the prompt is computed again.
"""

from __future__ import annotations

import os
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
from kvcache.memory.disk_tier import DiskPrefixTier, DiskTierStats
from kvcache.memory.host_pool import check_cache_serves, host_block_pool
from kvcache.memory.pitched_copy import copy_rows, pitched_copies_available

__all__ = ["MIN_PITCHED_LOAD_ROW_BYTES", "ON_DISK", "HostPrefixTier", "HostTierStats"]

#: Loads move blocks row by row on the copy engines from this row size up (one layer's K or V
#: of a block). On the H200, 64 blocks with the GPU busy (benchmarks/results/
#: tier-copies-rows-2026-12-03.json): rows of 32 KiB arrive at 50.5 GB/s idle / 41.5 busy row
#: by row against 46.8 / 43.0 staged, 64 KiB rows at 52.6 / 52.1 against 49.2 / 33.4; rows of
#: 8-16 KiB at 15-30 GB/s row by row against 42-45 GB/s staged on an idle GPU.
MIN_PITCHED_LOAD_ROW_BYTES = 32 * 1024

#: The handle :meth:`HostPrefixTier.lookup` returns for a block held by the disk tier.
ON_DISK = -1


@dataclass(frozen=True)
class HostTierStats:
    """What the host tier holds and has moved.

    hit_blocks:       blocks admission took from the host (each saved a block of prefill).
    offloaded_blocks: evicted device blocks copied to the host.
    dropped_blocks:   host blocks evicted to make room (their K/V is gone).
    bytes_to_host / bytes_to_device: K/V bytes copied each way.
    copy_seconds:     time the copies took: GPU time on CUDA (completed copies), wall time on CPU;
                      ``to_host_seconds`` and ``to_device_seconds`` split it by direction.
    disk:             the disk tier's figures (None without one).
    """

    blocks_total: int
    blocks_used: int
    hit_blocks: int
    offloaded_blocks: int
    dropped_blocks: int
    bytes_to_host: int
    bytes_to_device: int
    copy_seconds: float
    disk: DiskTierStats | None = None
    to_host_seconds: float = 0.0
    to_device_seconds: float = 0.0


class HostPrefixTier:
    """A host block pool under ``manager``'s prefix cache, for ``cache``'s tensors. Attaches
    itself to the manager (:meth:`BlockManager.attach_tier`)."""

    name = "host"

    def __init__(
        self,
        manager: BlockManager,
        cache: KVCacheTensors,
        num_host_blocks: int,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
    ):
        """``disk_dir``, ``disk_bytes``: a disk tier below this one (both or neither). Raises
        InvalidArgumentError (allocating nothing) for a pool of no block, a cache that does not
        match the manager, a manager without prefix caching or with a tier, or a disk bound
        that holds no block."""
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
        if (disk_dir is None) != (not disk_bytes):
            raise InvalidArgumentError(
                f"disk_dir, disk_bytes: a disk tier needs both a directory and a size (got {disk_dir!r:.80} and "
                f"{disk_bytes!r:.20}); give both, or neither"
            )
        s = cache.storage.shape
        self.disk = (
            None
            if disk_dir is None
            else DiskPrefixTier(disk_dir, disk_bytes, (*s[:2], *s[3:]), cache.dtype, manager.kv_events)
        )
        self.manager = manager
        self.cache = cache
        self.host = host_block_pool(cache, num_host_blocks)
        # High priority: its gather and scatter kernels start as soon as SMs free up, so the
        # copies behind them are not held up by a long step.
        self._stream = torch.cuda.Stream(cache.device, priority=-1) if cache.device.type == "cuda" else None
        #: Whether blocks move as rows (``[2 * num_layers, block_size, kv_heads, head_dim]`` each)
        #: on the copy engines, with no kernel (:mod:`kvcache.memory.pitched_copy`): offloads
        #: whenever the runtime allows, loads when rows are long enough to stream.
        self.pitched_offloads = self._stream is not None and pitched_copies_available()
        row_bytes = cache.bytes_per_block // (cache.storage.shape[0] * cache.storage.shape[1])
        self.pitched_loads = self.pitched_offloads and row_bytes >= MIN_PITCHED_LOAD_ROW_BYTES
        self._device_rows = cache.storage.flatten(0, 1)  # [2 * num_layers, num_blocks, ...]
        self._host_rows = self.host.flatten(1, 2)  # [num_host_blocks, 2 * num_layers, ...]
        #: Host tensors a queued copy still reads, until its event completes.
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        #: key -> host block, least recently used first.
        self._index: OrderedDict[BlockKey, int] = OrderedDict()
        self._key_at: dict[int, BlockKey] = {}
        self._free = list(range(num_host_blocks - 1, -1, -1))
        self._pinned: dict[int, int] = {}
        self._timings: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = {"to_host": 0.0, "to_device": 0.0}
        self.hit_blocks = 0
        self.offloaded_blocks = 0
        self.dropped_blocks = 0
        self._bytes_per_block = cache.bytes_per_block
        #: Offloads waiting for :meth:`flush`: (device block, host block).
        self._pending: list[tuple[int, int]] = []
        #: The copy that last wrote each host block (read on the host before a disk write).
        self._written: dict[int, torch.cuda.Event] = {}
        manager.attach_tier(self)

    @classmethod
    def for_bytes(
        cls,
        manager: BlockManager,
        cache: KVCacheTensors,
        num_bytes: int,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
    ) -> HostPrefixTier:
        """A pool of ``num_bytes`` (``cache.host_cache_space``), in whole blocks, over an
        optional disk tier (``cache.disk_cache_dir``, ``cache.disk_cache_space``)."""
        num_host_blocks = require_int("num_bytes", num_bytes, minimum=0) // cache.bytes_per_block
        return cls(manager, cache, num_host_blocks, disk_dir=disk_dir, disk_bytes=disk_bytes)

    @property
    def num_host_blocks(self) -> int:
        return self.host.shape[0]

    # ---- the LowerTier protocol ----------------------------------------------------------

    def lookup(self, key: BlockKey) -> int | None:
        h = self._index.get(key)
        if h is None and self.disk is not None and self.disk.holds(key):
            return ON_DISK
        return h

    def pin(self, handles: Sequence[int]) -> None:
        for h in handles:
            if h != ON_DISK:
                self._pinned[h] = self._pinned.get(h, 0) + 1

    def unpin(self, handles: Sequence[int]) -> None:
        for h in handles:
            if h == ON_DISK:
                continue
            count = self._pinned[h] - 1
            if count:
                self._pinned[h] = count
            else:
                del self._pinned[h]

    def load(self, keys: Sequence[BlockKey], handles: Sequence[int], blocks: Sequence[int]) -> int:
        from_host: list[tuple[int, int]] = []
        from_disk: list[tuple[torch.Tensor, int]] = []
        loaded = 0
        for key, h, block in zip(keys, handles, blocks, strict=True):
            if h == ON_DISK:
                data = None if self.disk is None else self.disk.read(key)
                if data is None:  # unusable: this block and the rest are computed again
                    break
                from_disk.append((data, block))
            else:
                self._index.move_to_end(self._key_at[h])
                from_host.append((h, block))
            loaded += 1
        if from_host:
            self._copy_to_device([h for h, _ in from_host], [b for _, b in from_host])
            self.hit_blocks += len(from_host)
        if from_disk:
            self._copy_disk_blocks(from_disk)
        return loaded

    def offload(self, key: BlockKey, block: int) -> None:
        if key in self._index:
            self._index.move_to_end(key)  # already here (loaded earlier): nothing to copy
            return
        h = self._take_block()
        if h is None:  # every host block is pinned by an admission in progress
            return
        self._pending.append((block, h))
        self._index[key] = h
        self._key_at[h] = key
        self.offloaded_blocks += 1
        self.manager.kv_events.stored(self.name, key)

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._copy_to_host([b for b, _ in pending], [h for _, h in pending])

    def held_keys(self) -> list[BlockKey]:
        """The keys the host pool holds, least recently used first."""
        return list(self._index)

    def tier_contents(self) -> dict[str, list[BlockKey]]:
        contents = {self.name: list(self._index)}
        if self.disk is not None:
            contents[self.disk.name] = self.disk.held_keys()
        return contents

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
            copy_seconds=self._seconds["to_host"] + self._seconds["to_device"],
            disk=None if self.disk is None else self.disk.stats(),
            to_host_seconds=self._seconds["to_host"],
            to_device_seconds=self._seconds["to_device"],
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
        if self._pending:
            found.append(f"host tier: {len(self._pending)} offloads were never flushed")
        if self.disk is not None:
            found += self.disk.integrity_problems()
        return found

    # ---- internals ----------------------------------------------------------------------

    def _take_block(self) -> int | None:
        """A free host block, evicting the least recently used unpinned key if need be (to
        the disk tier, when there is one)."""
        if self._free:
            return self._free.pop()
        for key, h in self._index.items():
            if h not in self._pinned:
                if self.disk is not None:
                    self.disk.store(key, self._host_block_now(h))
                del self._index[key]
                del self._key_at[h]
                self.dropped_blocks += 1
                self.manager.kv_events.removed(self.name, key)
                return h
        return None

    def _host_block_now(self, h: int) -> torch.Tensor:
        """Host block ``h`` once every copy into it has landed."""
        if any(host == h for _, host in self._pending):
            self.flush()
        written = self._written.pop(h, None)
        if written is not None:
            written.synchronize()
        return self.host[h]

    @staticmethod
    def _runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
        """``(first index, first host block, length)`` of each run of consecutive host blocks."""
        runs: list[tuple[int, int, int]] = []
        for i, h in enumerate(host_blocks):
            if runs and runs[-1][1] + runs[-1][2] == h and runs[-1][0] + runs[-1][2] == i:
                first, start, length = runs[-1]
                runs[-1] = (first, start, length + 1)
            else:
                runs.append((i, h, 1))
        return runs

    def _copy_to_host(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        storage = self.cache.storage
        if self._stream is None:
            start = time.perf_counter()
            for b, h in zip(device_blocks, host_blocks, strict=True):
                self.host[h].copy_(storage[:, :, b])
            self._seconds["to_host"] += time.perf_counter() - start
            return
        self._collect_timings()
        compute = torch.cuda.current_stream(storage.device)
        self._stream.wait_stream(compute)  # the blocks' last writes may still be queued
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            if self.pitched_offloads:
                begin.record(self._stream)
                for b, h in zip(device_blocks, host_blocks, strict=True):
                    copy_rows(self._host_rows[h], self._device_rows[:, b], self._stream)
            else:
                views = [storage[:, :, b] for b in device_blocks]
                runs = self._runs(host_blocks)  # host work first: the timing covers the device's work
                begin.record(self._stream)
                staged = torch.stack(views)  # block-major, as the host pool: one kernel
                for first, h, n in runs:
                    self.host[h : h + n].copy_(staged[first : first + n], non_blocking=True)
            done.record(self._stream)
        compute.wait_event(done)  # their new owners write only after the copy has read them
        self._timings.append(("to_host", begin, done))
        for h in host_blocks:
            self._written[h] = done

    def _copy_to_device(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        storage = self.cache.storage
        if self._stream is None:
            start = time.perf_counter()
            storage[:, :, device_blocks] = self.host[host_blocks].movedim(0, 2)
            self._seconds["to_device"] += time.perf_counter() - start
            return
        self._collect_timings()
        compute = torch.cuda.current_stream(storage.device)
        self._stream.wait_stream(compute)  # the fresh blocks may still be read by queued work
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            if self.pitched_loads:
                begin.record(self._stream)
                for h, b in zip(host_blocks, device_blocks, strict=True):
                    copy_rows(self._device_rows[:, b], self._host_rows[h], self._stream)
            else:
                runs = self._runs(host_blocks)
                # Host work and the small index copy first: the timing covers the block copies.
                shape = (len(host_blocks), *self.host.shape[1:])
                staged = torch.empty(shape, dtype=storage.dtype, device=storage.device)
                index = torch.tensor(device_blocks, dtype=torch.int64).to(storage.device, non_blocking=True)
                begin.record(self._stream)
                for first, h, n in runs:
                    staged[first : first + n].copy_(self.host[h : h + n], non_blocking=True)
                storage.index_copy_(2, index, staged.movedim(0, 2))
            done.record(self._stream)
        compute.wait_event(done)  # the step that reads the prefix sees it whole
        self._timings.append(("to_device", begin, done))

    def _copy_disk_blocks(self, pairs: list[tuple[torch.Tensor, int]]) -> None:
        """Device blocks from blocks read off disk (host tensors, checked whole), ordered as
        :meth:`_copy_to_device` orders host loads."""
        storage = self.cache.storage
        data = torch.stack([d for d, _ in pairs])  # [n, num_layers, 2, block_size, heads, dim]
        if self._stream is None:
            index = torch.tensor([b for _, b in pairs], dtype=torch.int64)
            storage.index_copy_(2, index, data.movedim(0, 2))
            return
        data = data.pin_memory()
        self._collect_timings()
        compute = torch.cuda.current_stream(storage.device)
        self._stream.wait_stream(compute)  # the fresh blocks may still be read by queued work
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            if self.pitched_loads:
                rows = data.flatten(1, 2)
                for i, (_, b) in enumerate(pairs):
                    copy_rows(self._device_rows[:, b], rows[i], self._stream)
            else:
                staged = data.to(storage.device, non_blocking=True)
                index = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=storage.device)
                storage.index_copy_(2, index, staged.movedim(0, 2))
            done.record(self._stream)
        self._in_flight.append((done, data))  # the copies read it after this returns
        compute.wait_event(done)  # the step that reads the prefix sees it whole

    def _collect_timings(self) -> None:
        self._in_flight = [(done, data) for done, data in self._in_flight if not done.query()]
        still = []
        for direction, begin, done in self._timings:
            if done.query():
                self._seconds[direction] += begin.elapsed_time(done) / 1000
            else:
                still.append((direction, begin, done))
        self._timings = still
