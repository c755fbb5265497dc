"""The disk tier of the prefix cache: blocks the host tier evicts are kept as files.

One file per block, named by the block's stable digest (:mod:`kvcache.blocks.digest`), under
``directory/<layout>/run-<pid>-<random>/``, where ``<layout>`` names the cache layout (layers,
block size, KV heads, head dim, dtype): a file is only ever read back into a cache of the same
layout, by the tier that wrote it. A file holds a header and the block's K/V (every layer's K
and V, the host pool's block layout)::

    magic (8 bytes) | digest (16) | payload bytes (8, little-endian) | CRC-32 of the payload (4) | payload

Reading checks every field: a file that is missing, short, or whose digest or checksum does not
match is deleted and reported as unusable, and the caller recomputes the block; no byte of it
reaches the device. The checksum is CRC-32 (zlib's, about 5 GB/s on one core, against 1 GB/s
for BLAKE2b: every block read back is checked on the admission path): it catches any damage of
up to 32 consecutive bits and misses random damage with probability 2**-32. It guards against
a bad disk, not against someone who can write to the directory. Writes go to a temporary file
renamed into place, so a reader never sees a half-written file under a block's name.

The tier is bounded by ``max_bytes``: the least recently used files are deleted to make room.
Files are written by a background thread: storing a block copies its bytes into a queue of at
most ``max_pending_bytes`` (a block that does not fit is not stored, and counted), so the
serving loop never waits for the disk; a block still in the queue is read back from memory.
Reads happen in admission, synchronously.

A digest covers the tokens and the salt, not the model's weights, so another process's file
could hold another model's K/V under the very digest a prompt looks up. Each tier therefore
writes into a folder of its own, which it claims with an exclusive lock (``fcntl.flock`` on
its ``.lock``) for as long as it lives: two engines sharing a directory never read, overwrite
or delete each other's files. At start a tier deletes what dead tiers left: folders whose lock
it can take (their process is gone), and block files directly under the layout folder (this
module's layout before the folders). :meth:`DiskPrefixTier.close` deletes the tier's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import secrets
import shutil
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from attention.checks import require_int
from attention.errors import InvalidArgumentError
from kvcache.blocks.events import KVEventStream
from kvcache.blocks.prefix_cache import BlockKey

try:
    import fcntl
except ImportError:  # not POSIX: folders are still per tier, but dead ones are not found
    fcntl = None  # type: ignore[assignment]

__all__ = ["HEADER_BYTES", "DiskPrefixTier", "DiskTierStats", "layout_name"]

_MAGIC = b"PKVBLK02"
_HEADER = struct.Struct("<8s16sQI")
#: Bytes before a file's payload.
HEADER_BYTES = _HEADER.size
_SUFFIX = ".kv"
#: A tier's folder: ``run-<pid>-<random>``, holding ``.lock`` while the tier lives.
_RUN_PREFIX = "run-"
_LOCK_NAME = ".lock"
#: A folder still under its temporary name (``.run-*.new``) this many seconds after it was
#: made belongs to a tier that died between making and renaming it (that takes microseconds).
_STALE_MAKING_S = 60.0


@dataclass(frozen=True)
class DiskTierStats:
    """What the disk tier holds and has moved.

    files / bytes_used: files held now and their size (headers included); bytes_total: the bound.
    blocks_total:   files the bound holds.
    hit_blocks:     blocks read back whole (each saved a block of prefill).
    written_blocks: blocks written.
    dropped_blocks: files deleted to make room.
    corrupt_blocks: files found unusable when read (missing, short, wrong digest or checksum),
                    deleted and recomputed.
    skipped_blocks: blocks not stored because the write queue was full (or the write failed).
    bytes_read / bytes_written: payload bytes each way.
    """

    files: int
    bytes_used: int
    bytes_total: int
    blocks_total: int
    hit_blocks: int
    written_blocks: int
    dropped_blocks: int
    corrupt_blocks: int
    bytes_read: int
    bytes_written: int
    skipped_blocks: int = 0


def layout_name(block_shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """The folder name of a cache layout: ``[num_layers, 2, block_size, kv_heads, head_dim]``
    and the dtype, e.g. ``L32-bs32-h8-d128-bfloat16``."""
    layers, _, block_size, heads, head_dim = block_shape
    return f"L{layers}-bs{block_size}-h{heads}-d{head_dim}-{str(dtype).removeprefix('torch.')}"


class DiskPrefixTier:
    """Block files under ``directory`` for blocks of shape ``block_shape`` (``[num_layers, 2,
    block_size, kv_heads, head_dim]``) in ``dtype``, at most ``max_bytes`` on disk.

    The host tier (:class:`kvcache.memory.host_tier.HostPrefixTier`) owns it: it stores blocks
    it evicts and reads blocks admission finds here. ``events``: where ``tier="disk"`` stored
    and removed events are published (the manager's ``kv_events``)."""

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        events: KVEventStream | None = None,
        *,
        max_pending_bytes: int = 256 << 20,
    ):
        """``max_pending_bytes``: most block bytes waiting for the writer thread. Raises
        InvalidArgumentError (creating nothing) for a bound smaller than one block, and OSError
        when the folder cannot be created."""
        self.max_bytes = require_int("max_bytes", max_bytes, minimum=0)
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        numel = 1
        for n in self.block_shape:
            numel *= n
        self.payload_bytes = numel * torch.empty((), dtype=dtype).element_size()
        self.file_bytes = _HEADER.size + self.payload_bytes
        if self.max_bytes < self.file_bytes:
            raise InvalidArgumentError(
                f"disk_cache_space: {self.max_bytes} bytes holds no block file of {self.file_bytes} bytes; "
                f"give at least that (or 0 for no disk tier)"
            )
        #: The layout's folder, shared with other tiers of this layout under ``directory``.
        self.layout_folder = Path(directory) / layout_name(self.block_shape, dtype)
        self.layout_folder.mkdir(parents=True, exist_ok=True)
        _remove_dead_tiers(self.layout_folder)
        #: This tier's own folder (its files), and the open lock file that claims it.
        self.folder: Path
        self._claim: IO[bytes] | None
        self.folder, self._claim = _claim_folder(self.layout_folder)
        self.events = events
        #: digest -> key, least recently used first.
        self._index: OrderedDict[bytes, BlockKey] = OrderedDict()
        self.hit_blocks = 0
        self.written_blocks = 0
        self.dropped_blocks = 0
        self.corrupt_blocks = 0
        self.skipped_blocks = 0
        self.max_pending = max(1, require_int("max_pending_bytes", max_pending_bytes, minimum=0) // self.payload_bytes)
        #: digest -> bytes not yet written (shared with the writer thread, under ``_lock``).
        self._pending: dict[bytes, bytes] = {}
        #: Digests whose write failed (the writer reports; the serving thread forgets them).
        self._failed: set[bytes] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, Path]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier-writer", daemon=True)
        self._writer.start()

    # ---- lookups (change nothing) ----------------------------------------------------------

    def holds(self, key: BlockKey) -> bool:
        """Whether a file was written for ``key`` (reading it may still find it unusable)."""
        return key.digest in self._index

    def held_keys(self) -> list[BlockKey]:
        return list(self._index.values())

    def path_of(self, key: BlockKey) -> Path:
        """The file of ``key``'s block."""
        return self.folder / (key.digest.hex() + _SUFFIX)

    def stats(self) -> DiskTierStats:
        return DiskTierStats(
            files=len(self._index),
            bytes_used=len(self._index) * self.file_bytes,
            bytes_total=self.max_bytes,
            blocks_total=self.max_bytes // self.file_bytes,
            hit_blocks=self.hit_blocks,
            written_blocks=self.written_blocks,
            dropped_blocks=self.dropped_blocks,
            corrupt_blocks=self.corrupt_blocks,
            bytes_read=self.hit_blocks * self.payload_bytes,
            bytes_written=self.written_blocks * self.payload_bytes,
            skipped_blocks=self.skipped_blocks,
        )

    # ---- actions -----------------------------------------------------------------------------

    def store(self, key: BlockKey, block: torch.Tensor) -> None:
        """Queue ``block`` (a CPU tensor of ``block_shape``, the K/V of ``key``) for its file,
        deleting the least recently used files to stay within the bound; its bytes are copied,
        so ``block`` may be reused at once. A key held already is only marked used. A block is
        skipped (``skipped_blocks``) when the queue is full."""
        self._forget_failed()
        digest = key.digest
        if digest in self._index:
            self._index.move_to_end(digest)
            return
        block = block.contiguous()
        view = _bytes_of(block)
        if len(view) != self.payload_bytes:
            raise InvalidArgumentError(f"block: {len(view)} bytes, but a block of this tier has {self.payload_bytes}")
        with self._lock:
            full = len(self._pending) >= self.max_pending
            if not full:
                self._pending[digest] = bytes(view)
        if full:
            self.skipped_blocks += 1
            return
        while self._index and (len(self._index) + 1) * self.file_bytes > self.max_bytes:
            self._drop(next(iter(self._index)))
        self._index[digest] = key
        self.written_blocks += 1
        self._queue.put((digest, self.path_of(key)))
        if self.events is not None:
            self.events.stored(self.name, key)

    def flush(self) -> None:
        """Wait until every queued block is written (tests; a clean shutdown)."""
        self._queue.join()
        self._forget_failed()

    def read(self, key: BlockKey) -> torch.Tensor | None:
        """``key``'s block as a CPU tensor of ``block_shape``, checked whole; None (the file
        deleted, the key forgotten, ``corrupt_blocks`` counted) when the file is missing or any
        field or the checksum does not match."""
        self._forget_failed()
        digest = key.digest
        if digest not in self._index:
            return None
        with self._lock:
            waiting = self._pending.get(digest)
        if waiting is not None:  # not on disk yet: its bytes are in memory, as stored
            self._index.move_to_end(digest)
            self.hit_blocks += 1
            return torch.frombuffer(bytearray(waiting), dtype=self.dtype).view(self.block_shape)
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            data = b""
        payload = self._checked_payload(data, digest)
        if payload is None:
            self.corrupt_blocks += 1
            self._drop(digest, dropped=False)
            return None
        self._index.move_to_end(digest)
        self.hit_blocks += 1
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.block_shape)

    def clear(self) -> None:
        """Delete every file of this tier."""
        for digest in list(self._index):
            self._drop(digest, dropped=False)

    def close(self) -> None:
        """A clean shutdown: wait for queued writes, delete this tier's files and folder, and
        release the folder's lock. The tier holds nothing afterwards (every lookup misses); a
        second call does nothing. Without it, a later tier on the directory deletes the files
        once this process is gone."""
        if self._claim is None:
            return
        self.flush()
        self.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
        self._claim.close()  # (closing the file releases its lock)
        self._claim = None

    def integrity_problems(self) -> list[str]:
        found = []
        for digest, key in self._index.items():
            if key.digest != digest:
                found.append(f"disk tier: file {digest.hex()} is indexed under another key")
        if len(self._index) * self.file_bytes > self.max_bytes:
            found.append(f"disk tier: {len(self._index)} files exceed the bound of {self.max_bytes} bytes")
        return found

    # ---- internals ---------------------------------------------------------------------------

    def _write_loop(self) -> None:
        """The writer thread: each queued block to its file, unless dropped meanwhile."""
        while True:
            digest, path = self._queue.get()
            try:
                with self._lock:
                    payload = self._pending.get(digest)
                if payload is None:  # dropped before its turn
                    continue
                try:
                    _write_file(path, digest, payload)
                except OSError:
                    with self._lock:
                        self._pending.pop(digest, None)
                        self._failed.add(digest)
                    continue
                with self._lock:
                    if self._pending.pop(digest, None) is None:  # dropped while being written
                        with contextlib.suppress(OSError):
                            path.unlink()
            finally:
                self._queue.task_done()

    def _forget_failed(self) -> None:
        """Forget blocks whose write failed (the disk is full or gone): they were never stored."""
        if not self._failed:
            return
        with self._lock:
            failed, self._failed = self._failed, set()
        for digest in failed:
            if digest in self._index:
                self.written_blocks -= 1
                self.skipped_blocks += 1
                self._drop(digest, dropped=False)

    def _checked_payload(self, data: bytes, digest: bytes) -> memoryview | None:
        if len(data) != self.file_bytes:
            return None
        magic, stored_digest, length, checksum = _HEADER.unpack_from(data)
        if magic != _MAGIC or stored_digest != digest or length != self.payload_bytes:
            return None
        payload = memoryview(data)[_HEADER.size :]
        if zlib.crc32(payload) != checksum:
            return None
        return payload

    def _drop(self, digest: bytes, *, dropped: bool = True) -> None:
        key = self._index.pop(digest)
        with self._lock:  # a queued write is skipped; a write under way deletes its own file
            self._pending.pop(digest, None)
            with contextlib.suppress(OSError):
                self.path_of(key).unlink()
        self.dropped_blocks += dropped
        if self.events is not None:
            self.events.removed(self.name, key)


def _claim_folder(layout_folder: Path) -> tuple[Path, IO[bytes]]:
    """A new folder of this process under ``layout_folder`` and its open, locked ``.lock``.
    The folder is made and locked under a temporary name, then renamed, so no other tier ever
    sees it unlocked. Raises OSError."""
    name = f"{_RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    making = layout_folder / f".{name}.new"
    making.mkdir()
    claim = open(making / _LOCK_NAME, "a+b")  # noqa: SIM115 (held open: it is the claim)
    try:
        if fcntl is not None:
            fcntl.flock(claim.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        folder = layout_folder / name
        os.replace(making, folder)
    except OSError:
        claim.close()
        shutil.rmtree(making, ignore_errors=True)
        raise
    return folder, claim


def _remove_dead_tiers(layout_folder: Path) -> None:
    """Delete what tiers that are gone left under ``layout_folder``: block files directly in it
    (the layout before per-tier folders), every ``run-*`` folder whose lock can be taken
    (never a live tier's: it holds its lock), and folders left under their temporary name
    (``.run-*.new``) more than ``_STALE_MAKING_S`` ago by a tier that died while claiming
    one. Errors are ignored: another process may be deleting the same folder."""
    now = time.time()
    for entry in layout_folder.iterdir():
        if entry.is_file() and entry.suffix in (_SUFFIX, ".tmp"):
            with contextlib.suppress(OSError):
                entry.unlink()
        elif entry.is_dir() and entry.name.startswith("." + _RUN_PREFIX) and entry.name.endswith(".new"):
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > _STALE_MAKING_S:
                    shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_dir() and entry.name.startswith(_RUN_PREFIX) and fcntl is not None:
            try:
                with open(entry / _LOCK_NAME, "a+b") as lock:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    shutil.rmtree(entry, ignore_errors=True)
            except OSError:  # held: a live tier's folder (or gone meanwhile)
                continue


def _write_file(path: Path, digest: bytes, payload: bytes) -> None:
    """Header and payload into a temporary file, renamed to ``path``. Raises OSError."""
    header = _HEADER.pack(_MAGIC, digest, len(payload), zlib.crc32(payload))
    temporary = path.with_suffix(".tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (no numpy needed); valid while
    ``tensor`` lives."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
