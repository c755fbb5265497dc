"""Each step's attention metadata (and its plan) in persistent buffers, with one host-to-device
copy per step.

The builder keeps one host buffer (pinned on CUDA) and one device buffer of the same layout,
allocated once for a :class:`~attention.staging.StepCapacity` (or grown on demand when no
capacity is given). Every integer a step needs -- lengths, query starts, slots, positions,
logits indices, the backend plan's work lists, and the block tables -- is written into the
host buffer and copied in one transfer; the metadata's tensors are views of the device buffer,
so their addresses never change (what a CUDA graph captured over them needs).

Block tables are persistent rows: row ``i`` remembers which sequence record it showed and how
many of its blocks are already written, so a step writes only the blocks appended since (a
decode step: one block every ``block_size`` steps per row), and rewrites a row only when
another sequence takes it.

Overlap (an engine that prepares step N+1 while the device runs step N): on CUDA the host
buffer is doubled, so planning a step never waits for the previous step's copy to have read
its buffer (each host buffer keeps its own record of the rows it holds; one device buffer is
enough, because the copy of step N+1 is queued behind step N's kernels on the same stream).
Tokens sampled on the device need no round trip through the host: the engine writes each
step's sampled ids into :attr:`MetadataBuilder.sampled`, and the next step's ``feed`` names,
per row, the sampled row whose token is that row's last input; :meth:`MetadataBuilder.input_ids`
gathers them on the device.

KV groups (a :class:`~kvcache.blocks.hybrid.HybridBlockManager`): every group has its own
block tables and slot mapping, written into regions of their own in the same buffers (one
copy still); lengths, positions, logits indices and the backend's plan are shared. The plan's
``groups`` holds one plan per group (:meth:`StepPlan.for_group`), which each layer of that
group runs with.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

import torch

from attention.base import AttentionBackend, StepPlan
from attention.checks import require_int
from attention.errors import ArgumentTypeError, InvalidArgumentError, MetadataError, UnknownSequenceError
from attention.metadata import PAD_BLOCK, PAD_SLOT, AttentionMetadata, StepCounter
from attention.metadata_check import DeviceCheck
from attention.staging import PlanStaging, StepCapacity
from kvcache.blocks.hybrid import AnyBlockManager, HybridBlockManager
from kvcache.blocks.manager import BlockManager
from kvcache.blocks.rows import ScheduledRow
from kvcache.blocks.sequence import SequenceBlocks
from kvcache.blocks.tokens import token_list

__all__ = ["MetadataBuilder", "ScheduledRow", "build_metadata"]

#: Device views of one step size: tables per KV group, seq_lens, query_start_loc, slots per
#: KV group, positions, logits_indices.
_StepViews = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the regions of one buffer, for one capacity and ``groups`` KV groups
    (slots and block tables: one region per group, group ``g``'s at ``g`` region sizes). The
    block tables come last, so a step copies only the rows it uses of the last group's."""

    capacity: StepCapacity
    groups: int
    seq_lens: int
    query_start_loc: int
    staged: dict[str, tuple[int, int]]  # name -> (offset, int32 entries)
    slots: int
    positions: int
    logits: int
    token_ids: int
    feed: int
    tables: int
    nbytes: int

    @staticmethod
    def of(capacity: StepCapacity, staged: dict[str, int], groups: int = 1) -> _Layout:
        r, t, w = capacity.max_rows, capacity.max_tokens, capacity.max_blocks_per_seq
        offset = 0

        def take(nbytes: int) -> int:
            nonlocal offset
            start = offset
            offset += -(-nbytes // 8) * 8  # 8-byte aligned, for the int64 views
            return start

        seq_lens, qsl = take(4 * r), take(4 * (r + 1))
        regions = {name: (take(4 * n), n) for name, n in staged.items()}
        slots, positions = take(8 * t * groups), take(8 * t)
        logits, token_ids, feed = take(8 * r), take(8 * t), take(8 * t)
        tables = take(4 * r * w * groups)
        return _Layout(
            capacity, groups, seq_lens, qsl, regions, slots, positions, logits, token_ids, feed, tables, offset
        )


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a CPU tensor's bytes (no numpy needed)."""
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


class _HostBuffer:
    """One host staging buffer (pinned on CUDA), the block-table rows it holds, and the event
    of the last copy that read it."""

    def __init__(self, layout: _Layout, pin: bool):
        self.tensor = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.mv = _bytes_view(self.tensor)
        rows = layout.capacity.max_rows
        # Per KV group: the record each table row shows, its epoch, and its blocks written.
        self.row_records: list[list[SequenceBlocks | None]] = [[None] * rows for _ in range(layout.groups)]
        self.row_epochs = [[0] * rows for _ in range(layout.groups)]
        self.row_writtens = [[0] * rows for _ in range(layout.groups)]
        self.copied: torch.cuda.Event | None = None

    def wait_for_copy(self) -> None:
        """The last copy from this buffer must have read it before it is rewritten."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None


class MetadataBuilder:
    """Builds :class:`AttentionMetadata` (and, with a backend, the step's plan) for one device.

    device:   where the metadata lives (the cache's device).
    capacity: fixed buffer sizes (required for CUDA graphs); None: buffers grow as needed.
    backend:  the backend whose plans :meth:`plan` makes, staged into the same buffers.
    device_check: check (and repair) every step's metadata on the device after its copy, with
              no sync (:mod:`attention.metadata_check`); a violation is raised by
              :meth:`raise_if_violated` at the engine's next sync point. Default: on for CUDA.
    num_cache_blocks: blocks of the cache the steps run over (``cache.num_blocks``): a step
              from a manager with more blocks is refused, and the device check holds block
              ids to the cache. None: the manager's count is trusted.
    kv_groups: the KV groups of the managers it plans for (``len(HybridBlockManager.groups)``;
              1 for a :class:`BlockManager`): each has its own tables and slots.
    One builder per engine: rows stay persistent between steps.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        capacity: StepCapacity | None = None,
        backend: AttentionBackend | None = None,
        device_check: bool | None = None,
        num_cache_blocks: int | None = None,
        kv_groups: int = 1,
    ):
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise InvalidArgumentError(
                f"device: {device!r:.40} is not a device; use e.g. 'cuda', 'cuda:1' or 'cpu'"
            ) from err
        if capacity is not None and not isinstance(capacity, StepCapacity):
            raise ArgumentTypeError(f"capacity: expected a StepCapacity or None, got {type(capacity).__name__}")
        if backend is not None and not isinstance(backend, AttentionBackend):
            raise ArgumentTypeError(f"backend: expected an AttentionBackend or None, got {type(backend).__name__}")
        if device_check is not None and not isinstance(device_check, bool):
            raise ArgumentTypeError(f"device_check: expected a bool or None, got {type(device_check).__name__}")
        self.num_cache_blocks = (
            None if num_cache_blocks is None else require_int("num_cache_blocks", num_cache_blocks, minimum=1)
        )
        self.backend = backend
        self.kv_groups = require_int("kv_groups", kv_groups, minimum=1, maximum=1024)
        check = self.device.type == "cuda" if device_check is None else device_check
        self._check = DeviceCheck(self.device) if check else None
        self.fixed = capacity is not None
        self._on_cuda = self.device.type == "cuda"
        #: Sampling rows of the last step planned (what ``feed`` may name in the next).
        self._sampled_rows = 0
        #: The records of the rows of the last step filled, per KV group (see _commit).
        self._records: list[list[SequenceBlocks]] = []
        self._steps = StepCounter()  # steps written into the buffers (a plan is good until the next)
        self._allocate(capacity or StepCapacity(8, 64, 8))

    @property
    def capacity(self) -> StepCapacity:
        return self._layout.capacity

    # ---- per step ----------------------------------------------------------------------

    def build(
        self,
        manager: AnyBlockManager,
        rows: Sequence[ScheduledRow],
        *,
        pad_to: int | None = None,
        pad_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        feed: Sequence[int] | None = None,
    ) -> AttentionMetadata:
        """Metadata for ``rows``, in order, padded with empty rows to ``pad_to`` rows (a CUDA
        graph bucket): each padding row brings one token (a decode bucket), or, with
        ``pad_tokens``, none, and the step's tokens are padded to ``pad_tokens`` (a bucket with
        room for prefill rows; it needs ``pad_to``). ``token_ids``: the step's input tokens
        (all rows' new tokens in row order), staged too and read back with :meth:`input_ids`.
        ``feed``: per row, -1 or the index ``j`` of a sampling row of the previous step: then
        that row's last input token is ``sampled[j]``, read on the device (its entry in
        ``token_ids`` is ignored).
        Changes nothing in ``manager``. Raises MetadataError naming the row when a row asks
        for positions outside the sequence's held tokens, UnknownSequenceError for an unknown
        id, and InvalidArgumentError when the step does not fit a fixed capacity or its
        bucket, or ``feed`` names no sampling row of the previous step. With KV groups it
        returns the first group's metadata: :meth:`plan` gives every group's."""
        metas = self._fill(manager, rows, pad_to, pad_tokens, token_ids, feed)
        self._commit(metas, manager)
        return metas[0]

    def plan(
        self,
        manager: AnyBlockManager,
        rows: Sequence[ScheduledRow],
        *,
        pad_to: int | None = None,
        pad_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        feed: Sequence[int] | None = None,
    ) -> StepPlan:
        """Metadata and the backend's plan for ``rows`` (arguments as in :meth:`build`),
        staged together and copied to the device in one transfer. ``pad_to`` (and
        ``pad_tokens``): plan for a CUDA-graph bucket of that many rows (and tokens). With KV
        groups, ``plan.group(g)`` is group ``g``'s plan (its tables and slots)."""
        if self.backend is None:
            raise InvalidArgumentError("backend: this builder was made without a backend; pass backend= to plan steps")
        graph_backend = self.backend if pad_to is not None else None
        metas = self._fill(manager, rows, pad_to, pad_tokens, token_ids, feed, graph_backend)
        plan = self.backend.plan(metas[0], staging=self._staging, graph=pad_to is not None)
        if len(metas) > 1:
            others = (plan.for_group(m) for m in metas[1:])
            plan = replace(plan, groups=(plan, *others))
        self._commit(metas, manager)
        return plan

    def raise_if_violated(self) -> None:
        """Raise MetadataError when a finished step's device check found a violation (never
        waits: call it after the engine's own sync point, e.g. after reading the logits)."""
        if self._check is not None:
            self._check.raise_if_violated()

    def token_ids(self, num_tokens: int) -> torch.Tensor:
        """int64 [num_tokens] device view of the staged input tokens (padding tokens: 0), as
        given: fed tokens are not in it (:meth:`input_ids` has them)."""
        return self._view(self._layout.token_ids, torch.int64, num_tokens)

    @property
    def sampled(self) -> torch.Tensor:
        """int64 [max_rows] on the device: the engine writes each step's sampled token ids
        here, row ``j`` for the step's sampling row ``j`` (e.g. ``torch.argmax(logits, -1,
        out=builder.sampled[:k])``), for the next step's ``feed``."""
        return self._sampled

    def input_ids(self, num_tokens: int) -> torch.Tensor:
        """int64 [num_tokens] device tensor of the step's input tokens: the staged ones, with
        every fed token read from :attr:`sampled` (device ops only, no host sync: callable
        inside a CUDA-graph capture, and valid once the previous step's sampling is queued).
        A persistent buffer, rewritten by the next call."""
        staged = self.token_ids(num_tokens)
        feed = self._view(self._layout.feed, torch.int64, num_tokens)
        picked = self._sampled.index_select(0, feed.clamp(0, self._sampled.numel() - 1))
        return torch.where(feed >= 0, picked, staged, out=self._inputs[:num_tokens])

    # ---- internals ---------------------------------------------------------------------

    def _allocate(self, capacity: StepCapacity) -> None:
        staged = {}
        if self.backend is not None:
            staged = {r.name: r.numel for r in self.backend.buffer_requests(capacity) if r.staged}
        layout = _Layout.of(capacity, staged, self.kv_groups)
        # Two host buffers on CUDA, so a step is planned while the previous one's copy is in
        # flight; one elsewhere (nothing is in flight: the CPU "device" buffer is the host's).
        self._buffers = [_HostBuffer(layout, self._on_cuda) for _ in range(2 if self._on_cuda else 1)]
        self._next = 0
        self._buf = self._buffers[0]
        self._mv = self._buf.mv
        host = self._buf.tensor
        self._device_buf = host if self.device.type == "cpu" else torch.zeros_like(host, device=self.device)
        previous = getattr(self, "_sampled", None)  # a grown builder keeps the last step's samples
        self._sampled = torch.zeros(capacity.max_rows, dtype=torch.int64, device=self.device)
        if previous is not None:
            self._sampled[: previous.numel()] = previous
        self._inputs = torch.zeros(capacity.max_tokens, dtype=torch.int64, device=self.device)
        self._layout = layout
        self._staging = _BufferStaging(self, capacity)
        self._view_cache: dict[tuple[int, int, int], _StepViews] = {}

    def _grow(self, rows: int, tokens: int, width: int) -> None:
        cap = self._layout.capacity
        if rows <= cap.max_rows and tokens <= cap.max_tokens and width <= cap.max_blocks_per_seq:
            return
        if self.fixed:
            raise InvalidArgumentError(
                f"rows: the step has {rows} rows, {tokens} tokens and needs {width} block-table columns; the "
                f"builder's capacity is {cap.max_rows} rows, {cap.max_tokens} tokens, {cap.max_blocks_per_seq} "
                f"columns; schedule smaller steps or build the MetadataBuilder with a larger capacity"
            )
        for buffer in self._buffers:
            buffer.wait_for_copy()
        if self._on_cuda:  # the old device buffers may still be read by queued kernels
            torch.cuda.current_stream(self.device).synchronize()
        self._allocate(
            StepCapacity(
                max(rows, 2 * cap.max_rows) if rows > cap.max_rows else cap.max_rows,
                max(tokens, 2 * cap.max_tokens) if tokens > cap.max_tokens else cap.max_tokens,
                max(width, 2 * cap.max_blocks_per_seq) if width > cap.max_blocks_per_seq else cap.max_blocks_per_seq,
            )
        )

    def _fill(
        self,
        manager: AnyBlockManager,
        rows: Sequence[ScheduledRow],
        pad_to: int | None,
        pad_tokens: int | None,
        token_ids: Sequence[int] | None,
        feed: Sequence[int] | None = None,
        graph_backend: AttentionBackend | None = None,
    ) -> list[AttentionMetadata]:
        """Check the step, then write it into the next host buffer; ``graph_backend``: the
        backend that will plan it as a CUDA-graph step (its bucket is checked before any
        write, so a refused step leaves the buffers as they were). Returns the metadata of
        each KV group (one without groups)."""
        if not isinstance(manager, (BlockManager, HybridBlockManager)):
            raise ArgumentTypeError(
                f"manager: expected a BlockManager or HybridBlockManager (kvcache.manager_for), "
                f"got {type(manager).__name__}"
            )
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
            raise ArgumentTypeError(f"rows: expected a sequence of ScheduledRow, got {type(rows).__name__}")
        n = len(rows)
        if n == 0 and pad_to is None:
            raise InvalidArgumentError("rows: a step needs at least one scheduled row (or pad_to)")
        if pad_tokens is not None and pad_to is None:
            raise InvalidArgumentError("pad_tokens: pads a bucket of rows; give pad_to too")
        padded = n if pad_to is None else require_int("pad_to", pad_to, minimum=max(n, 1))
        if self.num_cache_blocks is not None and manager.num_blocks > self.num_cache_blocks:
            raise InvalidArgumentError(
                f"manager: it hands out {manager.num_blocks} blocks but the cache has {self.num_cache_blocks}; "
                "build the manager over the cache (kvcache.manager_for(config, cache))"
            )
        groups: list[BlockManager] = manager.groups if isinstance(manager, HybridBlockManager) else [manager]
        if len(groups) != self.kv_groups:
            raise InvalidArgumentError(
                f"manager: it has {len(groups)} KV group(s), but this builder was made for {self.kv_groups}; build "
                f"the MetadataBuilder with kv_groups={len(groups)}"
            )
        seqs = groups[0]._seqs
        bs = manager.block_size
        records: list[SequenceBlocks] = []
        starts: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        qsl = [0]
        logits: list[int] = []
        sampling: list[int] = []
        tokens = 0
        widest = 0
        # One pass per row; the hot path (a decode row) does only list appends and a few
        # integer ops: this loop is most of a step's host time.
        for i, row in enumerate(rows):
            try:
                seq = seqs[row.seq_id]
                num_new = row.num_new
                start = row.start
            except (KeyError, TypeError, AttributeError):  # unknown or unhashable id, not a row
                _raise_bad_row(i, row, manager)
            held = seq.num_tokens
            if start is None:
                start = held - num_new
            end = start + num_new
            if (
                type(num_new) is not int
                or type(start) is not int
                or num_new < 1
                or start < 0
                or end > held
                or (seq.num_released and start < seq.num_released * bs)
                or (start > seq.num_computed and start > seq.num_planned)
            ):
                _raise_bad_range(i, row.seq_id, seq, start, num_new, bs)
            records.append(seq)
            starts.append(start)
            seq_lens.append(end)
            query_lens.append(num_new)
            slots += seq.slot_range(start, end, bs)
            if num_new == 1:
                positions.append(start)
            else:
                positions += range(start, end)
            tokens += num_new
            qsl.append(tokens)
            if end == held:  # reaches the end of what is known: its logits are needed
                logits.append(tokens - 1)
                sampling.append(i)
            if len(seq.blocks) > widest:
                widest = len(seq.blocks)
        if len(set(map(id, records))) != n:
            _raise_repeated(rows, records)
        group_records = [records]
        group_slots = [slots]
        for group in groups[1:]:  # the other groups' tables and slots, for the same tokens
            recs, gslots = _group_rows(group, rows, starts, query_lens, bs)
            group_records.append(recs)
            group_slots.append(gslots)
        ids = None if token_ids is None else token_list(token_ids)
        if ids is not None and len(ids) != tokens:
            raise InvalidArgumentError(f"token_ids: {len(ids)} ids for the step's {tokens} new tokens")
        pad = padded - n
        if pad_tokens is None:
            num_tokens = tokens + pad  # padding rows: one token each
        else:
            num_tokens = require_int("pad_tokens", pad_tokens, minimum=max(tokens, 1))
        fed = self._checked_feed(feed, n, qsl)
        if graph_backend is not None:
            graph_backend.check_graph_bucket(padded, num_tokens, prefill_rows=tokens > n)
        self._records = group_records  # their planned frontier moves when the step is committed
        self._grow(padded, num_tokens, widest)
        self._switch_buffer()
        for g, recs in enumerate(group_records):
            self._write_tables(recs, g)
            self._write_padding_tables(n, padded, g)
        if ids is not None:
            self._mv[self._layout.token_ids : self._layout.token_ids + 8 * num_tokens].cast("q")[:] = array(
                "q", ids + [0] * (num_tokens - tokens)
            )
        # Padding tokens: slot -1 (no K/V), position 0.
        for gslots in group_slots:
            gslots += [PAD_SLOT] * (num_tokens - tokens)
        positions += [0] * (num_tokens - tokens)
        if pad_tokens is None:
            logits += range(tokens, num_tokens)
            qsl += range(tokens + 1, num_tokens + 1)
        else:  # empty padding rows; logits padded to one entry per row (any token)
            logits += [num_tokens - 1] * (padded - len(logits))
            qsl += [tokens] * pad
        feed_values = array("q", [-1]) * num_tokens
        for position, j in fed:
            feed_values[position] = j
        self._mv[self._layout.feed : self._layout.feed + 8 * num_tokens].cast("q")[:] = feed_values
        return self._write_rows(seq_lens, query_lens, group_slots, positions, qsl, logits, sampling, padded, bs)

    def _checked_feed(self, feed: Sequence[int] | None, n: int, qsl: list[int]) -> list[tuple[int, int]]:
        """``(token position, sampled row)`` of each fed row's last token; raises
        InvalidArgumentError for a feed that does not fit this step and the previous one."""
        if feed is None:
            return []
        if isinstance(feed, (str, bytes)) or len(feed) != n:
            got = len(feed) if hasattr(feed, "__len__") else type(feed).__name__
            raise InvalidArgumentError(f"feed: expected one entry per row ({n}), got {got}")
        fed = []
        for i, j in enumerate(feed):
            if type(j) is not int or not -1 <= j < self._sampled_rows:
                raise InvalidArgumentError(
                    f"feed[{i}]: {j!r:.20} is not -1 or a sampling row of the previous step "
                    f"(it sampled {self._sampled_rows} rows)"
                )
            if j >= 0:
                fed.append((qsl[i + 1] - 1, j))
        return fed

    def _switch_buffer(self) -> None:
        """Plan into the next host buffer, once its last copy has read it; the step before is
        no longer current (its metadata shares the device memory)."""
        self._steps.current += 1
        self._buf = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        self._buf.wait_for_copy()
        self._mv = self._buf.mv

    def _write_tables(self, records: list[SequenceBlocks], group: int = 0) -> None:
        """Write the blocks each row does not show yet in KV group ``group``'s tables (all of
        them when the row changed hands)."""
        layout = self._layout
        width = layout.capacity.max_blocks_per_seq
        region = 4 * layout.capacity.max_rows * width
        base = layout.tables + group * region
        table = self._mv[base : base + region].cast("i")
        buf = self._buf
        shown, epochs, written = buf.row_records[group], buf.row_epochs[group], buf.row_writtens[group]
        for i, seq in enumerate(records):
            blocks = seq.blocks
            have = len(blocks)
            if shown[i] is seq and epochs[i] == seq.epoch:
                done = written[i]
                if have > done:
                    table[i * width + done : i * width + have] = array("i", blocks[done:])
                    written[i] = have
                continue
            stale = written[i] if shown[i] is not None else 0
            table[i * width : i * width + have] = array("i", blocks)
            if stale > have:  # the previous sequence of this row was longer: hide its blocks
                table[i * width + have : i * width + stale] = array("i", [PAD_BLOCK]) * (stale - have)
            shown[i], epochs[i], written[i] = seq, seq.epoch, have

    def _write_padding_tables(self, first: int, end: int, group: int = 0) -> None:
        """Padding rows ``first .. end - 1`` of group ``group``'s tables name block 0 in column
        0 (a real block: a kernel that reads one token for an empty row, as flash-attn's paged
        decode must, stays in the cache), and forget what they showed, so a sequence placed
        there later is rewritten."""
        layout = self._layout
        width = layout.capacity.max_blocks_per_seq
        base = layout.tables + group * 4 * layout.capacity.max_rows * width
        table = self._mv[base : base + 4 * end * width].cast("i")
        shown, written = self._buf.row_records[group], self._buf.row_writtens[group]
        for i in range(first, end):
            table[i * width] = 0
            shown[i] = None
            written[i] = 0

    def _write_rows(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        group_slots: list[list[int]],
        positions: list[int],
        qsl: list[int],
        logits: list[int],
        sampling: list[int],
        padded: int,
        bs: int,
    ) -> list[AttentionMetadata]:
        """Copy the step's per-row and per-token values into the host buffer; the metadata's
        tensors are (cached) views of the device buffer. One metadata per KV group (they
        differ in tables and slots only)."""
        n = len(seq_lens)
        num_tokens = len(positions)
        layout, mv = self._layout, self._mv
        mv[layout.seq_lens : layout.seq_lens + 4 * n].cast("i")[:] = array("i", seq_lens)
        if padded > n:
            mv[layout.seq_lens + 4 * n : layout.seq_lens + 4 * padded].cast("i")[:] = array("i", [0]) * (padded - n)
        mv[layout.query_start_loc : layout.query_start_loc + 4 * (padded + 1)].cast("i")[:] = array("i", qsl)
        slot_region = 8 * layout.capacity.max_tokens
        for g, slots in enumerate(group_slots):
            base = layout.slots + g * slot_region
            mv[base : base + 8 * num_tokens].cast("q")[:] = array("q", slots)
        mv[layout.positions : layout.positions + 8 * num_tokens].cast("q")[:] = array("q", positions)
        mv[layout.logits : layout.logits + 8 * len(logits)].cast("q")[:] = array("q", logits)
        self._rows_in_use = padded
        tables, lens, starts, slot_views, pos_view, logit_view = self._views(padded, num_tokens, len(logits))
        first = AttentionMetadata(
            block_tables=tables[0],
            seq_lens=lens,
            query_start_loc=starts,
            slot_mapping=slot_views[0],
            positions=pos_view,
            logits_indices=logit_view,
            block_size=bs,
            seq_lens_host=tuple(seq_lens),
            query_lens_host=tuple(query_lens),
            sampling_rows_host=tuple(sampling),
            written_at=(self._steps, self._steps.current),
        )
        groups = zip(tables[1:], slot_views[1:], strict=True)
        return [first, *(replace(first, block_tables=t, slot_mapping=v) for t, v in groups)]

    def _views(self, padded: int, num_tokens: int, num_logits: int) -> _StepViews:
        """The metadata's device views for these sizes (made once per size: a decode step's
        sizes repeat): tables and slots per KV group, then lengths, starts, positions, logits."""
        key = (padded, num_tokens, num_logits)
        views = self._view_cache.get(key)
        if views is None:
            layout = self._layout
            cap = layout.capacity
            width = cap.max_blocks_per_seq
            views = (
                [
                    self._view(layout.tables + 4 * g * cap.max_rows * width, torch.int32, padded * width).view(
                        padded, width
                    )
                    for g in range(layout.groups)
                ],
                self._view(layout.seq_lens, torch.int32, padded),
                self._view(layout.query_start_loc, torch.int32, padded + 1),
                [
                    self._view(layout.slots + 8 * g * cap.max_tokens, torch.int64, num_tokens)
                    for g in range(layout.groups)
                ],
                self._view(layout.positions, torch.int64, num_tokens),
                self._view(layout.logits, torch.int64, num_logits),
            )
            if len(self._view_cache) > 4096:  # bounded: sizes of prefill steps vary
                self._view_cache.clear()
            self._view_cache[key] = views
        return views

    def _view(self, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        itemsize = 4 if dtype == torch.int32 else 8
        return self._device_buf[offset : offset + itemsize * numel].view(dtype)

    def _commit(self, metas: list[AttentionMetadata], manager: AnyBlockManager) -> None:
        """The step's one host-to-device copy (everything up to the last table row in use),
        then the device check of every group's metadata. Only a committed step counts as the
        one ``feed`` refers to (a plan the backend refused leaves the previous step's sampling
        rows in force)."""
        meta = metas[0]
        self._sampled_rows = len(meta.sampling_rows_host)
        for records in self._records:
            for seq, end in zip(records, meta.seq_lens_host, strict=True):
                if end > seq.num_planned:
                    seq.num_planned = end
        self._copy()
        if self._check is not None:
            blocks = manager.num_blocks if self.num_cache_blocks is None else self.num_cache_blocks
            groups = manager.groups if isinstance(manager, HybridBlockManager) else [manager]
            self._check.run_groups([(m, g.sliding_window) for m, g in zip(metas, groups, strict=True)], blocks)

    def _copy(self) -> None:
        if self.device.type == "cpu":
            return
        layout = self._layout
        width = layout.capacity.max_blocks_per_seq
        end = layout.tables + 4 * width * ((layout.groups - 1) * layout.capacity.max_rows + self._rows_in_use)
        self._device_buf[:end].copy_(self._buf.tensor[:end], non_blocking=True)
        if self._on_cuda:
            self._buf.copied = torch.cuda.Event()
            self._buf.copied.record()


class _BufferStaging(PlanStaging):
    """Plan arrays in the builder's buffers (copied with the metadata), scratch allocated once."""

    def __init__(self, builder: MetadataBuilder, capacity: StepCapacity):
        self.builder = builder
        self.device = builder.device
        self._scratch: dict[str, torch.Tensor] = {}
        backend = builder.backend
        if backend is not None:
            for r in backend.buffer_requests(capacity):
                if not r.staged:
                    maker = torch.zeros if r.zeroed else torch.empty
                    self._scratch[r.name] = maker(r.numel, dtype=r.dtype, device=self.device)

    def stage(self, name: str, values: array) -> torch.Tensor:
        layout = self.builder._layout
        if name not in layout.staged:
            raise MetadataError(f"stage: {name!r} is not among the backend's buffer_requests")
        offset, room = layout.staged[name]
        if len(values) > room:
            raise MetadataError(f"stage: {name!r} needs {len(values)} entries, its buffer holds {room}")
        self.builder._mv[offset : offset + 4 * len(values)].cast("i")[:] = values
        return self.builder._view(offset, torch.int32, len(values))

    def scratch(self, name: str, dtype: torch.dtype, numel: int, *, zeroed: bool = False) -> torch.Tensor:
        buf = self._scratch.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            raise MetadataError(
                f"scratch: {name!r} ({numel} x {dtype}) is not among the backend's buffer_requests at this capacity"
            )
        return buf[:numel]


def _group_rows(
    group: BlockManager, rows: Sequence[ScheduledRow], starts: list[int], query_lens: list[int], bs: int
) -> tuple[list[SequenceBlocks], list[int]]:
    """Another KV group's records and slots for the step's rows (``starts``: each row's first
    new token, resolved and checked in the first group). Raises MetadataError for a row whose
    new tokens fall in blocks this group released behind its window."""
    seqs = group._seqs
    records: list[SequenceBlocks] = []
    slots: list[int] = []
    for i, row in enumerate(rows):
        seq = seqs[row.seq_id]
        start = starts[i]
        if seq.num_released and start < seq.num_released * bs:
            _raise_bad_range(i, row.seq_id, seq, start, query_lens[i], bs)
        records.append(seq)
        slots += seq.slot_range(start, start + query_lens[i], bs)
    return records, slots


def _raise_bad_row(i: int, row: object, manager: AnyBlockManager) -> NoReturn:
    if not isinstance(row, ScheduledRow):
        raise InvalidArgumentError(f"rows[{i}]: expected a ScheduledRow, got {type(row).__name__}")
    seq_id: Hashable = row.seq_id
    manager.sequence(seq_id)  # raises the precise error (unknown or unhashable)
    raise UnknownSequenceError(seq_id)


def _raise_bad_range(
    i: int, seq_id: Hashable, seq: SequenceBlocks, start: object, num_new: object, bs: int
) -> NoReturn:
    """The precise MetadataError for a row whose tokens no correct step holds."""
    if type(num_new) is not int or type(start) is not int:
        raise MetadataError(f"rows[{i}]: num_new {num_new!r:.20} and start {start!r:.20} must be ints")
    if num_new < 1:
        raise MetadataError(f"rows[{i}].num_new: {num_new} must be at least 1 (a row brings a token)")
    if start < 0:
        raise MetadataError(f"rows[{i}].start: {start} is negative; a row starts at a token position >= 0")
    end = start + num_new
    name = f"rows[{i}]: tokens [{start}, {end}) of sequence {seq_id!r:.60}"
    if end <= seq.num_tokens and start >= seq.num_released * bs:
        frontier = max(seq.num_computed, seq.num_planned)
        raise MetadataError(
            f"{name} start after its first {frontier} tokens, the ones computed or being computed; the tokens "
            f"[{frontier}, {start}) have no K/V to attend to: schedule them first (start={frontier})"
        )
    raise MetadataError(
        f"{name} are not within its held tokens [{seq.num_released * bs}, {seq.num_tokens}); append_slots first"
    )


def _raise_repeated(rows: Sequence[ScheduledRow], records: list[SequenceBlocks]) -> NoReturn:
    """MetadataError naming two rows of one sequence (a step computes each sequence once:
    two chunks of it would write and read its K/V in one launch, and commit refuses them)."""
    first: dict[int, int] = {}
    for j, seq in enumerate(records):
        if id(seq) in first:
            raise MetadataError(
                f"rows[{j}]: sequence {rows[j].seq_id!r:.60} is already scheduled in rows[{first[id(seq)]}]; "
                "give each sequence one row per step (one chunk: merge the two)"
            )
        first[id(seq)] = j
    raise AssertionError("unreachable: the records were not distinct")


def build_metadata(
    manager: AnyBlockManager, rows: Sequence[ScheduledRow], device: torch.device | str
) -> AttentionMetadata:
    """One-off :meth:`MetadataBuilder.build` (a serving loop keeps one builder instead)."""
    return MetadataBuilder(device).build(manager, rows)
