"""Build one step's attention metadata from the block manager, with one host-to-device copy.

Every integer the kernels need (block tables, lengths, query starts, slots) is written into
one host byte buffer and copied to the device in a single transfer; the device tensors are
views into that one buffer. On CUDA the host buffer is pinned and reused, and an event keeps
the next step from overwriting it while the previous copy is still in flight.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import torch

from attention.metadata import PAD_BLOCK, AttentionMetadata
from kvcache.manager import BlockManager

__all__ = ["MetadataBuilder", "ScheduledRow", "build_metadata"]


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's share of a step: ``num_new`` tokens starting at position ``start``.

    ``start`` defaults to the last ``num_new`` reserved tokens (a decode step after
    ``append_slots``). For a chunk of a prompt whose slots were all reserved by ``allocate``,
    give the chunk's first position.
    """

    seq_id: Hashable
    num_new: int
    start: int | None = None


class MetadataBuilder:
    """Builds :class:`AttentionMetadata` for a device, reusing a pinned staging buffer."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._on_cuda = self.device.type == "cuda"
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def build(self, manager: BlockManager, rows: Sequence[ScheduledRow]) -> AttentionMetadata:
        """Metadata for ``rows``, in order. Changes nothing in ``manager``.

        Raises ValueError naming the row when a row asks for positions outside the
        sequence's reserved tokens, and UnknownSequenceError for an unknown id.
        """
        if not rows:
            raise ValueError("rows: a step needs at least one scheduled row")
        bs = manager.block_size
        seq_lens: list[int] = []
        query_lens: list[int] = []
        # array('q') / array('i') hold machine ints: torch.frombuffer reads them without the
        # per-element conversion torch.tensor(list) pays (about 3x faster at 256 rows).
        slots = array("q")
        tables: list[list[int]] = []
        for i, row in enumerate(rows):
            seq = manager.sequence(row.seq_id)
            start = seq.num_tokens - row.num_new if row.start is None else row.start
            end = start + row.num_new
            if row.num_new < 1 or start < 0 or end > seq.num_tokens:
                raise ValueError(
                    f"rows[{i}]: tokens [{start}, {end}) of sequence {row.seq_id!r} are not "
                    f"within its {seq.num_tokens} reserved tokens; append_slots first"
                )
            blocks = seq.blocks
            if row.num_new == 1:
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(blocks[: -(-end // bs)])
            seq_lens.append(end)
            query_lens.append(row.num_new)
        width = max(len(t) for t in tables)
        ints = array("i")
        for t in tables:
            ints.extend(t)
            if len(t) < width:
                ints.extend(_padding(width - len(t)))
        ints.extend(seq_lens)
        ints.append(0)
        ints.extend(accumulate(query_lens))
        device_bytes = self._to_device(
            torch.frombuffer(slots, dtype=torch.int64), torch.frombuffer(ints, dtype=torch.int32)
        )
        n64 = len(slots) * 8
        as64 = device_bytes[:n64].view(torch.int64)
        as32 = device_bytes[n64:].view(torch.int32)
        b = len(rows)
        return AttentionMetadata(
            block_tables=as32[: b * width].view(b, width),
            seq_lens=as32[b * width : b * width + b],
            query_start_loc=as32[b * width + b :],
            slot_mapping=as64,
            block_size=bs,
            seq_lens_host=tuple(seq_lens),
            query_lens_host=tuple(query_lens),
        )

    def _to_device(self, i64: torch.Tensor, i32: torch.Tensor) -> torch.Tensor:
        """Concatenate the two arrays' bytes and copy them to the device in one transfer."""
        n64, n32 = i64.numel() * 8, i32.numel() * 4
        if not self._on_cuda:
            return torch.cat((i64.view(torch.uint8), i32.view(torch.uint8))).to(self.device)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must finish reading the buffer
        if self._staging is None or self._staging.numel() < n64 + n32:
            self._staging = torch.empty(2 * (n64 + n32), dtype=torch.uint8, pin_memory=True)
        staging = self._staging[: n64 + n32]
        staging[:n64].view(torch.int64).copy_(i64)
        staging[n64:].view(torch.int32).copy_(i32)
        out = staging.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


@lru_cache(maxsize=64)
def _padding(n: int) -> array:
    return array("i", [PAD_BLOCK]) * n


def build_metadata(
    manager: BlockManager, rows: Sequence[ScheduledRow], device: torch.device | str
) -> AttentionMetadata:
    """One-off :meth:`MetadataBuilder.build` (a serving loop keeps one builder instead)."""
    return MetadataBuilder(device).build(manager, rows)
