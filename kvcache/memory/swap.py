"""CPU swap: move a sequence's K/V to a host block pool and back.

The host pool is laid out block-major, ``[num_host_blocks, num_layers, 2, block_size,
kv_heads, head_dim]``, so one host block (every layer's K and V of its tokens) is contiguous
and moves in one copy. On CUDA the pool is pinned and every copy runs on one side stream:

* swap out waits for the work already queued (the K/V must be final), gathers the blocks and
  copies them to the host without blocking the host thread. The device blocks stay *held*
  until the copy has read them (:meth:`SwapSpace.poll` returns them to the free pool), so the
  compute stream never has to wait for a swap out;
* swap in copies to the device and makes the compute stream wait for that copy only, so the
  sequence's next step reads complete K/V, while work queued earlier overlaps the copy.

Both directions are all or nothing: when either side is short of blocks, OutOfBlocksError
is raised and nothing moves. Host-side bookkeeping needs no sync: the side stream runs the
copies in order, so a host block freed by a swap in is safe to reuse by a later swap out.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from attention.checks import require_int
from attention.errors import InvalidArgumentError, OutOfBlocksError, SequenceExistsError, UnknownSequenceError
from attention.metadata import PAD_BLOCK
from kvcache.blocks.allocator import BlockAllocator
from kvcache.blocks.hybrid import require_one_table
from kvcache.blocks.manager import BlockManager
from kvcache.blocks.sequence import SequenceBlocks
from kvcache.memory.cache_tensors import KVCacheTensors
from kvcache.memory.host_pool import check_cache_serves, host_block_pool

__all__ = ["SwapSpace"]


@dataclass
class _Swapped:
    record: SequenceBlocks
    host_blocks: list[int]


class SwapSpace:
    """A host block pool for one manager and its device cache."""

    def __init__(self, manager: BlockManager, cache: KVCacheTensors, num_host_blocks: int):
        """Raises InvalidArgumentError (allocating nothing) when the pool would hold no block
        or the cache has fewer blocks than the manager hands out."""
        num_host_blocks = require_int("num_host_blocks", num_host_blocks)
        if num_host_blocks < 1:
            raise InvalidArgumentError(
                f"num_host_blocks: {num_host_blocks} must be at least 1 (cache.swap_space is too small)"
            )
        require_one_table(manager)
        check_cache_serves(manager, cache)
        self.manager = manager
        self.cache = cache
        self.allocator = BlockAllocator(num_host_blocks)
        self.host = host_block_pool(cache, num_host_blocks)
        self._stream = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        self._swapped: dict[Hashable, _Swapped] = {}
        self._in_flight: list[tuple[torch.cuda.Event, list[int]]] = []
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    @classmethod
    def for_bytes(cls, manager: BlockManager, cache: KVCacheTensors, num_bytes: int) -> SwapSpace:
        """A pool of ``num_bytes`` (``cache.swap_space``), in whole blocks."""
        return cls(manager, cache, require_int("num_bytes", num_bytes, minimum=0) // cache.bytes_per_block)

    @property
    def num_host_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_swapped(self) -> int:
        """Sequences currently swapped out."""
        return len(self._swapped)

    def is_swapped(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._swapped
        except TypeError:  # an unhashable id names nothing
            return False

    def can_swap_out(self, seq_id: Hashable) -> bool:
        """Whether the host pool has room for ``seq_id``'s blocks. Changes nothing."""
        return self.allocator.can_allocate(len(_real(self.manager.sequence(seq_id).blocks)))

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether the device has free blocks for swapped-out ``seq_id``. Changes nothing."""
        return self.manager.allocator.can_allocate(len(self._entry(seq_id).host_blocks))

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move ``seq_id``'s K/V to the host; its device blocks return to the free pool once the
        copy has read them. Returns ``(device block, host block)`` pairs.

        Raises UnknownSequenceError or OutOfBlocksError (host pool full); changes nothing then.
        """
        self.poll()
        record = self.manager.sequence(seq_id)
        device_blocks = _real(record.blocks)
        if not self.allocator.can_allocate(len(device_blocks)):
            raise OutOfBlocksError(len(device_blocks), self.allocator.num_free, f"swap out {seq_id!r} (host pool)")
        host_blocks = self.allocator.allocate(len(device_blocks))
        asynchronous = self._stream is not None
        try:
            if not asynchronous:
                self._copy_to_host(device_blocks, host_blocks)
            # Asynchronous: the device blocks stay allocated under a hold until the copy,
            # queued below, has read them (see poll()); nothing appends to a detached sequence.
            self.manager.detach(seq_id, swapped=True, holder=self, hold=asynchronous)
        except BaseException:
            self.allocator.release(host_blocks)
            raise
        done = self._copy_to_host(device_blocks, host_blocks) if asynchronous else None
        if done is not None:
            self._in_flight.append((done, device_blocks))
        self._swapped[seq_id] = _Swapped(record, host_blocks)
        self.swapped_out_blocks += len(device_blocks)
        return list(zip(device_blocks, host_blocks, strict=True))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring swapped-out ``seq_id`` back into fresh device blocks. Returns ``(host block,
        device block)`` pairs. Raises UnknownSequenceError (not swapped out),
        SequenceExistsError, or OutOfBlocksError (device full); changes nothing then."""
        self.poll()
        entry = self._entry(seq_id)
        device_blocks = self.manager.attach(seq_id, entry.record)
        self._copy_to_device(entry.host_blocks, device_blocks)
        self.allocator.release(entry.host_blocks)
        del self._swapped[seq_id]
        self.swapped_in_blocks += len(device_blocks)
        return list(zip(entry.host_blocks, device_blocks, strict=True))

    def drop(self, seq_id: Hashable) -> None:
        """Forget a swapped-out sequence (e.g. its request was cancelled)."""
        entry = self._entry(seq_id)
        self.allocator.release(entry.host_blocks)
        del self._swapped[seq_id]
        self.manager.drop_swapped(seq_id, holder=self)

    def poll(self) -> None:
        """Return device blocks whose swap-out copy has finished to the free pool."""
        still: list[tuple[torch.cuda.Event, list[int]]] = []
        for event, blocks in self._in_flight:
            if event.query():
                self.manager.release(blocks)
            else:
                still.append((event, blocks))
        self._in_flight = still

    def synchronize(self) -> None:
        """Wait for every copy; afterwards the host pool holds final data."""
        if self._stream is not None:
            self._stream.synchronize()
        self.poll()

    def integrity_problems(self) -> list[str]:
        found = self.allocator.integrity_problems()
        held = sorted(b for e in self._swapped.values() for b in e.host_blocks)
        if len(set(held)) != len(held):
            found.append("a host block belongs to two swapped-out sequences")
        if len(held) != self.allocator.num_used:
            found.append(f"{len(held)} host blocks held by swapped sequences, {self.allocator.num_used} in use")
        both = [s for s in self._swapped if s in self.manager]
        if both:
            found.append(f"sequences both swapped out and on the device: {both}")
        return found

    # ---- copies ------------------------------------------------------------------------

    def _entry(self, seq_id: Hashable) -> _Swapped:
        self.manager.check_hashable(seq_id)
        try:
            return self._swapped[seq_id]
        except KeyError:
            if seq_id in self.manager:
                raise SequenceExistsError(seq_id) from None
            raise UnknownSequenceError(seq_id) from None

    def _copy_to_host(self, device_blocks: list[int], host_blocks: list[int]) -> torch.cuda.Event | None:
        """Copy the blocks out: at once without a copy stream (None), else queued on it after
        the compute stream's work, returning the event that marks its end."""
        storage = self.cache.storage
        if self._stream is None:
            self.host[host_blocks] = storage[:, :, device_blocks].movedim(2, 0)
            return None
        compute = torch.cuda.current_stream(storage.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            index = torch.tensor(device_blocks, device=storage.device)
            gathered = storage.index_select(2, index).movedim(2, 0).contiguous()
            for i, h in enumerate(host_blocks):
                self.host[h].copy_(gathered[i], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def _copy_to_device(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        storage = self.cache.storage
        if self._stream is None:
            storage[:, :, device_blocks] = self.host[host_blocks].movedim(0, 2)
            return
        compute = torch.cuda.current_stream(storage.device)
        # The fresh blocks may still be read by queued work of their previous owner.
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            staged = torch.empty((len(host_blocks), *self.host.shape[1:]), dtype=storage.dtype, device=storage.device)
            for i, h in enumerate(host_blocks):
                staged[i].copy_(self.host[h], non_blocking=True)
            index = torch.tensor(device_blocks, device=storage.device)
            storage.index_copy_(2, index, staged.movedim(0, 2))
            done = torch.cuda.Event()
            done.record(self._stream)
        compute.wait_event(done)


def _real(blocks: list[int]) -> list[int]:
    """The block ids of a table, without entries released behind a sliding window."""
    return [b for b in blocks if b != PAD_BLOCK]
